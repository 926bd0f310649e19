//! A demo run's plumbing around the registry the example builds: the meter, the pipeline file
//! `stageload plan` checks (eager: everything pinned), the registry's builder with the options
//! every example shares ([`Demo::builder`]), residency checks at every model call, the latents'
//! fingerprints, and at the end a JSON result (`--result FILE`) that tests read instead of
//! stdout. [`stream`]: the same for the stream demo, which builds its one model's registry from
//! its own pipeline file.

pub mod stream;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Serialize;
use stageload::latents::Latents;
use stageload::meter::{self, Meter, MeterOptions};
use stageload::{BoxError, EventSink, ModelSpec, StagedModels, StagedModelsBuilder};
use stageload_plan::{ModelEntry, PinEntry, PipelineFile, StageEntry};
use stageload_units::format_bytes;
use tch::{Device, Tensor};

use crate::args::CommonArgs;
use crate::progress::progress_bar;
use stageload::PrefetchPace;
use stageload_pipelines::runner::{Loading, StageRunner};

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
    /// Models with no checkpoint (a module file alone holds their weights) and their weights'
    /// bytes as loaded: what the plan counts for them.
    pub weights: Vec<(String, u64)>,
}

impl DemoSpec {
    /// A pipeline of `models` run through `stages` in order (each with the models it calls),
    /// nothing pinned, every model with a checkpoint.
    pub fn staged(name: &'static str, models: Vec<ModelSpec>, stages: &[(&str, &[&str])]) -> DemoSpec {
        let stages = stages
            .iter()
            .map(|(stage, models)| (stage.to_string(), models.iter().map(|m| m.to_string()).collect()))
            .collect();
        DemoSpec { name, models, stages, pinned: Vec::new(), pins: Vec::new(), weights: Vec::new() }
    }

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
                    weights: self.weights.iter().find(|(name, _)| name == m.name()).map(|(_, bytes)| bytes.to_string()),
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

/// A demo's set-up before its registry: the meter, and the pipeline file written for `stageload
/// plan` and read back as the plan the registry runs (eager: every model in every stage, all
/// pinned). The example builds its `StagedModels` from [`builder`](Self::builder) (the plan, the
/// meter as its event sink, the command line's options), then [`run`](Self::run)s it.
pub struct Demo {
    /// Eager, staged or prefetch.
    loading: Loading,
    /// The registry options the command line sets (`--no-preserve-rng`, `--no-host-cache`,
    /// `--no-huge-pages`, `--prefetch-pace`).
    preserve_rng: bool,
    host_cache: bool,
    huge_pages: bool,
    prefetch_pace: PrefetchPace,
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
}

impl Demo {
    /// Starts the meter (its trace: `--trace`, `$STAGELOAD_TRACE` or a temporary file), drops the
    /// checkpoints from the page cache with `--cold`, writes `spec`'s pipeline file and reads it
    /// back as the plan; eager runs change the plan so that every stage lists every model and
    /// every model is pinned (nothing is ever released; the example loads them all before seeding).
    pub fn start(spec: &DemoSpec, args: &CommonArgs) -> Result<Demo, BoxError> {
        crate::logging::init();
        let loading = args.loading();
        let asked = meter::trace_path(args.trace.clone());
        let trace = asked.clone().unwrap_or_else(|| {
            std::env::temp_dir().join(format!("stageload-{}-{}.jsonl", spec.name, std::process::id()))
        });
        let options = MeterOptions::default()
            .meta("mode", mode_name(loading))
            .meta("pipeline", spec.name)
            .meta("scale", args.scale)
            .meta("seed", args.seed)
            .meta("preserve_rng", !args.no_preserve_rng)
            .meta("host_cache", !args.no_host_cache)
            .meta("huge_pages", !args.no_huge_pages)
            .meta("prefetch", loading == Loading::Prefetch)
            .meta("prefetch_pace", args.prefetch_pace.to_string())
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
        if loading == Loading::Eager {
            for stage in &mut plan.stages {
                stage.models = names.clone();
            }
            plan.pinned = names.clone();
            plan.pins.clear();
        }
        Ok(Demo {
            loading,
            preserve_rng: !args.no_preserve_rng,
            host_cache: !args.no_host_cache,
            huge_pages: !args.no_huge_pages,
            prefetch_pace: args.prefetch_pace,
            plan,
            meter,
            temporary_trace: asked.is_none(),
            trace,
            latents: Latents::with_env(args.latents.clone()),
            check_residency: args.check_residency,
            result_file: args.result.clone(),
            description,
        })
    }

    /// The plan the registry runs ([`builder`](Self::builder) gives it to the registry).
    pub fn plan(&self) -> &stageload_plan::Pipeline {
        &self.plan
    }

    /// Eager, staged or prefetch (`--mode`).
    pub fn loading(&self) -> Loading {
        self.loading
    }

