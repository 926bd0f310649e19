//! The demo pipelines at a small scale, run as users run them (each in its own process): staged
//! latents equal eager ones bit for bit; without RNG preservation they drift after the first
//! lazy build while the first latent still matches; at every model call only the stage's planned
//! models are resident; the cascade's shape decoder is reloaded exactly once.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use stageload::meter::read_trace;
use stageload_trace::{EventKind, Record};

fn example(name: &str) -> PathBuf {
    // Integration tests run from target/<profile>/deps; `cargo test` builds examples beside it.
    let exe = std::env::current_exe().unwrap();
    let path = exe.parent().unwrap().parent().unwrap().join("examples").join(name);
    assert!(path.exists(), "{} is missing: plain `cargo test` builds it", path.display());
    path
}

/// A folder for one test, removed with its contents when dropped.
fn scratch(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new().prefix(&format!("stageload-demo-{name}-")).tempdir().unwrap()
}

struct Run {
    stdout: String,
    latents: BTreeMap<String, String>,
    trace: PathBuf,
}

/// Runs an example at scale 0.01 with checkpoints cached in `dir`.
fn run(example_name: &str, dir: &Path, label: &str, extra: &[&str]) -> Run {
    let trace = dir.join(format!("{label}.jsonl"));
    let output = Command::new(example(example_name))
        .args(["--scale", "0.01", "--cache"])
        .arg(dir.join("weights"))
        .arg("--trace")
        .arg(&trace)
        .args(extra)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{example_name} {extra:?} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let latents = stdout
        .lines()
        .filter_map(|line| line.strip_prefix("latent "))
        .map(|rest| {
            let (name, tail) = rest.split_once(' ').unwrap();
            (name.to_string(), tail.rsplit_once("sha256 ").unwrap().1.to_string())
        })
        .collect();
    Run { stdout, latents, trace }
}

fn check_determinism(example_name: &str, first: &str, after_build: &str) {
    let folder = scratch(example_name);
    let dir = folder.path();
    let eager = run(example_name, dir, "eager", &["--mode", "eager"]);
    let staged = run(example_name, dir, "staged", &["--mode", "staged", "--check-residency"]);
    assert!(eager.latents.len() >= 4, "{}", eager.stdout);
    assert_eq!(staged.latents, eager.latents, "staged latents equal eager ones bit for bit");

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
fn cascade_holds_only_the_planned_models_and_reloads_the_shape_decoder_once() {
    let folder = scratch("cascade-plan");
    let dir = folder.path();
    let staged = run("cascade", dir, "staged", &["--mode", "staged", "--check-residency"]);
    let extractors = ["ss_extractor", "shape512_extractor", "shape1024_extractor", "tex_extractor"];
    let plan: BTreeMap<&str, Vec<&str>> = [
        ("structure", vec!["ss_flow", "ss_decoder"]),
        ("shape_512", vec!["shape_flow_512", "shape_decoder"]),
        ("shape_1024", vec!["shape_flow_1024"]),
        ("texture", vec!["texture_flow"]),
        ("decode", vec!["shape_decoder", "texture_decoder"]),
    ]
    .into();
    let calls: Vec<&str> = staged.stdout.lines().filter(|l| l.starts_with("call ")).collect();
    assert_eq!(calls.len(), 12, "every model call was checked:\n{}", staged.stdout);
    for call in calls {
        let fields: Vec<&str> = call.split_whitespace().collect();
        let (stage, model, resident) = (fields[1], fields[2], fields[4].split(',').collect::<Vec<_>>());
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
            Record::Event(e) if e.kind.is_load() => Some((e.kind, e.model.unwrap_or_default())),
            _ => None,
        })
        .collect();
    let reloads: Vec<&(EventKind, String)> = events.iter().filter(|(kind, _)| *kind == EventKind::Reload).collect();
    assert_eq!(reloads, [&(EventKind::Reload, "shape_decoder".to_string())], "{events:?}");
    assert_eq!(events.iter().filter(|(_, model)| model == "shape_decoder").count(), 2);
}
