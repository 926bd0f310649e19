//! Shap-E image-to-3D (diffusers' `ShapEImg2ImgPipeline`, OpenAI's Shap-E) over the TorchScript
//! export of `scripts/reference/shap_e_export.py`: the CLIP image encoder, the prior run for N
//! Heun steps with classifier-free guidance, and the renderer, which turns the final latent into
//! 20 rendered views and a coloured mesh, as three registry models in four stages (`encode`:
//! `image_encoder`, `denoise`: `prior`, `decode`: `renderer`, `export`: none, while the files are
//! written). This file owns reading an export (its `config.json` and the files it names, checked)
//! and the pipeline run: the operations diffusers runs, in its order and with its chunking, so
//! that every output matches it bit for bit on the CPU. Writing the outputs (PLY, PNG) is
//! [`files`]; running diffusers itself and comparing is [`reference`](mod@reference). `examples/shap_e.rs` builds
//! a registry and runs it; `tests/shap_e.rs` checks it at the small size against diffusers.
//!
//! # The run, as diffusers does it
//!
//! - **encode**: `image_encoder(pixels)` is CLIP's `last_hidden_state[:, 1:]` ([1, 256, H]); the
//!   prior's conditioning is `cat([zeros_like(e), e])` (unconditional first).
//! - **noise**: `randn([1, E * D])` from torch's CPU generator after `manual_seed(seed)` (the draw
//!   `torch.Generator().manual_seed(seed)` makes), times the scheduler's `init_noise_sigma`,
//!   reshaped to [1, E, D]. Drawn before any model is built.
//! - **denoise**: for each of the `2N - 1` Heun calls at timestep t (a 0-d float32 tensor): the
//!   prior on `scale_model_input(cat([x, x]))`, its first D output channels (`split(D, dim=2)[0]`)
//!   chunked into (uncond, cond), `uncond + G * (cond - uncond)`, then the Heun step
//!   ([`crate::schedulers::heun`]).
//! - **decode**: the renderer's `forward` projects the latent into the weights of the MLP's first
//!   four layers. Views: the 20 pan cameras' rays ([`pan_rays`]) in batches of 4096, each batch
//!   after `manual_seed(0)` (diffusers' `StratifiedRaySampler` reseeds torch's global generators
//!   before every batch, and the batch draws three times from them), then `view(20, S, S, 3)`.
//!   Mesh: the signed distance at the 128³ grid points (`grid_points`) in chunks of 4096, a
//!   border of -1 around it, marching cubes, then the texture at every vertex in chunks of 4096.
//!
//! # Random generators
//!
//! diffusers leaves torch's global generators seeded with 0 and advanced by the last ray batch
//! (a caller's seeded state is lost). Here the decode stage saves every torch generator first
//! and puts it back afterwards ([`stageload::rng::PreservedRng`]): after a run the caller's
//! generators are as they were after the initial noise was drawn. The outputs are the same.
//!
//! # Bad input
//!
//! An export whose files or shapes do not agree is an [`ExportError`] naming the file; a frame
//! size that is not a multiple of 32 (diffusers fails on it) or a guidance not above 1 is a
//! [`RunError`]; a field with no zero crossing gives [`Surface::Empty`] (diffusers raises on it),
//! which the example reports after writing the views.

pub mod files;
pub mod reference;

use std::path::{Path, PathBuf};

use serde::Deserialize;
use stageload::rng::PreservedRng;
use stageload::{BoxError, ModelSpec};
use tch::{CModule, IValue, Kind, Tensor};

use crate::clip_image::ClipImageConfig;
pub use crate::export::ExportError;
use crate::export::{component_spec, ComponentFiles, ExportDir, Format, Scripts};
use crate::runner::{PipelineExport, StageRunner};
use crate::schedulers::heun::{Heun, HeunConfig};

