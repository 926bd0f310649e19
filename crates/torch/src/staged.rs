//! StagedModels: a map of named models where only the current stage's models are resident.
//!
//! A model is built by its loader the first time it is asked for, under preserved RNG state
//! ([`crate::rng`]), and filled from its safetensors checkpoint when it declared one.
//! [`StagedModels::enter`] releases, in place, every resident model the new stage does not list
//! and that is not pinned: its storages are freed through the shim, so memory comes back even
//! while other code still holds the model, and every handle to it then gives
//! [`StageError::Released`]. Asked for again, a model with a checkpoint comes back in place (the
//! same object, storages reallocated and refilled, no random number drawn); one without is
//! rebuilt by its loader.
//!
//! The API takes `&self` and is safe to share between threads. Builds are serialised (the RNG
//! state they preserve is global), and two threads asking for one model build it once.

use std::any::Any;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::marker::PhantomData;
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::ThreadId;
use std::time::Instant;

use tch::nn::VarStore;
use tch::Tensor;

use crate::checkpoint::{Checkpoint, CheckpointError, Progress};
use crate::events::{Event, EventKind, EventSink};
use crate::rng::{PreservedRng, RngSnapshot};
use crate::storage::{self, ReleaseStats, StorageRecord};
use stageload_torch_sys::ShimError;

/// A loader's own error.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Errors of StagedModels. Each names the model or stage involved and says what to do.
#[derive(Debug, thiserror::Error)]
pub enum StageError {
    #[error("unknown model '{name}'; known models: {known:?}")]
    UnknownModel { name: String, known: Vec<String> },
    #[error("unknown stage '{stage}'; known stages: {known:?}")]
    UnknownStage { stage: String, known: Vec<String> },
    #[error("the plan names models that have no loader: {}", .names.join(", "))]
    PlanWithoutLoader { names: Vec<String> },
    #[error("model '{name}' is defined twice")]
    DuplicateModel { name: String },
    #[error("'{model}' was released{} and its weights are gone. Get the model from the StagedModels registry again instead of keeping a handle to it.", at_stage(.stage))]
    Released { model: String, stage: Option<String> },
    #[error("'{model}' was registered without a loader and released{}; it cannot come back. Give it a loader (or a checkpoint) to reload it.", at_stage(.stage))]
    NoLoader { model: String, stage: Option<String> },
    #[error("the registry is closed; '{model}' cannot be loaded any more")]
    Closed { model: String },
    #[error("'{model}' was asked for in stage '{stage}', which does not list it, and the registry is strict; add it to the stage or pin it")]
    OutsideStage { model: String, stage: String },
    #[error("loader of '{model}' failed: {source}")]
    LoaderFailed { model: String, source: BoxError },
    #[error("loader of '{model}' panicked: {message}")]
    LoaderPanicked { model: String, message: String },
    #[error("'{model}' holds a {actual}, not the {expected} asked for")]
    WrongType { model: String, expected: &'static str, actual: &'static str },
    #[error("'{model}' is locked by this thread (a ModelGuard is alive) and cannot be released; drop the guard before entering stage {stage:?}")]
    InUse { model: String, stage: Option<String> },
    #[error("'{model}' is already locked by this thread; use the ModelGuard you hold instead of locking it again")]
    LockedTwice { model: String },
    #[error("checkpoint of '{model}': {source}")]
    Checkpoint { model: String, source: Box<CheckpointError> },
    #[error("'{model}': {source}")]
    Torch { model: String, source: ShimError },
    #[error("saving or restoring random generators: {0}")]
    Rng(ShimError),
}

fn at_stage(stage: &Option<String>) -> String {
    stage.as_ref().map(|s| format!(" when entering stage '{s}'")).unwrap_or_default()
}

type Result<T, E = StageError> = std::result::Result<T, E>;

/// What a loader returns: the model object and the tensors whose storage it owns.
pub struct Built {
    model: Box<dyn Any + Send>,
    type_name: &'static str,
    tensors: Vec<(String, Tensor)>,
}

impl Built {
    /// A model and every variable of its VarStore (parameters and buffers).
    pub fn new<M: Send + 'static>(model: M, vs: &VarStore) -> Self {
        let mut tensors: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        tensors.sort_by(|a, b| a.0.cmp(&b.0));
        Self::from_tensors(model, tensors)
    }

    /// A model and its named tensors, given explicitly.
    pub fn from_tensors<M: Send + 'static>(model: M, tensors: Vec<(String, Tensor)>) -> Self {
        Built { model: Box::new(model), type_name: std::any::type_name::<M>(), tensors }
    }
}

/// A component built once and shared by several models (e.g. one backbone under four feature
/// extractors). Lock it to use it.
pub struct Shared<T>(Arc<Mutex<T>>);

