//! What releases give back to the allocators: the host block cache's blocks, the host heap's
//! free pages (trimmed once enough was freed since the last trim), the device caches, and pinned
//! host memory.

use std::sync::atomic::{AtomicU64, Ordering};

/// Bytes releases freed since the host heap was last trimmed (see [`TRIM_AFTER`]).
#[derive(Default)]
pub(crate) struct Trim(AtomicU64);

impl Trim {
    /// Counts `freed` bytes towards the next trim of the host heap; says whether it is due now
    /// (and starts the count over).
    pub(crate) fn due(&self, freed: u64) -> bool {
        let untrimmed = self.0.fetch_add(freed, Ordering::Relaxed).saturating_add(freed);
        untrimmed >= TRIM_AFTER && self.0.swap(0, Ordering::Relaxed) > 0
    }
}

/// Bytes of storage that releases free before the host heap is trimmed again: a release that
/// frees this much trims at once (as every release did before), smaller ones add up until they
/// reach it, so less than this waits in the heap for the next trim. A trim (`malloc_trim`) walks
/// the whole heap, which grows with the number of models: trimming after every release made each
/// release cost what the registry holds (a run over 4,000 tiny models spent 90 % of its time
/// there). The same size as the mmap threshold the registry sets
/// ([`stageload_torch_sys::map_large_host_blocks`]): blocks that large go back to the OS as they
/// are freed, without a trim.
pub(crate) const TRIM_AFTER: u64 = stageload_torch_sys::HOST_MMAP_THRESHOLD as u64;

/// Frees the blocks the host block cache keeps (a no-op when it is not installed): at every
/// release, so that the model's memory goes back to the OS, and as each stage begins, so that
/// the stage's peak does not hold the last stage's activations.
pub(crate) fn flush_host_blocks() {
    if let Err(err) = stageload_torch_sys::flush_host_cache() {
        tracing::warn!(%err, "flushing the host block cache failed");
    }
}

/// Hands what the allocators keep cached after a release back: the host heap's free pages to
/// the OS when `trim` (see [`TRIM_AFTER`]), the device caches to their devices, and, when the
/// model object went (`dropped`), pinned host memory to the OS (not after every release: a copy
/// into the host tier reuses what a reload from it left cached).
pub(crate) fn give_back(dropped: bool, trim: bool) {
    // A released model's blocks went into the host block cache: free them first.
    flush_host_blocks();
    if trim {
        stageload_torch_sys::trim_host_heap();
    }
    let cuda = stageload_torch_sys::cuda_device_count().unwrap_or(0) > 0;
    let mps = stageload_torch_sys::mps_available().unwrap_or(false);
    if cuda {
        if let Err(err) = stageload_torch_sys::cuda_empty_cache() {
            tracing::warn!(%err, "emptying the CUDA cache after a release failed");
        }
    }
    if mps {
        if let Err(err) = stageload_torch_sys::mps_empty_cache() {
            tracing::warn!(%err, "emptying the MPS cache after a release failed");
        }
    }
    if dropped && (cuda || mps) {
        if let Err(err) = stageload_torch_sys::empty_pinned_cache() {
            tracing::warn!(%err, "emptying the pinned host memory cache after a release failed");
        }
    }
}
