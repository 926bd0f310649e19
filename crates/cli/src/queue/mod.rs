//! `stageload run [guard flags] [--lane L] [--owner O] [--who W] -- COMMAND` and `stageload
//! queue`: one queue for the machine, as the original Python `stageload` has it.
//!
//! `stageload guard` decides alone, so two guards that find room at the same moment both start.
//! `run` puts the command in a lane under `STAGELOAD_HOME` ([`home`]); it starts when no older
//! entry of the lane is alive and it holds the lane's lock (the guard crate's
//! [`stageload_guard::queue`] rules: fair order between owners), then the guard's own admission
//! and watch run as `stageload guard` runs them (`wait_for_room`, `run_admitted`). The command
//! inherits the lock, so the lane stays taken while anything of it runs, even after its queuer
//! is killed with SIGKILL. Every run is metered into a trace ([`meter`]) and one line per
//! finished run goes to `history.jsonl`.

mod home;
mod meter;

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Args;
use serde_json::json;
use stageload_guard::queue::{self as rules, wait_turn, Asking, Lane, Turn, DEFAULT_LANE};
use stageload_guard::{
    exit, run_admitted, signalled_before_start, wait_for_room, Admitted, Clock, GuardConfig, Outcome, Readings,
    SystemClock,
};
use stageload_plan::request::Mode;
use stageload_probe::{ProbeError, ProcessEntry, ProcessMemory, SystemMemory};
use stageload_units::format_bytes;

use crate::args::size;
use crate::guard::held::{CommandReadings, Held, TraceTail};
use crate::guard::{log_and_signals, GuardFlags};
use crate::out;
use home::{look, utc_now, EntryFile, FileState, Finished, Home, LaneView, QueueError};

const RUN_HELP: &str = "\
Exit codes: those of `stageload guard` (the command's own, 128+N, 3 stopped, 4 no turn or no
room within --start-timeout, 125, 126, 127), and 2 for bad usage: an invalid flag, a lane name
that is not a plain folder name, a STAGELOAD_HOME that cannot be written, a bad line in its
busy.txt.