impl<T> Clone for Shared<T> {
    fn clone(&self) -> Self {
        Shared(Arc::clone(&self.0))
    }
}

impl<T> std::fmt::Debug for Shared<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Shared<{}>", std::any::type_name::<T>())
    }
}

impl<T> Shared<T> {
    pub fn lock(&self) -> MutexGuard<'_, T> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

struct SharedEntry {
    component: Box<dyn Any + Send>,
    tensors: Vec<(String, Tensor)>,
}

/// Handed to a loader: the model being built, and shared components.
pub struct BuildContext<'a> {
    registry: &'a StagedModels,
    model: &'a str,
    /// Tensors of shared components this build used, and whether each was freshly built.
    shared_tensors: Mutex<Vec<(String, Tensor, bool)>>,
}

impl BuildContext<'_> {
    /// Name of the model being built.
    pub fn model(&self) -> &str {
        self.model
    }

    /// The component under `key`, built by `build` if it is not there or its storage was
    /// released. Its tensors join the building model's, named `key.name`, so a release keeps
    /// them while another resident model shares them and frees them after the last.
    pub fn shared<T: Send + 'static>(
        &self,
        key: &str,
        build: impl FnOnce() -> Result<(T, Vec<(String, Tensor)>), BoxError>,
    ) -> Result<Shared<T>, BoxError> {
        let mut cache = self.registry.shared.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(entry) = cache.get(key) {
            let alive = entry
                .tensors
                .iter()
                .all(|(_, t)| t.numel() == 0 || stageload_torch_sys::storage_info(t).is_ok_and(|i| i.allocated));
            if alive {
                let component = entry
                    .component
                    .downcast_ref::<Shared<T>>()
                    .ok_or_else(|| format!("shared component '{key}' holds another type"))?
                    .clone();
                self.record(key, &entry.tensors, false);
                return Ok(component);
            }
        }
        let (component, tensors) = build()?;
        let component = Shared(Arc::new(Mutex::new(component)));
        self.record(key, &tensors, true);
        cache.insert(key.to_string(), SharedEntry { component: Box::new(component.clone()), tensors });
        Ok(component)
    }

    fn record(&self, key: &str, tensors: &[(String, Tensor)], fresh: bool) {
        let mut all = self.shared_tensors.lock().unwrap_or_else(|e| e.into_inner());
        all.extend(tensors.iter().map(|(n, t)| (format!("{key}.{n}"), t.shallow_clone(), fresh)));
    }
}

type Loader = dyn Fn(&BuildContext) -> Result<Built, BoxError> + Send + Sync;

/// Told how far a checkpoint load has come: the model and bytes done of the total.
type ProgressHook = dyn Fn(&str, Progress) + Send + Sync;

/// How to build one model: its loader and, optionally, its safetensors checkpoint files.
pub struct ModelSpec {
    name: String,
    loader: Arc<Loader>,
    checkpoint: Vec<PathBuf>,
}

impl ModelSpec {
    /// A model built by `loader`. The loader places it on its device; weights come from the
    /// checkpoint when one is declared, else from the loader itself.
    pub fn new(
        name: impl Into<String>,
        loader: impl Fn(&BuildContext) -> Result<Built, BoxError> + Send + Sync + 'static,
    ) -> Self {
        ModelSpec { name: name.into(), loader: Arc::new(loader), checkpoint: Vec::new() }
    }

    /// The model's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The checkpoint files declared with [`checkpoint`](Self::checkpoint).
    pub fn checkpoint_files(&self) -> &[PathBuf] {
        &self.checkpoint
    }

    /// Declares the safetensors files holding every tensor of the model: they fill it after each
    /// build, and a released model comes back from them in place.
    pub fn checkpoint<P: Into<PathBuf>>(mut self, files: impl IntoIterator<Item = P>) -> Self {
        self.checkpoint = files.into_iter().map(Into::into).collect();
        self
    }
}

/// One built model object, shared by every handle to it.
struct Instance {
    name: String,
    type_name: &'static str,
    /// (identity, bytes) of each distinct storage: fixed at creation, read without the body
    /// lock, so accounting never waits on (or deadlocks with) a model in use.
    storage_sizes: Vec<(u64, u64)>,
    body: Mutex<Body>,
    released: Mutex<Option<Option<String>>>,
    holder: Mutex<Option<ThreadId>>,
}

struct Body {
    model: Box<dyn Any + Send>,
    tensors: Vec<(String, Tensor)>,
    storages: Vec<StorageRecord>,
}

