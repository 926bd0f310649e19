//! Heun's second-order sampler (Karras et al., 2022) over tch tensors, equal bit for bit on the CPU
//! in float32 to diffusers' `HeunDiscreteScheduler` (0.42.1) as `ShapEImg2ImgPipeline` configures
//! it: `beta_schedule = "exp"` over 1024 training steps, Karras sigmas (rho 7), `"linspace"`
//! timestep spacing, `prediction_type = "sample"`, the prediction clipped to ±1. This file owns
//! the schedule (sigmas, the fractional timesteps the prior sees, `init_noise_sigma`), the input
//! scaling and the step with its state between model calls; `tests/heun.rs` checks all of them
//! against diffusers (`scripts/reference/heun_reference.py`).
//!
//! A run of `n` inference steps makes `2n - 1` model calls. Steps alternate: a first-order (Euler)
//! step stores its derivative, its `dt` and the sample it started from; the second-order step that
//! follows averages the two derivatives and steps from the stored sample. The last call is a
//! first-order step to sigma 0.
//!
//! # Where the numbers come from
//!
//! Bit-exactness needs each number computed by the same arithmetic as diffusers':
//!
//! - **Python floats stay `f64`** and go through the same libm functions as CPython's `math`
//!   module (glibc's `exp`, `pow`, `log`): the betas of the `"exp"` schedule, the Karras ramp and
//!   its `** (1 / rho)` and `** rho`, `_sigma_to_t`'s interpolation. numpy computes the Karras
//!   power and `_sigma_to_t`'s log in float64 with its own code; for every step count the tests
//!   check (1 to 128 and a spread up to 1024), the results equal glibc's after rounding to
//!   float32.
//! - **What diffusers computes on torch tensors is computed here by the same libtorch ops** on
//!   float32 tensors: `1 - betas`, `cumprod`, `((1 - a) / a) ** 0.5` (libtorch's CPU square root is
//!   not the correctly rounded one: an exact square root differs by an ulp on about a fifth of
//!   values), `scale_model_input`'s `(sigma ** 2 + 1) ** 0.5`, and every op of the step on 0-d
//!   sigma tensors.
//! - **The `log_sigmas` table is data, never recomputed.** diffusers builds it as `np.log` of a
//!   float32 array, and numpy's own SIMD float32 log differs from glibc's `logf` in the last bit at
//!   92 of the 1,024 entries (and `torch.log` at 48); the timesteps are interpolated in that table,
//!   so a recomputed one moves them by an ulp for most step counts (`tests/heun.rs` measures it:
//!   with glibc's `logf` table, 19 of the 141 step counts it checks keep all their timesteps).
//!   numpy's log also depends on its CPU dispatch (a baseline-SSE numpy computes another table),
//!   so the table pins the timesteps to those of the exporting machine's diffusers. It comes with
//!   the configuration from the Python side (`scripts/reference/shap_e_scheduler.py` writes both as
//!   JSON; [`HeunConfig::from_json_file`] reads them). [`Heun::new`] only checks it against the
//!   sigmas it computes (every entry within 4 float32 ulps of the exact log), so that a table of
//!   another schedule is an error rather than wrong timesteps.

use std::path::Path;

use serde_json::Value;
use tch::{Kind, Tensor};

/// The `format` of the JSON document `scripts/reference/shap_e_scheduler.py` writes.
pub const CONFIG_FORMAT: &str = "stageload heun scheduler 1";

/// Karras et al.'s rho, fixed in diffusers' `_convert_to_karras`.
const RHO: f64 = 7.0;

/// Ulps of float32 a `log_sigmas` entry may be from the exact log of the sigma it belongs to.
const TABLE_ULPS: f64 = 4.0;

