//! The registry: slots by name, the state behind one lock, stage entry, `insert`, `remove` and
//! `close`, carried out as [`super::decide`] says. Loads are [`super::load`]'s, releases
//! [`super::release`]'s, background loads [`super::prefetch`]'s.
//!
//! Locking. The state lock (`Inner::state`) guards the slots, stages, pins and the host tier's
//! bookkeeping (its copies run with the lock let go, see [`super::tier_store`]); it is held for
//! bookkeeping only, never while a model is built, read from disk, freed, or in use, and never
//! while waiting for another thread: a `get` of a model another thread is loading waits on the
//! `changed` condition variable, which gives the lock up while it waits. A release takes the
//! model's own lock with `try_lock`; when a user holds the model (this thread or another), the
//! release is left to that user's guard, which frees the weights when it drops, so `enter` never
//! blocks and the rest of the registry stays usable. Lock order: an instance's `body` → the
//! state lock → an instance's `ctl` / `weights`; `build_lock` (builds are serialised because the
//! RNG state they preserve is process-wide) is taken with no other lock held.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use super::decide::{self, ModelState, SlotState};
use super::error::{Result, StageError};
use super::instance::{Handle, Instance, ReleaseMark};
use super::placement::Placement;
use super::spec::{Built, Loader, SharedComponents};
use super::tier_copy::{self, HostCopies};
use crate::checkpoint::Progress;
use crate::names::NameRules;
use crate::rng::RngSnapshot;
use crate::storage::ReleaseStats;
use crate::stream::StreamPlan;
use crate::sync::lock;
use stageload_plan::tier::Tier;
use stageload_trace::event::{Event, EventKind, EventSink, LoadReport, TierUsage};

/// Told how far a checkpoint load has come: the model and bytes done of the total.
pub(crate) type ProgressHook = dyn Fn(&str, Progress) + Send + Sync;

/// One model's slot and what it needs to (re)load.
pub(crate) struct Entry {
    pub(crate) name: String,
    pub(crate) loader: Option<Arc<Loader>>,
    pub(crate) checkpoint: Vec<PathBuf>,
    pub(crate) names: NameRules,
    pub(crate) placement: Placement,
    /// How the pipeline file streams the model (it then has no checkpoint).
    pub(crate) stream: Option<Arc<StreamPlan>>,
    pub(crate) skip_init: bool,
    pub(crate) slot: decide::Slot<Arc<Instance>>,
    pub(crate) report: Option<LoadReport>,
}

pub(crate) struct State {
    pub(crate) entries: Vec<Entry>,
    pub(crate) index: HashMap<String, usize>,
    /// Each stage name's models, as its first occurrence lists them.
    pub(crate) stages: BTreeMap<String, BTreeSet<String>>,
    /// The stages in the order the run enters them (a name may come back), each occurrence with
    /// its own models.
    pub(crate) sequence: Vec<(String, BTreeSet<String>)>,
    /// Pins for the whole run (the builder's and `pin`'s).
    pub(crate) pinned: BTreeSet<String>,
    /// Pins over a span of the sequence: (model, from, until).
    pub(crate) spans: Vec<(String, usize, Option<usize>)>,
    pub(crate) current: Option<String>,
    /// The occurrence of the sequence entered last.
    pub(crate) position: Option<usize>,
    pub(crate) closed: bool,
    pub(crate) next_ticket: u64,
    /// Host copies of released device models (`None`: no host tier).
    pub(crate) tier: Option<Tier<HostCopies>>,
}

impl State {
    pub(super) fn position(&self, name: &str) -> Result<usize> {
        self.index.get(name).copied().ok_or_else(|| StageError::UnknownModel {
            name: name.to_string(),
            known: self.entries.iter().map(|e| e.name.clone()).collect(),
        })
    }

    pub(super) fn entry_mut(&mut self, name: &str) -> Option<&mut Entry> {
        self.index.get(name).copied().map(|i| &mut self.entries[i])
    }

    pub(super) fn planned_here(&self, name: &str) -> bool {
        match (&self.current, self.position) {
            (None, _) => true,
            (Some(_), Some(index)) => self.pinned_at(index).contains(name) || self.sequence[index].1.contains(name),
            (Some(stage), None) => {
                self.pinned.contains(name) || self.stages.get(stage).is_some_and(|m| m.contains(name))
            }
        }
    }

    /// The models pinned now: at the occurrence entered last, else for the whole run.
    pub(super) fn pinned_now(&self) -> BTreeSet<String> {
        self.position.map_or_else(|| self.pinned.clone(), |index| self.pinned_at(index))
    }

    /// Whether the host tier has a finished copy of `name` that nobody is using.
    pub(super) fn in_tier(&self, name: &str) -> bool {
        self.tier.as_ref().is_some_and(|tier| tier.ready(name))
    }

    pub(super) fn tier_usage(&self) -> Option<TierUsage> {
        self.tier.as_ref().map(|tier| TierUsage { budget: tier.budget(), used: tier.used() })
    }

