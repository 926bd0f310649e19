//! Checkpoint I/O: safetensors files read once, straight into the storage of the tensors that
//! receive them.
//!
//! `tch::nn::VarStore::load` reads the whole file into a `Vec`, builds a tensor per entry and then
//! copies it into the variable: two transient copies of the model. Here only the headers are read
//! at open. At load, an entry whose target is a contiguous CPU tensor of the same dtype is read
//! straight into the target's memory, in pieces of at most 4 MiB ([`PIECE`]), each of [`readers`]
//! threads reading one contiguous run of them in file order through a handle of its own: no
//! transient copy. A piece in the page cache is copied from a mapping of just its pages with
//! non-temporal stores, one from the disk read with `pread` ([`HostRead`]); at most one piece
//! per reader is mapped at a time. (On the load benchmark's checkpoint, copying from one mapping
//! of the whole file measured 10.7–10.9 GB/s against 11.8–12.4 for `pread`, with the whole file
//! in RSS during the load.) Entries for contiguous CUDA targets go through the pinned ring of
//! `device_copy` ([`RingShape`]; 36.7 GB/s on the H200, against 55 for a pinned copy). Entries
//! that need a dtype conversion on the CPU, go to another device, or land in strided or
//! overlapping (tied) targets are read a window of rows at a time into one reused buffer of at
//! most 16 MiB and handed to libtorch's `copy_`, one after the other in the caller's order, so
//! that of tied targets the one listed last wins. `load_named` meets the targets' names with
//! the files' under a model's [`crate::NameRules`].
//!
//! Every check happens before the first byte is read: each target has an entry, shapes match,
//! dtypes convert, targets have storage, the files are as long as their headers say. A failed
//! check leaves every target as it was.
//!
//! A checkpoint given a hook with [`Checkpoint::before_each_piece`] (or a flag with
//! [`Checkpoint::stop_when`]) asks it before every piece (a read of at most 16 MiB, a CUDA piece,
//! a converted tensor) and ends a load with [`CheckpointError::Stopped`] once it says no: a
//! registry pauses a prefetched copy between pieces while the foreground loads, and stops it
//! when the registry closes instead of waiting for the whole model.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use stageload_trace::event::LoadReport as NamedLoad;
use tch::{Device, Kind, Tensor};

use crate::device_copy;
use crate::source::FileStamp;
use stageload_torch_sys::MappedReadError;

mod direct;
pub(crate) mod error;
mod kinds;
mod save;
mod to_cuda;

/// The pinned ring's shape for CUDA loads (set for a process by `STAGELOAD_RING`).
pub use crate::device_copy::{RingShape, RingShapeError};
use crate::names::{match_names, NameMatch, NameMismatch, NameRules};
use crate::sync::lock;
pub(crate) use direct::Direct;
pub(crate) use error::{paths, quoted};
pub use error::{CheckpointError, SaveFailure};
pub(crate) use kinds::{converts, device_holds, dtype_of, is_float, kind_of};
pub use save::{save, save_with_metadata};

/// One tensor of a checkpoint: where it lives and what it is.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    /// Index of its file in [`Checkpoint::files`].
    pub file: usize,
    /// Its libtorch kind.
    pub kind: Kind,
    /// Its shape.
    pub shape: Vec<i64>,
    /// First byte of its data inside the file.
    pub start: u64,
    /// Byte after its last one inside the file.
    pub end: u64,
}

/// What a load did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LoadReport {
    /// Bytes copied into the targets (in the targets' dtypes).
    pub bytes: u64,
    /// Tensors loaded.
    pub tensors: usize,
    /// Entries of the files that no target asked for (reported, not an error).
    pub unused: Vec<String>,
    /// Of `bytes`, those copied from mappings of the page cache ([`HostRead::Mapped`]); the
    /// rest were read with `pread` or went through `copy_`.
    pub mapped: u64,
}

/// Bytes done out of the total, for progress bars.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    /// Bytes loaded so far.
    pub done: u64,
    /// Bytes the load copies in all.
    pub total: u64,
}

/// One or several safetensors files, open, with their headers checked and indexed.
///
/// ```no_run
/// use stageload::{checkpoint::Checkpoint, named_tensors, NameRules};
/// # fn fill(vs: &tch::nn::VarStore) -> Result<(), stageload::CheckpointError> {
/// let checkpoint = Checkpoint::open(&["model-00001.safetensors", "model-00002.safetensors"])?; // headers
/// let report = checkpoint.load_named(&named_tensors(vs), &NameRules::default(), |_| ())?; // every byte once
/// # Ok(()) }
/// ```
pub struct Checkpoint {
    files: Vec<PathBuf>,
    handles: Vec<File>,
    /// Each file as its open found it ([`Checkpoint::stamps`]).
    stamps: Vec<FileStamp>,
    entries: HashMap<String, Entry>,
    before_piece: Option<Arc<BeforePiece>>,
    host_reads: HostRead,
    /// Per file, once a read past the page cache asked for it: the file opened again with
    /// `O_DIRECT`, or `None` where that open failed (a file system without it, no `/proc`).
    direct_handles: Vec<std::sync::OnceLock<Option<File>>>,
}