/// The scheduler's configuration: the fields of diffusers' `HeunDiscreteScheduler` config this port
/// reads, and the `log_sigmas` table diffusers computes from them with numpy. The rest is fixed as
/// `ShapEImg2ImgPipeline` sets it: `beta_schedule = "exp"`, `prediction_type = "sample"`,
/// `use_karras_sigmas = true`, `timestep_spacing = "linspace"`, no trained betas.
#[derive(Debug, Clone, PartialEq)]
pub struct HeunConfig {
    /// `num_train_timesteps`: the length of the training noise schedule.
    pub train_steps: usize,
    /// `clip_sample_range` when `clip_sample` is true: the predicted sample is clamped to
    /// `-range..=range`. `None` when `clip_sample` is false.
    pub clip_sample_range: Option<f64>,
    /// `np.log` of the training schedule's float32 sigmas, as numpy computes it: `train_steps`
    /// float32 values, exported by the Python side (see the module documentation).
    pub log_sigmas: Vec<f32>,
}

impl HeunConfig {
    /// `ShapEImg2ImgPipeline`'s scheduler (openai/shap-e-img2img's `scheduler_config.json`: 1024
    /// training steps, `clip_sample = true` with range 1.0) with its exported `log_sigmas` table.
    pub fn shap_e_img2img(log_sigmas: Vec<f32>) -> Self {
        HeunConfig { train_steps: 1024, clip_sample_range: Some(1.0), log_sigmas }
    }

    /// Reads the JSON document `scripts/reference/shap_e_scheduler.py` writes: `format`, the
    /// scheduler's diffusers configuration under `scheduler_config` and the table under
    /// `log_sigmas`. A configuration this port does not compute (another beta schedule, another
    /// prediction type, no Karras sigmas, ...) is an error naming the key.
    pub fn from_json(text: &str) -> Result<Self, HeunError> {
        let document: Value = serde_json::from_str(text).map_err(|e| HeunError::Json { error: e.to_string() })?;
        let format = document.get("format").and_then(Value::as_str);
        if format != Some(CONFIG_FORMAT) {
            return Err(HeunError::Config {
                key: "format",
                found: shown(document.get("format")),
                expected: CONFIG_FORMAT,
            });
        }
        let config = document.get("scheduler_config").and_then(Value::as_object).ok_or(HeunError::Config {
            key: "scheduler_config",
            found: shown(document.get("scheduler_config")),
            expected: "an object: diffusers' scheduler configuration",
        })?;
        let get = |key: &'static str| config.get(key).filter(|value| !value.is_null());
        // Keys whose value must be what this port computes; `None` accepts an absent key (diffusers'
        // default is then the value).
        let fixed: [(&'static str, Option<Value>, &'static str); 7] = [
            ("beta_schedule", None, "\"exp\""),
            ("prediction_type", None, "\"sample\""),
            ("use_karras_sigmas", None, "true"),
            ("use_exponential_sigmas", Some(Value::Bool(false)), "false"),
            ("use_beta_sigmas", Some(Value::Bool(false)), "false"),
            ("timestep_spacing", Some(Value::from("linspace")), "\"linspace\""),
            ("trained_betas", Some(Value::Null), "null"),
        ];
        for (key, default, expected) in fixed {
            let found = config.get(key).cloned().or(default);
            if found.as_ref().map(Value::to_string).as_deref() != Some(expected) {
                return Err(HeunError::Config { key, found: shown(found.as_ref()), expected });
            }
        }
        let train_steps = get("num_train_timesteps")
            .and_then(Value::as_u64)
            .and_then(|steps| usize::try_from(steps).ok())
            .ok_or(HeunError::Config {
                key: "num_train_timesteps",
                found: shown(config.get("num_train_timesteps")),
                expected: "a positive integer",
            })?;
        let clip_sample = match get("clip_sample") {
            None => false, // diffusers' default
            Some(value) => value.as_bool().ok_or(HeunError::Config {
                key: "clip_sample",
                found: value.to_string(),
                expected: "true or false",
            })?,
        };
        let clip_sample_range = match get("clip_sample_range") {
            None => 1.0, // diffusers' default
            Some(value) => value.as_f64().ok_or(HeunError::Config {
                key: "clip_sample_range",
                found: value.to_string(),
                expected: "a number",
            })?,
        };
        let table = document.get("log_sigmas").and_then(Value::as_array).ok_or(HeunError::Config {
            key: "log_sigmas",
            found: shown(document.get("log_sigmas")),
            expected: "an array of numbers",
        })?;
        // Each entry is a float32 value written as the shortest decimal of its double; reading it
        // back to within an ulp of that double and rounding to float32 gives the value again.
        let log_sigmas =
            table.iter().map(|value| value.as_f64().map(|v| v as f32)).collect::<Option<Vec<f32>>>().ok_or(
                HeunError::Config {
                    key: "log_sigmas",
                    found: "an array with an entry that is not a number".to_string(),
                    expected: "an array of numbers",
                },
            )?;
        Ok(HeunConfig { train_steps, clip_sample_range: clip_sample.then_some(clip_sample_range), log_sigmas })
    }

