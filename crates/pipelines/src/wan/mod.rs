//! Wan2.1 text-to-video (diffusers' `WanPipeline`, Wan-AI's Wan2.1-T2V-1.3B) over the TorchScript
//! export of `scripts/reference/wan_export.py`: the umT5 text encoder (bfloat16, as published), the
//! `WanTransformer3DModel` run for N UniPC steps with classifier-free guidance (bfloat16 but for the
//! modules diffusers keeps in float32), and the video VAE's decoder (float32), as three registry
//! models in four stages (`encode`: `text_encoder`, `denoise`: `transformer`, `decode`:
//! `vae_decoder`, `export`: none, while the frames are written). This file owns reading an export
//! (its `config.json` and the files it names, checked), the token ids a run takes, and the
//! pipeline run: the operations diffusers runs, in its order and on its dtypes, so that every
//! output matches it bit for bit on the CPU. Writing the frames (PNG, GIF) is [`files`]; running
//! diffusers itself and comparing is [`reference`](mod@reference). `examples/wan.rs` builds a
//! registry and runs it; `tests/wan.rs` checks it at the small size against diffusers.
//!
//! # The run, as diffusers does it
//!
//! - **token ids**: no tokenizer runs here. A prompt is its umT5 token ids (the words, then `</s>` =
//!   1), padded with `<pad>` = 0 to the export's sequence length L with an attention mask of ones
//!   over the ids, as the tokenizer's `padding="max_length"` gives them. The export's `config.json`
//!   carries ids for a prompt and for the empty negative prompt (`[1]`).
//! - **encode**: `text_encoder(ids, mask)` ([1, L, d] bfloat16), cut to the mask's length and padded
//!   with zeros back to L (`_get_t5_prompt_embeds`), for the prompt and, with guidance above 1, for
//!   the negative prompt.
//! - **noise**: `randn([1, 16, T, h, w])` float32 from torch's CPU generator after
//!   `manual_seed(seed)` (the draw `torch.Generator().manual_seed(seed)` makes in
//!   `prepare_latents`): T = (frames - 1) / 4 + 1 latent frames, h × w = the frame size / 8.
//! - **denoise**: for each UniPC timestep t: the transformer on `latents.to(bfloat16)`, `[t]`
//!   (int64) and the prompt's embeddings, then (guidance above 1) on the negative embeddings,
//!   `uncond + G * (cond - uncond)` in bfloat16, then the UniPC step ([`crate::schedulers::unipc`]) in float32.
//! - **decode**: the VAE decoder's module runs what the pipeline runs after the loop:
//!   `latents / (1 / latents_std) + latents_mean`, then `AutoencoderKLWan.decode`, which decodes
//!   one latent frame at a time with its causal convolution cache (the export traced that loop, so
//!   the chunking is diffusers' own), clamped to [-1, 1]. Then the video processor's `"np"` output:
//!   [F, H, W, 3] of `(x * 0.5 + 0.5).clamp(0, 1)`, and its `"pil"` pixels `(x * 255).round()`.
//!
//! # Bad input
//!
//! An export whose files or shapes do not agree is an [`ExportError`] naming the file; token ids
//! outside the vocabulary, longer than L or empty, a guidance that is not finite, a latent tensor
//! of another shape are a [`RunError`], refused before any model loads.

pub mod files;
pub mod reference;

use std::path::{Path, PathBuf};

use serde::Deserialize;
use stageload::{BoxError, ModelSpec};
use tch::{Device, Kind, Tensor};

pub use crate::export::ExportError;
use crate::export::{component_spec, ExportDir, Format, Scripts};
use crate::runner::{forward, PipelineExport, StageRunner};
use crate::schedulers::unipc::{UniPc, UniPcConfig};

/// The three models, in the order the pipeline runs them.
pub const MODELS: [&str; 3] = ["text_encoder", "transformer", "vae_decoder"];
/// The stages and the models each one runs (`export` writes files and holds none).
pub const STAGES: [(&str, &[&str]); 4] =
    [("encode", &["text_encoder"]), ("denoise", &["transformer"]), ("decode", &["vae_decoder"]), ("export", &[])];
