//! `stageload plan` as users run it: exit codes 0 / 1 / 2, the text, and `--json`.

use std::path::PathBuf;
use std::process::{Command, Output};

use safetensors::tensor::TensorView;
use safetensors::Dtype;

const STAGELOAD: &str = env!("CARGO_BIN_EXE_stageload");

/// A pipeline file in its own folder; the folder goes when this is dropped.
struct Fixture {
    folder: tempfile::TempDir,
    path: PathBuf,
}

impl std::ops::Deref for Fixture {
    type Target = std::path::Path;
    fn deref(&self) -> &std::path::Path {
        &self.path
    }
}

/// A pipeline of two 1 MiB f32 models used in turn, in a fresh folder.
fn pipeline(name: &str) -> Fixture {
    let folder = tempfile::Builder::new().prefix(&format!("stageload-cli-plan-{name}-")).tempdir().unwrap();
    let dir = folder.path();
    let data = vec![0u8; 1 << 20];
    for model in ["encoder", "decoder"] {
        let view = TensorView::new(Dtype::F32, vec![512, 512], &data).unwrap();
        safetensors::serialize_to_file([("w", view)], None, &dir.join(format!("{model}.safetensors"))).unwrap();
    }
    let path = dir.join("pipeline.toml");
    std::fs::write(
        &path,
        "[[models]]\nname = \"encoder\"\nfiles = [\"encoder.safetensors\"]\n\n\
         [[models]]\nname = \"decoder\"\nfiles = [\"decoder.safetensors\"]\n\n\
         [[stages]]\nname = \"encode\"\nmodels = [\"encoder\"]\n\n\
         [[stages]]\nname = \"decode\"\nmodels = [\"decoder\"]\n",
    )
    .unwrap();
    Fixture { folder, path }
}

fn plan(args: &[&str]) -> (Output, String) {
    let output = Command::new(STAGELOAD).arg("plan").args(args).output().unwrap();
    let text = String::from_utf8_lossy(&output.stdout).into_owned() + &String::from_utf8_lossy(&output.stderr);
    (output, text)
}

#[test]
fn fits_does_not_fit_and_what_staging_buys() {
    let path = pipeline("verdicts");
    let file = path.to_str().unwrap();
    let (output, text) = plan(&[file, "--memory", "1.5M"]);
    assert_eq!(output.status.code(), Some(0), "{text}");
    assert!(text.contains("stage decode: resident decoder (1.0 MiB)"), "{text}");
    assert!(text.contains("releases encoder; loads decoder"), "{text}");
    assert!(
        text.contains("eager (every model at once): peak 2.0 MiB at encode -> does not fit by 512.0 KiB"),
        "{text}"
    );
    assert!(text.contains("staging saves 1.0 MiB at the peak\n=> fits"), "{text}");
    let (output, text) = plan(&[file, "--memory", "512K"]);
    assert_eq!(output.status.code(), Some(1), "{text}");
    assert!(text.contains("does not fit by 512.0 KiB") && text.contains("=> does not fit"), "{text}");
    // This machine's own budget: a 2 MiB pipeline fits.
    let (output, text) = plan(&[file]);
    assert_eq!(output.status.code(), Some(0), "{text}");
    assert!(text.contains("budget (this machine") || text.contains("budget (this cgroup"), "{text}");
}

#[test]
fn json_output() {
    let path = pipeline("json");
    let (output, text) = plan(&[path.to_str().unwrap(), "--json", "--memory", "4M", "--device-memory", "1G"]);
    assert_eq!(output.status.code(), Some(0), "{text}");
    let json: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(json["schema"], 1);
    assert_eq!(json["peak_need"], 1 << 20);
    assert_eq!(json["eager"]["need"], 2 << 20);
    assert_eq!(json["read"], 2 << 20);
    assert_eq!(json["device_budget"]["total"], 1u64 << 30);
    assert_eq!(json["stages"][1]["released"], serde_json::json!(["encoder"]));
}

#[test]
fn the_files_device_memory_is_the_device_budget_unless_the_flag_gives_one() {
    let path = pipeline("device-memory");
    let text = std::fs::read_to_string(&path.path).unwrap();
    let text = format!(
        "device_memory = \"1536K\"\n{}",
        text.replace("files = [\"decoder.safetensors\"]", "files = [\"decoder.safetensors\"]\ndevice = \"cuda\"")
    );
    std::fs::write(&path.path, text).unwrap();
    let file = path.to_str().unwrap();
    let device_total = |args: &[&str]| {
        let (output, text) = plan(&[&[file, "--json", "--memory", "4M"], args].concat());
        assert_eq!(output.status.code(), Some(0), "{text}");
        serde_json::from_slice::<serde_json::Value>(&output.stdout).unwrap()["device_budget"]["total"].clone()
    };
    assert_eq!(device_total(&[]), 1536 << 10);
    assert_eq!(device_total(&["--device-memory", "1G"]), 1u64 << 30);
}

