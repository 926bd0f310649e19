//! The pipeline description file: models with their checkpoints, the stages in the order the run
//! enters them (a name may come back), pins for the whole run or for a span of stages, working
//! memory. The same file feeds `stageload plan` and `StagedModels`, so the plan that was checked
//! is the plan that runs.
//!
//! ```toml
//! pinned = ["backbone"]                      # resident for the whole run
//! reserve = "10%"                            # headroom on every stage's need (or a size: "512M")
//! host_tier = "8G"                           # released device models' weights kept in host memory
//! memory = "24G"                             # the run's host memory and device memory, from which
//! device_memory = "80G"                      # a streamed model without a budget takes the rest
//!
//! [[pins]]                                   # resident from a stage until another begins
//! models = ["extractor"]
//! from = "setup"                             # default: the first stage
//! until = "decode"                           # released when decode begins; default: the end
//!
//! [[models]]
//! name = "backbone"
//! files = ["weights/backbone.safetensors"]   # relative to this file's folder
//! device = "cpu"                             # cpu (default), cuda, cuda:N, mps
//!
//! [[models]]
//! name = "denoiser"
//! files = ["weights/denoiser-1.safetensors", "weights/denoiser-2.safetensors"]
//! dtype = "bf16"                             # float entries loaded as (default: as stored)
//! ignore = ["pooler.*"]                      # entries the model does not load (globs)
//!
//! [[models]]
//! name = "flow"                              # bigger than its budget: blocks streamed
//! files = ["weights/flow.safetensors"]
//! stream = { blocks = ["model.blocks.*"], resident = ["model.input", "model.output"], budget = "2G" }
//!                                            # no budget: what its stages leave of `memory`
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
use stageload_units::{format_bytes, parse_size};
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
    /// The dtype the model's float entries are loaded as (`f16`, `bf16`, `f32`, ...); default:
    /// as stored. Integer and bool entries keep theirs.
    #[serde(default)]
    pub dtype: Option<String>,
    /// Checkpoint entries the model does not load (glob patterns, as `NameRules::ignore`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ignore: Vec<String>,
    /// A model bigger than its budget: its blocks, streamed (`stageload::stream`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<StreamEntry>,
}

/// A streamed model's blocks and budget, as the file describes them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamEntry {
    /// Blocks in run order: tensor-name prefixes, or `prefix.*` for one block per child.
    pub blocks: Vec<String>,
    /// Prefixes of the tensors in no block (kept resident).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub resident: Vec<String>,
    /// Bytes the model may hold at once, its working memory included (a size: `2G`). Without
    /// it the model takes what its stages leave of the file's `memory` (`device_memory` on a
    /// device): less the reserve, the weights resident beside it and the stage's working memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<String>,
    /// Working memory of one step, kept free inside the budget (a size; default 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub working: Option<String>,
    /// The forward runs the blocks in any order or only some each step (experts;
    /// `StreamedModel::any_order`): no prefix, the budget's room is the hot set.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub any_order: bool,
}

/// How a streamed model holds its blocks under its budget, from its checkpoints' headers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Streaming {
    /// The file's blocks and resident tensors, as the run takes them.
    #[serde(default)]
    pub spec: crate::blocks::BlockSpec,
    pub blocks: usize,
    /// Blocks kept resident (a prefix).
    pub resident_blocks: usize,
    /// A streamed block is read while the one before runs.
    pub look_ahead: bool,
    /// Blocks run in any order (experts): `per_step` is what a step that runs them all reads.
    #[serde(default)]
    pub any_order: bool,
    /// Bytes held at most: resident tensors, resident blocks, slots and the blocks kept hot.
    pub held: u64,
    /// Bytes read into the slots per step.
    pub per_step: u64,
    /// Streamed blocks kept hot after the first step (a forward that runs them in order; with
    /// `any_order`, as many as the room holds: which ones depends on the forward).
    #[serde(default)]
    pub hot_blocks: usize,
    pub budget: u64,
    /// A budget the file did not give: what its tightest stage leaves (see [`crate::leftover`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget_from: Option<String>,
    pub working: u64,
    /// On CUDA: host bytes of every block's pinned copy, which the streamer reads once at set-up
    /// and refills from (0 elsewhere, where refills read the checkpoint).
    #[serde(default)]
    pub host_copies: u64,
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