    /// [`HeunConfig::from_json`] of the file at `path`.
    pub fn from_json_file(path: &Path) -> Result<Self, HeunError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| HeunError::Read { path: path.display().to_string(), error: e.to_string() })?;
        HeunConfig::from_json(&text).map_err(|error| match error {
            HeunError::Json { error } => HeunError::Json { error: format!("{}: {error}", path.display()) },
            other => other,
        })
    }
}

/// A JSON value as an error shows it.
fn shown(value: Option<&Value>) -> String {
    value.map_or_else(|| "nothing".to_string(), Value::to_string)
}

/// Why a scheduler could not be built or a call could not be made.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum HeunError {
    /// `inference_steps` is not in `1..=train_steps`.
    #[error(
        "inference_steps = {steps} is out of range: Heun runs at least 1 and at most train_steps = {train_steps} steps; pass a step count in 1..={train_steps}"
    )]
    InferenceSteps {
        /// The inference steps asked for.
        steps: usize,
        /// The training schedule's steps.
        train_steps: usize,
    },
    /// `train_steps` is below 2: `_sigma_to_t` interpolates between two neighbouring entries.
    #[error("train_steps = {train_steps}: the schedule needs at least 2 training steps")]
    TrainSteps {
        /// The training schedule's steps.
        train_steps: usize,
    },
    /// The `log_sigmas` table does not have one entry per training step.
    #[error(
        "the log_sigmas table has {len} entries, but the schedule has train_steps = {train_steps}; export the table of this configuration (scripts/reference/shap_e_scheduler.py)"
    )]
    TableLength {
        /// The table's entries.
        len: usize,
        /// The training schedule's steps.
        train_steps: usize,
    },
    /// An entry of the `log_sigmas` table is NaN or infinite.
    #[error(
        "log_sigmas[{index}] = {value} is not finite; export the table again (scripts/reference/shap_e_scheduler.py)"
    )]
    NonFinite {
        /// The entry's index.
        index: usize,
        /// Its value.
        value: f32,
    },
    /// An entry of the `log_sigmas` table is not the log of this schedule's sigma: the table
    /// belongs to another configuration.
    #[error(
        "log_sigmas[{index}] = {table} is not the log of this schedule's sigma there ({computed}): the table belongs to another scheduler configuration; export the table of this one (scripts/reference/shap_e_scheduler.py)"
    )]
    TableMismatch {
        /// The entry's index.
        index: usize,
        /// The table's value.
        table: f32,
        /// The exact log of the sigma computed here.
        computed: f64,
    },
    /// `clip_sample_range` is not a positive finite number.
    #[error("clip_sample_range = {range}: clipping needs a positive finite range")]
    ClipRange {
        /// The range.
        range: f64,
    },
    /// A configuration key holds a value this port does not compute.
    #[error("scheduler configuration: {key} is {found}, but this Heun port supports only {expected}")]
    Config {
        /// The key.
        key: &'static str,
        /// What the configuration holds there.
        found: String,
        /// What the port supports.
        expected: &'static str,
    },
    /// The configuration is not JSON.
    #[error("the scheduler configuration is not valid JSON: {error}")]
    Json {
        /// The parser's message.
        error: String,
    },
    /// The configuration file cannot be read.
    #[error(
        "cannot read the scheduler configuration {path}: {error}; write it with scripts/reference/shap_e_scheduler.py"
    )]
    Read {
        /// The file.
        path: String,
        /// The system's message.
        error: String,
    },
    /// A model call's index past the run's `2n - 1` calls.
    #[error("model call {index} is past the run's {calls} calls (2 * inference_steps - 1)")]
    CallIndex {
        /// The index asked for.
        index: usize,
        /// The run's model calls.
        calls: usize,
    },
    /// [`Heun::step`] after the run's last call.
    #[error("the run's {calls} steps are all taken; build a new scheduler for another run")]
    Finished {
        /// The run's model calls.
        calls: usize,
    },
    /// Tensors a step combines do not have one shape.
    #[error("{what}: shape {found:?} against the sample's {expected:?}")]
    Shape {
        /// Which tensor.
        what: &'static str,
        /// The sample's shape.
        expected: Vec<i64>,
        /// Its shape.
        found: Vec<i64>,
    },
    /// libtorch refused an operation (tensors on different devices, an unsupported kind).
    #[error("libtorch: {error}")]
    Torch {
        /// libtorch's message.
        error: String,
    },
}

