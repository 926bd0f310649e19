//! Prefetch: a stage's models loaded on background threads (on CUDA on a side stream of the
//! model's device) while the current stage computes, as far as the prefetch budget allows; the
//! prefetches running (listed in the state from their start until their thread ends, waited for
//! on the `changed` condition variable), and their cancellation when the registry closes or
//! drops.

use std::sync::Arc;

use tch::Device;

use super::decide;
use super::error::Result;
use super::registry::Inner;
use super::slots::{Entry, Purpose};
use crate::sync::lock;
use stageload_trace::event::{Event, Prefetching};

/// A model a prefetch may load: its name, the bytes it will hold if known (a streamed model's
/// plan, else its released instance), else its checkpoint files to measure, and its CUDA device.
type Candidate = (String, Option<u64>, Vec<std::path::PathBuf>, Option<usize>);

/// The nice value of a prefetch's thread: the lowest priority.
const BACKGROUND_NICE: i32 = 19;

impl Inner {
    /// Starts background loads of `stage`'s models (see [`super::StagedModels::prefetch`]): of
    /// the occurrence that entering it now would enter, those a prefetch may load
    /// ([`Self::candidates`]) and the prefetch budget holds ([`Self::within_budget`]), a thread
    /// each ([`Self::spawn_prefetch`]). Returns the models started.
    pub(crate) fn prefetch(self: &Arc<Self>, stage: &str) -> Result<Vec<String>> {
        let (trip, candidates, resident, working) = self.candidates(stage)?;
        let started = self.within_budget(stage, candidates, resident, working);
        // Listed before their threads start, so that `prefetching` names them as soon as this
        // returns; each thread takes its own off when it ends.
        let ids: Vec<u64> = {
            let mut state = self.slots.lock();
            started.iter().map(|(name, _, _)| state.start_prefetch(name, stage)).collect()
        };
        let mut spawned = Vec::with_capacity(started.len());
        for ((name, bytes, cuda), id) in started.into_iter().zip(ids) {
            self.emit(Event::now(Prefetching {
                stage: Some(stage.to_string()),
                model: name.clone(),
                bytes: Some(bytes),
            }));
            // (A thread that could not start dropped its `Ended`, which took its entry off.)
            match self.spawn_prefetch(&name, id, trip, cuda) {
                Ok(handle) => {
                    self.background.track(handle);
                    spawned.push(name);
                }
                Err(err) => tracing::warn!(model = name.as_str(), stage, %err, "prefetch not started: no thread"),
            }
        }
        Ok(spawned)
    }

    /// Under one taking of the state lock: the trip to `stage`'s next occurrence, the models it
    /// plans that a prefetch may load (see [`Candidate`]), the resident bytes and the working
    /// memory of the current stage.
    fn candidates(&self, stage: &str) -> Result<(decide::Trip, Vec<Candidate>, u64, u64)> {
        let state = self.slots.lock();
        let Some(index) = state.occurrence(stage) else {
            return Err(state.unknown_stage(stage));
        };
        let mut candidates = Vec::new();
        for name in state.planned_at(index) {
            let Some(position) = state.find(name) else { continue };
            let entry = &state.entries()[position];
            let in_tier = state.in_tier(name);
            match entry.slot().prefetch(state.is_closed(), entry.init.draws_nothing(), in_tier) {
                Ok(()) => {
                    let known = entry.stream.as_ref().map(|plan| plan.planned_held).or_else(|| instance_bytes(entry));
                    candidates.push((name.clone(), known, entry.checkpoint.clone(), cuda_device(entry)))
                }
                Err(skip) => tracing::debug!(model = name.as_str(), stage, ?skip, "not prefetched"),
            }
        }
        let working = self.background.working_of(state.current());
        Ok((state.trip_to(index), candidates, state.resident_bytes(), working))
    }

    /// The candidates the prefetch budget holds, in order, with the bytes each will hold (its
    /// checkpoint files measured, with the state lock let go, where nothing else says) and its
    /// CUDA device. Without a budget, a declared working memory leaves what the machine has
    /// available now less that working memory.
    fn within_budget(
        &self,
        stage: &str,
        candidates: Vec<Candidate>,
        resident: u64,
        working: u64,
    ) -> Vec<(String, u64, Option<usize>)> {
        let mut budget_left = match self.background.budget() {
            Some(budget) => Some(budget.saturating_sub(resident).saturating_sub(working)),
            // The resident weights are already out of what the machine has available.
            None if working > 0 => {
                stageload_probe::system_memory().ok().map(|m| m.budget_available().saturating_sub(working))
            }
            None => None,
        };
        let mut started = Vec::new();
        for (name, known, files, cuda) in candidates {
            let bytes =
                known.unwrap_or_else(|| files.iter().filter_map(|f| std::fs::metadata(f).ok()).map(|m| m.len()).sum());
            if let Some(left) = budget_left.as_mut() {
                if bytes > *left {
                    tracing::debug!(
                        model = name.as_str(),
                        stage,
                        bytes,
                        left = *left,
                        "not prefetched: over the prefetch budget"
                    );
                    continue;
                }
                *left -= bytes;
            }
            started.push((name, bytes, cuda));
        }
        started
    }

