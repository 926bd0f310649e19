//! `Registry`: a `stageload::StagedModels` whose models are Python modules.
//!
//! A model's Python loader runs inside the registry's own loader (the GIL taken there); the
//! module it returns is the model object and its parameters and buffers, shared in place, are
//! the model's tensors. Every method runs the registry with the GIL released.

use std::any::Any;
use std::path::PathBuf;
use std::sync::Arc;

use pyo3::prelude::*;
use pyo3_tch::PyTensor;
use stageload::rng::RngSnapshot;
use stageload::{
    BoxError, Built, Event, EventSink, ListSink, ModelSpec, ModelState, Reload, StageError, StagedModels, What,
};

use crate::errors::{raise, stage_error, PythonError};
use crate::meter::Meter;

/// The model object the registry holds: the Python module.
struct PyModel(Py<PyAny>);

/// The module's weights with their names (`stageload_rs.release.weights`: parameters and
/// persistent buffers, each tensor once), as `tch` tensors on the same `TensorImpl`s. Refuses
/// anything but an `nn.Module`, and a module with weights on `meta`: a loader that builds on
/// `meta` and fills afterwards (transformers' `from_pretrained`) leaves a weight there when its
/// fill fails, logging why and going on.
fn module_tensors(module: &Bound<'_, PyAny>, model: &str) -> PyResult<Vec<(String, tch::Tensor)>> {
    let py = module.py();
    let nn_module = py.import("torch.nn")?.getattr("Module")?;
    if !module.is_instance(&nn_module)? {
        let type_name = module.get_type().name()?;
        return Err(stage_error(
            py,
            format!("the loader of '{model}' returned a {type_name}, not a torch.nn.Module: return the module itself"),
        ));
    }
    let weights = py.import("stageload_rs.release")?.getattr("weights")?.call1((module,))?;
    let mut tensors = Vec::new();
    let mut on_meta = Vec::new();
    for item in weights.try_iter()? {
        let (name, tensor) = item?.extract::<(String, Bound<'_, PyAny>)>()?;
        if tensor.getattr("is_meta")?.extract::<bool>()? {
            on_meta.push(name);
        } else {
            tensors.push((name, tensor.extract::<PyTensor>()?.0));
        }
    }
    if let Some(first) = on_meta.first() {
        let total = tensors.len() + on_meta.len();
        return Err(stage_error(
            py,
            format!(
                "the loader of '{model}' returned {} of its {total} weights on the meta device, never loaded \
                 ('{first}' first): its loader's log says why it left them (from_pretrained logs a weight it \
                 could not read or convert); load it again once that is fixed",
                on_meta.len()
            ),
        ));
    }
    Ok(tensors)
}

/// What the registry is given for a module: the module and its tensors.
fn built(module: Bound<'_, PyAny>, model: &str) -> PyResult<Built> {
    let tensors = module_tensors(&module, model)?;
    Ok(Built::from_tensors(PyModel(module.unbind()), tensors))
}

/// A model as Python describes it: name, loader, checkpoint files, where its weights come
/// from at a build (`"loader"`: the loader's own, drawn under preserved generators, then the
/// checkpoint's; `"skip"`: built without initial values, every weight from the checkpoint;
/// `"reads"`: the loader reads the checkpoint itself, as `from_pretrained` does), and how it
/// comes back after a release (`"copy"` or `"map"`: [`Reload`]).
type ModelArgs = (String, Py<PyAny>, Vec<PathBuf>, String, String);

fn model_spec(py: Python<'_>, (name, loader, checkpoint, init, reload): ModelArgs) -> PyResult<ModelSpec> {
    let reload = match reload.as_str() {
        "copy" => Reload::Copy,
        "map" => Reload::Map,
        other => return Err(stage_error(py, format!("model '{name}': unknown reload {other:?}: 'copy' or 'map'"))),
    };
    let model = name.clone();
    let spec = ModelSpec::new(name, move |_ctx| {
        Python::with_gil(|py| {
            let module = loader.bind(py).call0().map_err(PythonError)?;
            built(module, &model).map_err(|e| Box::new(PythonError(e)) as BoxError)
        })
    })
    .checkpoint(checkpoint)
    .reload(reload);
    Ok(match init.as_str() {
        "loader" => spec,
        "skip" => spec.skip_init(true),
        "reads" => spec.loader_reads_checkpoint(),
        other => {
            return Err(stage_error(py, format!("unknown init {other:?}: 'loader', 'skip' or 'reads'")));
        }
    })
}

/// Python's `random` and NumPy's global generator, saved and put back around every foreground
/// build with torch's (the registry's own rule): `saver` is `stageload_rs.rng.PythonGenerators`.
struct PythonGenerators(Py<PyAny>);

impl RngSnapshot for PythonGenerators {
    fn save(&self) -> Box<dyn Any + Send> {
        Python::with_gil(|py| {
            let state = self.0.bind(py).call_method0("save");
            let state = match state {
                Ok(state) => Some(state.unbind()),
                Err(e) => {
                    e.write_unraisable(py, Some(self.0.bind(py)));
                    None
                }
            };
            Box::new(state)
        })
    }

    fn restore(&self, state: Box<dyn Any + Send>) {
        let Ok(state) = state.downcast::<Option<Py<PyAny>>>() else { return };
        let Some(state) = *state else { return };
        Python::with_gil(|py| {
            if let Err(e) = self.0.bind(py).call_method1("restore", (state,)) {
                e.write_unraisable(py, Some(self.0.bind(py)));
            }
        });
    }
}

/// Hands every event to a Python callable as its trace line (JSON); an exception it raises is
/// reported through `sys.unraisablehook` (the registry's work goes on).
fn python_sink(callback: Py<PyAny>) -> impl Fn(&Event) + Send + Sync {
    move |event: &Event| {
        let Ok(line) = serde_json::to_string(event) else { return };
        Python::with_gil(|py| {
            if let Err(e) = callback.bind(py).call1((line,)) {
                e.write_unraisable(py, Some(callback.bind(py)));
            }
        });
    }
}

fn state_name(state: ModelState) -> &'static str {
    match state {
        ModelState::Unloaded => "unloaded",
        ModelState::Loading => "loading",
        ModelState::Resident => "resident",
        ModelState::ReleasePending => "release_pending",
        ModelState::Released => "released",
        ModelState::Failed => "failed",
    }
}

