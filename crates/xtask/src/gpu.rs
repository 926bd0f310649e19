//! The GPU check, in one call of a few minutes on the GPU machine, which has no cargo: `build`
//! here stages every binary in `target/device-kit/` (the device kit, `../shared/device-kit`,
//! builds against the GPU machine's torch), this task runner among them (it is torch-free);
//! `run` there, from the repository's root with `target/device-kit` carried along:
//!
//! ```text
//! cargo xtask gpu-check build
//! target/device-kit/bin/xtask gpu-check run        # results in $OUT (or target/gpu-check)
//! ```
//!
//! `run`: `gpu_check` (crates/bench: the CUDA paths checked, checkpoint → CUDA against Python's
//! safetensors and the pinned/pageable copy limits on one 4 GiB file); the cascade on cuda:0
//! eager, staged, staged with prefetch and staged with a 4 GiB host tier under `stageload ab`
//! (latents compared, wall times, peaks, charts), and staged without RNG preservation, the
//! control, whose latents must differ; block streaming on cuda:0 under `stageload ab` in three
//! comparisons (texture_flow at scale 2 whole, under a 500 MiB budget and half streamed; a
//! router's access, whole and with a hot set; compute-bound, 4096 tokens, whole and 2 of 12
//! blocks resident); the checkpoint → CUDA load under other ring shapes (`STAGELOAD_RING`); the
//! small Stable Diffusion (TorchScript traced on the CPU) on cuda:0 eager, staged, prefetch.
//! Then `stream-ratios.json`: step time streamed over whole, refill GB/s over this run's pinned
//! limit, each ring shape's load rate. Everything under `$OUT`; `log.txt` has every command.

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
    Run,
}

/// Runs `step` (see the module docs).
pub fn task(shell: &mut Shell, step: Step) -> Result<(), Error> {
    match step {
        Step::Build { kit } => build(shell, &kit),
        Step::Run => run(shell),
    }
}

