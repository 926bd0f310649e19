//! Linux readings: `/proc/meminfo`, `/proc/PID/{stat,status}`, the `children` files of
//! `/proc/PID/task/TID/` and the cgroup files ([`crate::cgroup`]) read and parsed here;
//! `/proc/pressure/memory`, `/proc/PID/cmdline`, the process table and `/proc/self/clear_refs`
//! through the `procfs` crate. procfs's `Meminfo` demands some twenty fields that vary between
//! kernels and reports a missing one as an internal bug, and its `Status` parse builds a map of
//! every line; the guard needs a few fields of each, every poll, and a clear error.
//!
//! [`System`] and [`Tree`] take the readings a watcher repeats every poll with their files kept
//! open ([`crate::kept`]); the free functions open, read and close.

use std::collections::btree_map::{BTreeMap, Entry};
use std::io;
use std::path::Path;
use std::sync::OnceLock;
use std::time::Instant;

use procfs::process::{ClearRefs, Process};
use procfs::Current;

use crate::kept::{is_gone, parse_u64, Kept};
use crate::{cgroup, Pressure, ProbeError, ProcessEntry, ProcessMemory, SystemMemory};

fn read_error(source_name: impl Into<String>, error: impl std::fmt::Display) -> ProbeError {
    ProbeError::Read { source_name: source_name.into(), message: error.to_string() }
}

/// Turns `/proc/meminfo` text into readings, checking that they are consistent (a sample that is
/// not, for example MemAvailable above MemTotal, is an error rather than a wrong number).
pub(crate) fn parse_meminfo(text: &str) -> Result<(u64, u64, u64, u64), ProbeError> {
    const SOURCE: &str = "/proc/meminfo";
    // "MemTotal:       24684084 kB": a name, a number, and "kB" (which means KiB).
    const NAMES: [&str; 8] =
        ["MemTotal", "SwapTotal", "SwapFree", "MemAvailable", "MemFree", "Cached", "Buffers", "Shmem"];
    let mut values = [None; NAMES.len()];
    for line in text.lines() {
        let Some((name, rest)) = line.split_once(':') else { continue };
        let Some(slot) = NAMES.iter().position(|known| *known == name.trim()) else { continue };
        let mut words = rest.split_whitespace();
        let Some(value) = words.next().and_then(|word| word.parse::<u64>().ok()) else { continue };
        values[slot] = Some(if words.next() == Some("kB") { value.saturating_mul(1024) } else { value });
    }
    let field = |name: &str| {
        let slot = NAMES.iter().position(|known| *known == name);
        slot.and_then(|slot| values[slot]).ok_or_else(|| read_error(SOURCE, format!("no {name} line")))
    };
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

/// Where this process's memory limits can be: resolved once, each reading reads only their files.
fn own_group_dirs() -> &'static [cgroup::GroupDir] {
    static GROUP_DIRS: OnceLock<Vec<cgroup::GroupDir>> = OnceLock::new();
    GROUP_DIRS.get_or_init(|| {
        let own_groups = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
        cgroup::group_dirs(&own_groups, Path::new("/sys/fs/cgroup"))
    })
}

pub fn system_memory() -> Result<SystemMemory, ProbeError> {
    let text = std::fs::read_to_string("/proc/meminfo").map_err(|e| read_error("/proc/meminfo", e))?;
    let (total, available, swap_total, swap_used) = parse_meminfo(&text)?;
    let cgroup = cgroup::tightest(own_group_dirs(), total);
    Ok(SystemMemory { total, available, swap_total, swap_used, cgroup })
}

/// The machine's memory read with its files kept open: `/proc/meminfo` read again from its start
/// each time, the cgroup files as [`cgroup::KeptGroups`] reads them (limits about once a second).
#[derive(Debug, Default)]
pub struct System {
    meminfo: Option<Kept>,
    groups: Option<cgroup::KeptGroups>,
    buffer: Vec<u8>,
}

impl System {
    pub fn read(&mut self) -> Result<SystemMemory, ProbeError> {
        const SOURCE: &str = "/proc/meminfo";
        let meminfo = match self.meminfo.take() {
            Some(kept) => kept,
            None => Kept::open(Path::new(SOURCE)).map_err(|e| read_error(SOURCE, e))?,
        };
        let text = meminfo.read(&mut self.buffer).map_err(|e| read_error(SOURCE, e))?;
        // Kept only once it reads: a file that failed is opened again next time.
        let text = std::str::from_utf8(text).map_err(|e| read_error(SOURCE, e))?;
        let (total, available, swap_total, swap_used) = parse_meminfo(text)?;
        self.meminfo = Some(meminfo);
        let groups = self.groups.get_or_insert_with(|| cgroup::KeptGroups::new(own_group_dirs().to_vec()));
        let cgroup = groups.tightest(Instant::now(), total);
        Ok(SystemMemory { total, available, swap_total, swap_used, cgroup })
    }
}

