//! The order of a streamed block's memory between the stream that computes with it (the
//! forward's) and the side stream that refills it, kept by events on the streams, never by the
//! host waiting for the GPU (PyTorch's `recordStream` rule). A refill on CUDA takes its memory
//! from its side stream's pool ([`super::refill`]), where the allocator puts a freed block back
//! at once, although kernels the forward queued may still read it.
//!
//! Rules:
//!
//! 1. **A release leaves a fence.** Before a block's memory goes back to the allocator, a fence
//!    (an event) is recorded on the stream that used it, this thread's current one
//!    ([`FreeOrder::freed`]); the host does not wait for it.
//! 2. **A refill writes after every fence not yet passed.** A refill, once it has taken memory
//!    (which may be a block freed under rule 1), has its copy stream wait on each fence not yet
//!    passed before it writes ([`FreeOrder::before_write`]): the copy stream waits
//!    (`cudaStreamWaitEvent`), the host goes on. Taking the memory first and reading the fences
//!    after is what makes this whole: a release records its fence before it frees, so any memory
//!    the refill could have been given is behind a fence it sees.
//! 3. **A passed fence is forgotten.** Fences are queried (never waited for) whenever one is
//!    added or read; one that has passed orders nothing any more.
//! 4. **A refill ends with a fence the forward waits on.** The copy stream records a fence after
//!    the block's last copy ([`Filled`]); the forward's stream waits on it before the block's
//!    first kernel, so the forward's thread never waits for the copy either.
//! 5. **One order per process.** Every streamed model's refills take memory from the same pool
//!    of side streams, so every refill waits on every model's fences ([`cuda`]).
//!
//! On the CPU nothing is queued: releases free at once and nothing here is used.

use std::sync::{Arc, Mutex, OnceLock};

use crate::sync::lock;

/// A point in a stream's work.
pub(crate) trait Fence: Send + Sync + 'static {
    /// Whether the work before it is done: a query, never a wait.
    fn passed(&self) -> bool;
}

impl Fence for stageload_torch_sys::CudaEvent {
    fn passed(&self) -> bool {
        // A query that fails orders nothing new: keep the fence (the next wait on it reports).
        self.query().unwrap_or(false)
    }
}

/// The fences of freed memory not yet passed (rules 1–3).
pub(crate) struct FreeOrder<F: Fence> {
    pending: Mutex<Vec<Arc<F>>>,
}

impl<F: Fence> Default for FreeOrder<F> {
    fn default() -> Self {
        FreeOrder { pending: Mutex::new(Vec::new()) }
    }
}

impl<F: Fence> FreeOrder<F> {
    /// Rule 1: memory is about to be freed behind `fence` (recorded on the stream that used it).
    pub(crate) fn freed(&self, fence: F) {
        let mut pending = lock(&self.pending);
        pending.retain(|f| !f.passed());
        pending.push(Arc::new(fence));
    }

    /// Rule 2: the fences a refill's copy stream waits on before it writes into memory it has
    /// taken; the passed ones forgotten (rule 3). Never waits.
    pub(crate) fn before_write(&self) -> Vec<Arc<F>> {
        let mut pending = lock(&self.pending);
        pending.retain(|f| !f.passed());
        pending.clone()
    }

    /// How many fences are pending (not known to have passed).
    #[cfg(test)]
    pub(crate) fn pending(&self) -> usize {
        lock(&self.pending).len()
    }
}

/// The process's order of freed streamed-block memory on CUDA (rule 5).
pub(crate) fn cuda() -> &'static FreeOrder<stageload_torch_sys::CudaEvent> {
    static ORDER: OnceLock<FreeOrder<stageload_torch_sys::CudaEvent>> = OnceLock::new();
    ORDER.get_or_init(FreeOrder::default)
}

/// A refill done: the seconds its job took, and on CUDA the fence after its copies (rule 4),
/// which the forward's stream waits on before using the block.
pub(crate) struct Filled {
    pub(crate) seconds: f64,
    pub(crate) fence: Option<stageload_torch_sys::CudaEvent>,
}

