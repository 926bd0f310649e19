//! Who builds and reads next: the build turn, foreground loads before background ones, and the
//! registry's cancellation. One owner, [`Turns`], with its state private behind one lock.
//!
//! The rules:
//!
//! 1. **The build turn** is held by one build at a time, for what needs it: a foreground build's
//!    loader run (it saves, draws from and restores the process-wide generators, see
//!    [`crate::rng`]), and any build from the moment its loader asks for a shared component
//!    ([`super::BuildContext::shared`]) to its end (a component made by one build is filled by
//!    that build's checkpoint copy; no other build may see it half filled). A foreground build
//!    that made or used no shared component gives the turn back once its loader has run and the
//!    generators are restored: its checkpoint copy runs without it.
//! 2. **Foreground first.** A prefetch's build draws nothing (it is built without random
//!    initialisation, [`super::decide::Slot::prefetch`]), so its loader runs without the turn,
//!    beside whatever the foreground does; it takes the turn only for shared components, and
//!    then only when no foreground build holds it or waits for it. Prefetches load one at a
//!    time, in the order they were asked for (their list, [`super::prefetch`]), so that they
//!    do not pile onto the cores the current stage computes on, and a background build begins
//!    only while no foreground load runs: a loader's run (a TorchScript file's read) cannot
//!    pause.
//! 3. **Background copies pause.** While a foreground load (a build or a refill for the current
//!    stage) is in progress, a background checkpoint copy that holds no turn waits at its next
//!    piece boundary (a read of at most 4 MiB, or a converted window of 16) and resumes when the
//!    foreground loads are done: the foreground's reads get the disk and the cores. A background copy holding the turn
//!    (shared components) is not paused: a foreground build may be waiting for that turn. A
//!    foreground load that waits for a background copy to fill storages they share counts as
//!    not loading while it waits ([`super::fills`]), so that copy goes on (and a background
//!    build may begin meanwhile).
//! 4. **Paced while nothing waits for it.** A background copy into CPU memory where the stage's
//!    compute has no core to spare ([`PrefetchPace`]) goes at a quarter of one core while no
//!    foreground call waits for a background load: after each piece a reader pauses until the
//!    copy's readers together have used at most a quarter of the time of one core
//!    ([`pause_after`], counted in the reader's own CPU time, so that a piece waiting on the
//!    disk is not paced for the wait). Once the foreground waits for a prefetched model (a `get`
//!    of a model loading in the background, a wait for storages a background copy fills,
//!    `wait_prefetch`, a removal or insertion waiting for a load to end), the pause ends and the
//!    copy goes at full speed: what the foreground waits for is all there is to do. On this
//!    2-core machine a full-speed copy beside a two-thread compute made it 1.17-1.29x slower, a
//!    quarter-core one 0.99-1.16x (two runs), and in the cascade every stage computed faster
//!    beside the paced copy than beside the full-speed one (`traces/prefetch/pace/`).
//! 5. **Cancellation** (`close`, dropping the registry): background work waiting for the turn
//!    or paused gives up, and a background copy stops at its next piece.
//!
//! Nothing here is held while a model is built or read, except the turn itself (a flag); every
//! wait is on the one condition variable, with no other lock of the registry held.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::ThreadId;
use std::time::{Duration, Instant};

use crate::checkpoint::PieceWait;
use crate::sync::{lock, wait_timeout};

/// A paced background copy's readers together use at most one core's time divided by this
/// (rule 4 of the module docs).
const PACED_SHARE: u32 = 4;

/// How a prefetch's checkpoint copy into CPU memory goes while no foreground call waits for a
/// background load ([`StagedModelsBuilder::prefetch_pace`](super::StagedModelsBuilder::prefetch_pace)).
/// A paced copy's readers pause after each piece so that together they use at most a quarter
/// of one core's time; a copy to CUDA is never paced (its pieces are DMA beside the device's
/// compute).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PrefetchPace {
    /// Paced where the compute has no core to spare: torch's intra-op threads
    /// (`tch::get_num_threads`) as many as the cores, or more.
    #[default]
    Auto,
    /// Never paced: the copy takes whatever the scheduler gives its threads (at the lowest
    /// priority).
    Full,
    /// Always paced.
    Paced,
}

