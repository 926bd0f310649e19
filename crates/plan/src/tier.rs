//! The host tier's bookkeeping: which released device models keep a copy of their weights in
//! host memory, under a byte budget. Pure and torch-free: the copies are a type parameter (`T`,
//! the host tensors in `stageload`'s registry, `()` where the plan counts what the tier holds
//! at each stage), the clock is a counter, and every decision — admit, evict, lease, shrink —
//! is a method that changes this state and returns what the caller must carry out (copies to
//! drop) once the registry's lock is let go. [`TierPlan`] checks a pipeline's budget against its
//! largest device model.
//!
//! Identity. An entry belongs to the instance whose copy it is: [`Tier::admit`] hands out a
//! [`Ticket`], and every later call about that copy ([`Tier::fill`], [`Tier::withdraw`],
//! [`Tier::unlease`], and a lease's end) names it. A call whose ticket is not the entry's (the
//! model was replaced, removed or released again meanwhile, and the entry is another instance's
//! or gone) changes nothing and hands its copy back to be dropped, so one instance's weights never
//! land in another's entry. Only [`Tier::forget`], for a model that left the registry or was
//! replaced, goes by name alone.
//!
//! Rules. An entry is reserved (and leased) before its copy runs, so its bytes count at once
//! and a concurrent admission cannot overbook the budget. A leased entry (a copy in flight, into
//! the tier or back to the device) and the entry of a model pinned at the current stage are
//! never evicted; the others go least recently used first. A model larger than the budget, or
//! one that would need protected entries evicted, is not stored (it reloads from its checkpoint,
//! else by rebuilding). Shrinking the budget evicts least recently used entries down to the new
//! budget, or refuses, changing nothing, when the protected entries alone exceed it.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

/// Which reservation an entry is: handed out by [`Tier::admit`], named by every later call
/// about that copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ticket(u64);

/// A reservation made: its ticket, and the entries evicted to make room (for the caller to drop).
#[derive(Debug)]
pub struct Admitted<T> {
    /// The reservation's ticket.
    pub ticket: Ticket,
    /// Entries evicted to make room.
    pub evicted: Vec<Evicted<T>>,
}

/// One model's place in the tier.
#[derive(Debug)]
struct Slot<T> {
    ticket: Ticket,
    bytes: u64,
    last_used: u64,
    leased: bool,
    /// `None` while the copy into the tier runs.
    copies: Option<T>,
}

/// The tier's entries under its budget.
#[derive(Debug)]
pub struct Tier<T> {
    budget: u64,
    clock: u64,
    /// The last ticket handed out.
    tickets: u64,
    slots: BTreeMap<String, Slot<T>>,
}

/// An entry evicted to make room: the caller drops its copy with the registry's lock let go.
#[derive(Debug)]
pub struct Evicted<T> {
    /// The model whose copy it was.
    pub model: String,
    /// Bytes it held.
    pub bytes: u64,
    /// Its copy (`None`: still being copied in).
    pub copies: Option<T>,
}

/// Why a model is not stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotStored {
    /// Its weights alone are more than the budget.
    LargerThanBudget {
        /// The model's bytes.
        bytes: u64,
        /// The tier's budget, bytes.
        budget: u64,
    },
    /// Evicting every unprotected entry would not free enough.
    NoRoom {
        /// The model's bytes.
        bytes: u64,
        /// Bytes free in the tier now.
        free: u64,
        /// Bytes eviction could free.
        evictable: u64,
    },
    /// The tier has an entry for it already (a copy in flight).
    AlreadyStored,
}

impl std::fmt::Display for NotStored {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use stageload_units::format_bytes as b;
        match self {
            NotStored::LargerThanBudget { bytes, budget } => {
                write!(f, "its {} are more than the host tier's budget of {}", b(*bytes), b(*budget))
            }
            NotStored::NoRoom { bytes, free, evictable } => write!(
                f,
                "the host tier has {} free and {} it may evict, short of the {} needed (the rest is leased or pinned)",
                b(*free),
                b(*evictable),
                b(*bytes)
            ),
            NotStored::AlreadyStored => write!(f, "a copy of it is already in the host tier"),
        }
    }
}

