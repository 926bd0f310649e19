//! A stand-in for an image-to-3D cascade, shaped like the pipeline the original tool measured:
//! seven models (sparse-structure flow and decoder, shape flows at 512 and 1024, a shape decoder
//! used in two stages, texture flow and decoder) and four feature extractors sharing one
//! backbone, pinned until decode (a pin with a span, in the pipeline file). Stages: setup → structure → shape_512 → shape_1024 → texture
//! → decode → export.
//!
//! The models are transformers (attention + MLP blocks) whose checkpoints the example writes once
//! and caches; `--scale 1` is about 3 GB of weights, `--scale 4` a preset for bigger machines.
//! The run seeds once and draws each stage's noise from torch's CPU generator and from a
//! registered ChaCha generator. It prints each stage's latent fingerprint and peak memory.
//!
//!     cargo run --release --example cascade -- --mode staged --trace staged.jsonl
//!     cargo run --release --example cascade -- --mode eager --trace eager.jsonl

fn main() -> Result<(), stageload::BoxError> {
    stageload_demo_kit::demos::cascade::main()
}
