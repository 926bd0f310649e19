//! stageload-probe: memory readings of this machine and of processes, for the guard (is there
//! room, is the command growing too much) and the meter (where a run's memory went). Torch-free.
//!
//! Linux reads `/proc` (its own parsers for what is read every poll, the `procfs` crate for the
//! rest) and cgroupfs ([`cgroup`]); a [`Probe`] keeps the files of the readings a watcher repeats
//! open between them. macOS uses
//! `sysinfo`, plus `sysctl`, `proc_pid_rusage` and `getpgid` for what it lacks. A reading the platform lacks is `None`, never a panic; a
//! reading that fails is an error naming the file or call, and callers decide what to do (the
//! guard treats it as "unknown", the meter records it once).

#![warn(missing_docs)]

pub mod cgroup;

#[cfg(target_os = "linux")]
mod kept;
#[cfg(target_os = "linux")]
mod linux;
#[cfg(target_os = "linux")]
use linux as platform;
#[cfg(target_os = "macos")]
mod macos;
#[cfg(target_os = "macos")]
use macos as platform;

use serde::{Deserialize, Serialize};
use thiserror::Error;

pub use cgroup::CgroupMemory;

/// A reading that could not be taken.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ProbeError {
    /// A source (a `/proc` file, a system call) could not be read.
    #[error("cannot read {source_name}: {message}")]
    Read {
        /// The source, e.g. `/proc/meminfo`.
        source_name: String,
        /// The system's reason.
        message: String,
    },
    /// A source was read but its values do not add up.
    #[error("{source_name} is inconsistent: {message}")]
    Inconsistent {
        /// The source.
        source_name: String,
        /// What does not add up.
        message: String,
    },
    /// The reading named does not exist on this platform.
    #[error("{0} is not available on this platform")]
    Unsupported(&'static str),
}

/// The machine's memory and swap. Bytes throughout.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SystemMemory {
    /// Physical memory. Linux: `MemTotal` of `/proc/meminfo`; macOS: `hw.memsize`.
    pub total: u64,
    /// What new allocations can get without swapping. Linux: `MemAvailable` (or
    /// MemFree + Cached + Buffers − Shmem on kernels without it); macOS:
    /// `kern.memorystatus_level` percent of `total`.
    pub available: u64,
    /// Linux: `SwapTotal`; macOS: `vm.swapusage` total.
    pub swap_total: u64,
    /// Linux: `SwapTotal − SwapFree`; macOS: `vm.swapusage` used. System-wide, not this process's.
    pub swap_used: u64,
    /// The tightest memory-limited cgroup this process runs in, when its limit is below `total`.
    pub cgroup: Option<CgroupMemory>,
}

impl SystemMemory {
    /// The memory this process's world has: the cgroup limit inside a limited group, else `total`.
    pub fn budget_total(&self) -> u64 {
        self.cgroup.as_ref().map_or(self.total, |group| group.limit)
    }

    /// `available`, bounded by the cgroup's headroom inside a limited group.
    pub fn budget_available(&self) -> u64 {
        let group = self.cgroup.as_ref().map_or(u64::MAX, CgroupMemory::headroom);
        self.available.min(group)
    }

    /// [`budget_available`](Self::budget_available) as a percentage of
    /// [`budget_total`](Self::budget_total).
    pub fn available_percent(&self) -> f64 {
        100.0 * self.budget_available() as f64 / self.budget_total().max(1) as f64
    }
}

/// Pressure stall information for memory (Linux ≥ 4.20 with PSI enabled): the share of the
/// last 10 s, in percent, in which some / all non-idle tasks waited for memory.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Pressure {
    /// Percent of the last 10 s in which some task waited.
    pub some_avg10: f64,
    /// Percent of the last 10 s in which all non-idle tasks waited.
    pub full_avg10: f64,
}

/// One process's memory. Bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessMemory {
    /// Resident set. Linux: `VmRSS` of `/proc/PID/status`; macOS: `ri_resident_size`.
    pub rss: u64,
    /// Resident anonymous memory (`RssAnon`), the process's own heap; Linux only.
    pub rss_anon: Option<u64>,
    /// Resident file pages (`RssFile`): shared libraries' code and data, mapped files; Linux only.
    pub rss_file: Option<u64>,
    /// Swapped-out private memory (`VmSwap`); Linux only.
    pub swap: Option<u64>,
    /// High-water mark of the resident set (`VmHWM`), resettable with [`reset_peak`]; macOS:
    /// `ri_lifetime_max_phys_footprint`.
    pub peak: Option<u64>,
    /// macOS physical footprint (`ri_phys_footprint`), what Activity Monitor shows; None on Linux.
    pub footprint: Option<u64>,
    /// Locked memory (`VmLck`: mlock'd pages); Linux only.
    pub locked: Option<u64>,
    /// Pinned memory (`VmPin`: pages pinned by drivers that account for them); Linux only.
    pub pinned: Option<u64>,
}