/// The latent channels of Wan2.1's VAE (the transformer's `in_channels`).
pub const LATENT_CHANNELS: i64 = 16;
/// Frames per latent frame after the first (the VAE's temporal compression).
pub const TEMPORAL_SCALE: i64 = 4;
/// Pixels per latent pixel along each side (the VAE's spatial compression).
pub const SPATIAL_SCALE: i64 = 8;
/// The longest sequence an export may trace (umT5's relative attention has no limit of its own).
pub const MAX_SEQUENCE: i64 = 4096;
/// The most frames, and the largest side in pixels, an export may say it was traced at (the
/// published model's 81 frames of 480 x 832, with room); the traced shapes must agree with them.
const MAX_FRAMES: i64 = 257;
const MAX_SIDE: i64 = 2048;
/// The export format this file reads.
const FORMAT: u32 = 1;
/// The scripts that make an export: named in every [`ExportError`].
pub const SCRIPTS: Scripts = Scripts { export: "wan_export.py", sizes: "small|published", pt2: None };
/// umT5's padding id.
const PAD: i64 = 0;

/// Why a run could not start or a model's output is not what the pipeline expects.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunError {
    /// The guidance is not a finite number.
    #[error("guidance {0} is not a finite number (the pipeline's default is 5.0; 1 or below runs no negative prompt)")]
    Guidance(f64),
    /// A prompt's token ids are empty or longer than the export's sequence length.
    #[error(
        "the {which}'s {count} token ids do not fit the export's sequence length {length}: give 1 to {length} ids (the words, then </s> = 1)"
    )]
    TokenCount {
        /// `prompt` or `negative prompt`.
        which: &'static str,
        /// How many ids it has.
        count: usize,
        /// The export's sequence length L.
        length: i64,
    },
    /// A token id is outside the text encoder's vocabulary.
    #[error("the {which}'s token id {id} (at {position}) is outside the text encoder's vocabulary of {vocab} ids")]
    TokenId {
        /// `prompt` or `negative prompt`.
        which: &'static str,
        /// The id.
        id: i64,
        /// Its position.
        position: usize,
        /// The vocabulary's size.
        vocab: i64,
    },
    /// The latents are not float32 of the export's latent shape.
    #[error("the latents are {kind:?} {shape:?}; this export's transformer takes float32 {expected:?} (Export::noise draws them)")]
    Latents {
        /// Their dtype.
        kind: Kind,
        /// Their shape.
        shape: Vec<i64>,
        /// The export's latent shape.
        expected: Vec<i64>,
    },
    /// A model gave an output of another shape or dtype.
    #[error(
        "{model}: gave {kind:?} {found:?}, the pipeline expects {expected_kind:?} {expected:?}: the module does not agree with the export's config.json; export again with scripts/reference/wan_export.py"
    )]
    Output {
        /// The model.
        model: &'static str,
        /// The output's dtype.
        kind: Kind,
        /// Its shape.
        found: Vec<i64>,
        /// The dtype the pipeline expects.
        expected_kind: Kind,
        /// The shape the pipeline expects.
        expected: Vec<i64>,
    },
}

/// A tensor's dtype and shape, as the export records a trace's inputs and output.
#[derive(Debug, Clone, Deserialize)]
pub struct TensorInfo {
    /// torch's dtype name (`bfloat16`, `float32`, `int64`).
    pub dtype: String,
    /// The shape.
    pub shape: Vec<i64>,
}

/// A module file, relative to the export's folder, and the shapes it was traced at.
#[derive(Debug, Clone, Deserialize)]
pub struct ModuleFile {
    /// The TorchScript file.
    pub file: String,
    /// Its safetensors checkpoint, if the export wrote one (not for the text encoder: see
    /// [`PipelineExport::model_specs`]).
    #[serde(default)]
    pub weights: Option<String>,
    /// Its parameters' and buffers' bytes (the plan's size for a module without a checkpoint).
    pub bytes: u64,
    /// The inputs it was traced at.
    pub trace_inputs: Vec<TensorInfo>,
    /// Its output on them.
    pub output: TensorInfo,
}

/// The three components' files.
#[derive(Debug, Clone, Deserialize)]
pub struct Components {
    /// The umT5 text encoder (its weights in the module only).
    pub text_encoder: ModuleFile,
    /// The transformer.
    pub transformer: ModuleFile,
    /// The VAE decoder.
    pub vae_decoder: ModuleFile,
}

/// The token ids the export carries (each padded to L) and their masks.
#[derive(Debug, Clone, Deserialize)]
pub struct TokenIds {
    /// The prompt's ids.
    pub prompt: Vec<i64>,
    /// Its attention mask.
    pub prompt_mask: Vec<i64>,
    /// The empty negative prompt's ids.
    pub negative: Vec<i64>,
    /// Its attention mask.
    pub negative_mask: Vec<i64>,
}

