//! The registry: slots by name, the state behind one lock, stage entry, `insert`, `remove` and
//! `close`, carried out as [`super::decide`] says. Loads are [`super::load`]'s, releases
//! [`super::release`]'s, background loads [`super::prefetch`]'s.
//!
//! Locking. Every lock the registry takes, in the one order they nest (none is waited for while
//! a later one is held; a condition variable is waited on with no lock held but its own):
//!
//! 1. The build turn ([`super::turn`], `Inner::turns`): a flag under a lock of its own, held for
//!    a few statements. A foreground build holds it for its loader's run (the RNG state it
//!    preserves is process-wide); any build holds it from its first shared component to its end.
//!    A prefetch's loader runs without it, and its checkpoint copy pauses between pieces while a
//!    foreground load runs (not on its way to CUDA: it holds the process's pinned ring there,
//!    which the foreground load would wait for), so a foreground load does not queue behind a
//!    background one, with one exception: a background build that took a shared component holds
//!    the turn to its end, its copy included, so that no other build sees the component half
//!    filled, and a foreground build waits for it. Waits for the turn or at a paused piece are on
//!    the turns' own condition variable with no other lock held but the paused model's own
//!    (its body and weights, which nobody else uses while it loads), so that a prefetch gives up
//!    when the registry closes or drops. A loader must not ask
//!    its own registry for a model that needs loading (it would wait for the turn it holds, or
//!    for a prefetched copy paused behind its own load): a model a loader needs is built in that
//!    loader, or shared through [`super::BuildContext::shared`].
//! 2. An instance's `body` (the model itself): held by a user's guard for as long as it lives,
//!    and by a refill or a release while they reallocate or free its storages. The registry
//!    never waits for it while holding another lock: a release tries it (`try_lock`, under the
//!    state lock) and, when a user holds the model (this thread or another), leaves the release
//!    to that user's guard, which frees the weights when it drops; so `enter` never blocks and
//!    the rest of the registry stays usable.
//! 3. The shared components (`Inner::components`, [`super::BuildContext::shared`]): held across
//!    a component's build, inside a model's build turn, with nothing else of the registry held.
//! 4. The state lock (`Inner::state`): the slots, stages, pins and the host tier's bookkeeping
//!    (its copies run with the lock let go, see [`super::tier_store`]). Held for bookkeeping
//!    only, never while a model is built, read from disk, freed, or in use; a `get` of a model
//!    another thread is loading waits on the `changed` condition variable, which gives the lock
//!    up while it waits. The decisions of [`super::decide`] are made under it, a release's
//!    claim too ([`decide::ReleaseMark::claim`]), so a revival and a release never both win.
//! 5. Leaves, held for a few statements with nothing taken under them but 6: an instance's
//!    `ctl` (its release mark and holder) and `weights` (its tensors and storages), the
//!    prefetch threads' list (`Inner::prefetching`), the snapshot list, a generator of
//!    [`crate::rng`] (its state saved and restored around a build).
//! 6. The storages being filled and borrowed ([`super::fills`]), with nothing taken under it:
//!    a refill takes it under its own model's body and weights locks, reallocating freed
//!    storages under it (so refills' allocations are made one at a time); a release frees its
//!    storages under it; a load drops its borrow under the state lock once installed. A refill
//!    waits on its condition variable holding only its own model's body and weights, once its
//!    own fill has ended.
//!
//! Cost. What a call costs does not grow with the number of models: the slots holding storage
//! are indexed (`State::holding`, kept by `State::set_state`, the one way a slot's state
//! changes), so `enter`, a load's resident total and a release's shared-storage check walk the
//! models resident, not every slot; a stage's occurrences and the pin spans are looked up by
//! name. Listing calls (`states`, `names`) and `remove` (positions shift) walk every slot.
//! `enter` takes the state lock twice however many models it releases: once to decide, claim
//! the batch of releases and read the storages others keep live, and once to settle them after
//! the frees ([`super::release`]); a copy into the host tier or a snapshot before the frees
//! reads the kept storages again after it and adds its own bookkeeping.
//!
//! Identity. A name is never trusted across a let-go of the state lock; identities are. Whatever
//! is decided under the lock and finished after it names the instance or reservation it was
//! about, so that an `insert`, `remove` or `take` meanwhile (the name now another instance's, or
//! no one's) makes the late finish change nothing: a load installs only into the slot of its own
//! ticket (`decide::Slot::finish_load`), a prefetch is such a load; a release settles only the
//! slot still holding its instance (`Arc::ptr_eq` in `release`); the host tier's entries carry
//! the ticket `Tier::admit` handed out, and the copy's `fill` or `withdraw` and a reload's
//! `withdraw` or `unlease` name it (`tier_store`, `load`), so a copy of one instance never lands
//! in another's entry. A streamed model's residency report (its plan's `held`) comes only from
//! the instance that runs: a released streamed model is dropped, never run again.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use super::background::Background;
use super::caches::{self, Trim};
use super::decide::{self, ModelState, SlotState};
use super::error::{Result, StageError};
use super::fills::Fills;
use super::instance::{self, Handle, Instance};
use super::placement::Placement;
use super::snapshot::Snapshots;
use super::spec::{Builds, Built, Init, Loader};
use super::tier_copy::{HostCopies, TierSide};
use super::turn::Turns;
use crate::names::NameRules;
use crate::source::{FileStamp, FirstReads};
use crate::storage::ReleaseStats;
use crate::stream::StreamPlan;
use crate::sync::lock;
use stageload_plan::tier::Tier;
use stageload_trace::event::{Entered, Event, EventSink, LoadReport, MarkAction, Marked, TierUsage};

