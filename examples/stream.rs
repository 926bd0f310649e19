//! The cascade's largest model (`texture_flow`, 12 blocks, 0.6 GB at scale 1) run for a flow
//! stage with its blocks streamed from its checkpoint under a byte budget, or fully resident
//! (no `--budget`) for comparison: same checkpoint, same seeded noise, the latent's fingerprint
//! must match bit for bit.
//!
//!     cargo run --example stream -- --budget 200MiB --trace stream.jsonl
//!     stageload guard --max-memory 450MiB -- target/debug/examples/stream --budget 200MiB
//!
//! It prints the residency line, the latent's fingerprint, the process's peak RSS and how much
//! of it came after set-up (the model's weights and working memory), and what streaming moved.
//! The run goes through `StagedModels` built from the pipeline file it describes (`--pipeline`
//! writes it): the file's stream entry is what the streamer runs, and `stageload plan --check`
//! compares that file's plan with the run's trace.

fn main() -> std::process::ExitCode {
    stageload_demo_kit::demos::stream::main()
}
