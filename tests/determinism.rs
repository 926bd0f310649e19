//! The demo pipelines at a small scale, run as users run them (each in its own process): staged
//! latents equal eager ones bit for bit; without RNG preservation they drift after the first
//! lazy build while the first latent still matches; at every model call only the stage's planned
//! models are resident; the cascade's shape decoder is reloaded exactly once.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use stageload_test_support::build::example;

use stageload::meter::read_trace;
use stageload_trace::{EventKind, Record};

/// A folder for one test, removed with its contents when dropped.
fn scratch(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new().prefix(&format!("stageload-demo-{name}-")).tempdir().unwrap()
}

/// A run's `--result` file, and where its trace and latents went.
struct Run {
    result: serde_json::Value,
    latents: BTreeMap<String, String>,
    trace: PathBuf,
    latents_file: PathBuf,
}

/// Runs a demo at scale 0.01 with checkpoints cached in `dir`.
fn run(demo: &str, dir: &Path, label: &str, extra: &[&str]) -> Run {
    let (trace, result, latents_file) = (
        dir.join(format!("{label}.jsonl")),
        dir.join(format!("{label}.json")),
        dir.join(format!("{label}.safetensors")),
    );
    let output = Command::new(example(demo))
        .args(["--scale", "0.01", "--cache"])
        .arg(dir.join("weights"))
        .arg("--trace")
        .arg(&trace)
        .arg("--result")
        .arg(&result)
        .arg("--latents")
        .arg(&latents_file)
        .args(extra)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{demo} {extra:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    let result: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&result).unwrap()).unwrap();
    let latents = result["latents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|pair| (pair[0].as_str().unwrap().to_string(), pair[1].as_str().unwrap().to_string()))
        .collect();
    Run { result, latents, trace, latents_file }
}

fn check_determinism(example_name: &str, first: &str, after_build: &str) {
    let folder = scratch(example_name);
    let dir = folder.path();
    let eager = run(example_name, dir, "eager", &["--mode", "eager"]);
    let staged = run(example_name, dir, "staged", &["--mode", "staged", "--check-residency"]);
    assert!(eager.latents.len() >= 4, "{}", eager.result);
    assert_eq!(staged.latents, eager.latents, "staged latents equal eager ones bit for bit");
    // The latents file holds the tensors, and its sidecar the same fingerprints.
    let tensors =
        safetensors::SafeTensors::deserialize(&std::fs::read(&staged.latents_file).unwrap()).unwrap().names().len();
    assert_eq!(tensors, staged.latents.len());
    let sidecar = std::fs::read_to_string(stageload::latents::sidecar(&staged.latents_file)).unwrap();
    let listed: BTreeMap<String, String> = sidecar
        .lines()
        .map(|line| line.split_once(' ').map(|(n, p)| (n.to_string(), p.to_string())).unwrap())
        .collect();
    assert_eq!(listed, staged.latents);

    let control = run(example_name, dir, "control", &["--mode", "staged", "--no-preserve-rng"]);
    assert_eq!(control.latents[first], eager.latents[first], "the first latent is drawn before any lazy build");
    assert_ne!(
        control.latents[after_build], eager.latents[after_build],
        "without preservation the draws after a lazy build drift"
    );
}

#[test]
fn cascade_staged_equals_eager_and_the_control_drifts() {
    check_determinism("cascade", "image", "structure");
}

#[test]
fn text_to_image_staged_equals_eager_and_the_control_drifts() {
    check_determinism("text_to_image", "noise", "denoised");
}

