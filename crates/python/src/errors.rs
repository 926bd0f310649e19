//! Errors both ways: a Python exception carried through the registry as a Rust error (a loader
//! that raised), and each registry error raised as the Python exception that names it
//! (`stageload_rs.errors`, where the classes live so Python code can catch and raise them).

use pyo3::call::PyCallArgs;
use pyo3::exceptions::PyKeyError;
use pyo3::prelude::*;
use stageload::StageError;

/// A Python exception on its way through the registry (a loader raised it, or its module could
/// not be read), given back as itself when the registry's error reaches Python.
#[derive(Debug)]
pub struct PythonError(pub PyErr);

impl std::fmt::Display for PythonError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(&self.0, f)
    }
}

impl std::error::Error for PythonError {}

/// An instance of `stageload_rs.errors.<class>` made with `args`.
fn error_of<'py>(py: Python<'py>, class: &str, args: impl PyCallArgs<'py>) -> PyErr {
    let made = py.import("stageload_rs.errors").and_then(|m| m.getattr(class)).and_then(|c| c.call1(args));
    match made {
        Ok(instance) => PyErr::from_value(instance),
        Err(import_failed) => import_failed,
    }
}

/// A `stageload_rs.errors.StageError` saying `message`.
pub fn stage_error(py: Python<'_>, message: String) -> PyErr {
    error_of(py, "StageError", (message,))
}

/// The Python exception for a registry error:
/// - an unknown model is a `KeyError` of its name, as a mapping's (an unknown stage a `KeyError`
///   saying which stages there are);
/// - a model released for good or asked for through a stale handle, `ReleasedModuleError`;
/// - a loader that raised, `LoaderError` naming the model, caused by what the loader raised (a
///   `KeyboardInterrupt` or `SystemExit` is raised again as itself);
/// - a file changed since the model's first load, `SourceChangedError` (its `model`, `path` and
///   `change`); one written in place under a resident model that maps it,
///   `ChangedUnderModelError` (a `SourceChangedError` too);
/// - anything else, `StageError` with the registry's sentence.
pub fn raise(py: Python<'_>, error: StageError) -> PyErr {
    match error {
        StageError::UnknownModel { name, .. } => PyKeyError::new_err(name),
        StageError::UnknownStage { .. } => PyKeyError::new_err(error.to_string()),
        StageError::Released { model, stage } | StageError::NoLoader { model, stage } => {
            error_of(py, "ReleasedModuleError", (model, stage))
        }
        StageError::LoaderFailed { model, source } => match source.downcast::<PythonError>() {
            Ok(raised) => {
                let raised = raised.0;
                if !raised.is_instance_of::<pyo3::exceptions::PyException>(py) {
                    return raised;
                }
                let message = format!("the loader of '{model}' raised {raised}");
                let error = error_of(py, "LoaderError", (message, model));
                error.set_cause(py, Some(raised));
                error
            }
            Err(other) => error_of(py, "LoaderError", (format!("the loader of '{model}' failed: {other}"), model)),
        },
        StageError::LoaderPanicked { ref model, .. } => {
            let model = model.clone();
            error_of(py, "LoaderError", (error.to_string(), model))
        }
        StageError::SourceChanged(changed) => error_of(
            py,
            "SourceChangedError",
            (changed.to_string(), changed.model.clone(), changed.path.clone(), changed.change.to_string()),
        ),
        StageError::ChangedUnderModel { ref source } => error_of(
            py,
            "ChangedUnderModelError",
            (error.to_string(), source.model.clone(), source.path.clone(), source.change.to_string()),
        ),
        other => stage_error(py, other.to_string()),
    }
}