impl From<tch::TchError> for HeunError {
    fn from(error: tch::TchError) -> Self {
        HeunError::Torch { error: error.to_string() }
    }
}

/// Where a run stands between model calls: diffusers' `state_in_first_order` and what a
/// first-order step stores for the second-order step after it.
#[derive(Debug)]
pub enum HeunState<'a> {
    /// The next step is first order (nothing stored).
    FirstOrder,
    /// The next step is second order, from what the first-order step stored.
    SecondOrder {
        /// The first-order step's derivative (`prev_derivative`).
        derivative: &'a Tensor,
        /// Its step in sigma, `sigma_next - sigma` (`dt`, a 0-d float32 tensor).
        dt: &'a Tensor,
        /// The sample it started from (`sample`).
        sample: &'a Tensor,
    },
}

/// What a first-order step stores.
#[derive(Debug)]
struct FirstOrderStep {
    derivative: Tensor,
    dt: Tensor,
    sample: Tensor,
}

/// A Heun scheduler set to a number of inference steps (diffusers' `HeunDiscreteScheduler` after
/// `set_timesteps`), with the state of one run. Its sigmas live on the CPU as diffusers keeps
/// them; [`Heun::step`] takes samples on any device (0-d CPU tensors combine with any).
#[derive(Debug)]
pub struct Heun {
    inference_steps: usize,
    clip_sample_range: Option<f64>,
    sigmas: Tensor,
    sigma_values: Vec<f32>,
    timesteps: Vec<f32>,
    init_noise_sigma: f32,
    step_index: usize,
    stored: Option<FirstOrderStep>,
}

