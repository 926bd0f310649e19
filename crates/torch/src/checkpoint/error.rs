//! Why a checkpoint could not be read, loaded or written. Apart from the reader, so that the
//! host copies' error ([`crate::HostCopyError`]), which wraps a checkpoint read, names it
//! without importing the reader (which copies through the host copies' ring).

use std::path::PathBuf;

use tch::Kind;

use crate::names::{Collision, NameMismatch};
use crate::source::FileChange;

/// Why a checkpoint could not be read or loaded. Each variant names the file and the tensor.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CheckpointError {
    /// A file could not be opened or its header read.
    #[error("cannot open checkpoint {path}: {source}")]
    Open {
        /// The file.
        path: PathBuf,
        /// The system's error.
        source: std::io::Error,
    },
    /// A file's header is not valid safetensors (the file may be truncated or corrupt).
    #[error(
        "checkpoint {path} is not a valid safetensors file ({reason}); it may be truncated or corrupt: write it again"
    )]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: stageload_input::HeaderError,
    },
    /// An entry's dtype has no libtorch kind.
    #[error("tensor '{tensor}' in {path} has dtype {dtype}, which stageload does not load")]
    UnsupportedDtype {
        /// The file.
        path: PathBuf,
        /// The entry's name.
        tensor: String,
        /// The entry's safetensors dtype.
        dtype: String,
    },
    /// Two files hold an entry of the same name.
    #[error("tensor '{tensor}' is in two checkpoint files: {first} and {second}")]
    DuplicateTensor {
        /// The entry's name.
        tensor: String,
        /// The file that holds it first.
        first: PathBuf,
        /// The other file that holds it.
        second: PathBuf,
    },
    /// Targets have no entry in any of the files.
    #[error("the model's tensor(s) {} are in none of the checkpoint files {}", quoted(tensors), paths(files))]
    Missing {
        /// The targets' names.
        tensors: Vec<String>,
        /// The checkpoint's files.
        files: Vec<PathBuf>,
    },
    /// A target's shape differs from its entry's.
    #[error("tensor '{tensor}': the model expects shape {expected:?}, {path} has {found:?}")]
    Shape {
        /// The target's name.
        tensor: String,
        /// The file holding the entry.
        path: PathBuf,
        /// The target's shape.
        expected: Vec<i64>,
        /// The entry's shape.
        found: Vec<i64>,
    },
    /// An entry's kind does not convert to its target's without loss.
    #[error(
        "tensor '{tensor}': the model expects {expected:?}, {path} has {found:?}, which does not convert without loss"
    )]
    Dtype {
        /// The target's name.
        tensor: String,
        /// The file holding the entry.
        path: PathBuf,
        /// The target's kind.
        expected: Kind,
        /// The entry's kind.
        found: Kind,
    },
    /// A target's storage is freed (released and not reallocated).
    #[error("tensor '{tensor}' has no storage to load into (released and not reallocated)")]
    Unallocated {
        /// The target's name.
        tensor: String,
    },
    /// libtorch's copy into a target failed.
    #[error("copying tensor '{tensor}' from {path} failed: {source}")]
    Copy {
        /// The target's name.
        tensor: String,
        /// The file holding the entry.
        path: PathBuf,
        /// libtorch's error.
        source: tch::TchError,
    },
    /// Two entries rename to the same target.
    #[error("checkpoint {}: {source}", paths(files))]
    Collision {
        /// The checkpoint's files.
        files: Vec<PathBuf>,
        /// The entries that collide.
        source: Collision,
    },
    /// Under strict name rules, entries and targets do not meet one to one.
    #[error("checkpoint {}: {mismatch}", paths(files))]
    Names {
        /// The checkpoint's files.
        files: Vec<PathBuf>,
        /// The names that did not meet, with suggestions.
        mismatch: NameMismatch,
    },
    /// A copy through the pinned ring to a CUDA target failed.
    #[error("copying tensor '{tensor}' from {path} to the GPU failed: {source}")]
    Stream {
        /// The target's name.
        tensor: String,
        /// The file holding the entry.
        path: PathBuf,
        /// The shim's error.
        source: stageload_torch_sys::ShimError,
    },
    /// Reading an entry's bytes failed.
    #[error("reading tensor '{tensor}' from {path} failed: {source}")]
    Read {
        /// The entry's name.
        tensor: String,
        /// The file.
        path: PathBuf,
        /// The system's error.
        source: std::io::Error,
    },
    /// Dropping an entry's pages from the page cache failed (an uncached load).
    #[error("dropping tensor '{tensor}' of {path} from the page cache failed: {source}")]
    Uncache {
        /// The entry's name.
        tensor: String,
        /// The file.
        path: PathBuf,
        /// The system's error.
        source: std::io::Error,
    },
    /// A tensor could not be written into a checkpoint file.
    #[error("cannot write {path}: {reason}")]
    Save {
        /// The file being written.
        path: PathBuf,
        /// What failed.
        reason: SaveFailure,
    },
    /// Writing a checkpoint file failed.
    #[error("cannot write {path}: {source}")]
    Write {
        /// The file being written.
        path: PathBuf,
        /// The system's error.
        source: std::io::Error,
    },
    /// The storages behind the targets could not be read (to find tied weights).
    #[error("checkpoint {}: reading the model's storages failed: {source}", paths(files))]
    Storage {
        /// The checkpoint's files.
        files: Vec<PathBuf>,
        /// The shim's error.
        source: stageload_torch_sys::ShimError,
    },
    /// A file is no longer what [`Checkpoint::open`](super::Checkpoint::open) found (see
    /// [`crate::source`]): written, resized or replaced since, or while it was read.
    #[error("checkpoint {path} changed since it was opened: {change}; what a load read from it may mix its old and new bytes: load it again once it is written")]
    Changed {
        /// The file.
        path: PathBuf,
        /// What changed.
        change: FileChange,
    },
    /// The load's hook ([`Checkpoint::before_each_piece`](super::Checkpoint::before_each_piece),
    /// [`Checkpoint::stop_when`](super::Checkpoint::stop_when)) said no before its end.
    #[error("loading from {} was stopped before its end (the targets are partly written)", paths(files))]
    Stopped {
        /// The checkpoint's files.
        files: Vec<PathBuf>,
    },
}

/// Why a tensor could not be saved.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SaveFailure {
    /// Its kind has no safetensors dtype.
    #[error("tensor '{tensor}' has unsupported kind {kind:?}")]
    UnsupportedKind {
        /// The tensor's name.
        tensor: String,
        /// Its kind.
        kind: tch::Kind,
    },
    /// Its bytes could not be read (a device copy failed).
    #[error("reading tensor '{tensor}': {source}")]
    Read {
        /// The tensor's name.
        tensor: String,
        /// libtorch's error.
        source: tch::TchError,
    },
    /// The safetensors writer failed.
    #[error(transparent)]
    Writer(safetensors::SafeTensorError),
}

/// The names, quoted and comma-separated (error messages).
pub(crate) fn quoted(names: &[String]) -> String {
    names.iter().map(|n| format!("'{n}'")).collect::<Vec<_>>().join(", ")
}

/// The paths, comma-separated (error messages).
pub(crate) fn paths(files: &[PathBuf]) -> String {
    files.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
}
