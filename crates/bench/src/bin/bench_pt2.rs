//! AOTInductor packages against TorchScript, side by side, on Stable Diffusion's components: the
//! first load of each through the registry (`ModelSpec::pt2` against `ModelSpec::torchscript`
//! with its checkpoint) and Python's own `aoti_load_package` + `load_constants` of the same
//! package, each in a fresh process, time and memory; then in one process the reload in place
//! of each (the second of two, warm page cache) and a forward step (the compiled kernels against
//! the TorchScript interpreter), with the largest difference between their outputs.
//!
//! ```text
//! eval "$(scripts/setup-libtorch.sh)"
//! python scripts/reference/sd_pt2.py --size small --components ~/.cache/stageload/sd-small
//! cargo run --release -p stageload-bench --bin bench_pt2 -- --components ~/.cache/stageload/sd-small \
//!     --json traces/pt2/sd-small.json
//! ```
//!
//! The folder holds sd_export.py's `NAME.pt` and `NAME.safetensors` and sd_pt2.py's `pt2/NAME.pt2`,
//! `pt2/NAME.safetensors` and `pt2/NAME.inputs.safetensors`; components without a package are
//! skipped. Rounds alternate the three loaders; medians of `--rounds`. Memory: the process's
//! resident set after the load minus before (`growth`), and its high-water mark (VmHWM) minus the
//! resident set before (`peak`).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use clap::Parser;
use serde_json::{json, Value};
use stageload::pt2::Pt2Module;
use stageload::{BoxError, EventKind, ListSink, ModelSpec, StagedModels};
use stageload_bench::{median, rss_and_peak as memory};
use tch::{CModule, Tensor};

#[derive(Parser)]
struct Args {
    /// A folder written by scripts/reference/sd_export.py and scripts/reference/sd_pt2.py.
    #[arg(long)]
    components: PathBuf,
    /// Rounds of first loads (each a fresh process per loader and component).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Forward steps timed per module (the median is reported).
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Where to write the figures as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Measure the first load of this one component in this process, as `script` or `pt2`, and
    /// print it as JSON (what each round runs).
    #[arg(long, hide = true, num_args = 2, value_names = ["KIND", "COMPONENT"])]
    one: Option<Vec<String>>,
}

const COMPONENTS: [&str; 3] = ["text_encoder", "unet", "vae_decoder"];

/// The model spec of `component` as `kind` (`script` or `pt2`).
fn spec(components: &Path, component: &str, kind: &str) -> ModelSpec {
    match kind {
        "pt2" => {
            let dir = components.join("pt2");
            ModelSpec::pt2(
                component,
                dir.join(format!("{component}.pt2")),
                [dir.join(format!("{component}.safetensors"))],
            )
        }
        _ => ModelSpec::torchscript(component, components.join(format!("{component}.pt")))
            .checkpoint([components.join(format!("{component}.safetensors"))]),
    }
}

/// A first load through the registry in this process: seconds, growth, peak over the resident
/// set before.
fn one(components: &Path, kind: &str, component: &str) -> Result<Value, BoxError> {
    let models = StagedModels::builder().model(spec(components, component, kind)).stage("run", [component]).build()?;
    models.enter("run")?;
    let (before, _) = memory()?;
    let started = Instant::now();
    models.load(component)?;
    let seconds = started.elapsed().as_secs_f64();
    let (after, peak) = memory()?;
    Ok(
        json!({"load_s": seconds, "rss_growth": after.saturating_sub(before), "peak_growth": peak.saturating_sub(before)}),
    )
}

