//! The host tier as the plan sees it: which released device models hold a copy in host memory
//! at each stage, under the pipeline's `host_tier` budget, least recently released evicted first
//! (the registry's rule, `stageload::StagedModels` with `host_tier`). A model that comes back
//! from the tier reads nothing from disk; the copies are host memory the stage needs.

use serde::{Deserialize, Serialize};

/// What the tier holds along the run, released first and evicted first.
#[derive(Debug, Clone, Default)]
pub struct TierRun {
    budget: u64,
    held: Vec<(String, u64)>,
}

impl TierRun {
    pub fn new(budget: u64) -> Self {
        TierRun { budget, held: Vec::new() }
    }

    /// A device model of `bytes` released: stored if it fits the budget at all, evicting the
    /// oldest copies to make room.
    pub fn release(&mut self, model: &str, bytes: u64) {
        if bytes > self.budget || self.held.iter().any(|(m, _)| m == model) {
            return;
        }
        while self.used().saturating_add(bytes) > self.budget && !self.held.is_empty() {
            self.held.remove(0);
        }
        self.held.push((model.to_string(), bytes));
    }

    /// `model` loads again: whether it comes back from the tier (its copy then leaves it).
    pub fn reload(&mut self, model: &str) -> bool {
        let position = self.held.iter().position(|(m, _)| m == model);
        position.map(|p| self.held.remove(p)).is_some()
    }

    /// Host bytes the copies hold.
    pub fn used(&self) -> u64 {
        self.held.iter().fold(0u64, |sum, (_, bytes)| sum.saturating_add(*bytes))
    }

    /// The models with a copy, oldest first.
    pub fn models(&self) -> Vec<String> {
        self.held.iter().map(|(m, _)| m.clone()).collect()
    }
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
    pub fn fits(&self) -> bool {
        self.largest.as_ref().is_none_or(|(_, bytes)| *bytes <= self.budget)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn released_models_are_held_until_the_budget_evicts_the_oldest() {
        let mut tier = TierRun::new(100);
        tier.release("a", 40);
        tier.release("b", 40);
        tier.release("c", 40);
        assert_eq!((tier.models(), tier.used()), (vec!["b".to_string(), "c".to_string()], 80));
        tier.release("huge", 101);
        assert_eq!(tier.used(), 80, "a model larger than the budget is not held and evicts nothing");
    }

    #[test]
    fn a_model_that_comes_back_from_the_tier_leaves_it() {
        let mut tier = TierRun::new(100);
        tier.release("a", 40);
        assert!(tier.reload("a"));
        assert!(!tier.reload("a"), "the copy went back to the device");
        assert_eq!(tier.used(), 0);
    }

    #[test]
    fn a_budget_below_the_largest_device_model_does_not_fit() {
        let plan = |budget| TierPlan { budget, largest: Some(("flow".to_string(), 50)) };
        assert!(plan(50).fits());
        assert!(!plan(49).fits());
        assert!(TierPlan { budget: 0, largest: None }.fits(), "no device model: nothing to hold");
    }
}
