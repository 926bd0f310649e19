//! The host block cache against real libtorch on the CPU: a freed block goes to the next request
//! of its size, small blocks pass by, what it holds stays within its bound (and a step that
//! alternates sizes stops missing after its first round), a flush gives everything back, and a
//! request that cannot be met books nothing; its blocks of 2 MiB or more start at a huge-page
//! boundary and are advised for huge pages, unless that is turned off. The cache is
//! process-wide, so it has this binary of its own and its tests take turns.

use std::sync::{Mutex, MutexGuard};

use stageload_torch_sys::{
    cache_host_blocks, flush_host_cache, host_cache_stats, huge_host_pages, HostCacheStats, HUGE_PAGE,
};
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
    // Worded as libtorch's allocator words it, so that stageload reads it as an out-of-memory.
    assert!(err.to_string().contains("can't allocate memory"), "{err}");
    let after = stats();
    assert_eq!((after.live, after.high, after.largest), (before.live, before.high, before.largest), "{after:?}");
    drop(stays);
}

/// The kernel's transparent huge page mode: the bracketed word of its setting (`always`,
/// `madvise` or `never`).
fn thp_mode() -> String {
    let setting = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap();
    let start = setting.find('[').expect("a bracketed mode") + 1;
    let end = setting[start..].find(']').expect("a closing bracket") + start;
    setting[start..end].to_string()
}

/// Whether the kernel may back the mapping that holds `address` with huge pages: its
/// `THPeligible` in `/proc/self/smaps`.
fn thp_eligible(address: usize) -> bool {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let mut inside = false;
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or_default();
        if let Some((start, end)) = first.split_once('-') {
            if let (Ok(start), Ok(end)) = (usize::from_str_radix(start, 16), usize::from_str_radix(end, 16)) {
                inside = (start..end).contains(&address);
                continue;
            }
        }
        if let (true, Some(value)) = (inside, line.strip_prefix("THPeligible:")) {
            return value.trim() == "1";
        }
    }
    panic!("no mapping with THPeligible holds {address:#x}");
}

#[test]
fn a_block_of_two_mebibytes_or_more_starts_at_a_huge_page_boundary_and_may_get_huge_pages() {
    let _turn = alone();
    huge_host_pages(true);
    let weights = block(6 * MIB + 4096);
    let address = weights.data_ptr() as usize;
    assert_eq!(address % HUGE_PAGE, 0, "{address:#x}");
    assert_eq!(thp_eligible(address), thp_mode() != "never", "mode {}", thp_mode());
}

#[test]
fn with_huge_pages_off_a_block_is_left_to_the_kernel_s_default() {
    let _turn = alone();
    huge_host_pages(false);
    let weights = block(6 * MIB + 8192);
    let eligible = thp_eligible(weights.data_ptr() as usize);
    huge_host_pages(true);
    assert_eq!(eligible, thp_mode() == "always", "mode {}", thp_mode());
}
