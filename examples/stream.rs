//! Block streaming: the cascade's largest model (`texture_flow`, 12 blocks, 0.6 GB at scale 1) run
//! for a flow stage with its blocks streamed from its checkpoint under a byte budget, or fully
//! resident (no `--budget`) for comparison: same checkpoint, same seeded noise, the latent's
//! fingerprint must match bit for bit.
//!
//! What it teaches: a model bigger than the memory it is given. The pipeline file's model entry
//! has a `stream` table (its blocks as a `BlockSpec` names them, the prefixes that stay resident,
//! the budget and the working memory; `stageload_demo_kit::run::stream::pipeline` writes it), and `StagedModels` built from that file hands the loader a
//! `StreamPlan` (`ctx.stream()`). The loader builds the model touching none of its memory, makes
//! a `StreamedModel` over its tensors, and returns it with `Built::from_tensors`; a forward then
//! runs inside `streamed.run(|step| ...)`, each block fetched from the checkpoint as the step
//! reaches it (`--any-order`: a hot set of the blocks used most instead of a resident prefix;
//! `--resident-at-most N`: at most N blocks kept, the rest streamed). The hot-set benchmark's
//! knobs (routes, reads past the page cache, a cold start, the disk's rate, reads beside a whole
//! flow) are the bench binary `bench_stream` (`crates/bench`).
//!
//!     cargo run --example stream -- --budget 200MiB --trace stream.jsonl
//!     stageload guard --max-memory 450MiB -- target/debug/examples/stream --budget 200MiB
//!
//! It prints the residency line, the latent's fingerprint, the process's peak RSS and how much
//! of it came after set-up (the model's weights and working memory), and what streaming moved.
//! `--pipeline FILE` writes the pipeline file the run follows; `stageload plan --check` compares
//! that file's plan with the run's trace.

use std::sync::Arc;
use std::time::Instant;

use clap::Parser;
use stageload::stream::StreamedModel;
use stageload::{BoxError, Built, EventSink, ModelSpec, StagedModels};
use stageload_demo_kit::run::stream::{
    self as streaming, Checkpoint, Flow, Inputs, Measured, Outcome, StreamArgs, MODEL,
};
use stageload_demo_kit::sampler::sample_flow_with;
use stageload_demo_kit::Transformer;
use stageload_units::format_bytes;
use tch::nn::VarStore;
use tch::Device;

#[derive(Parser)]
struct Args {
    #[command(flatten)]
    stream: StreamArgs,
}

fn rss() -> Result<stageload_probe::ProcessMemory, BoxError> {
    Ok(stageload_probe::process_memory(std::process::id() as i32)?)
}

