//! Running the command: spawn it in its own process group, watch it every poll, and stop it —
//! SIGTERM and SIGCONT to the group and to every descendant that left it, the grace period,
//! SIGKILL — then reap it.
//!
//! Correctness rules this module keeps:
//! - The leader is reaped only after the final kill: until then its zombie pins the group id,
//!   so `kill(-pgid)` can never reach a stranger's group (Linux: `waitid(WNOWAIT)` sees the exit
//!   without reaping).
//! - The guard is a child subreaper (Linux): descendants that `setsid` or double-fork are
//!   re-parented to the guard instead of init, so "everything below the guard" is the command.
//! - The command gets `PR_SET_PDEATHSIG = SIGKILL` (Linux): a guard killed with SIGKILL does not
//!   leave its command running unwatched.
//! - At a terminal, the command's group becomes the foreground group, so Ctrl-C and terminal
//!   reads reach the command as they would without the guard.

use std::ffi::OsString;
use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, killpg, SigSet, SigmaskHow, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::{getpgrp, tcgetpgrp, tcsetpgrp, Pid};
use serde_json::json;
use stageload_probe::units::{format_bytes, format_gb};
use stageload_probe::ProcessEntry;

use crate::signals::name as signal_name;
use crate::{exit, wait_for_room, Admitted, Clock, GuardConfig, GuardLog, Readings, Signals, Stop, Watch};

/// How a guarded run ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// The command exited with this code.
    Exited(i32),
    /// A signal ended the command.
    Signaled(i32),
    /// The guard stopped the command.
    Stopped(Stop),
    /// The guard got this signal (and stopped the command first, if it had started).
    GuardSignal(i32),
    /// No room within the start timeout.
    NoRoom,
    /// The command could not be started; the exit code says why (126 or 127).
    CannotStart(i32),
}

impl Outcome {
    /// The guard's exit code for this outcome.
    pub fn exit_code(&self) -> i32 {
        match self {
            Outcome::Exited(code) | Outcome::CannotStart(code) => *code,
            Outcome::Signaled(signal) | Outcome::GuardSignal(signal) => 128 + signal,
            Outcome::Stopped(_) => exit::STOPPED,
            Outcome::NoRoom => exit::NO_ROOM,
        }
    }
}

/// Runs `command` under the guard: admission, start, watch, stop. See the module docs.
pub fn run_guarded(
    command: &[OsString],
    config: &GuardConfig,
    readings: &mut dyn Readings,
    clock: &mut dyn Clock,
    log: &mut GuardLog,
    signals: &Signals,
) -> Outcome {
    let at_start = match wait_for_room(config, readings, clock, log, signals) {
        Admitted::Start(memory) => memory,
        Admitted::NoRoom(_) => return Outcome::NoRoom,
        Admitted::Signal(signal) => {
            log.note("signal", &format!("got {} before starting the command", signal_name(signal)), None);
            return Outcome::GuardSignal(signal);
        }
    };
    let watch = Watch::new(config, &at_start);
    let mut message = format!(
        "start, swap {}, stop above {} or under {:.0}% available twice",
        format_gb(at_start.swap_used),
        format_gb(watch.stop_above()),
        config.kill_free
    );
    if let Some(max) = config.max_memory {
        message += &format!(", or when the command passes {}", format_bytes(max));
    }
    log.note("start", &message, Some(&at_start));
    let job = match Job::spawn(command) {
        Ok(job) => job,
        Err((code, reason)) => {
            let program = command.first().map(|p| p.to_string_lossy()).unwrap_or_default();
            log.record("cannot_start", &format!("cannot start '{program}': {reason}"), None, json!({ "exit": code }));
            return Outcome::CannotStart(code);
        }
    };
    log.record("started", &format!("started pid {}", job.leader), None, json!({ "pid": job.leader.as_raw() }));
    watch_job(job, watch, config, readings, log, signals)
}

