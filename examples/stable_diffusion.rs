//! Stable Diffusion (CLIP text encoder → UNet for `--steps` DDIM steps with classifier-free
//! guidance → VAE decoder) on an export of `scripts/reference/sd_export.py`, eager, staged, or
//! staged with the next stage prefetched.
//!
//! What it teaches: a pipeline of TorchScript models. `ModelSpec::torchscript(name, file)` loads
//! a traced module as a model (a `tch::CModule`, called with `forward_ts`), and its safetensors
//! checkpoint lets a released module come back in place; the stages are the pipeline's three
//! steps, one model each. `--format pt2` runs the same modules as AOTInductor packages
//! (`ModelSpec::pt2(name, package, checkpoint)`, a `stageload::pt2::Pt2Module`). The steps themselves (`stageload_pipelines::stable_diffusion::generate`:
//! `models.enter(stage)` then `call(model, |m: &mut CModule| m.forward_ts(inputs))`, the
//! operations diffusers' `StableDiffusionPipeline` does, in its order) are shared with
//! `tests/stable_diffusion.rs`, which checks them against diffusers.
//!
//! With the demos' meter: per-stage peaks at the end, `--trace`, `--latents`, `--result`,
//! `--check-residency`, and `STAGELOAD_TRACE` / `STAGELOAD_LATENTS` as `stageload ab` sets them
//! (the same options as `text_to_image`; `--mode prefetch` is `--mode staged --prefetch`).
//! `--compare-python` then runs diffusers' `StableDiffusionPipeline` on the same weights,
//! embeddings and initial latents (`scripts/reference/sd_reference.py`) and prints the largest
//! differences.
//!
//!     cargo run --release --example stable_diffusion -- --mode staged --compare-python

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use stageload::{BoxError, ModelSpec, SharedRng};
use stageload_demo_kit::args::{exit, export_folder, parse_pipeline, CompareArgs, PipelineArgs};
use stageload_demo_kit::run::Demo;
use stageload_demo_kit::{CommonArgs, DemoSpec, Loading};
use stageload_pipelines::compare::TOLERANCE;
use stageload_pipelines::export::Format;
use stageload_pipelines::stable_diffusion::reference::{compare, run_reference};
use stageload_pipelines::stable_diffusion::{generate, Export, Sampling, STAGES};

/// Stable Diffusion (text encoder, UNet with DDIM, VAE decoder) on an export of
/// scripts/reference/sd_export.py, eager, staged or prefetched, with per-stage peaks
#[derive(Parser)]
struct Args {
    #[command(flatten)]
    common: CommonArgs,
    /// The export's folder (sd_export.py's --out; default: the published SD 1.5 size,
    /// $STAGELOAD_CACHE/sd-sd15, else ~/.cache/stageload/sd-sd15)
    #[arg(long, value_name = "DIR")]
    components: Option<PathBuf>,
    /// The modules: the export's TorchScript files, or the AOTInductor packages
    /// scripts/reference/sd_pt2.py compiled from them into DIR/pt2
    #[arg(long, value_enum, default_value_t = Format::Torchscript)]
    format: Format,
    /// Classifier-free guidance scale (above 1)
    #[arg(long, default_value_t = 7.5)]
    guidance: f64,
    #[command(flatten)]
    compare: CompareArgs,
}

/// Parses the command line: `CommonArgs` with `--steps` defaulting to 4 and `--mode` taking
/// `prefetch` too (staged with `--prefetch`), on the CPU unless told.
fn parse() -> Result<Args, clap::Error> {
    let how = PipelineArgs {
        steps: "4",
        steps_help: "DDIM steps",
        device_help: "Where the models and the noise live: cpu (default: the export is traced on the CPU and the \
                      reference runs there), cuda, cuda:N, mps, auto",
        example: "Example: cargo run --release --example stable_diffusion -- --mode staged --compare-python",
        cpu_only: None,
    };
    parse_pipeline(how, |args: &mut Args| &mut args.common)
}

fn main() -> ExitCode {
    let args = parse().unwrap_or_else(|e| e.exit());
    exit("stable_diffusion", run(&args))
}

