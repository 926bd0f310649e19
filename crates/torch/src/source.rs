//! File stamps: what tells, without reading a file, that it is still the file an earlier read
//! found. A reload must read what the first load read (or staged differs from eager), so every
//! file a model is loaded from is stamped at its first load and compared before each reload:
//! [`crate::checkpoint::Checkpoint`] stamps its files when it opens them (through the handles
//! it then reads), the registry keeps each model's first stamps ([`crate::staged`]).
//!
//! Kernels from 6.13 on give a file written after its stamp was read a time of their finest
//! grain; older kernels tick coarsely (a few milliseconds), so a file written within the tick
//! of its first load's stamp, to the same size, is not seen written there.
//!
//! A stamp is the file's device and inode (another file put at the path: a rename over it, the
//! usual atomic write, or a delete and a new write), its size, and its modification and
//! status-change times in nanoseconds (written in place, even to the same size; the
//! status-change time also moves when a writer sets the modification time back, which no
//! user can set). No content hash: the fastest checksum measured here (CRC-32, 3.2 GB/s a core)
//! would make a warm reload (11.55 GB/s) about 2.8 times as long on both cores, while a stamp
//! is one `fstat` (1.5 µs; `traces/changed-files/`), and a rewrite that keeps inode, size and
//! both times would need the clock set back.

use std::collections::HashMap;
use std::fs::{File, Metadata};
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use crate::sync::lock;

/// A file's identity and version as the file system reports them (see the module's doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FileStamp {
    device: u64,
    inode: u64,
    size: u64,
    modified: (i64, i64),
    changed: (i64, i64),
}

impl From<&Metadata> for FileStamp {
    fn from(m: &Metadata) -> Self {
        FileStamp {
            device: m.dev(),
            inode: m.ino(),
            size: m.size(),
            modified: (m.mtime(), m.mtime_nsec()),
            changed: (m.ctime(), m.ctime_nsec()),
        }
    }
}

impl FileStamp {
    /// The stamp of an open file (the one a read through `file` reads).
    pub fn of(file: &File) -> io::Result<Self> {
        file.metadata().map(|m| FileStamp::from(&m))
    }

    /// The stamp of the file at `path` now (following links, as an open does).
    pub fn at(path: &Path) -> io::Result<Self> {
        std::fs::metadata(path).map(|m| FileStamp::from(&m))
    }

    /// What differs in `self` from the `earlier` stamp of the same path; `None`: nothing.
    pub fn change_since(&self, earlier: &FileStamp) -> Option<FileChange> {
        if (self.device, self.inode) != (earlier.device, earlier.inode) {
            Some(FileChange::Replaced)
        } else if self.size != earlier.size {
            Some(FileChange::Resized { from: earlier.size, to: self.size })
        } else if self.modified != earlier.modified {
            Some(FileChange::Modified)
        } else if self.changed != earlier.changed {
            Some(FileChange::StatusChanged)
        } else {
            None
        }
    }
}

/// How a file differs from its earlier stamp.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum FileChange {
    /// Another file is at the path (a rename over it, or deleted and written again).
    #[error("another file was put at its path (a rename over it, or a new write)")]
    Replaced,
    /// Its size changed.
    #[error("its size changed from {from} to {to} bytes")]
    Resized {
        /// The size first seen.
        from: u64,
        /// The size now.
        to: u64,
    },
    /// Written in place (its modification time moved), its size the same.
    #[error("it was written in place (its modification time moved; same size)")]
    Modified,
    /// Its status changed, its size and modification time the same: its permissions, owner or
    /// links, or a write that set its modification time back.
    #[error("its status changed (permissions, owner, links, or a write that set its modification time back)")]
    StatusChanged,
}

