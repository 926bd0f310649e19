//! The stream demo's set-up, which the example `stream` and the bench binary `bench_stream`
//! share: the cascade's largest model and its cached checkpoint ([`Checkpoint`]), the pipeline
//! file that runs it whole or streamed under a budget ([`pipeline`]), the command line both take
//! ([`StreamArgs`]), the meter, the texture stage's seeded inputs ([`Inputs`]) and what a run
//! reports ([`Outcome`]). The loader that
//! streams the model and the forward inside `StreamedModel::run` stay in each binary: they are
//! the example's lesson.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use stageload::meter::{Meter, MeterOptions};
use stageload::stream::{StreamStats, StreamedModel};
use stageload::{BoxError, Pipeline, SharedRng};
use stageload_plan::{ModelEntry, PipelineFile, StageEntry, StreamEntry};
use stageload_units::{format_bytes, parse_size};
use tch::{Device, Kind, Tensor};

use crate::args::{parse_device, positive_scale};
use crate::models::{cascade_seed, cascade_shapes, tokens_at, ModelShape, Transformer, CHANNELS};
use crate::sampler::schedule;
use crate::weights::{cache_root, cached_checkpoint};

/// The cascade's model the stream demo streams.
pub const MODEL: &str = "texture_flow";

/// The command line of the stream demo (the bench binary adds its knobs to it).
#[derive(Debug, Clone, clap::Args)]
pub struct StreamArgs {
    /// Bytes the model may hold at once (weights and working memory), e.g. 200MiB; without it
    /// the model is loaded whole
    #[arg(long, value_parser = |t: &str| parse_size(t).map_err(|e| e.to_string()))]
    pub budget: Option<u64>,
    /// Working memory a step needs (from a resident run: its peak over set-up less the model's
    /// bytes); the split keeps room for it
    #[arg(long, value_parser = |t: &str| parse_size(t).map_err(|e| e.to_string()))]
    pub working: Option<u64>,
    /// Keep at most this many blocks resident, and none hot (streams more than the budget asks)
    #[arg(long)]
    pub resident_at_most: Option<usize>,
    /// Stream the blocks in any order (with a budget): no prefix, the budget's room is the hot
    /// set of the blocks used most, and each forward names its next block ahead
    #[arg(long)]
    pub any_order: bool,
    /// Model sizes relative to the cascade's default (1.0: texture_flow is 0.6 GB)
    #[arg(long, default_value_t = 1.0, value_parser = positive_scale)]
    pub scale: f64,
    /// Tokens of the latent (default: the cascade's texture stage at this scale)
    #[arg(long, value_parser = clap::value_parser!(i64).range(1..=1_000_000))]
    pub tokens: Option<i64>,
    /// Sampler steps
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(i64).range(1..=10_000))]
    pub steps: i64,
    /// Seed of the noise and the step times (0 to 2^63 - 1)
    #[arg(long, default_value_t = 7, value_parser = clap::value_parser!(u64).range(..=i64::MAX as u64))]
    pub seed: u64,
    /// Folder of the cached checkpoints (default: the cascade's)
    #[arg(long)]
    pub cache: Option<PathBuf>,
    /// auto, cpu, cuda, cuda:N
    #[arg(long, default_value = "auto", value_parser = parse_device)]
    pub device: Device,
    /// The JSONL trace of the run (with a `residency` event per split)
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// What the run did, as JSON (default: $STAGELOAD_RESULT when set)
    #[arg(long, env = stageload_trace::meter::RESULT_ENV, hide_env = true)]
    pub result: Option<PathBuf>,
    /// Write the latent (safetensors) to this file and its fingerprint to FILE.sha256 (default:
    /// $STAGELOAD_LATENTS when set)
    #[arg(long, value_name = "FILE")]
    pub latents: Option<PathBuf>,
    /// Write the pipeline description `stageload plan` reads (the model with its blocks and
    /// budget, one stage) to this file
    #[arg(long)]
    pub pipeline: Option<PathBuf>,
}

impl StreamArgs {
    /// How the model streams (`--budget`, `--working`, `--any-order`); none: whole.
    pub fn streaming(&self) -> Option<Streaming> {
        self.budget.map(|budget| Streaming { budget, working: self.working, any_order: self.any_order })
    }
}

