//! diffusers' own `WanPipeline` on the same export, token ids and seed
//! (`scripts/reference/wan_reference.py`), and the largest differences of a Rust run from it.

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use stageload::BoxError;
use tch::Tensor;

use super::{Export, Generated, Sampling};
pub use crate::compare::Comparison;
use crate::compare::{
    read_summary, reference_command, reference_tensor, run_reference_script, Difference, ScriptOutput,
};

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
    let mut command =
        reference_command(python, "wan_reference.py", export.dir(), sampling.steps, sampling.guidance, &output);
    command.args(["--seed", &seed.to_string()]).arg("--summary").arg(&summary);
    let log = folder.join("reference.log");
    let ScriptOutput { tensors, seconds } =
        run_reference_script(command, "diffusers' WanPipeline", &log, &output, deadline)?;
    let summary = read_summary(&summary)?;
    Ok(Reference { tensors, summary, seconds })
}

/// The differences between `generated` and `reference`: the embeddings (the negative prompt's
/// only with guidance, and then the reference must have written them too), the latents and the
/// video; the timesteps and the frames' pixels equal or not. A tensor the reference did not write
/// is an error.
pub fn compare(generated: &Generated, reference: &Reference) -> Result<Comparison, BoxError> {
    let get = |name: &str| reference_tensor(&reference.tensors, name);
    let mut differences = Vec::new();
    let mut equal = Vec::new();
    let pairs = [
        ("prompt_embeds", Some(&generated.prompt_embeds)),
        ("negative_prompt_embeds", generated.negative_prompt_embeds.as_ref()),
        ("initial_latents", Some(&generated.initial_latents)),
        ("final_latents", Some(&generated.final_latents)),
        ("video", Some(&generated.video)),
    ];
    for (what, rust) in pairs {
        match rust {
            Some(rust) => differences.push((what, Difference::of(what, rust, get(what)?)?)),
            // No guidance: diffusers encodes no negative prompt either.
            None => equal.push(("no negative prompt on either side", !reference.tensors.contains_key(what))),
        }
    }
    let timesteps = Vec::<i64>::try_from(get("timesteps")?)?;
    let frames = get("frames")?;
    equal.push(("timesteps", timesteps == generated.timesteps));
    let same_frames = (frames.kind(), frames.size()) == (generated.frames.kind(), generated.frames.size())
        && frames.equal(&generated.frames);
    equal.push(("frames", same_frames));
    Ok(Comparison { differences, equal })
}
