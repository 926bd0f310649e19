//! UniPC, the unified predictor-corrector multistep sampler (Zhao et al., 2023), over tch tensors,
//! equal bit for bit on the CPU to diffusers' `UniPCMultistepScheduler` (0.42.1) as the Wan2.1
//! text-to-video pipeline configures it (`Wan-AI/Wan2.1-T2V-1.3B-Diffusers`,
//! `scheduler/scheduler_config.json`): flow sigmas shifted by `flow_shift` (3.0 published, the
//! 480p value; diffusers' Wan docs use 5.0 for 720p), `prediction_type = "flow_prediction"`,
//! `predict_x0`, the `"bh2"` B(h), order 2 with `lower_order_final`, the corrector after every
//! step but the first. This file owns the schedule (integer timesteps and float32 sigmas) and the
//! step with the multistep state between model calls; `tests/unipc.rs` checks both against
//! diffusers (`scripts/reference/unipc_reference.py`).
//!
//! A run of `n` inference steps makes `n` model calls, one per timestep, and one [`UniPc::step`]
//! after each. A step converts the model's velocity to a prediction of the clean sample
//! (`x0 = sample - sigma * model_output`), corrects the sample it is given with that prediction
//! (UniC, from the second step on, at the order the previous step predicted with), then predicts
//! the next sample (UniP) from the last `order` predictions. The order warms up (1, then 2) and,
//! with `lower_order_final`, drops back to 1 at the last step, whose target sigma is 0 (the result
//! is then the last prediction of `x0`).
//!
//! # Orders and `torch.linalg.solve`
//!
//! diffusers solves a small linear system for the predictor's coefficients at order 3 and up, and
//! for the corrector's at order 2 and up; order 2's predictor and order 1's corrector use the
//! constant 0.5. With `solver_order = 2` (Wan's) the orders are 1 and 2, so the corrector of every
//! order-2 step solves a 2x2 system. This port calls the same libtorch op (`linalg_solve`, LAPACK's
//! `gesv`) on the same float32 tensors, so the solution is the same bits as long as both sides run
//! one libtorch (here the one of the torch wheel diffusers runs on, `LIBTORCH_USE_PYTORCH`); the same holds for the 3x3 and 2x2 systems of `solver_order = 3`, which the tests
//! check too. Orders above 3 are refused ([`UniPcError::SolverOrder`]): diffusers computes them the
//! same way, but they are not checked here.
//!
//! # Where the numbers come from
//!
//! - **The schedule is numpy's float64 arithmetic, redone in `f64`.** diffusers takes
//!   `np.linspace(1, 1 / N, n + 1)[:-1]` (numpy computes `i * step + 1` with
//!   `step = (1 / N - 1) / n`), shifts it with `shift * s / (1 + (shift - 1) * s)`, lowers the first
//!   sigma (1, or within an ulp of it) by 1e-6, and takes the timesteps as `s * N` truncated to int64 and the
//!   sigmas (with a final 0) rounded to float32. These are additions, multiplications and
//!   divisions only, correctly rounded in numpy's SIMD loops as in Rust (no transcendental
//!   function, so no table from Python is needed, unlike [`super::heun`]); the tests check every
//!   step count from 1 to 100 and a spread up to 1000, for the 480p and 720p shifts.
//! - **What diffusers computes on torch tensors is computed here by the same libtorch ops, in the
//!   same order, on the same kinds**: the 0-d float32 sigmas selected from the schedule (moved to
//!   the sample's device, as diffusers moves them), `1 - sigma`, the logs, `expm1`, the
//!   coefficients' Python-int and Python-float scalars (passed as `i64` and `f64` scalars as
//!   Python passes them), `stack`, `pow`, `linalg_solve`, `einsum("k,bkc...->bc...")`, and the
//!   `0` diffusers adds or multiplies when there is no history (which can turn a `-0.0` into
//!   `+0.0`).
//!   The kinds follow: a bfloat16 `model_output` (the published pipeline's transformer output)
//!   makes `sigma * model_output` bfloat16 (a 0-d tensor does not promote a dimensioned one), and
//!   `sample - that` float32; the history, the corrector and the predictor are float32.
//!
//! # Configuration
//!
//! [`UniPcConfig::wan2_1_t2v`] is the published configuration; [`UniPcConfig::from_json`] reads a
//! diffusers `scheduler_config.json` (the published file, or what `save_config` writes) and refuses
//! a key whose value this port does not compute, naming it. Keys that diffusers does not read with
//! flow sigmas (the beta schedule, `rescale_betas_zero_snr`, `steps_offset`, `sigma_min`,
//! `sigma_max`) or without thresholding or dynamic shifting (`dynamic_thresholding_ratio`,
//! `sample_max_value`, `time_shift_type`) are not read; `timestep_spacing`, whose timesteps the
//! flow sigmas' replace, is only checked to be one diffusers accepts.