/// The model's shape at a scale and its checkpoint, written once from the cascade's seed.
pub struct Checkpoint {
    /// The folder of the cascade's checkpoints at this scale (the pipeline file goes there too).
    pub folder: PathBuf,
    /// The model's shape.
    pub shape: ModelShape,
    /// The safetensors file.
    pub file: PathBuf,
}

impl Checkpoint {
    /// [`MODEL`] at `scale`, its checkpoint cached under `cache` (default: the cascade's folder).
    pub fn cached(scale: f64, cache: Option<PathBuf>) -> Result<Checkpoint, BoxError> {
        let shapes = cascade_shapes(scale);
        let index = shapes
            .iter()
            .position(|s| s.name == MODEL)
            .ok_or_else(|| format!("the cascade's models at scale {scale} have no {MODEL}"))?;
        let shape = shapes[index].clone();
        let folder = cache.unwrap_or_else(cache_root).join(format!("cascade-scale-{scale}"));
        let file = cached_checkpoint(&folder, &shape, &["model"], cascade_seed(index))?;
        Ok(Checkpoint { folder, shape, file })
    }
}

/// How the model streams: the bytes it may hold, the working memory a step needs, and whether
/// its blocks go in any order (a hot set) rather than a resident prefix.
#[derive(Debug, Clone, Copy)]
pub struct Streaming {
    /// The budget in bytes (weights and working memory).
    pub budget: u64,
    /// The working memory a step needs, in bytes.
    pub working: Option<u64>,
    /// Blocks in any order.
    pub any_order: bool,
}

/// The pipeline the run follows: [`MODEL`] on `device`, streamed as `streaming` says (whole
/// without it), in one stage `texture`. Its file is written to `write_to` when given, for
/// `stageload plan`.
pub fn pipeline(
    checkpoint: &Checkpoint,
    device: Device,
    streaming: Option<Streaming>,
    write_to: Option<&Path>,
) -> Result<Pipeline, BoxError> {
    let spec = Transformer::block_spec("model");
    let stream = streaming.map(|s| StreamEntry {
        blocks: spec.blocks().to_vec(),
        resident: spec.resident_prefixes().to_vec(),
        budget: Some(s.budget.to_string()),
        working: s.working.map(|w| w.to_string()),
        any_order: s.any_order,
    });
    let file = PipelineFile {
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
            files: vec![checkpoint.file.clone()],
            weights: None,
            device: stageload::device::name(device),
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
    };
    let text = toml::to_string(&file)?;
    let described = write_to.map_or_else(|| checkpoint.folder.join("stream-demo.toml"), Path::to_path_buf);
    if write_to.is_some() {
        std::fs::write(&described, &text)?;
    }
    Ok(Pipeline::parse(&text, &described)?)
}

/// The meter writing the run's trace to `trace` (or `$STAGELOAD_TRACE`), its mode `streamed` or
/// `resident`; none when no trace is asked for.
pub fn meter(trace: Option<PathBuf>, device: Device, streamed: bool) -> Result<Option<Arc<Meter>>, BoxError> {
    let Some(path) = stageload::meter::trace_path(trace) else {
        return Ok(None);
    };
    let options = MeterOptions::default().meta("mode", if streamed { "streamed" } else { "resident" });
    Ok(Some(Arc::new(stageload::meter::start(path, device, options)?)))
}

/// The texture stage's inputs, as the cascade draws them from the seed: noise, a conditioning
/// row and the step times.
pub struct Inputs {
    /// Noise, `[tokens, CHANNELS]`.
    pub x: Tensor,
    /// The conditioning row, `[1, CHANNELS]`.
    pub cond: Tensor,
    /// The sampler's step times.
    pub times: Vec<f64>,
}

impl Inputs {
    /// Drawn from `seed` on `device`: `tokens` (default: the texture stage's at `scale`) and
    /// `steps` step times.
    pub fn seeded(seed: u64, tokens: Option<i64>, scale: f64, steps: i64, device: Device) -> Inputs {
        tch::manual_seed(seed as i64);
        let chacha = SharedRng::new(ChaCha8Rng::seed_from_u64(seed));
        let tokens = tokens.unwrap_or_else(|| tokens_at(1024, scale));
        let x = Tensor::randn([tokens, CHANNELS], (Kind::Float, device));
        let cond = Tensor::randn([1, CHANNELS], (Kind::Float, device));
        Inputs { x, cond, times: schedule(steps, &chacha) }
    }
}