pub fn pressure() -> Result<Option<Pressure>, ProbeError> {
    const SOURCE: &str = "/proc/pressure/memory";
    if !Path::new(SOURCE).exists() {
        return Ok(None);
    }
    let psi = procfs::MemoryPressure::current().map_err(|e| read_error(SOURCE, e))?;
    Ok(Some(Pressure { some_avg10: f64::from(psi.some.avg10), full_avg10: f64::from(psi.full.avg10) }))
}

/// The memory fields of `/proc/PID/status` text; an error names a field whose line does not
/// read as a number of kB. Only the lines named are looked at.
pub(crate) fn parse_status(text: &[u8]) -> Result<ProcessMemory, String> {
    const NAMES: [&[u8]; 7] = [b"VmRSS", b"RssAnon", b"RssFile", b"VmSwap", b"VmHWM", b"VmLck", b"VmPin"];
    let mut values = [None; NAMES.len()];
    for line in text.split(|&b| b == b'\n') {
        if !(line.starts_with(b"Vm") || line.starts_with(b"Rss")) {
            continue;
        }
        let Some(colon) = line.iter().position(|&b| b == b':') else { continue };
        let Some(slot) = NAMES.iter().position(|name| *name == &line[..colon]) else { continue };
        // "VmRSS:\t    1234 kB"
        let value = line[colon + 1..].trim_ascii().strip_suffix(b"kB").map(<[u8]>::trim_ascii).and_then(parse_u64);
        let bad = || format!("bad {} line", String::from_utf8_lossy(NAMES[slot]));
        values[slot] = Some(value.and_then(|kib| kib.checked_mul(1024)).ok_or_else(bad)?);
    }
    let [rss, rss_anon, rss_file, swap, peak, locked, pinned] = values;
    Ok(ProcessMemory {
        // A zombie has no VmRSS line: it holds nothing.
        rss: rss.unwrap_or(0),
        rss_anon,
        rss_file,
        swap,
        peak,
        footprint: None,
        locked,
        pinned,
    })
}

pub fn process_memory(pid: i32) -> Result<ProcessMemory, ProbeError> {
    let source = format!("/proc/{pid}/status");
    let text = std::fs::read(&source).map_err(|e| read_error(&*source, e))?;
    parse_status(&text).map_err(|e| read_error(source, e))
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

/// The fields of a `/proc/PID/stat` line the readings use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Stat {
    pub pid: i32,
    pub ppid: i32,
    pub pgrp: i32,
    /// `R`, `S`, `Z`, ...
    pub state: u8,
    pub threads: u64,
    /// Field 22: when the process started, in clock ticks after boot. A pid and its start time
    /// name one process: a later one with the same pid started later.
    pub start_time: u64,
}

/// `/proc/PID/stat` text read: `pid (comm) state ppid pgrp ...`, where comm may hold spaces
/// and parentheses (so the fields start after the last `)`). `None` if it does not read so.
pub(crate) fn parse_stat(text: &[u8]) -> Option<Stat> {
    let number = |field: &[u8]| parse_u64(field).and_then(|n| i32::try_from(n).ok());
    let open = text.iter().position(|&b| b == b'(')?;
    let close = text.iter().rposition(|&b| b == b')')?;
    let pid = number(text[..open].trim_ascii())?;
    let mut fields = text.get(close + 1..)?.split(|&b| b == b' ').filter(|field| !field.is_empty());
    let state = *fields.next()?.first()?;
    let (ppid, pgrp) = (number(fields.next()?)?, number(fields.next()?)?);
    // Fields 6 to 19 (session ... nice), then num_threads (20), itrealvalue (21), starttime (22).
    let mut rest = fields.skip(14);
    let threads = parse_u64(rest.next()?)?;
    let start_time = parse_u64(rest.nth(1)?.trim_ascii())?;
    Some(Stat { pid, ppid, pgrp, state, threads, start_time })
}