/// A model's file is not what the model's first load read from it: the registry refuses to
/// load the model from it (a typed error, an `error` event, nothing filled) until the first file
/// is back or [`StagedModels::accept_changed_files`](crate::StagedModels::accept_changed_files)
/// accepts the new one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("'{model}': {} changed since the model was first loaded from it ({change}), so a reload would differ from the first load: put the first file back, or accept the new one with StagedModels::accept_changed_files(\"{model}\")", .path.display())]
pub struct SourceChanged {
    /// The model.
    pub model: String,
    /// The file.
    pub path: PathBuf,
    /// What changed.
    pub change: FileChange,
}

/// The stamps of the files one model's first load read (its checkpoint, its TorchScript file or
/// package, its snapshot): every later load compares the files it reads with them. One per
/// model, kept across its releases, rebuilds and prefetches (the registry's entry holds it).
#[derive(Debug, Default)]
pub(crate) struct FirstReads {
    stamps: Mutex<HashMap<PathBuf, FileStamp>>,
    /// Set by `accept_changed_files`: the next load takes changed files as they are now.
    accept: AtomicBool,
    /// The changes that load accepted (`path: change`), for its event.
    accepted: Mutex<Vec<String>>,
}

impl FirstReads {
    /// Meets the stamp `now` of `path`, about to be read for `model`: the first stamp of a path
    /// is recorded, a later one must be the same (or is accepted and recorded, once asked to).
    pub(crate) fn meet(&self, model: &str, path: &Path, now: FileStamp) -> Result<(), SourceChanged> {
        let mut stamps = lock(&self.stamps);
        let Some(first) = stamps.get(path) else {
            stamps.insert(path.to_path_buf(), now);
            return Ok(());
        };
        let Some(change) = now.change_since(first) else { return Ok(()) };
        if !self.accept.load(Ordering::SeqCst) {
            return Err(SourceChanged { model: model.to_string(), path: path.to_path_buf(), change });
        }
        stamps.insert(path.to_path_buf(), now);
        lock(&self.accepted).push(format!("{}: {change}", path.display()));
        Ok(())
    }

    /// The stamp the first read of `path` found, if it has been read.
    pub(crate) fn first(&self, path: &Path) -> Option<FileStamp> {
        lock(&self.stamps).get(path).copied()
    }

    /// [`meet`](Self::meet) for each of `paths` with its stamp.
    pub(crate) fn meet_all(&self, model: &str, paths: &[PathBuf], stamps: &[FileStamp]) -> Result<(), SourceChanged> {
        paths.iter().zip(stamps).try_for_each(|(path, stamp)| self.meet(model, path, *stamp))
    }

    /// Records `stamp` as the first read of `path` (a file the registry wrote itself: a
    /// snapshot).
    pub(crate) fn record(&self, path: &Path, stamp: FileStamp) {
        lock(&self.stamps).insert(path.to_path_buf(), stamp);
    }

    /// The next load of the model takes its changed files as they are now.
    pub(crate) fn accept_changes(&self) {
        self.accept.store(true, Ordering::SeqCst);
    }

    /// Ends a load: what it accepted, and no more accepting.
    pub(crate) fn end_load(&self) -> Vec<String> {
        self.accept.store(false, Ordering::SeqCst);
        std::mem::take(&mut *lock(&self.accepted))
    }
}

