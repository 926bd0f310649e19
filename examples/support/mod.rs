//! Parts shared by the demo pipelines (`cascade`, `text_to_image`): transformer models as real
//! tch modules, checkpoints written once and cached, the eager or staged registry, residency
//! checks at every model call, fingerprints of latents, and the meter.
#![allow(dead_code)]

use std::collections::BTreeSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use sha2::{Digest, Sha256};
use stageload::meter::{self, Meter, MeterOptions};
use stageload::{BoxError, BuildContext, Built, ModelSpec, StagedModels};
use stageload_plan::{ModelEntry, PipelineFile, StageEntry};
use tch::nn::{self, Module, VarStore};
use tch::{Device, Kind, Tensor};

/// Channels of every latent, whatever the scale.
pub const CHANNELS: i64 = 64;

/// Pre-norm transformer block: multi-head self-attention and a GELU MLP, each with a residual.
#[derive(Debug)]
pub struct Block {
    norm1: nn::LayerNorm,
    qkv: nn::Linear,
    proj: nn::Linear,
    norm2: nn::LayerNorm,
    fc1: nn::Linear,
    fc2: nn::Linear,
    heads: i64,
}

impl Block {
    pub fn new(p: nn::Path, width: i64) -> Self {
        Block {
            norm1: nn::layer_norm(&p / "norm1", vec![width], Default::default()),
            qkv: nn::linear(&p / "qkv", width, 3 * width, Default::default()),
            proj: nn::linear(&p / "proj", width, width, Default::default()),
            norm2: nn::layer_norm(&p / "norm2", vec![width], Default::default()),
            fc1: nn::linear(&p / "fc1", width, 4 * width, Default::default()),
            fc2: nn::linear(&p / "fc2", 4 * width, width, Default::default()),
            heads: (width / 64).max(1),
        }
    }
}

impl Module for Block {
    /// `x`: [tokens, width].
    fn forward(&self, x: &Tensor) -> Tensor {
        let (tokens, width) = x.size2().expect("[tokens, width]");
        let head = width / self.heads;
        let qkv = x.apply(&self.norm1).apply(&self.qkv).view([tokens, 3, self.heads, head]).permute([1, 2, 0, 3]);
        let (q, k, v) = (qkv.get(0), qkv.get(1), qkv.get(2));
        let attention = (q.matmul(&k.transpose(-2, -1)) / (head as f64).sqrt()).softmax(-1, Kind::Float);
        let mixed = attention.matmul(&v).permute([1, 0, 2]).reshape([tokens, width]).apply(&self.proj);
        let x = x + mixed;
        let hidden = x.apply(&self.norm2).apply(&self.fc1).gelu("tanh").apply(&self.fc2);
        x + hidden
    }
}

/// Input projection, transformer blocks, output norm and projection.
#[derive(Debug)]
pub struct Transformer {
    input: nn::Linear,
    blocks: Vec<Block>,
    norm: nn::LayerNorm,
    output: nn::Linear,
}

impl Transformer {
    pub fn new(p: nn::Path, shape: &ModelShape) -> Self {
        Transformer {
            input: nn::linear(&p / "input", shape.input, shape.width, Default::default()),
            blocks: (0..shape.depth).map(|i| Block::new(&p / "blocks" / i, shape.width)).collect(),
            norm: nn::layer_norm(&p / "norm", vec![shape.width], Default::default()),
            output: nn::linear(&p / "output", shape.width, shape.output, Default::default()),
        }
    }
}

impl Module for Transformer {
    fn forward(&self, x: &Tensor) -> Tensor {
        let x = self.blocks.iter().fold(x.apply(&self.input), |x, block| block.forward(&x));
        x.apply(&self.norm).apply(&self.output)
    }
}

/// A model's architecture.
#[derive(Debug, Clone)]
pub struct ModelShape {
    pub name: &'static str,
    pub input: i64,
    pub width: i64,
    pub depth: i64,
    pub output: i64,
}

/// Width at a scale: bytes grow with the scale (width² per block), rounded to 64.
pub fn width_at(base: i64, scale: f64) -> i64 {
    (((base as f64) * scale.sqrt() / 64.0).ceil() as i64 * 64).max(64)
}

