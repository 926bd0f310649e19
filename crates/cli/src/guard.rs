//! `stageload guard [OPTIONS] -- COMMAND [ARGS...]`: flags, their checks (all before any
//! waiting), and the exit code.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Args;
use regex::Regex;
use stageload_guard::config::{defaults, ranges, within};
use stageload_guard::{exit, run_guarded, GuardConfig, GuardLog, Outcome, Signals, SystemClock, SystemReadings};
use stageload_plan::request::Mode;
use stageload_units::format_gb;

use crate::args::{duration, size};
use crate::out;

pub(crate) mod held;
use held::{CommandReadings, Held};

const EXIT_CODES: &str = "\
Exit codes:
  N        the command's own exit code
  128+N    a signal N ended the command, or the guard got SIGINT/SIGTERM/SIGHUP (it stops the
           command first; a second signal skips the grace and kills at once)
  3        the guard stopped the command (swap over budget, memory low twice, --max-memory,
           --max-device-memory, or the limits of --plan)
  4        no room within --start-timeout (with --check: it would not start now)
  125      the command ended in a way the guard could not read
  126      the command was found but cannot be executed
  127      the command was not found
  2        bad usage: an invalid flag, a duration out of its range, flags that contradict
           each other, or no command after --; with --plan also a pipeline file that does not
           load, or a plan that does not fit this machine

--plan FILE holds a job a scheduler already admitted to its plan: --max-memory is the plan's
largest stage need plus its reserve (the numbers of `stageload plan FILE --request json`; with
--eager those of the eager run), and on CUDA the device need plus reserve is a device limit,
read from the trace the command writes (--trace). It skips the rules that only make sense on a
shared desktop: --wait-free (0), --busy and --quiet-for (none), and --kill-free (0: a
machine-wide low-memory rule on a scheduler's node would stop whichever job it watches, not the
one over its plan); the swap budget and --swap-limit stay. Giving --plan with --max-memory,
--wait-free, --kill-free, --busy or --quiet-for is refused. A run over its plan is stopped (exit
3) and the log says by how much and in which stage (from --trace: the last stage begun).

Sizes: 8G, 512M, 1.5GiB (binary), 2GB (decimal), 100 (bytes). Durations: 250ms, 90s, 30m, 2h.

Example:
  stageload guard --max-memory 20G -- python train.py";

/// Start COMMAND only when there is memory for it, in its own process group; stop the group
/// when swap grows past the budget, available memory stays too low, or the command passes
/// --max-memory (or, with --plan, its plan's limits).
#[derive(Args)]
#[command(after_help = EXIT_CODES)]
pub struct GuardArgs {
    #[command(flatten)]
    pub flags: GuardFlags,
    /// Also write every decision, with the readings behind it, as JSON lines to FILE
    #[arg(long, value_name = "FILE")]
    pub log: Option<PathBuf>,
    /// Only say whether the command would start now, and if not, why (exit 0 or 4); with
    /// --plan also the limits the plan sets
    #[arg(long)]
    check: bool,
    /// Hold the command to this pipeline file's plan, for a job a scheduler already admitted:
    /// --max-memory is the plan's largest stage need plus its reserve (as `stageload plan
    /// --request` says), and with --trace on CUDA the device need plus reserve is a device limit.
    /// Skips --wait-free (0), --busy, --quiet-for and --kill-free (0: a machine-wide low-memory
    /// stop on a shared node would stop whichever job it watches); keeps the swap budget. Exit 2
    /// when the file does not load or the plan does not fit this machine
    #[arg(long, value_name = "FILE", conflicts_with_all = ["max_memory", "wait_free", "kill_free", "busy", "quiet_for"])]
    plan: Option<PathBuf>,
    /// With --plan: hold the command to the eager request (every model loaded up front)
    #[arg(long, requires = "plan")]
    eager: bool,
    /// With --plan or --max-device-memory: the trace the command writes (a stageload JSONL
    /// trace, read as it grows): its device memory, and the stage a run over its plan was in
    #[arg(long, value_name = "FILE")]
    trace: Option<PathBuf>,
    /// Stop the command when its device memory (CUDA memory allocated by tensors, read from the
    /// samples of the trace it writes: --trace) passes SIZE; with --plan the plan sets it
    #[arg(long, value_name = "SIZE", value_parser = size, requires = "trace", conflicts_with = "plan")]
    max_device_memory: Option<u64>,
    /// The command and its arguments, after --
    #[arg(last = true, value_name = "COMMAND")]
    command: Vec<OsString>,
}