impl ProcessMemory {
    /// What the process holds that the kernel cannot take back from it: its resident set less
    /// its file pages (clean copies of shared libraries and mapped files, which the kernel drops
    /// under pressure and a cgroup limit reclaims before it kills), plus its swap. The RSS where
    /// file pages are not counted apart (macOS).
    pub fn held(&self) -> u64 {
        self.rss.saturating_sub(self.rss_file.unwrap_or(0)).saturating_add(self.swap.unwrap_or(0))
    }
}

/// One line of the process table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessEntry {
    /// Process id.
    pub pid: i32,
    /// Parent process id.
    pub ppid: i32,
    /// Process group id.
    pub pgid: i32,
    /// Exited but not reaped yet: holds no memory and is not running.
    pub zombie: bool,
    /// The command line, arguments joined by spaces; empty for kernel threads and zombies, and
    /// where [`process_tree`] did not read it.
    pub cmdline: String,
}

/// The machine's memory now.
pub fn system_memory() -> Result<SystemMemory, ProbeError> {
    platform::system_memory()
}

/// Memory pressure now; `Ok(None)` where the kernel or platform has no such reading.
pub fn pressure() -> Result<Option<Pressure>, ProbeError> {
    platform::pressure()
}

/// A process's memory now.
pub fn process_memory(pid: i32) -> Result<ProcessMemory, ProbeError> {
    platform::process_memory(pid)
}

/// Resets this process's high-water mark (`VmHWM`) to its current RSS, so the next
/// [`ProcessMemory::peak`] is the peak since now (Linux: `/proc/self/clear_refs` ← 5).
pub fn reset_peak() -> Result<(), ProbeError> {
    platform::reset_peak()
}

/// How far a reading of a process's RSS ([`ProcessMemory::rss`]) or of its high-water mark
/// ([`ProcessMemory::peak`]) may be from the pages the process holds, in bytes: what a test or a
/// check of a measured figure allows for the readings themselves.
///
/// Linux (6.2 and later) counts a process's resident pages in three per-CPU counters
/// (anonymous, file and shared memory pages), and each online CPU may hold up to
/// `percpu_counter_batch` = max(32, 2 × CPUs) pages of each that it has not folded into the
/// counter's total yet. The high-water mark is taken from the folded totals (when memory is
/// unmapped, and by [`reset_peak`]), and so was `VmRSS` before Linux 6.16, which sums the CPUs'
/// shares exactly: either can be off by up to 3 × CPUs × batch pages (768 KiB on 2 CPUs with
/// 4 KiB pages). 0 elsewhere: macOS reads the task's own totals.
pub fn rss_counter_slack() -> u64 {
    platform::rss_counter_slack()
}

/// Every process this user can see, with its command line. Processes that vanish during the
/// scan are left out.
pub fn processes() -> Result<Vec<ProcessEntry>, ProbeError> {
    platform::processes(true)
}

/// As [`processes`], without reading command lines (Linux: one file per process instead of
/// two), for callers that only follow the tree: pids, parents, groups, zombies. `cmdline` may be
/// empty.
pub fn process_tree() -> Result<Vec<ProcessEntry>, ProbeError> {
    platform::processes(false)
}

/// Every process below `root` (not `root` itself). Linux walks the tree down from `root` through the
/// kernel's `children` lists, reading only those processes (a scan of the whole table costs
/// about four times as much CPU on a busy machine); elsewhere, or on a kernel without them,
/// the whole table is read and walked.
pub fn process_subtree(root: i32) -> Result<Vec<ProcessEntry>, ProbeError> {
    #[cfg(target_os = "linux")]
    if let Some(found) = linux::subtree(root)? {
        return Ok(found);
    }
    let table = process_tree()?;
    let below = descendants(&table, root);
    Ok(table.into_iter().filter(|e| below.contains(&e.pid)).collect())
}

/// The readings a watcher takes every poll (the machine's memory, a process tree, its members'
/// memory), with the same results as [`system_memory`], [`process_subtree`] and
/// [`process_memory`], at less cost: Linux keeps their files open between readings and reads
/// them again from their start (`/proc/meminfo`, the cgroup files, each member's `stat`,
/// `status` and `children`), reads a cgroup's limit about once a second
/// ([`cgroup::LIMIT_REFRESH`]) and tries a missing file again only then, and lets a member's
/// files go once it is reaped or leaves the tree. Elsewhere the free functions.
#[derive(Debug, Default)]
pub struct Probe {
    #[cfg(target_os = "linux")]
    system: linux::System,
    #[cfg(target_os = "linux")]
    tree: linux::Tree,
}

impl Probe {
    /// A probe with nothing open yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// As [`system_memory`] (a cgroup's limit as read at most [`cgroup::LIMIT_REFRESH`] ago).
    pub fn system_memory(&mut self) -> Result<SystemMemory, ProbeError> {
        #[cfg(target_os = "linux")]
        return self.system.read();
        #[cfg(not(target_os = "linux"))]
        system_memory()
    }

    /// As [`process_subtree`].
    pub fn subtree(&mut self, root: i32) -> Result<Vec<ProcessEntry>, ProbeError> {
        #[cfg(target_os = "linux")]
        if let Some(found) = self.tree.subtree(root)? {
            return Ok(found);
        }
        process_subtree(root)
    }

