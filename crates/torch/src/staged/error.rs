//! The registry's errors. Each names the model or stage involved and says what to do.

use stageload_torch_sys::ShimError;

use crate::checkpoint::CheckpointError;

/// A loader's own error.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Errors of StagedModels. Each names the model or stage involved and says what to do.
#[derive(Debug, thiserror::Error)]
pub enum StageError {
    #[error("unknown model '{name}'; known models: {known:?}")]
    UnknownModel { name: String, known: Vec<String> },
    #[error("unknown stage '{stage}'; known stages: {known:?}")]
    UnknownStage { stage: String, known: Vec<String> },
    #[error("pipeline file, model '{model}': {message}")]
    PlanMismatch { model: String, message: String },
    #[error("pin of '{model}': {message}")]
    PinSpan { model: String, message: String },
    #[error("the plan names models that have no loader: {}", .names.join(", "))]
    PlanWithoutLoader { names: Vec<String> },
    #[error("{message}; name a folder this process can write to, or leave snapshot_dir out")]
    SnapshotDir { path: std::path::PathBuf, message: String },
    #[error("model '{name}' is defined twice")]
    DuplicateModel { name: String },
    #[error("'{model}' was released{} and its weights are gone. Get the model from the StagedModels registry again instead of keeping a handle to it.", at_stage(.stage))]
    Released { model: String, stage: Option<String> },
    #[error("'{model}' was registered without a loader and released{}; it cannot come back. Give it a loader (or a checkpoint) to reload it.", at_stage(.stage))]
    NoLoader { model: String, stage: Option<String> },
    #[error("the registry is closed; '{model}' cannot be loaded any more")]
    Closed { model: String },
    #[error("'{model}' was asked for in stage '{stage}', which does not list it, and the registry is strict; add it to the stage or pin it")]
    OutsideStage { model: String, stage: String },
    #[error("loader of '{model}' failed: {source}")]
    LoaderFailed { model: String, source: BoxError },
    #[error("loader of '{model}' panicked: {message}")]
    LoaderPanicked { model: String, message: String },
    #[error("the call on '{model}' panicked: {message} (the model is unlocked and the registry usable)")]
    CallPanicked { model: String, message: String },
    #[error("'{model}' holds a {actual}, not the {expected} asked for")]
    WrongType { model: String, expected: &'static str, actual: &'static str },
    #[error("'{model}' is already locked by this thread; use the ModelGuard you hold instead of locking it again")]
    LockedTwice { model: String },
    #[error("'{model}' does not fit in the device's memory{}: {message}. Release or unpin models first, stream blocks, or turn on StagedModelsBuilder::on_out_of_memory(OutOfMemory::ReleaseOthersAndRetry)", at_stage(.stage))]
    OutOfMemory { model: String, stage: Option<String>, message: String },
    #[error("checkpoint of '{model}': {source}")]
    Checkpoint { model: String, source: Box<CheckpointError> },
    #[error("'{model}': {source}")]
    Torch { model: String, source: ShimError },
    #[error("saving or restoring random generators: {0}")]
    Rng(ShimError),
    #[error("host tier, model '{model}': {message}")]
    HostTier { model: String, message: String },
    #[error("host tier budget of {} is smaller than model '{model}' ({} on its device): raise the budget to at least that, or leave the model out of the tier by placing it on the CPU", fmt_bytes(*.budget), fmt_bytes(*.bytes))]
    HostTierTooSmall { model: String, bytes: u64, budget: u64 },
    #[error("host tier budget of {} refused: copies in flight or of pinned models hold {}; the budget stays {}", fmt_bytes(*.asked), fmt_bytes(*.protected), fmt_bytes(*.budget))]
    HostTierBudget { asked: u64, protected: u64, budget: u64 },
}

fn fmt_bytes(bytes: u64) -> String {
    stageload_units::format_bytes(bytes)
}

fn at_stage(stage: &Option<String>) -> String {
    stage.as_ref().map(|s| format!(" when entering stage '{s}'")).unwrap_or_default()
}

pub(crate) type Result<T, E = StageError> = std::result::Result<T, E>;
