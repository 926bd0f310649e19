//! Releases, a batch at a time (the models a stage entry, a `close`, an `insert` or a `remove`
//! lets go): each released instance's storages freed in place (once the host tier has its
//! copy), or left to the guard of whoever holds the model; the model object itself dropped when
//! it will not be refilled in place; the allocators' caches emptied once after the batch, and
//! the host heap trimmed once releases have freed [`caches::TRIM_AFTER`] bytes since its last trim.
//!
//! A batch is decided, then carried out. [`Inner::claim_batch`] runs under the taking of the state
//! lock that decided the releases (a stage entry's own): it claims them and reads the storages
//! other models keep live. [`Inner::release_batch`] frees them without the state lock (under the
//! fills' lock, which keeps what a load in flight borrows, [`super::fills`]) and takes the state
//! lock once more to settle. So a stage entry takes the state lock twice, however many models it lets go.
//! With a host tier or a snapshot folder, a copy into the tier or a snapshot may come before the
//! frees and lets other models load meanwhile: then the storages kept live are read again after
//! it, and the copy and the snapshot take the lock for their own bookkeeping.

use std::any::Any;
use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::{Arc, MutexGuard};
use std::time::Instant;

use super::caches;
use super::decide::{self, ReleaseMark};
use super::error::StageError;
use super::instance::Instance;
use super::registry::Inner;
use super::slots::State;
use crate::storage::ReleaseStats;
use crate::sync::lock;
use stageload_torch_sys::ShimError;
use stageload_trace::event::{Event, Failed, Released, SnapshotAction, SnapshotTaken, What};

/// The releases of one batch, claimed under the state lock.
pub(super) struct Batch<'a> {
    claimed: Vec<Claimed<'a>>,
    /// Copy each into the host tier first.
    tier: bool,
    /// For each claim, the storages to keep (others hold them live), when read with the claims;
    /// `None` when work outside the lock comes before the frees.
    keeps: Option<Vec<HashSet<u64>>>,
}

/// A release claimed under the state lock: nobody uses the model (its body is held) and no
/// revival can win any more.
struct Claimed<'a> {
    instance: &'a Arc<Instance>,
    body: MutexGuard<'a, Box<dyn Any + Send>>,
    /// The stage whose entry released it.
    stage: Option<String>,
}

impl Inner {
    /// Releases `instances` (already marked): claims them under one taking of the state lock,
    /// then carries them out ([`Self::release_batch`]). Adds up what was freed now.
    pub(crate) fn release_all(&self, instances: Vec<Arc<Instance>>) -> ReleaseStats {
        let batch = self.claim_batch(&self.slots.lock(), &instances);
        self.release_batch(batch)
    }