/// The scheduler's entry: diffusers' class and its configuration.
#[derive(Debug, Clone, Deserialize)]
pub struct SchedulerEntry {
    /// The configuration, as diffusers' `scheduler_config.json` has it.
    pub config: serde_json::Value,
}

/// The fields of an export's `config.json` the pipeline reads.
#[derive(Debug, Clone, Deserialize)]
pub struct ExportConfig {
    /// The export's format number.
    pub format: u32,
    /// `small` or `published`.
    pub size: String,
    /// L: the sequence length the text encoder is traced at (the pipeline's `max_sequence_length`).
    pub max_sequence_length: i64,
    /// Frames of the video (4k + 1).
    pub num_frames: i64,
    /// The frames' height in pixels.
    pub height: i64,
    /// The frames' width in pixels.
    pub width: i64,
    /// The text encoder's vocabulary size.
    pub vocab_size: i64,
    /// The text encoder's width.
    pub text_dim: i64,
    /// Token ids for a prompt and for the empty negative prompt.
    pub token_ids: TokenIds,
    /// The scheduler.
    pub scheduler: SchedulerEntry,
    /// The components' files.
    pub components: Components,
}

/// An export read and checked.
#[derive(Debug, Clone)]
pub struct Export {
    read: ExportDir<ExportConfig>,
    scheduler: UniPcConfig,
    prompt_ids: Vec<i64>,
    negative_ids: Vec<i64>,
}

