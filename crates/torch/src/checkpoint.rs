//! Checkpoint I/O: safetensors files memory-mapped and copied once, straight into the storage of
//! the tensors that receive them.
//!
//! `tch::nn::VarStore::load` reads the whole file into a `Vec`, builds a tensor per entry and then
//! copies it into the variable: two transient copies of the model. Here the file is mapped, each
//! entry is viewed in place as a CPU tensor and copied (with dtype conversion where needed) into
//! its target, so the only extra memory is the page cache of the mapping.
//!
//! Every check happens before the first byte is copied: each target has an entry, shapes match,
//! dtypes convert, targets have storage. A failed check leaves every target as it was.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use tch::{Device, Kind, Tensor};

/// Why a checkpoint could not be read or loaded. Each variant names the file and the tensor.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("cannot open checkpoint {path}: {source}")]
    Open { path: PathBuf, source: std::io::Error },
    #[error("checkpoint {path} is not a valid safetensors file ({reason}); it may be truncated or corrupt: write it again")]
    Invalid { path: PathBuf, reason: String },
    #[error("tensor '{tensor}' in {path} has dtype {dtype}, which stageload does not load")]
    UnsupportedDtype { path: PathBuf, tensor: String, dtype: String },
    #[error("tensor '{tensor}' is in two checkpoint files: {first} and {second}")]
    DuplicateTensor { tensor: String, first: PathBuf, second: PathBuf },
    #[error("the model's tensor(s) {} are in none of the checkpoint files {}", quoted(tensors), paths(files))]
    Missing { tensors: Vec<String>, files: Vec<PathBuf> },
    #[error("tensor '{tensor}': the model expects shape {expected:?}, {path} has {found:?}")]
    Shape { tensor: String, path: PathBuf, expected: Vec<i64>, found: Vec<i64> },
    #[error("tensor '{tensor}': the model expects {expected:?}, {path} has {found:?}, which does not convert without loss")]
    Dtype { tensor: String, path: PathBuf, expected: Kind, found: Kind },
    #[error("tensor '{tensor}' has no storage to load into (released and not reallocated)")]
    Unallocated { tensor: String },
    #[error("copying tensor '{tensor}' from {path} failed: {source}")]
    Copy { tensor: String, path: PathBuf, source: tch::TchError },
}

fn quoted(names: &[String]) -> String {
    names.iter().map(|n| format!("'{n}'")).collect::<Vec<_>>().join(", ")
}

fn paths(files: &[PathBuf]) -> String {
    files.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
}

/// The tch kind of a safetensors dtype, for the dtypes libtorch has.
pub fn kind_of(dtype: Dtype) -> Option<Kind> {
    Some(match dtype {
        Dtype::BOOL => Kind::Bool,
        Dtype::U8 => Kind::Uint8,
        Dtype::I8 => Kind::Int8,
        Dtype::I16 => Kind::Int16,
        Dtype::I32 => Kind::Int,
        Dtype::I64 => Kind::Int64,
        Dtype::F16 => Kind::Half,
        Dtype::BF16 => Kind::BFloat16,
        Dtype::F32 => Kind::Float,
        Dtype::F64 => Kind::Double,
        _ => return None,
    })
}

/// The safetensors dtype of a tch kind.
pub fn dtype_of(kind: Kind) -> Option<Dtype> {
    Some(match kind {
        Kind::Bool => Dtype::BOOL,
        Kind::Uint8 => Dtype::U8,
        Kind::Int8 => Dtype::I8,
        Kind::Int16 => Dtype::I16,
        Kind::Int => Dtype::I32,
        Kind::Int64 => Dtype::I64,
        Kind::Half => Dtype::F16,
        Kind::BFloat16 => Dtype::BF16,
        Kind::Float => Dtype::F32,
        Kind::Double => Dtype::F64,
        _ => return None,
    })
}

fn is_float(kind: Kind) -> bool {
    matches!(kind, Kind::Half | Kind::BFloat16 | Kind::Float | Kind::Double)
}