/// The registry (see the module doc). Python's `StagedModels` is its face.
#[pyclass(module = "stageload_rs._native", frozen)]
pub struct Registry {
    models: StagedModels,
}

impl Registry {
    /// Runs `f` on the registry with the GIL released; its error raised as Python's.
    fn run<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&StagedModels) -> Result<T, StageError> + Send,
    ) -> PyResult<T> {
        py.allow_threads(|| f(&self.models)).map_err(|e| raise(py, e))
    }
}

/// Dropping the registry joins the prefetch threads, and one may be running a Python loader,
/// which needs the GIL: they are stopped with it released (held, the drop would wait forever).
impl Drop for Registry {
    fn drop(&mut self) {
        Python::with_gil(|py| self.stop_prefetches(py));
    }
}

/// How many times `get` asks again for a model released between its load and its lock (by
/// another thread entering a stage) before it says so.
const GET_TRIES: usize = 3;

#[pymethods]
impl Registry {
    #[new]
    #[pyo3(signature = (models, stages, *, pinned, preserve_rng, generators, events, meter, prefetch, host_tier, snapshots, strict, cache_host_blocks, map_large_host_blocks))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        models: Vec<ModelArgs>,
        stages: Vec<(String, Vec<String>)>,
        pinned: Vec<String>,
        preserve_rng: bool,
        generators: Option<Py<PyAny>>,
        events: Option<Py<PyAny>>,
        meter: Option<Py<Meter>>,
        prefetch: bool,
        host_tier: Option<u64>,
        snapshots: Option<PathBuf>,
        strict: bool,
        cache_host_blocks: bool,
        map_large_host_blocks: bool,
    ) -> PyResult<Self> {
        let mut builder = StagedModels::builder()
            .preserve_rng(preserve_rng)
            .prefetch_next(prefetch)
            .strict(strict)
            .cache_host_blocks(cache_host_blocks)
            .map_large_host_blocks(map_large_host_blocks);
        for model in models {
            builder = builder.model(model_spec(py, model)?);
        }
        for (stage, names) in stages {
            builder = builder.stage(stage, names);
        }
        for name in pinned {
            builder = builder.pin(name);
        }
        if let Some(generators) = generators {
            builder = builder.register_rng(Arc::new(PythonGenerators(generators)));
        }
        let mut sinks: Vec<Arc<dyn EventSink>> = Vec::new();
        if let Some(meter) = meter {
            sinks.push(meter.get().sink());
        }
        if let Some(events) = events {
            sinks.push(Arc::new(python_sink(events)));
        }
        if !sinks.is_empty() {
            builder = builder.events(Arc::new(move |event: &Event| sinks.iter().for_each(|sink| sink.emit(event))));
        }
        if let Some(bytes) = host_tier {
            builder = builder.host_tier(bytes);
        }
        if let Some(dir) = snapshots {
            builder = builder.snapshot_dir(dir);
        }
        let models = py.allow_threads(|| builder.build()).map_err(|e| raise(py, e))?;
        Ok(Registry { models })
    }

    /// The module `name`, loaded (or brought back) first if it is not resident.
    fn get(&self, py: Python<'_>, name: &str) -> PyResult<Py<PyAny>> {
        let mut tries = 0;
        loop {
            tries += 1;
            let called = py.allow_threads(|| {
                self.models.call(name, |model: &mut PyModel| Python::with_gil(|py| model.0.clone_ref(py)))
            });
            match called {
                Err(StageError::Released { .. }) if tries < GET_TRIES => continue,
                other => return other.map_err(|e| raise(py, e)),
            }
        }
    }

    fn load(&self, py: Python<'_>, name: &str) -> PyResult<()> {
        self.run(py, |m| m.load(name))
    }

    /// Enters `stage`; returns the bytes freed and kept (shared with a model still resident).
    fn enter(&self, py: Python<'_>, stage: &str) -> PyResult<()> {
        self.run(py, |m| m.enter(stage)).map(|_stats| ())
    }

    fn prefetch(&self, py: Python<'_>, stage: &str) -> PyResult<Vec<String>> {
        self.run(py, |m| m.prefetch(stage))
    }

    fn wait_prefetch(&self, py: Python<'_>, stage: &str) -> PyResult<()> {
        self.run(py, |m| m.wait_prefetch(stage))
    }

    fn prefetching(&self, py: Python<'_>) -> Vec<String> {
        py.allow_threads(|| self.models.prefetching())
    }

    /// Every model with its state, in definition order (never loads).
    fn states(&self, py: Python<'_>) -> Vec<(String, &'static str)> {
        py.allow_threads(|| self.models.states()).into_iter().map(|(n, s)| (n, state_name(s))).collect()
    }

    fn state(&self, py: Python<'_>, name: &str) -> PyResult<&'static str> {
        self.run(py, |m| m.state(name)).map(state_name)
    }

    fn resident(&self, py: Python<'_>) -> Vec<String> {
        py.allow_threads(|| self.models.resident())
    }

    fn resident_bytes(&self, py: Python<'_>) -> u64 {
        py.allow_threads(|| self.models.resident_bytes())
    }

    fn current_stage(&self, py: Python<'_>) -> Option<String> {
        py.allow_threads(|| self.models.current_stage())
    }

    fn stage_models(&self, py: Python<'_>, stage: &str) -> PyResult<Vec<String>> {
        self.run(py, |m| m.stage_models(stage))
    }

    fn pin(&self, py: Python<'_>, name: &str) -> PyResult<()> {
        self.run(py, |m| m.pin(name))
    }

    fn unpin(&self, py: Python<'_>, name: &str) {
        py.allow_threads(|| self.models.unpin(name))
    }

    fn mark(&self, py: Python<'_>, label: &str) {
        py.allow_threads(|| self.models.mark(label))
    }

    /// Cancels the prefetches not begun and waits for those running (their loaders run with the
    /// GIL this gives up meanwhile); none starts after.
    fn stop_prefetches(&self, py: Python<'_>) {
        py.allow_threads(|| self.models.stop_prefetches())
    }

    /// Releases every resident model and refuses loads from then on.
    fn close(&self, py: Python<'_>) {
        py.allow_threads(|| {
            self.models.close();
        })
    }

    /// Registers `module` under `name` with no loader (a model already there is released, its
    /// storage shared with `module` kept).
    fn insert(&self, py: Python<'_>, name: &str, module: Bound<'_, PyAny>) -> PyResult<()> {
        let built = built(module, name)?;
        self.run(py, |m| m.insert(name, built))
    }

    /// Releases `name` if resident and forgets it.
    fn remove(&self, py: Python<'_>, name: &str) -> PyResult<()> {
        self.run(py, |m| m.remove(name))
    }

    /// Hands `name` over (loaded first if it is not) and forgets it without releasing it.
    fn take(&self, py: Python<'_>, name: &str) -> PyResult<Py<PyAny>> {
        let handle = self.run(py, |m| m.take::<PyModel>(name))?;
        let module = py.allow_threads(|| {
            let guard = handle.lock()?;
            Ok(Python::with_gil(|py| guard.0.clone_ref(py)))
        });
        module.map_err(|e| raise(py, e))
    }

    fn names(&self, py: Python<'_>) -> Vec<String> {
        py.allow_threads(|| self.models.names())
    }

    fn __len__(&self, py: Python<'_>) -> usize {
        py.allow_threads(|| self.models.len())
    }

    fn __contains__(&self, py: Python<'_>, name: &str) -> bool {
        py.allow_threads(|| self.models.contains(name))
    }

    fn accept_changed_files(&self, py: Python<'_>, name: &str) -> PyResult<()> {
        self.run(py, |m| m.accept_changed_files(name))
    }

    /// The host tier's budget and the bytes its copies hold; `None` without a tier.
    fn host_tier(&self, py: Python<'_>) -> Option<(u64, u64)> {
        py.allow_threads(|| self.models.host_tier()).map(|t| (t.budget, t.used))
    }

    fn set_host_tier_budget(&self, py: Python<'_>, bytes: u64) -> PyResult<()> {
        self.run(py, |m| m.set_host_tier_budget(bytes))
    }

    /// How the last load of `name` met its checkpoint, as JSON (`None` before a load from one).
    fn load_report(&self, py: Python<'_>, name: &str) -> PyResult<Option<String>> {
        let report = self.run(py, |m| m.load_report(name))?;
        Ok(report.and_then(|r| serde_json::to_string(&r).ok()))
    }
}

