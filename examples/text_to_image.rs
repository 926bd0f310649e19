//! Text encoder → denoiser run for N steps → image decoder, staged: the encoder is released when
//! denoising begins, the denoiser when `models.enter("decode")` runs. Same options as `cascade`
//! (`--mode eager|staged`, `--trace`, `--scale`, `--steps`, ...), plus `--prompt`.
//!
//!     cargo run --release --example text_to_image -- --prompt "a red fox in the snow" --steps 8

fn main() -> Result<(), stageload::BoxError> {
    stageload_demo_kit::demos::text_to_image::main()
}
