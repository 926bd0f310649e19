//! Shap-E image-to-3D in four stages (`crates/pipelines/src/shap_e/`) at the small size of
//! `scripts/reference/shap_e_export.py` (2 Heun steps, 32-pixel views, the 128³ mesh grid): the
//! image embedding, initial and final latents, rendered views, mesh vertices, faces and colours
//! match diffusers' `ShapEImg2ImgPipeline` on the same weights, pixels and seed
//! (`scripts/reference/shap_e_reference.py`, run once for the tests, killed past a deadline), and
//! the PLY file equals diffusers' `export_to_ply` byte for byte; eager, staged and staged with
//! prefetch give the same bits, a staged run holds only the running stage's model, and the caller's
//! torch generators are as they were after a run; the `.pt2` packages of the encoder and the prior
//! run the same pipeline within Inductor's rounding; bad input (a frame size, a guidance, noise
//! of the wrong shape, an export of other sizes, a missing, truncated or mismatched file, a field
//! without a surface) is a clear error or report. The three Rust runs are made once and shared
//! (torch's generator is global, so they are made under one lock). Without STAGELOAD_SHAP_E_SMALL
//! and STAGELOAD_PYTHON the tests fail and say what to run.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use stageload::{BoxError, Event, EventKind, EventSink, ListSink};
use stageload_pipelines::clip_image::preprocess;
use stageload_pipelines::compare::{Difference, TOLERANCE};
use stageload_pipelines::export::Format;
use stageload_pipelines::runner::{Loading, PipelineExport, StageRunner};
use stageload_pipelines::shap_e::files::{write_ply, write_views_png};
use stageload_pipelines::shap_e::reference::{compare, run_reference, Reference};
use stageload_pipelines::shap_e::{
    example_image, generate, Export, ExportError, Generated, RunError, Sampling, Surface,
};
use stageload_test_support::torch as support;
use tch::{CModule, Kind, Tensor};

use crate::watch::{assert_bits_equal, of_kind, prefetched_models, with_shared, Call, Shared, Watch};

const SAMPLING: Sampling = Sampling { steps: 2, guidance: 4.0, frame_size: 32, views: true, mesh: true };
const SEED: i64 = 5;
const DEADLINE: Duration = Duration::from_secs(240);

fn required(variable: &str) -> Result<String, String> {
    std::env::var(variable).map_err(|_| {
        format!(
            "{variable} is not set: these tests need the small Shap-E export and diffusers in the cached Python \
             environment. Run them through cargo xtask test, or first: eval \"$(scripts/setup-libtorch.sh)\"; eval \
             \"$(scripts/setup-reference.sh)\" (which installs diffusers and exports the small size)"
        )
    })
}

fn export() -> Export {
    let dir = required("STAGELOAD_SHAP_E_SMALL").unwrap_or_else(|e| panic!("{e}"));
    Export::open(&dir).unwrap_or_else(|e| panic!("{e}"))
}

/// The test image through the CLIP image processor.
fn pixels(export: &Export) -> Tensor {
    let image = image::DynamicImage::ImageRgb8(example_image());
    preprocess(&image, export.preprocessor()).unwrap_or_else(|e| panic!("{e}"))
}

/// One Rust run: what it made, the events until it closed, every call, what was resident in
/// `export`, and whether torch's generator was where the caller left it afterwards.
struct Run {
    generated: Generated,
    events: Vec<Event>,
    calls: Vec<Call>,
    resident_at_export: Vec<String>,
    generator_kept: bool,
    seconds: f64,
}

fn run(export: &Export, loading: Loading) -> Result<Run, BoxError> {
    let started = Instant::now();
    let sink = Arc::new(ListSink::new());
    let models = export.registry(loading, Some(sink.clone() as Arc<dyn EventSink>))?;
    let pixels = pixels(export);
    let noise = export.noise(SEED);
    // The caller's state: a seed of its own, and what it would draw next.
    tch::manual_seed(4242);
    let expected = Tensor::randn([8], (Kind::Float, tch::Device::Cpu));
    tch::manual_seed(4242);
    let watch = Watch::new(&models);
    let generated = generate(&watch, export, &pixels, &noise, SAMPLING)?;
    let generator_kept = Tensor::randn([8], (Kind::Float, tch::Device::Cpu)).equal(&expected);
    models.enter("export")?;
    let resident_at_export = models.resident();
    // A prefetch installs its model (waking the stage that waits for it) before it sends its
    // `load` event: the events are read once every prefetch has ended.
    for stage in ["encode", "denoise", "decode", "export"] {
        models.wait_prefetch(stage)?;
    }
    let events = sink.events();
    models.close();
    let calls = watch.into_calls();
    Ok(Run { generated, events, calls, resident_at_export, generator_kept, seconds: started.elapsed().as_secs_f64() })
}

