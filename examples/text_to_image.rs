//! Text encoder → denoiser run for N steps → image decoder, three models in three stages.
//!
//! What it teaches: the smallest staged pipeline with a loop inside a stage. Each stage lists its
//! one model; `models.enter("denoise")` releases the text encoder in place (its memory goes back
//! to the OS) before the denoiser is built, and `enter("decode")` releases the denoiser. The
//! starting noise is drawn before any lazy build, and the builds in between draw nothing the run
//! sees (the registry saves and restores the generators around them), so staged and eager give
//! the same image bit for bit. Same options as `cascade` (`--mode eager|staged`, `--prefetch`,
//! `--trace`, `--scale`, `--steps`, ...), plus `--prompt`.
//!
//!     cargo run --release --example text_to_image -- --prompt "a red fox in the snow" --steps 8

use std::sync::Arc;

use clap::Parser;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use sha2::{Digest, Sha256};
use stageload::{BoxError, ModelSpec, SharedRng};
use stageload_demo_kit::models::transformer_loader;
use stageload_demo_kit::run::Demo;
use stageload_demo_kit::{
    cached_checkpoint, sample_flow, schedule, tokens_at, width_at, CommonArgs, DemoSpec, Loading, ModelShape,
    Transformer, CHANNELS,
};
use tch::nn::Module;
use tch::{Device, Kind, Tensor};

#[derive(Parser)]
struct Args {
    #[command(flatten)]
    common: CommonArgs,
    /// What to draw
    #[arg(long, default_value = "a lighthouse on a cliff at dusk")]
    prompt: String,
}

fn shapes(scale: f64) -> [ModelShape; 3] {
    let width = width_at(1024, scale);
    let shape = |name, depth| ModelShape { name, input: CHANNELS, width, depth, output: CHANNELS };
    [shape("text_encoder", 8), shape("denoiser", 16), shape("image_decoder", 6)]
}

/// One embedding row per word, fixed by the word alone (a stand-in for a tokenizer and its table).
fn embed(prompt: &str) -> Tensor {
    let rows: Vec<f32> = prompt
        .split_whitespace()
        .flat_map(|word| {
            let digest = Sha256::digest(word.to_lowercase().as_bytes());
            let mut table = ChaCha8Rng::from_seed(digest.into());
            (0..CHANNELS).map(move |_| table.gen_range(-1.0f32..1.0))
        })
        .collect();
    let words = (rows.len() as i64 / CHANNELS).max(1);
    if rows.is_empty() {
        return Tensor::zeros([1, CHANNELS], (Kind::Float, Device::Cpu));
    }
    Tensor::from_slice(&rows).view([words, CHANNELS])
}

fn main() -> Result<(), BoxError> {
    let args = Args::parse();
    let common = args.common;
    let _no_grad = tch::no_grad_guard();

    // Three models, each filled from a checkpoint written once, and one stage each.
    let folder = common.cache_folder("text_to_image");
    let mut models = Vec::new();
    for (seed, shape) in shapes(common.scale).iter().enumerate() {
        let file = cached_checkpoint(&folder, shape, &["model"], 400 + seed as i64)?;
        models.push(ModelSpec::new(shape.name, transformer_loader(shape.clone(), common.device)).checkpoint([file]));
    }
    let stage = |name: &str, model: &str| (name.to_string(), vec![model.to_string()]);
    let spec = DemoSpec {
        name: "text_to_image",
        models,
        stages: vec![stage("encode", "text_encoder"), stage("denoise", "denoiser"), stage("decode", "image_decoder")],
        pinned: Vec::new(),
        pins: Vec::new(),
        weights: Vec::new(),
    };

    // The registry over the pipeline file the demo writes (eager: everything pinned), with the
    // meter as its event sink and the ChaCha generator preserved around builds.
    let chacha = SharedRng::new(ChaCha8Rng::seed_from_u64(common.seed));
    let demo = Demo::start(&spec, &common)?;
    let models = demo.builder(spec.models).register_rng(Arc::new(chacha.clone())).build()?;
    let mut p = demo.run(models);
    if p.loading() == Loading::Eager {
        p.load_everything()?;
    }
    tch::manual_seed(common.torch_seed());
    *chacha.lock() = ChaCha8Rng::seed_from_u64(common.seed);
    let latent_tokens = tokens_at(1024, common.scale);
    // The starting noise, drawn before any lazy build.
    let x = Tensor::randn([latent_tokens, CHANNELS], (Kind::Float, common.device));
    p.latent("noise", &x);

    p.enter("encode")?;
    let text =
        p.call("text_encoder", |m: &mut Transformer| m.forward(&embed(&args.prompt).to_device(common.device)))?;
    let cond = text.mean_dim(0, true, Kind::Float);
    p.latent("text", &cond);

    p.enter("denoise")?; // the text encoder is released here
    let times = schedule(common.steps, &chacha);
    let x = p.call("denoiser", |m: &mut Transformer| sample_flow(m, x, &cond, &times))?;
    p.latent("denoised", &x);

    p.enter("decode")?; // and the denoiser here
    let image = p.call("image_decoder", |m: &mut Transformer| m.forward(&x))?;
    p.latent("image", &image);
    p.finish()
}
