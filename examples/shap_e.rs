//! Shap-E image-to-3D (CLIP image encoder → prior for `--steps` Heun steps with classifier-free
//! guidance → renderer: 20 rendered views and a coloured mesh) on an export of
//! `scripts/reference/shap_e_export.py`, eager, staged, or staged with the next stage prefetched.
//!
//! What it teaches: a pipeline whose models do more than `forward`. The renderer is one
//! TorchScript model with five traced methods (`forward`, `render_rays`, `sdf`, `texture`,
//! `marching_cubes`) over one set of weights; the pipeline calls them with
//! `models.call("renderer", |m: &mut CModule| m.method_is("render_rays", ...))` inside the
//! `decode` stage, and the registry releases and refills the model as a whole. The stages are
//! `encode` (image_encoder), `denoise` (prior), `decode` (renderer) and `export`, which holds no
//! model while the files are written: during it, nothing is resident. The operations themselves
//! (`stageload_pipelines::shap_e::generate`, diffusers' `ShapEImg2ImgPipeline` step for step) are
//! shared with `tests/shap_e.rs`, which checks them against diffusers.
//!
//! `--format pt2` runs the image encoder and the prior as AOTInductor packages
//! (`ModelSpec::pt2`, compiled by `scripts/reference/shap_e_pt2.py`) beside the TorchScript
//! renderer: Inductor's fused kernels differ from eager ones in the last bits, so a comparison
//! then shows small non-zero differences.
//!
//! Writes `mesh.ply` (binary PLY with vertex colours, what diffusers' `export_to_ply` writes) and
//! `views.png` (the 20 views side by side) into `--out`. `--compare-python` then runs diffusers'
//! pipeline on the same weights, image and seed (`scripts/reference/shap_e_reference.py`) and
//! prints the largest differences.
//!
//!     cargo run --release --example shap_e -- --components DIR --image photo.png --mode staged --compare-python

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use stageload::{BoxError, ModelSpec};
use stageload_demo_kit::args::{exit, export_folder, parse_pipeline, CompareArgs, PipelineArgs};
use stageload_demo_kit::run::Demo;
use stageload_demo_kit::{CommonArgs, DemoSpec, Loading};
use stageload_pipelines::clip_image::{load_image, preprocess};
use stageload_pipelines::compare::TOLERANCE;
use stageload_pipelines::export::Format;
use stageload_pipelines::runner::PipelineExport;
use stageload_pipelines::shap_e::files::{write_ply, write_views_png};
use stageload_pipelines::shap_e::reference::{compare, run_reference};
use stageload_pipelines::shap_e::{example_image, generate, Export, Sampling, Surface, STAGES};

/// Shap-E image-to-3D (CLIP image encoder, prior with Heun, NeRF/STF renderer) on an export of
/// scripts/reference/shap_e_export.py, eager, staged or prefetched, with per-stage peaks
#[derive(Parser)]
struct Args {
    #[command(flatten)]
    common: CommonArgs,
    /// The export's folder (shap_e_export.py's --out; default: the published size,
    /// $STAGELOAD_CACHE/shap-e-published, else ~/.cache/stageload/shap-e-published)
    #[arg(long, value_name = "DIR")]
    components: Option<PathBuf>,
    /// The image encoder's and the prior's modules: the export's TorchScript files, or the
    /// AOTInductor packages scripts/reference/shap_e_pt2.py compiled from them into DIR/pt2 (the
    /// renderer is TorchScript either way)
    #[arg(long, value_enum, default_value_t = Format::Torchscript)]
    format: Format,
    /// The input image (PNG or JPEG; preprocessed as CLIPImageProcessor does). Default: a drawn
    /// test image (a red disc and a blue square on white)
    #[arg(long, value_name = "FILE")]
    image: Option<PathBuf>,
    /// Classifier-free guidance scale (above 1; the pipeline's default)
    #[arg(long, default_value_t = 4.0)]
    guidance: f64,
    /// The rendered views' side in pixels, a multiple of 32 (the pipeline's default is 64)
    #[arg(long, default_value_t = 64)]
    frame_size: i64,
    /// Skip the rendered views
    #[arg(long)]
    no_views: bool,
    /// Skip the mesh
    #[arg(long)]
    no_mesh: bool,
    /// Where mesh.ply and views.png go (default: the demo's cache folder)
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    #[command(flatten)]
    compare: CompareArgs,
}

/// Parses the command line: `CommonArgs` with `--steps` defaulting to 2 and `--mode` taking
/// `prefetch` too (staged with `--prefetch`), on the CPU only.
fn parse() -> Result<Args, clap::Error> {
    let how = PipelineArgs {
        steps: "2",
        steps_help: "Heun steps (the prior runs 2N-1 times; the pipeline's default is 25, about 20 s a step at the \
                     published size on a 2-core CPU)",
        device_help: "Where the models run: cpu (the export is traced there)",
        example: "Example: cargo run --release --example shap_e -- --image photo.png --mode staged --compare-python",
        cpu_only: Some("the Shap-E export is traced on the CPU (its traces record the device)"),
    };
    parse_pipeline(how, |args: &mut Args| &mut args.common)
}

