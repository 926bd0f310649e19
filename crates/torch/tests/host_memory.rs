//! The fixed mmap threshold that `StagedModelsBuilder::build` sets, against glibc's default, in
//! one process of its own (the setting is process-wide): weight-sized tensors freed between
//! tensors that stay alive are kept by the heap by default and go back to the OS with it.
#![cfg(all(target_os = "linux", target_env = "gnu"))]

use stageload::StagedModels;
use tch::{Device, Kind, Tensor};

mod common;
use common::rss_bytes;

const BLOCK: i64 = 4 << 20;
const BLOCKS: usize = 32;
const KEEPER: i64 = 64 << 10;

/// Allocates `BLOCKS` written 4 MiB tensors, each followed by a small tensor that stays alive,
/// frees the large ones, and returns how many bytes of them the process still holds (the small
/// ones are returned, alive).
fn bytes_kept_after_freeing() -> (i64, Vec<Tensor>) {
    let before = rss_bytes();
    let (mut large, mut keepers) = (Vec::new(), Vec::new());
    for _ in 0..BLOCKS {
        large.push(Tensor::full([BLOCK / 4], 1.0, (Kind::Float, Device::Cpu)));
        keepers.push(Tensor::full([KEEPER / 4], 1.0, (Kind::Float, Device::Cpu)));
    }
    drop(large);
    (rss_bytes() - before - KEEPER * BLOCKS as i64, keepers)
}

#[test]
fn freed_large_blocks_go_back_to_the_os_once_a_registry_is_built() {
    let total = BLOCK * BLOCKS as i64;
    // glibc's default: freeing one mapped block raises the threshold above it, so the blocks
    // that follow come from the heap and stay there when freed.
    drop(Tensor::full([BLOCK / 4], 1.0, (Kind::Float, Device::Cpu)));
    StagedModels::builder().map_large_host_blocks(false).build().unwrap();
    let (kept_by_default, _keepers) = bytes_kept_after_freeing();
    eprintln!("glibc's default: {kept_by_default} of {total} bytes kept");
    assert!(
        kept_by_default > total / 2,
        "control: glibc's default keeps them ({kept_by_default} of {total} bytes kept)"
    );

    StagedModels::builder().build().unwrap();
    let (kept, _keepers) = bytes_kept_after_freeing();
    eprintln!("fixed threshold: {kept} of {total} bytes kept");
    assert!(kept < total / 10, "{kept} of {total} bytes still held after freeing");
}
