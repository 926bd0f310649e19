//! The demos: the README's main job (the cascade under `stageload ab`, its plan checked against
//! the runs), block streaming (a model bigger than its guard's limit, streamed; with the published
//! sizes also step times and the hot set), Stable Diffusion, Shap-E and Wan2.1 against diffusers
//! at their small sizes (the exports `scripts/setup-reference.sh` makes; about 6 minutes in
//! all after the build) or, with `--published`, at their published sizes, and then the Python
//! package beside the original Python stageload. The demo says how long it will take before it
//! starts and where it is as it goes. Each part keeps going after a failed check, so that one
//! run shows every result, and fails at the end.

use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::ab::{build, cascade_arms, guard_flags, string_field, Arm, Comparison, Report};
use crate::benches;
use crate::shell::{check, free_bytes, words, Error, Failures, Log, Setup, Shell};

/// Runs example `name` of the library's package with `args`, libtorch set up first.
pub fn example(shell: &mut Shell, name: &str, release: bool, args: &[String]) -> Result<(), Error> {
    shell.set_up(&[Setup::Libtorch])?;
    let mut command = shell.cargo(&["run", "--example", name]);
    if release {
        command.arg("--release");
    }
    shell.run(command.arg("--").args(args))
}

/// A part of the demo after the cascade, which `--skip` can leave out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Part {
    /// Block streaming (with --published, its step times and the hot set).
    Stream,
    /// Stable Diffusion against diffusers (1.5 with --published).
    Sd,
    /// Shap-E against diffusers.
    ShapE,
    /// Wan2.1 against diffusers.
    Wan,
    /// The Python package beside the original, Stable Diffusion 1.5 at its published size (with
    /// --published only).
    Python,
}

/// Which sizes the demo's pipelines run at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sizes {
    /// The small exports `scripts/setup-reference.sh` makes: every comparison against diffusers,
    /// seconds per run.
    Small,
    /// The published sizes (`--published`): exported once into the cache, minutes per run.
    Published,
}

impl Sizes {
    /// What the whole demo takes at these sizes on 2 cores after its build, said before it starts.
    fn duration(self) -> &'static str {
        match self {
            Sizes::Small => {
                "about 6 minutes on 2 cores after the build: the cascade, block streaming, and Stable Diffusion, \
                 Shap-E and Wan2.1 at small sizes against diffusers (--published: the published sizes, about an hour)"
            }
            Sizes::Published => {
                "about an hour on 2 cores after the build (the cascade and streaming about 10 minutes, Stable \
                 Diffusion about 4, Shap-E and Wan2.1 about 25 each, Python beside the original a few), and the \
                 first time the exports about an hour more (8, 30 and 18 minutes; 7.7 GB and 18 GiB of disk for \
                 Stable Diffusion and Wan2.1); Wan2.1 needs about 15 GiB of free memory and is skipped without it"
            }
        }
    }
}

/// The README's main job (see the module docs) with the pipelines at `sizes`, without the parts
/// in `skip`; results in `out`. It says first how long it will take, then each part's place, what
/// it expects the part to take and what it took.
pub fn demo(shell: &mut Shell, out: &Path, skip: &[Part], cascade: &[String], sizes: Sizes) -> Result<(), Error> {
    let started = Instant::now();
    println!("== cargo xtask demo: {}", sizes.duration());
    shell.set_up(&[Setup::Libtorch])?;
    let out = shell.folder(out)?;
    let parts = parts(sizes);
    let total = parts.len() + 1;
    println!("== [1/{total}] the cascade eager, staged and prefetch under stageload ab (about 4 minutes, 6 runs)");
    let stageload = build(shell, &["--example", "cascade"])?;
    let log = Log::create(&out.join("ab.log"))?;
    log.line("== stageload ab: eager, staged, prefetch, twice each, alternating, under the guard");
    let flags = guard_flags(Some(&out.join("guard.jsonl")));
    let comparison =
        Comparison { stageload: &stageload, out: out.clone(), runs: 2, arms: cascade_arms(shell, cascade), flags };
    let mut failures = Failures::default();
    let report = comparison.run(shell, Some(&log))?;
    failures.keep(report.verdict("the cascade"));
    failures.keep(check_plan(shell, &stageload, &out, None));
    for (against, file) in [("staged", "summary-first-runs.txt"), ("prefetch", "summary-first-runs-prefetch.txt")] {
        let traces = [out.join("eager-1.jsonl"), out.join(format!("{against}-1.jsonl"))];
        let mut command = shell.cmd(&stageload, &["summary"]);
        command.args(&traces);
        failures.keep(save(shell, &mut command, &out.join(file), against == "staged"));
    }
    println!("   the cascade took {:.0} s", started.elapsed().as_secs_f64());
    for (number, part) in parts.into_iter().enumerate() {
        let place = format!("[{}/{total}] {}", number + 2, part.what);
        if skip.contains(&part.part) {
            println!("== {place}: skipped (--skip)");
            continue;
        }
        let Some(expected) = part.expected else {
            println!("== {place}: published sizes only (cargo xtask demo --published)");
            continue;
        };
        println!("== {place} (about {expected}; {:.0} s so far)", started.elapsed().as_secs_f64());
        let part_started = Instant::now();
        failures.keep((part.run)(shell, &out.join(part.folder), sizes));
        println!("   {} took {:.0} s", part.folder, part_started.elapsed().as_secs_f64());
    }
    println!(
        "everything is in {}/ (summary.txt: the aggregated comparison); the demo took {:.0} s",
        out.display(),
        started.elapsed().as_secs_f64()
    );
    failures.end()
}

