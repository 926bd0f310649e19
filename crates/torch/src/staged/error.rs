//! The registry's errors. Each names the model or stage involved and says what to do. They
//! live here, apart from the files that raise them, so that every file of the registry can
//! name them without importing another's.

use std::path::PathBuf;

use stageload_torch_sys::ShimError;

use crate::checkpoint::CheckpointError;

/// A loader's own error.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Errors of StagedModels. Each names the model or stage involved and says what to do.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StageError {
    /// No model of that name was defined.
    #[error("unknown model '{name}'; known models: {known:?}")]
    UnknownModel {
        /// The name asked for.
        name: String,
        /// The registry's models, in definition order.
        known: Vec<String>,
    },
    /// No stage of that name is in the plan.
    #[error("unknown stage '{stage}'; known stages: {known:?}")]
    UnknownStage {
        /// The stage asked for.
        stage: String,
        /// The plan's stages.
        known: Vec<String>,
    },
    /// The pipeline file's entry for a model does not fit the model as defined.
    #[error("pipeline file, model '{model}': {message}")]
    PlanMismatch {
        /// The model the file describes.
        model: String,
        /// What does not fit.
        message: String,
    },
    /// A pin's `from`/`until` stages do not make a span of the plan.
    #[error("{source}")]
    PinSpan {
        /// The pinned model.
        model: String,
        /// Why the span is refused (it names the model, the stages given and the sequence).
        source: stageload_plan::pipeline::PinError,
    },
    /// The plan lists models that were never given a loader.
    #[error("the plan names models that have no loader: {}", .names.join(", "))]
    PlanWithoutLoader {
        /// The models without a loader.
        names: Vec<String>,
    },
    /// The snapshot folder cannot be created, locked or written.
    #[error("{source}; name a folder this process can write to, or leave snapshot_dir out")]
    SnapshotDir {
        /// The folder given to `snapshot_dir`.
        path: std::path::PathBuf,
        /// What failed, with the system's reason.
        source: SnapshotError,
    },
    /// Two specs share one name.
    #[error("model '{name}' is defined twice")]
    DuplicateModel {
        /// The name defined twice.
        name: String,
    },
    /// A handle was used after its model was released.
    #[error("'{model}' was released{} and its weights are gone. Get the model from the StagedModels registry again instead of keeping a handle to it.", at_stage(.stage))]
    Released {
        /// The released model.
        model: String,
        /// The stage whose entry released it, if a stage did.
        stage: Option<String>,
    },
    /// A model inserted without a loader was released and cannot be rebuilt.
    #[error("'{model}' was registered without a loader and released{}; it cannot come back. Give it a loader (or a checkpoint) to reload it.", at_stage(.stage))]
    NoLoader {
        /// The model.
        model: String,
        /// The stage whose entry released it, if a stage did.
        stage: Option<String>,
    },
    /// A load was asked for after `close`.
    #[error("the registry is closed; '{model}' cannot be loaded any more")]
    Closed {
        /// The model asked for.
        model: String,
    },
    /// A strict registry was asked for a model the current stage does not list.
    #[error("'{model}' was asked for in stage '{stage}', which does not list it, and the registry is strict; add it to the stage or pin it")]
    OutsideStage {
        /// The model asked for.
        model: String,
        /// The current stage.
        stage: String,
    },
    /// The model's loader returned an error.
    #[error("loader of '{model}' failed: {source}")]
    LoaderFailed {
        /// The model being built.
        model: String,
        /// The loader's error.
        source: BoxError,
    },
    /// The model's loader panicked (caught; the registry stays usable).
    #[error("loader of '{model}' panicked: {message}")]
    LoaderPanicked {
        /// The model being built.
        model: String,
        /// The panic's text.
        message: String,
    },
    /// The closure given to [`StagedModels::call`](crate::StagedModels::call) panicked.
    #[error("the call on '{model}' panicked: {message} (the model is unlocked and the registry usable)")]
    CallPanicked {
        /// The model called.
        model: String,
        /// The panic's text.
        message: String,
    },
    /// The model is not of the type asked for.
    #[error("'{model}' holds a {actual}, not the {expected} asked for")]
    WrongType {
        /// The model asked for.
        model: String,
        /// The type name asked for.
        expected: &'static str,
        /// The type name the model has.
        actual: &'static str,
    },
    /// The thread already holds this model's guard.
    #[error("'{model}' is already locked by this thread; use the ModelGuard you hold instead of locking it again")]
    LockedTwice {
        /// The model locked twice.
        model: String,
    },
    /// Building, refilling or calling the model ran out of device memory.
    #[error("'{model}' does not fit in the device's memory{}: {message}. Release or unpin models first, stream blocks, or turn on StagedModelsBuilder::on_out_of_memory(OutOfMemory::ReleaseOthersAndRetry)", at_stage(.stage))]
    OutOfMemory {
        /// The model that did not fit.
        model: String,
        /// The current stage, if any.
        stage: Option<String>,
        /// libtorch's message.
        message: String,
    },
    /// The model's checkpoint could not be read or loaded.
    #[error("checkpoint of '{model}': {source}")]
    Checkpoint {
        /// The model being filled.
        model: String,
        /// The checkpoint's error.
        source: Box<CheckpointError>,
    },
    /// A file the model was first loaded from changed since (see [`crate::source`]): nothing
    /// was filled, the model stays as it was, and the registry goes on.
    #[error(transparent)]
    SourceChanged(#[from] crate::source::SourceChanged),
    /// A file whose pages a resident model held ([`Reload::Map`](super::Reload::Map)) was
    /// written in place, so the model's weights may have changed with it: the registry released
    /// the model instead of handing it out. Its next load meets the file like any reload
    /// ([`StageError::SourceChanged`] until the first file is back or the new one accepted).
    #[error("{source}; the model held that file's pages (Reload::Map), so its weights may have changed with it: it was released before any further use")]
    ChangedUnderModel {
        /// The file and what changed.
        source: crate::source::SourceChanged,
    },
    /// A storage operation through the shim failed (release, reallocation, copy).
    #[error("'{model}': {source}")]
    Torch {
        /// The model whose storages were involved.
        model: String,
        /// The shim's error.
        source: ShimError,
    },
    /// Saving or restoring the random generators around a build failed.
    #[error("saving or restoring random generators: {0}")]
    Rng(ShimError),
    /// Installing the host block cache failed (see [`super::StagedModelsBuilder::cache_host_blocks`]).
    #[error("installing the host block cache: {0}; build with StagedModelsBuilder::cache_host_blocks(false) to run without it")]
    HostCache(ShimError),
    /// A copy into or out of the host tier failed.
    #[error("host tier, model '{model}': {source}")]
    HostTier {
        /// The model being copied.
        model: String,
        /// What failed.
        source: crate::HostCopyError,
    },
    /// A tier model is larger than the host tier's whole budget.
    #[error("host tier budget of {} is smaller than model '{model}' ({} on its device): raise the budget to at least that, or leave the model out of the tier by placing it on the CPU", fmt_bytes(*.budget), fmt_bytes(*.bytes))]
    HostTierTooSmall {
        /// The model.
        model: String,
        /// The model's weights in bytes.
        bytes: u64,
        /// The tier's budget in bytes.
        budget: u64,
    },
    /// A new host tier budget was refused; the old one stays.
    #[error("host tier budget of {} refused: copies in flight or of pinned models hold {}; the budget stays {}", fmt_bytes(*.asked), fmt_bytes(*.protected), fmt_bytes(*.budget))]
    HostTierBudget {
        /// The budget asked for, in bytes.
        asked: u64,
        /// Bytes held by copies that cannot be evicted (in flight, or of pinned models).
        protected: u64,
        /// The budget kept, in bytes.
        budget: u64,
    },
}