impl Heun {
    /// The scheduler for `config`, set to `inference_steps` steps (`2 * inference_steps - 1`
    /// model calls), at the start of a run. The step count is limited to `1..=train_steps`
    /// (diffusers accepts more). As in diffusers, one step is a quirk: `np.linspace(0, 1023, 1)`
    /// is `[0]`, so the single call runs at the *smallest* training sigma (about 0.109 for
    /// Shap-E), which is then also `init_noise_sigma`.
    pub fn new(config: &HeunConfig, inference_steps: usize) -> Result<Self, HeunError> {
        let train_steps = config.train_steps;
        if train_steps < 2 {
            return Err(HeunError::TrainSteps { train_steps });
        }
        if !(1..=train_steps).contains(&inference_steps) {
            return Err(HeunError::InferenceSteps { steps: inference_steps, train_steps });
        }
        if config.log_sigmas.len() != train_steps {
            return Err(HeunError::TableLength { len: config.log_sigmas.len(), train_steps });
        }
        if let Some((index, &value)) = config.log_sigmas.iter().enumerate().find(|(_, v)| !v.is_finite()) {
            return Err(HeunError::NonFinite { index, value });
        }
        if let Some(range) = config.clip_sample_range.filter(|r| !(r.is_finite() && *r > 0.0)) {
            return Err(HeunError::ClipRange { range });
        }

        let train_sigmas = train_sigmas(train_steps)?;
        for (index, (&table, &sigma)) in config.log_sigmas.iter().zip(&train_sigmas).enumerate() {
            let computed = f64::from(sigma).ln();
            // False for a NaN too (the log of a negative sigma, or an infinite one's ulp).
            let within = (f64::from(table) - computed).abs() <= TABLE_ULPS * ulp(computed);
            if !within {
                return Err(HeunError::TableMismatch { index, table, computed });
            }
        }
        let log_sigmas: Vec<f64> = config.log_sigmas.iter().map(|&v| f64::from(v)).collect();

        // set_timesteps, "linspace": np.linspace(0, train_steps - 1, n, float32)[::-1], then the
        // sigmas np.interp'd at those timesteps. Karras reads only the two ends of that: the first
        // (sigma_max) is the train sigma at train_steps - 1 (at 0 when n = 1, where linspace is
        // [0]), the last (sigma_min) the train sigma at 0; np.interp at an integer returns the
        // table's value there exactly.
        let sigma_max = f64::from(train_sigmas[if inference_steps > 1 { train_steps - 1 } else { 0 }]);
        let sigma_min = f64::from(train_sigmas[0]);

        // _convert_to_karras: ramp = np.linspace(0, 1, n) (i * (1 / (n - 1)), the last set to 1);
        // the exponents go through black_box so that LLVM keeps libm's pow.
        let inverse_rho = std::hint::black_box(1.0 / RHO);
        let (min_inv_rho, max_inv_rho) = (sigma_min.powf(inverse_rho), sigma_max.powf(inverse_rho));
        let step = if inference_steps > 1 { 1.0 / (inference_steps - 1) as f64 } else { f64::NAN };
        let rho = std::hint::black_box(RHO);
        let karras: Vec<f64> = (0..inference_steps)
            .map(|i| {
                let ramp = match i {
                    0 => 0.0,
                    i if i == inference_steps - 1 => 1.0,
                    i => i as f64 * step,
                };
                (max_inv_rho + ramp * (min_inv_rho - max_inv_rho)).powf(rho)
            })
            .collect();
        let timesteps: Vec<f32> =
            karras.iter().map(|&sigma| sigma_to_t(sigma, &config.log_sigmas, &log_sigmas) as f32).collect();

        // sigmas: the Karras sigmas and a final 0 as float32, every inner one twice; timesteps:
        // every one after the first twice.
        let last = karras.len() - 1;
        let mut sigma_values = Vec::with_capacity(2 * inference_steps);
        sigma_values.push(karras[0] as f32);
        for &sigma in &karras[1..] {
            sigma_values.extend([sigma as f32, sigma as f32]);
        }
        sigma_values.push(0.0);
        debug_assert_eq!(sigma_values.len(), 2 * last + 2);
        let mut doubled = Vec::with_capacity(2 * inference_steps - 1);
        doubled.push(timesteps[0]);
        for &t in &timesteps[1..] {
            doubled.extend([t, t]);
        }
        // init_noise_sigma, "linspace": sigmas.max().
        let init_noise_sigma = sigma_values.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        Ok(Heun {
            inference_steps,
            clip_sample_range: config.clip_sample_range,
            sigmas: Tensor::from_slice(&sigma_values),
            sigma_values,
            timesteps: doubled,
            init_noise_sigma,
            step_index: 0,
            stored: None,
        })
    }

