//! Release and reload in place measured on the process RSS. Alone in its own test binary, so
//! that no other test allocates or frees memory between the readings; its tests take [`alone`]
//! first, so that they do not run beside each other either.

use std::path::PathBuf;
use std::sync::Arc;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use stageload::{EventKind, ListSink, ModelSpec, SharedRng, StagedModels};
use tch::nn::{Module, VarStore};
use tch::{Device, Tensor};

use stageload_test_support::torch as support;
use support::{assert_rss_moved, build_mlp, input, mlp, rss_bytes, Mlp};

/// One test at a time: each reads RSS around what it does.
fn alone() -> std::sync::MutexGuard<'static, ()> {
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ONE.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

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
    let _alone = alone();
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

/// The process's anonymous and file-backed resident bytes, read exactly (`/proc/self/smaps_rollup`
/// walks the page tables: `Anonymous`, and `Rss` less it).
fn anonymous_and_file() -> (i64, i64) {
    let rollup = std::fs::read_to_string("/proc/self/smaps_rollup").unwrap();
    let field = |name: &str| -> i64 {
        rollup
            .lines()
            .find_map(|line| line.strip_prefix(name)?.trim().strip_suffix("kB")?.trim().parse::<i64>().ok())
            .unwrap_or_else(|| panic!("no {name} line in /proc/self/smaps_rollup:\n{rollup}"))
            * 1024
    };
    let anonymous = field("Anonymous:");
    (anonymous, field("Rss:") - anonymous)
}

#[test]
fn a_reload_that_maps_brings_the_files_pages_in_and_no_anonymous_memory() {
    let _alone = alone();
    const WIDTH: i64 = 2048; // two 16 MiB matrices
    let (_folder, path) = checkpoint_for("mapped", WIDTH);
    let models = StagedModels::builder()
        .model(ModelSpec::new("big", |_| Ok(build_mlp(WIDTH))).checkpoint([path]).reload(stageload::Reload::Map))
        .stage("use", ["big"])
        .stage("other", Vec::<String>::new())
        .build()
        .unwrap();
    models.enter("use").unwrap();
    let before = models.call("big", |m: &mut Mlp| m.forward(&input(WIDTH))).unwrap();
    // What must move: the two weight matrices, each one entry of the file (the biases too, a
    // few KiB inside the slack). The first load copied them into anonymous memory; a release
    // frees it; the reload gives the storages the file's pages in its place and allocates
    // nothing for them, and the forward, which reads every weight, brings those pages in.
    // Allowed beside them: `rss_slack` of the matrices.
    let matrices = 2 * WIDTH * WIDTH * 4;
    let slack = stageload_test_support::memory::rss_slack(matrices);
    let (anonymous, _) = anonymous_and_file();
    models.enter("other").unwrap();
    let (released_anonymous, released_file) = anonymous_and_file();
    assert_rss_moved("fell (anonymous)", anonymous - released_anonymous, matrices);
    models.enter("use").unwrap();
    let again = models.call("big", |m: &mut Mlp| m.forward(&input(WIDTH))).unwrap();
    let (mapped_anonymous, mapped_file) = anonymous_and_file();
    assert_rss_moved("rose (file pages)", mapped_file - released_file, matrices);
    let grew = mapped_anonymous - released_anonymous;
    assert!(grew < slack, "anonymous memory grew by {grew} bytes for {matrices} mapped (slack {slack})");
    assert!(again.equal(&before), "bit for bit");
    models.enter("other").unwrap();
    let (_, unmapped_file) = anonymous_and_file();
    assert_rss_moved("fell (file pages unmapped)", mapped_file - unmapped_file, matrices);
}