    /// The models pinned at occurrence `index`: the whole run's and the spans holding there.
    pub(super) fn pinned_at(&self, index: usize) -> BTreeSet<String> {
        let spans = self.spans.iter().filter(|(_, from, until)| index >= *from && until.is_none_or(|u| index < u));
        self.pinned.iter().cloned().chain(spans.map(|(model, _, _)| model.clone())).collect()
    }

    /// The occurrence `stage` names when entered now: the next one after the current position,
    /// else (a run that starts over, or enters out of order) its first.
    pub(super) fn occurrence(&self, stage: &str) -> Option<usize> {
        let next = self.position.map_or(0, |p| p + 1);
        let after = self.sequence.iter().skip(next).position(|(s, _)| s == stage).map(|i| next + i);
        after.or_else(|| self.sequence.iter().position(|(s, _)| s == stage))
    }

    /// Instances whose storages are live (resident, or released with the release pending).
    pub(super) fn holding(&self) -> impl Iterator<Item = &Arc<Instance>> {
        self.entries.iter().filter_map(|e| decide::holds_storage(&e.slot.state))
    }

    /// Bytes of the instances holding storage, a storage two of them share counted once; a
    /// streamed model of the pipeline file counts what its split holds now (fixed tensors,
    /// resident prefix, slots, hot blocks: what the plan counts), which changes as it runs.
    pub(super) fn resident_bytes(&self) -> u64 {
        let mut seen = HashSet::new();
        let mut total = 0u64;
        for entry in &self.entries {
            let Some(instance) = decide::holds_storage(&entry.slot.state) else { continue };
            // 0 until the streamed model reports (a loader that built it some other way).
            let held = entry.stream.as_ref().map_or(0, |plan| plan.held.load(Ordering::Relaxed));
            let fresh = instance.storage_sizes.iter().filter(|(id, _)| seen.insert(*id));
            let own = fresh.fold(0u64, |sum, (_, bytes)| sum.saturating_add(*bytes));
            total = total.saturating_add(if held > 0 { held } else { own });
        }
        total
    }

    pub(super) fn remove_entry(&mut self, position: usize) -> Entry {
        let entry = self.entries.remove(position);
        self.pinned.remove(&entry.name);
        self.index = self.entries.iter().enumerate().map(|(i, e)| (e.name.clone(), i)).collect();
        entry
    }

    /// Marks `instance` for release at the current stage; the caller carries the release out
    /// with the state lock dropped.
    pub(super) fn request_release(&mut self, position: usize) -> Option<Arc<Instance>> {
        let stage = self.current.clone();
        let entry = &mut self.entries[position];
        let SlotState::Resident(instance) = &entry.slot.state else {
            return None;
        };
        let instance = Arc::clone(instance);
        lock(&instance.ctl).mark = ReleaseMark::Requested(stage.clone());
        entry.slot.state = SlotState::Released { stage, instance: Arc::clone(&instance), pending: true };
        Some(instance)
    }
}

/// The registry's shared inside; [`super::StagedModels`] is its face.
pub(crate) struct Inner {
    pub(crate) state: Mutex<State>,
    pub(crate) changed: Condvar,
    pub(crate) build_lock: Mutex<()>,
    pub(crate) components: SharedComponents,
    pub(crate) sink: Option<Arc<dyn EventSink>>,
    pub(crate) rngs: Vec<Arc<dyn RngSnapshot>>,
    pub(crate) preserve_rng: bool,
    pub(crate) strict: bool,
    pub(crate) progress: Option<Arc<ProgressHook>>,
    /// After each `enter`, prefetch the next stage of the plan.
    pub(crate) prefetch_next: bool,
    /// Prefetch only while the resident weights, the stage's working memory and the prefetched
    /// ones stay within this.
    pub(crate) prefetch_budget: Option<u64>,
    /// Working memory per stage (declared or measured), left free by a prefetch.
    pub(crate) stage_working: std::collections::BTreeMap<String, u64>,
    /// What a load that runs out of memory does.
    pub(crate) out_of_memory: decide::OutOfMemory,
    /// Background loads still running (joined when the registry is dropped).
    pub(crate) prefetching: Mutex<Vec<std::thread::JoinHandle<()>>>,
    /// The host tier said once that it does not hold CPU models.
    pub(crate) tier_said_cpu: std::sync::atomic::AtomicBool,
    /// Unit tests: the host tier holds CPU models too (no device here to test it with).
    #[cfg(test)]
    pub(crate) tier_on_cpu: bool,
}