/// The model as the registry holds it: whole, or with its streamer.
pub struct Flow {
    /// The model.
    pub model: Transformer,
    /// Its streamer, when it streams.
    pub streamed: Option<StreamedModel>,
}

/// What a run did, as the result file (`--result`) has it.
#[derive(Debug, serde::Serialize)]
pub struct Outcome {
    /// `streamed` or `resident`.
    pub mode: &'static str,
    /// The latent's fingerprint.
    pub fingerprint: String,
    /// The model's bytes.
    pub model_bytes: u64,
    /// `--budget`.
    pub budget: Option<u64>,
    /// The streamer's residency line.
    pub residency: Option<String>,
    /// Blocks kept resident.
    pub resident_blocks: Option<usize>,
    /// The model's blocks.
    pub blocks: usize,
    /// RSS after set-up's start (libtorch loaded, nothing of the model yet).
    pub base_rss: u64,
    /// The process's peak RSS (VmHWM).
    pub peak_rss: u64,
    /// Seconds of the flow (set-up excluded).
    pub seconds: f64,
    /// Seconds per forward.
    pub seconds_per_step: f64,
    /// `--any-order`.
    pub any_order: bool,
    /// Forward calls.
    pub calls: usize,
    /// The blocks they ran.
    pub blocks_run: usize,
    /// Blocks refilled.
    pub refills: u64,
    /// Blocks found in the hot set.
    pub hot_hits: u64,
    /// Refills read while the call before ended (the call's first streamed block).
    pub carried: u64,
    /// The most the streamed model held at a block boundary, from its storages.
    pub most_held: u64,
    /// Bytes refilled.
    pub bytes_refilled: u64,
    /// Seconds spent refilling.
    pub refill_seconds: f64,
    /// Seconds the forward waited for a refill.
    pub waited_seconds: f64,
}

/// What the flow measured, apart from the streamer.
#[derive(Debug)]
pub struct Measured {
    /// The latent's fingerprint.
    pub fingerprint: String,
    /// RSS after set-up's start.
    pub base_rss: u64,
    /// The process's peak RSS.
    pub peak_rss: u64,
    /// Seconds of the flow.
    pub seconds: f64,
    /// Forward calls.
    pub calls: usize,
    /// The blocks they ran.
    pub blocks_run: usize,
}

impl Outcome {
    /// The outcome of a run of `args` over a model of `model_bytes` in `blocks` blocks: what
    /// the flow `measured`, and the streamer's residency line, resident blocks and `stats` when
    /// it streamed.
    pub fn new(
        args: &StreamArgs,
        model_bytes: u64,
        blocks: usize,
        streamed: Option<(String, usize)>,
        stats: &StreamStats,
        measured: Measured,
    ) -> Outcome {
        let (residency, resident_blocks) = streamed.map_or((None, None), |(r, b)| (Some(r), Some(b)));
        Outcome {
            mode: if residency.is_some() { "streamed" } else { "resident" },
            fingerprint: measured.fingerprint,
            model_bytes,
            budget: args.budget,
            residency,
            resident_blocks,
            blocks,
            base_rss: measured.base_rss,
            peak_rss: measured.peak_rss,
            seconds: measured.seconds,
            seconds_per_step: measured.seconds / args.steps.max(1) as f64,
            any_order: args.any_order,
            calls: measured.calls,
            blocks_run: measured.blocks_run,
            refills: stats.refills,
            hot_hits: stats.hot_hits,
            carried: stats.carried,
            most_held: stats.most_held,
            bytes_refilled: stats.bytes_refilled,
            refill_seconds: stats.refill_seconds,
            waited_seconds: stats.waited_seconds,
        }
    }

    /// Prints the latent's fingerprint and the peak RSS line over `steps` steps.
    pub fn print(&self, steps: i64) {
        println!("latent {}", self.fingerprint);
        println!(
            "peak RSS {} ({} over the {} before set-up); {:.2} s for {steps} steps",
            format_bytes(self.peak_rss),
            format_bytes(self.peak_rss.saturating_sub(self.base_rss)),
            format_bytes(self.base_rss),
            self.seconds,
        );
    }
}
