//! Building a [`StagedModels`]: models, stages, pins, event sink, options, or all of it from a
//! pipeline file.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;

use super::decide;

use super::background::Background;
use super::error::{Result, StageError};
use super::placement::Placement;
use super::registry::Inner;
use super::slots::{Entry, State};
use super::snapshot::Snapshots;
use super::spec::{Builds, ModelSpec, ProgressHook};
use super::tier_copy::TierSide;
use super::turn::PrefetchPace;
use super::StagedModels;
use crate::checkpoint::Progress;
use crate::rng::RngSnapshot;
use crate::stream::StreamPlan;
use stageload_plan::pipeline::Model;
use stageload_plan::tier::{Tier, TierPlan};
use stageload_trace::event::EventSink;

/// Builds a [`StagedModels`]: models, stages, pins, sink, options; from
/// [`StagedModels::builder`]. Each option takes the builder and returns it; [`build`](Self::build)
/// checks the plan.
///
/// ```no_run
/// # use std::sync::Arc;
/// # use stageload::{BoxError, BuildContext, Built, ModelSpec, Pipeline, StagedModels};
/// # fn denoiser(_: &BuildContext) -> Result<Built, BoxError> { Err("your loader builds the model here".into()) }
/// # fn decoder(_: &BuildContext) -> Result<Built, BoxError> { Err("your loader builds the model here".into()) }
/// # fn run(sink: Arc<dyn stageload::EventSink>) -> Result<(), Box<dyn std::error::Error>> {
/// // By hand: models, stages in the order the run enters them, pins, options.
/// let models = StagedModels::builder()
///     .model(ModelSpec::new("denoiser", denoiser).checkpoint(["denoiser.safetensors"]))
///     .model(ModelSpec::new("decoder", decoder).checkpoint(["decoder.safetensors"]))
///     .stage("denoise", ["denoiser"])
///     .stage("decode", ["decoder"])
///     .events(sink) // every load, reload, release and stage entry
///     .prefetch_next(true)
///     .host_tier(8 << 30) // released CUDA models wait in 8 GiB of pinned host memory
///     .build()?;
///
/// // From the pipeline file `stageload plan` checked: its stages, pins, files, devices and
/// // dtypes; the loaders still come from `model`.
/// let plan = Pipeline::load("pipeline.toml".as_ref())?;
/// let models = StagedModels::builder()
///     .pipeline(&plan)
///     .model(ModelSpec::new("denoiser", denoiser))
///     .model(ModelSpec::new("decoder", decoder))
///     .build()?;
/// # Ok(()) }
/// ```
pub struct StagedModelsBuilder {
    specs: Vec<ModelSpec>,
    stages: Vec<(String, Vec<String>)>,
    pinned: Vec<String>,
    /// Pins over a span: (model, from, until), resolved against the stages at `build`.
    spans: Vec<(String, Option<String>, Option<String>)>,
    /// The pipeline file's models as `stageload plan` checked them (files, device, dtype,
    /// ignored entries, a streamed model's split), by name: kept as checked, read at `build`.
    planned: HashMap<String, Model>,
    sink: Option<Arc<dyn EventSink>>,
    rngs: Vec<Arc<dyn RngSnapshot>>,
    preserve_rng: bool,
    strict: bool,
    map_large_host_blocks: bool,
    cache_host_blocks: bool,
    huge_host_pages: bool,
    progress: Option<Arc<ProgressHook>>,
    prefetch_next: bool,
    prefetch_budget: Option<u64>,
    prefetch_pace: PrefetchPace,
    /// Working memory each stage needs beyond its weights (declared, or measured by an earlier
    /// run and written into the pipeline file).
    stage_working: BTreeMap<String, u64>,
    out_of_memory: decide::OutOfMemory,
    host_tier: Option<u64>,
    snapshot_dir: Option<PathBuf>,
    snapshot_keep_free: u64,
    host_memory: Arc<dyn crate::pinned::HostMemory>,
    /// The pipeline file's largest model on a device, as its plan sizes it.
    largest_device_model: Option<(String, u64)>,
    #[cfg(test)]
    tier_on_cpu: bool,
    #[cfg(test)]
    tier_copy_hook: Option<super::tier_copy::TierCopyHook>,
}

