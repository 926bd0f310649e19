//! TorchScript loads measured side by side with Python's: the first load of each module
//! (`stageload::script::load`, i.e. `ModelSpec::torchscript`'s loader) against `torch.jit.load` of
//! the same file, each in a fresh process, time and memory growth; and a released module's
//! reload in place from its checkpoint against the project's own checkpoint load of that file
//! into fresh tensors (`Checkpoint::load_into`), in one process, warm page cache.
//!
//! ```text
//! eval "$(scripts/setup-libtorch.sh)"
//! cargo run --release -p stageload-bench --bin bench_script -- --components ~/.cache/stageload/sd-sd15 \
//!     --json traces/stable-diffusion/load.json
//! ```
//!
//! Rounds alternate the Rust and the Python processes (`scripts/reference/sd_reference.py
//! --time-jit-load`), so that a machine busy with other work slows both alike; the median of
//! `--rounds` is reported. Memory: the process's resident set after the load minus before
//! (`growth`), and its high-water mark (VmHWM) minus the resident set before (`peak`): the
//! transient part of a load is `peak - growth`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use clap::Parser;
use serde_json::{json, Value};
use stageload::checkpoint::Checkpoint;
use stageload::{BoxError, EventKind, ListSink, ModelSpec, StagedModels};
use stageload_bench::{median, rss_and_peak as memory};
use tch::{CModule, Device, Tensor};

#[derive(Parser)]
struct Args {
    /// A folder written by scripts/reference/sd_export.py (NAME.pt and NAME.safetensors).
    #[arg(long)]
    components: PathBuf,
    /// Rounds of first loads (each a fresh process per module, Rust then Python).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Where to write the figures as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Measure the first load of this one file in this process and print it as JSON (what each
    /// round runs).
    #[arg(long, hide = true)]
    one: Option<PathBuf>,
}

const COMPONENTS: [&str; 3] = ["text_encoder", "unet", "vae_decoder"];

/// A first load in this process: seconds, growth, peak over the resident set before.
fn one(path: &Path) -> Result<Value, BoxError> {
    let (before, _) = memory()?;
    let started = Instant::now();
    let (module, tensors) = stageload::script::load(path, Device::Cpu)?;
    let seconds = started.elapsed().as_secs_f64();
    let (after, peak) = memory()?;
    drop((module, tensors));
    Ok(
        json!({"load_s": seconds, "rss_growth": after.saturating_sub(before), "peak_growth": peak.saturating_sub(before)}),
    )
}

/// One round of Rust first loads, each module in a process of its own.
fn rust_round(components: &Path) -> Result<Value, BoxError> {
    let mut round = serde_json::Map::new();
    for name in COMPONENTS {
        let path = components.join(format!("{name}.pt"));
        let out = Command::new(std::env::current_exe()?)
            .arg("--components")
            .arg(components)
            .arg("--one")
            .arg(&path)
            .output()?;
        if !out.status.success() {
            return Err(
                format!("the load of {} failed: {}", path.display(), String::from_utf8_lossy(&out.stderr)).into()
            );
        }
        round.insert(format!("{name}.pt"), serde_json::from_slice(&out.stdout)?);
    }
    Ok(Value::Object(round))
}

/// One round of `torch.jit.load`, each module in a process of its own (sd_reference.py).
fn python_round(components: &Path) -> Result<Value, BoxError> {
    let python = std::env::var("STAGELOAD_PYTHON")
        .map_err(|_| "STAGELOAD_PYTHON is not set: eval \"$(scripts/setup-libtorch.sh)\" first")?;
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/reference/sd_reference.py");
    let out = Command::new(&python).arg(&script).arg("--components").arg(components).arg("--time-jit-load").output()?;
    if !out.status.success() {
        return Err(
            format!("{} --time-jit-load failed: {}", script.display(), String::from_utf8_lossy(&out.stderr)).into()
        );
    }
    let summary: Value = serde_json::from_slice(&out.stdout)?;
    Ok(summary["jit_load"].clone())
}