/// One part of the demo after the cascade.
struct DemoPart {
    part: Part,
    /// What it shows, and the task that runs it alone.
    what: &'static str,
    /// Its folder under the demo's.
    folder: &'static str,
    /// What it takes at these sizes; `None`: it runs at the published sizes only.
    expected: Option<&'static str>,
    run: fn(&mut Shell, &Path, Sizes) -> Result<(), Error>,
}

/// The parts after the cascade, at `sizes`, in order.
fn parts(sizes: Sizes) -> [DemoPart; 5] {
    let small = sizes == Sizes::Small;
    let at = |small_time: &'static str, published: &'static str| Some(if small { small_time } else { published });
    [
        DemoPart {
            part: Part::Stream,
            what: "block streaming (cargo xtask stream-demo)",
            folder: "stream",
            expected: at("20 seconds", "8 minutes"),
            run: stream_part,
        },
        DemoPart {
            part: Part::Sd,
            what: "Stable Diffusion against diffusers (cargo xtask sd-demo)",
            folder: "stable-diffusion",
            expected: at("30 seconds", "4 minutes, and 8 more the first time for its export"),
            run: |shell, out, sizes| published_demo(shell, out, &SD15, &[], sizes),
        },
        DemoPart {
            part: Part::ShapE,
            what: "Shap-E image-to-3D against diffusers (cargo xtask shap-e-demo)",
            folder: "shap-e",
            expected: at("a minute", "25 minutes, and 30 more the first time for its export"),
            run: |shell, out, sizes| published_demo(shell, out, &SHAP_E, &shap_e_args(out), sizes),
        },
        DemoPart {
            part: Part::Wan,
            what: "Wan2.1 text-to-video against diffusers (cargo xtask wan-demo; published: skipped without the memory or disk)",
            folder: "wan",
            expected: at("20 seconds", "25 minutes, and 18 more the first time for its export"),
            run: wan_part,
        },
        DemoPart {
            part: Part::Python,
            what: "Stable Diffusion 1.5 from Python: unwrapped, the original stageload, stageload_rs (cargo xtask python-demo)",
            folder: "python",
            expected: if small { None } else { Some("5 minutes") },
            run: |shell, out, _| python_demo(shell, out, 2),
        },
    ]
}

/// The plan of the runs' pipeline description (from the eager run's result file) against the
/// machine, then with the working memory the eager run measured checked against the staged run
/// stage by stage (resident weights exactly, peak within 5 % of the need; with `below_because`,
/// a peak further below the need passes, the reason said).
fn check_plan(shell: &Shell, stageload: &Path, out: &Path, below_because: Option<&str>) -> Result<(), Error> {
    let description = Report::first_run(out, "eager", "description")?;
    println!("== stageload plan {description}");
    let mut plan = shell.cmd(stageload, &["plan", &description]);
    if save(shell, &mut plan, &out.join("plan.txt"), false).is_err() {
        println!("(the plan says it does not fit; the runs went ahead under the guard)");
    }
    println!("== stageload plan --from-trace eager-1.jsonl --check staged-1.jsonl");
    let mut command = shell.cmd(stageload, &["plan", &description, "--from-trace"]);
    command.arg(out.join("eager-1.jsonl")).arg("--check").arg(out.join("staged-1.jsonl"));
    if let Some(reason) = below_because {
        println!("(a stage below its need passes: {reason})");
        command.arg("--check-allow-below");
    }
    let (status, text) = shell.output(&mut command)?;
    write(&out.join("plan-check.txt"), &text)?;
    print!("{}", text.find("plan against").map_or(text.as_str(), |at| &text[at..]));
    check(&command, status)
}