/// Whether a checkpoint entry of kind `from` may be loaded into a tensor of kind `to`: any float
/// to any float (precision is the model's choice), integers to integers or floats, bool to bool.
pub fn converts(from: Kind, to: Kind) -> bool {
    from == to
        || (is_float(from) && is_float(to))
        || (!is_float(from) && from != Kind::Bool && to != Kind::Bool)
}

/// One tensor of a checkpoint: where it lives and what it is.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    /// Index of its file in [`Checkpoint::files`].
    pub file: usize,
    pub kind: Kind,
    pub shape: Vec<i64>,
    /// Byte range inside the mapped file.
    pub start: usize,
    pub end: usize,
}

/// What a load did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LoadReport {
    /// Bytes copied into the targets (in the targets' dtypes).
    pub bytes: u64,
    /// Tensors loaded.
    pub tensors: usize,
    /// Entries of the files that no target asked for (reported, not an error).
    pub unused: Vec<String>,
}

/// Bytes done out of the total, for progress bars.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    pub done: u64,
    pub total: u64,
}

/// One or several safetensors files, mapped, with their headers checked and indexed.
pub struct Checkpoint {
    files: Vec<PathBuf>,
    maps: Vec<Mmap>,
    entries: HashMap<String, Entry>,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint").field("files", &self.files).field("tensors", &self.entries.len()).finish()
    }
}

impl Checkpoint {
    /// Maps every file and checks its header: valid JSON, offsets inside the file and covering
    /// its data, supported dtypes, no tensor name in two files.
    pub fn open<P: AsRef<Path>>(files: &[P]) -> Result<Self, CheckpointError> {
        let mut checkpoint = Checkpoint { files: Vec::new(), maps: Vec::new(), entries: HashMap::new() };
        for path in files {
            let path = path.as_ref().to_path_buf();
            let file = std::fs::File::open(&path).map_err(|source| CheckpointError::Open { path: path.clone(), source })?;
            // `populate` faults the pages in at once (a page-cache read), far cheaper than one
            // fault per 4 KiB page during the copies.
            // SAFETY: the mapping is read-only and private to this process. Like every
            // memory-mapped reader we rely on the file not being truncated while it is mapped.
            let map = unsafe { memmap2::MmapOptions::new().populate().map(&file) }.map_err(|source| CheckpointError::Open { path: path.clone(), source })?;
            let index = checkpoint.files.len();
            {
                let parsed = SafeTensors::deserialize(&map)
                    .map_err(|e| CheckpointError::Invalid { path: path.clone(), reason: e.to_string() })?;
                for (name, view) in parsed.tensors() {
                    let kind = kind_of(view.dtype()).ok_or_else(|| CheckpointError::UnsupportedDtype {
                        path: path.clone(),
                        tensor: name.clone(),
                        dtype: format!("{:?}", view.dtype()),
                    })?;
                    let start = view.data().as_ptr() as usize - map.as_ptr() as usize;
                    let entry = Entry {
                        file: index,
                        kind,
                        shape: view.shape().iter().map(|&d| d as i64).collect(),
                        start,
                        end: start + view.data().len(),
                    };
                    if let Some(previous) = checkpoint.entries.insert(name.clone(), entry) {
                        return Err(CheckpointError::DuplicateTensor {
                            tensor: name,
                            first: checkpoint.files[previous.file].clone(),
                            second: path,
                        });
                    }
                }
            }
            checkpoint.files.push(path);
            checkpoint.maps.push(map);
        }
        Ok(checkpoint)
    }

    /// The files, in the order given.
    pub fn files(&self) -> &[PathBuf] {
        &self.files
    }

    /// Every entry by name.
    pub fn entries(&self) -> &HashMap<String, Entry> {
        &self.entries
    }

