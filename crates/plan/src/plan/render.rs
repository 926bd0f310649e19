//! The plan as `stageload plan` prints it: each model, each stage's residency, needs, verdict,
//! remedy and loads at entry, then the peak, the budget and the verdicts, staged and eager.

use stageload_units::format_bytes;

use super::Plan;
use crate::pipeline::Placement;

impl Plan {
    /// The plan as `stageload plan` prints it.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let list = |names: &[String]| {
            if names.is_empty() {
                "-".to_string()
            } else {
                names.join(", ")
            }
        };
        let has_device = self.models.iter().any(|m| m.placement == Placement::Device);
        out += &format!(
            "pipeline {}: {} models, {} stages\n\n",
            self.pipeline.display(),
            self.models.len(),
            self.stages.len()
        );
        for model in &self.models {
            let holds = match model.built() {
                true => "built by its loader (no checkpoint: size as declared)".to_string(),
                false => format!("{} tensor(s) in {} file(s)", model.tensors, model.files.len()),
            };
            out += &format!(
                "  model {:<20} {:>11} on {:<6} {holds}{}\n",
                model.name,
                format_bytes(model.bytes),
                model.device.to_string(),
                model.dtype.map_or(String::new(), |d| format!(", loaded as {d}"))
            );
        }
        out += "\n";
        for stage in &self.stages {
            out += &format!(
                "stage {}: resident {} ({}), needs {} -> {}\n",
                stage.name,
                list(&stage.resident),
                format_bytes(stage.weights),
                format_bytes(stage.need),
                stage.verdict.describe()
            );
            for model in stage.resident.iter().filter_map(|name| self.models.iter().find(|m| m.name == *name)) {
                if let Some(s) = &model.streamed {
                    out += &format!(
                        "  {} streamed{}: {} of {} blocks resident, {} kept hot, {} per step, holds {} of its {} (budget {}{}){}\n",
                        model.name,
                        if s.any_order { " in any order" } else { "" },
                        s.resident_blocks,
                        s.blocks,
                        s.hot_blocks,
                        format_bytes(s.per_step),
                        format_bytes(s.held),
                        format_bytes(model.bytes),
                        format_bytes(s.budget),
                        s.budget_from.as_ref().map_or(String::new(), |from| format!(": {from}")),
                        match s.host_copies {
                            0 => String::new(),
                            bytes => format!("; its blocks' pinned copies hold {} of host memory", format_bytes(bytes)),
                        }
                    );
                }
            }
            if has_device {
                out += &format!(
                    "  device: weights {}, needs {} -> {}\n",
                    format_bytes(stage.device_weights),
                    format_bytes(stage.device_need),
                    stage.device_verdict.describe()
                );
            }
            if self.host_tier.is_some() && (stage.tier > 0 || !stage.from_tier.is_empty()) {
                out += &format!(
                    "  host tier: holds {} at entry; back from it: {}\n",
                    format_bytes(stage.tier),
                    list(&stage.from_tier)
                );
            }
            if let Some(remedy) = &stage.remedy {
                out += &format!("  to fit (short by {}):", format_bytes(remedy.short_by));
                if remedy.options.is_empty() {
                    out += " nothing to unpin or shrink here: more memory, or a smaller model\n";
                }
                for (what, saves) in &remedy.options {
                    let alone = if *saves >= remedy.short_by { ", enough alone" } else { "" };
                    out += &format!("\n    {what}: saves {}{alone}", format_bytes(*saves));
                }
                if !remedy.options.is_empty() {
                    out += if remedy.together_fits {
                        "\n    all of these together: fits\n"
                    } else {
                        "\n    all of these together: still short\n"
                    };
                }
            }
            let some = |what: &str, names: &[String]| {
                if names.is_empty() {
                    String::new()
                } else {
                    format!("{what}{}", names.join(", "))
                }
            };
            out += &format!(
                "  at entry: releases {}{}; loads {} (reads {}{}{}{})\n",
                list(&stage.released),
                some(", writing the snapshot of ", &stage.snapshots),
                list(&stage.loaded),
                format_bytes(stage.read),
                some(", reloads ", &stage.reloaded),
                some("; from its snapshot: ", &stage.from_snapshot),
                some("; rebuilt by its loader: ", &stage.rebuilt)
            );
        }
        let source = self.budget.source.describe();
        out += &format!(
            "\npeak stage: {} needs {}\nread from disk over the run: {} (eager: {})\nbudget ({source}): {} total, {} available",
            self.peak_stage,
            format_bytes(self.peak_need),
            format_bytes(self.read),
            format_bytes(self.eager.read),
            format_bytes(self.budget.total),
            format_bytes(self.budget.available)
        );
        if let Some(device) = &self.device_budget {
            out += &format!("; device {}", format_bytes(device.total));
        }
        let peak_verdict = self.stages.iter().find(|s| s.name == self.peak_stage).map(|s| s.verdict);
        out += &format!(
            "\nstaged: peak {} -> {}\neager (every model at once): peak {} at {} -> {}\n",
            format_bytes(self.peak_need),
            peak_verdict.map_or(String::new(), |v| v.describe()),
            format_bytes(self.eager.need),
            self.eager.peak_stage,
            self.eager.verdict.describe()
        );
        if has_device {
            out += &format!(
                "device: staged peak {}, eager {} -> {}\n",
                format_bytes(self.device_peak_need),
                format_bytes(self.eager.device_need),
                self.eager.device_verdict.describe()
            );
        }
        if let Some(tier) = &self.host_tier {
            out += &format!("host tier: budget {}", format_bytes(tier.budget));
            out += &match &tier.largest {
                Some((model, bytes)) if !tier.fits() => format!(
                    ", smaller than device model {model} ({}): the registry refuses it at build; raise it to at least that\n",
                    format_bytes(*bytes)
                ),
                Some((model, bytes)) => format!(", largest device model {model} ({}) fits\n", format_bytes(*bytes)),
                None => ", no device model to hold\n".to_string(),
            };
        }
        out += &format!(
            "staging saves {} at the peak\n=> {}\n",
            format_bytes(self.eager.need.saturating_sub(self.peak_need)),
            if self.fits { "fits" } else { "does not fit" }
        );
        out
    }
}
