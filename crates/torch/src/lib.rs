//! stageload: run a multi-model libtorch pipeline with only the current stage's weights in
//! memory, and get the same results bit for bit as loading everything up front.
//!
//! - [`StagedModels`] (module [`staged`]): named models built on first use, released in place
//!   when a stage that does not list them begins, reloaded in place from their checkpoint.
//! - [`rng`]: every generator's state preserved around each build, so lazy loading never shifts
//!   the noise a seeded run draws.
//! - [`checkpoint`]: safetensors files mapped and copied once into the model's storage.
//! - [`storage`]: release and reallocation of a model's storages through the shim.
//! - [`hook`]: enter a stage when a module or closure you do not own is called.
//! - [`events`]: what happened, for traces and tests.
//! - [`meter`]: a run's memory and events as a JSONL trace (the meter of `stageload-trace`).

pub mod checkpoint;
pub mod events;
pub mod hook;
pub mod meter;
pub mod rng;
pub mod staged;
pub mod storage;

pub use events::{Event, EventKind, EventSink, ListSink};
pub use rng::SharedRng;
pub use staged::{BoxError, BuildContext, Built, Handle, ModelGuard, ModelSpec, Shared, StageError, StagedModels};
/// The pipeline description `stageload plan` checks; feed it to [`StagedModels::builder`]'s `pipeline`.
pub use stageload_plan::Pipeline;