use std::path::Path;

use serde_json::{Map, Value};
use tch::{Device, Kind, Tensor};

/// The largest `solver_order` this port runs (see the module documentation).
pub const MAX_SOLVER_ORDER: usize = 3;

/// diffusers' `flow_shift` for Wan2.1 at 480p, the published configuration's.
pub const FLOW_SHIFT_480P: f64 = 3.0;

/// diffusers' `flow_shift` for Wan2.1 at 720p (its Wan documentation and pipeline example).
pub const FLOW_SHIFT_720P: f64 = 5.0;

/// The sigma a run ends at (diffusers' `final_sigmas_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinalSigma {
    /// `"zero"`: the last step goes to sigma 0, the clean sample (Wan's).
    Zero,
    /// `"sigma_min"`: the last step goes to the last inference sigma again.
    SigmaMin,
}

/// The scheduler's configuration: the fields of diffusers' `UniPCMultistepScheduler` config that
/// this port reads. The rest is fixed as Wan sets it: `prediction_type = "flow_prediction"`,
/// `use_flow_sigmas = true`, `predict_x0 = true`, `solver_type = "bh2"`, no thresholding, no
/// `solver_p`, no Karras, exponential or beta sigmas, no dynamic shifting, no `shift_terminal`.
#[derive(Debug, Clone, PartialEq)]
pub struct UniPcConfig {
    /// `num_train_timesteps`: the training schedule's length; the flow sigmas run from 1 down to
    /// `1 / train_steps`, and a timestep is a sigma times it.
    pub train_steps: usize,
    /// `solver_order`: the most model outputs a step combines, 1 to [`MAX_SOLVER_ORDER`].
    pub solver_order: usize,
    /// `lower_order_final`: the last steps use lower orders (the last one order 1).
    pub lower_order_final: bool,
    /// `disable_corrector`: the step indices whose result is not corrected by the step after.
    pub disable_corrector: Vec<usize>,
    /// `flow_shift`: the shift of the flow sigmas, `shift * s / (1 + (shift - 1) * s)`; a finite
    /// positive number ([`FLOW_SHIFT_480P`], [`FLOW_SHIFT_720P`]).
    pub flow_shift: f64,
    /// `final_sigmas_type`.
    pub final_sigma: FinalSigma,
}

impl UniPcConfig {
    /// The published configuration of Wan2.1 text-to-video (`Wan-AI/Wan2.1-T2V-1.3B-Diffusers`,
    /// `scheduler/scheduler_config.json`): 1000 training steps, order 2 with `lower_order_final`, every
    /// corrector on, `flow_shift` 3.0 (480p), final sigma 0. [`UniPcConfig::with_flow_shift`] sets
    /// 720p's 5.0.
    pub fn wan2_1_t2v() -> Self {
        UniPcConfig {
            train_steps: 1000,
            solver_order: 2,
            lower_order_final: true,
            disable_corrector: Vec::new(),
            flow_shift: FLOW_SHIFT_480P,
            final_sigma: FinalSigma::Zero,
        }
    }

    /// This configuration with another `flow_shift`
    /// (`UniPCMultistepScheduler.from_config(config, flow_shift=...)`).
    pub fn with_flow_shift(self, flow_shift: f64) -> Self {
        UniPcConfig { flow_shift, ..self }
    }

    /// An error unless this port runs this configuration: at least 1 training step, a solver
    /// order from 1 to [`MAX_SOLVER_ORDER`], a finite positive flow shift.
    pub fn validate(&self) -> Result<(), UniPcError> {
        if self.train_steps == 0 {
            return Err(UniPcError::TrainSteps { train_steps: self.train_steps });
        }
        if !(1..=MAX_SOLVER_ORDER).contains(&self.solver_order) {
            return Err(UniPcError::SolverOrder { order: self.solver_order });
        }
        if !(self.flow_shift.is_finite() && self.flow_shift > 0.0) {
            return Err(UniPcError::FlowShift { shift: self.flow_shift });
        }
        Ok(())
    }