fn watch_job(
    mut job: Job,
    mut watch: Watch,
    config: &GuardConfig,
    readings: &mut dyn Readings,
    log: &mut GuardLog,
    signals: &Signals,
) -> Outcome {
    let started = Instant::now();
    let mut last_unknown: Option<String> = None;
    loop {
        let next_poll = Instant::now() + config.poll;
        while Instant::now() < next_poll && signals.received().is_none() && job.leader_exit().is_none() {
            std::thread::sleep((next_poll - Instant::now()).min(Duration::from_millis(20)));
        }
        if let Some(signal) = signals.received() {
            let message = format!("got {}, stopping pid {} and its group", signal_name(signal), job.leader);
            log.note("signal", &message, None);
            job.stop(config.grace, signals, readings, log);
            job.reap(log);
            return Outcome::GuardSignal(signal);
        }
        if let Some(status) = job.leader_exit() {
            let outcome = match status {
                WaitStatus::Signaled(_, signal, _) => Outcome::Signaled(signal as i32),
                WaitStatus::Exited(_, code) => Outcome::Exited(code),
                // Waiting for exits only, nothing else is reported.
                _ => Outcome::Exited(exit::STOPPED),
            };
            log.record("exit", &format!("exit {}", outcome.exit_code()), None, json!({ "exit": outcome.exit_code() }));
            let leftovers = job.members(readings).len();
            if leftovers > 0 {
                log.note("leftovers", &format!("the command left {leftovers} processes running; stopping them"), None);
                job.stop(config.grace, signals, readings, log);
            }
            job.reap(log);
            return outcome;
        }
        let memory = readings.memory();
        let command_memory = config.max_memory.map(|_| job.memory(readings));
        let (stop, notices) = watch.observe(started.elapsed(), memory.as_ref(), command_memory);
        for notice in notices {
            let text = notice.to_string();
            // A failing reading is logged once per distinct error, not every poll.
            if matches!(notice, crate::Notice::Unknown(_)) {
                if last_unknown.as_deref() == Some(&text) {
                    continue;
                }
                last_unknown = Some(text.clone());
            }
            log.note("notice", &text, memory.as_ref().ok());
        }
        if memory.is_ok() {
            last_unknown = None;
        }
        if let Some(stop) = stop {
            let message = format!("killing pid {} and its group ({stop})", job.leader);
            log.record("stop", &message, memory.as_ref().ok(), json!({ "command_memory": command_memory }));
            job.stop(config.grace, signals, readings, log);
            job.reap(log);
            return Outcome::Stopped(stop);
        }
    }
}

/// Whether the guard runs in the terminal's foreground process group, so the command should too.
fn in_foreground() -> bool {
    let stdin = io::stdin();
    std::io::IsTerminal::is_terminal(&stdin) && tcgetpgrp(stdin.as_fd()).ok() == Some(getpgrp())
}

/// Makes `group` the terminal's foreground group, with SIGTTOU blocked so a background caller
/// is allowed to.
fn hand_terminal(fd: BorrowedFd<'_>, group: Pid) {
    let mut ttou = SigSet::empty();
    ttou.add(Signal::SIGTTOU);
    let mut previous = SigSet::empty();
    if nix::sys::signal::pthread_sigmask(SigmaskHow::SIG_BLOCK, Some(&ttou), Some(&mut previous)).is_ok() {
        let _ = tcsetpgrp(fd, group);
        let _ = nix::sys::signal::pthread_sigmask(SigmaskHow::SIG_SETMASK, Some(&previous), None);
    }
}

/// The running command: its leader (whose pid is the group id) and what it needs to be reaped.
struct Job {
    leader: Pid,
    guard: i32,
    /// The command's group was made the terminal's foreground group.
    terminal: bool,
    /// The leader's exit, once seen (Linux: seen without reaping; elsewhere: reaped).
    exit: Option<WaitStatus>,
}

impl Job {
    /// Starts the command in a new process group. Err: (exit code 126/127, reason).
    fn spawn(command: &[OsString]) -> Result<Job, (i32, String)> {
        let (program, args) = command.split_first().ok_or((exit::NOT_FOUND, "no command".to_string()))?;
        let guard = std::process::id();
        #[cfg(target_os = "linux")]
        {
            // Orphaned descendants come to the guard, which then sees and stops them.
            nix::sys::prctl::set_child_subreaper(true).map_err(|e| (exit::NOT_EXECUTABLE, e.to_string()))?;
        }
        let foreground = in_foreground();
        let mut builder = Command::new(program);
        builder.args(args).process_group(0);
        // SAFETY: the closure runs in the child between fork and exec and only makes
        // async-signal-safe system calls (prctl, getppid, kill, sigprocmask, tcsetpgrp, getpid);
        // it allocates nothing and takes no lock.
        unsafe {
            builder.pre_exec(move || {
                #[cfg(target_os = "linux")]
                {
                    nix::sys::prctl::set_pdeathsig(Signal::SIGKILL)?;
                    // The guard may have died before the line above: then die now.
                    if nix::unistd::getppid().as_raw() as u32 != guard {
                        let _ = kill(nix::unistd::getpid(), Signal::SIGKILL);
                    }
                }
                if foreground {
                    // Not io::stdin(): its first use allocates, which a forked child must not.
                    hand_terminal(BorrowedFd::borrow_raw(0), nix::unistd::getpid());
                }
                Ok(())
            });
        }
        let child = builder.spawn().map_err(|error| {
            let code = match error.kind() {
                io::ErrorKind::NotFound => exit::NOT_FOUND,
                _ => exit::NOT_EXECUTABLE,
            };
            (code, error.to_string())
        })?;
        let leader = Pid::from_raw(child.id() as i32);
        if foreground {
            hand_terminal(io::stdin().as_fd(), leader);
        }
        // `child` is dropped without waiting: the guard reaps the leader itself, last.
        Ok(Job { leader, guard: guard as i32, terminal: foreground, exit: None })
    }

