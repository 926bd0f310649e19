//! Writing named tensors to a safetensors file: how the examples and tests make real checkpoints.

use std::collections::HashMap;
use std::path::Path;

use tch::{Device, Tensor};

use super::{dtype_of, CheckpointError};

/// Writes named tensors to a safetensors file (CPU copies, contiguous), e.g. a model's
/// variables. Used by the examples and tests to make real checkpoints.
pub fn save<P: AsRef<Path>>(tensors: &[(String, Tensor)], path: P) -> Result<(), CheckpointError> {
    save_with_metadata(tensors, None, path)
}

/// [`save`], with the file's string metadata (`__metadata__`).
pub fn save_with_metadata<P: AsRef<Path>>(
    tensors: &[(String, Tensor)],
    metadata: Option<HashMap<String, String>>,
    path: P,
) -> Result<(), CheckpointError> {
    let path = path.as_ref();
    let invalid = |reason: String| CheckpointError::Invalid { path: path.to_path_buf(), reason };
    let mut owned = Vec::with_capacity(tensors.len());
    for (name, tensor) in tensors {
        let cpu = tensor.to_device(Device::Cpu).contiguous();
        let dtype = dtype_of(cpu.kind())
            .ok_or_else(|| invalid(format!("tensor '{name}' has unsupported kind {:?}", cpu.kind())))?;
        let mut bytes = vec![0u8; cpu.numel() * cpu.kind().elt_size_in_bytes()];
        cpu.f_copy_data_u8(&mut bytes, cpu.numel()).map_err(|e| invalid(format!("reading tensor '{name}': {e}")))?;
        let shape: Vec<usize> = cpu.size().iter().map(|&d| d as usize).collect();
        owned.push((name.clone(), dtype, shape, bytes));
    }
    let views = owned
        .iter()
        .map(|(name, dtype, shape, bytes)| {
            safetensors::tensor::TensorView::new(*dtype, shape.clone(), bytes).map(|v| (name.clone(), v))
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| invalid(e.to_string()))?;
    let tmp = path.with_extension("safetensors.partial");
    safetensors::serialize_to_file(views, metadata, &tmp).map_err(|e| invalid(e.to_string()))?;
    std::fs::rename(&tmp, path).map_err(|source| CheckpointError::Write { path: path.to_path_buf(), source })
}
