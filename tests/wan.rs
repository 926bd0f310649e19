//! Wan2.1 text-to-video in four stages (`crates/pipelines/src/wan/`) at the small size of
//! `scripts/reference/wan_export.py` (9 frames of 32 × 32 pixels, sequence length 16, 4 UniPC
//! steps, guidance 5): the embeddings, initial and final latents, the video and its frames' pixels
//! match diffusers' `WanPipeline` on the same weights, token ids and seed
//! (`scripts/reference/wan_reference.py`, run once for the tests, killed past a deadline), also
//! without guidance; eager, staged and staged with prefetch give the same bits; a staged run holds
//! only the running stage's model and none while writing the frames; the text encoder, which has
//! no checkpoint, is read from its file again after a release; the frames are written as PNGs and
//! a looping GIF; bad input (token ids, latents, a guidance, an export of a frame count the VAE
//! cannot take, a scheduler the port does not run, a missing or truncated file) is a clear error
//! before any model loads or naming the file. The three Rust runs are made once and shared
//! (torch's generator is global, so they are made under its lock). Without STAGELOAD_WAN_SMALL and
//! STAGELOAD_PYTHON the tests fail and say what to run.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use stageload::{BoxError, Event, EventKind, EventSink, ListSink, ReloadFrom};
use stageload_pipelines::runner::{Loading, PipelineExport};
use stageload_pipelines::wan::files::{write_frames, write_gif, FPS};
use stageload_pipelines::wan::reference::{compare, run_reference, Reference};
use stageload_pipelines::wan::{generate, Export, ExportError, Generated, RunError, Sampling};
use stageload_test_support::torch as support;
use tch::{Kind, Tensor};

use crate::watch::{assert_bits_equal, of_kind, prefetched_models, with_shared, Call, Shared, Watch};

const SAMPLING: Sampling = Sampling { steps: 4, guidance: 5.0 };
const SEED: i64 = 7;
const DEADLINE: Duration = Duration::from_secs(240);

fn required(variable: &str) -> Result<String, String> {
    std::env::var(variable).map_err(|_| {
        format!(
            "{variable} is not set: these tests need the small Wan export and diffusers in the cached Python \
             environment. Run them through cargo xtask test, or first: eval \"$(scripts/setup-libtorch.sh)\"; eval \
             \"$(scripts/setup-reference.sh)\" (which installs diffusers and exports the small size)"
        )
    })
}

fn export() -> Export {
    let dir = required("STAGELOAD_WAN_SMALL").unwrap_or_else(|e| panic!("{e}"));
    Export::open(&dir).unwrap_or_else(|e| panic!("{e}"))
}

/// One Rust run: what it made, the events until it closed, every call, what was resident in
/// `export`.
struct Run {
    generated: Generated,
    events: Vec<Event>,
    calls: Vec<Call>,
    resident_at_export: Vec<String>,
    seconds: f64,
}

fn run(export: &Export, loading: Loading) -> Result<Run, BoxError> {
    let started = Instant::now();
    let sink = Arc::new(ListSink::new());
    let models = export.registry(loading, Some(sink.clone() as Arc<dyn EventSink>))?;
    let watch = Watch::new(&models);
    let latents = export.noise(SEED);
    let generated = generate(&watch, export, export.prompt_ids(), export.negative_ids(), &latents, SAMPLING)?;
    models.enter("export")?;
    let resident_at_export = models.resident();
    // A prefetch installs its model (waking the stage that waits for it) before it sends its
    // `load` event: the events are read once every prefetch has ended.
    for stage in ["encode", "denoise", "decode", "export"] {
        models.wait_prefetch(stage)?;
    }
    let events = sink.events();
    models.close();
    Ok(Run {
        generated,
        events,
        calls: watch.into_calls(),
        resident_at_export,
        seconds: started.elapsed().as_secs_f64(),
    })
}

struct Runs {
    export: Export,
    eager: Run,
    staged: Run,
    prefetch: Run,
}

