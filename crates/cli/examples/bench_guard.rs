//! Benchmark of `stageload guard` (not a test): how fast it reacts and what watching costs.
//!
//! 1. Reaction: a Python child allocates (and touches) memory as fast as it can, printing the
//!    monotonic time and its total after every block; the guard runs with `--max-memory LIMIT`
//!    at the default poll. Reported: the child's allocation rate, the time from the child
//!    crossing LIMIT to the guard's exit (group gone and reaped), and the overshoot (what the
//!    guard measured at the stop minus LIMIT). Bounded: the child stops at `--ceiling`.
//! 2. CPU: the guard watching `sleep` for `--watch-seconds`, without and with `--max-memory`
//!    (which walks the command's process tree every poll), as CPU seconds per hour of watching.
//!
//! Run: `cargo xtask bench-guard` (writes traces/guard-bench.md and .json).

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};

use clap::Parser;
use nix::sys::resource::{getrusage, UsageWho};
use nix::time::{clock_gettime, ClockId};
use serde_json::json;

#[derive(Parser)]
struct Options {
    /// --max-memory given to the guard
    #[arg(long, default_value = "1G")]
    limit: String,
    /// The most the child ever allocates
    #[arg(long, default_value = "3G")]
    ceiling: String,
    /// Reaction runs
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Length of each CPU measurement
    #[arg(long, default_value_t = 20)]
    watch_seconds: u64,
    /// Where the results go (.md and .json)
    #[arg(long, default_value = "traces/guard-bench")]
    out: PathBuf,
}

fn stageload() -> PathBuf {
    // Examples live in target/<profile>/examples/, the binary in target/<profile>/.
    let exe = std::env::current_exe().expect("own path");
    exe.parent().and_then(|dir| dir.parent()).expect("target folder").join("stageload")
}

fn monotonic() -> f64 {
    let now = clock_gettime(ClockId::CLOCK_MONOTONIC).expect("monotonic clock");
    now.tv_sec() as f64 + now.tv_nsec() as f64 * 1e-9
}

fn children_cpu() -> f64 {
    let usage = getrusage(UsageWho::RUSAGE_CHILDREN).expect("getrusage");
    let seconds = |t: nix::sys::time::TimeVal| t.tv_sec() as f64 + t.tv_usec() as f64 * 1e-6;
    seconds(usage.user_time()) + seconds(usage.system_time())
}

struct Reaction {
    rate_gb_s: f64,
    reaction_s: f64,
    overshoot: i64,
    exit: Option<i32>,
}

fn reaction_run(limit: u64, limit_text: &str, ceiling: u64, log: &PathBuf) -> Reaction {
    // time.monotonic() is CLOCK_MONOTONIC on Linux, the same clock as ours.
    let program = format!(
        "import sys, time\nblocks = []\ntotal = 0\nwhile total < {ceiling}:\n    blocks.append(b'x' * (16 << 20))\n    total += 16 << 20\n    print(time.monotonic(), total, flush=True)\ntime.sleep(30)\n"
    );
    let mut child = Command::new(stageload())
        .args(["guard", "--wait-free", "0", "--kill-free", "0", "--grace", "1s", "--max-memory", limit_text])
        .arg("--log")
        .arg(log)
        .args(["--", "python3", "-c", &program])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the guard");
    let mut points: Vec<(f64, u64)> = Vec::new();
    for line in BufReader::new(child.stdout.take().unwrap()).lines().map_while(Result::ok) {
        let mut fields = line.split_whitespace();
        if let (Some(t), Some(total)) = (fields.next(), fields.next()) {
            points.push((t.parse().unwrap(), total.parse().unwrap()));
        }
    }
    let status = child.wait().expect("guard exit");
    let gone = monotonic();
    let crossed = points.iter().find(|(_, total)| *total > limit).map_or(gone, |(t, _)| *t);
    let (first, last) = (points.first().copied().unwrap_or((gone, 0)), points.last().copied().unwrap_or((gone, 0)));
    let rate = (last.1 - first.1) as f64 / (last.0 - first.0).max(1e-9) / 1e9;
    let stop = std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .find(|record| record["event"] == "stop");
    let measured = stop.and_then(|record| record["detail"]["command_memory"].as_u64()).unwrap_or(0);
    Reaction {
        rate_gb_s: rate,
        reaction_s: gone - crossed,
        overshoot: measured as i64 - limit as i64,
        exit: status.code(),
    }
}