/// What the guard waits for and watches, as flags (`stageload guard` and `stageload ab`).
#[derive(Args)]
pub struct GuardFlags {
    /// Start only when at least PCT percent of memory is available (of the cgroup limit in a container)
    #[arg(long, value_name = "PCT", default_value = defaults::WAIT_FREE, value_parser = percent)]
    wait_free: u8,
    /// Swap the system may gain over its level at the start before the command is stopped
    #[arg(long, value_name = "SIZE", default_value = defaults::SWAP_BUDGET, value_parser = size)]
    swap_budget: u64,
    /// Absolute swap ceiling: caps the budget, and waits until swap + budget fits under it
    #[arg(long, value_name = "SIZE", value_parser = size)]
    swap_limit: Option<u64>,
    /// Stop the command after two readings in a row under PCT percent available
    #[arg(long, value_name = "PCT", default_value = defaults::KILL_FREE, value_parser = percent)]
    kill_free: u8,
    /// Do not start while a process whose command line matches REGEX runs (repeatable; the
    /// guard and its ancestors are ignored)
    #[arg(long, value_name = "REGEX", value_parser = regex)]
    busy: Vec<Regex>,
    /// With --busy: start only after no busy process was seen for this long
    #[arg(long, value_name = "DUR", default_value = defaults::QUIET_FOR, value_parser = |t: &str| ranged(t, ranges::QUIET_FOR))]
    quiet_for: Duration,
    /// Give up waiting for room after this long (exit 4; at most 7 days)
    #[arg(long, value_name = "DUR", default_value = defaults::START_TIMEOUT, value_parser = |t: &str| ranged(t, ranges::START_TIMEOUT))]
    start_timeout: Duration,
    /// Interval of the readings while waiting and while watching (10ms to 1m)
    #[arg(long, value_name = "DUR", default_value = defaults::POLL, value_parser = |t: &str| ranged(t, ranges::POLL))]
    poll: Duration,
    /// Time between SIGTERM and SIGKILL when stopping the command (at most 1h)
    #[arg(long, value_name = "DUR", default_value = defaults::GRACE, value_parser = |t: &str| ranged(t, ranges::GRACE))]
    grace: Duration,
    /// Stop the command when its own memory (resident memory less file pages, which the kernel
    /// reclaims, plus swap, over its processes) passes SIZE
    #[arg(long, value_name = "SIZE", value_parser = size)]
    max_memory: Option<u64>,
}

impl GuardFlags {
    /// The guard's configuration, with the rules between flags checked (the message names them).
    pub fn config(self) -> Result<GuardConfig, String> {
        let config = GuardConfig {
            wait_free: f64::from(self.wait_free),
            swap_budget: self.swap_budget,
            swap_limit: self.swap_limit,
            kill_free: f64::from(self.kill_free),
            busy: self.busy,
            quiet_for: self.quiet_for,
            start_timeout: self.start_timeout,
            poll: self.poll,
            grace: self.grace,
            max_memory: self.max_memory,
            max_device_memory: None,
            limits_from: None,
        };
        config.check().map(|()| config).map_err(|e| e.to_string())
    }
}

/// The log and the signal handlers a guarded run needs; Err: the exit code after saying why.
pub fn log_and_signals(command: &str, log: Option<&Path>, echo: bool) -> Result<(GuardLog, Signals), i32> {
    let log = GuardLog::new(log, echo).map_err(|error| {
        // Only creating the --log file can fail.
        eprintln!("stageload {command}: cannot write --log {}: {error}", log.unwrap_or(Path::new("")).display());
        exit::USAGE
    })?;
    let signals = Signals::install().map_err(|error| {
        eprintln!("stageload {command}: cannot install signal handlers: {error}");
        exit::USAGE
    })?;
    Ok((log, signals))
}