impl Instance {
    fn new(
        name: &str,
        type_name: &'static str,
        model: Box<dyn Any + Send>,
        tensors: Vec<(String, Tensor)>,
    ) -> Result<Arc<Self>> {
        let storages = storage::distinct_storages(&tensors)
            .map_err(|source| StageError::Torch { model: name.to_string(), source })?;
        Ok(Arc::new(Instance {
            name: name.to_string(),
            type_name,
            storage_sizes: storages.iter().map(|s| (s.id, s.nbytes as u64)).collect(),
            body: Mutex::new(Body { model, tensors, storages }),
            released: Mutex::new(None),
            holder: Mutex::new(None),
        }))
    }

    /// Marks the instance released at `stage` and frees its storages not in `keep`.
    fn release(&self, keep: &HashSet<u64>, stage: &Option<String>) -> Result<ReleaseStats> {
        let body = self.lock_for_release(stage)?;
        *self.released.lock().unwrap_or_else(|e| e.into_inner()) = Some(stage.clone());
        storage::release(&body.storages, keep, &released_message(&self.name, stage))
            .map_err(|source| StageError::Torch { model: self.name.clone(), source })
    }

    fn released_at(&self) -> Option<Option<String>> {
        self.released.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn storage_ids(&self) -> HashSet<u64> {
        self.storage_sizes.iter().map(|(id, _)| *id).collect()
    }

    fn lock_body(&self) -> MutexGuard<'_, Body> {
        self.body.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Locks the body, waiting for other threads but refusing when this very thread already
    /// holds it (which would deadlock): `in_use` makes the error.
    fn lock_unless_held_here(&self, in_use: impl FnOnce() -> StageError) -> Result<MutexGuard<'_, Body>> {
        match self.body.try_lock() {
            Ok(body) => Ok(body),
            Err(std::sync::TryLockError::Poisoned(e)) => Ok(e.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => {
                if *self.holder.lock().unwrap_or_else(|e| e.into_inner()) == Some(std::thread::current().id()) {
                    return Err(in_use());
                }
                Ok(self.lock_body())
            }
        }
    }

    fn lock_for_release(&self, stage: &Option<String>) -> Result<MutexGuard<'_, Body>> {
        self.lock_unless_held_here(|| StageError::InUse { model: self.name.clone(), stage: stage.clone() })
    }

    fn lock_for_use(&self) -> Result<MutexGuard<'_, Body>> {
        self.lock_unless_held_here(|| StageError::LockedTwice { model: self.name.clone() })
    }
}

/// A typed handle to a model. Cheap to clone; it stays valid across releases and reports them.
pub struct Handle<M> {
    instance: Arc<Instance>,
    _model: PhantomData<fn() -> M>,
}

impl<M> Clone for Handle<M> {
    fn clone(&self) -> Self {
        Handle { instance: Arc::clone(&self.instance), _model: PhantomData }
    }
}

impl<M: 'static> Handle<M> {
    /// The model's name in the registry.
    pub fn name(&self) -> &str {
        &self.instance.name
    }

    /// Whether the model's storages were released (and not brought back in place).
    pub fn is_released(&self) -> bool {
        self.instance.released_at().is_some()
    }

    /// Locks the model for use; [`StageError::Released`] once it was released. While the guard
    /// lives, a release of the model from another thread waits for it.
    pub fn lock(&self) -> Result<ModelGuard<'_, M>> {
        let body = self.instance.lock_for_use()?;
        if let Some(stage) = self.instance.released_at() {
            return Err(StageError::Released { model: self.instance.name.clone(), stage });
        }
        *self.instance.holder.lock().unwrap_or_else(|e| e.into_inner()) = Some(std::thread::current().id());
        Ok(ModelGuard { body, holder: &self.instance.holder, _model: PhantomData })
    }

    /// Shallow copies of the model's named tensors (they share its storages).
    pub fn tensors(&self) -> Vec<(String, Tensor)> {
        self.instance.lock_body().tensors.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect()
    }
}

/// The model, locked for use. Dereferences to it.
pub struct ModelGuard<'a, M> {
    body: MutexGuard<'a, Body>,
    holder: &'a Mutex<Option<ThreadId>>,
    _model: PhantomData<fn() -> M>,
}

impl<M: 'static> std::ops::Deref for ModelGuard<'_, M> {
    type Target = M;
    fn deref(&self) -> &M {
        self.body.model.downcast_ref::<M>().expect("type checked when the handle was made")
    }
}

impl<M> Drop for ModelGuard<'_, M> {
    fn drop(&mut self) {
        *self.holder.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }
}

enum SlotState {
    Unloaded,
    Building,
    Resident(Arc<Instance>),
    /// Released at `stage`; `instance` is kept to come back in place.
    Released {
        stage: Option<String>,
        instance: Arc<Instance>,
    },
}

struct Slot {
    name: String,
    loader: Option<Arc<Loader>>,
    checkpoint: Vec<PathBuf>,
    state: SlotState,
    loads: u32,
}

