//! The GPU check, in one call of a few minutes on the GPU machine, which has no cargo: `build`
//! here stages every binary in `target/device-kit/` (the device kit, `../shared/device-kit`,
//! builds against the GPU machine's torch), this task runner among them (it is torch-free);
//! `run` there, from the repository's root with `target/device-kit` carried along:
//!
//! ```text
//! cargo xtask gpu-check build
//! target/device-kit/bin/xtask gpu-check run        # results in $OUT (or target/gpu-check)
//! target/device-kit/bin/xtask gpu-check run --only checks,stream   # some parts: a rerun
//! ```
//!
//! `run`: a CUDA `.pt2` package compiled there (`crates/bench/python/pt2_cuda.py`: a CUDA
//! package runs only where it was compiled); `gpu_check` (crates/bench: the CUDA paths checked,
//! that package as a registry model among them, checkpoint → CUDA against Python's safetensors
//! and the pinned/pageable copy limits on one 4 GiB file; the host tier's stores, the second into
//! its registered arena, against that limit, with page-locked bytes over booked; a hundred
//! release and reload cycles, device memory and resident set after them); the load under other ring shapes
//! (`STAGELOAD_RING`); the cascade on cuda:0 eager, staged, staged with prefetch and staged with
//! a 4 GiB host tier under `stageload ab` (latents compared, wall times, peaks, charts), and
//! staged without RNG preservation, the control, whose latents must differ; block streaming on
//! cuda:0, compute-bound (4096 tokens, whole and 2 of 12 blocks resident); the small Stable
//! Diffusion, traced there on CUDA, eager, staged, prefetch, and staged against diffusers'
//! pipeline on the same GPU (`--compare-python`; `build` stages diffusers' wheel). Then
//! `stream-ratios.json`: step time streamed over whole (streamed blocks' frees ordered by events,
//! no host sync: the goal is 1.05), refill GB/s over this run's pinned limit (on CUDA a refill's
//! seconds are the time to queue its copies now, so this rate is an upper bound), each ring
//! shape's load rate. Everything under `$OUT`; `log.txt` has every command and the seconds each
//! took, `timings.json` those seconds (the whole run is meant to take about five minutes).

use std::path::{Path, PathBuf};

use clap::Subcommand;
use serde_json::{json, Map, Value};

use crate::ab::{read_json, string_field, Arm, Comparison, Report};
use crate::shell::{check, words, Error, Failures, Log, Setup, Shell};

/// The two halves.
#[derive(Subcommand)]
pub enum Step {
    /// Here: build every binary against the GPU machine's torch into target/device-kit
    Build {
        /// The device kit
        #[arg(long, default_value = "../shared/device-kit")]
        kit: PathBuf,
    },
    /// There: run every check (results in $OUT, else target/gpu-check)
    Run {
        /// Only these parts (comma-separated; all when not given)
        #[arg(long, value_delimiter = ',')]
        only: Vec<Part>,
    },
}

/// The parts of the run, in their order.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Part {
    /// A CUDA .pt2 package compiled there, then gpu_check: the CUDA paths and checkpoint → CUDA
    Checks,
    /// The load under other ring shapes
    Rings,
    /// The cascade under `stageload ab`, and the control
    Cascade,
    /// Block streaming, compute-bound
    Stream,
    /// The small Stable Diffusion, traced there, and against diffusers
    Sd,
}

/// The Python packages the run needs beside the GPU machine's (which has torch, transformers and
/// safetensors, no diffusers): the versions `scripts/setup-reference.sh` installed here, as wheels.
const WHEELS: [&str; 2] = ["diffusers", "importlib_metadata"];

/// The other loaders checkpoint → CUDA is measured against (issue 73), as wheels without their
/// dependencies: torch and numpy are the GPU machine's, and what the libraries import beyond them
/// is humanize (the Run:ai streamer; fastsafetensors' typer is its command line's only).
/// runai-model-streamer 0.17.0 was never published; 0.17.1 is its release.
const LOADERS: [&str; 4] =
    ["instanttensor==0.2.2", "fastsafetensors==0.5.0", "runai-model-streamer==0.17.1", "humanize"];

/// Runs `step` (see the module docs).
pub fn task(shell: &mut Shell, step: Step) -> Result<(), Error> {
    match step {
        Step::Build { kit } => build(shell, &kit),
        Step::Run { only } => run(shell, &only),
    }
}

