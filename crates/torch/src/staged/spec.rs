//! What users hand the registry: a model's spec (loader, checkpoint files, name rules), what a
//! loader returns ([`Built`]), and what a loader gets ([`BuildContext`], shared components).

use std::any::{Any, TypeId};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use tch::nn::VarStore;
use tch::Tensor;

use super::decide::OutOfMemory;
use super::error::BoxError;
use crate::checkpoint::Progress;
use crate::names::NameRules;
use crate::rng::{PreservedRng, RngSnapshot};
use crate::sync::{lock, Shared};
use stageload_torch_sys::ShimError;

/// What a loader returns: the model object and the tensors whose storage it owns.
pub struct Built {
    pub(crate) model: Box<dyn Any + Send>,
    pub(crate) type_id: TypeId,
    pub(crate) type_name: &'static str,
    pub(crate) tensors: Vec<(String, Tensor)>,
}

/// Every variable of a VarStore (parameters and buffers) with its name, sorted by name: the
/// order in which the registry lists a built model's tensors and `checkpoint::save` writes them.
pub fn named_tensors(vs: &VarStore) -> Vec<(String, Tensor)> {
    let mut tensors: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    tensors
}

impl Built {
    /// A model and every variable of its VarStore (parameters and buffers).
    pub fn new<M: Send + 'static>(model: M, vs: &VarStore) -> Self {
        Self::from_tensors(model, named_tensors(vs))
    }

    /// A model and its named tensors, given explicitly.
    pub fn from_tensors<M: Send + 'static>(model: M, tensors: Vec<(String, Tensor)>) -> Self {
        Built { model: Box::new(model), type_id: TypeId::of::<M>(), type_name: std::any::type_name::<M>(), tensors }
    }
}

pub(crate) struct SharedEntry {
    component: Box<dyn Any + Send>,
    tensors: Vec<(String, Tensor)>,
}

pub(crate) type SharedComponents = Mutex<BTreeMap<String, SharedEntry>>;

/// Told how far a checkpoint load has come: the model and bytes done of the total.
pub(crate) type ProgressHook = dyn Fn(&str, Progress) + Send + Sync;

/// What builds and refills go by: the generators a foreground build leaves as they were, the
/// components models share, the progress hook, what a load that runs out of memory does, and
/// whether a `get` outside its stage is refused.
pub(crate) struct Builds {
    rngs: Vec<Arc<dyn RngSnapshot>>,
    preserve_rng: bool,
    strict: bool,
    out_of_memory: OutOfMemory,
    progress: Option<Arc<ProgressHook>>,
    components: SharedComponents,
}

impl Builds {
    pub(crate) fn new(
        rngs: Vec<Arc<dyn RngSnapshot>>,
        preserve_rng: bool,
        strict: bool,
        out_of_memory: OutOfMemory,
        progress: Option<Arc<ProgressHook>>,
    ) -> Self {
        Builds { rngs, preserve_rng, strict, out_of_memory, progress, components: Default::default() }
    }

    /// The generators' states saved for a build to put back, when it preserves them: a
    /// `foreground` build of a registry that preserves them (a prefetched build draws nothing
    /// and must not touch the generators the foreground draws from).
    pub(crate) fn preserve_rng(&self, foreground: bool) -> Result<Option<PreservedRng>, ShimError> {
        (self.preserve_rng && foreground).then(|| PreservedRng::save(&self.rngs)).transpose()
    }

    /// Whether a `get` of a model its stage does not list is refused.
    pub(crate) fn strict(&self) -> bool {
        self.strict
    }

    pub(crate) fn out_of_memory(&self) -> OutOfMemory {
        self.out_of_memory
    }

    pub(crate) fn components(&self) -> &SharedComponents {
        &self.components
    }

    /// Tells the progress hook, if any, how far `model`'s checkpoint load has come.
    pub(crate) fn tell_progress(&self, model: &str, progress: Progress) {
        if let Some(hook) = &self.progress {
            hook(model, progress)
        }
    }
}