    /// Reads a diffusers `scheduler_config.json` of `UniPCMultistepScheduler`: the published file
    /// of a Wan pipeline, or what `save_config` writes. An absent key takes diffusers' default; a
    /// key whose value this port does not compute (another prediction type, no flow sigmas,
    /// thresholding, `"bh1"`, ...) is an error naming the key and what the port supports, and so
    /// is a configuration [`UniPcConfig::validate`] refuses.
    pub fn from_json(text: &str) -> Result<Self, UniPcError> {
        let document: Value = serde_json::from_str(text).map_err(|e| UniPcError::Json { error: e.to_string() })?;
        let config = document.as_object().ok_or(UniPcError::Config {
            key: "(the document)",
            found: shown(Some(&document)),
            expected: "an object: diffusers' scheduler configuration",
        })?;
        // Keys whose value must be what this port computes, with diffusers' default for an absent key.
        let fixed: [(&'static str, Value, &'static str); 10] = [
            ("_class_name", Value::from("UniPCMultistepScheduler"), "\"UniPCMultistepScheduler\""),
            ("prediction_type", Value::from("epsilon"), "\"flow_prediction\""),
            ("use_flow_sigmas", Value::Bool(false), "true"),
            ("predict_x0", Value::Bool(true), "true"),
            ("thresholding", Value::Bool(false), "false"),
            ("solver_p", Value::Null, "null"),
            ("use_karras_sigmas", Value::Bool(false), "false"),
            ("use_exponential_sigmas", Value::Bool(false), "false"),
            ("use_beta_sigmas", Value::Bool(false), "false"),
            ("use_dynamic_shifting", Value::Bool(false), "false"),
        ];
        for (key, default, expected) in fixed {
            // Compared as JSON text: "true" is not "\"true\"", 1 is not 1.0.
            let found = config.get(key).cloned().unwrap_or(default).to_string();
            if found != expected {
                return Err(UniPcError::Config { key, found, expected });
            }
        }
        if let Some(found) = config.get("shift_terminal").filter(|value| !value.is_null()) {
            return Err(UniPcError::Config { key: "shift_terminal", found: found.to_string(), expected: "null" });
        }
        // diffusers replaces "midpoint", "heun" and "logrho" by "bh2" when it builds the scheduler.
        one_of(
            config,
            "solver_type",
            "bh2",
            &["bh2", "midpoint", "heun", "logrho"],
            "\"bh2\" (or midpoint, heun, logrho)",
        )?;
        // Computed and then replaced by the flow sigmas' timesteps; diffusers refuses other values.
        one_of(
            config,
            "timestep_spacing",
            "linspace",
            &["linspace", "leading", "trailing"],
            "linspace, leading or trailing",
        )?;
        let final_sigma =
            match one_of(config, "final_sigmas_type", "zero", &["zero", "sigma_min"], "zero or sigma_min")? {
                "zero" => FinalSigma::Zero,
                _ => FinalSigma::SigmaMin,
            };
        let count = |key: &'static str, default: usize, expected: &'static str| -> Result<usize, UniPcError> {
            match config.get(key) {
                None => Ok(default),
                Some(value) => value.as_u64().and_then(|v| usize::try_from(v).ok()).ok_or(UniPcError::Config {
                    key,
                    found: value.to_string(),
                    expected,
                }),
            }
        };
        let train_steps = count("num_train_timesteps", 1000, "a positive integer")?;
        let solver_order = count("solver_order", 2, "an integer from 1 to 3")?;
        let lower_order_final = match config.get("lower_order_final") {
            None => true,
            Some(value) => value.as_bool().ok_or(UniPcError::Config {
                key: "lower_order_final",
                found: value.to_string(),
                expected: "true or false",
            })?,
        };
        let disable_corrector = match config.get("disable_corrector") {
            None => Vec::new(),
            Some(value) => value
                .as_array()
                .and_then(|steps| {
                    steps.iter().map(|step| step.as_u64().and_then(|s| usize::try_from(s).ok())).collect::<Option<_>>()
                })
                .ok_or(UniPcError::Config {
                    key: "disable_corrector",
                    found: value.to_string(),
                    expected: "a list of step indices",
                })?,
        };
        let flow_shift = match config.get("flow_shift") {
            None => 1.0,
            Some(value) => value.as_f64().ok_or(UniPcError::Config {
                key: "flow_shift",
                found: value.to_string(),
                expected: "a number",
            })?,
        };
        let config =
            UniPcConfig { train_steps, solver_order, lower_order_final, disable_corrector, flow_shift, final_sigma };
        config.validate()?;
        Ok(config)
    }

    /// [`UniPcConfig::from_json`] of the file at `path`.
    pub fn from_json_file(path: &Path) -> Result<Self, UniPcError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| UniPcError::Read { path: path.display().to_string(), error: e.to_string() })?;
        UniPcConfig::from_json(&text).map_err(|error| match error {
            UniPcError::Json { error } => UniPcError::Json { error: format!("{}: {error}", path.display()) },
            other => other,
        })
    }
}