/// One model's slot and what it needs to (re)load.
pub(crate) struct Entry {
    pub(crate) name: String,
    pub(crate) loader: Option<Arc<Loader>>,
    pub(crate) checkpoint: Vec<PathBuf>,
    pub(crate) names: NameRules,
    pub(crate) placement: Placement,
    /// How the pipeline file streams the model (it then has no checkpoint).
    pub(crate) stream: Option<Arc<StreamPlan>>,
    pub(crate) init: Init,
    /// Its checkpoint is the registry's snapshot of it (see [`super::snapshot`]).
    pub(crate) from_snapshot: bool,
    /// The files its first load read, as that load found them: every later load compares.
    pub(crate) first_reads: Arc<FirstReads>,
    /// Private: its state changes only through [`State::set_state`], which keeps the index of
    /// the slots holding storage.
    slot: decide::Slot<Arc<Instance>>,
    pub(crate) report: Option<LoadReport>,
}

impl Entry {
    /// A model's entry, not loaded yet.
    pub(crate) fn new(
        name: String,
        loader: Option<Arc<Loader>>,
        checkpoint: Vec<PathBuf>,
        names: NameRules,
        placement: Placement,
        stream: Option<Arc<StreamPlan>>,
        init: Init,
    ) -> Self {
        let slot = decide::Slot {
            state: SlotState::Unloaded,
            has_loader: loader.is_some(),
            has_checkpoint: !checkpoint.is_empty(),
            loads: 0,
        };
        // A streamed model's set-up reads its files through its plan: the same record.
        let first_reads = stream.as_ref().map_or_else(Default::default, |plan| Arc::clone(&plan.first_reads));
        Entry {
            name,
            loader,
            checkpoint,
            names,
            placement,
            stream,
            init,
            from_snapshot: false,
            first_reads,
            slot,
            report: None,
        }
    }

    /// Its weights are in the snapshot at `path` now, the file as `stamp` says the write left
    /// it: later reloads refill it in place from there, under the file's own names.
    pub(crate) fn refill_from_snapshot(&mut self, path: PathBuf, stamp: FileStamp) {
        self.first_reads.record(&path, stamp);
        self.checkpoint = vec![path];
        self.names = NameRules::default();
        self.from_snapshot = true;
        self.slot.has_checkpoint = true;
    }

    /// The snapshot file its reloads read, if the registry wrote one for it.
    pub(crate) fn snapshot_file(&self) -> Option<PathBuf> {
        self.from_snapshot.then(|| self.checkpoint.first().cloned()).flatten()
    }

    /// Unit tests: the entry with its slot in `state` (it belongs to no registry's index).
    #[cfg(test)]
    pub(crate) fn in_state(mut self, state: SlotState<Arc<Instance>>) -> Self {
        self.slot.state = state;
        self
    }