fn make_runs() -> Result<Runs, String> {
    // torch's generator is global: the runs draw their noise under its lock, which the tests that
    // use them do not hold (the reference then runs in Python without it).
    let _generator = support::generator();
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

/// diffusers with `sampling` on the export's token ids and the seed.
fn reference(export: &Export, sampling: Sampling) -> Result<Reference, String> {
    let python = PathBuf::from(required("STAGELOAD_PYTHON")?);
    let folder = tempfile::TempDir::new().map_err(|e| format!("no temporary folder: {e}"))?;
    let reference =
        run_reference(&python, export, SEED, sampling, folder.path(), DEADLINE).map_err(|e| e.to_string())?;
    eprintln!("diffusers in {:.1} s: {}", reference.seconds, reference.summary);
    Ok(reference)
}

/// Asserts that `generated` equals `reference` in every tensor and check, and that the compared
/// tensors are not constant.
fn assert_matches(generated: &Generated, reference: &Reference) {
    let comparison = compare(generated, reference).unwrap_or_else(|e| panic!("{e}"));
    eprintln!("Rust against diffusers:\n{comparison}");
    assert_eq!(comparison.failures(), Vec::<String>::new());
    assert!(comparison.identical(), "{comparison}");
    for (what, difference) in &comparison.differences {
        assert!(difference.range > 0.0, "{what} is constant: the comparison says nothing");
    }
}

#[test]
fn the_embeddings_latents_video_and_frames_match_diffusers_bit_for_bit() {
    with_runs(|runs| {
        let reference = reference(&runs.export, SAMPLING).unwrap_or_else(|e| panic!("{e}"));
        let generated = &runs.eager.generated;
        assert_matches(generated, &reference);
        assert_eq!(generated.timesteps.len(), SAMPLING.steps);
        // The frames vary: the comparison is not of a blank video.
        let spread = (generated.frames.max() - generated.frames.min()).int64_value(&[]);
        assert!(spread > 10, "the frames hardly vary ({spread})");
        assert!(generated.negative_prompt_embeds.is_some());
    });
}

#[test]
fn without_guidance_the_negative_prompt_is_not_encoded_and_the_run_still_matches_diffusers() {
    let _generator = support::generator();
    let export = export();
    let models = export.registry(Loading::Staged, None).unwrap_or_else(|e| panic!("{e}"));
    let watch = Watch::new(&models);
    let sampling = Sampling { steps: 2, guidance: 1.0 };
    let generated =
        generate(&watch, &export, export.prompt_ids(), export.negative_ids(), &export.noise(SEED), sampling)
            .unwrap_or_else(|e| panic!("{e}"));
    models.close();
    let calls = watch.into_calls();
    let count = |model: &str| calls.iter().filter(|c| c.model == model).count();
    assert_eq!((count("text_encoder"), count("transformer")), (1, 2), "{calls:?}");
    assert!(generated.negative_prompt_embeds.is_none());
    let reference = reference(&export, sampling).unwrap_or_else(|e| panic!("{e}"));
    assert_matches(&generated, &reference);
}

#[test]
fn eager_staged_and_prefetch_give_the_same_outputs_bit_for_bit() {
    with_runs(|runs| {
        let eager = &runs.eager.generated;
        for (mode, run) in [("staged", &runs.staged), ("prefetch", &runs.prefetch)] {
            let g = &run.generated;
            assert_bits_equal(&format!("{mode} prompt embeds"), &g.prompt_embeds, &eager.prompt_embeds);
            assert_bits_equal(
                &format!("{mode} negative embeds"),
                g.negative_prompt_embeds.as_ref().unwrap(),
                eager.negative_prompt_embeds.as_ref().unwrap(),
            );
            assert_bits_equal(&format!("{mode} final latents"), &g.final_latents, &eager.final_latents);
            assert_bits_equal(&format!("{mode} video"), &g.video, &eager.video);
            assert_bits_equal(&format!("{mode} frames"), &g.frames, &eager.frames);
        }
        let prefetched = prefetched_models(&runs.prefetch.events);
        assert_eq!(prefetched, ["transformer", "vae_decoder"], "{:#?}", runs.prefetch.events);
        assert!(of_kind(&runs.eager.events, EventKind::Release).is_empty(), "eager released a model");
    });
}

#[test]
fn a_staged_run_holds_only_the_running_stage_s_model_and_none_while_writing_frames() {
    with_runs(|runs| {
        let run = &runs.staged;
        let expected = [("encode", "text_encoder"), ("denoise", "transformer"), ("decode", "vae_decoder")];
        for call in &run.calls {
            let stage = call.stage.as_deref().unwrap_or("no stage");
            let model = expected.iter().find(|(s, _)| *s == stage).map(|(_, m)| *m);
            assert_eq!(Some(call.model.as_str()), model, "{call:?}");
            assert_eq!(call.resident, std::slice::from_ref(&call.model), "{call:?}");
        }
        let count = |model: &str| run.calls.iter().filter(|c| c.model == model).count();
        // Two prompts encoded; two transformer calls (prompt, negative) per step; one decode.
        assert_eq!((count("text_encoder"), count("transformer"), count("vae_decoder")), (2, 2 * SAMPLING.steps, 1));
        assert!(run.resident_at_export.is_empty(), "resident while writing frames: {:?}", run.resident_at_export);
        let releases: Vec<_> = of_kind(&run.events, EventKind::Release)
            .iter()
            .map(|e| {
                (e.model().map(str::to_string).unwrap_or_default(), e.stage().map(str::to_string).unwrap_or_default())
            })
            .collect();
        let released = |m: &str, s: &str| (m.to_string(), s.to_string());
        assert_eq!(
            releases,
            [released("text_encoder", "denoise"), released("transformer", "decode"), released("vae_decoder", "export")]
        );
    });
}

#[test]
fn the_text_encoder_without_a_checkpoint_is_read_from_its_file_again_after_a_release() {
    let _generator = support::generator();
    let export = export();
    let (_, _, weights) = &export.files()[0];
    assert!(weights.is_none(), "the text encoder has a checkpoint: {weights:?}");
    let sink = Arc::new(ListSink::new());
    let models =
        export.registry(Loading::Staged, Some(sink.clone() as Arc<dyn EventSink>)).unwrap_or_else(|e| panic!("{e}"));
    let sampling = Sampling { steps: 1, guidance: 5.0 };
    let first = generate(&models, &export, export.prompt_ids(), export.negative_ids(), &export.noise(SEED), sampling)
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(!models.resident().contains(&"text_encoder".to_string()), "{:?}", models.resident());
    let second = generate(&models, &export, export.prompt_ids(), export.negative_ids(), &export.noise(SEED), sampling)
        .unwrap_or_else(|e| panic!("{e}"));
    models.close();
    let events = sink.events();
    let of_encoder = |kind| of_kind(&events, kind).into_iter().filter(|e| e.model() == Some("text_encoder"));
    assert_eq!(of_encoder(EventKind::Load).count(), 1);
    let reloads: Vec<_> = of_encoder(EventKind::Reload).map(|e| e.reload_from()).collect();
    assert_eq!(reloads, [Some(ReloadFrom::Rebuilt)], "the text encoder was not built again from its file");
    assert_bits_equal("prompt embeds after a reload", &second.prompt_embeds, &first.prompt_embeds);
    assert_bits_equal("frames after a reload", &second.frames, &first.frames);
}

#[test]
fn the_frames_are_written_as_pngs_and_a_looping_gif_at_16_frames_per_second() {
    with_runs(|runs| {
        let frames = &runs.eager.generated.frames;
        let [n, h, w, _] = frames.size()[..] else { panic!("frames {:?}", frames.size()) };
        let folder = tempfile::TempDir::new().unwrap();
        let paths = write_frames(folder.path(), frames).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(paths.len() as i64, n);
        for (i, path) in paths.iter().enumerate() {
            let image = image::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())).to_rgb8();
            let pixels = Tensor::from_slice(image.as_raw()).view([h, w, 3]);
            assert_bits_equal(&format!("frame {i}"), &pixels, &frames.get(i as i64));
        }
        let gif = folder.path().join("video.gif");
        write_gif(&gif, frames).unwrap_or_else(|e| panic!("{e}"));
        use image::AnimationDecoder;
        let decoder = image::codecs::gif::GifDecoder::new(std::fs::File::open(&gif).unwrap()).unwrap();
        let decoded = decoder.into_frames().collect_frames().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(decoded.len() as i64, n);
        let (numer, denom) = decoded[0].delay().numer_denom_ms();
        // A GIF's delays are whole hundredths of a second: 1000 / 16 = 62.5 ms is stored as 60 ms.
        assert_eq!(f64::from(numer) / f64::from(denom), f64::from(1000 / FPS / 10 * 10));
        assert_eq!(decoded[0].buffer().dimensions(), (w as u32, h as u32));
        let bytes = std::fs::read(&gif).unwrap();
        let loops = bytes.windows(11).any(|window| window == b"NETSCAPE2.0");
        assert!(loops, "the GIF has no looping extension");
        // Bad frames: a float tensor is refused with the file named, and nothing is written.
        let error = write_gif(&folder.path().join("bad.gif"), &runs.eager.generated.video).unwrap_err();
        assert!(error.to_string().contains("bad.gif") && error.to_string().contains("uint8"), "{error}");
        assert!(!folder.path().join("bad.gif").exists());
    });
}