fn build(shell: &mut Shell, kit: &Path) -> Result<(), Error> {
    // diffusers' version from the reference environment; the kit sets up its own torch.
    shell.set_up(&[Setup::Libtorch, Setup::Reference])?;
    let script = shell.root().join(kit).join("build.sh");
    for targets in [
        &["build", "-p", "stageload-bench", "--bin", "gpu_check"][..],
        &["build", "-p", "stageload", "--example", "cascade", "--example", "stream", "--example", "stable_diffusion"],
        &["build", "-p", "stageload-cli", "--bin", "stageload"],
    ] {
        shell.run(&mut shell.cmd(&script, targets))?;
    }
    let staged = shell.target("device-kit");
    let python = shell.var("STAGELOAD_PYTHON").ok_or("scripts/setup-libtorch.sh set no STAGELOAD_PYTHON")?;
    let mut pins = Vec::new();
    for name in WHEELS {
        let query = format!("import importlib.metadata as m; print(m.version('{name}'))");
        let (status, version) = shell.output(&mut shell.cmd(&python, &["-c", &query]))?;
        if !status.success() {
            return Err(format!("the reference environment has no {name}"));
        }
        pins.push(format!("{name}=={}", version.trim()));
    }
    // The GPU machine's Python is 3.12 on x86-64 (the GPU machine's image).
    let wheels = staged.join("wheels").display().to_string();
    let mut download = shell.cmd(
        "python3",
        &["-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12"],
    );
    download.args(["--implementation", "cp", "-d", &wheels]);
    for platform in ["manylinux2014_x86_64", "manylinux_2_28_x86_64", "any"] {
        download.args(["--platform", platform]);
    }
    shell.run(download.args(&pins).args(LOADERS))?;
    shell.run(&mut shell.cargo(&["build", "--release", "-p", "xtask"]))?;
    let mut copy = shell.cmd("cp", &[]);
    shell.run(copy.arg(shell.target("release/xtask")).arg(staged.join("bin/xtask")))?;
    println!(
        "staged in {}: carry it to the GPU machine and run target/device-kit/bin/xtask gpu-check run",
        staged.display()
    );
    Ok(())
}

/// The cascade's arms on cuda:0 that must all give eager's latents.
const CASCADE: Arms = &[
    ("eager", &["--mode", "eager"]),
    ("staged", &["--mode", "staged"]),
    ("prefetch", &["--mode", "staged", "--prefetch"]),
    ("tier", &["--mode", "staged", "--host-tier", "4GiB"]),
];

/// Arms of a comparison: name, and the program's flags for it.
type Arms = &'static [(&'static str, &'static [&'static str])];

/// Block streaming on cuda:0, compute-bound (4096 tokens, 12 steps): the model whole against 10 of
/// its 12 blocks streamed (the other streaming comparisons run on the CPU: traces/stream/).
const STREAM: [(&str, Arms); 1] = [(
    "stream-compute",
    &[
        ("whole", &["--tokens", "4096", "--steps", "12"]),
        ("streamed", &["--tokens", "4096", "--steps", "12", "--budget", "8GiB", "--resident-at-most", "2"]),
    ],
)];

/// The ring shapes the load runs under, each in its own process (the ring is the process's):
/// more and larger buffers, fewer and more readers, and the peers' shapes (FlashPack: a reader
/// per buffer, each buffer large; InstantTensor: many small pieces in flight).
const RINGS: [&str; 6] = [
    "slots=64",
    "window=32M",
    "readers=8",
    "readers=32,slots=64",
    "readers=16,slots=16,window=64M",
    "slots=128,window=8M",
];

