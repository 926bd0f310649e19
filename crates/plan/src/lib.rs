//! stageload-plan: know before a run whether a staged pipeline fits this machine. Torch-free.
//!
//! - [`pipeline`]: the TOML pipeline description (models, checkpoints, stages, pins, working
//!   memory), checked, with each model's size read from its checkpoints' headers only.
//! - [`blocks`], [`split`]: a streamed model's blocks (which tensors) and which of them stay
//!   resident under a budget: the rules `stageload::stream` runs by and the plan counts by.
//! - [`hot`]: which streamed blocks stay in memory after they run (the hot set), by the same
//!   rules in the streamer and the plan.
//! - [`tier`]: the host tier's rules (budget, LRU eviction, leases), which `stageload`'s
//!   registry runs and the plan counts each stage's copies with.
//! - [`measured`]: working memory from a recorded run, and a plan checked against a run.
//! - [`plan`](mod@plan): stage by stage residency, loads, releases, reloads, bytes read, and a verdict
//!   per stage against this machine's budget, staged and eager.
//! - [`request`]: what one run asks a scheduler for (Ray, Slurm, Kubernetes), from its plan.

#![warn(missing_docs)]

pub mod blocks;
pub mod hot;
pub mod leftover;
pub mod measured;
pub mod pipeline;
pub mod plan;
pub mod request;
pub mod split;
pub mod tier;

pub use pipeline::{
    DeviceName, Model, ModelEntry, Pin, PinEntry, Pipeline, PipelineError, PipelineFile, Placement, Reserve, Stage,
    StageEntry, StreamEntry, Streaming,
};
pub use plan::{plan, Budget, BudgetSource, EagerPlan, EagerStage, Plan, StagePlan, Verdict, SCHEMA_VERSION};
