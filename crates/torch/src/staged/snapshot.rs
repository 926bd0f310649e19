//! Snapshots: the weights of a model that has no checkpoint (and no copy in the host tier),
//! written once as safetensors into the registry's snapshot folder at its first release, so that
//! its later reloads come back in place from that file (no loader call, no random draw) instead
//! of a rebuild.
//!
//! The files are the registry's own. Each registry holds an exclusive `flock` on a lock file of
//! its own in the folder for its whole life (`stageload-<pid>-<n>.lock`) and names its snapshots
//! after it (`stageload-<pid>-<n>-<k>.safetensors`). They go at `close` and when the registry
//! drops. A registry opening the folder removes the files of every lock that it can lock: their
//! owner is gone (killed, crashed); a live owner's lock cannot be taken, so its files stay. The
//! lock is the kernel's, so a reused pid changes nothing.
//!
//! Free space is checked before a write: the snapshot and the registry's keep-free bytes beside
//! it ([`KEEP_FREE`] unless the builder says otherwise) must fit in what the file system has for
//! unprivileged users. A write that cannot be made leaves the model
//! to be rebuilt as before; the registry says why in a `snapshot` event.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use nix::fcntl::{Flock, FlockArg};
use tch::Tensor;

use super::error::SnapshotError;
use super::instance::Instance;
use crate::source::FileStamp;
use crate::sync::lock;

/// What a write leaves free on the snapshot folder's file system by default, for everything
/// else on the machine (a shared machine's other users, the trace, the OS).
pub(crate) const KEEP_FREE: u64 = 1 << 30;

/// Registries of this process so far: each gets a name of its own in a shared folder.
static REGISTRIES: AtomicU64 = AtomicU64::new(0);

/// One registry's snapshot folder and the files it wrote there.
pub(crate) struct Snapshots {
    dir: PathBuf,
    /// `stageload-<pid>-<n>`: the lock file's stem and every snapshot's prefix.
    stem: String,
    /// Held for the registry's life: the sign to other processes that its files are live.
    _lock: Flock<File>,
    /// Bytes every write leaves free on the folder's file system.
    keep_free: u64,
    written: Mutex<Vec<PathBuf>>,
    next: AtomicU64,
}

impl Snapshots {
    /// Makes the folder if needed, removes what dead owners left in it, and takes a lock file of
    /// this registry's own; its writes leave `keep_free` bytes free.
    pub(crate) fn open(dir: &Path, keep_free: u64) -> Result<Self, SnapshotError> {
        std::fs::create_dir_all(dir).map_err(|source| SnapshotError::CreateDir { dir: dir.to_path_buf(), source })?;
        remove_stale(dir);
        let stem = format!("stageload-{}-{}", std::process::id(), REGISTRIES.fetch_add(1, Ordering::Relaxed));
        let path = dir.join(format!("{stem}.lock"));
        let lock_file = |created: bool, source: std::io::Error| SnapshotError::LockFile {
            dir: dir.to_path_buf(),
            path: path.clone(),
            created,
            source,
        };
        let file = File::create(&path).map_err(|e| lock_file(false, e))?;
        let lock = Flock::lock(file, FlockArg::LockExclusiveNonblock).map_err(|(_, e)| lock_file(true, e.into()))?;
        Ok(Snapshots {
            dir: dir.to_path_buf(),
            stem,
            _lock: lock,
            keep_free,
            written: Mutex::new(Vec::new()),
            next: AtomicU64::new(0),
        })
    }

    /// Writes `tensors` (`bytes` of data) as a new snapshot file and returns its path; a file
    /// that would not leave the keep-free bytes free is not begun.
    pub(crate) fn write(
        &self,
        model: &str,
        tensors: &[(String, Tensor)],
        bytes: u64,
    ) -> Result<(PathBuf, FileStamp), SnapshotError> {
        let free = free_bytes(&self.dir)?;
        if !leaves_enough(free, bytes, self.keep_free) {
            return Err(SnapshotError::NoRoom { dir: self.dir.clone(), free, bytes, keep_free: self.keep_free });
        }
        let k = self.next.fetch_add(1, Ordering::Relaxed);
        let path = self.dir.join(format!("{}-{k}.safetensors", self.stem));
        let metadata = std::collections::HashMap::from([("model".to_string(), model.to_string())]);
        // Written under a temporary name and renamed by `save`: a snapshot file is always whole.
        crate::checkpoint::save_with_metadata(tensors, Some(metadata), &path)
            .map_err(|e| SnapshotError::Write(Box::new(e)))?;
        lock(&self.written).push(path.clone());
        // The file as written: its reloads must find it so.
        let stamp = FileStamp::at(&path).map_err(|source| {
            SnapshotError::Write(Box::new(crate::CheckpointError::Open { path: path.clone(), source }))
        })?;
        Ok((path, stamp))
    }

