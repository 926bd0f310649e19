//! Random-generator preservation around model builds.
//!
//! Building a module runs random initialisation, which advances the generator of the device its
//! parameters are created on. A pipeline that seeds once and draws noise stage by stage would
//! draw different noise if a model were built lazily in between. [`PreservedRng`] snapshots
//! torch's default CPU generator, every CUDA device's generator (when CUDA is available; reading
//! it initialises CUDA on purpose, so a queued `manual_seed` is applied and kept), the MPS
//! generator on macOS, and every generator the pipeline registered; its `Drop` restores them all,
//! also when the build fails or panics.

use std::any::Any;
use std::sync::Arc;

use crate::sync::Shared;

use stageload_torch_sys::{self as shim, GeneratorDevice, ShimError};

/// A generator whose state can be saved and put back: implemented for [`SharedRng`] (a [`Shared`] generator).
pub trait RngSnapshot: Send + Sync {
    /// A copy of the current state.
    fn save(&self) -> Box<dyn Any + Send>;
    /// Puts back a state returned by `save` on the same generator.
    fn restore(&self, state: Box<dyn Any + Send>);
}

/// A `rand` generator shared between the pipeline (which draws from it) and StagedModels (which
/// preserves it around builds), e.g. `SharedRng::new(ChaCha8Rng::seed_from_u64(7))`.
///
/// ```no_run
/// use std::sync::Arc;
///
/// use rand::{Rng, SeedableRng};
/// use rand_chacha::ChaCha8Rng;
/// use stageload::{SharedRng, StagedModels};
///
/// let rng = SharedRng::new(ChaCha8Rng::seed_from_u64(7));
/// let models = StagedModels::builder().register_rng(Arc::new(rng.clone())) /* .model(...).stage(...) */ .build()?;
/// let noise: f32 = rng.lock().gen(); // the same draws whether a model was built in between or not
/// # Ok::<(), stageload::StageError>(())
/// ```
pub type SharedRng<R> = Shared<R>;

impl<R: Clone + Send + 'static> RngSnapshot for Shared<R> {
    fn save(&self) -> Box<dyn Any + Send> {
        Box::new(self.lock().clone())
    }

    fn restore(&self, state: Box<dyn Any + Send>) {
        let state = state.downcast::<R>().expect("state saved from this generator");
        *self.lock() = *state;
    }
}

/// The torch generators present on this machine: CPU, each CUDA device, MPS.
pub fn torch_generators() -> Result<Vec<GeneratorDevice>, ShimError> {
    let mut devices = vec![GeneratorDevice::Cpu];
    devices.extend((0..shim::cuda_device_count()?).map(GeneratorDevice::Cuda));
    if shim::mps_available()? {
        devices.push(GeneratorDevice::Mps);
    }
    Ok(devices)
}

/// A registered generator with its saved state (taken out when restored).
type SavedState = (Arc<dyn RngSnapshot>, Option<Box<dyn Any + Send>>);

/// Saved states of every generator; restores them when dropped.
pub struct PreservedRng {
    torch: Vec<(GeneratorDevice, Vec<u8>)>,
    registered: Vec<SavedState>,
}

impl PreservedRng {
    /// Snapshots torch's generators and each of `registered`.
    pub fn save(registered: &[Arc<dyn RngSnapshot>]) -> Result<Self, ShimError> {
        let torch = torch_generators()?
            .into_iter()
            .map(|device| Ok((device, shim::generator_state(device)?)))
            .collect::<Result<_, ShimError>>()?;
        let registered = registered.iter().map(|rng| (Arc::clone(rng), Some(rng.save()))).collect();
        Ok(PreservedRng { torch, registered })
    }
}

impl Drop for PreservedRng {
    fn drop(&mut self) {
        for (device, state) in &self.torch {
            if let Err(err) = shim::set_generator_state(*device, state) {
                // Cannot propagate from Drop; a state read from this very generator is always
                // accepted by libtorch, so this is not expected.
                tracing::error!(?device, %err, "restoring a generator state failed");
            }
        }
        for (rng, state) in &mut self.registered {
            if let Some(state) = state.take() {
                rng.restore(state);
            }
        }
    }
}