impl StagedModelsBuilder {
    /// Takes the stages (in order, repeats included), the pins (for the run and for spans),
    /// each model's checkpoint files, device, dtype and ignored entries, the host tier and the
    /// snapshot folder from a pipeline description, the file `stageload plan` checked, so the
    /// plan that was checked is the plan that runs. Loaders still come from [`model`](Self::model): a model of the file without
    /// one is a [`StageError::PlanWithoutLoader`] at [`build`](Self::build). A `ModelSpec` that
    /// declares no checkpoint gets the file's. A loader builds on [`BuildContext::device`]; the
    /// registry converts its float tensors to the file's dtype before loading, and refuses a
    /// model built on another device than the file's ([`StageError::PlanMismatch`]).
    ///
    /// [`BuildContext::device`]: super::BuildContext::device
    pub fn pipeline(mut self, pipeline: &stageload_plan::Pipeline) -> Self {
        if let Some(bytes) = pipeline.host_tier {
            self = self.host_tier(bytes);
        }
        if let Some(dir) = &pipeline.snapshot_dir {
            self = self.snapshot_dir(dir.clone());
        }
        if let Some(bytes) = pipeline.snapshot_keep_free {
            self = self.snapshot_keep_free(bytes);
        }
        self.largest_device_model = TierPlan::of(pipeline, 0).largest;
        for stage in &pipeline.stages {
            self = self.stage(stage.name.clone(), stage.models.iter().cloned());
            if stage.working > 0 {
                self = self.stage_working(stage.name.clone(), stage.working);
            }
        }
        for name in &pipeline.pinned {
            self = self.pin(name.clone());
        }
        let stage_name = |index: usize| pipeline.stages.get(index).map(|s| s.name.clone());
        for pin in &pipeline.pins {
            for model in &pin.models {
                self = self.pin_between(model.clone(), stage_name(pin.from), pin.until.and_then(stage_name));
            }
        }
        for model in &pipeline.models {
            self.planned.insert(model.name.clone(), model.clone());
        }
        self
    }

    /// Keeps a model resident from stage `from` (default: the first) until stage `until`
    /// begins (default: to the end). With repeated stages, `from` is the first occurrence and
    /// `until` the first after it.
    pub fn pin_between(mut self, name: impl Into<String>, from: Option<String>, until: Option<String>) -> Self {
        self.spans.push((name.into(), from, until));
        self
    }

    /// Defines a model: its name, loader, checkpoint and name rules ([`ModelSpec`]).
    pub fn model(mut self, spec: ModelSpec) -> Self {
        self.specs.push(spec);
        self
    }

    /// A stage and the models it uses, appended to the sequence the run enters; a name may come
    /// back (each occurrence with its own models).
    pub fn stage<S: Into<String>>(mut self, name: impl Into<String>, models: impl IntoIterator<Item = S>) -> Self {
        self.stages.push((name.into(), models.into_iter().map(Into::into).collect()));
        self
    }

    /// Keeps a model resident across stages (until unpinned or `close`).
    pub fn pin(mut self, name: impl Into<String>) -> Self {
        self.pinned.push(name.into());
        self
    }

    /// Where events go.
    pub fn events(mut self, sink: Arc<dyn EventSink>) -> Self {
        self.sink = Some(sink);
        self
    }

    /// A generator of the pipeline's own to preserve around every build.
    pub fn register_rng(mut self, rng: Arc<dyn RngSnapshot>) -> Self {
        self.rngs.push(rng);
        self
    }

    /// Turns RNG preservation off (default on): only for a control experiment.
    pub fn preserve_rng(mut self, on: bool) -> Self {
        self.preserve_rng = on;
        self
    }

    /// Called as checkpoint loads progress (model name, bytes done of the total), for a progress
    /// bar on long loads. Runs on the loading thread; keep it quick.
    pub fn progress(mut self, hook: impl Fn(&str, Progress) + Send + Sync + 'static) -> Self {
        self.progress = Some(Arc::new(hook));
        self
    }

    /// Refuses loads outside the current stage's plan instead of noting them.
    pub fn strict(mut self, on: bool) -> Self {
        self.strict = on;
        self
    }

    /// After each `enter`, prefetch the next stage of the plan (in the order the stages were
    /// given): its models load in the background while this stage computes (default off). Only
    /// loads that draw no random number are prefetched (see
    /// [`StagedModels::prefetch`](super::StagedModels::prefetch)).
    pub fn prefetch_next(mut self, on: bool) -> Self {
        self.prefetch_next = on;
        self
    }

