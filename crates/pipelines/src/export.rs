//! What the pipelines someone else wrote share (Stable Diffusion, Shap-E, Wan): how an export's
//! components are read ([`ComponentFiles`], [`Format`]), the registry a pipeline runs on for a
//! [`Loading`] ([`registry`]), what a run calls ([`StageRunner`], [`forward`]), and the
//! comparison against the Python original: its script ([`reference_script`], [`run_script`]) and
//! the largest differences ([`Difference`], [`TOLERANCE`]); and writing an output file whole or
//! not at all ([`write_atomically`], [`FileError`]).

use std::fmt;
use std::fs::File;
use std::io::BufWriter;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Deserialize;
use stageload::pt2::Pt2Module;
use stageload::{BoxError, EventSink, ModelSpec, StagedModels};
use tch::{CModule, Device, Kind, Tensor};

use crate::run::DemoRun;

/// A component's TorchScript file and its safetensors checkpoint (the traced module's names),
/// relative to the export's folder.
#[derive(Debug, Clone, Deserialize)]
pub struct ComponentFiles {
    /// The TorchScript file.
    pub file: String,
    /// The safetensors checkpoint.
    pub weights: String,
}

/// How a pipeline's components were exported (the export scripts in `scripts/reference/`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// TorchScript modules traced by the export script (`NAME.pt`, `NAME.safetensors`).
    Torchscript,
    /// AOTInductor packages compiled from the same modules and weights (`sd_pt2.py`,
    /// `shap_e_pt2.py`: `pt2/NAME.pt2`, `pt2/NAME.safetensors`).
    Pt2,
}

/// How the registry loads the models.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Loading {
    /// Every model loaded up front and kept.
    Eager,
    /// Each stage's model loaded when the stage calls it; the others released when a stage
    /// begins.
    Staged,
    /// Staged, and each stage's entry starts loading the next stage's model in the background.
    Prefetch,
}

impl Loading {
    /// `eager`, `staged` or `prefetch`.
    pub fn name(self) -> &'static str {
        match self {
            Loading::Eager => "eager",
            Loading::Staged => "staged",
            Loading::Prefetch => "prefetch",
        }
    }
}

/// A registry of `specs` with `stages` (each with the models it runs) for `loading`, its events to
/// `events`. Eager: every model pinned and loaded now, so nothing is ever released. (The command
/// line places models on other devices through `DemoRun`'s pipeline file.)
pub fn registry<'a>(
    specs: Vec<ModelSpec>,
    stages: impl IntoIterator<Item = (&'a str, &'a [&'a str])>,
    loading: Loading,
    events: Option<Arc<dyn EventSink>>,
) -> Result<StagedModels, BoxError> {
    let names: Vec<String> = specs.iter().map(|spec| spec.name().to_string()).collect();
    let mut builder = StagedModels::builder().prefetch_next(loading == Loading::Prefetch);
    if let Some(sink) = events {
        builder = builder.events(sink);
    }
    for spec in specs {
        builder = builder.model(spec);
    }
    for (stage, models) in stages {
        builder = builder.stage(stage, models.iter().copied());
    }
    if loading == Loading::Eager {
        for model in &names {
            builder = builder.pin(model);
        }
    }
    let models = builder.build()?;
    if loading == Loading::Eager {
        for model in &names {
            models.load(model)?;
        }
    }
    Ok(models)
}

/// What the pipeline runs on: stages to enter and models to call (a registry, or a demo run with
/// its meter and checks). Tests wrap one to watch every call.
pub trait StageRunner {
    /// Enters `stage` (releasing what it does not list).
    fn enter(&self, stage: &str) -> Result<(), BoxError>;
    /// Calls `f` on the model `model`, loaded if needed.
    fn call<M: 'static, R>(&self, model: &str, f: impl FnOnce(&mut M) -> R) -> Result<R, BoxError>;
}

impl StageRunner for StagedModels {
    fn enter(&self, stage: &str) -> Result<(), BoxError> {
        StagedModels::enter(self, stage)?;
        Ok(())
    }

    fn call<M: 'static, R>(&self, model: &str, f: impl FnOnce(&mut M) -> R) -> Result<R, BoxError> {
        Ok(StagedModels::call(self, model, f)?)
    }
}