/// The three models, in the order the pipeline runs them.
pub const MODELS: [&str; 3] = ["image_encoder", "prior", "renderer"];
/// The stages and the models each one runs (`export` writes files and holds none).
pub const STAGES: [(&str, &[&str]); 4] =
    [("encode", &["image_encoder"]), ("denoise", &["prior"]), ("decode", &["renderer"]), ("export", &[])];
/// The rendered views: diffusers' 20 pan cameras.
pub const VIEWS: i64 = 20;
/// Pixels a frame's side must be a multiple of: 20·S² rays must fill whole batches of 4096.
pub const FRAME_MULTIPLE: i64 = 32;
/// The largest frame side this pipeline renders (20 views of 1024² pixels: 21 M rays).
pub const MAX_FRAME: i64 = 1024;
/// The image encoder's input side in pixels.
pub const IMAGE_SIZE: i64 = 224;
/// The image tokens the encoder gives (16 × 16 patches of 14 pixels).
pub const IMAGE_TOKENS: i64 = 256;
/// Rays per render batch and points per MLP query (`decode_to_image`'s and `decode_to_mesh`'s
/// 4096, the shapes the renderer's methods are traced and checked at).
pub const BATCH: i64 = 4096;
/// Marching-cubes grid points along each side (`decode_to_mesh`'s 128; the traced marching
/// cubes takes the field with its border, 130³).
pub const GRID: i64 = 128;
/// The volume diffusers' renderer bounds: the box from -1 to 1 on every axis.
const BBOX: ([f32; 3], [f32; 3]) = ([-1.0; 3], [1.0; 3]);
/// The most latent values (E × D) an export may ask for (the published size has 2^20).
const MAX_LATENT: i64 = 1 << 24;
/// The export format this file reads.
const FORMAT: u32 = 1;
/// The scripts that make an export: named in every [`ExportError`].
pub const SCRIPTS: Scripts =
    Scripts { export: "shap_e_export.py", sizes: "small|published", pt2: Some("shap_e_pt2.py") };

/// Why a run could not start or a model's output is not what the pipeline expects.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunError {
    /// `--guidance` is not above 1.
    #[error(
        "guidance {0} is not above 1: diffusers runs no classifier-free guidance then, and this pipeline reproduces it with guidance only (its default is 4.0)"
    )]
    Guidance(f64),
    /// `--frame-size` is not a positive multiple of 32.
    #[error(
        "frame size {0} is not a positive multiple of 32 up to 1024: diffusers renders 20·S² rays in batches of 4096 and fails on a partial batch; pass 32, 64, ..."
    )]
    FrameSize(i64),
    /// The pixels are not float32 [1, 3, S, S] at the export's image size.
    #[error("the image tensor is {kind:?} {shape:?}; the image encoder takes float32 [1, 3, {size}, {size}]")]
    Pixels {
        /// Its dtype.
        kind: Kind,
        /// Its shape.
        shape: Vec<i64>,
        /// The export's image size.
        size: i64,
    },
    /// The noise is not float32 [1, E * D].
    #[error(
        "the noise is {kind:?} {shape:?}; the prior's latents are float32 [1, {numel}] (Export::noise draws them)"
    )]
    Noise {
        /// Its dtype.
        kind: Kind,
        /// Its shape.
        shape: Vec<i64>,
        /// E * D.
        numel: i64,
    },
    /// A model's call failed or gave an output of another shape.
    #[error("{model}.{method}: {message}")]
    Model {
        /// The model.
        model: &'static str,
        /// The method called.
        method: &'static str,
        /// What went wrong.
        message: String,
    },
}

