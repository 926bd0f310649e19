//! Stable Diffusion in three stages (`crates/pipelines/src/stable_diffusion/`) at the small size of
//! `scripts/reference/sd_export.py` (8x8 latents, a 16x16 image): eager, staged and staged with
//! prefetch give the same bits; the image, embeddings and final latents match diffusers'
//! `StableDiffusionPipeline` on the same weights (`scripts/reference/sd_reference.py`, run once
//! for the tests by the cached Python environment, killed past a deadline); and a staged run has
//! released the text encoder and the UNet when it decodes. The three Rust runs are made once and
//! shared too (torch's generator is global, so they are made under one lock). Without
//! STAGELOAD_SD_SMALL and STAGELOAD_PYTHON the tests fail and say what to run.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use stageload::{BoxError, Event, EventKind, EventSink, ListSink};
use stageload_pipelines::runner::{Loading, PipelineExport};
use stageload_pipelines::stable_diffusion::reference::{compare, run_reference, Reference};
use stageload_pipelines::stable_diffusion::{generate, Export, Generated, Sampling};
use stageload_test_support::torch as support;
use tch::Kind;

use crate::watch::{assert_bits_equal, of_kind, prefetched_models, with_shared, Call, Shared, Watch};

const SAMPLING: Sampling = Sampling { steps: 4, guidance: 7.5 };
const SEED: i64 = 11;
const DEADLINE: Duration = Duration::from_secs(180);

fn required(variable: &str) -> Result<String, String> {
    std::env::var(variable).map_err(|_| {
        format!(
            "{variable} is not set: these tests need the small Stable Diffusion export and diffusers in the cached \
             Python environment. Run them through cargo xtask test, or first: eval \"$(scripts/setup-libtorch.sh)\"; \
             eval \"$(scripts/setup-reference.sh)\" (which installs diffusers and exports the small size)"
        )
    })
}

/// One Rust run: what it made, the events until it closed, and every call.
struct Run {
    generated: Generated,
    events: Vec<Event>,
    calls: Vec<Call>,
    seconds: f64,
}

fn run(export: &Export, loading: Loading) -> Result<Run, BoxError> {
    let started = Instant::now();
    let sink = Arc::new(ListSink::new());
    let models = export.registry(loading, Some(sink.clone() as Arc<dyn EventSink>))?;
    let latents = export.initial_latents(SEED);
    let watch = Watch::new(&models);
    let generated = generate(&watch, export, &latents, SAMPLING)?;
    // A prefetch installs its model (waking the stage that waits for it) before it sends its
    // `load` event: the events are read once every prefetch has ended (a CI run read them
    // between the two, without the VAE decoder's).
    for stage in ["encode", "denoise", "decode"] {
        models.wait_prefetch(stage)?;
    }
    let events = sink.events();
    models.close();
    let calls = watch.into_calls();
    Ok(Run { generated, events, calls, seconds: started.elapsed().as_secs_f64() })
}

struct Runs {
    export: Export,
    eager: Run,
    staged: Run,
    prefetch: Run,
}

