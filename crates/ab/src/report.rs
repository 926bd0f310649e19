//! What an A/B run found: each run's ending (and the stage it reached), per-stage peaks
//! aggregated per arm, wall times and the result files' measures (medians and ratios, from
//! [`crate::results`]), and each arm's latents against the first arm's, as text and JSON.

use serde::{Deserialize, Serialize};
use stageload_trace::{read_trace, summarize, Summary, Trace};
use stageload_units::format_bytes;

use crate::latents::{compare, render as render_latents, LatentError, LatentFile, LatentReport};
use crate::results::{self, number, Medians, ResultField};
use crate::runner::{describe, Arm, RunRecord};
use stageload_trace::aggregate::{aggregate, Spread, StageSpread};

/// One run as the report lists it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunLine {
    /// Its arm's name.
    pub arm: String,
    /// 1-based round.
    pub round: usize,
    /// How it ended, in words.
    pub ending: String,
    /// Its exit code (see `stageload_guard::Outcome::exit_code`).
    pub exit: i32,
    /// The last stage its trace shows (where a stopped run stopped).
    pub reached: Option<String>,
    /// Why its trace could not be read, if it could not.
    pub trace_error: Option<String>,
    /// Why its result file could not be read, if it wrote one that could not.
    pub result_error: Option<String>,
}

/// The whole comparison: what `stageload ab` writes as `ab.json`, and what a reader of that file
/// (`cargo xtask`'s tasks) reads back.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AbReport {
    /// The arms' names; the first is the reference.
    pub arms: Vec<String>,
    /// Every run, in the order run.
    pub runs: Vec<RunLine>,
    /// Per stage, each arm's peaks over its runs.
    pub stages: Vec<StageSpread>,
    /// Per arm after the first: its latents against the first arm's.
    pub latents: Vec<(String, Vec<LatentReport>)>,
    /// Why latents could not be compared, if they could not.
    pub latents_error: Option<String>,
    /// Per arm, how long its runs took (each trace's first sample to its last, seconds).
    pub wall: Vec<Medians>,
    /// Every numeric field of the runs' result files, per arm.
    pub results: Vec<ResultField>,
    /// Every run exited 0, every result file it wrote reads, and every latent is identical or
    /// within the reference's variation.
    pub passed: bool,
}

/// The traces of the runs that have one, with their summaries, by arm.
pub type Traces = Vec<Vec<(Trace, Summary)>>;

/// Builds the report from the runs' files.
pub fn report(arms: &[Arm], records: &[RunRecord]) -> (AbReport, Traces) {
    let mut traces: Traces = vec![Vec::new(); arms.len()];
    let mut runs = Vec::new();
    let mut objects = vec![Vec::new(); arms.len()];
    for record in records {
        let result_error = match results::read(&record.files.result) {
            Ok(object) => {
                objects[record.arm].extend(object);
                None
            }
            Err(error) => Some(error.to_string()),
        };
        let (reached, trace_error) = match read_trace(&record.files.trace) {
            Ok(trace) => {
                let summary = summarize(&trace);
                let reached = summary.stages.last().map(|w| w.stage.clone());
                traces[record.arm].push((trace, summary));
                (reached, None)
            }
            Err(error) => (None, Some(error.to_string())),
        };
        runs.push(RunLine {
            arm: arms[record.arm].name.clone(),
            round: record.round,
            ending: describe(&record.outcome),
            exit: record.exit,
            reached,
            trace_error,
            result_error,
        });
    }
    let summaries: Vec<Vec<&Summary>> = traces.iter().map(|t| t.iter().map(|(_, s)| s).collect()).collect();
    let stages = aggregate(&summaries);
    let (latents, latents_error) = match compare_latents(arms, records) {
        Ok(latents) => (latents, None),
        Err(error) => (Vec::new(), Some(error.to_string())),
    };
    let passed = records.iter().all(|r| r.exit == 0)
        && runs.iter().all(|r| r.result_error.is_none())
        && latents_error.is_none()
        && latents.iter().flat_map(|(_, reports)| reports).all(|r| r.verdict.passes());
    let arms: Vec<String> = arms.iter().map(|a| a.name.clone()).collect();
    let seconds: Vec<Vec<f64>> = traces.iter().map(|t| t.iter().map(|(_, s)| s.duration).collect()).collect();
    let wall = results::medians(&arms, &seconds);
    let results = results::fields(&arms, &objects);
    (AbReport { arms, runs, stages, latents, latents_error, wall, results, passed }, traces)
}

