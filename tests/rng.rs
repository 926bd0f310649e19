//! RNG preservation around builds, with its control, and a failing or panicking loader leaving
//! the generators as they were. Alone in its own test binary: other tests build models, which
//! draw from torch's global CPU generator, and would race with these readings. The two tests
//! here take `support::generator()` so that they do not race with each other either.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use stageload::{EventKind, ListSink, ModelSpec, SharedRng, StageError, StagedModels};
use tch::{Device, Kind, Tensor};

use stageload_test_support::torch as support;
use support::{build_mlp, Mlp};

/// Seeds, draws torch and ChaCha noise, builds a model lazily between the draws, draws again.
fn seeded_run(preserve: bool) -> (Tensor, Tensor, u64, u64) {
    let chacha = SharedRng::new(ChaCha8Rng::seed_from_u64(11));
    let models = StagedModels::builder()
        .model(ModelSpec::new("lazy", {
            let chacha = chacha.clone();
            move |_| {
                let built = build_mlp(32);
                let _: u64 = chacha.lock().gen(); // a loader that draws from the pipeline's RNG too
                Ok(built)
            }
        }))
        .stage("s", ["lazy"])
        .register_rng(Arc::new(chacha.clone()))
        .preserve_rng(preserve)
        .build()
        .unwrap();
    tch::manual_seed(5);
    let first = Tensor::randn([16], (Kind::Float, Device::Cpu));
    let c1: u64 = chacha.lock().gen();
    models.enter("s").unwrap();
    models.get::<Mlp>("lazy").unwrap();
    let second = Tensor::randn([16], (Kind::Float, Device::Cpu));
    let c2: u64 = chacha.lock().gen();
    (first, second, c1, c2)
}

#[test]
fn builds_preserve_every_rng_and_the_control_drifts() {
    let _generator = support::generator();
    // Reference: the same draws with no build in between.
    tch::manual_seed(5);
    let first = Tensor::randn([16], (Kind::Float, Device::Cpu));
    let second = Tensor::randn([16], (Kind::Float, Device::Cpu));
    let mut reference = ChaCha8Rng::seed_from_u64(11);
    let (c1, c2): (u64, u64) = (reference.gen(), reference.gen());

    let (f, s, d1, d2) = seeded_run(true);
    assert!(f.equal(&first) && s.equal(&second), "torch noise unchanged by the lazy build");
    assert_eq!((d1, d2), (c1, c2), "ChaCha noise unchanged by the lazy build");

    let (f, s, d1, d2) = seeded_run(false);
    assert!(f.equal(&first) && d1 == c1, "draws before the build still match");
    assert!(!s.equal(&second), "without preservation the torch draw after the build drifts");
    assert_ne!(d2, c2, "without preservation the ChaCha draw after the build drifts");
}

#[test]
fn failing_and_panicking_loaders_leave_the_slot_unloaded_and_the_rng_restored() {
    let _generator = support::generator();
    let attempts = Arc::new(AtomicUsize::new(0));
    let sink = Arc::new(ListSink::new());
    let models = StagedModels::builder()
        .model(ModelSpec::new("fails", |_| {
            let _ = Tensor::randn([100], (Kind::Float, Device::Cpu));
            Err("weights folder not found".into())
        }))
        .model(ModelSpec::new("panics", {
            let attempts = attempts.clone();
            move |_| {
                let _ = Tensor::randn([100], (Kind::Float, Device::Cpu));
                if attempts.fetch_add(1, Ordering::SeqCst) == 0 {
                    panic!("shape bug in the loader");
                }
                Ok(build_mlp(4))
            }
        }))
        .model(ModelSpec::new("fine", |_| Ok(build_mlp(4))))
        .events(sink.clone())
        .build()
        .unwrap();
    tch::manual_seed(8);
    let state = stageload_torch_sys::generator_state(stageload_torch_sys::GeneratorDevice::Cpu).unwrap();
    let err = models.get::<Mlp>("fails").err().unwrap();
    assert!(err.to_string().contains("'fails'") && err.to_string().contains("weights folder not found"), "{err}");
    let err = models.get::<Mlp>("panics").err().unwrap();
    assert!(matches!(err, StageError::LoaderPanicked { .. }) && err.to_string().contains("shape bug"), "{err}");
    assert_eq!(stageload_torch_sys::generator_state(stageload_torch_sys::GeneratorDevice::Cpu).unwrap(), state);
    assert!(models.resident().is_empty());
    assert_eq!(sink.of_kind(EventKind::Error).len(), 2);
    // The registry stays usable, and the slot can be tried again.
    assert!(models.get::<Mlp>("fine").is_ok());
    assert!(models.get::<Mlp>("panics").is_ok());
    assert_eq!(sink.of_kind(EventKind::Load).len(), 2);
}
