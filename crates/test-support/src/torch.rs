//! What the tests that run libtorch in their own process share: a small real tch model, the
//! process's RSS, and the one lock on torch's global generator.

pub use crate::memory::{assert_rss_moved, rss_bytes, rss_slack, ELSEWHERE};
use stageload::Built;
use std::sync::{Mutex, MutexGuard};
use tch::nn::{self, Module, VarStore};

use tch::{Device, Kind, Tensor};

/// One test at a time draws from torch's global CPU generator: every test of a binary that
/// seeds it, builds a model with random initialisation or draws a random tensor holds this for
/// its whole run, so that no other test's draw lands between its seed and its own draws.
pub fn generator() -> MutexGuard<'static, ()> {
    static GENERATOR: Mutex<()> = Mutex::new(());
    GENERATOR.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Two square linear layers with a ReLU between: the tests' small real model.
#[derive(Debug)]
pub struct Mlp {
    /// The first layer (`l1.weight`, `l1.bias`).
    pub l1: nn::Linear,
    /// The second layer.
    pub l2: nn::Linear,
}

impl Module for Mlp {
    fn forward(&self, xs: &Tensor) -> Tensor {
        xs.apply(&self.l1).relu().apply(&self.l2)
    }
}

/// An [`Mlp`] of `width` features, its variables in `vs` (randomly initialised).
pub fn mlp(vs: &VarStore, width: i64) -> Mlp {
    let root = vs.root();
    Mlp {
        l1: nn::linear(&root / "l1", width, width, Default::default()),
        l2: nn::linear(&root / "l2", width, width, Default::default()),
    }
}

/// A CPU [`Mlp`] of `width` features as a loader returns it.
pub fn build_mlp(width: i64) -> Built {
    let vs = VarStore::new(Device::Cpu);
    let model = mlp(&vs, width);
    Built::new(model, &vs)
}

/// A batch of two rows of ones, `width` wide.
pub fn input(width: i64) -> Tensor {
    Tensor::ones([2, width], (Kind::Float, Device::Cpu))
}
