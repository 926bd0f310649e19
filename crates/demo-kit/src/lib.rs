//! What the examples share (`examples/` at the workspace root: `cascade`, `text_to_image`,
//! `stream`, `minilm`, `stable_diffusion`, `shap_e`, `wan`; the measuring tools of `crates/bench` use it too), one
//! concern per module: the plumbing that is not an example's lesson. Each example builds its own
//! `StagedModels` and runs its own stages in its own file.
//!
//! - [`models`]: the transformer the demo pipelines are made of, its shapes and its loader.
//! - [`weights`]: checkpoints written once from a seed and cached.
//! - [`args`]: the command line the demo pipelines share (mode, scale, device, trace, ...).
//! - [`run`]: a demo run's plumbing around the registry the example builds: the meter, the
//!   pipeline file for its mode, residency checks at every call, latent fingerprints, and the
//!   JSON result tests read; [`run::stream`], the stream demo's set-up, which the example and the
//!   bench binary `bench_stream` share.
//! - [`sampler`]: the flow sampler and its step schedule.
//! - [`progress`]: a progress bar for checkpoint loads.
//! - [`logging`]: the `tracing` subscriber every binary installs (`RUST_LOG`, stderr).
//!
//! The pipelines written for Python (Stable Diffusion, Shap-E, Wan2.1, their schedulers and the
//! comparison against the original) are the crate `stageload-pipelines`; a demo run is one of
//! their `StageRunner`s.

#![warn(missing_docs)]

pub mod args;
pub mod beside;
pub mod logging;
pub mod models;
pub mod progress;
pub mod run;
pub mod sampler;
pub mod weights;

pub use args::CommonArgs;
#[allow(deprecated)]
pub use args::Mode;
pub use models::{tokens_at, width_at, ModelShape, Transformer, CHANNELS};
pub use run::{progress_at_terminal, Demo, DemoRun, DemoSpec};
pub use sampler::{sample_flow, schedule};
pub use stageload_pipelines::runner::Loading;
pub use weights::{cached, cached_checkpoint};

/// The ports moved to the crate `stageload-pipelines`; these paths name them for one release.
macro_rules! moved {
    ($($name:ident => $path:path;)*) => {$(
        #[deprecated(note = "moved to the crate stageload-pipelines")]
        #[doc = concat!("Moved: `", stringify!($path), "`.")]
        pub mod $name {
            pub use $path::*;
        }
    )*};
}

moved! {
    ddim => stageload_pipelines::schedulers::ddim;
    heun => stageload_pipelines::schedulers::heun;
    unipc => stageload_pipelines::schedulers::unipc;
    clip_image => stageload_pipelines::clip_image;
    stable_diffusion => stageload_pipelines::stable_diffusion;
    shap_e => stageload_pipelines::shap_e;
    wan => stageload_pipelines::wan;
}

/// Moved to the crate `stageload-pipelines` (`export`, `runner`, `compare`, `files`); this path
/// names them for one release.
#[deprecated(note = "moved to the crate stageload-pipelines: export, runner, compare, files")]
pub mod pipeline {
    pub use stageload_pipelines::compare::*;
    pub use stageload_pipelines::export::*;
    pub use stageload_pipelines::files::*;
    pub use stageload_pipelines::runner::*;
}
