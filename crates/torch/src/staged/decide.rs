//! The registry's decisions, pure: every transition of a slot's life is a method of [`Slot`]
//! that returns what the caller must do or the state the slot takes (get, start, give up and
//! finish a load, request a release, revive, finish a release, insert), beside which models
//! `enter` releases, whether a release happens now or when the model's user lets go, and what
//! a prefetch may load. An instance's [`ReleaseMark`] is derived from the state its slot takes
//! ([`SlotState::mark`]); the one move of the mark of its own is a release's claim
//! ([`ReleaseMark::claim`]), which outlives the slot (a removed or replaced instance is still
//! freed). No libtorch, no locks, no clock: the registry (`registry.rs`) calls these under its
//! state lock and carries the decisions out with the lock dropped; the tests below script slot
//! states the way `guard/src/decide.rs` scripts readings.
//!
//! A slot's life (`I` is the model instance; an `Arc` in the registry, a number in the tests):
//!
//! ```text
//! unloaded ──get──▶ loading ──ok──▶ resident ──enter (not listed, not pinned)──▶ released
//!    ▲                 │ failed                    ▲   │ in use on another thread       │
//!    └── failed ◀──────┘                           │   ▼                                │
//!                                                  │ released, release pending ─get─▶ revived (resident)
//!                                                  └──── loading (refill in place or rebuild) ◀──get──┘
//! remove / take: the slot is gone;  close: everything released, no more loads.
//! ```

use std::collections::BTreeSet;
use std::sync::Arc;

/// How the decisions tell one instance from another: by identity, never by name or value (a
/// name is another instance's after an `insert`).
pub trait Same {
    fn same(&self, other: &Self) -> bool;
}

impl<T: ?Sized> Same for Arc<T> {
    fn same(&self, other: &Self) -> bool {
        Arc::ptr_eq(self, other)
    }
}

#[cfg(test)]
impl Same for u32 {
    fn same(&self, other: &Self) -> bool {
        self == other
    }
}

/// What a slot holds.
#[derive(Debug, Clone, PartialEq)]
pub enum SlotState<I> {
    /// Never built.
    Unloaded,
    /// A thread is building or refilling it; `ticket` identifies that load, so that a load
    /// overtaken by an `insert` or a `remove` installs nothing. `previous`: the released
    /// instance it refills or replaces, kept for a retry if the load fails.
    Loading {
        ticket: u64,
        previous: Option<I>,
    },
    Resident(I),
    /// Released when `stage` was entered. With `pending`, the model was in use on another
    /// thread: its storages are freed when that thread lets go, and until then a `get` takes it
    /// back as it is.
    Released {
        stage: Option<String>,
        instance: I,
        pending: bool,
    },
    /// The last load failed (its error went, typed, to the `get` that ran it, and into an
    /// `error` event); `instance` is the released object it tried to refill, kept for a retry.
    Failed {
        instance: Option<I>,
    },
}

/// Where an instance stands with respect to its last release, as its handles read it without
/// the registry's lock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReleaseMark {
    /// Usable.
    Live,
    /// Released when `stage` was entered, storages not freed yet: a guard still holds the model
    /// (the guard frees them when it drops), or the releasing thread is about to.
    Requested(Option<String>),
    /// Released at `stage`; storages freed (or being freed).
    Freed(Option<String>),
}

impl ReleaseMark {
    /// The stage it was released at (`Some(None)`: before any stage); `None` while live.
    pub fn stage(&self) -> Option<Option<String>> {
        match self {
            ReleaseMark::Live => None,
            ReleaseMark::Requested(stage) | ReleaseMark::Freed(stage) => Some(stage.clone()),
        }
    }

    /// A release begins freeing the storages: a requested release becomes freed, and its stage
    /// comes back. `None` when no release is requested (the model was taken back, or another
    /// thread claimed the release first): there is nothing to free.
    pub fn claim(&mut self) -> Option<Option<String>> {
        let ReleaseMark::Requested(stage) = self else { return None };
        let stage = stage.take();
        *self = ReleaseMark::Freed(stage.clone());
        Some(stage)
    }
}

