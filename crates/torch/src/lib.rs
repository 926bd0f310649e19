//! stageload: run a multi-model libtorch pipeline with only the current stage's weights in
//! memory, and get the same results bit for bit as loading everything up front.
//!
//! - [`StagedModels`] (module [`staged`]): named models built on first use, released in place
//!   when a stage that does not list them begins, reloaded in place from their checkpoint.
//! - [`rng`]: every generator's state preserved around each build, so lazy loading never shifts
//!   the noise a seeded run draws.
//! - [`checkpoint`]: safetensors files mapped and copied once into the model's storage.
//! - [`names`]: how a checkpoint's entry names meet a model's (rename, ignore, strictness).
//! - [`copy_watch`]: a test mode that slows every copy and watches the storages copies use.
//! - [`device`]: devices by name, both ways (pipeline files, flags, traces).
//! - [`stream`]: models bigger than their memory budget: a resident prefix of blocks, the rest
//!   refilled in place from the checkpoint before they run and freed after.
//! - [`script`]: TorchScript modules as models (`ModelSpec::torchscript`), their parameters
//!   and buffers as their tensors.
//! - [`pt2`]: AOTInductor packages as models (`ModelSpec::pt2`), their constants stageload's own
//!   tensors, released and refilled in place like any model's.
//! - [`Shared`]: a value several owners share and lock (a component two models hold, a seeded
//!   generator).
//! - [`hook`]: enter a stage when a module or closure you do not own is called.
//! - [`latents`]: a run's latents recorded at stage ends: fingerprints, and the tensors in a file
//!   for comparing runs by size.
//! - events ([`Event`], [`EventSink`]): what happened, typed, for traces and tests.
//! - [`meter`]: a run's memory and events as a JSONL trace (the meter of `stageload-trace`).
//!
//! Private mechanisms: `storage` (release and reallocation of a model's storages through the
//! shim; its [`ReleaseStats`] is public), `device_copy` (checkpoint entries into CUDA tensors
//! through a ring of pinned buffers; its [`checkpoint::RingShape`] is public), `pinned` (host
//! tier memory), `sync` (the shared-handle type and the lock helper), `error` (what the
//! registry's and the streamer's errors share: a caught panic's text, and whether a libtorch
//! message is an out-of-memory), and `staged`'s slot state machine.

#![warn(missing_docs)]

pub mod checkpoint;
pub mod copy_watch;
pub mod device;
mod device_copy;
mod error;
pub mod hook;
pub mod latents;
pub mod meter;
pub mod names;
mod pinned;
pub mod pt2;
pub mod rng;
pub mod script;
pub mod staged;
mod storage;
pub mod stream;
mod sync;

pub use checkpoint::CheckpointError;
pub use names::NameRules;
pub use rng::SharedRng;
pub use staged::{
    named_tensors, BoxError, BuildContext, Built, Handle, ModelGuard, ModelSpec, ModelState, OutOfMemory, StageError,
    StagedModels, StagedModelsBuilder,
};
/// The pipeline description `stageload plan` checks; feed it to [`StagedModels::builder`]'s `pipeline`.
pub use stageload_plan::Pipeline;
/// Typed events (they live in the torch-free trace crate, so traces read the same fields).
pub use stageload_trace::event::{Action, Event, EventKind, EventSink, ListSink, LoadReport, ReloadFrom, TierUsage};
pub use storage::ReleaseStats;
pub use stream::StreamError;
pub use sync::Shared;
