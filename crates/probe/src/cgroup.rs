//! The memory limit of the control group this process runs in (a container, a CI job, a systemd
//! slice), so that "available" means what this process can really still use.
//!
//! cgroup v2: `memory.max`, `memory.current` and `inactive_file` of `memory.stat`, for the
//! process's own group and each ancestor (the tightest wins). cgroup v1 (hybrid hosts):
//! `memory.limit_in_bytes`, `memory.usage_in_bytes`, `total_inactive_file`. "max", v1's huge
//! "unlimited" sentinel and any limit at or above the machine's memory are not limits.
//! The files are plain numbers; no crate parses cgroupfs, so this module reads them itself.

use std::fs;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// A memory-limited control group: its limit, what it uses, and what of that the kernel can
/// reclaim (inactive file cache). All in bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CgroupMemory {
    /// The group's folder in cgroupfs.
    pub path: PathBuf,
    /// `memory.max` (v2) or `memory.limit_in_bytes` (v1), bytes.
    pub limit: u64,
    /// `memory.current` (v2) or `memory.usage_in_bytes` (v1), bytes.
    pub usage: u64,
    /// `inactive_file` (v2) or `total_inactive_file` (v1) of `memory.stat`, bytes.
    pub reclaimable: u64,
}

impl CgroupMemory {
    /// What a new allocation in this group can still get: limit − usage + reclaimable cache,
    /// never more than the limit.
    pub fn headroom(&self) -> u64 {
        (self.limit.saturating_sub(self.usage) + self.reclaimable).min(self.limit)
    }
}

fn read_number(path: &Path) -> Option<u64> {
    fs::read_to_string(path).ok()?.trim().parse().ok()
}

fn stat_field(dir: &Path, field: &str) -> u64 {
    let text = fs::read_to_string(dir.join("memory.stat")).unwrap_or_default();
    text.lines()
        .filter_map(|line| line.split_once(' '))
        .find(|(name, _)| *name == field)
        .and_then(|(_, value)| value.trim().parse().ok())
        .unwrap_or(0)
}

/// Reads one group's folder; `None` when it has no limit below `machine_total`.
fn read_group(dir: &Path, v2: bool, machine_total: u64) -> Option<CgroupMemory> {
    let (limit_file, usage_file, reclaim_field) = names(v2);
    let limit = read_number(&dir.join(limit_file)).filter(|&limit| limit < machine_total)?;
    let usage = read_number(&dir.join(usage_file))?;
    Some(CgroupMemory { path: dir.to_path_buf(), limit, usage, reclaimable: stat_field(dir, reclaim_field) })
}

/// `leaf` and its ancestors up to `mount`, leaf first.
fn group_and_ancestors(mount: &Path, leaf: &str, v2: bool, dirs: &mut Vec<GroupDir>) {
    let mut dir = mount.join(leaf.trim_start_matches('/'));
    if !dir.is_dir() {
        // Inside a cgroup namespace the path in /proc/self/cgroup may not exist under the
        // mount; the mount's root is then the process's own group.
        dir = mount.to_path_buf();
    }
    loop {
        dirs.push(GroupDir { path: dir.clone(), v2 });
        if dir == mount || !dir.pop() || !dir.starts_with(mount) {
            return;
        }
    }
}

/// A control group folder whose memory files may hold a limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupDir {
    /// The folder, e.g. `/sys/fs/cgroup/user.slice`.
    pub path: PathBuf,
    /// cgroup v2 file names (else v1).
    pub v2: bool,
}

/// Where the limits of the process whose `/proc/PID/cgroup` text is given can be, under
/// `cgroup_root` (normally `/sys/fs/cgroup`): its group in each memory hierarchy and their
/// ancestors. Resolving this once lets a poll read only the limit files.
pub fn group_dirs(proc_cgroup: &str, cgroup_root: &Path) -> Vec<GroupDir> {
    let mut dirs = Vec::new();
    for line in proc_cgroup.lines() {
        let mut fields = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (fields.next(), fields.next(), fields.next()) else {
            continue;
        };
        if id == "0" && controllers.is_empty() {
            // v2: the unified hierarchy is the mount itself, or `unified/` on hybrid hosts.
            let mount = if cgroup_root.join("cgroup.controllers").exists() {
                cgroup_root.to_path_buf()
            } else {
                cgroup_root.join("unified")
            };
            group_and_ancestors(&mount, path, true, &mut dirs);
        } else if controllers.split(',').any(|c| c == "memory") {
            group_and_ancestors(&cgroup_root.join("memory"), path, false, &mut dirs);
        }
    }
    dirs
}

