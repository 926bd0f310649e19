//! stageload-ab: proving what staging changes. Torch-free.
//!
//! - [`runner`]: two or more commands run alternately, N times each, each in its own process
//!   under the guard, each with its own trace and latents file.
//! - [`latents`]: latents files compared by size, judged against the reference's own variation.
//! - [`mod@report`]: all of it as text and JSON.

pub mod latents;
pub mod report;
pub mod runner;

pub use latents::{compare, LatentFile, LatentReport, Verdict};
pub use report::{report, AbReport};
pub use runner::{run, Arm, Guard, RunRecord};
