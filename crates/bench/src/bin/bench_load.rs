//! Checkpoint loading benchmark: stageload's loader against `tch::nn::VarStore::load` and
//! Python's `safetensors.torch.load_file` + `load_state_dict`, side by side in one run.
//!
//!     cargo xtask bench-load            (= cargo run --release -p stageload-bench --bin bench_load)
//!
//! One checkpoint of about 1.04 GB (f32 linear layers of three sizes) is written once. Each
//! round loads it with each loader in turn (alternating), with the warm page cache; with
//! `--cold`, rounds that drop the file's pages first (posix_fadvise) are added. Reported: GB/s
//! and the transient peak of anonymous memory over the model (VmHWM reset before each load,
//! pages of the mapped file subtracted; the table also shows the peak with them). Results go to `traces/load-bench.json` and `.md`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use clap::Parser;
use stageload::checkpoint::{Checkpoint, Progress};
use stageload_bench::median;
use stageload_probe::ProcessMemory;
use tch::nn::{self, VarStore};
use tch::{Device, Tensor};

#[derive(Parser)]
struct Args {
    /// Rounds of (stageload, tch, python), alternating.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Also measure with the file's pages dropped from the page cache before each load.
    #[arg(long)]
    cold: bool,
    /// Where the checkpoint is written once.
    #[arg(long, default_value = "target/stageload-bench/model.safetensors")]
    checkpoint: PathBuf,
    /// Python with torch and safetensors (the set-up exports STAGELOAD_PYTHON).
    #[arg(long, env = "STAGELOAD_PYTHON", default_value = "python3")]
    python: String,
    /// Output folder for the results.
    #[arg(long, default_value = "traces")]
    out: PathBuf,
}

/// (out, in) of each layer: 13 × 4096², 8 × 4096×1024, 8 × 1024².
fn layer_shapes() -> Vec<(i64, i64)> {
    let mut shapes = vec![(4096, 4096); 13];
    shapes.extend([(4096, 1024); 8]);
    shapes.extend([(1024, 1024); 8]);
    shapes
}

fn build(vs: &VarStore) {
    for (i, (out, inp)) in layer_shapes().into_iter().enumerate() {
        let _ = nn::linear(vs.root() / "layers" / i, inp, out, Default::default());
    }
}

/// This process's memory now.
fn memory() -> ProcessMemory {
    stageload_probe::process_memory(std::process::id() as i32).expect("read this process's memory")
}

/// Resident pages that are not anonymous: mapped files (and shared memory, constant here).
fn file_pages(memory: &ProcessMemory) -> i64 {
    memory.rss as i64 - memory.rss_anon.expect("RssAnon (Linux)") as i64
}

struct Measure {
    seconds: f64,
    /// Anonymous memory over the model at the peak.
    peak_over: i64,
    /// The same with the checkpoint's mapped page-cache pages counted.
    peak_with_file: i64,
}

/// Runs `load` with the high-water mark reset. The peak over the model counts anonymous memory
/// only: pages of a file still mapped by what `load` returns are subtracted.
fn measured<T>(load: impl FnOnce() -> T) -> Measure {
    let before = memory();
    stageload_probe::reset_peak().expect("reset the peak");
    let start = Instant::now();
    let still_mapped = load();
    let seconds = start.elapsed().as_secs_f64();
    let after = memory();
    let file_pages = file_pages(&after) - file_pages(&before);
    let peak_with_file = after.peak.expect("VmHWM (Linux)") as i64 - before.rss as i64;
    drop(still_mapped);
    Measure { seconds, peak_over: peak_with_file - file_pages, peak_with_file }
}

fn drop_page_cache(path: &Path) {
    stageload_demo_kit::weights::drop_page_cache(path).expect("drop the checkpoint's pages");
}

/// Reads the file once so that the first warm round does not read it from the disk.
fn warm_page_cache(path: &Path) {
    let mut file = std::fs::File::open(path).expect("open checkpoint");
    std::io::copy(&mut file, &mut std::io::sink()).expect("read checkpoint");
}

fn python_runs(args: &Args, runs: usize) -> Vec<Measure> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("python/bench_load.py");
    let out = Command::new(&args.python).arg(script).arg(&args.checkpoint).arg(runs.to_string()).output();
    let out = match out {
        Ok(out) if out.status.success() => out,
        Ok(out) => panic!("python peer failed: {}", String::from_utf8_lossy(&out.stderr)),
        Err(e) => panic!("cannot run {}: {e}; run scripts/setup-libtorch.sh or pass --python", args.python),
    };
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("python prints JSON lines");
            Measure {
                seconds: v["seconds"].as_f64().unwrap(),
                peak_over: v["peak_over"].as_i64().unwrap(),
                peak_with_file: v["peak_with_file"].as_i64().unwrap(),
            }
        })
        .collect()
}