    /// The slot, to read (see [`State::set_state`] to change its state).
    pub(crate) fn slot(&self) -> &decide::Slot<Arc<Instance>> {
        &self.slot
    }

    /// The instance a released (or failed) slot keeps for a refill in place.
    pub(crate) fn released(&self) -> Option<&Arc<Instance>> {
        self.slot.state.released_instance()
    }
}

/// Whether a slot in `state` keeps storage resident while released: its released instance has
/// storage no refill source holds ([`Instance::kept`]), and is not counted as holding storage.
fn keeps_storage(state: &SlotState<Arc<Instance>>) -> bool {
    state.holds_storage().is_none() && state.released_instance().is_some_and(|i| !i.kept.is_empty())
}

/// A background load started by `prefetch` and not ended yet.
struct Prefetching {
    id: u64,
    model: String,
    /// The stage it was started for.
    stage: String,
}

/// The registry's state, behind its one lock. Its fields are this file's: the other files read
/// and change it through the methods below.
pub(crate) struct State {
    /// Slots are added and removed by `State`'s own methods, which keep `index` and `holding` in
    /// step.
    entries: Vec<Entry>,
    index: HashMap<String, usize>,
    /// Positions of the slots holding storage (resident, or released with the release pending:
    /// [`SlotState::holds_storage`]), in definition order. Kept by [`State::set_state`].
    holding: BTreeSet<usize>,
    /// Positions of the released slots whose instance keeps storage resident through its
    /// releases (tensors no refill source holds: [`Instance::kept`]). Kept by
    /// [`State::set_state`].
    keeping: BTreeSet<usize>,
    /// Each stage name's models, as its first occurrence lists them.
    stages: BTreeMap<String, BTreeSet<String>>,
    /// The stages in the order the run enters them (a name may come back), each occurrence with
    /// its own models.
    sequence: Vec<(String, BTreeSet<String>)>,
    /// Each stage name's occurrences in `sequence`, ascending.
    occurrences: HashMap<String, Vec<usize>>,
    /// Pins for the whole run (the builder's and `pin`'s).
    pinned: BTreeSet<String>,
    /// Pins over a span of the sequence: (model, from, until).
    spans: Vec<(String, usize, Option<usize>)>,
    /// Each model's spans, as positions in `spans`.
    spans_of: HashMap<String, Vec<usize>>,
    current: Option<String>,
    /// The occurrence of the sequence entered last.
    position: Option<usize>,
    /// How many times a stage has been entered.
    entered: u64,
    closed: bool,
    next_ticket: u64,
    /// Host copies of released device models (`None`: no host tier).
    tier: Option<Tier<HostCopies>>,
    /// Prefetches started and not ended, in the order they started.
    prefetches: Vec<Prefetching>,
}

impl State {
    /// The state of a registry of `entries` (in definition order) and its plan.
    pub(crate) fn new(
        entries: Vec<Entry>,
        stages: BTreeMap<String, BTreeSet<String>>,
        sequence: Vec<(String, BTreeSet<String>)>,
        pinned: BTreeSet<String>,
        spans: Vec<(String, usize, Option<usize>)>,
        tier: Option<Tier<HostCopies>>,
    ) -> Self {
        let mut occurrences: HashMap<String, Vec<usize>> = HashMap::new();
        for (i, (stage, _)) in sequence.iter().enumerate() {
            occurrences.entry(stage.clone()).or_default().push(i);
        }
        let mut spans_of: HashMap<String, Vec<usize>> = HashMap::new();
        for (i, (model, _, _)) in spans.iter().enumerate() {
            spans_of.entry(model.clone()).or_default().push(i);
        }
        let mut state = State {
            entries,
            index: HashMap::new(),
            holding: BTreeSet::new(),
            keeping: BTreeSet::new(),
            stages,
            sequence,
            occurrences,
            pinned,
            spans,
            spans_of,
            current: None,
            position: None,
            entered: 0,
            closed: false,
            next_ticket: 0,
            tier,
            prefetches: Vec::new(),
        };
        state.reindex();
        state
    }