/// The string at `key` if it is one of `allowed` (`default` when absent), else a configuration error.
fn one_of<'a>(
    config: &'a Map<String, Value>,
    key: &'static str,
    default: &'a str,
    allowed: &[&str],
    expected: &'static str,
) -> Result<&'a str, UniPcError> {
    match config.get(key) {
        None => Ok(default),
        Some(value) => value.as_str().filter(|found| allowed.contains(found)).ok_or(UniPcError::Config {
            key,
            found: value.to_string(),
            expected,
        }),
    }
}

/// A JSON value as an error shows it.
fn shown(value: Option<&Value>) -> String {
    value.map_or_else(|| "nothing".to_string(), Value::to_string)
}

/// Why a scheduler could not be built or a step could not be taken.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum UniPcError {
    /// `inference_steps` is not in `1..=train_steps`.
    #[error(
        "inference_steps = {steps} is out of range: UniPC runs at least 1 and at most num_train_timesteps = {train_steps} steps; pass a step count in 1..={train_steps}"
    )]
    InferenceSteps {
        /// The inference steps asked for.
        steps: usize,
        /// The training schedule's steps.
        train_steps: usize,
    },
    /// `train_steps` is 0.
    #[error("num_train_timesteps = {train_steps}: the schedule needs at least 1 training step")]
    TrainSteps {
        /// The training schedule's steps.
        train_steps: usize,
    },
    /// `solver_order` is 0 or above [`MAX_SOLVER_ORDER`].
    #[error(
        "solver_order = {order}: this UniPC port runs orders 1 to 3 (checked against diffusers; Wan uses 2); set solver_order to 1, 2 or 3"
    )]
    SolverOrder {
        /// The order asked for.
        order: usize,
    },
    /// `flow_shift` is not a finite positive number.
    #[error("flow_shift = {shift}: the flow sigmas' shift must be a finite positive number (Wan: 3.0 for 480p, 5.0 for 720p)")]
    FlowShift {
        /// The shift.
        shift: f64,
    },
    /// A configuration key holds a value this port does not compute.
    #[error("scheduler configuration: {key} is {found}, but this UniPC port supports only {expected}")]
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
    #[error("cannot read the scheduler configuration {path}: {error}")]
    Read {
        /// The file.
        path: String,
        /// The system's message.
        error: String,
    },
    /// [`UniPc::step`] after the run's last step.
    #[error("the run's {steps} steps are all taken; build a new scheduler for another run")]
    Finished {
        /// The run's inference steps.
        steps: usize,
    },
    /// The sample is not float32.
    #[error("the sample is {found:?}: UniPC steps float32 samples (the pipeline's latents); convert it with to_kind(Kind::Float)")]
    SampleKind {
        /// The sample's kind.
        found: Kind,
    },
    /// The model output is not float32, bfloat16 or float16.
    #[error("the model output is {found:?}: UniPC takes a float32, bfloat16 or float16 model output")]
    ModelOutputKind {
        /// The model output's kind.
        found: Kind,
    },
    /// The sample has fewer than two dimensions (diffusers' `einsum("k,bkc...->bc...")` needs a
    /// batch and a channel dimension).
    #[error("the sample has shape {found:?}: UniPC needs a batch and a channel dimension (at least two)")]
    SampleDims {
        /// The sample's shape.
        found: Vec<i64>,
    },
    /// Tensors a step combines do not have one shape.
    #[error("{what}: shape {found:?} against {expected:?}")]
    Shape {
        /// Which tensor, against which.
        what: &'static str,
        /// The shape it must have.
        expected: Vec<i64>,
        /// Its shape.
        found: Vec<i64>,
    },
    /// Tensors a step combines are not on one device.
    #[error("{what} is on {found:?}, the sample on {expected:?}")]
    Device {
        /// Which tensor.
        what: &'static str,
        /// The sample's device.
        expected: Device,
        /// Its device.
        found: Device,
    },
    /// The run's history does not hold what a step of this order reads (a bug of this port).
    #[error("a step of order {order} at step index {step_index} reads more history than the run holds")]
    History {
        /// The step's order.
        order: usize,
        /// The step's index.
        step_index: usize,
    },
    /// libtorch refused an operation.
    #[error("libtorch: {error}")]
    Torch {
        /// libtorch's message.
        error: String,
    },
}

impl From<tch::TchError> for UniPcError {
    fn from(error: tch::TchError) -> Self {
        UniPcError::Torch { error: error.to_string() }
    }
}

