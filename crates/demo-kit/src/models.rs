//! The model the demo pipelines are made of: a pre-norm transformer (attention + MLP blocks) as
//! real tch modules, its shapes at a scale, and the loader the registry builds it with.

use stageload::stream::{BlockSpec, Step, StreamError};
use stageload::{BoxError, BuildContext, Built};
use tch::nn::{self, Module, VarStore};
use tch::{Device, Kind, Tensor};

/// Channels of every latent, whatever the scale.
pub const CHANNELS: i64 = 64;

/// Pre-norm transformer block: multi-head self-attention and a GELU MLP, each with a residual.
#[derive(Debug)]
pub struct Block {
    norm1: nn::LayerNorm,
    qkv: nn::Linear,
    proj: nn::Linear,
    norm2: nn::LayerNorm,
    fc1: nn::Linear,
    fc2: nn::Linear,
    heads: i64,
}

impl Block {
    /// A block of `width` features, its variables under `p`.
    pub fn new(p: nn::Path, width: i64) -> Self {
        Block {
            norm1: nn::layer_norm(&p / "norm1", vec![width], Default::default()),
            qkv: nn::linear(&p / "qkv", width, 3 * width, Default::default()),
            proj: nn::linear(&p / "proj", width, width, Default::default()),
            norm2: nn::layer_norm(&p / "norm2", vec![width], Default::default()),
            fc1: nn::linear(&p / "fc1", width, 4 * width, Default::default()),
            fc2: nn::linear(&p / "fc2", 4 * width, width, Default::default()),
            heads: (width / 64).max(1),
        }
    }
}

impl Module for Block {
    /// `x`: [tokens, width].
    fn forward(&self, x: &Tensor) -> Tensor {
        let (tokens, width) = x.size2().expect("[tokens, width]");
        let head = width / self.heads;
        let qkv = x.apply(&self.norm1).apply(&self.qkv).view([tokens, 3, self.heads, head]).permute([1, 2, 0, 3]);
        let (q, k, v) = (qkv.get(0), qkv.get(1), qkv.get(2));
        let attention = (q.matmul(&k.transpose(-2, -1)) / (head as f64).sqrt()).softmax(-1, Kind::Float);
        let mixed = attention.matmul(&v).permute([1, 0, 2]).reshape([tokens, width]).apply(&self.proj);
        let x = x + mixed;
        let hidden = x.apply(&self.norm2).apply(&self.fc1).gelu("tanh").apply(&self.fc2);
        x + hidden
    }
}

/// Input projection, transformer blocks, output norm and projection.
#[derive(Debug)]
pub struct Transformer {
    input: nn::Linear,
    blocks: Vec<Block>,
    norm: nn::LayerNorm,
    output: nn::Linear,
}

impl Transformer {
    /// A transformer of `shape`, its variables under `p`.
    pub fn new(p: nn::Path, shape: &ModelShape) -> Self {
        Transformer {
            input: nn::linear(&p / "input", shape.input, shape.width, Default::default()),
            blocks: (0..shape.depth).map(|i| Block::new(&p / "blocks" / i, shape.width)).collect(),
            norm: nn::layer_norm(&p / "norm", vec![shape.width], Default::default()),
            output: nn::linear(&p / "output", shape.width, shape.output, Default::default()),
        }
    }
}

impl Module for Transformer {
    fn forward(&self, x: &Tensor) -> Tensor {
        let x = self.blocks.iter().fold(x.apply(&self.input), |x, block| block.forward(&x));
        x.apply(&self.norm).apply(&self.output)
    }
}

impl Transformer {
    /// The same forward as a streamed model's step: `step.block(i)` before block `i`.
    pub fn forward_streamed(&self, x: &Tensor, step: &mut Step<'_>) -> Result<Tensor, StreamError> {
        let all: Vec<usize> = (0..self.blocks.len()).collect();
        self.forward_routed_streamed(x, step, &all, &[])
    }

