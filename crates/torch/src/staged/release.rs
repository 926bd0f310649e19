//! Releases: a released instance's storages freed in place (once the host tier has its copy),
//! or left to the guard of whoever holds the model; the model object itself dropped when it
//! will not be refilled in place; the allocators' caches emptied after.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

use super::decide::{self, SlotState};
use super::error::StageError;
use super::instance::{Instance, ReleaseMark};
use super::registry::Inner;
use crate::storage::{self, ReleaseStats};
use crate::sync::lock;
use stageload_trace::event::{Event, EventKind};

impl Inner {
    /// Frees a released instance's storages now, or leaves that to the guard holding it (see the
    /// module docs). Returns what was freed, or `None` when the release was left to a guard or
    /// the model was taken back meanwhile.
    pub(crate) fn release_instance(&self, instance: &Arc<Instance>) -> Option<ReleaseStats> {
        let mut ctl = lock(&instance.ctl);
        let ReleaseMark::Requested(stage) = ctl.mark.clone() else {
            return None;
        };
        let body = instance.try_body();
        if decide::on_release(body.is_some()) == decide::ReleaseWhen::WhenUnlocked {
            return None;
        }
        let mut body = body?;
        ctl.mark = ReleaseMark::Freed(stage.clone());
        drop(ctl);

        self.store_in_tier(instance, &stage);
        let started = Instant::now();
        let keep: HashSet<u64> =
            self.state().holding().filter(|i| !Arc::ptr_eq(i, instance)).flat_map(|i| i.storage_ids()).collect();
        let message = released_message(&instance.name, &stage);
        // SAFETY: the body lock is held, so no caller of this model runs; storages another
        // resident model holds are in `keep` and stay.
        let result = unsafe { storage::release(&lock(&instance.weights).storages, &keep, &message) };
        // Settled either way: a failed free leaves what it could not free allocated, and the
        // next `get` refills the rest; nobody waits for this release any longer.
        let mut state = self.state();
        let in_tier = state.in_tier(&instance.name);
        let mut comes_back = true;
        if let Some(entry) = state.entry_mut(&instance.name) {
            if let SlotState::Released { instance: held, pending, .. } = &mut entry.slot.state {
                if Arc::ptr_eq(held, instance) {
                    *pending = false;
                    comes_back = decide::refillable(&entry.slot, in_tier);
                }
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
        if dropped || result.as_ref().is_ok_and(|stats| stats.freed > 0) {
            // Before the event, so that a meter reading at the event sees the memory gone.
            give_back_caches(dropped);
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

/// Hands what the allocators keep cached after a release back: the host heap's free pages to
/// the OS, the device caches to their devices, and, when the model object went (`dropped`),
/// pinned host memory to the OS (not after every release: a copy into the host tier reuses
/// what a reload from it left cached).
fn give_back_caches(dropped: bool) {
    stageload_torch_sys::trim_host_heap();
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