/// Tokens at a scale, rounded to 16.
pub fn tokens_at(base: i64, scale: f64) -> i64 {
    (((base as f64) * scale.sqrt() / 16.0).ceil() as i64 * 16).max(16)
}

pub fn sorted_variables(vs: &VarStore) -> Vec<(String, Tensor)> {
    let mut vars: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    vars
}

/// The checkpoint of `shape` under `folder`, written once from weights drawn with `seed` (same
/// seed, same weights, every time).
pub fn cached_checkpoint(folder: &Path, shape: &ModelShape, prefix: &[&str], seed: i64) -> Result<PathBuf, BoxError> {
    let path = folder.join(format!("{}-{}x{}.safetensors", shape.name, shape.width, shape.depth));
    cached(&path, seed, |vs| {
        let _ = Transformer::new(prefix.iter().fold(vs.root(), |p, part| p / *part), shape);
    })?;
    Ok(path)
}

/// Writes `path` once from the variables `build` creates with torch seeded by `seed`
/// (`checkpoint::save` writes a temporary name and renames it, so an interrupted write never
/// leaves a file that looks complete).
pub fn cached(path: &Path, seed: i64, build: impl FnOnce(&VarStore)) -> Result<(), BoxError> {
    if path.exists() {
        return Ok(());
    }
    if let Some(folder) = path.parent() {
        std::fs::create_dir_all(folder)?;
    }
    tch::manual_seed(seed);
    let vs = VarStore::new(Device::Cpu);
    build(&vs);
    stageload::checkpoint::save(&sorted_variables(&vs), path)?;
    Ok(())
}

/// A loader that builds `shape` on `device` (random initialisation: it draws from torch's
/// generator, as a real model's constructor does); the registry fills it from its checkpoint.
pub fn transformer_loader(
    shape: ModelShape,
    device: Device,
) -> impl Fn(&BuildContext) -> Result<Built, BoxError> + Send + Sync {
    move |_| {
        let vs = VarStore::new(device);
        let model = Transformer::new(vs.root() / "model", &shape);
        Ok(Built::new(model, &vs))
    }
}

/// SHA-256 of a tensor's values (as f32 on the CPU) and shape: equal fingerprints, equal bits.
pub fn fingerprint(tensor: &Tensor) -> String {
    let values = tensor.to_device(Device::Cpu).to_kind(Kind::Float).contiguous();
    let mut bytes = vec![0u8; values.numel() * 4];
    values.copy_data_u8(&mut bytes, values.numel());
    let mut hasher = Sha256::new();
    hasher.update(format!("{:?}", values.size()).as_bytes());
    hasher.update(&bytes);
    format!("{:x}", hasher.finalize())
}

/// A progress bar on stderr for each checkpoint load (shown only at a terminal).
fn progress_bar() -> impl Fn(&str, stageload::checkpoint::Progress) + Send + Sync {
    let bar: std::sync::Mutex<Option<(String, indicatif::ProgressBar)>> = std::sync::Mutex::new(None);
    move |model, progress| {
        let mut current = bar.lock().unwrap_or_else(|e| e.into_inner());
        if current.as_ref().is_none_or(|(name, _)| name != model) {
            let new = indicatif::ProgressBar::new(progress.total).with_message(format!("loading {model}"));
            new.set_style(
                indicatif::ProgressStyle::with_template(
                    "{msg:<28} {bar:30} {bytes}/{total_bytes} {binary_bytes_per_sec}",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            *current = Some((model.to_string(), new));
        }
        if let Some((_, bar)) = current.as_ref() {
            bar.set_position(progress.done);
            if progress.done >= progress.total {
                bar.finish_and_clear();
                *current = None;
            }
        }
    }
}

/// How the pipeline loads its models.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// Every model loaded up front and kept (the baseline).
    Eager,
    /// Each stage's models loaded on first use and released when a stage does not list them.
    Staged,
}

/// The registry, the plan it runs, the meter, and the checks and prints around every call.
pub struct Pipeline {
    pub models: StagedModels,
    pub mode: Mode,
    plan: Vec<(String, Vec<String>)>,
    pinned: Vec<String>,
    meter: Arc<Meter>,
    trace: PathBuf,
    /// The trace was not asked for: it goes away after the stage peaks are printed.
    temporary_trace: bool,
    check_residency: bool,
    fingerprints: Vec<(String, String)>,
    fingerprint_file: Option<PathBuf>,
}

fn positive_scale(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(scale) if scale.is_finite() && scale > 0.0 => Ok(scale),
        _ => Err(format!("'{text}' is not a positive number (1 is the default size, 0.01 a tiny one)")),
    }
}

