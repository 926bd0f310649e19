//! The fixed mmap threshold that `StagedModelsBuilder::build` sets, against glibc's default,
//! each in a process of its own (the setting is process-wide, and glibc serves a request from
//! the free blocks of its heap before it maps new memory, whatever the threshold): weight-sized
//! tensors freed between tensors that stay alive are kept by the heap by default and go back to
//! the OS with it. And the host block cache the builder installs beside it: it keeps such blocks
//! for the next request of their size until the next stage begins.
#![cfg(all(target_os = "linux", target_env = "gnu"))]

use std::process::{Command, Stdio};
use std::time::Duration;

use stageload::StagedModels;
use tch::{Device, Kind, Tensor};

use stageload_test_support::torch as support;
use support::{rss_bytes, rss_slack};

const BLOCK: i64 = 4 << 20;
const BLOCKS: usize = 32;
const KEEPER: i64 = 64 << 10;
const NO_MODELS: [&str; 0] = [];

/// Which threshold [`one_round_of_large_blocks_freed_between_live_ones`] runs with.
const MODE: &str = "STAGELOAD_HOST_MEMORY_MODE";

/// Allocates `BLOCKS` written 4 MiB tensors, each followed by a small tensor that stays alive,
/// frees the large ones, and returns how many of their bytes the process still holds: their
/// bytes less what RSS fell by when they were freed (the small ones are returned, alive).
fn bytes_kept_after_freeing() -> (i64, Vec<Tensor>) {
    let (mut large, mut keepers) = (Vec::new(), Vec::new());
    for _ in 0..BLOCKS {
        large.push(Tensor::full([BLOCK / 4], 1.0, (Kind::Float, Device::Cpu)));
        keepers.push(Tensor::full([KEEPER / 4], 1.0, (Kind::Float, Device::Cpu)));
    }
    let before = rss_bytes();
    drop(large);
    (BLOCK * BLOCKS as i64 - (before - rss_bytes()), keepers)
}

/// The counts one round prints (`kept N`, and `after entering N` in the cached mode), run in a
/// fresh process: this binary again, on the round alone.
fn round_in_a_process_of_its_own(mode: &str) -> String {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["one_round_of_large_blocks_freed_between_live_ones", "--exact", "--ignored", "--nocapture"])
        .env(MODE, mode)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // A round takes about a second; a child that hangs is stopped, by its own pid.
    if stageload_test_support::pids::wait_for(&mut child, Duration::from_secs(120)).is_none() {
        panic!("the {mode} round ran past 120 s");
    }
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "the {mode} round failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    stdout
}

/// The count a round printed after `label `.
fn count(stdout: &str, label: &str) -> i64 {
    stdout
        .lines()
        .find_map(|line| line.strip_prefix(label)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("the round printed no {label} count:\n{stdout}"))
}

fn kept_in_a_process_of_its_own(mode: &str) -> i64 {
    count(&round_in_a_process_of_its_own(mode), "kept")
}

#[test]
#[ignore = "one round of the tests below, each of which runs it in a process of its own"]
fn one_round_of_large_blocks_freed_between_live_ones() {
    match std::env::var(MODE).as_deref() {
        // glibc's default: freeing one mapped block raises the threshold above it, so the blocks
        // that follow come from the heap and stay there when freed.
        Ok("default") => {
            drop(Tensor::full([BLOCK / 4], 1.0, (Kind::Float, Device::Cpu)));
            StagedModels::builder().map_large_host_blocks(false).build().unwrap();
        }
        Ok("fixed") => {
            StagedModels::builder().cache_host_blocks(false).build().unwrap();
        }
        Ok("cached") => {
            let models = StagedModels::builder().stage("compute", NO_MODELS).stage("next", NO_MODELS).build().unwrap();
            models.enter("compute").unwrap();
            let (kept, _keepers) = bytes_kept_after_freeing();
            let after_freeing = rss_bytes();
            models.enter("next").unwrap();
            // What entering the stage gave back, against what freeing the blocks had kept.
            println!("kept {kept}");
            println!("after entering {}", kept - (after_freeing - rss_bytes()).max(0));
            return;
        }
        // Asked for by a run of the ignored tests: only a process of its own measures anything.
        Err(_) => return,
        Ok(other) => panic!("{MODE} is {other:?}, not default, fixed or cached"),
    }
    let (kept, _keepers) = bytes_kept_after_freeing();
    println!("kept {kept}");
}

#[test]
fn freed_large_blocks_go_back_to_the_os_once_a_registry_is_built() {
    let total = BLOCK * BLOCKS as i64;
    // Nothing else runs in a round's process between the two readings of its count, and the
    // readings are exact (`rss_bytes`), so they differ from the pages freed only by what the
    // round touches or frees beside the blocks (`rss_slack`, at most a quarter of them). A
    // block served by a mapping of its own goes back whole, with the page its header shares (so
    // `kept` is then below 0); a block in the heap between two live tensors stays whole.
    let slack = rss_slack(total);
    let kept_by_default = kept_in_a_process_of_its_own("default");
    eprintln!("glibc's default: {kept_by_default} of {total} bytes kept");
    assert!(
        kept_by_default + slack >= total,
        "control: glibc's default keeps them ({kept_by_default} of {total} bytes kept, slack {slack})"
    );
    let kept = kept_in_a_process_of_its_own("fixed");
    eprintln!("fixed threshold: {kept} of {total} bytes kept");
    assert!(kept <= slack, "{kept} of {total} bytes still held after freeing (slack {slack})");
}

#[test]
fn the_host_block_cache_keeps_freed_large_blocks_until_the_next_stage_begins() {
    let total = BLOCK * BLOCKS as i64;
    let slack = rss_slack(total);
    let out = round_in_a_process_of_its_own("cached");
    let (kept, after_entering) = (count(&out, "kept"), count(&out, "after entering"));
    eprintln!("cached: {kept} of {total} bytes kept, {after_entering} after entering the next stage");
    assert!(kept + slack >= total, "the cache kept {kept} of {total} bytes (slack {slack})");
    assert!(after_entering <= slack, "{after_entering} of {total} bytes still held in the next stage (slack {slack})");
}
