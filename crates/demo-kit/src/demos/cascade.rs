//! The `cascade` example's program (`examples/cascade.rs` says what it runs and prints): its
//! command line, models and stages, and the run.

use std::sync::Arc;

use crate::models::{cascade_seed, cascade_shapes, transformer_loader};
use crate::{
    cached, cached_checkpoint, sample_flow, schedule, tokens_at, CommonArgs, DemoRun, DemoSpec, Mode, ModelShape,
    Transformer, CHANNELS,
};
use clap::Parser;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use stageload::{BoxError, BuildContext, Built, ModelSpec, Shared, SharedRng};
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
    })
}

/// Calls model `name` (checking residency first) on `input`.
fn run(p: &DemoRun, name: &str, input: &Tensor) -> Result<Tensor, BoxError> {
    p.call(name, |m: &mut Transformer| m.forward(input))
}

fn flow(p: &DemoRun, name: &str, x: Tensor, cond: &Tensor, times: &[f64]) -> Result<Tensor, BoxError> {
    p.call(name, |m: &mut Transformer| sample_flow(m, x, cond, times))
}

fn condition(p: &DemoRun, name: &str, image: &Tensor) -> Result<Tensor, BoxError> {
    p.call(name, |m: &mut Extractor| m.condition(image))
}

/// The example's `main`: parses the command line and runs.
pub fn main() -> Result<(), BoxError> {
    let args = Args::parse().common;
    let _no_grad = tch::no_grad_guard();
    tch::set_num_threads(std::thread::available_parallelism().map_or(1, |n| n.get()) as i32);
    let chacha = SharedRng::new(ChaCha8Rng::seed_from_u64(args.seed));
    let mut p = DemoRun::build(spec(&args)?, &args, Arc::new(chacha.clone()))?;
    let noise = |tokens: i64| Tensor::randn([tokens, CHANNELS], (Kind::Float, args.device));
    let (image_tokens, t_structure, t_512, t_1024) = (
        tokens_at(256, args.scale),
        tokens_at(256, args.scale),
        tokens_at(512, args.scale),
        tokens_at(1024, args.scale),
    );

    p.enter("setup")?;
    if p.mode == Mode::Eager {
        p.load_everything()?;
    }
    // The run seeds once, after eager loading and before any lazy build.
    tch::manual_seed(args.seed as i64);
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
