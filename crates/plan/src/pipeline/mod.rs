//! A pipeline: the file that describes it ([`mod@file`]: models with their checkpoints, the stages in
//! the order the run enters them, pins, working memory) and the same checked (`check.rs`): every
//! name resolved, every checkpoint's header read (`header.rs`), each streamed model's split
//! decided. The checked pipeline feeds both `stageload plan` and `StagedModels`, so the plan
//! that was checked is the plan that runs.

mod check;
pub mod file;
mod header;

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use thiserror::Error;

pub use check::resolve_pin;
pub use file::{ModelEntry, PinEntry, PipelineFile, StageEntry, StreamEntry};

/// Why a pipeline file or one of its checkpoints cannot be planned.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum PipelineError {
    /// The file cannot be read.
    #[error("cannot read pipeline file {path}: {message}")]
    Read {
        /// The pipeline file.
        path: PathBuf,
        /// The system's reason.
        message: String,
    },
    /// The file is not valid TOML or has fields it should not.
    #[error("pipeline file {path} is not valid: {message}")]
    Syntax {
        /// The pipeline file.
        path: PathBuf,
        /// The parser's message.
        message: String,
    },
    /// The file parses but does not make a pipeline (unknown names, bad sizes, a budget that does not fit).
    #[error("pipeline file {path}: {message}")]
    Invalid {
        /// The pipeline file.
        path: PathBuf,
        /// What is wrong and how to fix it.
        message: String,
    },
    /// A model's checkpoint header cannot be read.
    #[error("model '{model}': cannot read checkpoint {file}: {source}")]
    Checkpoint {
        /// The model.
        model: String,
        /// The checkpoint file.
        file: PathBuf,
        /// Why.
        source: stageload_input::HeaderError,
    },
}

/// Why a pin's `from`/`until` do not make a span of the stage sequence.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum PinError {
    /// `from` or `until` names no stage.
    #[error("pin of {}: {field} names unknown stage '{stage}' (stages: {})", .models.join(", "), .stages.join(", "))]
    UnknownStage {
        /// The pinned models.
        models: Vec<String>,
        /// `from` or `until`.
        field: &'static str,
        /// The name given.
        stage: String,
        /// The stage sequence.
        stages: Vec<String>,
    },
    /// `until` names a stage that does not come after `from`.
    #[error("pin of {}: until '{until}' does not come after from '{from}'", .models.join(", "))]
    UntilNotAfter {
        /// The pinned models.
        models: Vec<String>,
        /// The `until` stage.
        until: String,
        /// The `from` stage.
        from: String,
    },
}

/// How a streamed model holds its blocks under its budget, from its checkpoints' headers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Streaming {
    /// The file's blocks and resident tensors, as the run takes them.
    #[serde(default)]
    pub spec: crate::blocks::BlockSpec,
    /// Blocks the model is cut into.
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
    /// Bytes the model may hold (its own `budget`, or what its stages leave).
    pub budget: u64,
    /// A budget the file did not give: what its tightest stage leaves (see [`crate::leftover`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget_from: Option<String>,
    /// Bytes a step needs beside the weights.
    pub working: u64,
    /// On CUDA: host bytes of every block's pinned copy, which the streamer reads once at set-up
    /// and refills from (0 elsewhere, where refills read the checkpoint).
    #[serde(default)]
    pub host_copies: u64,
}

/// A device as pipeline files (and the demos' `--device`) name it: `cpu`, `cuda` (device 0),
/// `cuda:N`, `mps`. Parsed once, when the file is checked; written as `cpu`, `cuda:N`, `mps`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub enum DeviceName {
    /// The host.
    Cpu,
    /// CUDA device N.
    Cuda(usize),
    /// Apple's Metal device.
    Mps,
}

impl DeviceName {
    /// `cpu`, `cuda`, `cuda:N` or `mps`; `None` for anything else.
    pub fn parse(text: &str) -> Option<DeviceName> {
        match text {
            "cpu" => Some(DeviceName::Cpu),
            "cuda" => Some(DeviceName::Cuda(0)),
            "mps" => Some(DeviceName::Mps),
            other => other.strip_prefix("cuda:").and_then(|n| n.parse().ok()).map(DeviceName::Cuda),
        }
    }

    /// Where weights on this device count: host memory or device memory.
    pub fn placement(self) -> Placement {
        match self {
            DeviceName::Cpu => Placement::Host,
            DeviceName::Cuda(_) | DeviceName::Mps => Placement::Device,
        }
    }
}

impl std::fmt::Display for DeviceName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceName::Cpu => f.write_str("cpu"),
            DeviceName::Cuda(index) => write!(f, "cuda:{index}"),
            DeviceName::Mps => f.write_str("mps"),
        }
    }
}

impl From<DeviceName> for String {
    fn from(device: DeviceName) -> String {
        device.to_string()
    }
}

/// A device or dtype name the pipeline file does not know.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("unknown {what} '{text}' ({known})")]
pub struct UnknownName {
    /// `device` or `dtype`.
    pub what: &'static str,
    /// The name given.
    pub text: String,
    /// The names known.
    pub known: &'static str,
}

