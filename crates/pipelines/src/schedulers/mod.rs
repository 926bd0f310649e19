//! diffusers' schedulers as the pipelines here configure them, ported bit for bit: [`ddim`]
//! (Stable Diffusion), [`heun`] (Shap-E) and [`unipc`] (Wan2.1), and what a denoising loop asks
//! of any of them ([`Scheduler`]).
//!
//! Each port keeps its own API as diffusers has it (DDIM's stateless `step` at a timestep, Heun's
//! model calls two per step but the first, UniPC's multistep state); [`Scheduler`] is where the
//! three agree: a run is a sequence of model calls, each at a timestep, each followed by one
//! step that gives the next call's sample.

pub mod ddim;
pub mod heun;
pub mod unipc;

use tch::Tensor;

use ddim::{Ddim, DdimError};
use heun::{Heun, HeunError};
use unipc::{UniPc, UniPcError};

/// A scheduler set to a number of steps, run call by call: for each of [`timesteps`]
/// (one per model call), the model on [`scale_model_input`] of the sample, then [`step`] with
/// its output. The starting noise is scaled by [`init_noise_sigma`].
///
/// [`timesteps`]: Scheduler::timesteps
/// [`scale_model_input`]: Scheduler::scale_model_input
/// [`step`]: Scheduler::step
/// [`init_noise_sigma`]: Scheduler::init_noise_sigma
pub trait Scheduler {
    /// Why a step could not be taken.
    type Error: std::error::Error + Send + Sync + 'static;

    /// The timestep of every model call, in order (DDIM's and UniPC's integers, Heun's float32
    /// values, each exactly as an f64).
    fn timesteps(&self) -> Vec<f64>;

    /// The standard deviation of the initial noise: the pipeline multiplies its starting latents
    /// by it.
    fn init_noise_sigma(&self) -> f64;

    /// The model's input at model call `call` (DDIM and UniPC: the sample itself).
    fn scale_model_input(&self, sample: &Tensor, call: usize) -> Result<Tensor, Self::Error>;

    /// One step from `sample`, given the model's output at the current call; the result is the
    /// next call's sample. A step after the last call is an error.
    fn step(&mut self, model_output: &Tensor, sample: &Tensor) -> Result<Tensor, Self::Error>;
}

impl Scheduler for Ddim {
    type Error = DdimError;

    fn timesteps(&self) -> Vec<f64> {
        Ddim::timesteps(self).iter().map(|&t| t as f64).collect()
    }

    fn init_noise_sigma(&self) -> f64 {
        Ddim::init_noise_sigma(self)
    }

    fn scale_model_input(&self, sample: &Tensor, _call: usize) -> Result<Tensor, DdimError> {
        Ok(sample.shallow_clone())
    }

    /// [`Ddim::step`] at the next of [`Ddim::timesteps`].
    fn step(&mut self, model_output: &Tensor, sample: &Tensor) -> Result<Tensor, DdimError> {
        let timestep = self.next_timestep().ok_or(DdimError::Finished { steps: Ddim::timesteps(self).len() as i64 })?;
        Ok(Ddim::step(self, model_output, timestep, sample))
    }
}

impl Scheduler for Heun {
    type Error = HeunError;

    fn timesteps(&self) -> Vec<f64> {
        Heun::timesteps(self).iter().map(|&t| f64::from(t)).collect()
    }

    fn init_noise_sigma(&self) -> f64 {
        f64::from(Heun::init_noise_sigma(self))
    }

    fn scale_model_input(&self, sample: &Tensor, call: usize) -> Result<Tensor, HeunError> {
        Heun::scale_model_input(self, sample, call)
    }

    fn step(&mut self, model_output: &Tensor, sample: &Tensor) -> Result<Tensor, HeunError> {
        Heun::step(self, model_output, sample)
    }
}

impl Scheduler for UniPc {
    type Error = UniPcError;

    fn timesteps(&self) -> Vec<f64> {
        UniPc::timesteps(self).iter().map(|&t| t as f64).collect()
    }

    /// Flow matching starts from unscaled noise: 1.
    fn init_noise_sigma(&self) -> f64 {
        1.0
    }

    fn scale_model_input(&self, sample: &Tensor, _call: usize) -> Result<Tensor, UniPcError> {
        Ok(sample.shallow_clone())
    }

    fn step(&mut self, model_output: &Tensor, sample: &Tensor) -> Result<Tensor, UniPcError> {
        UniPc::step(self, model_output, sample)
    }
}
