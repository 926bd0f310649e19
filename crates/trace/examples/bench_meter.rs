//! What metering costs (a benchmark, not a test): the process's CPU time while the meter samples
//! an otherwise idle process at the default 0.25 s for `--seconds`, and the time of one sample.
//! Writes traces/meter-cost.md. Run: `cargo run --release -p stageload-trace --example bench_meter`.

use std::time::{Duration, Instant};

use nix::sys::resource::{getrusage, UsageWho};
use stageload_trace::{Meter, MeterOptions};

fn cpu_seconds() -> f64 {
    let usage = getrusage(UsageWho::RUSAGE_SELF).expect("getrusage");
    let seconds = |t: nix::sys::time::TimeVal| t.tv_sec() as f64 + t.tv_usec() as f64 * 1e-6;
    seconds(usage.user_time()) + seconds(usage.system_time())
}

fn main() {
    let seconds: u64 =
        std::env::args().skip_while(|a| a != "--seconds").nth(1).map_or(30, |s| s.parse().expect("--seconds N"));
    let dir = std::env::temp_dir().join(format!("stageload-bench-meter-{}", std::process::id()));
    let meter = Meter::start(dir.join("idle.jsonl"), MeterOptions::default()).expect("meter");
    let before = cpu_seconds();
    std::thread::sleep(Duration::from_secs(seconds));
    let idle_cpu = cpu_seconds() - before;
    let samples = 1000;
    let started = Instant::now();
    for _ in 0..samples {
        meter.sample();
    }
    let per_sample = started.elapsed().as_secs_f64() / samples as f64;
    meter.finish();
    let _ = std::fs::remove_dir_all(&dir);
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let table = format!(
        "# Meter cost\n\nCommand: `{command}` (release build), default interval 0.25 s, {} CPUs.\n\n\
         | measure | value |\n|---|---|\n\
         | CPU while metering an idle process for {seconds} s | {idle_cpu:.3} s ({:.3} % of one core) |\n\
         | one sample (process, system, pressure readings + one JSON line) | {:.0} µs |\n",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        100.0 * idle_cpu / seconds as f64,
        per_sample * 1e6,
    );
    print!("{table}");
    std::fs::write("traces/meter-cost.md", table).expect("write traces/meter-cost.md (run from the repository root)");
}
