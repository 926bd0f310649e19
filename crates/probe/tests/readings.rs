//! Real readings on this machine: in range, consistent, and moved by a real allocation.

use stageload_probe::{process_memory, processes, reset_peak, system_memory};

#[test]
fn system_readings_are_in_range() {
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
    let pid = std::process::id() as i32;
    let before = process_memory(pid).unwrap();
    assert!(before.rss > 0 && before.peak.unwrap() >= before.rss, "{before:?}");
    let mut block = vec![0u8; 256 << 20];
    for page in block.chunks_mut(4096) {
        page[0] = 1;
    }
    let during = process_memory(pid).unwrap();
    assert!(during.rss >= before.rss + (200 << 20), "{before:?} -> {during:?}");
    assert!(during.rss_anon.unwrap() >= 200 << 20, "the block is anonymous memory: {during:?}");
    std::hint::black_box(&block);
    drop(block);
    let after = process_memory(pid).unwrap();
    // The kernel keeps RSS in per-CPU counters: the mark can trail the last reading by a few pages.
    assert!(
        after.peak.unwrap() + (1 << 20) >= during.rss,
        "the high-water mark keeps the 256 MiB: {during:?} -> {after:?}"
    );
    reset_peak().unwrap();
    let reset = process_memory(pid).unwrap();
    assert!(reset.peak.unwrap() + (200 << 20) <= during.rss, "{during:?} -> {reset:?}");
}

#[test]
fn the_process_table_has_this_process_and_its_parent() {
    let table = processes().unwrap();
    let pid = std::process::id() as i32;
    let me = table.iter().find(|e| e.pid == pid).expect("this process is listed");
    assert!(me.cmdline.contains("readings"), "{me:?}");
    assert_eq!(me.ppid, std::os::unix::process::parent_id() as i32);
    let chain = stageload_probe::ancestors(&table, pid);
    assert!(chain.len() >= 2 && chain[1] == me.ppid, "{chain:?}");
}
