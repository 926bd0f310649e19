//! The registry's decisions, as pure functions over a slot's state: what `get` must do, which
//! models `enter` releases, what a finished load may install, whether a release happens now or
//! when the model's user lets go. No libtorch, no locks, no clock: the registry
//! (`registry.rs`) calls these under its state lock and carries the decisions out with the
//! lock dropped; the tests below script slot states the way `guard/src/decide.rs` scripts
//! readings.
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
    /// The last load failed with `error`; `instance` is the released object it tried to refill.
    Failed {
        error: String,
        instance: Option<I>,
    },
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

/// Whether a released instance comes back in place: refilled from its checkpoint or from the
/// host tier's copy. When it does not, nothing of it is used again (a `get` rebuilds the model
/// or refuses), so the model object goes at its release, with whatever it holds beside its
/// weights.
pub fn refillable<I>(slot: &Slot<I>, in_tier: bool) -> bool {
    slot.has_checkpoint || in_tier
}

/// Decides a `get` of `slot`.
pub fn on_get<I: Clone>(slot: &Slot<I>, ctx: GetContext) -> GetAction<I> {
    let released = match &slot.state {
        SlotState::Resident(instance) => return GetAction::Use(instance.clone()),
        SlotState::Loading { .. } => return GetAction::Wait,
        _ if ctx.closed => return GetAction::Refuse(Refusal::Closed),
        _ if ctx.strict && !ctx.planned_here => return GetAction::Refuse(Refusal::OutsideStage),
        SlotState::Released { instance, pending: true, .. } => return GetAction::Revive(instance.clone()),
        SlotState::Released { stage, instance, .. } => Some((stage.clone(), instance)),
        SlotState::Failed { instance: Some(instance), .. } => Some((None, instance)),
        SlotState::Failed { instance: None, .. } | SlotState::Unloaded => None,
    };
    match released {
        Some((_, instance)) if refillable(slot, ctx.in_tier) => GetAction::Refill(instance.clone()),
        _ if slot.has_loader => GetAction::Build { reload: slot.loads > 0 },
        Some((stage, _)) => GetAction::Refuse(Refusal::NoLoader { stage }),
        None => GetAction::Refuse(Refusal::NoLoader { stage: None }),
    }
}

/// The state a slot takes while the load `get` decided runs.
pub fn start_load<I: Clone>(slot: &Slot<I>, ticket: u64) -> SlotState<I> {
    let previous = match &slot.state {
        SlotState::Released { instance, .. } => Some(instance.clone()),
        SlotState::Failed { instance, .. } => instance.clone(),
        _ => None,
    };
    SlotState::Loading { ticket, previous }
}

/// What becomes of a finished load.
#[derive(Debug, Clone, PartialEq)]
pub enum Finish<I> {
    /// The slot takes this state (resident on success, failed otherwise).
    Install(SlotState<I>),
    /// The slot moved on meanwhile (an `insert` replaced it, a `remove` took it): keep nothing.
    Discard,
}