fn run(args: &Args) -> Result<(), BoxError> {
    let common = &args.common;
    let _no_grad = tch::no_grad_guard();
    let dir = export_folder(args.components.as_deref(), "sd-sd15", "sd_export.py --size sd15", "about 7.7 GB")?;
    // A missing .pt2 package is an error naming scripts/reference/sd_pt2.py.
    let export = Export::open_as(&dir, args.format)?;
    let config = export.config();
    println!(
        "stable diffusion {} from {}: latents {:?} -> image {:?}, {} steps, guidance {}, seed {}, mode {}",
        config.size,
        dir.display(),
        config.latent_size,
        config.image_size,
        common.steps,
        args.guidance,
        common.seed,
        common.loading().name(),
    );
    let sampling = Sampling { steps: common.steps, guidance: args.guidance };

    // The three TorchScript models: each built by loading its file (`torch.jit.load`'s job) and
    // refilled after a release from its safetensors checkpoint (the traced module's names), in
    // place, without loading the TorchScript file again.
    // With `--format pt2`, AOTInductor packages of the same modules: the compiled library loaded,
    // its weights stageload's own tensors, filled from the checkpoint and refilled in place.
    let models = export
        .files()
        .into_iter()
        .map(|(name, module, weights)| match export.format() {
            Format::Torchscript => ModelSpec::torchscript(name, module).checkpoint([weights]),
            Format::Pt2 => ModelSpec::pt2(name, module, [weights]),
        })
        .collect();
    // One model per stage: encode (text_encoder), denoise (unet), decode (vae_decoder).
    let spec = DemoSpec::staged("stable_diffusion", models, &STAGES);

    // Nothing here draws from a ChaCha generator; the demo run registers one as every demo does.
    let chacha = SharedRng::new(ChaCha8Rng::seed_from_u64(common.seed));
    let started = Instant::now();
    // The demo writes the pipeline description `stageload plan` reads into this folder.
    let folder = common.cache_folder("stable_diffusion");
    std::fs::create_dir_all(&folder).map_err(|e| format!("creating {}: {e}", folder.display()))?;
    let demo = Demo::start(&spec, common)?;
    let models = demo.builder(spec.models).register_rng(std::sync::Arc::new(chacha)).build()?;
    let mut p = demo.run(models);
    if p.loading() == Loading::Eager {
        p.load_everything()?;
    }
    // The starting noise, drawn before any lazy build, from torch's CPU generator.
    let noise = export.initial_latents(common.torch_seed()).to_device(common.device);
    p.latent("noise", &noise);
    let generated = generate(&p, &export, &noise, sampling)?;
    p.latent("embeds", &generated.embeds);
    p.latent("negative_embeds", &generated.negative_embeds);
    p.latent("final_latents", &generated.final_latents);
    p.latent("image", &generated.image);
    println!("timesteps {:?}", generated.timesteps);
    p.finish()?;
    println!("pipeline in {:.1} s", started.elapsed().as_secs_f64());

    if args.compare.compare_python {
        let python = args.compare.python();
        let folder = std::env::temp_dir().join(format!("stageload-sd-compare-{}", std::process::id()));
        std::fs::create_dir_all(&folder).map_err(|e| format!("creating {}: {e}", folder.display()))?;
        println!("running diffusers ({} {})", python.display(), export.dir().display());
        let reference = run_reference(&python, &export, &generated, sampling, &folder, args.compare.deadline());
        let reference = match reference {
            Ok(reference) => reference,
            Err(error) => return Err(format!("{error}\n(its files are in {})", folder.display()).into()),
        };
        let comparison = compare(&generated, &reference)?;
        for line in reference.log.lines().filter(|line| line.starts_with("sd_reference:")) {
            println!("{line}");
        }
        println!("diffusers ran in {:.1} s; largest differences, Rust against diffusers:", reference.seconds);
        println!("{comparison}");
        let image = &generated.image;
        let inside = image.gt(0.0).logical_and(&image.lt(1.0)).sum(tch::Kind::Int64).int64_value(&[]);
        println!("{inside} of {} pixels inside (0, 1): the clamp does not hide a difference there", image.numel());
        std::fs::remove_dir_all(&folder).map_err(|e| format!("removing {}: {e}", folder.display()))?;
        let failures = comparison.failures();
        if !failures.is_empty() {
            return Err(format!("the run does not match diffusers: {}", failures.join("; ")).into());
        }
        println!("matches diffusers (every largest difference within {:e} of its range)", TOLERANCE);
    }
    Ok(())
}
