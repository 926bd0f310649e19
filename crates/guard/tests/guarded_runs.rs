//! The guard with scripted system readings and a scripted admission clock, around real
//! commands: the original's guard tests, and the process-group cases a guard must get right.
//!
//! The guard counts every process below its own as the command's, so the tests of this binary
//! run one at a time (`ONE_GUARD`). Every command is bounded: a `sleep 60` at most, and the
//! guard stops it well before.

use std::ffi::OsString;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use regex::Regex;
use stageload_guard::{
    run_guarded, Clock, FakeClock, GuardConfig, GuardLog, LimitFrom, Outcome, Readings, Signals, Stop, SystemClock,
};
use stageload_probe::{ProbeError, ProcessEntry, SystemMemory};
use stageload_units::GIB;

use stageload_test_support::pids::{read_pid, running};

static ONE_GUARD: Mutex<()> = Mutex::new(());

fn one_guard() -> std::sync::MutexGuard<'static, ()> {
    ONE_GUARD.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// System readings from a script (one per call, then the last one again); the process table is
/// scripted for the first calls, then real.
struct Scripted {
    memory: Vec<SystemMemory>,
    calls: usize,
    tables: Vec<Vec<ProcessEntry>>,
    /// The process table cannot be read this many times first.
    blind: usize,
}

impl Scripted {
    fn levels(levels: &[u64]) -> Self {
        Scripted { memory: levels.iter().map(|&l| memory(l, 0)).collect(), calls: 0, tables: Vec::new(), blind: 0 }
    }
    fn swaps(swaps_gib: &[u64]) -> Self {
        Scripted { memory: swaps_gib.iter().map(|&s| memory(90, s)).collect(), calls: 0, tables: Vec::new(), blind: 0 }
    }
}

fn memory(available_percent: u64, swap_gib: u64) -> SystemMemory {
    SystemMemory {
        total: 100 * GIB,
        available: available_percent * GIB,
        swap_total: 64 * GIB,
        swap_used: swap_gib * GIB,
        cgroup: None,
    }
}

impl Readings for Scripted {
    fn memory(&mut self) -> Result<SystemMemory, ProbeError> {
        let reading = self.memory[self.calls.min(self.memory.len() - 1)].clone();
        self.calls += 1;
        Ok(reading)
    }
    fn processes(&mut self) -> Result<Vec<ProcessEntry>, ProbeError> {
        if self.blind > 0 {
            self.blind -= 1;
            return Err(ProbeError::Read { source_name: "/proc".into(), message: "hidden".into() });
        }
        if self.tables.is_empty() {
            stageload_probe::processes()
        } else {
            Ok(self.tables.remove(0))
        }
    }
}

fn config() -> GuardConfig {
    GuardConfig { poll: Duration::from_millis(50), grace: Duration::from_secs(1), ..GuardConfig::default() }
}

fn sh(script: &str) -> Vec<OsString> {
    ["sh", "-c", script].into_iter().map(OsString::from).collect()
}

fn guard(command: &[OsString], config: &GuardConfig, readings: &mut dyn Readings) -> (Outcome, Vec<String>, Duration) {
    guard_on(command, config, readings, &mut SystemClock::new())
}

fn guard_on(
    command: &[OsString],
    config: &GuardConfig,
    readings: &mut dyn Readings,
    clock: &mut dyn Clock,
) -> (Outcome, Vec<String>, Duration) {
    let mut log = GuardLog::silent();
    let started = Instant::now();
    let outcome = run_guarded(command, config, readings, clock, &mut log, &Signals::none());
    (outcome, log.lines().to_vec(), started.elapsed())
}

fn has(lines: &[String], text: &str) -> bool {
    lines.iter().any(|line| line.contains(text))
}

/// A folder for one test, removed with its contents when dropped.
fn scratch(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new().prefix(&format!("stageload-guard-{name}-")).tempdir().unwrap()
}

