//! Running the command: spawn it in its own process group, watch it every poll, stop it when a
//! rule says so ([`crate::stop`]: SIGTERM and SIGCONT to the group and to every descendant that
//! left it, the grace period, SIGKILL), then reap it.
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
//! - Whatever way the guard leaves a started command (a panic, an early return), the `Job`'s
//!   drop sends SIGKILL to its group and members unless it was reaped: nothing the guard started
//!   outlives it unwatched.

use std::ffi::OsString;
use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::time::Duration;

use nix::sys::signal::{kill, killpg, SigSet, SigmaskHow, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::{getpgrp, tcgetpgrp, tcsetpgrp, Pid};
use serde_json::json;
use stageload_probe::{ProcessEntry, SystemMemory};
use stageload_units::{format_bytes, format_gb};

use crate::admit::{sleep_until, wait_for_room, Admitted};
use crate::config::GuardConfig;
use crate::decide::{Notice, Watch};
use crate::log::GuardLog;
use crate::machine::{Clock, Readings, SystemClock, SystemReadings};
use crate::outcome::{exit, Outcome};
use crate::signals::{name as signal_name, Signals};
use crate::stop::{stop, Ending, Group, AFTER_KILL};

/// Runs `command` under the guard: admission, start, watch, stop. See the module docs.
pub fn run_guarded(
    command: &[OsString],
    config: &GuardConfig,
    readings: &mut dyn Readings,
    clock: &mut dyn Clock,
    log: &mut GuardLog,
    signals: &Signals,
) -> Outcome {
    run_guarded_with_env(command, &[], config, readings, clock, log, signals)
}

/// [`run_guarded`], with `env` set for the command (on top of the guard's own environment).
pub fn run_guarded_with_env(
    command: &[OsString],
    env: &[(OsString, OsString)],
    config: &GuardConfig,
    readings: &mut dyn Readings,
    clock: &mut dyn Clock,
    log: &mut GuardLog,
    signals: &Signals,
) -> Outcome {
    match wait_for_room(config, readings, clock, log, signals) {
        Admitted::Start(memory) => run_admitted(command, env, &memory, config, readings, clock, log, signals),
        Admitted::NoRoom(_) => Outcome::NoRoom,
        Admitted::Signal(signal) => signalled_before_start(signal, log),
    }
}

/// The ending of a run that got `signal` before its command started, said in the log.
pub fn signalled_before_start(signal: i32, log: &mut GuardLog) -> Outcome {
    log.note("signal", &format!("got {} before starting the command", signal_name(signal)), None);
    Outcome::GuardSignal(signal)
}

/// The part of [`run_guarded_with_env`] after admission: starts `command` now and watches it,
/// `at_start` being the readings that admitted it (the swap budget counts from them). For a
/// caller that does more between admission and the start (`stageload run` starts its meter).
#[allow(clippy::too_many_arguments)]
pub fn run_admitted(
    command: &[OsString],
    env: &[(OsString, OsString)],
    at_start: &SystemMemory,
    config: &GuardConfig,
    readings: &mut dyn Readings,
    clock: &mut dyn Clock,
    log: &mut GuardLog,
    signals: &Signals,
) -> Outcome {
    let at_start = at_start.clone();
    let watch = Watch::new(config, &at_start);
    let message = start_message(config, &at_start, watch.stop_above());
    let limits = json!({
        "max_memory": config.max_memory,
        "max_device_memory": config.max_device_memory,
        "limits_from": config.limits_from,
    });
    log.record("start", &message, Some(&at_start), limits);
    let job = match Job::spawn(command, env) {
        Ok(job) => job,
        Err((code, reason)) => {
            let program = command.first().map(|p| p.to_string_lossy()).unwrap_or_default();
            log.record("cannot_start", &format!("cannot start '{program}': {reason}"), None, json!({ "exit": code }));
            return Outcome::CannotStart(code);
        }
    };
    log.record("started", &format!("started pid {}", job.leader), None, json!({ "pid": job.leader.as_raw() }));
    let mut run = Run { job, config, readings, clock, log, signals };
    let outcome = run.watch(watch);
    run.job.reap(run.log, run.clock);
    outcome
}

/// The start line: where the limits come from (a plan), then what stops the command.
fn start_message(config: &GuardConfig, at_start: &SystemMemory, stop_above: u64) -> String {
    let mut message = String::from("start, ");
    if let Some(from) = &config.limits_from {
        message += &format!("{from}; ");
    }
    message += &format!("swap {}, stop above {}", format_gb(at_start.swap_used), format_gb(stop_above));
    if config.kill_free > 0.0 {
        message += &format!(" or under {:.0}% available twice", config.kill_free);
    }
    if let Some(max) = config.max_memory {
        message += &format!(", or when the command passes {}", format_bytes(max));
    }
    if let Some(max) = config.max_device_memory {
        message += &format!(", or when its device memory passes {}", format_bytes(max));
    }
    message
}

/// What watching and stopping a started command work with.
struct Run<'a> {
    job: Job,
    config: &'a GuardConfig,
    readings: &'a mut dyn Readings,
    clock: &'a mut dyn Clock,
    log: &'a mut GuardLog,
    signals: &'a Signals,
}

