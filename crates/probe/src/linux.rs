//! Linux readings: `/proc/pressure/memory`, `/proc/PID/{status,stat,cmdline}` and
//! `/proc/self/clear_refs` through the `procfs` crate; `/proc/meminfo` and the cgroup files
//! ([`crate::cgroup`]) read here. procfs's `Meminfo` demands some twenty fields that vary between
//! kernels and reports a missing one as an internal bug; the guard needs five fields and a clear
//! error, so that one file is parsed by hand.

use std::collections::HashMap;
use std::path::Path;
use std::sync::OnceLock;

use procfs::process::{ClearRefs, Process};
use procfs::Current;

use crate::{cgroup, Pressure, ProbeError, ProcessEntry, ProcessMemory, SystemMemory};

fn read_error(source_name: impl Into<String>, error: impl std::fmt::Display) -> ProbeError {
    ProbeError::Read { source_name: source_name.into(), message: error.to_string() }
}

/// Turns `/proc/meminfo` text into readings, checking that they are consistent (a sample that is
/// not, for example MemAvailable above MemTotal, is an error rather than a wrong number).
pub(crate) fn parse_meminfo(text: &str) -> Result<(u64, u64, u64, u64), ProbeError> {
    const SOURCE: &str = "/proc/meminfo";
    // "MemTotal:       24684084 kB": a name, a number, and "kB" (which means KiB).
    let fields: HashMap<&str, u64> = text
        .lines()
        .filter_map(|line| {
            let (name, rest) = line.split_once(':')?;
            let mut words = rest.split_whitespace();
            let value: u64 = words.next()?.parse().ok()?;
            Some((name.trim(), if words.next() == Some("kB") { value * 1024 } else { value }))
        })
        .collect();
    let field = |name: &str| fields.get(name).copied().ok_or_else(|| read_error(SOURCE, format!("no {name} line")));
    let (total, swap_total, swap_free) = (field("MemTotal")?, field("SwapTotal")?, field("SwapFree")?);
    let available = match field("MemAvailable") {
        Ok(available) => available,
        // Kernels before 3.14: what earlyoom falls back to.
        Err(_) => {
            (field("MemFree")? + field("Cached")? + field("Buffers")?).saturating_sub(field("Shmem").unwrap_or(0))
        }
    };
    let inconsistent = |message: String| ProbeError::Inconsistent { source_name: SOURCE.into(), message };
    if total == 0 || available > total {
        return Err(inconsistent(format!("MemAvailable {available} B with MemTotal {total} B")));
    }
    if swap_free > swap_total {
        return Err(inconsistent(format!("SwapFree {swap_free} B above SwapTotal {swap_total} B")));
    }
    Ok((total, available, swap_total, swap_total - swap_free))
}

pub fn system_memory() -> Result<SystemMemory, ProbeError> {
    let text = std::fs::read_to_string("/proc/meminfo").map_err(|e| read_error("/proc/meminfo", e))?;
    let (total, available, swap_total, swap_used) = parse_meminfo(&text)?;
    // Where this process's limits can be is resolved once; each reading reads only their files.
    static GROUP_DIRS: OnceLock<Vec<cgroup::GroupDir>> = OnceLock::new();
    let dirs = GROUP_DIRS.get_or_init(|| {
        let own_groups = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
        cgroup::group_dirs(&own_groups, Path::new("/sys/fs/cgroup"))
    });
    let cgroup = cgroup::tightest(dirs, total);
    Ok(SystemMemory { total, available, swap_total, swap_used, cgroup })
}

pub fn pressure() -> Result<Option<Pressure>, ProbeError> {
    const SOURCE: &str = "/proc/pressure/memory";
    if !Path::new(SOURCE).exists() {
        return Ok(None);
    }
    let psi = procfs::MemoryPressure::current().map_err(|e| read_error(SOURCE, e))?;
    Ok(Some(Pressure { some_avg10: f64::from(psi.some.avg10), full_avg10: f64::from(psi.full.avg10) }))
}

pub fn process_memory(pid: i32) -> Result<ProcessMemory, ProbeError> {
    let source = || format!("/proc/{pid}/status");
    let status = Process::new(pid).and_then(|p| p.status()).map_err(|e| read_error(source(), e))?;
    let kib = |value: Option<u64>| value.map(|v| v * 1024);
    Ok(ProcessMemory {
        // A zombie has no VmRSS line: it holds nothing.
        rss: kib(status.vmrss).unwrap_or(0),
        rss_anon: kib(status.rssanon),
        rss_file: kib(status.rssfile),
        swap: kib(status.vmswap),
        peak: kib(status.vmhwm),
        footprint: None,
        locked: kib(status.vmlck),
        pinned: kib(status.vmpin),
    })
}

pub fn reset_peak() -> Result<(), ProbeError> {
    Process::myself().and_then(|p| p.clear_refs(ClearRefs::PeakRSS)).map_err(|e| read_error("/proc/self/clear_refs", e))
}

/// The number of CPUs in a kernel CPU list ("0-1", "0,2-5"); `None` if it is not one.
fn cpus_in_list(list: &str) -> Option<u64> {
    list.trim().split(',').try_fold(0u64, |count, range| {
        let (first, last) = range.split_once('-').unwrap_or((range, range));
        Some(count + last.parse::<u64>().ok()?.checked_sub(first.parse::<u64>().ok()?)? + 1)
    })
}