/// Runs `command` into `file` (and on the terminal with `show`).
fn save(shell: &Shell, command: &mut std::process::Command, file: &Path, show: bool) -> Result<(), Error> {
    let (status, text) = shell.output(command)?;
    write(file, &text)?;
    if show {
        print!("{text}");
    }
    check(command, status)
}

fn write(file: &Path, text: &str) -> Result<(), Error> {
    std::fs::write(file, text).map_err(|e| format!("cannot write {}: {e}", file.display()))
}

/// Block streaming with its step times and the hot set: [`stream_part`] at the published sizes.
pub fn stream_demo(shell: &mut Shell, out: &Path) -> Result<(), Error> {
    stream_part(shell, out, Sizes::Published)
}

/// Block streaming: the cascade's largest model (texture_flow) at scale 2 (1.2 GiB) loaded whole,
/// then under `stageload guard --max-memory 1GiB` (below its size: the guard must stop it), then
/// streamed under a 500 MiB budget inside the same guard; the latents must match, and the plan of
/// the streamed run's pipeline file (with the working memory the whole run measured) must match
/// the streamed run. With [`Sizes::Published`], then the step time at scale 1 (1024 tokens,
/// compute-bound) under `stageload ab`: fully resident, half the blocks streamed, a 400 MiB
/// budget's own split; then the hot set (`cargo xtask hot-set-bench`). Results in `out`.
fn stream_part(shell: &mut Shell, out: &Path, sizes: Sizes) -> Result<(), Error> {
    shell.set_up(&[Setup::Libtorch])?;
    let out = shell.folder(out)?;
    let stageload = build(shell, &["--example", "stream"])?;
    let stream = shell.target("debug/examples/stream");
    let log = Log::create(&out.join("stream.log"))?;
    let file = |name: &str| out.join(name).display().to_string();
    let big = ["--device", "cpu", "--scale", "2", "--tokens", "256"];
    let mut failures = Failures::default();

    log.line("== texture_flow at scale 2, loaded whole (no guard)");
    let mut whole = shell.cmd(&stream, &big);
    whole.args(["--result", &file("whole.json"), "--trace", &file("whole.jsonl")]);
    let status = shell.status(&mut whole, Some(&log))?;
    check(&whole, status)?;

    log.line("== the same under stageload guard --max-memory 1GiB (the guard must stop it)");
    let mut guarded = shell.cmd(&stageload, &["guard", "--max-memory", "1GiB", "--"]);
    guarded.arg(&stream).args(big);
    if shell.status(&mut guarded, Some(&log))?.success() {
        failures.keep(Err("the whole model ran under a limit below its size".into()));
    }

    log.line("== streamed under a 500 MiB budget, under stageload guard --max-memory 1GiB");
    let mut streamed = shell.cmd(&stageload, &["guard", "--max-memory", "1GiB", "--log", &file("guard.ndjson"), "--"]);
    streamed.arg(&stream).args(big).args(["--budget", "500MiB", "--working", "32MiB"]).args([
        "--result",
        &file("streamed.json"),
        "--trace",
        &file("streamed.jsonl"),
        "--pipeline",
        &file("pipeline.toml"),
    ]);
    let status = shell.status(&mut streamed, Some(&log))?;
    failures.keep(check(&streamed, status));

    log.line("== stageload plan of the streamed run's pipeline file against 1 GiB, with the working memory");
    log.line("   the whole run measured, checked against the streamed run (weights exact, peak within 5 %)");
    let mut plan = shell.cmd(&stageload, &["plan", &file("pipeline.toml"), "--memory", "1GiB"]);
    plan.args(["--from-trace", &file("whole.jsonl"), "--check", &file("streamed.jsonl")]);
    let status = shell.status(&mut plan, Some(&log))?;
    failures.keep(check(&plan, status));
    failures.keep(same_latent(&out.join("whole.json"), &out.join("streamed.json"), &log));
    if sizes == Sizes::Small {
        log.line("(step times and the hot set: cargo xtask demo --published, or cargo xtask stream-demo)");
        return failures.end();
    }

    log.line("== step time at scale 1, 1024 tokens: resident, half streamed, a 400 MiB budget (twice each)");
    let arm = |name: &str, flags: &[&str]| Arm::new(name, &stream, &words(&[&["--device", "cpu"], flags].concat()));
    let bench = Comparison {
        stageload: &stageload,
        out: out.join("bench"),
        runs: 2,
        arms: vec![
            arm("resident", &[]),
            arm("half", &["--budget", "2GiB", "--resident-at-most", "6"]),
            arm("budget", &["--budget", "400MiB", "--working", "200MiB"]),
        ],
        flags: guard_flags(None),
    };
    let report = bench.run(shell, Some(&log))?;
    failures.keep(report.verdict("the step times"));
    let seconds = |arm| report.median("seconds", arm).map_or("-".into(), |s| format!("{s:.2} s"));
    let ratio = |arm| report.ratio("seconds", arm).map_or("-".into(), |r| format!("{r:.3}x"));
    log.line(&format!(
        "seconds of the flow, median of two runs each: resident {}; half streamed {} ({}); 400 MiB budget {} ({})",
        seconds("resident"),
        seconds("half"),
        ratio("half"),
        seconds("budget"),
        ratio("budget")
    ));
    let mut summary = shell.cmd(&stageload, &["summary", &file("whole.jsonl"), &file("streamed.jsonl")]);
    let status = shell.status(&mut summary, Some(&log))?;
    failures.keep(check(&summary, status));

    println!("== the hot set, a forward that runs some blocks per call (cargo xtask hot-set-bench)");
    failures.keep(benches::hot_set(shell, &out.join("hot-set"), 2));
    failures.end()
}

