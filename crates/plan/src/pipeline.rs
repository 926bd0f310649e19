//! The pipeline description file: models with their checkpoints, the stages in order, pinned
//! models, working memory. The same file feeds `stageload plan` and `StagedModels`, so the plan
//! that was checked is the plan that runs.
//!
//! ```toml
//! pinned = ["backbone"]
//!
//! [[models]]
//! name = "backbone"
//! files = ["weights/backbone.safetensors"]   # relative to this file's folder
//! device = "cpu"                             # cpu (default), cuda, cuda:N, mps
//!
//! [[models]]
//! name = "denoiser"
//! files = ["weights/denoiser-1.safetensors", "weights/denoiser-2.safetensors"]
//! dtype = "bf16"                             # loaded as (default: as stored)
//!
//! [[stages]]
//! name = "denoise"
//! models = ["backbone", "denoiser"]
//! working = "2G"                             # activations etc. beyond the weights (host)
//! device_working = "4G"                      # the same on the GPU
//! ```

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use stageload_units::parse_size;
use thiserror::Error;

/// Why a pipeline file or one of its checkpoints cannot be planned.
#[derive(Debug, Error)]
pub enum PipelineError {
    #[error("cannot read pipeline file {path}: {message}")]
    Read { path: PathBuf, message: String },
    #[error("pipeline file {path} is not valid: {message}")]
    Syntax { path: PathBuf, message: String },
    #[error("pipeline file {path}: {message}")]
    Invalid { path: PathBuf, message: String },
    #[error("model '{model}': cannot read checkpoint {file}: {message}")]
    Checkpoint { model: String, file: PathBuf, message: String },
}

/// A model as the file describes it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelEntry {
    pub name: String,
    /// Safetensors files, relative to the pipeline file's folder unless absolute.
    pub files: Vec<PathBuf>,
    /// `cpu` (default), `cuda`, `cuda:N` or `mps`.
    #[serde(default = "cpu")]
    pub device: String,
    /// The dtype the model is loaded as (`f16`, `bf16`, `f32`, ...); default: as stored.
    #[serde(default)]
    pub dtype: Option<String>,
}

fn cpu() -> String {
    "cpu".to_string()
}

/// A stage as the file describes it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StageEntry {
    pub name: String,
    #[serde(default)]
    pub models: Vec<String>,
    /// Host memory the stage needs beyond its weights (a size: `2G`).
    #[serde(default)]
    pub working: Option<String>,
    /// Device memory the stage needs beyond its weights.
    #[serde(default)]
    pub device_working: Option<String>,
}

/// The file itself, before any check: what [`Pipeline::load`] parses, and what a program that
/// describes its own pipeline serializes (`toml::to_string`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PipelineFile {
    #[serde(default)]
    pub pinned: Vec<String>,
    #[serde(default)]
    pub models: Vec<ModelEntry>,
    #[serde(default)]
    pub stages: Vec<StageEntry>,
}

/// Where a model's weights live while it is resident.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Placement {
    Host,
    Device,
}

/// One checkpoint file of a model and what it holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Part {
    pub file: PathBuf,
    /// Bytes resident once loaded (in the model's `dtype` when given, else as stored).
    pub bytes: u64,
    /// Bytes read from disk to load it.
    pub file_bytes: u64,
}

/// A checked model: its files resolved and its size read from their headers. A file that several
/// models list (a shared backbone) is held once while any of them is resident, and read once.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Model {
    pub name: String,
    pub files: Vec<PathBuf>,
    pub device: String,
    pub placement: Placement,
    pub dtype: Option<String>,
    /// Tensors over all files.
    pub tensors: usize,
    /// Bytes resident once loaded (in `dtype` when given, else as stored).
    pub bytes: u64,
    /// Bytes read from disk per load (the tensors' data as stored).
    pub file_bytes: u64,
    /// The same, file by file.
    pub parts: Vec<Part>,
}

/// A checked stage.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Stage {
    pub name: String,
    pub models: Vec<String>,
    pub working: u64,
    pub device_working: u64,
}

/// A checked pipeline: every name resolved, every checkpoint header read.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Pipeline {
    pub path: PathBuf,
    pub models: Vec<Model>,
    pub stages: Vec<Stage>,
    pub pinned: Vec<String>,
}

impl Pipeline {
    pub fn model(&self, name: &str) -> Option<&Model> {
        self.models.iter().find(|m| m.name == name)
    }
}

/// Bits per element of a dtype name as users write it (`f16`, `bfloat16`, `F32`, `int8`, ...).
pub fn dtype_bits(name: &str) -> Option<usize> {
    let bits = match name.to_ascii_lowercase().as_str() {
        "bool" | "u8" | "uint8" | "i8" | "int8" | "f8_e4m3" | "f8_e5m2" => 8,
        "f16" | "float16" | "half" | "bf16" | "bfloat16" | "i16" | "int16" | "u16" | "uint16" => 16,
        "f32" | "float32" | "float" | "i32" | "int32" | "u32" | "uint32" => 32,
        "f64" | "float64" | "double" | "i64" | "int64" | "long" | "u64" | "uint64" => 64,
        _ => return None,
    };
    Some(bits)
}