struct State {
    slots: Vec<Slot>,
    stages: BTreeMap<String, BTreeSet<String>>,
    pinned: BTreeSet<String>,
    current: Option<String>,
    closed: bool,
}

impl State {
    fn index(&self, name: &str) -> Result<usize> {
        self.slots.iter().position(|s| s.name == name).ok_or_else(|| StageError::UnknownModel {
            name: name.to_string(),
            known: self.slots.iter().map(|s| s.name.clone()).collect(),
        })
    }

    fn resident(&self) -> impl Iterator<Item = (&str, &Arc<Instance>)> {
        self.slots.iter().filter_map(|s| match &s.state {
            SlotState::Resident(i) => Some((s.name.as_str(), i)),
            _ => None,
        })
    }

    fn planned_here(&self, name: &str) -> bool {
        match &self.current {
            None => true,
            Some(stage) => self.pinned.contains(name) || self.stages.get(stage).is_some_and(|m| m.contains(name)),
        }
    }
}

/// Builds a [`StagedModels`]: models, stages, pins, sink, options.
pub struct StagedModelsBuilder {
    specs: Vec<ModelSpec>,
    stages: Vec<(String, Vec<String>)>,
    pinned: Vec<String>,
    sink: Option<Arc<dyn EventSink>>,
    rngs: Vec<Arc<dyn RngSnapshot>>,
    preserve_rng: bool,
    strict: bool,
    map_large_host_blocks: bool,
    progress: Option<Arc<ProgressHook>>,
    planned_checkpoints: HashMap<String, Vec<PathBuf>>,
    planned_models: Vec<String>,
}

impl StagedModelsBuilder {
    /// Takes the stages (in order), the pins and each model's checkpoint files from a pipeline
    /// description, the file `stageload plan` checked, so the plan that was checked is the plan
    /// that runs. Loaders still come from [`model`](Self::model): a model of the file without
    /// one is a [`StageError::PlanWithoutLoader`] at [`build`](Self::build). A `ModelSpec` that
    /// declares no checkpoint gets the file's.
    pub fn pipeline(mut self, pipeline: &stageload_plan::Pipeline) -> Self {
        for stage in &pipeline.stages {
            self = self.stage(stage.name.clone(), stage.models.iter().cloned());
        }
        for name in &pipeline.pinned {
            self = self.pin(name.clone());
        }
        for model in &pipeline.models {
            self.planned_checkpoints.insert(model.name.clone(), model.files.clone());
            self.planned_models.push(model.name.clone());
        }
        self
    }

    pub fn model(mut self, spec: ModelSpec) -> Self {
        self.specs.push(spec);
        self
    }

    /// A stage and the models it uses.
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

    /// Whether [`Self::build`] fixes glibc's mmap threshold so that freed weight- and
    /// activation-sized blocks go back to the OS at once (default on; a process-wide setting).
    pub fn map_large_host_blocks(mut self, on: bool) -> Self {
        self.map_large_host_blocks = on;
        self
    }

    /// Validates the plan: every model named once, every name in stages and pins has a loader.
    ///
    /// Once the plan is valid, and unless [`Self::map_large_host_blocks`] turned it off, this
    /// also fixes glibc's mmap threshold for the process (see
    /// [`stageload_torch_sys::map_large_host_blocks`]), so that the memory of released models
    /// and of finished stages goes back to the OS.
    pub fn build(self) -> Result<StagedModels> {
        let mut slots: Vec<Slot> = Vec::new();
        for spec in self.specs {
            if slots.iter().any(|s| s.name == spec.name) {
                return Err(StageError::DuplicateModel { name: spec.name });
            }
            let checkpoint = match (spec.checkpoint.is_empty(), self.planned_checkpoints.get(&spec.name)) {
                (true, Some(planned)) => planned.clone(),
                _ => spec.checkpoint,
            };
            slots.push(Slot {
                name: spec.name,
                loader: Some(spec.loader),
                checkpoint,
                state: SlotState::Unloaded,
                loads: 0,
            });
        }
        let known: HashSet<&str> = slots.iter().map(|s| s.name.as_str()).collect();
        let unknown: BTreeSet<String> = self
            .stages
            .iter()
            .flat_map(|(_, m)| m.iter())
            .chain(self.pinned.iter())
            .chain(self.planned_models.iter())
            .filter(|n| !known.contains(n.as_str()))
            .cloned()
            .collect();
        if !unknown.is_empty() {
            return Err(StageError::PlanWithoutLoader { names: unknown.into_iter().collect() });
        }
        let stages = self.stages.into_iter().map(|(s, m)| (s, m.into_iter().collect())).collect();
        if self.map_large_host_blocks {
            stageload_torch_sys::map_large_host_blocks();
        }
        Ok(StagedModels {
            state: Mutex::new(State {
                slots,
                stages,
                pinned: self.pinned.into_iter().collect(),
                current: None,
                closed: false,
            }),
            built: Condvar::new(),
            build_lock: Mutex::new(()),
            shared: Mutex::new(BTreeMap::new()),
            sink: self.sink,
            rngs: self.rngs,
            preserve_rng: self.preserve_rng,
            strict: self.strict,
            progress: self.progress,
        })
    }
}

