//! Stable Diffusion (CLIP text encoder → UNet for `--steps` DDIM steps with classifier-free
//! guidance → VAE decoder) on an export of `scripts/reference/sd_export.py`, eager, staged, or
//! staged with the next stage prefetched, with the demos' meter: per-stage peaks at the end,
//! `--trace`, `--latents`, `--result`, `--check-residency`, and `STAGELOAD_TRACE` /
//! `STAGELOAD_LATENTS` as `stageload ab` sets them (the same options as `text_to_image`; `--mode
//! prefetch` is `--mode staged --prefetch`). `--compare-python` then runs diffusers'
//! `StableDiffusionPipeline` on the same weights, embeddings and initial latents
//! (`scripts/reference/sd_reference.py`) and prints the largest differences.
//!
//!     cargo run --release --example stable_diffusion -- --mode staged --compare-python

fn main() -> std::process::ExitCode {
    stageload_demo_kit::demos::stable_diffusion::main()
}