impl<I> SlotState<I> {
    /// The instance this state holds and the mark it gives it: live while resident, requested
    /// while its release is pending, freed once released. `None`: the state says nothing new
    /// of an instance (loading, failed and unloaded keep the mark the instance had).
    pub fn mark(&self) -> Option<(&I, ReleaseMark)> {
        match self {
            SlotState::Resident(instance) => Some((instance, ReleaseMark::Live)),
            SlotState::Released { stage, instance, pending: true } => {
                Some((instance, ReleaseMark::Requested(stage.clone())))
            }
            SlotState::Released { stage, instance, pending: false } => {
                Some((instance, ReleaseMark::Freed(stage.clone())))
            }
            _ => None,
        }
    }

    /// Whether its storages count as live for others' releases (shared storage they hold is
    /// kept) and in the resident total: resident, or released with the release still pending.
    pub fn holds_storage(&self) -> Option<&I> {
        match self {
            SlotState::Resident(instance) | SlotState::Released { instance, pending: true, .. } => Some(instance),
            _ => None,
        }
    }

    /// The released instance it keeps for a refill in place (released, or failed refilling).
    pub fn released_instance(&self) -> Option<&I> {
        match self {
            SlotState::Released { instance, .. } => Some(instance),
            SlotState::Failed { instance } => instance.as_ref(),
            _ => None,
        }
    }

    /// The state as users see it ([`super::StagedModels::states`]).
    pub fn model_state(&self) -> ModelState {
        match self {
            SlotState::Unloaded => ModelState::Unloaded,
            SlotState::Loading { .. } => ModelState::Loading,
            SlotState::Resident(_) => ModelState::Resident,
            SlotState::Released { pending: true, .. } => ModelState::ReleasePending,
            SlotState::Released { .. } => ModelState::Released,
            SlotState::Failed { .. } => ModelState::Failed,
        }
    }
}

/// A slot as the decisions see it.
#[derive(Debug, Clone, PartialEq)]
pub struct Slot<I> {
    pub state: SlotState<I>,
    /// A loader can build it (false for models registered with `insert`).
    pub has_loader: bool,
    /// Checkpoint files can refill it in place.
    pub has_checkpoint: bool,
    /// Completed loads.
    pub loads: u32,
}

/// What the registry looks like to one `get`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GetContext {
    pub closed: bool,
    pub strict: bool,
    /// The current stage lists the model, pins it, or no stage was entered yet.
    pub planned_here: bool,
    /// The host tier has a ready copy of the model's weights.
    pub in_tier: bool,
}

/// Why a `get` is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    Closed,
    OutsideStage,
    /// Released and without loader or checkpoint: it cannot come back.
    NoLoader {
        stage: Option<String>,
    },
}

/// What `get` must do.
#[derive(Debug, Clone, PartialEq)]
pub enum GetAction<I> {
    /// Hand out this resident instance.
    Use(I),
    /// Another thread is loading it: wait for the slot to change, then decide again.
    Wait,
    /// Take back a model whose release is still pending: its storages were never freed.
    Revive(I),
    /// Reallocate and refill this released instance from the checkpoint.
    Refill(I),
    /// Run the loader (`reload`: it was built before).
    Build {
        reload: bool,
    },
    Refuse(Refusal),
}

/// What becomes of a finished load.
#[derive(Debug, Clone, PartialEq)]
pub enum Finish<I> {
    /// The slot takes this state (resident on success, failed otherwise).
    Install(SlotState<I>),
    /// The slot moved on meanwhile (an `insert` replaced it, a `remove` took it): keep nothing.
    Discard,
}

