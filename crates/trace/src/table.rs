//! Summaries as text: one table per trace, and a side-by-side table of per-stage peaks for
//! several traces (eager against staged) with the differences.

use stageload_units::format_bytes;

use crate::summary::Summary;

/// The name a trace goes by in tables and charts: its `mode` meta field, else the file stem.
pub fn label(summary: &Summary, path: &std::path::Path) -> String {
    summary
        .header
        .as_ref()
        .and_then(|h| h.meta.get("mode"))
        .and_then(|mode| mode.as_str().map(str::to_string))
        .unwrap_or_else(|| path.file_stem().map_or("trace".into(), |s| s.to_string_lossy().into_owned()))
}

fn opt_bytes(value: Option<u64>) -> String {
    value.map_or("-".to_string(), format_bytes)
}

/// One trace's summary as a table.
pub fn render(summary: &Summary, path: &std::path::Path) -> String {
    let mut out = format!("trace {} ({})", path.display(), label(summary, path));
    if let Some(header) = &summary.header {
        out += &format!(", pid {} on {}, device {}", header.pid, header.host, header.device);
    }
    out += if summary.complete { "\n" } else { ", ended without its end record (killed?)\n" };
    out +=
        &format!("peak {} at {:.1} s; {:.1} s in all\n", format_bytes(summary.peak), summary.peak_t, summary.duration);
    let loads = &summary.loads;
    out += &format!(
        "loads: {} ({} reloads), {} in {:.2} s ({:.2} GB/s); releases: {}, {}\n",
        loads.count,
        loads.reloads,
        format_bytes(loads.bytes),
        loads.seconds,
        loads.gb_per_s,
        summary.releases.count,
        format_bytes(summary.releases.bytes)
    );
    if let Some(swap) = summary.swap {
        out += &format!(
            "system swap: start {}, peak {}, end {}; process swap peak {}\n",
            format_bytes(swap.start),
            format_bytes(swap.peak),
            format_bytes(swap.end),
            opt_bytes(summary.process_swap_peak)
        );
    }
    out += &format!("lowest available memory: {}\n", opt_bytes(summary.min_available));
    if summary.device_allocated_peak.is_some() {
        out += &format!(
            "device: allocated peak {}, reserved peak {}\n",
            opt_bytes(summary.device_allocated_peak),
            opt_bytes(summary.device_reserved_peak)
        );
    }
    for streamed in &summary.streamed {
        let r = &streamed.residency;
        out += &format!(
            "streamed {}: {} of {} blocks resident, {} streamed, {} per step, budget {}{} (split set {} time(s): {})\n",
            streamed.model,
            r.resident,
            r.blocks,
            r.blocks.saturating_sub(r.resident),
            format_bytes(r.streamed_per_step),
            format_bytes(r.budget),
            if r.hot > 0 { format!(", hot set room {}", format_bytes(r.hot)) } else { String::new() },
            streamed.reasons.len(),
            streamed.reasons.join(", ")
        );
        let moved = &streamed.moved;
        if moved.refills > 0 || moved.hot_hits > 0 {
            out += &format!(
                "  read {} block(s), {} at {:.2} GB/s; {} found hot\n",
                moved.refills,
                format_bytes(moved.bytes),
                moved.bytes as f64 / moved.seconds.max(1e-9) / 1e9,
                moved.hot_hits
            );
        }
    }
    let loads = &summary.loads;
    if loads.snapshots_written > 0 || !loads.snapshots_not_written.is_empty() {
        out +=
            &format!("snapshots: {} written, {} reload(s) from them\n", loads.snapshots_written, loads.from_snapshot);
        for reason in &loads.snapshots_not_written {
            out += &format!("  not written: {reason}\n");
        }
    }
    if let Some(tier) = &summary.host_tier {
        out += &format!(
            "host tier: budget {}, held at most {}; {} stored, {} evicted, {} reload(s) from it ({} at {:.2} GB/s)\n",
            format_bytes(tier.budget),
            format_bytes(tier.peak_used),
            tier.stored,
            tier.evicted,
            tier.reloads,
            format_bytes(tier.reload_bytes),
            tier.reload_gb_per_s
        );
        for reason in &tier.not_stored {
            out += &format!("  not stored: {reason}\n");
        }
    }
    if !summary.outside_stage.is_empty() {
        out += &format!("loaded outside their stage: {}\n", summary.outside_stage.join(", "));
    }
    for error in &summary.errors {
        out += &format!("reading failed at {:.1} s ({}): {}\n", error.t, error.source, error.error);
    }
    // On a device the weights live there: its peak is the column to read them against.
    let device = summary.stages.iter().any(|s| s.device_peak.is_some());
    out += &format!(
        "\n{:<16} {:>9} {:>9} {:>12} {:>12} {:>12}{}\n",
        "stage",
        "start s",
        "time s",
        "host peak",
        "sampled",
        "weights",
        if device { format!(" {:>12}", "device peak") } else { String::new() }
    );
    for stage in &summary.stages {
        out += &format!(
            "{:<16} {:>9.2} {:>9.2} {:>12} {:>12} {:>12}{}\n",
            stage.stage,
            stage.start,
            stage.seconds,
            opt_bytes(stage.peak),
            opt_bytes(stage.sampled_peak),
            opt_bytes(stage.weights),
            if device { format!(" {:>12}", opt_bytes(stage.device_peak)) } else { String::new() }
        );
    }
    out
}