/// The pids listed in a `children` file ("1234 1240 ").
fn parse_children(text: &[u8], into: &mut Vec<i32>) {
    let pids = text.split(|b| b.is_ascii_whitespace()).filter_map(|word| i32::try_from(parse_u64(word)?).ok());
    into.extend(pids);
}

/// Why a member's files could not be read.
#[derive(Debug)]
enum MemberError {
    /// The process is gone (reaped), or its pid now names another process.
    Gone,
    /// The kernel has no `children` files (built without `CONFIG_PROC_CHILDREN`).
    NoChildrenFiles,
    /// Another failure: the file and the system's reason, or what did not parse.
    Failed(String, String),
}

impl MemberError {
    fn of(path: impl Into<String>, error: io::Error) -> Self {
        if is_gone(&error) {
            MemberError::Gone
        } else {
            MemberError::Failed(path.into(), error.to_string())
        }
    }

    fn into_probe_error(self, pid: i32, file: &str) -> ProbeError {
        match self {
            MemberError::Gone => read_error(format!("/proc/{pid}/{file}"), "the process is gone"),
            MemberError::NoChildrenFiles => read_error(format!("/proc/{pid}/task"), "no children files"),
            MemberError::Failed(path, message) => read_error(path, message),
        }
    }
}

/// One process's files, kept open: its `stat` (opened first, it names the process: every file
/// opened later by path is checked against it), its `status` once asked for, and its threads'
/// `children` files.
#[derive(Debug)]
struct Member {
    stat_file: Kept,
    stat: Stat,
    status_file: Option<Kept>,
    /// Thread id and its `children` file: the main thread's alone for a single-threaded process.
    children_files: Vec<(i32, Kept)>,
    /// The walk of the tree that last found it.
    walk: u64,
}

impl Member {
    /// Opens `pid`'s `stat` and reads it: the process that holds the pid now.
    fn open(pid: i32, buffer: &mut Vec<u8>) -> Result<Member, MemberError> {
        let path = format!("/proc/{pid}/stat");
        let stat_file = Kept::open(Path::new(&path)).map_err(|e| MemberError::of(&*path, e))?;
        let text = stat_file.read(buffer).map_err(|e| MemberError::of(&*path, e))?;
        let stat = parse_stat(text).ok_or_else(|| MemberError::Failed(path, "no stat line".into()))?;
        Ok(Member { stat_file, stat, status_file: None, children_files: Vec::new(), walk: 0 })
    }

    /// Reads the kept `stat` again: `Gone` once the process has been reaped.
    fn refresh(&mut self, buffer: &mut Vec<u8>) -> Result<(), MemberError> {
        let path = || format!("/proc/{}/stat", self.stat.pid);
        let text = self.stat_file.read(buffer).map_err(|e| MemberError::of(path(), e))?;
        let stat = parse_stat(text).ok_or_else(|| MemberError::Failed(path(), "no stat line".into()))?;
        // The same process, or the file would have failed.
        if stat.pid != self.stat.pid || stat.start_time != self.stat.start_time {
            return Err(MemberError::Gone);
        }
        self.stat = stat;
        Ok(())
    }

    /// Opens another file of the process by its path, and makes sure it is this process's: the
    /// pid cannot have passed to another process before the open if the kept `stat` still reads
    /// afterwards, with the same start time.
    fn open_own(&mut self, path: &str, buffer: &mut Vec<u8>) -> Result<Kept, MemberError> {
        let kept = Kept::open(Path::new(path)).map_err(|e| MemberError::of(path, e))?;
        self.refresh(buffer)?;
        Ok(kept)
    }

    fn entry(&self) -> ProcessEntry {
        let Stat { pid, ppid, pgrp, state, .. } = self.stat;
        ProcessEntry { pid, ppid, pgid: pgrp, zombie: state == b'Z', cmdline: String::new() }
    }