/// The fields of an export's `config.json` the pipeline reads.
#[derive(Debug, Clone, Deserialize)]
pub struct ExportConfig {
    /// The export's format number.
    pub format: u32,
    /// `small` or `published`.
    pub size: String,
    /// E: latent vectors (the prior's `num_embeddings`).
    pub num_embeddings: i64,
    /// D: each vector's width (the prior's `embedding_dim`).
    pub embedding_dim: i64,
    /// Image tokens the encoder gives (must be [`IMAGE_TOKENS`]).
    pub image_tokens: i64,
    /// The encoder's input side in pixels (must be [`IMAGE_SIZE`]).
    pub image_size: i64,
    /// Rays per render batch (must be [`BATCH`]).
    pub ray_batch: i64,
    /// Points per MLP query chunk (must be [`BATCH`]).
    pub query_batch: i64,
    /// Marching-cubes grid points along each side (must be [`GRID`]).
    pub grid_size: i64,
    /// Rendered views (must be [`VIEWS`]).
    pub views: i64,
    /// The volume's lower corner (must be diffusers' -1, -1, -1).
    pub bbox_min: [f32; 3],
    /// The volume's upper corner (must be 1, 1, 1).
    pub bbox_max: [f32; 3],
    /// The scheduler's file (`scheduler.json`).
    pub scheduler: String,
    /// The image processor's file (`preprocessor_config.json`).
    pub preprocessor: String,
    /// The components' files.
    pub components: Components,
}

/// The three components' files.
#[derive(Debug, Clone, Deserialize)]
pub struct Components {
    /// The CLIP image encoder.
    pub image_encoder: ComponentFiles,
    /// The prior.
    pub prior: ComponentFiles,
    /// The renderer (its traced methods: `forward`, `render_rays`, `sdf`, `texture`, `marching_cubes`).
    pub renderer: ComponentFiles,
}

/// An export read and checked.
#[derive(Debug, Clone)]
pub struct Export {
    read: ExportDir<ExportConfig>,
    format: Format,
    scheduler: HeunConfig,
    preprocessor: ClipImageConfig,
}

impl Export {
    /// Reads `dir/config.json`, the scheduler and image processor files it names, and checks that
    /// every component file is there and the sizes agree.
    pub fn open(dir: impl Into<PathBuf>) -> Result<Export, ExportError> {
        Export::open_as(dir, Format::Torchscript)
    }

    /// [`open`](Self::open) with the image encoder and the prior in `format`: with
    /// [`Format::Pt2`], the AOTInductor packages `scripts/reference/shap_e_pt2.py` compiled into
    /// `dir/pt2` (the renderer stays TorchScript: torch.export refuses its data-dependent ray
    /// sampling and marching cubes).
    pub fn open_as(dir: impl Into<PathBuf>, format: Format) -> Result<Export, ExportError> {
        let read: ExportDir<ExportConfig> = ExportDir::read(dir, SCRIPTS)?;
        let unsupported = |message: String| read.unsupported(message);
        read.check_format(read.config().format, FORMAT)?;
        let c = read.config();
        // diffusers fixes these sizes, and the renderer's methods are traced and checked at them.
        let fixed = [
            ("image_size", c.image_size, IMAGE_SIZE),
            ("image_tokens", c.image_tokens, IMAGE_TOKENS),
            ("ray_batch", c.ray_batch, BATCH),
            ("query_batch", c.query_batch, BATCH),
            ("grid_size", c.grid_size, GRID),
            ("views", c.views, VIEWS),
        ];
        if let Some((field, found, wanted)) = fixed.iter().find(|(_, found, wanted)| found != wanted) {
            return Err(unsupported(format!(
                "{field} = {found}; diffusers' Shap-E pipeline (and this export's traces) use {wanted}"
            )));
        }
        if (c.bbox_min, c.bbox_max) != BBOX {
            return Err(unsupported(format!(
                "the volume {:?}..{:?} is not diffusers' renderer's box {:?}..{:?}",
                c.bbox_min, c.bbox_max, BBOX.0, BBOX.1
            )));
        }
        let (e, d) = (c.num_embeddings, c.embedding_dim);
        let latent = e.checked_mul(d).filter(|n| (1..=MAX_LATENT).contains(n) && e > 0 && e % 4 == 0);
        if latent.is_none() {
            return Err(unsupported(format!(
                "num_embeddings = {e} by embedding_dim = {d} is not a latent this pipeline runs: four MLP layers' \
                 rows (a positive multiple of 4) by a width, at most {MAX_LATENT} values"
            )));
        }
        let scheduler_path = read.dir().join(&c.scheduler);
        let scheduler = HeunConfig::from_json_file(&scheduler_path)
            .map_err(|source| ExportError::Scheduler { path: scheduler_path, source: source.into() })?;
        let preprocessor_path = read.dir().join(&c.preprocessor);
        let preprocessor = ClipImageConfig::from_json_file(&preprocessor_path)
            .map_err(|source| ExportError::Preprocessor { path: preprocessor_path, source })?;
        let export = Export { read, format, scheduler, preprocessor };
        let files = export.files().into_iter().flat_map(|(model, module, weights)| [(model, module), (model, weights)]);
        export.read.check_files(files)?;
        Ok(export)
    }