impl PrefetchPace {
    /// Whether a background copy paces itself: into CPU memory (`to_cpu`) with `compute_threads`
    /// intra-op threads on `cores` cores.
    pub fn paces(self, to_cpu: bool, compute_threads: usize, cores: usize) -> bool {
        to_cpu
            && match self {
                PrefetchPace::Auto => compute_threads >= cores,
                PrefetchPace::Full => false,
                PrefetchPace::Paced => true,
            }
    }

    const NAMES: [(&'static str, PrefetchPace); 3] =
        [("auto", PrefetchPace::Auto), ("full", PrefetchPace::Full), ("paced", PrefetchPace::Paced)];
}

impl std::fmt::Display for PrefetchPace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = PrefetchPace::NAMES.iter().find(|(_, pace)| pace == self).map_or("auto", |(name, _)| name);
        f.write_str(name)
    }
}

/// A prefetch pace that is none of `auto`, `full` and `paced`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown prefetch pace {0:?}: give auto, full or paced")]
pub struct UnknownPace(pub String);

impl std::str::FromStr for PrefetchPace {
    type Err = UnknownPace;

    fn from_str(text: &str) -> Result<Self, UnknownPace> {
        PrefetchPace::NAMES
            .iter()
            .find(|(name, _)| *name == text)
            .map(|(_, pace)| *pace)
            .ok_or_else(|| UnknownPace(text.to_string()))
    }
}

/// The pause after a piece that took `cpu` of one of `readers` paced readers' CPU time: long
/// enough that the readers together use at most 1/[`PACED_SHARE`] of one core.
pub(crate) fn pause_after(cpu: Duration, readers: usize) -> Duration {
    let per_reader = u32::try_from(readers.max(1)).unwrap_or(u32::MAX).saturating_mul(PACED_SHARE);
    cpu.saturating_mul(per_reader.saturating_sub(1))
}

/// One paced background copy: the CPU time each of its reader threads had when it last went on
/// (so the next call knows what its piece cost).
#[derive(Debug)]
pub(crate) struct Pacer {
    readers: usize,
    went_on: Mutex<HashMap<ThreadId, Duration>>,
}

impl Pacer {
    /// A pacer for a copy read by at most `readers` threads at once.
    pub(crate) fn new(readers: usize) -> Self {
        Pacer { readers, went_on: Mutex::new(HashMap::new()) }
    }

    /// The pause this thread owes for the piece it read since it last went on (none for its
    /// first, or where the thread's CPU clock cannot be read).
    fn pause(&self) -> Duration {
        let Some(now) = thread_cpu_time() else { return Duration::ZERO };
        match lock(&self.went_on).get(&std::thread::current().id()) {
            Some(&then) => pause_after(now.saturating_sub(then), self.readers),
            None => Duration::ZERO,
        }
    }

    /// This thread goes on to its next piece now.
    fn went_on(&self) {
        if let Some(now) = thread_cpu_time() {
            lock(&self.went_on).insert(std::thread::current().id(), now);
        }
    }
}

/// The CPU time the calling thread has used (user and system).
fn thread_cpu_time() -> Option<Duration> {
    let time = nix::time::clock_gettime(nix::time::ClockId::CLOCK_THREAD_CPUTIME_ID).ok()?;
    Some(Duration::from(time))
}

/// Whose load it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Who {
    /// A load for the current stage (`get`, `load`).
    Foreground,
    /// A prefetch's load, on its own thread.
    Background,
}

#[derive(Debug, Default)]
struct TurnState {
    /// A build holds the turn.
    held: bool,
    /// Foreground builds waiting for the turn.
    foreground_waiting: usize,
    /// Foreground loads in progress (from their start to their end, waiting for the turn
    /// included; waiting for another load's fill of storages they share not included).
    foreground_loading: usize,
    /// Foreground calls waiting for a background load now: paced copies go at full speed.
    awaited: usize,
}

/// The build turn, the foreground's loads and the registry's cancellation (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct Turns {
    state: Mutex<TurnState>,
    changed: Condvar,
    cancelled: AtomicBool,
}