/// Handed to a loader: the model being built, and shared components.
pub struct BuildContext<'a> {
    /// The build's hold on the build turn, taken for shared components (see [`super::turn`]).
    pub(crate) hold: &'a super::turn::BuildHold,
    pub(crate) components: &'a SharedComponents,
    pub(crate) model: &'a str,
    /// Where the pipeline file puts the model, if a file gave the plan.
    pub(crate) device: Option<tch::Device>,
    /// Tensors of shared components this build used, and whether each was freshly built.
    pub(crate) shared_tensors: Mutex<Vec<(String, Tensor, bool)>>,
    /// How the pipeline file streams the model, if it does.
    pub(crate) stream: Option<&'a crate::stream::StreamPlan>,
    /// Whether the loader asked for [`Self::stream`] (a streamed model's loader must).
    pub(crate) stream_taken: std::sync::atomic::AtomicBool,
    /// The files the model's first load read, as it found them ([`Self::source_file`]).
    pub(crate) first_reads: &'a crate::source::FirstReads,
}

impl BuildContext<'_> {
    /// Name of the model being built.
    pub fn model(&self) -> &str {
        self.model
    }

    /// The device the pipeline file places the model on (`None` without a file, or for a model
    /// it does not describe): build there, or the registry refuses the model.
    pub fn device(&self) -> Option<tch::Device> {
        self.device
    }

    /// How the pipeline file streams the model (`stream = { ... }` in its entry), if it does:
    /// build the modules under `stageload_torch_sys::without_fills` and make the model with
    /// [`StreamedModel::planned`](crate::stream::StreamedModel::planned). The registry gives a
    /// streamed model no checkpoint (it would load it whole); a release drops it and a later
    /// stage rebuilds it.
    pub fn stream(&self) -> Option<&crate::stream::StreamPlan> {
        self.stream_taken.store(true, std::sync::atomic::Ordering::Relaxed);
        self.stream
    }

    /// Reads the file at `path` with `read`, as a file the model's weights come from: a file
    /// the model's first load read must be the same at every later build (a rebuild after a
    /// release), or the build is refused with
    /// [`StageError::SourceChanged`](crate::StageError::SourceChanged) before `read` runs. The
    /// file is stamped before and after `read` ([`crate::source::FileStamp`]); one written
    /// meanwhile is refused too. [`ModelSpec::torchscript`] and [`ModelSpec::pt2`] read their
    /// files through it; a loader that reads a file of its own (a state dict, a config that
    /// shapes the weights) should too.
    ///
    /// ```no_run
    /// # use stageload::{BoxError, BuildContext, Built};
    /// fn loader(ctx: &BuildContext) -> Result<Built, BoxError> {
    ///     let (module, tensors) = ctx.source_file("unet.pt".as_ref(), |path| {
    ///         Ok(stageload::script::load(path, tch::Device::Cpu)?)
    ///     })?;
    ///     Ok(Built::from_tensors(module, tensors))
    /// }
    /// ```
    pub fn source_file<T>(
        &self,
        path: &std::path::Path,
        read: impl FnOnce(&std::path::Path) -> Result<T, BoxError>,
    ) -> Result<T, BoxError> {
        use crate::source::FileStamp;
        // A file that cannot be looked at is left to `read`, whose error names what is wrong.
        if let Ok(before) = FileStamp::at(path) {
            self.first_reads.meet(self.model, path, before)?;
        }
        let value = read(path)?;
        // Written while `read` ran: what it read may be either version, or both.
        let after =
            FileStamp::at(path).map_err(|e| -> BoxError { format!("cannot read {}: {e}", path.display()).into() })?;
        self.first_reads.meet(self.model, path, after)?;
        Ok(value)
    }

    /// The component under `key`, built by `build` if it is not there or its storage was
    /// released. Its tensors join the building model's, named `key.name`, so a release keeps
    /// them while another resident model shares them and frees them after the last.
    ///
    /// ```no_run
    /// # use stageload::{BoxError, BuildContext, Built, Shared};
    /// # use tch::nn::{self, VarStore};
    /// struct Head {
    ///     backbone: Shared<nn::Linear>, // built once, held by every model that asks for it
    ///     head: nn::Linear,
    /// }
    ///
    /// fn head(ctx: &BuildContext) -> Result<Built, BoxError> {
    ///     let backbone = ctx.shared("backbone", || {
    ///         let vs = VarStore::new(tch::Device::Cpu);
    ///         let backbone = nn::linear(vs.root(), 512, 512, Default::default());
    ///         Ok((backbone, stageload::named_tensors(&vs)))
    ///     })?;
    ///     let vs = VarStore::new(tch::Device::Cpu);
    ///     let head = nn::linear(vs.root() / "head", 512, 10, Default::default());
    ///     Ok(Built::new(Head { backbone, head }, &vs))
    /// }
    /// ```
    pub fn shared<T: Send + 'static>(
        &self,
        key: &str,
        build: impl FnOnce() -> Result<(T, Vec<(String, Tensor)>), BoxError>,
    ) -> Result<Shared<T>, BoxError> {
        // A component one build makes, that build fills: the turn is held from here to the
        // build's end, so no other build sees it half filled.
        self.hold.for_shared()?;
        let mut cache = lock(self.components);
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
        let component = Shared::new(component);
        self.record(key, &tensors, true);
        cache.insert(key.to_string(), SharedEntry { component: Box::new(component.clone()), tensors });
        Ok(component)
    }

    fn record(&self, key: &str, tensors: &[(String, Tensor)], fresh: bool) {
        lock(&self.shared_tensors)
            .extend(tensors.iter().map(|(n, t)| (format!("{key}.{n}"), t.shallow_clone(), fresh)));
    }
}

