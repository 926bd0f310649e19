//! Wan2.1 text-to-video (umT5 text encoder → transformer for `--steps` UniPC steps with
//! classifier-free guidance → video VAE decoder → frames) on an export of
//! `scripts/reference/wan_export.py`, eager, staged, or staged with the next stage prefetched.
//!
//! What it teaches: a pipeline whose first model is the largest. At the published size the text
//! encoder is 11.4 GB of bfloat16 against the transformer's 2.8 GB, and it is needed for two
//! forward passes only: staged, it is released when `denoise` begins, so the run's peak is the
//! encoder's stage instead of everything at once. The encoder has no checkpoint beside its
//! module (`ModelSpec::torchscript(name, file)` alone): a released encoder is read from its file
//! again if a later stage asked for it. The transformer and the VAE decoder are refilled in place
//! from their safetensors (`.checkpoint([file])`). The stages are `encode` (text_encoder),
//! `denoise` (transformer), `decode` (vae_decoder) and `export`, which holds no model while the
//! frames are written. The operations themselves (`stageload_pipelines::wan::generate`, diffusers'
//! `WanPipeline` step for step, with the UniPC scheduler ported in `stageload_pipelines::schedulers::unipc`)
//! are shared with `tests/wan.rs`, which checks them against diffusers.
//!
//! No tokenizer runs: a prompt is its umT5 token ids (`--prompt-ids`, default the export's). Writes
//! `frame_NNNN.png` and `video.gif` into `--out`. `--compare-python` then runs diffusers'
//! pipeline on the same weights, token ids and seed (`scripts/reference/wan_reference.py`) and
//! prints the largest differences.
//!
//!     cargo run --release --example wan -- --components DIR --mode staged --compare-python

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::{CommandFactory, Parser};
use stageload::BoxError;
use stageload_demo_kit::args::{exit, export_folder, parse_pipeline, CompareArgs, PipelineArgs};
use stageload_demo_kit::run::Demo;
use stageload_demo_kit::{CommonArgs, DemoSpec, Loading};
use stageload_pipelines::compare::TOLERANCE;
use stageload_pipelines::runner::PipelineExport;
use stageload_pipelines::wan::files::{write_frames, write_gif};
use stageload_pipelines::wan::reference::{compare, run_reference};
use stageload_pipelines::wan::{check_inputs, generate, Export, Sampling, STAGES};

/// Wan2.1 text-to-video (umT5 text encoder, transformer with UniPC, video VAE decoder) on an
/// export of scripts/reference/wan_export.py, eager, staged or prefetched, with per-stage peaks
#[derive(Parser)]
struct Args {
    #[command(flatten)]
    common: CommonArgs,
    /// The export's folder (wan_export.py's --out; default: the published size,
    /// $STAGELOAD_CACHE/wan-published, else ~/.cache/stageload/wan-published)
    #[arg(long, value_name = "DIR")]
    components: Option<PathBuf>,
    /// The prompt's umT5 token ids, comma-separated (the words, then </s> = 1; default: the
    /// export's)
    #[arg(long, value_name = "IDS", value_delimiter = ',')]
    prompt_ids: Option<Vec<i64>>,
    /// The negative prompt's token ids (default: the export's, the empty prompt: 1)
    #[arg(long, value_name = "IDS", value_delimiter = ',')]
    negative_ids: Option<Vec<i64>>,
    /// Classifier-free guidance scale (the pipeline's default; 1 or below: no negative prompt)
    #[arg(long, default_value_t = 5.0)]
    guidance: f64,
    /// Where the frames (frame_NNNN.png) and video.gif go (default: the demo's cache folder)
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    #[command(flatten)]
    compare: CompareArgs,
}

/// Parses the command line: `CommonArgs` with `--steps` defaulting to 4 and `--mode` taking
/// `prefetch` too (staged with `--prefetch`), on the CPU only.
fn parse() -> Result<Args, clap::Error> {
    let how = PipelineArgs {
        steps: "4",
        steps_help: "UniPC steps (two transformer calls each with guidance; the pipeline's default is 50)",
        device_help: "Where the models run: cpu (the export is traced there)",
        example: "Example: cargo run --release --example wan -- --components DIR --mode staged --compare-python",
        cpu_only: Some("the Wan export is traced on the CPU (its traces record the device)"),
    };
    let args = parse_pipeline(how, |args: &mut Args| &mut args.common)?;
    let custom_ids = args.prompt_ids.is_some() || args.negative_ids.is_some();
    if args.compare.compare_python && custom_ids {
        let message =
            "--compare-python runs diffusers on the export's token ids: leave out --prompt-ids and --negative-ids";
        return Err(Args::command().error(clap::error::ErrorKind::ArgumentConflict, message));
    }
    Ok(args)
}