/// The tightest (least headroom) memory-limited group among `dirs`; `None` when none has a
/// limit below `machine_total`.
pub fn tightest(dirs: &[GroupDir], machine_total: u64) -> Option<CgroupMemory> {
    dirs.iter().filter_map(|dir| read_group(&dir.path, dir.v2, machine_total)).min_by_key(CgroupMemory::headroom)
}

/// The memory limit that applies to the process whose `/proc/PID/cgroup` text is given, looked
/// up under `cgroup_root` (normally `/sys/fs/cgroup`); `None` when no limit below
/// `machine_total` applies.
pub fn cgroup_memory(proc_cgroup: &str, cgroup_root: &Path, machine_total: u64) -> Option<CgroupMemory> {
    tightest(&group_dirs(proc_cgroup, cgroup_root), machine_total)
}

/// How long a limit read stays in use: a group's limit seldom changes (a container's is set once),
/// so [`KeptGroups`] reads the limit files about once a second, and the usage every reading.
#[cfg(target_os = "linux")]
pub const LIMIT_REFRESH: std::time::Duration = std::time::Duration::from_secs(1);

/// A file of a group: not opened yet, open, or missing (not there, or unreadable, at the last
/// try: tried again only at the next refresh of the limits, not every reading).
#[cfg(target_os = "linux")]
#[derive(Debug)]
enum Slot {
    Closed,
    Open(crate::kept::Kept),
    Missing,
}

#[cfg(target_os = "linux")]
impl Slot {
    /// The file's content now, opening it first if it is closed, or missing and `retry` is set.
    /// A file that cannot be opened or read is missing from then on.
    fn read<'b>(&mut self, path: &Path, retry: bool, opens: &mut u64, buffer: &'b mut Vec<u8>) -> Option<&'b [u8]> {
        if matches!(self, Slot::Closed) || (retry && matches!(self, Slot::Missing)) {
            *opens += 1;
            *self = crate::kept::Kept::open(path).map_or(Slot::Missing, Slot::Open);
        }
        let Slot::Open(file) = self else { return None };
        match file.read(buffer) {
            Ok(text) => Some(text),
            Err(_) => {
                *self = Slot::Missing;
                None
            }
        }
    }
}

/// One group's memory files, kept open, and its limit as last read (`None`: no limit, or none
/// could be read).
#[cfg(target_os = "linux")]
#[derive(Debug)]
struct KeptGroup {
    dir: GroupDir,
    limit_file: Slot,
    usage_file: Slot,
    stat_file: Slot,
    limit: Option<u64>,
}

/// The memory files of a process's groups ([`group_dirs`]), kept open between readings: what
/// [`tightest`] reads, at the cost of one read per file instead of an open, a read and a close.
/// The limits are read again every [`LIMIT_REFRESH`], usage and reclaimable cache at every reading of a
/// group whose limit counts; a file that is missing is tried again only at a refresh.
#[cfg(target_os = "linux")]
#[derive(Debug)]
pub struct KeptGroups {
    groups: Vec<KeptGroup>,
    /// When the limits were last read.
    refreshed: Option<std::time::Instant>,
    buffer: Vec<u8>,
    /// Files opened or tried, all told.
    opens: u64,
}

#[cfg(target_os = "linux")]
impl KeptGroups {
    /// The groups in `dirs`; nothing is opened until the first [`tightest`](Self::tightest).
    pub fn new(dirs: Vec<GroupDir>) -> Self {
        let groups = dirs
            .into_iter()
            .map(|dir| KeptGroup {
                dir,
                limit_file: Slot::Closed,
                usage_file: Slot::Closed,
                stat_file: Slot::Closed,
                limit: None,
            })
            .collect();
        KeptGroups { groups, refreshed: None, buffer: Vec::new(), opens: 0 }
    }