    /// The thread of prefetch `id` of model `name`, on `trip`: it waits for its turn, lowers its
    /// priority, goes to a side stream of its CUDA device, and loads.
    fn spawn_prefetch(
        self: &Arc<Self>,
        name: &str,
        id: u64,
        trip: decide::Trip,
        cuda: Option<usize>,
    ) -> std::io::Result<std::thread::JoinHandle<()>> {
        let ended = Ended { inner: Arc::clone(self), id };
        let (inner, model) = (Arc::clone(self), name.to_string());
        std::thread::Builder::new().name(format!("prefetch {name}")).spawn(move || {
            let _ended = ended;
            // One prefetch loads at a time, in the order they were asked for; closed or
            // dropped before this one's turn came: nothing begun, nothing to do.
            if !inner.prefetch_turn(id) {
                return;
            }
            // The stage computing now goes first for the cores: this thread, and the readers
            // it starts (they inherit it), take what the stage leaves.
            if let Err(error) = stageload_torch_sys::set_thread_nice(BACKGROUND_NICE) {
                tracing::debug!(%error, "the prefetch thread keeps its priority");
            }
            // On CUDA the copies go on a side stream of the model's device (device 0 when
            // neither the file nor an earlier load says which), beside the foreground's kernels.
            let _side = (stageload_torch_sys::cuda_device_count().unwrap_or(0) > 0)
                .then(|| stageload_torch_sys::cuda_side_stream(cuda.unwrap_or(0)).ok())
                .flatten();
            // A failure is told in an `error` event; the `get` that needs the model tries
            // the load again, and its caller gets the error if that fails too.
            let _ = inner.instance_for(&model, Purpose::Prefetch(trip));
        })
    }

    /// Waits until prefetch `id` is the earliest not ended: prefetches load one at a time, in
    /// the order they were asked for, so that the model needed first is in first (on shared
    /// cores or a shared bus two loads at once finish no sooner together, and each later).
    /// `false` once the registry is closed or dropped.
    fn prefetch_turn(&self, id: u64) -> bool {
        let mut state = self.slots.lock();
        while !self.cancelled() && !state.prefetch_first(id) {
            state = self.slots.wait(state);
        }
        !self.cancelled()
    }

    /// The models being prefetched now, in the order their prefetches started (a model named
    /// once however many prefetches of it run).
    pub(crate) fn prefetching(&self) -> Vec<String> {
        self.slots.lock().prefetching()
    }

    /// Waits until every prefetch started for `stage` has ended (see
    /// [`super::StagedModels::wait_prefetch`]).
    pub(crate) fn wait_prefetch(&self, stage: &str) -> Result<()> {
        let mut state = self.slots.lock();
        state.stage_models(stage)?;
        let _awaiting = self.turns.awaiting();
        while state.prefetching_for(stage) {
            state = self.slots.wait(state);
        }
        Ok(())
    }

    /// Makes prefetches give up (`close`, and dropping the registry): cancels the turns (those
    /// waiting for the build turn or paused between pieces), then wakes those waiting for a
    /// slot. Each check of the flag happens under the lock its waiter waits with, and the lock is
    /// taken here after the flag is set, so no wake-up is lost.
    pub(crate) fn cancel_prefetches(&self) {
        self.turns.cancel();
        drop(self.slots.lock());
        self.slots.notify();
    }

    /// The stage after the one entered last, in the plan's sequence.
    pub(crate) fn next_stage(&self) -> Option<String> {
        self.slots.lock().next_stage().map(str::to_string)
    }
}

/// Takes a prefetch off the list when its thread ends (a panic included) and wakes those
/// waiting for it.
struct Ended {
    inner: Arc<Inner>,
    id: u64,
}

impl Drop for Ended {
    fn drop(&mut self) {
        let mut state = self.inner.slots.lock();
        state.end_prefetch(self.id);
        drop(state);
        self.inner.slots.notify();
    }
}

/// The bytes of the released instance a load of `entry` would bring back, if it has one.
fn instance_bytes(entry: &Entry) -> Option<u64> {
    Some(entry.released()?.storage_sizes.iter().map(|(_, bytes)| bytes).sum())
}

/// The CUDA device a model lives on: the pipeline file's, else that of its released weights.
fn cuda_device(entry: &Entry) -> Option<usize> {
    let device = entry.placement.device.or_else(|| {
        let weights = lock(&entry.released()?.weights);
        weights.tensors.first().map(|(_, t)| t.device())
    })?;
    match device {
        Device::Cuda(index) => Some(index),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::staged::decide::SlotState;
    use crate::staged::instance::Instance;
    use crate::staged::placement::Placement;
    use crate::staged::spec::{Built, Init};
    use crate::NameRules;
    use tch::{Kind, Tensor};

    fn entry(placement: Placement, state: SlotState<Arc<Instance>>) -> Entry {
        Entry::new("m".into(), None, Vec::new(), NameRules::default(), placement, None, Init::Loader).in_state(state)
    }

    #[test]
    fn a_prefetch_copies_on_the_side_stream_of_the_models_own_cuda_device() {
        let on = |device| Placement { device: Some(device), kind: None };
        assert_eq!(cuda_device(&entry(on(Device::Cuda(2)), SlotState::Unloaded)), Some(2), "the file's device");
        assert_eq!(cuda_device(&entry(on(Device::Cpu), SlotState::Unloaded)), None);
        assert_eq!(cuda_device(&entry(Placement::default(), SlotState::Unloaded)), None, "not known yet");
        // Without a file, a released model's own weights say where it lives (the CPU here).
        let weights = Tensor::zeros([2], (Kind::Float, Device::Cpu));
        let built = Built::from_tensors((), vec![("w".to_string(), weights)]);
        let instance = Instance::new("m", built, &[], std::sync::Weak::<Inner>::new(), None).unwrap();
        let released = SlotState::Released { instance, stage: None, pending: false };
        assert_eq!(cuda_device(&entry(Placement::default(), released)), None);
    }
}
