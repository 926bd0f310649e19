//! The stream example (`examples/stream.rs`) as a measuring tool: the cascade's largest model
//! (`texture_flow`) run for a flow stage, whole or with its blocks streamed from its checkpoint
//! under a byte budget, with the knobs the hot-set benchmark (`cargo xtask hot-set-bench`,
//! `crates/xtask/src/benches.rs`) and the stream demo's step times turn: which blocks each forward
//! runs (`--route experts`), how many blocks stay resident (`--resident-at-most`), refills read
//! past the page cache (`--uncached`, `--buffered`), the checkpoint cold (`--cold`), the disk's
//! read rate measured around the flow (`--disk-rate`), blocks read beside a whole model's flow as
//! a streamed one would read them (`--read-beside`), and the resident model's control for large
//! host mappings (`--map-large-blocks`). The latent's fingerprint is the example's, bit for bit.
//!
//!     cargo run -p stageload-bench --bin bench_stream -- --device cpu --route experts --budget 550MiB --any-order
//!
//! `--result FILE` writes what the run did as JSON (the benchmark reads it).

use std::sync::Arc;
use std::time::Instant;

use clap::Parser;
use stageload::stream::{DirectReads, StreamedModel};
use stageload::{BoxError, Built, EventSink, ModelSpec, StagedModels};
use stageload_demo_kit::beside::ReadsBeside;
use stageload_demo_kit::run::stream::{
    self as streaming, Checkpoint, Flow, Inputs, Measured, Outcome, StreamArgs, MODEL,
};
use stageload_demo_kit::sampler::sample_flow_with;
use stageload_demo_kit::weights::{disk_read_rate, drop_page_cache};
use stageload_demo_kit::Transformer;
use stageload_units::format_bytes;
use tch::nn::VarStore;
use tch::Device;

