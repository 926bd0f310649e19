//! Release and reallocation in place of a model's storages.
//!
//! A model is known by its named tensors (a VarStore's parameters and buffers). Several tensors
//! may share one storage (tied weights, views, a backbone two models hold): storages are
//! identified through the shim and counted, freed and reallocated once each.

use std::collections::{HashMap, HashSet};

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

/// Where a tensor's bytes lie in its storage, to tell whether filling one tensor fills another.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Span {
    storage: u64,
    /// First byte it reaches, from the storage's start.
    start: usize,
    /// Byte after the last one it reaches ([`needed_bytes`]).
    end: usize,
    /// Every byte of `start..end` is one of its elements (contiguous): filling it fills them all.
    dense: bool,
    /// Sizes, strides and dtype: the same view when equal and at the same `start`.
    view: (Vec<i64>, Vec<i64>, tch::Kind),
}

impl Span {
    fn of(tensor: &Tensor) -> Result<Span, ShimError> {
        let storage = shim::storage_info(tensor)?.id;
        let start = (tensor.storage_offset().max(0) as usize).saturating_mul(tensor.kind().elt_size_in_bytes());
        Ok(Span {
            storage,
            start,
            end: needed_bytes(tensor),
            dense: tensor.is_contiguous(),
            view: (tensor.size(), tensor.stride(), tensor.kind()),
        })
    }

    /// Whether filling this tensor writes every byte `other` reaches: the same view of the same
    /// storage (tied weights), or a dense tensor whose bytes hold all of `other`'s.
    fn covers(&self, other: &Span) -> bool {
        self.storage == other.storage
            && ((self.start == other.start && self.view == other.view)
                || (self.dense && self.start <= other.start && other.end <= self.end))
    }
}

/// For each of `tensors` that is not `filled`, the index of a filled one whose filling writes
/// every byte it reaches (its storage is filled through another name: tied weights, a view of a
/// filled weight); `None` for the filled ones, empty ones and the rest.
pub(crate) fn filled_through(tensors: &[&Tensor], filled: &[bool]) -> Result<Vec<Option<usize>>, ShimError> {
    let spans = tensors.iter().map(|t| Span::of(t)).collect::<Result<Vec<_>, _>>()?;
    let mut by_storage: HashMap<u64, Vec<usize>> = HashMap::new();
    for (i, span) in spans.iter().enumerate().filter(|(i, _)| filled[*i]) {
        by_storage.entry(span.storage).or_default().push(i);
    }
    Ok(spans
        .iter()
        .enumerate()
        .map(|(i, span)| {
            if filled[i] || tensors[i].numel() == 0 {
                return None;
            }
            by_storage.get(&span.storage)?.iter().copied().find(|&j| spans[j].covers(span))
        })
        .collect())
}

/// The fewest of `tensors` whose filling fills them all, in their order: each tensor unless
/// another one chosen covers it (tied weights once). What a model's own copy of its weights
/// (a snapshot) writes.
pub(crate) fn covering(tensors: &[(String, Tensor)]) -> Result<Vec<usize>, ShimError> {
    let spans = tensors.iter().map(|(_, t)| Span::of(t)).collect::<Result<Vec<_>, _>>()?;
    // Larger dense spans first, so that a whole weight is chosen before a view into it.
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(spans[i].dense), std::cmp::Reverse(spans[i].end - spans[i].start), i));
    let mut chosen: HashMap<u64, Vec<usize>> = HashMap::new();
    for i in order {
        let on_storage = chosen.entry(spans[i].storage).or_default();
        if !on_storage.iter().any(|&j| spans[j].covers(&spans[i])) {
            on_storage.push(i);
        }
    }
    let mut chosen: Vec<usize> = chosen.into_values().flatten().collect();
    chosen.sort_unstable();
    Ok(chosen)
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
/// reallocated, so the caller refills exactly those. On failure (out of memory) the storages
/// it had reallocated are freed again: none is left allocated and unfilled.
///
/// # Safety
///
/// As [`shim::realloc_storage`]: the caller fills those storages before anything reads them
/// and keeps every other thread away meanwhile.
pub unsafe fn reallocate<'a>(
    storages: impl IntoIterator<Item = &'a StorageRecord> + Clone,
) -> Result<HashSet<u64>, ShimError> {
    let give = |storage: &StorageRecord| {
        crate::copy_watch::check_free(storage.id, "given new memory");
        // SAFETY: this function's own precondition.
        unsafe { shim::realloc_storage(&storage.tensor, storage.nbytes) }.map(|()| true)
    };
    // SAFETY: as above.
    unsafe { give_memory(storages, give, "stageload: a refill ran out of memory") }
}