    /// Checks `targets` against the files without copying anything; returns the entries to
    /// copy, in the targets' order.
    fn check<'a>(&'a self, targets: &[(String, Tensor)]) -> Result<Vec<&'a Entry>, CheckpointError> {
        let missing: Vec<String> =
            targets.iter().filter(|(name, _)| !self.entries.contains_key(name)).map(|(n, _)| n.clone()).collect();
        if !missing.is_empty() {
            return Err(CheckpointError::Missing { tensors: missing, files: self.files.clone() });
        }
        let mut plan = Vec::with_capacity(targets.len());
        for (name, target) in targets {
            let entry = &self.entries[name];
            let path = &self.files[entry.file];
            let expected = target.size();
            if expected != entry.shape {
                return Err(CheckpointError::Shape {
                    tensor: name.clone(),
                    path: path.clone(),
                    expected,
                    found: entry.shape.clone(),
                });
            }
            if !converts(entry.kind, target.kind()) {
                return Err(CheckpointError::Dtype {
                    tensor: name.clone(),
                    path: path.clone(),
                    expected: target.kind(),
                    found: entry.kind,
                });
            }
            let allocated = stageload_torch_sys::storage_info(target).is_ok_and(|i| i.allocated);
            if target.numel() > 0 && !allocated {
                return Err(CheckpointError::Unallocated { tensor: name.clone() });
            }
            plan.push(entry);
        }
        Ok(plan)
    }

    /// Copies the entry of each target's name into it, converting dtypes where they differ.
    /// Everything is checked first; on a check failure no target has changed.
    pub fn load_into(
        &self,
        targets: &[(String, Tensor)],
        mut progress: impl FnMut(Progress),
    ) -> Result<LoadReport, CheckpointError> {
        let plan = self.check(targets)?;
        let total: u64 = targets.iter().map(|(_, t)| (t.numel() * t.kind().elt_size_in_bytes()) as u64).sum();
        let mut report = LoadReport::default();
        tch::no_grad(|| -> Result<(), CheckpointError> {
            for ((name, target), entry) in targets.iter().zip(plan) {
                let bytes = &self.maps[entry.file][entry.start..entry.end];
                let strides = contiguous_strides(&entry.shape);
                // SAFETY: `bytes` covers exactly numel × element size of `entry.kind` (checked by
                // safetensors at open) and outlives `source`, which is dropped at the end of
                // this iteration; libtorch only reads through it (it is the source of copy_).
                let source = unsafe { Tensor::f_from_blob(bytes.as_ptr(), &entry.shape, &strides, entry.kind, Device::Cpu) }
                    .map_err(|source| self.copy_error(name, entry, source))?;
                let mut destination = target.shallow_clone();
                destination.f_copy_(&source).map_err(|source| self.copy_error(name, entry, source))?;
                let copied = (target.numel() * target.kind().elt_size_in_bytes()) as u64;
                report.bytes += copied;
                report.tensors += 1;
                progress(Progress { done: report.bytes, total });
            }
            Ok(())
        })?;
        let wanted: std::collections::HashSet<&str> = targets.iter().map(|(n, _)| n.as_str()).collect();
        report.unused = self.entries.keys().filter(|n| !wanted.contains(n.as_str())).cloned().collect();
        report.unused.sort();
        Ok(report)
    }

    fn copy_error(&self, name: &str, entry: &Entry, source: tch::TchError) -> CheckpointError {
        CheckpointError::Copy { tensor: name.to_string(), path: self.files[entry.file].clone(), source }
    }
}

fn contiguous_strides(shape: &[i64]) -> Vec<i64> {
    let mut strides = vec![1i64; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1].max(1);
    }
    strides
}

/// Writes named tensors to a safetensors file (CPU copies, contiguous), e.g. a model's
/// variables. Used by the examples and tests to make real checkpoints.
pub fn save<P: AsRef<Path>>(tensors: &[(String, Tensor)], path: P) -> Result<(), CheckpointError> {
    let path = path.as_ref();
    let invalid = |reason: String| CheckpointError::Invalid { path: path.to_path_buf(), reason };
    let mut owned = Vec::with_capacity(tensors.len());
    for (name, tensor) in tensors {
        let cpu = tensor.to_device(Device::Cpu).contiguous();
        let dtype = dtype_of(cpu.kind()).ok_or_else(|| invalid(format!("tensor '{name}' has unsupported kind {:?}", cpu.kind())))?;
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
    safetensors::serialize_to_file(views, None, &tmp).map_err(|e| invalid(e.to_string()))?;
    std::fs::rename(&tmp, path).map_err(|source| CheckpointError::Open { path: path.to_path_buf(), source })
}