/// The largest pipeline file read: far more than any real description, far less than a device
/// read forever.
pub const MAX_PIPELINE_FILE: u64 = 16 << 20;

/// Sums sizes without wrapping: an absurd size saturates at `u64::MAX`, which fits nowhere.
pub fn total(sizes: impl IntoIterator<Item = u64>) -> u64 {
    sizes.into_iter().fold(0, u64::saturating_add)
}

/// One checkpoint's header: (tensors, bytes of data as stored, element counts).
fn read_header(path: &Path) -> Result<(usize, u64, u64), String> {
    let mut file = stageload_input::open_regular(path).map_err(|e| e.to_string())?;
    let header = stageload_input::read_header(&mut file)?;
    let tensors = header.metadata.tensors();
    let data_bytes = tensors.values().map(|info| info.data_offsets.1 as u64).max().unwrap_or(0);
    // safetensors checked each shape's product against its offsets, so each fits the file.
    let elements = total(tensors.values().map(|info| info.shape.iter().product::<usize>() as u64));
    Ok((tensors.len(), data_bytes, elements))
}

impl Pipeline {
    /// Reads and checks a pipeline file and the headers of every checkpoint it names.
    pub fn load(path: &Path) -> Result<Pipeline, PipelineError> {
        let text = stageload_input::read_text(path, MAX_PIPELINE_FILE)
            .map_err(|e| PipelineError::Read { path: path.to_path_buf(), message: e.to_string() })?;
        let file: PipelineFile = toml::from_str(&text)
            .map_err(|e| PipelineError::Syntax { path: path.to_path_buf(), message: e.to_string() })?;
        let invalid = |message: String| PipelineError::Invalid { path: path.to_path_buf(), message };
        let folder = path.parent().unwrap_or(Path::new("."));

        let mut names = HashSet::new();
        let mut models = Vec::new();
        for entry in file.models {
            if !names.insert(entry.name.clone()) {
                return Err(invalid(format!("model '{}' is described twice", entry.name)));
            }
            if entry.files.is_empty() {
                return Err(invalid(format!(
                    "model '{}' has no files: give its safetensors checkpoint(s)",
                    entry.name
                )));
            }
            let placement = match entry.device.as_str() {
                "cpu" => Placement::Host,
                "cuda" | "mps" => Placement::Device,
                device if device.strip_prefix("cuda:").is_some_and(|n| n.parse::<u32>().is_ok()) => Placement::Device,
                other => {
                    return Err(invalid(format!(
                        "model '{}': unknown device '{other}' (cpu, cuda, cuda:N or mps)",
                        entry.name
                    )))
                }
            };
            let loaded_bits = match &entry.dtype {
                Some(dtype) => Some(dtype_bits(dtype).ok_or_else(|| {
                    invalid(format!(
                        "model '{}': unknown dtype '{dtype}' (f16, bf16, f32, f64, i8 ... i64, u8, bool)",
                        entry.name
                    ))
                })?),
                None => None,
            };
            let files: Vec<PathBuf> = entry.files.iter().map(|f| folder.join(f)).collect();
            let mut tensors = 0;
            let mut parts = Vec::new();
            for file in &files {
                let (count, file_bytes, elements) = read_header(file).map_err(|message| PipelineError::Checkpoint {
                    model: entry.name.clone(),
                    file: file.clone(),
                    message,
                })?;
                tensors += count;
                let bytes = loaded_bits.map_or(file_bytes, |bits| elements.saturating_mul(bits as u64) / 8);
                parts.push(Part { file: file.clone(), bytes, file_bytes });
            }
            let bytes = total(parts.iter().map(|p| p.bytes));
            let file_bytes = total(parts.iter().map(|p| p.file_bytes));
            models.push(Model {
                name: entry.name,
                files,
                device: entry.device,
                placement,
                dtype: entry.dtype,
                tensors,
                bytes,
                file_bytes,
                parts,
            });
        }

        let mut stage_names = HashSet::new();
        let mut stages = Vec::new();
        for entry in file.stages {
            if !stage_names.insert(entry.name.clone()) {
                return Err(invalid(format!("stage '{}' is described twice", entry.name)));
            }
            let mut listed = HashSet::new();
            for model in &entry.models {
                if !names.contains(model) {
                    return Err(invalid(format!("stage '{}' names unknown model '{model}'", entry.name)));
                }
                if !listed.insert(model) {
                    return Err(invalid(format!("stage '{}' lists model '{model}' twice", entry.name)));
                }
            }
            let size = |field: &str, value: &Option<String>| -> Result<u64, PipelineError> {
                value.as_deref().map_or(Ok(0), |text| {
                    parse_size(text).map_err(|e| invalid(format!("stage '{}': {field}: {e}", entry.name)))
                })
            };
            let working = size("working", &entry.working)?;
            let device_working = size("device_working", &entry.device_working)?;
            stages.push(Stage { name: entry.name, models: entry.models, working, device_working });
        }
        if stages.is_empty() {
            return Err(invalid("no stages: add [[stages]] entries with a name and the models they use".into()));
        }
        for pinned in &file.pinned {
            if !names.contains(pinned) {
                return Err(invalid(format!("pinned names unknown model '{pinned}'")));
            }
        }
        Ok(Pipeline { path: path.to_path_buf(), models, stages, pinned: file.pinned })
    }
}
