//! The stream demo as a user runs it: the cascade's largest model loaded whole, then streamed
//! under a budget below its size with the working memory the whole runs measured, in separate
//! processes. The latent must match bit for bit, the streamed model's storages must hold no more
//! than the budget leaves beside that working memory, and the process's RSS must grow by no more
//! than the budget after set-up, within what the working memory's measurement does not cover. A
//! budget under one block is refused naming both sizes. A run told its result and latents files
//! through the environment, as `stageload ab` tells each run, writes them there. The benchmark's
//! knobs are the bench binary `bench_stream`'s: blocks read beside a whole flow change nothing it
//! computes.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use stageload_test_support::build::{binary, example};
use stageload_test_support::pids::wait_for;

const MIB: u64 = 1 << 20;

/// The demo on the CPU at scale 0.25 (64 tokens, 2 steps, checkpoints in `cache`) with `args`.
fn demo(cache: &Path, args: &[&str]) -> Command {
    on_cpu(Command::new(example("stream")), cache, args)
}

/// The bench binary `bench_stream` as [`demo`] runs the example.
fn bench(cache: &Path, args: &[&str]) -> Command {
    on_cpu(Command::new(binary("stageload-bench", "bench_stream")), cache, args)
}

/// `command` on the CPU at scale 0.25 (64 tokens, 2 steps, checkpoints in `cache`) with `args`.
fn on_cpu(mut command: Command, cache: &Path, args: &[&str]) -> Command {
    command
        .args(["--device", "cpu", "--scale", "0.25", "--tokens", "64", "--steps", "2", "--cache"])
        .arg(cache)
        .args(args);
    command
}

/// Runs `command` to its end within 300 s (stopped and failed past that); it must succeed.
fn finish(command: &mut Command) {
    let mut child = command.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped()).spawn().unwrap();
    wait_for(&mut child, Duration::from_secs(300)).expect("the stream demo ends within 300 s");
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{command:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// Runs the demo with `args`; its `--result` JSON.
fn run(cache: &Path, result: &Path, args: &[&str]) -> serde_json::Value {
    finish(demo(cache, args).arg("--result").arg(result));
    serde_json::from_str(&std::fs::read_to_string(result).unwrap()).unwrap()
}

#[test]
fn the_largest_model_streamed_under_a_budget_below_its_size_gives_the_same_latent() {
    let folder = tempfile::TempDir::new().unwrap();
    let (cache, result) = (folder.path().join("cache"), folder.path().join("result.json"));
    let grown = |r: &serde_json::Value| r["peak_rss"].as_u64().unwrap() - r["base_rss"].as_u64().unwrap();
    // The first run writes the checkpoint into the cache; the two after it measure.
    run(&cache, &result, &[]);
    let wholes = [run(&cache, &result, &[]), run(&cache, &result, &[])];
    let model = wholes[0]["model_bytes"].as_u64().unwrap();
    assert!(model > 140 * MIB, "texture_flow at scale 0.25 is about 150 MiB: {}", wholes[0]);
    // The working memory, as the demo's `--working` says to measure it: a resident run's growth
    // over set-up less the model (libtorch's first-use buffers included), the larger of two.
    let workings: Vec<u64> =
        wholes.iter().map(|w| grown(w).checked_sub(model).expect("the whole run holds the model")).collect();
    let working = *workings.iter().max().unwrap();
    let budget = 60 * MIB;
    let streamed = run(&cache, &result, &["--budget", "60MiB", "--working", &working.to_string()]);
    assert_eq!(streamed["fingerprint"], wholes[0]["fingerprint"], "{streamed}");
    let resident = streamed["resident_blocks"].as_u64().unwrap();
    assert!(resident < 12 && streamed["bytes_refilled"].as_u64().unwrap() > 0, "{streamed}");
    // The weights' share of the budget, by the storages themselves: exact.
    let held = streamed["most_held"].as_u64().unwrap();
    assert!(
        held <= budget - working,
        "held {held} at a block boundary, over the budget less the working memory; {streamed}"
    );
    // The process: what the budget covers, plus what the resident runs' working memory does not
    // cover: its run-to-run spread (libtorch's and glibc's per-thread buffers), and the refill
    // thread's stack, which the resident run has no thread for (Rust's default: 2 MiB).
    let spread = workings.iter().max().unwrap() - workings.iter().min().unwrap();
    let allowance = spread + 2 * MIB;
    assert!(
        grown(&streamed) <= budget + allowance,
        "streamed: {} MiB over set-up against a budget of 60 MiB + {} KiB; {streamed}",
        grown(&streamed) / MIB,
        allowance >> 10
    );
}

#[test]
fn blocks_read_beside_a_whole_flow_are_all_read_and_change_nothing_it_computes() {
    let folder = tempfile::TempDir::new().unwrap();
    let (cache, result) = (folder.path().join("cache"), folder.path().join("result.json"));
    let whole = run(&cache, &result, &[]);
    // Five blocks over the two calls, dropped from the page cache as they are read.
    finish(bench(&cache, &["--read-beside", "5", "--uncached"]).arg("--result").arg(&result));
    let beside: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&result).unwrap()).unwrap();
    assert_eq!(beside["fingerprint"], whole["fingerprint"], "{beside}");
    // Blocks 0-4, each its tensors' bytes in the checkpoint (all blocks are the same size).
    let file = std::fs::read_dir(cache.join("cascade-scale-0.25"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.file_name().unwrap().to_string_lossy().starts_with("texture_flow"))
        .unwrap();
    let checkpoint = stageload::checkpoint::Checkpoint::open(&[file]).unwrap();
    let block: u64 = checkpoint
        .entries()
        .iter()
        .filter(|(name, _)| name.starts_with("model.blocks.0."))
        .map(|(_, entry)| entry.end - entry.start)
        .sum();
    assert!(block > 0);
    assert_eq!(beside["bytes_read_beside"].as_u64(), Some(5 * block), "{beside}");
    assert_eq!(beside["bytes_refilled"].as_u64(), Some(0), "{beside}");
}

