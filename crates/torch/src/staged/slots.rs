//! The slot table: every model's slot, the stage plan and the host tier's bookkeeping, behind
//! one lock. One owner, [`Slots`], holds the lock and its condition variable; [`State`]'s fields
//! are private to this file, read and changed through its methods under that lock.
//!
//! The rules:
//!
//! 1. **Bookkeeping only under the lock.** It is held for a decision and what records it, never
//!    while a model is built, read from disk, freed or in use (see the lock order in
//!    [`super::registry`]); whoever waits for a slot to change waits on the condition variable
//!    ([`Slots::wait`]), which lets the lock go meanwhile, and every change that someone may wait
//!    for is followed by [`Slots::notify`].
//! 2. **A slot's state changes in one place**, [`State::set_state`]: it keeps the indexes of the
//!    slots holding and keeping storage, and sets the instance's release mark to the one the
//!    state gives it ([`super::decide::SlotState::mark`]).
//! 3. **A load is a transaction of two lock takings.** [`Slots::begin_load`] decides under the
//!    lock what a `get` or a prefetch does ([`super::decide::Slot::get`]): hand out the resident
//!    instance, revive one whose release is pending, wait for another thread's load, refuse, or
//!    begin a load. A load begun marks the slot loading under a ticket of its own, leases the
//!    host tier's copy for a refill from it, and takes from the entry what the load needs
//!    ([`Recipe`]): the [`Begun`] load runs with the lock let go ([`super::load`]).
//!    [`Slots::finish_load`] takes the lock once more: it gives the tier's lease up (withdrawn
//!    after a success, kept for the next try after a failure), installs the outcome into the slot
//!    only if the slot still loads under the same ticket (an `insert` or a `remove` meanwhile
//!    makes the load [`Landed::Overtaken`]: nothing of it is kept), drops the load's borrows of
//!    shared storages once installed ([`super::fills`]), counts the load, and marks for release
//!    a prefetch that ended after `close` or that the stages entered meanwhile overtook.
//! 4. **A load that gives up** before it began (a prefetch cancelled or stopped between pieces,
//!    [`Slots::give_up`]) puts the slot back as it was, again only under its own ticket.
//! 5. **Identities, not names,** carry a decision across a let-go of the lock: the load's ticket,
//!    the tier lease's ticket, the released instance (`Arc::ptr_eq`).
//!
//! What it costs: the slots holding storage are indexed, so a stage entry, a load's resident
//! total and a release's shared-storage check walk the models resident, not every slot (see
//! [`super::registry`]). A `get` of a resident model takes the lock once; a load twice.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use super::decide::{self, Finish, GetAction, GetContext, ModelState, Refusal, ReleaseMark, SlotState};
use super::error::{Result, StageError};
use super::fills::Borrow;
use super::instance::Instance;
use super::placement::Placement;
use super::spec::{Init, Loader, Reload};
use super::tier_copy::HostCopies;
use super::turn::Turns;
use crate::names::NameRules;
use crate::source::{FileStamp, FirstReads};
use crate::stream::StreamPlan;
use crate::sync::lock;
use stageload_plan::tier::{Ticket, Tier};
use stageload_trace::event::{LoadReport, TierUsage};

/// The slot table's owner: the state and the condition variable its waiters wait on.
pub(crate) struct Slots {
    state: Mutex<State>,
    changed: Condvar,
    /// Unit tests: how many times the lock was taken.
    #[cfg(test)]
    locks: std::sync::atomic::AtomicU64,
}

impl Slots {
    pub(crate) fn new(state: State) -> Self {
        Slots {
            state: Mutex::new(state),
            changed: Condvar::new(),
            #[cfg(test)]
            locks: Default::default(),
        }
    }