/// A foreground load in progress, until dropped: background copies pause meanwhile.
#[derive(Debug)]
pub(crate) struct ForegroundLoad<'a>(&'a Turns);

impl Drop for ForegroundLoad<'_> {
    fn drop(&mut self) {
        let mut state = self.0.state();
        state.foreground_loading = state.foreground_loading.saturating_sub(1);
        drop(state);
        self.0.changed.notify_all();
    }
}

impl ForegroundLoad<'_> {
    /// While the returned value lives, this load counts as not in progress and as waiting for
    /// a background load: it waits for another load to fill storages it shares
    /// ([`super::fills`]), which may be a background copy that would otherwise pause for it.
    pub(crate) fn waiting(&self) -> Waiting<'_> {
        let mut state = self.0.state();
        state.foreground_loading = state.foreground_loading.saturating_sub(1);
        drop(state);
        Waiting { _awaiting: self.0.awaiting(), turns: self.0 }
    }
}

/// A foreground load waiting ([`ForegroundLoad::waiting`]); in progress again when dropped.
#[derive(Debug)]
pub(crate) struct Waiting<'a> {
    _awaiting: Awaiting<'a>,
    turns: &'a Turns,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.turns.state().foreground_loading += 1;
    }
}

/// A foreground call waiting for a background load, until dropped: paced copies go at full
/// speed meanwhile (rule 4 of the module docs).
#[derive(Debug)]
pub(crate) struct Awaiting<'a>(&'a Turns);

impl Drop for Awaiting<'_> {
    fn drop(&mut self) {
        let mut state = self.0.state();
        state.awaited = state.awaited.saturating_sub(1);
    }
}

impl Turns {
    fn state(&self) -> MutexGuard<'_, TurnState> {
        lock(&self.state)
    }

    /// Marks a foreground load in progress until the returned value drops.
    pub(crate) fn foreground_load(&self) -> ForegroundLoad<'_> {
        self.state().foreground_loading += 1;
        ForegroundLoad(self)
    }

    /// Marks a foreground call waiting for a background load until the returned value drops:
    /// paced copies end their pause now.
    pub(crate) fn awaiting(&self) -> Awaiting<'_> {
        self.state().awaited += 1;
        self.changed.notify_all();
        Awaiting(self)
    }

    /// Waits for the build turn and takes it: a foreground build as soon as it is free; a
    /// background one once it is free and no foreground build waits for it, giving up with
    /// `false` once the registry is cancelled. [`Turns::give_back`] ends it.
    fn take(&self, who: Who) -> bool {
        let mut state = self.state();
        if who == Who::Foreground {
            state.foreground_waiting += 1;
        }
        loop {
            if who == Who::Background && self.cancelled() {
                return false;
            }
            if !state.held && (who == Who::Foreground || state.foreground_waiting == 0) {
                if who == Who::Foreground {
                    state.foreground_waiting -= 1;
                }
                state.held = true;
                return true;
            }
            state = crate::sync::wait(&self.changed, state);
        }
    }

    /// Waits until no foreground load runs (a build that begins beside one could not pause
    /// where a copy can); `false` once the registry is cancelled.
    fn no_foreground_load(&self) -> bool {
        let mut state = self.state();
        while state.foreground_loading > 0 && !self.cancelled() {
            state = crate::sync::wait(&self.changed, state);
        }
        !self.cancelled()
    }

    /// Ends the turn [`Turns::take`] gave.
    fn give_back(&self) {
        self.state().held = false;
        self.changed.notify_all();
    }

    /// Before each piece of a background copy that holds no turn: a `pacer`'s copy pauses for
    /// the piece before while no foreground call waits for a background load, then any copy
    /// waits while a foreground load is in progress (unless the piece must not wait: it holds
    /// the pinned ring a foreground load to CUDA would wait for); `false` once the registry is
    /// cancelled (the copy stops).
    pub(crate) fn before_background_piece(&self, wait: PieceWait, pacer: Option<&Pacer>) -> bool {
        if wait == PieceWait::MustNot {
            return !self.cancelled();
        }
        if let Some(pacer) = pacer {
            self.pace(pacer.pause());
        }
        let go_on = self.no_foreground_load();
        if let Some(pacer) = pacer {
            pacer.went_on();
        }
        go_on
    }

    /// Waits `pause`, or less: until a foreground call waits for a background load or the
    /// registry is cancelled.
    fn pace(&self, pause: Duration) {
        let until = Instant::now() + pause;
        let mut state = self.state();
        while state.awaited == 0 && !self.cancelled() {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            state = wait_timeout(&self.changed, state, left);
        }
    }

    /// Whether the registry closed or dropped.
    pub(crate) fn cancelled(&self) -> bool {
        self.cancelled.load(Ordering::SeqCst)
    }

    /// Cancels background work (`close`, dropping the registry): sets the flag, then wakes every
    /// waiter. The flag is checked under the lock its waiters wait with, and the lock is taken
    /// here after the flag is set, so no wake-up is lost.
    pub(crate) fn cancel(&self) {
        self.cancelled.store(true, Ordering::SeqCst);
        drop(self.state());
        self.changed.notify_all();
    }
}