struct Runs {
    export: Export,
    eager: Run,
    staged: Run,
    prefetch: Run,
}

fn make_runs() -> Result<Runs, String> {
    let export = export();
    let run = |loading: Loading| run(&export, loading).map_err(|e| format!("the {} run failed: {e}", loading.name()));
    let (eager, staged, prefetch) = (run(Loading::Eager)?, run(Loading::Staged)?, run(Loading::Prefetch)?);
    eprintln!(
        "Rust runs: eager {:.2} s, staged {:.2} s, prefetch {:.2} s",
        eager.seconds, staged.seconds, prefetch.seconds
    );
    Ok(Runs { export, eager, staged, prefetch })
}

/// The three runs, made once for every test that needs them.
static RUNS: Shared<Runs> = Mutex::new(None);

fn with_runs<R>(check: impl FnOnce(&Runs) -> R) -> R {
    with_shared(&RUNS, make_runs, check)
}

/// diffusers on the eager run's pixels and seed, run once for every test that needs it (with the
/// folder holding its PLY file).
fn with_reference(check: impl FnOnce(&Runs, &Reference)) {
    static REFERENCE: Shared<(Reference, tempfile::TempDir)> = Mutex::new(None);
    with_runs(|runs| {
        let make = || {
            let python = PathBuf::from(required("STAGELOAD_PYTHON")?);
            let folder = tempfile::TempDir::new().map_err(|e| format!("no temporary folder: {e}"))?;
            let pixels = pixels(&runs.export);
            let reference = run_reference(&python, &runs.export, &pixels, SEED, SAMPLING, folder.path(), DEADLINE)
                .map_err(|e| e.to_string())?;
            eprintln!("diffusers in {:.1} s: {}", reference.seconds, reference.summary);
            Ok((reference, folder))
        };
        with_shared(&REFERENCE, make, |(reference, _)| check(runs, reference))
    })
}

fn mesh(generated: &Generated) -> &stageload_pipelines::shap_e::Mesh {
    match &generated.surface {
        Some(Surface::Mesh(mesh)) => mesh,
        other => panic!("no mesh: {other:?}"),
    }
}

#[test]
fn the_embedding_latents_views_and_mesh_match_diffusers_bit_for_bit() {
    let _generator = support::generator();
    with_reference(|runs, reference| {
        let generated = &runs.eager.generated;
        let comparison = compare(generated, reference).unwrap_or_else(|e| panic!("{e}"));
        eprintln!("Rust against diffusers:\n{comparison}");
        assert_eq!(comparison.failures(), Vec::<String>::new());
        assert!(comparison.equal.iter().any(|(what, ok)| *what == "faces" && *ok), "{comparison}");
        for (what, difference) in &comparison.differences {
            assert_eq!(difference.largest, 0.0, "{what}: {difference}");
            assert!(difference.range > 0.0, "{what} is constant: the comparison says nothing");
        }
        let rays = stageload_pipelines::shap_e::pan_rays(SAMPLING.frame_size).unwrap_or_else(|e| panic!("{e}"));
        assert_bits_equal("the cameras' rays", &rays, &reference.tensors["rays"]);
        assert_eq!(generated.timesteps, [1023.0, 0.0, 0.0]);
        // A surface with faces and colours that vary over it: the mesh comparison is not of a
        // trivial mesh, and a vertex given another's colour would differ from diffusers.
        let mesh = mesh(generated);
        assert!(mesh.faces.size()[0] > 1000, "{:?} faces", mesh.faces.size());
        assert_colours_vary_across_vertices(&mesh.colors);
    });
}

/// The PLY file's step between two colour levels: colours are written as 8-bit values.
const COLOUR_STEP: f64 = 1.0 / 255.0;

