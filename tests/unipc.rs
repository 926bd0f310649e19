//! The Rust UniPC scheduler (`crates/pipelines/src/schedulers/unipc.rs`) against diffusers'
//! `UniPCMultistepScheduler` as the Wan2.1 text-to-video pipeline configures it, run by the cached
//! Python environment (`scripts/reference/unipc_reference.py`): the configuration read from the
//! JSON diffusers writes, timesteps and sigmas equal bit for bit for every step count from 1 to 100
//! and a spread up to 1000 (480p's and 720p's flow shift, and `final_sigmas_type = "sigma_min"`),
//! and whole runs as `WanPipeline` makes them (every step's result, converted output, corrected
//! sample and order) with float32, bfloat16 and float16 model outputs, for the published
//! configuration and variants (720p, solver orders 1 and 3, no `lower_order_final` with
//! `"sigma_min"`, disabled correctors). The Python side draws the samples and model outputs from a
//! seeded generator and hands them to Rust with its results. All tests that need it share one
//! Python run; the bad-input tests need none. Without STAGELOAD_PYTHON (or without diffusers in it)
//! the reference tests fail and say what to run.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;

use serde_json::json;
use stageload_pipelines::schedulers::unipc::{FinalSigma, UniPc, UniPcConfig, UniPcError, FLOW_SHIFT_720P};
use stageload_pipelines::schedulers::Scheduler;
use tch::{Device, Kind, Tensor};

/// Every step count from 1 to 100, then a spread up to the training schedule's 1000.
fn table_steps() -> Vec<usize> {
    (1..=100).chain([101, 128, 200, 250, 256, 333, 500, 512, 640, 768, 999, 1000]).collect()
}

const SEED: u64 = 51;
/// Wan latents (batch, channels, frames, height, width), small.
const SHAPE: [i64; 5] = [2, 16, 2, 6, 8];
const DEADLINE: Duration = Duration::from_secs(120);
const RUN_STEPS: [usize; 6] = [1, 2, 3, 4, 10, 50];

/// The configurations the reference builds: a name, its overrides of the published configuration,
/// and the Rust configuration its JSON must read as.
fn configurations() -> Vec<(&'static str, serde_json::Value, UniPcConfig)> {
    let wan = UniPcConfig::wan2_1_t2v();
    vec![
        ("wan", json!({}), wan.clone()),
        ("wan720", json!({"flow_shift": FLOW_SHIFT_720P}), wan.clone().with_flow_shift(FLOW_SHIFT_720P)),
        ("order1", json!({"solver_order": 1}), UniPcConfig { solver_order: 1, ..wan.clone() }),
        ("order3", json!({"solver_order": 3}), UniPcConfig { solver_order: 3, ..wan.clone() }),
        (
            "sigma_min",
            json!({"final_sigmas_type": "sigma_min", "lower_order_final": false}),
            UniPcConfig { final_sigma: FinalSigma::SigmaMin, lower_order_final: false, ..wan.clone() },
        ),
        (
            "no_corrector",
            json!({"disable_corrector": [0, 2, 5]}),
            UniPcConfig { disable_corrector: vec![0, 2, 5], ..wan },
        ),
    ]
}

/// The configurations whose schedules are checked (the others share `wan`'s).
const TABLES: [&str; 3] = ["wan", "wan720", "sigma_min"];

/// The runs: configuration, kind of the model outputs, step counts.
fn runs() -> Vec<(&'static str, &'static str, Vec<usize>)> {
    vec![
        ("wan", "float32", RUN_STEPS.to_vec()),
        ("wan", "bfloat16", RUN_STEPS.to_vec()),
        ("wan", "float16", vec![3, 10]),
        ("wan720", "bfloat16", vec![4, 50]),
        ("order1", "float32", vec![1, 3, 10]),
        ("order3", "float32", vec![1, 2, 3, 4, 10, 25]),
        ("order3", "bfloat16", vec![10]),
        ("sigma_min", "float32", vec![2, 3, 10]),
        ("no_corrector", "bfloat16", vec![4, 10]),
    ]
}