#[test]
fn token_ids_latents_or_a_guidance_the_pipeline_cannot_take_are_refused_before_any_model_loads() {
    let _generator = support::generator();
    let export = export();
    let sink = Arc::new(ListSink::new());
    let models =
        export.registry(Loading::Staged, Some(sink.clone() as Arc<dyn EventSink>)).unwrap_or_else(|e| panic!("{e}"));
    let c = export.config();
    let latents = export.noise(SEED);
    let (prompt, negative) = (export.prompt_ids().to_vec(), export.negative_ids().to_vec());
    let too_long = vec![5; c.max_sequence_length as usize + 1];
    let outside = [3, c.vocab_size, 1];
    let wrong_shape = Tensor::zeros([1, 16, 1, 4, 4], (Kind::Float, tch::Device::Cpu));
    /// What a run is given, and what its error must say.
    struct Case<'a> {
        prompt: &'a [i64],
        negative: &'a [i64],
        latents: &'a Tensor,
        guidance: f64,
        message: &'a str,
    }
    let case = |prompt, negative, latents, guidance, message| Case { prompt, negative, latents, guidance, message };
    let cases = [
        case(&outside, &negative, &latents, 5.0, "outside the text encoder's vocabulary"),
        case(&[-1], &negative, &latents, 5.0, "outside the text encoder's vocabulary"),
        case(&too_long, &negative, &latents, 5.0, "do not fit the export's sequence length"),
        case(&prompt, &[], &latents, 5.0, "negative prompt's 0 token ids"),
        case(&prompt, &negative, &wrong_shape, 5.0, "the latents are"),
        case(&prompt, &negative, &latents, f64::NAN, "not a finite number"),
    ];
    for Case { prompt, negative, latents, guidance, message } in cases {
        let error = generate(&models, &export, prompt, negative, latents, Sampling { steps: 2, guidance }).unwrap_err();
        assert!(error.downcast_ref::<RunError>().is_some(), "{error}");
        assert!(error.to_string().contains(message), "{error} (expected: {message})");
        assert!(models.resident().is_empty(), "a model was loaded: {:?}", models.resident());
    }
    let error =
        generate(&models, &export, &prompt, &negative, &latents, Sampling { steps: 0, guidance: 5.0 }).unwrap_err();
    assert!(error.to_string().contains("inference_steps = 0 is out of range"), "{error}");
    // Without guidance the negative prompt is not encoded, so it is not checked either (diffusers
    // ignores it then): an empty one is no error. Refused the same way before any model loads.
    let error = generate(&models, &export, &[-5], &[], &latents, Sampling { steps: 2, guidance: 1.0 }).unwrap_err();
    assert!(error.to_string().contains("the prompt's token id -5"), "{error}");
    assert!(of_kind(&sink.events(), EventKind::Load).is_empty(), "a model was loaded: {:?}", sink.events());
    models.close();
}