/// Models kept resident over a span of stages, as the file describes it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PinEntry {
    pub models: Vec<String>,
    /// The stage from which they are kept (default: the first).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<String>,
    /// The stage at whose entry they are released (default: kept to the end).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub until: Option<String>,
}

/// The file itself, before any check: what [`Pipeline::load`] parses, and what a program that
/// describes its own pipeline serializes (`toml::to_string`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PipelineFile {
    /// Models resident for the whole run.
    #[serde(default)]
    pub pinned: Vec<String>,
    /// Headroom added to every stage's need: a size (`512M`) or a percent of the need (`10%`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reserve: Option<String>,
    /// Host memory for copies of released device models' weights (a size).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_tier: Option<String>,
    /// Host memory the run is given (a size): what streamed host models without a budget share.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<String>,
    /// Device memory the run is given (a size): the same for device models, and the plan's
    /// device budget when `--device-memory` is not given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_memory: Option<String>,
    /// Models resident over a span of stages.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pins: Vec<PinEntry>,
    #[serde(default)]
    pub models: Vec<ModelEntry>,
    #[serde(default)]
    pub stages: Vec<StageEntry>,
}

/// A device as pipeline files (and the demos' `--device`) name it: `cpu`, `cuda` (device 0),
/// `cuda:N`, `mps`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceName {
    Cpu,
    Cuda(usize),
    Mps,
}

impl DeviceName {
    pub fn parse(text: &str) -> Option<DeviceName> {
        match text {
            "cpu" => Some(DeviceName::Cpu),
            "cuda" => Some(DeviceName::Cuda(0)),
            "mps" => Some(DeviceName::Mps),
            other => other.strip_prefix("cuda:").and_then(|n| n.parse().ok()).map(DeviceName::Cuda),
        }
    }

    pub fn placement(self) -> Placement {
        match self {
            DeviceName::Cpu => Placement::Host,
            DeviceName::Cuda(_) | DeviceName::Mps => Placement::Device,
        }
    }
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
    /// Of `bytes`, those of float entries, and how many elements they hold (what a smaller
    /// float dtype would shrink).
    #[serde(default)]
    pub float_bytes: u64,
    #[serde(default)]
    pub float_elements: u64,
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
    /// Checkpoint entries the model does not load (globs).
    #[serde(default)]
    pub ignore: Vec<String>,
    /// Tensors over all files that the model loads.
    pub tensors: usize,
    /// Bytes resident once loaded (in `dtype` when given, else as stored).
    pub bytes: u64,
    /// Bytes read from disk per load (the tensors' data as stored).
    pub file_bytes: u64,
    /// The same, file by file.
    pub parts: Vec<Part>,
    /// A streamed model's split; `None`: loaded whole.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub streamed: Option<Streaming>,
}

impl Model {
    /// Bytes the model holds when resident: its weights, or a streamed model's most.
    pub fn held(&self) -> u64 {
        self.streamed.as_ref().map_or(self.bytes, |s| s.held)
    }

    /// Whether the host tier holds the model's copy when it is released: a device model's,
    /// unless it is streamed (its blocks have no memory between steps; it keeps its own copies).
    pub fn tiered(&self) -> bool {
        self.placement == Placement::Device && self.streamed.is_none()
    }
}

/// A checked stage.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Stage {
    pub name: String,
    pub models: Vec<String>,
    pub working: u64,
    pub device_working: u64,
}

/// Models kept resident over the stages `from..until` (indices into the stage sequence; `until`
/// `None`: to the end).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Pin {
    pub models: Vec<String>,
    pub from: usize,
    pub until: Option<usize>,
}

impl Pin {
    /// Whether the pin holds at stage `index` of the sequence.
    pub fn holds_at(&self, index: usize) -> bool {
        index >= self.from && self.until.is_none_or(|until| index < until)
    }
}

/// Headroom on every stage's need.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", content = "value", rename_all = "snake_case")]
pub enum Reserve {
    Bytes(u64),
    Percent(f64),
}

impl Reserve {
    /// `need` with the headroom added (saturating).
    pub fn on(&self, need: u64) -> u64 {
        match *self {
            Reserve::Bytes(bytes) => need.saturating_add(bytes),
            Reserve::Percent(percent) => need.saturating_add((need as f64 * percent / 100.0) as u64),
        }
    }

