//! diffusers' own `WanPipeline` on the same export, token ids and seed
//! (`scripts/reference/wan_reference.py`), and the largest differences of a Rust run from it.

use std::collections::HashMap;
use std::fmt;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use stageload::BoxError;
use tch::Tensor;

use super::{Export, Generated, Sampling};
use crate::pipeline::{reference_script, run_script, Difference, TOLERANCE};

/// What diffusers computed.
#[derive(Debug)]
pub struct Reference {
    /// Its tensors (`wan_reference.py`'s documentation lists them).
    pub tensors: HashMap<String, Tensor>,
    /// The script's JSON summary (wall times, peak resident set, versions).
    pub summary: serde_json::Value,
    /// Its wall time, start to exit.
    pub seconds: f64,
}

/// Runs the reference with `python` on `export` with the run's seed and settings, in `folder` (its
/// output, summary and log stay there), stopped after `deadline`. diffusers runs on the export's
/// own token ids (the script's stand-in tokenizer gives them).
pub fn run_reference(
    python: &Path,
    export: &Export,
    seed: i64,
    sampling: Sampling,
    folder: &Path,
    deadline: Duration,
) -> Result<Reference, BoxError> {
    let output = folder.join("reference.safetensors");
    let summary = folder.join("summary.json");
    let script = reference_script("wan_reference.py");
    let mut command = Command::new(python);
    command
        .arg(&script)
        .arg("--components")
        .arg(export.dir())
        .args(["--steps", &sampling.steps.to_string(), "--guidance", &sampling.guidance.to_string()])
        .args(["--seed", &seed.to_string()])
        .arg("--out")
        .arg(&output)
        .arg("--summary")
        .arg(&summary);
    let started = Instant::now();
    run_script(command, "diffusers' WanPipeline", &folder.join("reference.log"), deadline)?;
    let seconds = started.elapsed().as_secs_f64();
    let tensors = Tensor::read_safetensors(&output)?.into_iter().collect();
    let text = std::fs::read_to_string(&summary).map_err(|e| format!("reading {}: {e}", summary.display()))?;
    let summary = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", summary.display()))?;
    Ok(Reference { tensors, summary, seconds })
}

/// A run against the reference: each compared tensor's largest difference, and the checks that are
/// equal or not.
#[derive(Debug)]
pub struct Comparison {
    /// (what, difference) for every tensor both sides have.
    pub differences: Vec<(&'static str, Difference)>,
    /// Checks that hold or not: the timesteps, the frames' pixels.
    pub equal: Vec<(&'static str, bool)>,
}

impl Comparison {
    /// The differences between `generated` and `reference`; a tensor the reference did not write
    /// is an error.
    pub fn of(generated: &Generated, reference: &Reference) -> Result<Comparison, BoxError> {
        let get = |name: &str| reference.tensors.get(name).ok_or_else(|| format!("the reference wrote no {name}"));
        let mut differences =
            vec![("prompt_embeds", Difference::of("prompt_embeds", &generated.prompt_embeds, get("prompt_embeds")?)?)];
        if let Some(negative) = &generated.negative_prompt_embeds {
            let want = get("negative_prompt_embeds")?;
            differences.push(("negative_embeds", Difference::of("negative_prompt_embeds", negative, want)?));
        }
        for (what, rust) in [
            ("initial_latents", &generated.initial_latents),
            ("final_latents", &generated.final_latents),
            ("video", &generated.video),
        ] {
            differences.push((what, Difference::of(what, rust, get(what)?)?));
        }
        let timesteps = Vec::<i64>::try_from(get("timesteps")?)?;
        let frames = get("frames")?;
        let equal = vec![
            ("timesteps", timesteps == generated.timesteps),
            ("frames", frames.size() == generated.frames.size() && frames.equal(&generated.frames)),
        ];
        Ok(Comparison { differences, equal })
    }

    /// What is not as diffusers has it: each check that fails and each tensor whose largest
    /// difference is over [`TOLERANCE`] of its range. Empty: the run matches.
    pub fn failures(&self) -> Vec<String> {
        let checks = self.equal.iter().filter(|(_, ok)| !ok).map(|(what, _)| format!("{what}: not equal"));
        let tensors = self
            .differences
            .iter()
            .filter(|(_, d)| d.relative() > TOLERANCE)
            .map(|(what, d)| format!("{what}: largest difference {d}, over {TOLERANCE:e} of the range"));
        checks.chain(tensors).collect()
    }

    /// Whether every tensor is equal to the reference's (largest difference 0) and every check holds.
    pub fn identical(&self) -> bool {
        self.differences.iter().all(|(_, d)| d.largest == 0.0) && self.equal.iter().all(|(_, ok)| *ok)
    }
}

impl fmt::Display for Comparison {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (what, difference) in &self.differences {
            writeln!(f, "{what:<16} {difference}")?;
        }
        let checks: Vec<String> =
            self.equal.iter().map(|(what, ok)| format!("{what} {}", if *ok { "equal" } else { "DIFFER" })).collect();
        write!(f, "{}", checks.join(", "))
    }
}