    /// How a prefetch's checkpoint copy into CPU memory goes while no foreground call waits
    /// for a background load (default [`PrefetchPace::Auto`]: paced where torch's intra-op
    /// threads take every core, so that the copy does not slow the stage computing beside it;
    /// at full speed once the foreground waits for the prefetched model).
    pub fn prefetch_pace(mut self, pace: PrefetchPace) -> Self {
        self.prefetch_pace = pace;
        self
    }

    /// Prefetches only while the resident weights, the current stage's working memory
    /// ([`stage_working`](Self::stage_working)) and the prefetched models stay within `bytes`.
    pub fn prefetch_budget(mut self, bytes: u64) -> Self {
        self.prefetch_budget = Some(bytes);
        self
    }

    /// The working memory `stage` needs beyond its weights (the largest given for a stage that
    /// comes back; [`pipeline`](Self::pipeline) takes each stage's `working`). A prefetch during
    /// that stage leaves it free: within [`prefetch_budget`](Self::prefetch_budget), or, without
    /// one, within the memory the machine has available when the prefetch starts.
    pub fn stage_working(mut self, stage: impl Into<String>, bytes: u64) -> Self {
        let working = self.stage_working.entry(stage.into()).or_insert(0);
        *working = (*working).max(bytes);
        self
    }

    /// What a load that runs out of memory does (a build, a load or a reload; the error is
    /// [`StageError::OutOfMemory`] either way): fail (default), or release the unpinned models
    /// the current stage does not list and try once more.
    pub fn on_out_of_memory(mut self, policy: decide::OutOfMemory) -> Self {
        self.out_of_memory = policy;
        self
    }

    /// A host tier of `bytes` (default none): a device model's release first copies its weights
    /// into host memory pinned for the device, and its reload copies them back (`reload` event
    /// `from: host_tier`) instead of reading its checkpoint or rebuilding it. Least recently used
    /// copies are evicted to make room; copies in flight and those of pinned models never are.
    /// CPU models are not held (their weights are host memory already; a `tier` event says so
    /// once). [`build`](Self::build) refuses a budget smaller than the largest model the
    /// [`pipeline`](Self::pipeline) file places on a device, sized as `stageload plan` sizes it
    /// from the checkpoint headers ([`StageError::HostTierTooSmall`]); models the registry learns
    /// the size of only once built are checked when released (a `tier` event says when one is
    /// not stored).
    pub fn host_tier(mut self, bytes: u64) -> Self {
        self.host_tier = Some(bytes);
        self
    }