#[test]
fn waits_for_memory_then_runs_the_command() {
    let _alone = one_guard();
    let (outcome, lines, _) = guard(&sh("exit 0"), &config(), &mut Scripted::levels(&[30, 35, 90]));
    assert_eq!(outcome, Outcome::Exited(0), "{lines:?}");
    assert!(has(&lines, "waiting (memory available 30% < 40%)"), "{lines:?}");
    assert_eq!(lines.iter().filter(|l| l.contains("waiting")).count(), 1, "logged once while the kind is the same");
}

#[test]
fn gives_up_when_there_is_no_room_in_time_and_never_starts() {
    let _alone = one_guard();
    let folder = scratch("no-room");
    let dir = folder.path();
    let marker = dir.join("started");
    let config = GuardConfig { start_timeout: Duration::from_secs(10), ..config() };
    let command = sh(&format!("touch {}", marker.display()));
    let (outcome, lines, elapsed) =
        guard_on(&command, &config, &mut Scripted::levels(&[10]), &mut FakeClock(Duration::ZERO));
    assert_eq!((outcome.exit_code(), outcome), (4, Outcome::NoRoom));
    assert!(has(&lines, "no room after 10 s (memory available 10% < 40%)"), "{lines:?}");
    assert!(!marker.exists());
    assert!(elapsed < Duration::from_secs(5), "the admission clock is scripted: {elapsed:?}");
}

#[test]
fn waits_for_swap_headroom_under_the_limit() {
    let _alone = one_guard();
    let config = GuardConfig { swap_limit: Some(20 * GIB), ..config() };
    let (outcome, lines, _) = guard(&sh("exit 0"), &config, &mut Scripted::swaps(&[15, 15, 5]));
    assert_eq!(outcome, Outcome::Exited(0));
    assert!(has(&lines, "> limit 20.0 GB"), "{lines:?}");
}

#[test]
fn waits_while_a_busy_process_runs_but_not_for_itself() {
    let _alone = one_guard();
    let config = GuardConfig { busy: vec![Regex::new("ltx-2-mlx").unwrap()], quiet_for: Duration::ZERO, ..config() };
    let me = std::process::id() as i32;
    let entry =
        |pid, ppid, cmdline: &str| ProcessEntry { pid, ppid, pgid: pid, zombie: false, cmdline: cmdline.into() };
    // The guard itself (this process) carries the pattern on its command line; a stranger does once.
    let mut readings = Scripted::levels(&[90]);
    readings.tables = vec![
        vec![entry(me, 1, "stageload guard --busy ltx-2-mlx -- x"), entry(4242, 1, "python ltx-2-mlx/run.py")],
        vec![entry(me, 1, "stageload guard --busy ltx-2-mlx -- x")],
    ];
    let (outcome, lines, _) = guard(&sh("exit 0"), &config, &mut readings);
    assert_eq!(outcome, Outcome::Exited(0), "{lines:?}");
    assert!(has(&lines, "busy: python ltx-2-mlx/run.py"), "{lines:?}");
}

#[test]
fn a_process_table_that_cannot_be_read_is_logged_once() {
    let _alone = one_guard();
    let config = GuardConfig { busy: vec![Regex::new("ltx-2-mlx").unwrap()], quiet_for: Duration::ZERO, ..config() };
    // Low memory for five polls while /proc cannot be read, then room.
    let mut readings = Scripted::levels(&[10, 10, 10, 10, 10, 90]);
    readings.blind = 3;
    let (outcome, lines, _) = guard(&sh("exit 0"), &config, &mut readings);
    assert_eq!(outcome, Outcome::Exited(0), "{lines:?}");
    assert_eq!(lines.iter().filter(|l| l.contains("cannot list processes for --busy")).count(), 1, "{lines:?}");
}

#[test]
fn a_swap_rise_over_the_budget_stops_the_command() {
    let _alone = one_guard();
    let (outcome, lines, elapsed) = guard(&sh("sleep 60"), &config(), &mut Scripted::swaps(&[1, 1, 2, 10]));
    assert_eq!(outcome.exit_code(), 3);
    assert_eq!(outcome, Outcome::Stopped(Stop::Swap { used: 10 * GIB, stop_above: 9 * GIB }));
    assert!(has(&lines, "killing pid") && has(&lines, "(swap 10.0 GB > 9.0 GB)"), "{lines:?}");
    assert!(elapsed < Duration::from_secs(15), "{elapsed:?}");
}