/// A fresh process of this benchmark measuring one first load.
fn child(components: &Path, kind: &str, component: &str) -> Result<Value, BoxError> {
    let out = Command::new(std::env::current_exe()?)
        .arg("--components")
        .arg(components)
        .args(["--one", kind, component])
        .output()?;
    if !out.status.success() {
        return Err(format!("the {kind} load of {component} failed: {}", String::from_utf8_lossy(&out.stderr)).into());
    }
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// Python's `aoti_load_package` + `load_constants` of the package, in a fresh process.
fn python(components: &Path, component: &str) -> Result<Value, BoxError> {
    let python = std::env::var("STAGELOAD_PYTHON")
        .map_err(|_| "STAGELOAD_PYTHON is not set: eval \"$(scripts/setup-libtorch.sh)\" first")?;
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/reference/pt2_time.py");
    let dir = components.join("pt2");
    let out = Command::new(&python)
        .arg(&script)
        .arg(dir.join(format!("{component}.pt2")))
        .arg(dir.join(format!("{component}.safetensors")))
        .output()?;
    if !out.status.success() {
        return Err(format!("{} failed: {}", script.display(), String::from_utf8_lossy(&out.stderr)).into());
    }
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// In one process: each kind's forward step (median of `steps`, after one warm-up) and its
/// reload in place (seconds, from the reload event), and the largest difference between the
/// two kinds' outputs.
fn steps(components: &Path, component: &str, steps: usize) -> Result<Value, BoxError> {
    let dir = components.join("pt2");
    let mut inputs: Vec<(String, Tensor)> =
        Tensor::read_safetensors(dir.join(format!("{component}.inputs.safetensors")))?;
    inputs.sort_by(|a, b| a.0.cmp(&b.0));
    let inputs: Vec<Tensor> = inputs.into_iter().map(|(_, t)| t).collect();
    let refs: Vec<&Tensor> = inputs.iter().collect();
    let mut figures = serde_json::Map::new();
    let mut outputs = Vec::new();
    for kind in ["script", "pt2"] {
        let sink = Arc::new(ListSink::new());
        let models = StagedModels::builder()
            .model(spec(components, component, kind))
            .stage("run", [component])
            .stage("other", Vec::<String>::new())
            .events(sink.clone())
            .build()?;
        models.enter("run")?;
        let run = || -> Result<Tensor, BoxError> {
            let output = match kind {
                "pt2" => models.call(component, |m: &mut Pt2Module| m.forward(&refs).map(|mut o| o.remove(0)))??,
                _ => {
                    let ivalues: Vec<tch::IValue> =
                        inputs.iter().map(|t| tch::IValue::Tensor(t.shallow_clone())).collect();
                    match models.call(component, |m: &mut CModule| m.forward_is(&ivalues))?? {
                        tch::IValue::Tensor(t) => t,
                        other => return Err(format!("{component}: the TorchScript module returned {other:?}").into()),
                    }
                }
            };
            Ok(output)
        };
        outputs.push(tch::no_grad(run)?);
        let mut seconds = Vec::new();
        for _ in 0..steps {
            let started = Instant::now();
            drop(tch::no_grad(run)?);
            seconds.push(started.elapsed().as_secs_f64());
        }
        // Two reloads, the second reported: a TorchScript module's first load reads its `.pt`, so
        // its checkpoint's pages are cold at the first reload, and a `.pt2`'s are warm.
        for _ in 0..2 {
            models.enter("other")?;
            models.enter("run")?;
            drop(tch::no_grad(run)?);
        }
        let reload = sink.of_kind(EventKind::Reload).last().and_then(|e| e.seconds()).unwrap_or(f64::NAN);
        figures.insert(format!("{kind}_step_s"), json!(median(seconds)));
        figures.insert(format!("{kind}_reload_s"), json!(reload));
    }
    let difference = (&outputs[0] - &outputs[1]).abs().max().double_value(&[]);
    figures.insert("max_abs_difference".into(), json!(difference));
    Ok(Value::Object(figures))
}

fn main() -> Result<(), BoxError> {
    let args = Args::parse();
    if let Some(one_args) = &args.one {
        println!("{}", one(&args.components, &one_args[0], &one_args[1])?);
        return Ok(());
    }
    let present: Vec<&str> =
        COMPONENTS.into_iter().filter(|c| args.components.join("pt2").join(format!("{c}.pt2")).exists()).collect();
    if present.is_empty() {
        return Err(format!(
            "{} holds no pt2/NAME.pt2: run scripts/reference/sd_pt2.py first",
            args.components.display()
        )
        .into());
    }
    let mut runs: Vec<Value> = Vec::new();
    for round in 0..args.rounds {
        eprintln!("round {} of {}", round + 1, args.rounds);
        let mut row = serde_json::Map::new();
        for component in &present {
            row.insert(format!("{component}.script"), child(&args.components, "script", component)?);
            row.insert(format!("{component}.pt2"), child(&args.components, "pt2", component)?);
            row.insert(format!("{component}.python"), python(&args.components, component)?);
        }
        runs.push(Value::Object(row));
    }
    let mib = |b: f64| b / (1u64 << 20) as f64;
    println!("| component | first load s: TorchScript / .pt2 / Python aoti_load_package | peak MiB: TorchScript / .pt2 / Python | reload in place s: TorchScript / .pt2 | step s: TorchScript / .pt2 | max abs difference |");
    println!("|---|---|---|---|---|---|");
    let mut rows = Vec::new();
    for component in &present {
        let field = |arm: &str, f: &str| {
            median(runs.iter().map(|r| r[format!("{component}.{arm}")][f].as_f64().unwrap_or(f64::NAN)).collect())
        };
        let step = steps(&args.components, component, args.steps)?;
        let number = |key: &str| step[key].as_f64().unwrap_or(f64::NAN);
        println!(
            "| {component} | {:.3} / {:.3} / {:.3} | {:.1} / {:.1} / {:.1} | {:.4} / {:.4} | {:.4} / {:.4} | {:.2e} |",
            field("script", "load_s"),
            field("pt2", "load_s"),
            field("python", "load_s"),
            mib(field("script", "peak_growth")),
            mib(field("pt2", "peak_growth")),
            mib(field("python", "peak_growth")),
            number("script_reload_s"),
            number("pt2_reload_s"),
            number("script_step_s"),
            number("pt2_step_s"),
            number("max_abs_difference"),
        );
        let mut row = json!({"component": component});
        for arm in ["script", "pt2", "python"] {
            for f in ["load_s", "rss_growth", "peak_growth"] {
                row[format!("{arm}_{f}")] = json!(field(arm, f));
            }
        }
        row["steps"] = step;
        rows.push(row);
    }
    if let Some(path) = &args.json {
        let command = std::env::args().collect::<Vec<_>>().join(" ");
        let all = json!({"command": command, "cores": std::thread::available_parallelism().map_or(1, |n| n.get()),
            "rounds": args.rounds, "rows": rows, "runs": runs});
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::write(path, serde_json::to_string_pretty(&all)?)?;
    }
    Ok(())
}