pub fn rss_counter_slack() -> u64 {
    // The kernel's batch follows the online CPUs (`percpu_counter_batch`, set at boot and at
    // each hotplug), and so does the number of shares a counter is split into.
    let online = std::fs::read_to_string("/sys/devices/system/cpu/online").ok().and_then(|list| cpus_in_list(&list));
    let cpus = online.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get() as u64));
    let batch = 32.max(2 * cpus);
    3 * cpus * batch * procfs::page_size()
}

/// The entry of one process, without its command line, and its number of threads; `None` once
/// it has gone.
fn tree_entry(process: &Process) -> Option<(ProcessEntry, i64)> {
    let stat = process.stat().ok()?;
    let entry = ProcessEntry {
        pid: stat.pid,
        ppid: stat.ppid,
        pgid: stat.pgrp,
        zombie: stat.state == 'Z',
        cmdline: String::new(),
    };
    Some((entry, stat.num_threads))
}

/// The children of `process` (`threads` of them list theirs): a single-threaded process's from
/// its main thread's file, without listing its task folder.
fn children(process: &Process, threads: i64) -> Result<Vec<u32>, procfs::ProcError> {
    if threads == 1 {
        return process.task_main_thread()?.children();
    }
    let mut all = Vec::new();
    for task in process.tasks()?.flatten() {
        all.extend(task.children()?);
    }
    Ok(all)
}

/// Every process below `root`, found through `/proc/PID/task/TID/children` (one read per thread
/// of each member) instead of a scan of the whole process table; zombies included. `Ok(None)`
/// when the kernel has no `children` files (built without `CONFIG_PROC_CHILDREN`).
pub fn subtree(root: i32) -> Result<Option<Vec<ProcessEntry>>, ProbeError> {
    let process = Process::new(root).map_err(|e| read_error(format!("/proc/{root}"), e))?;
    let threads = process.stat().map_err(|e| read_error(format!("/proc/{root}/stat"), e))?.num_threads;
    let mut found: Vec<ProcessEntry> = Vec::new();
    let mut seen = std::collections::HashSet::from([root]);
    let mut parents = vec![(process, threads)];
    while let Some((parent, threads)) = parents.pop() {
        let pids = match children(&parent, threads) {
            Ok(pids) => pids,
            Err(procfs::ProcError::NotFound(_)) if parent.pid == root => return Ok(None),
            // A member that exited while it was read: its children are the guard's now.
            Err(_) => continue,
        };
        for pid in pids.into_iter().filter_map(|child| i32::try_from(child).ok()) {
            if !seen.insert(pid) {
                continue;
            }
            let Ok(child) = Process::new(pid) else { continue };
            if let Some((entry, threads)) = tree_entry(&child) {
                found.push(entry);
                parents.push((child, threads));
            }
        }
    }
    Ok(Some(found))
}

pub fn processes(with_commands: bool) -> Result<Vec<ProcessEntry>, ProbeError> {
    let all = procfs::process::all_processes().map_err(|e| read_error("/proc", e))?;
    let mut table = Vec::new();
    for process in all.flatten() {
        // A process that exits during the scan is simply left out.
        let Ok(stat) = process.stat() else { continue };
        let cmdline = if with_commands {
            process.cmdline().map(|args| args.join(" ")).unwrap_or_default()
        } else {
            String::new()
        };
        table.push(ProcessEntry {
            pid: stat.pid,
            ppid: stat.ppid,
            pgid: stat.pgrp,
            zombie: stat.state == 'Z',
            cmdline,
        });
    }
    Ok(table)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MEMINFO: &str = "MemTotal:       24684084 kB\nMemFree:        19057420 kB\n\
        MemAvailable:   23885064 kB\nBuffers:            7600 kB\nCached:          4910696 kB\n\
        SwapCached:            0 kB\nSwapTotal:       2097148 kB\nSwapFree:        1048572 kB\n\
        Shmem:             10000 kB\n";

    #[test]
    fn meminfo_fixtures() {
        let (total, available, swap_total, swap_used) = parse_meminfo(MEMINFO).unwrap();
        assert_eq!((total, available), (24684084 * 1024, 23885064 * 1024));
        assert_eq!((swap_total, swap_used), (2097148 * 1024, 1048576 * 1024));
        // A kernel without MemAvailable: MemFree + Cached + Buffers - Shmem.
        let old = MEMINFO.replace("MemAvailable:   23885064 kB\n", "");
        let (_, available, _, _) = parse_meminfo(&old).unwrap();
        assert_eq!(available, (19057420 + 4910696 + 7600 - 10000) * 1024);
        // Available above total, free swap above total swap, missing fields, junk: errors.
        let bad = MEMINFO.replace("MemAvailable:   23885064", "MemAvailable:   93885064");
        assert!(matches!(parse_meminfo(&bad), Err(ProbeError::Inconsistent { .. })));
        let bad = MEMINFO.replace("SwapFree:        1048572", "SwapFree:        9048572");
        assert!(parse_meminfo(&bad).unwrap_err().to_string().contains("SwapFree"));
        assert!(parse_meminfo("MemTotal: 10 kB\n").unwrap_err().to_string().contains("no SwapTotal line"));
        assert!(parse_meminfo(&MEMINFO.replace("MemTotal:       24684084", "MemTotal:       junk")).is_err());
        assert!(parse_meminfo("").is_err());
    }

    #[test]
    fn cpu_lists_count_their_ranges_and_single_cpus() {
        assert_eq!(cpus_in_list("0-1\n"), Some(2));
        assert_eq!(cpus_in_list("0"), Some(1));
        assert_eq!(cpus_in_list("0,2-5,7"), Some(6));
        assert_eq!(cpus_in_list("3-1"), None);
        assert_eq!(cpus_in_list(""), None);
    }
}
