//! Stable Diffusion over the TorchScript export of `scripts/reference/sd_export.py`: the CLIP text
//! encoder, the UNet run for N DDIM steps with classifier-free guidance, and the VAE decoder, as
//! three registry models in three stages (`encode`: `text_encoder`, `denoise`: `unet`, `decode`:
//! `vae_decoder`), eager, staged, or staged with the next stage prefetched. This file owns
//! reading an export (`config.json` and its files, checked), the models and stages, the pipeline
//! run (the operations diffusers' `StableDiffusionPipeline` does, in its order, so that the
//! image matches it), and running and comparing against diffusers itself
//! (`scripts/reference/sd_reference.py`). `examples/stable_diffusion.rs` builds its registry
//! and runs it; `tests/stable_diffusion.rs` checks it at the small size.
//!
//! The run, as diffusers does it: conditioning = cat([negative, positive]) from the text encoder
//! on the config's token ids (int64 [1, 77]); x = latents * init_noise_sigma; for each DDIM
//! timestep t: unet(cat([x, x]), t as a 0-d int64 tensor, conditioning) split in two (uncond,
//! text), eps = uncond + G * (text - uncond), x = DDIM step; image = vae_decoder(x /
//! scaling_factor), then (image * 0.5 + 0.5).clamp(0, 1). The initial latents are torch's CPU
//! generator's `randn` after `manual_seed(seed)`.

use std::fmt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Deserialize;
use stageload::{BoxError, EventSink, ModelSpec, StagedModels};
use tch::{Device, Kind, Tensor};

use crate::ddim::{Ddim, DdimConfig};
use crate::pipeline::{
    forward, reference_script, registry, run_script, ComponentFiles, Difference, Format, Loading, StageRunner,
    TOLERANCE,
};

/// The three models, in the order the pipeline runs them.
pub const MODELS: [&str; 3] = ["text_encoder", "unet", "vae_decoder"];
/// The stages, each with its one model (`MODELS` in the same order).
pub const STAGES: [(&str, &str); 3] = [("encode", "text_encoder"), ("denoise", "unet"), ("decode", "vae_decoder")];