/// The `fingerprint` of two stream results must be the same.
fn same_latent(reference: &Path, run: &Path, log: &Log) -> Result<(), Error> {
    let (want, got) = (string_field(reference, "fingerprint")?, string_field(run, "fingerprint")?);
    if want == got {
        log.line(&format!("latents identical: {want}"));
        Ok(())
    } else {
        Err(format!("latents differ: {} {want}, {} {got}", reference.display(), run.display()))
    }
}

/// Stable Diffusion 1.5 at its published component sizes (seeded random weights: trained ones
/// cannot be fetched here), exported once into the cache (scripts/reference/sd_export.py: about 8
/// minutes and 7.7 GB the first time); eager, staged and staged with prefetch, one run each under
/// `stageload ab` (256x256, 4 DDIM steps, guidance 7.5, CPU); the plan checked against the runs;
/// then a staged run checked against diffusers' StableDiffusionPipeline on the same weights,
/// embeddings and initial latents (within 1e-5 of each value range, or it fails). Results in `out`.
pub fn sd_demo(shell: &mut Shell, out: &Path) -> Result<(), Error> {
    published_demo(shell, out, &SD15, &[], Sizes::Published)
}

/// Stable Diffusion 1.5 at its published size: the SD part's and the Python part's.
const SD15: Published<'static> = Published {
    what: "Stable Diffusion",
    small: "STAGELOAD_SD_SMALL",
    folder: "sd-sd15",
    export: &["scripts/reference/sd_export.py", "--size", "sd15"],
    example: "stable_diffusion",
    reference: "StableDiffusionPipeline",
    guard_latent: None,
    plan_below_because: None,
};

/// A pipeline written by others, at its published size, against diffusers.
struct Published<'a> {
    /// Its name in the verdict.
    what: &'a str,
    /// The variable scripts/setup-reference.sh sets to the small export (the cache is its parent).
    small: &'a str,
    /// The published export's folder in the cache.
    folder: &'a str,
    /// The export script and its arguments before `--out`.
    export: &'a [&'a str],
    /// The example that runs it.
    example: &'a str,
    /// diffusers' pipeline class, for the log.
    reference: &'a str,
    /// The latent the guard's run must reproduce, for a demo that also shows the guard stopping
    /// eager and letting staged finish (see [`guard_story`]); `None`: no guard runs.
    guard_latent: Option<&'a str>,
    /// Why the plan's check lets a stage peak more than 5 % below its need, where it does.
    plan_below_because: Option<&'a str>,
}