    /// The pids of the process's children, added to `into`: from the main thread's `children`
    /// file for a single-threaded process, else from each thread's (the threads listed afresh).
    fn children(&mut self, buffer: &mut Vec<u8>, into: &mut Vec<i32>) -> Result<(), MemberError> {
        let pid = self.stat.pid;
        if self.stat.threads == 1 {
            self.children_files.retain(|(tid, _)| *tid == pid);
            if self.children_files.is_empty() {
                let kept = self.open_children(pid, buffer)?;
                self.children_files.push((pid, kept));
            }
        } else {
            let task = format!("/proc/{pid}/task");
            let threads = std::fs::read_dir(&task).map_err(|e| MemberError::of(&*task, e))?;
            let tids: Vec<i32> =
                threads.flatten().filter_map(|thread| thread.file_name().to_str()?.parse().ok()).collect();
            self.children_files.retain(|(tid, _)| tids.contains(tid));
            for tid in tids {
                if !self.children_files.iter().any(|(kept, _)| *kept == tid) {
                    match self.open_children(tid, buffer) {
                        Ok(kept) => self.children_files.push((tid, kept)),
                        // A thread that ended since the listing.
                        Err(MemberError::Failed(..)) => {}
                        Err(error) => return Err(error),
                    }
                }
            }
        }
        for (tid, kept) in &self.children_files {
            let path = || format!("/proc/{pid}/task/{tid}/children");
            // The file of a thread that has ended reads empty.
            parse_children(kept.read(buffer).map_err(|e| MemberError::of(path(), e))?, into);
        }
        Ok(())
    }

    /// Opens thread `tid`'s `children` file. A file that is not there while the process still
    /// is means the kernel has none.
    fn open_children(&mut self, tid: i32, buffer: &mut Vec<u8>) -> Result<Kept, MemberError> {
        let path = format!("/proc/{}/task/{tid}/children", self.stat.pid);
        match self.open_own(&path, buffer) {
            Err(MemberError::Gone) if tid == self.stat.pid => match self.refresh(buffer) {
                Ok(()) => Err(MemberError::NoChildrenFiles),
                Err(error) => Err(error),
            },
            Err(MemberError::Gone) => Err(MemberError::Failed(path, "the thread has ended".into())),
            other => other,
        }
    }

    /// The process's memory, from its kept `status`.
    fn memory(&mut self, buffer: &mut Vec<u8>) -> Result<ProcessMemory, MemberError> {
        let path = format!("/proc/{}/status", self.stat.pid);
        let status_file = match self.status_file.take() {
            Some(kept) => kept,
            None => self.open_own(&path, buffer)?,
        };
        let text = status_file.read(buffer).map_err(|e| MemberError::of(&*path, e))?;
        let memory = parse_status(text).map_err(|message| MemberError::Failed(path, message))?;
        self.status_file = Some(status_file);
        Ok(memory)
    }
}

/// A process tree and its members' memory, read with each member's files kept open between
/// readings ([`Member`]): a member found again costs a read of its `stat` and of its `children`,
/// and its `status` when its memory is asked. A member that is gone, or no longer in the tree, is
/// let go at the next walk.
#[derive(Debug, Default)]
pub struct Tree {
    members: BTreeMap<i32, Member>,
    /// Walks so far: a member's `walk` says whether this one found it.
    walks: u64,
    buffer: Vec<u8>,
    /// The children of the member being walked, and the members still to walk (kept for their
    /// capacity).
    children: Vec<i32>,
    pending: Vec<i32>,
    /// The kernel has no `children` files.
    no_children_files: bool,
}

impl Tree {
    /// Every process below `root` (zombies included), found through the kernel's `children`
    /// files; `Ok(None)` when the kernel has none (built without `CONFIG_PROC_CHILDREN`).
    pub fn subtree(&mut self, root: i32) -> Result<Option<Vec<ProcessEntry>>, ProbeError> {
        if self.no_children_files {
            return Ok(None);
        }
        self.walks += 1;
        let walk = self.walks;
        let Tree { members, buffer, children, pending, .. } = self;
        if members.get_mut(&root).is_some_and(|kept| kept.refresh(buffer).is_err()) {
            // Gone: whatever holds its pid now is opened afresh.
            members.remove(&root);
        }
        let root_member = match members.entry(root) {
            Entry::Occupied(kept) => kept.into_mut(),
            Entry::Vacant(slot) => {
                slot.insert(Member::open(root, buffer).map_err(|e| e.into_probe_error(root, "stat"))?)
            }
        };
        root_member.walk = walk;
        let mut found = Vec::new();
        pending.clear();
        pending.push(root);
        while let Some(parent) = pending.pop() {
            children.clear();
            let Some(member) = members.get_mut(&parent) else { continue };
            match member.children(buffer, children) {
                Ok(()) => {}
                Err(MemberError::NoChildrenFiles) if parent == root => {
                    self.no_children_files = true;
                    return Ok(None);
                }
                // A member that exited while it was read: its children are the guard's now.
                Err(_) => continue,
            }
            for &pid in children.iter() {
                let member = match members.entry(pid) {
                    Entry::Occupied(kept) if kept.get().walk == walk => continue,
                    Entry::Occupied(mut kept) => {
                        if kept.get_mut().refresh(buffer).is_err() {
                            // Reaped since the last walk; the pid listed now is another process.
                            match Member::open(pid, buffer) {
                                Ok(member) => *kept.get_mut() = member,
                                Err(_) => {
                                    kept.remove();
                                    continue;
                                }
                            }
                        }
                        kept.into_mut()
                    }
                    Entry::Vacant(slot) => match Member::open(pid, buffer) {
                        Ok(member) => slot.insert(member),
                        // Gone between its parent's listing and now.
                        Err(_) => continue,
                    },
                };
                member.walk = walk;
                found.push(member.entry());
                pending.push(pid);
            }
        }
        members.retain(|_, member| member.walk == walk);
        Ok(Some(found))
    }

