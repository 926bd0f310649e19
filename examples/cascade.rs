//! A stand-in for an image-to-3D cascade, shaped like the pipeline the original tool measured:
//! seven models (sparse-structure flow and decoder, shape flows at 512 and 1024, a shape decoder
//! used in two stages, texture flow and decoder) and four feature extractors sharing one
//! backbone. Stages: setup → structure → shape_512 → shape_1024 → texture → decode → export.
//!
//! What it teaches: a pipeline's **stage entries** (each stage lists the models it calls; a model
//! no stage lists at the current one is released in place), a **pin with a span** (the four
//! extractors, and with the last of them the backbone they share through `BuildContext::shared`,
//! stay resident from the start until `decode` begins), **prefetch** (`--prefetch`: entering a
//! stage loads the next stage's models in the background; those builds skip random
//! initialisation, every weight comes from the checkpoint), a **registered generator** (a ChaCha
//! RNG saved and restored around every lazy build, as torch's own are, so a seeded run draws the
//! same noise staged or eager), and the pipeline file `stageload plan` checks, which the registry
//! then runs. `--mode eager` is the baseline: every model pinned and loaded before seeding.
//!
//! The models are transformers (attention + MLP blocks) whose checkpoints the demo kit writes
//! once and caches; `--scale 1` is about 3 GB of weights, `--scale 4` a preset for bigger
//! machines. It prints each stage's latent fingerprint and peak memory.
//!
//!     cargo run --release --example cascade -- --mode staged --trace staged.jsonl
//!     cargo run --release --example cascade -- --mode eager --trace eager.jsonl
//!     cargo run --release --example cascade -- --prefetch --scale 0.1

use std::sync::Arc;

use clap::Parser;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use stageload::{BoxError, BuildContext, Built, ModelSpec, Shared, SharedRng};
use stageload_demo_kit::models::{cascade_seed, cascade_shapes, transformer_loader};
use stageload_demo_kit::run::Demo;
use stageload_demo_kit::{
    cached, cached_checkpoint, sample_flow, schedule, tokens_at, CommonArgs, DemoRun, DemoSpec, Loading, ModelShape,
    Transformer, CHANNELS,
};
use stageload_plan::PinEntry;
use tch::nn::{self, Module, VarStore};
use tch::{Device, Kind, Tensor};

#[derive(Parser)]
struct Args {
    #[command(flatten)]
    common: CommonArgs,
}

const EXTRACTORS: [&str; 4] = ["ss_extractor", "shape512_extractor", "shape1024_extractor", "tex_extractor"];

/// A feature extractor: the shared backbone and a head of its own.
#[derive(Debug)]
struct Extractor {
    backbone: Shared<Transformer>,
    head: nn::Linear,
}

impl Extractor {
    /// Image tokens → one conditioning row per latent channel.
    fn condition(&self, image: &Tensor) -> Tensor {
        self.backbone.lock().forward(image).apply(&self.head).mean_dim(0, true, Kind::Float)
    }
}

/// An extractor's loader: the backbone is built once and shared by every extractor
/// (`ctx.shared`), and released when the last of them is; the head is the extractor's own.
fn extractor_loader(
    backbone: ModelShape,
    device: Device,
) -> impl Fn(&BuildContext) -> Result<Built, BoxError> + Send + Sync {
    move |ctx| {
        let shared = ctx.shared("backbone", || {
            let vs = VarStore::new(device);
            let model = Transformer::new(vs.root() / "model", &backbone);
            Ok((model, stageload::named_tensors(&vs)))
        })?;
        let vs = VarStore::new(device);
        let head = nn::linear(vs.root() / "head", backbone.output, CHANNELS, Default::default());
        Ok(Built::new(Extractor { backbone: shared, head }, &vs))
    }
}

/// The models (each with its loader and checkpoint files), the stages and the pin.
fn spec(args: &CommonArgs) -> Result<DemoSpec, BoxError> {
    let folder = args.cache_folder("cascade");
    let device = args.device;
    let mut models = Vec::new();
    let all = cascade_shapes(args.scale);
    let (backbone, flows) = all.split_last().expect("the backbone is last");
    for (seed, shape) in flows.iter().enumerate() {
        let file = cached_checkpoint(&folder, shape, &["model"], cascade_seed(seed))?;
        models.push(ModelSpec::new(shape.name, transformer_loader(shape.clone(), device)).checkpoint([file]));
    }
    let backbone_file = cached_checkpoint(&folder, backbone, &["backbone", "model"], 200)?;
    for (seed, name) in EXTRACTORS.iter().enumerate() {
        let head_file = folder.join(format!("{name}-head-{}.safetensors", backbone.output));
        cached(&head_file, 300 + seed as i64, |vs| {
            let _ = nn::linear(vs.root() / "head", backbone.output, CHANNELS, Default::default());
        })?;
        // An extractor's checkpoint is two files: the shared backbone's and its head's.
        models.push(
            ModelSpec::new(*name, extractor_loader(backbone.clone(), device))
                .checkpoint([backbone_file.clone(), head_file]),
        );
    }
    let stage = |name: &str, models: &[&str]| (name.to_string(), models.iter().map(|m| m.to_string()).collect());
    Ok(DemoSpec {
        name: "cascade",
        models,
        stages: vec![
            stage("setup", &EXTRACTORS),
            stage("structure", &["ss_flow", "ss_decoder"]),
            stage("shape_512", &["shape_flow_512", "shape_decoder"]),
            stage("shape_1024", &["shape_flow_1024"]),
            stage("texture", &["texture_flow"]),
            // shape_decoder comes back here, in place, from its checkpoint.
            stage("decode", &["shape_decoder", "texture_decoder"]),
            stage("export", &[]),
        ],
        pinned: Vec::new(),
        // The extractors (and with the last of them the backbone) stay until decoding begins.
        pins: vec![PinEntry {
            models: EXTRACTORS.iter().map(|e| e.to_string()).collect(),
            from: None,
            until: Some("decode".to_string()),
        }],
        weights: Vec::new(),
    })
}

