//! The Rust Heun scheduler (`crates/pipelines/src/schedulers/heun.rs`) against diffusers'
//! `HeunDiscreteScheduler` as `ShapEImg2ImgPipeline` configures it, run by the cached Python
//! environment (`scripts/reference/heun_reference.py`): sigmas, timesteps and `init_noise_sigma`
//! equal bit for bit for every step count from 1 to 128 and a spread up to 1024, and whole runs
//! (scaled inputs, every step's output and the state between calls) for 1, 2, 3, 4 and 64 steps.
//! The Python side draws the model outputs from a seeded generator and hands them to Rust with its
//! results; it also writes the configuration JSON with the `log_sigmas` table the Rust side reads
//! (`scripts/reference/shap_e_scheduler.py`). All tests share one Python run. Without
//! STAGELOAD_PYTHON (or without diffusers in it) the tests fail and say what to run.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use stageload_pipelines::schedulers::heun::{Heun, HeunConfig, HeunError, HeunState};
use stageload_pipelines::schedulers::Scheduler;
use tch::{Kind, Tensor};

/// Every step count from 1 to 128, then a spread up to the training schedule's 1024.
fn table_steps() -> Vec<usize> {
    (1..=128).chain([129, 192, 255, 256, 384, 500, 512, 640, 768, 896, 1000, 1023, 1024]).collect()
}
const RUN_STEPS: [usize; 5] = [1, 2, 3, 4, 64];
const SEED: u64 = 50;
const DEADLINE: Duration = Duration::from_secs(120);

/// What the reference wrote: its tensors and the configuration file.
struct Reference {
    outputs: HashMap<String, Tensor>,
    config: HeunConfig,
    _folder: tempfile::TempDir,
}

/// Runs the reference script within the deadline and reads what it wrote.
fn run_reference() -> Result<Reference, String> {
    let folder = tempfile::TempDir::new().map_err(|e| format!("no temporary folder: {e}"))?;
    let (config, output) = (folder.path().join("scheduler.json"), folder.path().join("reference.safetensors"));
    let list = |steps: &[usize]| steps.iter().map(usize::to_string).collect::<Vec<_>>().join(",");
    let (tables, runs, seed) = (list(&table_steps()), list(&RUN_STEPS), SEED.to_string());
    let args = [config.as_os_str(), output.as_os_str(), tables.as_ref(), runs.as_ref(), seed.as_ref()];
    let outputs = crate::reference::run("heun_reference.py", &args, folder.path(), &output, DEADLINE)?;
    let config = HeunConfig::from_json_file(&config).map_err(|e| e.to_string())?;
    Ok(Reference { outputs, config, _folder: folder })
}

/// Runs `check` on the reference, failing with the reference's error if there is none. The
/// reference runs once for all the tests that need it.
fn with_reference(check: impl FnOnce(&Reference)) {
    static REFERENCE: Mutex<Option<Result<Reference, String>>> = Mutex::new(None);
    let mut slot = REFERENCE.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    match slot.get_or_insert_with(run_reference) {
        Ok(reference) => check(reference),
        Err(error) => panic!("{error}"),
    }
}

fn output<'a>(reference: &'a Reference, name: &str) -> &'a Tensor {
    reference.outputs.get(name).unwrap_or_else(|| panic!("the reference wrote no {name}"))
}

