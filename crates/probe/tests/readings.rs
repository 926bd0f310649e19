//! Real readings on this machine: in range, consistent, and moved by a real allocation. One test
//! reads this process's RSS while it allocates: every test takes `ONE_AT_A_TIME`, so that no
//! other test allocates or frees beside it.

use std::sync::{Mutex, MutexGuard};

use stageload_probe::{process_memory, processes, reset_peak, rss_counter_slack, system_memory};

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn alone() -> MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[test]
fn system_readings_are_in_range() {
    let _alone = alone();
    let memory = system_memory().unwrap();
    assert!(memory.total > 256 << 20, "{memory:?}");
    assert!(memory.available > 0 && memory.available <= memory.total, "{memory:?}");
    assert!(memory.swap_used <= memory.swap_total, "{memory:?}");
    let percent = memory.available_percent();
    assert!(percent > 0.0 && percent <= 100.0, "{percent}");
    if let Some(group) = &memory.cgroup {
        assert!(group.limit < memory.total && group.headroom() <= group.limit, "{group:?}");
    }
    if let Some(psi) = stageload_probe::pressure().unwrap() {
        assert!((0.0..=100.0).contains(&psi.some_avg10) && psi.full_avg10 <= psi.some_avg10 + 1e-9, "{psi:?}");
    }
}

#[test]
fn an_allocation_raises_rss_and_the_peak_resets() {
    const BLOCK: u64 = 256 << 20;
    let _alone = alone();
    // What the kernel's per-CPU counters may leave out of one reading; two readings compared can
    // differ from the pages between them by twice that.
    let slack = rss_counter_slack();
    let pid = std::process::id() as i32;
    let before = process_memory(pid).unwrap();
    // One reading takes both from the same counts, and the mark is at least the count.
    assert!(before.rss > 0 && before.peak.unwrap() >= before.rss, "{before:?}");
    // A mapping of its own (above glibc's mmap threshold), one byte written in each of its pages.
    let mut block = vec![0u8; BLOCK as usize];
    for page in block.chunks_mut(4096) {
        page[0] = 1;
    }
    let during = process_memory(pid).unwrap();
    assert!(during.rss + 2 * slack >= before.rss + BLOCK, "{before:?} -> {during:?}, slack {slack}");
    assert!(during.rss_anon.unwrap() + slack >= BLOCK, "the block is anonymous memory: {during:?}, slack {slack}");
    std::hint::black_box(&block);
    drop(block);
    let after = process_memory(pid).unwrap();
    // The mark was taken from the counters' folded totals when the block was unmapped.
    assert!(
        after.peak.unwrap() + 2 * slack >= during.rss,
        "the high-water mark keeps the block: {during:?} -> {after:?}, slack {slack}"
    );
    reset_peak().unwrap();
    let reset = process_memory(pid).unwrap();
    assert!(reset.peak.unwrap() + BLOCK <= during.rss + 2 * slack, "{during:?} -> {reset:?}, slack {slack}");
}

#[test]
fn the_process_table_has_this_process_and_its_parent() {
    let _alone = alone();
    let table = processes().unwrap();
    let pid = std::process::id() as i32;
    let me = table.iter().find(|e| e.pid == pid).expect("this process is listed");
    assert!(me.cmdline.contains("readings"), "{me:?}");
    assert_eq!(me.ppid, std::os::unix::process::parent_id() as i32);
    let chain = stageload_probe::ancestors(&table, pid);
    assert!(chain.len() >= 2 && chain[1] == me.ppid, "{chain:?}");
}