/// Calls `give` for every freed storage of `storages` that has bytes (`true`: it gave the
/// storage memory); returns the ids given memory. On an error the storages given memory are
/// freed again (with `message` for whoever reaches them), so none is left with memory nobody
/// filled: the one place both a reallocation
/// and a reload that maps ([`crate::staged`]) undo a half-done round.
///
/// # Safety
///
/// As [`shim::realloc_storage`], for what `give` does.
pub(crate) unsafe fn give_memory<'a>(
    storages: impl IntoIterator<Item = &'a StorageRecord> + Clone,
    mut give: impl FnMut(&StorageRecord) -> Result<bool, ShimError>,
    message: &str,
) -> Result<HashSet<u64>, ShimError> {
    let mut given = HashSet::new();
    let mut each = || {
        for storage in storages.clone() {
            if storage.nbytes > 0 && !shim::storage_info(&storage.tensor)?.allocated && give(storage)? {
                given.insert(storage.id);
            }
        }
        Ok(())
    };
    if let Err(error) = each() {
        for storage in storages.into_iter().filter(|s| given.contains(&s.id)) {
            // SAFETY: given memory just now and not handed out.
            let _ = unsafe { shim::free_storage(&storage.tensor, message) };
        }
        return Err(error);
    }
    Ok(given)
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
/// [`layout`]); returns the ids attached, so the caller fills exactly those. On an error the
/// storages it had attached are freed again, so none is left pointing into the buffer.
///
/// # Safety
///
/// As [`shim::attach_storage`]: `base` is valid for the whole layout for as long as the storages
/// hold it, each storage's place aligned for its dtype (`base` [`ALIGNMENT`]-aligned, or at a
/// block's file phase where its first byte is), and no other storage uses that buffer meanwhile.
pub unsafe fn attach(storages: &[StorageRecord], base: *mut u8, offsets: &[usize]) -> Result<HashSet<u64>, ShimError> {
    let mut attached = HashSet::new();
    for (storage, &offset) in storages.iter().zip(offsets) {
        let attach = || -> Result<bool, ShimError> {
            if storage.nbytes == 0 || shim::storage_info(&storage.tensor)?.allocated {
                return Ok(false);
            }
            crate::copy_watch::check_free(storage.id, "given a slot's memory");
            // SAFETY: `offset + nbytes` lies inside the buffer (the layout) and this function's
            // own precondition covers the rest.
            unsafe { shim::attach_storage(&storage.tensor, base.add(offset), storage.nbytes) }?;
            Ok(true)
        };
        match attach() {
            Ok(true) => {
                attached.insert(storage.id);
            }
            Ok(false) => {}
            Err(err) => {
                // SAFETY: the storages attached above hold nothing anyone has used yet.
                let _ = unsafe { free_ids(storages, &attached, "a slot's memory given back after a failed attach") };
                return Err(err);
            }
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
    fn a_reallocation_that_runs_out_of_memory_leaves_nothing_allocated_and_unfilled() {
        let tensors: Vec<(String, Tensor)> =
            ["a", "b"].iter().map(|n| (n.to_string(), Tensor::ones([16], (Kind::Float, Device::Cpu)))).collect();
        let mut records = distinct_storages(&tensors).unwrap();
        let all: HashSet<u64> = records.iter().map(|r| r.id).collect();
        // SAFETY: nothing else holds these tensors.
        unsafe { free_ids(&records, &all, "freed by the test") }.unwrap();
        // The second asks for more than any machine has: its allocation fails.
        records[1].nbytes = usize::MAX / 2;
        // SAFETY: nothing reads the storages.
        let err = unsafe { reallocate(&records) }.unwrap_err();
        assert!(!err.to_string().is_empty());
        let allocated = |t: &Tensor| shim::storage_info(t).unwrap().allocated;
        assert!(!allocated(&tensors[0].1), "the first, reallocated before the failure, is freed again");
        assert!(!allocated(&tensors[1].1));
        records[1].nbytes = 64;
        // SAFETY: as above.
        let ids = unsafe { reallocate(&records) }.unwrap();
        assert_eq!(ids, all, "both come back on a later try");
    }

    #[test]
    fn a_tensor_is_filled_through_another_only_when_that_one_writes_every_byte_it_reaches() {
        let w = Tensor::arange(24, (Kind::Float, Device::Cpu)).reshape([4, 6]);
        let rows = w.narrow(0, 1, 2);
        let transposed = w.tr();
        let other = Tensor::zeros([4, 6], (Kind::Float, Device::Cpu));
        let tensors = [&w, &w.shallow_clone(), &rows, &transposed, &other];
        let through = filled_through(&tensors, &[true, false, false, false, false]).unwrap();
        assert_eq!(
            through,
            [None, Some(0), Some(0), Some(0), None],
            "tied, a row view, a transpose; not another storage"
        );

        // A strided tensor fills only its own elements: a view of other bytes is not filled by it.
        let columns = w.narrow(1, 0, 3);
        let tensors = [&columns, &w.narrow(1, 3, 3), &columns.shallow_clone()];
        let through = filled_through(&tensors, &[true, false, false]).unwrap();
        assert_eq!(through, [None, None, Some(0)], "only the same view is filled through a strided one");
    }

    #[test]
    fn the_covering_set_is_each_storage_once_through_its_widest_dense_tensor() {
        let w = Tensor::zeros([4, 6], (Kind::Float, Device::Cpu));
        let b = Tensor::zeros([6], (Kind::Float, Device::Cpu));
        let tensors = vec![
            ("head".to_string(), w.narrow(0, 0, 2)),
            ("embedding".to_string(), w.shallow_clone()),
            ("tied".to_string(), w.shallow_clone()),
            ("bias".to_string(), b),
        ];
        assert_eq!(covering(&tensors).unwrap(), [1, 3], "the whole weight once, and the bias");
    }

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