pub(crate) type Loader = dyn Fn(&BuildContext) -> Result<Built, BoxError> + Send + Sync;

/// How to build one model: its loader and, optionally, its safetensors checkpoint files and how
/// their entries' names meet the model's. Three kinds: built by a loader of yours
/// ([`new`](Self::new)), a TorchScript file ([`torchscript`](Self::torchscript)), an AOTInductor
/// package ([`pt2`](Self::pt2)).
///
/// ```no_run
/// # use stageload::{BoxError, BuildContext, Built, ModelSpec, NameRules};
/// # fn bert(_: &BuildContext) -> Result<Built, BoxError> { Err("your loader builds the model here".into()) }
/// // A published checkpoint whose names lack the model's `bert.` prefix, with entries the model
/// // does not use, loaded into a model built without random initialisation.
/// let spec = ModelSpec::new("bert", bert)
///     .checkpoint(["model.safetensors"])
///     .names(NameRules::default().add_prefix("bert.").ignore(["pooler.*"])?)
///     .skip_init(true);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct ModelSpec {
    pub(crate) name: String,
    pub(crate) loader: Arc<Loader>,
    pub(crate) checkpoint: Vec<PathBuf>,
    pub(crate) names: NameRules,
    pub(crate) init: Init,
    pub(crate) reload: Reload,
}

/// How a released model comes back from its checkpoint ([`ModelSpec::reload`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Reload {
    /// Its storages are allocated again and the checkpoint's bytes copied into them: the
    /// weights are the process's own memory, whatever happens to the files afterwards.
    #[default]
    Copy,
    /// Its storages are given the checkpoint file's pages in place, through a private mapping of
    /// the file (as `safetensors`' `load_file` and `from_pretrained` hold weights): nothing is
    /// allocated, zeroed or copied, and the pages come in as the model touches them (read from
    /// the disk where they are not cached; a prefetch maps them in at once). For each CPU storage that is exactly one entry of the
    /// file in its dtype and shape (contiguous, from the storage's first byte, aligned for its
    /// dtype); the others are copied. A write to a weight stays in this process. The hazard
    /// `from_pretrained` has comes with it: a file written in place while the model holds its
    /// pages changes the weights. So while such a model is resident, each time it is handed
    /// out its files are checked: one written in place since its first load makes the
    /// registry release the model and answer [`StageError::ChangedUnderModel`](crate::StageError::ChangedUnderModel) instead
    /// (a file put at the path by a rename, or deleted, changes nothing the model holds). A
    /// file truncated under a model that is computing ends the process with SIGBUS, as it does
    /// under `from_pretrained`.
    Map,
}

/// Where a model's weights come from at a build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Init {
    /// The loader initialises them (drawing random numbers, under preserved RNG); a declared
    /// checkpoint fills them afterwards.
    Loader,
    /// [`ModelSpec::skip_init`]: built without initial values; the checkpoint writes every
    /// weight (a load leaving one out is refused, whatever the name rules).
    Skipped,
    /// Read from a file by the loader ([`ModelSpec::torchscript`],
    /// [`ModelSpec::loader_reads_checkpoint`]): nothing is drawn, and a
    /// declared checkpoint is only checked against the model after a build (it refills the
    /// model after a release).
    Deserialized,
}

impl Init {
    /// Whether a build draws no random number (so it may be prefetched).
    pub(crate) fn draws_nothing(self) -> bool {
        self != Init::Loader
    }
}