    /// The state, for bookkeeping (rule 1).
    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        #[cfg(test)]
        self.locks.fetch_add(1, Ordering::Relaxed);
        lock(&self.state)
    }

    /// Waits for a slot or a prefetch to change, the lock let go meanwhile.
    pub(crate) fn wait<'a>(&'a self, state: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        crate::sync::wait(&self.changed, state)
    }

    /// Wakes whoever waits for a slot or a prefetch to change.
    pub(crate) fn notify(&self) {
        self.changed.notify_all();
    }

    /// Unit tests: how many times the lock was taken so far.
    #[cfg(test)]
    pub(crate) fn locks(&self) -> u64 {
        self.locks.load(Ordering::Relaxed)
    }

    /// Decides what a `get` (or a prefetch) of `name` does, waiting while another thread loads
    /// the model (rule 3): the instance to hand out, or a load begun. A foreground wait counts as
    /// awaiting in `turns` (a prefetch's paced copy goes at full speed meanwhile); a prefetch
    /// cancelled or overtaken begins nothing ([`StageError::Closed`]).
    pub(crate) fn begin_load(&self, name: &str, purpose: Purpose, turns: &Turns, strict: bool) -> Result<Begin> {
        let mut state = self.lock();
        loop {
            match state.decide_load(name, purpose, turns.cancelled(), strict)? {
                Next::Use(instance) => return Ok(Begin::Use(instance)),
                Next::Revived(instance) => {
                    self.notify();
                    return Ok(Begin::Use(instance));
                }
                Next::Wait => {
                    let _awaiting = (!purpose.is_prefetch()).then(|| turns.awaiting());
                    state = self.wait(state);
                }
                Next::Start(position, plan) => {
                    return Ok(Begin::Load(Box::new(state.start_load(position, plan, purpose))))
                }
            }
        }
    }

    /// A load that gave up before it began goes back as it was (rule 4); wakes whoever waits
    /// for it.
    pub(crate) fn give_up(&self, begun: Begun) {
        let mut state = self.lock();
        if let Some(position) = state.find(&begun.name) {
            if let Some(back) = state.entries[position].slot.give_up(begun.ticket, begun.before) {
                state.set_state(position, back);
            }
        }
        self.notify();
    }

    /// Ends a load that ran (rule 3), with what it brought in or its error. What the caller
    /// carries out and tells with the lock let go comes back.
    pub(crate) fn finish_load(&self, begun: &Begun, ran: Result<Ran<'_>>) -> Finished {
        let mut state = self.lock();
        let restored = state.end_lease(begun, ran.is_ok());
        let tier = if begun.plan.refills_from_tier() { state.tier_usage() } else { None };
        let position = state.find(&begun.name);
        let outcome = ran.as_ref().ok().map(|ran| Arc::clone(&ran.instance));
        let finish = position.map_or(Finish::Discard, |p| state.entries[p].slot.finish_load(begun.ticket, outcome));
        self.notify();
        let (Some(position), Finish::Install(installed)) = (position, finish) else {
            drop(state);
            return Finished { landed: Landed::Overtaken(ran.map(drop)), restored };
        };
        state.set_state(position, installed);
        let landed = match ran {
            Ok(Ran { instance, bytes, report, borrows }) => {
                // Installed: the model holds what it relied on, as any resident model does.
                drop(borrows);
                state.count_load(position, report.clone());
                let give_back = state.give_back_prefetch(position, begun.purpose);
                let resident = state.resident_bytes();
                Landed::Loaded(Installed { instance, bytes, report, resident, tier, give_back })
            }
            Err(err) => Landed::Failed(err),
        };
        Finished { landed, restored }
    }
}

/// What a load that ran brought in.
pub(crate) struct Ran<'a> {
    pub(crate) instance: Arc<Instance>,
    /// The bytes it brought in.
    pub(crate) bytes: u64,
    /// How it met the checkpoint.
    pub(crate) report: Option<LoadReport>,
    /// The storages the model relies on without having filled them, borrowed until it is
    /// installed ([`super::fills`]).
    pub(crate) borrows: Vec<Borrow<'a>>,
}