    /// Claims the releases of `instances` under `state`, the caller's taking of the state lock:
    /// a `get` decides to revive a model whose release is still pending under that lock too, so
    /// either the revival or the free happens, never both. A release is claimed when still
    /// requested and its body is free (tried, never waited for); one in use is left to the
    /// guard holding it.
    pub(super) fn claim_batch<'a>(&self, state: &State, instances: &'a [Arc<Instance>]) -> Batch<'a> {
        let claimed: Vec<Claimed<'a>> = instances.iter().filter_map(claim).collect();
        let tier = state.tier().is_some() && !state.is_closed();
        let work_first = tier || self.snapshots.is_some();
        let keeps = (!work_first && !claimed.is_empty()).then(|| state.kept_in_batch(&instances_of(&claimed)));
        Batch { claimed, tier, keeps }
    }

    /// Carries out a claimed batch: each model's storages freed in place (after its copy into
    /// the host tier or its snapshot), settled under one more taking of the state lock
    /// ([`State::settle_releases`]), then told.
    pub(super) fn release_batch(&self, batch: Batch<'_>) -> ReleaseStats {
        let Batch { claimed, tier, keeps } = batch;
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
        let keeps = keeps.unwrap_or_else(|| self.slots.lock().kept_in_batch(&instances_of(&claimed)));
        let freed = self.free_batch(&claimed, &keeps);
        // Settled either way: a failed free leaves what it could not free allocated, and the
        // next `get` refills the rest; nobody waits for these releases any longer.
        let settled = self.slots.lock().settle_releases(&instances_of(&claimed));
        self.slots.notify();
        self.tell_released(claimed, freed, settled)
    }

    /// Frees each claimed model's storages in place but those of its `keeps`: the outcome and
    /// the seconds each took.
    fn free_batch(
        &self,
        claimed: &[Claimed<'_>],
        keeps: &[HashSet<u64>],
    ) -> Vec<(Result<ReleaseStats, ShimError>, f64)> {
        claimed
            .iter()
            .zip(keeps)
            .map(|(release, keep)| {
                let started = Instant::now();
                let message = released_message(&release.instance.name, &release.stage);
                let weights = lock(&release.instance.weights);
                // SAFETY: the body lock is held, so no caller of this model runs; storages
                // another resident model holds are in `keep`, those a load in flight borrows
                // are kept by the fills, and both stay.
                let result = unsafe { self.fills.release(&weights.storages, keep, &message) };
                (result, started.elapsed().as_secs_f64())
            })
            .collect()
    }

    /// Ends a batch carried out and settled (`settled`: whether each comes back in place, and
    /// the resident bytes after it): drops the model objects that never come back, gives the
    /// memory back to the OS once, then emits a `release` (or `error`) event each. The total.
    fn tell_released(
        &self,
        claimed: Vec<Claimed<'_>>,
        freed: Vec<(Result<ReleaseStats, ShimError>, f64)>,
        settled: Vec<(bool, u64)>,
    ) -> ReleaseStats {
        let mut total = ReleaseStats::default();
        let mut events = Vec::with_capacity(claimed.len());
        let mut any_dropped = false;
        for ((release, (result, seconds)), (comes_back, resident)) in claimed.into_iter().zip(freed).zip(settled) {
            let Claimed { instance, mut body, stage } = release;
            if !comes_back && result.is_ok() {
                // Never used again: the model object goes now, and whatever it holds beside its
                // weights (host buffers, a streamed model's pinned copies) with it.
                drop(std::mem::replace(&mut *body, Box::new(())));
                any_dropped = true;
            }
            drop(body);
            let model = instance.name.clone();
            events.push(match result {
                Ok(stats) => {
                    total.freed += stats.freed;
                    total.kept += stats.kept;
                    let (bytes, seconds, kept_bytes) = (Some(stats.freed), Some(seconds), stats.kept);
                    What::from(Released { stage, model, bytes, seconds, kept_bytes, resident: Some(resident) })
                }
                Err(source) => {
                    let note = StageError::Torch { model: model.clone(), source }.to_string();
                    What::from(Failed { stage, model: Some(model), seconds: None, note })
                }
            });
        }
        if any_dropped || total.freed > 0 {
            // Before the events, so that a meter reading at them sees the memory gone.
            let started = Instant::now();
            caches::give_back(any_dropped, self.trim.due(total.freed));
            share_give_back(&mut events, started.elapsed().as_secs_f64(), total.freed);
        }
        // Stamped now, after the memory went back (the host block cache's flush included): a
        // sample taken during the give-back falls before them, in the stage being left.
        for what in events {
            self.emit(Event::now(what));
        }
        total
    }

    /// Removes the snapshot file of a model replaced or removed: no reload reads it any more.
    pub(super) fn forget_snapshot(&self, path: Option<PathBuf>) {
        if let (Some(snapshots), Some(path)) = (&self.snapshots, path) {
            snapshots.forget(&path);
        }
    }

    /// Before a release frees a model that has no checkpoint, no copy in the host tier and is
    /// not streamed: writes its weights as a snapshot ([`super::snapshot`]) and makes that file
    /// its checkpoint, so that it comes back in place. Runs under the instance's body lock
    /// (nobody uses the model), with the state lock taken only to decide and to record; says
    /// what it did in a `snapshot` event.
    fn snapshot_before_release(&self, instance: &Instance, stage: &Option<String>) {
        let Some(snapshots) = &self.snapshots else { return };
        let name = instance.name.as_str();
        let wanted = |state: &State| {
            !state.is_closed()
                && !state.in_tier(name)
                && state.find(name).is_some_and(|p| {
                    let entry = &state.entries()[p];
                    entry.checkpoint.is_empty()
                        && entry.stream.is_none()
                        && entry.released().is_some_and(|held| std::ptr::eq(held.as_ref(), instance))
                })
        };
        if !wanted(&self.slots.lock()) {
            return;
        }
        let started = Instant::now();
        let (bytes, written) = snapshots.write_instance(instance);
        let (action, detail) = match written {
            Ok((path, stamp)) => {
                let mut state = self.slots.lock();
                if let Some(position) = state.find(name).filter(|_| wanted(&state)) {
                    state.entry_mut(position).refill_from_snapshot(path.clone(), stamp);
                    (SnapshotAction::Written, path.display().to_string())
                } else {
                    // Replaced or removed meanwhile: the file is nobody's.
                    drop(state);
                    snapshots.forget(&path);
                    (SnapshotAction::NotWritten, "the model was replaced meanwhile".to_string())
                }
            }
            Err(reason) => (SnapshotAction::NotWritten, format!("{reason}; '{name}' is rebuilt when needed")),
        };
        self.emit(Event::now(SnapshotTaken {
            stage: stage.clone(),
            model: name.to_string(),
            action,
            detail,
            bytes: Some(bytes),
            seconds: Some(started.elapsed().as_secs_f64()),
        }));
    }
}

