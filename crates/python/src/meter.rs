//! `Meter`: the project's trace meter (`stageload::meter`), which Python's `MemoryMeter` wraps.
//! Its trace is the one `stageload summary`, `plot` and `plan --from-trace` read; a registry
//! given it writes its events there without a trip through Python.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use pyo3::prelude::*;
use stageload::meter::{self, MeterOptions};
use stageload::EventSink;

use crate::errors::stage_error;

/// A running meter: samples the process's memory into its trace every `interval` seconds, and
/// writes every event and mark given it.
#[pyclass(module = "stageload_rs._native", frozen)]
pub struct Meter {
    inner: Arc<meter::Meter>,
}

impl Meter {
    /// The meter as a registry's event sink.
    pub fn sink(&self) -> Arc<dyn EventSink> {
        self.inner.clone()
    }
}

#[pymethods]
impl Meter {
    /// Starts metering into `path` (created or truncated); `meta` (a JSON object) goes into the
    /// trace's header.
    #[new]
    #[pyo3(signature = (path, *, interval, device, meta))]
    fn new(py: Python<'_>, path: PathBuf, interval: f64, device: &str, meta: &str) -> PyResult<Self> {
        let Some(device) = stageload::device::from_name(device) else {
            return Err(stage_error(py, format!("MemoryMeter: unknown device {device:?} (cpu, cuda:N or mps)")));
        };
        if !(interval.is_finite() && interval > 0.0) {
            return Err(stage_error(
                py,
                format!("MemoryMeter: interval must be a positive number of seconds, not {interval}"),
            ));
        }
        let meta: serde_json::Map<String, serde_json::Value> = serde_json::from_str(meta)
            .map_err(|e| stage_error(py, format!("MemoryMeter: meta is not a JSON object: {e}")))?;
        let options = meta
            .into_iter()
            .fold(MeterOptions::default().interval(Duration::from_secs_f64(interval)), |o, (k, v)| o.meta(k, v));
        let started = py.allow_threads(|| meter::start(&path, device, options));
        let inner = started
            .map_err(|e| stage_error(py, format!("MemoryMeter: cannot write the trace {}: {e}", path.display())))?;
        Ok(Meter { inner: Arc::new(inner) })
    }

    /// Writes an event given as a trace line (JSON of the project's schema; its time is now).
    fn emit_line(&self, py: Python<'_>, line: &str) -> PyResult<()> {
        let event: stageload::Event = serde_json::from_str(line)
            .map_err(|e| stage_error(py, format!("MemoryMeter: {line} is not an event of the trace schema: {e}")))?;
        py.allow_threads(|| self.inner.emit(&event));
        Ok(())
    }

    /// Writes a `mark` event with `label`.
    fn mark(&self, py: Python<'_>, label: &str) {
        py.allow_threads(|| self.inner.mark(label))
    }

    /// Takes a sample now.
    fn sample(&self, py: Python<'_>) {
        py.allow_threads(|| self.inner.sample())
    }

    /// Stops sampling and closes the trace with a last sample.
    fn finish(&self, py: Python<'_>) {
        py.allow_threads(|| self.inner.finish())
    }
}

/// What `stageload summary` says of the trace at `path`, as JSON.
#[pyfunction]
pub fn summarize_trace(py: Python<'_>, path: PathBuf) -> PyResult<String> {
    let trace = py
        .allow_threads(|| meter::read_trace(&path))
        .map_err(|e| stage_error(py, format!("cannot read the trace {}: {e}", path.display())))?;
    serde_json::to_string(&meter::summarize(&trace)).map_err(|e| stage_error(py, e.to_string()))
}
