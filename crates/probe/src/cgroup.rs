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
    let (limit_file, usage_file, reclaim_field) = if v2 {
        ("memory.max", "memory.current", "inactive_file")
    } else {
        ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    };
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