/// How a checkpoint's pieces for CPU targets of the file's dtype reach the targets' memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum HostRead {
    /// Every piece is read with `pread` straight into the target's memory.
    Pread,
    /// The default. Each piece of at least [`MAPPED_MIN`] bytes whose pages are in the page
    /// cache is copied from a mapping of just those pages with non-temporal stores, the widest
    /// the CPU has ([`stageload_torch_sys::read_mapped`]); a smaller piece, or one whose mapping
    /// fails for any reason, is read with `pread`, which reports the file's own error if it has
    /// one. A reader that meets a piece not in the page cache reads the rest of its run with
    /// `pread`: from the disk, each run stays one sequential stream for the kernel's read-ahead.
    /// On the load benchmark's checkpoint (1 GB, warm, 7 rounds) 1.26x the rate of `pread`, with
    /// 64-byte stores (`crates/bench/c/load-bench-mapped-stores.c`); cold 0.96x before a reader
    /// kept to `pread` after its first uncached piece (`traces/archive/load-bench-mapped/`). At most one
    /// piece per reader is mapped at a time: [`readers`] × [`PIECE`] bytes of the file's pages in
    /// the process's RSS during a load (streamed models, whose budget covers the RSS, read with
    /// `pread`: [`crate::stream::REFILL_READS`]).
    #[default]
    Mapped,
}

/// The smallest piece [`HostRead::Mapped`] copies from a mapping; a smaller one is read with
/// `pread`. The mapping's fixed costs (its calls, the TLB flush at the unmap) grow as a share of
/// the piece as it shrinks; this bound was chosen, not measured.
pub const MAPPED_MIN: usize = 256 << 10;

/// Asked before every piece of a load: it may wait as long as it likes (the load pauses there)
/// when told [`PieceWait::May`], then says whether the load goes on.
pub type BeforePiece = dyn Fn(PieceWait) -> bool + Send + Sync;

/// Whether the hook asked before a piece may make the load wait there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PieceWait {
    /// The load holds nothing others need: it may pause.
    May,
    /// The load holds what another load would wait for (the process's pinned ring, on the way
    /// to CUDA): the hook only says whether it goes on, at once. A load paused there would
    /// leave the load it gave way to waiting for the ring.
    MustNot,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint").field("files", &self.files).field("tensors", &self.entries.len()).finish()
    }
}

impl Checkpoint {
    /// Opens every file and checks its header: valid JSON, offsets inside the file and covering
    /// its data, supported dtypes, no tensor name in two files.
    pub fn open<P: AsRef<Path>>(files: &[P]) -> Result<Self, CheckpointError> {
        let mut checkpoint = Checkpoint {
            files: Vec::new(),
            handles: Vec::new(),
            stamps: Vec::new(),
            entries: HashMap::new(),
            before_piece: None,
            host_reads: HostRead::default(),
            direct_handles: Vec::new(),
        };
        for path in files {
            let path = path.as_ref().to_path_buf();
            let mut file = stageload_input::open_regular(&path)
                .map_err(|source| CheckpointError::Open { path: path.clone(), source })?;
            let stamp = FileStamp::of(&file).map_err(|source| CheckpointError::Open { path: path.clone(), source })?;
            let stageload_input::Header { data_start, metadata } = stageload_input::read_header(&mut file)
                .map_err(|reason| CheckpointError::Invalid { path: path.clone(), reason })?;
            let index = checkpoint.files.len();
            for (name, info) in metadata.tensors() {
                let kind = kind_of(info.dtype).ok_or_else(|| CheckpointError::UnsupportedDtype {
                    path: path.clone(),
                    tensor: name.clone(),
                    dtype: format!("{:?}", info.dtype),
                })?;
                let entry = Entry {
                    file: index,
                    kind,
                    shape: info.shape.iter().map(|&d| d as i64).collect(),
                    start: data_start + info.data_offsets.0 as u64,
                    end: data_start + info.data_offsets.1 as u64,
                };
                if let Some(previous) = checkpoint.entries.insert(name.clone(), entry) {
                    return Err(CheckpointError::DuplicateTensor {
                        tensor: name,
                        first: checkpoint.files[previous.file].clone(),
                        second: path,
                    });
                }
            }
            checkpoint.files.push(path);
            checkpoint.handles.push(file);
            checkpoint.stamps.push(stamp);
            checkpoint.direct_handles.push(std::sync::OnceLock::new());
        }
        Ok(checkpoint)
    }

    /// Loads from this checkpoint end with [`CheckpointError::Stopped`] at the first piece that
    /// finds `flag` set (checked before each piece is read).
    pub fn stop_when(self, flag: Arc<AtomicBool>) -> Self {
        self.before_each_piece(Arc::new(move |_| !flag.load(Ordering::SeqCst)))
    }

