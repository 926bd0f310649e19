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
