//! Block streaming: the cascade's largest model (`texture_flow`, 12 blocks, 0.6 GB at scale 1) run
//! for a flow stage with its blocks streamed from its checkpoint under a byte budget, or fully
//! resident (no `--budget`) for comparison: same checkpoint, same seeded noise, the latent's
//! fingerprint must match bit for bit.
//!
//! What it teaches: a model bigger than the memory it is given. The pipeline file's model entry
//! has a `stream` table (its blocks as a `BlockSpec` names them, the prefixes that stay resident,
//! the budget and the working memory), and `StagedModels` built from that file hands the loader a
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

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use clap::Parser;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use stageload::stream::StreamedModel;
use stageload::{BoxError, Built, EventSink, ModelSpec, Pipeline, SharedRng, StagedModels};
use stageload_demo_kit::args::{parse_device, positive_scale};
use stageload_demo_kit::models::{cascade_seed, cascade_shapes};
use stageload_demo_kit::sampler::sample_flow_with;
use stageload_demo_kit::weights::cache_root;
use stageload_demo_kit::{cached_checkpoint, schedule, tokens_at, Transformer, CHANNELS};
use stageload_plan::{ModelEntry, PipelineFile, StageEntry, StreamEntry};
use stageload_units::{format_bytes, parse_size};
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

/// The cascade's model this demo streams.
const MODEL: &str = "texture_flow";

#[derive(Parser)]
struct Args {
    /// Bytes the model may hold at once (weights and working memory), e.g. 200MiB; without it
    /// the model is loaded whole
    #[arg(long, value_parser = |t: &str| parse_size(t).map_err(|e| e.to_string()))]
    budget: Option<u64>,
    /// Working memory a step needs (from a resident run: its peak over set-up less the model's
    /// bytes); the split keeps room for it
    #[arg(long, value_parser = |t: &str| parse_size(t).map_err(|e| e.to_string()))]
    working: Option<u64>,
    /// Keep at most this many blocks resident, and none hot (streams more than the budget asks)
    #[arg(long)]
    resident_at_most: Option<usize>,
    /// Stream the blocks in any order (with a budget): no prefix, the budget's room is the hot
    /// set of the blocks used most, and each forward names its next block ahead
    #[arg(long)]
    any_order: bool,
    /// Model sizes relative to the cascade's default (1.0: texture_flow is 0.6 GB)
    #[arg(long, default_value_t = 1.0, value_parser = positive_scale)]
    scale: f64,
    /// Tokens of the latent (default: the cascade's texture stage at this scale)
    #[arg(long, value_parser = clap::value_parser!(i64).range(1..=1_000_000))]
    tokens: Option<i64>,
    /// Sampler steps
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(i64).range(1..=10_000))]
    steps: i64,
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Folder of the cached checkpoints (default: the cascade's)
    #[arg(long)]
    cache: Option<PathBuf>,
    /// auto, cpu, cuda, cuda:N
    #[arg(long, default_value = "auto", value_parser = parse_device)]
    device: Device,
    /// The JSONL trace of the run (with a `residency` event per split)
    #[arg(long)]
    trace: Option<PathBuf>,
    /// What the run did, as JSON (default: $STAGELOAD_RESULT when set)
    #[arg(long, env = stageload_trace::meter::RESULT_ENV, hide_env = true)]
    result: Option<PathBuf>,
    /// Write the latent (safetensors) to this file and its fingerprint to FILE.sha256 (default:
    /// $STAGELOAD_LATENTS when set)
    #[arg(long, value_name = "FILE")]
    latents: Option<PathBuf>,
    /// Write the pipeline description `stageload plan` reads (the model with its blocks and
    /// budget, one stage) to this file
    #[arg(long)]
    pipeline: Option<PathBuf>,
}

/// The pipeline file of this run: the model streamed under `budget` (whole without one).
fn description(file: &std::path::Path, args: &Args) -> PipelineFile {
    let spec = Transformer::block_spec("model");
    let stream = args.budget.map(|budget| StreamEntry {
        blocks: spec.blocks().to_vec(),
        resident: spec.resident_prefixes().to_vec(),
        budget: Some(budget.to_string()),
        working: args.working.map(|w| w.to_string()),
        any_order: args.any_order,
    });
    PipelineFile {
        pinned: Vec::new(),
        reserve: None,
        host_tier: None,
        memory: None,
        device_memory: None,
        snapshot_dir: None,
        snapshot_keep_free: None,
        cpus: None,
        pins: Vec::new(),
        models: vec![ModelEntry {
            name: MODEL.to_string(),
            files: vec![file.to_path_buf()],
            weights: None,
            device: stageload::device::name(args.device),
            dtype: None,
            ignore: Vec::new(),
            stream,
        }],
        stages: vec![StageEntry {
            name: "texture".into(),
            models: vec![MODEL.into()],
            working: None,
            device_working: None,
        }],
    }
}