fn run(shell: &mut Shell, only: &[Part]) -> Result<(), Error> {
    let wanted = |part: Part| only.is_empty() || only.contains(&part);
    let kit = shell.target("device-kit");
    let out = std::env::var_os("OUT").map_or_else(|| shell.target("gpu-check"), PathBuf::from);
    let scratch = std::env::temp_dir().join("stageload-gpu-check");
    for folder in [&out, &scratch] {
        std::fs::create_dir_all(folder).map_err(|e| format!("cannot create {}: {e}", folder.display()))?;
    }
    let log = Log::create(&out.join("log.txt"))?;
    // The wheels the build staged, for every Python step; Python prints a crash's stack.
    let site = scratch.join("site").display().to_string();
    let wheels = std::fs::read_dir(kit.join("wheels")).map_err(|e| format!("{}: {e}", kit.join("wheels").display()))?;
    // The other loaders apart: one that does not install there (its failure logged and kept)
    // leaves the pipeline's wheels installed.
    let (loaders, needed): (Vec<PathBuf>, Vec<PathBuf>) =
        wheels.filter_map(|entry| Some(entry.ok()?.path())).partition(|path| is_loader_wheel(path));
    let mut installed = Ok(());
    for group in [needed, loaders].iter().filter(|group| !group.is_empty()) {
        let mut install = shell.cmd(
            "python3",
            &["-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--upgrade", "--target", &site],
        );
        install.args(group);
        let done = shell.status(&mut install, Some(&log)).and_then(|status| check(&install, status));
        installed = installed.and(done);
    }
    shell.set("PYTHONPATH", &site);
    shell.set("PYTHONFAULTHANDLER", "1");
    shell.set("PYTHONUNBUFFERED", "1");
    // The kit's run.sh prints the GPU and torch version at every start unless told not to; the
    // first command below lets it.
    shell.set("DEVICE_KIT_QUIET", "1");
    let shell = &*shell;
    let stageload = kit.join("bin/stageload");
    let run_sh = kit.join("run.sh");
    let on_device = |binary: &str, args: &[&str]| {
        let mut command = shell.cmd(&run_sh, &[binary]);
        command.args(args);
        command
    };
    let weights = scratch.join("weights").display().to_string();
    let mut failures = Failures::default();
    failures.keep(installed);
    // Runs `command`, keeps its failure and the seconds it took; whether it succeeded.
    let timings = std::cell::RefCell::new(Vec::<(String, f64)>::new());
    let run_started = std::time::Instant::now();
    let timed = |name: String, started: std::time::Instant| {
        let seconds = started.elapsed().as_secs_f64();
        log.line(&format!("  ({seconds:.1} s: {name})"));
        timings.borrow_mut().push((name, seconds));
    };
    let step = |command: &mut std::process::Command, failures: &mut Failures| {
        let started = std::time::Instant::now();
        let status = shell.status(command, Some(&log)).and_then(|status| check(command, status));
        let name = std::path::Path::new(command.get_program())
            .file_name()
            .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
        let first = command.get_args().next().map(|a| a.to_string_lossy().into_owned()).unwrap_or_default();
        // The project's variables a step sets (a ring shape) tell its runs apart.
        let set: Vec<String> = command
            .get_envs()
            .filter(|(key, _)| key.to_string_lossy().starts_with("STAGELOAD_"))
            .filter_map(|(key, value)| Some(format!("{}={}", key.to_string_lossy(), value?.to_string_lossy())))
            .collect();
        timed(format!("{name} {first} {}", set.join(" ")).trim().to_string(), started);
        let ran = status.is_ok();
        failures.keep(status);
        ran
    };

    // The GPU and the torch version, then the CUDA paths and the load against its peers.
    step(shell.cmd(&run_sh, &["true"]).env_remove("DEVICE_KIT_QUIET"), &mut failures);
    let (out_text, scratch_text) = (out.display().to_string(), scratch.display().to_string());
    if wanted(Part::Checks) {
        // A CUDA .pt2 package compiled here (it runs only where it was compiled), for gpu_check,
        // which checks what the compile wrote even if a later step of it failed.
        let pt2 = scratch.join("pt2");
        let pt2_text = pt2.display().to_string();
        let python = shell.root().join("crates/bench/python");
        let compile = python.join("pt2_cuda.py").display().to_string();
        step(&mut shell.cmd("timeout", &["300", "python3", &compile, &pt2_text]), &mut failures);
        let peer = python.join("bench_device.py").display().to_string();
        let peers = python.join("bench_peers.py").display().to_string();
        let mut args = vec![
            "--out",
            &out_text,
            "--scratch",
            &scratch_text,
            "--gib",
            "4",
            "--rounds",
            "5",
            "--peer",
            &peer,
            "--peers",
            &peers,
        ];
        if pt2.join("mlp.safetensors").exists() {
            args.extend(["--pt2", &pt2_text]);
        }
        step(&mut on_device("bin/gpu_check", &args), &mut failures);
    }
    if wanted(Part::Rings) {
        for ring in RINGS {
            let ring_out = scratch.join("ring").display().to_string();
            let mut load = on_device(
                "bin/gpu_check",
                &["--load-only", "--out", &ring_out, "--scratch", &scratch_text, "--gib", "4", "--rounds", "3"],
            );
            step(load.env("STAGELOAD_RING", ring), &mut failures);
            let _ = std::fs::copy(scratch.join("ring/gpu-check.json"), ring_file(&out, ring));
        }
    }

    let device_arm = |name: &str, binary: &str, flags: &[&str]| {
        Arm::new(name, &run_sh, &words(&[&[binary, "--device", "cuda"], flags].concat()))
    };
    let compare = |name: &str, arms: Vec<Arm>, failures: &mut Failures| -> Option<Report> {
        let comparison = Comparison { stageload: &stageload, out: out.join(name), runs: 1, arms, flags: Vec::new() };
        let started = std::time::Instant::now();
        let ran = comparison.run(shell, Some(&log));
        timed(format!("ab {name}"), started);
        match ran {
            Ok(report) => {
                failures.keep(report.verdict(name));
                Some(report)
            }
            Err(error) => {
                failures.keep(Err(error));
                None
            }
        }
    };
    let cache = ["--cache", weights.as_str()];
    if wanted(Part::Cascade) {
        let cascade =
            CASCADE.iter().map(|(name, flags)| device_arm(name, "bin/cascade", &[&cache[..], flags].concat()));
        compare("cascade", cascade.collect(), &mut failures);
        failures.keep(control_differs(shell, &log, on_device("bin/cascade", &cache), &stageload, &out));
    }
    let mut ratios = Map::new();
    let pinned = number_field(&out.join("gpu-check.json"), "pinned_h2d_gb_per_s");
    ratios.insert("pinned_h2d_gb_per_s".into(), pinned.map_or(Value::Null, Value::from));
    for (name, modes) in STREAM.iter().filter(|_| wanted(Part::Stream)) {
        let scale = ["--scale", "2"];
        let arms =
            modes.iter().map(|(arm, flags)| device_arm(arm, "bin/stream", &[&cache[..], &scale, flags].concat()));
        let Some(report) = compare(name, arms.collect(), &mut failures) else { continue };
        for (arm, _) in &modes[1..] {
            ratios.insert(format!("{name}-{arm}"), stream_ratios(&report, &out.join(name), arm, pinned));
        }
    }
    if wanted(Part::Sd) {
        // Traced here, on CUDA: a trace keeps the device of the tensors it makes (the UNet's
        // timestep embedding), so the CPU trace the tests use cannot run on CUDA.
        let sd = scratch.join("sd-small-cuda").display().to_string();
        let export = shell.root().join("scripts/reference/sd_export.py").display().to_string();
        let exported = step(
            &mut shell.cmd("python3", &[&export, "--size", "small", "--device", "cuda", "--out", &sd]),
            &mut failures,
        );
        if exported {
            let sd_arms = ["eager", "staged", "prefetch"]
                .map(|mode| device_arm(mode, "bin/stable_diffusion", &["--components", &sd, "--mode", mode]));
            compare("sd", sd_arms.into(), &mut failures);
            // diffusers' own pipeline on the same GPU, weights and inputs.
            let flags = ["--components", &sd, "--mode", "staged", "--compare-python", "--python", "python3"];
            step(&mut on_device("bin/stable_diffusion", &[&["--device", "cuda"][..], &flags].concat()), &mut failures);
        }
    }
    for ring in RINGS.iter().filter(|_| wanted(Part::Rings)) {
        let file = ring_file(&out, ring);
        let field = |name| number_field(&file, name).map_or(Value::Null, Value::from);
        ratios.insert(
            format!("ring-{ring}"),
            json!({"to_cuda_gb_per_s": field("stageload_to_cuda_gb_per_s"), "over_pinned": field("stageload_over_pinned_limit")}),
        );
    }
    let text = serde_json::to_string_pretty(&Value::Object(ratios)).unwrap_or_default();
    log.line(&text);
    let file = out.join("stream-ratios.json");
    failures.keep(std::fs::write(&file, text).map_err(|e| format!("cannot write {}: {e}", file.display())));
    let steps: Vec<Value> =
        timings.take().into_iter().map(|(step, seconds)| json!({"step": step, "seconds": seconds})).collect();
    let total = run_started.elapsed().as_secs_f64();
    log.line(&format!("the run took {total:.0} s"));
    let text = serde_json::to_string_pretty(&json!({"seconds": total, "steps": steps})).unwrap_or_default();
    let file = out.join("timings.json");
    failures.keep(std::fs::write(&file, text).map_err(|e| format!("cannot write {}: {e}", file.display())));
    failures.end()
}