/// What the examples' command lines share.
#[derive(Debug, Clone, clap::Args)]
pub struct CommonArgs {
    /// eager: load everything up front; staged: per stage
    #[arg(long, value_enum, default_value = "staged")]
    pub mode: Mode,
    /// Model and token sizes relative to the default (1.0: about 3 GB of weights; 4 for bigger machines)
    #[arg(long, default_value_t = 1.0, value_parser = positive_scale)]
    pub scale: f64,
    /// Seed of the run
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// Sampler steps per flow stage
    #[arg(long, default_value_t = 3)]
    pub steps: i64,
    /// The JSONL trace of the run (default: a temporary file)
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Write each stage's latent fingerprint to this file too
    #[arg(long)]
    pub fingerprints: Option<PathBuf>,
    /// Folder of the cached checkpoints (default: $STAGELOAD_CACHE or ~/.cache/stageload, then demo-weights/)
    #[arg(long)]
    pub cache: Option<PathBuf>,
    /// Print and check, at every model call, that the resident models are the stage's plan
    #[arg(long)]
    pub check_residency: bool,
    /// Control experiment: do not preserve the generators around lazy builds
    #[arg(long)]
    pub no_preserve_rng: bool,
    /// Staged: load the next stage's models in the background while a stage computes (models
    /// built without random initialisation)
    #[arg(long)]
    pub prefetch: bool,
    /// Where the models and the noise live: auto (CUDA when present, else the CPU), cpu, cuda,
    /// cuda:N, mps
    #[arg(long, default_value = "auto", value_parser = parse_device)]
    pub device: Device,
}

/// `auto`, `cpu`, `cuda`, `cuda:N` or `mps`; a device this machine lacks is refused.
pub fn parse_device(text: &str) -> Result<Device, String> {
    let cuda = |index: usize| {
        let count = stageload_torch_sys::cuda_device_count().unwrap_or(0);
        if index < count {
            Ok(Device::Cuda(index))
        } else {
            Err(format!("cuda:{index} does not exist: this machine has {count} CUDA device(s); use --device cpu"))
        }
    };
    match text {
        "auto" => Ok(Device::cuda_if_available()),
        "cpu" => Ok(Device::Cpu),
        "cuda" => cuda(0),
        "mps" if stageload_torch_sys::mps_available().unwrap_or(false) => Ok(Device::Mps),
        "mps" => Err("MPS is not available on this machine; use --device cpu".into()),
        other => match other.strip_prefix("cuda:").and_then(|n| n.parse().ok()) {
            Some(index) => cuda(index),
            None => Err(format!("unknown device '{other}' (auto, cpu, cuda, cuda:N or mps)")),
        },
    }
}

impl CommonArgs {
    /// The checkpoint folder for `pipeline` at this scale.
    pub fn cache_folder(&self, pipeline: &str) -> PathBuf {
        let root = self.cache.clone().unwrap_or_else(|| {
            std::env::var_os("STAGELOAD_CACHE")
                .map(PathBuf::from)
                .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cache/stageload")))
                .unwrap_or_else(|| PathBuf::from("target"))
                .join("demo-weights")
        });
        root.join(format!("{pipeline}-scale-{}", self.scale))
    }
}

/// Specs, plan and pins for [`Pipeline::build`].
pub struct PipelineSpec {
    pub name: &'static str,
    pub models: Vec<ModelSpec>,
    pub stages: Vec<(String, Vec<String>)>,
    pub pinned: Vec<String>,
}