/// Why a load runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Purpose {
    /// A `get` (or `load`) of the current stage.
    Use,
    /// A background load for a stage about to begin, on its way there.
    Prefetch(decide::Trip),
}

impl Purpose {
    pub(crate) fn is_prefetch(self) -> bool {
        matches!(self, Purpose::Prefetch(_))
    }
}

/// What [`Slots::begin_load`] decided.
pub(crate) enum Begin {
    /// Hand out this instance (resident, or revived).
    Use(Arc<Instance>),
    /// A load begun: run it, then [`Slots::finish_load`] (or [`Slots::give_up`]).
    Load(Box<Begun>),
}

/// What one turn of [`State::decide_load`] found.
enum Next {
    Use(Arc<Instance>),
    /// Taken back from a pending release.
    Revived(Arc<Instance>),
    Wait,
    Start(usize, Plan),
}

/// How a load begun brings the model in.
pub(crate) enum Plan {
    /// Runs the loader (`reload`: it was built before).
    Build { reload: bool, loader: Arc<Loader> },
    /// In place, from the host tier's copies (leased: with the entry's ticket) or else the
    /// checkpoint.
    Refill(Arc<Instance>, Option<(Ticket, HostCopies)>),
}

impl Plan {
    /// Whether it refills from the host tier's copies.
    pub(crate) fn refills_from_tier(&self) -> bool {
        matches!(self, Plan::Refill(_, Some(_)))
    }
}

/// What a load of one model needs besides its loader, taken from its entry under the lock.
pub(crate) struct Recipe {
    pub(crate) checkpoint: Vec<PathBuf>,
    pub(crate) names: NameRules,
    pub(crate) init: Init,
    pub(crate) reload: Reload,
    pub(crate) from_snapshot: bool,
    pub(crate) placement: Placement,
    pub(crate) stream: Option<Arc<StreamPlan>>,
    pub(crate) first_reads: Arc<FirstReads>,
}

impl Recipe {
    fn of(entry: &Entry) -> Self {
        Recipe {
            checkpoint: entry.checkpoint.clone(),
            names: entry.names.clone(),
            init: entry.init,
            reload: entry.reload,
            from_snapshot: entry.from_snapshot,
            placement: entry.placement,
            stream: entry.stream.clone(),
            first_reads: Arc::clone(&entry.first_reads),
        }
    }
}

/// A load begun under the lock, to run with the lock let go.
pub(crate) struct Begun {
    pub(crate) name: String,
    ticket: u64,
    /// The slot's state before, for a give-up.
    before: SlotState<Arc<Instance>>,
    pub(crate) plan: Plan,
    pub(crate) recipe: Recipe,
    pub(crate) purpose: Purpose,
    /// The stage entered when it began.
    pub(crate) stage: Option<String>,
    /// A `get` of a model the current stage does not plan.
    pub(crate) outside_stage: bool,
}

/// What [`Slots::finish_load`] did.
pub(crate) struct Finished {
    pub(crate) landed: Landed,
    /// The host tier's copy a reload from it gave up (the weights are on the device again): to
    /// drop with the lock let go.
    pub(crate) restored: Option<HostCopies>,
}

/// Where a finished load landed.
pub(crate) enum Landed {
    /// Installed and resident.
    Loaded(Installed),
    /// Installed as failed, with the load's error.
    Failed(StageError),
    /// An `insert` or a `remove` overtook it: nothing of it kept (`Ok`: it had loaded).
    Overtaken(Result<()>),
}

/// A load installed: what to hand out, tell and carry out.
pub(crate) struct Installed {
    pub(crate) instance: Arc<Instance>,
    pub(crate) bytes: u64,
    pub(crate) report: Option<LoadReport>,
    /// The resident bytes with it.
    pub(crate) resident: u64,
    /// The host tier after a reload from it.
    pub(crate) tier: Option<TierUsage>,
    /// A prefetch that ended after `close` or overtaken by the stages entered meanwhile: its
    /// release, requested, to carry out.
    pub(crate) give_back: Option<Arc<Instance>>,
}
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
    /// How it comes back from its checkpoint after a release ([`Reload`]).
    pub(crate) reload: Reload,
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
            reload: Reload::Copy,
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

