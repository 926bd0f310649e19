//! The README example: an encoder → decoder pipeline run staged.
//!
//! The example writes both models' safetensors checkpoints once (into `--cache`), then runs:
//! seed, enter "encode" (the encoder is built lazily and filled from its checkpoint), encode a
//! noise batch, enter "decode" (the encoder is released in place, its memory goes back to the
//! OS), decode, and print what happened and a fingerprint of the output.
//!
//!     cargo run --release --example two_models -- --width 2048

use std::path::PathBuf;
use std::sync::Arc;

use clap::Parser;
use stageload::{Built, Event, EventSink, ListSink, ModelSpec, StagedModels};
use tch::nn::{self, Module, VarStore};
use tch::{Device, Kind, Tensor};

#[derive(Parser)]
struct Args {
    /// Width of each model's layers (4 layers of width × width floats each).
    #[arg(long, default_value_t = 1024)]
    width: i64,
    /// Folder for the checkpoints the example writes once.
    #[arg(long, default_value = "target/stageload-examples")]
    cache: PathBuf,
    /// Seed of the run.
    #[arg(long, default_value_t = 7)]
    seed: i64,
    /// Also write what happened as JSON (for tests)
    #[arg(long)]
    result: Option<PathBuf>,
}

/// Four linear layers with GELU between them.
#[derive(Debug)]
struct Stack(nn::Sequential);

impl Stack {
    fn new(vs: &VarStore, width: i64) -> Self {
        let mut seq = nn::seq();
        for i in 0..4 {
            seq = seq.add(nn::linear(vs.root() / format!("layer{i}"), width, width, Default::default()));
            if i < 3 {
                seq = seq.add_fn(|x| x.gelu("none"));
            }
        }
        Stack(seq)
    }
}

fn loader(width: i64) -> impl Fn(&stageload::BuildContext) -> Result<Built, stageload::BoxError> + Send + Sync {
    move |_| {
        let vs = VarStore::new(Device::Cpu);
        let model = Stack::new(&vs, width);
        Ok(Built::new(model, &vs))
    }
}

/// Writes the checkpoint of a model once (same seed, same weights every time).
fn checkpoint(
    cache: &std::path::Path,
    name: &str,
    width: i64,
    seed: i64,
) -> Result<PathBuf, Box<dyn std::error::Error>> {
    let path = cache.join(format!("{name}-{width}.safetensors"));
    if !path.exists() {
        std::fs::create_dir_all(cache)?;
        tch::manual_seed(seed);
        let vs = VarStore::new(Device::Cpu);
        let _ = Stack::new(&vs, width);
        let mut vars: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        stageload::checkpoint::save(&vars, &path)?;
    }
    Ok(path)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    stageload_demo_kit::logging::init();
    let args = Args::parse();
    let encoder_file = checkpoint(&args.cache, "encoder", args.width, 1)?;
    let decoder_file = checkpoint(&args.cache, "decoder", args.width, 2)?;

    let events = Arc::new(ListSink::default());
    let printed = events.clone();
    let models = StagedModels::builder()
        .model(ModelSpec::new("encoder", loader(args.width)).checkpoint([encoder_file]))
        .model(ModelSpec::new("decoder", loader(args.width)).checkpoint([decoder_file]))
        .stage("encode", ["encoder"])
        .stage("decode", ["decoder"])
        .events(Arc::new(move |e: &Event| {
            println!("  event: {e}");
            printed.emit(e);
        }))
        .build()?;

    tch::manual_seed(args.seed);
    models.enter("encode")?;
    let noise = Tensor::randn([8, args.width], (Kind::Float, Device::Cpu));
    let latent = models.call("encoder", |m: &mut Stack| m.0.forward(&noise))?; // built lazily
    println!("resident after encode: {:?}, {} MiB", models.resident(), models.resident_bytes() >> 20);
    let after_encode = models.resident();

    models.enter("decode")?;
    let image = models.call("decoder", |m: &mut Stack| m.0.forward(&latent))?;
    println!("resident after decode: {:?}, {} MiB", models.resident(), models.resident_bytes() >> 20);

    let output = stageload::latents::fingerprint(&image);
    println!("output {:?} sha256 {output}", image.size());
    if let Some(path) = &args.result {
        let events: Vec<String> = events.events().iter().map(ToString::to_string).collect();
        let result = serde_json::json!({
            "resident_after_encode": after_encode,
            "resident_after_decode": models.resident(),
            "events": events,
            "output": output,
        });
        std::fs::write(path, result.to_string())?;
    }
    models.close();
    Ok(())
}
