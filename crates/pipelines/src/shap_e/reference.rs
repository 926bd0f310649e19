//! diffusers' own `ShapEImg2ImgPipeline` on the same export, pixels and seed
//! (`scripts/reference/shap_e_reference.py`), and the largest differences of a Rust run from it.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use stageload::BoxError;
use tch::Tensor;

use super::{Export, Generated, Sampling, Surface};
pub use crate::compare::Comparison;
use crate::compare::{
    read_summary, reference_command, reference_tensor, run_reference_script, Difference, ScriptOutput,
};

/// What diffusers computed.
#[derive(Debug)]
pub struct Reference {
    /// Its tensors (`shap_e_reference.py`'s documentation lists them).
    pub tensors: HashMap<String, Tensor>,
    /// The script's JSON summary (timings, peak resident set, the mesh's size or why there is none).
    pub summary: serde_json::Value,
    /// Its wall time, start to exit.
    pub seconds: f64,
    /// The mesh as diffusers' `export_to_ply` wrote it, when there is one.
    pub ply: Option<PathBuf>,
}

/// Runs the reference with `python` on `pixels` (float32 [1, 3, 224, 224]) and the run's seed
/// and settings, in `folder` (its inputs, outputs and log stay there), stopped after `deadline`.
pub fn run_reference(
    python: &Path,
    export: &Export,
    pixels: &Tensor,
    seed: i64,
    sampling: Sampling,
    folder: &Path,
    deadline: Duration,
) -> Result<Reference, BoxError> {
    let inputs = folder.join("pixels.safetensors");
    let output = folder.join("reference.safetensors");
    let summary = folder.join("summary.json");
    Tensor::write_safetensors(&[("pixel_values", pixels)], &inputs)?;
    let mut command =
        reference_command(python, "shap_e_reference.py", export.dir(), sampling.steps, sampling.guidance, &output);
    command
        .arg("--pixels")
        .arg(&inputs)
        .args(["--frame-size", &sampling.frame_size.to_string(), "--seed", &seed.to_string()])
        .arg("--summary")
        .arg(&summary);
    if !sampling.views {
        command.arg("--no-views");
    }
    let ply = folder.join("diffusers.ply");
    if sampling.mesh {
        command.arg("--ply").arg(&ply);
    } else {
        command.arg("--no-mesh");
    }
    let log = folder.join("reference.log");
    let ScriptOutput { tensors, seconds } =
        run_reference_script(command, "diffusers' ShapEImg2ImgPipeline", &log, &output, deadline)?;
    let summary = read_summary(&summary)?;
    let ply = ply.is_file().then_some(ply);
    Ok(Reference { tensors, summary, seconds, ply })
}

/// The differences between `generated` and `reference`. A tensor the run made and the reference
/// did not write is an error; a mesh on one side only is a failed check.
pub fn compare(generated: &Generated, reference: &Reference) -> Result<Comparison, BoxError> {
    let get = |name: &str| reference_tensor(&reference.tensors, name);
    let mut differences = vec![
        ("image_embeds", Difference::of("image_embeds", &generated.image_embeds, get("image_embeds")?)?),
        ("initial_latents", Difference::of("initial_latents", &generated.initial_latents, get("initial_latents")?)?),
        ("final_latents", Difference::of("final_latents", &generated.final_latents, get("final_latents")?)?),
    ];
    let timesteps = Vec::<f32>::try_from(get("timesteps")?)?;
    let mut equal = vec![("timesteps", timesteps == generated.timesteps)];
    if let Some(views) = &generated.views {
        differences.push(("views", Difference::of("views", views, get("views")?)?));
    }
    match (&generated.surface, reference.tensors.get("faces")) {
        (Some(Surface::Mesh(mesh)), Some(faces)) => {
            equal.push(("faces", mesh.faces.size() == faces.size() && mesh.faces.equal(faces)));
            if mesh.verts.size() == get("verts")?.size() {
                differences.push(("verts", Difference::of("verts", &mesh.verts, get("verts")?)?));
                differences.push(("colors", Difference::of("colors", &mesh.colors, get("colors")?)?));
            } else {
                equal.push(("vertex count", false));
            }
        }
        (Some(Surface::Empty), None) => {
            let empty = reference.summary.get("mesh").and_then(|m| m.as_str()) == Some("empty");
            equal.push(("empty surface on both sides", empty));
        }
        (Some(_), _) => equal.push(("a surface on both sides or on neither", false)),
        (None, _) => {}
    }
    Ok(Comparison { differences, equal })
}
