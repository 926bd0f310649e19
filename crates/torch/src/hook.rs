//! Stage entry on code you do not own.
//!
//! A pipeline's run loop calls its modules in order; [`EnterOnCall`] wraps one of them (or any
//! value or closure) so that calling it first enters a stage, and optionally marks the end of
//! its work afterwards. The pipeline's own code stays unchanged: swap the module for the
//! wrapper where the pipeline is assembled.

use std::sync::Arc;

use tch::Tensor;

use crate::staged::{StageError, StagedModels};

/// `inner`, entering `stage` of `models` whenever it is called while another stage is current.
///
/// ```no_run
/// # use std::sync::Arc;
/// # use stageload::{hook::EnterOnCall, StagedModels};
/// # fn run(models: Arc<StagedModels>, vae: tch::CModule, x: &tch::Tensor) -> Result<(), Box<dyn std::error::Error>> {
/// // Where the pipeline is assembled: its decoder, wrapped.
/// let decoder = EnterOnCall::new(models.clone(), "decode", vae).mark_end("decoded");
/// // Where the pipeline calls it, unchanged but for `call`: "decode" is entered first.
/// let image = decoder.call(|vae| vae.forward_ts(&[x]))??;
/// # Ok(()) }
/// ```
pub struct EnterOnCall<T> {
    models: Arc<StagedModels>,
    stage: String,
    end_mark: Option<String>,
    inner: T,
}

impl<T> EnterOnCall<T> {
    /// Wraps `inner` so that each call enters `stage` of `models` first (unless it is current).
    pub fn new(models: Arc<StagedModels>, stage: impl Into<String>, inner: T) -> Self {
        EnterOnCall { models, stage: stage.into(), end_mark: None, inner }
    }

    /// Emits a `mark` event with `label` after each call.
    pub fn mark_end(mut self, label: impl Into<String>) -> Self {
        self.end_mark = Some(label.into());
        self
    }

    /// The wrapped value, without entering anything.
    pub fn inner(&self) -> &T {
        &self.inner
    }

    /// Enters the stage (unless it is already current), calls `f` on the wrapped value, then
    /// marks the end if asked. An error entering the stage means `f` is not called.
    pub fn call<R>(&self, f: impl FnOnce(&T) -> R) -> Result<R, StageError> {
        if self.models.current_stage().as_deref() != Some(self.stage.as_str()) {
            self.models.enter(&self.stage)?;
        }
        let result = f(&self.inner);
        if let Some(label) = &self.end_mark {
            self.models.mark(label);
        }
        Ok(result)
    }
}

impl<T> std::fmt::Debug for EnterOnCall<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EnterOnCall").field("stage", &self.stage).field("end_mark", &self.end_mark).finish()
    }
}

/// A wrapped tch module stays a module. `Module::forward` cannot return an error, so a failure
/// to enter the stage panics with the registry's message; use [`EnterOnCall::call`] to get it
/// as a `Result`.
impl<T: tch::nn::Module> tch::nn::Module for EnterOnCall<T> {
    fn forward(&self, xs: &Tensor) -> Tensor {
        match self.call(|inner| inner.forward(xs)) {
            Ok(ys) => ys,
            Err(err) => panic!("entering stage '{}' before a forward pass: {err}", self.stage),
        }
    }
}
