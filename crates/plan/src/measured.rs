//! Working memory measured instead of guessed: each stage occurrence of a pipeline matched with
//! the window of a recorded run (`stageload plan FILE --from-trace RUN.jsonl`), its working
//! memory taken as the window's peak minus the weights resident in it (host, and device memory
//! on a device run), and a plan checked against a run stage by stage (`--check RUN.jsonl`).

use std::path::{Path, PathBuf};

use serde::Serialize;
use stageload_trace::record::Record;
use stageload_trace::{summarize, StageWindow, Summary, Trace};
use stageload_units::format_bytes;

use crate::pipeline::Pipeline;
use crate::plan::Plan;

/// A trace with stages its pipeline does not have: a trace of another pipeline, most likely.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "trace {} has stages the pipeline does not: {} (the pipeline's: {}); a trace of another pipeline?",
    .trace.display(), .foreign.join(", "), .ours.join(", ")
)]
pub struct ForeignStages {
    /// The trace.
    pub trace: PathBuf,
    /// Its stages the pipeline lacks, in the trace's order.
    pub foreign: Vec<String>,
    /// The pipeline's stages.
    pub ours: Vec<String>,
}

/// The windows of `summary` matched to the pipeline's stage occurrences: each occurrence takes
/// the first window whose stage event recorded it (its place in the sequence, the registry's
/// rule, so `[a, a]` and `[a, b, a]` meet the right windows). A trace written before stage
/// events carried their place: each occurrence takes the next window of its name. Err: the
/// trace has stages the pipeline does not (the synthetic `setup` window aside), listed.
pub fn match_windows<'a>(
    pipeline: &Pipeline,
    summary: &'a Summary,
    trace: &Path,
) -> Result<Vec<Option<&'a StageWindow>>, ForeignStages> {
    let known = |name: &str| pipeline.stages.iter().any(|s| s.name == name);
    let mut foreign: Vec<String> =
        summary.stages.iter().map(|w| w.stage.clone()).filter(|s| !known(s) && s != "setup").collect();
    foreign.dedup();
    if !foreign.is_empty() {
        let ours = pipeline.stages.iter().map(|s| s.name.clone()).collect();
        return Err(ForeignStages { trace: trace.to_path_buf(), foreign, ours });
    }
    if summary.stages.iter().any(|w| w.position.is_some()) {
        return Ok(pipeline
            .stages
            .iter()
            .enumerate()
            .map(|(i, stage)| summary.stages.iter().find(|w| w.position == Some(i) && w.stage == stage.name))
            .collect());
    }
    let mut next = 0;
    Ok(pipeline
        .stages
        .iter()
        .map(|stage| {
            let found = summary.stages[next..].iter().position(|w| w.stage == stage.name)?;
            next += found + 1;
            Some(&summary.stages[next - 1])
        })
        .collect())
}

/// One occurrence's working memory as a run measured it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Working {
    /// On the host: the RSS peak minus the weights.
    pub host: u64,
    /// On a device run: the device peak minus the weights.
    pub device: Option<u64>,
}

/// Working memory per stage occurrence from one run.
#[derive(Debug, Clone, Serialize)]
pub struct Measured {
    /// The trace the run wrote.
    pub trace: PathBuf,
    /// Per occurrence; `None` where the run has no window for it.
    pub working: Vec<Option<Working>>,
    /// The trace has no exact peak records: the peaks are the largest samples.
    pub sampled_only: bool,
    /// The run was on a device (`cuda:0`, `mps`): its weights are device memory.
    pub device_run: bool,
}

impl Measured {
    /// Reads the working memory of each stage occurrence of `pipeline` from a recorded run.
    pub fn from_trace(pipeline: &Pipeline, trace: &Trace) -> Result<Measured, ForeignStages> {
        let summary = summarize(trace);
        let device_run = summary.on_device();
        let windows = match_windows(pipeline, &summary, &trace.path)?;
        let working = windows
            .iter()
            .map(|window| {
                let window = (*window)?;
                let weights = window.weights.unwrap_or(0);
                Some(if device_run {
                    Working { host: window.peak?, device: window.device_peak.map(|p| p.saturating_sub(weights)) }
                } else {
                    Working { host: window.peak?.saturating_sub(weights), device: None }
                })
            })
            .collect();
        let sampled_only = !trace.records.iter().any(|r| matches!(r, Record::Peak(_)));
        Ok(Measured { trace: trace.path.clone(), working, sampled_only, device_run })
    }

    /// `pipeline` with each measured occurrence's working memory in place of the file's.
    pub fn apply(&self, pipeline: &Pipeline) -> Pipeline {
        let mut measured = pipeline.clone();
        for (stage, working) in measured.stages.iter_mut().zip(&self.working) {
            if let Some(working) = working {
                stage.working = working.host;
                if let Some(device) = working.device {
                    stage.device_working = device;
                }
            }
        }
        measured
    }

    /// Where the numbers came from, and what they leave out, for the plan's text.
    pub fn describe(&self, pipeline: &Pipeline) -> String {
        let mut out = format!("working memory measured in {}", self.trace.display());
        if self.sampled_only {
            out += " (no exact peak records in it: the largest samples, which may miss a spike)";
        }
        let uncovered: Vec<&str> = pipeline
            .stages
            .iter()
            .zip(&self.working)
            .filter(|(_, w)| w.is_none())
            .map(|(s, _)| s.name.as_str())
            .collect();
        if !uncovered.is_empty() {
            out += &format!("; not in the run, the file's numbers kept: {}", uncovered.join(", "));
        }
        out + "\n"
    }
}