/// Asserts that `colors` (float32 [V, 3]) vary across the vertices, channel by channel, by more
/// than the PLY's 8-bit levels can hide: each channel's standard deviation across the vertices
/// is above four levels (a channel that is one colour everywhere, quantised, has at most half a
/// level), and the vertices have at least 100 distinct 8-bit colours.
fn assert_colours_vary_across_vertices(colors: &Tensor) {
    let values = Vec::<f32>::try_from(colors.contiguous().view([-1])).unwrap();
    let vertices = values.len() / 3;
    assert!(vertices > 0 && values.len() == 3 * vertices, "{:?}", colors.size());
    for (channel, name) in ["red", "green", "blue"].iter().enumerate() {
        let channel: Vec<f64> = values.iter().skip(channel).step_by(3).map(|&v| f64::from(v)).collect();
        let mean = channel.iter().sum::<f64>() / vertices as f64;
        let deviation = (channel.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / vertices as f64).sqrt();
        assert!(
            deviation > 4.0 * COLOUR_STEP,
            "{name} hardly varies across the {vertices} vertices: standard deviation {deviation}, mean {mean}"
        );
    }
    let levels: std::collections::HashSet<[u8; 3]> =
        values.chunks(3).map(|rgb| [0, 1, 2].map(|c| (f64::from(rgb[c]) / COLOUR_STEP).round() as u8)).collect();
    assert!(levels.len() >= 100, "{} distinct 8-bit colours over {vertices} vertices", levels.len());
    eprintln!("{} distinct 8-bit colours over {vertices} vertices", levels.len());
}

#[test]
fn the_ply_file_equals_the_one_diffusers_export_to_ply_writes() {
    let _generator = support::generator();
    with_reference(|runs, reference| {
        let folder = tempfile::TempDir::new().unwrap();
        let path = folder.path().join("mesh.ply");
        write_ply(&path, mesh(&runs.eager.generated)).unwrap_or_else(|e| panic!("{e}"));
        let ours = std::fs::read(&path).unwrap();
        let theirs = reference.ply.as_ref().map(std::fs::read).expect("the reference wrote no PLY").unwrap();
        assert_eq!(ours.len(), theirs.len(), "file sizes");
        let first = ours.iter().zip(&theirs).position(|(a, b)| a != b);
        assert_eq!(first, None, "the files differ from byte {first:?}");
        // The views as one PNG strip: 20 views side by side.
        let strip = folder.path().join("views.png");
        write_views_png(&strip, runs.eager.generated.views.as_ref().unwrap()).unwrap_or_else(|e| panic!("{e}"));
        let image = image::open(&strip).unwrap_or_else(|e| panic!("{e}")).to_rgb8();
        let s = SAMPLING.frame_size;
        assert_eq!((image.width(), image.height()), (20 * s as u32, s as u32));
        // View k is the strip's k-th square, each pixel (x * 255).round() as the pipeline's PIL output.
        let views = runs.eager.generated.views.as_ref().unwrap();
        let expected = (views * 255.0).round().to_kind(Kind::Uint8);
        for (k, y, x) in [(0, 0, 0), (3, 17, 9), (19, 31, 31), (11, 5, 28)] {
            let want: Vec<u8> = (0..3).map(|c| expected.int64_value(&[k, y, x, c]) as u8).collect();
            let got = image.get_pixel((k * s + x) as u32, y as u32).0;
            assert_eq!(got.to_vec(), want, "view {k}, pixel ({x}, {y})");
        }
    });
}