#[derive(Parser)]
struct Args {
    #[command(flatten)]
    stream: StreamArgs,
    /// Which blocks each forward runs: `all` in order, or `experts` (a fixed router: blocks 0
    /// and 1 every call, one of the last three and one of the others in turn)
    #[arg(long, value_enum, default_value_t = Route::All)]
    route: Route,
    /// Refills read past the page cache (each drops what it read), as a model bigger than
    /// memory streams from disk (with `--read-beside`, those reads do)
    #[arg(long)]
    uncached: bool,
    /// With `--uncached`: every refill reads through the page cache, never straight into its
    /// slot with `O_DIRECT` (`StreamedModel::direct_reads(DirectReads::Never)`)
    #[arg(long, requires = "uncached")]
    buffered: bool,
    /// Whole model only: read this many blocks of the checkpoint beside the flow, spread over
    /// its calls, as refills read them but waited for by nothing (`ReadsBeside`): the least
    /// time a streamed flow reading as many blocks can take on this machine
    #[arg(long, value_name = "BLOCKS", conflicts_with = "budget")]
    read_beside: Option<usize>,
    /// Drop the checkpoint's pages from the page cache before set-up: its first reads come from
    /// the disk
    #[arg(long)]
    cold: bool,
    /// Measure the disk's read rate on the checkpoint before set-up and again after the flow
    /// (its pages dropped before and after each read), for a from-disk run's limit:
    /// `disk_bytes_per_second` and `reading_seconds` in the result
    #[arg(long)]
    disk_rate: bool,
    /// Serve every host allocation of 1 MiB or more with its own mapping, as a streamed model on
    /// the CPU makes the process do (`map_large_host_blocks`): the resident model's control for
    /// what that costs
    #[arg(long)]
    map_large_blocks: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
enum Route {
    All,
    Experts,
}

/// The blocks forward call `n` runs, in order: every block, or (experts, at least 6 blocks)
/// blocks 0 and 1, one of the middle blocks in turn (each in one call of `depth - 5`) and one of
/// the last three in turn (each in one call of three).
fn route(route: Route, n: usize, depth: usize) -> Vec<usize> {
    match route {
        Route::Experts if depth >= 6 => vec![0, 1, 2 + n % (depth - 5), depth - 1 - n % 3],
        _ => (0..depth).collect(),
    }
}

/// The example's outcome, and what this binary's knobs add.
#[derive(serde::Serialize)]
struct BenchOutcome {
    #[serde(flatten)]
    outcome: Outcome,
    route: Route,
    /// Of the bytes refilled, those read past the page cache straight into the slots
    /// (`--uncached`, after a step limited by its compute).
    bytes_direct: u64,
    /// The disk's read rate over its two measurements (`--disk-rate`): the checkpoint read
    /// once before set-up and once after the flow, bytes over seconds of both. This shared
    /// virtual disk's rate drifts (up to 1.7x between the two reads of one run here); the two
    /// reads bracket the flow.
    #[serde(skip_serializing_if = "Option::is_none")]
    disk_bytes_per_second: Option<f64>,
    /// Each of the two measurements, before and after.
    #[serde(skip_serializing_if = "Option::is_none")]
    disk_rates: Option<[f64; 2]>,
    /// Bytes read beside a whole model's flow (`--read-beside`).
    #[serde(skip_serializing_if = "Option::is_none")]
    bytes_read_beside: Option<u64>,
    /// `bytes_refilled` (or `bytes_read_beside`) read at `disk_bytes_per_second`: the time the flow cannot go below when
    /// its reads are what bounds it.
    #[serde(skip_serializing_if = "Option::is_none")]
    reading_seconds: Option<f64>,
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

fn run(bench: Args) -> Result<(), BoxError> {
    let args = &bench.stream;
    let _no_grad = tch::no_grad_guard();
    tch::set_num_threads(std::thread::available_parallelism().map_or(1, |n| n.get()) as i32);
    let checkpoint = Checkpoint::cached(args.scale, args.cache.clone())?;
    let file = &checkpoint.file;
    let pipeline = streaming::pipeline(&checkpoint, args.device, args.streaming(), args.pipeline.as_deref())?;
    let model_bytes = pipeline.models[0].bytes;
    let meter = streaming::meter(args.trace.clone(), args.device, args.budget.is_some())?;
    if bench.map_large_blocks {
        stageload_torch_sys::map_large_host_blocks();
    }
    let base = rss()?;
    let rate_before = if bench.disk_rate { Some(disk_read_rate(file)?) } else { None };
    if bench.cold {
        drop_page_cache(file)?;
    }
    let (device, uncached, buffered, resident_at_most, built) =
        (args.device, bench.uncached, bench.buffered, args.resident_at_most, checkpoint.shape.clone());
    let mut builder = StagedModels::builder().pipeline(&pipeline);
    if let Some(meter) = &meter {
        builder = builder.events(Arc::clone(meter) as Arc<dyn EventSink>);
    }
    let models = builder
        .model(
            ModelSpec::new(MODEL, move |ctx| {
                let Some(plan) = ctx.stream() else {
                    let vs = VarStore::new(device);
                    let model = Transformer::new(vs.root() / "model", &built);
                    return Ok(Built::new(Flow { model, streamed: None }, &vs));
                };
                // Built and placed as the example builds it; the refills' reads as the knobs say.
                let vs = VarStore::new(Device::Cpu);
                let model = stageload_torch_sys::without_fills(|| Transformer::new(vs.root() / "model", &built));
                let tensors = stageload::named_tensors(&vs);
                if device != Device::Cpu {
                    stageload::stream::place(MODEL, &tensors, device)?;
                }
                let mut streamed = StreamedModel::planned(MODEL, tensors, plan)?;
                if uncached {
                    let direct = if buffered { DirectReads::Never } else { DirectReads::Adaptive };
                    streamed.uncached().direct_reads(direct);
                }
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

    let Inputs { x, cond, times } = Inputs::seeded(args.seed, args.tokens, args.scale, args.steps, args.device);
    let depth = checkpoint.shape.depth as usize;
    let (mut calls, mut blocks_run) = (0, 0);
    // The next call's blocks, and the call's after it (the route is fixed).
    let mut next_route = || {
        let blocks = route(bench.route, calls, depth);
        calls += 1;
        blocks_run += blocks.len();
        (blocks, route(bench.route, calls, depth))
    };
    // Set-up (the whole load, or the streamer's resident part) before the clock starts.
    models.get::<Flow>(MODEL)?;
    let beside = match bench.read_beside {
        Some(_) => {
            if bench.uncached {
                drop_page_cache(file)?;
            }
            Some(ReadsBeside::start(file, "model.blocks", bench.uncached)?)
        }
        None => None,
    };
    // Block reads asked for beside call `call` of `steps`: reads spread evenly over the calls.
    let (reads, steps) = (bench.read_beside.unwrap_or(0), args.steps as usize);
    let (mut call, mut asked) = (0, 0);
    let start = Instant::now();
    let (latent, stats, streamed) = models.call(MODEL, |flow: &mut Flow| -> Result<_, BoxError> {
        let latent = match flow.streamed.as_mut() {
            Some(streamed) => sample_flow_with(x, &cond, &times, |input| {
                let (blocks, then) = next_route();
                streamed.run(|step| flow.model.forward_routed_streamed(input, step, &blocks, &then))
            })?,
            None => sample_flow_with(x, &cond, &times, |input| {
                if let Some(beside) = &beside {
                    while asked < reads && asked * steps / reads <= call {
                        beside.read(asked % depth);
                        asked += 1;
                    }
                }
                call += 1;
                Ok::<_, BoxError>(flow.model.forward_routed(input, &next_route().0))
            })?,
        };
        let streamed = flow.streamed.as_ref();
        let stats = streamed.map(|s| s.stats()).unwrap_or_default();
        Ok((latent, stats, streamed.map(|s| (s.residency(), s.split().resident))))
    })??;
    let bytes_read_beside = beside.map(ReadsBeside::finish).transpose()?;
    let seconds = start.elapsed().as_secs_f64();
    let disk_rates = rate_before.map(|before| disk_read_rate(file).map(|after| [before, after])).transpose()?;
    // Both reads are of the whole checkpoint: their combined rate is the harmonic mean.
    let disk_bytes_per_second = disk_rates.map(|[before, after]| 2.0 / (1.0 / before + 1.0 / after));
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
        blocks_run,
    };
    let outcome = Outcome::new(args, model_bytes, depth, streamed, &stats, measured);
    outcome.print(args.steps);
    if let Some(residency) = &outcome.residency {
        println!(
            "{residency}; refilled {} ({} blocks, {} carried from the call before, {} found hot; {} read direct) in {:.3} s ({:.2} GB/s), waited {:.3} s",
            format_bytes(stats.bytes_refilled),
            stats.refills,
            stats.carried,
            stats.hot_hits,
            format_bytes(stats.bytes_direct),
            stats.refill_seconds,
            stats.bytes_refilled as f64 / stats.refill_seconds.max(1e-9) / 1e9,
            stats.waited_seconds
        );
    }
    if let Some(path) = &args.result {
        let outcome = BenchOutcome {
            outcome,
            route: bench.route,
            bytes_direct: stats.bytes_direct,
            disk_bytes_per_second,
            disk_rates,
            bytes_read_beside,
            reading_seconds: disk_bytes_per_second
                .map(|rate| (stats.bytes_refilled + bytes_read_beside.unwrap_or(0)) as f64 / rate),
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