impl Export {
    /// Reads `dir/config.json`, checks that its sizes are ones the pipeline runs, reads its
    /// scheduler's configuration, and checks that every file it names is there.
    pub fn open(dir: impl Into<PathBuf>) -> Result<Export, ExportError> {
        let read: ExportDir<ExportConfig> = ExportDir::read(dir, SCRIPTS)?;
        let unsupported = |message: String| read.unsupported(message);
        let c = read.config();
        read.check_format(c.format, FORMAT)?;
        if !(1..=MAX_FRAMES).contains(&c.num_frames) || (c.num_frames - 1) % TEMPORAL_SCALE != 0 {
            return Err(unsupported(format!(
                "num_frames = {}: the VAE decodes 4k + 1 frames (1, 5, 9, ..., up to {MAX_FRAMES})",
                c.num_frames
            )));
        }
        let side = SPATIAL_SCALE * 2; // the VAE's 8, times the transformer's 2 x 2 patches
        for (field, value) in [("height", c.height), ("width", c.width)] {
            if !(1..=MAX_SIDE).contains(&value) || value % side != 0 {
                return Err(unsupported(format!(
                    "{field} = {value}: WanPipeline takes a positive multiple of {side} up to {MAX_SIDE}"
                )));
            }
        }
        if !(1..=MAX_SEQUENCE).contains(&c.max_sequence_length) {
            return Err(unsupported(format!(
                "max_sequence_length = {} is not between 1 and {MAX_SEQUENCE}",
                c.max_sequence_length
            )));
        }
        if c.vocab_size < 2 || c.text_dim < 1 {
            return Err(unsupported(format!(
                "vocab_size = {} and text_dim = {}: a text encoder has at least 2 ids and a width of at least 1; export again with scripts/reference/wan_export.py",
                c.vocab_size, c.text_dim
            )));
        }
        let t = &c.token_ids;
        let (length, vocab) = (c.max_sequence_length, c.vocab_size);
        let prompt_ids = unpadded("prompt", &t.prompt, &t.prompt_mask, length, vocab).map_err(&unsupported)?;
        let negative_ids =
            unpadded("negative prompt", &t.negative, &t.negative_mask, length, vocab).map_err(&unsupported)?;
        let scheduler = UniPcConfig::from_json(&c.scheduler.config.to_string())
            .map_err(|source| ExportError::Scheduler { path: read.config_path(), source: source.into() })?;
        let export = Export { read, scheduler, prompt_ids, negative_ids };
        export.check_traces().map_err(|message| export.read.unsupported(message))?;
        let files = export.files().into_iter().flat_map(|(model, module, weights)| {
            std::iter::once((model, module)).chain(weights.map(|weights| (model, weights)))
        });
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

    /// The scheduler's configuration.
    pub fn scheduler(&self) -> &UniPcConfig {
        &self.scheduler
    }

    /// The latents' shape: [1, 16, T, h, w].
    pub fn latent_shape(&self) -> [i64; 5] {
        let c = self.config();
        let frames = (c.num_frames - 1) / TEMPORAL_SCALE + 1;
        [1, LATENT_CHANNELS, frames, c.height / SPATIAL_SCALE, c.width / SPATIAL_SCALE]
    }

    /// The prompt's token ids the export carries, without their padding.
    pub fn prompt_ids(&self) -> &[i64] {
        &self.prompt_ids
    }

    /// The empty negative prompt's token ids (`[1]`, `</s>`).
    pub fn negative_ids(&self) -> &[i64] {
        &self.negative_ids
    }

    /// The video's shape as the VAE decoder gives it: [1, 3, F, H, W].
    fn video_shape(&self) -> [i64; 5] {
        let c = self.config();
        [1, 3, c.num_frames, c.height, c.width]
    }

    /// The traces' recorded shapes against the sizes the config states, and the checkpoints the
    /// transformer and the VAE decoder must have.
    fn check_traces(&self) -> Result<(), String> {
        let c = self.config();
        let (length, width, latent) = (c.max_sequence_length, c.text_dim, self.latent_shape().to_vec());
        let parts = &c.components;
        let expected = [
            ("text_encoder", &parts.text_encoder, vec![vec![1, length], vec![1, length]], vec![1, length, width]),
            ("transformer", &parts.transformer, vec![latent.clone(), vec![1], vec![1, length, width]], latent.clone()),
            ("vae_decoder", &parts.vae_decoder, vec![latent], self.video_shape().to_vec()),
        ];
        for (model, files, inputs, output) in expected {
            let traced: Vec<Vec<i64>> = files.trace_inputs.iter().map(|t| t.shape.clone()).collect();
            if traced != inputs || files.output.shape != output {
                return Err(format!(
                    "{model} was traced at inputs {traced:?} giving {:?}; the sizes this config states need {inputs:?} giving {output:?}: export again with scripts/reference/wan_export.py",
                    files.output.shape
                ));
            }
            if model != "text_encoder" && files.weights.is_none() {
                return Err(format!(
                    "{model} has no safetensors checkpoint (weights); export again with scripts/reference/wan_export.py"
                ));
            }
        }
        Ok(())
    }

    /// Each model with its module file and its checkpoint, in the order of [`MODELS`].
    pub fn files(&self) -> [(&'static str, PathBuf, Option<PathBuf>); 3] {
        let (c, dir) = (&self.config().components, self.dir());
        [(MODELS[0], &c.text_encoder), (MODELS[1], &c.transformer), (MODELS[2], &c.vae_decoder)]
            .map(|(name, files)| (name, dir.join(&files.file), files.weights.as_ref().map(|w| dir.join(w))))
    }

    /// The initial latents of `seed`: `tch::manual_seed(seed)`, then `randn` of
    /// [`latent_shape`](Self::latent_shape) from torch's CPU generator (what
    /// `torch.Generator().manual_seed(seed)` draws in `prepare_latents`).
    pub fn noise(&self, seed: i64) -> Tensor {
        tch::manual_seed(seed);
        Tensor::randn(self.latent_shape(), (Kind::Float, Device::Cpu))
    }
}

impl PipelineExport for Export {
    const STAGES: &'static [(&'static str, &'static [&'static str])] = &STAGES;

    /// The three models as TorchScript modules. The transformer and the VAE decoder have their
    /// safetensors as the checkpoint that refills them after a release; the text encoder has none
    /// (the published one is 11.4 GB, and the pipeline encodes once): released, it is read from
    /// its module file again.
    fn model_specs(&self) -> Vec<ModelSpec> {
        self.files().into_iter().map(|(name, module, weights)| component_spec(name, module, weights)).collect()
    }
}

/// The ids of `ids` up to the mask's length, after checking that the mask is ones then zeros,
/// the padding is `<pad>`, and the ids fit the vocabulary and the length.
fn unpadded(which: &'static str, ids: &[i64], mask: &[i64], length: i64, vocab: i64) -> Result<Vec<i64>, String> {
    let expected = usize::try_from(length).map_err(|e| e.to_string())?;
    if ids.len() != expected || mask.len() != expected {
        return Err(format!("the {which}'s ids and mask are {} and {} long, not {length}", ids.len(), mask.len()));
    }
    let count = mask.iter().take_while(|m| **m == 1).count();
    if count == 0 || mask[count..].iter().any(|m| *m != 0) || ids[count..].iter().any(|id| *id != PAD) {
        return Err(format!("the {which}'s mask is not ones over its ids then zeros over <pad> (0) ids"));
    }
    let ids = ids[..count].to_vec();
    check_ids(which, &ids, length, vocab).map_err(|e| e.to_string())?;
    Ok(ids)
}