/// A budget the tier cannot shrink to: its protected entries alone hold more.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShrinkRefused {
    /// The budget asked for, bytes.
    pub asked: u64,
    /// Bytes the protected entries hold.
    pub protected: u64,
}

/// The tier's budget against the largest device model: the registry refuses a budget smaller
/// than a model it would hold.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierPlan {
    /// The tier's budget, bytes.
    pub budget: u64,
    /// The largest model placed on a device, with its bytes there.
    pub largest: Option<(String, u64)>,
}

impl TierPlan {
    /// A tier of `budget` for `pipeline`: its largest model the tier would hold (on a device, not
    /// streamed), sized as the plan sizes it (in the file's dtype, ignored entries left out).
    pub fn of(pipeline: &crate::Pipeline, budget: u64) -> TierPlan {
        // Ties go to the model listed first (`max_by_key` keeps the last, hence `rev`).
        let on_device = pipeline.models.iter().rev().filter(|m| m.tiered());
        TierPlan { budget, largest: on_device.max_by_key(|m| m.held()).map(|m| (m.name.clone(), m.held())) }
    }

    /// Whether the budget holds the largest device model.
    pub fn fits(&self) -> bool {
        self.largest.as_ref().is_none_or(|(_, bytes)| *bytes <= self.budget)
    }
}

impl<T> Tier<T> {
    /// An empty tier of `budget` bytes.
    pub fn new(budget: u64) -> Self {
        Tier { budget, clock: 0, tickets: 0, slots: BTreeMap::new() }
    }

    /// The budget, bytes.
    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// Bytes the entries hold (reserved ones included).
    pub fn used(&self) -> u64 {
        self.slots.values().fold(0u64, |sum, s| sum.saturating_add(s.bytes))
    }

    /// Whether `model` has a finished copy that nobody is using.
    pub fn ready(&self, model: &str) -> bool {
        self.slots.get(model).is_some_and(|s| s.copies.is_some() && !s.leased)
    }

    /// Reserves `bytes` for `model`'s copy (leased until [`fill`](Self::fill) or
    /// [`withdraw`](Self::withdraw)), evicting least recently used unprotected entries to make
    /// room. Returns the reservation's ticket and the evicted entries, for the caller to drop.
    pub fn admit(&mut self, model: &str, bytes: u64, protected: &BTreeSet<String>) -> Result<Admitted<T>, NotStored> {
        if self.slots.contains_key(model) {
            return Err(NotStored::AlreadyStored);
        }
        if bytes > self.budget {
            return Err(NotStored::LargerThanBudget { bytes, budget: self.budget });
        }
        let free = self.budget.saturating_sub(self.used());
        let victims = self.victims(bytes.saturating_sub(free), protected).ok_or_else(|| NotStored::NoRoom {
            bytes,
            free,
            evictable: self.evictable(protected).iter().map(|(_, b)| b).sum(),
        })?;
        let evicted = self.evict(&victims);
        self.clock += 1;
        self.tickets += 1;
        let ticket = Ticket(self.tickets);
        self.slots.insert(model.to_string(), Slot { ticket, bytes, last_used: self.clock, leased: true, copies: None });
        Ok(Admitted { ticket, evicted })
    }

    /// `model`'s entry when it is `ticket`'s.
    fn entry(&mut self, model: &str, ticket: Ticket) -> Option<&mut Slot<T>> {
        self.slots.get_mut(model).filter(|slot| slot.ticket == ticket)
    }

    /// Puts the finished copy into the reservation of `ticket`; gives it back when that
    /// reservation is gone (forgotten meanwhile, or the entry is another instance's now).
    pub fn fill(&mut self, model: &str, ticket: Ticket, copies: T) -> Option<T> {
        self.clock += 1;
        let clock = self.clock;
        match self.entry(model, ticket) {
            Some(slot) if slot.copies.is_none() => {
                slot.copies = Some(copies);
                slot.leased = false;
                slot.last_used = clock;
                None
            }
            _ => Some(copies),
        }
    }