/// A copy of the export's files in a folder of its own, with `config.json` changed by `edit`.
fn copy_with(export: &Export, edit: impl FnOnce(&mut serde_json::Value)) -> tempfile::TempDir {
    let folder = tempfile::TempDir::new().unwrap();
    for entry in std::fs::read_dir(export.dir()).unwrap() {
        let path = entry.unwrap().path();
        if path.is_file() {
            std::fs::copy(&path, folder.path().join(path.file_name().unwrap())).unwrap();
        }
    }
    let path = folder.path().join("config.json");
    let mut config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(&path, config.to_string()).unwrap();
    folder
}

#[test]
fn an_export_of_a_frame_count_the_vae_cannot_take_or_another_scheduler_is_refused_naming_the_field() {
    let export = export();
    type Edit = fn(&mut serde_json::Value);
    let cases: [(&str, bool, Edit); 6] = [
        ("num_frames = 6", false, |c| c["num_frames"] = 6.into()),
        ("height = 40", false, |c| c["height"] = 40.into()),
        // A size the traces were not made at: caught before any model runs.
        ("transformer was traced at", false, |c| c["num_frames"] = 13.into()),
        ("transformer has no safetensors checkpoint", false, |c| {
            c["components"]["transformer"]["weights"] = serde_json::Value::Null
        }),
        ("prediction_type", true, |c| c["scheduler"]["config"]["prediction_type"] = "epsilon".into()),
        ("mask is not ones", false, |c| c["token_ids"]["prompt_mask"][0] = 0.into()),
    ];
    for (message, scheduler, edit) in cases {
        let folder = copy_with(&export, edit);
        let error = Export::open(folder.path()).unwrap_err();
        match scheduler {
            true => assert!(matches!(error, ExportError::Scheduler { .. }), "{error}"),
            false => assert!(matches!(error, ExportError::Unsupported { .. }), "{error}"),
        }
        assert!(error.to_string().contains(message), "{error} (expected: {message})");
        assert!(error.to_string().contains("config.json"), "{error}");
    }
}