fn cpu_per_hour(extra: &[&str], seconds: u64) -> f64 {
    let before = children_cpu();
    let status = Command::new(stageload())
        .args(["guard", "--wait-free", "0", "--kill-free", "0"])
        .args(extra)
        .args(["--", "sleep", &seconds.to_string()])
        .stderr(Stdio::null())
        .status()
        .expect("run the guard");
    assert!(status.success(), "guard watching sleep: {status}");
    (children_cpu() - before) / seconds as f64 * 3600.0
}

/// The median of `values` (the project's one median; NaN for none).
fn median(values: Vec<f64>) -> f64 {
    stageload_trace::aggregate::median(&values).unwrap_or(f64::NAN)
}

fn main() {
    let options = Options::parse();
    let limit = stageload_units::parse_size(&options.limit).expect("--limit");
    let ceiling = stageload_units::parse_size(&options.ceiling).expect("--ceiling");
    let log = std::env::temp_dir().join(format!("stageload-bench-guard-{}.jsonl", std::process::id()));
    let runs: Vec<Reaction> = (0..options.runs).map(|_| reaction_run(limit, &options.limit, ceiling, &log)).collect();
    let _ = std::fs::remove_file(&log);
    for (i, run) in runs.iter().enumerate() {
        println!(
            "run {i}: child {:.2} GB/s, reaction {:.3} s, overshoot {:.0} MiB, exit {:?}",
            run.rate_gb_s,
            run.reaction_s,
            run.overshoot as f64 / 1048576.0,
            run.exit
        );
    }
    let plain = cpu_per_hour(&[], options.watch_seconds);
    let scanning = cpu_per_hour(&["--max-memory", "64G"], options.watch_seconds);
    let rate = median(runs.iter().map(|r| r.rate_gb_s).collect());
    let reaction = median(runs.iter().map(|r| r.reaction_s).collect());
    let overshoot = median(runs.iter().map(|r| r.overshoot as f64).collect());
    let worst = runs.iter().map(|r| r.reaction_s).fold(0.0, f64::max);
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let machine = stageload_probe::system_memory().map(|m| m.total).unwrap_or(0);
    let table = format!(
        "# stageload guard: reaction and cost\n\n\
         Command: `{command}` (through `cargo xtask bench-guard`), default poll 100 ms, grace 1 s, \
         {} CPUs, {:.1} GiB.\n\n\
         | measure | value |\n|---|---|\n\
         | child allocation rate (median of {}) | {rate:.2} GB/s |\n\
         | reaction: limit crossed → group gone (median) | {reaction:.3} s |\n\
         | reaction, worst run | {worst:.3} s |\n\
         | overshoot at the stop: measured − limit (median) | {:.0} MiB |\n\
         | CPU watching, system readings only | {plain:.1} s per hour ({:.3} %) |\n\
         | CPU watching with `--max-memory` (process-tree walk each poll) | {scanning:.1} s per hour ({:.3} %) |\n",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        machine as f64 / (1u64 << 30) as f64,
        runs.len(),
        overshoot / 1048576.0,
        plain / 36.0,
        scanning / 36.0,
    );
    print!("{table}");
    let results = json!({
        "command": command,
        "limit": limit,
        "runs": runs.iter().map(|r| json!({"rate_gb_s": r.rate_gb_s, "reaction_s": r.reaction_s, "overshoot": r.overshoot, "exit": r.exit})).collect::<Vec<_>>(),
        "median": {"rate_gb_s": rate, "reaction_s": reaction, "overshoot": overshoot},
        "cpu_seconds_per_hour": {"plain": plain, "max_memory": scanning},
    });
    std::fs::write(options.out.with_extension("md"), table).expect("write the table");
    std::fs::write(options.out.with_extension("json"), serde_json::to_string_pretty(&results).unwrap())
        .expect("write the json");
}