/// A UniPC scheduler set to a number of inference steps (diffusers' `UniPCMultistepScheduler` after
/// `set_timesteps(n)` and `set_begin_index(0)`, as `WanPipeline` calls them), with the state of one
/// run. Its sigmas live on the CPU as diffusers keeps them; [`UniPc::step`] takes samples on any
/// device and moves the sigmas it combines there as diffusers does (bit equality is checked on the
/// CPU).
#[derive(Debug)]
pub struct UniPc {
    config: UniPcConfig,
    timesteps: Vec<i64>,
    sigma_values: Vec<f32>,
    sigmas: Tensor,
    step_index: usize,
    /// The converted model outputs (`x0` predictions), oldest first, at most `solver_order`.
    model_outputs: Vec<Tensor>,
    last_sample: Option<Tensor>,
    this_order: Option<usize>,
    lower_order_nums: usize,
}

/// What a predictor or corrector step of one order computes before it combines samples: the 0-d
/// sigma terms, `R`, `b` and the stacked differences `D1s`.
struct Coefficients {
    alpha_t: Tensor,
    sigma_t: Tensor,
    sigma_s0: Tensor,
    h_phi_1: Tensor,
    b_h: Tensor,
    r: Tensor,
    b: Tensor,
    d1s: Option<Tensor>,
}

impl UniPc {
    /// The scheduler for `config`, set to `inference_steps` steps, at the start of a run. The step
    /// count is limited to `1..=train_steps` (diffusers accepts more).
    pub fn new(config: &UniPcConfig, inference_steps: usize) -> Result<Self, UniPcError> {
        config.validate()?;
        if !(1..=config.train_steps).contains(&inference_steps) {
            return Err(UniPcError::InferenceSteps { steps: inference_steps, train_steps: config.train_steps });
        }
        let (timesteps, sigma_values) = flow_schedule(config, inference_steps);
        Ok(UniPc {
            config: config.clone(),
            timesteps,
            sigmas: Tensor::from_slice(&sigma_values),
            sigma_values,
            step_index: 0,
            model_outputs: Vec::new(),
            last_sample: None,
            this_order: None,
            lower_order_nums: 0,
        })
    }

    /// The configuration the scheduler was built with.
    pub fn config(&self) -> &UniPcConfig {
        &self.config
    }

    /// The inference steps the scheduler is set to.
    pub fn inference_steps(&self) -> usize {
        self.timesteps.len()
    }

    /// The timestep of every step, descending (diffusers' `scheduler.timesteps`, int64): the
    /// transformer's `timestep` input at step `i` is `timesteps()[i]`, expanded to the batch.
    pub fn timesteps(&self) -> &[i64] {
        &self.timesteps
    }

    /// The sigmas (diffusers' `scheduler.sigmas`): `inference_steps + 1` float32 values on the CPU,
    /// ending in 0 (or the last sigma again with [`FinalSigma::SigmaMin`]).
    pub fn sigmas(&self) -> &Tensor {
        &self.sigmas
    }

    /// The sigmas as values (`float(scheduler.sigmas[i])` is `f64::from(sigma_values()[i])`).
    pub fn sigma_values(&self) -> &[f32] {
        &self.sigma_values
    }

    /// The index of the next step (diffusers' `step_index`; 0 before the first step).
    pub fn step_index(&self) -> usize {
        self.step_index
    }

    /// The order the last step predicted with, which the next step's corrector uses (diffusers'
    /// `this_order`); `None` before the first step.
    pub fn this_order(&self) -> Option<usize> {
        self.this_order
    }

    /// The steps taken so far, capped at `solver_order` (diffusers' `lower_order_nums`): the
    /// multistep warm-up.
    pub fn lower_order_nums(&self) -> usize {
        self.lower_order_nums
    }

    /// The converted model outputs of the last steps (the `x0` predictions, float32), oldest first,
    /// at most `solver_order` (diffusers' `model_outputs` without its leading `None`s).
    pub fn model_outputs(&self) -> &[Tensor] {
        &self.model_outputs
    }

    /// The sample the last step predicted from, after its correction (diffusers' `last_sample`).
    pub fn last_sample(&self) -> Option<&Tensor> {
        self.last_sample.as_ref()
    }