/// What a release that freed its instance's storages does to the slot.
#[derive(Debug, Clone, PartialEq)]
pub struct Settled<I> {
    /// Released, no longer pending.
    pub state: SlotState<I>,
    /// The instance comes back in place ([`Slot::refillable`]); when it does not, nothing of it
    /// is used again and the model object goes.
    pub comes_back: bool,
}

impl<I: Clone + Same> Slot<I> {
    /// The slot of a model registered with `insert`: resident, with no loader and no checkpoint
    /// (it cannot be rebuilt), counted as loaded once.
    pub fn inserted(instance: I) -> Self {
        Slot { state: SlotState::Resident(instance), has_loader: false, has_checkpoint: false, loads: 1 }
    }

    /// Whether a released instance comes back in place: refilled from its checkpoint or from
    /// the host tier's copy (`in_tier`). When it does not, nothing of it is used again (a `get`
    /// rebuilds the model or refuses), so the model object goes at its release, with whatever
    /// it holds beside its weights.
    pub fn refillable(&self, in_tier: bool) -> bool {
        self.has_checkpoint || in_tier
    }

    /// What a `get` must do.
    pub fn get(&self, ctx: GetContext) -> GetAction<I> {
        let released = match &self.state {
            SlotState::Resident(instance) => return GetAction::Use(instance.clone()),
            SlotState::Loading { .. } => return GetAction::Wait,
            _ if ctx.closed => return GetAction::Refuse(Refusal::Closed),
            _ if ctx.strict && !ctx.planned_here => return GetAction::Refuse(Refusal::OutsideStage),
            SlotState::Released { instance, pending: true, .. } => return GetAction::Revive(instance.clone()),
            SlotState::Released { stage, instance, .. } => Some((stage.clone(), instance)),
            SlotState::Failed { instance: Some(instance) } => Some((None, instance)),
            SlotState::Failed { instance: None } | SlotState::Unloaded => None,
        };
        match released {
            Some((_, instance)) if self.refillable(ctx.in_tier) => GetAction::Refill(instance.clone()),
            _ if self.has_loader => GetAction::Build { reload: self.loads > 0 },
            Some((stage, _)) => GetAction::Refuse(Refusal::NoLoader { stage }),
            None => GetAction::Refuse(Refusal::NoLoader { stage: None }),
        }
    }

    /// The state the slot takes while the load `get` decided runs under `ticket`.
    pub fn start_load(&self, ticket: u64) -> SlotState<I> {
        SlotState::Loading { ticket, previous: self.state.released_instance().cloned() }
    }

    /// A load with `ticket` gave up before it began: the slot goes back to `before`, unless an
    /// `insert` or a `remove` took it over meanwhile (`None`: leave it).
    pub fn give_up(&self, ticket: u64, before: SlotState<I>) -> Option<SlotState<I>> {
        matches!(self.state, SlotState::Loading { ticket: t, .. } if t == ticket).then_some(before)
    }

    /// What a load with `ticket` installs: the instance it loaded, or (`None`) that it failed.
    pub fn finish_load(&self, ticket: u64, loaded: Option<I>) -> Finish<I> {
        let SlotState::Loading { ticket: current, previous } = &self.state else {
            return Finish::Discard;
        };
        if *current != ticket {
            return Finish::Discard;
        }
        Finish::Install(match loaded {
            Some(instance) => SlotState::Resident(instance),
            None => SlotState::Failed { instance: previous.clone() },
        })
    }

    /// A release of a resident model, entering `stage`: the instance to release and the state
    /// the slot takes (released, pending until its storages are freed). `None`: not resident.
    pub fn request_release(&self, stage: Option<String>) -> Option<(I, SlotState<I>)> {
        let SlotState::Resident(instance) = &self.state else { return None };
        Some((instance.clone(), SlotState::Released { stage, instance: instance.clone(), pending: true }))
    }