    /// The inference steps the scheduler is set to.
    pub fn inference_steps(&self) -> usize {
        self.inference_steps
    }

    /// The run's model calls: `2 * inference_steps - 1`.
    pub fn model_calls(&self) -> usize {
        self.timesteps.len()
    }

    /// The timestep of every model call, descending (diffusers' `scheduler.timesteps`): fractional
    /// float32 values, every one after the first twice.
    pub fn timesteps(&self) -> &[f32] {
        &self.timesteps
    }

    /// The sigmas (diffusers' `scheduler.sigmas`): `2 * inference_steps` float32 values on the CPU,
    /// every inner one twice, ending in 0.
    pub fn sigmas(&self) -> &Tensor {
        &self.sigmas
    }

    /// The standard deviation of the initial noise: the largest sigma. The pipeline multiplies its
    /// starting latents by it.
    pub fn init_noise_sigma(&self) -> f32 {
        self.init_noise_sigma
    }

    /// The index of the next model call (diffusers' `step_index`; 0 before the first step).
    pub fn step_index(&self) -> usize {
        self.step_index
    }

    /// Where the run stands: whether the next step is first or second order, and what the last
    /// first-order step stored.
    pub fn state(&self) -> HeunState<'_> {
        match &self.stored {
            None => HeunState::FirstOrder,
            Some(stored) => {
                HeunState::SecondOrder { derivative: &stored.derivative, dt: &stored.dt, sample: &stored.sample }
            }
        }
    }

    /// The model's input at model call `call_index`: `sample / sqrt(sigma² + 1)` (diffusers'
    /// `scale_model_input`, whose sigma is that of the call's index).
    pub fn scale_model_input(&self, sample: &Tensor, call_index: usize) -> Result<Tensor, HeunError> {
        let calls = self.model_calls();
        if call_index >= calls {
            return Err(HeunError::CallIndex { index: call_index, calls });
        }
        let sigma = self.sigma(call_index)?;
        let scale = sigma.f_pow_tensor_scalar(2i64)?.f_add_scalar(1i64)?.f_pow_tensor_scalar(0.5)?;
        Ok(sample.f_div(&scale)?)
    }

    /// One step of the run from `sample`, given the model's prediction of the clean sample at the
    /// current call (diffusers' `step(...).prev_sample`): first order at even calls, second order
    /// at odd ones. The result is the next call's sample.
    pub fn step(&mut self, model_output: &Tensor, sample: &Tensor) -> Result<Tensor, HeunError> {
        let calls = self.model_calls();
        if self.step_index >= calls {
            return Err(HeunError::Finished { calls });
        }
        same_shape("model_output", model_output, sample)?;

        // prediction_type "sample": the prediction is x0, clipped when configured.
        let pred_original_sample = match self.clip_sample_range {
            Some(range) => model_output.f_clamp(-range, range)?,
            None => model_output.shallow_clone(),
        };
        let prev_sample = match &self.stored {
            None => {
                // First order (Euler), sigma_hat = sigma (gamma = 0; diffusers' `* (0 + 1)` is exact).
                let sigma = self.sigma(self.step_index)?;
                let sigma_next = self.sigma(self.step_index + 1)?;
                let derivative = sample.f_sub(&pred_original_sample)?.f_div(&sigma)?;
                let dt = sigma_next.f_sub(&sigma)?;
                let prev_sample = sample.f_add(&derivative.f_mul(&dt)?)?;
                self.stored = Some(FirstOrderStep { derivative, dt, sample: sample.shallow_clone() });
                prev_sample
            }
            Some(stored) => {
                // Second order (Heun): the derivative at sigma_next averaged with the stored one,
                // stepped from the stored sample.
                same_shape("the sample the first-order step stored", &stored.sample, sample)?;
                let sigma_next = self.sigma(self.step_index)?;
                let derivative = sample.f_sub(&pred_original_sample)?.f_div(&sigma_next)?;
                let derivative = stored.derivative.f_add(&derivative)?.f_div_scalar(2i64)?;
                let prev_sample = stored.sample.f_add(&derivative.f_mul(&stored.dt)?)?;
                self.stored = None;
                prev_sample
            }
        };
        self.step_index += 1;
        Ok(prev_sample)
    }

    /// The sigma at `index` as diffusers reads it: a 0-d float32 tensor selected from `sigmas`.
    fn sigma(&self, index: usize) -> Result<Tensor, HeunError> {
        if index >= self.sigma_values.len() {
            return Err(HeunError::CallIndex { index, calls: self.model_calls() });
        }
        Ok(self.sigmas.f_select(0, index as i64)?)
    }
}