    /// One step of the run (diffusers' `step(model_output, t, sample).prev_sample` at the current
    /// `t`): `model_output` is the transformer's prediction (float32, or bfloat16 as the published
    /// pipeline's bf16 transformer and its classifier-free guidance give it; float16 works too) at
    /// `sample`, the run's float32 latents. The result is the next step's sample (float32). A
    /// refused step (an error) leaves the run where it was.
    pub fn step(&mut self, model_output: &Tensor, sample: &Tensor) -> Result<Tensor, UniPcError> {
        let steps = self.inference_steps();
        if self.step_index >= steps {
            return Err(UniPcError::Finished { steps });
        }
        self.check_inputs(model_output, sample)?;
        let device = sample.device();
        let step_index = self.step_index;

        let x0 = self.convert_model_output(model_output, sample)?;
        // diffusers: step_index > 0, step_index - 1 not in disable_corrector, last_sample set (and
        // with it this_order).
        let corrected = match (&self.last_sample, self.this_order) {
            (Some(last_sample), Some(order))
                if step_index > 0 && !self.config.disable_corrector.contains(&(step_index - 1)) =>
            {
                self.corrector(&x0, last_sample, order, device)?
            }
            _ => sample.shallow_clone(),
        };

        // The history after this step: the oldest output out when full, this one in.
        let mut history: Vec<Tensor> = self.model_outputs.iter().map(Tensor::shallow_clone).collect();
        if history.len() == self.config.solver_order {
            let _oldest = history.remove(0);
        }
        history.push(x0);

        let order = if self.config.lower_order_final {
            self.config.solver_order.min(steps - step_index)
        } else {
            self.config.solver_order
        };
        let order = order.min(self.lower_order_nums + 1);
        let prev_sample = self.predictor(&history, &corrected, order, device)?;

        self.model_outputs = history;
        self.last_sample = Some(corrected);
        self.this_order = Some(order);
        self.lower_order_nums = (self.lower_order_nums + 1).min(self.config.solver_order);
        self.step_index += 1;
        Ok(prev_sample)
    }

    /// The errors of bad inputs, before anything is computed.
    fn check_inputs(&self, model_output: &Tensor, sample: &Tensor) -> Result<(), UniPcError> {
        if sample.kind() != Kind::Float {
            return Err(UniPcError::SampleKind { found: sample.kind() });
        }
        if !matches!(model_output.kind(), Kind::Float | Kind::BFloat16 | Kind::Half) {
            return Err(UniPcError::ModelOutputKind { found: model_output.kind() });
        }
        let shape = sample.size();
        if shape.len() < 2 {
            return Err(UniPcError::SampleDims { found: shape });
        }
        if model_output.size() != shape {
            return Err(UniPcError::Shape {
                what: "the model output against the sample",
                expected: shape,
                found: model_output.size(),
            });
        }
        if model_output.device() != sample.device() {
            return Err(UniPcError::Device {
                what: "the model output",
                expected: sample.device(),
                found: model_output.device(),
            });
        }
        if let Some(last_sample) = &self.last_sample {
            if last_sample.size() != shape {
                return Err(UniPcError::Shape {
                    what: "the sample against the run's earlier samples",
                    expected: last_sample.size(),
                    found: shape,
                });
            }
            if last_sample.device() != sample.device() {
                return Err(UniPcError::Device {
                    what: "the run's earlier samples",
                    expected: sample.device(),
                    found: last_sample.device(),
                });
            }
        }
        Ok(())
    }

    /// `convert_model_output`, flow prediction with `predict_x0`: `sample - sigma * model_output`
    /// with the step's sigma as a 0-d CPU tensor (diffusers does not move it here).
    fn convert_model_output(&self, model_output: &Tensor, sample: &Tensor) -> Result<Tensor, UniPcError> {
        let sigma = self.sigma(self.step_index)?;
        Ok(sample.f_sub(&sigma.f_mul(model_output)?)?)
    }

    /// `multistep_uni_p_bh_update` (B(h) "bh2", `predict_x0`) at `order`, from `sample` with the
    /// history `history` (this step's `x0` last).
    fn predictor(
        &self,
        history: &[Tensor],
        sample: &Tensor,
        order: usize,
        device: Device,
    ) -> Result<Tensor, UniPcError> {
        let s = self.step_index;
        let history_error = UniPcError::History { order, step_index: s };
        let m0 = history.last().ok_or_else(|| history_error.clone())?;
        // sigma_t at step_index + 1, sigma_s0 at step_index, sigma_si at step_index - i.
        let earlier = |i: usize| s.checked_sub(i).ok_or_else(|| history_error.clone());
        let c = self.coefficients(s + 1, s, order, earlier, history, device)?;
        let rhos_p = match order {
            1 => None,
            // diffusers' simplified order 2: torch.ones(1, dtype=x.dtype) * 0.5.
            2 => Some(Tensor::f_ones([1], (sample.kind(), device))?.f_mul_scalar(0.5)?),
            _ => {
                let k = i64::try_from(order - 1).map_err(|_| history_error.clone())?;
                let r = c.r.f_narrow(0, 0, k)?.f_narrow(1, 0, k)?;
                let b = c.b.f_narrow(0, 0, k)?;
                Some(Tensor::f_linalg_solve(&r, &b, true)?.f_to_device(device)?.f_to_kind(sample.kind())?)
            }
        };
        let x_t_ = c.sigma_t.f_div(&c.sigma_s0)?.f_mul(sample)?.f_sub(&c.alpha_t.f_mul(&c.h_phi_1)?.f_mul(m0)?)?;
        let scale = c.alpha_t.f_mul(&c.b_h)?;
        let x_t = match (&c.d1s, &rhos_p) {
            (Some(d1s), Some(rhos_p)) => {
                let pred_res = Tensor::f_einsum("k,bkc...->bc...", &[rhos_p, d1s], None::<&[i64]>)?;
                x_t_.f_sub(&scale.f_mul(&pred_res)?)?
            }
            // pred_res = 0, a Python int.
            _ => x_t_.f_sub(&scale.f_mul_scalar(0i64)?)?,
        };
        Ok(x_t.f_to_kind(sample.kind())?)
    }