    /// Asks `hook` before each piece of a load is read (on the thread reading it; the load's
    /// readers ask it concurrently): a piece waits for its answer, and a `false` ends the load
    /// with [`CheckpointError::Stopped`]. Pieces on the way to CUDA through the pinned ring ask
    /// with [`PieceWait::MustNot`].
    pub fn before_each_piece(mut self, hook: Arc<BeforePiece>) -> Self {
        self.before_piece = Some(hook);
        self
    }

    /// How pieces for CPU targets of the file's dtype are read ([`HostRead::Mapped`] unless set).
    pub fn host_reads(mut self, how: HostRead) -> Self {
        self.host_reads = how;
        self
    }

    /// Fills `memory` with the bytes of file `file` at `offset` through `handle` (one of that
    /// file's), as [`HostRead`] says; whether it copied them from a mapping. `mapping`: whether
    /// this reader still copies from mappings, cleared at its first piece not in the page cache
    /// (or where mappings are unsupported).
    fn read_piece(
        &self,
        handle: &File,
        file: usize,
        memory: &mut [u8],
        offset: u64,
        mapping: &mut bool,
    ) -> std::io::Result<bool> {
        if *mapping && memory.len() >= MAPPED_MIN {
            match stageload_torch_sys::read_mapped(handle, offset, memory) {
                Ok(()) => return Ok(true),
                Err(MappedReadError::Unsupported | MappedReadError::NotCached { .. }) => *mapping = false,
                Err(err) => {
                    tracing::debug!(file = %self.files[file].display(), %err, "mapped read failed; reading with pread")
                }
            }
        }
        handle.read_exact_at(memory, offset).map(|()| false)
    }

    /// `Stopped` once the hook of [`before_each_piece`](Self::before_each_piece) says no.
    fn go_on(&self, wait: PieceWait) -> Result<(), CheckpointError> {
        match &self.before_piece {
            Some(hook) if !hook(wait) => Err(CheckpointError::Stopped { files: self.files.clone() }),
            _ => Ok(()),
        }
    }

    /// The files, in the order given.
    pub fn files(&self) -> &[PathBuf] {
        &self.files
    }

    /// Each file's stamp as [`open`](Self::open) found it, in the order of
    /// [`files`](Self::files): a caller that opens the same paths again later compares them to
    /// know it reads the same files ([`FileStamp::change_since`]).
    pub fn stamps(&self) -> &[FileStamp] {
        &self.stamps
    }

    /// `Changed` for the first file that is no longer as its open found it: every load looks
    /// before its first read and after its last, so that a file written in place under a
    /// long-lived checkpoint (a streamed model's), or during a load, is an error instead of
    /// weights that mix two versions.
    pub(crate) fn unchanged(&self) -> Result<(), CheckpointError> {
        for ((path, handle), first) in self.files.iter().zip(&self.handles).zip(&self.stamps) {
            let now = FileStamp::of(handle).map_err(|source| CheckpointError::Open { path: path.clone(), source })?;
            if let Some(change) = now.change_since(first) {
                return Err(CheckpointError::Changed { path: path.clone(), change });
            }
        }
        Ok(())
    }

    /// The open handle of file `file` (an index into [`files`](Self::files)): the file its
    /// open stamped, whatever is at the path now.
    pub(crate) fn handle(&self, file: usize) -> &File {
        &self.handles[file]
    }

    /// Every entry by name.
    pub fn entries(&self) -> &HashMap<String, Entry> {
        &self.entries
    }