    /// The largest need that fits `memory` with the headroom added: `on(room(m)) <= m` (0 when
    /// nothing does).
    pub fn room(&self, memory: u64) -> u64 {
        match *self {
            Reserve::Bytes(bytes) => memory.saturating_sub(bytes),
            Reserve::Percent(percent) => {
                // Unlike `on`, a sum past u64::MAX fits nothing here (else the search below
                // would walk to u64::MAX).
                let fits = |need: u64| {
                    need.checked_add((need as f64 * percent / 100.0) as u64).is_some_and(|with| with <= memory)
                };
                // The float estimate is off by a few bytes at most either way: step to the edge.
                let mut room = (memory as f64 / (1.0 + percent / 100.0)) as u64;
                while room > 0 && !fits(room) {
                    room -= 1;
                }
                while room < memory && fits(room + 1) {
                    room += 1;
                }
                room
            }
        }
    }
}

/// A checked pipeline: every name resolved, every checkpoint header read.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Pipeline {
    pub path: PathBuf,
    pub models: Vec<Model>,
    /// The stages in the order the run enters them; a name may come back.
    pub stages: Vec<Stage>,
    /// Models resident for the whole run.
    pub pinned: Vec<String>,
    /// Models resident over a span of stages.
    #[serde(default)]
    pub pins: Vec<Pin>,
    #[serde(default)]
    pub reserve: Option<Reserve>,
    /// The host tier's budget, bytes.
    #[serde(default)]
    pub host_tier: Option<u64>,
    /// Host and device memory the run is given, bytes.
    #[serde(default)]
    pub memory: Option<u64>,
    #[serde(default)]
    pub device_memory: Option<u64>,
}

impl Pipeline {
    pub fn model(&self, name: &str) -> Option<&Model> {
        self.models.iter().find(|m| m.name == name)
    }

    /// The models pinned at stage `index` of the sequence: the whole run's and the spans'.
    pub fn pinned_at(&self, index: usize) -> Vec<&String> {
        let mut pinned: Vec<&String> = self.pinned.iter().collect();
        for pin in self.pins.iter().filter(|p| p.holds_at(index)) {
            pinned.extend(pin.models.iter().filter(|m| !self.pinned.contains(m)));
        }
        pinned.dedup();
        pinned
    }
}

/// A dtype a model's float entries load as: the ones the registry converts to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadDtype {
    F16,
    BF16,
    F32,
    F64,
}

impl LoadDtype {
    /// As users write it: `f16`, `bf16`, `f32`, `f64` and their long names, any case.
    pub fn parse(name: &str) -> Option<LoadDtype> {
        match name.to_ascii_lowercase().as_str() {
            "f16" | "float16" | "half" => Some(LoadDtype::F16),
            "bf16" | "bfloat16" => Some(LoadDtype::BF16),
            "f32" | "float32" | "float" => Some(LoadDtype::F32),
            "f64" | "float64" | "double" => Some(LoadDtype::F64),
            _ => None,
        }
    }

    pub fn bits(self) -> usize {
        match self {
            LoadDtype::F16 | LoadDtype::BF16 => 16,
            LoadDtype::F32 => 32,
            LoadDtype::F64 => 64,
        }
    }
}

/// A streamed model without a budget, until its stages are known: its index among the models,
/// its stream entry, its entries' names and bytes, whether it is on CUDA.
type Undecided = (usize, StreamEntry, Vec<(String, u64)>, bool);

/// The largest pipeline file read: far more than any real description, far less than a device
/// read forever.
pub const MAX_PIPELINE_FILE: u64 = 16 << 20;

/// Sums sizes without wrapping: an absurd size saturates at `u64::MAX`, which fits nowhere.
pub fn total(sizes: impl IntoIterator<Item = u64>) -> u64 {
    sizes.into_iter().fold(0, u64::saturating_add)
}

/// Whether entries of `dtype` convert to a model's load dtype (floats do; integers and bools
/// keep theirs).
fn converts(dtype: safetensors::Dtype) -> bool {
    use safetensors::Dtype::*;
    matches!(dtype, F16 | BF16 | F32 | F64 | F8_E4M3 | F8_E5M2)
}