fn main() -> ExitCode {
    let args = parse().unwrap_or_else(|e| e.exit());
    exit("shap_e", run(&args))
}

fn run(args: &Args) -> Result<(), BoxError> {
    let common = &args.common;
    let _no_grad = tch::no_grad_guard();
    let dir = export_folder(
        args.components.as_deref(),
        "shap-e-published",
        "shap_e_export.py --size published",
        "about 3.4 GB, a few minutes",
    )?;
    // A missing .pt2 package is an error naming scripts/reference/shap_e_pt2.py.
    let export = Export::open_as(&dir, args.format)?;
    let seed = common.torch_seed();
    let image = match &args.image {
        Some(path) => load_image(path)?,
        None => image::DynamicImage::ImageRgb8(example_image()),
    };
    // CLIPImageProcessor: resize the short side to 224 (PIL bicubic), centre crop, normalise.
    let pixels = preprocess(&image, export.preprocessor())?;
    let sampling = Sampling {
        steps: usize::try_from(common.steps).map_err(|_| format!("--steps {} is not a step count", common.steps))?,
        guidance: args.guidance,
        frame_size: args.frame_size,
        views: !args.no_views,
        mesh: !args.no_mesh,
    };
    // The demo writes the pipeline description `stageload plan` reads into its cache folder.
    let folder = common.cache_folder("shap_e");
    let out = args.out.clone().unwrap_or_else(|| folder.clone());
    for dir in [&folder, &out] {
        std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    }
    println!(
        "shap-e {} from {}: {} steps, guidance {}, frame {}, seed {}, mode {}",
        export.config().size,
        dir.display(),
        sampling.steps,
        sampling.guidance,
        sampling.frame_size,
        common.seed,
        common.loading().name(),
    );

    // The three models (TorchScript, or .pt2 packages for the encoder and the prior), each refilled
    // in place from its safetensors after a release.
    let models: Vec<ModelSpec> = export.model_specs();
    // encode: image_encoder; denoise: prior; decode: renderer; export: nothing resident.
    let spec = DemoSpec::staged("shap_e", models, &STAGES);
    let started = Instant::now();
    let demo = Demo::start(&spec, common)?;
    let models = demo.builder(spec.models).build()?;
    let mut p = demo.run(models);
    if p.loading() == Loading::Eager {
        p.load_everything()?;
    }
    // The starting noise, drawn before any lazy build, from torch's CPU generator.
    let noise = export.noise(seed);
    let generated = generate(&p, &export, &pixels, &noise, sampling)?;
    p.latent("image_embeds", &generated.image_embeds);
    p.latent("final_latents", &generated.final_latents);
    if let Some(views) = &generated.views {
        p.latent("views", views);
    }

    p.enter("export")?;
    if let Some(views) = &generated.views {
        let path = out.join("views.png");
        write_views_png(&path, views)?;
        println!("views: {}", path.display());
    }
    let empty = match &generated.surface {
        Some(Surface::Mesh(mesh)) => {
            p.latent("mesh_verts", &mesh.verts);
            let path = out.join("mesh.ply");
            write_ply(&path, mesh)?;
            println!("mesh: {} vertices, {} faces: {}", mesh.verts.size()[0], mesh.faces.size()[0], path.display());
            false
        }
        Some(Surface::Empty) => true,
        None => false,
    };
    p.finish()?;
    println!("pipeline in {:.1} s", started.elapsed().as_secs_f64());

    if args.compare.compare_python {
        let python = args.compare.python();
        let folder = tempfile::Builder::new().prefix("stageload-shap-e-compare").tempdir()?;
        println!("running diffusers ({} {})", python.display(), export.dir().display());
        let deadline = args.compare.deadline();
        let reference = run_reference(&python, &export, &pixels, seed, sampling, folder.path(), deadline)?;
        let comparison = compare(&generated, &reference)?;
        println!(
            "diffusers ran in {:.1} s ({}); largest differences, Rust against diffusers:",
            reference.seconds, reference.summary
        );
        println!("{comparison}");
        let failures = comparison.failures();
        if args.format == Format::Pt2 {
            // Not a failure: Inductor's fused kernels round differently from eager ones.
            println!(
                "(--format pt2: the image encoder and the prior are Inductor-compiled; their kernels round differently \
                 from eager ones, so differences in the last bits are expected and not checked against {TOLERANCE:e})"
            );
        } else if !failures.is_empty() {
            return Err(format!("the run does not match diffusers: {}", failures.join("; ")).into());
        }
        if args.format == Format::Torchscript {
            println!("matches diffusers (every largest difference within {TOLERANCE:e} of its range)");
        }
    }
    if empty {
        return Err(format!(
            "the surface is empty at level 0: the signed distance has no zero crossing on the {0}³ grid, so there is no \
             mesh (diffusers raises here); {1}",
            export.config().grid_size,
            if args.no_views { "nothing was written".to_string() } else { format!("the views are in {}", out.display()) }
        )
        .into());
    }
    Ok(())
}