#[test]
fn reads_beside_a_streamed_model_are_refused_naming_both_flags() {
    let out = Command::new(binary("stageload-bench", "bench_stream"))
        .args(["--device", "cpu", "--read-beside", "3", "--budget", "60MiB"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--read-beside") && stderr.contains("--budget"), "{stderr}");
}

#[test]
fn a_run_told_its_files_through_the_environment_writes_its_result_and_latent_there() {
    // As `stageload ab` tells each run (STAGELOAD_RESULT, STAGELOAD_LATENTS), without flags.
    let folder = tempfile::TempDir::new().unwrap();
    let (result, latents) = (folder.path().join("run-1.json"), folder.path().join("run-1.safetensors"));
    finish(
        demo(&folder.path().join("cache"), &["--budget", "60MiB"])
            .env("STAGELOAD_RESULT", &result)
            .env("STAGELOAD_LATENTS", &latents),
    );
    let result: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&result).unwrap()).unwrap();
    assert!(result["seconds"].as_f64().unwrap() > 0.0 && result["refills"].as_u64().unwrap() > 0, "{result}");
    let sidecar = std::fs::read_to_string(folder.path().join("run-1.safetensors.sha256")).unwrap();
    let fingerprint = result["fingerprint"].as_str().unwrap();
    assert_eq!(sidecar.trim(), format!("texture {fingerprint}"), "the latent file holds the result's latent");
    let header = std::fs::read(&latents).unwrap();
    assert!(header.len() > 64 * 64 * 4, "the latent's values are in the file: {} bytes", header.len());
}

#[test]
fn a_budget_under_one_block_is_refused_with_both_sizes() {
    let folder = tempfile::TempDir::new().unwrap();
    let out = Command::new(example("stream"))
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
fn the_example_leaves_the_benchmark_s_knobs_to_the_bench_binary() {
    for flag in ["--read-beside", "--uncached", "--route", "--disk-rate", "--cold", "--map-large-blocks", "--buffered"]
    {
        let out = Command::new(example("stream")).args(["--device", "cpu", flag]).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{flag}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(flag), "{flag}: {stderr}");
    }
}

#[test]
fn flags_out_of_range_are_refused_naming_the_flag() {
    for (flag, value) in [("--tokens", "0"), ("--steps", "0"), ("--scale", "0"), ("--budget", "lots")] {
        let out = Command::new(example("stream")).args(["--device", "cpu", flag, value]).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{flag} {value}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(flag), "{flag} {value}: {stderr}");
    }
}

/// Three blocks of a weight and a bias each, under `m.blocks`.
fn blocks_checkpoint(folder: &std::path::Path) -> std::path::PathBuf {
    let path = folder.join("blocks.safetensors");
    let tensors: Vec<(String, tch::Tensor)> = (0..3)
        .flat_map(|block| {
            [
                (format!("m.blocks.{block}.weight"), tch::Tensor::ones([4, 8], (tch::Kind::Float, tch::Device::Cpu))),
                (format!("m.blocks.{block}.bias"), tch::Tensor::ones([8], (tch::Kind::Float, tch::Device::Cpu))),
            ]
        })
        .collect();
    stageload::checkpoint::save(&tensors, &path).unwrap();
    path
}

#[test]
fn blocks_asked_to_be_read_beside_are_each_read_once_per_ask() {
    let folder = tempfile::TempDir::new().unwrap();
    let beside =
        stageload_demo_kit::beside::ReadsBeside::start(&blocks_checkpoint(folder.path()), "m.blocks", true).unwrap();
    for block in [0, 2, 0] {
        beside.read(block);
    }
    assert_eq!(beside.finish().unwrap(), 3 * (32 + 8) * 4);
}

#[test]
fn reading_beside_a_block_the_checkpoint_lacks_is_an_error_naming_the_file_and_the_block() {
    let folder = tempfile::TempDir::new().unwrap();
    let path = blocks_checkpoint(folder.path());
    let beside = stageload_demo_kit::beside::ReadsBeside::start(&path, "m.blocks", false).unwrap();
    beside.read(1);
    beside.read(7);
    beside.read(2);
    let message = beside.finish().unwrap_err().to_string();
    assert!(message.contains(&path.display().to_string()) && message.contains("m.blocks.7.*"), "{message}");
}