/// The control: staged without RNG preservation on cuda:0 (`cascade`, its cache given) must give
/// latents that differ from eager's (`stageload latents` exits 1 on a difference).
fn control_differs(
    shell: &Shell,
    log: &Log,
    mut cascade: std::process::Command,
    stageload: &Path,
    out: &Path,
) -> Result<(), Error> {
    let latents = out.join("control.safetensors").display().to_string();
    cascade.args(["--device", "cuda", "--mode", "staged", "--no-preserve-rng", "--latents", &latents]);
    let status = shell.status(&mut cascade, Some(log))?;
    check(&cascade, status)?;
    let mut compare = shell.cmd(stageload, &["latents"]);
    compare.arg(out.join("cascade/eager-1.safetensors")).args(["--against", &latents, "--name", "eager"]);
    match shell.status(&mut compare, Some(log))?.code() {
        Some(1) => Ok(()),
        Some(0) => Err("the control (no RNG preservation) gave eager's latents: the check cannot tell".into()),
        _ => Err("the control's latents could not be compared with eager's".into()),
    }
}

/// Whether `wheel` is one of [`LOADERS`]' (its file name starts with the package's name as wheels
/// spell it: `-` as `_`).
fn is_loader_wheel(wheel: &Path) -> bool {
    let name = wheel.file_name().map(|n| n.to_string_lossy().to_lowercase()).unwrap_or_default();
    LOADERS.iter().any(|pin| {
        let package = pin.split("==").next().unwrap_or(pin).replace('-', "_");
        name.starts_with(&format!("{package}-"))
    })
}