fn build(shell: &mut Shell, kit: &Path) -> Result<(), Error> {
    // The small Stable Diffusion export goes along (11 MB); the kit sets up its own torch.
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
    let small = shell.var("STAGELOAD_SD_SMALL").ok_or("scripts/setup-reference.sh set no STAGELOAD_SD_SMALL")?;
    let mut copy = shell.cmd("cp", &["-rT"]);
    shell.run(copy.arg(&small).arg(staged.join("sd-small")))?;
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

/// Block streaming on cuda:0: three comparisons, each against its model whole.
const STREAM: [(&str, Arms); 3] = [
    (
        "stream",
        &[
            ("whole", &["--tokens", "1024"]),
            ("budget", &["--tokens", "1024", "--budget", "500MiB", "--working", "256MiB"]),
            ("half", &["--tokens", "1024", "--budget", "8GiB", "--resident-at-most", "6"]),
        ],
    ),
    (
        "stream-experts",
        &[
            ("whole", &["--tokens", "1024", "--route", "experts", "--steps", "12"]),
            (
                "hot",
                &[
                    "--tokens",
                    "1024",
                    "--route",
                    "experts",
                    "--steps",
                    "12",
                    "--budget",
                    "900MiB",
                    "--working",
                    "256MiB",
                    "--any-order",
                ],
            ),
        ],
    ),
    (
        "stream-compute",
        &[
            ("whole", &["--tokens", "4096"]),
            ("streamed", &["--tokens", "4096", "--budget", "8GiB", "--resident-at-most", "2"]),
        ],
    ),
];

/// The ring shapes the load runs under, each in its own process (the ring is the process's).
const RINGS: [&str; 7] =
    ["slots=16", "slots=64", "window=32M", "window=64M,slots=16", "readers=4", "readers=8", "readers=32,slots=64"];

fn run(shell: &mut Shell) -> Result<(), Error> {
    // The kit's run.sh prints the GPU and torch version at every start unless told not to; the
    // first command below lets it.
    shell.set("DEVICE_KIT_QUIET", "1");
    let shell = &*shell;
    let kit = shell.target("device-kit");
    let out = std::env::var_os("OUT").map_or_else(|| shell.target("gpu-check"), PathBuf::from);
    let scratch = std::env::temp_dir().join("stageload-gpu-check");
    for folder in [&out, &scratch] {
        std::fs::create_dir_all(folder).map_err(|e| format!("cannot create {}: {e}", folder.display()))?;
    }
    let log = Log::create(&out.join("log.txt"))?;
    let stageload = kit.join("bin/stageload");
    let run_sh = kit.join("run.sh");
    let on_device = |binary: &str, args: &[&str]| {
        let mut command = shell.cmd(&run_sh, &[binary]);
        command.args(args);
        command
    };
    let weights = scratch.join("weights").display().to_string();
    let mut failures = Failures::default();
    {
        let mut step = |command: &mut std::process::Command| {
            let status = shell.status(command, Some(&log));
            failures.keep(status.and_then(|status| check(command, status)));
        };

        // The GPU and the torch version, then the CUDA paths and the load against its peers.
        step(shell.cmd(&run_sh, &["true"]).env_remove("DEVICE_KIT_QUIET"));
        let peer = shell.root().join("crates/bench/python/bench_device.py").display().to_string();
        let (out_text, scratch_text) = (out.display().to_string(), scratch.display().to_string());
        step(&mut on_device(
            "bin/gpu_check",
            &["--out", &out_text, "--scratch", &scratch_text, "--gib", "4", "--rounds", "5", "--peer", &peer],
        ));
        for ring in RINGS {
            let ring_out = scratch.join("ring").display().to_string();
            let mut load = on_device(
                "bin/gpu_check",
                &["--load-only", "--out", &ring_out, "--scratch", &scratch_text, "--gib", "4", "--rounds", "3"],
            );
            step(load.env("STAGELOAD_RING", ring));
            let _ = std::fs::copy(scratch.join("ring/gpu-check.json"), ring_file(&out, ring));
        }
    }

    let device_arm = |name: &str, binary: &str, flags: &[&str]| {
        Arm::new(name, &run_sh, &words(&[&[binary, "--device", "cuda"], flags].concat()))
    };
    let compare = |name: &str, arms: Vec<Arm>, failures: &mut Failures| -> Option<Report> {
        let comparison = Comparison { stageload: &stageload, out: out.join(name), runs: 1, arms, flags: Vec::new() };
        match comparison.run(shell, Some(&log)) {
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
    let cascade = CASCADE.iter().map(|(name, flags)| device_arm(name, "bin/cascade", &[&cache[..], flags].concat()));
    compare("cascade", cascade.collect(), &mut failures);
    failures.keep(control_differs(shell, &log, on_device("bin/cascade", &cache), &stageload, &out));
    let mut ratios = Map::new();
    let pinned = number_field(&out.join("gpu-check.json"), "pinned_h2d_gb_per_s");
    ratios.insert("pinned_h2d_gb_per_s".into(), pinned.map_or(Value::Null, Value::from));
    for (name, modes) in STREAM {
        let scale = ["--scale", "2"];
        let arms =
            modes.iter().map(|(arm, flags)| device_arm(arm, "bin/stream", &[&cache[..], &scale, flags].concat()));
        let Some(report) = compare(name, arms.collect(), &mut failures) else { continue };
        for (arm, _) in &modes[1..] {
            ratios.insert(format!("{name}-{arm}"), stream_ratios(&report, &out.join(name), arm, pinned));
        }
    }
    let sd = kit.join("sd-small").display().to_string();
    let sd_arms = ["eager", "staged", "prefetch"]
        .map(|mode| device_arm(mode, "bin/stable_diffusion", &["--components", &sd, "--mode", mode]));
    compare("sd", sd_arms.into(), &mut failures);
    for ring in RINGS {
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
