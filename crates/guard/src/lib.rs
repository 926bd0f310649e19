//! stageload-guard: start one heavy command only when there is memory for it, in its own process
//! group, and stop that group (and nothing else) before it takes the machine down. Torch-free.
//!
//! - [`decide`]: the rules, pure functions of readings and time.
//! - [`wait_for_room`]: admission, polling until the rules say start (or the timeout, exit 4).
//! - [`supervise`]: spawning, watching and stopping the command's process group and the
//!   descendants that left it.
//! - [`log`]: every decision as a stderr line and, with `--log`, a JSON line with its readings.
//! - [`signals`]: SIGINT/SIGTERM/SIGHUP to the guard, recorded and acted on between polls.
//!
//! One guarded command per process at a time: the guard makes its process a child subreaper and
//! counts every process below it as the command's.

pub mod decide;
pub mod log;
pub mod signals;
pub mod supervise;

use std::time::{Duration, Instant};

use regex::Regex;
use stageload_probe::units::GIB;
use stageload_probe::{ProbeError, ProcessEntry, ProcessMemory, SystemMemory};

pub use decide::{Admission, Notice, Stop, Wait, Watch};
pub use log::GuardLog;
pub use signals::Signals;
pub use supervise::{run_guarded, Outcome};

/// Exit codes of `stageload guard`, besides the command's own and 128 + N for a signal N.
pub mod exit {
    /// The guard stopped the command (swap, low memory or `--max-memory`).
    pub const STOPPED: i32 = 3;
    /// No room within `--start-timeout`, or `--check` says it would not start now.
    pub const NO_ROOM: i32 = 4;
    /// Bad usage: unknown or invalid flag, no command.
    pub const USAGE: i32 = 2;
    /// The command was found but cannot be executed.
    pub const NOT_EXECUTABLE: i32 = 126;
    /// The command was not found.
    pub const NOT_FOUND: i32 = 127;
}

/// What the guard waits for and watches. Percentages are of the machine's memory, or of the
/// cgroup limit when the guard runs in a memory-limited cgroup.
#[derive(Debug, Clone)]
pub struct GuardConfig {
    /// Start only when at least this percent of memory is available.
    pub wait_free: f64,
    /// Swap the system may gain over its level at the command's start before the command is stopped.
    pub swap_budget: u64,
    /// Absolute swap ceiling: caps the budget and is an admission check (swap + budget ≤ limit).
    pub swap_limit: Option<u64>,
    /// Stop the command after two samples in a row under this percent available.
    pub kill_free: f64,
    /// Do not start while a process whose command line matches one of these runs.
    pub busy: Vec<Regex>,
    /// With `busy`: start only after no busy process was seen for this long.
    pub quiet_for: Duration,
    /// Give up waiting after this long (exit 4).
    pub start_timeout: Duration,
    /// Interval of admission and watch readings.
    pub poll: Duration,
    /// Time between SIGTERM and SIGKILL when stopping the command.
    pub grace: Duration,
    /// Stop the command when its own memory (RSS + swap over its members) passes this.
    pub max_memory: Option<u64>,
}

impl Default for GuardConfig {
    fn default() -> Self {
        GuardConfig {
            wait_free: 40.0,
            swap_budget: 8 * GIB,
            swap_limit: None,
            kill_free: 10.0,
            busy: Vec::new(),
            quiet_for: Duration::from_secs(60),
            start_timeout: Duration::from_secs(30 * 60),
            poll: Duration::from_millis(100),
            grace: Duration::from_secs(5),
            max_memory: None,
        }
    }
}

/// Where the guard gets its readings. The default methods read the real machine; tests replace
/// some of them with scripted values while the command itself stays real.
pub trait Readings {
    fn memory(&mut self) -> Result<SystemMemory, ProbeError> {
        stageload_probe::system_memory()
    }
    /// The process table with command lines (for `--busy`).
    fn processes(&mut self) -> Result<Vec<ProcessEntry>, ProbeError> {
        stageload_probe::processes()
    }
    /// The process table without command lines (the command's members, read every poll).
    fn process_tree(&mut self) -> Result<Vec<ProcessEntry>, ProbeError> {
        stageload_probe::process_tree()
    }
    fn process_memory(&mut self, pid: i32) -> Result<ProcessMemory, ProbeError> {
        stageload_probe::process_memory(pid)
    }
}

/// The real machine.
pub struct SystemReadings;

impl Readings for SystemReadings {}

/// Time as the admission phase sees it; tests use a clock whose `sleep` only moves it forward.
pub trait Clock {
    /// Time since the guard began.
    fn now(&self) -> Duration;
    fn sleep(&mut self, duration: Duration);
}

/// The monotonic clock and real sleeps.
pub struct SystemClock(Instant);

impl SystemClock {
    pub fn new() -> Self {
        SystemClock(Instant::now())
    }
}

impl Default for SystemClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for SystemClock {
    fn now(&self) -> Duration {
        self.0.elapsed()
    }
    fn sleep(&mut self, duration: Duration) {
        std::thread::sleep(duration)
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
fn busy_now(config: &GuardConfig, readings: &mut dyn Readings) -> Result<Vec<String>, String> {
    if config.busy.is_empty() {
        return Ok(Vec::new());
    }
    let table = readings.processes().map_err(|error| format!("cannot list processes for --busy: {error}"))?;
    let exclude = stageload_probe::ancestors(&table, std::process::id() as i32);
    Ok(decide::busy_commands(&config.busy, &table, &exclude))
}

/// One admission check now, for `--check`: the reasons not to start (empty: it would start).
/// A `--quiet-for` countdown cannot be judged from one look and is left out.
pub fn check_once(
    config: &GuardConfig,
    readings: &mut dyn Readings,
    log: &mut GuardLog,
) -> (Vec<Wait>, Option<SystemMemory>) {
    let memory = readings.memory();
    let busy = busy_now(config, readings).unwrap_or_else(|blind| {
        log.note("blind", &blind, None);
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
    let deadline = clock.now() + config.start_timeout;
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
            Err(blind) => {
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
        let until = now + config.poll;
        while clock.now() < until && signals.received().is_none() {
            clock.sleep((until - clock.now()).min(Duration::from_millis(50)));
        }
    }
}