/// The published export's folder in the cache (beside the small export setup-reference made).
fn published_folder(shell: &Shell, published: &Published) -> Result<PathBuf, Error> {
    let small = shell.var(published.small).ok_or(format!("scripts/setup-reference.sh set no {}", published.small))?;
    Ok(Path::new(&small).parent().unwrap_or(Path::new(".")).join(published.folder))
}

/// The export at `sizes` (the published one made once; the small one is setup-reference's);
/// eager, staged and staged with prefetch, one run each under `stageload ab` with `args`; the
/// plan checked against the runs; the guard's story where the pipeline has one (published sizes:
/// at the small ones the peaks are too close for a limit between them); then a staged run with
/// `--compare-python`. Results in `out`.
fn published_demo(
    shell: &mut Shell,
    out: &Path,
    published: &Published,
    args: &[String],
    sizes: Sizes,
) -> Result<(), Error> {
    shell.set_up(&[Setup::Libtorch, Setup::Reference])?;
    let out = shell.folder(out)?;
    let components = match sizes {
        Sizes::Small => {
            let small =
                shell.var(published.small).ok_or(format!("scripts/setup-reference.sh set no {}", published.small))?;
            println!("== the small export in {} (scripts/setup-reference.sh made it)", Path::new(&small).display());
            PathBuf::from(small)
        }
        Sizes::Published => {
            let components = published_folder(shell, published)?;
            let python = shell.var("STAGELOAD_PYTHON").ok_or("scripts/setup-libtorch.sh set no STAGELOAD_PYTHON")?;
            println!("== the published-size export in {} (made once)", components.display());
            let mut export = shell.cmd(&python, published.export);
            shell.run(export.arg("--out").arg(&components))?;
            components
        }
    };
    let stageload = build(shell, &["--example", published.example])?;
    let program = shell.target(&format!("debug/examples/{}", published.example));
    let base = [vec!["--components".to_string(), components.display().to_string()], args.to_vec()].concat();
    let arm = |name: &str| Arm::new(name, &program, &[base.clone(), words(&["--mode", name])].concat());
    let log = Log::create(&out.join("ab.log"))?;
    log.line("== stageload ab: eager, staged, prefetch, one run each, under the guard");
    let flags = guard_flags(Some(&out.join("guard.ndjson")));
    let comparison = Comparison {
        stageload: &stageload,
        out: out.clone(),
        runs: 1,
        arms: vec![arm("eager"), arm("staged"), arm("prefetch")],
        flags,
    };
    let mut failures = Failures::default();
    let report = comparison.run(shell, Some(&log))?;
    failures.keep(report.verdict(published.what));
    failures.keep(check_plan(shell, &stageload, &out, published.plan_below_because));
    if let Some(latent) = published.guard_latent.filter(|_| sizes == Sizes::Published) {
        let runs = GuardRuns { stageload: &stageload, program: &program, args: &base, out: &out, latent };
        failures.keep(guard_story(shell, &report, &runs, &log));
    }
    println!("== a staged run against diffusers' {}", published.reference);
    let mut compare = shell.cmd(&program, &[]);
    compare.args(&base).args(["--mode", "staged", "--compare-python"]);
    failures.keep(save(shell, &mut compare, &out.join("compare.txt"), true));
    failures.end()
}

/// The Python package side by side (crates/bench/python/python_side_by_side.py): Stable Diffusion
/// 1.5 at its published size (the SD part's export, made once, written once more as a diffusers
/// folder), 256x256, 4 DDIM steps, two images per process: unwrapped, under the original Python
/// stageload 0.1.1, and staged by stageload_rs (staged, prefetch), `rounds` runs of each arm
/// alternating, each under `stageload guard`. Per-stage peaks and times, memory kept, and every
/// image against the unwrapped pipeline's (any difference fails). Results in `out`.
pub fn python_demo(shell: &mut Shell, out: &Path, rounds: u16) -> Result<(), Error> {
    shell.set_up(&[Setup::Libtorch, Setup::Reference, Setup::Python])?;
    let out = shell.folder(out)?;
    let components = published_folder(shell, &SD15)?;
    let python = shell.var("STAGELOAD_PYTHON").ok_or("scripts/setup-libtorch.sh set no STAGELOAD_PYTHON")?;
    println!("== the published-size export in {} and its diffusers folder (made once)", components.display());
    shell.run(shell.cmd(&python, SD15.export).arg("--out").arg(&components))?;
    let folder = ["scripts/reference/diffusers_folder.py", "--pipeline", "sd", "--components"];
    shell.run(shell.cmd(&python, &folder).arg(&components))?;
    shell.run(&mut shell.cargo(&["build", "-p", "stageload-cli", "--bin", "stageload"]))?;
    let mut bench = shell.cmd(&python, &["crates/bench/python/python_side_by_side.py", "--folder"]);
    bench.arg(components.join("diffusers")).arg("--out").arg(&out).arg("--guard").arg(shell.target("debug/stageload"));
    shell.run(bench.args(["--rounds", &rounds.to_string(), "--steps", "4", "--size", "256"]))
}