fn main() -> ExitCode {
    let args = parse().unwrap_or_else(|e| e.exit());
    exit("wan", run(&args))
}

fn run(args: &Args) -> Result<(), BoxError> {
    let common = &args.common;
    let _no_grad = tch::no_grad_guard();
    let dir = export_folder(
        args.components.as_deref(),
        "wan-published",
        "wan_export.py --size published",
        "about 15 GB of disk, 12 GB of free memory, one component per process",
    )?;
    let export = Export::open(&dir)?;
    let seed = common.torch_seed();
    let prompt = args.prompt_ids.clone().unwrap_or_else(|| export.prompt_ids().to_vec());
    let negative = args.negative_ids.clone().unwrap_or_else(|| export.negative_ids().to_vec());
    let sampling = Sampling {
        steps: usize::try_from(common.steps).map_err(|_| format!("--steps {} is not a step count", common.steps))?,
        guidance: args.guidance,
    };
    // The starting noise, from torch's CPU generator, before any model loads; the inputs checked
    // before eager loads everything.
    let latents = export.noise(seed);
    check_inputs(&export, &prompt, &negative, &latents, sampling)?;
    // The demo writes the pipeline description `stageload plan` reads into its cache folder.
    let folder = common.cache_folder("wan");
    let out = args.out.clone().unwrap_or_else(|| folder.clone());
    for dir in [&folder, &out] {
        std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    }
    let c = export.config();
    println!(
        "wan {} from {}: {} frames of {}x{}, {} prompt ids, {} steps, guidance {}, seed {}, mode {}",
        c.size,
        dir.display(),
        c.num_frames,
        c.width,
        c.height,
        prompt.len(),
        sampling.steps,
        sampling.guidance,
        common.seed,
        common.loading().name(),
    );

    // The text encoder from its module file alone; the transformer and the VAE decoder refilled
    // in place from their safetensors after a release.
    let models = export.model_specs();
    // encode: text_encoder; denoise: transformer; decode: vae_decoder; export: nothing resident.
    // The text encoder's size for the plan, from the export (it has no checkpoint whose headers give it).
    let weights = vec![("text_encoder".to_string(), c.components.text_encoder.bytes)];
    let spec = DemoSpec { weights, ..DemoSpec::staged("wan", models, &STAGES) };
    let started = Instant::now();
    let demo = Demo::start(&spec, common)?;
    let models = demo.builder(spec.models).build()?;
    let mut p = demo.run(models);
    if p.loading() == Loading::Eager {
        p.load_everything()?;
    }
    let generated = generate(&p, &export, &prompt, &negative, &latents, sampling)?;
    p.latent("prompt_embeds", &generated.prompt_embeds);
    p.latent("final_latents", &generated.final_latents);
    p.latent("video", &generated.video);

    p.enter("export")?;
    let frames = write_frames(&out, &generated.frames)?;
    let gif = out.join("video.gif");
    write_gif(&gif, &generated.frames)?;
    println!("frames: {} PNGs in {}; {}", frames.len(), out.display(), gif.display());
    p.finish()?;
    println!("pipeline in {:.1} s", started.elapsed().as_secs_f64());

    if args.compare.compare_python {
        let python = args.compare.python();
        let folder = tempfile::Builder::new().prefix("stageload-wan-compare").tempdir()?;
        println!("running diffusers ({} {})", python.display(), export.dir().display());
        let deadline = args.compare.deadline();
        let reference = run_reference(&python, &export, seed, sampling, folder.path(), deadline)?;
        let comparison = compare(&generated, &reference)?;
        println!(
            "diffusers ran in {:.1} s ({}); largest differences, Rust against diffusers:",
            reference.seconds, reference.summary
        );
        println!("{comparison}");
        let failures = comparison.failures();
        if !failures.is_empty() {
            return Err(format!("the run does not match diffusers: {}", failures.join("; ")).into());
        }
        if comparison.identical() {
            println!("identical to diffusers: every largest difference 0.0, timesteps and frames equal");
        } else {
            println!("matches diffusers (every largest difference within {TOLERANCE:e} of its range)");
        }
    }
    Ok(())
}