/// One build's hold on the turn (rule 1 and 2 of the module docs): a foreground build takes the
/// turn at its start and gives it back once its loader has run ([`BuildHold::loader_done`]); a
/// background build has no turn until its loader asks for a shared component. Either keeps the
/// turn from its first shared component to the build's end.
#[derive(Debug)]
pub(crate) struct BuildHold {
    turns: Arc<Turns>,
    /// The build holds the turn.
    turn: Mutex<bool>,
    /// The loader asked for a shared component.
    shared: AtomicBool,
}

/// The registry closed or dropped while a background build waited for the turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the registry closed while this background build waited for its turn")]
pub(crate) struct Cancelled;

impl BuildHold {
    /// A build's hold: a foreground build waits for the turn here, a background one until no
    /// foreground load runs (giving up once the registry is cancelled).
    pub(crate) fn new(turns: &Arc<Turns>, who: Who) -> Result<Self, Cancelled> {
        let turn = match who {
            Who::Foreground => turns.take(Who::Foreground),
            Who::Background if turns.no_foreground_load() => false,
            Who::Background => return Err(Cancelled),
        };
        Ok(BuildHold { turns: Arc::clone(turns), turn: Mutex::new(turn), shared: AtomicBool::new(false) })
    }

    /// Before the loader touches the shared components: the build holds the turn from now on
    /// to its end (a background build waits for it here).
    pub(crate) fn for_shared(&self) -> Result<(), Cancelled> {
        self.shared.store(true, Ordering::SeqCst);
        let mut turn = lock(&self.turn);
        if !*turn {
            *turn = self.turns.take(Who::Background);
        }
        if *turn {
            Ok(())
        } else {
            Err(Cancelled)
        }
    }

    /// The loader has run and the generators are restored: a build that asked for no shared
    /// component gives the turn back (its checkpoint copy needs none).
    pub(crate) fn loader_done(&self) {
        if !self.shared.load(Ordering::SeqCst) {
            self.give_back();
        }
    }

    /// Whether the build holds the turn now.
    pub(crate) fn holds_turn(&self) -> bool {
        *lock(&self.turn)
    }

    fn give_back(&self) {
        if std::mem::take(&mut *lock(&self.turn)) {
            self.turns.give_back();
        }
    }
}

impl Drop for BuildHold {
    fn drop(&mut self) {
        self.give_back();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::Duration;

    const DEADLINE: Duration = Duration::from_secs(10);

    #[test]
    fn a_waiting_foreground_build_goes_before_a_waiting_background_one() {
        let turns = Arc::new(Turns::default());
        assert!(turns.take(Who::Foreground));
        let (order_tx, order) = mpsc::channel();
        let spawn = |who: Who, name: &'static str| {
            let (turns, order_tx) = (Arc::clone(&turns), order_tx.clone());
            std::thread::spawn(move || {
                assert!(turns.take(who));
                order_tx.send(name).unwrap();
                turns.give_back();
            })
        };
        let background = spawn(Who::Background, "background");
        let foreground = spawn(Who::Foreground, "foreground");
        let deadline = std::time::Instant::now() + DEADLINE;
        while turns.state().foreground_waiting == 0 {
            assert!(std::time::Instant::now() < deadline, "the foreground build never waited");
            std::thread::yield_now();
        }
        assert!(order.try_recv().is_err(), "nobody builds while the turn is held");
        turns.give_back();
        assert_eq!(order.recv_timeout(DEADLINE), Ok("foreground"));
        assert_eq!(order.recv_timeout(DEADLINE), Ok("background"));
        foreground.join().unwrap();
        background.join().unwrap();
    }