/// Shap-E image-to-3D at its published component sizes (seeded random weights), exported once
/// into the cache (scripts/reference/shap_e_export.py: one component per process, 3.4 GB);
/// eager, staged and staged with prefetch, one run each under `stageload ab` (2 Heun steps, the
/// drawn test image, 32-pixel views and the 128³ mesh, CPU); the plan checked against the runs;
/// then a staged run checked against diffusers' ShapEImg2ImgPipeline on the same weights, pixels
/// and seed (within 1e-5 of each value range, or it fails), its mesh and views written. Results
/// in `out`.
pub fn shap_e_demo(shell: &mut Shell, out: &Path) -> Result<(), Error> {
    published_demo(shell, out, &SHAP_E, &shap_e_args(out), Sizes::Published)
}

/// Shap-E: its exports, example and reference.
const SHAP_E: Published<'static> = Published {
    what: "Shap-E",
    small: "STAGELOAD_SHAP_E_SMALL",
    folder: "shap-e-published",
    export: &["scripts/reference/shap_e_export.py", "--size", "published"],
    example: "shap_e",
    reference: "ShapEImg2ImgPipeline",
    guard_latent: None,
    plan_below_because: Some(
        "the eager run the plan measures carries heap from the decode stage (2.3 GiB of working \
         memory) into export, which the staged run, trimming its heap at each release, does not: \
         export 556 and 899 MiB over the weights in eager against 517 and 514 MiB in staged in two \
         fresh-clone demos",
    ),
};

/// The Shap-E example's arguments in the demo: 2 Heun steps, 32-pixel views, files into `out`.
fn shap_e_args(out: &Path) -> Vec<String> {
    let files = out.join("files").display().to_string();
    [words(&["--steps", "2", "--frame-size", "32", "--out"]), vec![files]].concat()
}

/// What the guard's two runs need: the binaries, the example's arguments, where files go, and the
/// latent both runs must agree on.
struct GuardRuns<'a> {
    stageload: &'a Path,
    program: &'a Path,
    args: &'a [String],
    out: &'a Path,
    latent: &'a str,
}

/// The limit between the staged and the eager arm's highest measured peaks (their midpoint), or
/// why there is none: the guard's story needs eager to need more than staged.
fn limit_between(eager: Option<f64>, staged: Option<f64>) -> Result<u64, Error> {
    match (eager, staged) {
        (Some(eager), Some(staged)) if eager > staged && staged > 0.0 => Ok(((eager + staged) / 2.0) as u64),
        (eager, staged) => Err(format!(
            "no limit between staged's and eager's peaks (staged {staged:?}, eager {eager:?} bytes): eager must need more"
        )),
    }
}

