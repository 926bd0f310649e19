//! stageload: run a multi-model libtorch pipeline with only the current stage's weights in
//! memory, and get the same results bit for bit as loading everything up front.
//!
//! Models are built the first time a stage asks for them, released in place when a stage does
//! not list them (their memory goes back to the OS, even while other code still holds the
//! model), and come back in place from their safetensors checkpoint. Every build runs with the
//! random generators saved and restored, so a seeded run draws the same noise staged as eager.
//!
//! This page is the tour of the API. The guide (`docs/` in the repository, one file per task)
//! has the measurements and the depth; `examples/` has one program per part of the API.
//!
//! # A pipeline in two stages
//!
//! ```no_run
//! use stageload::{BoxError, BuildContext, Built, ModelSpec, StagedModels};
//! use tch::nn::{self, Module, VarStore};
//! use tch::{Device, Kind, Tensor};
//!
//! /// A loader: builds the model on its device, returns it with the VarStore of its weights.
//! fn linear(_: &BuildContext) -> Result<Built, BoxError> {
//!     let vs = VarStore::new(Device::Cpu);
//!     Ok(Built::new(nn::linear(vs.root(), 1024, 1024, Default::default()), &vs))
//! }
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let models = StagedModels::builder()
//!     .model(ModelSpec::new("encoder", linear).checkpoint(["encoder.safetensors"]))
//!     .model(ModelSpec::new("decoder", linear).checkpoint(["decoder.safetensors"]))
//!     .stage("encode", ["encoder"])
//!     .stage("decode", ["decoder"])
//!     .build()?; // a stage naming an unknown model is an error here
//!
//! tch::manual_seed(7);
//! let x = Tensor::randn([8, 1024], (Kind::Float, Device::Cpu));
//! models.enter("encode")?; // nothing is loaded yet
//! let latent = models.call("encoder", |m: &mut nn::Linear| m.forward(&x))?; // built, then filled
//! models.enter("decode")?; // the encoder released in place: its memory goes back to the OS
//! let y = models.call("decoder", |m: &mut nn::Linear| m.forward(&latent))?;
//! models.close();
//! # Ok(()) }
//! ```
//!
//! # The tour
//!
//! **Models and stages.** [`StagedModels`] is the registry: [`enter`](StagedModels::enter) a
//! stage, [`call`](StagedModels::call) a model (or [`get`](StagedModels::get) a typed
//! [`Handle`] and [`lock`](Handle::lock) it: a [`ModelGuard`]), [`prefetch`](StagedModels::prefetch)
//! the next stage, [`states`](StagedModels::states) and [`close`](StagedModels::close).
//! [`StagedModelsBuilder`] takes the models, the stages, pins, the event sink and the options
//! (prefetch, host tier, snapshots, strictness). A [`ModelSpec`] says how to build one model: a
//! loader ([`ModelSpec::new`]: a closure that gets a [`BuildContext`] and returns [`Built`]), its
//! checkpoint files, how their names meet the model's ([`NameRules`]), and whether to skip random
//! initialisation. [`ModelState`] is where a model is in its life; [`StageError`] says what went
//! wrong and names the model, the stage or the file ([`OutOfMemory`] is the policy for a load
//! that runs out).
//!
//! **Checkpoints and names.** [`checkpoint`] reads safetensors files each entry once and
//! straight into the model's storage, in 4 MiB pieces over the CPUs (no transient copy): a piece
//! in the page cache copied from a mapping of just its pages, one from the disk read with `pread`
//! ([`checkpoint::HostRead`]); into CUDA through a ring of pinned buffers
//! ([`checkpoint::RingShape`]). [`checkpoint::save`] writes one tensor's copy at a time. Every
//! file a model loads from is stamped at its first load and must be the same at each reload
//! ([`source`], [`StagedModels::accept_changed_files`]).
//! [`names`] meets a file's entry names with a model's ([`NameRules`]: prefixes, renames,
//! ignored entries, strictness) and explains a mismatch; [`StagedModels::load_report`] says how
//! the last load met the file ([`LoadReport`]).
//!
//! **Models exported from Python.** [`ModelSpec::torchscript`] makes a model of a TorchScript
//! file ([`script`]), [`ModelSpec::pt2`] one of an AOTInductor `.pt2` package ([`pt2`]), whose
//! weights stageload owns: both are released and refilled in place like any model.
//!
//! **Bigger than its memory.** [`stream`]: a [`StreamedModel`](stream::StreamedModel) keeps the
//! blocks that fit its budget resident and refills the others in place just before they run,
//! with one call at each block boundary ([`Step::block`](stream::Step::block)).
//!
//! **The plan that runs.** A [`Pipeline`] file (the one `stageload plan` checks) gives
//! [`StagedModelsBuilder::pipeline`] the stages, pins, checkpoint files, devices and dtypes; a
//! loader reads its device and streaming plan from its [`BuildContext`].
//!
//! **Noise that does not move.** [`rng`] saves and restores torch's generators around every build;
//! [`SharedRng`] is a `rand` generator of your own, preserved the same way once registered
//! ([`StagedModelsBuilder::register_rng`]).
//!
//! **What happened.** Every load, reload, release and stage entry is an [`Event`] (one [`What`]
//! variant per [`EventKind`], each with its own fields: [`event`]) handed to an [`EventSink`]
//! ([`ListSink`] keeps them; any `Fn(&Event)` is one). [`meter`] writes them with the process's
//! memory as a JSONL trace that `stageload summary` and `stageload plot` read; [`latents`] records
//! a run's latents for comparing runs; [`ReleaseStats`] is what a stage entry freed.
//!
//! **Around the registry.** [`hook`] enters a stage when code you do not own is called;
//! [`Shared`] is a value several owners share and lock (a component two models hold, a seeded
//! generator; [`BuildContext::shared`] builds one); [`device`] names devices both ways;
//! [`copy_watch`] is a test mode that slows every copy and watches the storages copies use;
//! [`named_tensors`] lists a VarStore's tensors in the order the registry and
//! [`checkpoint::save`] use.
//!
//! # Inside
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
pub mod source;
pub mod staged;
mod storage;
pub mod stream;
mod sync;

