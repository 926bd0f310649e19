//! `stageload_rs._native`: the Rust registry (`stageload::StagedModels`) serving Python's torch
//! modules. A Python loader builds an `nn.Module`; its parameters and buffers go to the registry
//! as the model's tensors, shared in place with Python's torch (pyo3-tch: one libtorch per
//! process, the same `TensorImpl`s), so a release frees the module's storages where they are and
//! a reload refills them there, while Python keeps the same module and `Parameter` objects.
//!
//! Python's face over this (`python/stageload_rs/`: the original's mapping API, `on_call`,
//! `share`, events, the released-module error) holds no state of its own beyond what it hands
//! out; every decision is the registry's.
//!
//! Threads: every call into the registry runs with the GIL released, and everything the registry
//! calls back (a loader, the event sink, Python's generators) takes the GIL for itself, so no
//! thread waits on a registry lock while holding the GIL.

mod checkpoint;
mod errors;
mod meter;
mod registry;

use pyo3::prelude::*;

#[pymodule]
#[pyo3(name = "_native")]
fn native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<registry::Registry>()?;
    m.add_class::<meter::Meter>()?;
    m.add_function(wrap_pyfunction!(registry::release_module, m)?)?;
    m.add_function(wrap_pyfunction!(meter::summarize_trace, m)?)?;
    m.add_function(wrap_pyfunction!(checkpoint::checkpoint_dtypes, m)?)?;
    Ok(())
}