    /// The forward through the blocks of `route` only, in its order (a router's choice of
    /// experts; indices past the last block are skipped).
    pub fn forward_routed(&self, x: &Tensor, route: &[usize]) -> Tensor {
        let x = route.iter().filter_map(|&i| self.blocks.get(i)).fold(x.apply(&self.input), |x, b| b.forward(&x));
        x.apply(&self.norm).apply(&self.output)
    }

    /// [`Self::forward_routed`] as a streamed model's step: `step.block(i)` before block `i`,
    /// and the route's next block named ahead (`step.prefetch`); while the last block runs,
    /// `then`, the next call's route when the router knows it (`step.prefetch_first`: the first
    /// of its blocks not in memory is read meanwhile, carried into that call).
    pub fn forward_routed_streamed(
        &self,
        x: &Tensor,
        step: &mut Step<'_>,
        route: &[usize],
        then: &[usize],
    ) -> Result<Tensor, StreamError> {
        let mut x = x.apply(&self.input);
        let depth = self.blocks.len();
        let route: Vec<usize> = route.iter().copied().filter(|&i| i < depth).collect();
        let then: Vec<usize> = then.iter().copied().filter(|&i| i < depth).collect();
        for (k, &i) in route.iter().enumerate() {
            step.block(i)?;
            match route.get(k + 1) {
                Some(&next) => step.prefetch(next)?,
                None => step.prefetch_first(&then)?,
            }
            x = self.blocks[i].forward(&x);
        }
        Ok(x.apply(&self.norm).apply(&self.output))
    }

    /// How the tensors under `prefix` fall into blocks, for [`stageload::stream`].
    pub fn block_spec(prefix: &str) -> BlockSpec {
        BlockSpec::new([format!("{prefix}.blocks.*")])
            .resident(["input", "norm", "output"].map(|part| format!("{prefix}.{part}")))
    }
}

/// The cascade demo's seven models and, last, the backbone its extractors share, at a scale.
/// The largest is `texture_flow` (12 blocks; 0.6 GB at scale 1).
pub fn cascade_shapes(scale: f64) -> Vec<ModelShape> {
    let width = width_at(1024, scale);
    let shape = |name, depth, output| ModelShape { name, input: CHANNELS, width, depth, output };
    vec![
        shape("ss_flow", 10, CHANNELS),
        shape("ss_decoder", 2, CHANNELS),
        shape("shape_flow_512", 8, CHANNELS),
        shape("shape_flow_1024", 8, CHANNELS),
        shape("shape_decoder", 4, CHANNELS),
        shape("texture_flow", 12, CHANNELS),
        shape("texture_decoder", 4, CHANNELS),
        shape("backbone", 8, width),
    ]
}

/// The seed the cascade's model `i` of [`cascade_shapes`] (not the backbone) is drawn with.
pub fn cascade_seed(i: usize) -> i64 {
    100 + i as i64
}

/// A model's architecture.
#[derive(Debug, Clone)]
pub struct ModelShape {
    /// The model's name in the pipeline.
    pub name: &'static str,
    /// Input features.
    pub input: i64,
    /// Features inside the blocks.
    pub width: i64,
    /// Number of blocks.
    pub depth: i64,
    /// Output features.
    pub output: i64,
}

/// Width at a scale: bytes grow with the scale (width² per block), rounded to 64.
pub fn width_at(base: i64, scale: f64) -> i64 {
    (((base as f64) * scale.sqrt() / 64.0).ceil() as i64 * 64).max(64)
}

/// Tokens at a scale, rounded to 16.
pub fn tokens_at(base: i64, scale: f64) -> i64 {
    (((base as f64) * scale.sqrt() / 16.0).ceil() as i64 * 16).max(16)
}

/// A loader that builds `shape` on `device` (random initialisation: it draws from torch's
/// generator, as a real model's constructor does); the registry fills it from its checkpoint.
pub fn transformer_loader(
    shape: ModelShape,
    device: Device,
) -> impl Fn(&BuildContext) -> Result<Built, BoxError> + Send + Sync {
    move |_| {
        let vs = VarStore::new(device);
        let model = Transformer::new(vs.root() / "model", &shape);
        Ok(Built::new(model, &vs))
    }
}
