//! Models bigger than the memory they are given: a resident prefix of blocks, the rest streamed
//! through one slot (plus one loaded ahead) and refilled in place from the checkpoint, the ones
//! used most kept hot in what the budget leaves.
//!
//! This is release and reload in place at the grain of a block. A [`StreamedModel`] owns a
//! model's named tensors, split into blocks by a [`BlockSpec`]; under a byte budget the first
//! blocks that fit stay resident ([`split`]), and each of the others is refilled from the
//! checkpoint just before it runs (`pread` into two reused slot buffers on the CPU; on CUDA an
//! async copy on a side stream from pinned host copies of every block, read once at set-up) and
//! freed in place just after, with the next streamed block read on a background
//! thread while the current one computes (on the CPU, across the step boundary too: the last
//! block runs while the next step's first streamed block is read, `slots.rs`).
//! The forward code stays the same except for one call
//! at each block boundary, [`Step::block`](step::Step::block):
//!
//! ```no_run
//! # use stageload::stream::{BlockSpec, StreamedModel};
//! # use stageload::{checkpoint::Checkpoint, NameRules};
//! # fn f(vs: &tch::nn::VarStore, blocks: &[tch::nn::Linear], x: tch::Tensor) -> Result<(), Box<dyn std::error::Error>> {
//! let spec = BlockSpec::new(["model.blocks.*"]).resident(["model.input", "model.output"]);
//! let checkpoint = Checkpoint::open(&["model.safetensors"])?;
//! let mut model = StreamedModel::new("flow", stageload::named_tensors(vs), checkpoint, &NameRules::default(), &spec, 512 << 20)?;
//! let y = model.run(|step| {
//!     let mut x = x.shallow_clone();
//!     for (i, block) in blocks.iter().enumerate() {
//!         step.block(i)?; // block i is in memory from here to the next call
//!         x = tch::nn::Module::forward(block, &x);
//!     }
//!     Ok(x)
//! })?;
//! # Ok(()) }
//! ```
//!
//! A pipeline file may stream a model (`stream = { blocks, resident, budget, ... }` in its
//! entry): [`StagedModelsBuilder::pipeline`](crate::StagedModelsBuilder::pipeline) hands that plan to the model's loader
//! ([`crate::BuildContext::stream`]) and [`StreamedModel::planned`] makes the model from it, so
//! the run keeps the split `stageload plan` counted.
//!
//! The room the budget leaves beyond the prefix, the slots and the working memory keeps
//! streamed blocks hot after they run ([`hot`]: the blocks used most, ties to those held, so a
//! forward in order keeps a fixed set instead of thrashing). A forward that runs its blocks in
//! any order, or only some each step (experts), says so with [`StreamedModel::any_order`]: then
//! no prefix is kept, the whole room is the hot set, and the block read ahead is the one the
//! forward names with [`Step::prefetch`](step::Step::prefetch).
//!
//! An out-of-memory inside a step (a libtorch error or panic saying so) gives up the hot set, or
//! else streams one more block, and runs the step again; on the CPU, where running out is the
//! machine's problem rather than an error, the working memory measured at block boundaries
//! decides the next step's split. The resident count and the hot set's room only go down during
//! a run ([`StreamedModel::reset`] sets them back). Each change is one line in the log and a
//! `residency` event. [`StreamedModel::uncached`] makes refills read past the page cache.
//!
//! Where each part lives: the pure rules in `stageload-plan` ([`blocks`]: names into blocks;
//! [`split`]: what stays, what streams, when a governor or a step's memory changes that;
//! [`hot`]: the hot set); `block.rs` what a model is cut into and its host copies;
//! `streamer.rs` the model's state, set-up and options; `refill.rs` a block's refill and
//! release, over what refills read (`Setting`) and what they change (`Memory`); `order.rs` the
//! order the forward runs blocks in; `direct.rs` a read past the page cache into a slot;
//! `slots.rs` the slot buffers and the read carried across a step boundary; `readings.rs` the
//! memory readings and governors; `stats.rs` what the model moved; `run.rs` a step and the
//! changes after it; `step.rs` the call at a block boundary.

mod block;
mod direct;
mod fences;
mod order;
mod readings;
mod refill;
mod run;
mod slots;
mod stats;
mod step;
mod streamer;

/// Block lists and split decisions are pure and torch-free: they live in the plan crate, which
/// counts streamed models with the same rules.
pub use stageload_plan::{blocks, hot, split};