    /// Every entry, in definition order.
    /// The slot of model `name`, if it has one.
    pub(super) fn find(&self, name: &str) -> Option<usize> {
        self.index.get(name).copied()
    }

    /// Whether `close` ran.
    pub(super) fn is_closed(&self) -> bool {
        self.closed
    }

    /// The stage entered last.
    pub(super) fn current(&self) -> Option<&str> {
        self.current.as_deref()
    }

    /// A ticket of its own for a load or a prefetch.
    pub(super) fn take_ticket(&mut self) -> u64 {
        self.next_ticket += 1;
        self.next_ticket
    }

    /// The host tier, if there is one.
    pub(super) fn tier(&self) -> Option<&Tier<HostCopies>> {
        self.tier.as_ref()
    }

    pub(super) fn tier_mut(&mut self) -> Option<&mut Tier<HostCopies>> {
        self.tier.as_mut()
    }

    /// The host tier, made with a budget of `bytes` if there was none.
    pub(super) fn tier_or_new(&mut self, bytes: u64) -> &mut Tier<HostCopies> {
        self.tier.get_or_insert_with(|| Tier::new(bytes))
    }

    /// The models stage `stage` lists (its first occurrence), or the error naming the stages.
    pub(super) fn stage_models(&self, stage: &str) -> Result<&BTreeSet<String>> {
        self.stages.get(stage).ok_or_else(|| self.unknown_stage(stage))
    }

    /// The error for a stage the plan does not have, naming the ones it has.
    pub(super) fn unknown_stage(&self, stage: &str) -> StageError {
        StageError::UnknownStage { stage: stage.to_string(), known: self.stages.keys().cloned().collect() }
    }

    /// The models occurrence `index` of the sequence lists.
    pub(super) fn planned_at(&self, index: usize) -> &BTreeSet<String> {
        &self.sequence[index].1
    }

    /// A trip from the occurrence entered last to occurrence `target`, as it stands now.
    pub(super) fn trip_to(&self, target: usize) -> decide::Trip {
        decide::Trip { from: self.position, target, entered: self.entered }
    }

    /// The stage after the one entered last, in the sequence.
    pub(super) fn next_stage(&self) -> Option<&str> {
        let position = self.position?;
        self.sequence.get(position + 1).map(|(name, _)| name.as_str())
    }

    /// Notes a prefetch of `model` for `stage`; its id.
    pub(super) fn start_prefetch(&mut self, model: &str, stage: &str) -> u64 {
        let id = self.take_ticket();
        self.prefetches.push(Prefetching { id, model: model.to_string(), stage: stage.to_string() });
        id
    }

    /// The prefetch `id` ended.
    pub(super) fn end_prefetch(&mut self, id: u64) {
        self.prefetches.retain(|p| p.id != id);
    }

    /// The models being prefetched, in the order their prefetches started, each once.
    pub(super) fn prefetching(&self) -> Vec<String> {
        let mut models: Vec<String> = Vec::new();
        for prefetch in &self.prefetches {
            if !models.contains(&prefetch.model) {
                models.push(prefetch.model.clone());
            }
        }
        models
    }

    /// Whether prefetch `id` is the earliest not ended (its load's turn).
    pub(super) fn prefetch_first(&self, id: u64) -> bool {
        self.prefetches.first().is_some_and(|p| p.id == id)
    }

    /// Whether a prefetch for `stage` has not ended.
    pub(super) fn prefetching_for(&self, stage: &str) -> bool {
        self.prefetches.iter().any(|p| p.stage == stage)
    }

    /// Pins `name` for the whole run (false: no such model) or ends its pin.
    pub(super) fn set_pin(&mut self, name: &str, pinned: bool) -> bool {
        if !self.index.contains_key(name) {
            return false;
        }
        if pinned {
            self.pinned.insert(name.to_string());
        } else {
            self.pinned.remove(name);
        }
        true
    }

    pub(crate) fn entries(&self) -> &[Entry] {
        &self.entries
    }

    /// One entry to change what it loads from (its slot changes only through
    /// [`State::set_state`]).
    pub(crate) fn entry_mut(&mut self, position: usize) -> &mut Entry {
        &mut self.entries[position]
    }