fn main() -> std::process::ExitCode {
    stageload_demo_kit::logging::init();
    match run(Args::parse().stream) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(args: StreamArgs) -> Result<(), BoxError> {
    let _no_grad = tch::no_grad_guard();
    tch::set_num_threads(std::thread::available_parallelism().map_or(1, |n| n.get()) as i32);
    let checkpoint = Checkpoint::cached(args.scale, args.cache.clone())?;
    // The run is the pipeline file's: the model, whole or streamed (its blocks, budget, working
    // memory, order), in one stage, through StagedModels; `stageload plan` reads the same file.
    let pipeline = streaming::pipeline(&checkpoint, args.device, args.streaming(), args.pipeline.as_deref())?;
    let model_bytes = pipeline.models[0].bytes;
    let meter = streaming::meter(args.trace.clone(), args.device, args.budget.is_some())?;
    let base = rss()?;
    let (device, resident_at_most, built) = (args.device, args.resident_at_most, checkpoint.shape.clone());
    let mut builder = StagedModels::builder().pipeline(&pipeline);
    if let Some(meter) = &meter {
        builder = builder.events(Arc::clone(meter) as Arc<dyn EventSink>);
    }
    let models = builder
        .model(
            ModelSpec::new(MODEL, move |ctx| {
                let Some(plan) = ctx.stream() else {
                    // Whole: built without initial values on the device, filled by the registry
                    // from the file's checkpoint.
                    let vs = VarStore::new(device);
                    let model = Transformer::new(vs.root() / "model", &built);
                    return Ok(Built::new(Flow { model, streamed: None }, &vs));
                };
                // Streamed: built on the CPU touching none of its memory and placed on its device
                // one tensor at a time, without memory: the device never holds it whole.
                let vs = VarStore::new(Device::Cpu);
                let model = stageload_torch_sys::without_fills(|| Transformer::new(vs.root() / "model", &built));
                let tensors = stageload::named_tensors(&vs);
                if device != Device::Cpu {
                    stageload::stream::place(MODEL, &tensors, device)?;
                }
                let mut streamed = StreamedModel::planned(MODEL, tensors, plan)?;
                if let Some(at_most) = resident_at_most {
                    streamed.limit_resident(at_most)?;
                }
                println!("{}", streamed.residency());
                let tensors = streamed.tensors();
                Ok(Built::from_tensors(Flow { model, streamed: Some(streamed) }, tensors))
            })
            .skip_init(true),
        )
        .build()?;
    models.enter("texture")?;

    // The texture stage's inputs: seeded noise and a conditioning row, as the cascade draws them.
    let Inputs { x, cond, times } = Inputs::seeded(args.seed, args.tokens, args.scale, args.steps, args.device);
    // Every forward runs every block in order; a streamed one names the next call's first
    // blocks ahead while its last block runs.
    let all: Vec<usize> = (0..checkpoint.shape.depth as usize).collect();
    let mut calls = 0;
    // Set-up (the whole load, or the streamer's resident part) before the clock starts.
    models.get::<Flow>(MODEL)?;
    let start = Instant::now();
    let (latent, stats, streamed) = models.call(MODEL, |flow: &mut Flow| -> Result<_, BoxError> {
        let latent = match flow.streamed.as_mut() {
            Some(streamed) => sample_flow_with(x, &cond, &times, |input| {
                calls += 1;
                streamed.run(|step| flow.model.forward_routed_streamed(input, step, &all, &all))
            })?,
            None => sample_flow_with(x, &cond, &times, |input| {
                calls += 1;
                Ok::<_, BoxError>(flow.model.forward_routed(input, &all))
            })?,
        };
        let streamed = flow.streamed.as_ref();
        let stats = streamed.map(|s| s.stats()).unwrap_or_default();
        Ok((latent, stats, streamed.map(|s| (s.residency(), s.split().resident))))
    })??;
    let seconds = start.elapsed().as_secs_f64();
    let mut latents = stageload::latents::Latents::with_env(args.latents.clone());
    let fingerprint = latents.record("texture", &latent);
    latents.save()?;
    let peak = rss()?;
    let measured = Measured {
        fingerprint,
        base_rss: base.rss,
        peak_rss: peak.peak.unwrap_or(peak.rss),
        seconds,
        calls,
        blocks_run: calls * all.len(),
    };
    let outcome = Outcome::new(&args, model_bytes, all.len(), streamed, &stats, measured);
    outcome.print(args.steps);
    if let Some(residency) = &outcome.residency {
        println!(
            "{residency}; refilled {} ({} blocks, {} carried from the call before, {} found hot) in {:.3} s ({:.2} GB/s), waited {:.3} s",
            format_bytes(stats.bytes_refilled),
            stats.refills,
            stats.carried,
            stats.hot_hits,
            stats.refill_seconds,
            stats.bytes_refilled as f64 / stats.refill_seconds.max(1e-9) / 1e9,
            stats.waited_seconds
        );
    }
    if let Some(path) = &args.result {
        std::fs::write(path, serde_json::to_string_pretty(&outcome)?)?;
    }
    models.close();
    drop(models);
    if let Some(meter) = meter {
        meter.finish();
    }
    Ok(())
}