pub use blocks::{BlockError, BlockSpec};
pub use split::{DirectReads, Split, TooSmall};
pub use stats::StreamStats;
pub use step::Step;
pub use streamer::{place, StreamPlan, StreamedModel};

use crate::checkpoint::{CheckpointError, HostRead};

/// How a streamed model's checkpoint reads (whatever the checkpoint it is given was set to): with
/// `pread`, since a mapped piece would hold up to `readers` × `PIECE` bytes of the file's pages in
/// the RSS, beyond the budget, while it is copied.
pub const REFILL_READS: HostRead = HostRead::Pread;

/// Why a streamed model could not be set up or could not run a step. Each names the model.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StreamError {
    /// A file its first set-up read changed since (a rebuild after a release reads it again).
    #[error("streamed model: {0}")]
    SourceChanged(#[from] crate::source::SourceChanged),
    /// The block list does not cover the model's tensors exactly once.
    #[error("streamed model '{model}': {source}")]
    Blocks {
        /// The streamed model.
        model: String,
        /// How the block list fails.
        source: BlockError,
    },
    /// The budget is smaller than a step needs with every block streamed.
    #[error("streamed model '{model}': {source}")]
    Budget {
        /// The streamed model.
        model: String,
        /// What the budget is short of.
        source: TooSmall,
    },
    /// The model's checkpoint could not be opened or read.
    #[error("streamed model '{model}': {source}")]
    Checkpoint {
        /// The streamed model.
        model: String,
        /// The checkpoint's error.
        source: Box<CheckpointError>,
    },
    /// Two blocks share a storage, so neither could be freed alone.
    #[error(
        "streamed model '{model}': block '{block}' and '{other}' share the storage of tensor '{tensor}'; a block must own its storages (untie them, or put both in one block)"
    )]
    SharedStorage {
        /// The streamed model.
        model: String,
        /// The block holding the tensor.
        block: String,
        /// The other block on the same storage.
        other: String,
        /// The tensor whose storage they share.
        tensor: String,
    },
    /// A tensor's shape changed after set-up (the refill would not fit it).
    #[error(
        "streamed model '{model}': tensor '{tensor}' of block '{block}' changed shape from {was:?} to {now:?} since the model was set up; build the model again"
    )]
    Reshaped {
        /// The streamed model.
        model: String,
        /// The tensor's block.
        block: String,
        /// The tensor.
        tensor: String,
        /// Its shape at set-up.
        was: Vec<i64>,
        /// Its shape now.
        now: Vec<i64>,
    },
    /// The forward asked for a block index the model does not have.
    #[error("streamed model '{model}' has {blocks} blocks; the forward asked for block {index}")]
    NoSuchBlock {
        /// The streamed model.
        model: String,
        /// The index asked for.
        index: usize,
        /// How many blocks the model has.
        blocks: usize,
    },
    /// A storage operation through the shim failed.
    #[error("streamed model '{model}': {operation} failed: {source}")]
    Torch {
        /// The streamed model.
        model: String,
        /// What was being done (free, reallocate, attach, ...).
        operation: &'static str,
        /// The shim's error.
        source: stageload_torch_sys::ShimError,
    },
    /// A step ran out of memory even with every block streamed.
    #[error("streamed model '{model}' ran out of memory with every block streamed ({residency}): {message}")]
    OutOfMemory {
        /// The streamed model.
        model: String,
        /// Which blocks were resident then.
        residency: String,
        /// libtorch's message.
        message: String,
    },
    /// A step (the user's closure) panicked.
    #[error("streamed model '{model}': the step failed: {message}")]
    Step {
        /// The streamed model.
        model: String,
        /// The panic's text.
        message: String,
    },
    /// A setting was given a value it cannot use (a governor's threshold, a resident count).
    #[error("streamed model '{model}': {message}")]
    Setting {
        /// The streamed model.
        model: String,
        /// What is wrong and what to give instead.
        message: String,
    },
    /// A libtorch error from a tensor operation.
    #[error(transparent)]
    Tch(#[from] tch::TchError),
}

/// A shim failure of `operation` on `model` as a stream error.
fn torch<'a>(
    model: &'a str,
    operation: &'static str,
) -> impl FnOnce(stageload_torch_sys::ShimError) -> StreamError + 'a {
    move |source| StreamError::Torch { model: model.to_string(), operation, source }
}