    /// Sets the state of the slot at `position`: the one way a slot's state changes, so that
    /// the index of slots holding storage stays true and the instance's release mark is the
    /// one the state gives it ([`SlotState::mark`]).
    pub(crate) fn set_state(&mut self, position: usize, state: SlotState<Arc<Instance>>) {
        if state.holds_storage().is_some() {
            self.holding.insert(position);
        } else {
            self.holding.remove(&position);
        }
        if keeps_storage(&state) {
            self.keeping.insert(position);
        } else {
            self.keeping.remove(&position);
        }
        if let Some((instance, mark)) = state.mark() {
            lock(&instance.ctl).mark = mark;
        }
        self.entries[position].slot.state = state;
    }

    /// Puts `slot` at `position` whole: its counts, and its state through [`Self::set_state`].
    fn set_slot(&mut self, position: usize, mut slot: decide::Slot<Arc<Instance>>) {
        let state = std::mem::replace(&mut slot.state, SlotState::Unloaded);
        self.entries[position].slot = slot;
        self.set_state(position, state);
    }

    /// Counts a completed load of the slot at `position`, with its checkpoint report.
    pub(crate) fn count_load(&mut self, position: usize, report: Option<LoadReport>) {
        let entry = &mut self.entries[position];
        entry.slot.loads += 1;
        entry.report = report;
    }

