//! The registry's side of the host tier: storing a released device model's weights (reserve
//! under the state lock, copy with it let go, fill), the budget set at run time, and the `tier`
//! events. The rules are [`stageload_plan::tier`]'s, the copies [`super::tier_copy`]'s; a reload from
//! the tier is a refill in place ([`super::registry`]).

use std::time::Instant;

use tch::Device;

use super::error::{Result, StageError};
use super::instance::Instance;
use super::registry::Inner;
use super::tier_copy::{self, HostCopies};
use crate::sync::lock;
use stageload_plan::tier::{Evicted, Ticket};
use stageload_trace::event::{Event, TierAction, TierChanged, TierUsage};

impl Inner {
    /// Copies a device model's weights into the host tier before its release frees them, when
    /// the tier has (or can make) room; says why when it does not. Runs under the instance's
    /// body lock, with the state lock taken only to reserve ([`Self::reserve_in_tier`]) and to
    /// fill the entry.
    pub(super) fn store_in_tier(&self, instance: &Instance, stage: &Option<String>) {
        let name = instance.name.as_str();
        let Some((views, device, ticket, bytes, budget)) = self.reserve_in_tier(instance, stage) else { return };
        let started = Instant::now();
        // The arena's pieces stay within the tier's budget as it is now.
        self.tier_side.arena().set_budget(budget);
        let copied = self
            .tier_side
            .before_copy(name, true)
            .and_then(|()| tier_copy::copy_out(views, device, self.tier_side.host_memory(), self.tier_side.arena()));
        let mut state = self.slots.lock();
        let Some(tier) = state.tier_mut() else { return };
        let (what, dropped) = match copied {
            // The ticket, not the name: the model may have been replaced (and the new instance
            // released into a reservation of its own) while the copy ran.
            // Stored; where not in the registered arena, the event says why (a buffer of its own).
            Ok((copies, not_in_arena)) => ((TierAction::Stored, not_in_arena), tier.fill(name, ticket, copies)),
            Err(error) => (not_stored(error.to_string()), tier.withdraw(name, ticket)),
        };
        let usage = state.tier_usage();
        drop(state);
        drop(dropped);
        self.tier_event(stage, name, Some(bytes), Some(started.elapsed().as_secs_f64()), what, usage);
    }

    /// Under the state lock: reserves room in the host tier for a copy of `instance`'s weights
    /// (evicting what must go, told), if the tier takes it: the tensors to copy, their device,
    /// the reservation's ticket, its bytes and the tier's budget. `None`, said in an event where it is news, when
    /// there is no tier, it is closing, the instance left its slot, it lives on the CPU, it
    /// cannot be copied whole, or the tier has no room.
    fn reserve_in_tier(
        &self,
        instance: &Instance,
        stage: &Option<String>,
    ) -> Option<(tier_copy::Views, Device, Ticket, u64, u64)> {
        let name = instance.name.as_str();
        let mut state = self.slots.lock();
        // Not when closing, nor for an instance that left its slot (removed, replaced).
        let still_held = state
            .find(name)
            .and_then(|p| state.entries()[p].released())
            .is_some_and(|held| std::ptr::eq(held.as_ref(), instance));
        if state.tier().is_none() || state.is_closed() || !still_held {
            return None;
        }
        // Lock order: the state lock, then the instance's weights.
        let weights = lock(&instance.weights);
        let device = weights.tensors.first().map(|(_, t)| t.device())?;
        if !self.tier_side.applies(device) {
            drop(weights);
            let usage = state.tier_usage();
            drop(state);
            if self.tier_side.first_cpu_model() {
                let why = format!(
                    "'{name}' lives on the CPU, where its weights are host memory already; the host tier holds device models"
                );
                self.tier_event(stage, name, None, None, not_stored(why), usage);
            }
            return None;
        }
        let views = tier_copy::Views::of(&weights.tensors);
        drop(weights);
        // Before the tier makes room: a copy that cannot be whole evicts nothing.
        let views = match views {
            Ok(views) if views.unallocated() == 0 => Ok(views),
            Ok(views) => Err(format!(
                "'{name}' has {} tensors with no memory now (a streamed model's blocks between steps: it keeps its own copies); it is rebuilt when needed",
                views.unallocated()
            )),
            Err(err) => Err(err.to_string()),
        };
        let views = match views {
            Ok(views) => views,
            Err(why) => {
                let usage = state.tier_usage();
                drop(state);
                self.tier_event(stage, name, None, None, not_stored(why), usage);
                return None;
            }
        };
        let bytes = views.bytes();
        let budget = state.tier().map_or(0, |tier| tier.budget());
        let protected = state.pinned_now();
        let admitted = state.tier_mut().map(|tier| tier.admit(name, bytes, &protected));
        let usage = state.tier_usage();
        drop(state);
        let (ticket, evicted) = match admitted {
            Some(Ok(admitted)) => (admitted.ticket, admitted.evicted),
            Some(Err(why)) => {
                self.tier_event(stage, name, Some(bytes), None, not_stored(why), usage);
                return None;
            }
            None => return None,
        };
        drop(self.evicted(stage, evicted, usage));
        Some((views, device, ticket, bytes, budget))
    }

    /// Says which copies were evicted (the state lock let go); returns them for the caller to drop.
    fn evicted(
        &self,
        stage: &Option<String>,
        evicted: Vec<Evicted<HostCopies>>,
        usage: Option<TierUsage>,
    ) -> Vec<HostCopies> {
        let mut copies = Vec::with_capacity(evicted.len());
        for Evicted { model, bytes, copies: copy } in evicted {
            copies.extend(copy);
            self.tier_event(stage, &model, Some(bytes), None, (TierAction::Evicted, None), usage);
        }
        copies
    }

    fn tier_event(
        &self,
        stage: &Option<String>,
        model: &str,
        bytes: Option<u64>,
        seconds: Option<f64>,
        (action, detail): (TierAction, Option<String>),
        tier: Option<TierUsage>,
    ) {
        self.emit(Event::now(TierChanged {
            stage: stage.clone(),
            model: Some(model.to_string()),
            action,
            detail,
            bytes,
            seconds,
            tier,
        }));
    }

    /// Sets the host tier's budget (see [`super::StagedModels::set_host_tier_budget`]); the
    /// pinned memory of the copies it evicts goes back to the OS.
    pub(crate) fn set_tier_budget(&self, bytes: u64) -> Result<()> {
        let mut state = self.slots.lock();
        let protected = state.pinned_now();
        let stage = state.current().map(str::to_string);
        let tier = state.tier_or_new(bytes);
        let old = tier.budget();
        let evicted = tier.set_budget(bytes, &protected).map_err(|refused| StageError::HostTierBudget {
            asked: refused.asked,
            protected: refused.protected,
            budget: old,
        })?;
        let usage = state.tier_usage();
        drop(state);
        drop(self.evicted(&stage, evicted, usage));
        // The registered arena's free pieces over the new budget go back too.
        self.tier_side.arena().set_budget(bytes);
        self.emit(Event::now(TierChanged {
            stage,
            model: None,
            action: TierAction::Budget,
            detail: None,
            bytes: None,
            seconds: None,
            tier: usage,
        }));
        Ok(())
    }

    pub(crate) fn tier_usage(&self) -> Option<TierUsage> {
        self.slots.lock().tier_usage()
    }
}

/// A `tier` event's action and detail for a copy the tier does not hold: why.
fn not_stored(why: impl std::fmt::Display) -> (TierAction, Option<String>) {
    (TierAction::NotStored, Some(why.to_string()))
}