#[test]
fn eager_staged_and_prefetch_give_the_same_outputs_bit_for_bit() {
    let _generator = support::generator();
    with_runs(|runs| {
        let eager = &runs.eager.generated;
        for (mode, run) in [("staged", &runs.staged), ("prefetch", &runs.prefetch)] {
            let g = &run.generated;
            assert_bits_equal(&format!("{mode} image embeds"), &g.image_embeds, &eager.image_embeds);
            assert_bits_equal(&format!("{mode} initial latents"), &g.initial_latents, &eager.initial_latents);
            assert_bits_equal(&format!("{mode} final latents"), &g.final_latents, &eager.final_latents);
            assert_bits_equal(&format!("{mode} views"), g.views.as_ref().unwrap(), eager.views.as_ref().unwrap());
            let (m, e) = (mesh(g), mesh(eager));
            assert_bits_equal(&format!("{mode} vertices"), &m.verts, &e.verts);
            assert_bits_equal(&format!("{mode} faces"), &m.faces, &e.faces);
            assert_bits_equal(&format!("{mode} colours"), &m.colors, &e.colors);
        }
        // Prefetch loaded models in the background (the prior, the renderer: which of them in the
        // background depends on how the stages' threads meet on a loaded machine), each one a
        // prefetch asked for, and every model once.
        let events = &runs.prefetch.events;
        let prefetched = prefetched_models(events);
        assert!(!prefetched.is_empty(), "no model was loaded in the background: {events:#?}");
        let asked: Vec<&str> = of_kind(events, EventKind::Prefetch).iter().filter_map(|e| e.model()).collect();
        for model in &prefetched {
            assert!(asked.contains(&model.as_str()), "{model} loaded in the background unasked: {events:#?}");
        }
        let mut loaded: Vec<&str> = of_kind(events, EventKind::Load).iter().filter_map(|e| e.model()).collect();
        loaded.sort_unstable();
        assert_eq!(loaded, ["image_encoder", "prior", "renderer"], "{events:#?}");
        assert!(of_kind(&runs.eager.events, EventKind::Release).is_empty(), "eager released a model");
    });
}

#[test]
fn a_staged_run_holds_only_the_running_stage_s_model_and_none_while_writing_files() {
    let _generator = support::generator();
    with_runs(|runs| {
        let run = &runs.staged;
        let expected = [("encode", "image_encoder"), ("denoise", "prior"), ("decode", "renderer")];
        for call in &run.calls {
            let stage = call.stage.as_deref().unwrap_or("no stage");
            let model = expected.iter().find(|(s, _)| *s == stage).map(|(_, m)| *m);
            assert_eq!(Some(call.model.as_str()), model, "{call:?}");
            assert_eq!(call.resident, std::slice::from_ref(&call.model), "{call:?}");
        }
        let prior_calls = run.calls.iter().filter(|c| c.model == "prior").count();
        assert_eq!(prior_calls, 2 * SAMPLING.steps - 1);
        assert!(run.resident_at_export.is_empty(), "resident while writing files: {:?}", run.resident_at_export);
        let releases: Vec<_> = of_kind(&run.events, EventKind::Release)
            .iter()
            .map(|e| {
                (e.model().map(str::to_string).unwrap_or_default(), e.stage().map(str::to_string).unwrap_or_default())
            })
            .collect();
        let released = |m: &str, s: &str| (m.to_string(), s.to_string());
        assert_eq!(
            releases,
            [released("image_encoder", "denoise"), released("prior", "decode"), released("renderer", "export")]
        );
    });
}

#[test]
fn the_caller_s_torch_generator_is_as_it_was_after_the_renderer_reseeds_it() {
    let _generator = support::generator();
    with_runs(|runs| {
        for (mode, run) in [("eager", &runs.eager), ("staged", &runs.staged), ("prefetch", &runs.prefetch)] {
            assert!(run.generator_kept, "{mode}: the caller's next draw changed");
        }
    });
}

/// A runner over three modules loaded by hand, the renderer's signed-distance bias changed:
/// the registry is not the point here.
struct Modules {
    image_encoder: Mutex<CModule>,
    prior: Mutex<CModule>,
    renderer: Mutex<CModule>,
}

impl StageRunner for Modules {
    fn enter(&self, _stage: &str) -> Result<(), BoxError> {
        Ok(())
    }

    fn call<M: 'static, R>(&self, model: &str, f: impl FnOnce(&mut M) -> R) -> Result<R, BoxError> {
        let module = match model {
            "image_encoder" => &self.image_encoder,
            "prior" => &self.prior,
            "renderer" => &self.renderer,
            other => return Err(format!("no model {other}").into()),
        };
        let mut module = module.lock().unwrap_or_else(|p| p.into_inner());
        let module: &mut dyn std::any::Any = &mut *module;
        let module = module.downcast_mut::<M>().ok_or("not a CModule")?;
        Ok(f(module))
    }
}

