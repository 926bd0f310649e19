//! Release and reallocation in place of a model's storages.
//!
//! A model is known by its named tensors (a VarStore's parameters and buffers). Several tensors
//! may share one storage (tied weights, views, a backbone two models hold): storages are
//! identified through the shim and counted, freed and reallocated once each.

use std::collections::HashSet;

use stageload_torch_sys::{self as shim, ShimError};
use tch::Tensor;

/// One distinct storage of a model, with the size it had when the model was built.
#[derive(Debug)]
pub struct StorageRecord {
    pub id: u64,
    pub nbytes: usize,
    /// A tensor on this storage, to reach it through the shim.
    pub tensor: Tensor,
}

/// What one release did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReleaseStats {
    /// Bytes of storage freed.
    pub freed: u64,
    /// Bytes of storage left alone because another resident model shares them.
    pub kept: u64,
}

/// Named tensors sharing `tensors`' storages (shallow copies: what a holder of the model sees).
pub(crate) fn shallow(tensors: &[(String, Tensor)]) -> Vec<(String, Tensor)> {
    tensors.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect()
}

/// The distinct storages behind `tensors`, in first-seen order.
pub fn distinct_storages(tensors: &[(String, Tensor)]) -> Result<Vec<StorageRecord>, ShimError> {
    let mut seen = HashSet::new();
    let mut records = Vec::new();
    for (_, tensor) in tensors {
        let info = shim::storage_info(tensor)?;
        if seen.insert(info.id) {
            records.push(StorageRecord { id: info.id, nbytes: info.nbytes, tensor: tensor.shallow_clone() });
        }
    }
    Ok(records)
}

/// Bytes a storage needs to hold `tensor` (its offset and every element it reaches), whatever
/// the storage holds now: the size a freed storage is given back.
pub fn needed_bytes(tensor: &Tensor) -> usize {
    if tensor.numel() == 0 {
        return 0;
    }
    let reach = tensor
        .size()
        .iter()
        .zip(tensor.stride())
        .map(|(&size, stride)| ((size - 1).max(0) as usize).saturating_mul(stride.unsigned_abs() as usize))
        .fold(1usize, usize::saturating_add);
    (tensor.storage_offset().max(0) as usize).saturating_add(reach).saturating_mul(tensor.kind().elt_size_in_bytes())
}

/// Bytes of the storage behind `tensor` while it has memory (0 when freed or unreadable).
pub fn allocated_bytes(tensor: &Tensor) -> u64 {
    shim::storage_info(tensor).map_or(0, |info| if info.allocated { info.nbytes as u64 } else { 0 })
}

/// Frees every storage in `storages` whose id is not in `keep`. Storages already freed count
/// for nothing. Any later use of their tensors fails with `message`.
///
/// # Safety
///
/// As [`shim::free_storage`]: nothing may be running on these storages, in any thread.
pub unsafe fn release(
    storages: &[StorageRecord],
    keep: &HashSet<u64>,
    message: &str,
) -> Result<ReleaseStats, ShimError> {
    let mut stats = ReleaseStats::default();
    for storage in storages {
        if keep.contains(&storage.id) {
            stats.kept += storage.nbytes as u64;
        } else if shim::storage_info(&storage.tensor)?.allocated {
            crate::copy_watch::check_free(storage.id, "freed");
            // SAFETY: this function's own precondition.
            stats.freed += unsafe { shim::free_storage(&storage.tensor, message) }? as u64;
        }
    }
    Ok(stats)
}

/// Gives every freed storage of `storages` its memory back (uninitialised); returns the ids
/// reallocated, so the caller refills exactly those.
///
/// # Safety
///
/// As [`shim::realloc_storage`]: the caller fills those storages before anything reads them
/// and keeps every other thread away meanwhile.
pub unsafe fn reallocate(storages: &[StorageRecord]) -> Result<HashSet<u64>, ShimError> {
    let mut reallocated = HashSet::new();
    for storage in storages {
        if storage.nbytes > 0 && !shim::storage_info(&storage.tensor)?.allocated {
            crate::copy_watch::check_free(storage.id, "given new memory");
            // SAFETY: this function's own precondition.
            unsafe { shim::realloc_storage(&storage.tensor, storage.nbytes) }?;
            reallocated.insert(storage.id);
        }
    }
    Ok(reallocated)
}

