//! Runs the README example as a user would and checks what it did (its `--result` file).

use std::process::Command;

use stageload_test_support::build::example;

#[test]
fn the_readme_example_runs_staged() {
    let two_models = example("two_models");
    let folder = tempfile::TempDir::new().unwrap();
    let (cache, result) = (folder.path().join("cache"), folder.path().join("result.json"));
    let run = || {
        let out = Command::new(&two_models)
            .args(["--width", "256", "--cache"])
            .arg(&cache)
            .arg("--result")
            .arg(&result)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_str::<serde_json::Value>(&std::fs::read_to_string(&result).unwrap()).unwrap()
    };
    let first = run();
    assert_eq!(first["resident_after_encode"], serde_json::json!(["encoder"]), "{first}");
    assert_eq!(first["resident_after_decode"], serde_json::json!(["decoder"]), "{first}");
    let events = first["events"].as_array().unwrap();
    assert!(events.iter().any(|e| e.as_str().unwrap().starts_with("release encoder 1.0 MiB")), "{first}");
    // A second run reads the cached checkpoints and must give the same output bit for bit.
    assert_eq!(first["output"], run()["output"]);
}