/// Named models loaded on first use and released in place between stages. See the module docs.
pub struct StagedModels {
    state: Mutex<State>,
    built: Condvar,
    build_lock: Mutex<()>,
    shared: Mutex<BTreeMap<String, SharedEntry>>,
    sink: Option<Arc<dyn EventSink>>,
    rngs: Vec<Arc<dyn RngSnapshot>>,
    preserve_rng: bool,
    strict: bool,
    progress: Option<Arc<ProgressHook>>,
}

enum Plan {
    Build { reload: bool, loader: Arc<Loader>, checkpoint: Vec<PathBuf> },
    InPlace { instance: Arc<Instance>, checkpoint: Vec<PathBuf> },
}

impl StagedModels {
    pub fn builder() -> StagedModelsBuilder {
        StagedModelsBuilder {
            specs: Vec::new(),
            stages: Vec::new(),
            pinned: Vec::new(),
            sink: None,
            rngs: Vec::new(),
            preserve_rng: true,
            strict: false,
            map_large_host_blocks: true,
            progress: None,
            planned_checkpoints: HashMap::new(),
            planned_models: Vec::new(),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sends an event to the sink. `resident` is what the registry holds after it (the weights
    /// curve of a trace); the caller computes it because it may hold the state lock.
    #[allow(clippy::too_many_arguments)]
    fn emit(
        &self,
        kind: EventKind,
        stage: Option<String>,
        model: Option<&str>,
        bytes: Option<u64>,
        seconds: Option<f64>,
        note: Option<String>,
        resident: Option<u64>,
    ) {
        if let Some(sink) = &self.sink {
            let mut event = Event::now(kind);
            event.stage = stage;
            event.model = model.map(str::to_string);
            event.bytes = bytes;
            event.seconds = seconds;
            event.note = note;
            event.resident = resident;
            sink.emit(&event);
        }
    }

    /// Whether a model of that name exists (never loads).
    pub fn contains(&self, name: &str) -> bool {
        self.state().index(name).is_ok()
    }

    /// Number of models (never loads).
    pub fn len(&self) -> usize {
        self.state().slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Model names in definition order (never loads).
    pub fn names(&self) -> Vec<String> {
        self.state().slots.iter().map(|s| s.name.clone()).collect()
    }

    /// Names of the resident models, in definition order.
    pub fn resident(&self) -> Vec<String> {
        self.state().resident().map(|(n, _)| n.to_string()).collect()
    }

    /// The stage entered last, if any.
    pub fn current_stage(&self) -> Option<String> {
        self.state().current.clone()
    }

    /// The models a stage lists.
    pub fn stage_models(&self, stage: &str) -> Result<Vec<String>> {
        let state = self.state();
        state.stages.get(stage).map(|m| m.iter().cloned().collect()).ok_or_else(|| StageError::UnknownStage {
            stage: stage.to_string(),
            known: state.stages.keys().cloned().collect(),
        })
    }

    /// Bytes of the distinct storages of every resident model (shared storage counted once).
    pub fn resident_bytes(&self) -> u64 {
        Self::resident_bytes_of(&self.state())
    }

    fn resident_bytes_of(state: &State) -> u64 {
        let mut seen = HashSet::new();
        let mut total = 0;
        for (_, instance) in state.resident() {
            for (id, bytes) in &instance.storage_sizes {
                if seen.insert(*id) {
                    total += bytes;
                }
            }
        }
        total
    }

    /// The model `name`, built (or brought back) on first use. Emits `load` or `reload`.
    pub fn get<M: 'static>(&self, name: &str) -> Result<Handle<M>> {
        let instance = self.instance(name)?;
        if !instance.body.try_lock().map(|b| b.model.is::<M>()).unwrap_or(true) {
            return Err(StageError::WrongType {
                model: name.to_string(),
                expected: std::any::type_name::<M>(),
                actual: instance.type_name,
            });
        }
        Ok(Handle { instance, _model: PhantomData })
    }

    /// Builds (or brings back) `name` now without handing out a handle: for loading models up
    /// front (eager runs) or ahead of the stage that uses them. Emits `load` or `reload`.
    pub fn load(&self, name: &str) -> Result<()> {
        self.instance(name).map(drop)
    }

    fn instance(&self, name: &str) -> Result<Arc<Instance>> {
        let mut state = self.state();
        let (index, plan, previous) = loop {
            let index = state.index(name)?;
            let slot = &state.slots[index];
            match &slot.state {
                SlotState::Resident(instance) => return Ok(Arc::clone(instance)),
                SlotState::Building => {
                    state = self.built.wait(state).unwrap_or_else(|e| e.into_inner());
                    continue;
                }
                _ => {}
            }
            if state.closed {
                return Err(StageError::Closed { model: name.to_string() });
            }
            if self.strict && !state.planned_here(name) {
                return Err(StageError::OutsideStage {
                    model: name.to_string(),
                    stage: state.current.clone().unwrap_or_default(),
                });
            }
            let plan = match (&slot.state, &slot.loader) {
                (SlotState::Released { instance, .. }, _) if !slot.checkpoint.is_empty() => {
                    Plan::InPlace { instance: Arc::clone(instance), checkpoint: slot.checkpoint.clone() }
                }
                (SlotState::Released { stage, .. }, None) => {
                    return Err(StageError::NoLoader { model: name.to_string(), stage: stage.clone() })
                }
                (_, Some(loader)) => Plan::Build {
                    reload: slot.loads > 0,
                    loader: Arc::clone(loader),
                    checkpoint: slot.checkpoint.clone(),
                },
                (_, None) => unreachable!("a slot without loader is created resident"),
            };
            let previous = std::mem::replace(&mut state.slots[index].state, SlotState::Building);
            break (index, plan, previous);
        };
        let stage = state.current.clone();
        let outside = !state.planned_here(name);
        drop(state);

        let started = Instant::now();
        let result = {
            let _one_build_at_a_time = self.build_lock.lock().unwrap_or_else(|e| e.into_inner());
            match &plan {
                Plan::Build { loader, checkpoint, .. } => self.build(name, loader, checkpoint),
                Plan::InPlace { instance, checkpoint } => {
                    self.refill(instance, checkpoint).map(|bytes| (Arc::clone(instance), bytes))
                }
            }
        };
        let seconds = started.elapsed().as_secs_f64();

        let mut state = self.state();
        // The slot may have moved if another slot was removed meanwhile; find it again.
        let index = state.slots.iter().position(|s| s.name == name).unwrap_or(index);
        let slot = &mut state.slots[index];
        self.built.notify_all();
        match result {
            Ok((instance, bytes)) => {
                slot.state = SlotState::Resident(Arc::clone(&instance));
                slot.loads += 1;
                drop(state);
                let (kind, how) = match plan {
                    Plan::Build { reload: false, .. } => (EventKind::Load, None),
                    Plan::Build { reload: true, .. } => (EventKind::Reload, Some("rebuilt")),
                    Plan::InPlace { .. } => (EventKind::Reload, Some("in_place")),
                };
                let note =
                    [how, outside.then_some("outside_stage")].into_iter().flatten().collect::<Vec<_>>().join(",");
                let resident = Some(self.resident_bytes());
                self.emit(
                    kind,
                    stage,
                    Some(name),
                    Some(bytes),
                    Some(seconds),
                    (!note.is_empty()).then_some(note),
                    resident,
                );
                Ok(instance)
            }
            Err(err) => {
                slot.state = previous;
                drop(state);
                self.emit(EventKind::Error, stage, Some(name), None, Some(seconds), Some(err.to_string()), None);
                Err(err)
            }
        }
    }

    /// Runs a loader under preserved RNG, catching panics, and fills the model from its
    /// checkpoint. Returns the instance and its bytes.
    fn build(&self, name: &str, loader: &Arc<Loader>, checkpoint: &[PathBuf]) -> Result<(Arc<Instance>, u64)> {
        let _rng =
            if self.preserve_rng { Some(PreservedRng::save(&self.rngs).map_err(StageError::Rng)?) } else { None };
        let context = BuildContext { registry: self, model: name, shared_tensors: Mutex::new(Vec::new()) };
        let built = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| loader(&context))) {
            Ok(Ok(built)) => built,
            Ok(Err(source)) => return Err(StageError::LoaderFailed { model: name.to_string(), source }),
            Err(panic) => {
                return Err(StageError::LoaderPanicked { model: name.to_string(), message: panic_message(&*panic) })
            }
        };
        let Built { model, type_name, mut tensors } = built;
        let shared = context.shared_tensors.into_inner().unwrap_or_else(|e| e.into_inner());
        if !checkpoint.is_empty() {
            let mut targets: Vec<(String, Tensor)> =
                tensors.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect();
            targets
                .extend(shared.iter().filter(|(_, _, fresh)| *fresh).map(|(n, t, _)| (n.clone(), t.shallow_clone())));
            self.load_checkpoint(name, checkpoint, &targets)?;
        }
        // Shared components another model already built are not loaded again: not counted.
        let reused: Vec<(String, Tensor)> =
            shared.iter().filter(|(_, _, fresh)| !fresh).map(|(n, t, _)| (n.clone(), t.shallow_clone())).collect();
        let reused = storage::distinct_storages(&reused)
            .map_err(|source| StageError::Torch { model: name.to_string(), source })?;
        tensors.extend(shared.into_iter().map(|(n, t, _)| (n, t)));
        let instance = Instance::new(name, type_name, model, tensors)?;
        let bytes = instance
            .storage_sizes
            .iter()
            .filter(|(id, _)| !reused.iter().any(|r| r.id == *id))
            .map(|(_, bytes)| bytes)
            .sum();
        Ok((instance, bytes))
    }

    fn load_checkpoint(&self, model: &str, files: &[PathBuf], targets: &[(String, Tensor)]) -> Result<()> {
        let wrap = |source| StageError::Checkpoint { model: model.to_string(), source: Box::new(source) };
        let checkpoint = Checkpoint::open(files).map_err(wrap)?;
        let report = checkpoint
            .load_into(targets, |progress| {
                if let Some(hook) = &self.progress {
                    hook(model, progress)
                }
            })
            .map_err(wrap)?;
        if !report.unused.is_empty() {
            tracing::debug!(model, unused = ?report.unused, "checkpoint entries the model does not have");
        }
        Ok(())
    }

    /// Brings a released instance back in place: reallocates its freed storages and refills
    /// them from the checkpoint. On failure the instance stays released as it was.
    fn refill(&self, instance: &Arc<Instance>, checkpoint: &[PathBuf]) -> Result<u64> {
        let name = &instance.name;
        let torch = |source| StageError::Torch { model: name.clone(), source };
        let body = instance.lock_body();
        let reallocated = storage::reallocate(&body.storages).map_err(torch)?;
        let targets: Vec<(String, Tensor)> = body
            .tensors
            .iter()
            .filter(|(_, t)| stageload_torch_sys::storage_info(t).is_ok_and(|i| reallocated.contains(&i.id)))
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect();
        if let Err(err) = self.load_checkpoint(name, checkpoint, &targets) {
            let stage = instance.released_at().flatten();
            storage::free_ids(&body.storages, &reallocated, &released_message(name, &stage)).map_err(torch)?;
            return Err(err);
        }
        *instance.released.lock().unwrap_or_else(|e| e.into_inner()) = None;
        Ok(body.storages.iter().filter(|s| reallocated.contains(&s.id)).map(|s| s.nbytes as u64).sum())
    }

    /// Enters `stage`: records it, then releases every resident model it does not list and that
    /// is not pinned. Emits `stage`, then one `release` per model.
    pub fn enter(&self, stage: &str) -> Result<ReleaseStats> {
        let mut state = self.state();
        let Some(planned) = state.stages.get(stage).cloned() else {
            return Err(StageError::UnknownStage {
                stage: stage.to_string(),
                known: state.stages.keys().cloned().collect(),
            });
        };
        state.current = Some(stage.to_string());
        self.emit(
            EventKind::Stage,
            Some(stage.to_string()),
            None,
            None,
            None,
            None,
            Some(Self::resident_bytes_of(&state)),
        );
        let leaving: Vec<String> = state
            .resident()
            .map(|(n, _)| n.to_string())
            .filter(|n| !planned.contains(n) && !state.pinned.contains(n))
            .collect();
        self.release_all(&mut state, &leaving)
    }

    /// Releases `names` (resident ones) in order (each release trims the host heap), then empties
    /// the CUDA cache once.
    fn release_all(&self, state: &mut State, names: &[String]) -> Result<ReleaseStats> {
        let mut total = ReleaseStats::default();
        for name in names {
            let stats = self.release_one(state, name)?;
            total.freed += stats.freed;
            total.kept += stats.kept;
        }
        if total.freed > 0 && stageload_torch_sys::cuda_device_count().unwrap_or(0) > 0 {
            if let Err(err) = stageload_torch_sys::cuda_empty_cache() {
                tracing::warn!(%err, "emptying the CUDA cache after a release failed");
            }
        }
        Ok(total)
    }

    fn release_one(&self, state: &mut State, name: &str) -> Result<ReleaseStats> {
        let index = state.index(name)?;
        let SlotState::Resident(instance) = &state.slots[index].state else { return Ok(ReleaseStats::default()) };
        let instance = Arc::clone(instance);
        let keep: HashSet<u64> =
            state.resident().filter(|(n, _)| *n != name).flat_map(|(_, i)| i.storage_ids()).collect();
        let stage = state.current.clone();
        let started = Instant::now();
        let stats = instance.release(&keep, &stage)?;
        state.slots[index].state = SlotState::Released { stage: stage.clone(), instance };
        if stats.freed > 0 {
            // Before the event, so that a meter reading at the event sees the memory gone.
            stageload_torch_sys::trim_host_heap();
        }
        let note = (stats.kept > 0).then(|| format!("kept={}", stats.kept));
        let resident = Some(Self::resident_bytes_of(state));
        self.emit(
            EventKind::Release,
            stage,
            Some(name),
            Some(stats.freed),
            Some(started.elapsed().as_secs_f64()),
            note,
            resident,
        );
        Ok(stats)
    }

    /// Keeps `name` resident across stages. Does not load it.
    pub fn pin(&self, name: &str) -> Result<()> {
        let mut state = self.state();
        state.index(name)?;
        state.pinned.insert(name.to_string());
        Ok(())
    }

    /// Ends a pin; the next `enter` releases the model if its stage does not list it.
    pub fn unpin(&self, name: &str) {
        self.state().pinned.remove(name);
    }

    /// Emits a `mark` event with `label`.
    pub fn mark(&self, label: &str) {
        let stage = self.state().current.clone();
        self.emit(EventKind::Mark, stage, None, None, None, Some(label.to_string()), None);
    }

    /// Releases every resident model, pinned ones too, and refuses further loads. Emits a `close`
    /// mark, then one `release` per model.
    pub fn close(&self) -> Result<ReleaseStats> {
        let mut state = self.state();
        let names: Vec<String> = state.resident().map(|(n, _)| n.to_string()).collect();
        // A `close` mark first, so a trace does not read these releases as the tail of the last
        // stage's entry.
        let resident = Some(Self::resident_bytes_of(&state));
        self.emit(EventKind::Mark, state.current.clone(), None, None, None, Some("close".into()), resident);
        let stats = self.release_all(&mut state, &names)?;
        state.current = None;
        state.closed = true;
        Ok(stats)
    }

    /// Registers an already-built model with no loader: once released it cannot come back. A
    /// model already under that name is released first (storage it shares with `built` is kept).
    pub fn insert(&self, name: &str, built: Built) -> Result<()> {
        let instance = Instance::new(name, built.type_name, built.model, built.tensors)?;
        let new_ids = instance.storage_ids();
        let mut state = self.state();
        if let Ok(index) = state.index(name) {
            if let SlotState::Resident(old) = &state.slots[index].state {
                let old = Arc::clone(old);
                let stage = state.current.clone();
                let stats = old.release(&new_ids, &stage)?;
                self.emit(
                    EventKind::Release,
                    stage,
                    Some(name),
                    Some(stats.freed),
                    None,
                    Some("replaced".into()),
                    None,
                );
            }
            let slot = &mut state.slots[index];
            slot.state = SlotState::Resident(instance);
            slot.loader = None;
            slot.checkpoint.clear();
            slot.loads = 1;
        } else {
            state.slots.push(Slot {
                name: name.to_string(),
                loader: None,
                checkpoint: Vec::new(),
                state: SlotState::Resident(instance),
                loads: 1,
            });
        }
        Ok(())
    }

    /// Removes a model: releases it if resident, forgets its slot and its pin.
    pub fn remove(&self, name: &str) -> Result<()> {
        let mut state = self.wait_not_building(name)?;
        self.release_all(&mut state, &[name.to_string()])?;
        let index = state.index(name)?;
        state.slots.remove(index);
        state.pinned.remove(name);
        Ok(())
    }

    /// Hands a live model over and forgets it: loads it if needed, then removes its slot and
    /// pin without releasing. The handle returned is never released by the registry.
    pub fn take<M: 'static>(&self, name: &str) -> Result<Handle<M>> {
        let handle = self.get::<M>(name)?;
        let mut state = self.wait_not_building(name)?;
        let index = state.index(name)?;
        state.slots.remove(index);
        state.pinned.remove(name);
        Ok(handle)
    }

    fn wait_not_building(&self, name: &str) -> Result<MutexGuard<'_, State>> {
        let mut state = self.state();
        loop {
            let index = state.index(name)?;
            if !matches!(state.slots[index].state, SlotState::Building) {
                return Ok(state);
            }
            state = self.built.wait(state).unwrap_or_else(|e| e.into_inner());
        }
    }
}

fn released_message(model: &str, stage: &Option<String>) -> String {
    format!(
        "stageload: model '{model}' was released{} and its weights are gone; get it from the registry again",
        at_stage(stage)
    )
}

fn panic_message(panic: &(dyn Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic with a non-string payload".to_string())
}