    /// A `get` takes back a model whose release is pending: resident again, as it is. `None`
    /// while its storages are being freed (`freeing`: the release claimed them), or when it is
    /// not pending: wait for the slot to change.
    pub fn revive(&self, freeing: bool) -> Option<SlotState<I>> {
        match &self.state {
            SlotState::Released { instance, pending: true, .. } if !freeing => {
                Some(SlotState::Resident(instance.clone()))
            }
            _ => None,
        }
    }

    /// The release of `released` freed its storages: the slot settles, if it still holds that
    /// very instance (an `insert`, `remove` or revival meanwhile leaves it alone: `None`).
    pub fn finish_release(&self, released: &I, in_tier: bool) -> Option<Settled<I>> {
        let SlotState::Released { stage, instance, .. } = &self.state else { return None };
        instance.same(released).then(|| Settled {
            state: SlotState::Released { stage: stage.clone(), instance: instance.clone(), pending: false },
            comes_back: self.refillable(in_tier),
        })
    }

    /// Whether a prefetch starts loading the slot in the background. Only loads that draw no
    /// random number qualify: a refill in place from the checkpoint or the host tier
    /// (`in_tier`), or a build that draws nothing (`skip_init`, a TorchScript load:
    /// `draws_nothing`).
    pub fn prefetch(&self, closed: bool, draws_nothing: bool, in_tier: bool) -> Result<(), PrefetchSkip> {
        match &self.state {
            SlotState::Resident(_) | SlotState::Released { pending: true, .. } => Err(PrefetchSkip::Resident),
            SlotState::Loading { .. } => Err(PrefetchSkip::InFlight),
            _ if closed => Err(PrefetchSkip::Closed),
            SlotState::Released { .. } | SlotState::Failed { instance: Some(_) } if self.refillable(in_tier) => Ok(()),
            _ if self.has_loader && draws_nothing => Ok(()),
            _ if self.has_loader => Err(PrefetchSkip::DrawsRandomNumbers),
            _ => Err(PrefetchSkip::NoLoader),
        }
    }
}

/// The resident models that entering a stage listing `planned` releases: every resident model
/// it does not list and that is not pinned, in the order given.
pub fn leaving<'a>(
    resident: impl IntoIterator<Item = &'a str>,
    planned: &BTreeSet<String>,
    pinned: &BTreeSet<String>,
) -> Vec<String> {
    resident.into_iter().filter(|n| !planned.contains(*n) && !pinned.contains(*n)).map(str::to_string).collect()
}

/// Whether a release frees the storages now or leaves that to the thread using the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReleaseWhen {
    Now,
    /// The model is locked (by any thread, the caller's too): its guard frees it on drop.
    WhenUnlocked,
}

/// Decides a release given whether the model's lock could be taken without waiting.
pub fn on_release(lock_taken: bool) -> ReleaseWhen {
    if lock_taken {
        ReleaseWhen::Now
    } else {
        ReleaseWhen::WhenUnlocked
    }
}

/// Why a prefetch leaves a model alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefetchSkip {
    /// Resident already (or its release is still pending: a `get` takes it back as it is).
    Resident,
    /// A load of it is in flight.
    InFlight,
    Closed,
    /// Loading it means running its loader, which draws random numbers from the process-wide
    /// generators: done in the background it would shift the foreground's draws. It loads at its
    /// `get` (declare a checkpoint and `skip_init` to make it prefetchable).
    DrawsRandomNumbers,
    /// Released with no loader and no checkpoint: it cannot come back.
    NoLoader,
}

/// Where a prefetch is headed: the position in the stage sequence when it started (`None`
/// before any stage), the occurrence it loads for, and how many stages had been entered then.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Trip {
    pub from: Option<usize>,
    pub target: usize,
    pub entered: u64,
}

