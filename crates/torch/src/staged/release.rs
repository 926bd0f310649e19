//! Releases: a released instance's storages freed in place (once the host tier has its copy),
//! or left to the guard of whoever holds the model; the model object itself dropped when it
//! will not be refilled in place; the allocators' caches emptied after, and the host heap
//! trimmed once releases have freed [`TRIM_AFTER`] bytes since its last trim.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use super::decide::{self, ReleaseMark};
use super::error::StageError;
use super::instance::Instance;
use super::registry::Inner;
use crate::storage::{self, ReleaseStats};
use crate::sync::lock;
use stageload_trace::event::{Event, EventKind};

impl Inner {
    /// Frees a released instance's storages now, or leaves that to the guard holding it (see the
    /// module docs). Returns what was freed, or `None` when the release was left to a guard or
    /// the model was taken back meanwhile.
    pub(crate) fn release_instance(&self, instance: &Arc<Instance>) -> Option<ReleaseStats> {
        // The claim is made under the state lock, under which a `get` decides to revive a model
        // whose release is pending: either the revival or the free happens, never both.
        let state = self.state();
        let mut ctl = lock(&instance.ctl);
        if !matches!(ctl.mark, ReleaseMark::Requested(_)) {
            return None;
        }
        // Tried, never waited for: the state lock is held.
        let body = instance.try_body();
        if decide::on_release(body.is_some()) == decide::ReleaseWhen::WhenUnlocked {
            return None;
        }
        let mut body = body?;
        let stage = ctl.mark.claim()?;
        drop(ctl);
        drop(state);

        self.store_in_tier(instance, &stage);
        self.snapshot_before_release(instance, &stage);
        let started = Instant::now();
        // Storages other models keep live stay, and so do this model's own that nothing could
        // refill (tensors its checkpoint lacks): both counted as kept.
        let mut keep = self.state().live_storage_ids(instance);
        keep.extend(instance.kept.iter().map(|(id, _)| *id));
        let message = released_message(&instance.name, &stage);
        // SAFETY: the body lock is held, so no caller of this model runs; storages another
        // resident model holds are in `keep` and stay.
        let result = unsafe { storage::release(&lock(&instance.weights).storages, &keep, &message) };
        // Settled either way: a failed free leaves what it could not free allocated, and the
        // next `get` refills the rest; nobody waits for this release any longer.
        let mut state = self.state();
        let in_tier = state.in_tier(&instance.name);
        let mut comes_back = true;
        if let Some(position) = state.index.get(&instance.name).copied() {
            if let Some(settled) = state.entries()[position].slot().finish_release(instance, in_tier) {
                comes_back = settled.comes_back;
                state.set_state(position, settled.state);
            }
        }
        let resident = state.resident_bytes();
        self.changed.notify_all();
        drop(state);
        let dropped = !comes_back && result.is_ok();
        if dropped {
            // Never used again: the model object goes now, and whatever it holds beside its
            // weights (host buffers, a streamed model's pinned copies) with it.
            drop(std::mem::replace(&mut *body, Box::new(())));
        }
        drop(body);
        let freed = result.as_ref().map_or(0, |stats| stats.freed);
        if dropped || freed > 0 {
            // Before the event, so that a meter reading at the event sees the memory gone.
            give_back_caches(dropped, self.trim_due(freed));
        }
        let stats = match result {
            Ok(stats) => stats,
            Err(source) => {
                let err = StageError::Torch { model: instance.name.clone(), source };
                self.emit(Event {
                    stage,
                    model: Some(instance.name.clone()),
                    note: Some(err.to_string()),
                    ..Event::now(EventKind::Error)
                });
                return None;
            }
        };
        self.emit(Event {
            stage,
            model: Some(instance.name.clone()),
            bytes: Some(stats.freed),
            seconds: Some(started.elapsed().as_secs_f64()),
            kept_bytes: (stats.kept > 0).then_some(stats.kept),
            resident: Some(resident),
            ..Event::now(EventKind::Release)
        });
        Some(stats)
    }

    /// Counts `freed` bytes towards the next trim of the host heap; says whether it is due now
    /// (and starts the count over).
    fn trim_due(&self, freed: u64) -> bool {
        let untrimmed = self.untrimmed.fetch_add(freed, Ordering::Relaxed).saturating_add(freed);
        untrimmed >= TRIM_AFTER && self.untrimmed.swap(0, Ordering::Relaxed) > 0
    }

    /// Releases `instances` (already marked), adding up what was freed now.
    pub(crate) fn release_all(&self, instances: Vec<Arc<Instance>>) -> ReleaseStats {
        let mut total = ReleaseStats::default();
        for instance in instances {
            if let Some(stats) = self.release_instance(&instance) {
                total.freed += stats.freed;
                total.kept += stats.kept;
            }
        }
        total
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

/// Hands what the allocators keep cached after a release back: the host heap's free pages to
/// the OS when `trim` (see [`TRIM_AFTER`]), the device caches to their devices, and, when the
/// model object went (`dropped`), pinned host memory to the OS (not after every release: a copy
/// into the host tier reuses what a reload from it left cached).
fn give_back_caches(dropped: bool, trim: bool) {
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

pub(super) fn released_message(model: &str, stage: &Option<String>) -> String {
    let at = stage.as_ref().map(|s| format!(" when entering stage '{s}'")).unwrap_or_default();
    format!("stageload: model '{model}' was released{at} and its weights are gone; get it from the registry again")
}
