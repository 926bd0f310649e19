//! The command line the demo pipelines share, and its checks.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use stageload::PrefetchPace;
use stageload_pipelines::runner::Loading;
use tch::Device;

use crate::weights::cache_root;

/// How the pipeline loads its models: the one name is [`Loading`] (`--mode eager|staged|prefetch`).
#[deprecated(note = "use Loading (CommonArgs::loading)")]
pub type Mode = Loading;

/// A `--scale`: a finite number above zero.
pub fn positive_scale(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(scale) if scale.is_finite() && scale > 0.0 => Ok(scale),
        _ => Err(format!("'{text}' is not a positive number (1 is the default size, 0.01 a tiny one)")),
    }
}

/// What the examples' command lines share.
#[derive(Debug, Clone, clap::Args)]
pub struct CommonArgs {
    /// eager: load everything up front; staged: per stage; prefetch: staged, the next stage's
    /// models loaded in the background while a stage computes (models built without random
    /// initialisation)
    #[arg(long, value_enum, default_value = "staged")]
    mode: Loading,
    /// Model and token sizes relative to the default (1.0: about 3 GB of weights; 4 for bigger machines)
    #[arg(long, default_value_t = 1.0, value_parser = positive_scale)]
    pub scale: f64,
    /// Seed of the run (0 to 2^63 - 1: torch's generators take it too)
    #[arg(long, default_value_t = 7, value_parser = clap::value_parser!(u64).range(..=i64::MAX as u64))]
    pub seed: u64,
    /// Sampler steps per flow stage
    #[arg(long, default_value_t = 3)]
    pub steps: i64,
    /// The JSONL trace of the run (default: $STAGELOAD_TRACE when set, else a temporary file)
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// Write the latents (safetensors) to this file, and their fingerprints to FILE.sha256
    /// (default: $STAGELOAD_LATENTS when set)
    #[arg(long, value_name = "FILE")]
    pub latents: Option<PathBuf>,
    /// Write what the run did (latent fingerprints, the residency at every checked call, the
    /// pipeline description) as JSON (default: $STAGELOAD_RESULT when set)
    #[arg(long, value_name = "FILE", env = stageload_trace::meter::RESULT_ENV, hide_env = true)]
    pub result: Option<PathBuf>,
    /// Folder of the cached checkpoints (default: $STAGELOAD_CACHE or ~/.cache/stageload, then demo-weights/)
    #[arg(long)]
    pub cache: Option<PathBuf>,
    /// Print and check, at every model call, that the resident models are the stage's plan
    #[arg(long)]
    pub check_residency: bool,
    /// Control experiment: do not preserve the generators around lazy builds
    #[arg(long)]
    pub no_preserve_rng: bool,
    /// Control experiment: run without the host block cache (every freed activation block goes
    /// back to the OS and the next step faults it in again)
    #[arg(long)]
    pub no_host_cache: bool,
    /// Control experiment: the host block cache's blocks get no huge pages (every 4 KiB page of
    /// fresh memory faults in on its own)
    #[arg(long)]
    pub no_huge_pages: bool,
    /// The same as --mode prefetch (kept for one release)
    #[arg(long, hide = true)]
    prefetch: bool,
    /// With --mode prefetch: how the background copy into CPU memory goes while the stage computes:
    /// auto (paced to a quarter of one core where torch's threads take every core), paced, or
    /// full
    #[arg(long, default_value = "auto", value_parser = |t: &str| t.parse::<PrefetchPace>().map_err(|e| e.to_string()))]
    pub prefetch_pace: PrefetchPace,
    /// Staged: keep released device models' weights in this much pinned host memory (e.g.
    /// 4GiB) and reload them from it; CPU models are not held (a `tier` event says so)
    #[arg(long, value_name = "SIZE", value_parser = |t: &str| stageload_units::parse_size(t).map_err(|e| e.to_string()))]
    pub host_tier: Option<u64>,
    /// Drop the checkpoints' pages from the page cache before the run: every load reads the disk
    #[arg(long)]
    pub cold: bool,
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
    if text == "auto" {
        return Ok(Device::cuda_if_available());
    }
    match stageload::device::from_name(text) {
        Some(Device::Cuda(index)) => cuda(index),
        Some(Device::Mps) if !stageload_torch_sys::mps_available().unwrap_or(false) => {
            Err("MPS is not available on this machine; use --device cpu".into())
        }
        Some(device) => Ok(device),
        None => Err(format!("unknown device '{text}' (auto, cpu, cuda, cuda:N or mps)")),
    }
}

impl CommonArgs {
    /// `--seed` as torch's generators and the pipelines' noise take it (the parser keeps it at
    /// most `i64::MAX`, so it is the same number).
    pub fn torch_seed(&self) -> i64 {
        self.seed as i64
    }

    /// How the models load: `--mode` (`--prefetch` with `--mode staged` is `prefetch`).
    pub fn loading(&self) -> Loading {
        match (self.mode, self.prefetch) {
            (Loading::Staged, true) => Loading::Prefetch,
            (loading, _) => loading,
        }
    }