    /// The export's folder.
    pub fn dir(&self) -> &Path {
        self.read.dir()
    }

    /// Its `config.json`.
    pub fn config(&self) -> &ExportConfig {
        self.read.config()
    }

    /// The scheduler's configuration with its `log_sigmas` table.
    pub fn scheduler(&self) -> &HeunConfig {
        &self.scheduler
    }

    /// The image processor's configuration.
    pub fn preprocessor(&self) -> &ClipImageConfig {
        &self.preprocessor
    }

    /// The format of the image encoder and the prior.
    pub fn format(&self) -> Format {
        self.format
    }

    /// Each model with its module file and its checkpoint, in the order of [`MODELS`].
    pub fn files(&self) -> [(&'static str, PathBuf, PathBuf); 3] {
        let (c, dir) = (&self.config().components, self.dir());
        [(MODELS[0], &c.image_encoder), (MODELS[1], &c.prior), (MODELS[2], &c.renderer)].map(|(name, files)| {
            if self.format == Format::Pt2 && name != "renderer" {
                let pt2 = dir.join("pt2");
                (name, pt2.join(format!("{name}.pt2")), pt2.join(format!("{name}.safetensors")))
            } else {
                (name, dir.join(&files.file), dir.join(&files.weights))
            }
        })
    }

    /// The initial noise of `seed`, before scaling: `tch::manual_seed(seed)`, then `randn([1, E * D])`
    /// from torch's CPU generator (what `torch.Generator().manual_seed(seed)` draws).
    pub fn noise(&self, seed: i64) -> Tensor {
        let c = self.config();
        tch::manual_seed(seed);
        Tensor::randn([1, c.num_embeddings * c.embedding_dim], (Kind::Float, tch::Device::Cpu))
    }
}

impl PipelineExport for Export {
    const STAGES: &'static [(&'static str, &'static [&'static str])] = &STAGES;

    /// The three models: each its module (a TorchScript file or a `.pt2` package), with its
    /// safetensors as the checkpoint that refills it after a release.
    fn model_specs(&self) -> Vec<ModelSpec> {
        self.files().into_iter().map(|(name, module, weights)| component_spec(name, module, Some(weights))).collect()
    }
}

/// The pipeline's settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// Heun steps (the prior runs `2 * steps - 1` times).
    pub steps: usize,
    /// Classifier-free guidance scale (above 1; the pipeline's default is 4.0).
    pub guidance: f64,
    /// The rendered views' side in pixels (a multiple of 32; the pipeline's default is 64).
    pub frame_size: i64,
    /// Whether to render the views.
    pub views: bool,
    /// Whether to extract the mesh.
    pub mesh: bool,
}

