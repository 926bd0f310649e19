//! A demo run: the registry for its mode (eager pins everything; staged runs the pipeline file
//! `stageload plan` checks), the meter, residency checks at every model call, the latents'
//! fingerprints, and at the end a JSON result (`--result FILE`) that tests read instead of
//! stdout.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Serialize;
use stageload::latents::Latents;
use stageload::meter::{self, Meter, MeterOptions};
use stageload::{BoxError, ModelSpec, StagedModels};
use stageload_plan::{ModelEntry, PinEntry, PipelineFile, StageEntry};
use stageload_units::format_bytes;
use tch::{Device, Tensor};

use crate::args::{CommonArgs, Mode};
use crate::progress::progress_bar;

/// A demo pipeline: its models, stages in order, models pinned for the whole run and pins over a
/// span of stages.
pub struct DemoSpec {
    /// The demo's name (its pipeline and result files).
    pub name: &'static str,
    /// The models.
    pub models: Vec<ModelSpec>,
    /// The stages in run order, each with its models.
    pub stages: Vec<(String, Vec<String>)>,
    /// Models pinned for the whole run.
    pub pinned: Vec<String>,
    /// Pins over a span of stages.
    pub pins: Vec<PinEntry>,
}

impl DemoSpec {
    /// Writes the pipeline description `stageload plan` reads (models with their checkpoint
    /// files, stages, pins) to `path`, replacing it in one rename.
    pub fn write_description(&self, path: &Path, device: Device, host_tier: Option<u64>) -> Result<(), BoxError> {
        let description = PipelineFile {
            pinned: self.pinned.clone(),
            pins: self.pins.clone(),
            reserve: None,
            host_tier: host_tier.map(|bytes| bytes.to_string()),
            memory: None,
            device_memory: None,
            snapshot_dir: None,
            snapshot_keep_free: None,
            cpus: None,
            models: self
                .models
                .iter()
                .map(|m| ModelEntry {
                    name: m.name().to_string(),
                    files: m.checkpoint_files().to_vec(),
                    weights: None,
                    device: stageload::device::name(device),
                    dtype: None,
                    ignore: Vec::new(),
                    stream: None,
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
        // Whole or not at all: runs sharing a cache folder (many jobs at once) rewrite the same
        // file, and one must never read another's half-written copy. A temporary file beside it,
        // renamed over it.
        let folder = path.parent().unwrap_or(Path::new("."));
        let mut file = tempfile::NamedTempFile::new_in(folder)?;
        std::io::Write::write_all(&mut file, toml::to_string(&description)?.as_bytes())?;
        file.persist(path).map_err(|error| error.error)?;
        Ok(())
    }
}

/// One model call as `--check-residency` saw it.
#[derive(Debug, Clone, Serialize)]
pub struct Call {
    /// The stage current at the call.
    pub stage: String,
    /// The model called.
    pub model: String,
    /// The models resident then.
    pub resident: Vec<String>,
}

/// What a run writes to `--result`.
#[derive(Debug, Default, Serialize)]
struct RunResult {
    mode: String,
    /// (latent name, SHA-256 of its shape and values), in the order recorded.
    latents: Vec<(String, String)>,
    /// Every model call, with what was resident (only with `--check-residency`).
    calls: Vec<Call>,
    trace: Option<PathBuf>,
    latents_file: Option<PathBuf>,
    /// The pipeline description the run wrote (`stageload plan` reads it).
    description: PathBuf,
}

/// The registry, the plan it runs, the meter, and the checks and records around every call.
pub struct DemoRun {
    /// The registry.
    pub models: StagedModels,
    /// Staged or eager.
    pub mode: Mode,
    /// What the run follows: the description (staged), or every model everywhere (eager).
    plan: stageload_plan::Pipeline,
    meter: Arc<Meter>,
    trace: PathBuf,
    /// The trace was not asked for: it goes away after the stage peaks are printed.
    temporary_trace: bool,
    check_residency: bool,
    latents: Latents,
    result_file: Option<PathBuf>,
    /// The pipeline description written for the run.
    description: PathBuf,
    /// Calls checked so far (`call` takes `&self`).
    calls: std::sync::Mutex<Vec<Call>>,
}

impl DemoRun {
    /// Builds the registry for `mode`: staged runs the pipeline file written from `spec`; eager
    /// pins every model (so no stage releases anything) and the caller loads them all before
    /// seeding.
    pub fn build(
        spec: DemoSpec,
        args: &CommonArgs,
        chacha: Arc<dyn stageload::rng::RngSnapshot>,
    ) -> Result<DemoRun, BoxError> {
        crate::logging::init();
        let asked = meter::trace_path(args.trace.clone());
        let trace = asked.clone().unwrap_or_else(|| {
            std::env::temp_dir().join(format!("stageload-{}-{}.jsonl", spec.name, std::process::id()))
        });
        let options = MeterOptions::default()
            .meta("mode", args.mode.name())
            .meta("pipeline", spec.name)
            .meta("scale", args.scale)
            .meta("seed", args.seed)
            .meta("preserve_rng", !args.no_preserve_rng)
            .meta("prefetch", args.prefetch)
            .meta("host_tier", args.host_tier.unwrap_or(0))
            .meta("cold", args.cold)
            .meta("device", stageload::device::name(args.device));
        let meter = Arc::new(meter::start(&trace, args.device, options)?);
        let names: Vec<String> = spec.models.iter().map(|m| m.name().to_string()).collect();
        if args.cold {
            for file in spec.models.iter().flat_map(|m| m.checkpoint_files()) {
                crate::weights::drop_page_cache(file)
                    .map_err(|e| format!("--cold: dropping {} from the page cache: {e}", file.display()))?;
            }
        }
        let description = args.cache_folder(spec.name).join(format!("{}.toml", spec.name));
        spec.write_description(&description, args.device, args.host_tier)?;
        println!("pipeline description {} (stageload plan reads it)", description.display());
        let mut plan = stageload::Pipeline::load(&description)?;
        if args.mode == Mode::Eager {
            // Every stage lists every model and every model is pinned, so nothing is ever released
            // and no load is outside its stage.
            for stage in &mut plan.stages {
                stage.models = names.clone();
            }
            plan.pinned = names.clone();
            plan.pins.clear();
        }
        let mut builder =
            StagedModels::builder().events(meter.clone()).register_rng(chacha).preserve_rng(!args.no_preserve_rng);
        if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
            builder = builder.progress(progress_bar());
        }
        for model in spec.models {
            // Prefetched builds must draw nothing: every weight comes from the checkpoint.
            builder = builder.model(if args.prefetch { model.skip_init(true) } else { model });
        }
        // Stages, pins, devices: the description `stageload plan` checks (eager: everything pinned).
        builder = builder.prefetch_next(args.prefetch).pipeline(&plan);
        Ok(DemoRun {
            models: builder.build()?,
            mode: args.mode,
            plan,
            meter,
            temporary_trace: asked.is_none(),
            trace,
            latents: Latents::with_env(args.latents.clone()),
            calls: std::sync::Mutex::default(),
            check_residency: args.check_residency,
            result_file: args.result.clone(),
            description,
        })
    }

    /// Eager mode: loads every model now.
    pub fn load_everything(&self) -> Result<(), BoxError> {
        for name in self.models.names() {
            self.models.load(&name)?;
        }
        Ok(())
    }

    /// Enters `stage` in the registry.
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
        // The demos do not repeat stages: a stage's occurrence is its place in the sequence.
        let index = self.plan.stages.iter().position(|s| s.name == stage);
        let planned: BTreeSet<&String> = index
            .map(|i| self.plan.stages[i].models.iter().chain(self.plan.pinned_at(i)).collect())
            .unwrap_or_default();
        println!("call {stage} {model} resident {}", resident.join(","));
        let unplanned: Vec<&String> = resident.iter().filter(|name| !planned.contains(name)).collect();
        if !unplanned.is_empty() || !resident.iter().any(|r| r == model) {
            return Err(format!("at {stage}, calling {model}: resident {resident:?}, not planned {unplanned:?}").into());
        }
        stageload_trace::sync::lock(&self.calls).push(Call { stage, model: model.to_string(), resident });
        Ok(())
    }

    /// Records a stage's latent and prints its fingerprint.
    pub fn latent(&mut self, name: &str, tensor: &Tensor) {
        let print = self.latents.record(name, tensor);
        println!("latent {name} {:?} sha256 {print}", tensor.size());
    }

    /// Closes the registry and the meter, prints each stage's peak, writes the result file.
    pub fn finish(self) -> Result<(), BoxError> {
        self.models.close();
        self.meter.finish();
        let summary = stageload::meter::summarize(&stageload::meter::read_trace(&self.trace)?);
        if !self.temporary_trace {
            println!("trace {}", self.trace.display());
        }
        for window in &summary.stages {
            let peak = window.peak.map_or("-".to_string(), format_bytes);
            println!("stage {:<12} {:>8.2} s  peak {peak}", window.stage, window.seconds);
        }
        println!(
            "loaded {} models ({} reloads), {} in {:.2} s; overall peak {}",
            summary.loads.count,
            summary.loads.reloads,
            format_bytes(summary.loads.bytes),
            summary.loads.seconds,
            format_bytes(summary.peak)
        );
        if self.temporary_trace {
            std::fs::remove_file(&self.trace)?;
        }
        self.latents.save()?;
        if let Some(path) = &self.result_file {
            let result = RunResult {
                mode: self.mode.name().to_string(),
                latents: self.latents.fingerprints().map(|(n, p)| (n.to_string(), p.to_string())).collect(),
                calls: std::mem::take(&mut *stageload_trace::sync::lock(&self.calls)),
                trace: (!self.temporary_trace).then(|| self.trace.clone()),
                latents_file: self.latents.file().map(Path::to_path_buf),
                description: self.description.clone(),
            };
            std::fs::write(path, serde_json::to_string_pretty(&result)?)?;
        }
        Ok(())
    }
}