impl StageRunner for DemoRun {
    fn enter(&self, stage: &str) -> Result<(), BoxError> {
        DemoRun::enter(self, stage)
    }

    fn call<M: 'static, R>(&self, model: &str, f: impl FnOnce(&mut M) -> R) -> Result<R, BoxError> {
        DemoRun::call(self, model, f)
    }
}

/// Runs the model `model` (of `format`) on `inputs`; a failing forward is an error naming it.
pub fn forward(runner: &impl StageRunner, format: Format, model: &str, inputs: &[Tensor]) -> Result<Tensor, BoxError> {
    let failed = |e: &dyn std::fmt::Display| format!("{model}: forward failed: {e}");
    match format {
        Format::Torchscript => {
            runner.call(model, |m: &mut CModule| m.forward_ts(inputs))?.map_err(|e| failed(&e).into())
        }
        Format::Pt2 => {
            let inputs: Vec<&Tensor> = inputs.iter().collect();
            let mut outputs = runner.call(model, |m: &mut Pt2Module| m.forward(&inputs))?.map_err(|e| failed(&e))?;
            match outputs.len() {
                1 => Ok(outputs.remove(0)),
                n => Err(failed(&format!("{n} outputs, not one")).into()),
            }
        }
    }
}

/// `scripts/reference/NAME` in this checkout; for a binary carried into a checkout on another
/// machine (the GPU check's device kit), the one in the checkout holding the binary.
pub fn reference_script(name: &str) -> PathBuf {
    let script = Path::new("scripts/reference").join(name);
    let built = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..").join(&script);
    if built.exists() {
        return built;
    }
    let exe = std::env::current_exe().ok();
    exe.and_then(|exe| exe.ancestors().map(|dir| dir.join(&script)).find(|path| path.exists())).unwrap_or(built)
}

/// The Python a comparison runs: `given`, else `$STAGELOAD_PYTHON`, else the cached environment
/// `scripts/setup-libtorch.sh` makes.
pub fn python(given: Option<&Path>) -> PathBuf {
    given
        .map(Path::to_path_buf)
        .or_else(|| std::env::var_os("STAGELOAD_PYTHON").map(PathBuf::from))
        .unwrap_or_else(|| crate::weights::stageload_cache().join("torch-2.13.0/bin/python"))
}

/// The largest difference between two tensors, and the reference's value range.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Difference {
    /// max |rust - reference|.
    pub largest: f64,
    /// max - min of the reference.
    pub range: f64,
}

impl Difference {
    /// `rust` against `reference`: their dtypes and shapes must agree, and neither may be empty.
    pub fn of(what: &str, rust: &Tensor, reference: &Tensor) -> Result<Difference, BoxError> {
        if (rust.kind(), rust.size()) != (reference.kind(), reference.size()) || reference.numel() == 0 {
            return Err(format!(
                "{what}: Rust's {:?} {:?} against the reference's {:?} {:?} (both the same, not empty)",
                rust.kind(),
                rust.size(),
                reference.kind(),
                reference.size()
            )
            .into());
        }
        let (rust, reference) = (rust.to_device(Device::Cpu).to_kind(Kind::Double), reference.to_kind(Kind::Double));
        let largest = (&rust - &reference).abs().f_max()?.f_double_value(&[])?;
        let range = (reference.f_max()? - reference.f_min()?).f_double_value(&[])?;
        Ok(Difference { largest, range })
    }

    /// The largest difference as a fraction of the range.
    pub fn relative(&self) -> f64 {
        if self.range > 0.0 {
            self.largest / self.range
        } else {
            self.largest
        }
    }

    /// Whether the largest difference is within `tolerance` of the range (a NaN on either side
    /// never is).
    pub fn within(&self, tolerance: f64) -> bool {
        self.relative() <= tolerance
    }
}

impl fmt::Display for Difference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:.3e} ({:.3e} of the range {:.4})", self.largest, self.relative(), self.range)
    }
}

/// The largest difference from diffusers allowed, as a fraction of the reference's value range.
pub const TOLERANCE: f64 = 1e-5;