/// The registry's state, behind the [`Slots`] lock. Its fields are this file's: the other files
/// read and change it through the methods below.
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

/// The load transaction's steps under the lock (rule 3), and the registry's stage entry,
/// `close`, `insert` and `remove` as the decisions and records they make under it.
impl State {
    /// One look at `name`'s slot for a load (see [`Slots::begin_load`]).
    fn decide_load(&mut self, name: &str, purpose: Purpose, cancelled: bool, strict: bool) -> Result<Next> {
        let position = self.position(name)?;
        if let Purpose::Prefetch(trip) = purpose {
            // Closed or dropped, or overtaken by the stages entered since it was asked for:
            // nothing begun (its thread drops this error; the slot is as it was).
            if cancelled || self.overtaken(name, trip) {
                return Err(StageError::Closed { model: name.to_string() });
            }
        }
        let planned_here = purpose.is_prefetch() || self.planned_here(name);
        let ctx = GetContext { closed: self.closed, strict, planned_here, in_tier: self.in_tier(name) };
        let entry = &self.entries[position];
        let plan = match entry.slot.get(ctx) {
            GetAction::Use(instance) => return Ok(Next::Use(instance)),
            GetAction::Wait => return Ok(Next::Wait),
            GetAction::Revive(instance) => return Ok(self.revive(position, instance)),
            GetAction::Refuse(refusal) => return Err(self.refused(name, refusal)),
            GetAction::Refill(instance) => {
                let leased = self.tier.as_mut().and_then(|tier| tier.lease(name));
                Plan::Refill(instance, leased.map(|(ticket, copies)| (ticket, HostCopies::shallow(copies))))
            }
            GetAction::Build { reload } => match &entry.loader {
                Some(loader) => Plan::Build { reload, loader: Arc::clone(loader) },
                None => return Err(StageError::NoLoader { model: name.to_string(), stage: None }),
            },
        };
        Ok(Next::Start(position, plan))
    }

    /// Takes back the model at `position`, whose release is pending, unless the release is
    /// freeing its storages right now: then wait for that to finish.
    fn revive(&mut self, position: usize, instance: Arc<Instance>) -> Next {
        // The release's claim takes the state lock too, so it cannot begin between this look at
        // the mark and the revival.
        let freeing = !matches!(instance.mark(), ReleaseMark::Requested(_));
        match self.entries[position].slot.revive(freeing) {
            Some(resident) => {
                self.set_state(position, resident);
                Next::Revived(instance)
            }
            None => Next::Wait,
        }
    }

    /// The error for a `get` of `name` refused.
    fn refused(&self, name: &str, refusal: Refusal) -> StageError {
        let model = name.to_string();
        match refusal {
            Refusal::Closed => StageError::Closed { model },
            Refusal::OutsideStage => {
                StageError::OutsideStage { model, stage: self.current().unwrap_or_default().to_string() }
            }
            Refusal::NoLoader { stage } => StageError::NoLoader { model, stage },
        }
    }

    /// Marks the slot at `position` loading under a ticket of its own, and takes what the load
    /// needs from its entry.
    fn start_load(&mut self, position: usize, plan: Plan, purpose: Purpose) -> Begun {
        let ticket = self.take_ticket();
        let entry = &self.entries[position];
        let name = entry.name.clone();
        let before = entry.slot.state.clone();
        let loading = entry.slot.start_load(ticket);
        let recipe = Recipe::of(entry);
        let outside_stage = !purpose.is_prefetch() && !self.planned_here(&name);
        let stage = self.current.clone();
        self.set_state(position, loading);
        Begun { name, ticket, before, plan, recipe, purpose, stage, outside_stage }
    }