    /// As [`tightest`] at `now` (the limits as read at the last refresh, at most
    /// [`LIMIT_REFRESH`] before it).
    pub fn tightest(&mut self, now: std::time::Instant, machine_total: u64) -> Option<CgroupMemory> {
        let refresh = self.refreshed.is_none_or(|at| now.saturating_duration_since(at) >= LIMIT_REFRESH);
        if refresh {
            self.refreshed = Some(now);
        }
        let KeptGroups { groups, buffer, opens, .. } = self;
        let mut tightest: Option<CgroupMemory> = None;
        for group in groups.iter_mut() {
            let (limit_name, usage_name, reclaim_field) = names(group.dir.v2);
            if refresh {
                let text = group.limit_file.read(&group.dir.path.join(limit_name), true, opens, buffer);
                group.limit = text.and_then(number);
            }
            let Some(limit) = group.limit.filter(|&limit| limit < machine_total) else { continue };
            let usage_path = group.dir.path.join(usage_name);
            let Some(usage) = group.usage_file.read(&usage_path, refresh, opens, buffer).and_then(number) else {
                continue;
            };
            let stat_path = group.dir.path.join("memory.stat");
            let reclaimable = group
                .stat_file
                .read(&stat_path, refresh, opens, buffer)
                .map_or(0, |text| stat_value(text, reclaim_field).unwrap_or(0));
            let found = CgroupMemory { path: group.dir.path.clone(), limit, usage, reclaimable };
            if tightest.as_ref().is_none_or(|best| found.headroom() < best.headroom()) {
                tightest = Some(found);
            }
        }
        tightest
    }

    /// Files opened or tried so far (each reading of a kept one costs none).
    pub fn opens(&self) -> u64 {
        self.opens
    }
}

/// The limit file, usage file and reclaimable field of `memory.stat`, for v2 or v1.
fn names(v2: bool) -> (&'static str, &'static str, &'static str) {
    if v2 {
        ("memory.max", "memory.current", "inactive_file")
    } else {
        ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    }
}

/// A file holding one number (`max` and anything else that is not a number: `None`).
#[cfg(target_os = "linux")]
fn number(text: &[u8]) -> Option<u64> {
    crate::kept::parse_u64(text.trim_ascii())
}