/// Why an export could not be read or is not one this pipeline runs. Each variant names the file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ExportError {
    /// `config.json` (or a file it names) cannot be read.
    #[error("cannot read {}: {source}; export the components with scripts/reference/sd_export.py --size small|sd15 --out DIR", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The system's error.
        source: std::io::Error,
    },
    /// `config.json` is not the JSON `sd_export.py` writes.
    #[error("{} is not the config.json scripts/reference/sd_export.py writes: {source}", path.display())]
    Parse {
        /// The file.
        path: PathBuf,
        /// The JSON parser's error.
        source: serde_json::Error,
    },
    /// `config.json` describes something this pipeline does not run (another scheduler, token
    /// ids of the wrong length, sizes that do not agree).
    #[error("{}: {message}", path.display())]
    Unsupported {
        /// The file.
        path: PathBuf,
        /// What this pipeline does not run.
        message: String,
    },
}

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
    dir: PathBuf,
    config: ExportConfig,
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
        let dir = dir.into();
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| ExportError::Read { path: path.clone(), source })?;
        let config: ExportConfig =
            serde_json::from_str(&text).map_err(|source| ExportError::Parse { path: path.clone(), source })?;
        let export = Export { dir, config, format };
        export.check().map_err(|message| ExportError::Unsupported { path: path.clone(), message })?;
        for (model, module, weights) in export.files() {
            for file in [module, weights] {
                std::fs::metadata(&file).map_err(|source| ExportError::Read { path: file.clone(), source })?;
                if !file.is_file() {
                    let message = format!("{model}'s {} is not a regular file", file.display());
                    return Err(ExportError::Unsupported { path, message });
                }
            }
        }
        Ok(export)
    }

    fn check(&self) -> Result<(), String> {
        let c = &self.config;
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
        &self.dir
    }

    /// Its `config.json`.
    pub fn config(&self) -> &ExportConfig {
        &self.config
    }

    /// Each model with its module file and its checkpoint, in the order of [`MODELS`].
    pub fn files(&self) -> [(&'static str, PathBuf, PathBuf); 3] {
        let c = &self.config.components;
        [(MODELS[0], &c.text_encoder), (MODELS[1], &c.unet), (MODELS[2], &c.vae_decoder)].map(
            |(name, files)| match self.format {
                Format::Torchscript => (name, self.dir.join(&files.file), self.dir.join(&files.weights)),
                Format::Pt2 => {
                    let pt2 = self.dir.join("pt2");
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
        let s = &self.config.scheduler.config;
        DdimConfig {
            train_steps: s.num_train_timesteps,
            beta_start: s.beta_start,
            beta_end: s.beta_end,
            steps_offset: s.steps_offset,
            set_alpha_to_one: s.set_alpha_to_one,
        }
    }

    /// The three models: each its module (a TorchScript file or a `.pt2` package), with its
    /// safetensors as the checkpoint that refills it after a release.
    pub fn model_specs(&self) -> Vec<ModelSpec> {
        self.files()
            .into_iter()
            .map(|(name, module, weights)| match self.format {
                Format::Torchscript => ModelSpec::torchscript(name, module).checkpoint([weights]),
                Format::Pt2 => ModelSpec::pt2(name, module, [weights]),
            })
            .collect()
    }

    /// A registry of the three models on the CPU for `loading`, its events to `events`. Eager:
    /// every model pinned and loaded now, so nothing is ever released. (The command line places
    /// models on other devices through `DemoRun`'s pipeline file.)
    pub fn registry(&self, loading: Loading, events: Option<Arc<dyn EventSink>>) -> Result<StagedModels, BoxError> {
        let stages = STAGES.iter().map(|(stage, model)| (*stage, std::slice::from_ref(model)));
        registry(self.model_specs(), stages, loading, events)
    }

    /// The initial latents of `seed`: `tch::manual_seed(seed)`, then `randn` from torch's CPU
    /// generator, [1, channels, h, w] float32 (as `torch.manual_seed(seed); torch.randn(...)`).
    pub fn initial_latents(&self, seed: i64) -> Tensor {
        let [h, w] = self.config.latent_size;
        tch::manual_seed(seed);
        Tensor::randn([1, self.config.latent_channels, h, w], (Kind::Float, Device::Cpu))
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
    let ddim = Ddim::new(export.ddim_config(), sampling.steps)?;
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
    let mut x = latents * ddim.init_noise_sigma();
    for &t in ddim.timesteps() {
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
        x = ddim.step(&eps, t, &x);
    }

    runner.enter("decode")?;
    let decoded = forward(runner, export.format(), "vae_decoder", &[&x / config.vae_scaling_factor])?;
    let image = (decoded * 0.5 + 0.5).clamp(0.0, 1.0);
    Ok(Generated {
        latents: latents.shallow_clone(),
        embeds,
        negative_embeds,
        final_latents: x,
        image,
        timesteps: ddim.timesteps().to_vec(),
    })
}

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
    let script = reference_script("sd_reference.py");
    let started = Instant::now();
    let mut command = Command::new(python);
    command
        .arg(&script)
        .arg("--components")
        .arg(export.dir())
        .arg("--inputs")
        .arg(&inputs)
        .args(["--steps", &sampling.steps.to_string(), "--guidance", &sampling.guidance.to_string()])
        .args(["--device", &stageload::device::name(generated.latents.device())])
        .arg("--out")
        .arg(&output);
    run_script(command, &script.display().to_string(), &log, deadline)?;
    let seconds = started.elapsed().as_secs_f64();
    let tensors = Tensor::read_safetensors(&output).map_err(|e| format!("reading {}: {e}", output.display()))?;
    let take = |name: &str| {
        tensors
            .iter()
            .position(|(n, _)| n == name)
            .map(|i| tensors[i].1.shallow_clone())
            .ok_or_else(|| format!("{} holds no {name}", output.display()))
    };
    let timesteps = take("timesteps")?;
    let timesteps = Vec::<i64>::try_from(&timesteps.to_kind(Kind::Int64).flatten(0, -1))
        .map_err(|e| format!("{}: timesteps: {e}", output.display()))?;
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

/// A run against the reference.
#[derive(Debug, Clone, PartialEq)]
pub struct Comparison {
    /// Of the decoded images.
    pub image: Difference,
    /// Of the prompt's embeddings.
    pub embeds: Difference,
    /// Of the empty prompt's embeddings.
    pub negative_embeds: Difference,
    /// Of the final latents.
    pub final_latents: Difference,
    /// Whether the timesteps are the same.
    pub timesteps_equal: bool,
}

impl Comparison {
    /// What is not as diffusers has it: timesteps that differ, and each tensor whose largest
    /// difference is over [`TOLERANCE`] of its range. Empty: the run matches.
    pub fn failures(&self) -> Vec<String> {
        let mut failures = Vec::new();
        if !self.timesteps_equal {
            failures.push("the timesteps differ".to_string());
        }
        for (what, difference) in [
            ("image", self.image),
            ("embeds", self.embeds),
            ("negative embeds", self.negative_embeds),
            ("final latents", self.final_latents),
        ] {
            if difference.relative() > TOLERANCE {
                failures.push(format!("{what}: largest difference {difference}, over {TOLERANCE:e} of the range"));
            }
        }
        failures
    }

    /// The differences between a run and the reference.
    pub fn of(generated: &Generated, reference: &Reference) -> Result<Comparison, BoxError> {
        Ok(Comparison {
            image: Difference::of("image", &generated.image, &reference.image)?,
            embeds: Difference::of("embeds", &generated.embeds, &reference.embeds)?,
            negative_embeds: Difference::of("negative_embeds", &generated.negative_embeds, &reference.negative_embeds)?,
            final_latents: Difference::of("final_latents", &generated.final_latents, &reference.final_latents)?,
            timesteps_equal: generated.timesteps == reference.timesteps,
        })
    }
}

impl fmt::Display for Comparison {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "image            {}", self.image)?;
        writeln!(f, "embeds           {}", self.embeds)?;
        writeln!(f, "negative_embeds  {}", self.negative_embeds)?;
        writeln!(f, "final_latents    {}", self.final_latents)?;
        write!(f, "timesteps        {}", if self.timesteps_equal { "equal" } else { "DIFFER" })
    }
}
