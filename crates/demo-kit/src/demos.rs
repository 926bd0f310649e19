//! The examples' programs, one module each, so that every file in `examples/` is a thin `main`.

pub mod cascade;
pub mod minilm;
pub mod stable_diffusion;
pub mod stream;
pub mod text_to_image;