    /// Removes one snapshot that no model uses.
    pub(crate) fn forget(&self, path: &Path) {
        lock(&self.written).retain(|p| p != path);
        let _ = std::fs::remove_file(path);
    }

    /// Removes every snapshot this registry wrote (at close, and when it drops).
    pub(crate) fn remove_all(&self) {
        for path in lock(&self.written).drain(..) {
            if let Err(err) = std::fs::remove_file(&path) {
                tracing::warn!(path = %path.display(), %err, "could not remove a snapshot");
            }
        }
    }
}

impl Drop for Snapshots {
    fn drop(&mut self) {
        self.remove_all();
        let _ = std::fs::remove_file(self.dir.join(format!("{}.lock", self.stem)));
    }
}

/// Whether writing `bytes` where `free` bytes are free leaves `keep_free` of them.
fn leaves_enough(free: u64, bytes: u64, keep_free: u64) -> bool {
    bytes.checked_add(keep_free).is_some_and(|needed| needed <= free)
}

/// Bytes an unprivileged process may still write on the file system of `dir`.
fn free_bytes(dir: &Path) -> Result<u64, SnapshotError> {
    let stat = nix::sys::statvfs::statvfs(dir)
        .map_err(|source| SnapshotError::FreeSpace { dir: dir.to_path_buf(), source })?;
    Ok((stat.blocks_available() as u64).saturating_mul(stat.fragment_size() as u64))
}

/// Removes the files of every lock in `dir` that can be locked (its owner is gone), the lock
/// file last. Failures are logged and skipped: what stays is removed by a later registry.
fn remove_stale(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    let names: Vec<String> = entries.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
    for stem in names.iter().filter_map(|n| n.strip_suffix(".lock")).filter(|s| s.starts_with("stageload-")) {
        let lock_path = dir.join(format!("{stem}.lock"));
        let Ok(file) = File::open(&lock_path) else { continue };
        // A live owner holds it: its files stay.
        let Ok(_gone) = Flock::lock(file, FlockArg::LockExclusiveNonblock) else { continue };
        let owned = format!("{stem}-");
        for name in names.iter().filter(|n| n.starts_with(&owned)) {
            let path = dir.join(name);
            if let Err(err) = std::fs::remove_file(&path) {
                tracing::warn!(path = %path.display(), %err, "could not remove a dead registry's snapshot");
            }
        }
        let _ = std::fs::remove_file(&lock_path);
    }
}

impl Snapshots {
    /// Writes `instance`'s weights as a new snapshot file (each storage once: a tensor filled
    /// through another, tied weights, is left out and comes back as its alias). Returns the
    /// bytes of data and the file's path, or why it was not written.
    pub(crate) fn write_instance(&self, instance: &Instance) -> (u64, Result<(PathBuf, FileStamp), SnapshotError>) {
        let weights = lock(&instance.weights);
        let covering = crate::storage::covering(&weights.tensors);
        let tensors: Vec<(String, Tensor)> = covering
            .iter()
            .flatten()
            .map(|&i| {
                let (name, tensor) = &weights.tensors[i];
                (name.clone(), tensor.shallow_clone())
            })
            .collect();
        drop(weights);
        let bytes: u64 = tensors.iter().map(|(_, t)| (t.numel() * t.kind().elt_size_in_bytes()) as u64).sum();
        let unallocated = tensors
            .iter()
            .filter(|(_, t)| t.numel() > 0 && !stageload_torch_sys::storage_info(t).is_ok_and(|i| i.allocated))
            .count();
        let written = match covering {
            Err(err) => Err(SnapshotError::Storages(err)),
            Ok(_) if unallocated > 0 => Err(SnapshotError::Unallocated { count: unallocated }),
            Ok(_) => self.write(&instance.name, &tensors, bytes),
        };
        (bytes, written)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snapshot_is_written_only_when_it_leaves_the_keep_free_bytes_free() {
        assert!(leaves_enough(KEEP_FREE + 100, 100, KEEP_FREE));
        assert!(!leaves_enough(KEEP_FREE + 99, 100, KEEP_FREE));
        assert!(!leaves_enough(KEEP_FREE - 1, 0, KEEP_FREE));
        assert!(leaves_enough(100, 100, 0), "nothing kept: the file alone must fit");
        assert!(!leaves_enough(u64::MAX, u64::MAX, KEEP_FREE), "no wrapping");
    }
}
