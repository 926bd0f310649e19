//! stageload-ab: proving what staging changes. Torch-free.
//!
//! - [`runner`]: two or more commands run alternately, N times each, each in its own process
//!   under the guard, each with its own trace and latents file.
//! - [`latents`]: latents files compared by size, judged against the reference's own variation.
//! - [`results`]: the runs' result files, and every median and ratio of a comparison.
//! - [`mod@report`]: all of it as text and JSON.

#![warn(missing_docs)]

pub mod latents;
pub mod report;
pub mod results;
pub mod runner;

pub use latents::{compare, LatentFile, LatentReport, Verdict};
pub use report::{report, AbReport};
pub use results::{median, Medians, ResultField};
pub use runner::{run, Arm, Guard, RunFiles, RunRecord};
