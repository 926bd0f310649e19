//! Releases, a batch at a time (the models a stage entry, a `close`, an `insert` or a `remove`
//! lets go): each released instance's storages freed in place (once the host tier has its
//! copy), or left to the guard of whoever holds the model; the model object itself dropped when
//! it will not be refilled in place; the allocators' caches emptied once after the batch, and
//! the host heap trimmed once releases have freed [`TRIM_AFTER`] bytes since its last trim. A
//! batch is claimed, checked for the storages others keep live, and settled under one taking
//! of the state lock each, so the lock is not taken per model.

use std::any::Any;
use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::{Arc, MutexGuard};
use std::time::Instant;

use super::decide::{self, ReleaseMark};
use super::error::StageError;
use super::instance::Instance;
use super::registry::Inner;
use crate::storage::{self, ReleaseStats};
use crate::sync::lock;
use stageload_trace::event::{Event, EventKind};

/// A release claimed under the state lock: nobody uses the model (its body is held) and no
/// revival can win any more.
struct Claimed<'a> {
    instance: &'a Arc<Instance>,
    body: MutexGuard<'a, Box<dyn Any + Send>>,
    /// The stage whose entry released it.
    stage: Option<String>,
}

impl Inner {
    /// Carries out the releases of `instances` (already marked): each is freed now, or left to
    /// the guard holding it (see the module docs). Adds up what was freed now.
    ///
    /// The state lock is taken three times for the whole batch, however many models it holds:
    /// to claim, to read the storages others keep live, and to settle; a copy into the host tier
    /// or a snapshot takes it again for its own bookkeeping.
    pub(crate) fn release_all(&self, instances: Vec<Arc<Instance>>) -> ReleaseStats {
        let state = self.state();
        // The claims are made under the state lock, under which a `get` decides to revive a
        // model whose release is still pending: either the revival or the free happens, never
        // both.
        let claimed: Vec<Claimed<'_>> = instances.iter().filter_map(claim).collect();
        let tier = state.tier.is_some() && !state.closed;
        drop(state);
        if claimed.is_empty() {
            return ReleaseStats::default();
        }
        for release in &claimed {
            if tier {
                self.store_in_tier(release.instance, &release.stage);
            }
            self.snapshot_before_release(release.instance, &release.stage);
        }
        // Storages other models keep live stay, and so do a model's own that nothing could
        // refill (tensors its checkpoint lacks): both counted as kept. In the batch, a storage
        // two of its models share is freed by the later one, as if they were released one
        // after the other.
        let keeps: Vec<HashSet<u64>> = {
            let state = self.state();
            let batch: Vec<&Arc<Instance>> = claimed.iter().map(|c| c.instance).collect();
            (0..claimed.len()).map(|i| state.live_storage_ids_in_batch(&batch, i)).collect()
        };
        let freed: Vec<(Result<ReleaseStats, _>, f64)> = claimed
            .iter()
            .zip(&keeps)
            .map(|(release, keep)| {
                let started = Instant::now();
                let message = released_message(&release.instance.name, &release.stage);
                // SAFETY: the body lock is held, so no caller of this model runs; storages
                // another resident model holds are in `keep` and stay.
                let result = unsafe { storage::release(&lock(&release.instance.weights).storages, keep, &message) };
                (result, started.elapsed().as_secs_f64())
            })
            .collect();
        // Settled either way: a failed free leaves what it could not free allocated, and the
        // next `get` refills the rest; nobody waits for these releases any longer.
        let mut state = self.state();
        let mut settled = Vec::with_capacity(claimed.len());
        for release in &claimed {
            let instance = release.instance;
            let in_tier = state.in_tier(&instance.name);
            let mut comes_back = true;
            if let Some(position) = state.index.get(&instance.name).copied() {
                if let Some(done) = state.entries()[position].slot().finish_release(instance, in_tier) {
                    comes_back = done.comes_back;
                    state.set_state(position, done.state);
                }
            }
            settled.push((comes_back, state.resident_bytes()));
        }
        self.changed.notify_all();
        drop(state);
        let mut total = ReleaseStats::default();
        let mut events = Vec::with_capacity(claimed.len());
        let (mut any_dropped, mut freed_now) = (false, 0u64);
        for ((release, (result, seconds)), (comes_back, resident)) in claimed.into_iter().zip(freed).zip(settled) {
            let Claimed { instance, mut body, stage } = release;
            if !comes_back && result.is_ok() {
                // Never used again: the model object goes now, and whatever it holds beside its
                // weights (host buffers, a streamed model's pinned copies) with it.
                drop(std::mem::replace(&mut *body, Box::new(())));
                any_dropped = true;
            }
            drop(body);
            let event = match result {
                Ok(stats) => {
                    total.freed += stats.freed;
                    total.kept += stats.kept;
                    freed_now = freed_now.saturating_add(stats.freed);
                    Event {
                        stage,
                        model: Some(instance.name.clone()),
                        bytes: Some(stats.freed),
                        seconds: Some(seconds),
                        kept_bytes: (stats.kept > 0).then_some(stats.kept),
                        resident: Some(resident),
                        ..Event::now(EventKind::Release)
                    }
                }
                Err(source) => {
                    let err = StageError::Torch { model: instance.name.clone(), source };
                    Event {
                        stage,
                        model: Some(instance.name.clone()),
                        note: Some(err.to_string()),
                        ..Event::now(EventKind::Error)
                    }
                }
            };
            events.push(event);
        }
        if any_dropped || freed_now > 0 {
            // Before the events, so that a meter reading at them sees the memory gone.
            give_back_caches(any_dropped, self.trim_due(freed_now));
        }
        for event in events {
            self.emit(event);
        }
        total
    }