    #[test]
    fn a_background_piece_waits_for_the_foreground_loads_unless_it_holds_the_ring_and_cancellation_ends_the_wait() {
        let turns = Arc::new(Turns::default());
        assert!(turns.before_background_piece(PieceWait::May, None), "nothing in the foreground: go on");
        let load = turns.foreground_load();
        // A piece holding the pinned ring a foreground load to CUDA waits for never pauses.
        assert!(turns.before_background_piece(PieceWait::MustNot, None), "holding the ring: go on at once");
        let (done_tx, done) = mpsc::channel();
        let piece = {
            let (turns, done_tx) = (Arc::clone(&turns), done_tx.clone());
            std::thread::spawn(move || done_tx.send(turns.before_background_piece(PieceWait::May, None)).unwrap())
        };
        assert!(done.recv_timeout(Duration::from_millis(200)).is_err(), "paused while the foreground loads");
        drop(load);
        assert_eq!(done.recv_timeout(DEADLINE), Ok(true), "resumed");
        piece.join().unwrap();

        let _load = turns.foreground_load();
        let piece = {
            let turns = Arc::clone(&turns);
            std::thread::spawn(move || done_tx.send(turns.before_background_piece(PieceWait::May, None)).unwrap())
        };
        turns.cancel();
        assert_eq!(done.recv_timeout(DEADLINE), Ok(false), "cancelled: the copy stops");
        assert!(!turns.before_background_piece(PieceWait::MustNot, None), "cancelled: it stops holding the ring too");
        piece.join().unwrap();
        assert!(!turns.take(Who::Background), "cancelled: no background build begins");
        assert!(BuildHold::new(&turns, Who::Foreground).unwrap().holds_turn(), "a foreground build still can");
        assert_eq!(BuildHold::new(&turns, Who::Background).unwrap_err(), Cancelled);
    }

    #[test]
    fn a_paced_copy_owes_three_times_its_cpu_time_per_reader_and_paces_only_into_cpu_memory_with_no_core_to_spare() {
        let ms = Duration::from_millis;
        assert_eq!(pause_after(ms(2), 1), ms(6), "one reader: a quarter of a core");
        assert_eq!(pause_after(ms(2), 4), ms(30), "four readers: a sixteenth each");
        assert_eq!(pause_after(ms(2), 0), ms(6), "no reader counted: as one");
        assert_eq!(pause_after(Duration::MAX, 8), Duration::MAX, "saturates");
        assert_eq!(pause_after(Duration::ZERO, 8), Duration::ZERO);
        // (pace, into CPU memory, compute threads, cores) → paced
        for (pace, to_cpu, threads, cores, paced) in [
            (PrefetchPace::Auto, true, 2, 2, true),
            (PrefetchPace::Auto, true, 4, 2, true),
            (PrefetchPace::Auto, true, 1, 2, false),
            (PrefetchPace::Auto, false, 2, 2, false),
            (PrefetchPace::Full, true, 2, 2, false),
            (PrefetchPace::Paced, true, 1, 16, true),
            (PrefetchPace::Paced, false, 1, 16, false),
        ] {
            assert_eq!(pace.paces(to_cpu, threads, cores), paced, "{pace} to_cpu={to_cpu} {threads}/{cores}");
        }
        for pace in [PrefetchPace::Auto, PrefetchPace::Full, PrefetchPace::Paced] {
            assert_eq!(pace.to_string().parse::<PrefetchPace>(), Ok(pace));
        }
        assert_eq!("fast".parse::<PrefetchPace>(), Err(UnknownPace("fast".into())));
    }