    /// Rebuilds `index` and `holding` from the entries (positions changed).
    fn reindex(&mut self) {
        self.index = self.entries.iter().enumerate().map(|(i, e)| (e.name.clone(), i)).collect();
        self.holding = self
            .entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.slot.state.holds_storage().is_some())
            .map(|(i, _)| i)
            .collect();
        self.keeping =
            self.entries.iter().enumerate().filter(|(_, e)| keeps_storage(&e.slot.state)).map(|(i, _)| i).collect();
    }

    /// Positions of the resident slots (not those with a release pending), in definition order.
    pub(crate) fn resident_positions(&self) -> Vec<usize> {
        let resident = |p: &&usize| matches!(self.entries[**p].slot.state, SlotState::Resident(_));
        self.holding.iter().filter(resident).copied().collect()
    }

    /// The model state of `name`.
    pub(crate) fn model_state(&self, name: &str) -> Result<ModelState> {
        let position = self.position(name)?;
        Ok(self.entries[position].slot.state.model_state())
    }

    pub(super) fn position(&self, name: &str) -> Result<usize> {
        self.index.get(name).copied().ok_or_else(|| StageError::UnknownModel {
            name: name.to_string(),
            known: self.entries.iter().map(|e| e.name.clone()).collect(),
        })
    }

    pub(super) fn planned_here(&self, name: &str) -> bool {
        match (&self.current, self.position) {
            (None, _) => true,
            (Some(_), Some(index)) => self.is_pinned_at(name, index) || self.sequence[index].1.contains(name),
            (Some(stage), None) => {
                self.pinned.contains(name) || self.stages.get(stage).is_some_and(|m| m.contains(name))
            }
        }
    }

    /// Whether a prefetch of `name` on `trip` has been overtaken by the stages entered since
    /// ([`decide::prefetch_overtaken`]).
    pub(super) fn overtaken(&self, name: &str, trip: decide::Trip) -> bool {
        decide::prefetch_overtaken(trip, self.position, self.entered, self.planned_here(name))
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
        let spans = self.spans.iter().filter(|(_, from, until)| covers(*from, *until, index));
        self.pinned.iter().cloned().chain(spans.map(|(model, _, _)| model.clone())).collect()
    }

    /// Whether `name` is pinned at occurrence `index` (for the whole run, or by a span holding
    /// there): its own pins only are looked at.
    pub(super) fn is_pinned_at(&self, name: &str, index: usize) -> bool {
        self.pinned.contains(name)
            || self.spans_of.get(name).is_some_and(|spans| {
                spans.iter().any(|&s| {
                    let (_, from, until) = self.spans[s];
                    covers(from, until, index)
                })
            })
    }

    /// The occurrence `stage` names when entered now: the next one after the current position,
    /// else (a run that starts over, or enters out of order) its first.
    pub(super) fn occurrence(&self, stage: &str) -> Option<usize> {
        let next = self.position.map_or(0, |p| p + 1);
        let occurrences = self.occurrences.get(stage)?;
        let after = occurrences.partition_point(|&i| i < next);
        occurrences.get(after).or_else(|| occurrences.first()).copied()
    }

    /// Instances whose storages are live (resident, or released with the release pending).
    pub(super) fn holding(&self) -> impl Iterator<Item = &Arc<Instance>> + '_ {
        self.holding.iter().filter_map(|&p| self.entries[p].slot.state.holds_storage())
    }

    /// For each model of `batch` (freed in that order), the identities of its storages that
    /// stay: those other models keep live (the instances holding storage outside the batch, the
    /// batch's models after it, which still hold theirs), and those released instances keep
    /// resident (the batch's so far, its own included: tensors nothing refills). Walks each
    /// storage a few times, however large the batch.
    pub(super) fn kept_in_batch(&self, batch: &[&Arc<Instance>]) -> Vec<HashSet<u64>> {
        let in_batch: HashSet<*const Instance> = batch.iter().map(|b| Arc::as_ptr(b)).collect();
        let outside = self.holding().filter(|i| !in_batch.contains(&Arc::as_ptr(i)));
        let mut live: HashSet<u64> = outside.flat_map(|i| i.storage_ids()).collect();
        live.extend(self.kept_by_released().flat_map(|i| i.kept.iter().map(|(id, _)| *id)));
        // How many of the batch's models not yet freed hold each storage.
        let mut holders: HashMap<u64, usize> = HashMap::new();
        for id in batch.iter().flat_map(|b| b.storage_ids()) {
            *holders.entry(id).or_default() += 1;
        }
        batch
            .iter()
            .map(|instance| {
                for id in instance.storage_ids() {
                    holders.entry(id).and_modify(|n| *n = n.saturating_sub(1));
                }
                live.extend(instance.kept.iter().map(|(id, _)| *id));
                instance
                    .storage_ids()
                    .filter(|id| live.contains(id) || holders.get(id).is_some_and(|n| *n > 0))
                    .collect()
            })
            .collect()
    }

    /// Released instances that keep storage resident ([`Instance::kept`]).
    fn kept_by_released(&self) -> impl Iterator<Item = &Arc<Instance>> + '_ {
        self.keeping.iter().filter_map(|&p| self.entries[p].slot.state.released_instance())
    }

    /// Bytes of the instances holding storage and of the storages released instances keep, a
    /// storage two of them share counted once; a streamed model of the pipeline file counts what
    /// its split holds now (fixed tensors, resident prefix, slots, hot blocks: what the plan
    /// counts), which changes as it runs.
    pub(super) fn resident_bytes(&self) -> u64 {
        let mut seen = HashSet::new();
        let mut total = 0u64;
        for &position in &self.holding {
            let entry = &self.entries[position];
            let Some(instance) = entry.slot.state.holds_storage() else { continue };
            // 0 until the streamed model reports (a loader that built it some other way).
            let held = entry.stream.as_ref().map_or(0, |plan| plan.held.load(Ordering::Relaxed));
            let fresh = instance.storage_sizes.iter().filter(|(id, _)| seen.insert(*id));
            let own = fresh.fold(0u64, |sum, (_, bytes)| sum.saturating_add(*bytes));
            total = total.saturating_add(if held > 0 { held } else { own });
        }
        for instance in self.kept_by_released() {
            let fresh = instance.kept.iter().filter(|(id, _)| seen.insert(*id));
            total = fresh.fold(total, |sum, (_, bytes)| sum.saturating_add(*bytes));
        }
        total
    }

    /// Forgets the slot at `position` and its pin; the positions after it shift down, so the
    /// indexes are rebuilt (the one call here that walks every slot).
    pub(super) fn remove_entry(&mut self, position: usize) -> Entry {
        let entry = self.entries.remove(position);
        self.pinned.remove(&entry.name);
        self.reindex();
        entry
    }

    /// Appends `entry` and returns its position.
    fn push_entry(&mut self, entry: Entry) -> usize {
        let position = self.entries.len();
        self.index.insert(entry.name.clone(), position);
        let state = entry.slot.state.clone();
        self.entries.push(entry);
        self.set_state(position, state);
        position
    }

    /// Requests the release of the resident model at `position` at the current stage
    /// ([`decide::Slot::request_release`]); the caller carries the release out with the state
    /// lock dropped.
    pub(super) fn request_release(&mut self, position: usize) -> Option<Arc<Instance>> {
        let (instance, released) = self.entries[position].slot.request_release(self.current.clone())?;
        self.set_state(position, released);
        Some(instance)
    }

    /// Registers `instance` as the model at `position` ([`decide::Slot::inserted`]): it keeps
    /// no loader, checkpoint or load report of what was there.
    fn install_inserted(&mut self, position: usize, instance: Arc<Instance>) {
        let entry = &mut self.entries[position];
        entry.loader = None;
        entry.checkpoint.clear();
        entry.from_snapshot = false;
        entry.first_reads = Default::default();
        entry.report = None;
        self.set_slot(position, decide::Slot::inserted(instance));
    }
}