    /// Counts `freed` bytes towards the next trim of the host heap; says whether it is due now
    /// (and starts the count over).
    fn trim_due(&self, freed: u64) -> bool {
        let untrimmed = self.untrimmed.fetch_add(freed, Ordering::Relaxed).saturating_add(freed);
        untrimmed >= TRIM_AFTER && self.untrimmed.swap(0, Ordering::Relaxed) > 0
    }
}

/// Claims the release of `instance` if it can be made now (under the state lock): still
/// requested, and its body free (tried, never waited for). A body in use leaves the release to
/// whoever holds it ([`decide::on_release`]).
fn claim(instance: &Arc<Instance>) -> Option<Claimed<'_>> {
    let mut ctl = lock(&instance.ctl);
    if !matches!(ctl.mark, ReleaseMark::Requested(_)) {
        return None;
    }
    let body = instance.try_body();
    if decide::on_release(body.is_some()) == decide::ReleaseWhen::WhenUnlocked {
        return None;
    }
    let body = body?;
    let stage = ctl.mark.claim()?;
    Some(Claimed { instance, body, stage })
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

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use tch::{Device, Kind, Tensor};

    use super::super::{Built, ModelSpec, StagedModels};

    /// A model of one `[n]` float tensor of its own and, when `shared`, a `[64]` backbone built
    /// once and shared by every model built with it.
    fn model(name: &str, n: i64, shared: bool) -> ModelSpec {
        ModelSpec::new(name, move |ctx| {
            let head = Tensor::zeros([n], (Kind::Float, Device::Cpu));
            let tensors = vec![("head".to_string(), head.shallow_clone())];
            let backbone = shared
                .then(|| {
                    ctx.shared("backbone", || {
                        let w = Tensor::zeros([64], (Kind::Float, Device::Cpu));
                        Ok((w.shallow_clone(), vec![("w".to_string(), w)]))
                    })
                })
                .transpose()?;
            Ok(Built::from_tensors((head, backbone), tensors))
        })
    }

    /// What [`model`] builds.
    type Model = (Tensor, Option<crate::sync::Shared<Tensor>>);

    /// `count` models in stage `many` (sharing a backbone when `shared`), and stage `none`.
    fn registry(count: usize, shared: bool) -> StagedModels {
        let mut builder = StagedModels::builder().preserve_rng(false);
        let names: Vec<String> = (0..count).map(|i| format!("m{i}")).collect();
        for (i, name) in names.iter().enumerate() {
            builder = builder.model(model(name, 8 + i as i64, shared));
        }
        let models = builder.stage("many", names.clone()).stage("none", Vec::<String>::new()).build().unwrap();
        models.enter("many").unwrap();
        for name in &names {
            models.get::<Model>(name).unwrap();
        }
        models
    }

    #[test]
    fn entering_a_stage_takes_the_state_lock_as_often_however_many_models_it_releases() {
        let locks: Vec<u64> = [1, 4, 16]
            .into_iter()
            .map(|count| {
                let models = registry(count, false);
                let before = models.inner.state_locks.load(Ordering::Relaxed);
                let stats = models.enter("none").unwrap();
                let locks = models.inner.state_locks.load(Ordering::Relaxed) - before;
                assert_eq!(models.resident_bytes(), 0, "{count} models: all released");
                assert!(stats.freed > 0);
                locks
            })
            .collect();
        // The entry's decision, then the batch: its claims, the storages others keep, settling.
        assert_eq!(locks, [4, 4, 4]);
    }

    #[test]
    fn a_storage_the_models_of_one_batch_share_is_freed_once_by_the_last_of_them() {
        let models = registry(3, true);
        let heads = 4 * (8 + 9 + 10);
        assert_eq!(models.resident_bytes(), heads + 4 * 64, "the backbone counted once");
        let stats = models.enter("none").unwrap();
        // m0 and m1 each keep it for the ones after them (as released one after the other).
        assert_eq!((stats.freed, stats.kept), (heads + 4 * 64, 2 * 4 * 64));
        assert_eq!(models.resident_bytes(), 0);
    }
}
