//! Checkpoint I/O: safetensors files read once, straight into the storage of the tensors that
//! receive them.
//!
//! `tch::nn::VarStore::load` reads the whole file into a `Vec`, builds a tensor per entry and then
//! copies it into the variable: two transient copies of the model. Here only the headers are read
//! at open; at load, an entry whose target is a contiguous CPU tensor of the same dtype is read
//! with `pread` directly into the target's memory: no copy, no mapping, and the process's RSS
//! grows by the model alone (a mapped file's pages would count in RSS while mapped). Entries that
//! need a dtype conversion or go to a GPU pass through a buffer of one entry, converted by
//! libtorch's `copy_`.
//!
//! Every check happens before the first byte is read: each target has an entry, shapes match,
//! dtypes convert, targets have storage, the files are as long as their headers say. A failed
//! check leaves every target as it was.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use safetensors::Dtype;
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
    #[error("reading tensor '{tensor}' from {path} failed: {source}")]
    Read { tensor: String, path: PathBuf, source: std::io::Error },
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
    /// Byte range inside the file.
    pub start: u64,
    pub end: u64,
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

/// One or several safetensors files, open, with their headers checked and indexed.
pub struct Checkpoint {
    files: Vec<PathBuf>,
    handles: Vec<File>,
    entries: HashMap<String, Entry>,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint").field("files", &self.files).field("tensors", &self.entries.len()).finish()
    }
}

impl Checkpoint {
    /// Opens every file and checks its header: valid JSON, offsets inside the file and covering
    /// its data, supported dtypes, no tensor name in two files.
    pub fn open<P: AsRef<Path>>(files: &[P]) -> Result<Self, CheckpointError> {
        let mut checkpoint = Checkpoint { files: Vec::new(), handles: Vec::new(), entries: HashMap::new() };
        for path in files {
            let path = path.as_ref().to_path_buf();
            let mut file = File::open(&path).map_err(|source| CheckpointError::Open { path: path.clone(), source })?;
            let stageload_plan::header::Header { data_start, metadata } = stageload_plan::header::read_header(&mut file)
                .map_err(|reason| CheckpointError::Invalid { path: path.clone(), reason })?;
            let index = checkpoint.files.len();
            for (name, info) in metadata.tensors() {
                let kind = kind_of(info.dtype).ok_or_else(|| CheckpointError::UnsupportedDtype {
                    path: path.clone(),
                    tensor: name.clone(),
                    dtype: format!("{:?}", info.dtype),
                })?;
                let entry = Entry {
                    file: index,
                    kind,
                    shape: info.shape.iter().map(|&d| d as i64).collect(),
                    start: data_start + info.data_offsets.0 as u64,
                    end: data_start + info.data_offsets.1 as u64,
                };
                if let Some(previous) = checkpoint.entries.insert(name.clone(), entry) {
                    return Err(CheckpointError::DuplicateTensor {
                        tensor: name,
                        first: checkpoint.files[previous.file].clone(),
                        second: path,
                    });
                }
            }
            checkpoint.files.push(path);
            checkpoint.handles.push(file);
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
        let mut buffer: Vec<u8> = Vec::new();
        tch::no_grad(|| -> Result<(), CheckpointError> {
            for ((name, target), entry) in targets.iter().zip(plan) {
                let length = (entry.end - entry.start) as usize;
                let file = &self.handles[entry.file];
                let read_error = |source| CheckpointError::Read { tensor: name.clone(), path: self.files[entry.file].clone(), source };
                if length > 0 && target.device() == Device::Cpu && target.kind() == entry.kind && target.is_contiguous() {
                    // The target is an allocated (checked), contiguous CPU tensor of the entry's
                    // kind and shape (checked): its memory is exactly `length` bytes at data_ptr.
                    // SAFETY: that memory is valid for writes of `length` bytes; no Rust reference
                    // to it exists and nothing else touches it while it is being loaded.
                    let memory = unsafe { std::slice::from_raw_parts_mut(target.data_ptr() as *mut u8, length) };
                    read_parallel(file, entry.start, memory).map_err(read_error)?;
                } else if length > 0 {
                    buffer.resize(length, 0);
                    read_parallel(file, entry.start, &mut buffer).map_err(read_error)?;
                    let strides = contiguous_strides(&entry.shape);
                    // SAFETY: `buffer` holds exactly numel × element size of `entry.kind` and
                    // outlives `source`, dropped at the end of this block; libtorch only reads
                    // through it (it is the source of copy_).
                    let source = unsafe { Tensor::f_from_blob(buffer.as_ptr(), &entry.shape, &strides, entry.kind, Device::Cpu) }
                        .map_err(|source| self.copy_error(name, entry, source))?;
                    let mut destination = target.shallow_clone();
                    destination.f_copy_(&source).map_err(|source| self.copy_error(name, entry, source))?;
                }
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

/// Reads `memory.len()` bytes at `offset`, split over the CPUs for large reads: a single thread
/// copies from the page cache at about 5 GB/s here, two at about 8.
fn read_parallel(file: &File, offset: u64, memory: &mut [u8]) -> std::io::Result<()> {
    const SPLIT_ABOVE: usize = 8 << 20;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(8);
    if memory.len() <= SPLIT_ABOVE || threads == 1 {
        return file.read_exact_at(memory, offset);
    }
    let part = memory.len().div_ceil(threads).next_multiple_of(4096);
    std::thread::scope(|scope| {
        let readers: Vec<_> = memory
            .chunks_mut(part)
            .enumerate()
            .map(|(i, chunk)| scope.spawn(move || file.read_exact_at(chunk, offset + (i * part) as u64)))
            .collect();
        readers.into_iter().try_for_each(|reader| reader.join().unwrap_or_else(|_| Err(std::io::Error::other("a reader thread panicked"))))
    })
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