#[test]
fn two_low_memory_samples_in_a_row_stop_the_command() {
    let _alone = one_guard();
    let (outcome, lines, _) = guard(&sh("sleep 60"), &config(), &mut Scripted::levels(&[90, 5, 50, 5, 5]));
    assert_eq!(outcome.exit_code(), 3, "{lines:?}");
    assert!(has(&lines, "memory available 5% < 10% twice"), "{lines:?}");
}

#[test]
fn exit_codes_of_the_command_pass_through() {
    let _alone = one_guard();
    let real = || Scripted::levels(&[90]);
    assert_eq!(guard(&sh("exit 7"), &config(), &mut real()).0.exit_code(), 7);
    assert_eq!(guard(&sh("kill -TERM $$; sleep 5"), &config(), &mut real()).0.exit_code(), 143);
    let (outcome, lines, _) = guard(&[OsString::from("/no/such/program")], &config(), &mut real());
    assert_eq!(outcome.exit_code(), 127);
    assert!(has(&lines, "cannot start '/no/such/program'"), "{lines:?}");
    let folder = scratch("not-executable");
    let dir = folder.path();
    let script = dir.join("script.sh");
    std::fs::write(&script, "#!/bin/sh\nexit 0\n").unwrap();
    assert_eq!(guard(&[script.into_os_string()], &config(), &mut real()).0.exit_code(), 126);
}

#[test]
fn a_command_that_ignores_sigterm_is_killed_after_the_grace() {
    let _alone = one_guard();
    let folder = scratch("ignores-term");
    let dir = folder.path();
    let pid_file = dir.join("pid");
    let script = format!("trap '' TERM; sleep 60 & echo $! > {}; wait", pid_file.display());
    let started = Instant::now();
    let handle = {
        let script = script.clone();
        std::thread::spawn(move || guard(&sh(&script), &config(), &mut Scripted::levels(&[90, 90, 90, 90, 5])))
    };
    let sleeper = read_pid(&pid_file);
    let (outcome, lines, _) = handle.join().unwrap();
    let elapsed = started.elapsed();
    assert_eq!(outcome.exit_code(), 3, "{lines:?}");
    assert!(elapsed >= Duration::from_secs(1), "the grace was given: {elapsed:?}");
    assert!(elapsed < Duration::from_secs(10), "{elapsed:?}");
    assert!(!running(sleeper), "the member that ignored SIGTERM is gone");
}

#[test]
fn a_grandchild_that_left_the_group_is_stopped_too() {
    let _alone = one_guard();
    let folder = scratch("setsid");
    let dir = folder.path();
    let pid_file = dir.join("pid");
    // setsid puts the grandchild in a session and group of its own; the shell then exits.
    let script = format!("setsid sh -c 'echo $$ > {}; exec sleep 60' & sleep 60", pid_file.display());
    let handle =
        std::thread::spawn(move || guard(&sh(&script), &config(), &mut Scripted::levels(&[90, 90, 90, 90, 90, 90, 5])));
    let escaped = read_pid(&pid_file);
    let (outcome, lines, _) = handle.join().unwrap();
    assert_eq!(outcome.exit_code(), 3, "{lines:?}");
    assert!(!running(escaped), "the setsid grandchild {escaped} was stopped");
}

#[test]
fn leftovers_of_a_finished_command_are_stopped_before_the_leader_is_reaped() {
    let _alone = one_guard();
    let folder = scratch("leftover");
    let dir = folder.path();
    let pid_file = dir.join("pid");
    let script = format!("sleep 60 & echo $! > {}; exit 5", pid_file.display());
    let (outcome, lines, _) = guard(&sh(&script), &config(), &mut Scripted::levels(&[90]));
    let leftover = read_pid(&pid_file);
    assert_eq!(outcome, Outcome::Exited(5), "{lines:?}");
    assert!(has(&lines, "left 1 processes running"), "{lines:?}");
    assert!(!running(leftover));
}