fn percent(text: &str) -> Result<u8, String> {
    let value: u64 = text.trim().parse().map_err(|_| format!("'{text}' is not a whole percent (0 to 100)"))?;
    u8::try_from(value).ok().filter(|v| *v <= 100).ok_or_else(|| format!("{value} is out of range (0 to 100)"))
}

fn ranged(text: &str, range: std::ops::RangeInclusive<Duration>) -> Result<Duration, String> {
    within(duration(text)?, &range).map_err(|e| e.to_string())
}

fn regex(text: &str) -> Result<Regex, String> {
    Regex::new(text).map_err(|e| format!("bad regex '{text}': {e}"))
}

pub fn run(args: GuardArgs) -> i32 {
    if args.command.is_empty() && !args.check {
        eprintln!("stageload guard: guard needs a command after -- (for example: stageload guard -- python run.py)");
        return exit::USAGE;
    }
    let mut config = match args.flags.config() {
        Ok(config) => config,
        Err(error) => {
            eprintln!("stageload guard: {error}");
            return exit::USAGE;
        }
    };
    if args.trace.is_some() && args.plan.is_none() && args.max_device_memory.is_none() {
        eprintln!(
            "stageload guard: --trace is read for --plan or --max-device-memory: give one of them, or leave --trace out"
        );
        return exit::USAGE;
    }
    config.max_device_memory = args.max_device_memory;
    let mode = if args.eager { Mode::Eager } else { Mode::Staged };
    let held = match args.plan.as_deref().map(|file| Held::load(file, mode, args.trace.as_deref())).transpose() {
        Ok(held) => held,
        Err(error) => {
            eprintln!("stageload guard: {error}");
            return exit::USAGE;
        }
    };
    if let Some(held) = &held {
        held.hold(&mut config);
    }
    let (mut log, signals) = match log_and_signals("guard", args.log.as_deref(), !args.check) {
        Ok(both) => both,
        Err(code) => return code,
    };
    if args.check {
        if let Some(from) = &config.limits_from {
            out::line(from);
        }
        return check(&config, &mut log);
    }
    // Made before the command starts: a trace already there is a previous run's.
    let mut readings = CommandReadings::new(args.trace.as_deref());
    let outcome = run_guarded(&args.command, &config, &mut readings, &mut SystemClock::new(), &mut log, &signals);
    let tail = readings.tail;
    if let (Some(held), Outcome::Stopped(stop)) = (&held, &outcome) {
        if let Some(over) = held.over_plan(stop, tail.as_ref()) {
            log.record("over_plan", &over.message(), None, over.detail());
        }
    }
    if let (Some(tail), Some(_)) = (&tail, config.max_device_memory) {
        if tail.never_read_device() {
            let message = format!(
                "the trace {} carried no device reading: the device limit was never checked",
                tail.path().display()
            );
            log.note("device_unread", &message, None);
        }
    }
    outcome.exit_code()
}

/// `--check`: one look at the machine, printed to stdout.
fn check(config: &GuardConfig, log: &mut GuardLog) -> i32 {
    let (reasons, memory) = stageload_guard::check_once(config, &mut SystemReadings::new(), log);
    if let Some(memory) = &memory {
        out::line(&format!(
            "memory: {:.0}% available ({} of {}), swap used {} of {}",
            memory.available_percent(),
            format_gb(memory.budget_available()),
            format_gb(memory.budget_total()),
            format_gb(memory.swap_used),
            format_gb(memory.swap_total)
        ));
    }
    if reasons.is_empty() {
        let quiet = if config.busy.is_empty() {
            String::new()
        } else {
            format!(" (after {:.0} s with no busy process)", config.quiet_for.as_secs_f64())
        };
        out::line(&format!("would start now{quiet}"));
        0
    } else {
        log.note("check", &format!("would wait ({})", stageload_guard::decide::describe(&reasons)), memory.as_ref());
        out::line(&format!("would wait: {}", stageload_guard::decide::describe(&reasons)));
        exit::NO_ROOM
    }
}