    /// Ends a refill's lease of the host tier's copy: a reload that `loaded` gives its copy up
    /// (returned, to drop with the lock let go); a failed one leaves it for the next try. By the
    /// lease's ticket: an insert meanwhile replaced the entry with another instance's, which
    /// stays as it is.
    fn end_lease(&mut self, begun: &Begun, loaded: bool) -> Option<HostCopies> {
        let Plan::Refill(_, Some((ticket, _))) = &begun.plan else { return None };
        let tier = self.tier.as_mut()?;
        if loaded {
            tier.withdraw(&begun.name, *ticket)
        } else {
            tier.unlease(&begun.name, *ticket);
            None
        }
    }

    /// A prefetch installed at `position` that ended after `close` (nobody will ask for the
    /// model, and close promised its memory back) or overtaken by the stages entered meanwhile
    /// (the current stage's plan does not count it): its release, requested at once.
    fn give_back_prefetch(&mut self, position: usize, purpose: Purpose) -> Option<Arc<Instance>> {
        let overtaken = match purpose {
            Purpose::Prefetch(trip) => self.closed || self.overtaken(&self.entries[position].name, trip),
            Purpose::Use => false,
        };
        if overtaken {
            self.request_release(position)
        } else {
            None
        }
    }

    /// Enters `stage`: records it, and requests the release of every resident model it does not
    /// list and that is not pinned there. The occurrence entered, the resident bytes before, and
    /// the instances whose release was requested.
    pub(crate) fn enter(&mut self, stage: &str) -> Result<(usize, u64, Vec<Arc<Instance>>)> {
        let Some(index) = self.occurrence(stage) else {
            return Err(self.unknown_stage(stage));
        };
        self.current = Some(stage.to_string());
        self.position = Some(index);
        self.entered += 1;
        let resident_names: Vec<&str> =
            self.resident_positions().into_iter().map(|p| self.entries[p].name.as_str()).collect();
        // The pins of the resident models only: what the decision looks at.
        let pinned: BTreeSet<String> =
            resident_names.iter().filter(|n| self.is_pinned_at(n, index)).map(|n| n.to_string()).collect();
        let leaving = decide::leaving(resident_names, &self.sequence[index].1, &pinned);
        let resident = self.resident_bytes();
        let positions: Vec<usize> = leaving.iter().filter_map(|n| self.find(n)).collect();
        let instances = positions.into_iter().filter_map(|p| self.request_release(p)).collect();
        Ok((index, resident, instances))
    }

    /// Closes: requests the release of every resident model and refuses later loads. The stage
    /// it was at, the resident bytes, the instances whose release was requested, and the host
    /// tier's copies (to drop with the lock let go).
    pub(crate) fn close(&mut self) -> (Option<String>, u64, Vec<Arc<Instance>>, Vec<HostCopies>) {
        let stage = self.current.clone();
        let resident = self.resident_bytes();
        let positions = self.resident_positions();
        let instances = positions.into_iter().filter_map(|p| self.request_release(p)).collect();
        self.current = None;
        self.closed = true;
        let copies = self.tier.as_mut().map(Tier::clear).unwrap_or_default();
        (stage, resident, instances, copies)
    }