/// A coloured triangle mesh, as diffusers' `decode_to_mesh` gives it.
#[derive(Debug)]
pub struct Mesh {
    /// Vertex positions, float32 [V, 3], inside the volume.
    pub verts: Tensor,
    /// Triangles as vertex indices, int64 [F, 3].
    pub faces: Tensor,
    /// Vertex colours in linear RGB, float32 [V, 3] in [0, 1].
    pub colors: Tensor,
}

/// What marching cubes found.
#[derive(Debug)]
pub enum Surface {
    /// A mesh with at least one face.
    Mesh(Mesh),
    /// The field has no zero crossing: the surface at level 0 is empty (diffusers raises here).
    Empty,
}

/// What a run of the pipeline gives.
#[derive(Debug)]
pub struct Generated {
    /// The image encoder's output, [1, 256, H].
    pub image_embeds: Tensor,
    /// The initial latents (noise times `init_noise_sigma`), [1, E * D].
    pub initial_latents: Tensor,
    /// Every prior call's timestep.
    pub timesteps: Vec<f32>,
    /// The latents after the last Heun step, [1, E, D].
    pub final_latents: Tensor,
    /// The rendered views, [20, S, S, 3] float32 in [0, 1], when asked for.
    pub views: Option<Tensor>,
    /// The surface, when asked for.
    pub surface: Option<Surface>,
}

/// Calls `method` of the TorchScript model `model` on `inputs`.
fn call(
    runner: &impl StageRunner,
    model: &'static str,
    method: &'static str,
    inputs: &[Tensor],
) -> Result<IValue, BoxError> {
    let inputs: Vec<IValue> = inputs.iter().map(|t| IValue::Tensor(t.shallow_clone())).collect();
    let out = runner.call(model, |m: &mut CModule| m.method_is(method, &inputs))?;
    out.map_err(|e| RunError::Model { model, method, message: e.to_string() }.into())
}

/// Calls `method` and takes its one tensor output, which must have `shape` (-1: any size).
fn call_tensor(
    runner: &impl StageRunner,
    model: &'static str,
    method: &'static str,
    inputs: &[Tensor],
    shape: &[i64],
) -> Result<Tensor, BoxError> {
    match call(runner, model, method, inputs)? {
        IValue::Tensor(t) => checked(t, model, method, shape),
        other => Err(RunError::Model { model, method, message: format!("gave {other:?}, not a tensor") }.into()),
    }
}

/// Runs the image encoder or the prior (`forward`, in the export's format): one tensor of `shape`.
fn forward(
    runner: &impl StageRunner,
    format: Format,
    model: &'static str,
    inputs: &[Tensor],
    shape: &[i64],
) -> Result<Tensor, BoxError> {
    checked(crate::runner::forward(runner, format, model, inputs)?, model, "forward", shape)
}

/// Calls `method` and takes its tuple of `n` tensors.
fn call_tuple(
    runner: &impl StageRunner,
    model: &'static str,
    method: &'static str,
    inputs: &[Tensor],
    n: usize,
) -> Result<Vec<Tensor>, BoxError> {
    let wrong = |what: String| RunError::Model { model, method, message: what };
    match call(runner, model, method, inputs)? {
        IValue::Tuple(items) if items.len() == n => items
            .into_iter()
            .map(|item| match item {
                IValue::Tensor(t) => Ok(t),
                other => Err(wrong(format!("gave {other:?} in its tuple, not a tensor")).into()),
            })
            .collect(),
        other => Err(wrong(format!("gave {other:?}, not a tuple of {n} tensors")).into()),
    }
}

/// `tensor` unless its shape differs from `shape` (-1 matches any size).
fn checked(tensor: Tensor, model: &'static str, method: &'static str, shape: &[i64]) -> Result<Tensor, BoxError> {
    let found = tensor.size();
    let fits = found.len() == shape.len() && found.iter().zip(shape).all(|(f, s)| *s == -1 || f == s);
    if !fits {
        let message = format!("gave shape {found:?}, the pipeline expects {shape:?}");
        return Err(RunError::Model { model, method, message }.into());
    }
    Ok(tensor)
}