impl Filled {
    /// A refill with nothing queued (the CPU, or a read on the host): done when its job returns.
    pub(crate) fn done(seconds: f64) -> Self {
        Filled { seconds, fence: None }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::Arc;

    use super::*;

    /// A fence passed when the test says so.
    struct FakeFence {
        id: usize,
        passed: Arc<AtomicBool>,
        queries: Arc<AtomicUsize>,
    }

    impl Fence for FakeFence {
        fn passed(&self) -> bool {
            self.queries.fetch_add(1, Ordering::SeqCst);
            self.passed.load(Ordering::SeqCst)
        }
    }

    /// What a stream was given, in order.
    #[derive(Debug, Clone, PartialEq)]
    enum Op {
        /// Wait on the device for fence `id`.
        Wait(usize),
        /// Write block memory `at`.
        Write(&'static str),
    }

    /// A copy stream: ops queued, run in order by [`FakeStream::run`] as far as the fences let
    /// them; the host never waits on it (it has no way to).
    #[derive(Default)]
    struct FakeStream {
        queued: Vec<Op>,
        ran: Vec<Op>,
    }

    impl FakeStream {
        /// Runs queued ops in order until a wait on a fence not passed.
        fn run(&mut self, passed: &dyn Fn(usize) -> bool) {
            while let Some(op) = self.queued.first().cloned() {
                if let Op::Wait(id) = op {
                    if !passed(id) {
                        return;
                    }
                }
                self.ran.push(self.queued.remove(0));
            }
        }
    }

    struct World {
        order: FreeOrder<FakeFence>,
        fences: Vec<Arc<AtomicBool>>,
        queries: Arc<AtomicUsize>,
    }

    impl World {
        fn new() -> Self {
            World { order: FreeOrder::default(), fences: Vec::new(), queries: Arc::default() }
        }

        /// A release: a fence on the forward's stream (not passed: its kernels are queued).
        fn release(&mut self) -> usize {
            let id = self.fences.len();
            let passed = Arc::new(AtomicBool::new(false));
            self.fences.push(Arc::clone(&passed));
            self.order.freed(FakeFence { id, passed, queries: Arc::clone(&self.queries) });
            id
        }

        /// A refill into `memory` on `stream`, as the real one queues it.
        fn refill(&self, stream: &mut FakeStream, memory: &'static str) {
            for fence in self.order.before_write() {
                stream.queued.push(Op::Wait(fence.id));
            }
            stream.queued.push(Op::Write(memory));
        }

        fn passed(&self) -> impl Fn(usize) -> bool + '_ {
            |id| self.fences[id].load(Ordering::SeqCst)
        }
    }

    #[test]
    fn a_freed_block_is_not_written_before_the_kernels_that_read_it_are_done() {
        let mut world = World::new();
        let mut copy = FakeStream::default();
        // Block A ran (its kernels queued on the forward's stream) and was released; the refill
        // of B was given A's memory.
        let a = world.release();
        world.refill(&mut copy, "A's memory");
        copy.run(&world.passed());
        assert!(copy.ran.is_empty(), "nothing written while A's kernels are queued: {:?}", copy.ran);
        assert_eq!(copy.queued, [Op::Wait(a), Op::Write("A's memory")], "the copy stream waits, in order");
        // A's kernels finish: the write runs, after the wait.
        world.fences[a].store(true, Ordering::SeqCst);
        copy.run(&world.passed());
        assert_eq!(copy.ran, [Op::Wait(a), Op::Write("A's memory")]);
    }

    #[test]
    fn memory_freed_behind_a_passed_fence_is_written_at_once_and_the_fence_forgotten() {
        let mut world = World::new();
        let a = world.release();
        world.fences[a].store(true, Ordering::SeqCst);
        let mut copy = FakeStream::default();
        world.refill(&mut copy, "A's memory");
        assert_eq!(copy.queued, [Op::Write("A's memory")], "no wait on a passed fence");
        assert_eq!(world.order.pending(), 0, "forgotten");
    }

    #[test]
    fn a_refill_waits_on_the_copy_stream_for_every_fence_not_passed_and_the_host_never_waits() {
        let mut world = World::new();
        let (a, b) = (world.release(), world.release());
        let c = world.release();
        world.fences[b].store(true, Ordering::SeqCst);
        let mut copy = FakeStream::default();
        world.refill(&mut copy, "memory");
        // The host queued the refill although no fence but b has passed: only queries were made.
        assert_eq!(copy.queued, [Op::Wait(a), Op::Wait(c), Op::Write("memory")]);
        assert!(world.queries.load(Ordering::SeqCst) > 0, "fences are queried");
        world.fences[c].store(true, Ordering::SeqCst);
        copy.run(&world.passed());
        assert!(copy.ran.is_empty(), "c passed, a not: still waiting on a");
        world.fences[a].store(true, Ordering::SeqCst);
        copy.run(&world.passed());
        assert_eq!(copy.ran.last(), Some(&Op::Write("memory")));
        assert_eq!(world.order.before_write().len(), 0);
    }
}