    /// Leases `model`'s copy for a reload: the entry's ticket (for [`unlease`](Self::unlease)
    /// or [`withdraw`](Self::withdraw) when the reload ends) and the copy; `None` when it has no
    /// ready copy.
    pub fn lease(&mut self, model: &str) -> Option<(Ticket, &T)> {
        let slot = self.slots.get_mut(model).filter(|s| s.copies.is_some() && !s.leased)?;
        slot.leased = true;
        Some((slot.ticket, slot.copies.as_ref()?))
    }

    /// Ends the lease of `ticket` without taking the copy (a reload that failed): the entry
    /// stays, evictable. Changes nothing when the entry is not `ticket`'s.
    pub fn unlease(&mut self, model: &str, ticket: Ticket) {
        self.clock += 1;
        let clock = self.clock;
        if let Some(slot) = self.entry(model, ticket) {
            slot.leased = false;
            slot.last_used = clock;
        }
    }

    /// Removes the entry of `ticket` (its copy went back to the device, or its copy into the
    /// tier failed); returns the copy for the caller to drop. Changes nothing when the entry is
    /// not `ticket`'s.
    pub fn withdraw(&mut self, model: &str, ticket: Ticket) -> Option<T> {
        self.entry(model, ticket)?;
        self.slots.remove(model).and_then(|s| s.copies)
    }

    /// Removes `model`'s entry, whichever instance's it is (the model left the registry or was
    /// replaced); returns the copy for the caller to drop.
    pub fn forget(&mut self, model: &str) -> Option<T> {
        self.slots.remove(model).and_then(|s| s.copies)
    }

    /// Sets the budget to `bytes`, evicting least recently used unprotected entries down to it;
    /// refused, changing nothing, when the protected entries alone hold more.
    pub fn set_budget(&mut self, bytes: u64, protected: &BTreeSet<String>) -> Result<Vec<Evicted<T>>, ShrinkRefused> {
        let over = self.used().saturating_sub(bytes);
        let Some(victims) = self.victims(over, protected) else {
            let kept = self.slots.iter().filter(|(name, slot)| slot.leased || protected.contains(*name));
            return Err(ShrinkRefused { asked: bytes, protected: kept.map(|(_, s)| s.bytes).sum() });
        };
        self.budget = bytes;
        Ok(self.evict(&victims))
    }

    /// The unprotected entries, least recently used first, with their bytes.
    fn evictable(&self, protected: &BTreeSet<String>) -> Vec<(String, u64)> {
        let mut candidates: Vec<(&String, &Slot<T>)> =
            self.slots.iter().filter(|(name, slot)| !slot.leased && !protected.contains(*name)).collect();
        candidates.sort_by_key(|(_, slot)| slot.last_used);
        candidates.into_iter().map(|(name, slot)| (name.clone(), slot.bytes)).collect()
    }

    /// The least recently used unprotected entries that free at least `bytes`; `None` when all
    /// of them together do not.
    fn victims(&self, bytes: u64, protected: &BTreeSet<String>) -> Option<Vec<String>> {
        let mut freed = 0u64;
        let mut victims = Vec::new();
        for (name, size) in self.evictable(protected) {
            if freed >= bytes {
                break;
            }
            freed = freed.saturating_add(size);
            victims.push(name);
        }
        (freed >= bytes).then_some(victims)
    }

    /// Empties the tier (the registry closed); returns the copies for the caller to drop.
    pub fn clear(&mut self) -> Vec<T> {
        std::mem::take(&mut self.slots).into_values().filter_map(|s| s.copies).collect()
    }