#[test]
fn cascade_with_prefetch_holds_the_stage_and_the_next_stages_models_and_gives_eagers_latents() {
    let folder = scratch("cascade-prefetch");
    let dir = folder.path();
    let eager = run("cascade", dir, "eager", &["--mode", "eager"]);
    // Each call checks that nothing but the stage's, the pinned and the next stage's models is resident.
    let prefetch = run("cascade", dir, "prefetch", &["--mode", "staged", "--prefetch", "--check-residency"]);
    assert_eq!(prefetch.latents, eager.latents, "prefetch latents equal eager ones bit for bit");
    let calls = prefetch.result["calls"].as_array().unwrap();
    assert!(!calls.is_empty(), "every model call was checked: {}", prefetch.result);
    // The prefetch did prefetch: models of the next stage were loaded in the background (a
    // `--prefetch` that loads nothing ahead would pass every check above), each asked for on
    // entering the stage before the one that lists it.
    let prefetches = prefetches(&prefetch.trace);
    let held: Vec<&Prefetched> = prefetches.loaded.iter().filter(|p| p.before_its_stage).collect();
    assert!(!prefetches.loaded.is_empty(), "no model was loaded in the background: {prefetches:#?}");
    for (asked_in, loads_for, model) in &prefetches.asked {
        let next = prefetches.entered.iter().position(|s| s == asked_in).and_then(|i| prefetches.entered.get(i + 1));
        assert_eq!(next, Some(loads_for), "{model} prefetched in {asked_in} for {loads_for}: {prefetches:#?}");
    }
    for loaded in &prefetches.loaded {
        assert!(
            prefetches.asked.iter().any(|(_, _, model)| *model == loaded.model),
            "{} loaded in the background without a prefetch asking for it: {prefetches:#?}",
            loaded.model
        );
    }
    eprintln!(
        "prefetched {} models, {} of them held before their stage began: {prefetches:?}",
        prefetches.loaded.len(),
        held.len()
    );
}

/// What a run's trace says its prefetches did.
#[derive(Debug)]
struct Prefetches {
    /// The stages entered, in order.
    entered: Vec<String>,
    /// Each background load begun: the stage current then, the stage it loads for, the model.
    asked: Vec<(String, String, String)>,
    /// Each load or reload done in the background.
    loaded: Vec<Prefetched>,
}

/// A load or reload done in the background.
#[derive(Debug)]
struct Prefetched {
    model: String,
    /// Its event (sent after the install) came before the stage it was loaded for began: the
    /// stage before held it beside its own models. (One installed just before that stage began
    /// and said just after is not counted.)
    before_its_stage: bool,
}

fn prefetches(trace: &Path) -> Prefetches {
    let mut found = Prefetches { entered: Vec::new(), asked: Vec::new(), loaded: Vec::new() };
    for record in read_trace(trace).unwrap().records {
        let Record::Event(event) = record else { continue };
        let name = |s: Option<&str>| s.unwrap_or_default().to_string();
        match event.kind() {
            EventKind::Stage => found.entered.push(name(event.stage())),
            EventKind::Prefetch => {
                let current = found.entered.last().cloned().unwrap_or_default();
                found.asked.push((current, name(event.stage()), name(event.model())));
            }
            kind if kind.is_load() && event.prefetched() => {
                let model = name(event.model());
                let loads_for = found.asked.iter().rev().find(|(_, _, asked)| *asked == model).map(|(_, s, _)| s);
                let before_its_stage = loads_for.is_some_and(|stage| !found.entered.contains(stage));
                found.loaded.push(Prefetched { model, before_its_stage });
            }
            _ => {}
        }
    }
    found
}