/// What the reference wrote: its tensors and the configurations read from its JSON files.
struct Reference {
    outputs: HashMap<String, Tensor>,
    configs: HashMap<&'static str, Result<UniPcConfig, UniPcError>>,
    _folder: tempfile::TempDir,
}

/// Writes the reference's spec, runs it within the deadline and reads what it wrote.
fn run_reference() -> Result<Reference, String> {
    let folder = tempfile::TempDir::new().map_err(|e| format!("no temporary folder: {e}"))?;
    let spec = json!({
        "seed": SEED,
        "shape": SHAPE,
        "configs": configurations().into_iter().map(|(name, overrides, _)| (name, overrides)).collect::<HashMap<_, _>>(),
        "tables": TABLES.iter().map(|&name| (name, table_steps())).collect::<HashMap<_, _>>(),
        "runs": runs().into_iter().map(|(config, dtype, steps)| json!({"config": config, "dtype": dtype, "steps": steps})).collect::<Vec<_>>(),
    });
    let spec_path = folder.path().join("spec.json");
    std::fs::write(&spec_path, spec.to_string()).map_err(|e| format!("writing {}: {e}", spec_path.display()))?;
    let output = folder.path().join("reference.safetensors");
    let args = [spec_path.as_os_str(), folder.path().as_os_str()];
    let outputs = crate::reference::run("unipc_reference.py", &args, folder.path(), &output, DEADLINE)?;
    let configs = configurations()
        .into_iter()
        .map(|(name, _, _)| {
            (name, UniPcConfig::from_json_file(&folder.path().join(name).join("scheduler_config.json")))
        })
        .collect();
    Ok(Reference { outputs, configs, _folder: folder })
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

/// The configuration `name` as read from the JSON diffusers wrote for it.
fn config<'a>(reference: &'a Reference, name: &str) -> &'a UniPcConfig {
    match reference.configs.get(name) {
        Some(Ok(config)) => config,
        Some(Err(error)) => panic!("reading diffusers' {name} configuration: {error}"),
        None => panic!("no configuration {name}"),
    }
}

