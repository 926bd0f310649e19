//! Pipelines written for Python, run over stageload's registry: each reads the folder its export
//! script in `scripts/reference/` writes, runs diffusers' operations in diffusers' order (so that
//! its outputs match the original's), and can run the original on the same inputs and compare.
//!
//! - [`stable_diffusion`], [`shap_e`], [`wan`]: one folder per pipeline, of one shape: `mod.rs`
//!   (its models, `STAGES`, `Export` and `generate`), `files.rs` where it writes output files, and
//!   `reference.rs` (running the Python original, `run_reference`, and comparing).
//! - [`schedulers`]: diffusers' DDIM, Heun and UniPC, bit for bit.
//! - [`clip_image`]: transformers' `CLIPImageProcessor` (PIL backend), bit for bit on PNG inputs.
//! - [`export`]: what every export has: component files and their [`Format`](export::Format).
//! - [`runner`]: the registry a pipeline runs on for a [`Loading`](runner::Loading), the
//!   [`StageRunner`](runner::StageRunner) a run calls, and one model's forward.
//! - [`compare`]: running the Python original and measuring the differences.
//! - [`files`]: writing an output file whole or not at all.
//! - [`cache`]: where the cached Python environment and the published-size exports live.
//!
//! Adding a pipeline is one folder here, one example, one export script, one test file and one
//! demo row (`docs/layout.md`, "Adding a pipeline").

#![warn(missing_docs)]

pub mod cache;
pub mod clip_image;
pub mod compare;
pub mod export;
pub mod files;
pub mod runner;
pub mod schedulers;
pub mod shap_e;
pub mod stable_diffusion;
pub mod wan;

pub use cache::stageload_cache;