#[test]
fn bad_input_exits_2_naming_the_problem() {
    let (output, text) = plan(&["/no/such/pipeline.toml"]);
    assert_eq!(output.status.code(), Some(2));
    assert!(text.contains("cannot read pipeline file /no/such/pipeline.toml"), "{text}");
    let path = pipeline("bad");
    std::fs::write(path.folder.path().join("encoder.safetensors"), b"\x10\0\0\0\0\0\0\0{").unwrap();
    let (output, text) = plan(&[path.to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(2));
    assert!(text.contains("model 'encoder'") && text.contains("encoder.safetensors"), "{text}");
    let (output, text) = plan(&[path.to_str().unwrap(), "--memory", "much"]);
    assert_eq!(output.status.code(), Some(2));
    assert!(text.contains("--memory") && text.contains("not a size"), "{text}");
}

const MIB: u64 = 1 << 20;

/// A hand-made trace of the fixture's pipeline: `encode` then `decode`, each with `weights`
/// resident and a peak of `peaks` (MiB); exact peak records unless `sampled_only`.
fn trace(dir: &std::path::Path, name: &str, stages: &[(&str, u64, u64)], sampled_only: bool) -> PathBuf {
    let mut lines = vec![format!(
        "{{\"type\":\"header\",\"schema\":2,\"utc\":\"x\",\"pid\":1,\"host\":\"h\",\"os\":\"linux\",\"total_memory\":1,\
         \"device\":\"cpu\",\"command\":[],\"interval\":0.25,\"meta\":{{\"mode\":\"{name}\"}}}}"
    )];
    for (i, (stage, weights, peak)) in stages.iter().enumerate() {
        let t = i as f64;
        lines.push(format!("{{\"type\":\"event\",\"t\":{t},\"kind\":\"stage\",\"stage\":\"{stage}\",\"resident\":0}}"));
        lines.push(format!(
            "{{\"type\":\"event\",\"t\":{},\"kind\":\"load\",\"model\":\"m\",\"resident\":{}}}",
            t + 0.1,
            weights * MIB
        ));
        lines.push(format!("{{\"type\":\"sample\",\"t\":{},\"rss\":{}}}", t + 0.5, (peak - 1) * MIB));
        if !sampled_only {
            lines.push(format!("{{\"type\":\"peak\",\"t\":{},\"stage\":\"{stage}\",\"rss\":{}}}", t + 0.9, peak * MIB));
        }
        lines.push(format!("{{\"type\":\"sample\",\"t\":{},\"rss\":{}}}", t + 0.95, (peak - 1) * MIB));
    }
    let path = dir.join(format!("{name}.jsonl"));
    std::fs::write(&path, lines.join("\n")).unwrap();
    path
}

#[test]
fn working_memory_from_a_run_predicts_and_checks_another() {
    let path = pipeline("measured");
    let dir = path.folder.path();
    let file = path.to_str().unwrap();
    // Eager holds both models (2 MiB) with 10 MiB of working memory; staged holds one at a time.
    let eager = trace(dir, "eager", &[("encode", 2, 12), ("decode", 2, 12)], false);
    let staged = trace(dir, "staged", &[("encode", 1, 11), ("decode", 1, 11)], false);
    let (output, text) =
        plan(&[file, "--from-trace", eager.to_str().unwrap(), "--check", staged.to_str().unwrap(), "--memory", "1G"]);
    assert_eq!(output.status.code(), Some(0), "{text}");
    assert!(text.starts_with(&format!("working memory measured in {}", eager.display())), "{text}");
    assert!(text.contains("stage encode: resident encoder (1.0 MiB), needs 11.0 MiB"), "{text}");
    let row = text.lines().find(|l| l.starts_with("decode ")).unwrap();
    assert!(row.contains("1.000") && row.ends_with("yes"), "{row}");

    // A run that holds more than planned fails the check.
    let heavier = trace(dir, "heavier", &[("encode", 2, 13), ("decode", 1, 11)], false);
    let (output, text) = plan(&[file, "--from-trace", eager.to_str().unwrap(), "--check", heavier.to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(1), "{text}");
    assert!(text.lines().any(|l| l.starts_with("encode ") && l.ends_with("NO")), "{text}");

    // A run that peaks further below the plan than 5 % fails, unless the check allows it (the
    // plan errs on the safe side), which its row says.
    let lighter = trace(dir, "lighter", &[("encode", 1, 9), ("decode", 1, 11)], false);
    let (output, text) = plan(&[file, "--from-trace", eager.to_str().unwrap(), "--check", lighter.to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(1), "{text}");
    assert!(text.lines().any(|l| l.starts_with("encode ") && l.ends_with("NO")), "{text}");
    let (output, text) = plan(&[
        file,
        "--from-trace",
        eager.to_str().unwrap(),
        "--check",
        lighter.to_str().unwrap(),
        "--check-allow-below",
    ]);
    assert_eq!(output.status.code(), Some(0), "{text}");
    assert!(
        text.lines().any(|l| l.starts_with("encode ") && l.ends_with("below (the plan errs safe; allowed)")),
        "{text}"
    );
    let (output, text) = plan(&[
        file,
        "--from-trace",
        eager.to_str().unwrap(),
        "--check",
        heavier.to_str().unwrap(),
        "--check-allow-below",
    ]);
    assert_eq!(output.status.code(), Some(1), "a run above its plan still fails: {text}");

    // Without exact peaks the plan says so; a stage the run never reached keeps the file's number.
    let sampled = trace(dir, "sampled", &[("encode", 2, 12)], true);
    let (_, text) = plan(&[file, "--from-trace", sampled.to_str().unwrap()]);
    assert!(
        text.contains("no exact peak records in it")
            && text.contains("not in the run, the file's numbers kept: decode"),
        "{text}"
    );

    // A trace of another pipeline is refused, its stages listed.
    let other = trace(dir, "other", &[("render", 1, 5)], false);
    let (output, text) = plan(&[file, "--from-trace", other.to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(2), "{text}");
    assert!(text.contains("has stages the pipeline does not: render (the pipeline's: encode, decode)"), "{text}");
}

#[test]
fn summary_writes_the_measured_working_memory_into_the_pipeline_file() {
    let path = pipeline("write-working");
    let dir = path.folder.path();
    std::fs::write(
        &*path,
        std::fs::read_to_string(&*path).unwrap().replacen("[[models]]", "# my models\n[[models]]", 1),
    )
    .unwrap();
    let eager = trace(dir, "eager", &[("encode", 2, 12), ("decode", 2, 14)], false);
    let output = Command::new(STAGELOAD)
        .args(["summary", eager.to_str().unwrap(), "--write-working", path.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(0), "{}", String::from_utf8_lossy(&output.stderr));
    let written = std::fs::read_to_string(&*path).unwrap();
    assert!(written.contains("# my models"), "the rest of the file is kept:\n{written}");
    assert!(written.contains(&format!("working = \"{}\"", 12 * MIB - 2 * MIB)), "{written}");
    assert!(written.contains(&format!("working = \"{}\"", 14 * MIB - 2 * MIB)), "{written}");
    let (output, text) = plan(&[path.to_str().unwrap(), "--memory", "1G"]);
    assert_eq!(output.status.code(), Some(0), "{text}");
    assert!(text.contains("stage decode: resident decoder (1.0 MiB), needs 13.0 MiB"), "{text}");
}

#[test]
fn a_stage_that_does_not_fit_says_what_would_make_it_fit() {
    let path = pipeline("remedy");
    let text = std::fs::read_to_string(&*path).unwrap();
    std::fs::write(&*path, format!("pinned = [\"encoder\"]\n{text}")).unwrap();
    let (output, text) = plan(&[path.to_str().unwrap(), "--memory", "1.5M"]);
    assert_eq!(output.status.code(), Some(1), "{text}");
    assert!(text.contains("to fit (short by 512.0 KiB):"), "{text}");
    assert!(text.contains("unpin encoder here (kept, not used by this stage): saves 1.0 MiB, enough alone"), "{text}");
    assert!(text.contains("load decoder as bf16 (dtype = \"bf16\"): saves 512.0 KiB, enough alone"), "{text}");
}

/// The fixture with a reserve, working memory, CPUs and the decoder on cuda:1.
fn scheduled(name: &str) -> Fixture {
    let path = pipeline(name);
    let text = std::fs::read_to_string(&path.path).unwrap();
    let text = format!(
        "reserve = \"10%\"\ncpus = 2\n{}",
        text.replace("files = [\"decoder.safetensors\"]", "files = [\"decoder.safetensors\"]\ndevice = \"cuda:1\"")
            .replace("models = [\"encoder\"]", "models = [\"encoder\"]\nworking = \"3M\"")
    );
    std::fs::write(&path.path, text).unwrap();
    path
}

#[test]
fn a_request_is_the_plans_peak_need_with_its_reserve_in_each_schedulers_words() {
    let path = scheduled("request");
    let file = path.to_str().unwrap();
    let (output, text) = plan(&[file, "--json", "--memory", "1G", "--device-memory", "1G"]);
    assert_eq!(output.status.code(), Some(0), "{text}");
    let planned: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    let request_of = |args: &[&str]| {
        let (output, text) = plan(&[&[file, "--memory", "1G", "--device-memory", "1G", "--request"], args].concat());
        assert_eq!(output.status.code(), Some(0), "{text}");
        String::from_utf8(output.stdout).unwrap()
    };
    let json: serde_json::Value = serde_json::from_str(&request_of(&["json"])).unwrap();
    // encode: 1 MiB of weights and 3 MiB working, 10 % on top; decode: its 1 MiB on the device.
    let (need, device_need) = (4u64 << 20, 1u64 << 20);
    assert_eq!(json["memory"], planned["peak_need"]);
    assert_eq!(json["memory"], need + need / 10);
    assert_eq!(json["expected"], need);
    assert_eq!(json["device_memory"], planned["device_peak_need"]);
    assert_eq!(json["device_memory"], device_need + device_need / 10);
    assert_eq!(json["stage"], "encode");
    // A scheduler numbers a job's GPUs from 0: cuda:1 needs two.
    assert_eq!(json["gpus"], 2);
    assert_eq!(json["cpus"], 2);
    let ray: serde_json::Value = serde_json::from_str(&request_of(&["ray"])).unwrap();
    assert_eq!(
        ray,
        serde_json::json!({ "memory": need + need / 10, "num_cpus": 2, "num_gpus": 2, "resources": { "device_memory_mib": 2 } })
    );
    let mib = |bytes: u64| bytes.div_ceil(1 << 20);
    let slurm = request_of(&["slurm"]);
    assert!(
        slurm.starts_with(&format!(
            "#SBATCH --mem={}M\n#SBATCH --cpus-per-task=2\n#SBATCH --gres=gpu:2\n",
            mib(need + need / 10)
        )),
        "{slurm}"
    );
    let kubernetes = request_of(&["kubernetes"]);
    assert!(
        kubernetes.contains(&format!(
            "requests:\n    memory: 4Mi\n    cpu: \"2\"\n    nvidia.com/gpu: 2\n  limits:\n    memory: {}Mi\n",
            mib(need + need / 10)
        )),
        "{kubernetes}"
    );
    // Eager: both models' weights and the largest working memory.
    let eager: serde_json::Value = serde_json::from_str(&request_of(&["json", "--eager"])).unwrap();
    assert_eq!(eager["memory"], planned["eager"]["need"]);
    assert_eq!(eager["mode"], "eager");
}

#[test]
fn a_plan_that_fits_no_machine_prints_why_instead_of_a_request() {
    let path = scheduled("no-fit");
    let file = path.to_str().unwrap();
    let (output, text) = plan(&[file, "--memory", "2M", "--request", "ray"]);
    assert_eq!(output.status.code(), Some(1), "{text}");
    assert!(output.stdout.is_empty(), "{text}");
    assert!(
        text.contains(
            "the plan does not fit: stage 'encode' needs 4.4 MiB of host memory (--memory), over 2.0 MiB by 2.4 MiB"
        ),
        "{text}"
    );
    let (output, text) = plan(&[file, "--memory", "1G", "--device-memory", "1M", "--request", "slurm"]);
    assert_eq!(output.status.code(), Some(1), "{text}");
    assert!(
        text.contains("stage 'decode' needs 1.1 MiB of device memory (--device-memory, or the file's device_memory)"),
        "{text}"
    );
    // 1.5 MiB holds the two 1 MiB host models staged, not eager.
    let host_only = pipeline("no-fit-eager");
    let host_file = host_only.to_str().unwrap();
    let (output, text) = plan(&[host_file, "--memory", "1536K", "--request", "json", "--eager"]);
    assert_eq!(output.status.code(), Some(1), "{text}");
    assert!(
        text.contains("stage 'encode' needs 2.0 MiB of host memory (--memory), over 1.5 MiB by 512.0 KiB"),
        "{text}"
    );
    assert_eq!(plan(&[host_file, "--memory", "1536K", "--request", "json"]).0.status.code(), Some(0));
    // Usage errors: --eager without --request; --request with --json, or with --from-trace (guard
    // --plan reads the file alone: the measured working memory goes into it).
    for args in [
        &[file, "--eager"][..],
        &[file, "--request", "ray", "--json"],
        &[file, "--request", "yaml"],
        &[file, "--request", "ray", "--from-trace", file],
    ] {
        let (output, text) = plan(args);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {text}");
    }
}