    /// `multistep_uni_c_bh_update` (B(h) "bh2", `predict_x0`) at `order` (the previous step's):
    /// the corrected sample, computed again from `last_sample` (the sample the previous step
    /// predicted from) with this step's converted output `model_t`, over the history before this
    /// step. diffusers reads only the device of the sample it corrects (`this_sample`); that is
    /// `device` here.
    fn corrector(
        &self,
        model_t: &Tensor,
        last_sample: &Tensor,
        order: usize,
        device: Device,
    ) -> Result<Tensor, UniPcError> {
        let s = self.step_index;
        let history_error = UniPcError::History { order, step_index: s };
        let history = &self.model_outputs;
        let m0 = history.last().ok_or_else(|| history_error.clone())?;
        // sigma_t at step_index, sigma_s0 at step_index - 1, sigma_si at step_index - (i + 1).
        let s0 = s.checked_sub(1).ok_or_else(|| history_error.clone())?;
        let earlier = |i: usize| s.checked_sub(i + 1).ok_or_else(|| history_error.clone());
        let c = self.coefficients(s, s0, order, earlier, history, device)?;
        let rhos_c = if order == 1 {
            // diffusers' simplified order 1: torch.ones(1, dtype=x.dtype) * 0.5.
            Tensor::f_ones([1], (last_sample.kind(), device))?.f_mul_scalar(0.5)?
        } else {
            Tensor::f_linalg_solve(&c.r, &c.b, true)?.f_to_device(device)?.f_to_kind(last_sample.kind())?
        };
        let x_t_ = c.sigma_t.f_div(&c.sigma_s0)?.f_mul(last_sample)?.f_sub(&c.alpha_t.f_mul(&c.h_phi_1)?.f_mul(m0)?)?;
        let d1_t = model_t.f_sub(m0)?;
        let last_rho = rhos_c.f_select(0, -1)?;
        let correction = match &c.d1s {
            Some(d1s) => {
                let k = i64::try_from(order - 1).map_err(|_| history_error.clone())?;
                let rhos = rhos_c.f_narrow(0, 0, k)?;
                let corr_res = Tensor::f_einsum("k,bkc...->bc...", &[&rhos, d1s], None::<&[i64]>)?;
                corr_res.f_add(&last_rho.f_mul(&d1_t)?)?
            }
            // corr_res = 0, a Python int: `0 + tensor` is tensor.add(0).
            None => last_rho.f_mul(&d1_t)?.f_add_scalar(0i64)?,
        };
        let x_t = x_t_.f_sub(&c.alpha_t.f_mul(&c.b_h)?.f_mul(&correction)?)?;
        Ok(x_t.f_to_kind(last_sample.kind())?)
    }