    /// Drops the bytes of the entries `names` from the page cache (`posix_fadvise(DONTNEED)`
    /// over each range; pages other processes map stay): after a read, what reading past the
    /// cache leaves, so a model streamed from disk does not push other files out of memory and
    /// its next read comes from the disk. Names the checkpoint does not have are skipped; where
    /// the call does not exist (macOS) nothing is dropped.
    pub fn drop_cached<'a>(&self, names: impl IntoIterator<Item = &'a str>) -> Result<(), CheckpointError> {
        for entry_name in names {
            let Some(entry) = self.entries.get(entry_name) else { continue };
            self.drop_range(entry.file, entry.start, entry.end - entry.start, entry_name)?;
        }
        Ok(())
    }

    /// Drops `len` bytes of file `file` from `start` from the page cache (see
    /// [`drop_cached`](Self::drop_cached)); `tensor` names them in an error.
    fn drop_range(&self, file: usize, start: u64, len: u64, tensor: &str) -> Result<(), CheckpointError> {
        #[cfg(any(target_os = "linux", target_os = "android", target_os = "freebsd"))]
        if let (Some(handle), Ok(start), Ok(len)) = (self.handles.get(file), i64::try_from(start), i64::try_from(len)) {
            nix::fcntl::posix_fadvise(handle, start, len, nix::fcntl::PosixFadviseAdvice::POSIX_FADV_DONTNEED)
                .map_err(|errno| CheckpointError::Uncache {
                    tensor: tensor.to_string(),
                    path: self.files[file].clone(),
                    source: errno.into(),
                })?;
        }
        #[cfg(not(any(target_os = "linux", target_os = "android", target_os = "freebsd")))]
        let _ = (file, start, len, tensor);
        Ok(())
    }

    /// Checks `targets` against the files without copying anything; returns the entries to
    /// copy, in the targets' order.
    fn check<'a>(&'a self, targets: &[(String, Tensor)]) -> Result<Vec<&'a Entry>, CheckpointError> {
        let missing: Vec<String> =
            targets.iter().filter(|(name, _)| !self.entries.contains_key(name)).map(|(n, _)| n.clone()).collect();
        if !missing.is_empty() {
            return Err(CheckpointError::Missing { tensors: missing, files: self.files.clone() });
        }
        let mut plan = Vec::with_capacity(targets.len());
        for (name, target) in targets {
            let entry = &self.entries[name];
            let path = &self.files[entry.file];
            let expected = target.size();
            if expected != entry.shape {
                return Err(CheckpointError::Shape {
                    tensor: name.clone(),
                    path: path.clone(),
                    expected,
                    found: entry.shape.clone(),
                });
            }
            if !converts(entry.kind, target.kind()) {
                return Err(CheckpointError::Dtype {
                    tensor: name.clone(),
                    path: path.clone(),
                    expected: target.kind(),
                    found: entry.kind,
                });
            }
            let allocated = stageload_torch_sys::storage_info(target).is_ok_and(|i| i.allocated);
            if target.numel() > 0 && !allocated {
                return Err(CheckpointError::Unallocated { tensor: name.clone() });
            }
            plan.push(entry);
        }
        Ok(plan)
    }

    /// Copies the entry of each target's name into it, converting dtypes where they differ.
    /// Everything is checked first; on a check failure no target has changed. A read error (an
    /// I/O error, or a file truncated since [`Checkpoint::open`]) is an error too, but by then
    /// the targets may be partly written: load them again. (StagedModels never keeps a model
    /// whose load failed.)
    pub fn load_into(
        &self,
        targets: &[(String, Tensor)],
        progress: impl FnMut(Progress),
    ) -> Result<LoadReport, CheckpointError> {
        let Copied { bytes, mapped } = self.copy_all(targets, progress)?;
        let wanted: HashSet<&str> = targets.iter().map(|(n, _)| n.as_str()).collect();
        let mut unused: Vec<String> = self.entries.keys().filter(|n| !wanted.contains(n.as_str())).cloned().collect();
        unused.sort();
        Ok(LoadReport { bytes, tensors: targets.len(), unused, mapped })
    }

    /// Checks the targets, then copies every entry into its target.
    fn copy_all(
        &self,
        targets: &[(String, Tensor)],
        mut progress: impl FnMut(Progress),
    ) -> Result<Copied, CheckpointError> {
        let plan = self.check(targets)?;
        self.unchanged()?;
        let _watched = crate::copy_watch::copying(targets.iter().map(|(_, t)| t));
        let total: u64 = targets.iter().map(|(_, t)| (t.numel() * t.kind().elt_size_in_bytes()) as u64).sum();
        let done = AtomicU64::new(0);
        // Targets whose memory overlaps another's (tied weights) are copied one after the other,
        // in the caller's order, after the others.
        let overlapping = overlapping_targets(targets);
        let (direct, rest): (Vec<_>, Vec<_>) =
            targets.iter().zip(plan).enumerate().partition(|(i, ((_, target), entry))| {
                !overlapping.contains(i)
                    && target.device() == Device::Cpu
                    && target.kind() == entry.kind
                    && target.is_contiguous()
            });
        // Contiguous CUDA targets go through the pinned ring; the rest one by one through `copy_`.
        let (cuda, mut sequential): (Vec<_>, Vec<_>) =
            rest.into_iter().partition(|(_, ((_, target), _))| target.device().is_cuda() && target.is_contiguous());
        // Direct copies: every chunk of every entry is a job.
        let mut jobs = Vec::new();
        for (_, ((name, target), entry)) in &direct {
            let length = (entry.end - entry.start) as usize;
            if length == 0 {
                continue;
            }
            // The target is an allocated (checked), contiguous CPU tensor of the entry's kind and
            // shape (checked): its memory is exactly `length` bytes at data_ptr.
            // SAFETY: that memory is valid for writes of `length` bytes; no Rust reference to it
            // exists, and each job below writes a disjoint part of it, nothing else touches it.
            let memory = unsafe { std::slice::from_raw_parts_mut(target.data_ptr() as *mut u8, length) };
            for (i, chunk) in memory.chunks_mut(PIECE).enumerate() {
                jobs.push(Job { name, entry, offset: entry.start + (i * PIECE) as u64, memory: chunk });
            }
        }
        let mapped = self.run_jobs(jobs, &done, |done| progress(Progress { done, total }))?;
        let on_device: Vec<(&str, &Tensor, &Entry)> = cuda.iter().map(|(_, ((n, t), e))| (n.as_str(), t, *e)).collect();
        if let Err(reason) = self.copy_to_cuda(&on_device, &done, &mut |done| progress(Progress { done, total }))? {
            warn_pageable_once(&reason);
            sequential.extend(cuda);
        }
        let mut buffer = Vec::new();
        tch::no_grad(|| -> Result<(), CheckpointError> {
            for (_, ((name, target), entry)) in sequential {
                self.go_on(PieceWait::May)?;
                self.copy_converted(name, target, entry, &mut buffer)?;
                let bytes = (target.numel() * target.kind().elt_size_in_bytes()) as u64;
                progress(Progress { done: done.fetch_add(bytes, Ordering::Relaxed) + bytes, total });
            }
            Ok(())
        })?;
        // A stop that came during the last report ends the load stopped too.
        self.go_on(PieceWait::May)?;
        // Written while it was read: the targets may hold a mix of both versions.
        self.unchanged()?;
        Ok(Copied { bytes: total, mapped })
    }

    /// Like [`load_into`](Self::load_into), with the targets' names met under `rules`: file
    /// entries renamed, ignored entries skipped, and (when strict) any tensor without an entry or
    /// entry without a tensor refused before a byte is copied, with both sides' names and a
    /// suggested rule ([`NameMismatch`]). Lenient: what matches is loaded, the rest reported.
    pub fn load_named(
        &self,
        targets: &[(String, Tensor)],
        rules: &NameRules,
        progress: impl FnMut(Progress),
    ) -> Result<NamedLoad, CheckpointError> {
        let (renamed, report) = self.meet(targets, rules)?;
        self.copy_all(&renamed, progress)?;
        Ok(report)
    }

    /// The checks of [`load_named`](Self::load_named) (names under `rules`, shapes, dtypes,
    /// allocated targets), from the headers alone: nothing is read or copied. For a model whose
    /// weights came from elsewhere (a TorchScript file) and that this checkpoint refills later.
    pub fn check_named(&self, targets: &[(String, Tensor)], rules: &NameRules) -> Result<NamedLoad, CheckpointError> {
        let (renamed, report) = self.meet(targets, rules)?;
        self.check(&renamed)?;
        Ok(report)
    }

    /// Pairs a model's `tensors` with the files' entries under `rules`; a tensor without an
    /// entry whose bytes another paired tensor fills (tied weights: one storage, two names)
    /// needs none, and is reported as that tensor's alias. A strict model's mismatch is refused
    /// with both sides' names. The one matcher of checkpoint loads and of streamed models'
    /// set-up ([`crate::stream`]).
    pub(crate) fn match_entries(
        &self,
        tensors: &[(String, Tensor)],
        rules: &NameRules,
    ) -> Result<NameMatch, CheckpointError> {
        let names: Vec<&str> = tensors.iter().map(|(n, _)| n.as_str()).collect();
        let mut found = match_names(self.entries.keys().map(String::as_str), &names, rules)
            .map_err(|source| CheckpointError::Collision { files: self.files.clone(), source })?;
        if !found.missing.is_empty() {
            let filled: Vec<bool> = names.iter().map(|n| found.pairs.contains_key(*n)).collect();
            let views: Vec<&Tensor> = tensors.iter().map(|(_, t)| t).collect();
            let through = crate::storage::filled_through(&views, &filled)
                .map_err(|source| CheckpointError::Storage { files: self.files.clone(), source })?;
            for (i, via) in through.into_iter().enumerate() {
                if let Some(via) = via {
                    found.aliases.insert(names[i].to_string(), names[via].to_string());
                }
            }
            found.missing.retain(|name| !found.aliases.contains_key(name));
        }
        if rules.complete && !rules.strict && !found.missing.is_empty() {
            return Err(CheckpointError::Missing { tensors: found.missing, files: self.files.clone() });
        }
        if rules.strict && (!found.missing.is_empty() || !found.unused.is_empty()) {
            return Err(CheckpointError::Names { files: self.files.clone(), mismatch: NameMismatch::new(&found) });
        }
        Ok(found)
    }

    /// Meets the targets' names with the files' under `rules`: each matched target under the
    /// name of the entry that fills it, and the report of what matched (strict: a mismatch is
    /// an error).
    fn meet(
        &self,
        targets: &[(String, Tensor)],
        rules: &NameRules,
    ) -> Result<(Vec<(String, Tensor)>, NamedLoad), CheckpointError> {
        let found = self.match_entries(targets, rules)?;
        let renamed: Vec<(String, Tensor)> = targets
            .iter()
            .filter_map(|(n, t)| found.pairs.get(n).map(|entry| (entry.clone(), t.shallow_clone())))
            .collect();
        let converted = renamed
            .iter()
            .filter_map(|(entry, t)| {
                let from = self.entries.get(entry)?.kind;
                (from != t.kind()).then(|| format!("{entry}: {from:?} -> {:?}", t.kind()))
            })
            .collect();
        let report = NamedLoad {
            used: renamed.len(),
            converted,
            unused: found.unused,
            ignored: found.ignored,
            missing: found.missing,
            aliases: found.aliases,
        };
        Ok((renamed, report))
    }

    /// Reads each piece straight into its target, on [`readers`] threads, the caller's among
    /// them (only it calls `progress`, with the bytes done by all). The pieces, in file order,
    /// are split into one contiguous run per reader of about the same bytes, each read in order
    /// through the reader's own handles ([`OwnHandles`]): from the disk, each run is then a
    /// sequential stream with read-ahead of its own (`crates/bench/c/load-bench-cold-runs.c`:
    /// 1.11-1.25x the rate of readers taking pieces in turn through one handle). Returns the
    /// bytes copied from mappings.
    fn run_jobs(
        &self,
        mut jobs: Vec<Job<'_>>,
        done: &AtomicU64,
        mut progress: impl FnMut(u64),
    ) -> Result<u64, CheckpointError> {
        let threads = readers().min(jobs.len()).max(1);
        jobs.sort_by_key(|job| (job.entry.file, job.offset));
        let mut runs = contiguous_runs(jobs, threads).into_iter();
        let mine = runs.next().unwrap_or_default();
        let failed: Mutex<Option<CheckpointError>> = Mutex::new(None);
        // Set once a reader fails: the others stop at their next piece.
        let stop = AtomicBool::new(false);
        let mapped = AtomicU64::new(0);
        let work = |run: Vec<Job<'_>>, report: &mut dyn FnMut(u64)| {
            // One reader has no other to keep its read-ahead apart from.
            let mut handles = OwnHandles::new(self, threads > 1);
            let mut mapping = self.host_reads == HostRead::Mapped;
            let mut run = run.into_iter();
            loop {
                if stop.load(Ordering::Relaxed) {
                    return;
                }
                // A stop is looked for at every turn, the last (run done) too: a load the
                // caller's thread sees stopped ends stopped, whoever read the last pieces.
                let read = match (self.go_on(PieceWait::May), run.next()) {
                    (Err(stopped), _) => Err(stopped),
                    (Ok(()), None) => return,
                    (Ok(()), Some(job)) => self
                        .read_piece(handles.of(job.entry.file), job.entry.file, job.memory, job.offset, &mut mapping)
                        .inspect(|_| crate::copy_watch::piece())
                        .map(|from_mapping| {
                            let bytes = job.memory.len() as u64;
                            if from_mapping {
                                mapped.fetch_add(bytes, Ordering::Relaxed);
                            }
                            bytes
                        })
                        .map_err(|source| self.read_error(job.name, job.entry, source)),
                };
                let bytes = match read {
                    Ok(bytes) => bytes,
                    Err(err) => {
                        lock(&failed).get_or_insert(err);
                        stop.store(true, Ordering::Relaxed);
                        return;
                    }
                };
                report(done.fetch_add(bytes, Ordering::Relaxed) + bytes);
            }
        };
        std::thread::scope(|scope| {
            for run in runs {
                scope.spawn(|| work(run, &mut |_| {}));
            }
            work(mine, &mut progress);
        });
        if let Some(err) = failed.into_inner().unwrap_or_else(|e| e.into_inner()) {
            return Err(err);
        }
        // The other threads may have finished the last pieces.
        progress(done.load(Ordering::Relaxed));
        Ok(mapped.into_inner())
    }

    /// Copies an entry through libtorch's `copy_` (dtype conversion, other devices, strided or
    /// tied targets): a window of whole rows (along the first dimension) at a time is read into
    /// `buffer` and copied into the same rows of the target.
    fn copy_converted(
        &self,
        name: &str,
        target: &Tensor,
        entry: &Entry,
        buffer: &mut Vec<u8>,
    ) -> Result<(), CheckpointError> {
        let length = (entry.end - entry.start) as usize;
        if length == 0 {
            return Ok(());
        }
        let copy_error =
            |source| CheckpointError::Copy { tensor: name.to_string(), path: self.files[entry.file].clone(), source };
        let rows = entry.shape.first().copied().unwrap_or(1).max(1) as usize;
        let row_bytes = length / rows;
        let step = (WINDOW / row_bytes).max(1);
        for first in (0..rows).step_by(step) {
            let count = step.min(rows - first);
            buffer.resize(count * row_bytes, 0);
            crate::copy_watch::piece();
            let file = &self.handles[entry.file];
            file.read_exact_at(buffer, entry.start + (first * row_bytes) as u64)
                .map_err(|source| self.read_error(name, entry, source))?;
            let mut shape = entry.shape.clone();
            let mut destination = match shape.first_mut() {
                Some(dim) => {
                    *dim = count as i64;
                    target.f_narrow(0, first as i64, count as i64).map_err(copy_error)?
                }
                None => target.shallow_clone(),
            };
            // SAFETY: `buffer` holds exactly the `count` rows of `entry.kind` that `shape` and its
            // contiguous strides span, and outlives `source` (dropped at the end of this
            // iteration); libtorch only reads from the source of copy_.
            let source = unsafe {
                Tensor::f_from_blob(buffer.as_ptr(), &shape, &contiguous_strides(&shape), entry.kind, Device::Cpu)
            }
            .map_err(copy_error)?;
            // A kind the target's device cannot hold (float64 on MPS) converts on the host.
            let source = match device_holds(target.device(), entry.kind) {
                true => source,
                false => source.f_to_kind(target.kind()).map_err(copy_error)?,
            };
            destination.f_copy_(&source).map_err(copy_error)?;
        }
        Ok(())
    }

    fn read_error(&self, name: &str, entry: &Entry, source: std::io::Error) -> CheckpointError {
        CheckpointError::Read { tensor: name.to_string(), path: self.files[entry.file].clone(), source }
    }
}

