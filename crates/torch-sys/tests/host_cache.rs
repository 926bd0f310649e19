//! The host block cache against real libtorch on the CPU: a freed block goes to the next request
//! of its size, small blocks pass by, what it holds stays within its bound (and a step that
//! alternates sizes stops missing after its first round), a flush gives everything back, and a
//! request that cannot be met books nothing. The cache is process-wide, so it has this binary of
//! its own and its tests take turns.

use std::sync::{Mutex, MutexGuard};

use stageload_torch_sys::{cache_host_blocks, flush_host_cache, host_cache_stats, HostCacheStats};
use tch::{Device, Kind, Tensor};

const MIB: i64 = 1 << 20;

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Takes this binary's turn, with the cache installed and empty.
fn alone() -> MutexGuard<'static, ()> {
    let turn = ONE_AT_A_TIME.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    cache_host_blocks().unwrap();
    flush_host_cache().unwrap();
    turn
}

fn stats() -> HostCacheStats {
    host_cache_stats().unwrap()
}

/// A written tensor of `bytes` (a multiple of 4).
fn block(bytes: i64) -> Tensor {
    Tensor::full([bytes / 4], 1.0, (Kind::Float, Device::Cpu))
}

#[test]
fn a_freed_block_is_handed_to_the_next_request_of_its_size() {
    let _turn = alone();
    let first = block(4 * MIB);
    let address = first.data_ptr();
    drop(first);
    let kept = stats();
    assert_eq!(kept.kept, 4 * MIB as u64, "{kept:?}");
    let again = block(4 * MIB);
    assert_eq!(again.data_ptr(), address, "the same block again");
    let after = stats();
    assert_eq!((after.kept, after.hits), (0, kept.hits + 1), "{after:?}");
}

#[test]
fn a_request_is_rounded_up_to_whole_pages_and_served_by_its_rounded_size() {
    let _turn = alone();
    let odd = block(4 * MIB + 4);
    let address = odd.data_ptr();
    drop(odd);
    assert_eq!(stats().kept, 4 * MIB as u64 + 4096);
    // Any request that rounds to the same pages takes it.
    let other = block(4 * MIB + 4000);
    assert_eq!(other.data_ptr(), address);
}

#[test]
fn blocks_below_one_mebibyte_go_straight_back_to_libtorch() {
    let _turn = alone();
    let before = stats();
    drop(block(MIB - 4096));
    let after = stats();
    assert_eq!((after.kept, after.misses, after.hits), (0, before.misses, before.hits), "{after:?}");
}

#[test]
fn a_flush_gives_every_kept_block_back_and_starts_the_marks_over() {
    let _turn = alone();
    let stays = block(2 * MIB);
    drop([block(8 * MIB), block(16 * MIB), block(16 * MIB)]);
    let full = stats();
    assert_eq!(full.kept, 40 * MIB as u64, "{full:?}");
    assert_eq!(flush_host_cache().unwrap(), 40 * MIB as u64);
    let empty = stats();
    assert_eq!(
        (empty.kept, empty.live, empty.high, empty.largest),
        (0, 2 * MIB as u64, 2 * MIB as u64, 0),
        "only the live block counts after a flush: {empty:?}"
    );
    drop(stays);
}

/// One layer of a step, as attention and MLP blocks take turns in the same memory: a large
/// block alone, then two of half its size together.
fn layer() {
    drop(block(16 * MIB));
    let halves = [block(8 * MIB), block(8 * MIB)];
    drop(halves);
}

#[test]
fn a_step_that_alternates_sizes_misses_only_in_its_first_round() {
    let _turn = alone();
    let carried = block(2 * MIB);
    let mut misses = Vec::new();
    for _step in 0..6 {
        for _layer in 0..4 {
            layer();
            let now = stats();
            assert!(now.kept + now.live <= now.bound(), "above the bound: {now:?}");
        }
        misses.push(stats().misses);
    }
    assert!(misses.windows(2).skip(1).all(|pair| pair[0] == pair[1]), "misses after each step: {misses:?}");
    drop(carried);
}

#[test]
fn what_the_cache_holds_stays_within_its_bound_whatever_the_order() {
    let _turn = alone();
    // A fixed pseudo-random walk over allocations and frees of several sizes.
    let sizes = [MIB, 3 * MIB, 4 * MIB, 12 * MIB, 16 * MIB, 64 * MIB];
    let mut held: Vec<Tensor> = Vec::new();
    let mut state = 0x2545_f491_4f6c_dd1du64;
    for _ in 0..400 {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        if held.len() < 8 && (!state.is_multiple_of(3) || held.is_empty()) {
            held.push(Tensor::empty([sizes[(state >> 8) as usize % sizes.len()] / 4], (Kind::Float, Device::Cpu)));
        } else {
            drop(held.swap_remove((state >> 16) as usize % held.len()));
        }
        let now = stats();
        assert!(now.kept + now.live <= now.bound(), "above the bound: {now:?}");
    }
    assert!(stats().hits > 0, "the walk reused nothing: {:?}", stats());
}

#[test]
fn a_request_that_cannot_be_met_is_an_error_and_books_nothing() {
    let _turn = alone();
    let stays = block(4 * MIB);
    let before = stats();
    // 32 TiB: more than this machine's memory and swap, which the kernel refuses outright.
    let err = Tensor::f_empty([1i64 << 43], (Kind::Float, Device::Cpu)).unwrap_err();
    assert!(err.to_string().to_lowercase().contains("alloc"), "{err}");
    let after = stats();
    assert_eq!((after.live, after.high, after.largest), (before.live, before.high, before.largest), "{after:?}");
    drop(stays);
}