/// The guard tells the memory story in one line: under `stageload guard --max-memory L`, L between
/// the staged and the eager run's peaks (from `report`), eager is stopped and staged finishes
/// with the same `latent` as the unguarded eager run.
fn guard_story(shell: &Shell, report: &Report, runs: &GuardRuns, log: &Log) -> Result<(), Error> {
    let limit = limit_between(report.peak("eager"), report.peak("staged"))?.to_string();
    let file = |name: &str| runs.out.join(name).display().to_string();
    log.line(&format!("== under stageload guard --max-memory {limit} (between staged's and eager's peaks)"));
    let mut eager =
        shell.cmd(runs.stageload, &["guard", "--max-memory", &limit, "--log", &file("guard-eager.ndjson"), "--"]);
    eager.arg(runs.program).args(runs.args).args(["--mode", "eager"]);
    let status = shell.status(&mut eager, Some(log))?;
    if status.code() != Some(stageload_guard::outcome::exit::STOPPED) {
        return Err(format!(
            "eager under --max-memory {limit}, a limit below its measured peak, was not stopped by the guard ({status})"
        ));
    }
    log.line("eager was stopped by the guard");
    let mut staged =
        shell.cmd(runs.stageload, &["guard", "--max-memory", &limit, "--log", &file("guard-staged.ndjson"), "--"]);
    staged.arg(runs.program).args(runs.args).args(["--mode", "staged", "--result", &file("guarded-staged.json")]);
    let status = shell.status(&mut staged, Some(log))?;
    check(&staged, status)?;
    let (want, got) = (
        latent_fingerprint(&runs.out.join("eager-1.json"), runs.latent)?,
        latent_fingerprint(&runs.out.join("guarded-staged.json"), runs.latent)?,
    );
    if want != got {
        return Err(format!("the guarded staged run's {} differs from eager's: {got} against {want}", runs.latent));
    }
    log.line(&format!("staged finished under the same limit with the same {}: {got}", runs.latent));
    Ok(())
}

/// The fingerprint of latent `name` in a demo run's result file (`latents`: [name, fingerprint]
/// pairs).
fn latent_fingerprint(path: &Path, name: &str) -> Result<String, Error> {
    let json = crate::ab::read_json(path)?;
    let pairs = json["latents"].as_array().map(Vec::as_slice).unwrap_or_default();
    let found = pairs.iter().find(|pair| pair[0] == name).and_then(|pair| pair[1].as_str());
    found.map(str::to_string).ok_or(format!("{} has no latent {name}", path.display()))
}

/// What the published Wan export and its runs need, when it is not there yet: the text encoder
/// (10.6 GiB of bf16), the transformer (2.6 GiB) and the VAE decoder (0.5 GiB) as the export
/// script counts them, the last two also as safetensors, with 1 GiB spare.
const WAN_EXPORT_DISK: u64 = (106 + 2 * 26 + 2 * 5 + 10) * (1 << 30) / 10;
/// Memory the eager arm holds: the three models' weights (13.7 GiB) and about 1 GiB of working
/// memory at the demo's shapes (64 tokens, 5 frames of 64 x 64).
const WAN_WORKING: u64 = 1 << 30;
const WAN_WEIGHTS: u64 = 137 * (1 << 30) / 10;

/// Why the Wan part cannot run here, if it cannot: `available` bytes of memory against the eager
/// arm's weights (`weights`: the export's own count when it exists) and working memory, and
/// `free` bytes of disk against the export's files when it still has to be made.
fn wan_skip_reason(available: u64, free: u64, weights: Option<u64>) -> Option<String> {
    let gib = |bytes: u64| format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64);
    let memory = weights.unwrap_or(WAN_WEIGHTS).saturating_add(WAN_WORKING);
    if available < memory {
        return Some(format!(
            "it needs about {} of free memory (the eager arm holds every model) and {} is available",
            gib(memory),
            gib(available)
        ));
    }
    if weights.is_none() && free < WAN_EXPORT_DISK {
        return Some(format!("its export needs about {} of disk and {} is free", gib(WAN_EXPORT_DISK), gib(free)));
    }
    None
}

/// The weights an export's config.json counts (the sum of its components' `bytes`), if it is there.
fn export_weights(components: &Path) -> Option<u64> {
    let config = crate::ab::read_json(&components.join("config.json")).ok()?;
    config["components"].as_object()?.values().map(|c| c["bytes"].as_u64()).sum()
}

/// Wan2.1 text-to-video at its published component sizes (seeded random weights: the umT5 text
/// encoder in bf16 as published, 11.4 GB), exported once into the cache
/// (scripts/reference/wan_export.py: one component per process, about 17 GB); eager, staged and
/// staged with prefetch, one run each under `stageload ab` (2 UniPC steps, guidance 5, 64 tokens,
/// 5 frames of 64 x 64, CPU); the plan checked against the runs; the guard's story (a limit
/// between staged's and eager's peaks stops eager and lets staged finish with the same video);
/// then a staged run checked against diffusers' WanPipeline on the same weights, token ids and
/// seed (within 1e-5 of each value range, or it fails), its frames written. Skipped, saying why,
/// where the memory or the disk is not there. Results in `out`.
pub fn wan_demo(shell: &mut Shell, out: &Path) -> Result<(), Error> {
    wan_part(shell, out, Sizes::Published)
}