/// Indexes of the CPU targets whose memory overlaps another's: each target spans from its first
/// element to its last, whatever its strides.
fn overlapping_targets(targets: &[(String, Tensor)]) -> HashSet<usize> {
    let ranges: Vec<(usize, usize)> = targets
        .iter()
        .map(|(_, t)| {
            if t.device() != Device::Cpu || t.numel() == 0 {
                return (0, 0);
            }
            let last: i64 = t.size().iter().zip(t.stride()).map(|(size, stride)| (size - 1) * stride).sum();
            let start = t.data_ptr() as usize;
            (start, start + (last as usize + 1) * t.kind().elt_size_in_bytes())
        })
        .collect();
    overlapping_ranges(&ranges)
}

/// Indexes of the non-empty byte ranges `[start, end)` that overlap another.
fn overlapping_ranges(ranges: &[(usize, usize)]) -> HashSet<usize> {
    let mut order: Vec<usize> = (0..ranges.len()).filter(|&i| ranges[i].1 > ranges[i].0).collect();
    order.sort_unstable_by_key(|&i| ranges[i]);
    let mut overlapping = HashSet::new();
    let mut furthest: Option<(usize, usize)> = None; // (end, index) of the range reaching furthest so far
    for i in order {
        let (start, end) = ranges[i];
        match furthest {
            Some((reach, owner)) if start < reach => {
                overlapping.extend([owner, i]);
                if end > reach {
                    furthest = Some((end, i));
                }
            }
            _ => furthest = Some((end, i)),
        }
    }
    overlapping
}