impl TryFrom<String> for DeviceName {
    type Error = UnknownName;
    fn try_from(text: String) -> Result<Self, UnknownName> {
        DeviceName::parse(&text).ok_or(UnknownName { what: "device", text, known: "cpu, cuda, cuda:N or mps" })
    }
}

/// Where a model's weights live while it is resident.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Placement {
    /// In host memory (RSS).
    Host,
    /// In a device's memory.
    Device,
}

/// One checkpoint file of a model and what it holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Part {
    /// The file, resolved.
    pub file: PathBuf,
    /// Bytes resident once loaded (in the model's `dtype` when given, else as stored).
    pub bytes: u64,
    /// Bytes read from disk to load it.
    pub file_bytes: u64,
    /// Of `bytes`, those of float entries (what a smaller float dtype would shrink).
    #[serde(default)]
    pub float_bytes: u64,
    /// Elements of the float entries.
    #[serde(default)]
    pub float_elements: u64,
}

/// A checked model: its files resolved and its size read from their headers. A file that several
/// models list (a shared backbone) is held once while any of them is resident, and read once.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Model {
    /// The model's name.
    pub name: String,
    /// Its checkpoints; none: built by its loader, `bytes` as the file declares them.
    pub files: Vec<PathBuf>,
    /// The device it loads on.
    pub device: DeviceName,
    /// Which memory its weights count in (from `device`).
    pub placement: Placement,
    /// What its float entries load as; `None`: as stored.
    pub dtype: Option<LoadDtype>,
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

    /// Whether its loader builds it (no checkpoint): released, it is rebuilt, or reloaded from
    /// a snapshot once one is written.
    pub fn built(&self) -> bool {
        self.files.is_empty()
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
    /// The stage's name.
    pub name: String,
    /// The models it uses.
    pub models: Vec<String>,
    /// Host memory it needs beyond its weights, bytes.
    pub working: u64,
    /// Device memory it needs beyond its weights, bytes.
    pub device_working: u64,
}

/// Models kept resident over the stages `from..until` (indices into the stage sequence; `until`
/// `None`: to the end).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Pin {
    /// The models kept resident.
    pub models: Vec<String>,
    /// Index of the first stage they are kept in.
    pub from: usize,
    /// Index of the stage whose entry lets them go (`None`: the end).
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
    /// A fixed number of bytes.
    Bytes(u64),
    /// A percent of each need.
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
    /// The pipeline file.
    pub path: PathBuf,
    /// The models, in definition order.
    pub models: Vec<Model>,
    /// The stages in the order the run enters them; a name may come back.
    pub stages: Vec<Stage>,
    /// Models resident for the whole run.
    pub pinned: Vec<String>,
    /// Models resident over a span of stages.
    #[serde(default)]
    pub pins: Vec<Pin>,
    /// Headroom added to every stage's need.
    #[serde(default)]
    pub reserve: Option<Reserve>,
    /// The host tier's budget, bytes.
    #[serde(default)]
    pub host_tier: Option<u64>,
    /// Host memory the run is given, bytes.
    #[serde(default)]
    pub memory: Option<u64>,
    /// Device memory the run is given, bytes.
    #[serde(default)]
    pub device_memory: Option<u64>,
    /// Where models without a checkpoint write their snapshots (resolved from the file's folder).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_dir: Option<PathBuf>,
    /// What a snapshot write leaves free there, bytes (the registry's default when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_keep_free: Option<u64>,
    /// CPUs one run asks a scheduler for (at least 1), when the file says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpus: Option<u32>,
}

impl Pipeline {
    /// The model `name`, if the pipeline has one.
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

/// A dtype a model's float entries load as: the ones the registry converts to. Parsed once,
/// when the file is checked; written by its short name (`f16`, `bf16`, `f32`, `f64`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub enum LoadDtype {
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
    /// Single precision.
    F32,
    /// Double precision.
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

    /// Bits per element.
    pub fn bits(self) -> usize {
        match self {
            LoadDtype::F16 | LoadDtype::BF16 => 16,
            LoadDtype::F32 => 32,
            LoadDtype::F64 => 64,
        }
    }

    /// Its short name.
    pub fn name(self) -> &'static str {
        match self {
            LoadDtype::F16 => "f16",
            LoadDtype::BF16 => "bf16",
            LoadDtype::F32 => "f32",
            LoadDtype::F64 => "f64",
        }
    }
}

impl std::fmt::Display for LoadDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl From<LoadDtype> for String {
    fn from(dtype: LoadDtype) -> String {
        dtype.name().to_string()
    }
}

impl TryFrom<String> for LoadDtype {
    type Error = UnknownName;
    fn try_from(text: String) -> Result<Self, UnknownName> {
        LoadDtype::parse(&text).ok_or(UnknownName { what: "dtype", text, known: "f16, bf16, f32 or f64" })
    }
}

/// The largest pipeline file read: far more than any real description, far less than a device
/// read forever.
pub const MAX_PIPELINE_FILE: u64 = 16 << 20;

/// Sums sizes without wrapping: an absurd size saturates at `u64::MAX`, which fits nowhere.
pub fn total(sizes: impl IntoIterator<Item = u64>) -> u64 {
    sizes.into_iter().fold(0, u64::saturating_add)
}
