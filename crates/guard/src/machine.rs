//! Where the guard's readings and time come from: the real machine and the monotonic clock, or,
//! in tests, scripted readings and a clock that only moves when the guard sleeps.

use std::time::{Duration, Instant};

use stageload_probe::{Probe, ProbeError, ProcessEntry, ProcessMemory, SystemMemory};

/// Where the guard gets its readings. The default methods read the real machine, opening their
/// files at each call ([`SystemReadings`] keeps them open between polls); tests replace some of
/// them with scripted values while the command itself stays real.
pub trait Readings {
    /// The machine's memory and swap (or the cgroup's).
    fn memory(&mut self) -> Result<SystemMemory, ProbeError> {
        stageload_probe::system_memory()
    }
    /// The process table with command lines (for `--busy`).
    fn processes(&mut self) -> Result<Vec<ProcessEntry>, ProbeError> {
        stageload_probe::processes()
    }
    /// The processes below `root`, without command lines (the command's members, read every
    /// poll with `--max-memory` and during a stop).
    fn subtree(&mut self, root: i32) -> Result<Vec<ProcessEntry>, ProbeError> {
        stageload_probe::process_subtree(root)
    }
    /// The memory of process `pid`.
    fn process_memory(&mut self, pid: i32) -> Result<ProcessMemory, ProbeError> {
        stageload_probe::process_memory(pid)
    }
    /// The command's device memory, where something reports it (`stageload guard --trace`
    /// reads it from the trace the command writes): the most reported since the last call,
    /// `None` when nothing new was. Asked every poll of the watch (the reading counts only
    /// with `max_device_memory`); the machine itself has no such reading.
    fn command_device_memory(&mut self) -> Option<u64> {
        None
    }
}

/// The real machine, read through a [`Probe`]: the files read every poll stay open between
/// polls (and a cgroup's limit is read about once a second).
#[derive(Debug, Default)]
pub struct SystemReadings(Probe);

impl SystemReadings {
    /// Readings with nothing open yet.
    pub fn new() -> Self {
        Self::default()
    }
}

impl Readings for SystemReadings {
    fn memory(&mut self) -> Result<SystemMemory, ProbeError> {
        self.0.system_memory()
    }
    fn subtree(&mut self, root: i32) -> Result<Vec<ProcessEntry>, ProbeError> {
        self.0.subtree(root)
    }
    fn process_memory(&mut self, pid: i32) -> Result<ProcessMemory, ProbeError> {
        self.0.process_memory(pid)
    }
}

/// Time as the guard sees it; tests use a clock whose `sleep` only moves it forward.
pub trait Clock {
    /// Time since the guard began.
    fn now(&self) -> Duration;
    /// Waits `duration` (a test clock just moves forward by it).
    fn sleep(&mut self, duration: Duration);
}

/// Time that moves only when slept (tests of the pure rules: admission, the queue's wait).
#[derive(Debug, Default)]
pub struct FakeClock(pub Duration);

impl Clock for FakeClock {
    fn now(&self) -> Duration {
        self.0
    }
    fn sleep(&mut self, duration: Duration) {
        self.0 += duration;
    }
}

/// The monotonic clock and real sleeps.
pub struct SystemClock(Instant);

impl SystemClock {
    /// A clock starting now.
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
