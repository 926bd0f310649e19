//! The host tier's bookkeeping: which released device models keep a copy of their weights in
//! host memory, under a byte budget. Pure and torch-free: the copies are a type parameter (`T`,
//! the host tensors in `stageload`'s registry, `()` where the plan counts what the tier holds
//! at each stage), the clock is a counter, and every decision — admit, evict, lease, shrink —
//! is a method that changes this state and returns what the caller must carry out (copies to
//! drop) once the registry's lock is let go. [`TierPlan`] checks a pipeline's budget against its
//! largest device model.
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

/// One model's place in the tier.
#[derive(Debug)]
struct Slot<T> {
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
    slots: BTreeMap<String, Slot<T>>,
}

/// An entry evicted to make room: the caller drops its copy with the registry's lock let go.
#[derive(Debug)]
pub struct Evicted<T> {
    pub model: String,
    pub bytes: u64,
    pub copies: Option<T>,
}

/// Why a model is not stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotStored {
    /// Its weights alone are more than the budget.
    LargerThanBudget { bytes: u64, budget: u64 },
    /// Evicting every unprotected entry would not free enough.
    NoRoom { bytes: u64, free: u64, evictable: u64 },
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
    pub asked: u64,
    pub protected: u64,
}

/// The tier's budget against the largest device model: the registry refuses a budget smaller
/// than a model it would hold.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierPlan {
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

    pub fn fits(&self) -> bool {
        self.largest.as_ref().is_none_or(|(_, bytes)| *bytes <= self.budget)
    }
}

impl<T> Tier<T> {
    pub fn new(budget: u64) -> Self {
        Tier { budget, clock: 0, slots: BTreeMap::new() }
    }

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
    /// [`forget`](Self::forget)), evicting least recently used unprotected entries to make room.
    /// Returns the evicted entries' names and copies, for the caller to drop.
    pub fn admit(
        &mut self,
        model: &str,
        bytes: u64,
        protected: &BTreeSet<String>,
    ) -> Result<Vec<Evicted<T>>, NotStored> {
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
        self.slots.insert(model.to_string(), Slot { bytes, last_used: self.clock, leased: true, copies: None });
        Ok(evicted)
    }

    /// Puts the finished copy of a model [`admit`](Self::admit) reserved; gives it back when the
    /// reservation was forgotten meanwhile.
    pub fn fill(&mut self, model: &str, copies: T) -> Option<T> {
        self.clock += 1;
        match self.slots.get_mut(model) {
            Some(slot) if slot.copies.is_none() => {
                slot.copies = Some(copies);
                slot.leased = false;
                slot.last_used = self.clock;
                None
            }
            _ => Some(copies),
        }
    }

    /// Leases `model`'s copy for a reload; `None` when it has no ready copy.
    pub fn lease(&mut self, model: &str) -> Option<&T> {
        let slot = self.slots.get_mut(model).filter(|s| s.copies.is_some() && !s.leased)?;
        slot.leased = true;
        slot.copies.as_ref()
    }

    /// Ends a lease without taking the copy (a reload that failed): the entry stays, evictable.
    pub fn unlease(&mut self, model: &str) {
        self.clock += 1;
        if let Some(slot) = self.slots.get_mut(model) {
            slot.leased = false;
            slot.last_used = self.clock;
        }
    }

    /// Removes `model`'s entry (its copy went back to the device, its copy into the tier failed,
    /// or the model left the registry); returns the copy for the caller to drop.
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
        let evicted = tier.admit(model, bytes, &none()).unwrap();
        assert_eq!(tier.fill(model, ()), None);
        evicted.into_iter().map(|e| e.model).collect()
    }

    #[test]
    fn a_model_is_stored_while_the_budget_has_room_and_its_bytes_count_from_the_reservation() {
        let mut tier = Tier::<()>::new(100);
        tier.admit("a", 60, &none()).unwrap();
        assert_eq!(tier.used(), 60, "reserved before the copy runs");
        assert!(!tier.ready("a"), "not usable while the copy runs");
        assert_eq!(tier.fill("a", ()), None);
        assert!(tier.ready("a"));
    }

    #[test]
    fn the_least_recently_used_entries_are_evicted_to_make_room() {
        let mut tier = Tier::<()>::new(100);
        stored(&mut tier, "a", 40);
        stored(&mut tier, "b", 40);
        // "a" is used (a reload that failed keeps it and makes it recent): "b" is now the oldest.
        tier.lease("a").unwrap();
        tier.unlease("a");
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
        let evicted = tier.admit("new", 20, &none()).unwrap();
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
        tier.admit("a", 10, &none()).unwrap();
        assert_eq!(tier.forget("a"), None, "no copy yet");
        assert_eq!(tier.fill("a", 7), Some(7), "the caller drops it");
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
