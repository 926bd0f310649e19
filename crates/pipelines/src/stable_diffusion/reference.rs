//! Running diffusers' `StableDiffusionPipeline` itself (`scripts/reference/sd_reference.py`) on
//! an export, given a run's embeddings and initial latents ([`run_reference`]), and comparing the
//! two ([`compare`]).

use std::path::Path;
use std::time::Duration;

use stageload::BoxError;
use tch::{Device, Kind, Tensor};

use super::{Export, Generated, Sampling};
pub use crate::compare::Comparison;
use crate::compare::{
    reference_command, reference_tensor, run_reference_script, CompareError, Difference, ScriptOutput,
};

/// What diffusers' `StableDiffusionPipeline` gave on the same weights and inputs.
#[derive(Debug)]
pub struct Reference {
    /// The decoded image.
    pub image: Tensor,
    /// The prompt's text embeddings.
    pub embeds: Tensor,
    /// The empty prompt's text embeddings.
    pub negative_embeds: Tensor,
    /// The latents after the last step.
    pub final_latents: Tensor,
    /// The scheduler's timesteps.
    pub timesteps: Vec<i64>,
    /// The script's output (its JSON summary and its log).
    pub log: String,
    /// How long the script ran.
    pub seconds: f64,
}

/// Runs `sd_reference.py` with `python` on `export`, given `generated`'s embeddings and initial
/// latents, in `folder` (its inputs, output and log go there), and reads what it wrote. Past
/// `deadline` the script is killed (by its pid) and that is the error.
pub fn run_reference(
    python: &Path,
    export: &Export,
    generated: &Generated,
    sampling: Sampling,
    folder: &Path,
    deadline: Duration,
) -> Result<Reference, BoxError> {
    let (inputs, output, log) = (
        folder.join("sd-inputs.safetensors"),
        folder.join("sd-reference.safetensors"),
        folder.join("sd-reference.log"),
    );
    let cpu = |t: &Tensor| t.to_device(Device::Cpu).contiguous();
    let named = [
        ("prompt_embeds", cpu(&generated.embeds)),
        ("negative_prompt_embeds", cpu(&generated.negative_embeds)),
        ("latents", cpu(&generated.latents)),
    ];
    Tensor::write_safetensors(&named, &inputs).map_err(|e| format!("writing {}: {e}", inputs.display()))?;
    let mut command =
        reference_command(python, "sd_reference.py", export.dir(), sampling.steps, sampling.guidance, &output);
    command.arg("--inputs").arg(&inputs).args(["--device", &stageload::device::name(generated.latents.device())]);
    let what = "diffusers' StableDiffusionPipeline (sd_reference.py)";
    let ScriptOutput { tensors, seconds } = run_reference_script(command, what, &log, &output, deadline)?;
    let take = |name: &str| reference_tensor(&tensors, name).map(Tensor::shallow_clone);
    let timesteps = take("timesteps")?;
    let timesteps = Vec::<i64>::try_from(&timesteps.to_kind(Kind::Int64).flatten(0, -1))
        .map_err(|source| CompareError::Tensor { what: "timesteps".to_string(), source })?;
    Ok(Reference {
        image: take("image")?,
        embeds: take("embeds")?,
        negative_embeds: take("negative_embeds")?,
        final_latents: take("final_latents")?,
        timesteps,
        log: std::fs::read_to_string(&log).unwrap_or_default(),
        seconds,
    })
}

/// The differences between `generated` and `reference`: the image, both prompts' embeddings and
/// the final latents; the timesteps equal or not.
pub fn compare(generated: &Generated, reference: &Reference) -> Result<Comparison, BoxError> {
    let pairs = [
        ("image", &generated.image, &reference.image),
        ("embeds", &generated.embeds, &reference.embeds),
        ("negative_embeds", &generated.negative_embeds, &reference.negative_embeds),
        ("final_latents", &generated.final_latents, &reference.final_latents),
    ];
    let differences = pairs
        .into_iter()
        .map(|(what, rust, python)| Ok((what, Difference::of(what, rust, python)?)))
        .collect::<Result<_, BoxError>>()?;
    Ok(Comparison { differences, equal: vec![("timesteps", generated.timesteps == reference.timesteps)] })
}
