//! What prefetches go by (whether each `enter` prefetches the next stage, the prefetch budget,
//! each stage's working memory) and the threads they run on; the prefetches themselves are
//! [`super::prefetch`]'s.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::thread::JoinHandle;

use super::turn::PrefetchPace;
use crate::sync::lock;

/// What prefetches go by, and the threads they run on (joined when the registry drops).
pub(crate) struct Background {
    /// After each `enter`, prefetch the next stage of the plan.
    next: bool,
    /// Prefetch only while the resident weights, the stage's working memory and the prefetched
    /// ones stay within this.
    budget: Option<u64>,
    /// Working memory per stage (declared or measured), left free by a prefetch.
    stage_working: BTreeMap<String, u64>,
    /// How a prefetch's copy into CPU memory goes while nothing waits for it.
    pace: PrefetchPace,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl Background {
    pub(crate) fn new(
        next: bool,
        budget: Option<u64>,
        stage_working: BTreeMap<String, u64>,
        pace: PrefetchPace,
    ) -> Self {
        Background { next, budget, stage_working, pace, threads: Mutex::new(Vec::new()) }
    }

    /// How a prefetch's copy into CPU memory goes while nothing waits for it.
    pub(crate) fn pace(&self) -> PrefetchPace {
        self.pace
    }

    /// Whether each `enter` prefetches the next stage.
    pub(crate) fn after_enter(&self) -> bool {
        self.next
    }

    /// The prefetch budget, if any.
    pub(crate) fn budget(&self) -> Option<u64> {
        self.budget
    }

    /// The working memory of `stage` (0 when none is declared or measured, or no stage).
    pub(crate) fn working_of(&self, stage: Option<&str>) -> u64 {
        stage.and_then(|s| self.stage_working.get(s)).copied().unwrap_or(0)
    }

    /// Keeps a prefetch thread's handle, for the drop to join; those that ended are let go.
    pub(crate) fn track(&self, handle: JoinHandle<()>) {
        let mut threads = lock(&self.threads);
        threads.retain(|h| !h.is_finished());
        threads.push(handle);
    }

    /// The prefetch threads started so far, for the registry's drop to join.
    pub(crate) fn take_threads(&self) -> Vec<JoinHandle<()>> {
        std::mem::take(&mut *lock(&self.threads))
    }
}