fn int64s(tensor: &Tensor) -> Vec<i64> {
    Vec::<i64>::try_from(&tensor.reshape([-1])).expect("an int64 tensor")
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

#[test]
fn the_configurations_diffusers_writes_read_as_the_published_wan_one_and_its_variants() {
    with_reference(|reference| {
        for (name, _, expected) in configurations() {
            assert_eq!(config(reference, name), &expected, "{name}: the JSON diffusers' save_config wrote");
        }
        assert_eq!(config(reference, "wan"), &UniPcConfig::wan2_1_t2v());
    });
}

#[test]
fn timesteps_and_sigmas_equal_diffusers_bit_for_bit_for_every_step_count_checked() {
    with_reference(|reference| {
        let mut mismatches = Vec::new();
        let mut checked = 0;
        for name in TABLES {
            for n in table_steps() {
                let unipc = UniPc::new(config(reference, name), n).unwrap_or_else(|e| panic!("{name}, {n} steps: {e}"));
                let mut differing = Vec::new();
                if unipc.timesteps() != int64s(output(reference, &format!("{name}.n{n}.timesteps"))) {
                    differing.push("timesteps");
                }
                let sigmas = output(reference, &format!("{name}.n{n}.sigmas"));
                if !same_bits(unipc.sigmas(), sigmas) {
                    differing.push("sigmas");
                }
                let values: Vec<u32> = unipc.sigma_values().iter().map(|v| v.to_bits()).collect();
                let python: Vec<u32> =
                    Vec::<f32>::try_from(sigmas).expect("float32 sigmas").iter().map(|v| v.to_bits()).collect();
                if values != python {
                    differing.push("sigma_values");
                }
                if !differing.is_empty() {
                    mismatches.push(format!("{name}, {n} steps: {}", differing.join(", ")));
                }
                checked += 1;
            }
        }
        eprintln!("timesteps and sigmas equal bit for bit for {} of {checked} schedules", checked - mismatches.len());
        assert!(
            mismatches.is_empty(),
            "{} of {checked} schedules differ from diffusers:\n{}",
            mismatches.len(),
            mismatches.join("\n")
        );
    });
}

/// Replays the reference's runs of `config_name` with model outputs of `dtype`: Rust steps from its
/// own previous result, and every step's result, converted output, corrected sample and state must
/// equal diffusers'.
fn check_runs(reference: &Reference, config_name: &str, dtype: &str) {
    let (_, _, steps) = runs()
        .into_iter()
        .find(|(name, kind, _)| *name == config_name && *kind == dtype)
        .unwrap_or_else(|| panic!("no run {config_name} {dtype}"));
    let expected_kind = match dtype {
        "float32" => Kind::Float,
        "bfloat16" => Kind::BFloat16,
        "float16" => Kind::Half,
        other => panic!("unknown dtype {other}"),
    };
    for n in steps {
        let prefix = format!("{config_name}.{dtype}.n{n}");
        let mut unipc = UniPc::new(config(reference, config_name), n).unwrap_or_else(|e| panic!("{prefix}: {e}"));
        let mut sample = output(reference, &format!("{prefix}.sample")).shallow_clone();
        for i in 0..n {
            let at = format!("{prefix}, step {i} (t = {})", unipc.timesteps()[i]);
            assert_eq!(unipc.step_index(), i, "{at}: step index");
            let model_output = output(reference, &format!("{prefix}.model_output.{i}"));
            assert_eq!(model_output.kind(), expected_kind, "{at}: the model output's kind");
            sample = unipc.step(model_output, &sample).unwrap_or_else(|e| panic!("{at}: {e}"));
            assert_bits_equal(&format!("{at}: step"), &sample, output(reference, &format!("{prefix}.prev.{i}")));
            let x0 = unipc.model_outputs().last().unwrap_or_else(|| panic!("{at}: no model output stored"));
            assert_bits_equal(&format!("{at}: converted output"), x0, output(reference, &format!("{prefix}.x0.{i}")));
            let last_sample = unipc.last_sample().unwrap_or_else(|| panic!("{at}: no last sample"));
            assert_bits_equal(
                &format!("{at}: corrected sample"),
                last_sample,
                output(reference, &format!("{prefix}.last_sample.{i}")),
            );
            let state = int64s(output(reference, &format!("{prefix}.state.{i}")));
            let rust_state = [unipc.this_order(), Some(unipc.lower_order_nums()), Some(unipc.step_index())]
                .map(|v| v.map(|v| i64::try_from(v).expect("a small count")));
            assert_eq!(
                rust_state.to_vec(),
                state.iter().map(|&v| Some(v)).collect::<Vec<_>>(),
                "{at}: this_order, lower_order_nums, step_index"
            );
        }
        assert_eq!(unipc.step(&sample, &sample).unwrap_err(), UniPcError::Finished { steps: n });
    }
}

#[test]
fn a_wan_run_through_the_scheduler_trait_equals_diffusers_bit_for_bit_step_by_step() {
    with_reference(|reference| {
        let (_, _, steps) = runs().into_iter().find(|(name, kind, _)| (*name, *kind) == ("wan", "float32")).unwrap();
        for n in steps {
            let prefix = format!("wan.float32.n{n}");
            let mut unipc = UniPc::new(config(reference, "wan"), n).unwrap_or_else(|e| panic!("{prefix}: {e}"));
            let timesteps = Scheduler::timesteps(&unipc);
            assert_eq!(timesteps, unipc.timesteps().iter().map(|&t| t as f64).collect::<Vec<_>>());
            assert_eq!(Scheduler::init_noise_sigma(&unipc), 1.0, "flow matching starts from unscaled noise");
            let mut sample = output(reference, &format!("{prefix}.sample")).shallow_clone();
            for i in 0..timesteps.len() {
                let at = format!("{prefix} through the trait, step {i}");
                let input = Scheduler::scale_model_input(&unipc, &sample, i).unwrap_or_else(|e| panic!("{at}: {e}"));
                assert!(input.equal(&sample), "{at}: UniPC's model input is the sample");
                let model_output = output(reference, &format!("{prefix}.model_output.{i}"));
                sample = Scheduler::step(&mut unipc, model_output, &sample).unwrap_or_else(|e| panic!("{at}: {e}"));
                assert_bits_equal(&format!("{at}: step"), &sample, output(reference, &format!("{prefix}.prev.{i}")));
            }
        }
    });
}

#[test]
fn whole_wan_runs_equal_diffusers_bit_for_bit_step_by_step_with_float32_bfloat16_and_float16_model_outputs() {
    with_reference(|reference| {
        check_runs(reference, "wan", "float32");
        check_runs(reference, "wan", "bfloat16");
        check_runs(reference, "wan", "float16");
        check_runs(reference, "wan720", "bfloat16");
    });
}

#[test]
fn runs_of_solver_orders_1_and_3_sigma_min_and_disabled_correctors_equal_diffusers_bit_for_bit() {
    with_reference(|reference| {
        check_runs(reference, "order1", "float32");
        check_runs(reference, "order3", "float32");
        check_runs(reference, "order3", "bfloat16");
        check_runs(reference, "sigma_min", "float32");
        check_runs(reference, "no_corrector", "bfloat16");
    });
}

fn zeros(shape: &[i64], kind: Kind) -> Tensor {
    Tensor::zeros(shape, (kind, Device::Cpu))
}

#[test]
fn zero_steps_and_more_steps_than_training_steps_are_refused_naming_the_range() {
    let config = UniPcConfig::wan2_1_t2v();
    let zero = UniPc::new(&config, 0).unwrap_err();
    assert_eq!(zero, UniPcError::InferenceSteps { steps: 0, train_steps: 1000 });
    assert!(zero.to_string().contains("1..=1000"), "{zero}");
    assert_eq!(UniPc::new(&config, 1001).unwrap_err(), UniPcError::InferenceSteps { steps: 1001, train_steps: 1000 });
    assert_eq!(UniPc::new(&config, 1000).expect("1000 steps").timesteps().len(), 1000);
}

#[test]
fn a_model_output_of_another_shape_than_the_sample_is_refused_and_the_run_stays_where_it_was() {
    let mut unipc = UniPc::new(&UniPcConfig::wan2_1_t2v(), 3).expect("3 steps");
    let sample = zeros(&SHAPE, Kind::Float);
    let error = unipc.step(&zeros(&[2, 16, 2, 6, 7], Kind::BFloat16), &sample).unwrap_err();
    assert!(
        matches!(&error, UniPcError::Shape { found, expected, .. } if found == &[2, 16, 2, 6, 7] && expected == &SHAPE),
        "{error}"
    );
    // A model output that would broadcast is refused too.
    assert!(matches!(unipc.step(&zeros(&[1, 16, 2, 6, 8], Kind::Float), &sample), Err(UniPcError::Shape { .. })));
    assert_eq!((unipc.step_index(), unipc.this_order(), unipc.model_outputs().len()), (0, None, 0));
    let _ = unipc.step(&zeros(&SHAPE, Kind::BFloat16), &sample).expect("a first step");
    assert_eq!(unipc.step_index(), 1);
}

#[test]
fn a_sample_that_is_not_float32_is_refused() {
    let mut unipc = UniPc::new(&UniPcConfig::wan2_1_t2v(), 3).expect("3 steps");
    for kind in [Kind::BFloat16, Kind::Double, Kind::Half] {
        let error = unipc.step(&zeros(&SHAPE, Kind::Float), &zeros(&SHAPE, kind)).unwrap_err();
        assert_eq!(error, UniPcError::SampleKind { found: kind });
        assert!(error.to_string().contains("float32"), "{error}");
    }
    assert_eq!(unipc.step_index(), 0);
}

#[test]
fn a_model_output_that_is_not_float32_bfloat16_or_float16_is_refused() {
    let mut unipc = UniPc::new(&UniPcConfig::wan2_1_t2v(), 3).expect("3 steps");
    let sample = zeros(&SHAPE, Kind::Float);
    for kind in [Kind::Int64, Kind::Double, Kind::Bool] {
        assert_eq!(unipc.step(&zeros(&SHAPE, kind), &sample).unwrap_err(), UniPcError::ModelOutputKind { found: kind });
    }
}

#[test]
fn a_sample_without_batch_and_channel_dimensions_is_refused() {
    let mut unipc = UniPc::new(&UniPcConfig::wan2_1_t2v(), 3).expect("3 steps");
    let flat = zeros(&[16], Kind::Float);
    assert_eq!(unipc.step(&flat, &flat).unwrap_err(), UniPcError::SampleDims { found: vec![16] });
    // Two dimensions are enough: a whole run of [batch, channels] samples.
    let small = zeros(&[2, 3], Kind::Float);
    for _ in 0..3 {
        let _ = unipc.step(&small, &small).expect("a step of a two-dimensional sample");
    }
}

#[test]
fn a_sample_of_another_shape_than_the_runs_earlier_ones_is_refused() {
    let mut unipc = UniPc::new(&UniPcConfig::wan2_1_t2v(), 4).expect("4 steps");
    let sample = zeros(&SHAPE, Kind::Float);
    let _ = unipc.step(&sample, &sample).expect("a first step");
    let other = zeros(&[1, 16, 2, 6, 8], Kind::Float);
    let error = unipc.step(&other, &other).unwrap_err();
    assert!(matches!(error, UniPcError::Shape { what: "the sample against the run's earlier samples", .. }), "{error}");
    assert_eq!((unipc.step_index(), unipc.this_order()), (1, Some(1)), "a refused step leaves the run where it was");
    let _ = unipc.step(&sample, &sample).expect("the second step");
}

#[test]
fn stepping_past_the_last_step_is_refused() {
    let mut unipc = UniPc::new(&UniPcConfig::wan2_1_t2v(), 2).expect("2 steps");
    let sample = zeros(&SHAPE, Kind::Float);
    let _ = unipc.step(&sample, &sample).expect("step 0");
    let _ = unipc.step(&sample, &sample).expect("step 1");
    let error = unipc.step(&sample, &sample).unwrap_err();
    assert_eq!(error, UniPcError::Finished { steps: 2 });
    assert!(error.to_string().contains("build a new scheduler"), "{error}");
}

/// The published `scheduler/scheduler_config.json` of Wan-AI/Wan2.1-T2V-1.3B-Diffusers (these keys
/// and values, serialized as diffusers does, make the 751 bytes Hugging Face lists for the file;
/// `_diffusers_version` is not read) with `replace` applied: a key with a value replaces or adds
/// it, a key with `None` removes it.
fn published(replace: &[(&str, Option<&str>)]) -> String {
    let mut pairs = vec![
        ("_class_name", "\"UniPCMultistepScheduler\""),
        ("_diffusers_version", "\"0.33.0.dev0\""),
        ("beta_end", "0.02"),
        ("beta_schedule", "\"linear\""),
        ("beta_start", "0.0001"),
        ("disable_corrector", "[]"),
        ("dynamic_thresholding_ratio", "0.995"),
        ("final_sigmas_type", "\"zero\""),
        ("flow_shift", "3.0"),
        ("lower_order_final", "true"),
        ("num_train_timesteps", "1000"),
        ("predict_x0", "true"),
        ("prediction_type", "\"flow_prediction\""),
        ("rescale_betas_zero_snr", "false"),
        ("sample_max_value", "1.0"),
        ("solver_order", "2"),
        ("solver_p", "null"),
        ("solver_type", "\"bh2\""),
        ("steps_offset", "0"),
        ("thresholding", "false"),
        ("timestep_spacing", "\"linspace\""),
        ("trained_betas", "null"),
        ("use_beta_sigmas", "false"),
        ("use_exponential_sigmas", "false"),
        ("use_flow_sigmas", "true"),
        ("use_karras_sigmas", "false"),
    ];
    for &(key, value) in replace {
        pairs.retain(|(k, _)| *k != key);
        if let Some(value) = value {
            pairs.push((key, value));
        }
    }
    let body: Vec<String> = pairs.iter().map(|(k, v)| format!("\"{k}\": {v}")).collect();
    format!("{{{}}}", body.join(", "))
}

#[test]
fn configurations_this_port_does_not_compute_are_refused_naming_the_key() {
    assert_eq!(UniPcConfig::from_json(&published(&[])), Ok(UniPcConfig::wan2_1_t2v()));
    assert_eq!(
        UniPcConfig::from_json(&published(&[("flow_shift", Some("5.0"))])),
        Ok(UniPcConfig::wan2_1_t2v().with_flow_shift(5.0))
    );
    // diffusers builds "midpoint" as "bh2"; an absent key takes diffusers' default.
    assert_eq!(
        UniPcConfig::from_json(&published(&[("solver_type", Some("\"midpoint\""))])),
        Ok(UniPcConfig::wan2_1_t2v())
    );
    assert_eq!(
        UniPcConfig::from_json(&published(&[("flow_shift", None), ("lower_order_final", None)])),
        Ok(UniPcConfig::wan2_1_t2v().with_flow_shift(1.0))
    );

    let refused = |replace: &[(&str, Option<&str>)], key: &str| {
        let error = UniPcConfig::from_json(&published(replace)).unwrap_err();
        assert!(matches!(&error, UniPcError::Config { key: k, .. } if *k == key), "{replace:?}: {error}");
        assert!(error.to_string().contains(key), "{error}");
    };
    refused(&[("prediction_type", Some("\"epsilon\""))], "prediction_type");
    refused(&[("prediction_type", None)], "prediction_type");
    refused(&[("use_flow_sigmas", None)], "use_flow_sigmas");
    refused(&[("use_flow_sigmas", Some("false"))], "use_flow_sigmas");
    refused(&[("predict_x0", Some("false"))], "predict_x0");
    refused(&[("thresholding", Some("true"))], "thresholding");
    refused(&[("solver_type", Some("\"bh1\""))], "solver_type");
    refused(&[("use_karras_sigmas", Some("true"))], "use_karras_sigmas");
    refused(&[("use_exponential_sigmas", Some("true"))], "use_exponential_sigmas");
    refused(&[("use_beta_sigmas", Some("true"))], "use_beta_sigmas");
    refused(&[("use_dynamic_shifting", Some("true"))], "use_dynamic_shifting");
    refused(&[("shift_terminal", Some("0.1"))], "shift_terminal");
    refused(&[("solver_p", Some("{}"))], "solver_p");
    refused(&[("final_sigmas_type", Some("\"sigma_max\""))], "final_sigmas_type");
    refused(&[("timestep_spacing", Some("\"karras\""))], "timestep_spacing");
    refused(&[("_class_name", Some("\"FlowMatchEulerDiscreteScheduler\""))], "_class_name");
    refused(&[("num_train_timesteps", Some("-5"))], "num_train_timesteps");
    refused(&[("disable_corrector", Some("[1, -1]"))], "disable_corrector");
    refused(&[("flow_shift", Some("\"3\""))], "flow_shift");

    let order = |order: &str| UniPcConfig::from_json(&published(&[("solver_order", Some(order))]));
    assert_eq!(order("4"), Err(UniPcError::SolverOrder { order: 4 }));
    assert_eq!(order("0"), Err(UniPcError::SolverOrder { order: 0 }));
    assert_eq!(order("3").map(|c| c.solver_order), Ok(3));
    let shift = |shift: f64| UniPc::new(&UniPcConfig::wan2_1_t2v().with_flow_shift(shift), 10).unwrap_err();
    assert!(matches!(shift(0.0), UniPcError::FlowShift { .. }));
    assert!(matches!(shift(-3.0), UniPcError::FlowShift { .. }));
    assert!(matches!(shift(f64::NAN), UniPcError::FlowShift { .. }));
    assert!(matches!(shift(f64::INFINITY), UniPcError::FlowShift { .. }));
    let no_training = UniPcConfig { train_steps: 0, ..UniPcConfig::wan2_1_t2v() };
    assert_eq!(UniPc::new(&no_training, 1).unwrap_err(), UniPcError::TrainSteps { train_steps: 0 });

    assert!(matches!(UniPcConfig::from_json("{not json"), Err(UniPcError::Json { .. })));
    assert!(matches!(UniPcConfig::from_json("[1, 2]"), Err(UniPcError::Config { .. })));
    let missing = Path::new("/nonexistent/scheduler_config.json");
    let error = UniPcConfig::from_json_file(missing).unwrap_err();
    assert!(matches!(&error, UniPcError::Read { path, .. } if path == "/nonexistent/scheduler_config.json"), "{error}");
}
