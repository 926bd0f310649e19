//! The Rust DDIM scheduler (`crates/pipelines/src/schedulers/ddim.rs`) against diffusers' `DDIMScheduler`, run by the cached
//! Python environment (`scripts/reference/ddim_reference.py`): the schedule and every step equal
//! bit for bit, for 1, 4, 20 and 50 inference steps, one step at a time and chained. The Rust side
//! draws the noise predictions and samples from a seed and hands them to Python in a safetensors
//! file; both tests share one Python run. Without STAGELOAD_PYTHON (or without diffusers in it)
//! the tests fail and say what to run.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use rand::{Rng, SeedableRng};
use stageload_pipelines::schedulers::ddim::{Ddim, DdimConfig, DdimError};
use stageload_pipelines::schedulers::Scheduler;
use stageload_test_support::torch as support;
use tch::{Kind, Tensor};

const STEP_COUNTS: [i64; 4] = [1, 4, 20, 50];
const SHAPE: [i64; 4] = [1, 4, 8, 8];
const DEADLINE: Duration = Duration::from_secs(120);

/// Standard normal float32 values of `SHAPE` from the ChaCha generator (Box-Muller).
fn normal(rng: &mut rand_chacha::ChaCha8Rng) -> Tensor {
    let len = SHAPE.iter().product::<i64>() as usize;
    let values: Vec<f32> = (0..len)
        .map(|_| {
            let (u, v): (f64, f64) = (1.0 - rng.gen::<f64>(), rng.gen());
            ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
        })
        .collect();
    Tensor::from_slice(&values).reshape(SHAPE)
}

/// The inputs of every step of every step count, named as the reference script reads them.
fn inputs() -> HashMap<String, Tensor> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(15);
    let mut inputs = HashMap::from([("steps".to_string(), Tensor::from_slice(&STEP_COUNTS))]);
    for n in STEP_COUNTS {
        for i in 0..n {
            inputs.insert(format!("n{n}.noise.{i}"), normal(&mut rng));
            inputs.insert(format!("n{n}.sample.{i}"), normal(&mut rng));
        }
    }
    inputs
}

/// Runs the reference script on `inputs` within the deadline and reads what it wrote.
fn run_reference(inputs: &HashMap<String, Tensor>) -> Result<HashMap<String, Tensor>, String> {
    let folder = tempfile::TempDir::new().map_err(|e| format!("no temporary folder: {e}"))?;
    let (input, output) = (folder.path().join("inputs.safetensors"), folder.path().join("reference.safetensors"));
    let named: Vec<(&str, &Tensor)> = inputs.iter().map(|(name, tensor)| (name.as_str(), tensor)).collect();
    Tensor::write_safetensors(&named, &input).map_err(|e| format!("writing {}: {e}", input.display()))?;
    crate::reference::run(
        "ddim_reference.py",
        &[input.as_os_str(), output.as_os_str()],
        folder.path(),
        &output,
        DEADLINE,
    )
}

/// Runs `check` on the reference's outputs, failing with the reference's error if it has none.
/// The reference runs once for all the tests that need it (the inputs are drawn from a seed, so
/// every test draws the same ones).
fn with_reference(check: impl FnOnce(&HashMap<String, Tensor>)) {
    static REFERENCE: Mutex<Option<Result<HashMap<String, Tensor>, String>>> = Mutex::new(None);
    let mut slot = REFERENCE.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    match slot.get_or_insert_with(|| run_reference(&inputs())) {
        Ok(outputs) => check(outputs),
        Err(error) => panic!("{error}"),
    }
}

fn output<'a>(outputs: &'a HashMap<String, Tensor>, name: &str) -> &'a Tensor {
    outputs.get(name).unwrap_or_else(|| panic!("the reference wrote no {name}"))
}