#[derive(serde::Serialize)]
struct Outcome {
    mode: &'static str,
    fingerprint: String,
    model_bytes: u64,
    budget: Option<u64>,
    residency: Option<String>,
    resident_blocks: Option<usize>,
    blocks: usize,
    /// RSS after set-up's start (libtorch loaded, nothing of the model yet).
    base_rss: u64,
    /// The process's peak RSS (VmHWM).
    peak_rss: u64,
    /// Seconds of the flow (set-up excluded).
    seconds: f64,
    /// Seconds per forward.
    seconds_per_step: f64,
    any_order: bool,
    /// Forward calls, and the blocks they ran.
    calls: usize,
    blocks_run: usize,
    refills: u64,
    hot_hits: u64,
    /// Refills read while the call before ended (the call's first streamed block).
    carried: u64,
    /// The most the streamed model held at a block boundary, from its storages.
    most_held: u64,
    bytes_refilled: u64,
    refill_seconds: f64,
    waited_seconds: f64,
}

/// The model as the registry holds it: whole, or with its streamer.
struct Flow {
    model: Transformer,
    streamed: Option<StreamedModel>,
}

fn rss() -> Result<stageload_probe::ProcessMemory, BoxError> {
    Ok(stageload_probe::process_memory(std::process::id() as i32)?)
}

fn main() -> std::process::ExitCode {
    stageload_demo_kit::logging::init();
    match run(Args::parse()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> Result<(), BoxError> {
    let _no_grad = tch::no_grad_guard();
    tch::set_num_threads(std::thread::available_parallelism().map_or(1, |n| n.get()) as i32);
    let all = cascade_shapes(args.scale);
    let index = all.iter().position(|s| s.name == MODEL).expect("the cascade has texture_flow");
    let shape = all[index].clone();
    let folder = args.cache.clone().unwrap_or_else(cache_root).join(format!("cascade-scale-{}", args.scale));
    let file = cached_checkpoint(&folder, &shape, &["model"], cascade_seed(index))?;
    // The run is the pipeline file's: the model, whole or streamed (its blocks, budget, working
    // memory, order), in one stage, through StagedModels; `stageload plan` reads the same file.
    let text = toml::to_string(&description(&file, &args))?;
    let described = args.pipeline.clone().unwrap_or_else(|| folder.join("stream-demo.toml"));
    if args.pipeline.is_some() {
        std::fs::write(&described, &text)?;
    }
    let pipeline = Pipeline::parse(&text, &described)?;
    let model_bytes = pipeline.models[0].bytes;
    let meter = match stageload::meter::trace_path(args.trace.clone()) {
        Some(path) => Some(Arc::new(stageload::meter::start(
            path,
            args.device,
            stageload::meter::MeterOptions::default()
                .meta("mode", if args.budget.is_some() { "streamed" } else { "resident" }),
        )?)),
        None => None,
    };
    let base = rss()?;
    let (device, resident_at_most, built) = (args.device, args.resident_at_most, shape.clone());
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
    tch::manual_seed(args.seed as i64);
    let chacha = SharedRng::new(ChaCha8Rng::seed_from_u64(args.seed));
    let tokens = args.tokens.unwrap_or_else(|| tokens_at(1024, args.scale));
    let x = Tensor::randn([tokens, CHANNELS], (Kind::Float, args.device));
    let cond = Tensor::randn([1, CHANNELS], (Kind::Float, args.device));
    let times = schedule(args.steps, &chacha);
    // Every forward runs every block in order; a streamed one names the next call's first
    // blocks ahead while its last block runs.
    let all: Vec<usize> = (0..shape.depth as usize).collect();
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
    let peak_rss = peak.peak.unwrap_or(peak.rss);
    println!("latent {fingerprint}");
    println!(
        "peak RSS {} ({} over the {} before set-up); {seconds:.2} s for {} steps",
        format_bytes(peak_rss),
        format_bytes(peak_rss.saturating_sub(base.rss)),
        format_bytes(base.rss),
        args.steps
    );
    if let Some((residency, _)) = &streamed {
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
        let outcome = Outcome {
            mode: if streamed.is_some() { "streamed" } else { "resident" },
            fingerprint,
            model_bytes,
            budget: args.budget,
            residency: streamed.as_ref().map(|(residency, _)| residency.clone()),
            resident_blocks: streamed.as_ref().map(|(_, resident)| *resident),
            blocks: shape.depth as usize,
            base_rss: base.rss,
            peak_rss,
            seconds,
            seconds_per_step: seconds / args.steps.max(1) as f64,
            any_order: args.any_order,
            calls,
            blocks_run: calls * all.len(),
            refills: stats.refills,
            hot_hits: stats.hot_hits,
            carried: stats.carried,
            most_held: stats.most_held,
            bytes_refilled: stats.bytes_refilled,
            refill_seconds: stats.refill_seconds,
            waited_seconds: stats.waited_seconds,
        };
        std::fs::write(path, serde_json::to_string_pretty(&outcome)?)?;
    }
    models.close();
    drop(models);
    if let Some(meter) = meter {
        meter.finish();
    }
    Ok(())
}
