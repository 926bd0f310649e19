//! Stable Diffusion over the TorchScript export of `scripts/reference/sd_export.py`: the CLIP text
//! encoder, the UNet run for N DDIM steps with classifier-free guidance, and the VAE decoder, as
//! three registry models in three stages (`encode`: `text_encoder`, `denoise`: `unet`, `decode`:
//! `vae_decoder`), eager, staged, or staged with the next stage prefetched. This file owns
//! reading an export (`config.json` and its files, checked), the models and stages, the pipeline
//! run (the operations diffusers' `StableDiffusionPipeline` does, in its order, so that the
//! image matches it); running and comparing against diffusers itself
//! (`scripts/reference/sd_reference.py`) is [`reference`](mod@reference). `examples/stable_diffusion.rs` builds its registry
//! and runs it; `tests/stable_diffusion.rs` checks it at the small size.
//!
//! The run, as diffusers does it: conditioning = cat([negative, positive]) from the text encoder
//! on the config's token ids (int64 [1, 77]); x = latents * init_noise_sigma; for each DDIM
//! timestep t: unet(cat([x, x]), t as a 0-d int64 tensor, conditioning) split in two (uncond,
//! text), eps = uncond + G * (text - uncond), x = DDIM step; image = vae_decoder(x /
//! scaling_factor), then (image * 0.5 + 0.5).clamp(0, 1). The initial latents are torch's CPU
//! generator's `randn` after `manual_seed(seed)`.

pub mod reference;

use std::path::{Path, PathBuf};

use serde::Deserialize;
use stageload::{BoxError, ModelSpec};
use tch::{Device, Kind, Tensor};

pub use crate::export::ExportError;
use crate::export::{component_spec, ComponentFiles, ExportDir, Format, Scripts};
use crate::runner::{forward, PipelineExport, StageRunner};
use crate::schedulers::ddim::{Ddim, DdimConfig};
use crate::schedulers::Scheduler;

/// The three models, in the order the pipeline runs them.
pub const MODELS: [&str; 3] = ["text_encoder", "unet", "vae_decoder"];
/// The stages, each with its one model (`MODELS` in the same order).
pub const STAGES: [(&str, &[&str]); 3] =
    [("encode", &["text_encoder"]), ("denoise", &["unet"]), ("decode", &["vae_decoder"])];
/// The scripts that make an export: named in every [`ExportError`].
pub const SCRIPTS: Scripts = Scripts { export: "sd_export.py", sizes: "small|sd15", pt2: Some("sd_pt2.py") };

/// The fields of an export's `config.json` the pipeline reads.
#[derive(Debug, Clone, Deserialize)]
pub struct ExportConfig {
    /// `small` or `sd15`.
    pub size: String,
    /// Tokens per prompt (77).
    pub seq_len: usize,
    /// Latent height and width.
    pub latent_size: [i64; 2],
    /// Channels of a latent.
    pub latent_channels: i64,
    /// Image pixels per latent, along each side.
    pub vae_scale_factor: i64,
    /// Image height and width.
    pub image_size: [i64; 2],
    /// The VAE's `scaling_factor`: latents are divided by it before decoding.
    pub vae_scaling_factor: f64,
    /// The scheduler.
    pub scheduler: SchedulerEntry,
    /// The prompts' token ids.
    pub token_ids: TokenIds,
    /// The components' files.
    pub components: Components,
}

/// `config.json`'s `scheduler`.
#[derive(Debug, Clone, Deserialize)]
pub struct SchedulerEntry {
    /// The scheduler's class (`diffusers.DDIMScheduler`).
    pub cls: String,
    /// Its configuration.
    pub config: SchedulerConfig,
}

/// The scheduler's configuration as diffusers writes it.
#[derive(Debug, Clone, Deserialize)]
pub struct SchedulerConfig {
    /// Steps of the training schedule.
    pub num_train_timesteps: i64,
    /// The first beta of the schedule.
    pub beta_start: f64,
    /// The last beta of the schedule.
    pub beta_end: f64,
    /// How betas go from first to last (`scaled_linear`).
    pub beta_schedule: String,
    /// Whether predicted samples are clipped to [-1, 1].
    pub clip_sample: bool,
    /// Whether the final cumulative alpha is 1 (else the first step's).
    pub set_alpha_to_one: bool,
    /// Added to every inference timestep.
    pub steps_offset: i64,
    /// What the UNet predicts (`epsilon`).
    pub prediction_type: String,
    /// How inference timesteps are spread (`leading`).
    pub timestep_spacing: String,
}