fn main() {
    stageload_demo_kit::logging::init();
    let args = Args::parse();
    tch::set_num_threads(std::thread::available_parallelism().map(|n| n.get() as i32).unwrap_or(2));
    if !args.checkpoint.exists() {
        std::fs::create_dir_all(args.checkpoint.parent().unwrap()).unwrap();
        let vs = VarStore::new(Device::Cpu);
        build(&vs);
        let vars: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        stageload::checkpoint::save(&vars, &args.checkpoint).expect("write the checkpoint");
    }
    let vs = VarStore::new(Device::Cpu);
    build(&vs);
    let mut vs_tch = VarStore::new(Device::Cpu);
    build(&vs_tch);
    let targets: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    let model_bytes: i64 = targets.iter().map(|(_, t)| (t.numel() * 4) as i64).sum();
    let gb = model_bytes as f64 / 1e9;
    println!("model: {} tensors, {:.3} GB; {} rounds", targets.len(), gb, args.rounds);

    let show_bar = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let mut results: Vec<(&str, &str, Measure)> = Vec::new();
    let modes: &[&str] = if args.cold { &["warm", "cold"] } else { &["warm"] };
    for &mode in modes {
        if mode == "warm" {
            warm_page_cache(&args.checkpoint);
        }
        // Python: one process per mode, loading `rounds` times (startup is not timed); its runs
        // are interleaved into the table in order.
        for round in 0..args.rounds {
            if mode == "cold" {
                drop_page_cache(&args.checkpoint);
            }
            let bar = show_bar.then(|| indicatif::ProgressBar::new(model_bytes as u64));
            let m = measured(|| {
                let checkpoint = Checkpoint::open(&[&args.checkpoint]).expect("open");
                checkpoint
                    .load_into(&targets, |p: Progress| {
                        if let Some(bar) = &bar {
                            bar.set_position(p.done)
                        }
                    })
                    .expect("load");
                checkpoint
            });
            if let Some(bar) = bar {
                bar.finish_and_clear();
            }
            results.push(("stageload", mode, m));
            if mode == "cold" {
                drop_page_cache(&args.checkpoint);
            }
            results.push(("tch", mode, measured(|| vs_tch.load(&args.checkpoint).expect("VarStore::load"))));
            if mode == "cold" {
                drop_page_cache(&args.checkpoint);
            }
            let python = python_runs(&args, 1).pop().expect("one python run");
            results.push(("python", mode, python));
            eprintln!("{mode} round {} done", round + 1);
        }
    }
    // Verify the loaders agree (the benchmark must load the right numbers).
    for (name, t) in &targets {
        let other = vs_tch.variables()[name].shallow_clone();
        assert!(t.equal(&other), "stageload and tch disagree on {name}");
    }

    let mut summary = serde_json::Map::new();
    let mut table = String::from(
        "| loader | cache | GB/s (median) | GB/s runs | peak over model, anonymous (median) | with mapped file pages (median) |\n|---|---|---|---|---|---|\n",
    );
    for &mode in modes {
        for loader in ["stageload", "tch", "python"] {
            let runs: Vec<&Measure> =
                results.iter().filter(|(l, m, _)| *l == loader && *m == mode).map(|(_, _, m)| m).collect();
            let rates: Vec<f64> = runs.iter().map(|m| gb / m.seconds).collect();
            let percent = |bytes: i64| 100.0 * bytes as f64 / model_bytes as f64;
            let over = median(runs.iter().map(|m| percent(m.peak_over)).collect());
            let with_file = median(runs.iter().map(|m| percent(m.peak_with_file)).collect());
            let rate = median(rates.clone());
            table += &format!(
                "| {loader} | {mode} | {rate:.2} | {} | {over:.1} % | {with_file:.1} % |\n",
                rates.iter().map(|r| format!("{r:.2}")).collect::<Vec<_>>().join(", ")
            );
            summary.insert(format!("{loader}_{mode}_gbps"), rate.into());
            summary.insert(format!("{loader}_{mode}_peak_over_pct"), over.into());
            summary.insert(format!("{loader}_{mode}_peak_with_file_pct"), with_file.into());
        }
    }
    let values = summary.clone();
    let g = |k: &str| values[k].as_f64().unwrap();
    let ratios = format!(
        "stageload/tch {:.1}x, stageload/python {:.2}x (warm, medians)",
        g("stageload_warm_gbps") / g("tch_warm_gbps"),
        g("stageload_warm_gbps") / g("python_warm_gbps")
    );
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let report = format!(
        "# Checkpoint load benchmark\n\nCommand: `cargo xtask bench-load -- {}` ({command})\n\nModel: {} f32 tensors, {gb:.3} GB, {} cores.\n\n{table}\n{ratios}\n",
        std::env::args().skip(1).collect::<Vec<_>>().join(" "),
        targets.len(),
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0)
    );
    std::fs::create_dir_all(&args.out).unwrap();
    std::fs::write(args.out.join("load-bench.md"), &report).unwrap();
    summary.insert("command".into(), command.into());
    summary.insert("model_bytes".into(), model_bytes.into());
    std::fs::write(args.out.join("load-bench.json"), serde_json::to_string_pretty(&summary).unwrap()).unwrap();
    print!("{report}");
    println!(
        "load: stageload {:.2} GB/s, tch {:.2} GB/s, python {:.2} GB/s; peak over model: stageload {:.1}%, tch {:.1}%, python {:.1}%",
        g("stageload_warm_gbps"), g("tch_warm_gbps"), g("python_warm_gbps"),
        g("stageload_warm_peak_over_pct"), g("tch_warm_peak_over_pct"), g("python_warm_peak_over_pct")
    );
}