/// The training schedule's float32 sigmas, as diffusers' `__init__` and `set_timesteps` compute
/// them: betas of the "exp" schedule in Python floats (`betas_for_alpha_bar` with
/// `alpha_bar(t) = exp(-12 t)`, capped at 0.999) rounded to float32, then
/// `((1 - alphas_cumprod) / alphas_cumprod) ** 0.5` by libtorch.
fn train_sigmas(train_steps: usize) -> Result<Vec<f32>, HeunError> {
    let alpha_bar = |t: f64| (t * -12.0).exp();
    let steps = train_steps as f64;
    let betas: Vec<f32> = (0..train_steps)
        .map(|i| {
            let (t1, t2) = (i as f64 / steps, (i + 1) as f64 / steps);
            let beta = 1.0 - alpha_bar(t2) / alpha_bar(t1);
            // Python's min(beta, 0.999): beta unless 0.999 is smaller.
            (if 0.999 < beta { 0.999 } else { beta }) as f32
        })
        .collect();
    let alphas = Tensor::from_slice(&betas).f_rsub_scalar(1.0)?;
    let alphas_cumprod = alphas.f_cumprod(0, None::<Kind>)?;
    let sigmas = alphas_cumprod.f_rsub_scalar(1i64)?.f_div(&alphas_cumprod)?.f_pow_tensor_scalar(0.5)?;
    Ok(Vec::<f32>::try_from(&sigmas)?)
}

/// diffusers' `_sigma_to_t` for one sigma: the fractional index of `log(sigma)` in the table,
/// computed as numpy does (float64 throughout but for `low - high`, a difference of two float32
/// entries that numpy takes in float32).
fn sigma_to_t(sigma: f64, table: &[f32], log_sigmas: &[f64]) -> f64 {
    let log_sigma = sigma.max(1e-10).ln();
    // np.cumsum(dists >= 0).argmax(): the last index where log_sigma >= the entry (0 if none),
    // clipped to leave a high neighbour.
    let low_idx = log_sigmas.iter().rposition(|&entry| log_sigma - entry >= 0.0).unwrap_or(0).min(table.len() - 2);
    let high_idx = low_idx + 1;
    let (low, high) = (table[low_idx], table[high_idx]);
    let w = (f64::from(low) - log_sigma) / f64::from(low - high);
    let w = w.clamp(0.0, 1.0);
    (1.0 - w) * low_idx as f64 + w * high_idx as f64
}

/// The spacing of float32 values at `value`'s magnitude.
fn ulp(value: f64) -> f64 {
    let magnitude = (value.abs() as f32).max(f32::MIN_POSITIVE);
    f64::from(f32::from_bits(magnitude.to_bits() + 1)) - f64::from(magnitude)
}

/// An error unless `tensor` has `sample`'s shape.
fn same_shape(what: &'static str, tensor: &Tensor, sample: &Tensor) -> Result<(), HeunError> {
    let (found, expected) = (tensor.size(), sample.size());
    if found != expected {
        return Err(HeunError::Shape { what, expected, found });
    }
    Ok(())
}
