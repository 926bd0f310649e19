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
//! 4. **Cancellation** (`close`, dropping the registry): background work waiting for the turn
//!    or paused gives up, and a background copy stops at its next piece.
//!
//! Nothing here is held while a model is built or read, except the turn itself (a flag); every
//! wait is on the one condition variable, with no other lock of the registry held.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use crate::checkpoint::PieceWait;
use crate::sync::lock;

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
    /// While the returned value lives, this load counts as not in progress: it waits for
    /// another load to fill storages it shares ([`super::fills`]), which may be a background
    /// copy that would otherwise pause for it.
    pub(crate) fn waiting(&self) -> Waiting<'_> {
        let mut state = self.0.state();
        state.foreground_loading = state.foreground_loading.saturating_sub(1);
        drop(state);
        self.0.changed.notify_all();
        Waiting(self.0)
    }
}

/// A foreground load waiting ([`ForegroundLoad::waiting`]); in progress again when dropped.
#[derive(Debug)]
pub(crate) struct Waiting<'a>(&'a Turns);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.state().foreground_loading += 1;
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

    /// Before each piece of a background copy that holds no turn: waits while a foreground load
    /// is in progress (unless the piece must not wait: it holds the pinned ring a foreground load
    /// to CUDA would wait for); `false` once the registry is cancelled (the copy stops).
    pub(crate) fn before_background_piece(&self, wait: PieceWait) -> bool {
        if wait == PieceWait::MustNot {
            return !self.cancelled();
        }
        self.no_foreground_load()
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
        assert!(turns.before_background_piece(PieceWait::May), "nothing in the foreground: go on");
        let load = turns.foreground_load();
        // A piece holding the pinned ring a foreground load to CUDA waits for never pauses.
        assert!(turns.before_background_piece(PieceWait::MustNot), "holding the ring: go on at once");
        let (done_tx, done) = mpsc::channel();
        let piece = {
            let (turns, done_tx) = (Arc::clone(&turns), done_tx.clone());
            std::thread::spawn(move || done_tx.send(turns.before_background_piece(PieceWait::May)).unwrap())
        };
        assert!(done.recv_timeout(Duration::from_millis(200)).is_err(), "paused while the foreground loads");
        drop(load);
        assert_eq!(done.recv_timeout(DEADLINE), Ok(true), "resumed");
        piece.join().unwrap();

        let _load = turns.foreground_load();
        let piece = {
            let turns = Arc::clone(&turns);
            std::thread::spawn(move || done_tx.send(turns.before_background_piece(PieceWait::May)).unwrap())
        };
        turns.cancel();
        assert_eq!(done.recv_timeout(DEADLINE), Ok(false), "cancelled: the copy stops");
        assert!(!turns.before_background_piece(PieceWait::MustNot), "cancelled: it stops holding the ring too");
        piece.join().unwrap();
        assert!(!turns.take(Who::Background), "cancelled: no background build begins");
        assert!(BuildHold::new(&turns, Who::Foreground).unwrap().holds_turn(), "a foreground build still can");
        assert_eq!(BuildHold::new(&turns, Who::Background).unwrap_err(), Cancelled);
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
