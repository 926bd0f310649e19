//! Registry cost benchmark: what a run costs per model as the number of models grows.
//!
//!     cargo run --release -p stageload-bench --bin bench_registry -- --models 250,1000,4000,16000
//!
//! For each count N, in a process of its own (so that no count inherits the heap another one
//! left), a registry of N tiny models (one 1-element f32 tensor each, a loader and no
//! checkpoint) in stages of `--per-stage` models (8 by default) is built, warmed up with
//! `--warmup` runs, then timed over `--rounds` runs, or more for small counts: enough runs for
//! `--min-calls` calls in all, so that a small count is not timed over a few milliseconds only.
//! A run enters every stage once, in order,
//! and calls each of its models once: entering a stage releases the previous stage's models, so
//! every call of a run rebuilds its model (no checkpoint to refill from), and the build is part
//! of what is timed. Printed: µs per model (the run's time over N), median and range over the
//! rounds. With `--json`, the figures also go to that file (the numbers of
//! `traces/registry/bench.md`).

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use clap::Parser;
use stageload::{Built, ModelSpec, StagedModels};
use stageload_bench::median;
use tch::{Device, Kind, Tensor};

#[derive(Parser)]
struct Args {
    /// Model counts to measure, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "250,1000,4000,16000")]
    models: Vec<usize>,
    /// Models per stage.
    #[arg(long, default_value_t = 8)]
    per_stage: usize,
    /// Untimed runs before the timed ones.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Timed runs per count at least (the median is reported).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Calls to time per count at least: a small count gets more runs.
    #[arg(long, default_value_t = 16_000)]
    min_calls: usize,
    /// A label for the figures (`before`, `after`, ...), written into the JSON.
    #[arg(long, default_value = "")]
    label: String,
    /// Where to write the figures as JSON (none by default).
    #[arg(long)]
    json: Option<PathBuf>,
    /// Measure the one count given in this process and print its figures as one JSON line (what
    /// the benchmark runs for each count).
    #[arg(long, hide = true)]
    one: bool,
}

/// A tiny model: one 1-element tensor.
struct Tiny {
    w: Tensor,
}

fn name(i: usize) -> String {
    format!("m{i:05}")
}

/// N tiny models in stages of `per_stage` models, in definition order.
fn registry(models: usize, per_stage: usize) -> StagedModels {
    let mut builder = StagedModels::builder();
    for i in 0..models {
        builder = builder.model(ModelSpec::new(name(i), move |_| {
            let w = Tensor::full([1], i as f64, (Kind::Float, Device::Cpu));
            Ok(Built::from_tensors(Tiny { w: w.shallow_clone() }, vec![("w".to_string(), w)]))
        }));
    }
    for (s, first) in (0..models).step_by(per_stage).enumerate() {
        builder = builder.stage(format!("s{s:05}"), (first..(first + per_stage).min(models)).map(name));
    }
    builder.build().expect("a valid plan")
}

/// One run: every stage entered once, each of its models called once. Returns its seconds.
fn run(models: &StagedModels, count: usize, per_stage: usize) -> f64 {
    let started = Instant::now();
    for (s, first) in (0..count).step_by(per_stage).enumerate() {
        models.enter(&format!("s{s:05}")).expect("enter");
        for i in first..(first + per_stage).min(count) {
            let value = models.call(&name(i), |m: &mut Tiny| m.w.double_value(&[0])).expect("call");
            assert_eq!(value, i as f64, "model {i} holds its own weight");
        }
    }
    started.elapsed().as_secs_f64()
}

/// Measures `count` models in this process: the figures as JSON.
fn measure(args: &Args, count: usize) -> serde_json::Value {
    let models = registry(count, args.per_stage);
    for _ in 0..args.warmup {
        run(&models, count, args.per_stage);
    }
    let rounds = args.rounds.max(args.min_calls.div_ceil(count));
    let per_model: Vec<f64> = (0..rounds).map(|_| run(&models, count, args.per_stage) * 1e6 / count as f64).collect();
    let tenth = |v: f64| (v * 10.0).round() / 10.0;
    serde_json::json!({
        "models": count,
        "stages": count.div_ceil(args.per_stage),
        "us_per_model_median": tenth(median(per_model.clone())),
        "us_per_model_runs": per_model.into_iter().map(tenth).collect::<Vec<_>>(),
    })
}

/// Measures `count` models in a child process (this binary with `--one`).
fn measure_apart(args: &Args, count: usize) -> serde_json::Value {
    let out = Command::new(std::env::current_exe().expect("this binary's path"))
        .args(["--one", "--models", &count.to_string()])
        .args(["--per-stage", &args.per_stage.to_string()])
        .args(["--warmup", &args.warmup.to_string(), "--rounds", &args.rounds.to_string()])
        .args(["--min-calls", &args.min_calls.to_string()])
        .output()
        .expect("run the measuring process");
    assert!(out.status.success(), "measuring {count} models failed: {}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(stdout.lines().last().unwrap_or_default()).expect("the child prints its figures as JSON")
}

fn main() {
    stageload_demo_kit::logging::init();
    let args = Args::parse();
    assert!(args.per_stage > 0 && args.rounds > 0, "--per-stage and --rounds must be at least 1");
    if args.one {
        let [count] = args.models[..] else { panic!("--one measures one count") };
        println!("{}", measure(&args, count));
        return;
    }
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0);
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    println!(
        "{cores} cores; {} models per stage, {} warm-up run(s), {} timed at least ({} calls at least)",
        args.per_stage, args.warmup, args.rounds, args.min_calls
    );
    println!("| models | stages | µs per model (median) | range |");
    println!("|---|---|---|---|");
    let mut rows = Vec::new();
    for &count in &args.models {
        let row = measure_apart(&args, count);
        let runs: Vec<f64> = row["us_per_model_runs"].as_array().unwrap().iter().filter_map(|v| v.as_f64()).collect();
        let (low, high) = runs.iter().fold((f64::MAX, 0f64), |(l, h), &v| (l.min(v), h.max(v)));
        let median = row["us_per_model_median"].as_f64().unwrap_or_default();
        println!("| {count} | {} | {median:.1} | {low:.1} – {high:.1} |", row["stages"]);
        rows.push(row);
    }
    if let Some(path) = &args.json {
        let report = serde_json::json!({
            "label": args.label,
            "command": command,
            "cores": cores,
            "per_stage": args.per_stage,
            "warmup": args.warmup,
            "rounds": args.rounds,
            "min_calls": args.min_calls,
            "rows": rows,
        });
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).expect("create the output folder");
        }
        std::fs::write(path, serde_json::to_string_pretty(&report).unwrap()).expect("write the JSON");
    }
}
