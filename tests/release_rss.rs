//! Release and reload in place measured on the process RSS. Alone in its own test binary, so
//! that no other test allocates or frees memory between the readings.

use std::path::PathBuf;
use std::sync::Arc;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use stageload::{EventKind, ListSink, ModelSpec, SharedRng, StagedModels};
use tch::nn::{Module, VarStore};
use tch::{Device, Tensor};

use stageload_test_support::torch as support;
use support::{assert_rss_moved, build_mlp, input, mlp, rss_bytes, Mlp};

/// A checkpoint of an MLP in a folder of its own, removed when the folder is dropped.
fn checkpoint_for(name: &str, width: i64) -> (tempfile::TempDir, PathBuf) {
    let folder = tempfile::Builder::new().prefix("stageload-rss-").tempdir().unwrap();
    let path = folder.path().join(format!("{name}-{width}.safetensors"));
    let vs = VarStore::new(Device::Cpu);
    let _ = mlp(&vs, width);
    let vars: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    stageload::checkpoint::save(&vars, &path).unwrap();
    (folder, path)
}

#[test]
fn release_returns_memory_and_reload_in_place_brings_it_back_without_drawing() {
    const WIDTH: i64 = 2048; // two 16 MiB matrices
    let (_folder, path) = checkpoint_for("big", WIDTH);
    let sink = Arc::new(ListSink::new());
    let chacha = SharedRng::new(ChaCha8Rng::seed_from_u64(3));
    let models = StagedModels::builder()
        .model(ModelSpec::new("big", |_| Ok(build_mlp(WIDTH))).checkpoint([path]))
        .stage("use", ["big"])
        .stage("other", Vec::<String>::new())
        .register_rng(Arc::new(chacha.clone()))
        .events(sink.clone())
        .build()
        .unwrap();
    models.enter("use").unwrap();
    let big = models.get::<Mlp>("big").unwrap();
    let before = big.lock().unwrap().forward(&input(WIDTH));
    let model_bytes = 2 * (WIDTH * WIDTH + WIDTH) * 4;
    // What RSS must move by: the two weight matrices, each in a mapping of its own (above the
    // mmap threshold the registry sets), every page written, unmapped by a release and mapped
    // and filled again by a reload. The biases live in the heap, where the release's trim may
    // give their pages back or not, and where the registry's own few allocations for a stage
    // change come from. Allowed: what that code may touch or free beside them, capped at a
    // quarter of the matrices (`assert_rss_moved`, `rss_slack`).
    let matrices = 2 * WIDTH * WIDTH * 4;

    let resident = rss_bytes();
    models.enter("other").unwrap();
    let released = rss_bytes();
    assert_rss_moved("fell", resident - released, matrices);

    tch::manual_seed(99);
    let torch_state = stageload_torch_sys::generator_state(stageload_torch_sys::GeneratorDevice::Cpu).unwrap();
    let chacha_next = chacha.lock().clone().gen::<u64>();
    models.enter("use").unwrap();
    let again = models.get::<Mlp>("big").unwrap();
    assert_rss_moved("came back", rss_bytes() - released, matrices);
    assert!(!big.is_released(), "the old handle works again: same object");
    assert!(big.lock().unwrap().forward(&input(WIDTH)).equal(&before));
    assert!(again.lock().unwrap().forward(&input(WIDTH)).equal(&before));
    assert_eq!(stageload_torch_sys::generator_state(stageload_torch_sys::GeneratorDevice::Cpu).unwrap(), torch_state);
    assert_eq!(chacha.lock().gen::<u64>(), chacha_next);
    let reload = &sink.of_kind(EventKind::Reload)[0];
    assert_eq!(reload.reload_from(), Some(stageload::ReloadFrom::InPlace));
    assert_eq!(reload.bytes(), Some(model_bytes as u64));
}