    /// The checkpoint folder for `pipeline` at this scale.
    pub fn cache_folder(&self, pipeline: &str) -> PathBuf {
        self.cache.clone().unwrap_or_else(cache_root).join(format!("{pipeline}-scale-{}", self.scale))
    }
}

/// The comparison with the pipeline's Python original that each pipeline example offers
/// (`--compare-python`; the example's documentation names its reference script).
#[derive(Debug, Clone, clap::Args)]
pub struct CompareArgs {
    /// Afterwards, run the pipeline's Python original (diffusers) on the same weights, inputs and
    /// seed (scripts/reference/*_reference.py) and print the largest differences
    #[arg(long)]
    pub compare_python: bool,
    /// The Python with torch and diffusers for --compare-python (default: $STAGELOAD_PYTHON,
    /// else the cached environment scripts/setup-libtorch.sh makes)
    #[arg(long, value_name = "FILE")]
    pub python: Option<PathBuf>,
    /// --compare-python: stop the reference after this many seconds
    #[arg(long, default_value_t = 3600, value_name = "SECONDS")]
    pub python_deadline: u64,
}

impl CompareArgs {
    /// The Python to run: `--python`, else `$STAGELOAD_PYTHON`, else the cached environment.
    pub fn python(&self) -> PathBuf {
        stageload_pipelines::compare::python(self.python.as_deref())
    }

    /// `--python-deadline`.
    pub fn deadline(&self) -> std::time::Duration {
        std::time::Duration::from_secs(self.python_deadline)
    }
}

/// How a pipeline example's command line differs from [`CommonArgs`]' defaults.
#[derive(Debug, Clone, Copy)]
pub struct PipelineArgs {
    /// `--steps`' default.
    pub steps: &'static str,
    /// `--steps`' help (the scheduler, what a step costs).
    pub steps_help: &'static str,
    /// `--device`' help (the example's export decides where it runs).
    pub device_help: &'static str,
    /// The line after the help: an example command.
    pub example: &'static str,
    /// Runs on the CPU only, and why (an export traced there: its traces record the device).
    pub cpu_only: Option<&'static str>,
}

/// Parses the command line of a pipeline example (`examples/stable_diffusion.rs`, `shap_e.rs`,
/// `wan.rs`): `A`'s arguments with [`CommonArgs`] flattened in, `--steps` and `--device` (default
/// `cpu`) as `how` says, `--scale` hidden (an export has one size), another device than the CPU
/// refused where `how.cpu_only` says so. `common` gives `A`'s [`CommonArgs`].
pub fn parse_pipeline<A: clap::Parser>(
    how: PipelineArgs,
    common: fn(&mut A) -> &mut CommonArgs,
) -> Result<A, clap::Error> {
    let command = A::command()
        .mut_arg("steps", |a| a.default_value(how.steps).help(how.steps_help))
        .mut_arg("device", |a| a.default_value("cpu").help(how.device_help))
        .mut_arg("scale", |a| a.hide(true))
        .after_help(how.example);
    let matches = command.try_get_matches()?;
    let mut args = A::from_arg_matches(&matches)?;
    if let Some(why) = how.cpu_only.filter(|_| common(&mut args).device != Device::Cpu) {
        return Err(
            A::command().error(clap::error::ErrorKind::ArgumentConflict, format!("{why}: run with --device cpu"))
        );
    }
    Ok(args)
}

/// No export where a pipeline example looks for it by default.
#[derive(Debug, thiserror::Error)]
#[error(
    "no export at {} (the default --components). Make it once ({cost}):\n  $STAGELOAD_PYTHON \
     scripts/reference/{export} --out {}\n(eval \"$(scripts/setup-libtorch.sh)\"; eval \
     \"$(scripts/setup-reference.sh)\" sets STAGELOAD_PYTHON and installs torch and diffusers), or give \
     --components DIR",
    dir.display(),
    dir.display()
)]
pub struct NoExport {
    /// The folder looked in.
    pub dir: PathBuf,
    /// The export script and its arguments (`sd_export.py --size sd15`).
    pub export: &'static str,
    /// What making it takes (`about 7.7 GB`).
    pub cost: &'static str,
}

/// The export a pipeline example runs: `given` (`--components`), else `folder` in the stageload
/// cache, where the published size is exported once. Missing there, the error gives the command
/// that makes it: `export` (`sd_export.py --size sd15`), which takes `cost` (`about 7.7 GB`).
pub fn export_folder(
    given: Option<&Path>,
    folder: &str,
    export: &'static str,
    cost: &'static str,
) -> Result<PathBuf, NoExport> {
    if let Some(given) = given {
        return Ok(given.to_path_buf());
    }
    let dir = stageload_pipelines::stageload_cache().join(folder);
    if dir.join("config.json").is_file() {
        return Ok(dir);
    }
    Err(NoExport { dir, export, cost })
}

/// A pipeline example's exit: success, or `name: error` on stderr and failure.
pub fn exit(name: &str, result: Result<(), stageload::BoxError>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("{name}: {error}");
            ExitCode::FAILURE
        }
    }
}