/// Calls model `name` (checking residency first with `--check-residency`) on `input`.
fn run(p: &DemoRun, name: &str, input: &Tensor) -> Result<Tensor, BoxError> {
    p.call(name, |m: &mut Transformer| m.forward(input))
}

fn flow(p: &DemoRun, name: &str, x: Tensor, cond: &Tensor, times: &[f64]) -> Result<Tensor, BoxError> {
    p.call(name, |m: &mut Transformer| sample_flow(m, x, cond, times))
}

fn condition(p: &DemoRun, name: &str, image: &Tensor) -> Result<Tensor, BoxError> {
    p.call(name, |m: &mut Extractor| m.condition(image))
}

fn main() -> Result<(), BoxError> {
    let args = Args::parse().common;
    let _no_grad = tch::no_grad_guard();
    tch::set_num_threads(std::thread::available_parallelism().map_or(1, |n| n.get()) as i32);
    let chacha = SharedRng::new(ChaCha8Rng::seed_from_u64(args.seed));

    // The registry: the pipeline file's stages and pin (written for `stageload plan`, read back),
    // events to the meter, the ChaCha generator preserved around builds, and prefetch.
    let spec = spec(&args)?;
    let demo = Demo::start(&spec, &args)?;
    let models = demo.builder(spec.models).register_rng(Arc::new(chacha.clone())).build()?;
    let mut p = demo.run(models);
    let noise = |tokens: i64| Tensor::randn([tokens, CHANNELS], (Kind::Float, args.device));
    let (image_tokens, t_structure, t_512, t_1024) = (
        tokens_at(256, args.scale),
        tokens_at(256, args.scale),
        tokens_at(512, args.scale),
        tokens_at(1024, args.scale),
    );

    p.enter("setup")?;
    if p.loading() == Loading::Eager {
        p.load_everything()?;
    }
    // The run seeds once, after eager loading and before any lazy build.
    tch::manual_seed(args.torch_seed());
    *chacha.lock() = ChaCha8Rng::seed_from_u64(args.seed);
    let image = noise(image_tokens);
    p.latent("image", &image);
    for name in EXTRACTORS {
        p.models.load(name)?;
    }

    p.enter("structure")?;
    let x = noise(t_structure);
    let cond = condition(&p, "ss_extractor", &image)?;
    let x = flow(&p, "ss_flow", x, &cond, &schedule(args.steps, &chacha))?;
    let structure = run(&p, "ss_decoder", &x)?;
    p.latent("structure", &structure);

    p.enter("shape_512")?;
    let x = noise(t_512) + structure.mean_dim(0, true, Kind::Float);
    let cond = condition(&p, "shape512_extractor", &image)?;
    let x = flow(&p, "shape_flow_512", x, &cond, &schedule(args.steps, &chacha))?;
    let shape_512 = run(&p, "shape_decoder", &x)?;
    p.latent("shape_512", &shape_512);

    p.enter("shape_1024")?;
    let x = shape_512.repeat([2, 1]).narrow(0, 0, t_1024) + noise(t_1024) * 0.5;
    let cond = condition(&p, "shape1024_extractor", &image)?;
    let shape_1024 = flow(&p, "shape_flow_1024", x, &cond, &schedule(args.steps, &chacha))?;
    p.latent("shape_1024", &shape_1024);

    p.enter("texture")?;
    let x = noise(t_1024) + &shape_1024 * 0.1;
    let cond = condition(&p, "tex_extractor", &image)?;
    let texture = flow(&p, "texture_flow", x, &cond, &schedule(args.steps, &chacha))?;
    p.latent("texture", &texture);

    p.enter("decode")?;
    let mesh = run(&p, "shape_decoder", &shape_1024)?;
    let colors = run(&p, "texture_decoder", &texture)?;
    p.latent("decode_shape", &mesh);
    p.latent("decode_texture", &colors);

    p.enter("export")?;
    let asset = Tensor::cat(&[mesh, colors], 1);
    p.latent("export", &asset);
    p.finish()
}