/// `ids` unless they are empty, longer than `length` or outside the vocabulary.
fn check_ids(which: &'static str, ids: &[i64], length: i64, vocab: i64) -> Result<(), RunError> {
    if ids.is_empty() || i64::try_from(ids.len()).map_or(true, |n| n > length) {
        return Err(RunError::TokenCount { which, count: ids.len(), length });
    }
    if let Some((position, &id)) = ids.iter().enumerate().find(|(_, id)| !(0..vocab).contains(*id)) {
        return Err(RunError::TokenId { which, id, position, vocab });
    }
    Ok(())
}

/// The pipeline's settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// UniPC steps (one transformer call per step, two with guidance above 1).
    pub steps: usize,
    /// Classifier-free guidance scale (the pipeline's default is 5.0; 1 or below: no negative prompt).
    pub guidance: f64,
}

/// A prompt as the tokenizer would give it: its ids padded to L, its mask, its length.
#[derive(Debug)]
struct Tokens {
    ids: Tensor,
    mask: Tensor,
    len: i64,
}

impl Tokens {
    fn new(which: &'static str, ids: &[i64], length: i64, vocab: i64) -> Result<Tokens, RunError> {
        check_ids(which, ids, length, vocab)?;
        // ids.len() <= length <= MAX_SEQUENCE: the conversions below cannot fail or wrap.
        let len = ids.len() as i64;
        let mut padded = ids.to_vec();
        padded.resize(length as usize, PAD);
        let mask: Vec<i64> = (0..length).map(|i| i64::from(i < len)).collect();
        Ok(Tokens {
            ids: Tensor::from_slice(&padded).view([1, length]),
            mask: Tensor::from_slice(&mask).view([1, length]),
            len,
        })
    }
}

/// What a run of the pipeline gives.
#[derive(Debug)]
pub struct Generated {
    /// The prompt's embeddings as the transformer sees them, bfloat16 [1, L, d].
    pub prompt_embeds: Tensor,
    /// The negative prompt's, when the guidance is above 1.
    pub negative_prompt_embeds: Option<Tensor>,
    /// The initial latents it was given, float32 [1, 16, T, h, w].
    pub initial_latents: Tensor,
    /// The scheduler's timesteps.
    pub timesteps: Vec<i64>,
    /// The latents after the last step.
    pub final_latents: Tensor,
    /// The video as the pipeline's `"np"` output: float32 [F, H, W, 3] in [0, 1].
    pub video: Tensor,
    /// Its frames' pixels as the `"pil"` output has them: uint8 [F, H, W, 3].
    pub frames: Tensor,
}

/// `tensor` unless its shape or dtype differs.
fn checked(tensor: Tensor, model: &'static str, kind: Kind, shape: &[i64]) -> Result<Tensor, RunError> {
    if tensor.size() != shape || tensor.kind() != kind {
        let (found, expected) = (tensor.size(), shape.to_vec());
        return Err(RunError::Output { model, kind: tensor.kind(), found, expected_kind: kind, expected });
    }
    Ok(tensor)
}

/// The text encoder on `tokens`, cut to the prompt's length and padded with zeros back to L.
fn encode(runner: &impl StageRunner, tokens: &Tokens, length: i64, width: i64) -> Result<Tensor, BoxError> {
    let inputs = [tokens.ids.shallow_clone(), tokens.mask.shallow_clone()];
    let out = forward(runner, Format::Torchscript, "text_encoder", &inputs)?;
    let out = checked(out, "text_encoder", Kind::BFloat16, &[1, length, width])?;
    let kept = out.get(0).narrow(0, 0, tokens.len);
    let padding = kept.new_zeros([length - tokens.len, width], (kept.kind(), kept.device()));
    Ok(Tensor::cat(&[kept, padding], 0).unsqueeze(0))
}