    /// The registry's builder with `models` and what every demo sets: the [`plan`](Self::plan),
    /// the meter as its event sink, the command line's options (generators preserved around
    /// builds, the host block cache and its huge pages, prefetch and its pace), and a progress
    /// bar at a terminal. With prefetch, every model is built without random initialisation
    /// (`skip_init`): a build in the background must draw nothing, every weight comes from the
    /// checkpoint. The example adds what its lesson adds (a registered generator, ...) and builds.
    pub fn builder(&self, models: Vec<ModelSpec>) -> StagedModelsBuilder {
        let prefetch = self.loading == Loading::Prefetch;
        let mut builder = StagedModels::builder()
            .events(self.meter())
            .preserve_rng(self.preserve_rng)
            .cache_host_blocks(self.host_cache)
            .huge_host_pages(self.huge_pages)
            .prefetch_next(prefetch)
            .prefetch_pace(self.prefetch_pace)
            .pipeline(&self.plan);
        for model in models {
            builder = builder.model(if prefetch { model.skip_init(true) } else { model });
        }
        progress_at_terminal(builder)
    }

    /// The meter, the registry's event sink: every stage, load and release goes into the trace.
    pub fn meter(&self) -> Arc<dyn EventSink> {
        self.meter.clone()
    }

    /// The run over `models`, the registry built over [`plan`](Self::plan).
    pub fn run(self, models: StagedModels) -> DemoRun {
        DemoRun { models, demo: self, calls: std::sync::Mutex::default() }
    }
}

/// `builder` with a progress bar on stderr for every checkpoint load when stderr is a terminal.
pub fn progress_at_terminal(builder: StagedModelsBuilder) -> StagedModelsBuilder {
    if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        builder.progress(progress_bar())
    } else {
        builder
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

/// A demo run: the registry, and the checks and records around every call.
pub struct DemoRun {
    /// The registry.
    pub models: StagedModels,
    demo: Demo,
    /// Calls checked so far (`call` takes `&self`).
    calls: std::sync::Mutex<Vec<Call>>,
}

impl DemoRun {
    /// Eager, staged or prefetch (`--mode`).
    pub fn loading(&self) -> Loading {
        self.demo.loading
    }

    /// [`loading`](Self::loading), by its old name.
    #[deprecated(note = "use DemoRun::loading")]
    pub fn mode(&self) -> Loading {
        self.demo.loading
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
    /// and pinned ones, with `--prefetch` the next stage's models, nothing left over from earlier
    /// stages.
    pub fn call<M: 'static, R>(&self, model: &str, f: impl FnOnce(&mut M) -> R) -> Result<R, BoxError> {
        if self.demo.check_residency {
            self.models.load(model)?;
            self.check_resident(model)?;
        }
        Ok(self.models.call(model, f)?)
    }

    fn check_resident(&self, model: &str) -> Result<(), BoxError> {
        let stage = self.models.current_stage().unwrap_or_default();
        let resident = self.models.resident();
        // The demos do not repeat stages: a stage's occurrence is its place in the sequence.
        let index = self.demo.plan.stages.iter().position(|s| s.name == stage);
        let stages = &self.demo.plan.stages;
        let planned: BTreeSet<&String> = index
            .map(|i| {
                let prefetch = self.demo.loading == Loading::Prefetch;
                let next = stages.get(i + 1).filter(|_| prefetch).map(|s| s.models.iter());
                stages[i].models.iter().chain(self.demo.plan.pinned_at(i)).chain(next.into_iter().flatten()).collect()
            })
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
        let print = self.demo.latents.record(name, tensor);
        println!("latent {name} {:?} sha256 {print}", tensor.size());
    }

    /// Closes the registry and the meter, prints each stage's peak, writes the result file.
    pub fn finish(self) -> Result<(), BoxError> {
        self.models.close();
        self.demo.meter.finish();
        let summary = stageload::meter::summarize(&stageload::meter::read_trace(&self.demo.trace)?);
        if !self.demo.temporary_trace {
            println!("trace {}", self.demo.trace.display());
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
        if self.demo.temporary_trace {
            std::fs::remove_file(&self.demo.trace)?;
        }
        self.demo.latents.save()?;
        if let Some(path) = &self.demo.result_file {
            let result = RunResult {
                mode: mode_name(self.demo.loading).to_string(),
                latents: self.demo.latents.fingerprints().map(|(n, p)| (n.to_string(), p.to_string())).collect(),
                calls: std::mem::take(&mut *stageload_trace::sync::lock(&self.calls)),
                trace: (!self.demo.temporary_trace).then(|| self.demo.trace.clone()),
                latents_file: self.demo.latents.file().map(Path::to_path_buf),
                description: self.demo.description.clone(),
            };
            std::fs::write(path, serde_json::to_string_pretty(&result)?)?;
        }
        Ok(())
    }
}

/// The mode as traces and results name it: `eager`, or `staged` (prefetch is staged, with the
/// trace's `prefetch` meta set).
fn mode_name(loading: Loading) -> &'static str {
    match loading {
        Loading::Eager => "eager",
        Loading::Staged | Loading::Prefetch => "staged",
    }
}