/// Where each of `storages` starts in one buffer: in order, each at a multiple of
/// [`ALIGNMENT`]; and the buffer's size ([`stageload_plan::split::block_bytes`], the size the
/// split counts the block for).
pub fn layout(storages: &[StorageRecord]) -> (Vec<usize>, usize) {
    aligned_offsets(storages.iter().map(|s| s.nbytes))
}

/// Where each of pieces of `sizes` bytes starts in one buffer, in order, each at a multiple of
/// [`ALIGNMENT`]; and the buffer's size.
pub(crate) fn aligned_offsets(sizes: impl IntoIterator<Item = usize>) -> (Vec<usize>, usize) {
    let mut offsets = Vec::new();
    let mut end = 0usize;
    for bytes in sizes {
        offsets.push(end);
        end = end.saturating_add(bytes.div_ceil(ALIGNMENT).saturating_mul(ALIGNMENT));
    }
    (offsets, end)
}

/// Alignment of each storage in a shared buffer: the plan's
/// [`SLOT_ALIGNMENT`](stageload_plan::split::SLOT_ALIGNMENT) (libtorch's CPU allocator aligns to 64).
pub const ALIGNMENT: usize = stageload_plan::split::SLOT_ALIGNMENT as usize;

/// Points every freed storage of `storages` at its part of the buffer at `base` (offsets from
/// [`layout`]); returns the ids attached, so the caller fills exactly those.
///
/// # Safety
///
/// As [`shim::attach_storage`]: `base` is valid and [`ALIGNMENT`]-aligned for the whole layout
/// for as long as the storages hold it, and no other storage uses that buffer meanwhile.
pub unsafe fn attach(storages: &[StorageRecord], base: *mut u8, offsets: &[usize]) -> Result<HashSet<u64>, ShimError> {
    let mut attached = HashSet::new();
    for (storage, &offset) in storages.iter().zip(offsets) {
        if storage.nbytes > 0 && !shim::storage_info(&storage.tensor)?.allocated {
            crate::copy_watch::check_free(storage.id, "given a slot's memory");
            // SAFETY: `offset + nbytes` lies inside the buffer (the layout) and this function's
            // own precondition covers the rest.
            unsafe { shim::attach_storage(&storage.tensor, base.add(offset), storage.nbytes) }?;
            attached.insert(storage.id);
        }
    }
    Ok(attached)
}

/// Frees again the storages of `ids` (undoing a [`reallocate`] whose refill failed).
///
/// # Safety
///
/// As [`release`].
pub unsafe fn free_ids(storages: &[StorageRecord], ids: &HashSet<u64>, message: &str) -> Result<(), ShimError> {
    for storage in storages.iter().filter(|s| ids.contains(&s.id)) {
        crate::copy_watch::check_free(storage.id, "freed after a failed refill");
        // SAFETY: this function's own precondition.
        unsafe { shim::free_storage(&storage.tensor, message) }?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    #[test]
    fn tied_storage_is_counted_once_and_a_second_release_frees_nothing() {
        let weight = Tensor::ones([4, 4], (Kind::Float, Device::Cpu));
        let tensors = vec![("a".to_string(), weight.shallow_clone()), ("b".to_string(), weight.shallow_clone())];
        let storages = distinct_storages(&tensors).unwrap();
        assert_eq!(storages.iter().map(|s| s.nbytes).sum::<usize>(), 64, "one storage behind both names");
        let keep = HashSet::new();
        // SAFETY: one thread, no op running on these tensors.
        assert_eq!(unsafe { release(&storages, &keep, "test") }.unwrap().freed, 64);
        // SAFETY: as above.
        assert_eq!(unsafe { release(&storages, &keep, "test") }.unwrap().freed, 0);
    }
}