#[test]
fn a_field_without_a_zero_crossing_gives_an_empty_surface_not_a_crash() {
    let _generator = support::generator();
    let export = export();
    let load = |name: &str| {
        let (_, module, _) = export.files().into_iter().find(|(n, _, _)| *n == name).unwrap();
        Mutex::new(CModule::load(module).unwrap_or_else(|e| panic!("{e}")))
    };
    let modules = Modules { image_encoder: load("image_encoder"), prior: load("prior"), renderer: load("renderer") };
    {
        let renderer = modules.renderer.lock().unwrap();
        let named = renderer.named_parameters().unwrap();
        let (_, bias) = named.iter().find(|(n, _)| n == "model.mlp.mlp.6.bias").expect("the SDF output's bias");
        let _no_grad = tch::no_grad_guard();
        // tanh(output) < 0 everywhere: the whole grid is outside.
        let _ = bias.get(0).fill_(-50.0);
    }
    let sampling = Sampling { views: false, ..SAMPLING };
    let generated =
        generate(&modules, &export, &pixels(&export), &export.noise(SEED), sampling).unwrap_or_else(|e| panic!("{e}"));
    assert!(matches!(generated.surface, Some(Surface::Empty)), "{:?}", generated.surface);
}

#[test]
fn a_frame_size_that_is_not_a_multiple_of_32_is_refused_before_any_model_runs() {
    let _generator = support::generator();
    let export = export();
    let models = export.registry(Loading::Staged, None).unwrap_or_else(|e| panic!("{e}"));
    let sampling = Sampling { frame_size: 48, ..SAMPLING };
    let error = generate(&models, &export, &pixels(&export), &export.noise(SEED), sampling).unwrap_err();
    assert!(matches!(error.downcast_ref::<RunError>(), Some(RunError::FrameSize(48))), "{error}");
    assert!(error.to_string().contains("multiple of 32"), "{error}");
    assert!(models.resident().is_empty(), "a model was loaded: {:?}", models.resident());
    let error = generate(
        &models,
        &export,
        &Tensor::zeros([1, 3, 64, 64], (Kind::Float, tch::Device::Cpu)),
        &export.noise(SEED),
        SAMPLING,
    )
    .unwrap_err();
    assert!(matches!(error.downcast_ref::<RunError>(), Some(RunError::Pixels { .. })), "{error}");
}

#[test]
fn an_export_missing_a_file_is_refused_with_the_file_named() {
    let export = export();
    let folder = tempfile::TempDir::new().unwrap();
    for file in
        ["config.json", "scheduler.json", "preprocessor_config.json", "image_encoder.pt", "image_encoder.safetensors"]
    {
        std::fs::copy(export.dir().join(file), folder.path().join(file)).unwrap();
    }
    let error = Export::open(folder.path()).unwrap_err();
    assert!(matches!(error, ExportError::Read { .. }), "{error}");
    eprintln!("a truncated module: {error}");
    assert!(error.to_string().contains("prior.pt"), "{error}");
    std::fs::write(folder.path().join("config.json"), "{\"format\": 1").unwrap();
    let error = Export::open(folder.path()).unwrap_err();
    assert!(matches!(error, ExportError::Parse { .. }), "{error}");
    assert!(error.to_string().contains("config.json"), "{error}");
}

#[test]
fn a_truncated_module_or_a_checkpoint_of_another_model_is_an_error_naming_it() {
    let _generator = support::generator();
    let export = export();
    let folder = tempfile::TempDir::new().unwrap();
    for entry in std::fs::read_dir(export.dir()).unwrap() {
        let path = entry.unwrap().path();
        if path.is_file() {
            std::fs::copy(&path, folder.path().join(path.file_name().unwrap())).unwrap();
        }
    }
    // The prior's module cut in half.
    let prior = folder.path().join("prior.pt");
    let bytes = std::fs::read(&prior).unwrap();
    std::fs::write(&prior, &bytes[..bytes.len() / 2]).unwrap();
    let broken = Export::open(folder.path()).unwrap_or_else(|e| panic!("{e}"));
    let models = broken.registry(Loading::Staged, None).unwrap_or_else(|e| panic!("{e}"));
    let error = generate(&models, &broken, &pixels(&broken), &broken.noise(SEED), SAMPLING).unwrap_err();
    eprintln!("truncated module: {error}");
    assert!(error.to_string().contains("prior.pt"), "{error}");
    models.close();

    // The renderer's checkpoint replaced by the image encoder's: refused when the renderer is built.
    std::fs::write(&prior, &bytes).unwrap();
    std::fs::copy(folder.path().join("image_encoder.safetensors"), folder.path().join("renderer.safetensors")).unwrap();
    let mismatched = Export::open(folder.path()).unwrap_or_else(|e| panic!("{e}"));
    let models = mismatched.registry(Loading::Staged, None).unwrap_or_else(|e| panic!("{e}"));
    let sampling = Sampling { views: false, mesh: false, ..SAMPLING };
    let error = generate(&models, &mismatched, &pixels(&mismatched), &mismatched.noise(SEED), sampling).unwrap_err();
    eprintln!("mismatched checkpoint: {error}");
    assert!(error.to_string().contains("renderer"), "{error}");
    models.close();
}