    /// The leader's exit status if it has exited, without reaping it where the platform allows.
    fn leader_exit(&mut self) -> Option<WaitStatus> {
        if self.exit.is_none() {
            #[cfg(target_os = "linux")]
            let status = nix::sys::wait::waitid(
                nix::sys::wait::Id::Pid(self.leader),
                WaitPidFlag::WEXITED | WaitPidFlag::WNOHANG | WaitPidFlag::WNOWAIT,
            );
            #[cfg(not(target_os = "linux"))]
            let status = waitpid(self.leader, Some(WaitPidFlag::WNOHANG));
            self.exit = match status {
                Ok(WaitStatus::StillAlive) | Err(_) => None,
                Ok(status) => Some(status),
            };
        }
        self.exit
    }

    /// Live members: the leader's group and every process below the guard, zombies left out.
    /// Orphans re-parented to the guard that have exited are reaped on the way.
    fn members(&self, readings: &mut dyn Readings) -> Vec<ProcessEntry> {
        let Ok(table) = readings.process_tree() else {
            return Vec::new();
        };
        let below = stageload_probe::descendants(&table, self.guard);
        for orphan in table.iter().filter(|e| e.zombie && e.ppid == self.guard && e.pid != self.leader.as_raw()) {
            let _ = waitpid(Pid::from_raw(orphan.pid), Some(WaitPidFlag::WNOHANG));
        }
        table
            .into_iter()
            .filter(|e| !e.zombie && e.pid != self.guard && (e.pgid == self.leader.as_raw() || below.contains(&e.pid)))
            .collect()
    }

    /// The command's memory: RSS + swap summed over its live members.
    fn memory(&self, readings: &mut dyn Readings) -> u64 {
        self.members(readings)
            .iter()
            .filter_map(|member| readings.process_memory(member.pid).ok())
            .map(|m| m.rss + m.swap.unwrap_or(0))
            .sum()
    }

    /// Sends `signal` to the group and to each member outside it.
    fn send(&self, signal: Signal, members: &[ProcessEntry]) {
        let _ = killpg(self.leader, signal);
        for member in members.iter().filter(|m| m.pgid != self.leader.as_raw()) {
            let _ = kill(Pid::from_raw(member.pid), signal);
        }
    }

    /// SIGTERM + SIGCONT, up to `grace` for everyone to exit (cut short by another signal to the
    /// guard), then SIGKILL to what is left and a bounded wait for it to go.
    fn stop(&mut self, grace: Duration, signals: &Signals, readings: &mut dyn Readings, log: &mut GuardLog) {
        let signals_before = signals.count();
        let members = self.members(readings);
        self.send(Signal::SIGTERM, &members);
        self.send(Signal::SIGCONT, &members);
        let deadline = Instant::now() + grace;
        loop {
            let _ = self.leader_exit();
            let alive = self.members(readings);
            if alive.is_empty() {
                return;
            }
            if Instant::now() >= deadline || signals.count() > signals_before {
                self.send(Signal::SIGKILL, &alive);
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        // A process in uninterruptible sleep can outlive SIGKILL for a while: wait, but not forever.
        let cap = Instant::now() + Duration::from_secs(10);
        loop {
            let _ = self.leader_exit();
            let alive = self.members(readings);
            if alive.is_empty() {
                return;
            }
            if Instant::now() >= cap {
                let pids: Vec<i32> = alive.iter().map(|m| m.pid).collect();
                log.note("unkillable", &format!("processes {pids:?} still there 10 s after SIGKILL"), None);
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Reaps the leader (last of all) and gives the terminal back to the guard's group.
    fn reap(self, log: &mut GuardLog) {
        // Elsewhere than Linux the exit was seen by reaping it.
        let already_reaped = cfg!(not(target_os = "linux")) && self.exit.is_some();
        let cap = Instant::now() + Duration::from_secs(10);
        if !already_reaped {
            loop {
                match waitpid(self.leader, Some(WaitPidFlag::WNOHANG)) {
                    Ok(WaitStatus::StillAlive) if Instant::now() < cap => std::thread::sleep(Duration::from_millis(20)),
                    Ok(WaitStatus::StillAlive) => {
                        log.note("unreaped", &format!("pid {} has not exited; not waiting for it", self.leader), None);
                        break;
                    }
                    _ => break,
                }
            }
        }
        if self.terminal {
            hand_terminal(io::stdin().as_fd(), getpgrp());
        }
    }
}