/// The [`SourceChanged`] behind a loader's error, if one is there (a loader reading its files
/// through [`crate::BuildContext::source_file`], a streamed model's set-up).
pub(crate) fn changed_source(err: &(dyn std::error::Error + 'static)) -> Option<SourceChanged> {
    std::iter::successors(Some(err), |e| e.source()).find_map(|e| e.downcast_ref::<SourceChanged>()).cloned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn a_rename_over_the_path_a_resize_and_an_in_place_write_each_show_as_their_own_change() {
        let dir = tempfile::TempDir::new().unwrap();
        let path = dir.path().join("w.bin");
        std::fs::write(&path, b"0123456789").unwrap();
        let first = FileStamp::at(&path).unwrap();
        assert_eq!(FileStamp::at(&path).unwrap().change_since(&first), None, "nothing changed");
        assert_eq!(FileStamp::of(&File::open(&path).unwrap()).unwrap(), first, "an open file's stamp is its path's");

        // Same size, in place; the modification time set forward, so that a file system whose
        // clock ticks coarsely shows the write too.
        let mut file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        file.write_all(b"9876543210").unwrap();
        file.set_modified(std::time::SystemTime::now() + std::time::Duration::from_secs(5)).unwrap();
        drop(file);
        let written = FileStamp::at(&path).unwrap();
        assert_eq!(written.change_since(&first), Some(FileChange::Modified));

        std::fs::write(&path, b"01234").unwrap();
        let resized = FileStamp::at(&path).unwrap();
        assert_eq!(resized.change_since(&written), Some(FileChange::Resized { from: 10, to: 5 }));

        let other = dir.path().join("new.bin");
        std::fs::write(&other, b"01234").unwrap();
        std::fs::rename(&other, &path).unwrap();
        assert_eq!(FileStamp::at(&path).unwrap().change_since(&resized), Some(FileChange::Replaced));
    }

    #[test]
    fn the_first_difference_in_identity_size_modification_and_status_time_names_the_change() {
        let first = FileStamp { device: 1, inode: 2, size: 3, modified: (4, 5), changed: (6, 7) };
        let with = |f: fn(&mut FileStamp)| {
            let mut stamp = first;
            f(&mut stamp);
            stamp.change_since(&first)
        };
        assert_eq!(with(|s| s.changed.1 += 1), Some(FileChange::StatusChanged));
        assert_eq!(with(|s| s.modified.1 += 1), Some(FileChange::Modified));
        assert_eq!(with(|s| s.size = 9), Some(FileChange::Resized { from: 3, to: 9 }));
        assert_eq!(with(|s| s.device = 9), Some(FileChange::Replaced));
        assert_eq!(with(|s| (s.inode, s.size) = (9, 9)), Some(FileChange::Replaced), "a new file, whatever its size");
    }

    #[test]
    fn a_models_first_read_is_recorded_a_changed_one_refused_and_accepted_only_once_asked() {
        let first = FileStamp { device: 1, inode: 2, size: 3, modified: (4, 5), changed: (6, 7) };
        let written = FileStamp { modified: (4, 6), ..first };
        let path = Path::new("w.safetensors");
        let reads = FirstReads::default();
        reads.meet("net", path, first).unwrap();
        reads.meet("net", path, first).unwrap();
        let err = reads.meet("net", path, written).unwrap_err();
        assert_eq!(err, SourceChanged { model: "net".into(), path: path.into(), change: FileChange::Modified });
        assert!(err.to_string().contains("accept_changed_files(\"net\")"), "{err}");
        assert!(reads.end_load().is_empty(), "a refused change is not accepted");

        reads.accept_changes();
        reads.meet("net", path, written).unwrap();
        assert_eq!(
            reads.end_load(),
            ["w.safetensors: it was written in place (its modification time moved; same size)"]
        );
        reads.meet("net", path, written).unwrap();
        assert!(reads.meet("net", path, first).is_err(), "accepting ends with the load that accepted");
    }

    #[test]
    fn a_changed_source_is_found_inside_the_errors_that_wrap_it() {
        #[derive(Debug, thiserror::Error)]
        #[error("outer")]
        struct Outer(#[source] SourceChanged);
        let changed = SourceChanged { model: "m".into(), path: "f".into(), change: FileChange::Replaced };
        let boxed: Box<dyn std::error::Error + Send + Sync> = Box::new(Outer(changed.clone()));
        assert_eq!(changed_source(&*boxed), Some(changed));
        let other: Box<dyn std::error::Error + Send + Sync> = "no".into();
        assert_eq!(changed_source(&*other), None);
    }
}
