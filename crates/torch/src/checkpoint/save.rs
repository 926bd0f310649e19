//! Writing named tensors to a safetensors file: how the examples and tests make real checkpoints.

use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::HashMap;
use std::path::Path;

use tch::{Device, Tensor};

use super::{dtype_of, CheckpointError, SaveFailure};

/// Writes named tensors to a safetensors file (CPU copies, contiguous), e.g. a model's
/// variables. Each tensor's bytes are made as the file reaches it and dropped once written, so
/// a save holds at most one tensor's copy beside the tensors (a release that snapshots a model
/// does not double it). Written under a temporary name and renamed: the file is always whole.
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
    let invalid = |reason: SaveFailure| CheckpointError::Save { path: path.to_path_buf(), reason };
    let failed = RefCell::new(None);
    let mut views = Vec::with_capacity(tensors.len());
    for (name, tensor) in tensors {
        let dtype = dtype_of(tensor.kind())
            .ok_or_else(|| invalid(SaveFailure::UnsupportedKind { tensor: name.clone(), kind: tensor.kind() }))?;
        let shape = tensor.size().iter().map(|&d| d as usize).collect();
        views.push((name.clone(), Lazy { name, tensor, dtype, shape, failed: &failed }));
    }
    let tmp = path.with_extension("safetensors.partial");
    let written = safetensors::serialize_to_file(views, metadata, &tmp).map_err(|e| invalid(SaveFailure::Writer(e)));
    let written = match failed.into_inner() {
        Some(reason) => Err(invalid(reason)),
        None => written,
    };
    if let Err(err) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(err);
    }
    std::fs::rename(&tmp, path).map_err(|source| CheckpointError::Write { path: path.to_path_buf(), source })
}

/// A tensor whose bytes are read when the writer reaches it. A read that fails (a device copy)
/// gives zeros of the right length and leaves its reason in `failed`: the save then fails and
/// removes the file.
struct Lazy<'a> {
    name: &'a str,
    tensor: &'a Tensor,
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    failed: &'a RefCell<Option<SaveFailure>>,
}

impl safetensors::View for Lazy<'_> {
    fn dtype(&self) -> safetensors::Dtype {
        self.dtype
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        let mut bytes = vec![0u8; self.data_len()];
        let read = self
            .tensor
            .f_to_device(Device::Cpu)
            .and_then(|cpu| cpu.f_contiguous())
            .and_then(|cpu| cpu.f_copy_data_u8(&mut bytes, cpu.numel()));
        if let Err(e) = read {
            self.failed.borrow_mut().get_or_insert(SaveFailure::Read { tensor: self.name.to_string(), source: e });
        }
        Cow::Owned(bytes)
    }

    fn data_len(&self) -> usize {
        self.tensor.numel() * self.tensor.kind().elt_size_in_bytes()
    }
}