/// Asserts that two float32 tensors hold the same bits (a stricter test than `Tensor::equal`,
/// which counts -0 equal to +0 and NaN unequal to itself); reports the largest difference.
fn assert_bits_equal(what: &str, rust: &Tensor, python: &Tensor) {
    assert_eq!(
        (rust.kind(), rust.size()),
        (python.kind(), python.size()),
        "{what}: Rust's kind and shape against diffusers'"
    );
    if !rust.view_dtype(Kind::Int).equal(&python.view_dtype(Kind::Int)) {
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

fn scheduler(n: i64) -> Ddim {
    Ddim::new(DdimConfig::stable_diffusion(), n).unwrap_or_else(|e| panic!("{n} steps: {e}"))
}

#[test]
fn the_rust_ddim_scheduler_equals_diffusers_bit_for_bit() {
    let _generator = support::generator();
    let inputs = inputs();
    with_reference(|outputs| {
        let ddim = scheduler(1);
        assert_bits_equal("alphas_cumprod", ddim.alphas_cumprod(), output(outputs, "alphas_cumprod"));
        assert_eq!(ddim.init_noise_sigma(), 1.0);
        for n in STEP_COUNTS {
            let ddim = scheduler(n);
            let timesteps = Vec::<i64>::try_from(output(outputs, &format!("n{n}.timesteps"))).unwrap();
            assert_eq!(ddim.timesteps(), timesteps.as_slice(), "{n} steps: timesteps");
            for (i, &t) in ddim.timesteps().iter().enumerate() {
                let (noise, sample) = (&inputs[&format!("n{n}.noise.{i}")], &inputs[&format!("n{n}.sample.{i}")]);
                let prev = ddim.step(noise, t, sample);
                assert_bits_equal(
                    &format!("{n} steps, step {i} (t = {t})"),
                    &prev,
                    output(outputs, &format!("n{n}.prev.{i}")),
                );
            }
        }
    });
}

#[test]
fn a_chained_rust_ddim_run_equals_diffusers_chained_run_bit_for_bit() {
    let _generator = support::generator();
    let inputs = inputs();
    with_reference(|outputs| {
        for n in STEP_COUNTS {
            let ddim = scheduler(n);
            let mut sample = inputs[&format!("n{n}.sample.0")].shallow_clone();
            for (i, &t) in ddim.timesteps().iter().enumerate() {
                sample = ddim.step(&inputs[&format!("n{n}.noise.{i}")], t, &sample);
                assert_bits_equal(
                    &format!("{n} steps chained, after step {i} (t = {t})"),
                    &sample,
                    output(outputs, &format!("n{n}.chained.{i}")),
                );
            }
        }
    });
}

#[test]
fn a_run_through_the_scheduler_trait_equals_diffusers_chained_run_and_stops_after_the_last_step() {
    let _generator = support::generator();
    let inputs = inputs();
    with_reference(|outputs| {
        for n in STEP_COUNTS {
            let mut ddim = scheduler(n);
            let timesteps: Vec<f64> = Ddim::timesteps(&ddim).iter().map(|&t| t as f64).collect();
            assert_eq!(Scheduler::timesteps(&ddim), timesteps, "{n} steps: the trait's timesteps");
            assert_eq!(Scheduler::init_noise_sigma(&ddim), 1.0);
            let mut sample = inputs[&format!("n{n}.sample.0")].shallow_clone();
            for i in 0..n as usize {
                let input = ddim.scale_model_input(&sample, i).unwrap();
                assert!(input.equal(&sample), "{n} steps, call {i}: DDIM's model input is the sample");
                sample = Scheduler::step(&mut ddim, &inputs[&format!("n{n}.noise.{i}")], &sample).unwrap();
                assert_bits_equal(
                    &format!("{n} steps through the trait, after step {i}"),
                    &sample,
                    output(outputs, &format!("n{n}.chained.{i}")),
                );
            }
            let past = Scheduler::step(&mut ddim, &sample, &sample).unwrap_err();
            assert_eq!(past, DdimError::Finished { steps: n });
        }
    });
}

#[test]
fn zero_or_too_many_steps_or_a_timestep_past_the_schedule_is_a_typed_error() {
    let _generator = support::generator();
    let config = DdimConfig::stable_diffusion();
    let zero = Ddim::new(config, 0).unwrap_err();
    assert_eq!(zero, DdimError::InferenceSteps { steps: 0, train_steps: 1000 });
    let message = zero.to_string();
    assert!(message.contains("inference_steps = 0") && message.contains("1..=1000"), "{message}");
    assert_eq!(Ddim::new(config, 1001).unwrap_err(), DdimError::InferenceSteps { steps: 1001, train_steps: 1000 });
    // 1000 leading steps from 0 plus steps_offset 1 end at 1000, past alphas_cumprod's last index
    // (diffusers fails there with an IndexError at the first step).
    let past = Ddim::new(config, 1000).unwrap_err();
    assert_eq!(past, DdimError::Timestep { timestep: 1000, steps: 1000, steps_offset: 1, train_steps: 1000 });
    assert!(past.to_string().contains("steps_offset = 1"), "{past}");
    assert_eq!(Ddim::new(config, 999).map(|ddim| ddim.timesteps()[0]), Ok(999));
    assert_eq!(Ddim::new(config, 50).unwrap().timesteps()[..3], [981, 961, 941]);
}
