//! The registry: its parts, stage entry, `insert`, `remove` and `close`, carried out as
//! [`super::decide`] says. The slot table and its lock are [`super::slots`]'s; loads are
//! [`super::load`]'s, releases [`super::release`]'s, background loads [`super::prefetch`]'s.
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
//! 4. The state lock ([`super::slots::Slots`], `Inner::slots`): the slots, stages, pins and the
//!    host tier's bookkeeping (its copies run with the lock let go, see [`super::tier_store`]).
//!    Held for bookkeeping only, never while a model is built, read from disk, freed, or in
//!    use; a `get` of a model another thread is loading waits on the slot table's condition
//!    variable, which gives the lock up while it waits. The decisions of [`super::decide`] are
//!    made under it, a release's claim too ([`super::decide::ReleaseMark::claim`]), so a revival
//!    and a release never both win.
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
//! are indexed (kept by `State::set_state`, the one way a slot's state changes), so `enter`, a
//! load's resident total and a release's shared-storage check walk the models resident, not
//! every slot; a stage's occurrences and the pin spans are looked up by name. Listing calls
//! (`states`, `names`) and `remove` (positions shift) walk every slot. A `get` takes the state
//! lock once for a resident model, twice for a load (begin and finish, [`super::slots`]).
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
//! `withdraw` or `unlease` name it (`tier_store`, `slots`), so a copy of one instance never lands
//! in another's entry. A streamed model's residency report (its plan's `held`) comes only from
//! the instance that runs: a released streamed model is dropped, never run again.

use std::sync::Arc;

use super::background::Background;
use super::caches::{self, Trim};
use super::decide::ModelState;
use super::error::Result;
use super::fills::Fills;
use super::instance::{self, Handle, Instance};
use super::slots::{LetGo, Slots, State};
use super::snapshot::Snapshots;
use super::spec::{Builds, Built};
use super::tier_copy::TierSide;
use super::turn::Turns;
use crate::storage::ReleaseStats;
use stageload_trace::event::{Entered, Event, EventSink, LoadReport, MarkAction, Marked};

/// The registry's shared inside; [`super::StagedModels`] is its face. The event sink is this
/// file's; every other part is an owner with state of its own, private to its file: the slot
/// table ([`super::slots`]), the build turn ([`super::turn`]), what builds go by
/// ([`super::spec`]), prefetching ([`super::background`]), the host tier's side
/// ([`super::tier_copy`]), the snapshot folder ([`super::snapshot`]), the heap's trim
/// ([`super::caches`]) and the storages refills fill ([`super::fills`]).
pub(crate) struct Inner {
    /// The slots, stages, pins and the host tier's bookkeeping, behind the state lock.
    pub(super) slots: Slots,
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
            slots: Slots::new(state),
            sink,
            turns: Arc::default(),
            builds,
            background,
            tier_side,
            snapshots,
            trim: Trim::default(),
            fills: Fills::default(),
        }
    }

    pub(crate) fn emit(&self, event: Event) {
        if let Some(sink) = &self.sink {
            sink.emit(&event);
        }
    }

    /// Enters `stage` (see [`super::StagedModels::enter`]): decided, with the batch of releases
    /// claimed, under one taking of the state lock; carried out after it.
    pub(crate) fn enter(&self, stage: &str) -> Result<ReleaseStats> {
        let mut state = self.slots.lock();
        let (index, resident, instances) = state.enter(stage)?;
        let batch = self.claim_batch(&state, &instances);
        drop(state);
        // Before the event, so that the new stage's meter window starts without them.
        caches::flush_host_blocks();
        self.emit(Event::now(Entered { stage: stage.to_string(), position: Some(index), resident: Some(resident) }));
        Ok(self.release_batch(batch))
    }

    /// Releases everything and refuses later loads (see [`super::StagedModels::close`]).
    pub(crate) fn close(&self) -> ReleaseStats {
        let (stage, resident, instances, copies) = self.slots.lock().close();
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
        let instance = Instance::new(name, built, &[], Arc::<Inner>::downgrade(self), None)?;
        let let_go = self.slots.lock().insert(name, instance);
        self.let_go(let_go);
        Ok(())
    }

    /// Forgets `name`; releases it first when `release`. Waits until it is not loading.
    pub(crate) fn remove(&self, name: &str, release: bool) -> Result<()> {
        let mut state = self.slots.lock();
        let _awaiting = self.turns.awaiting();
        let position = loop {
            let position = state.position(name)?;
            if !state.is_loading(position) {
                break position;
            }
            state = self.slots.wait(state);
        };
        let let_go = state.remove(position, release);
        drop(state);
        self.let_go(let_go);
        Ok(())
    }

    /// Lets go of what an `insert` or a `remove` took out of the table, with the state lock let
    /// go: wakes the loads it overtook, drops the tier's copy, releases the instance, removes
    /// its snapshot file.
    fn let_go(&self, LetGo { old, stale, snapshot }: LetGo) {
        self.slots.notify();
        drop(stale);
        self.release_all(old.into_iter().collect());
        self.forget_snapshot(snapshot);
    }

    pub(crate) fn states(&self) -> Vec<(String, ModelState)> {
        self.slots.lock().states()
    }

    /// Names of the resident models, in definition order.
    pub(crate) fn resident(&self) -> Vec<String> {
        self.slots.lock().resident_names()
    }

    pub(crate) fn load_report(&self, name: &str) -> Result<Option<LoadReport>> {
        self.slots.lock().load_report(name)
    }

    pub(crate) fn resident_bytes(&self) -> u64 {
        self.slots.lock().resident_bytes()
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