    fn evict(&mut self, victims: &[String]) -> Vec<Evicted<T>> {
        let mut evicted = Vec::with_capacity(victims.len());
        for model in victims {
            if let Some(slot) = self.slots.remove(model) {
                evicted.push(Evicted { model: model.clone(), bytes: slot.bytes, copies: slot.copies });
            }
        }
        evicted
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn none() -> BTreeSet<String> {
        BTreeSet::new()
    }

    fn stored(tier: &mut Tier<()>, model: &str, bytes: u64) -> Vec<String> {
        let admitted = tier.admit(model, bytes, &none()).unwrap();
        assert_eq!(tier.fill(model, admitted.ticket, ()), None);
        admitted.evicted.into_iter().map(|e| e.model).collect()
    }

    /// Ends a lease of `model` that failed.
    fn lease_and_fail(tier: &mut Tier<()>, model: &str) {
        let (ticket, _) = tier.lease(model).unwrap();
        tier.unlease(model, ticket);
    }

    #[test]
    fn a_model_is_stored_while_the_budget_has_room_and_its_bytes_count_from_the_reservation() {
        let mut tier = Tier::<()>::new(100);
        let ticket = tier.admit("a", 60, &none()).unwrap().ticket;
        assert_eq!(tier.used(), 60, "reserved before the copy runs");
        assert!(!tier.ready("a"), "not usable while the copy runs");
        assert_eq!(tier.fill("a", ticket, ()), None);
        assert!(tier.ready("a"));
    }

    #[test]
    fn a_copy_of_a_replaced_instance_never_lands_in_the_new_instances_entry() {
        let mut tier = Tier::<&str>::new(100);
        let old = tier.admit("m", 10, &none()).unwrap().ticket;
        // The model is replaced during the copy (its entry forgotten), and the new instance is
        // released in turn: a new reservation of the same name.
        assert_eq!(tier.forget("m"), None);
        let new = tier.admit("m", 10, &none()).unwrap().ticket;
        assert_ne!(old, new);
        assert_eq!(tier.fill("m", old, "old weights"), Some("old weights"), "handed back to be dropped");
        assert!(!tier.ready("m"), "the new reservation still waits for its own copy");
        assert_eq!(tier.fill("m", new, "new weights"), None);
        assert_eq!(tier.lease("m").map(|(ticket, copies)| (ticket, *copies)), Some((new, "new weights")));
    }

    #[test]
    fn a_failed_copy_or_reload_of_another_instance_leaves_the_entry_alone() {
        let mut tier = Tier::<&str>::new(100);
        let old = tier.admit("m", 10, &none()).unwrap().ticket;
        tier.forget("m");
        let new = tier.admit("m", 10, &none()).unwrap().ticket;
        assert_eq!(tier.withdraw("m", old), None, "the old copy failed: not the new reservation");
        assert_eq!(tier.used(), 10);
        assert_eq!(tier.fill("m", new, "new"), None);
        let (leased, _) = tier.lease("m").unwrap();
        tier.unlease("m", old);
        assert!(!tier.ready("m"), "a stale unlease does not end the new lease");
        assert_eq!(tier.withdraw("m", old), None);
        tier.unlease("m", leased);
        assert!(tier.ready("m"));
        assert_eq!(tier.withdraw("m", new), Some("new"), "the entry's own ticket takes it");
        assert_eq!(tier.used(), 0);
    }

    #[test]
    fn the_least_recently_used_entries_are_evicted_to_make_room() {
        let mut tier = Tier::<()>::new(100);
        stored(&mut tier, "a", 40);
        stored(&mut tier, "b", 40);
        // "a" is used (a reload that failed keeps it and makes it recent): "b" is now the oldest.
        lease_and_fail(&mut tier, "a");
        assert_eq!(stored(&mut tier, "c", 50), ["b"]);
        assert_eq!(tier.used(), 90);
        assert_eq!(stored(&mut tier, "d", 100), ["a", "c"], "oldest first, as many as needed");
    }

    #[test]
    fn leased_and_pinned_entries_are_never_evicted() {
        let mut tier = Tier::<()>::new(100);
        stored(&mut tier, "pinned", 30);
        stored(&mut tier, "leased", 30);
        tier.lease("leased").unwrap();
        tier.admit("copying", 30, &none()).unwrap();
        let pins = BTreeSet::from(["pinned".to_string()]);
        let refused = tier.admit("new", 20, &pins).unwrap_err();
        assert_eq!(refused, NotStored::NoRoom { bytes: 20, free: 10, evictable: 0 });
        assert!(refused.to_string().contains("leased or pinned"), "{refused}");
        assert_eq!(tier.used(), 90, "nothing evicted by a refusal");
        // Unpinned, the oldest entry goes.
        let evicted = tier.admit("new", 20, &none()).unwrap().evicted;
        assert_eq!((evicted[0].model.as_str(), evicted[0].bytes, evicted.len()), ("pinned", 30, 1));
    }

    #[test]
    fn a_model_larger_than_the_budget_is_refused_naming_both_sizes() {
        let mut tier = Tier::<()>::new(1 << 20);
        let refused = tier.admit("big", 3 << 20, &none()).unwrap_err();
        assert_eq!(refused, NotStored::LargerThanBudget { bytes: 3 << 20, budget: 1 << 20 });
        assert!(refused.to_string().contains("3.0 MiB") && refused.to_string().contains("1.0 MiB"), "{refused}");
        assert_eq!(tier.used(), 0);
    }

    #[test]
    fn a_model_is_stored_once_and_a_lease_is_exclusive() {
        let mut tier = Tier::<()>::new(100);
        stored(&mut tier, "a", 10);
        assert_eq!(tier.admit("a", 10, &none()).unwrap_err(), NotStored::AlreadyStored);
        assert!(tier.lease("a").is_some());
        assert!(tier.lease("a").is_none(), "one reload at a time");
        assert!(!tier.ready("a"));
        assert_eq!(tier.forget("a"), Some(()));
        assert_eq!(tier.used(), 0);
        assert!(tier.lease("a").is_none());
    }

    #[test]
    fn a_copy_whose_reservation_was_forgotten_is_given_back() {
        let mut tier = Tier::<u32>::new(100);
        let ticket = tier.admit("a", 10, &none()).unwrap().ticket;
        assert_eq!(tier.forget("a"), None, "no copy yet");
        assert_eq!(tier.fill("a", ticket, 7), Some(7), "the caller drops it");
        assert_eq!(tier.used(), 0);
    }

    #[test]
    fn shrinking_evicts_down_to_the_new_budget_oldest_first() {
        let mut tier = Tier::<()>::new(100);
        for (name, bytes) in [("a", 30), ("b", 30), ("c", 30)] {
            stored(&mut tier, name, bytes);
        }
        let evicted: Vec<String> = tier.set_budget(50, &none()).unwrap().into_iter().map(|e| e.model).collect();
        assert_eq!(evicted, ["a", "b"]);
        assert_eq!((tier.budget(), tier.used()), (50, 30));
        assert!(tier.set_budget(1000, &none()).unwrap().is_empty(), "growing evicts nothing");
    }

    #[test]
    fn a_shrink_below_the_protected_entries_is_refused_and_changes_nothing() {
        let mut tier = Tier::<()>::new(100);
        stored(&mut tier, "a", 30);
        stored(&mut tier, "b", 30);
        tier.lease("b").unwrap();
        let refused = tier.set_budget(20, &none()).unwrap_err();
        assert_eq!(refused, ShrinkRefused { asked: 20, protected: 30 });
        assert_eq!((tier.budget(), tier.used()), (100, 60), "old budget kept, nothing evicted");
        assert!(tier.ready("a"));
    }

    #[test]
    fn a_budget_below_the_largest_device_model_does_not_fit() {
        let plan = |budget| TierPlan { budget, largest: Some(("flow".to_string(), 50)) };
        assert!(plan(50).fits());
        assert!(!plan(49).fits());
        assert!(TierPlan { budget: 0, largest: None }.fits(), "no device model: nothing to hold");
    }
}
