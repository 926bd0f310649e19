//! A foreground load beside a prefetch: how long the current stage's model takes to load while
//! the next stage's model is being prefetched, against the same load alone, in one run.
//!
//!     cargo run --release -p stageload-bench --bin bench_foreground -- --rounds 5
//!
//! Two models of square f32 layers with safetensors checkpoints written here: `current` (the
//! stage's, `--current-mib`) and `next` (the next stage's, `--next-mib`, several times larger).
//! Three arms, alternating, each round with a fresh registry and warm page cache:
//!
//! - `alone`: `current` loaded with nothing else going on;
//! - `behind a prefetched build`: `next` (built without initialisation, then filled from its
//!   checkpoint) prefetched first, `current` loaded once the prefetch has copied its first piece;
//! - `behind a prefetched refill`: `next` loaded, released, then prefetched (refilled in place),
//!   `current` loaded once that copy has begun.
//!
//! Printed: each arm's load seconds (median of `--rounds`) and its ratio to `alone`, and how long
//! the prefetch took in all. The registry lets a foreground load go first (`staged/turn.rs`): a
//! background build's loader runs without the build turn, and its copy pauses between pieces
//! while a foreground load runs. With `--json`, the figures also go to that file.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use stageload::{Built, ModelSpec, StagedModels};
use stageload_bench::median;
use tch::nn::{self, VarStore};
use tch::Device;

#[derive(Parser)]
struct Args {
    /// Timed rounds (each runs every arm once).
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// The current stage's model, MiB.
    #[arg(long, default_value_t = 256)]
    current_mib: i64,
    /// The next stage's model (prefetched), MiB.
    #[arg(long, default_value_t = 1024)]
    next_mib: i64,
    /// Where to write the figures as JSON (none by default).
    #[arg(long)]
    json: Option<PathBuf>,
}

/// Layers of 1024 x 1024 f32: 4 MiB each.
const WIDTH: i64 = 1024;
const LAYER_MIB: i64 = 4;

struct Layers {
    _layers: Vec<nn::Linear>,
}

fn layers(vs: &VarStore, mib: i64) -> Layers {
    let root = vs.root();
    let config = nn::LinearConfig { bias: false, ..Default::default() };
    Layers {
        _layers: (0..mib / LAYER_MIB).map(|i| nn::linear(&root / format!("l{i}"), WIDTH, WIDTH, config)).collect(),
    }
}

fn build(mib: i64) -> Built {
    let vs = VarStore::new(Device::Cpu);
    Built::new(layers(&vs, mib), &vs)
}

fn write_checkpoint(dir: &Path, name: &str, mib: i64) -> PathBuf {
    let path = dir.join(format!("{name}.safetensors"));
    let vs = VarStore::new(Device::Cpu);
    let _layers = layers(&vs, mib);
    stageload::checkpoint::save(&vs.variables().into_iter().collect::<Vec<_>>(), &path).expect("write the checkpoint");
    path
}

/// The arms, in the order each round runs them.
const ARMS: [&str; 3] = ["alone", "behind a prefetched build", "behind a prefetched refill"];

/// One run of arm `arm`: the seconds `current`'s load took, and the prefetch's seconds.
fn run(arm: &str, files: &[PathBuf; 2], (current_mib, next_mib): (i64, i64)) -> (f64, Option<f64>) {
    let armed = Arc::new(AtomicBool::new(false));
    let (piece_tx, piece) = mpsc::channel();
    let models = {
        let (armed, piece_tx) = (armed.clone(), Mutex::new(piece_tx));
        StagedModels::builder()
            .model(ModelSpec::new("current", move |_| Ok(build(current_mib))).checkpoint([&files[0]]).skip_init(true))
            .model(ModelSpec::new("next", move |_| Ok(build(next_mib))).checkpoint([&files[1]]).skip_init(true))
            .stage("first", ["next"])
            .stage("now", ["current"])
            .stage("after", ["next"])
            .progress(move |model, _| {
                if model == "next" && armed.swap(false, Ordering::SeqCst) {
                    let _ = piece_tx.lock().expect("the channel's lock").send(());
                }
            })
            .build()
            .expect("the registry")
    };
    if arm == "behind a prefetched refill" {
        // `next` loaded and released: its prefetch is a refill in place.
        models.enter("first").expect("enter first");
        models.load("next").expect("load next");
    }
    models.enter("now").expect("enter now");
    let prefetch_started = Instant::now();
    if arm != "alone" {
        armed.store(true, Ordering::SeqCst);
        assert_eq!(models.prefetch("after").expect("prefetch"), ["next"]);
        piece.recv_timeout(Duration::from_secs(120)).expect("the prefetch copies its first piece");
    }
    let started = Instant::now();
    models.load("current").expect("load current");
    let seconds = started.elapsed().as_secs_f64();
    let prefetch = (arm != "alone").then(|| {
        models.wait_prefetch("after").expect("wait for the prefetch");
        prefetch_started.elapsed().as_secs_f64()
    });
    (seconds, prefetch)
}

fn main() {
    stageload_demo_kit::logging::init();
    let args = Args::parse();
    assert!(args.rounds > 0, "--rounds must be at least 1");
    let dir = tempfile_dir();
    let files = [write_checkpoint(&dir, "current", args.current_mib), write_checkpoint(&dir, "next", args.next_mib)];
    let sizes = (args.current_mib, args.next_mib);
    // One untimed round: the files' pages into the cache, the allocator warm.
    for arm in ARMS {
        run(arm, &files, sizes);
    }
    let mut loads = vec![Vec::new(); ARMS.len()];
    let mut prefetches = vec![Vec::new(); ARMS.len()];
    for _ in 0..args.rounds {
        for (i, arm) in ARMS.iter().enumerate() {
            let (seconds, prefetch) = run(arm, &files, sizes);
            loads[i].push(seconds);
            prefetches[i].extend(prefetch);
        }
    }
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0);
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    println!(
        "{cores} cores; current {} MiB, next {} MiB; {} rounds, arms alternating, warm page cache",
        args.current_mib, args.next_mib, args.rounds
    );
    println!("| arm | current's load, s (median) | runs | x alone | next's prefetch, s (median) |");
    println!("|---|---|---|---|---|");
    let alone = median(loads[0].clone());
    let mut rows = Vec::new();
    for (i, arm) in ARMS.iter().enumerate() {
        let load = median(loads[i].clone());
        let prefetch = (!prefetches[i].is_empty()).then(|| median(prefetches[i].clone()));
        let runs: Vec<String> = loads[i].iter().map(|s| format!("{s:.3}")).collect();
        println!(
            "| {arm} | {load:.3} | {} | {:.2} | {} |",
            runs.join(", "),
            load / alone,
            prefetch.map_or("–".to_string(), |p| format!("{p:.3}"))
        );
        rows.push(serde_json::json!({
            "arm": arm, "load_seconds": loads[i], "load_median": load, "ratio_to_alone": load / alone,
            "prefetch_median": prefetch,
        }));
    }
    if let Some(path) = &args.json {
        let report = serde_json::json!({
            "command": command, "cores": cores, "current_mib": args.current_mib, "next_mib": args.next_mib,
            "rounds": args.rounds, "rows": rows,
        });
        std::fs::write(path, serde_json::to_string_pretty(&report).expect("JSON")).expect("write the JSON");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A folder of this process's own for the checkpoints, under the system's temporary folder.
fn tempfile_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("stageload-bench-foreground-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("create the benchmark's folder");
    dir
}
