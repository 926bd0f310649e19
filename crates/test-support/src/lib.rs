//! What the workspace's tests share, one concern per module:
//!
//! - [`pids`]: the pid a test command wrote, whether a pid still runs, a child waited for with a
//!   deadline.
//! - [`build`]: a binary or example of this workspace built now (never stale) for a test to run.
//! - [`fixtures`]: fixtures a Python script of the workspace writes with the cached torch.
//! - [`memory`]: the process's RSS read exactly, and the slack an RSS check allows.
//! - `torch` (feature `torch`): a small real tch model, and the one lock on torch's global
//!   generator that every test drawing from it takes.

#![warn(missing_docs)]

pub mod build;
pub mod fixtures;
pub mod memory;
pub mod pids;
#[cfg(feature = "torch")]
pub mod torch;
