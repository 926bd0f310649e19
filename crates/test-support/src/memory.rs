//! The process's RSS read exactly, and what an RSS check allows beside the bytes it covers (no
//! libtorch needed: the shim's tests use it too).

/// The process's resident set size, in bytes, counted exactly. On Linux it is the `Rss` of
/// `/proc/self/smaps_rollup`, which the kernel sums by walking this process's page tables when
/// the file is read: every page mapped then, and nothing else. (`VmRSS`, which
/// [`stageload_probe::process_memory`] reads, comes from per-CPU counters that, before Linux
/// 6.16, could leave up to 3 × CPUs × max(32, 2 × CPUs) pages unfolded in each reading,
/// [`stageload_probe::rss_counter_slack`]: 768 KiB on 2 CPUs, 17 MiB on 27, growing with the
/// square of the CPUs, so that allowing it for two readings let a 32 MiB check pass with nothing
/// moved from 27 CPUs up.) Elsewhere the probe's reading (macOS reads the task's own totals,
/// exact too).
pub fn rss_bytes() -> i64 {
    #[cfg(target_os = "linux")]
    {
        let rollup = std::fs::read_to_string("/proc/self/smaps_rollup").expect("read /proc/self/smaps_rollup");
        let kib = rollup
            .lines()
            .find_map(|line| line.strip_prefix("Rss:")?.trim().strip_suffix("kB")?.trim().parse::<i64>().ok())
            .unwrap_or_else(|| panic!("no Rss line in /proc/self/smaps_rollup:\n{rollup}"));
        kib * 1024
    }
    #[cfg(not(target_os = "linux"))]
    {
        stageload_probe::process_memory(std::process::id() as i32).expect("read this process's memory").rss as i64
    }
}

/// What an RSS check that covers `covered` bytes allows beside them, the same on every machine.
///
/// The readings themselves are exact ([`rss_bytes`]), so what is allowed is memory the code
/// between the two readings may touch or free beside the quantity checked:
///
/// - the registry's own allocations for a stage change (its bookkeeping, an event, a log line):
///   heap chunks of a few KiB, in pages the heap holds already or new ones;
/// - a thread that allocates for the first time gets a glibc arena of its own, whose first heap
///   has its header page and then pages as its chunks touch them, and a stack that touches a
///   few pages (no test here starts more than a few threads between two readings: torch's
///   intra-op pool is started by the forward before the first reading);
/// - glibc gives the main heap's free top back only past its trim threshold (128 KiB by
///   default), so up to that much freed beside the quantity may stay.
///
/// Each is at most about 128 KiB, and they may add up: measured on the checks of `release_rss`,
/// `pt2_rss` and `host_memory`, at most 248 KiB moved beside the quantity (all of it in the
/// direction each check allows). [`ELSEWHERE`] allows 1 MiB, four times that, and the slack is
/// at most a quarter of `covered`, so that a check of `covered` bytes fails whenever more than a
/// quarter of them did not move, on any machine (the CPUs count nowhere here).
pub fn rss_slack(covered: i64) -> i64 {
    ELSEWHERE.min(covered / 4)
}

/// What [`rss_slack`] allows beside the bytes a check covers, before the cap (see there).
pub const ELSEWHERE: i64 = 8 * (128 << 10);

/// Asserts that the process's RSS `went` (fell, came back) by at least `bytes`, as `moved`
/// (the difference of two [`rss_bytes`] readings) says, allowing [`rss_slack`] of them.
pub fn assert_rss_moved(went: &str, moved: i64, bytes: i64) {
    let slack = rss_slack(bytes);
    eprintln!("RSS {went} by {moved} for {bytes} bytes (slack {slack}, moved beyond them {})", moved - bytes);
    assert!(moved + slack >= bytes, "RSS {went} by {moved} for {bytes} bytes (slack {slack})");
}