#[test]
fn the_pt2_packages_run_the_same_pipeline_within_inductor_s_rounding() {
    let _generator = support::generator();
    let dir = export().dir().to_path_buf();
    let pt2 = Export::open_as(&dir, Format::Pt2).unwrap_or_else(|e| panic!("{e}"));
    let files: Vec<String> = pt2.files().iter().map(|(_, module, _)| module.display().to_string()).collect();
    assert!(files[0].ends_with("pt2/image_encoder.pt2") && files[2].ends_with("renderer.pt"), "{files:?}");
    let models = pt2.registry(Loading::Staged, None).unwrap_or_else(|e| panic!("{e}"));
    let sampling = Sampling { views: false, ..SAMPLING };
    let generated =
        generate(&models, &pt2, &pixels(&pt2), &pt2.noise(SEED), sampling).unwrap_or_else(|e| panic!("{e}"));
    models.close();
    with_runs(|runs| {
        let script = &runs.staged.generated;
        let embeds = Difference::of("image_embeds", &generated.image_embeds, &script.image_embeds).unwrap();
        eprintln!("pt2 against TorchScript: image embeds {embeds}");
        // One component's output: Inductor's rounding only (the export measures about 1e-7 of the range).
        assert!(embeds.relative() <= TOLERANCE, "image embeds: {embeds}");
        let latents = Difference::of("final latents", &generated.final_latents, &script.final_latents).unwrap();
        eprintln!("pt2 against TorchScript: final latents {latents}");
        // Through 3 prior calls with guidance 4 (which multiplies a difference of the two halves
        // by 7) and Heun's steps: measured 1.2e-4 of the range; still far below it.
        assert!(latents.relative() <= 1e-3, "final latents: {latents}");
        // A grid value near 0 may change sign with the latents: the surface is the same within 1 %.
        let (ours, theirs) = (mesh(&generated).faces.size()[0], mesh(script).faces.size()[0]);
        assert!((ours - theirs).abs() * 100 <= theirs, "face counts {ours} and {theirs}");
    });
}

#[test]
fn a_guidance_not_above_1_and_an_export_of_other_sizes_are_refused() {
    let _generator = support::generator();
    let export = export();
    let models = export.registry(Loading::Staged, None).unwrap_or_else(|e| panic!("{e}"));
    let sampling = Sampling { guidance: 1.0, ..SAMPLING };
    let error = generate(&models, &export, &pixels(&export), &export.noise(SEED), sampling).unwrap_err();
    assert!(matches!(error.downcast_ref::<RunError>(), Some(RunError::Guidance(_))), "{error}");
    assert!(models.resident().is_empty(), "a model was loaded: {:?}", models.resident());
    let error =
        generate(&models, &export, &pixels(&export), &Tensor::zeros([3], (Kind::Float, tch::Device::Cpu)), SAMPLING)
            .unwrap_err();
    assert!(matches!(error.downcast_ref::<RunError>(), Some(RunError::Noise { .. })), "{error}");

    // A config.json whose grid is not diffusers' 128 (the traced marching cubes takes 130³).
    let folder = tempfile::TempDir::new().unwrap();
    for file in ["scheduler.json", "preprocessor_config.json"] {
        std::fs::copy(export.dir().join(file), folder.path().join(file)).unwrap();
    }
    let text = std::fs::read_to_string(export.dir().join("config.json")).unwrap();
    let mut config: serde_json::Value = serde_json::from_str(&text).unwrap();
    config["grid_size"] = serde_json::json!(64);
    std::fs::write(folder.path().join("config.json"), config.to_string()).unwrap();
    let error = Export::open(folder.path()).unwrap_err();
    assert!(matches!(error, ExportError::Unsupported { .. }), "{error}");
    assert!(error.to_string().contains("grid_size = 64"), "{error}");
}