/// Each later arm's latents files against the first arm's (runs without a file are left out).
fn compare_latents(arms: &[Arm], records: &[RunRecord]) -> Result<Vec<(String, Vec<LatentReport>)>, LatentError> {
    let files = |arm: usize| -> Result<Vec<LatentFile>, LatentError> {
        records
            .iter()
            .filter(|r| r.arm == arm && r.files.latents.exists())
            .map(|r| LatentFile::read(&r.files.latents))
            .collect()
    };
    let reference = files(0)?;
    if reference.is_empty() {
        return Ok(Vec::new());
    }
    (1..arms.len()).map(|arm| Ok((arms[arm].name.clone(), compare(&reference, &files(arm)?)?))).collect()
}

fn spread_text(spread: &Option<Spread>) -> String {
    match spread {
        None => "-".to_string(),
        Some(s) if s.n == 1 => format_bytes(s.median),
        Some(s) => format!("{} ({} – {})", format_bytes(s.median), format_bytes(s.min), format_bytes(s.max)),
    }
}

/// The report as text.
pub fn render(report: &AbReport) -> String {
    let mut out = String::from("runs (alternating):\n");
    for run in &report.runs {
        let reached = run.reached.as_deref().map_or(String::new(), |s| format!(", last stage {s}"));
        let errors: String =
            [&run.trace_error, &run.result_error].into_iter().flatten().map(|e| format!(" [{e}]")).collect();
        out += &format!("  {} {}: {}{reached}{errors}\n", run.arm, run.round, run.ending);
    }
    out += "\nwall time per run (each trace's first sample to its last), median; ratio = median / the first arm's:\n";
    for wall in &report.wall {
        let runs: Vec<String> = wall.values.iter().map(|s| format!("{s:.1}")).collect();
        let median = wall.median.map_or("-".to_string(), |m| format!("{m:.1} s"));
        let ratio = wall.ratio.map_or("-".to_string(), |r| format!("{r:.3}"));
        out += &format!("  {:<14} {median:>9}  ratio {ratio}  (runs: {} s)\n", wall.arm, runs.join(", "));
    }
    out += &render_results(report);
    out += "\npeak per stage, median (min – max) over the runs; ratio = median / the first arm's median:\n";
    out += &header("stage", [14, 34, 10], &report.arms);
    for stage in &report.stages {
        let mut line = format!("  {:<14}", stage.stage);
        for spread in &stage.host {
            line += &format!(" {:>34}", spread_text(spread));
        }
        for ratio in stage.ratio.iter().skip(1) {
            line += &format!(" {:>10}", ratio.map_or("-".to_string(), |r| format!("{r:.3}")));
        }
        out += &line;
        out += "\n";
        if stage.device.iter().any(Option::is_some) {
            let mut line = format!("  {:<14}", "  (device)");
            for spread in &stage.device {
                line += &format!(" {:>34}", spread_text(spread));
            }
            out += &line;
            out += "\n";
        }
    }
    out += "\n";
    match (&report.latents_error, report.latents.is_empty()) {
        (Some(error), _) => out += &format!("latents: not compared: {error}\n"),
        (None, true) => out += "latents: none written (the commands did not write $STAGELOAD_LATENTS)\n",
        (None, false) => {
            for (arm, reports) in &report.latents {
                out += &format!("latents, {arm} against {}:\n", report.arms[0]);
                out += &render_latents(reports, &report.arms[0]);
            }
        }
    }
    out += if report.passed {
        "\nverdict: every run finished and every latent matches\n"
    } else {
        "\nverdict: FAILED (see above)\n"
    };
    out
}

/// A table's header line: `label`, each arm, then each later arm over the first; `widths` are
/// the label's, a value column's and a ratio column's.
fn header(label: &str, [label_width, value, ratio]: [usize; 3], arms: &[String]) -> String {
    let mut line = format!("  {label:<label_width$}");
    for arm in arms {
        line += &format!(" {arm:>value$}");
    }
    for arm in arms.iter().skip(1) {
        line += &format!(" {:>ratio$}", format!("{arm}/{}", arms[0]));
    }
    line + "\n"
}

/// The result files' measures: one line per field, each arm's median, then the ratios.
fn render_results(report: &AbReport) -> String {
    if report.results.is_empty() {
        return String::new();
    }
    let mut out = String::from(
        "\nresults (each run's ARM-ROUND.json, its numeric fields), median; ratio = median / the first arm's:\n",
    );
    out += &header("field", [20, 14, 14], &report.arms);
    for field in &report.results {
        let mut line = format!("  {:<20}", field.field);
        for arm in &field.arms {
            line += &format!(" {:>14}", arm.median.map_or("-".to_string(), number));
        }
        for arm in field.arms.iter().skip(1) {
            line += &format!(" {:>14}", arm.ratio.map_or("-".to_string(), |r| format!("{r:.3}")));
        }
        out += &line;
        out += "\n";
    }
    out
}