/// The tokenizer's output for the prompt and for the empty prompt (the export has no tokenizer).
#[derive(Debug, Clone, Deserialize)]
pub struct TokenIds {
    /// The prompt's ids.
    pub prompt: Vec<i64>,
    /// The empty prompt's ids (the unconditional input).
    pub empty: Vec<i64>,
}

/// The three components' files.
#[derive(Debug, Clone, Deserialize)]
pub struct Components {
    /// The CLIP text encoder.
    pub text_encoder: ComponentFiles,
    /// The UNet.
    pub unet: ComponentFiles,
    /// The VAE decoder.
    pub vae_decoder: ComponentFiles,
}

/// An export read and checked: its folder, its `config.json` and the format of its modules.
#[derive(Debug, Clone)]
pub struct Export {
    read: ExportDir<ExportConfig>,
    format: Format,
}

impl Export {
    /// Reads `dir/config.json` and checks that the pipeline runs it: a DDIM scheduler this crate
    /// reproduces, token ids of `seq_len`, sizes that agree, and every component file present.
    pub fn open(dir: impl Into<PathBuf>) -> Result<Export, ExportError> {
        Export::open_as(dir, Format::Torchscript)
    }

    /// [`open`](Self::open) for the modules in `format`: its files must be there.
    pub fn open_as(dir: impl Into<PathBuf>, format: Format) -> Result<Export, ExportError> {
        let export = Export { read: ExportDir::read(dir, SCRIPTS)?, format };
        export.check().map_err(|message| export.read.unsupported(message))?;
        let files = export.files().into_iter().flat_map(|(model, module, weights)| [(model, module), (model, weights)]);
        export.read.check_files(files)?;
        Ok(export)
    }

    fn check(&self) -> Result<(), String> {
        let c = self.read.config();
        for (what, ids) in [("prompt", &c.token_ids.prompt), ("empty", &c.token_ids.empty)] {
            if ids.len() != c.seq_len {
                return Err(format!("token_ids.{what} has {} ids, seq_len is {}", ids.len(), c.seq_len));
            }
        }
        let [h, w] = c.latent_size;
        if h <= 0 || w <= 0 || c.latent_channels <= 0 {
            return Err(format!(
                "latent_size {:?} with {} channels is not a latent shape",
                c.latent_size, c.latent_channels
            ));
        }
        if [h * c.vae_scale_factor, w * c.vae_scale_factor] != c.image_size {
            return Err(format!(
                "latent_size {:?} times vae_scale_factor {} is not image_size {:?}",
                c.latent_size, c.vae_scale_factor, c.image_size
            ));
        }
        if !(c.vae_scaling_factor.is_finite() && c.vae_scaling_factor > 0.0) {
            return Err(format!("vae_scaling_factor {} is not a positive number", c.vae_scaling_factor));
        }
        let s = &c.scheduler.config;
        let expected = [
            ("cls", c.scheduler.cls.as_str(), "diffusers.DDIMScheduler"),
            ("beta_schedule", s.beta_schedule.as_str(), "scaled_linear"),
            ("prediction_type", s.prediction_type.as_str(), "epsilon"),
            ("timestep_spacing", s.timestep_spacing.as_str(), "leading"),
        ];
        for (field, found, wanted) in expected {
            if found != wanted {
                return Err(format!(
                    "scheduler {field} is '{found}'; this pipeline reproduces DDIM with {field} = '{wanted}' only"
                ));
            }
        }
        if s.clip_sample {
            return Err("scheduler clip_sample is true; this pipeline reproduces DDIM without clipping only".into());
        }
        Ok(())
    }

    /// The export's folder.
    pub fn dir(&self) -> &Path {
        self.read.dir()
    }

    /// Its `config.json`.
    pub fn config(&self) -> &ExportConfig {
        self.read.config()
    }