/// Largest piece read at once through `copy_` (dtype conversion, strided targets): the
/// conversion buffer's size.
const WINDOW: usize = device_copy::WINDOW;

/// Largest piece of a direct copy (one `pread` into the target). Small enough that a streamed
/// block of a few tensors gives each of the [`readers`] several pieces, so that a cold read keeps
/// them all busy to its end: reading 48 MiB blocks from this machine's disk with 4 threads, 4 MiB
/// pieces gave 1.14-1.55 GB/s (median 1.42) against 1.07-1.34 (1.31) with 16 MiB ones, and 8 MiB
/// ones (a second round of two pieces) less than either; from the page cache the piece size
/// changed nothing measurable.
pub const PIECE: usize = 4 << 20;

/// Says once per process that CUDA loads take the pageable path.
fn warn_pageable_once(reason: &crate::HostCopyError) {
    static WARNED: std::sync::Once = std::sync::Once::new();
    WARNED
        .call_once(|| tracing::warn!(%reason, "no pinned host memory: CUDA loads go through pageable copies (slower)"));
}
/// Threads that read at once: two per core, at most 8. A cold read spends most of its time
/// waiting on the disk, which serves more with more requests in flight: on 2 cores, 4 readers
/// read cold at 0.97-0.98x the one-thread `pread` loop's rate against 0.81-0.84x with 2, warm
/// unchanged within the runs' spread (`traces/archive/load-bench-cold.md`).
pub fn readers() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get()).saturating_mul(2).min(8)
}

