//! A user's two-stage pipeline over stageload: an encoder, then a decoder, each built on first
//! use and filled from its checkpoint; entering "decode" releases the encoder in place.

use std::path::{Path, PathBuf};

use stageload::{Built, ModelSpec, StagedModels};
use tch::nn::{self, Module, VarStore};
use tch::{Device, Kind, Tensor};

/// Four linear layers with GELU between them.
pub struct Stack(nn::Sequential);

fn stack(vs: &VarStore, width: i64) -> Stack {
    let mut seq = nn::seq();
    for i in 0..4 {
        seq = seq.add(nn::linear(vs.root() / format!("layer{i}"), width, width, Default::default()));
    }
    Stack(seq)
}

/// Writes a model's checkpoint (seeded weights) into `folder`.
fn checkpoint(folder: &Path, name: &str, width: i64, seed: i64) -> Result<PathBuf, stageload::BoxError> {
    tch::manual_seed(seed);
    let vs = VarStore::new(Device::Cpu);
    let _ = stack(&vs, width);
    let path = folder.join(format!("{name}.safetensors"));
    stageload::checkpoint::save(&vs.variables().into_iter().collect::<Vec<_>>(), &path)?;
    Ok(path)
}

/// What one run did.
pub struct Outcome {
    pub resident_after_decode: Vec<String>,
    pub output: Vec<i64>,
}

/// Runs the pipeline with its checkpoints in `folder`.
pub fn run(folder: &Path, width: i64) -> Result<Outcome, stageload::BoxError> {
    let loader = move |_: &stageload::BuildContext| -> Result<Built, stageload::BoxError> {
        let vs = VarStore::new(Device::Cpu);
        let model = stack(&vs, width);
        Ok(Built::new(model, &vs))
    };
    let models = StagedModels::builder()
        .model(ModelSpec::new("encoder", loader).checkpoint([checkpoint(folder, "encoder", width, 1)?]))
        .model(ModelSpec::new("decoder", loader).checkpoint([checkpoint(folder, "decoder", width, 2)?]))
        .stage("encode", ["encoder"])
        .stage("decode", ["decoder"])
        .build()?;
    tch::manual_seed(7);
    models.enter("encode")?;
    let noise = Tensor::randn([8, width], (Kind::Float, Device::Cpu));
    let latent = models.call("encoder", |m: &mut Stack| m.0.forward(&noise))?; // built lazily
    models.enter("decode")?; // the encoder is released in place: its memory goes back
    let image = models.call("decoder", |m: &mut Stack| m.0.forward(&latent))?;
    Ok(Outcome { resident_after_decode: models.resident(), output: image.size() })
}
