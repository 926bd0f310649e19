//! Admission: waiting for room. Polls the readings until every rule of [`crate::decide`] holds
//! at one moment, the start timeout passes, or a signal arrives; `--check` is one such look.

use std::time::Duration;

use crate::config::GuardConfig;
use crate::decide::{self, Admission, Wait};
use crate::log::GuardLog;
use crate::machine::{Clock, Readings};
use crate::signals::Signals;
use stageload_probe::{ProbeError, SystemMemory};

/// Sleeps on `clock` until `until`, in slices of at most 50 ms, returning early once `interrupt`
/// says so. Admission, the watch and the stop all wait through this.
pub fn sleep_until(clock: &mut dyn Clock, until: Duration, mut interrupt: impl FnMut() -> bool) {
    while clock.now() < until && !interrupt() {
        clock.sleep(until.saturating_sub(clock.now()).min(Duration::from_millis(50)));
    }
}

/// How admission ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Admitted {
    /// There is room: the readings that said so.
    Start(SystemMemory),
    /// The start timeout passed; the reasons still holding.
    NoRoom(Vec<Wait>),
    /// The guard got this signal while waiting.
    Signal(i32),
}

/// The busy command lines now, leaving out this process and its ancestors; an error when the
/// process table cannot be read (the check is blind then, and finds nothing busy).
fn busy_now(config: &GuardConfig, readings: &mut dyn Readings) -> Result<Vec<String>, ProbeError> {
    if config.busy.is_empty() {
        return Ok(Vec::new());
    }
    let table = readings.processes()?;
    let exclude = stageload_probe::ancestors(&table, std::process::id() as i32);
    Ok(decide::busy_commands(&config.busy, &table, &exclude))
}

/// The log line of a `--busy` check that cannot see the process table.
fn blind(error: &ProbeError) -> String {
    format!("cannot list processes for --busy: {error}")
}

/// One admission check now, for `--check`: the reasons not to start (empty: it would start).
/// A `--quiet-for` countdown cannot be judged from one look and is left out.
pub fn check_once(
    config: &GuardConfig,
    readings: &mut dyn Readings,
    log: &mut GuardLog,
) -> (Vec<Wait>, Option<SystemMemory>) {
    let memory = readings.memory();
    let busy = busy_now(config, readings).unwrap_or_else(|error| {
        log.note("blind", &blind(&error), None);
        Vec::new()
    });
    let one_look = GuardConfig { quiet_for: Duration::ZERO, ..config.clone() };
    let reasons = Admission::new().check(&one_look, Duration::ZERO, memory.as_ref(), &busy);
    (reasons, memory.ok())
}

/// Admission: polls until every condition holds at one moment, the start timeout passes, or a
/// signal arrives. Logs the reasons to wait only when they change.
pub fn wait_for_room(
    config: &GuardConfig,
    readings: &mut dyn Readings,
    clock: &mut dyn Clock,
    log: &mut GuardLog,
    signals: &Signals,
) -> Admitted {
    let deadline = clock.now().saturating_add(config.start_timeout);
    let mut admission = Admission::new();
    let mut last_logged: Option<Vec<Wait>> = None;
    let mut last_blind: Option<String> = None;
    loop {
        if let Some(signal) = signals.received() {
            return Admitted::Signal(signal);
        }
        let memory = readings.memory();
        let busy = match busy_now(config, readings) {
            Ok(busy) => {
                last_blind = None;
                busy
            }
            Err(error) => {
                let blind = blind(&error);
                // Logged once per distinct error, not every poll.
                if last_blind.as_ref() != Some(&blind) {
                    log.note("blind", &blind, None);
                    last_blind = Some(blind);
                }
                Vec::new()
            }
        };
        let now = clock.now();
        let reasons = admission.check(config, now, memory.as_ref(), &busy);
        let memory = match (reasons.is_empty(), memory) {
            // No reason to wait includes "the reading succeeded".
            (true, Ok(memory)) => return Admitted::Start(memory),
            (_, memory) => memory.ok(),
        };
        let memory_json = memory.as_ref();
        if !last_logged.as_deref().is_some_and(|last| decide::same_kind(last, &reasons)) {
            log.note("waiting", &format!("waiting ({})", decide::describe(&reasons)), memory_json);
            last_logged = Some(reasons.clone());
        }
        if now >= deadline {
            let message = format!("no room after {:.0} s ({})", now.as_secs_f64(), decide::describe(&reasons));
            log.note("no_room", &message, memory_json);
            return Admitted::NoRoom(reasons);
        }
        // Sleep one poll in slices, so a signal is acted on at once.
        sleep_until(clock, now.saturating_add(config.poll), || signals.received().is_some());
    }
}