impl ModelSpec {
    /// A model built by `loader`. The loader places it on its device; weights come from the
    /// checkpoint when one is declared, else from the loader itself.
    ///
    /// ```no_run
    /// use stageload::{BoxError, BuildContext, Built, ModelSpec};
    /// use tch::nn::{self, VarStore};
    ///
    /// fn loader(ctx: &BuildContext) -> Result<Built, BoxError> {
    ///     // On the device a pipeline file gives the model, else the CPU.
    ///     let vs = VarStore::new(ctx.device().unwrap_or(tch::Device::Cpu));
    ///     let model = nn::linear(vs.root() / "proj", 768, 768, Default::default());
    ///     Ok(Built::new(model, &vs)) // the model and the tensors a release frees
    /// }
    ///
    /// let spec = ModelSpec::new("proj", loader).checkpoint(["proj.safetensors"]);
    /// ```
    pub fn new(
        name: impl Into<String>,
        loader: impl Fn(&BuildContext) -> Result<Built, BoxError> + Send + Sync + 'static,
    ) -> Self {
        ModelSpec {
            name: name.into(),
            loader: Arc::new(loader),
            checkpoint: Vec::new(),
            names: NameRules::default(),
            init: Init::Loader,
            reload: Reload::Copy,
        }
    }

    /// A TorchScript module, the file `torch.jit.save` (or `torch.jit.trace(...).save`) wrote,
    /// loaded on the model's device in evaluation mode; its parameters and buffers are its
    /// tensors. Called as `models.call(name, |m: &mut tch::CModule| m.forward_ts(&[x]))`. A load
    /// draws no random number, so it may be prefetched. Without a checkpoint a released module
    /// is loaded from the file again; with one ([`checkpoint`](Self::checkpoint), the module's own
    /// tensor names, [`NameRules`] apply) it is checked against the module at each load and
    /// refills the module in place after a release. Errors name the file: one that is not
    /// TorchScript or is truncated ([`crate::script::ScriptError`], inside
    /// [`StageError::LoaderFailed`](crate::StageError::LoaderFailed)).
    ///
    /// ```no_run
    /// # use stageload::{ModelSpec, StagedModels};
    /// # fn run(x: &tch::Tensor, t: &tch::Tensor) -> Result<(), Box<dyn std::error::Error>> {
    /// let models = StagedModels::builder()
    ///     .model(ModelSpec::torchscript("unet", "unet.pt").checkpoint(["unet.safetensors"]))
    ///     .stage("denoise", ["unet"])
    ///     .build()?;
    /// models.enter("denoise")?;
    /// let eps = models.call("unet", |m: &mut tch::CModule| m.forward_ts(&[x, t]))??;
    /// # Ok(()) }
    /// ```
    pub fn torchscript(name: impl Into<String>, path: impl Into<PathBuf>) -> Self {
        let path: PathBuf = path.into();
        let mut spec = ModelSpec::new(name, move |ctx| {
            let device = ctx.device().unwrap_or(tch::Device::Cpu);
            let (module, tensors) = ctx.source_file(&path, |path| Ok(crate::script::load(path, device)?))?;
            Ok(Built::from_tensors(module, tensors))
        });
        spec.init = Init::Deserialized;
        spec
    }