    /// Registers `instance` as the model `name`, in its slot (its release requested) or a new
    /// one: what was there, to let go of.
    pub(crate) fn insert(&mut self, name: &str, instance: Arc<Instance>) -> LetGo {
        let stale = self.tier.as_mut().and_then(|tier| tier.forget(name));
        let snapshot = self.find(name).and_then(|position| self.entries[position].snapshot_file());
        let (position, old) = match self.find(name) {
            Some(position) => (position, self.request_release(position)),
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
                (self.push_entry(entry), None)
            }
        };
        self.install_inserted(position, instance);
        LetGo { old, stale, snapshot }
    }

    /// Forgets the slot at `position` (its release requested first when `release`): what it
    /// held, to let go of.
    pub(crate) fn remove(&mut self, position: usize, release: bool) -> LetGo {
        let old = if release { self.request_release(position) } else { None };
        let entry = self.remove_entry(position);
        let stale = self.tier.as_mut().and_then(|tier| tier.forget(&entry.name));
        LetGo { old, stale, snapshot: entry.snapshot_file() }
    }

    /// Settles the releases of `instances`, their storages freed (or a free failed: what it
    /// could not free stays allocated, and the next `get` refills the rest): each slot still
    /// holding its instance is released, no longer pending. For each, whether it comes back in
    /// place, and the resident bytes after it.
    pub(crate) fn settle_releases(&mut self, instances: &[&Arc<Instance>]) -> Vec<(bool, u64)> {
        let settle = |state: &mut State, instance: &Arc<Instance>| {
            let in_tier = state.in_tier(&instance.name);
            let position = state.find(&instance.name)?;
            let done = state.entries[position].slot.finish_release(instance, in_tier)?;
            state.set_state(position, done.state);
            Some(done.comes_back)
        };
        instances.iter().map(|instance| (settle(self, instance).unwrap_or(true), self.resident_bytes())).collect()
    }

    /// Whether the slot at `position` is loading.
    pub(crate) fn is_loading(&self, position: usize) -> bool {
        matches!(self.entries[position].slot.state, SlotState::Loading { .. })
    }

    /// Every model with its state, in definition order.
    pub(crate) fn states(&self) -> Vec<(String, ModelState)> {
        self.entries.iter().map(|e| (e.name.clone(), e.slot.state.model_state())).collect()
    }

    /// Names of the resident models, in definition order.
    pub(crate) fn resident_names(&self) -> Vec<String> {
        self.resident_positions().into_iter().map(|p| self.entries[p].name.clone()).collect()
    }

    /// How the last load of `name` met its checkpoint.
    pub(crate) fn load_report(&self, name: &str) -> Result<Option<LoadReport>> {
        Ok(self.entries[self.position(name)?].report.clone())
    }
}

/// What an `insert` or a `remove` took out of the table, to let go of with the lock let go.
pub(crate) struct LetGo {
    /// The instance that was there, its release requested.
    pub(crate) old: Option<Arc<Instance>>,
    /// The host tier's copy of it.
    pub(crate) stale: Option<HostCopies>,
    /// Its snapshot file, which no reload reads any more.
    pub(crate) snapshot: Option<PathBuf>,
}

#[cfg(test)]
mod tests {
    use std::sync::Weak;

    use tch::{Device, Kind, Tensor};

    use super::super::instance::Registry;
    use super::super::spec::Built;
    use super::*;

    /// Instances of these tests belong to no registry.
    struct NoRegistry;

    impl Registry for NoRegistry {
        fn release_left_to_unlock(&self, _: &Arc<Instance>) {}
    }

    /// A model of one `[4]` float tensor (16 bytes).
    fn built() -> Built {
        let w = Tensor::zeros([4], (Kind::Float, Device::Cpu));
        Built::from_tensors(w.shallow_clone(), vec![("w".to_string(), w)])
    }

    fn instance() -> Arc<Instance> {
        let registry: Weak<dyn Registry> = Weak::<NoRegistry>::new();
        Instance::new("m", built(), &[], registry, None).unwrap()
    }

    /// The slot table of one model `m` with a loader, listed by stage `s`.
    fn slots() -> Slots {
        let loader: Arc<Loader> = Arc::new(|_| Ok(built()));
        let entry = Entry::new(
            "m".into(),
            Some(loader),
            Vec::new(),
            NameRules::default(),
            Placement::default(),
            None,
            Init::Loader,
        );
        let models = BTreeSet::from(["m".to_string()]);
        let stages = BTreeMap::from([("s".to_string(), models.clone())]);
        let sequence = vec![("s".to_string(), models)];
        Slots::new(State::new(vec![entry], stages, sequence, BTreeSet::new(), Vec::new(), None))
    }