/// What went wrong with the snapshot folder or a snapshot.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SnapshotError {
    /// The folder could not be made.
    #[error("snapshot folder {}: cannot create it: {source}", .dir.display())]
    CreateDir {
        /// The folder.
        dir: PathBuf,
        /// The system's reason.
        source: std::io::Error,
    },
    /// The registry's lock file could not be made or locked.
    #[error("snapshot folder {}: cannot {} its lock file {}: {source}", .dir.display(), if *.created { "lock" } else { "create" }, .path.display())]
    LockFile {
        /// The folder.
        dir: PathBuf,
        /// The lock file.
        path: PathBuf,
        /// It was made, and locking it failed.
        created: bool,
        /// The system's reason.
        source: std::io::Error,
    },
    /// The folder's free space could not be read.
    #[error("cannot read the free space of {}: {source}", .dir.display())]
    FreeSpace {
        /// The folder.
        dir: PathBuf,
        /// The system's reason.
        source: nix::Error,
    },
    /// The snapshot would leave less than the keep-free bytes free.
    #[error("{} has {} free, and the snapshot of {} would leave less than {} free", .dir.display(), fmt_bytes(*.free), fmt_bytes(*.bytes), fmt_bytes(*.keep_free))]
    NoRoom {
        /// The folder.
        dir: PathBuf,
        /// Bytes free there.
        free: u64,
        /// The snapshot's bytes.
        bytes: u64,
        /// The bytes a write leaves free.
        keep_free: u64,
    },
    /// Writing the file failed.
    #[error(transparent)]
    Write(Box<crate::checkpoint::CheckpointError>),
    /// The model's storages could not be read.
    #[error("reading its storages failed: {0}")]
    Storages(#[source] stageload_torch_sys::ShimError),
    /// Some of the model's tensors have no memory (released meanwhile).
    #[error("{count} of its tensors have no memory now")]
    Unallocated {
        /// How many.
        count: usize,
    },
}

fn fmt_bytes(bytes: u64) -> String {
    stageload_units::format_bytes(bytes)
}

fn at_stage(stage: &Option<String>) -> String {
    stage.as_ref().map(|s| format!(" when entering stage '{s}'")).unwrap_or_default()
}

pub(crate) type Result<T, E = StageError> = std::result::Result<T, E>;