    /// Spins until this thread has used `cpu` more CPU time (or the deadline passed).
    fn spin(cpu: Duration) {
        let (start, deadline) = (thread_cpu_time().unwrap(), Instant::now() + DEADLINE);
        while thread_cpu_time().unwrap() < start + cpu && Instant::now() < deadline {
            std::hint::black_box((0..1000u64).sum::<u64>());
        }
    }

    #[test]
    fn a_paced_piece_waits_out_its_pause_until_the_foreground_awaits_a_background_load_or_the_registry_closes() {
        let turns = Arc::new(Turns::default());
        // 64 readers: each owes 255 times its CPU time, 12.75 s after a 50 ms piece.
        let pacer = Arc::new(Pacer::new(64));
        let (spun_tx, spun) = mpsc::channel();
        let (done_tx, done) = mpsc::channel();
        let reader = {
            let (turns, pacer) = (Arc::clone(&turns), Arc::clone(&pacer));
            std::thread::spawn(move || {
                assert!(turns.before_background_piece(PieceWait::May, Some(&pacer)), "the first piece owes nothing");
                for _ in 0..3 {
                    spin(Duration::from_millis(50));
                    spun_tx.send(()).unwrap();
                    done_tx.send(turns.before_background_piece(PieceWait::May, Some(&pacer))).unwrap();
                }
            })
        };
        spun.recv_timeout(DEADLINE).unwrap();
        assert!(done.recv_timeout(Duration::from_millis(200)).is_err(), "paused: nothing waits for it");
        let awaiting = turns.awaiting();
        assert_eq!(done.recv_timeout(DEADLINE), Ok(true), "the foreground awaits a background load: on at once");
        spun.recv_timeout(DEADLINE).unwrap();
        assert_eq!(done.recv_timeout(DEADLINE), Ok(true), "still awaited: no pause");
        drop(awaiting);
        spun.recv_timeout(DEADLINE).unwrap();
        assert!(done.recv_timeout(Duration::from_millis(200)).is_err(), "paused again");
        turns.cancel();
        assert_eq!(done.recv_timeout(DEADLINE), Ok(false), "cancelled: the copy stops");
        reader.join().unwrap();
        // A load waiting for a background copy's fill awaits it too.
        let load = turns.foreground_load();
        let waiting = load.waiting();
        assert_eq!(turns.state().awaited, 1);
        drop(waiting);
        let state = turns.state();
        assert_eq!((state.awaited, state.foreground_loading), (0, 1));
    }

    #[test]
    fn a_build_holds_the_turn_through_its_loader_and_from_its_first_shared_component_to_its_end() {
        let turns = Arc::new(Turns::default());
        let foreground = BuildHold::new(&turns, Who::Foreground).unwrap();
        assert!(foreground.holds_turn());
        foreground.loader_done();
        assert!(!foreground.holds_turn(), "no shared component: its copy runs without the turn");
        let background = BuildHold::new(&turns, Who::Background).unwrap();
        assert!(!background.holds_turn(), "a background loader runs without it");
        background.for_shared().unwrap();
        background.loader_done();
        assert!(background.holds_turn(), "kept to the build's end");
        drop(background);
        assert!(!turns.state().held, "given back at its end");
        // A background build begins only once the foreground's loads are done.
        let load = turns.foreground_load();
        let (began_tx, began) = mpsc::channel();
        let waiting = {
            let turns = Arc::clone(&turns);
            std::thread::spawn(move || {
                let hold = BuildHold::new(&turns, Who::Background).map(|_| ());
                began_tx.send(()).unwrap();
                hold
            })
        };
        assert!(began.recv_timeout(Duration::from_millis(200)).is_err(), "not begun beside a foreground load");
        drop(load);
        assert_eq!(began.recv_timeout(DEADLINE), Ok(()), "begun once it ended");
        assert_eq!(waiting.join().unwrap(), Ok(()));
        let shared = BuildHold::new(&turns, Who::Foreground).unwrap();
        shared.for_shared().unwrap();
        shared.loader_done();
        assert!(shared.holds_turn());
    }
}