    fn begin(slots: &Slots) -> Result<Begin> {
        slots.begin_load("m", Purpose::Use, &Turns::default(), false)
    }

    fn begun(slots: &Slots) -> Box<Begun> {
        match begin(slots).unwrap() {
            Begin::Load(begun) => begun,
            Begin::Use(_) => panic!("a load was expected"),
        }
    }

    fn ran(instance: &Arc<Instance>) -> Result<Ran<'static>> {
        Ok(Ran { instance: Arc::clone(instance), bytes: 16, report: None, borrows: Vec::new() })
    }

    fn state_of(slots: &Slots) -> ModelState {
        slots.lock().model_state("m").unwrap()
    }

    #[test]
    fn a_load_begun_marks_the_slot_loading_and_its_finish_installs_what_it_loaded() {
        let slots = slots();
        let begun = begun(&slots);
        assert!(matches!(begun.plan, Plan::Build { reload: false, .. }));
        assert_eq!(state_of(&slots), ModelState::Loading);
        let loaded = instance();
        let Landed::Loaded(installed) = slots.finish_load(&begun, ran(&loaded)).landed else {
            panic!("a load still under its ticket is installed")
        };
        assert!(Arc::ptr_eq(&installed.instance, &loaded));
        assert_eq!((installed.resident, installed.give_back.is_none()), (16, true));
        assert_eq!(state_of(&slots), ModelState::Resident);
    }

    #[test]
    fn a_get_of_a_resident_model_takes_the_lock_once_and_a_load_twice() {
        let slots = slots();
        let before = slots.locks();
        let begun = begun(&slots);
        let loaded = instance();
        slots.finish_load(&begun, ran(&loaded));
        assert_eq!(slots.locks() - before, 2);
        let before = slots.locks();
        assert!(matches!(begin(&slots).unwrap(), Begin::Use(used) if Arc::ptr_eq(&used, &loaded)));
        assert_eq!(slots.locks() - before, 1);
    }

    #[test]
    fn a_failed_load_is_installed_as_failed_and_its_error_comes_back() {
        let slots = slots();
        let begun = begun(&slots);
        let failed = slots.finish_load(&begun, Err(StageError::Closed { model: "m".into() }));
        assert!(matches!(failed.landed, Landed::Failed(StageError::Closed { .. })));
        assert_eq!(state_of(&slots), ModelState::Failed);
        // The next get loads it again.
        assert!(matches!(begin(&slots).unwrap(), Begin::Load(_)));
    }

    #[test]
    fn a_load_overtaken_by_an_insert_installs_nothing_and_the_inserted_model_stays() {
        let slots = slots();
        let begun = begun(&slots);
        let inserted = instance();
        let let_go = slots.lock().insert("m", Arc::clone(&inserted));
        assert!(let_go.old.is_none(), "nothing was resident to release");
        let finished = slots.finish_load(&begun, ran(&instance()));
        assert!(matches!(finished.landed, Landed::Overtaken(Ok(()))));
        assert!(matches!(begin(&slots).unwrap(), Begin::Use(used) if Arc::ptr_eq(&used, &inserted)));
    }

    #[test]
    fn a_load_that_gives_up_puts_the_slot_back_as_it_was() {
        let slots = slots();
        slots.give_up(*begun(&slots));
        assert_eq!(state_of(&slots), ModelState::Unloaded);
    }

    #[test]
    fn a_get_after_close_is_refused_and_begins_nothing() {
        let slots = slots();
        let _ = slots.lock().close();
        assert!(matches!(begin(&slots), Err(StageError::Closed { .. })));
        assert_eq!(state_of(&slots), ModelState::Unloaded);
    }
}