/// Whether a span from occurrence `from` until `until` (exclusive; `None`: to the end) holds at
/// occurrence `index`.
fn covers(from: usize, until: Option<usize>, index: usize) -> bool {
    index >= from && until.is_none_or(|u| index < u)
}

/// The registry's shared inside; [`super::StagedModels`] is its face. The state and its
/// condition variable, and the event sink, are this file's; every other part is an owner with
/// state of its own, private to its file: the build turn ([`super::turn`]), what builds go by
/// ([`super::load`]), prefetching ([`super::prefetch`]), the host tier's side
/// ([`super::tier_store`]), the snapshot folder ([`super::snapshot`]) and the heap's trim
/// ([`super::release`]).
pub(crate) struct Inner {
    state: Mutex<State>,
    changed: Condvar,
    sink: Option<Arc<dyn EventSink>>,
    /// The build turn, the foreground's loads before background ones, and the cancellation
    /// `close` and dropping the registry set.
    pub(super) turns: Arc<Turns>,
    pub(super) builds: Builds,
    pub(super) background: Background,
    pub(super) tier_side: TierSide,
    /// The snapshot folder's files, when the builder named one.
    pub(super) snapshots: Option<Snapshots>,
    pub(super) trim: Trim,
    /// The storages refills are filling now.
    pub(super) fills: Fills,
    /// Unit tests: how many times the state lock was taken.
    #[cfg(test)]
    pub(crate) state_locks: std::sync::atomic::AtomicU64,
}

impl Inner {
    pub(crate) fn new(
        state: State,
        sink: Option<Arc<dyn EventSink>>,
        builds: Builds,
        background: Background,
        tier_side: TierSide,
        snapshots: Option<Snapshots>,
    ) -> Self {
        Inner {
            state: Mutex::new(state),
            changed: Condvar::new(),
            sink,
            turns: Arc::default(),
            builds,
            background,
            tier_side,
            snapshots,
            trim: Trim::default(),
            fills: Fills::default(),
            #[cfg(test)]
            state_locks: Default::default(),
        }
    }

    /// Wakes whoever waits for a slot or a prefetch to change.
    pub(crate) fn notify_changed(&self) {
        self.changed.notify_all();
    }