/// A run's inputs checked, as [`generate`] checks them before any model loads: the guidance is
/// finite, the token ids fit (the negative prompt's only with guidance above 1: diffusers encodes
/// it only then), the latents have the export's shape, and the scheduler runs `sampling.steps`.
/// A caller that loads models before the run (eager) calls it first.
pub fn check_inputs(
    export: &Export,
    prompt: &[i64],
    negative: &[i64],
    latents: &Tensor,
    sampling: Sampling,
) -> Result<(), BoxError> {
    prepare(export, prompt, negative, latents, sampling).map(drop)
}

/// The checked inputs as the run takes them: the prompts' tokens (the negative one with guidance
/// only) and the scheduler.
fn prepare(
    export: &Export,
    prompt: &[i64],
    negative: &[i64],
    latents: &Tensor,
    sampling: Sampling,
) -> Result<(Tokens, Option<Tokens>, UniPc), BoxError> {
    let c = export.config();
    if !sampling.guidance.is_finite() {
        return Err(RunError::Guidance(sampling.guidance).into());
    }
    let (length, vocab) = (c.max_sequence_length, c.vocab_size);
    let prompt = Tokens::new("prompt", prompt, length, vocab)?;
    let guided = sampling.guidance > 1.0;
    let negative = if guided { Some(Tokens::new("negative prompt", negative, length, vocab)?) } else { None };
    let shape = export.latent_shape();
    if latents.size() != shape || latents.kind() != Kind::Float {
        return Err(RunError::Latents { kind: latents.kind(), shape: latents.size(), expected: shape.to_vec() }.into());
    }
    Ok((prompt, negative, UniPc::new(export.scheduler(), sampling.steps)?))
}

/// Runs the pipeline on `prompt` and `negative` (token ids, unpadded) from `latents`: checks them
/// ([`check_inputs`]), then enters `encode`, `denoise` and `decode` in turn on `runner` and calls
/// each stage's model there (see the module docs for the operations). Runs without gradients, on
/// the CPU.
pub fn generate(
    runner: &impl StageRunner,
    export: &Export,
    prompt: &[i64],
    negative: &[i64],
    latents: &Tensor,
    sampling: Sampling,
) -> Result<Generated, BoxError> {
    let c = export.config();
    let (prompt, negative, mut unipc) = prepare(export, prompt, negative, latents, sampling)?;
    let (length, shape) = (c.max_sequence_length, export.latent_shape());
    let _no_grad = tch::no_grad_guard();

    runner.enter("encode")?;
    let prompt_embeds = encode(runner, &prompt, length, c.text_dim)?;
    let negative_prompt_embeds = match &negative {
        Some(negative) => Some(encode(runner, negative, length, c.text_dim)?),
        None => None,
    };

    runner.enter("denoise")?;
    let timesteps = unipc.timesteps().to_vec();
    let mut x = latents.shallow_clone();
    for &t in &timesteps {
        let input = x.to_kind(Kind::BFloat16);
        let timestep = Tensor::from_slice(&[t]);
        let call = |embeds: &Tensor| -> Result<Tensor, BoxError> {
            let inputs = [input.shallow_clone(), timestep.shallow_clone(), embeds.shallow_clone()];
            let out = forward(runner, Format::Torchscript, "transformer", &inputs)?;
            Ok(checked(out, "transformer", Kind::BFloat16, &shape)?)
        };
        let cond = call(&prompt_embeds)?;
        let noise = match &negative_prompt_embeds {
            Some(negative) => {
                let uncond = call(negative)?;
                &uncond + (&cond - &uncond) * sampling.guidance
            }
            None => cond,
        };
        x = unipc.step(&noise, &x)?;
    }
    let final_latents = x;

    runner.enter("decode")?;
    let decoded = forward(runner, Format::Torchscript, "vae_decoder", &[final_latents.shallow_clone()])?;
    let decoded = checked(decoded, "vae_decoder", Kind::Float, &export.video_shape())?;
    // postprocess_video: each video [C, F, H, W] as frames [F, C, H, W], denormalized, as [F, H, W, C].
    let frames = decoded.get(0).permute([1, 0, 2, 3]);
    let video = (frames * 0.5 + 0.5).clamp(0.0, 1.0).permute([0, 2, 3, 1]).contiguous();
    let frames = (&video * 255.0).round().to_kind(Kind::Uint8);
    Ok(Generated {
        prompt_embeds,
        negative_prompt_embeds,
        initial_latents: latents.shallow_clone(),
        timesteps,
        final_latents,
        video,
        frames,
    })
}