    /// Each model with its module file and its checkpoint, in the order of [`MODELS`].
    pub fn files(&self) -> [(&'static str, PathBuf, PathBuf); 3] {
        let (c, dir) = (&self.config().components, self.dir());
        [(MODELS[0], &c.text_encoder), (MODELS[1], &c.unet), (MODELS[2], &c.vae_decoder)].map(
            |(name, files)| match self.format {
                Format::Torchscript => (name, dir.join(&files.file), dir.join(&files.weights)),
                Format::Pt2 => {
                    let pt2 = dir.join("pt2");
                    (name, pt2.join(format!("{name}.pt2")), pt2.join(format!("{name}.safetensors")))
                }
            },
        )
    }

    /// The format of its modules.
    pub fn format(&self) -> Format {
        self.format
    }

    /// The scheduler `config.json` describes.
    pub fn ddim_config(&self) -> DdimConfig {
        let s = &self.config().scheduler.config;
        DdimConfig {
            train_steps: s.num_train_timesteps,
            beta_start: s.beta_start,
            beta_end: s.beta_end,
            steps_offset: s.steps_offset,
            set_alpha_to_one: s.set_alpha_to_one,
        }
    }

    /// The initial latents of `seed`: `tch::manual_seed(seed)`, then `randn` from torch's CPU
    /// generator, [1, channels, h, w] float32 (as `torch.manual_seed(seed); torch.randn(...)`).
    pub fn initial_latents(&self, seed: i64) -> Tensor {
        let [h, w] = self.config().latent_size;
        tch::manual_seed(seed);
        Tensor::randn([1, self.config().latent_channels, h, w], (Kind::Float, Device::Cpu))
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

/// What a run of the pipeline gives.
#[derive(Debug)]
pub struct Generated {
    /// The initial latents it was given, [1, 4, h, w].
    pub latents: Tensor,
    /// The text encoder's output on the prompt's ids, [1, 77, hidden].
    pub embeds: Tensor,
    /// The same on the empty prompt's ids.
    pub negative_embeds: Tensor,
    /// The latents after the last DDIM step, before decoding.
    pub final_latents: Tensor,
    /// The image, [1, 3, H, W] in [0, 1].
    pub image: Tensor,
    /// The DDIM timesteps run, descending.
    pub timesteps: Vec<i64>,
}

/// The sampler's settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// DDIM steps.
    pub steps: i64,
    /// Classifier-free guidance scale (above 1; diffusers skips guidance at 1 or below).
    pub guidance: f64,
}

/// Runs the pipeline from `latents` (on the device the models live on): enters `encode`,
/// `denoise` and `decode` in turn on `runner` and calls each stage's model there (see the module
/// docs for the operations). Runs without gradients.
pub fn generate(
    runner: &impl StageRunner,
    export: &Export,
    latents: &Tensor,
    sampling: Sampling,
) -> Result<Generated, BoxError> {
    if sampling.guidance <= 1.0 || !sampling.guidance.is_finite() {
        return Err(format!(
            "guidance {} is not above 1: diffusers runs no classifier-free guidance then, and this pipeline \
             reproduces it with guidance only",
            sampling.guidance
        )
        .into());
    }
    let _no_grad = tch::no_grad_guard();
    let config = export.config();
    let device = latents.device();
    let [h, w] = config.latent_size;
    let expected = [1, config.latent_channels, h, w];
    if latents.size() != expected || latents.kind() != Kind::Float {
        return Err(format!(
            "the initial latents are {:?} {:?}; {} wants float32 {expected:?}",
            latents.kind(),
            latents.size(),
            export.dir().display()
        )
        .into());
    }
    let mut ddim = Ddim::new(export.ddim_config(), sampling.steps)?;
    let timesteps = ddim.timesteps().to_vec();
    let ids = |ids: &[i64]| Tensor::from_slice(ids).view([1, -1]).to_device(device);

    runner.enter("encode")?;
    let embeds = forward(runner, export.format(), "text_encoder", &[ids(&config.token_ids.prompt)])?;
    let negative_embeds = forward(runner, export.format(), "text_encoder", &[ids(&config.token_ids.empty)])?;
    let seq = config.seq_len as i64;
    if embeds.dim() != 3 || embeds.size()[..2] != [1, seq] {
        return Err(format!("text_encoder gave {:?}, not [1, {seq}, hidden]", embeds.size()).into());
    }
    let conditioning = Tensor::cat(&[&negative_embeds, &embeds], 0);

    runner.enter("denoise")?;
    let mut x = latents * Scheduler::init_noise_sigma(&ddim);
    for &t in &timesteps {
        let input = Tensor::cat(&[&x, &x], 0);
        let timestep = Tensor::scalar_tensor(t as f64, (Kind::Int64, device));
        let noise = forward(runner, export.format(), "unet", &[input, timestep, conditioning.shallow_clone()])?;
        if noise.size() != [2, config.latent_channels, h, w] {
            return Err(
                format!("unet gave {:?} at timestep {t}, not [2, {}, {h}, {w}]", noise.size(), expected[1]).into()
            );
        }
        let halves = noise.chunk(2, 0);
        let (uncond, text) = (&halves[0], &halves[1]);
        let eps = uncond + (text - uncond) * sampling.guidance;
        x = Scheduler::step(&mut ddim, &eps, &x)?;
    }

    runner.enter("decode")?;
    let decoded = forward(runner, export.format(), "vae_decoder", &[&x / config.vae_scaling_factor])?;
    let image = (decoded * 0.5 + 0.5).clamp(0.0, 1.0);
    Ok(Generated { latents: latents.shallow_clone(), embeds, negative_embeds, final_latents: x, image, timesteps })
}