fn instances_of<'a>(claimed: &[Claimed<'a>]) -> Vec<&'a Arc<Instance>> {
    claimed.iter().map(|c| c.instance).collect()
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

pub(super) fn released_message(model: &str, stage: &Option<String>) -> String {
    let at = stage.as_ref().map(|s| format!(" when entering stage '{s}'")).unwrap_or_default();
    format!("stageload: model '{model}' was released{at} and its weights are gone; get it from the registry again")
}

/// Adds to each release's seconds its share, by bytes freed, of `seconds` spent giving a batch's
/// memory back to the OS (the host block cache's flush and the heap's trim, where most of a
/// release's time goes: the frees themselves only hand blocks to the cache), so that the
/// releases' seconds add up to the time they took.
fn share_give_back(events: &mut [What], seconds: f64, freed: u64) {
    for what in events {
        if let What::Release(Released { bytes: Some(bytes), seconds: Some(own), .. }) = what {
            // u64 to f64: a ratio, exact enough at any size.
            let share = if freed == 0 { 0.0 } else { *bytes as f64 / freed as f64 };
            *own += seconds * share;
        }
    }
}

#[cfg(test)]
mod tests {
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
                let before = models.inner.slots.locks();
                let stats = models.enter("none").unwrap();
                let locks = models.inner.slots.locks() - before;
                assert_eq!(models.resident_bytes(), 0, "{count} models: all released");
                assert!(stats.freed > 0);
                locks
            })
            .collect();
        // The entry's decision with the batch's claims and the storages others keep; settling.
        assert_eq!(locks, [2, 2, 2]);
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

    #[test]
    fn the_give_back_is_shared_among_a_batch_s_releases_by_bytes_freed() {
        use super::{share_give_back, Released, What};
        let released = |bytes, seconds| {
            What::from(Released {
                model: "m".into(),
                bytes: Some(bytes),
                seconds: Some(seconds),
                ..Released::default()
            })
        };
        let mut events = vec![released(300, 0.5), released(100, 0.25)];
        share_give_back(&mut events, 2.0, 400);
        let seconds: Vec<_> = events
            .iter()
            .map(|what| match what {
                What::Release(Released { seconds, .. }) => *seconds,
                _ => None,
            })
            .collect();
        assert_eq!(seconds, [Some(2.0), Some(0.75)]);
    }
}