    /// As [`process_memory`].
    pub fn process_memory(&mut self, pid: i32) -> Result<ProcessMemory, ProbeError> {
        #[cfg(target_os = "linux")]
        return self.tree.process_memory(pid);
        #[cfg(not(target_os = "linux"))]
        process_memory(pid)
    }
}

/// `pid` and its chain of parents, stopping before pid 1, at an unknown parent or at a cycle.
pub fn ancestors(table: &[ProcessEntry], pid: i32) -> Vec<i32> {
    let mut chain = vec![pid];
    let mut current = pid;
    while let Some(entry) = table.iter().find(|e| e.pid == current) {
        if entry.ppid <= 1 || chain.contains(&entry.ppid) {
            break;
        }
        chain.push(entry.ppid);
        current = entry.ppid;
    }
    chain
}

/// Every process below `root` in the process tree (not `root` itself).
pub fn descendants(table: &[ProcessEntry], root: i32) -> Vec<i32> {
    let mut found = Vec::new();
    let mut frontier = vec![root];
    while let Some(parent) = frontier.pop() {
        for entry in table.iter().filter(|e| e.ppid == parent && e.pid != root) {
            if !found.contains(&entry.pid) {
                found.push(entry.pid);
                frontier.push(entry.pid);
            }
        }
    }
    found
}

#[cfg(not(any(target_os = "linux", target_os = "macos")))]
mod platform {
    //! Other platforms: every reading says it is not available.
    use super::*;
    pub fn system_memory() -> Result<SystemMemory, ProbeError> {
        Err(ProbeError::Unsupported("system memory"))
    }
    pub fn pressure() -> Result<Option<Pressure>, ProbeError> {
        Ok(None)
    }
    pub fn process_memory(_: i32) -> Result<ProcessMemory, ProbeError> {
        Err(ProbeError::Unsupported("process memory"))
    }
    pub fn reset_peak() -> Result<(), ProbeError> {
        Err(ProbeError::Unsupported("peak reset"))
    }
    pub fn processes(_with_commands: bool) -> Result<Vec<ProcessEntry>, ProbeError> {
        Err(ProbeError::Unsupported("process table"))
    }
    pub fn rss_counter_slack() -> u64 {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(pid: i32, ppid: i32) -> ProcessEntry {
        ProcessEntry { pid, ppid, pgid: pid, zombie: false, cmdline: format!("p{pid}") }
    }

    #[test]
    fn what_a_process_holds_is_its_resident_memory_less_file_pages_plus_swap() {
        let memory = |rss_file: Option<u64>, swap: Option<u64>| ProcessMemory {
            rss: 500,
            rss_anon: Some(300),
            rss_file,
            swap,
            peak: None,
            footprint: None,
            locked: None,
            pinned: None,
        };
        assert_eq!(memory(Some(200), Some(40)).held(), 340);
        // Where file pages are not counted apart (macOS), the resident set.
        assert_eq!(memory(None, None).held(), 500);
        assert_eq!(memory(Some(u64::MAX), Some(u64::MAX)).held(), u64::MAX);
    }

    #[test]
    fn ancestors_stop_at_init_unknown_parents_and_cycles() {
        let table = [entry(10, 1), entry(20, 10), entry(30, 20), entry(40, 41), entry(41, 40)];
        assert_eq!(ancestors(&table, 30), vec![30, 20, 10]);
        assert_eq!(ancestors(&table, 99), vec![99]);
        assert_eq!(ancestors(&table, 40), vec![40, 41]);
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn the_subtree_walk_finds_a_real_grandchild_and_matches_the_table_scan() {
        let mut child = std::process::Command::new("sh").args(["-c", "sleep 30 & wait"]).spawn().unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let walked = loop {
            let walked = process_subtree(child.id() as i32).unwrap();
            if walked.len() == 1 || std::time::Instant::now() > deadline {
                break walked;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        };
        let table = process_tree().unwrap();
        let mut scanned = descendants(&table, child.id() as i32);
        let mut pids: Vec<i32> = walked.iter().map(|e| e.pid).collect();
        pids.sort();
        scanned.sort();
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(pids, scanned);
        assert_eq!(pids.len(), 1, "the shell's sleep");
    }

    #[test]
    fn descendants_walk_the_whole_subtree() {
        let table = [entry(10, 1), entry(20, 10), entry(30, 20), entry(31, 20), entry(50, 1)];
        let mut below = descendants(&table, 10);
        below.sort();
        assert_eq!(below, vec![20, 30, 31]);
        assert!(descendants(&table, 50).is_empty());
    }

    #[test]
    fn budget_follows_the_cgroup_when_limited() {
        let mut memory = SystemMemory { total: 100, available: 60, swap_total: 0, swap_used: 0, cgroup: None };
        assert_eq!((memory.budget_total(), memory.budget_available()), (100, 60));
        assert!((memory.available_percent() - 60.0).abs() < 1e-9);
        memory.cgroup = Some(CgroupMemory { path: "/x".into(), limit: 40, usage: 30, reclaimable: 5 });
        assert_eq!((memory.budget_total(), memory.budget_available()), (40, 15));
    }
}