/// Decides what a load with `ticket` installs: `Ok(instance)` or the error's message.
pub fn on_load_finished<I: Clone>(slot: Option<&Slot<I>>, ticket: u64, result: Result<I, String>) -> Finish<I> {
    let Some(Slot { state: SlotState::Loading { ticket: current, previous }, .. }) = slot else {
        return Finish::Discard;
    };
    if *current != ticket {
        return Finish::Discard;
    }
    Finish::Install(match result {
        Ok(instance) => SlotState::Resident(instance),
        Err(error) => SlotState::Failed { error, instance: previous.clone() },
    })
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

/// Whether a slot's storages count as live for others' releases (shared storage they hold is
/// kept) and in the resident total: resident, or released with the release still pending.
pub fn holds_storage<I>(state: &SlotState<I>) -> Option<&I> {
    match state {
        SlotState::Resident(instance) | SlotState::Released { instance, pending: true, .. } => Some(instance),
        _ => None,
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

/// Decides whether a prefetch starts loading `slot` in the background. Only loads that draw no
/// random number qualify: a refill in place from the checkpoint or the host tier (`in_tier`), or
/// a build that draws nothing (`skip_init`, a TorchScript load: `draws_nothing`).
pub fn on_prefetch<I>(slot: &Slot<I>, closed: bool, draws_nothing: bool, in_tier: bool) -> Result<(), PrefetchSkip> {
    match &slot.state {
        SlotState::Resident(_) | SlotState::Released { pending: true, .. } => Err(PrefetchSkip::Resident),
        SlotState::Loading { .. } => Err(PrefetchSkip::InFlight),
        _ if closed => Err(PrefetchSkip::Closed),
        SlotState::Released { .. } | SlotState::Failed { instance: Some(_), .. } if refillable(slot, in_tier) => Ok(()),
        _ if slot.has_loader && draws_nothing => Ok(()),
        _ if slot.has_loader => Err(PrefetchSkip::DrawsRandomNumbers),
        _ => Err(PrefetchSkip::NoLoader),
    }
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

/// Whether a libtorch error message is an out-of-memory (CUDA's "CUDA out of memory", the
/// caching allocator's `OutOfMemoryError`, the CPU allocator's "not enough memory").
pub fn is_out_of_memory(message: &str) -> bool {
    let message = message.to_ascii_lowercase();
    ["out of memory", "outofmemoryerror", "not enough memory", "can't allocate memory"]
        .iter()
        .any(|m| message.contains(m))
}

/// A model's state as users see it ([`super::StagedModels::states`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ModelState {
    Unloaded,
    Loading,
    Resident,
    /// Released; its weights go when the thread using it lets go.
    ReleasePending,
    Released,
    Failed,
}

/// The user-facing state of a slot.
pub fn model_state<I>(state: &SlotState<I>) -> ModelState {
    match state {
        SlotState::Unloaded => ModelState::Unloaded,
        SlotState::Loading { .. } => ModelState::Loading,
        SlotState::Resident(_) => ModelState::Resident,
        SlotState::Released { pending: true, .. } => ModelState::ReleasePending,
        SlotState::Released { .. } => ModelState::Released,
        SlotState::Failed { .. } => ModelState::Failed,
    }
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
        assert_eq!(on_get(&slot(SlotState::Resident(7)), ctx), GetAction::Use(7));
    }

    #[test]
    fn a_model_being_loaded_is_waited_for_not_loaded_twice() {
        let loading = slot(SlotState::Loading { ticket: 3, previous: None });
        assert_eq!(on_get(&loading, FREE), GetAction::Wait);
    }

    #[test]
    fn an_unloaded_model_is_built_and_a_released_one_refilled_in_place() {
        let mut first = slot(SlotState::Unloaded);
        first.loads = 0;
        assert_eq!(on_get(&first, FREE), GetAction::Build { reload: false });
        assert_eq!(on_get(&slot(released(false)), FREE), GetAction::Refill(7));
    }

    #[test]
    fn a_released_model_without_checkpoint_is_rebuilt_and_without_loader_refused() {
        let mut no_checkpoint = slot(released(false));
        no_checkpoint.has_checkpoint = false;
        assert_eq!(on_get(&no_checkpoint, FREE), GetAction::Build { reload: true });
        no_checkpoint.has_loader = false;
        assert_eq!(on_get(&no_checkpoint, FREE), GetAction::Refuse(Refusal::NoLoader { stage: Some("decode".into()) }));
    }

    #[test]
    fn a_released_model_with_a_copy_in_the_host_tier_comes_back_in_place_even_without_checkpoint() {
        let mut no_checkpoint = slot(released(false));
        no_checkpoint.has_checkpoint = false;
        let in_tier = GetContext { in_tier: true, ..FREE };
        assert_eq!(on_get(&no_checkpoint, in_tier), GetAction::Refill(7), "no rebuild, no random number drawn");
        no_checkpoint.has_loader = false;
        assert_eq!(on_get(&no_checkpoint, in_tier), GetAction::Refill(7), "an inserted model comes back too");
        assert_eq!(on_prefetch(&no_checkpoint, false, false, true), Ok(()), "and is prefetched");
        let mut unloaded = slot(SlotState::Unloaded);
        unloaded.loads = 0;
        assert_eq!(
            on_get(&unloaded, in_tier),
            GetAction::Build { reload: false },
            "a copy without instance is useless"
        );
    }

    #[test]
    fn a_model_whose_release_is_pending_is_revived_without_a_load() {
        assert_eq!(on_get(&slot(released(true)), FREE), GetAction::Revive(7));
    }

    #[test]
    fn a_closed_or_strict_registry_refuses_loads_but_not_waits() {
        let closed = GetContext { closed: true, ..FREE };
        assert_eq!(on_get(&slot(SlotState::Unloaded), closed), GetAction::Refuse(Refusal::Closed));
        let strict = GetContext { strict: true, planned_here: false, ..FREE };
        assert_eq!(on_get(&slot(released(false)), strict), GetAction::Refuse(Refusal::OutsideStage));
        assert_eq!(on_get(&slot(released(true)), strict), GetAction::Refuse(Refusal::OutsideStage));
        assert_eq!(on_get(&slot(SlotState::Loading { ticket: 1, previous: None }), strict), GetAction::Wait);
    }

    #[test]
    fn a_failed_load_is_tried_again_from_where_it_was() {
        let failed_refill = slot(SlotState::Failed { error: "disk".into(), instance: Some(7) });
        assert_eq!(on_get(&failed_refill, FREE), GetAction::Refill(7));
        let mut failed_build = slot(SlotState::Failed { error: "panic".into(), instance: None });
        failed_build.loads = 0;
        assert_eq!(on_get(&failed_build, FREE), GetAction::Build { reload: false });
    }

    #[test]
    fn a_finished_load_installs_only_while_its_ticket_is_current() {
        let loading = slot(SlotState::Loading { ticket: 4, previous: None });
        assert_eq!(on_load_finished(Some(&loading), 4, Ok(9)), Finish::Install(SlotState::Resident(9)));
        assert_eq!(on_load_finished(Some(&loading), 3, Ok(9)), Finish::Discard, "an insert took the slot over");
        assert_eq!(on_load_finished(Some(&slot(SlotState::Resident(1))), 4, Ok(9)), Finish::Discard);
        assert_eq!(on_load_finished::<u32>(None, 4, Ok(9)), Finish::Discard, "the slot was removed");
    }

    #[test]
    fn a_failed_refill_keeps_the_released_instance_to_try_again() {
        let refilling = slot(start_load(&slot(released(false)), 5));
        assert_eq!(
            on_load_finished(Some(&refilling), 5, Err("read error".into())),
            Finish::Install(SlotState::Failed { error: "read error".into(), instance: Some(7) })
        );
        let building = slot(start_load(&slot(SlotState::Unloaded), 6));
        assert_eq!(
            on_load_finished(Some(&building), 6, Err("loader failed".into())),
            Finish::Install(SlotState::Failed { error: "loader failed".into(), instance: None })
        );
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
        assert_eq!(on_prefetch(&slot(released(false)), false, false, false), Ok(()), "a refill in place draws nothing");
        let mut unloaded = slot(SlotState::Unloaded);
        unloaded.loads = 0;
        assert_eq!(on_prefetch(&unloaded, false, false, false), Err(PrefetchSkip::DrawsRandomNumbers));
        assert_eq!(on_prefetch(&unloaded, false, true, false), Ok(()), "a build without initialisation draws nothing");
        assert_eq!(on_prefetch(&slot(SlotState::Resident(1)), false, true, false), Err(PrefetchSkip::Resident));
        assert_eq!(on_prefetch(&slot(released(true)), false, true, false), Err(PrefetchSkip::Resident));
        let loading = slot(SlotState::Loading { ticket: 1, previous: None });
        assert_eq!(on_prefetch(&loading, false, true, false), Err(PrefetchSkip::InFlight));
        assert_eq!(on_prefetch(&slot(released(false)), true, true, false), Err(PrefetchSkip::Closed));
        let mut lost = slot(released(false));
        (lost.has_loader, lost.has_checkpoint) = (false, false);
        assert_eq!(on_prefetch(&lost, false, true, false), Err(PrefetchSkip::NoLoader));
    }

    #[test]
    fn an_out_of_memory_load_is_retried_once_and_only_under_the_policy() {
        assert!(retry_out_of_memory(OutOfMemory::ReleaseOthersAndRetry, false));
        assert!(!retry_out_of_memory(OutOfMemory::ReleaseOthersAndRetry, true), "once");
        assert!(!retry_out_of_memory(OutOfMemory::Fail, false), "off by default");
        assert!(is_out_of_memory("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.1 GiB total capacity)"));
        assert!(is_out_of_memory("DefaultCPUAllocator: not enough memory: you tried to allocate 1099511627776 bytes."));
        assert!(is_out_of_memory(
            "DefaultCPUAllocator: can't allocate memory: you tried to allocate 1125899906842624 bytes."
        ));
        assert!(!is_out_of_memory("shape mismatch"));
    }

    #[test]
    fn storage_counts_as_held_while_resident_or_pending_release() {
        assert_eq!(holds_storage(&SlotState::Resident(1)), Some(&1));
        assert_eq!(holds_storage(&released(true)), Some(&7));
        assert_eq!(holds_storage(&released(false)), None);
        assert_eq!(holds_storage::<u32>(&SlotState::Unloaded), None);
        assert_eq!(model_state(&released(true)), ModelState::ReleasePending);
    }
}