#[test]
fn max_memory_stops_a_command_that_allocates_past_it() {
    let _alone = one_guard();
    // Python allocates (and touches) 32 MiB every 50 ms, up to 512 MiB at most.
    let program = "import time\nblocks = []\nfor _ in range(16):\n    blocks.append(b'x' * (32 << 20))\n    time.sleep(0.05)\ntime.sleep(30)\n";
    let command: Vec<OsString> = ["python3", "-c", program].into_iter().map(OsString::from).collect();
    let config = GuardConfig { max_memory: Some(160 << 20), ..config() };
    let (outcome, lines, elapsed) = guard(&command, &config, &mut Scripted::levels(&[90]));
    let Outcome::Stopped(Stop::MaxMemory { used, max, from: LimitFrom::Flag }) = outcome else {
        panic!("{outcome:?} {lines:?}")
    };
    assert_eq!(max, 160 << 20);
    // Stopped on the way up: over the limit (what a stop means), and short of the 16 blocks
    // alone, which the whole program (its interpreter's own memory on top) would pass.
    assert!(used > max && used < 16 * (32 << 20), "stopped on the way up: {used}");
    assert!(has(&lines, "--max-memory"), "{lines:?}");
    assert!(elapsed < Duration::from_secs(20), "{elapsed:?}");
}

/// The machine's readings, real, plus the command's device memory from a script (one per
/// call, then nothing new): what `stageload guard --trace` reads from a trace. Counts the
/// device readings the guard asked for, and how many of them it was given.
struct DeviceScript {
    script: Vec<Option<u64>>,
    asked: usize,
    given: usize,
}

impl DeviceScript {
    fn new(script: Vec<Option<u64>>) -> Self {
        DeviceScript { script, asked: 0, given: 0 }
    }
}

impl Readings for DeviceScript {
    fn memory(&mut self) -> Result<SystemMemory, ProbeError> {
        Ok(memory(90, 0))
    }
    fn command_device_memory(&mut self) -> Option<u64> {
        self.asked += 1;
        let reading = if self.script.is_empty() { None } else { self.script.remove(0) };
        self.given += usize::from(reading.is_some());
        reading
    }
}

#[test]
fn a_device_reading_over_the_device_limit_stops_the_command() {
    let _alone = one_guard();
    let config = GuardConfig { max_device_memory: Some(GIB), ..config() };
    let mut script = DeviceScript::new(vec![None, Some(GIB / 2), None, Some(GIB), Some(2 * GIB)]);
    let (outcome, lines, elapsed) = guard(&sh("exec sleep 30"), &config, &mut script);
    assert_eq!(
        outcome,
        Outcome::Stopped(Stop::MaxDeviceMemory { used: 2 * GIB, max: GIB, from: LimitFrom::Flag }),
        "{lines:?}"
    );
    assert!(has(&lines, "or when its device memory passes 1.0 GiB"), "{lines:?}");
    assert!(has(&lines, "command's device memory 2.0 GiB > --max-device-memory 1.0 GiB"), "{lines:?}");
    assert!(elapsed < Duration::from_secs(10), "{elapsed:?}");
}

#[test]
fn without_a_device_limit_device_readings_over_anything_are_read_and_never_stop_the_command() {
    let _alone = one_guard();
    // The guard asks for the command's device memory every poll, limit or not (a reader that
    // follows the command's trace keeps up with it); with no limit set, a reading far over
    // anything is read and ignored, and the command ends itself.
    let mut script = DeviceScript::new(vec![Some(u64::MAX); 100]);
    let (outcome, lines, _) = guard(&sh("sleep 0.3"), &config(), &mut script);
    assert_eq!(outcome, Outcome::Exited(0), "{lines:?}");
    // Read, not merely left unread: the 0.3 s command spans several 50 ms polls, and each
    // poll was given one of the readings over anything.
    assert!(
        script.given >= 2 && script.given == script.asked,
        "{} of {} asked readings given",
        script.given,
        script.asked
    );
    assert!(!lines.iter().any(|line| line.contains("device memory")), "{lines:?}");
}