/// `size` unless it is not a frame side this pipeline renders: a positive multiple of 32 up to
/// [`MAX_FRAME`].
fn check_frame_size(size: i64) -> Result<i64, RunError> {
    if size <= 0 || size % FRAME_MULTIPLE != 0 || size > MAX_FRAME {
        return Err(RunError::FrameSize(size));
    }
    Ok(size)
}

/// The rays of diffusers' 20 pan cameras (`create_pan_cameras(size).camera_rays`): [1, 20·S², 2, 3]
/// float32, origin then direction for each pixel of each view. The cameras circle the volume at
/// distance 4, looking down at 0.5 of their height, with a 0.7 rad field of view. Their vectors are
/// computed in f64 with the same libm calls numpy makes and rounded to float32 (as
/// `torch.from_numpy(...).float()`); the rays are libtorch ops on those, as diffusers has them.
pub fn pan_rays(size: i64) -> Result<Tensor, RunError> {
    check_frame_size(size)?;
    let n = VIEWS as usize;
    let (mut origins, mut xs, mut ys, mut zs) = (vec![], vec![], vec![], vec![]);
    // np.linspace(0, 2π, 20): i * step, the last exactly 2π.
    let step = 2.0 * std::f64::consts::PI / (n - 1) as f64;
    for i in 0..n {
        let theta = if i == n - 1 { 2.0 * std::f64::consts::PI } else { i as f64 * step };
        let mut z = [theta.sin(), theta.cos(), -0.5];
        let norm = (z[0] * z[0] + z[1] * z[1] + z[2] * z[2]).sqrt();
        z = z.map(|v| v / norm);
        let origin = z.map(|v| -v * 4.0);
        let x = [theta.cos(), -theta.sin(), 0.0];
        // np.cross(z, x)
        let y = [z[1] * x[2] - z[2] * x[1], z[2] * x[0] - z[0] * x[2], z[0] * x[1] - z[1] * x[0]];
        origins.extend(origin.map(|v| v as f32));
        xs.extend(x.map(|v| v as f32));
        ys.extend(y.map(|v| v as f32));
        zs.extend(z.map(|v| v as f32));
    }
    let vectors = |v: &[f32]| Tensor::from_slice(v).view([VIEWS, 1, 3]);
    let (origin, x, y, z) = (vectors(&origins), vectors(&xs), vectors(&ys), vectors(&zs));
    // get_image_coords: (pixel % width, pixel // width) for every pixel of a view.
    let pixels = Tensor::arange(size * size, (Kind::Int64, tch::Device::Cpu));
    let coords = Tensor::stack(&[pixels.remainder(size), pixels.divide_scalar_mode(size, "trunc")], 1);
    let flat = coords.unsqueeze(0).broadcast_to([VIEWS, size * size, 2]);
    let resolution = Tensor::from_slice(&[size as f32, size as f32]);
    let fov = Tensor::from_slice(&[0.7f32, 0.7]);
    let fracs = (flat.to_kind(Kind::Float) / (resolution - 1)) * 2 - 1;
    let fracs = fracs * (fov / 2).tan();
    let directions = z + x * fracs.narrow(2, 0, 1) + y * fracs.narrow(2, 1, 1);
    let directions = &directions / directions.norm_scalaropt_dim(2, [-1i64].as_slice(), true);
    let origins = origin.broadcast_to([VIEWS, size * size, 3]);
    let rays = Tensor::stack(&[origins, directions], 2);
    Ok(rays.view([1, VIEWS * size * size, 2, 3]))
}