#[test]
fn a_missing_or_truncated_module_is_an_error_naming_its_file() {
    let _generator = support::generator();
    let export = export();
    let folder = copy_with(&export, |_| {});
    std::fs::remove_file(folder.path().join("vae_decoder.safetensors")).unwrap();
    let error = Export::open(folder.path()).unwrap_err();
    assert!(matches!(error, ExportError::Read { .. }), "{error}");
    assert!(error.to_string().contains("vae_decoder.safetensors") && error.to_string().contains("wan_export.py"));

    let folder = copy_with(&export, |_| {});
    let module = folder.path().join("transformer.pt");
    let bytes = std::fs::read(&module).unwrap();
    std::fs::write(&module, &bytes[..bytes.len() / 2]).unwrap();
    let broken = Export::open(folder.path()).unwrap_or_else(|e| panic!("{e}"));
    let models = broken.registry(Loading::Staged, None).unwrap_or_else(|e| panic!("{e}"));
    let sampling = Sampling { steps: 1, guidance: 5.0 };
    let error = generate(&models, &broken, broken.prompt_ids(), broken.negative_ids(), &broken.noise(SEED), sampling)
        .unwrap_err();
    eprintln!("truncated module: {error}");
    assert!(error.to_string().contains("transformer.pt"), "{error}");
    models.close();
}

#[test]
fn the_example_runs_staged_writes_its_frames_and_matches_diffusers() {
    let export = export();
    let out = tempfile::TempDir::new().unwrap();
    let cache = tempfile::TempDir::new().unwrap();
    let binary = stageload_test_support::build::example("wan");
    let output = std::process::Command::new(&binary)
        .arg("--components")
        .arg(export.dir())
        .args(["--mode", "staged", "--steps", "2", "--compare-python", "--python-deadline", "240"])
        .arg("--out")
        .arg(out.path())
        .env("STAGELOAD_CACHE", cache.path())
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert!(output.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("identical to diffusers"), "{stdout}");
    assert!(stdout.contains("stage encode") && stdout.contains("stage export"), "{stdout}");
    let frames = export.config().num_frames;
    for i in 0..frames {
        assert!(out.path().join(format!("frame_{i:04}.png")).is_file(), "frame {i} missing");
    }
    assert!(out.path().join("video.gif").is_file());

    // Token ids outside the vocabulary: a clear error and a failed exit, no panic, no frames.
    let empty = tempfile::TempDir::new().unwrap();
    let output = std::process::Command::new(&binary)
        .arg("--components")
        .arg(export.dir())
        .args(["--prompt-ids", &format!("3,{},1", export.config().vocab_size)])
        .arg("--out")
        .arg(empty.path())
        .env("STAGELOAD_CACHE", cache.path())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("outside the text encoder's vocabulary") && !stderr.contains("panicked"), "{stderr}");
    assert_eq!(std::fs::read_dir(empty.path()).unwrap().count(), 0, "files written after a refused run");
}