/// `jobs` split, in order, into at most `runs` contiguous runs of about the same bytes (a run
/// ends at the first piece that takes it to its share).
fn contiguous_runs(jobs: Vec<Job<'_>>, runs: usize) -> Vec<Vec<Job<'_>>> {
    let total: usize = jobs.iter().map(|job| job.memory.len()).sum();
    let share = total.div_ceil(runs.max(1)).max(1);
    let mut split: Vec<Vec<Job<'_>>> = vec![Vec::new()];
    let mut bytes = 0usize;
    for job in jobs {
        let full = bytes >= share.saturating_mul(split.len());
        if full && split.len() < runs {
            split.push(Vec::new());
        }
        bytes = bytes.saturating_add(job.memory.len());
        if let Some(run) = split.last_mut() {
            run.push(job);
        }
    }
    split
}

/// A reader's handles on the checkpoint's files: each file opened again, once, on first use,
/// through `/proc/self/fd` (the same file even if its path now names another), so that the
/// kernel keeps the reader's read-ahead apart from the other readers'. Where that open fails
/// (no `/proc`), or when the reader is the load's only one, the checkpoint's shared handle.
struct OwnHandles<'a> {
    checkpoint: &'a Checkpoint,
    /// Per file: not opened yet, or what opening it again gave. Empty: the shared handles.
    own: Vec<Option<Option<File>>>,
}

impl<'a> OwnHandles<'a> {
    fn new(checkpoint: &'a Checkpoint, reopen: bool) -> Self {
        let files = if reopen { checkpoint.handles.len() } else { 0 };
        Self { checkpoint, own: (0..files).map(|_| None).collect() }
    }