fn make_runs() -> Result<Runs, String> {
    let dir = required("STAGELOAD_SD_SMALL")?;
    let export = Export::open(&dir).map_err(|e| e.to_string())?;
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

/// diffusers on the eager run's embeddings and latents, run once for every test that needs it.
fn with_reference(check: impl FnOnce(&Runs, &Reference)) {
    static REFERENCE: Shared<Reference> = Mutex::new(None);
    with_runs(|runs| {
        let make = || {
            let python = PathBuf::from(required("STAGELOAD_PYTHON")?);
            let folder = tempfile::TempDir::new().map_err(|e| format!("no temporary folder: {e}"))?;
            let reference =
                run_reference(&python, &runs.export, &runs.eager.generated, SAMPLING, folder.path(), DEADLINE)
                    .map_err(|e| e.to_string())?;
            eprintln!("diffusers in {:.1} s:\n{}", reference.seconds, reference.log.trim());
            Ok(reference)
        };
        with_shared(&REFERENCE, make, |reference| check(runs, reference))
    })
}

#[test]
fn eager_staged_and_prefetch_give_the_same_image_embeddings_and_latents_bit_for_bit() {
    let _generator = support::generator();
    with_runs(|runs| {
        let eager = &runs.eager.generated;
        for (mode, run) in [("staged", &runs.staged), ("prefetch", &runs.prefetch)] {
            let g = &run.generated;
            assert_bits_equal(&format!("{mode} initial latents"), &g.latents, &eager.latents);
            assert_bits_equal(&format!("{mode} embeds"), &g.embeds, &eager.embeds);
            assert_bits_equal(&format!("{mode} negative embeds"), &g.negative_embeds, &eager.negative_embeds);
            assert_bits_equal(&format!("{mode} final latents"), &g.final_latents, &eager.final_latents);
            assert_bits_equal(&format!("{mode} image"), &g.image, &eager.image);
            assert_eq!(g.timesteps, eager.timesteps, "{mode} timesteps");
        }
        let [h, w] = runs.export.config().image_size;
        assert_eq!(eager.image.size(), [1, 3, h, w]);
        assert_eq!(eager.timesteps, [751, 501, 251, 1]);

        // Eager loaded everything up front and released nothing before closing.
        let events = &runs.eager.events;
        assert!(of_kind(events, EventKind::Release).is_empty(), "eager released a model: {events:#?}");
        let loads: Vec<_> = of_kind(events, EventKind::Load)
            .iter()
            .map(|e| (e.model().map(str::to_string), e.stage().map(str::to_string)))
            .collect();
        let up_front = |m: &str| (Some(m.to_string()), None);
        assert_eq!(loads, [up_front("text_encoder"), up_front("unet"), up_front("vae_decoder")], "{events:#?}");
        // Prefetch loaded the unet and the VAE decoder in the background, once each.
        let events = &runs.prefetch.events;
        let prefetched = prefetched_models(events);
        assert_eq!(prefetched, ["unet", "vae_decoder"], "{events:#?}");
        assert_eq!(of_kind(events, EventKind::Load).len(), 3, "{events:#?}");
    });
}

#[test]
fn the_image_embeddings_and_final_latents_match_diffusers_within_1e_5_of_their_range() {
    let _generator = support::generator();
    with_reference(|runs, reference| {
        let comparison = compare(&runs.eager.generated, reference).unwrap_or_else(|e| panic!("{e}"));
        eprintln!("Rust against diffusers:\n{comparison}");
        assert!(
            runs.eager.generated.timesteps == reference.timesteps,
            "timesteps: Rust {:?}, diffusers {:?}",
            runs.eager.generated.timesteps,
            reference.timesteps
        );
        assert_eq!(comparison.failures(), Vec::<String>::new());
        // The comparison means something only where the clamp to [0, 1] left the pixels alone.
        let image = &runs.eager.generated.image;
        let inside = image.gt(0.0).logical_and(&image.lt(1.0)).sum(Kind::Int64).int64_value(&[]);
        assert!(inside * 2 > image.numel() as i64, "only {inside} of {} pixels are inside (0, 1)", image.numel());
    });
}

#[test]
fn a_staged_run_decodes_with_only_the_vae_decoder_resident_the_others_released() {
    let _generator = support::generator();
    with_runs(|runs| {
        let run = &runs.staged;
        let at =
            |stage: &str| -> Vec<&Call> { run.calls.iter().filter(|c| c.stage.as_deref() == Some(stage)).collect() };
        let decode = at("decode");
        assert_eq!(decode.len(), 1, "{:#?}", run.calls);
        assert_eq!(decode[0].model, "vae_decoder");
        assert_eq!(decode[0].resident, ["vae_decoder"], "resident when decoding");
        assert!(at("denoise").iter().all(|c| c.model == "unet" && c.resident == ["unet"]), "{:#?}", run.calls);
        assert_eq!(at("denoise").len(), SAMPLING.steps as usize);
        assert!(at("encode").iter().all(|c| c.resident == ["text_encoder"]), "{:#?}", run.calls);

        // The text encoder went when denoising began, the unet when decoding began, each once,
        // with its bytes freed; nothing came back.
        let releases: Vec<_> = of_kind(&run.events, EventKind::Release)
            .iter()
            .map(|e| {
                (
                    e.model().map(str::to_string).unwrap_or_default(),
                    e.stage().map(str::to_string).unwrap_or_default(),
                    e.bytes().unwrap_or(0),
                )
            })
            .collect();
        assert_eq!(releases.len(), 2, "{releases:?}");
        assert_eq!((releases[0].0.as_str(), releases[0].1.as_str()), ("text_encoder", "denoise"), "{releases:?}");
        assert_eq!((releases[1].0.as_str(), releases[1].1.as_str()), ("unet", "decode"), "{releases:?}");
        assert!(releases.iter().all(|r| r.2 > 0), "{releases:?}");
        assert!(of_kind(&run.events, EventKind::Reload).is_empty(), "{:#?}", run.events);
        let loads: Vec<_> = of_kind(&run.events, EventKind::Load)
            .iter()
            .map(|e| (e.model().map(str::to_string), e.stage().map(str::to_string), e.prefetched()))
            .collect();
        let in_stage = |m: &str, s: &str| (Some(m.to_string()), Some(s.to_string()), false);
        assert_eq!(
            loads,
            [in_stage("text_encoder", "encode"), in_stage("unet", "denoise"), in_stage("vae_decoder", "decode")]
        );
    });
}
