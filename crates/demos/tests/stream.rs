//! The stream demo as a user runs it: the cascade's largest model loaded whole, then streamed
//! under a budget below its size, in separate processes. The latent must match bit for bit, and
//! the streamed process's RSS must grow by no more than the budget after set-up. A budget under
//! one block is refused naming both sizes.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

const MIB: u64 = 1 << 20;

/// Runs the demo with `args`; its `--result` JSON.
fn run(cache: &Path, result: &Path, args: &[&str]) -> serde_json::Value {
    let mut child = Command::new(env!("CARGO_BIN_EXE_stream"))
        .args(["--device", "cpu", "--scale", "0.25", "--tokens", "64", "--steps", "2", "--cache"])
        .arg(cache)
        .arg("--result")
        .arg(result)
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(300);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the stream demo ran past 300 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_str(&std::fs::read_to_string(result).unwrap()).unwrap()
}

#[test]
fn the_largest_model_streamed_under_a_budget_below_its_size_gives_the_same_latent() {
    let folder = tempfile::TempDir::new().unwrap();
    let (cache, result) = (folder.path().join("cache"), folder.path().join("result.json"));
    let whole = run(&cache, &result, &[]);
    let model = whole["model_bytes"].as_u64().unwrap();
    assert!(model > 140 * MIB, "texture_flow at scale 0.25 is about 150 MiB: {whole}");
    let budget = 60 * MIB;
    let streamed = run(&cache, &result, &["--budget", "60MiB", "--working", "8MiB"]);
    assert_eq!(streamed["fingerprint"], whole["fingerprint"], "{streamed}");
    let resident = streamed["resident_blocks"].as_u64().unwrap();
    assert!(resident < 12 && streamed["bytes_refilled"].as_u64().unwrap() > 0, "{streamed}");
    let grown = |r: &serde_json::Value| r["peak_rss"].as_u64().unwrap() - r["base_rss"].as_u64().unwrap();
    assert!(grown(&whole) > model, "loaded whole, the process holds the model: {whole}");
    // Allocator and page-cache noise: 8 MiB.
    assert!(grown(&streamed) <= budget + 8 * MIB, "streamed: {} MiB over set-up; {streamed}", grown(&streamed) / MIB);
}

#[test]
fn a_budget_under_one_block_is_refused_with_both_sizes() {
    let folder = tempfile::TempDir::new().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_stream"))
        .args(["--device", "cpu", "--scale", "0.25", "--budget", "4MiB", "--cache"])
        .arg(folder.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    // The run's pipeline file refuses it before anything is built.
    assert!(stderr.contains("model 'texture_flow': stream: a budget of 4.0 MiB"), "{stderr}");
    assert!(stderr.contains("one block 12."), "the block's size: {stderr}");
}

#[test]
fn flags_out_of_range_are_refused_naming_the_flag() {
    for (flag, value) in [("--tokens", "0"), ("--steps", "0"), ("--scale", "0"), ("--budget", "lots")] {
        let out = Command::new(env!("CARGO_BIN_EXE_stream")).args(["--device", "cpu", flag, value]).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{flag} {value}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(flag), "{flag} {value}: {stderr}");
    }
}