/// The outcome for the leader's wait status.
fn outcome_of(status: WaitStatus) -> Outcome {
    match status {
        WaitStatus::Signaled(_, signal, _) => Outcome::Signaled(signal as i32),
        WaitStatus::Exited(_, code) => Outcome::Exited(code),
        // Waiting for exits only, nothing else should be reported.
        other => Outcome::Unexplained(format!("{other:?}")),
    }
}

impl Run<'_> {
    /// Stops the command's group and logs what it took.
    fn stop(&mut self) {
        match stop(&mut self.job, self.config.grace, self.clock, self.signals, self.readings) {
            Ending::Terminated => {}
            Ending::Killed => self.log.note("killed", "SIGKILL after the grace", None),
            Ending::Unkillable(pids) => {
                let message = format!("processes {pids:?} still there {} s after SIGKILL", AFTER_KILL.as_secs());
                self.log.note("unkillable", &message, None);
            }
        }
    }

    /// Watches the command until it ends or a rule or a signal stops it.
    fn watch(&mut self, mut watch: Watch) -> Outcome {
        let started = self.clock.now();
        let mut last_unknown: Option<String> = None;
        loop {
            let next_poll = self.clock.now().saturating_add(self.config.poll);
            let (job, signals) = (&mut self.job, self.signals);
            sleep_until(self.clock, next_poll, || signals.received().is_some() || job.leader_exit().is_some());
            if let Some(signal) = self.signals.received() {
                let message = format!("got {}, stopping pid {} and its group", signal_name(signal), self.job.leader);
                self.log.note("signal", &message, None);
                self.stop();
                return Outcome::GuardSignal(signal);
            }
            if let Some(status) = self.job.leader_exit() {
                let outcome = outcome_of(status);
                let code = outcome.exit_code();
                let message = match &outcome {
                    Outcome::Unexplained(status) => {
                        format!("exit {code}: the command's end could not be read ({status})")
                    }
                    _ => format!("exit {code}"),
                };
                self.log.record("exit", &message, None, json!({ "exit": code }));
                let leftovers = self.job.alive(self.readings).len();
                if leftovers > 0 {
                    let message = format!("the command left {leftovers} processes running; stopping them");
                    self.log.note("leftovers", &message, None);
                    self.stop();
                }
                return outcome;
            }
            let memory = self.readings.memory();
            let command_memory = self.config.max_memory.map(|_| self.job.memory(self.readings));
            // Asked every poll, limit or not: a reader that follows the command's trace keeps up
            // with it, so a stop names the stage the command was in when it was stopped.
            let device_memory = self.readings.command_device_memory();
            let now = self.clock.now().saturating_sub(started);
            let (stop, notices) = watch.observe(now, memory.as_ref(), command_memory, device_memory);
            for notice in notices {
                let text = notice.to_string();
                // A failing reading is logged once per distinct error, not every poll.
                if matches!(notice, Notice::Unknown(_)) {
                    if last_unknown.as_deref() == Some(&text) {
                        continue;
                    }
                    last_unknown = Some(text.clone());
                }
                self.log.note("notice", &text, memory.as_ref().ok());
            }
            if memory.is_ok() {
                last_unknown = None;
            }
            if let Some(stop) = stop {
                let message = format!("killing pid {} and its group ({stop})", self.job.leader);
                self.log.record(
                    "stop",
                    &message,
                    memory.as_ref().ok(),
                    json!({ "command_memory": command_memory, "command_device_memory": device_memory }),
                );
                self.stop();
                return Outcome::Stopped(stop);
            }
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
/// Dropped before [`Job::reap`] (a panic, an early return), it kills its group and members.
struct Job {
    leader: Pid,
    guard: i32,
    /// The command's group was made the terminal's foreground group.
    terminal: bool,
    /// The leader's exit, once seen (Linux: seen without reaping; elsewhere: reaped).
    exit: Option<WaitStatus>,
    /// The members the last look found (the ones outside the group get signals one by one).
    members: Vec<ProcessEntry>,
    /// The leader was reaped: the group id may belong to someone else now.
    reaped: bool,
}

impl Job {
    /// Starts the command in a new process group. Err: (exit code 126/127, reason).
    fn spawn(command: &[OsString], env: &[(OsString, OsString)]) -> Result<Job, (i32, String)> {
        let (program, args) = command.split_first().ok_or((exit::NOT_FOUND, "no command".to_string()))?;
        let guard = std::process::id();
        #[cfg(target_os = "linux")]
        {
            // Orphaned descendants come to the guard, which then sees and stops them.
            nix::sys::prctl::set_child_subreaper(true).map_err(|e| (exit::NOT_EXECUTABLE, e.to_string()))?;
        }
        let foreground = in_foreground();
        let mut builder = Command::new(program);
        builder.args(args).envs(env.iter().map(|(k, v)| (k, v))).process_group(0);
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
        Ok(Job { leader, guard: guard as i32, terminal: foreground, exit: None, members: Vec::new(), reaped: false })
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

    /// Live members: every process below the guard (as a subreaper, the guard inherits every
    /// orphan of the command, so its group and whoever left it are all there), zombies left out.
    /// Orphans re-parented to the guard that have exited are reaped on the way. A tree that
    /// cannot be read gives the last members seen.
    fn members(&mut self, readings: &mut dyn Readings) -> Vec<ProcessEntry> {
        let Ok(tree) = readings.subtree(self.guard) else {
            return self.members.clone();
        };
        for orphan in tree.iter().filter(|e| e.zombie && e.ppid == self.guard && e.pid != self.leader.as_raw()) {
            let _ = waitpid(Pid::from_raw(orphan.pid), Some(WaitPidFlag::WNOHANG));
        }
        self.members = tree.into_iter().filter(|e| !e.zombie && e.pid != self.guard).collect();
        self.members.clone()
    }

    /// The command's memory: what its live members hold ([`stageload_probe::ProcessMemory::held`]:
    /// resident memory less file pages, plus swap), summed.
    fn memory(&mut self, readings: &mut dyn Readings) -> u64 {
        self.members(readings)
            .iter()
            .filter_map(|member| readings.process_memory(member.pid).ok())
            .map(|m| m.held())
            .fold(0, u64::saturating_add)
    }

    /// Reaps the leader (last of all) and gives the terminal back to the guard's group.
    fn reap(&mut self, log: &mut GuardLog, clock: &mut dyn Clock) {
        // Elsewhere than Linux the exit was seen by reaping it.
        let already_reaped = cfg!(not(target_os = "linux")) && self.exit.is_some();
        let cap = clock.now().saturating_add(AFTER_KILL);
        if !already_reaped {
            loop {
                match waitpid(self.leader, Some(WaitPidFlag::WNOHANG)) {
                    Ok(WaitStatus::StillAlive) if clock.now() < cap => clock.sleep(Duration::from_millis(20)),
                    Ok(WaitStatus::StillAlive) => {
                        log.note("unreaped", &format!("pid {} has not exited; not waiting for it", self.leader), None);
                        break;
                    }
                    _ => break,
                }
            }
        }
        self.reaped = true;
        if self.terminal {
            hand_terminal(io::stdin().as_fd(), getpgrp());
        }
    }
}

impl Group for Job {
    fn alive(&mut self, readings: &mut dyn Readings) -> Vec<i32> {
        let _ = self.leader_exit();
        self.members(readings).iter().map(|m| m.pid).collect()
    }

    fn send(&mut self, signal: Signal) {
        let _ = killpg(self.leader, signal);
        for member in self.members.iter().filter(|m| m.pgid != self.leader.as_raw()) {
            let _ = kill(Pid::from_raw(member.pid), signal);
        }
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        if self.reaped {
            return;
        }
        // Left without a stop and a reap: nothing the guard started may outlive it unwatched.
        let _ = self.alive(&mut SystemReadings::new());
        self.send(Signal::SIGKILL);
        // No clock reaches a drop: the real one bounds the wait.
        self.reap(&mut GuardLog::silent(), &mut SystemClock::new());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The process's state letter (`Z` for a zombie), or `None` once it is gone.
    fn state(pid: Pid) -> Option<char> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        stat.rsplit_once(") ").and_then(|(_, rest)| rest.chars().next())
    }

    /// A job counts every process below the guard as its own: one job at a time in this binary.
    static ONE_JOB: std::sync::Mutex<()> = std::sync::Mutex::new(());

    fn stubborn() -> Job {
        let command: Vec<OsString> =
            ["sh", "-c", "trap '' TERM; exec sleep 30"].into_iter().map(OsString::from).collect();
        Job::spawn(&command, &[]).unwrap()
    }

    #[test]
    fn an_unexpected_wait_status_is_its_own_outcome_not_a_stop_by_the_guard() {
        let outcome = outcome_of(WaitStatus::Stopped(Pid::from_raw(1), Signal::SIGSTOP));
        assert!(matches!(&outcome, Outcome::Unexplained(status) if status.contains("SIGSTOP")), "{outcome:?}");
        assert_eq!(outcome.exit_code(), exit::UNEXPLAINED);
        assert_eq!(outcome_of(WaitStatus::Exited(Pid::from_raw(1), 3)), Outcome::Exited(3));
    }

    #[test]
    fn a_job_dropped_without_a_stop_is_killed_and_reaped() {
        let _alone = ONE_JOB.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let job = stubborn();
        let leader = job.leader;
        assert!(state(leader).is_some_and(|s| s != 'Z'), "running");
        drop(job);
        assert_eq!(state(leader), None, "killed and reaped");
    }

    #[test]
    fn a_panic_while_a_job_runs_still_kills_its_group() {
        let _alone = ONE_JOB.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let leader = std::panic::catch_unwind(|| {
            let job = stubborn();
            let leader = job.leader;
            std::thread::sleep(Duration::from_millis(50));
            panic!("something failed in the middle of a stop of {leader}");
        });
        let message = leader.unwrap_err().downcast::<String>().unwrap();
        let pid: i32 = message.rsplit(' ').next().unwrap().parse().unwrap();
        assert_eq!(state(Pid::from_raw(pid)), None, "the panic's unwinding killed and reaped it");
    }
}
