//! Stopping the command: SIGTERM and SIGCONT to every member, up to the grace for them to go (cut
//! short by another signal to the guard), SIGKILL to what is left, then a bounded wait for it.
//!
//! Written over [`Group`], so the escalation has fast unit tests with a scripted group and a fake
//! clock beside the real-process tests of [`crate::supervise`]. Every deadline is a saturating
//! sum, so no grace can make a stop panic half-way.

use std::time::Duration;

use nix::sys::signal::Signal;

use crate::machine::{Clock, Readings};
use crate::signals::Signals;

/// The running command as a stop sees it.
pub trait Group {
    /// The pids of the command's live processes now (the real group also notes the leader's
    /// exit and reaps exited orphans on the way).
    fn alive(&mut self, readings: &mut dyn Readings) -> Vec<i32>;
    /// Sends `signal` to the command's process group and to the live members outside it that
    /// the last [`alive`](Group::alive) saw.
    fn send(&mut self, signal: Signal);
}

/// How a stop ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Ending {
    /// Everyone was gone within the grace (or was gone already).
    Terminated,
    /// SIGKILL was needed, and everyone went.
    Killed,
    /// These were still there [`AFTER_KILL`] after SIGKILL (uninterruptible sleep); the guard
    /// moves on.
    Unkillable(Vec<i32>),
}

/// How long processes get to go after SIGKILL before the guard reports them and moves on.
pub const AFTER_KILL: Duration = Duration::from_secs(10);
/// How often a stop looks whether everyone has gone.
const POLL: Duration = Duration::from_millis(20);

/// Stops `group`: see the module docs. A signal the guard gets after the stop began skips the
/// rest of the grace.
pub fn stop(
    group: &mut dyn Group,
    grace: Duration,
    clock: &mut dyn Clock,
    signals: &Signals,
    readings: &mut dyn Readings,
) -> Ending {
    let signals_before = signals.count();
    let interrupted = || signals.count() > signals_before;
    if group.alive(readings).is_empty() {
        return Ending::Terminated;
    }
    group.send(Signal::SIGTERM);
    group.send(Signal::SIGCONT);
    let grace_over = clock.now().saturating_add(grace);
    if gone_by(group, grace_over, &interrupted, clock, readings).is_ok() {
        return Ending::Terminated;
    }
    group.send(Signal::SIGKILL);
    let kill_over = clock.now().saturating_add(AFTER_KILL);
    match gone_by(group, kill_over, &|| false, clock, readings) {
        Ok(()) => Ending::Killed,
        Err(pids) => Ending::Unkillable(pids),
    }
}