/// What one checkpoint holds for a model: the entries it loads and their bytes as stored, once
/// loaded with `load_bits` per float element (as stored without it), and of floats once loaded.
struct FileSizes {
    /// Each loaded entry's name and bytes once loaded.
    loaded: Vec<(String, u64)>,
    stored: u64,
    resident: u64,
    float_bytes: u64,
    float_elements: u64,
}

fn read_header(path: &Path, ignore: &[glob::Pattern], load_bits: Option<usize>) -> Result<FileSizes, String> {
    let mut file = stageload_input::open_regular(path).map_err(|e| e.to_string())?;
    let header = stageload_input::read_header(&mut file)?;
    let loaded: Vec<_> =
        header.metadata.tensors().into_iter().filter(|(name, _)| !ignore.iter().any(|p| p.matches(name))).collect();
    // safetensors checked each entry's offsets against its shape and dtype, and the reader
    // checked them against the file, so each size below fits the file.
    let stored = total(loaded.iter().map(|(_, info)| (info.data_offsets.1 - info.data_offsets.0) as u64));
    let resident_of = |info: &safetensors::tensor::TensorInfo| match load_bits {
        Some(bits) if converts(info.dtype) => {
            (info.shape.iter().product::<usize>() as u64).saturating_mul(bits as u64) / 8
        }
        _ => (info.data_offsets.1 - info.data_offsets.0) as u64,
    };
    let floats: Vec<_> = loaded.iter().filter(|(_, info)| converts(info.dtype)).collect();
    Ok(FileSizes {
        loaded: loaded.iter().map(|(name, info)| (name.clone(), resident_of(info))).collect(),
        stored,
        resident: total(loaded.iter().map(|(_, info)| resident_of(info))),
        float_bytes: total(floats.iter().map(|(_, info)| resident_of(info))),
        float_elements: total(floats.iter().map(|(_, info)| info.shape.iter().product::<usize>() as u64)),
    })
}

/// The split a streamed model gets under `budget`, from its entries' names and bytes.
fn streaming(
    stream: &StreamEntry,
    entries: &[(String, u64)],
    on_cuda: bool,
    budget: (u64, Option<String>),
) -> Result<Streaming, String> {
    let (budget, budget_from) = budget;
    let working = stream.working.as_deref().map_or(Ok(0), parse_size).map_err(|e| format!("working: {e}"))?;
    let spec = crate::blocks::BlockSpec::new(stream.blocks.iter().cloned()).resident(stream.resident.iter().cloned());
    let names: Vec<&str> = entries.iter().map(|(n, _)| n.as_str()).collect();
    let layout = crate::blocks::assign(&spec, &names).map_err(|e| e.to_string())?;
    let bytes = |members: &[usize]| total(members.iter().map(|&i| entries[i].1));
    let sizes = crate::split::Sizes {
        fixed: bytes(&layout.fixed),
        blocks: layout.blocks.iter().map(|(_, members)| bytes(members)).collect(),
    };
    let at_most = if stream.any_order { 0 } else { sizes.blocks.len() };
    let split = crate::split::fit(&sizes, budget, working, at_most).map_err(|e| e.to_string())?;
    let holding = sizes.holding(split, stream.any_order);
    Ok(Streaming {
        spec,
        blocks: split.blocks,
        resident_blocks: split.resident,
        look_ahead: split.look_ahead,
        any_order: stream.any_order,
        held: holding.held,
        per_step: holding.per_step,
        hot_blocks: holding.hot_blocks,
        budget,
        budget_from,
        working,
        host_copies: if on_cuda { total(sizes.blocks.iter().copied()) } else { 0 },
    })
}

/// A pin's span as indices into the stage sequence: `from` at its first occurrence, `until` at
/// its first occurrence after `from`.
pub fn resolve_pin(pin: &PinEntry, stages: &[&str]) -> Result<Pin, String> {
    let what = format!("pin of {}", pin.models.join(", "));
    let unknown = |field: &str, name: &str| {
        format!("{what}: {field} names unknown stage '{name}' (stages: {})", stages.join(", "))
    };
    let from = match &pin.from {
        None => 0,
        Some(name) => stages.iter().position(|s| s == name).ok_or_else(|| unknown("from", name))?,
    };
    let until = match &pin.until {
        None => None,
        Some(name) => {
            let after = stages[from..].iter().skip(1).position(|s| s == name).map(|i| from + 1 + i);
            match after {
                Some(index) => Some(index),
                None if stages.contains(&name.as_str()) => {
                    return Err(format!("{what}: until '{name}' does not come after from '{}'", stages[from]))
                }
                None => return Err(unknown("until", name)),
            }
        }
    };
    Ok(Pin { models: pin.models.clone(), from, until })
}