/// Whether a prefetch on `trip` has been overtaken now that the run is at position `now` after
/// `entered` stage entries: the model is not planned in the current stage, and a stage entered
/// since the prefetch began lies off the way to its target (the target itself, beyond it, back
/// before the start, or the start again). Such a load is not begun, and one that ends is
/// released at once: nothing on the way needs it, and the current stage's plan does not count it.
pub fn prefetch_overtaken(trip: Trip, now: Option<usize>, entered: u64, planned_here: bool) -> bool {
    if planned_here || entered == trip.entered {
        return false;
    }
    let on_the_way = match (trip.from, now) {
        (_, None) => true,
        (None, Some(now)) => now < trip.target,
        (Some(from), Some(now)) => from < now && now < trip.target,
    };
    !on_the_way
}

/// What the registry does when a load runs out of device memory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum OutOfMemory {
    /// Return the typed error (default).
    #[default]
    Fail,
    /// Release the unpinned resident models the current stage does not list, then try the load
    /// once more (iris #54: the decoder did not fit next to the transformer).
    ReleaseOthersAndRetry,
}

/// Whether a load that ran out of memory is tried again (only once, only under the policy).
pub fn retry_out_of_memory(policy: OutOfMemory, already_retried: bool) -> bool {
    policy == OutOfMemory::ReleaseOthersAndRetry && !already_retried
}

/// A model's state as users see it ([`super::StagedModels::states`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ModelState {
    /// Never loaded yet.
    Unloaded,
    /// Its loader or refill is running (a `get`, or a prefetch).
    Loading,
    /// Loaded, its weights in memory.
    Resident,
    /// Released; its weights go when the thread using it lets go.
    ReleasePending,
    /// Released: its storages freed; a `get` brings it back (refilled, or rebuilt by its loader).
    Released,
    /// Its last load failed; a `get` tries again.
    Failed,
}

#[cfg(test)]
mod prefetch_tests {
    use super::{prefetch_overtaken, Trip};

    /// A prefetch begun at position 0 (after one entry) for the occurrence at 2.
    const TRIP: Trip = Trip { from: Some(0), target: 2, entered: 1 };

    #[test]
    fn a_prefetch_is_not_overtaken_before_any_stage_is_entered_after_it_began() {
        assert!(!prefetch_overtaken(TRIP, Some(0), 1, false));
    }

    #[test]
    fn a_stage_on_the_way_to_the_target_leaves_the_prefetch_running() {
        assert!(!prefetch_overtaken(TRIP, Some(1), 2, false));
    }

    #[test]
    fn the_target_or_any_stage_that_plans_the_model_wants_it() {
        assert!(!prefetch_overtaken(TRIP, Some(2), 2, true));
        assert!(!prefetch_overtaken(TRIP, Some(5), 4, true));
    }

    #[test]
    fn a_stage_at_or_beyond_the_target_that_does_not_plan_it_overtakes_the_prefetch() {
        assert!(prefetch_overtaken(TRIP, Some(2), 2, false));
        assert!(prefetch_overtaken(TRIP, Some(3), 2, false));
    }

    #[test]
    fn going_back_to_the_start_or_before_it_overtakes_the_prefetch() {
        assert!(prefetch_overtaken(TRIP, Some(0), 3, false), "the start entered again");
        let later = Trip { from: Some(3), target: 5, entered: 4 };
        assert!(prefetch_overtaken(later, Some(1), 5, false));
    }

    #[test]
    fn a_prefetch_back_to_an_earlier_stage_is_overtaken_by_any_other_stage() {
        // Its target comes before its start (a stage entered again out of sequence).
        let back = Trip { from: Some(4), target: 1, entered: 5 };
        assert!(!prefetch_overtaken(back, Some(4), 5, false));
        assert!(prefetch_overtaken(back, Some(3), 6, false));
    }

