//! A checkpoint's header read for Python: what `staged_pipeline` needs of a component's files
//! before its first load (each tensor's dtype), by the core's reader, which checks the header as
//! it does for a load (a length field bounded by the file, offsets inside it, known dtypes).

use std::collections::HashMap;
use std::path::PathBuf;

use pyo3::prelude::*;
use stageload::checkpoint::Checkpoint;
use tch::Kind;

use crate::errors::stage_error;

/// Torch's name of a kind a checkpoint's entry can have (`torch.<name>` is its dtype).
fn torch_name(kind: Kind) -> Option<&'static str> {
    Some(match kind {
        Kind::Bool => "bool",
        Kind::Uint8 => "uint8",
        Kind::Int8 => "int8",
        Kind::Int16 => "int16",
        Kind::Int => "int32",
        Kind::Int64 => "int64",
        Kind::Half => "float16",
        Kind::BFloat16 => "bfloat16",
        Kind::Float => "float32",
        Kind::Double => "float64",
        _ => return None,
    })
}

/// The dtype of each tensor of the safetensors `files` (one checkpoint), by name, as torch's
/// name for it; a file that cannot be read or has a tensor of a dtype the core does not load is
/// a `StageError` naming the file (and the tensor).
#[pyfunction]
pub fn checkpoint_dtypes(py: Python<'_>, files: Vec<PathBuf>) -> PyResult<HashMap<String, &'static str>> {
    let checkpoint = py.allow_threads(|| Checkpoint::open(&files)).map_err(|e| stage_error(py, e.to_string()))?;
    checkpoint
        .entries()
        .iter()
        .map(|(name, entry)| match torch_name(entry.kind) {
            Some(dtype) => Ok((name.clone(), dtype)),
            None => Err(stage_error(
                py,
                format!("tensor '{name}' of {files:?}: kind {:?} has no torch name here", entry.kind),
            )),
        })
        .collect()
}