/// `10%` or a size.
fn parse_reserve(text: &str) -> Result<Reserve, String> {
    if let Some(percent) = text.trim().strip_suffix('%') {
        return match percent.trim().parse::<f64>() {
            Ok(p) if (0.0..=1000.0).contains(&p) => Ok(Reserve::Percent(p)),
            _ => Err(format!("reserve: '{text}' is not a percent from 0% to 1000%")),
        };
    }
    parse_size(text).map(Reserve::Bytes).map_err(|e| format!("reserve: {e} (or a percent: 10%)"))
}

impl Pipeline {
    /// Reads and checks a pipeline file and the headers of every checkpoint it names.
    pub fn load(path: &Path) -> Result<Pipeline, PipelineError> {
        let text = stageload_input::read_text(path, MAX_PIPELINE_FILE)
            .map_err(|e| PipelineError::Read { path: path.to_path_buf(), message: e.to_string() })?;
        Self::parse(&text, path)
    }

    /// Checks the text of the pipeline file at `path` (already read) and reads the headers of
    /// every checkpoint it names; relative checkpoint paths are taken from `path`'s folder.
    pub fn parse(text: &str, path: &Path) -> Result<Pipeline, PipelineError> {
        let file: PipelineFile = toml::from_str(text)
            .map_err(|e| PipelineError::Syntax { path: path.to_path_buf(), message: e.to_string() })?;
        let invalid = |message: String| PipelineError::Invalid { path: path.to_path_buf(), message };
        let folder = path.parent().unwrap_or(Path::new("."));

        let mut names = HashSet::new();
        let mut models = Vec::new();
        let mut undecided: Vec<Undecided> = Vec::new();
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
            let placement = DeviceName::parse(&entry.device).map(DeviceName::placement).ok_or_else(|| {
                invalid(format!("model '{}': unknown device '{}' (cpu, cuda, cuda:N or mps)", entry.name, entry.device))
            })?;
            let loaded_bits = match &entry.dtype {
                Some(dtype) => Some(LoadDtype::parse(dtype).map(LoadDtype::bits).ok_or_else(|| {
                    invalid(format!(
                        "model '{}': unknown dtype '{dtype}': float entries load as f16, bf16, f32 or f64 (integer and bool entries keep theirs)",
                        entry.name
                    ))
                })?),
                None => None,
            };
            if loaded_bits == Some(64) && entry.device == "mps" {
                return Err(invalid(format!(
                    "model '{}': dtype '{}': mps cannot hold float64; choose f32, f16 or bf16",
                    entry.name,
                    entry.dtype.as_deref().unwrap_or_default()
                )));
            }
            let ignore = entry
                .ignore
                .iter()
                .map(|p| glob::Pattern::new(p))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| invalid(format!("model '{}': ignore: {e}", entry.name)))?;
            let files: Vec<PathBuf> = entry.files.iter().map(|f| folder.join(f)).collect();
            let mut parts = Vec::new();
            let mut entries = Vec::new();
            for file in &files {
                let sizes = read_header(file, &ignore, loaded_bits).map_err(|message| PipelineError::Checkpoint {
                    model: entry.name.clone(),
                    file: file.clone(),
                    message,
                })?;
                entries.extend(sizes.loaded);
                parts.push(Part {
                    file: file.clone(),
                    bytes: sizes.resident,
                    file_bytes: sizes.stored,
                    float_bytes: sizes.float_bytes,
                    float_elements: sizes.float_elements,
                });
            }
            let bytes = total(parts.iter().map(|p| p.bytes));
            let file_bytes = total(parts.iter().map(|p| p.file_bytes));
            let tensors = entries.len();
            let streamed = match &entry.stream {
                Some(_) if entry.dtype.is_some() => {
                    return Err(invalid(format!(
                        "model '{}': dtype and stream together: a streamed model's blocks load in the kinds its loader builds them in; build it in that dtype and leave dtype out",
                        entry.name
                    )))
                }
                Some(stream) => {
                    let on_cuda = matches!(DeviceName::parse(&entry.device), Some(DeviceName::Cuda(_)));
                    match &stream.budget {
                        Some(budget) => {
                            let budget = parse_size(budget)
                                .map_err(|e| invalid(format!("model '{}': stream: budget: {e}", entry.name)))?;
                            Some(
                                streaming(stream, &entries, on_cuda, (budget, None))
                                    .map_err(|e| invalid(format!("model '{}': stream: {e}", entry.name)))?,
                            )
                        }
                        None => {
                            undecided.push((models.len(), stream.clone(), entries, on_cuda));
                            None
                        }
                    }
                }
                None => None,
            };
            models.push(Model {
                name: entry.name,
                files,
                device: entry.device,
                placement,
                dtype: entry.dtype,
                ignore: entry.ignore,
                tensors,
                bytes,
                file_bytes,
                parts,
                streamed,
            });
        }

        let mut stages = Vec::new();
        for entry in file.stages {
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
        for pinned in file.pinned.iter().chain(file.pins.iter().flat_map(|p| &p.models)) {
            if !names.contains(pinned) {
                return Err(invalid(format!("pinned names unknown model '{pinned}'")));
            }
        }
        let stage_names: Vec<&str> = stages.iter().map(|s: &Stage| s.name.as_str()).collect();
        let pins = file
            .pins
            .iter()
            .map(|pin| resolve_pin(pin, &stage_names))
            .collect::<Result<Vec<_>, _>>()
            .map_err(invalid)?;
        let reserve = file.reserve.as_deref().map(parse_reserve).transpose().map_err(invalid)?;
        let host_tier = file
            .host_tier
            .as_deref()
            .map(|text| parse_size(text).map_err(|e| invalid(format!("host_tier: {e}"))))
            .transpose()?;
        let memory = |field: &str, value: &Option<String>| -> Result<Option<u64>, PipelineError> {
            value.as_deref().map(|text| parse_size(text).map_err(|e| invalid(format!("{field}: {e}")))).transpose()
        };
        let (memory, device_memory) = (memory("memory", &file.memory)?, memory("device_memory", &file.device_memory)?);
        let mut pipeline = Pipeline {
            path: path.to_path_buf(),
            models,
            stages,
            pinned: file.pinned,
            pins,
            reserve,
            host_tier,
            memory,
            device_memory,
        };
        pipeline.derive_budgets(undecided).map_err(invalid)?;
        Ok(pipeline)
    }

    /// Gives each streamed model without a budget what its stages leave ([`crate::leftover`]).
    fn derive_budgets(&mut self, undecided: Vec<Undecided>) -> Result<(), String> {
        let names: Vec<String> = undecided.iter().map(|(index, ..)| self.models[*index].name.clone()).collect();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let mut derived = Vec::new();
        for (index, stream, entries, on_cuda) in &undecided {
            let model = &self.models[*index];
            let (memory, field) = match model.placement {
                Placement::Host => (self.memory, "memory"),
                Placement::Device => (self.device_memory, "device_memory"),
            };
            let what = |message: String| format!("model '{}': stream: {message}", model.name);
            let memory = memory.ok_or_else(|| {
                what(format!(
                    "no budget: give it one (budget = \"2G\"), or give the pipeline {field} = \"...\" so that it takes what its stages leave"
                ))
            })?;
            let left = crate::leftover::leftover(self, &model.name, model.placement, memory, &names).map_err(what)?;
            let from = match &left.stage {
                Some(stage) => format!("what stage '{stage}' leaves of {field} {}", format_bytes(memory)),
                None => format!("{field} {}, in no stage", format_bytes(memory)),
            };
            let working =
                stream.working.as_deref().map_or(Ok(0), parse_size).map_err(|e| what(format!("working: {e}")))?;
            // Its own working memory is inside the stage's, and kept free inside its budget.
            let budget = left.bytes.saturating_add(working);
            derived.push((*index, streaming(stream, entries, *on_cuda, (budget, Some(from))).map_err(what)?));
        }
        for (index, streamed) in derived {
            self.models[index].streamed = Some(streamed);
        }
        Ok(())
    }
}
