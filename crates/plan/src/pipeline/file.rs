//! The pipeline description file as written (before any check): models with their checkpoints, the stages in the order the run
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
//! snapshot_dir = "snapshots"                 # models without a checkpoint reload from a snapshot
//! snapshot_keep_free = "4G"                  # what a snapshot write leaves free (default 1G)
//! cpus = 4                                   # CPUs one run asks a scheduler for (`plan --request`)
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
//! name = "sampler"                           # no checkpoint: built by its loader
//! weights = "300M"                           # its weights' size, as loaded (what the plan counts)
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

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// A model as the file describes it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelEntry {
    /// The model's name, as stages and pins list it.
    pub name: String,
    /// Safetensors files, relative to the pipeline file's folder unless absolute. None: the
    /// model is built by its loader (and `weights` gives its size).
    #[serde(default)]
    pub files: Vec<PathBuf>,
    /// A model without files: its weights' size as loaded (a size: `300M`), what the plan
    /// counts for it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weights: Option<String>,
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

fn cpu() -> String {
    "cpu".to_string()
}

/// A stage as the file describes it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StageEntry {
    /// The stage's name.
    pub name: String,
    /// The models the stage uses.
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
    /// The models kept resident.
    pub models: Vec<String>,
    /// The stage from which they are kept (default: the first).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<String>,
    /// The stage at whose entry they are released (default: kept to the end).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub until: Option<String>,
}

/// The file itself, before any check: what [`super::Pipeline::load`] parses, and what a program that
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
    /// A folder for snapshots (relative to this file's folder unless absolute): a model without
    /// files writes its weights there at its first release and reloads from them
    /// (`StagedModelsBuilder::snapshot_dir`); without it, such a model is rebuilt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_dir: Option<PathBuf>,
    /// What every snapshot write leaves free on the folder's file system (a size; default 1G).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_keep_free: Option<String>,
    /// CPUs one run asks a scheduler for (`stageload plan --request`; at least 1). None: the
    /// request names no CPUs and the scheduler's default holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpus: Option<u32>,
    /// Models resident over a span of stages.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pins: Vec<PinEntry>,
    /// The models, in definition order.
    #[serde(default)]
    pub models: Vec<ModelEntry>,
    /// The stages, in run order.
    #[serde(default)]
    pub stages: Vec<StageEntry>,
}