/// Wan2.1: its exports, example and reference.
const WAN: Published<'static> = Published {
    what: "Wan2.1",
    small: "STAGELOAD_WAN_SMALL",
    folder: "wan-published",
    export: &["scripts/reference/wan_export.py", "--size", "published"],
    example: "wan",
    reference: "WanPipeline",
    guard_latent: Some("video"),
    plan_below_because: Some(
        "the eager run the plan measures carries about 180 MiB from the text encoder's stage into \
         decode and export, which the staged run does not (traces/wan/ab/README.md)",
    ),
};

/// [`wan_demo`] at `sizes`: at the published sizes, skipped where the memory or the disk is short.
fn wan_part(shell: &mut Shell, out: &Path, sizes: Sizes) -> Result<(), Error> {
    let published = &WAN;
    let files = out.join("files").display().to_string();
    let args = [words(&["--steps", "2", "--out"]), vec![files]].concat();
    if sizes == Sizes::Small {
        return published_demo(shell, out, published, &args, sizes);
    }
    shell.set_up(&[Setup::Libtorch, Setup::Reference])?;
    let components = published_folder(shell, published)?;
    let cache = components.parent().unwrap_or(Path::new("."));
    let available =
        stageload_probe::system_memory().map_err(|e| format!("cannot read the free memory: {e}"))?.available;
    let free = free_bytes(cache)?;
    if let Some(reason) = wan_skip_reason(available, free, export_weights(&components)) {
        let out = shell.folder(out)?;
        let line = format!("Wan2.1 at its published size SKIPPED: {reason}");
        println!("== {line}");
        return write(&out.join("skipped.txt"), &format!("{line}\n"));
    }
    published_demo(shell, out, published, &args, sizes)
}

#[cfg(test)]
mod wan_tests {
    use super::*;

    #[test]
    fn the_small_demo_runs_every_pipeline_and_leaves_python_to_the_published_one() {
        let small = parts(Sizes::Small);
        let pipelines = [Part::Sd, Part::ShapE, Part::Wan];
        assert!(small.iter().filter(|p| pipelines.contains(&p.part)).all(|p| p.expected.is_some()));
        assert!(small.iter().any(|p| p.part == Part::Stream && p.expected.is_some()));
        assert!(small.iter().any(|p| p.part == Part::Python && p.expected.is_none()));
        assert!(parts(Sizes::Published).iter().all(|p| p.expected.is_some()));
        assert!(Sizes::Small.duration().starts_with("about 6 minutes"));
        assert!(Sizes::Published.duration().starts_with("about an hour"));
    }

    #[test]
    fn the_wan_part_is_skipped_with_the_reason_when_memory_or_disk_is_short() {
        let gib = 1u64 << 30;
        assert_eq!(wan_skip_reason(32 * gib, 40 * gib, None), None);
        let memory = wan_skip_reason(8 * gib, 40 * gib, None).unwrap();
        assert!(memory.contains("14.7 GiB of free memory") && memory.contains("8.0 GiB is available"), "{memory}");
        let disk = wan_skip_reason(32 * gib, 5 * gib, None).unwrap();
        assert!(disk.contains("of disk") && disk.contains("5.0 GiB is free"), "{disk}");
        // With the export there, its own count decides and the disk does not matter.
        assert_eq!(wan_skip_reason(16 * gib, 0, Some(14 * gib)), None);
        assert!(wan_skip_reason(14 * gib, 0, Some(14 * gib)).is_some());
    }

    #[test]
    fn a_latent_s_fingerprint_is_read_from_a_result_file_or_named_missing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("eager-1.json");
        std::fs::write(&path, r#"{"latents": [["prompt_embeds", "aa"], ["video", "9a"]]}"#).unwrap();
        assert_eq!(latent_fingerprint(&path, "video").unwrap(), "9a");
        let error = latent_fingerprint(&path, "frames").unwrap_err();
        assert!(error.contains("eager-1.json has no latent frames"), "{error}");
    }

    #[test]
    fn the_guard_s_limit_lies_between_staged_s_and_eager_s_peaks() {
        assert_eq!(limit_between(Some(14.0), Some(10.0)), Ok(12));
        assert!(limit_between(Some(10.0), Some(14.0)).unwrap_err().contains("eager must need more"));
        assert!(limit_between(None, Some(1.0)).is_err());
    }
}