/// Polls until no member is alive (`Ok`), or until `deadline` or `interrupted` (`Err`: who is
/// still there; the last `alive` call saw exactly them, so a `send` after it reaches them).
fn gone_by(
    group: &mut dyn Group,
    deadline: Duration,
    interrupted: &dyn Fn() -> bool,
    clock: &mut dyn Clock,
    readings: &mut dyn Readings,
) -> Result<(), Vec<i32>> {
    loop {
        let alive = group.alive(readings);
        if alive.is_empty() {
            return Ok(());
        }
        let now = clock.now();
        if now >= deadline || interrupted() {
            return Err(alive);
        }
        clock.sleep(POLL.min(deadline.saturating_sub(now)));
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;

    /// What a scripted member does with a signal.
    #[derive(Clone, Copy, PartialEq)]
    enum Member {
        /// Exits on SIGTERM.
        Obeys,
        /// Exits only on SIGKILL.
        IgnoresTerm,
        /// Never exits (uninterruptible sleep).
        Stuck,
    }

    /// A scripted group; its clock moves only when the stop sleeps.
    struct Scripted<'a> {
        members: Vec<(i32, Member)>,
        now: &'a Cell<Duration>,
        sent: Vec<(Signal, Duration)>,
        /// The guard gets a signal at this poll.
        signal_at_poll: Option<(usize, &'a Signals)>,
        polls: usize,
    }

    impl Group for Scripted<'_> {
        fn alive(&mut self, _: &mut dyn Readings) -> Vec<i32> {
            self.polls += 1;
            if let Some((poll, signals)) = self.signal_at_poll {
                if poll == self.polls {
                    signals.simulate(libc::SIGINT);
                }
            }
            self.members.iter().map(|(pid, _)| *pid).collect()
        }
        fn send(&mut self, signal: Signal) {
            self.sent.push((signal, self.now.get()));
            let goes = |member: &Member| match signal {
                Signal::SIGTERM => *member == Member::Obeys,
                Signal::SIGKILL => *member != Member::Stuck,
                _ => false,
            };
            self.members.retain(|(_, member)| !goes(member));
        }
    }

    struct FakeClock<'a>(&'a Cell<Duration>);

    impl Clock for FakeClock<'_> {
        fn now(&self) -> Duration {
            self.0.get()
        }
        fn sleep(&mut self, duration: Duration) {
            self.0.set(self.0.get() + duration);
        }
    }

    struct NoReadings;
    impl Readings for NoReadings {}

    fn run(members: &[Member], grace: Duration, signal_at_poll: Option<usize>) -> (Ending, Vec<(Signal, Duration)>) {
        let now = Cell::new(Duration::from_secs(100));
        let signals = Signals::none();
        let mut group = Scripted {
            members: members.iter().enumerate().map(|(i, m)| (i as i32 + 10, *m)).collect(),
            now: &now,
            sent: Vec::new(),
            signal_at_poll: signal_at_poll.map(|poll| (poll, &signals)),
            polls: 0,
        };
        let ending = stop(&mut group, grace, &mut FakeClock(&now), &signals, &mut NoReadings);
        let since_start = group.sent.iter().map(|(s, t)| (*s, *t - Duration::from_secs(100))).collect();
        (ending, since_start)
    }

    const GRACE: Duration = Duration::from_secs(5);

    #[test]
    fn members_that_obey_sigterm_are_gone_within_the_grace_and_get_no_sigkill() {
        let (ending, sent) = run(&[Member::Obeys, Member::Obeys], GRACE, None);
        assert_eq!(ending, Ending::Terminated);
        assert_eq!(sent, [(Signal::SIGTERM, Duration::ZERO), (Signal::SIGCONT, Duration::ZERO)]);
    }

    #[test]
    fn a_member_that_ignores_sigterm_gets_sigkill_when_the_grace_is_over_and_not_before() {
        let (ending, sent) = run(&[Member::Obeys, Member::IgnoresTerm], GRACE, None);
        assert_eq!(ending, Ending::Killed);
        assert_eq!(sent.last(), Some(&(Signal::SIGKILL, GRACE)));
    }

    #[test]
    fn a_second_signal_to_the_guard_skips_the_rest_of_the_grace() {
        let (ending, sent) = run(&[Member::IgnoresTerm], GRACE, Some(4));
        assert_eq!(ending, Ending::Killed);
        let (signal, at) = *sent.last().unwrap();
        assert_eq!(signal, Signal::SIGKILL);
        assert!(at < Duration::from_millis(100), "killed at {at:?}, not after the grace");
    }

    #[test]
    fn a_grace_as_long_as_a_clock_can_hold_cannot_overflow() {
        assert_eq!(run(&[Member::Obeys], Duration::MAX, None).0, Ending::Terminated);
        // Only another signal ends such a grace; the stop then kills as usual.
        assert_eq!(run(&[Member::IgnoresTerm], Duration::MAX, Some(3)).0, Ending::Killed);
    }

    #[test]
    fn a_member_that_survives_sigkill_is_named_after_the_wait_and_the_stop_returns() {
        let (ending, sent) = run(&[Member::Obeys, Member::Stuck], Duration::ZERO, None);
        assert_eq!(ending, Ending::Unkillable(vec![11]));
        assert_eq!(sent.last(), Some(&(Signal::SIGKILL, Duration::ZERO)));
    }

    #[test]
    fn a_group_already_gone_gets_no_signal() {
        let (ending, sent) = run(&[], GRACE, None);
        assert_eq!((ending, sent.len()), (Ending::Terminated, 0));
    }
}
