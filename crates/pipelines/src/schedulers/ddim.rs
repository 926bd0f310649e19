//! The DDIM scheduler (Song et al., 2020) over tch tensors, equal bit for bit on the CPU in
//! float32 to diffusers' `DDIMScheduler` (0.42.1) for the configuration Stable Diffusion 1.5 ships
//! with: scaled-linear betas, "leading" timestep spacing with `steps_offset`, epsilon prediction,
//! no clipping or thresholding, eta = 0. This file owns the schedule (betas, `alphas_cumprod`, the
//! timesteps) and the deterministic step; `tests/ddim.rs` checks both against diffusers
//! (`scripts/reference/ddim_reference.py`).
//!
//! Bit-exactness comes from running the same libtorch operations as diffusers, in its order and
//! with its operand types: Python floats stay `f64` (the square roots of `beta_start` and
//! `beta_end` go through libm's `pow`, as CPython's `**` does), and everything diffusers computes
//! on tensors is computed here on float32 tensors, the per-step alphas included (0-d tensors
//! selected from `alphas_cumprod`, never `f64`s read out of them).

use tch::{Device, Kind, Tensor};

/// The scheduler's configuration: the fields of diffusers' `DDIMScheduler` config that vary
/// between checkpoints. The rest is fixed as Stable Diffusion 1.5 sets it: `beta_schedule =
/// "scaled_linear"`, `clip_sample = false`, `prediction_type = "epsilon"`, `timestep_spacing =
/// "leading"`, no thresholding, no zero-SNR rescaling.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DdimConfig {
    /// `num_train_timesteps`: the length of the training noise schedule.
    pub train_steps: i64,
    /// `beta_start`: the first beta of the schedule (its square root is interpolated).
    pub beta_start: f64,
    /// `beta_end`: the last beta of the schedule.
    pub beta_end: f64,
    /// `steps_offset`: added to every inference timestep.
    pub steps_offset: i64,
    /// `set_alpha_to_one`: the alpha product past the last step is 1 (true) or the first
    /// step's (false).
    pub set_alpha_to_one: bool,
}

impl DdimConfig {
    /// Stable Diffusion 1.5's `scheduler/scheduler_config.json`.
    pub fn stable_diffusion() -> Self {
        DdimConfig { train_steps: 1000, beta_start: 0.00085, beta_end: 0.012, steps_offset: 1, set_alpha_to_one: false }
    }
}

/// Why a scheduler could not be built or a step could not be taken.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DdimError {
    /// `inference_steps` is not in `1..=train_steps`.
    #[error(
        "inference_steps = {steps} is out of range: DDIM runs at least 1 and at most train_steps = {train_steps} steps; pass a step count in 1..={train_steps}"
    )]
    InferenceSteps {
        /// The inference steps asked for.
        steps: i64,
        /// The training schedule's steps.
        train_steps: i64,
    },
    /// `steps_offset` moves a timestep of the schedule outside `0..train_steps`, where the
    /// training schedule has no alpha.
    #[error(
        "inference_steps = {steps} with steps_offset = {steps_offset} puts timestep {timestep} outside 0..{train_steps}, where the training schedule has no alpha; use fewer inference steps or a smaller steps_offset"
    )]
    Timestep {
        /// The timestep outside the schedule.
        timestep: i64,
        /// The inference steps asked for.
        steps: i64,
        /// The schedule's offset.
        steps_offset: i64,
        /// The training schedule's steps.
        train_steps: i64,
    },
    /// [`Scheduler::step`](super::Scheduler::step) was called after the last timestep.
    #[error("the run's {steps} steps are all taken; build a new scheduler for another run")]
    Finished {
        /// The inference steps the scheduler is set to.
        steps: i64,
    },
}

/// A DDIM scheduler set to a number of inference steps (diffusers' `DDIMScheduler` after
/// `set_timesteps`). Its tensors live on the CPU; [`Ddim::step`] takes samples on any device.
#[derive(Debug)]
pub struct Ddim {
    config: DdimConfig,
    inference_steps: i64,
    alphas_cumprod: Tensor,
    final_alpha_cumprod: Tensor,
    timesteps: Vec<i64>,
    /// The index in `timesteps` of the next [`Scheduler::step`](super::Scheduler::step).
    next: usize,
}