/// One occurrence of the plan against the same occurrence of a run.
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct StageCheck {
    /// The stage's name.
    pub stage: String,
    /// Bytes of weights the plan has resident in it.
    pub planned_weights: u64,
    /// Bytes of weights the run had resident (`None`: the run has no window for it).
    pub run_weights: Option<u64>,
    /// Bytes the plan says the occurrence needs (weights and working memory).
    pub planned_need: u64,
    /// The run's memory peak in it, bytes.
    pub run_peak: Option<u64>,
    /// How the peak met the need.
    #[serde(default)]
    pub fit: PeakFit,
    /// The weights match exactly and the peak is within the tolerance of the need.
    pub ok: bool,
}

/// A stage's run peak against the plan's need, with [`PEAK_TOLERANCE`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PeakFit {
    /// Within the tolerance of the need.
    Within,
    /// More than the tolerance below the need: the plan errs on the safe side.
    Below,
    /// More than the tolerance above the need: the run needed more than the plan says.
    Above,
    /// The run has no peak for the stage.
    #[default]
    Unmeasured,
}

impl StageCheck {
    /// Whether the stage holds: `ok`, or with `allow_below` a peak below the need (the weights
    /// still exact).
    pub fn passes(&self, allow_below: bool) -> bool {
        self.ok || (allow_below && self.fit == PeakFit::Below && self.run_weights == Some(self.planned_weights))
    }
}

/// The relative tolerance of a checked peak against the planned need.
pub const PEAK_TOLERANCE: f64 = 0.05;

/// A plan as `stageload plan` reports it: the plan, and (with `--check`) the plan against a
/// recorded run, stage by stage. Its JSON is the plan's with a `check` field beside.
#[derive(Debug, Clone, Serialize)]
pub struct PlanReport {
    /// The plan.
    #[serde(flatten)]
    pub plan: Plan,
    /// With `--check`: each occurrence against the recorded run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub check: Option<Vec<StageCheck>>,
    /// `--check-allow-below`: a stage that peaked below its need by more than the tolerance
    /// passes ([`StageCheck::passes`]).
    #[serde(skip)]
    pub allow_below: bool,
}

impl PlanReport {
    /// Whether the plan fits and every stage checked (if any) holds.
    pub fn ok(&self) -> bool {
        self.plan.fits && self.check.as_ref().is_none_or(|checks| checks.iter().all(|c| c.passes(self.allow_below)))
    }
}

/// Checks `plan` against a run of the same pipeline: per occurrence, the resident weights
/// exactly, the peak within [`PEAK_TOLERANCE`] of the need (host on a CPU run; device on a
/// device run).
pub fn check(pipeline: &Pipeline, plan: &Plan, run: &Trace) -> Result<Vec<StageCheck>, ForeignStages> {
    let summary = summarize(run);
    let device_run = summary.on_device();
    let windows = match_windows(pipeline, &summary, &run.path)?;
    Ok(plan
        .stages
        .iter()
        .zip(windows)
        .map(|(stage, window)| {
            let (planned_weights, planned_need, run_peak) = if device_run {
                (
                    stage.weights.saturating_add(stage.device_weights),
                    stage.device_need,
                    window.and_then(|w| w.device_peak),
                )
            } else {
                (stage.weights, stage.need, window.and_then(|w| w.peak))
            };
            let run_weights = window.and_then(|w| w.weights);
            let band = planned_need as f64 * PEAK_TOLERANCE;
            let fit = match run_peak.map(|peak| peak as f64 - planned_need as f64) {
                None => PeakFit::Unmeasured,
                Some(off) if off.abs() <= band => PeakFit::Within,
                Some(off) if off < 0.0 => PeakFit::Below,
                Some(_) => PeakFit::Above,
            };
            let ok = run_weights == Some(planned_weights) && fit == PeakFit::Within;
            StageCheck { stage: stage.name.clone(), planned_weights, run_weights, planned_need, run_peak, fit, ok }
        })
        .collect())
}

/// The checks as a table; with `allow_below`, a stage that passes only by it says so.
pub fn render_checks(checks: &[StageCheck], run: &Path, allow_below: bool) -> String {
    let bytes = |b: Option<u64>| b.map_or("-".to_string(), format_bytes);
    let mut out = format!(
        "plan against {} (weights exact, peak within {:.0} % of the need):\n{:<14} {:>13} {:>13} {:>13} {:>13} {:>7}  ok\n",
        run.display(),
        PEAK_TOLERANCE * 100.0,
        "stage",
        "plan weights",
        "run weights",
        "plan need",
        "run peak",
        "peak/need"
    );
    for c in checks {
        let ratio = c.run_peak.map_or("-".to_string(), |p| format!("{:.3}", p as f64 / c.planned_need.max(1) as f64));
        out += &format!(
            "{:<14} {:>13} {:>13} {:>13} {:>13} {:>7}  {}\n",
            c.stage,
            format_bytes(c.planned_weights),
            bytes(c.run_weights),
            format_bytes(c.planned_need),
            bytes(c.run_peak),
            ratio,
            match (c.ok, c.passes(allow_below)) {
                (true, _) => "yes",
                (false, true) => "below (the plan errs safe; allowed)",
                (false, false) => "NO",
            }
        );
    }
    out
}