/// Where the load under ring shape `ring` keeps its result.
fn ring_file(out: &Path, ring: &str) -> PathBuf {
    out.join(format!("ring-{}.json", ring.replace(['=', ','], "-")))
}

/// One streamed arm against its model whole: step time over whole's, refill rate and its ratio
/// to the pinned host→device limit of this run, and the split (from its result file).
fn stream_ratios(report: &Report, out: &Path, arm: &str, pinned: Option<f64>) -> Value {
    let refill = report
        .median("bytes_refilled", arm)
        .zip(report.median("refill_seconds", arm))
        .filter(|(_, seconds)| *seconds > 0.0)
        .map(|(bytes, seconds)| bytes / seconds / 1e9);
    json!({
        "step_over_whole": report.ratio("seconds_per_step", arm),
        "refill_gb_per_s": refill,
        "refill_over_pinned": refill.zip(pinned).map(|(r, p)| r / p),
        "residency": string_field(&out.join(format!("{arm}-1.json")), "residency").ok(),
    })
}

/// A number field of the JSON object in `path`, if it has one.
fn number_field(path: &Path, field: &str) -> Option<f64> {
    read_json(path).ok()?[field].as_f64()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_other_loaders_wheels_are_told_from_the_pipelines_by_their_file_names() {
        let staged = [
            "diffusers-0.42.1-py3-none-any.whl",
            "importlib_metadata-10.2.0-py3-none-any.whl",
            "fastsafetensors-0.5.0-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl",
            "humanize-4.17.0-py3-none-any.whl",
            "instanttensor-0.2.2-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl",
            "runai_model_streamer-0.17.1-py3-none-manylinux_2_28_x86_64.whl",
        ];
        let loaders: Vec<&str> = staged.into_iter().filter(|name| is_loader_wheel(Path::new(name))).collect();
        assert_eq!(loaders, &staged[2..], "the pipeline's wheels are not the loaders'");
        assert!(!is_loader_wheel(Path::new("instanttensorx-1.0-py3-none-any.whl")), "a name only starting alike");
    }
}