impl Ddim {
    /// The scheduler for `config`, set to `inference_steps` steps.
    pub fn new(config: DdimConfig, inference_steps: i64) -> Result<Self, DdimError> {
        let train_steps = config.train_steps;
        if !(1..=train_steps).contains(&inference_steps) {
            return Err(DdimError::InferenceSteps { steps: inference_steps, train_steps });
        }
        // set_timesteps, "leading": (arange(0, n) * (train // n))[::-1] + steps_offset, in integers.
        let step_ratio = train_steps / inference_steps;
        let timesteps: Vec<i64> = (0..inference_steps).rev().map(|i| i * step_ratio + config.steps_offset).collect();
        if let Some(&timestep) = timesteps.iter().find(|t| !(0..train_steps).contains(*t)) {
            return Err(DdimError::Timestep {
                timestep,
                steps: inference_steps,
                steps_offset: config.steps_offset,
                train_steps,
            });
        }

        // __init__, "scaled_linear": linspace(beta_start ** 0.5, beta_end ** 0.5, n, float32) ** 2.
        // The square roots are Python floats computed by libm's pow (CPython's `**`); the exponent
        // goes through black_box so that LLVM cannot turn pow(x, 0.5) into sqrt(x).
        let half = std::hint::black_box(0.5);
        let (start, end) = (config.beta_start.powf(half), config.beta_end.powf(half));
        let betas = Tensor::linspace(start, end, train_steps, (Kind::Float, Device::Cpu)).pow_tensor_scalar(2i64);
        let alphas = betas.rsub_scalar(1.0);
        let alphas_cumprod = alphas.cumprod(0, None::<Kind>);
        let final_alpha_cumprod = if config.set_alpha_to_one {
            Tensor::scalar_tensor(1.0, (Kind::Float, Device::Cpu)) // torch.tensor(1.0)
        } else {
            alphas_cumprod.select(0, 0)
        };
        Ok(Ddim { config, inference_steps, alphas_cumprod, final_alpha_cumprod, timesteps, next: 0 })
    }

    /// The inference timesteps, descending (diffusers' `scheduler.timesteps`).
    pub fn timesteps(&self) -> &[i64] {
        &self.timesteps
    }

    /// The timestep of the next [`Scheduler::step`](super::Scheduler::step), which moves past it;
    /// `None` once every one was taken.
    pub(super) fn next_timestep(&mut self) -> Option<i64> {
        let timestep = self.timesteps.get(self.next).copied();
        self.next += timestep.is_some() as usize;
        timestep
    }

    /// The cumulative alpha products of the training schedule: `train_steps` float32 values.
    pub fn alphas_cumprod(&self) -> &Tensor {
        &self.alphas_cumprod
    }

    /// The standard deviation of the initial noise: 1.
    pub fn init_noise_sigma(&self) -> f64 {
        1.0
    }

    /// One deterministic DDIM step (eta = 0) from `sample` at `timestep` to the previous
    /// timestep, given the model's noise prediction: diffusers' `step(...).prev_sample`.
    ///
    /// # Panics
    ///
    /// If `timestep` is outside `0..train_steps` (every one of [`Ddim::timesteps`] is inside).
    pub fn step(&self, noise_pred: &Tensor, timestep: i64, sample: &Tensor) -> Tensor {
        let prev_timestep = timestep - self.config.train_steps / self.inference_steps;
        let alpha_prod_t = self.alphas_cumprod.select(0, timestep);
        let alpha_prod_t_prev = if prev_timestep >= 0 {
            self.alphas_cumprod.select(0, prev_timestep)
        } else {
            self.final_alpha_cumprod.shallow_clone()
        };
        let beta_prod_t = alpha_prod_t.rsub_scalar(1i64);

        // Epsilon prediction: x0 = (x_t - sqrt(1 - a_t) * eps) / sqrt(a_t).
        let pred_original_sample =
            (sample - beta_prod_t.pow_tensor_scalar(0.5) * noise_pred) / alpha_prod_t.pow_tensor_scalar(0.5);

        // sigma_t = eta * sqrt(variance) with eta = 0: a 0-d zero, kept so that the direction below
        // is computed with diffusers' operations.
        let beta_prod_t_prev = alpha_prod_t_prev.rsub_scalar(1i64);
        let variance = (&beta_prod_t_prev / &beta_prod_t) * (&alpha_prod_t / &alpha_prod_t_prev).rsub_scalar(1i64);
        let std_dev_t = variance.pow_tensor_scalar(0.5) * 0.0;

        let pred_sample_direction = (alpha_prod_t_prev.rsub_scalar(1i64) - std_dev_t.pow_tensor_scalar(2i64))
            .pow_tensor_scalar(0.5)
            * noise_pred;
        alpha_prod_t_prev.pow_tensor_scalar(0.5) * pred_original_sample + pred_sample_direction
    }
}
