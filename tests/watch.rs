//! What the tests of the pipelines written by others (`stable_diffusion`, `shap_e`, `wan`) share: a
//! registry that records what was resident inside every model call, a bit-for-bit tensor
//! comparison, events of one kind, and values made once for a module's tests (its runs, the
//! reference).

use std::sync::Mutex;

use stageload::{BoxError, Event, EventKind, StagedModels};
use stageload_pipelines::runner::StageRunner;
use tch::{Kind, Tensor};

/// One model call as the watching runner saw it: the stage, the model, what was resident.
#[derive(Debug, Clone, PartialEq)]
pub struct Call {
    pub stage: Option<String>,
    pub model: String,
    pub resident: Vec<String>,
}

/// A registry that records, inside every model call, what was resident.
pub struct Watch<'a> {
    pub models: &'a StagedModels,
    pub calls: Mutex<Vec<Call>>,
}

impl<'a> Watch<'a> {
    pub fn new(models: &'a StagedModels) -> Self {
        Watch { models, calls: Mutex::default() }
    }

    /// The calls recorded.
    pub fn into_calls(self) -> Vec<Call> {
        self.calls.into_inner().unwrap_or_else(|p| p.into_inner())
    }
}

impl StageRunner for Watch<'_> {
    fn enter(&self, stage: &str) -> Result<(), BoxError> {
        self.models.enter(stage)?;
        Ok(())
    }

    fn call<M: 'static, R>(&self, model: &str, f: impl FnOnce(&mut M) -> R) -> Result<R, BoxError> {
        Ok(self.models.call(model, |m: &mut M| {
            let call =
                Call { stage: self.models.current_stage(), model: model.to_string(), resident: self.models.resident() };
            self.calls.lock().unwrap_or_else(|p| p.into_inner()).push(call);
            f(m)
        })?)
    }
}

/// Asserts that two tensors hold the same bits (stricter than `Tensor::equal` for floats, which
/// counts -0 equal to +0); reports how many values differ and the largest difference.
pub fn assert_bits_equal(what: &str, a: &Tensor, b: &Tensor) {
    assert_eq!((a.kind(), a.size()), (b.kind(), b.size()), "{what}: kinds and shapes");
    let bits = |t: &Tensor| match t.kind() {
        Kind::Float => t.contiguous().view_dtype(Kind::Int),
        Kind::BFloat16 | Kind::Half => t.contiguous().view_dtype(Kind::Int16),
        Kind::Double => t.contiguous().view_dtype(Kind::Int64),
        _ => t.shallow_clone(),
    };
    let (a_bits, b_bits) = (bits(a), bits(b));
    if !a_bits.equal(&b_bits) {
        let differing = a_bits.ne_tensor(&b_bits).sum(Kind::Int64).int64_value(&[]);
        let largest = (a.to_kind(Kind::Double) - b.to_kind(Kind::Double)).abs().max().double_value(&[]);
        panic!("{what}: {differing} of {} values differ, the largest by {largest:e}", a.numel());
    }
}

/// The events of `kind`.
pub fn of_kind(events: &[Event], kind: EventKind) -> Vec<&Event> {
    events.iter().filter(|e| e.kind() == kind).collect()
}

/// The models loaded by a prefetch, sorted: two stages' prefetches may overlap (the second may
/// start while the first still copies) and the smaller model's load end first, so a test claims
/// which models were prefetched, not in what order.
pub fn prefetched_models(events: &[Event]) -> Vec<String> {
    let mut models: Vec<String> = of_kind(events, EventKind::Load)
        .iter()
        .filter(|e| e.prefetched())
        .map(|e| e.model().map(str::to_string).unwrap_or_default())
        .collect();
    models.sort();
    models
}

/// A value a module's tests make once and share (its Rust runs, diffusers' reference), or the
/// error making it gave.
pub type Shared<T> = Mutex<Option<Result<T, String>>>;

/// Runs `check` on the value in `slot`, made by `make` the first time, while holding `slot`; a
/// failed `make` fails every test that asks, with its error.
pub fn with_shared<T, R>(slot: &Shared<T>, make: impl FnOnce() -> Result<T, String>, check: impl FnOnce(&T) -> R) -> R {
    let mut guard = slot.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    match guard.get_or_insert_with(make) {
        Ok(value) => check(value),
        Err(error) => panic!("{error}"),
    }
}