    /// An AOTInductor package (`.pt2`, written by `torch._inductor.aoti_compile_and_package`
    /// with `aot_inductor.package_constants_in_so=False`, as `scripts/reference/pt2.py` does)
    /// run on the model's device, its weights from `checkpoint` (safetensors under the
    /// constants' FQNs: the exported program's state dict and constants). Called as
    /// `models.call(name, |m: &mut stageload::pt2::Pt2Module| m.forward(&[&x]))`. The loader
    /// makes one tensor per constant the package expects and the registry fills them from the
    /// checkpoint (a load draws no random number, so it may be prefetched); release frees them
    /// in place and reload refills them in place, and the next run registers them with the
    /// runner again. Exported the ordinary way or by the helper, it is checked as strictly:
    /// errors name the file, for a package for another machine, CPU or device, one whose weights
    /// are inside its library, a checkpoint without a constant or with one of another shape (as
    /// the package records it) or dtype ([`crate::pt2::Pt2Error`], inside
    /// [`StageError::LoaderFailed`](crate::StageError::LoaderFailed)); checkpoint entries no
    /// constant reads are listed as unused in the load report.
    ///
    /// ```no_run
    /// # use stageload::{ModelSpec, StagedModels};
    /// # fn run(x: &tch::Tensor, t: &tch::Tensor) -> Result<(), Box<dyn std::error::Error>> {
    /// let models = StagedModels::builder()
    ///     .model(ModelSpec::pt2("unet", "unet.pt2", ["unet.safetensors"]))
    ///     .stage("denoise", ["unet"])
    ///     .build()?;
    /// models.enter("denoise")?;
    /// let outputs = models.call("unet", |m: &mut stageload::pt2::Pt2Module| m.forward(&[x, t]))??;
    /// # Ok(()) }
    /// ```
    pub fn pt2<P: Into<PathBuf>>(
        name: impl Into<String>,
        package: impl Into<PathBuf>,
        checkpoint: impl IntoIterator<Item = P>,
    ) -> Self {
        let package: PathBuf = package.into();
        let files: Vec<PathBuf> = checkpoint.into_iter().map(Into::into).collect();
        let shapes_from = files.clone();
        let mut spec = ModelSpec::new(name, move |ctx| {
            let device = ctx.device().unwrap_or(tch::Device::Cpu);
            let (module, tensors) =
                ctx.source_file(&package, |path| Ok(crate::pt2::load(path, device, &shapes_from)?))?;
            Ok(Built::from_tensors(module, tensors))
        });
        spec.checkpoint = files;
        spec.init = Init::Skipped;
        // Every constant is filled (skip_init makes the load complete); entries no constant
        // reads (`num_batches_tracked`, tensors Inductor inlined) are listed as unused.
        spec.names = NameRules::default().strict(false);
        spec
    }

    /// The model's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The checkpoint files declared with [`checkpoint`](Self::checkpoint).
    pub fn checkpoint_files(&self) -> &[PathBuf] {
        &self.checkpoint
    }

    /// Declares the safetensors files holding the model's tensors: they fill it after each
    /// build, and a released model comes back from them in place.
    pub fn checkpoint<P: Into<PathBuf>>(mut self, files: impl IntoIterator<Item = P>) -> Self {
        self.checkpoint = files.into_iter().map(Into::into).collect();
        self
    }

    /// How the files' entry names map to the model's tensor names, which entries to ignore, and
    /// whether a mismatch is an error (default: same names, nothing ignored, strict).
    pub fn names(mut self, rules: NameRules) -> Self {
        self.names = rules;
        self
    }

    /// Says that the loader reads the model's weights itself from the declared checkpoint (as
    /// Python's `from_pretrained` does): a build draws nothing, so it may be prefetched, and the
    /// checkpoint is checked against the built model (names, shapes, dtypes) without being copied
    /// again; after a release it refills the model in place. The checkpoint must be the files the
    /// loader reads: they are the ones a reload comes back from.
    pub fn loader_reads_checkpoint(mut self) -> Self {
        self.init = Init::Deserialized;
        self
    }

    /// How the model comes back from its checkpoint after a release ([`Reload::Copy`] unless
    /// set). [`Reload::Map`] gives its CPU weights the file's pages instead of copies; with
    /// [`skip_init`](Self::skip_init), from its first load on (the build allocates nothing it
    /// keeps).
    ///
    /// ```no_run
    /// use stageload::{Built, ModelSpec, Reload};
    /// use tch::nn::{self, VarStore};
    ///
    /// let spec = ModelSpec::new("proj", |_| {
    ///     let vs = VarStore::new(tch::Device::Cpu);
    ///     let model = nn::linear(vs.root() / "proj", 768, 768, Default::default());
    ///     Ok(Built::new(model, &vs))
    /// })
    /// .checkpoint(["proj.safetensors"])
    /// .reload(Reload::Map); // after a release, its weights are the file's pages
    /// ```
    pub fn reload(mut self, how: Reload) -> Self {
        self.reload = how;
        self
    }

    /// Builds the model without filling its tensors with random (or constant) initial values:
    /// the loader's `randn`, `uniform_`, `normal_` and friends leave memory as allocated, and
    /// the checkpoint writes every weight. Only for models whose every tensor the checkpoint
    /// fills: the registry then refuses a lenient load that leaves a tensor missing. Nothing is
    /// drawn from any generator.
    ///
    /// A [`torchscript`](Self::torchscript) model has no initialisation to skip: it stays as it
    /// is (its file's weights, its checkpoint checked, not copied).
    pub fn skip_init(mut self, on: bool) -> Self {
        self.init = match (self.init, on) {
            (Init::Deserialized, _) => Init::Deserialized,
            (_, true) => Init::Skipped,
            (_, false) => Init::Loader,
        };
        self
    }
}