/// The marching-cubes grid's points (diffusers' `volume_query_points`): [GRID³, 3] float32,
/// x slowest and z fastest, spanning the volume corner to corner.
fn grid_points() -> Tensor {
    let indices = Tensor::arange(GRID * GRID * GRID, (Kind::Int64, tch::Device::Cpu));
    let zs = indices.remainder(GRID);
    let ys = indices.divide_scalar_mode(GRID, "trunc").remainder(GRID);
    let xs = indices.divide_scalar_mode(GRID * GRID, "trunc").remainder(GRID);
    let combined = Tensor::stack(&[xs, ys, zs], 1);
    let (lo, hi) = (Tensor::from_slice(&BBOX.0), Tensor::from_slice(&BBOX.1));
    (combined.to_kind(Kind::Float) / (GRID - 1)) * (hi - &lo) + lo
}

/// Runs the pipeline on `pixels` (float32 [1, 3, 224, 224], already preprocessed): enters
/// `encode`, `denoise` and `decode` in turn on `runner` and calls each stage's model there (see
/// the module docs for the operations). Runs without gradients, on the CPU.
pub fn generate(
    runner: &impl StageRunner,
    export: &Export,
    pixels: &Tensor,
    noise: &Tensor,
    sampling: Sampling,
) -> Result<Generated, BoxError> {
    if !(sampling.guidance > 1.0 && sampling.guidance.is_finite()) {
        return Err(RunError::Guidance(sampling.guidance).into());
    }
    if sampling.views {
        check_frame_size(sampling.frame_size)?;
    }
    let _no_grad = tch::no_grad_guard();
    let c = export.config();
    if pixels.size() != [1, 3, IMAGE_SIZE, IMAGE_SIZE] || pixels.kind() != Kind::Float {
        return Err(RunError::Pixels { kind: pixels.kind(), shape: pixels.size(), size: IMAGE_SIZE }.into());
    }
    let (e, d) = (c.num_embeddings, c.embedding_dim);
    if noise.size() != [1, e * d] || noise.kind() != Kind::Float {
        return Err(RunError::Noise { kind: noise.kind(), shape: noise.size(), numel: e * d }.into());
    }
    let mut heun = Heun::new(export.scheduler(), sampling.steps)?;

    runner.enter("encode")?;
    let image_embeds =
        forward(runner, export.format(), "image_encoder", &[pixels.shallow_clone()], &[1, IMAGE_TOKENS, -1])?;
    let conditioning = Tensor::cat(&[image_embeds.zeros_like(), image_embeds.shallow_clone()], 0);

    let initial_latents = noise * Tensor::from(heun.init_noise_sigma());
    let mut latents = initial_latents.reshape([1, e, d]);
    let timesteps = heun.timesteps().to_vec();
    runner.enter("denoise")?;
    for (call_index, &t) in timesteps.iter().enumerate() {
        let input = Tensor::cat(&[&latents, &latents], 0);
        let scaled = heun.scale_model_input(&input, call_index)?;
        let timestep = Tensor::from(t);
        let inputs = [scaled, timestep, conditioning.shallow_clone()];
        let predicted = forward(runner, export.format(), "prior", &inputs, &[2, e, 2 * d])?;
        let noise_pred = predicted.split(d, 2).swap_remove(0);
        let halves = noise_pred.chunk(2, 0);
        let (uncond, cond) = (&halves[0], &halves[1]);
        let guided = uncond + (cond - uncond) * sampling.guidance;
        latents = heun.step(&guided, &latents)?;
    }
    let final_latents = latents;

    runner.enter("decode")?;
    // The renderer reseeds torch's global generators before every ray batch: the caller's come back after.
    let preserved = PreservedRng::save(&[])?;
    let weights = call_tuple(runner, "renderer", "forward", &[final_latents.shallow_clone()], 4)?;
    let views = if sampling.views { Some(render_views(runner, &weights, sampling.frame_size)?) } else { None };
    let surface = if sampling.mesh { Some(extract_surface(runner, &weights)?) } else { None };
    drop(preserved);
    Ok(Generated { image_embeds, initial_latents, timesteps, final_latents, views, surface })
}