/// Frees `module`'s parameters and buffers in place for good, leaving alone the storage it shares
/// with a module in `keep`: the registry's own release, by a registry of these modules alone
/// (`module` as `name`, the others pinned) entering `stage`. Returns the bytes freed and kept.
#[pyfunction]
#[pyo3(signature = (module, *, name, stage, keep))]
pub fn release_module(
    py: Python<'_>,
    module: Bound<'_, PyAny>,
    name: String,
    stage: Option<String>,
    keep: Vec<Bound<'_, PyAny>>,
) -> PyResult<(u64, u64)> {
    let target = built(module, &name)?;
    let keep: Vec<(String, Built)> = keep
        .into_iter()
        .enumerate()
        .map(|(i, module)| {
            let keeper = format!("{name} (kept #{i})");
            built(module, &keeper).map(|b| (keeper, b))
        })
        .collect::<PyResult<_>>()?;
    let events = Arc::new(ListSink::default());
    let released = py.allow_threads(|| {
        let mut builder = StagedModels::builder().events(events.clone());
        if let Some(stage) = &stage {
            builder = builder.stage(stage.clone(), Vec::<String>::new());
        }
        let registry = builder.build()?;
        registry.insert(&name, target)?;
        for (keeper, built) in keep {
            registry.insert(&keeper, built)?;
            registry.pin(&keeper)?;
        }
        match &stage {
            Some(stage) => registry.enter(stage).map(drop),
            None => registry.remove(&name),
        }
    });
    released.map_err(|e| raise(py, e))?;
    events
        .events()
        .iter()
        .find_map(|event| match &event.what {
            What::Release(release) if release.model == name => Some((release.bytes.unwrap_or(0), release.kept_bytes)),
            _ => None,
        })
        .ok_or_else(|| stage_error(py, format!("releasing '{name}' said nothing of what it freed")))
}