    fn of(&mut self, file: usize) -> &File {
        let shared = &self.checkpoint.handles[file];
        match self.own.get_mut(file) {
            Some(own) => own.get_or_insert_with(|| reopen(shared, 0)).as_ref().unwrap_or(shared),
            None => shared,
        }
    }
}

/// A new open file description of `file`'s own file (Linux) with the open `flags` added, or
/// `None`.
fn reopen(file: &File, flags: i32) -> Option<File> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let path = format!("/proc/self/fd/{}", file.as_raw_fd());
    let again = std::fs::OpenOptions::new().read(true).custom_flags(flags).open(path).ok()?;
    let (first, second) = (file.metadata().ok()?, again.metadata().ok()?);
    (first.dev() == second.dev() && first.ino() == second.ino()).then_some(again)
}

/// What a load copied: all its bytes, and those of them copied from mappings.
struct Copied {
    bytes: u64,
    mapped: u64,
}

/// One piece of a direct copy: `memory.len()` bytes of the file at `offset` into `memory`.
struct Job<'a> {
    name: &'a str,
    entry: &'a Entry,
    offset: u64,
    memory: &'a mut [u8],
}

fn contiguous_strides(shape: &[i64]) -> Vec<i64> {
    let mut strides = vec![1i64; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1].max(1);
    }
    strides
}

#[cfg(test)]
mod tests {
    use super::{contiguous_runs, overlapping_ranges, reopen, Entry, Job};
    use std::os::unix::fs::FileExt;

    #[test]
    fn pieces_are_split_into_contiguous_runs_of_about_the_same_bytes_in_order() {
        let entry = Entry { file: 0, kind: tch::Kind::Uint8, shape: vec![100], start: 0, end: 100 };
        let mut memory = vec![0u8; 100];
        // Pieces of 10, 10, 10, 10, 10, 10, 10, 30 bytes at offsets 0, 10, ...
        let mut rest = memory.as_mut_slice();
        let mut jobs = Vec::new();
        let mut offset = 0;
        for size in [10, 10, 10, 10, 10, 10, 10, 30] {
            let (piece, after) = rest.split_at_mut(size);
            jobs.push(Job { name: "t", entry: &entry, offset, memory: piece });
            (rest, offset) = (after, offset + size as u64);
        }
        let offsets = |runs: &[Vec<Job<'_>>]| -> Vec<Vec<u64>> {
            runs.iter().map(|run| run.iter().map(|job| job.offset).collect()).collect()
        };
        let runs = contiguous_runs(jobs, 3);
        // Shares of 34 bytes: a run ends at the piece that takes it to 34, 68.
        assert_eq!(offsets(&runs), vec![vec![0, 10, 20, 30], vec![40, 50, 60], vec![70]]);
        let runs = contiguous_runs(runs.into_iter().flatten().collect(), 1);
        assert_eq!(offsets(&runs), vec![vec![0, 10, 20, 30, 40, 50, 60, 70]]);
        // More runs than pieces: no empty run.
        let runs = contiguous_runs(runs.into_iter().flatten().take(2).collect(), 8);
        assert_eq!(offsets(&runs), vec![vec![0], vec![10]]);
        assert_eq!(contiguous_runs(Vec::new(), 4).len(), 1, "no pieces: one empty run, for the caller's thread");
    }

    #[test]
    fn a_reader_opens_the_checkpoints_own_file_again_even_when_its_path_now_names_another() {
        let folder = tempfile::TempDir::new().unwrap();
        let path = folder.path().join("model.safetensors");
        std::fs::write(&path, b"the checkpoint").unwrap();
        let file = std::fs::File::open(&path).unwrap();
        std::fs::rename(&path, folder.path().join("old")).unwrap();
        std::fs::write(&path, b"another file").unwrap();
        let again = reopen(&file, 0).expect("/proc/self/fd is there on Linux");
        let mut bytes = [0u8; 14];
        again.read_exact_at(&mut bytes, 0).unwrap();
        assert_eq!(&bytes, b"the checkpoint");
    }

    #[test]
    fn overlapping_ranges_are_found_and_touching_or_empty_ones_are_not() {
        let set = |v: &[usize]| v.iter().copied().collect::<std::collections::HashSet<_>>();
        assert_eq!(overlapping_ranges(&[(0, 10), (10, 20), (30, 40)]), set(&[]), "touching is not overlapping");
        assert_eq!(overlapping_ranges(&[(0, 10), (0, 10)]), set(&[0, 1]), "one tensor under two names");
        assert_eq!(
            overlapping_ranges(&[(50, 60), (0, 100), (10, 20), (200, 210)]),
            set(&[0, 1, 2]),
            "inside a larger one, any order"
        );
        assert_eq!(overlapping_ranges(&[(0, 10), (5, 15), (12, 20)]), set(&[0, 1, 2]), "a chain");
        assert_eq!(overlapping_ranges(&[(5, 5), (0, 10)]), set(&[]), "an empty range overlaps nothing");
    }
}