Files under STAGELOAD_HOME (default ~/.stageload): queue/LANE/ (one entry per run, the lane's
lock run.lock, owners.json), history.jsonl (one line per finished run), traces/ (each run's
own trace, unless --meter names another file; --trace is the command's own, as for guard),
busy.txt (--busy patterns every run of lane ram adds, one a line).

Order: a command starts when no older entry of its lane is alive and it holds the lane's lock;
the owner (--owner, else --who up to its first dash) who started least recently goes next, each
owner's entries in the order they joined. The command inherits the lock: the lane stays taken
while any process of it runs, even if this run is killed. Lanes do not wait for each other.
--start-timeout counts from joining the queue (default 24h here).

Example:
  stageload run --lane ram --who alice-sd --max-memory 20G -- python run.py";

/// Queue COMMAND in a lane, start it when its turn comes and there is room, then guard it as
/// `stageload guard` does, metered into a trace
#[derive(Args)]
#[command(after_help = RUN_HELP, mut_arg("start_timeout", |arg| arg.default_value("24h")))]
pub struct RunArgs {
    #[command(flatten)]
    flags: GuardFlags,
    /// Commands of one lane run one at a time; lanes do not wait for each other
    #[arg(long, value_name = "LANE", default_value = DEFAULT_LANE)]
    lane: String,
    /// Who queued it, shown by `stageload queue`
    #[arg(long, value_name = "WHO", env = "STAGELOAD_WHO", default_value = "")]
    who: String,
    /// Whose turn the run takes (default: --who up to its first dash)
    #[arg(long, value_name = "OWNER", env = "STAGELOAD_OWNER")]
    owner: Option<String>,
    /// Also write every decision, with the readings behind it, as JSON lines to FILE
    #[arg(long, value_name = "FILE")]
    log: Option<PathBuf>,
    /// Where the run's own trace goes, the memory of the command's processes metered from
    /// outside (default STAGELOAD_HOME/traces/STAMP-WHO-PID.jsonl)
    #[arg(long, value_name = "FILE", conflicts_with = "no_meter")]
    meter: Option<PathBuf>,
    /// Do not meter the command
    #[arg(long)]
    no_meter: bool,
    /// With --plan or --max-device-memory: the trace the command writes, read as `stageload
    /// guard --trace` reads it (its device memory, and the stage a run over its plan was in)
    #[arg(long, value_name = "FILE")]
    trace: Option<PathBuf>,
    /// Stop the command when its device memory (read from --trace) passes SIZE; with --plan
    /// the plan sets it
    #[arg(long, value_name = "SIZE", value_parser = size, requires = "trace", conflicts_with = "plan")]
    max_device_memory: Option<u64>,
    /// Declare what the command will hold by this pipeline file's plan and hold it there, as
    /// `stageload guard --plan` does (its --max-memory; --wait-free, --kill-free, --busy and
    /// --quiet-for skipped): it may start beside other runs of its lane that declared theirs
    #[arg(long, value_name = "FILE", conflicts_with_all = ["max_memory", "wait_free", "kill_free", "busy", "quiet_for", "memory"])]
    plan: Option<PathBuf>,
    /// With --plan: the eager request, every model loaded up front
    #[arg(long, requires = "plan")]
    eager: bool,
    /// Declare that the command holds at most SIZE (and hold it there: its --max-memory): it may
    /// start beside other runs of its lane that declared theirs
    #[arg(long, value_name = "SIZE", value_parser = size, conflicts_with = "max_memory")]
    memory: Option<u64>,
    /// With --plan or --memory: memory to keep free beside the sum of the declared plans
    #[arg(long, value_name = "SIZE", value_parser = size, default_value = "0")]
    margin: u64,
    /// The command and its arguments, after --
    #[arg(last = true, value_name = "COMMAND")]
    command: Vec<OsString>,
}

/// Show the running and waiting commands of every lane, and the last finished runs
#[derive(Args)]
#[command(after_help = "Example:\n  stageload queue --lane ram --history 5")]
pub struct QueueArgs {
    /// Only this lane
    #[arg(long, value_name = "LANE")]
    lane: Option<String>,
    /// Print JSON: the entries, or with --history an object of `queue` and `history`
    #[arg(long)]
    json: bool,
    /// Also show the last N finished runs
    #[arg(long, value_name = "N", default_value_t = 0)]
    history: usize,
}

/// The command as one line for the queue's files, cut to 300 characters.
fn command_line(command: &[OsString]) -> String {
    let line = command.iter().map(|part| part.to_string_lossy()).collect::<Vec<_>>().join(" ");
    line.chars().take(300).collect()
}

pub fn run(args: RunArgs) -> i32 {
    if args.command.is_empty() {
        eprintln!("stageload run: run needs a command after -- (for example: stageload run -- python run.py)");
        return exit::USAGE;
    }
    match queued(args) {
        Ok(code) => code,
        Err(Refused::Said(code)) => code,
        Err(Refused::Queue(error)) => {
            eprintln!("stageload run: {error}");
            exit::USAGE
        }
        Err(Refused::Usage(error)) => {
            eprintln!("stageload run: {error}");
            exit::USAGE
        }
    }
}

/// Why a run did not get to its command, before any waiting.
enum Refused {
    Queue(QueueError),
    Usage(String),
    /// Already said; the exit code.
    Said(i32),
}

impl From<QueueError> for Refused {
    fn from(error: QueueError) -> Self {
        Refused::Queue(error)
    }
}

fn queued(args: RunArgs) -> Result<i32, Refused> {
    // Read here, not by clap, so a refusal is one line.
    let lane = Lane::parse(&args.lane).map_err(|e| Refused::Usage(e.to_string()))?;
    let mut config = args.flags.config().map_err(Refused::Usage)?;
    if args.trace.is_some() && args.plan.is_none() && args.max_device_memory.is_none() {
        let message = "--trace is the command's own trace, read for --plan or --max-device-memory: give one of them, \
                       or --meter FILE for where the run's trace goes";
        return Err(Refused::Usage(message.to_string()));
    }
    config.max_device_memory = args.max_device_memory;
    let (request, held) = declared(args.plan.as_deref(), args.eager, args.memory, args.trace.as_deref(), &mut config)?;
    let home = Home::from_env()?;
    let dir = home.lane(&lane)?;
    if lane.as_str() == DEFAULT_LANE && request.is_none() {
        // The engines that fill the memory, named once for every session (a run that declares
        // what it holds is held to that instead, as guard --plan skips --busy).
        config.busy.extend(home.busy_patterns()?);
    }
    let lock = dir.lock_file()?;
    let pid = std::process::id() as i32;
    let owner = rules::owner_of(&args.who, args.owner.as_deref());
    let start_time = match look(pid) {
        rules::Seen::Alive { start_time } => start_time,
        rules::Seen::Gone => None,
    };
    let entry = EntryFile {
        pid,
        start_time,
        who: args.who.clone(),
        owner: owner.clone(),
        lane: lane.to_string(),
        cmd: command_line(&args.command),
        since: utc_now(),
        state: FileState::Waiting,
        request,
        waits_for: None,
    };
    // Before joining: a signal from here on removes the entry on the way out.
    let (mut log, signals) = log_and_signals("run", args.log.as_deref(), true).map_err(Refused::Said)?;
    let (joined, me) = dir.join(pid, &entry)?;
    let mut clock = SystemClock::new();
    let total = stageload_probe::system_memory().ok().map(|memory| memory.budget_total());
    let asking = Asking { ticket: me, request, margin: args.margin, total };
    let mut view = LaneView { dir: &dir, lock: &lock, joined: &joined, file: entry, hold: None };
    let turn = wait_turn(&mut view, &lane, &asking, config.poll, config.start_timeout, &mut clock, &mut log, &signals);
    let mut entry = view.file;
    match turn {
        Turn::Taken(_) => {}
        Turn::NoTurn(_) => return Ok(exit::NO_ROOM),
        Turn::Signal(signal) => return Ok(signalled_before_start(signal, &mut log).exit_code()),
    }
    // One --start-timeout from joining to the start.
    config.start_timeout = config.start_timeout.saturating_sub(clock.now());
    let mut readings = WithoutQueue { home: home.clone(), command: CommandReadings::new(None) };
    let at_start = match wait_for_room(&config, &mut readings, &mut clock, &mut log, &signals) {
        Admitted::Start(memory) => memory,
        Admitted::NoRoom(_) => return Ok(exit::NO_ROOM),
        Admitted::Signal(signal) => return Ok(signalled_before_start(signal, &mut log).exit_code()),
    };
    let waited = clock.now();
    let started_ns = home::now_ns();
    entry.state = FileState::Running { started: utc_now(), started_ns };
    entry.waits_for = None;
    if let Err(error) = joined.write(&entry) {
        log.note("queue_file", &error.to_string(), None);
    }
    if let Err(error) = dir.note_start(&owner, started_ns) {
        log.note("queue_file", &error.to_string(), None);
    }
    let trace = (!args.no_meter).then(|| args.meter.clone().unwrap_or_else(|| home.default_trace(&args.who)));
    let meta = json!({ "who": args.who, "owner": owner, "lane": lane.as_str(), "cmd": entry.cmd });
    let metered = trace.as_ref().and_then(|path| match meter::start(path, meta) {
        Ok(meter) => Some(meter),
        Err(error) => {
            let message = format!("cannot write the trace {}: {error}; the run goes on unmetered", path.display());
            log.note("trace", &message, None);
            None
        }
    });
    // The history and the last line name a trace only where one is written.
    let trace = trace.filter(|_| metered.is_some());
    let message = format!("start in lane {} after {:.0} s", lane, waited.as_secs_f64());
    log.record(
        "queue_start",
        &message,
        Some(&at_start),
        json!({ "lane": lane.as_str(), "waited_s": waited.as_secs_f64() }),
    );
    if let Err(error) = lock.inherit() {
        // The lane stays this run's while it watches; only a SIGKILL of it frees the lane early.
        log.note("queue_lock", &error, None);
    }
    // Made before the command starts: a trace already there is a previous run's.
    readings.command.tail = args.trace.as_deref().map(TraceTail::new);
    let began = clock.now();
    let outcome = run_admitted(&args.command, &[], &at_start, &config, &mut readings, &mut clock, &mut log, &signals);
    let ran = clock.now().saturating_sub(began);
    if let (Some(held), Outcome::Stopped(stop)) = (&held, &outcome) {
        if let Some(over) = held.over_plan(stop, readings.command.tail.as_ref()) {
            log.record("over_plan", &over.message(), None, over.detail());
        }
    }
    if let (Some(tail), Some(_)) = (&readings.command.tail, config.max_device_memory) {
        if tail.never_read_device() {
            let message = format!(
                "the trace {} carried no device reading: the device limit was never checked",
                tail.path().display()
            );
            log.note("device_unread", &message, None);
        }
    }
    let footprint = metered.map(|meter| meter.finish()).unwrap_or_default();
    let code = outcome.exit_code();
    let finished = Finished {
        end: utc_now(),
        lane: lane.to_string(),
        who: args.who.clone(),
        owner,
        cmd: entry.cmd.clone(),
        exit: code,
        stopped: match &outcome {
            Outcome::Stopped(stop) => Some(stop.to_string()),
            _ => None,
        },
        waited_s: round1(waited),
        run_s: round1(ran),
        peak_rss: footprint.peak_rss,
        swap_start: footprint.swap.map(|s| s.start),
        swap_peak: footprint.swap.map(|s| s.peak),
        swap_end: footprint.swap.map(|s| s.end),
        min_available: footprint.min_available,
        trace: trace.as_ref().map(|p| p.display().to_string()),
    };
    if let Err(error) = home.append_finished(&finished) {
        log.note("history", &error.to_string(), None);
    }
    let mut message = format!("exit {code} after {:.0} s", ran.as_secs_f64());
    if let Some(peak) = footprint.peak_rss {
        message += &format!(", peak {}", format_bytes(peak));
    }
    if let Some(trace) = &trace {
        message += &format!(", trace {}", trace.display());
    }
    log.note("queue_end", &message, None);
    // The entry goes, then the lock file closes (the command's processes are gone by now).
    drop(joined);
    drop(lock);
    Ok(code)
}

/// What the run declares it will hold (`--plan`, `--memory`), with the guard held to it (and
/// the plan, for what a stop over it says); `None`: nothing, it runs alone in its lane.
fn declared(
    plan: Option<&Path>,
    eager: bool,
    memory: Option<u64>,
    trace: Option<&Path>,
    config: &mut GuardConfig,
) -> Result<(Option<u64>, Option<Held>), Refused> {
    if let Some(file) = plan {
        let mode = if eager { Mode::Eager } else { Mode::Staged };
        let held = Held::load(file, mode, trace).map_err(Refused::Usage)?;
        held.hold(config);
        return Ok((config.max_memory, Some(held)));
    }
    if let Some(memory) = memory {
        config.max_memory = Some(memory);
        config.limits_from = Some(format!("held to --memory {}", format_bytes(memory)));
        return Ok((Some(memory), None));
    }
    Ok((None, None))
}

fn round1(duration: Duration) -> f64 {
    (duration.as_secs_f64() * 10.0).round() / 10.0
}

/// The machine's readings, with the runs of the queue left out of the process table that
/// `--busy` matches: each one's command line names the engine it will start, so the head of a
/// lane would wait for the runs behind it and none would ever start. What they started counts.
struct WithoutQueue {
    home: Home,
    /// The machine's readings, and the command's own trace (`--trace`), read for its device
    /// memory.
    command: CommandReadings,
}

/// A `stageload guard` or `stageload run` command line (not yet its command).
fn is_wrapper(cmdline: &str) -> bool {
    let mut words = cmdline.split_whitespace();
    while let Some(word) = words.next() {
        if word == "stageload" || word.ends_with("/stageload") {
            return words.next().is_some_and(|next| next == "guard" || next == "run");
        }
    }
    false
}

impl Readings for WithoutQueue {
    fn processes(&mut self) -> Result<Vec<ProcessEntry>, ProbeError> {
        let queued = self.home.queued_pids();
        let table = stageload_probe::processes()?;
        Ok(table.into_iter().filter(|p| !queued.contains(&p.pid) && !is_wrapper(&p.cmdline)).collect())
    }

    fn memory(&mut self) -> Result<SystemMemory, ProbeError> {
        self.command.memory()
    }
    fn subtree(&mut self, root: i32) -> Result<Vec<ProcessEntry>, ProbeError> {
        self.command.subtree(root)
    }
    fn process_memory(&mut self, pid: i32) -> Result<ProcessMemory, ProbeError> {
        self.command.process_memory(pid)
    }
    fn command_device_memory(&mut self) -> Option<u64> {
        self.command.command_device_memory()
    }
}

pub fn queue(args: QueueArgs) -> i32 {
    match show(&args) {
        Ok(()) => 0,
        Err(error) => {
            eprintln!("stageload queue: {error}");
            exit::USAGE
        }
    }
}

fn show(args: &QueueArgs) -> Result<(), String> {
    let only = args.lane.as_deref().map(Lane::parse).transpose().map_err(|e| e.to_string())?;
    let home = Home::from_env().map_err(|e| e.to_string())?;
    let lanes = home.lanes().map_err(|e| e.to_string())?;
    let lanes: Vec<_> = lanes.into_iter().filter(|dir| only.is_none() || only.as_ref() == Some(dir.lane())).collect();
    let mut rows = Vec::new();
    for dir in &lanes {
        let live = dir.live().map_err(|e| e.to_string())?;
        let entries: Vec<rules::Entry> = live.iter().map(|l| l.entry.clone()).collect();
        for (position, entry) in rules::listing(&entries, &dir.last_starts()).into_iter().enumerate() {
            let Some(file) = live.iter().find(|l| l.entry.ticket == entry.ticket).map(|l| &l.file) else { continue };
            let (state, since) = match &file.state {
                FileState::Waiting => ("waiting", file.since.clone()),
                FileState::Starting { .. } => ("starting", file.since.clone()),
                FileState::Running { started, .. } => ("running", started.clone()),
            };
            let waits_for = match &file.state {
                FileState::Running { .. } => None,
                _ => file.waits_for.clone(),
            };
            rows.push(json!({
                "lane": dir.lane().as_str(),
                "position": position,
                "state": state,
                "who": file.who,
                "owner": file.owner,
                "pid": entry.ticket.pid,
                "since": since,
                "request": file.request,
                "waits_for": waits_for,
                "cmd": file.cmd,
            }));
        }
    }
    let history =
        if args.history > 0 { home.last_finished(args.history).map_err(|e| e.to_string())? } else { Vec::new() };
    if args.json {
        let value = if args.history > 0 { json!({ "queue": rows, "history": history }) } else { json!(rows) };
        out::line(&serde_json::to_string_pretty(&value).unwrap_or_default());
        return Ok(());
    }
    if rows.is_empty() {
        out::line("queue: empty");
    }
    let text = |row: &serde_json::Value, key: &str| row[key].as_str().unwrap_or("").to_string();
    for row in &rows {
        let who = text(row, "who");
        let cmd: String = text(row, "cmd").chars().take(80).collect();
        let request = row["request"].as_u64().map_or("-".to_string(), format_bytes);
        let waits = row["waits_for"].as_str().map(|w| format!("  waits for {w}")).unwrap_or_default();
        out::line(&format!(
            "{:6} {:>2} {:8} {:20} {:10} pid {:<7} since {}  request {request}  {}{waits}",
            text(row, "lane"),
            row["position"],
            text(row, "state"),
            if who.is_empty() { "-" } else { &who },
            text(row, "owner"),
            row["pid"],
            text(row, "since"),
            cmd
        ));
    }
    for run in &history {
        let cmd: String = run.cmd.chars().take(60).collect();
        let peak = run.peak_rss.map_or("-".to_string(), format_bytes);
        out::line(&format!(
            "done   {:6} exit {:<4} {:20} waited {:.0} s, ran {:.0} s, peak {peak}  {cmd}",
            run.lane,
            run.exit,
            if run.who.is_empty() { "-" } else { &run.who },
            run.waited_s,
            run.run_s
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guard_and_run_command_lines_are_wrappers_and_their_commands_are_not() {
        assert!(is_wrapper("/usr/bin/stageload run --lane ram -- python ltx.py"));
        assert!(is_wrapper("stageload guard --busy ltx -- python ltx.py"));
        assert!(!is_wrapper("python ltx.py"));
        assert!(!is_wrapper("stageload summary run.jsonl"));
        assert!(!is_wrapper("python /opt/stageload/run.py"));
    }
}