#[test]
fn cascade_holds_only_the_planned_models_and_reloads_the_shape_decoder_once() {
    let folder = scratch("cascade-plan");
    let dir = folder.path();
    // With a host tier, which on the CPU holds nothing and says so (on CUDA it holds the
    // released models: cargo xtask gpu-check).
    let staged = run("cascade", dir, "staged", &["--mode", "staged", "--check-residency", "--host-tier", "64MiB"]);
    let extractors = ["ss_extractor", "shape512_extractor", "shape1024_extractor", "tex_extractor"];
    let plan: BTreeMap<&str, Vec<&str>> = [
        ("structure", vec!["ss_flow", "ss_decoder"]),
        ("shape_512", vec!["shape_flow_512", "shape_decoder"]),
        ("shape_1024", vec!["shape_flow_1024"]),
        ("texture", vec!["texture_flow"]),
        ("decode", vec!["shape_decoder", "texture_decoder"]),
    ]
    .into();
    let calls = staged.result["calls"].as_array().unwrap();
    assert_eq!(calls.len(), 12, "every model call was checked: {:#}", staged.result);
    for call in calls {
        let (stage, model) = (call["stage"].as_str().unwrap(), call["model"].as_str().unwrap());
        let resident: Vec<&str> = call["resident"].as_array().unwrap().iter().map(|r| r.as_str().unwrap()).collect();
        assert!(resident.contains(&model), "{call}");
        for name in resident {
            let pinned = extractors.contains(&name) && stage != "decode";
            assert!(plan[stage].contains(&name) || pinned, "{name} is resident at {stage}: {call}");
        }
    }
    let events: Vec<(EventKind, String)> = read_trace(&staged.trace)
        .unwrap()
        .records
        .into_iter()
        .filter_map(|r| match r {
            Record::Event(e) if e.kind().is_load() => Some((e.kind(), e.model().unwrap_or_default().to_string())),
            _ => None,
        })
        .collect();
    let reloads: Vec<&(EventKind, String)> = events.iter().filter(|(kind, _)| *kind == EventKind::Reload).collect();
    assert_eq!(reloads, [&(EventKind::Reload, "shape_decoder".to_string())], "{events:?}");
    assert_eq!(events.iter().filter(|(_, model)| model == "shape_decoder").count(), 2);
    let tier: Vec<String> = read_trace(&staged.trace)
        .unwrap()
        .records
        .into_iter()
        .filter_map(|r| match r {
            Record::Event(e) if e.kind() == EventKind::Tier => e.note(),
            _ => None,
        })
        .collect();
    assert!(tier.len() == 1 && tier[0].contains("lives on the CPU"), "{tier:?}");
}

#[test]
fn a_runner_gives_the_trace_and_latents_files_through_the_environment() {
    let folder = scratch("env");
    let dir = folder.path();
    let (trace, latents) = (dir.join("from-env.jsonl"), dir.join("from-env.safetensors"));
    let output = Command::new(example("text_to_image"))
        .args(["--scale", "0.01", "--cache"])
        .arg(dir.join("weights"))
        .env("STAGELOAD_TRACE", &trace)
        .env("STAGELOAD_LATENTS", &latents)
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    assert!(read_trace(&trace).unwrap().records.len() > 3, "the meter wrote the trace the runner named");
    let names = safetensors::SafeTensors::deserialize(&std::fs::read(&latents).unwrap()).unwrap().names().len();
    assert!(names >= 3, "the latents went to the file the runner named");
}

#[test]
fn the_plan_with_the_eager_runs_working_memory_matches_the_staged_run_stage_by_stage() {
    let folder = scratch("plan-check");
    let dir = folder.path();
    let eager = run("cascade", dir, "eager", &["--mode", "eager"]);
    let staged = run("cascade", dir, "staged", &["--mode", "staged"]);
    let description = dir.join("weights/cascade-scale-0.01/cascade.toml");
    let pipeline = stageload_plan::Pipeline::load(&description).unwrap();
    let measured =
        stageload_plan::measured::Measured::from_trace(&pipeline, &read_trace(&eager.trace).unwrap()).unwrap();
    assert!(!measured.sampled_only && measured.working.iter().all(Option::is_some), "{measured:?}");
    let predicted = measured.apply(&pipeline);
    let plan = stageload_plan::plan(&predicted, stageload_plan::Budget::given(1 << 40), None);
    let checks = stageload_plan::measured::check(&predicted, &plan, &read_trace(&staged.trace).unwrap()).unwrap();
    assert_eq!(checks.len(), 7);
    for check in &checks {
        assert!(check.ok, "{check:?}\n{}", stageload_plan::measured::render_checks(&checks, &staged.trace, false));
    }
}

#[test]
fn a_host_tier_that_is_not_a_size_is_refused_naming_the_flag() {
    let out = Command::new(example("cascade")).args(["--device", "cpu", "--host-tier", "lots"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--host-tier") && stderr.contains("lots"), "{stderr}");
}