    /// The part `multistep_uni_p_bh_update` and `multistep_uni_c_bh_update` share: the sigmas at
    /// `t` and `s0`, the log-SNR steps, `rks` and `D1s` over the `order - 1` earlier outputs (the
    /// i-th at sigma index `earlier(i)` and `history[len - 1 - i]`), and `R` and `b`.
    fn coefficients(
        &self,
        t: usize,
        s0: usize,
        order: usize,
        earlier: impl Fn(usize) -> Result<usize, UniPcError>,
        history: &[Tensor],
        device: Device,
    ) -> Result<Coefficients, UniPcError> {
        let history_error = || UniPcError::History { order, step_index: self.step_index };
        let m0 = history.last().ok_or_else(history_error)?;
        let (alpha_t, sigma_t) = alpha_sigma(self.sigma(t)?.f_to_device(device)?)?;
        let (alpha_s0, sigma_s0) = alpha_sigma(self.sigma(s0)?.f_to_device(device)?)?;
        let lambda_t = alpha_t.f_log()?.f_sub(&sigma_t.f_log()?)?;
        let lambda_s0 = alpha_s0.f_log()?.f_sub(&sigma_s0.f_log()?)?;
        let h = lambda_t.f_sub(&lambda_s0)?;

        let mut rks = Vec::with_capacity(order);
        let mut d1s = Vec::with_capacity(order);
        for i in 1..order {
            let si = earlier(i)?;
            let mi = history.len().checked_sub(i + 1).and_then(|index| history.get(index)).ok_or_else(history_error)?;
            let (alpha_si, sigma_si) = alpha_sigma(self.sigma(si)?.f_to_device(device)?)?;
            let lambda_si = alpha_si.f_log()?.f_sub(&sigma_si.f_log()?)?;
            let rk = lambda_si.f_sub(&lambda_s0)?.f_div(&h)?;
            d1s.push(mi.f_sub(m0)?.f_div(&rk)?);
            rks.push(rk);
        }
        rks.push(Tensor::f_ones([0i64; 0], (Kind::Float, device))?);
        let rks = Tensor::f_stack(&rks, 0)?;

        // predict_x0: hh = -h; bh2: B_h = expm1(hh).
        let hh = h.f_neg()?;
        let h_phi_1 = hh.f_expm1()?;
        let mut h_phi_k = h_phi_1.f_div(&hh)?.f_sub_scalar(1i64)?;
        let mut factorial_i: i64 = 1;
        let b_h = hh.f_expm1()?;
        let mut r = Vec::with_capacity(order);
        let mut b = Vec::with_capacity(order);
        for i in 1..=order {
            let i = i64::try_from(i).map_err(|_| history_error())?;
            r.push(rks.f_pow_tensor_scalar(i - 1)?);
            b.push(h_phi_k.f_mul_scalar(factorial_i)?.f_div(&b_h)?);
            factorial_i = factorial_i.checked_mul(i + 1).ok_or_else(history_error)?;
            // 1 / factorial_i is a Python float.
            h_phi_k = h_phi_k.f_div(&hh)?.f_sub_scalar(1.0 / factorial_i as f64)?;
        }
        let r = Tensor::f_stack(&r, 0)?;
        let b = Tensor::f_stack(&b, 0)?;
        let d1s = if d1s.is_empty() { None } else { Some(Tensor::f_stack(&d1s, 1)?) };
        Ok(Coefficients { alpha_t, sigma_t, sigma_s0, h_phi_1, b_h, r, b, d1s })
    }

    /// The sigma at `index` as diffusers reads it: a 0-d float32 CPU tensor selected from `sigmas`.
    fn sigma(&self, index: usize) -> Result<Tensor, UniPcError> {
        // An index past the schedule is libtorch's error (a step never reads one).
        Ok(self.sigmas.f_select(0, index as i64)?)
    }
}

/// `_sigma_to_alpha_sigma_t` with flow sigmas: `(1 - sigma, sigma)`.
fn alpha_sigma(sigma: Tensor) -> Result<(Tensor, Tensor), UniPcError> {
    Ok((sigma.f_rsub_scalar(1i64)?, sigma))
}

/// `set_timesteps(n)` with flow sigmas, as numpy computes it in float64 (see the module
/// documentation): the int64 timesteps and the `n + 1` float32 sigmas.
fn flow_schedule(config: &UniPcConfig, steps: usize) -> (Vec<i64>, Vec<f32>) {
    let train = config.train_steps as f64;
    // np.linspace(1, 1 / N, n + 1)[:-1]: y = arange(n + 1) * step + start, step = (stop - start) / n
    // (numpy multiplies by the step unless it is 0, then divides by n and multiplies by the delta:
    // the same values here, where the delta is 0 only when N = 1 and every y is 1).
    let (start, stop) = (1.0_f64, 1.0 / train);
    let step = (stop - start) / steps as f64;
    let shift = config.flow_shift;
    let mut sigmas: Vec<f64> =
        (0..steps).map(|i| i as f64 * step + start).map(|s| shift * s / (1.0 + (shift - 1.0) * s)).collect();
    // "to avoid inf torch.log(alpha_si)": the first sigma, 1 for any shift, is lowered by 1e-6.
    const EPS: f64 = 1e-6;
    if let Some(first) = sigmas.first_mut() {
        if (*first - 1.0).abs() < EPS {
            *first -= EPS;
        }
    }
    // torch.from_numpy(sigmas * N).to(int64): truncation toward zero.
    let timesteps = sigmas.iter().map(|&s| (s * train) as i64).collect();
    let last = match config.final_sigma {
        FinalSigma::Zero => 0.0,
        FinalSigma::SigmaMin => sigmas.last().copied().unwrap_or(0.0),
    };
    let values = sigmas.iter().chain([&last]).map(|&s| s as f32).collect();
    (timesteps, values)
}