/// decode_to_image: every ray batch after `manual_seed(0)`, then the views.
fn render_views(runner: &impl StageRunner, weights: &[Tensor], size: i64) -> Result<Tensor, BoxError> {
    let rays = pan_rays(size)?;
    // 20·S² rays with S a multiple of 32: whole batches of 4096.
    let batches = rays.size()[1] / BATCH;
    let mut channels = Vec::new();
    for batch in 0..batches {
        tch::manual_seed(0);
        let mut inputs = vec![rays.narrow(1, batch * BATCH, BATCH)];
        inputs.extend(weights.iter().map(Tensor::shallow_clone));
        channels.push(call_tensor(runner, "renderer", "render_rays", &inputs, &[1, BATCH, 3])?);
    }
    Ok(Tensor::cat(&channels, 1).view([1, VIEWS, size, size, -1]).squeeze_dim(0))
}

/// The MLP's `method` (`sdf` or `texture`) over `points` [1, n, 3] in chunks of 4096, the last
/// one shorter when n is not a multiple (as diffusers chunks).
fn query(
    runner: &impl StageRunner,
    method: &'static str,
    points: &Tensor,
    weights: &[Tensor],
    channels: i64,
) -> Result<Tensor, BoxError> {
    let total = points.size()[1];
    let mut out = Vec::new();
    for start in (0..total).step_by(BATCH as usize) {
        let chunk = points.narrow(1, start, BATCH.min(total - start));
        let n = chunk.size()[1];
        let mut inputs = vec![chunk];
        inputs.extend(weights.iter().map(Tensor::shallow_clone));
        out.push(call_tensor(runner, "renderer", method, &inputs, &[1, n, channels])?);
    }
    Ok(Tensor::cat(&out, 1))
}

/// decode_to_mesh: the field on the grid, its -1 border, marching cubes, the texture.
fn extract_surface(runner: &impl StageRunner, weights: &[Tensor]) -> Result<Surface, BoxError> {
    let points = grid_points().unsqueeze(0).repeat([1, 1, 1]);
    let fields = query(runner, "sdf", &points, weights, 1)?.reshape([1, GRID, GRID, GRID]);
    let mut full = Tensor::zeros([1, GRID + 2, GRID + 2, GRID + 2], (Kind::Float, tch::Device::Cpu));
    let _ = full.fill_(-1.0);
    full.narrow(1, 1, GRID).narrow(2, 1, GRID).narrow(3, 1, GRID).copy_(&fields);
    let mut outputs = call_tuple(runner, "renderer", "marching_cubes", &[full.get(0)], 2)?;
    let (faces, verts) = (outputs.swap_remove(1), outputs.swap_remove(0));
    let verts = checked(verts, "renderer", "marching_cubes", &[-1, 3])?;
    let faces = checked(faces, "renderer", "marching_cubes", &[-1, 3])?;
    if faces.size()[0] == 0 {
        return Ok(Surface::Empty);
    }
    let n = verts.size()[0];
    let positions =
        verts.index_select(0, &Tensor::arange(n, (Kind::Int64, tch::Device::Cpu)).remainder(n)).unsqueeze(0);
    let colors = query(runner, "texture", &positions, weights, 3)?.get(0);
    Ok(Surface::Mesh(Mesh { verts, faces, colors }))
}

/// The example's input when it is given no image: 256 × 256, a red disc and a blue square on white.
pub fn example_image() -> image::RgbImage {
    image::RgbImage::from_fn(256, 256, |x, y| {
        let (dx, dy) = (x as f32 - 96.0, y as f32 - 110.0);
        if dx * dx + dy * dy < 60.0 * 60.0 {
            image::Rgb([220, 40, 40])
        } else if (140..220).contains(&x) && (120..200).contains(&y) {
            image::Rgb([40, 70, 200])
        } else {
            image::Rgb([255, 255, 255])
        }
    })
}