    /// The memory of process `pid`, from its kept `status` (opened the first time it is asked
    /// for; a member of the last walk has its `stat` open already).
    pub fn process_memory(&mut self, pid: i32) -> Result<ProcessMemory, ProbeError> {
        let Tree { members, buffer, .. } = self;
        let member = match members.entry(pid) {
            Entry::Occupied(kept) => kept.into_mut(),
            Entry::Vacant(slot) => {
                slot.insert(Member::open(pid, buffer).map_err(|e| e.into_probe_error(pid, "status"))?)
            }
        };
        match member.memory(buffer) {
            Ok(memory) => Ok(memory),
            Err(error) => {
                if matches!(error, MemberError::Gone) {
                    members.remove(&pid);
                }
                Err(error.into_probe_error(pid, "status"))
            }
        }
    }

    /// The pids whose files are kept open.
    #[cfg(test)]
    fn kept(&self) -> Vec<i32> {
        self.members.keys().copied().collect()
    }
}

/// Every process below `root`, found through `/proc/PID/task/TID/children` (one read per thread
/// of each member) instead of a scan of the whole process table; zombies included. `Ok(None)`
/// when the kernel has no `children` files (built without `CONFIG_PROC_CHILDREN`).
pub fn subtree(root: i32) -> Result<Option<Vec<ProcessEntry>>, ProbeError> {
    Tree::default().subtree(root)
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

    const STATUS: &[u8] = b"Name:\tpython3\nUmask:\t0022\nState:\tS (sleeping)\nVmPeak:\t  900000 kB\n\
        VmHWM:\t  500000 kB\nVmRSS:\t  400000 kB\nRssAnon:\t  300000 kB\nRssFile:\t   99000 kB\n\
        RssShmem:\t    1000 kB\nVmLck:\t       0 kB\nVmPin:\t       4 kB\nVmSwap:\t    2048 kB\nThreads:\t3\n";

    #[test]
    fn status_fixtures_read_only_the_memory_lines() {
        let memory = parse_status(STATUS).unwrap();
        assert_eq!(
            (memory.rss, memory.rss_anon, memory.rss_file),
            (400000 << 10, Some(300000 << 10), Some(99000 << 10))
        );
        assert_eq!((memory.swap, memory.peak), (Some(2048 << 10), Some(500000 << 10)));
        assert_eq!((memory.locked, memory.pinned, memory.footprint), (Some(0), Some(4 << 10), None));
        // A zombie has no memory lines: it holds nothing.
        let zombie = parse_status(b"Name:\tsh\nState:\tZ (zombie)\nThreads:\t1\n").unwrap();
        assert_eq!((zombie.rss, zombie.rss_anon, zombie.swap), (0, None, None));
        // A memory line that does not read is an error naming it; a name with odd bytes is not.
        let bad = [STATUS, b"VmSwap:\t  lots kB\n"].concat();
        assert_eq!(parse_status(&bad).unwrap_err(), "bad VmSwap line");
        assert!(parse_status(b"VmRSS:\t18446744073709551615 kB\n").is_err(), "overflows in bytes");
        assert!(parse_status(b"Name:\t\xff\xfe:VmRSS\nVmRSS:\t 1 kB\n").is_ok());
    }

    #[test]
    fn stat_fixtures_read_after_the_last_parenthesis() {
        let line = b"4242 (a (b) c) S 1 4242 4242 0 -1 4194560 100 0 0 0 5 3 0 0 20 0 7 0 123456 1000 10 \
            18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0\n";
        let stat = parse_stat(line).unwrap();
        assert_eq!(stat, Stat { pid: 4242, ppid: 1, pgrp: 4242, state: b'S', threads: 7, start_time: 123456 });
        assert_eq!(parse_stat(b"4242 (sh) Z 1 4242 4242"), None, "cut short");
        assert_eq!(parse_stat(b"garbage"), None);
        assert_eq!(parse_stat(b""), None);
    }

    #[test]
    fn children_files_list_pids() {
        let mut pids = vec![1];
        parse_children(b"10 20 junk 30 ", &mut pids);
        assert_eq!(pids, vec![1, 10, 20, 30]);
    }

    /// A shell whose one child is `sleep 30`, and the sleep's pid once the tree shows it. The
    /// caller waits for the shell.
    #[allow(clippy::zombie_processes)]
    fn shell_and_sleep(tree: &mut Tree) -> (std::process::Child, i32) {
        let shell = std::process::Command::new("sh").args(["-c", "sleep 30 & wait"]).spawn().unwrap();
        let root = shell.id() as i32;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let found = tree.subtree(root).unwrap().unwrap();
            if let [sleep] = found.as_slice() {
                assert_eq!((sleep.ppid, sleep.zombie), (root, false));
                return (shell, sleep.pid);
            }
            assert!(std::time::Instant::now() < deadline, "no sleep below the shell: {found:?}");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }

    #[test]
    fn a_kept_tree_reads_its_members_again_and_drops_one_that_is_gone() {
        let mut tree = Tree::default();
        let (mut shell, sleep) = shell_and_sleep(&mut tree);
        let root = shell.id() as i32;
        let mut both = vec![root, sleep];
        both.sort();
        assert_eq!(tree.kept(), both);
        let memory = tree.process_memory(sleep).unwrap();
        assert!(memory.rss > 0 && memory.rss_file.is_some(), "{memory:?}");
        // Found again: the same kept files, read again.
        assert_eq!(tree.subtree(root).unwrap().unwrap().len(), 1);
        assert!(tree.process_memory(sleep).unwrap().rss_anon.is_some());
        assert_eq!(tree.kept(), both);
        // The sleep ends and the shell reaps it (and exits): the next walk lets it go.
        assert!(std::process::Command::new("kill").arg(sleep.to_string()).status().unwrap().success());
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !tree.subtree(root).unwrap().unwrap().is_empty() {
            assert!(std::time::Instant::now() < deadline, "the sleep is still there");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert_eq!(tree.kept(), vec![root]);
        shell.wait().unwrap();
        // The root itself reaped: an error, and nothing of it kept.
        assert!(tree.subtree(root).is_err());
        assert!(tree.kept().is_empty());
    }

    #[test]
    fn a_child_started_by_another_thread_is_found_through_that_threads_children_file() {
        // The thread stays until the walk is done: the child is listed in its children file.
        let (started, release) = (std::sync::mpsc::channel(), std::sync::mpsc::channel::<()>());
        let thread = std::thread::spawn(move || {
            let child = std::process::Command::new("sleep").arg("30").spawn().unwrap();
            started.0.send(child.id() as i32).unwrap();
            release.1.recv().unwrap();
            child
        });
        let pid = started.1.recv().unwrap();
        let mut tree = Tree::default();
        let me = std::process::id() as i32;
        let found = tree.subtree(me).unwrap().unwrap();
        release.0.send(()).unwrap();
        let mut child = thread.join().unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(found.iter().any(|entry| entry.pid == pid && entry.ppid == me), "{found:?}");
    }

    #[test]
    fn the_memory_of_a_reaped_process_is_an_error_and_its_files_are_let_go() {
        let mut tree = Tree::default();
        let mut child = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let pid = child.id() as i32;
        assert!(tree.process_memory(pid).is_ok());
        assert_eq!(tree.kept(), vec![pid]);
        child.kill().unwrap();
        child.wait().unwrap();
        let error = tree.process_memory(pid).unwrap_err();
        assert!(error.to_string().contains(&format!("/proc/{pid}/status")), "{error}");
        assert!(tree.kept().is_empty());
    }

    #[test]
    fn kept_system_readings_agree_with_the_free_function() {
        let mut system = System::default();
        for _ in 0..3 {
            let (kept, fresh) = (system.read().unwrap(), system_memory().unwrap());
            assert_eq!((kept.total, kept.swap_total), (fresh.total, fresh.swap_total));
            assert_eq!(kept.cgroup.map(|g| g.limit), fresh.cgroup.map(|g| g.limit));
        }
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