/// One stage of [`against_eager`]: what staging should hold and what it held.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct StageCheck {
    /// The stage.
    pub stage: String,
    /// Weights resident in the stage in the staged run, bytes.
    pub staged_weights: u64,
    /// Eager peak − eager weights: the stage's working memory plus the process's base.
    pub working: u64,
    /// `staged_weights + working`: the stage's own weights and working memory, nothing else.
    pub expected: u64,
    /// The staged run's peak in the stage, bytes.
    pub staged_peak: u64,
    /// The eager run's peak in the stage, bytes.
    pub eager_peak: u64,
    /// `host` (RSS) or `device` (the device's allocated peak): where the weights live.
    pub memory: &'static str,
}

impl StageCheck {
    /// Staged peak over what the stage needs (≤ 1.05: nothing left over from earlier stages).
    pub fn ratio(&self) -> f64 {
        self.staged_peak as f64 / self.expected.max(1) as f64
    }
}

/// Checks a staged run against an eager run of the same pipeline, stage by stage: the staged
/// peak against the stage's own weights plus the working memory the eager run shows. Stages
/// missing a peak or weights in either trace are left out.
pub fn against_eager(eager: &Summary, staged: &Summary) -> Vec<StageCheck> {
    // Weights on a device are checked against that device's peaks, never against host RSS.
    let device = eager.on_device() && staged.on_device();
    let peak = |w: &crate::summary::StageWindow| if device { w.device_peak } else { w.peak };
    staged
        .stages
        .iter()
        .filter_map(|window| {
            let eager_window = eager.stages.iter().find(|w| w.stage == window.stage)?;
            let (eager_peak, eager_weights) = (peak(eager_window)?, eager_window.weights?);
            let (staged_peak, staged_weights) = (peak(window)?, window.weights?);
            let working = eager_peak.saturating_sub(eager_weights);
            Some(StageCheck {
                stage: window.stage.clone(),
                staged_weights,
                working,
                expected: staged_weights + working,
                staged_peak,
                eager_peak,
                memory: if device { "device" } else { "host" },
            })
        })
        .collect()
}

/// [`against_eager`] as a table.
pub fn render_checks(checks: &[StageCheck]) -> String {
    let memory = checks.first().map_or("host", |c| c.memory);
    let mut out = format!("peaks of {memory} memory (where the weights live)\n");
    out += &format!(
        "{:<16} {:>14} {:>12} {:>12} {:>12} {:>12} {:>8} {:>12}\n",
        "stage", "staged weights", "working", "expected", "staged peak", "eager peak", "ratio", "eager/staged"
    );
    for check in checks {
        out += &format!(
            "{:<16} {:>14} {:>12} {:>12} {:>12} {:>12} {:>8.3} {:>11.2}x\n",
            check.stage,
            format_bytes(check.staged_weights),
            format_bytes(check.working),
            format_bytes(check.expected),
            format_bytes(check.staged_peak),
            format_bytes(check.eager_peak),
            check.ratio(),
            check.eager_peak as f64 / check.staged_peak.max(1) as f64
        );
    }
    out
}

/// Several traces side by side: per-stage peaks, each against the first trace, and the totals.
pub fn compare(summaries: &[(String, &Summary)]) -> String {
    let Some((base_label, _)) = summaries.first() else {
        return String::new();
    };
    let mut stages: Vec<String> = Vec::new();
    for (_, summary) in summaries {
        for window in &summary.stages {
            if !stages.contains(&window.stage) {
                stages.push(window.stage.clone());
            }
        }
    }
    let mut out = format!("{:<16}", "stage");
    for (label, _) in summaries {
        out += &format!(" {label:>12}");
    }
    for (label, _) in &summaries[1..] {
        out += &format!(" {:>22}", format!("{label} - {base_label}"));
        out += &format!(" {:>8}", format!("{base_label}/{label}"));
    }
    out += "\n";
    let peak_of =
        |summary: &Summary, stage: &str| summary.stages.iter().find(|w| w.stage == stage).and_then(|w| w.peak);
    let mut row = |name: &str, values: Vec<Option<u64>>| {
        out += &format!("{name:<16}");
        for value in &values {
            out += &format!(" {:>12}", opt_bytes(*value));
        }
        for value in &values[1..] {
            match (values[0], *value) {
                (Some(base), Some(other)) => {
                    let difference = other as i128 - base as i128;
                    let sign = if difference < 0 { "-" } else { "+" };
                    out += &format!(" {:>22}", format!("{sign}{}", format_bytes(difference.unsigned_abs() as u64)));
                    out += &format!(
                        " {:>8}",
                        if other > 0 { format!("{:.2}x", base as f64 / other as f64) } else { "-".into() }
                    );
                }
                _ => out += &format!(" {:>22} {:>8}", "-", "-"),
            }
        }
        out += "\n";
    };
    for stage in &stages {
        row(stage, summaries.iter().map(|(_, s)| peak_of(s, stage)).collect());
    }
    row("overall peak", summaries.iter().map(|(_, s)| Some(s.peak)).collect());
    row("bytes loaded", summaries.iter().map(|(_, s)| Some(s.loads.bytes)).collect());
    out += &format!("{:<16}", "load seconds");
    for (_, summary) in summaries {
        out += &format!(" {:>12.2}", summary.loads.seconds);
    }
    out += &format!("\n{:<16}", "run seconds");
    for (_, summary) in summaries {
        out += &format!(" {:>12.2}", summary.duration);
    }
    out += "\n";
    out
}