    /// Waits for a slot or a prefetch to change, the state lock let go meanwhile.
    pub(crate) fn wait_changed<'a>(&'a self, state: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        crate::sync::wait(&self.changed, state)
    }

    pub(crate) fn state(&self) -> MutexGuard<'_, State> {
        #[cfg(test)]
        self.state_locks.fetch_add(1, Ordering::Relaxed);
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
            return Err(state.unknown_stage(stage));
        };
        let planned = state.sequence[index].1.clone();
        state.current = Some(stage.to_string());
        state.position = Some(index);
        state.entered += 1;
        let resident_names: Vec<&str> =
            state.resident_positions().into_iter().map(|p| state.entries[p].name.as_str()).collect();
        // The pins of the resident models only: what the decision looks at.
        let pinned: BTreeSet<String> =
            resident_names.iter().filter(|n| state.is_pinned_at(n, index)).map(|n| n.to_string()).collect();
        let leaving = decide::leaving(resident_names, &planned, &pinned);
        let resident = state.resident_bytes();
        let positions: Vec<usize> = leaving.iter().filter_map(|n| state.index.get(n).copied()).collect();
        let instances: Vec<Arc<Instance>> = positions.into_iter().filter_map(|p| state.request_release(p)).collect();
        let batch = self.claim_batch(&state, &instances);
        drop(state);
        // Before the event, so that the new stage's meter window starts without them.
        caches::flush_host_blocks();
        self.emit(Event::now(Entered { stage: stage.to_string(), position: Some(index), resident: Some(resident) }));
        Ok(self.release_batch(batch))
    }

    /// Releases everything and refuses later loads (see [`super::StagedModels::close`]).
    pub(crate) fn close(&self) -> ReleaseStats {
        let mut state = self.state();
        let stage = state.current.clone();
        let resident = state.resident_bytes();
        let positions = state.resident_positions();
        let instances: Vec<Arc<Instance>> = positions.into_iter().filter_map(|p| state.request_release(p)).collect();
        state.current = None;
        state.closed = true;
        let copies = state.tier.as_mut().map(Tier::clear).unwrap_or_default();
        drop(state);
        self.cancel_prefetches();
        // Their buffers go back to the machine as they drop.
        drop(copies);
        // A `close` mark first, so a trace does not read these releases as the tail of the last
        // stage's entry.
        self.emit(Event::now(Marked {
            stage,
            note: "close".to_string(),
            action: Some(MarkAction::Close),
            resident: Some(resident),
        }));
        let stats = self.release_all(instances);
        if let Some(snapshots) = &self.snapshots {
            snapshots.remove_all();
        }
        stats
    }

    /// Registers a built model under `name`, replacing (and releasing) what was there.
    pub(crate) fn insert(self: &Arc<Self>, name: &str, built: Built) -> Result<()> {
        let instance = Instance::new(name, built, &[], Arc::<Inner>::downgrade(self))?;
        let mut state = self.state();
        let stale = state.tier.as_mut().and_then(|tier| tier.forget(name));
        let snapshot = state.index.get(name).and_then(|&position| state.entries[position].snapshot_file());
        let (position, old) = match state.index.get(name).copied() {
            Some(position) => (position, state.request_release(position)),
            None => {
                let entry = Entry::new(
                    name.to_string(),
                    None,
                    Vec::new(),
                    NameRules::default(),
                    Placement::default(),
                    None,
                    Init::Loader,
                );
                (state.push_entry(entry), None)
            }
        };
        state.install_inserted(position, instance);
        self.notify_changed();
        drop(state);
        drop(stale);
        self.release_all(old.into_iter().collect());
        self.forget_snapshot(snapshot);
        Ok(())
    }

    /// Waits until `name` is not loading; the state lock comes back held.
    fn settled(&self, name: &str) -> Result<(MutexGuard<'_, State>, usize)> {
        let mut state = self.state();
        let _awaiting = self.turns.awaiting();
        loop {
            let position = state.position(name)?;
            if !matches!(state.entries[position].slot.state, SlotState::Loading { .. }) {
                return Ok((state, position));
            }
            state = self.wait_changed(state);
        }
    }

    /// Forgets `name`; releases it first when `release`.
    pub(crate) fn remove(&self, name: &str, release: bool) -> Result<()> {
        let (mut state, position) = self.settled(name)?;
        let old = if release { state.request_release(position) } else { None };
        let snapshot = state.remove_entry(position).snapshot_file();
        let stale = state.tier.as_mut().and_then(|tier| tier.forget(name));
        self.notify_changed();
        drop(state);
        drop(stale);
        self.release_all(old.into_iter().collect());
        self.forget_snapshot(snapshot);
        Ok(())
    }

    pub(crate) fn states(&self) -> Vec<(String, ModelState)> {
        self.state().entries.iter().map(|e| (e.name.clone(), e.slot.state.model_state())).collect()
    }

    /// Names of the resident models, in definition order.
    pub(crate) fn resident(&self) -> Vec<String> {
        let state = self.state();
        state.resident_positions().into_iter().map(|p| state.entries[p].name.clone()).collect()
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

impl instance::Registry for Inner {
    fn release_left_to_unlock(&self, instance: &Arc<Instance>) {
        self.release_all(vec![Arc::clone(instance)]);
    }
}