    #[test]
    fn a_prefetch_begun_before_the_first_stage_is_on_its_way_until_the_target() {
        let first = Trip { from: None, target: 1, entered: 0 };
        assert!(!prefetch_overtaken(first, Some(0), 1, false));
        assert!(prefetch_overtaken(first, Some(1), 1, false));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(state: SlotState<u32>) -> Slot<u32> {
        Slot { state, has_loader: true, has_checkpoint: true, loads: 1 }
    }

    const FREE: GetContext = GetContext { closed: false, strict: false, planned_here: true, in_tier: false };

    fn released(pending: bool) -> SlotState<u32> {
        SlotState::Released { stage: Some("decode".into()), instance: 7, pending }
    }

    #[test]
    fn a_resident_model_is_handed_out_even_outside_its_stage_and_after_close() {
        let ctx = GetContext { closed: true, strict: true, planned_here: false, in_tier: false };
        assert_eq!(slot(SlotState::Resident(7)).get(ctx), GetAction::Use(7));
    }

    #[test]
    fn a_model_being_loaded_is_waited_for_not_loaded_twice() {
        let loading = slot(SlotState::Loading { ticket: 3, previous: None });
        assert_eq!(loading.get(FREE), GetAction::Wait);
    }

    #[test]
    fn an_unloaded_model_is_built_and_a_released_one_refilled_in_place() {
        let mut first = slot(SlotState::Unloaded);
        first.loads = 0;
        assert_eq!(first.get(FREE), GetAction::Build { reload: false });
        assert_eq!(slot(released(false)).get(FREE), GetAction::Refill(7));
    }

    #[test]
    fn a_released_model_without_checkpoint_is_rebuilt_and_without_loader_refused() {
        let mut no_checkpoint = slot(released(false));
        no_checkpoint.has_checkpoint = false;
        assert_eq!(no_checkpoint.get(FREE), GetAction::Build { reload: true });
        no_checkpoint.has_loader = false;
        assert_eq!(no_checkpoint.get(FREE), GetAction::Refuse(Refusal::NoLoader { stage: Some("decode".into()) }));
    }

    #[test]
    fn a_released_model_with_a_copy_in_the_host_tier_comes_back_in_place_even_without_checkpoint() {
        let mut no_checkpoint = slot(released(false));
        no_checkpoint.has_checkpoint = false;
        let in_tier = GetContext { in_tier: true, ..FREE };
        assert_eq!(no_checkpoint.get(in_tier), GetAction::Refill(7), "no rebuild, no random number drawn");
        no_checkpoint.has_loader = false;
        assert_eq!(no_checkpoint.get(in_tier), GetAction::Refill(7), "an inserted model comes back too");
        assert_eq!(no_checkpoint.prefetch(false, false, true), Ok(()), "and is prefetched");
        let mut unloaded = slot(SlotState::Unloaded);
        unloaded.loads = 0;
        assert_eq!(unloaded.get(in_tier), GetAction::Build { reload: false }, "a copy without instance is useless");
    }

    #[test]
    fn a_model_whose_release_is_pending_is_revived_without_a_load() {
        assert_eq!(slot(released(true)).get(FREE), GetAction::Revive(7));
    }

    #[test]
    fn a_closed_or_strict_registry_refuses_loads_but_not_waits() {
        let closed = GetContext { closed: true, ..FREE };
        assert_eq!(slot(SlotState::Unloaded).get(closed), GetAction::Refuse(Refusal::Closed));
        let strict = GetContext { strict: true, planned_here: false, ..FREE };
        assert_eq!(slot(released(false)).get(strict), GetAction::Refuse(Refusal::OutsideStage));
        assert_eq!(slot(released(true)).get(strict), GetAction::Refuse(Refusal::OutsideStage));
        assert_eq!(slot(SlotState::Loading { ticket: 1, previous: None }).get(strict), GetAction::Wait);
    }

    #[test]
    fn a_failed_load_is_tried_again_from_where_it_was() {
        let failed_refill = slot(SlotState::Failed { instance: Some(7) });
        assert_eq!(failed_refill.get(FREE), GetAction::Refill(7));
        let mut failed_build = slot(SlotState::Failed { instance: None });
        failed_build.loads = 0;
        assert_eq!(failed_build.get(FREE), GetAction::Build { reload: false });
    }

    #[test]
    fn a_finished_load_installs_only_while_its_ticket_is_current() {
        let loading = slot(SlotState::Loading { ticket: 4, previous: None });
        assert_eq!(loading.finish_load(4, Some(9)), Finish::Install(SlotState::Resident(9)));
        assert_eq!(loading.finish_load(3, Some(9)), Finish::Discard, "an insert took the slot over");
        assert_eq!(slot(SlotState::Resident(1)).finish_load(4, Some(9)), Finish::Discard);
    }

    #[test]
    fn a_failed_refill_keeps_the_released_instance_to_try_again() {
        let refilling = slot(slot(released(false)).start_load(5));
        assert_eq!(refilling.finish_load(5, None), Finish::Install(SlotState::Failed { instance: Some(7) }));
        let building = slot(slot(SlotState::Unloaded).start_load(6));
        assert_eq!(building.finish_load(6, None), Finish::Install(SlotState::Failed { instance: None }));
    }

    #[test]
    fn entering_a_stage_releases_what_it_does_not_list_unless_pinned() {
        let set = |names: &[&str]| names.iter().map(|n| n.to_string()).collect::<BTreeSet<_>>();
        assert_eq!(leaving(["enc", "dec", "aux"], &set(&["dec"]), &set(&["aux"])), ["enc"]);
        assert!(leaving(["enc"], &set(&["enc"]), &set(&[])).is_empty());
    }

    #[test]
    fn a_release_of_a_model_in_use_waits_for_its_user_instead_of_blocking() {
        assert_eq!(on_release(true), ReleaseWhen::Now);
        assert_eq!(on_release(false), ReleaseWhen::WhenUnlocked);
    }

    #[test]
    fn only_loads_that_draw_no_random_number_are_prefetched() {
        assert_eq!(slot(released(false)).prefetch(false, false, false), Ok(()), "a refill in place draws nothing");
        let mut unloaded = slot(SlotState::Unloaded);
        unloaded.loads = 0;
        assert_eq!(unloaded.prefetch(false, false, false), Err(PrefetchSkip::DrawsRandomNumbers));
        assert_eq!(unloaded.prefetch(false, true, false), Ok(()), "a build without initialisation draws nothing");
        assert_eq!(slot(SlotState::Resident(1)).prefetch(false, true, false), Err(PrefetchSkip::Resident));
        assert_eq!(slot(released(true)).prefetch(false, true, false), Err(PrefetchSkip::Resident));
        let loading = slot(SlotState::Loading { ticket: 1, previous: None });
        assert_eq!(loading.prefetch(false, true, false), Err(PrefetchSkip::InFlight));
        assert_eq!(slot(released(false)).prefetch(true, true, false), Err(PrefetchSkip::Closed));
        let mut lost = slot(released(false));
        (lost.has_loader, lost.has_checkpoint) = (false, false);
        assert_eq!(lost.prefetch(false, true, false), Err(PrefetchSkip::NoLoader));
    }

    #[test]
    fn an_out_of_memory_load_is_retried_once_and_only_under_the_policy() {
        assert!(retry_out_of_memory(OutOfMemory::ReleaseOthersAndRetry, false));
        assert!(!retry_out_of_memory(OutOfMemory::ReleaseOthersAndRetry, true), "once");
        assert!(!retry_out_of_memory(OutOfMemory::Fail, false), "off by default");
    }

    #[test]
    fn storage_counts_as_held_while_resident_or_pending_release() {
        assert_eq!(SlotState::Resident(1).holds_storage(), Some(&1));
        assert_eq!(released(true).holds_storage(), Some(&7));
        assert_eq!(released(false).holds_storage(), None);
        assert_eq!(SlotState::<u32>::Unloaded.holds_storage(), None);
        assert_eq!(released(true).model_state(), ModelState::ReleasePending);
    }

    #[test]
    fn a_load_that_gives_up_puts_its_slot_back_unless_another_took_it_over() {
        let loading = slot(SlotState::Loading { ticket: 2, previous: Some(7) });
        assert_eq!(loading.give_up(2, released(false)), Some(released(false)));
        assert_eq!(loading.give_up(1, released(false)), None, "another load's ticket");
        assert_eq!(slot(SlotState::Resident(9)).give_up(2, released(false)), None, "an insert meanwhile");
    }

    #[test]
    fn a_release_is_requested_of_resident_models_only_and_stays_pending_until_freed() {
        let (instance, state) = slot(SlotState::Resident(7)).request_release(Some("decode".into())).unwrap();
        assert_eq!((instance, state), (7, released(true)));
        assert_eq!(slot(released(true)).request_release(None), None, "already released");
        assert_eq!(slot(SlotState::Unloaded).request_release(None), None);
    }

    #[test]
    fn a_pending_release_is_revived_unless_its_storages_are_being_freed() {
        assert_eq!(slot(released(true)).revive(false), Some(SlotState::Resident(7)));
        assert_eq!(slot(released(true)).revive(true), None, "wait for the free to finish");
        assert_eq!(slot(released(false)).revive(false), None, "freed: a refill brings it back");
    }

    #[test]
    fn a_finished_release_settles_only_the_slot_still_holding_that_instance() {
        let settled = slot(released(true)).finish_release(&7, false).unwrap();
        assert_eq!(settled, Settled { state: released(false), comes_back: true });
        assert_eq!(slot(released(true)).finish_release(&8, false), None, "another instance took the name");
        assert_eq!(slot(SlotState::Resident(7)).finish_release(&7, false), None, "revived meanwhile");
        let mut no_checkpoint = slot(released(true));
        no_checkpoint.has_checkpoint = false;
        assert!(!no_checkpoint.finish_release(&7, false).unwrap().comes_back, "nothing refills it: the object goes");
        assert!(no_checkpoint.finish_release(&7, true).unwrap().comes_back, "the host tier's copy refills it");
    }

    #[test]
    fn an_inserted_model_is_resident_and_cannot_be_rebuilt() {
        let inserted = Slot::inserted(4u32);
        assert_eq!(inserted.get(FREE), GetAction::Use(4));
        let (_, released) = inserted.request_release(None).unwrap();
        let released = Slot { state: released, ..inserted };
        assert_eq!(released.get(FREE), GetAction::Revive(4));
        assert_eq!(
            Slot { state: SlotState::Released { stage: None, instance: 4, pending: false }, ..released }.get(FREE),
            GetAction::Refuse(Refusal::NoLoader { stage: None })
        );
    }

    #[test]
    fn the_mark_an_instance_shows_follows_the_state_its_slot_takes() {
        assert_eq!(SlotState::Resident(7).mark(), Some((&7, ReleaseMark::Live)));
        assert_eq!(released(true).mark(), Some((&7, ReleaseMark::Requested(Some("decode".into())))));
        assert_eq!(released(false).mark(), Some((&7, ReleaseMark::Freed(Some("decode".into())))));
        assert_eq!(SlotState::Loading { ticket: 1, previous: Some(7) }.mark(), None, "a refill keeps it freed");
        assert_eq!(SlotState::<u32>::Failed { instance: Some(7) }.mark(), None);
    }

    #[test]
    fn a_release_is_claimed_once_and_only_while_requested() {
        let mut mark = ReleaseMark::Requested(Some("decode".into()));
        assert_eq!(mark.claim(), Some(Some("decode".into())));
        assert_eq!(mark, ReleaseMark::Freed(Some("decode".into())));
        assert_eq!(mark.claim(), None, "a second release of the same instance frees nothing");
        assert_eq!(ReleaseMark::Live.claim(), None, "revived before the release began");
        assert_eq!(ReleaseMark::Freed(None).stage(), Some(None));
        assert_eq!(ReleaseMark::Live.stage(), None);
    }
}