pub use checkpoint::CheckpointError;
pub use names::NameRules;
pub use pinned::{HostCopyError, LibtorchError};
pub use rng::SharedRng;
pub use staged::{
    named_tensors, BoxError, BuildContext, Built, Handle, ModelGuard, ModelSpec, ModelState, OutOfMemory, PrefetchPace,
    Reload, SnapshotError, StageError, StagedModels, StagedModelsBuilder, UnknownPace,
};
/// The pipeline description `stageload plan` checks; feed it to [`StagedModels::builder`]'s `pipeline`.
pub use stageload_plan::Pipeline;
/// Typed events (they live in the torch-free trace crate, so traces read the same fields): one
/// [`What`] variant per kind, with its fields in [`event`]'s structs.
pub use stageload_trace::event;
pub use stageload_trace::event::{Event, EventKind, EventSink, ListSink, LoadReport, ReloadFrom, TierUsage, What};
pub use storage::ReleaseStats;
pub use stream::StreamError;
pub use sync::Shared;

/// The README and the guide (`docs/*.md`), each a doc comment here so that rustdoc compiles their
/// Rust blocks as doc-tests of this library (`no_run` where a block needs files: type-checked,
/// not linked). `tests/docs_check.rs` checks that every document is here and that no Rust block
/// is ignored but the build script. A failing block is reported as `guide::Name (line N)`: N is
/// the line of its document's `include_str!` below plus the block's line in the document, less 1.
#[cfg(doctest)]
mod guide {
    #[doc = include_str!("../../../README.md")]
    struct Readme;
    #[doc = include_str!("../../../docs/README.md")]
    struct Index;
    #[doc = include_str!("../../../docs/checkpoints.md")]
    struct Checkpoints;
    #[doc = include_str!("../../../docs/cli.md")]
    struct Cli;
    #[doc = include_str!("../../../docs/gpu.md")]
    struct Gpu;
    #[doc = include_str!("../../../docs/guard.md")]
    struct Guard;
    #[doc = include_str!("../../../docs/layout.md")]
    struct Layout;
    #[doc = include_str!("../../../docs/pipelines.md")]
    struct Pipelines;
    #[doc = include_str!("../../../docs/plans.md")]
    struct Plans;
    #[doc = include_str!("../../../docs/python.md")]
    struct Python;
    #[doc = include_str!("../../../docs/setup.md")]
    struct Setup;
    #[doc = include_str!("../../../docs/staging.md")]
    struct Staging;
    #[doc = include_str!("../../../docs/streaming.md")]
    struct Streaming;
    #[doc = include_str!("../../../docs/torchscript.md")]
    struct Torchscript;
    #[doc = include_str!("../../../docs/traces.md")]
    struct Traces;
}