/// A module's reload in place (GB/s, from its `reload` event) and the checkpoint load of the
/// same file into fresh tensors (GB/s), each the best of three, warm page cache.
fn reloads(components: &Path, name: &str) -> Result<(f64, f64, u64), BoxError> {
    let file = components.join(format!("{name}.safetensors"));
    let sink = Arc::new(ListSink::new());
    let models = StagedModels::builder()
        .model(ModelSpec::torchscript(name, components.join(format!("{name}.pt"))).checkpoint([&file]))
        .stage("run", [name])
        .stage("other", Vec::<String>::new())
        .events(sink.clone())
        .build()?;
    let checkpoint = Checkpoint::open(&[&file])?;
    let mut load_rate: f64 = 0.0;
    let mut reload_rate: f64 = 0.0;
    let mut bytes = 0;
    for _ in 0..3 {
        models.enter("run")?;
        models.call(name, |m: &mut CModule| m.named_parameters().map(|p| p.len()))??;
        models.enter("other")?;
        // Fresh tensors of the module's shapes, filled by the project's checkpoint load.
        let targets: Vec<(String, Tensor)> = checkpoint
            .entries()
            .iter()
            .map(|(n, e)| (n.clone(), Tensor::empty(&e.shape, (e.kind, Device::Cpu))))
            .collect();
        let started = Instant::now();
        let report = checkpoint.load_into(&targets, |_| {})?;
        load_rate = load_rate.max(report.bytes as f64 / started.elapsed().as_secs_f64() / 1e9);
        bytes = report.bytes;
        drop(targets);
    }
    for reload in sink.of_kind(EventKind::Reload) {
        reload_rate =
            reload_rate.max(reload.bytes().unwrap_or(0) as f64 / reload.seconds().unwrap_or(f64::INFINITY) / 1e9);
    }
    Ok((reload_rate, load_rate, bytes))
}

fn main() -> Result<(), BoxError> {
    let args = Args::parse();
    if let Some(path) = &args.one {
        println!("{}", one(path)?);
        return Ok(());
    }
    let (mut rust, mut python) = (Vec::new(), Vec::new());
    for round in 0..args.rounds {
        eprintln!("round {} of {}", round + 1, args.rounds);
        rust.push(rust_round(&args.components)?);
        python.push(python_round(&args.components)?);
    }
    let mib = |b: f64| b / (1u64 << 20) as f64;
    println!("| module | stageload load s | torch.jit.load s | ratio | stageload growth / peak MiB | torch.jit.load growth / peak MiB | reload in place GB/s | checkpoint load GB/s | reload / load |");
    println!("|---|---|---|---|---|---|---|---|---|");
    let mut rows = Vec::new();
    for name in COMPONENTS {
        let key = format!("{name}.pt");
        let field =
            |runs: &[Value], f: &str| median(runs.iter().map(|r| r[&key][f].as_f64().unwrap_or(f64::NAN)).collect());
        let (rs, ps) = (field(&rust, "load_s"), field(&python, "load_s"));
        let (rg, rp) = (field(&rust, "rss_growth"), field(&rust, "peak_growth"));
        let (pg, pp) = (field(&python, "rss_growth"), field(&python, "peak_growth"));
        let (reload, load, bytes) = reloads(&args.components, name)?;
        println!(
            "| {name} | {rs:.3} | {ps:.3} | {:.2} | {:.1} / {:.1} | {:.1} / {:.1} | {reload:.2} | {load:.2} | {:.2} |",
            rs / ps,
            mib(rg),
            mib(rp),
            mib(pg),
            mib(pp),
            reload / load
        );
        rows.push(json!({"module": name, "bytes": bytes, "stageload_load_s": rs, "jit_load_s": ps, "stageload_rss_growth": rg,
            "stageload_peak_growth": rp, "jit_rss_growth": pg, "jit_peak_growth": pp, "reload_gb_per_s": reload, "checkpoint_gb_per_s": load}));
    }
    if let Some(path) = &args.json {
        let command = std::env::args().collect::<Vec<_>>().join(" ");
        let all = json!({"command": command, "cores": std::thread::available_parallelism().map_or(1, |n| n.get()), "rounds": args.rounds, "rows": rows, "rust_runs": rust, "python_runs": python});
        std::fs::write(path, serde_json::to_string_pretty(&all)?)?;
    }
    Ok(())
}