/// The value of `field` in `memory.stat` text (`name value` lines).
#[cfg(target_os = "linux")]
fn stat_value(text: &[u8], field: &str) -> Option<u64> {
    text.split(|&b| b == b'\n').find_map(|line| {
        let rest = line.strip_prefix(field.as_bytes())?.strip_prefix(b" ")?;
        crate::kept::parse_u64(rest.trim_ascii())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, text: &str) {
        fs::create_dir_all(dir).unwrap();
        fs::write(dir.join(name), text).unwrap();
    }

    /// A scratch folder standing in for /sys/fs/cgroup, removed when dropped.
    fn temp_root() -> tempfile::TempDir {
        tempfile::Builder::new().prefix("stageload-cgroup-").tempdir().unwrap()
    }

    const GB: u64 = 1 << 30;

    #[test]
    fn v2_tightest_ancestor_wins_and_max_is_no_limit() {
        let folder = temp_root();
        let root = folder.path();
        write(root, "cgroup.controllers", "memory\n");
        let parent = root.join("ci");
        let leaf = parent.join("job");
        write(&parent, "memory.max", &format!("{}\n", 4 * GB));
        write(&parent, "memory.current", &format!("{}\n", 3 * GB));
        write(&parent, "memory.stat", &format!("anon 1\ninactive_file {}\n", GB / 2));
        write(&leaf, "memory.max", "max\n");
        write(&leaf, "memory.current", "100\n");
        let group = cgroup_memory("0::/ci/job\n", root, 16 * GB).unwrap();
        assert_eq!(group.path, parent);
        assert_eq!((group.limit, group.usage, group.reclaimable), (4 * GB, 3 * GB, GB / 2));
        assert_eq!(group.headroom(), GB + GB / 2);
        // A limit at or above the machine's memory is not a limit.
        assert_eq!(cgroup_memory("0::/ci/job\n", root, 2 * GB), None);
    }

    #[test]
    fn v1_sentinel_is_ignored_and_a_real_limit_is_read() {
        let folder = temp_root();
        let root = folder.path();
        let memory = root.join("memory");
        write(&memory, "memory.limit_in_bytes", "9223372036854771712\n");
        write(&memory, "memory.usage_in_bytes", "5042298880\n");
        let text = "4:memory:/process_api/abc\n0::/\n";
        assert_eq!(cgroup_memory(text, root, 16 * GB), None, "unlimited sentinel");
        write(&memory, "memory.limit_in_bytes", &format!("{}\n", 8 * GB));
        write(&memory, "memory.stat", "total_inactive_file 1024\n");
        let group = cgroup_memory(text, root, 16 * GB).unwrap();
        assert_eq!((group.limit, group.usage, group.reclaimable), (8 * GB, 5042298880, 1024));
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn kept_groups_read_usage_afresh_every_time_and_limits_once_a_second() {
        use std::time::{Duration, Instant};
        let folder = temp_root();
        let root = folder.path();
        write(root, "cgroup.controllers", "memory\n");
        let job = root.join("job");
        write(&job, "memory.max", &format!("{}\n", 4 * GB));
        write(&job, "memory.current", &format!("{}\n", GB));
        write(&job, "memory.stat", "anon 1\ninactive_file 1024\n");
        let mut kept = KeptGroups::new(group_dirs("0::/job\n", root));
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let first = kept.tightest(t0, 16 * GB).unwrap();
        assert_eq!((first.path.clone(), first.limit, first.usage, first.reclaimable), (job.clone(), 4 * GB, GB, 1024));
        let opened = kept.opens();
        // The usage is read through the kept file at every reading: a new value, no new open.
        write(&job, "memory.current", &format!("{}\n", 2 * GB));
        assert_eq!(kept.tightest(at(100), 16 * GB).unwrap().usage, 2 * GB);
        // A new limit counts from the next refresh on, not before.
        write(&job, "memory.max", &format!("{}\n", 8 * GB));
        assert_eq!(kept.tightest(at(900), 16 * GB).unwrap().limit, 4 * GB);
        assert_eq!(kept.opens(), opened);
        assert_eq!(kept.tightest(at(1000), 16 * GB).unwrap().limit, 8 * GB);
        // The job's limit file was read again, not opened again; only the mount root's, which
        // is missing, was tried again.
        assert_eq!(kept.opens(), opened + 1);
        // A limit set to "max" is no limit; a group no longer limited reads none of its files.
        write(&job, "memory.max", "max\n");
        assert_eq!(kept.tightest(at(2000), 16 * GB), None);
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn a_missing_limit_file_is_tried_again_at_a_refresh_not_every_reading() {
        use std::time::{Duration, Instant};
        let folder = temp_root();
        let root = folder.path();
        write(root, "cgroup.controllers", "memory\n");
        let job = root.join("job");
        fs::create_dir_all(&job).unwrap();
        // The job's folder and the mount's root: two limit files, both missing.
        let mut kept = KeptGroups::new(group_dirs("0::/job\n", root));
        let t0 = Instant::now();
        assert_eq!(kept.tightest(t0, 16 * GB), None);
        assert_eq!(kept.opens(), 2);
        for poll in 1..10 {
            assert_eq!(kept.tightest(t0 + Duration::from_millis(100 * poll), 16 * GB), None);
        }
        assert_eq!(kept.opens(), 2, "nine readings within the second tried no file again");
        // A limit that appears is seen at the next refresh.
        write(&job, "memory.max", &format!("{}\n", 4 * GB));
        write(&job, "memory.current", "100\n");
        assert_eq!(kept.tightest(t0 + Duration::from_millis(999), 16 * GB), None);
        let group = kept.tightest(t0 + Duration::from_secs(1), 16 * GB).unwrap();
        assert_eq!(
            (group.limit, group.usage, group.reclaimable),
            (4 * GB, 100, 0),
            "no memory.stat: nothing reclaimable"
        );
    }

    #[test]
    fn vanished_or_garbled_files_mean_no_limit() {
        let folder = temp_root();
        let root = folder.path();
        write(root, "cgroup.controllers", "");
        write(&root.join("a"), "memory.max", "lots\n");
        assert_eq!(cgroup_memory("0::/a\n", root, 16 * GB), None);
        assert_eq!(cgroup_memory("garbage", root, 16 * GB), None);
        assert_eq!(cgroup_memory("0::/a\n", &root.join("missing"), 16 * GB), None);
    }
}
