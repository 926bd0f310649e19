//! The integration tests of `stageload`, one binary of modules (as ripgrep's `tests/tests.rs`).
//! A test with process-wide state has a binary of its own (`host_memory`, `metered`,
//! `release_rss`, `pt2_rss`, `rng`, `slow_copies`; each module doc says why), and so has
//! `docs_check` (torch-free: it reads files only).
//!
//! Every test here that runs libtorch in this process and draws from torch's global generator
//! (seeding it, building a model with random initialisation, drawing a tensor) holds
//! [`stageload_test_support::torch::generator`] for its whole run. Tests that run an example
//! start it as a user would, in its own process (`stageload_test_support::build::example`).
//!
//! - The registry: `staged`, `threads`, `prefetch`, `names`, `snapshot`, `pipeline_file`,
//!   `host_tier`, `script` (TorchScript), `every_tensor` (modules exported the ordinary way: tied
//!   weights, buffers a checkpoint lacks), `pt2` (AOTInductor packages), `stream` (block streaming),
//!   `checkpoint` (I/O), `changed_files` (a file changed between a release and its reload), `mapped`
//!   (reloads that map the checkpoint's pages).
//! - The examples run as users run them: `readme_example` (two_models), `determinism` (cascade
//!   and text_to_image, staged against eager), `stream_demo`, `minilm` (a published checkpoint
//!   against its reference implementation), `stable_diffusion` and `ddim` (against diffusers),
//!   `many_jobs` (cascade jobs on a local Ray cluster); `heun` (against diffusers), `clip_image`
//!   (against transformers), `shap_e` (image to 3D, against diffusers), `unipc` (Wan's sampler,
//!   against diffusers), `wan` (text to video, against diffusers).
//! - `reference`: running a reference script for `ddim`, `heun` and `unipc`; `watch`: what the
//!   `stable_diffusion`, `shap_e` and `wan` tests share (a registry watched at every call).

mod changed_files;
mod checkpoint;
mod clip_image;
mod ddim;
mod determinism;
mod every_tensor;
mod heun;
mod host_tier;
mod many_jobs;
mod mapped;
mod minilm;
mod names;
mod pipeline_file;
mod prefetch;
mod pt2;
mod readme_example;
mod reference;
mod script;
mod shap_e;
mod snapshot;
mod stable_diffusion;
mod staged;
mod stream;
mod stream_demo;
mod threads;
mod unipc;
mod wan;
mod watch;