impl PipelineSpec {
    /// Writes the pipeline description `stageload plan` reads (models with their checkpoint
    /// files, stages, pins) to `path`.
    pub fn write_description(&self, path: &Path, device: Device) -> Result<(), BoxError> {
        let description = PipelineFile {
            pinned: self.pinned.clone(),
            models: self
                .models
                .iter()
                .map(|m| ModelEntry {
                    name: m.name().to_string(),
                    files: m.checkpoint_files().to_vec(),
                    device: meter::device_name(device),
                    dtype: None,
                })
                .collect(),
            stages: self
                .stages
                .iter()
                .map(|(name, models)| StageEntry {
                    name: name.clone(),
                    models: models.clone(),
                    working: None,
                    device_working: None,
                })
                .collect(),
        };
        std::fs::write(path, toml::to_string(&description)?)?;
        Ok(())
    }
}

impl Pipeline {
    /// Builds the registry for `mode`: staged runs the plan; eager pins every model (so no
    /// stage releases anything) and the caller loads them all before seeding.
    pub fn build(
        spec: PipelineSpec,
        args: &CommonArgs,
        chacha: Arc<dyn stageload::rng::RngSnapshot>,
    ) -> Result<Pipeline, BoxError> {
        let trace = args.trace.clone().unwrap_or_else(|| {
            std::env::temp_dir().join(format!("stageload-{}-{}.jsonl", spec.name, std::process::id()))
        });
        let mode_name = match args.mode {
            Mode::Eager => "eager",
            Mode::Staged => "staged",
        };
        let options = MeterOptions::default()
            .meta("mode", mode_name)
            .meta("pipeline", spec.name)
            .meta("scale", args.scale)
            .meta("seed", args.seed)
            .meta("preserve_rng", !args.no_preserve_rng)
            .meta("prefetch", args.prefetch)
            .meta("device", meter::device_name(args.device));
        let meter = Arc::new(meter::start(&trace, args.device, options)?);
        let names: Vec<String> = spec.models.iter().map(|m| m.name().to_string()).collect();
        let description = args.cache_folder(spec.name).join(format!("{}.toml", spec.name));
        spec.write_description(&description, args.device)?;
        println!("pipeline description {} (stageload plan reads it)", description.display());
        // Eager: every stage lists every model and every model is pinned, so nothing is ever
        // released and no load is outside its stage.
        let (plan, pinned) = match args.mode {
            Mode::Staged => (spec.stages.clone(), spec.pinned.clone()),
            Mode::Eager => {
                (spec.stages.iter().map(|(stage, _)| (stage.clone(), names.clone())).collect(), names.clone())
            }
        };
        let mut builder =
            StagedModels::builder().events(meter.clone()).register_rng(chacha).preserve_rng(!args.no_preserve_rng);
        if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
            builder = builder.progress(progress_bar());
        }
        for model in spec.models {
            // Prefetched builds must draw nothing: every weight comes from the checkpoint.
            builder = builder.model(if args.prefetch { model.skip_init(true) } else { model });
        }
        builder = builder.prefetch_next(args.prefetch);
        match args.mode {
            // Staged: stages and pins come from the description `stageload plan` checks.
            Mode::Staged => builder = builder.pipeline(&stageload::Pipeline::load(&description)?),
            Mode::Eager => {
                for (stage, models) in &plan {
                    builder = builder.stage(stage.clone(), models.iter().cloned());
                }
                for name in &pinned {
                    builder = builder.pin(name.clone());
                }
            }
        }
        Ok(Pipeline {
            models: builder.build()?,
            mode: args.mode,
            plan,
            pinned,
            meter,
            trace,
            temporary_trace: args.trace.is_none(),
            check_residency: args.check_residency,
            fingerprints: Vec::new(),
            fingerprint_file: args.fingerprints.clone(),
        })
    }

    /// Eager mode: loads every model now.
    pub fn load_everything(&self) -> Result<(), BoxError> {
        for name in self.models.names() {
            self.models.load(&name)?;
        }
        Ok(())
    }

    pub fn enter(&self, stage: &str) -> Result<(), BoxError> {
        self.models.enter(stage)?;
        Ok(())
    }

    /// Calls `f` on model `name` (built on first use). With `--check-residency`, checks first
    /// that what is resident is what the stage plans: the called model, the stage's other models
    /// and pinned ones, nothing left over from earlier stages.
    pub fn call<M: 'static, R>(&self, model: &str, f: impl FnOnce(&mut M) -> R) -> Result<R, BoxError> {
        if self.check_residency {
            self.models.load(model)?;
            self.check_resident(model)?;
        }
        Ok(self.models.call(model, f)?)
    }

    fn check_resident(&self, model: &str) -> Result<(), BoxError> {
        let stage = self.models.current_stage().unwrap_or_default();
        let resident = self.models.resident();
        let planned: BTreeSet<&String> = self
            .plan
            .iter()
            .filter(|(s, _)| *s == stage)
            .flat_map(|(_, m)| m.iter())
            .chain(self.pinned.iter())
            .collect();
        println!("call {stage} {model} resident {}", resident.join(","));
        let unplanned: Vec<&String> = resident.iter().filter(|name| !planned.contains(name)).collect();
        if !unplanned.is_empty() || !resident.iter().any(|r| r == model) {
            return Err(format!("at {stage}, calling {model}: resident {resident:?}, not planned {unplanned:?}").into());
        }
        Ok(())
    }

    /// Records and prints a stage's latent fingerprint.
    pub fn latent(&mut self, name: &str, tensor: &Tensor) {
        let print = fingerprint(tensor);
        println!("latent {name} {:?} sha256 {print}", tensor.size());
        self.fingerprints.push((name.to_string(), print));
    }

    /// Closes the registry and the meter, prints each stage's peak, writes the fingerprints.
    pub fn finish(self) -> Result<(), BoxError> {
        self.models.close()?;
        self.meter.finish();
        let summary = stageload::meter::summarize(&stageload::meter::read_trace(&self.trace)?);
        if !self.temporary_trace {
            println!("trace {}", self.trace.display());
        }
        for window in &summary.stages {
            let peak = window.peak.map_or("-".to_string(), |p| format!("{:.1} MiB", p as f64 / (1u64 << 20) as f64));
            println!("stage {:<12} {:>8.2} s  peak {peak}", window.stage, window.seconds);
        }
        println!(
            "loaded {} models ({} reloads), {:.1} MiB in {:.2} s; overall peak {:.1} MiB",
            summary.loads.count,
            summary.loads.reloads,
            summary.loads.bytes as f64 / (1u64 << 20) as f64,
            summary.loads.seconds,
            summary.peak as f64 / (1u64 << 20) as f64
        );
        if self.temporary_trace {
            std::fs::remove_file(&self.trace)?;
        }
        if let Some(path) = &self.fingerprint_file {
            let mut file = std::fs::File::create(path)?;
            for (name, print) in &self.fingerprints {
                writeln!(file, "{name} {print}")?;
            }
        }
        Ok(())
    }
}

/// One sampler step size schedule: `steps` times in (0, 1], each nudged by the pipeline's ChaCha
/// generator as a stochastic sampler would.
pub fn schedule(steps: i64, chacha: &stageload::SharedRng<rand_chacha::ChaCha8Rng>) -> Vec<f64> {
    use rand::Rng;
    (0..steps).map(|i| (i as f64 + 1.0) / steps as f64 - chacha.lock().gen_range(0.0..0.01)).collect()
}

/// Runs a flow model for the schedule: x ← x − dt · v(x + cond), fresh noise mixed in per step.
pub fn sample_flow(model: &Transformer, mut x: Tensor, cond: &Tensor, times: &[f64]) -> Tensor {
    let _no_grad = tch::no_grad_guard();
    let mut previous = 0.0;
    for &t in times {
        let velocity = model.forward(&(&x + cond));
        let noise = Tensor::randn_like(&x) * 0.05;
        x = x - velocity * (t - previous) + noise;
        previous = t;
    }
    x
}
