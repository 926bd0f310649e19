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
//!   JSON result tests read.
//! - [`sampler`]: the flow sampler and its step schedule.
//! - [`progress`]: a progress bar for checkpoint loads.
//! - [`logging`]: the `tracing` subscriber every binary installs (`RUST_LOG`, stderr).
//! - [`pipeline`]: what the pipelines someone else wrote share: export formats, the registry for
//!   eager, staged or prefetch, the stage runner, running the Python original and comparing.
//! - [`stable_diffusion`]: Stable Diffusion over the TorchScript export of
//!   `scripts/reference/sd_export.py` (text encoder, UNet with DDIM, VAE decoder) in three stages,
//!   and its comparison against diffusers.
//! - [`heun`]: diffusers' `HeunDiscreteScheduler` as Shap-E configures it, bit for bit.
//! - [`clip_image`]: transformers' `CLIPImageProcessor` (PIL backend), bit for bit on PNG inputs.
//! - [`shap_e`]: Shap-E image-to-3D over the TorchScript export of
//!   `scripts/reference/shap_e_export.py` (image encoder, prior with Heun, renderer: views and a
//!   coloured mesh) in four stages, its PLY and PNG outputs, and its comparison against diffusers.
//! - [`wan`]: Wan2.1 text-to-video over the TorchScript export of
//!   `scripts/reference/wan_export.py` (umT5 text encoder, transformer with UniPC, video VAE
//!   decoder) in four stages, its PNG frames and GIF, and its comparison against diffusers.
//! - [`unipc`]: diffusers' `UniPCMultistepScheduler` as Wan2.1 text-to-video configures it, bit for bit.

#![warn(missing_docs)]

pub mod args;
pub mod beside;
pub mod clip_image;
pub mod ddim;
pub mod heun;
pub mod logging;
pub mod models;
pub mod pipeline;
pub mod progress;
pub mod run;
pub mod sampler;
pub mod shap_e;
pub mod stable_diffusion;
pub mod unipc;
pub mod wan;
pub mod weights;

pub use args::{CommonArgs, Mode};
pub use models::{tokens_at, width_at, ModelShape, Transformer, CHANNELS};
pub use run::{progress_at_terminal, Demo, DemoRun, DemoSpec};
pub use sampler::{sample_flow, schedule};
pub use weights::{cached, cached_checkpoint};