fn floats(tensor: &Tensor) -> Vec<f32> {
    Vec::<f32>::try_from(&tensor.reshape([-1])).expect("a float32 tensor")
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

/// Whether two float32 tensors hold the same bits (stricter than `Tensor::equal`, which counts -0
/// equal to +0 and NaN unequal to itself).
fn same_bits(rust: &Tensor, python: &Tensor) -> bool {
    (rust.kind(), rust.size()) == (python.kind(), python.size())
        && rust.view_dtype(Kind::Int).equal(&python.view_dtype(Kind::Int))
}

/// Asserts that two float32 tensors hold the same bits; reports the largest difference.
fn assert_bits_equal(what: &str, rust: &Tensor, python: &Tensor) {
    assert_eq!(
        (rust.kind(), rust.size()),
        (python.kind(), python.size()),
        "{what}: Rust's kind and shape against diffusers'"
    );
    if !same_bits(rust, python) {
        let differing = rust.view_dtype(Kind::Int).ne_tensor(&python.view_dtype(Kind::Int)).sum(Kind::Int64);
        let largest = (rust.to_kind(Kind::Double) - python.to_kind(Kind::Double)).abs().max();
        panic!(
            "{what}: {} of {} values differ from diffusers', the largest by {:e}",
            differing.int64_value(&[]),
            rust.numel(),
            largest.double_value(&[])
        );
    }
}

/// The step counts of `table_steps` whose sigmas, timesteps and `init_noise_sigma` built from
/// `config` differ from diffusers', each with what differs.
fn schedule_mismatches(reference: &Reference, config: &HeunConfig) -> Vec<String> {
    let mut mismatches = Vec::new();
    for n in table_steps() {
        let heun = Heun::new(config, n).unwrap_or_else(|e| panic!("{n} steps: {e}"));
        let mut differing = Vec::new();
        if !same_bits(heun.sigmas(), output(reference, &format!("n{n}.sigmas"))) {
            differing.push("sigmas");
        }
        if bits(heun.timesteps()) != bits(&floats(output(reference, &format!("n{n}.timesteps")))) {
            differing.push("timesteps");
        }
        if bits(&[heun.init_noise_sigma()]) != bits(&floats(output(reference, &format!("n{n}.init_noise_sigma")))) {
            differing.push("init_noise_sigma");
        }
        if !differing.is_empty() {
            mismatches.push(format!("{n} steps: {}", differing.join(", ")));
        }
    }
    mismatches
}

#[test]
fn the_rust_heun_schedule_equals_diffusers_bit_for_bit_for_every_step_count_checked() {
    with_reference(|reference| {
        // The table read back from the JSON is numpy's, bit for bit.
        assert_eq!(
            bits(&reference.config.log_sigmas),
            bits(&floats(output(reference, "log_sigmas"))),
            "the log_sigmas table read from the JSON against diffusers' own"
        );
        assert_eq!(reference.config, HeunConfig::shap_e_img2img(reference.config.log_sigmas.clone()));
        let mismatches = schedule_mismatches(reference, &reference.config);
        let counts = table_steps().len();
        eprintln!(
            "sigmas, timesteps and init_noise_sigma equal bit for bit for {} of {counts} step counts",
            counts - mismatches.len()
        );
        assert!(
            mismatches.is_empty(),
            "{} of {counts} step counts differ from diffusers:\n{}",
            mismatches.len(),
            mismatches.join("\n")
        );

        // Why the table is data: recomputed with glibc's logf, it differs from numpy's, and the
        // timesteps of many step counts move by an ulp. Measured and shown, not asserted (it
        // depends on numpy's SIMD dispatch on this CPU).
        let recomputed: Vec<f32> = floats(output(reference, "train_sigmas")).iter().map(|s| s.ln()).collect();
        let differing_entries =
            recomputed.iter().zip(&reference.config.log_sigmas).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        let with_logf = schedule_mismatches(reference, &HeunConfig::shap_e_img2img(recomputed));
        eprintln!(
            "with a table recomputed by glibc's logf ({differing_entries} of 1024 entries differ from numpy's), \
             {} of {counts} step counts would match",
            counts - with_logf.len()
        );
    });
}

#[test]
fn a_whole_rust_heun_run_equals_diffusers_run_bit_for_bit_call_by_call() {
    with_reference(|reference| {
        for n in RUN_STEPS {
            let mut heun = Heun::new(&reference.config, n).unwrap_or_else(|e| panic!("{n} steps: {e}"));
            assert_eq!(heun.model_calls(), 2 * n - 1);
            // As the pipeline's prepare_latents: the drawn latents times init_noise_sigma.
            let latents = output(reference, &format!("n{n}.latents"));
            let mut sample = latents * f64::from(heun.init_noise_sigma());
            assert_bits_equal(
                &format!("{n} steps: initial latents"),
                &sample,
                output(reference, &format!("n{n}.initial")),
            );
            for i in 0..heun.model_calls() {
                let at = format!("{n} steps, call {i} (t = {})", heun.timesteps()[i]);
                assert_eq!(heun.step_index(), i, "{at}: step index");
                let scaled = heun.scale_model_input(&sample, i).unwrap_or_else(|e| panic!("{at}: {e}"));
                assert_bits_equal(
                    &format!("{at}: scale_model_input"),
                    &scaled,
                    output(reference, &format!("n{n}.scaled.{i}")),
                );
                let model_output = output(reference, &format!("n{n}.model_output.{i}"));
                sample = heun.step(model_output, &sample).unwrap_or_else(|e| panic!("{at}: {e}"));
                assert_bits_equal(&format!("{at}: step"), &sample, output(reference, &format!("n{n}.prev.{i}")));
                let first_order = output(reference, &format!("n{n}.first_order.{i}")).int64_value(&[0]) == 1;
                match (heun.state(), first_order) {
                    (HeunState::FirstOrder, true) => {}
                    (HeunState::SecondOrder { derivative, dt, sample: stored }, false) => {
                        assert_bits_equal(
                            &format!("{at}: stored derivative"),
                            derivative,
                            output(reference, &format!("n{n}.derivative.{i}")),
                        );
                        assert_bits_equal(
                            &format!("{at}: stored dt"),
                            &dt.reshape([1]),
                            output(reference, &format!("n{n}.dt.{i}")),
                        );
                        assert_bits_equal(
                            &format!("{at}: stored sample"),
                            stored,
                            output(reference, &format!("n{n}.stored.{i}")),
                        );
                    }
                    (state, _) => {
                        panic!("{at}: Rust's state is {state:?}, diffusers' next step is first order: {first_order}")
                    }
                }
            }
            assert_eq!(heun.step(&sample, &sample).unwrap_err(), HeunError::Finished { calls: 2 * n - 1 });
        }
    });
}

#[test]
fn a_run_through_the_scheduler_trait_equals_diffusers_run_bit_for_bit_call_by_call() {
    with_reference(|reference| {
        for n in RUN_STEPS {
            let mut heun = Heun::new(&reference.config, n).unwrap_or_else(|e| panic!("{n} steps: {e}"));
            let timesteps = Scheduler::timesteps(&heun);
            assert_eq!(timesteps, heun.timesteps().iter().map(|&t| f64::from(t)).collect::<Vec<_>>());
            let latents = output(reference, &format!("n{n}.latents"));
            let mut sample = latents * Scheduler::init_noise_sigma(&heun);
            for (i, t) in timesteps.iter().enumerate() {
                let at = format!("{n} steps through the trait, call {i} (t = {t})");
                let scaled = Scheduler::scale_model_input(&heun, &sample, i).unwrap_or_else(|e| panic!("{at}: {e}"));
                assert_bits_equal(
                    &format!("{at}: scale_model_input"),
                    &scaled,
                    output(reference, &format!("n{n}.scaled.{i}")),
                );
                let model_output = output(reference, &format!("n{n}.model_output.{i}"));
                sample = Scheduler::step(&mut heun, model_output, &sample).unwrap_or_else(|e| panic!("{at}: {e}"));
                assert_bits_equal(&format!("{at}: step"), &sample, output(reference, &format!("n{n}.prev.{i}")));
            }
        }
    });
}

#[test]
fn bad_steps_tables_configurations_and_calls_are_typed_errors_naming_what_is_wrong() {
    with_reference(|reference| {
        let config = &reference.config;
        let zero = Heun::new(config, 0).unwrap_err();
        assert_eq!(zero, HeunError::InferenceSteps { steps: 0, train_steps: 1024 });
        assert!(zero.to_string().contains("inference_steps = 0"), "{zero}");
        assert_eq!(Heun::new(config, 1025).unwrap_err(), HeunError::InferenceSteps { steps: 1025, train_steps: 1024 });

        let short = HeunConfig::shap_e_img2img(config.log_sigmas[..1000].to_vec());
        let error = Heun::new(&short, 4).unwrap_err();
        assert_eq!(error, HeunError::TableLength { len: 1000, train_steps: 1024 });
        assert!(error.to_string().contains("1000 entries"), "{error}");

        let mut nan = config.clone();
        nan.log_sigmas[7] = f32::NAN;
        assert!(matches!(Heun::new(&nan, 4), Err(HeunError::NonFinite { index: 7, .. })));
        let mut infinite = config.clone();
        infinite.log_sigmas[0] = f32::NEG_INFINITY;
        assert!(matches!(Heun::new(&infinite, 4), Err(HeunError::NonFinite { index: 0, .. })));

        // A table of another schedule (shifted by a hundredth) is caught at its first entry.
        let mut other = config.clone();
        other.log_sigmas.iter_mut().for_each(|v| *v += 0.01);
        let error = Heun::new(&other, 4).unwrap_err();
        assert!(matches!(error, HeunError::TableMismatch { index: 0, .. }), "{error}");
        assert!(error.to_string().contains("another scheduler configuration"), "{error}");

        let mut clip = config.clone();
        clip.clip_sample_range = Some(f64::NAN);
        assert!(matches!(Heun::new(&clip, 4), Err(HeunError::ClipRange { .. })));

        // Calls out of the run, and tensors of different shapes.
        let mut heun = Heun::new(config, 2).expect("2 steps");
        let sample = Tensor::zeros([2, 3], (Kind::Float, tch::Device::Cpu));
        assert_eq!(heun.scale_model_input(&sample, 3).unwrap_err(), HeunError::CallIndex { index: 3, calls: 3 });
        let error = heun.step(&Tensor::zeros([3, 2], (Kind::Float, tch::Device::Cpu)), &sample).unwrap_err();
        assert_eq!(error, HeunError::Shape { what: "model_output", expected: vec![2, 3], found: vec![3, 2] });
        assert_eq!(heun.step_index(), 0, "a refused step leaves the run where it was");
        let _ = heun.step(&sample, &sample).expect("a first-order step");
        let other_shape = Tensor::zeros([6], (Kind::Float, tch::Device::Cpu));
        let error = heun.step(&other_shape, &other_shape).unwrap_err();
        assert!(matches!(error, HeunError::Shape { what: "the sample the first-order step stored", .. }), "{error}");
        assert!(matches!(heun.state(), HeunState::SecondOrder { .. }), "a refused step keeps the stored state");
        let _ = heun.step(&sample, &sample).expect("the second-order step");
        let _ = heun.step(&sample, &sample).expect("the last first-order step");
        assert_eq!(heun.step(&sample, &sample).unwrap_err(), HeunError::Finished { calls: 3 });

        // Configurations the port does not compute name their key.
        let table: Vec<String> = config.log_sigmas.iter().map(|v| v.to_string()).collect();
        let document = |scheduler: &str| {
            format!(
                r#"{{"format": "stageload heun scheduler 1", "scheduler_config": {{{scheduler}}}, "log_sigmas": [{}]}}"#,
                table.join(",")
            )
        };
        let published = r#""beta_schedule": "exp", "num_train_timesteps": 1024, "prediction_type": "sample", "use_karras_sigmas": true, "clip_sample": true, "clip_sample_range": 1.0"#;
        assert_eq!(HeunConfig::from_json(&document(published)).as_ref(), Ok(config));
        let linear = published.replace(r#""beta_schedule": "exp""#, r#""beta_schedule": "linear""#);
        let error = HeunConfig::from_json(&document(&linear)).unwrap_err();
        assert_eq!(error, HeunError::Config { key: "beta_schedule", found: "\"linear\"".into(), expected: "\"exp\"" });
        assert!(error.to_string().contains("beta_schedule is \"linear\""), "{error}");
        let epsilon = published.replace(r#""prediction_type": "sample""#, r#""prediction_type": "epsilon""#);
        assert!(matches!(
            HeunConfig::from_json(&document(&epsilon)),
            Err(HeunError::Config { key: "prediction_type", .. })
        ));
        let no_karras = published.replace(r#", "use_karras_sigmas": true"#, "");
        assert!(matches!(
            HeunConfig::from_json(&document(&no_karras)),
            Err(HeunError::Config { key: "use_karras_sigmas", .. })
        ));
        let leading = format!(r#"{published}, "timestep_spacing": "leading""#);
        assert!(matches!(
            HeunConfig::from_json(&document(&leading)),
            Err(HeunError::Config { key: "timestep_spacing", .. })
        ));
        assert!(matches!(HeunConfig::from_json("{not json"), Err(HeunError::Json { .. })));
        assert!(matches!(
            HeunConfig::from_json(r#"{"format": "something else"}"#),
            Err(HeunError::Config { key: "format", .. })
        ));
        let missing = std::path::Path::new("/nonexistent/scheduler.json");
        let error = HeunConfig::from_json_file(missing).unwrap_err();
        assert!(matches!(&error, HeunError::Read { path, .. } if path == "/nonexistent/scheduler.json"), "{error}");
    });
}