/// A run against the Python original: each compared tensor's largest difference, and the checks
/// that hold or not (the timesteps, a mesh's faces, a video's pixels, ...).
#[derive(Debug, Default)]
pub struct Comparison {
    /// (what, difference) for every tensor both sides have.
    pub differences: Vec<(&'static str, Difference)>,
    /// (what, whether it holds).
    pub equal: Vec<(&'static str, bool)>,
}

impl Comparison {
    /// What is not as the original has it: each check that fails and each tensor whose largest
    /// difference is not within [`TOLERANCE`] of its range. Empty: the run matches.
    pub fn failures(&self) -> Vec<String> {
        let checks = self.equal.iter().filter(|(_, ok)| !ok).map(|(what, _)| format!("{what}: not equal"));
        let tensors = self
            .differences
            .iter()
            .filter(|(_, d)| !d.within(TOLERANCE))
            .map(|(what, d)| format!("{what}: largest difference {d}, over {TOLERANCE:e} of the range"));
        checks.chain(tensors).collect()
    }

    /// Whether every tensor equals the original's (largest difference 0) and every check holds.
    pub fn identical(&self) -> bool {
        self.differences.iter().all(|(_, d)| d.largest == 0.0) && self.equal.iter().all(|(_, ok)| *ok)
    }
}

impl fmt::Display for Comparison {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (what, difference) in &self.differences {
            writeln!(f, "{what:<16} {difference}")?;
        }
        let checks: Vec<String> =
            self.equal.iter().map(|(what, ok)| format!("{what} {}", if *ok { "equal" } else { "DIFFER" })).collect();
        write!(f, "{}", checks.join(", "))
    }
}

/// Runs `command` (a reference script, `what`) offline with its output into `log`, within
/// `deadline`: one that runs past it is killed by its own pid. An error carries the log.
pub fn run_script(mut command: Command, what: &str, log: &Path, deadline: Duration) -> Result<(), String> {
    let stdout = File::create(log).map_err(|e| format!("creating {}: {e}", log.display()))?;
    let stderr = stdout.try_clone().map_err(|e| format!("{}: {e}", log.display()))?;
    let started = Instant::now();
    let mut child = command
        .env("HF_HUB_OFFLINE", "1")
        .stdout(stdout)
        .stderr(stderr)
        .spawn()
        .map_err(|e| format!("could not start {what}: {e}"))?;
    let read_log = || std::fs::read_to_string(log).unwrap_or_default();
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if started.elapsed() < deadline => std::thread::sleep(Duration::from_millis(50)),
            Ok(None) => {
                let pid = child.id();
                // Child::kill sends SIGKILL to this child's pid (never by name).
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "{what} (pid {pid}) ran past {} s and was killed; its output:\n{}",
                    deadline.as_secs(),
                    read_log()
                ));
            }
            Err(e) => return Err(format!("waiting for {what}: {e}")),
        }
    };
    if !status.success() {
        return Err(format!("{what} failed ({status}):\n{}", read_log()));
    }
    Ok(())
}

/// Why an output file could not be written; names the file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FileError {
    /// Writing, flushing or renaming failed.
    #[error("writing {}: {source}", path.display())]
    Io {
        /// The destination.
        path: PathBuf,
        /// The system's error.
        source: std::io::Error,
    },
    /// Encoding the image failed.
    #[error("encoding {}: {source}", path.display())]
    Encode {
        /// The destination.
        path: PathBuf,
        /// The encoder's error.
        source: image::ImageError,
    },
    /// The tensors do not have the shapes this writer takes, or a count does not fit its field.
    #[error("{}: {message}", path.display())]
    Shape {
        /// The destination.
        path: PathBuf,
        /// What does not fit.
        message: String,
    },
}

/// Runs `write` into a temporary file beside `path` and renames it over `path` once complete.
pub fn write_atomically(
    path: &Path,
    write: impl FnOnce(&mut BufWriter<File>) -> std::io::Result<()>,
) -> Result<(), FileError> {
    let io = |source| FileError::Io { path: path.to_path_buf(), source };
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let temporary = path.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
    let result = (|| {
        let mut out = BufWriter::new(File::create(&temporary)?);
        write(&mut out)?;
        out.into_inner().map_err(|e| e.into_error())?.sync_all()?;
        std::fs::rename(&temporary, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&temporary);
    }
    result.map_err(io)
}