impl Inner {
    pub(crate) fn state(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    pub(crate) fn emit(&self, event: Event) {
        if let Some(sink) = &self.sink {
            sink.emit(&event);
        }
    }

    /// Enters `stage` (see [`super::StagedModels::enter`]).
    pub(crate) fn enter(&self, stage: &str) -> Result<ReleaseStats> {
        let mut state = self.state();
        let Some(index) = state.occurrence(stage) else {
            return Err(StageError::UnknownStage {
                stage: stage.to_string(),
                known: state.stages.keys().cloned().collect(),
            });
        };
        let planned = state.sequence[index].1.clone();
        let pinned = state.pinned_at(index);
        state.current = Some(stage.to_string());
        state.position = Some(index);
        let resident_names: Vec<&str> = state
            .entries
            .iter()
            .filter(|e| matches!(e.slot.state, SlotState::Resident(_)))
            .map(|e| e.name.as_str())
            .collect();
        let leaving = decide::leaving(resident_names, &planned, &pinned);
        let resident = state.resident_bytes();
        let positions: Vec<usize> = leaving.iter().filter_map(|n| state.index.get(n).copied()).collect();
        let instances: Vec<Arc<Instance>> = positions.into_iter().filter_map(|p| state.request_release(p)).collect();
        drop(state);
        self.emit(Event { stage: Some(stage.to_string()), resident: Some(resident), ..Event::now(EventKind::Stage) });
        Ok(self.release_all(instances))
    }

    /// Releases everything and refuses later loads (see [`super::StagedModels::close`]).
    pub(crate) fn close(&self) -> ReleaseStats {
        let mut state = self.state();
        let stage = state.current.clone();
        let resident = state.resident_bytes();
        let positions: Vec<usize> = (0..state.entries.len()).collect();
        let instances: Vec<Arc<Instance>> = positions.into_iter().filter_map(|p| state.request_release(p)).collect();
        state.current = None;
        state.closed = true;
        let copies = state.tier.as_mut().map(Tier::clear).unwrap_or_default();
        drop(state);
        tier_copy::drop_giving_back(copies);
        // A `close` mark first, so a trace does not read these releases as the tail of the last
        // stage's entry.
        self.emit(Event { stage, note: Some("close".into()), resident: Some(resident), ..Event::now(EventKind::Mark) });
        self.release_all(instances)
    }

    /// Registers a built model under `name`, replacing (and releasing) what was there.
    pub(crate) fn insert(self: &Arc<Self>, name: &str, built: Built) -> Result<()> {
        let instance = Instance::new(name, built, Arc::downgrade(self))?;
        let mut state = self.state();
        let stale = state.tier.as_mut().and_then(|tier| tier.forget(name));
        let old = match state.index.get(name).copied() {
            Some(position) => {
                let old = state.request_release(position);
                let entry = &mut state.entries[position];
                entry.slot = decide::Slot {
                    state: SlotState::Resident(instance),
                    has_loader: false,
                    has_checkpoint: false,
                    loads: 1,
                };
                entry.loader = None;
                entry.checkpoint.clear();
                entry.report = None;
                old
            }
            None => {
                let position = state.entries.len();
                state.index.insert(name.to_string(), position);
                state.entries.push(Entry {
                    name: name.to_string(),
                    loader: None,
                    checkpoint: Vec::new(),
                    names: NameRules::default(),
                    placement: Placement::default(),
                    stream: None,
                    skip_init: false,
                    slot: decide::Slot {
                        state: SlotState::Resident(instance),
                        has_loader: false,
                        has_checkpoint: false,
                        loads: 1,
                    },
                    report: None,
                });
                None
            }
        };
        self.changed.notify_all();
        drop(state);
        drop(stale);
        self.release_all(old.into_iter().collect());
        Ok(())
    }

    /// Waits until `name` is not loading; the state lock comes back held.
    fn settled(&self, name: &str) -> Result<(MutexGuard<'_, State>, usize)> {
        let mut state = self.state();
        loop {
            let position = state.position(name)?;
            if !matches!(state.entries[position].slot.state, SlotState::Loading { .. }) {
                return Ok((state, position));
            }
            state = crate::sync::wait(&self.changed, state);
        }
    }

    /// Forgets `name`; releases it first when `release`.
    pub(crate) fn remove(&self, name: &str, release: bool) -> Result<()> {
        let (mut state, position) = self.settled(name)?;
        let old = if release { state.request_release(position) } else { None };
        state.remove_entry(position);
        let stale = state.tier.as_mut().and_then(|tier| tier.forget(name));
        self.changed.notify_all();
        drop(state);
        drop(stale);
        self.release_all(old.into_iter().collect());
        Ok(())
    }

    pub(crate) fn states(&self) -> Vec<(String, ModelState)> {
        self.state().entries.iter().map(|e| (e.name.clone(), decide::model_state(&e.slot.state))).collect()
    }

    pub(crate) fn load_report(&self, name: &str) -> Result<Option<LoadReport>> {
        let state = self.state();
        let position = state.position(name)?;
        Ok(state.entries[position].report.clone())
    }

    pub(crate) fn resident_bytes(&self) -> u64 {
        self.state().resident_bytes()
    }

    pub(crate) fn handle<M: 'static>(self: &Arc<Self>, name: &str) -> Result<Handle<M>> {
        self.instance(name)?.handle::<M>()
    }
}

/// The instance a released (or failed) slot keeps for a refill in place.
pub(super) fn released(entry: &Entry) -> Option<&Arc<Instance>> {
    match &entry.slot.state {
        SlotState::Released { instance, .. } => Some(instance),
        SlotState::Failed { instance, .. } => instance.as_ref(),
        _ => None,
    }
}