    /// A folder for snapshots: the first release of a model that has no checkpoint and no copy
    /// in the host tier writes its weights there once as safetensors, and its later reloads come
    /// back in place from that file (no loader call, no random number drawn: it may be
    /// prefetched; `reload` events say `from: snapshot`) instead of rebuilding it. Free space is
    /// checked first (the write must leave [`snapshot_keep_free`](Self::snapshot_keep_free)
    /// bytes free, 1 GiB unless set); a write that cannot be made leaves the
    /// model to be rebuilt, and its `snapshot` event says why. The files are the registry's
    /// own: removed at `close` and when it drops; those of a process that was killed are removed
    /// by the next registry that opens the folder, never a live one's. [`build`](Self::build)
    /// makes the folder, or fails naming it ([`StageError::SnapshotDir`]).
    pub fn snapshot_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.snapshot_dir = Some(dir.into());
        self
    }

    /// Bytes every snapshot write leaves free on its folder's file system, for the machine's
    /// other users (1 GiB unless set): a write that would leave less is not begun and the model
    /// is rebuilt when needed.
    pub fn snapshot_keep_free(mut self, bytes: u64) -> Self {
        self.snapshot_keep_free = bytes;
        self
    }

    /// Unit tests: where host copies' memory comes from (a fake that counts it).
    #[cfg(test)]
    pub(crate) fn host_memory(mut self, memory: Arc<dyn crate::pinned::HostMemory>) -> Self {
        self.host_memory = memory;
        self
    }

    /// Unit tests: the host tier holds CPU models as it would device models.
    #[cfg(test)]
    pub(crate) fn tier_on_cpu(mut self) -> Self {
        self.tier_on_cpu = true;
        self
    }

    /// Unit tests: runs before each copy into the host tier (`true`) and back out of it, with the
    /// state lock let go (to hold a copy there, or fail it).
    #[cfg(test)]
    pub(crate) fn tier_copy_hook(
        mut self,
        hook: impl Fn(&str, bool) -> Result<(), String> + Send + Sync + 'static,
    ) -> Self {
        self.tier_copy_hook = Some(Arc::new(hook));
        self
    }

    /// Whether [`Self::build`] fixes glibc's mmap threshold so that freed weight- and
    /// activation-sized blocks go back to the OS at once (default on; a process-wide setting).
    pub fn map_large_host_blocks(mut self, on: bool) -> Self {
        self.map_large_host_blocks = on;
        self
    }

    /// Whether [`Self::build`] makes libtorch's CPU tensors allocate through the host block
    /// cache (default on; a process-wide setting, see
    /// [`stageload_torch_sys::cache_host_blocks`]): freed blocks of 1 MiB or more are kept for
    /// the next request of their size, so a forward that allocates the same activations at every
    /// step does not fault their pages in again at every step. The registry empties the cache as
    /// each stage begins and at every release, so a stage's peak holds neither the last stage's
    /// activations nor a released model's weights; within a stage, live and kept blocks stay
    /// within the most the live blocks reached plus two of the largest block asked for (the
    /// stage peaks of the cascade rose by 0-4.8 %, `traces/prefetch/host-cache/`).
    pub fn cache_host_blocks(mut self, on: bool) -> Self {
        self.cache_host_blocks = on;
        self
    }

    /// Whether the host block cache's blocks of 2 MiB or more get huge pages where the kernel
    /// gives them to advised memory (default on; a process-wide setting, see
    /// [`stageload_torch_sys::huge_host_pages`]; nothing without the cache): a load into fresh
    /// memory, as every staged load is, then takes one page fault per 2 MiB instead of 512.
    pub fn huge_host_pages(mut self, on: bool) -> Self {
        self.huge_host_pages = on;
        self
    }

    /// Validates the plan: every model named once, every name in stages and pins has a loader.
    ///
    /// Once the plan is valid, and unless [`Self::map_large_host_blocks`] turned it off, this
    /// also fixes glibc's mmap threshold for the process (see
    /// [`stageload_torch_sys::map_large_host_blocks`]), so that the memory of released models
    /// and of finished stages goes back to the OS; and unless [`Self::cache_host_blocks`]
    /// turned it off, it installs the host block cache.
    pub fn build(self) -> Result<StagedModels> {
        let mut entries: Vec<Entry> = Vec::new();
        let mut seen: HashSet<String> = HashSet::new();
        for spec in self.specs {
            if !seen.insert(spec.name.clone()) {
                return Err(StageError::DuplicateModel { name: spec.name });
            }
            let planned = self.planned.get(&spec.name);
            let (placement, names) = match planned {
                Some(model) => {
                    let mismatch = |message: String| StageError::PlanMismatch { model: spec.name.clone(), message };
                    let placement =
                        Placement::from_file(model.device, model.dtype).map_err(|e| mismatch(e.to_string()))?;
                    let names =
                        spec.names.clone().ignore(&model.ignore).map_err(|e| mismatch(format!("ignore: {e}")))?;
                    (placement, names)
                }
                None => (Placement::default(), spec.names.clone()),
            };
            // A streamed model has no checkpoint for the registry (it would load it whole).
            let checkpoint = match planned {
                Some(model) if spec.checkpoint.is_empty() && model.streamed.is_none() => model.files.clone(),
                _ => spec.checkpoint,
            };
            let stream =
                planned.and_then(|model| Some((&model.files, model.streamed.as_ref()?))).map(|(files, streamed)| {
                    Arc::new(StreamPlan {
                        files: files.clone(),
                        spec: streamed.spec.clone(),
                        budget: streamed.budget,
                        working: streamed.working,
                        any_order: streamed.any_order,
                        names: names.clone(),
                        sink: self.sink.clone(),
                        held: Default::default(),
                        planned_held: streamed.held,
                        first_reads: Default::default(),
                    })
                });
            let mut entry = Entry::new(spec.name, Some(spec.loader), checkpoint, names, placement, stream, spec.init);
            entry.reload = spec.reload;
            entries.push(entry);
        }
        let known: HashSet<&str> = entries.iter().map(|e| e.name.as_str()).collect();
        let unknown: BTreeSet<String> = self
            .stages
            .iter()
            .flat_map(|(_, m)| m.iter())
            .chain(self.pinned.iter())
            .chain(self.spans.iter().map(|(m, _, _)| m))
            .chain(self.planned.keys())
            .filter(|n| !known.contains(n.as_str()))
            .cloned()
            .collect();
        if !unknown.is_empty() {
            return Err(StageError::PlanWithoutLoader { names: unknown.into_iter().collect() });
        }
        let names: Vec<&str> = self.stages.iter().map(|(s, _)| s.as_str()).collect();
        let mut spans = Vec::new();
        for (model, from, until) in &self.spans {
            let entry =
                stageload_plan::PinEntry { models: vec![model.clone()], from: from.clone(), until: until.clone() };
            let pin = stageload_plan::pipeline::resolve_pin(&entry, &names)
                .map_err(|source| StageError::PinSpan { model: model.clone(), source })?;
            spans.push((model.clone(), pin.from, pin.until));
        }
        let sequence: Vec<(String, BTreeSet<String>)> =
            self.stages.into_iter().map(|(s, m)| (s, m.into_iter().collect())).collect();
        let mut stages = BTreeMap::new();
        for (name, models) in &sequence {
            stages.entry(name.clone()).or_insert_with(|| models.clone());
        }
        if let Some(budget) = self.host_tier {
            let tier = TierPlan { budget, largest: self.largest_device_model.clone() };
            if let (false, Some((model, bytes))) = (tier.fits(), tier.largest) {
                return Err(StageError::HostTierTooSmall { model, bytes, budget });
            }
        }
        if self.map_large_host_blocks {
            stageload_torch_sys::map_large_host_blocks();
        }
        if self.cache_host_blocks {
            stageload_torch_sys::huge_host_pages(self.huge_host_pages);
            stageload_torch_sys::cache_host_blocks().map_err(StageError::HostCache)?;
        }
        let snapshots = match &self.snapshot_dir {
            Some(dir) => Some(
                Snapshots::open(dir, self.snapshot_keep_free)
                    .map_err(|source| StageError::SnapshotDir { path: dir.clone(), source })?,
            ),
            None => None,
        };
        let pinned = self.pinned.into_iter().collect();
        let state = State::new(entries, stages, sequence, pinned, spans, self.host_tier.map(Tier::new));
        let builds = Builds::new(self.rngs, self.preserve_rng, self.strict, self.out_of_memory, self.progress);
        let background =
            Background::new(self.prefetch_next, self.prefetch_budget, self.stage_working, self.prefetch_pace);
        let tier_side = TierSide::new(self.host_memory);
        #[cfg(test)]
        let tier_side = tier_side.for_tests(self.tier_on_cpu, self.tier_copy_hook);
        Ok(StagedModels { inner: Arc::new(Inner::new(state, self.sink, builds, background, tier_side, snapshots)) })
    }
}

impl StagedModels {
    /// A builder with no model and no stage: no event sink, generators preserved, not strict,
    /// no prefetch, no host tier, no snapshot folder.
    pub fn builder() -> StagedModelsBuilder {
        StagedModelsBuilder {
            specs: Vec::new(),
            stages: Vec::new(),
            pinned: Vec::new(),
            spans: Vec::new(),
            planned: HashMap::new(),
            sink: None,
            rngs: Vec::new(),
            preserve_rng: true,
            strict: false,
            map_large_host_blocks: true,
            cache_host_blocks: true,
            huge_host_pages: true,
            progress: None,
            prefetch_next: false,
            prefetch_budget: None,
            prefetch_pace: PrefetchPace::Auto,
            stage_working: BTreeMap::new(),
            out_of_memory: decide::OutOfMemory::Fail,
            host_tier: None,
            snapshot_dir: None,
            snapshot_keep_free: super::snapshot::KEEP_FREE,
            host_memory: Arc::new(crate::pinned::Mapped),
            largest_device_model: None,
            #[cfg(test)]
            tier_on_cpu: false,
            #[cfg(test)]
            tier_copy_hook: None,
        }
    }
}
