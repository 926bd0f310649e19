//! The host tier inside the registry, run on the CPU: the registry's tier holds device models
//! only, so these tests switch it on for CPU models ([`StagedModelsBuilder::tier_on_cpu`]); the
//! copies themselves are the real ones (pageable here, pinned on a GPU machine, where
//! `cargo xtask gpu-check` runs the same path on CUDA).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tch::{Device, Kind, Tensor};

use super::{Built, ModelSpec, StageError, StagedModels, StagedModelsBuilder};
use stageload_trace::event::{EventKind, ListSink, ReloadFrom, TierAction, What};

/// A model of one random `[n]` float tensor, no checkpoint, counting its builds.
fn random_model(name: &str, n: i64, builds: Arc<AtomicUsize>) -> ModelSpec {
    ModelSpec::new(name, move |_| {
        builds.fetch_add(1, Ordering::SeqCst);
        let weight = Tensor::randn([n], (Kind::Float, Device::Cpu));
        Ok(Built::from_tensors(weight.shallow_clone(), vec![("weight".to_string(), weight)]))
    })
}

/// Models `a`, `b`, `c` of `sizes` floats, one stage each (`sa`, `sb`, `sc`), a tier of `budget`
/// bytes; the builds of each model counted.
fn registry(sizes: [i64; 3], budget: u64) -> (StagedModels, Arc<ListSink>, [Arc<AtomicUsize>; 3]) {
    let sink = Arc::new(ListSink::new());
    let builds = [(); 3].map(|_| Arc::new(AtomicUsize::new(0)));
    let mut builder: StagedModelsBuilder =
        StagedModels::builder().host_tier(budget).tier_on_cpu().events(sink.clone()).preserve_rng(false);
    for ((name, n), count) in ["a", "b", "c"].into_iter().zip(sizes).zip(&builds) {
        builder = builder.model(random_model(name, n, Arc::clone(count))).stage(format!("s{name}"), [name]);
    }
    (builder.build().unwrap(), sink, builds)
}

fn weight(models: &StagedModels, name: &str) -> Tensor {
    models.call(name, |w: &mut Tensor| w.copy()).unwrap()
}

fn tier_actions(sink: &ListSink) -> Vec<(String, TierAction)> {
    let events = sink.events().into_iter();
    events.filter_map(|e| if let What::Tier(tier) = e.what { Some((tier.model?, tier.action)) } else { None }).collect()
}

#[test]
fn a_released_model_comes_back_from_the_host_tier_bit_identical_without_being_rebuilt() {
    let (models, sink, builds) = registry([1024, 8, 8], 1 << 20);
    models.enter("sa").unwrap();
    let before = weight(&models, "a");
    models.enter("sb").unwrap();
    models.get::<Tensor>("b").unwrap();
    let usage = models.host_tier().unwrap();
    assert_eq!((usage.budget, usage.used), (1 << 20, 4096), "a's 4 KiB in the tier");
    assert_eq!(models.resident_bytes(), 32, "a's storage is freed all the same");

    models.enter("sa").unwrap();
    assert!(weight(&models, "a").equal(&before), "bit for bit");
    assert_eq!(builds[0].load(Ordering::SeqCst), 1, "no rebuild (it has no checkpoint: it would have been)");
    let reload = sink.of_kind(EventKind::Reload).into_iter().find(|e| e.model() == Some("a")).unwrap();
    assert_eq!(reload.reload_from(), Some(ReloadFrom::HostTier));
    // b's 32 bytes take a page of their own.
    assert_eq!(reload.tier().unwrap().used, crate::pinned::booked(&[32]), "a's copy given up, b's stored meanwhile");
    assert_eq!(tier_actions(&sink), [("a".into(), TierAction::Stored), ("b".into(), TierAction::Stored)]);
}

#[test]
fn the_least_recently_released_copy_is_evicted_and_its_model_rebuilt() {
    // Room for two of the three 4 KiB models.
    let (models, sink, builds) = registry([1024, 1024, 1024], 9000);
    for stage in ["sa", "sb", "sc", "sa"] {
        models.enter(stage).unwrap();
        models.get::<Tensor>(&stage[1..]).unwrap();
    }
    // Entering sc stored b (a and b in); entering sa again stored c and evicted a.
    let actions = tier_actions(&sink);
    assert_eq!(
        actions[..4],
        [
            ("a".into(), TierAction::Stored),
            ("b".into(), TierAction::Stored),
            ("a".into(), TierAction::Evicted),
            ("c".into(), TierAction::Stored)
        ]
    );
    assert_eq!(builds[0].load(Ordering::SeqCst), 2, "a rebuilt: its copy was evicted");
    let reload = sink.of_kind(EventKind::Reload).pop().unwrap();
    assert_eq!((reload.model(), reload.reload_from()), (Some("a"), Some(ReloadFrom::Rebuilt)));
    assert_eq!(models.host_tier().unwrap().used, 8192, "b and c");
}

#[test]
fn a_model_larger_than_the_budget_is_not_stored_and_the_event_names_both_sizes() {
    let (models, sink, _) = registry([1 << 20, 8, 8], 1 << 20);
    models.enter("sa").unwrap();
    models.get::<Tensor>("a").unwrap();
    models.enter("sb").unwrap();
    let event = sink.of_kind(EventKind::Tier).into_iter().next().unwrap();
    let note = event.note().unwrap();
    assert!(note.starts_with("not stored") && note.contains("4.0 MiB") && note.contains("1.0 MiB"), "{note}");
    assert_eq!(models.host_tier().unwrap().used, 0);
}

#[test]
fn shrinking_the_budget_evicts_what_it_can_and_refuses_below_a_pinned_models_copy() {
    let (models, sink, _) = registry([1024, 1024, 8], 1 << 20);
    for stage in ["sa", "sb", "sc"] {
        models.enter(stage).unwrap();
        models.get::<Tensor>(&stage[1..]).unwrap();
    }
    assert_eq!(models.host_tier().unwrap().used, 8192);
    models.pin("b").unwrap();
    let refused = models.set_host_tier_budget(1000).unwrap_err();
    assert!(matches!(refused, StageError::HostTierBudget { asked: 1000, protected: 4096, budget: 1_048_576 }));
    assert!(refused.to_string().contains("the budget stays 1.0 MiB"), "{refused}");
    assert_eq!(models.host_tier().unwrap().used, 8192, "a refusal evicts nothing");

    models.set_host_tier_budget(5000).unwrap();
    let usage = models.host_tier().unwrap();
    assert_eq!((usage.budget, usage.used), (5000, 4096), "a evicted, b (pinned) kept");
    assert!(tier_actions(&sink).contains(&("a".into(), TierAction::Evicted)));
}

#[test]
fn closing_does_not_copy_models_into_the_tier_and_empties_it() {
    let (models, sink, _) = registry([1024, 1024, 8], 1 << 20);
    models.enter("sa").unwrap();
    models.get::<Tensor>("a").unwrap();
    models.enter("sb").unwrap();
    models.get::<Tensor>("b").unwrap();
    models.close();
    assert_eq!(tier_actions(&sink), [("a".into(), TierAction::Stored)], "b released by close, not stored");
    assert_eq!(models.host_tier().unwrap().used, 0);
}

#[test]
fn a_prefetch_brings_a_model_back_from_the_tier_in_the_background() {
    let (models, sink, builds) = registry([1024, 8, 8], 1 << 20);
    models.enter("sa").unwrap();
    let before = weight(&models, "a");
    models.enter("sb").unwrap();
    assert_eq!(models.prefetch("sa").unwrap(), ["a"], "no checkpoint, yet no random number drawn");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while models.states().iter().any(|(name, state)| name == "a" && *state != super::ModelState::Resident) {
        assert!(std::time::Instant::now() < deadline, "the prefetch did not finish in 20 s");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    models.enter("sa").unwrap();
    assert!(weight(&models, "a").equal(&before));
    assert_eq!(builds[0].load(Ordering::SeqCst), 1);
    let reload = sink.of_kind(EventKind::Reload).into_iter().find(|e| e.model() == Some("a")).unwrap();
    assert!(reload.prefetched() && reload.reload_from() == Some(ReloadFrom::HostTier), "{reload:?}");
}

#[test]
fn a_model_in_use_when_its_stage_ends_is_stored_when_its_user_lets_go() {
    let (models, sink, builds) = registry([1024, 8, 8], 1 << 20);
    models.enter("sa").unwrap();
    let handle = models.get::<Tensor>("a").unwrap();
    let guard = handle.lock().unwrap();
    let before = guard.copy();
    models.enter("sb").unwrap();
    assert!(tier_actions(&sink).is_empty(), "the release waits for the guard");
    drop(guard);
    assert_eq!(tier_actions(&sink), [("a".into(), TierAction::Stored)], "stored by the guard's release");
    models.enter("sa").unwrap();
    assert!(weight(&models, "a").equal(&before));
    assert_eq!(builds[0].load(Ordering::SeqCst), 1);
}

/// A model of four 1 KiB blocks streamed under a budget that keeps one resident: its
/// forward adds each block's weight to the input.
struct Streamed {
    streamed: crate::stream::StreamedModel,
    blocks: Vec<Tensor>,
}

fn streamed_model(file: std::path::PathBuf, builds: Arc<AtomicUsize>) -> ModelSpec {
    ModelSpec::new("s", move |_| {
        builds.fetch_add(1, Ordering::SeqCst);
        let blocks: Vec<Tensor> = (0..4).map(|_| Tensor::zeros([256], (Kind::Float, Device::Cpu))).collect();
        let tensors = blocks.iter().enumerate().map(|(i, t)| (format!("blocks.{i}"), t.shallow_clone())).collect();
        let checkpoint = crate::checkpoint::Checkpoint::open(&[&file])?;
        let spec = crate::stream::BlockSpec::new(["blocks.*"]);
        // One resident block and two slots, each block 1 KiB and the room for its file phase.
        let budget = 3 * (1024 + stageload_plan::split::FILE_PHASE_ROOM);
        let mut streamed =
            crate::stream::StreamedModel::new("s", tensors, checkpoint, &crate::NameRules::default(), &spec, budget)?;
        streamed.reading(|| None);
        let tensors = streamed.tensors();
        Ok(Built::from_tensors(Streamed { streamed, blocks }, tensors))
    })
}

fn forward(models: &StagedModels) -> Tensor {
    models
        .call("s", |m: &mut Streamed| {
            let blocks = &m.blocks;
            m.streamed.run(|step| {
                let mut x = Tensor::zeros([256], (Kind::Float, Device::Cpu));
                for (i, block) in blocks.iter().enumerate() {
                    step.block(i)?;
                    x += block;
                }
                Ok(x)
            })
        })
        .unwrap()
        .unwrap()
}

#[test]
fn a_streamed_model_is_not_stored_evicts_nothing_and_is_rebuilt_the_same() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("s.safetensors");
    let weights: Vec<(String, Tensor)> =
        (0..4).map(|i| (format!("blocks.{i}"), Tensor::randn([256], (Kind::Float, Device::Cpu)))).collect();
    crate::checkpoint::save(&weights, &file).unwrap();
    let expected = weights.iter().fold(Tensor::zeros([256], (Kind::Float, Device::Cpu)), |x, (_, w)| x + w);

    let sink = Arc::new(ListSink::new());
    let (a_builds, s_builds) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    // Room for a's 4 KiB copy and not for both: storing s would have evicted a.
    let models = StagedModels::builder()
        .host_tier(6 * 1024)
        .tier_on_cpu()
        .events(sink.clone())
        .preserve_rng(false)
        .model(random_model("a", 1024, Arc::clone(&a_builds)))
        .model(streamed_model(file, Arc::clone(&s_builds)))
        .stage("sa", ["a"])
        .stage("ss", ["s"])
        .build()
        .unwrap();
    models.enter("sa").unwrap();
    let a = weight(&models, "a");
    models.enter("ss").unwrap();
    assert!(forward(&models).equal(&expected));
    models.enter("sa").unwrap();
    assert!(weight(&models, "a").equal(&a));
    assert_eq!(a_builds.load(Ordering::SeqCst), 1, "a came back from the tier: s evicted nothing");
    models.enter("ss").unwrap();
    assert!(forward(&models).equal(&expected), "rebuilt, the same output");
    assert_eq!(s_builds.load(Ordering::SeqCst), 2);

    assert_eq!(tier_actions(&sink)[..2], [("a".into(), TierAction::Stored), ("s".into(), TierAction::NotStored)]);
    let note = sink.of_kind(EventKind::Tier).into_iter().filter_map(|e| e.note()).find(|n| n.contains("'s'")).unwrap();
    // Its 3 streamed blocks, and the slot whose buffer the read carried to its next step holds.
    assert!(note.contains("'s' has 4 tensors with no memory now"), "{note}");
}

/// Copies into and out of the tier held at gates the test opens one by one: the `n`th copy
/// (counted over both directions) waits for `open(n)` and then fails when `fail(n)` says so.
struct Gates {
    started: std::sync::mpsc::Receiver<usize>,
    open: Vec<std::sync::mpsc::Sender<()>>,
}

const DEADLINE: std::time::Duration = std::time::Duration::from_secs(20);

/// A registry of one model `m` (seeded random weights, no checkpoint), stages `use` [m] and
/// `other` [], a tier on the CPU whose first `held` copies wait at gates; `fail(n, into)` says
/// whether the `n`th copy fails.
fn gated(held: usize, fail: impl Fn(usize, bool) -> bool + Send + Sync + 'static) -> (Arc<StagedModels>, Gates) {
    let (started_tx, started) = std::sync::mpsc::channel();
    let (mut open, mut waits) = (Vec::new(), Vec::new());
    for _ in 0..held {
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        open.push(tx);
        waits.push(std::sync::Mutex::new(rx));
    }
    let count = AtomicUsize::new(0);
    let started_tx = std::sync::Mutex::new(started_tx);
    let models = StagedModels::builder()
        .host_tier(1 << 20)
        .tier_on_cpu()
        .tier_copy_hook(move |_, into| {
            let n = count.fetch_add(1, Ordering::SeqCst);
            if let Some(wait) = waits.get(n) {
                let _ = started_tx.lock().unwrap().send(n);
                wait.lock().unwrap().recv_timeout(DEADLINE).map_err(|_| "the test never opened the gate")?;
            }
            if fail(n, into) {
                return Err(format!("copy {n} failed on purpose"));
            }
            Ok(())
        })
        .model(random_model("m", 256, Arc::new(AtomicUsize::new(0))))
        .stage("use", ["m"])
        .stage("other", Vec::<String>::new())
        .preserve_rng(false)
        .build()
        .unwrap();
    (Arc::new(models), Gates { started, open })
}

impl Gates {
    /// Waits until copy `n` is at its gate.
    fn reached(&self, n: usize) {
        assert_eq!(self.started.recv_timeout(DEADLINE), Ok(n), "copy {n} never reached its gate");
    }

    fn open(&self, n: usize) {
        self.open[n].send(()).unwrap();
    }
}

/// `enter(stage)` on a thread of its own (it blocks while a copy waits at a gate).
fn enter_on_thread(models: &Arc<StagedModels>, stage: &'static str) -> std::thread::JoinHandle<()> {
    let models = Arc::clone(models);
    std::thread::spawn(move || {
        models.enter(stage).unwrap();
    })
}

/// A prebuilt model of `[256]` floats, all `value`.
fn filled(value: f64) -> (Built, Tensor) {
    let weight = Tensor::full([256], value, (Kind::Float, Device::Cpu));
    (Built::from_tensors(weight.shallow_clone(), vec![("weight".to_string(), weight.shallow_clone())]), weight.copy())
}

/// The race on purpose: `m`, resident in `use`, is released into the tier (copy 0, held at its
/// gate); meanwhile `replace` puts a new `m` in its place, which is released in turn (copy 1,
/// held); then the old copy finishes first, while the new reservation still waits for its own.
fn replace_during_a_copy(models: &Arc<StagedModels>, gates: &Gates, replace: impl FnOnce()) {
    let leaving = enter_on_thread(models, "other");
    gates.reached(0);
    replace();
    let again = enter_on_thread(models, "other");
    gates.reached(1);
    gates.open(0);
    leaving.join().unwrap();
    gates.open(1);
    again.join().unwrap();
}

#[test]
fn an_insert_during_a_copy_into_the_tier_never_gets_the_old_instances_weights_back() {
    let (models, gates) = gated(2, |_, _| false);
    models.enter("use").unwrap();
    let old = weight(&models, "m");
    let (built, new) = filled(3.0);
    replace_during_a_copy(&models, &gates, || models.insert("m", built).unwrap());
    models.enter("use").unwrap();
    let back = weight(&models, "m");
    assert!(back.equal(&new), "the new instance's weights, bit for bit");
    assert!(!back.equal(&old));
}

#[test]
fn a_failed_copy_of_the_old_instance_leaves_the_new_instances_reservation_alone() {
    let (models, gates) = gated(2, |n, _| n == 0);
    models.enter("use").unwrap();
    models.load("m").unwrap();
    let (built, new) = filled(5.0);
    replace_during_a_copy(&models, &gates, || models.insert("m", built).unwrap());
    models.enter("use").unwrap();
    // An inserted model has no loader: only its own copy in the tier brings it back.
    assert!(weight(&models, "m").equal(&new));
}

#[test]
fn a_reload_from_the_tier_racing_an_insert_does_not_take_the_new_instances_copy() {
    // Copy 0: the old instance into the tier (opened at once); copy 1: its reload (held); copy
    // 2: the new instance into the tier (no gate).
    let (models, gates) = gated(2, |_, _| false);
    models.enter("use").unwrap();
    models.load("m").unwrap();
    let leaving = enter_on_thread(&models, "other");
    gates.reached(0);
    gates.open(0);
    leaving.join().unwrap();
    models.enter("use").unwrap();
    let reload = {
        let models = Arc::clone(&models);
        std::thread::spawn(move || models.call("m", |w: &mut Tensor| w.copy()))
    };
    gates.reached(1);
    let (built, new) = filled(7.0);
    models.insert("m", built).unwrap();
    models.enter("other").unwrap();
    gates.open(1);
    // The reload overtaken by the insert hands back the model now in the slot: the new one,
    // which comes back from its own copy.
    let got = reload.join().unwrap().unwrap();
    assert!(got.equal(&new), "the reload gives the new instance");
    models.enter("other").unwrap();
    models.enter("use").unwrap();
    assert!(weight(&models, "m").equal(&new), "and the new instance's copy is still there");
}

#[test]
fn a_remove_during_a_copy_then_a_new_model_of_that_name_gets_only_its_own_weights() {
    let (models, gates) = gated(2, |_, _| false);
    models.enter("use").unwrap();
    models.load("m").unwrap();
    let (built, new) = filled(9.0);
    replace_during_a_copy(&models, &gates, || {
        models.remove("m").unwrap();
        models.insert("m", built).unwrap();
    });
    let back = models.call("m", |w: &mut Tensor| w.copy()).unwrap();
    assert!(back.equal(&new));
}

/// The wait before every copy piece in the slow-copy run below.
const SLOW: std::time::Duration = std::time::Duration::from_millis(20);

#[test]
#[ignore = "the process of slow_host_tier_copies_change_no_output_and_free_nothing_a_copy_uses, which starts it"]
fn host_tier_copies_run_slowly_in_a_process_of_their_own() {
    // Process-wide: only this process, which runs this test alone, has it.
    crate::copy_watch::slow_copies(SLOW);
    let (models, sink, builds) = registry([4096, 4096, 4096], 1 << 20);
    models.enter("sa").unwrap();
    let a = weight(&models, "a");
    let started = std::time::Instant::now();
    models.enter("sb").unwrap();
    assert!(started.elapsed() >= SLOW, "a's copy into the tier waited: the mode is on");
    let b = weight(&models, "b");
    // a comes back from the tier in the background, slowly, while a stage that does not list
    // it stores b and overtakes the prefetch.
    assert_eq!(models.prefetch("sa").unwrap(), ["a"]);
    models.enter("sc").unwrap();
    let c = weight(&models, "c");
    for (stage, model, before) in [("sa", "a", &a), ("sb", "b", &b), ("sc", "c", &c)] {
        models.enter(stage).unwrap();
        assert!(weight(&models, model).equal(before), "{model}: the copy back differs");
    }
    assert_eq!(builds.iter().map(|b| b.load(Ordering::SeqCst)).collect::<Vec<_>>(), [1, 1, 1], "no rebuild");
    assert!(sink.of_kind(EventKind::Reload).iter().all(|e| e.reload_from() == Some(ReloadFrom::HostTier)));
    models.close();
    assert_eq!(crate::copy_watch::violations(), Vec::<String>::new());
}

#[test]
fn slow_host_tier_copies_change_no_output_and_free_nothing_a_copy_uses() {
    let name = "staged::tier_tests::host_tier_copies_run_slowly_in_a_process_of_their_own";
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([name, "--exact", "--ignored", "--test-threads=1"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let status = stageload_test_support::pids::wait_for(&mut child, std::time::Duration::from_secs(60))
        .expect("the slow host-tier run ends within 60 s");
    let output = child.wait_with_output().unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert!(status.success() && stdout.contains("1 passed"), "{stdout}\n{stderr}");
}

#[test]
fn what_the_tier_books_is_what_its_memory_gives_out_and_eviction_and_close_give_it_back() {
    let counting = Arc::new(crate::pinned::fake::Counting::default());
    let sink = Arc::new(ListSink::new());
    let builds = [(); 3].map(|_| Arc::new(AtomicUsize::new(0)));
    // In pages: a takes 1, b (three pages and 4 bytes) 4, c 2; the tier has room for 6.
    let page = crate::pinned::booked(&[4]);
    let floats = |bytes: u64| (bytes / 4) as i64;
    let sizes = [floats(page), floats(3 * page + 4), floats(2 * page)];
    let mut builder = StagedModels::builder()
        .host_tier(6 * page + 100)
        .tier_on_cpu()
        .host_memory(counting.clone())
        .events(sink.clone())
        .preserve_rng(false);
    for ((name, n), count) in ["a", "b", "c"].into_iter().zip(sizes).zip(&builds) {
        builder = builder.model(random_model(name, n, Arc::clone(count))).stage(format!("s{name}"), [name]);
    }
    let models = builder.build().unwrap();
    let out = || counting.out.load(Ordering::SeqCst);
    for (stage, used) in [("sa", 0), ("sb", page), ("sc", page + 4 * page)] {
        models.enter(stage).unwrap();
        models.get::<Tensor>(&stage[1..]).unwrap();
        assert_eq!((models.host_tier().unwrap().used, out()), (used, used), "after entering {stage}");
    }
    // Storing c evicts a (the least recently released): its buffer goes back.
    models.enter("sa").unwrap();
    let usage = models.host_tier().unwrap();
    assert_eq!((usage.used, out()), (6 * page, 6 * page), "b and c");
    assert_eq!(counting.takes.load(Ordering::SeqCst), 3, "one buffer per stored copy");
    models.close();
    assert_eq!(out(), 0, "close gives every buffer back");
}

/// The modules of `tests/fixtures/every_tensor.py` (exported from Python the ordinary way),
/// written by the cached torch into a folder of their own.
fn python_modules() -> tempfile::TempDir {
    let python = std::env::var("STAGELOAD_PYTHON")
        .expect("STAGELOAD_PYTHON is not set: run the tests through cargo xtask test (it exports the fixtures with the cached torch)");
    let dir = tempfile::TempDir::new().unwrap();
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/every_tensor.py");
    let out = std::process::Command::new(&python).arg(&script).arg(dir.path()).output().unwrap();
    assert!(out.status.success(), "{python} {}: {}", script.display(), String::from_utf8_lossy(&out.stderr));
    dir
}

#[test]
fn modules_exported_from_python_come_back_from_the_tier_bit_identical_ties_and_kept_buffers_included() {
    let dir = python_modules();
    let path = |name: &str| dir.path().join(name);
    let lenient = crate::NameRules::default().strict(false);
    for (fixture, rules) in [("tied", crate::NameRules::default()), ("buffers", lenient)] {
        let sink = Arc::new(ListSink::new());
        let spec = ModelSpec::torchscript("m", path(&format!("{fixture}.pt")))
            .checkpoint([path(&format!("{fixture}.safetensors"))])
            .names(rules);
        let models = StagedModels::builder()
            .host_tier(1 << 24)
            .tier_on_cpu()
            .model(spec)
            .stage("run", ["m"])
            .stage("other", Vec::<String>::new())
            .events(sink.clone())
            .build()
            .unwrap();
        let io: std::collections::HashMap<String, Tensor> =
            Tensor::read_safetensors(path(&format!("{fixture}.io.safetensors"))).unwrap().into_iter().collect();
        let forward = || models.call("m", |m: &mut tch::CModule| m.forward_ts(&[&io["x"]]).unwrap()).unwrap();
        models.enter("run").unwrap();
        assert!(forward().equal(&io["y"]), "{fixture}: Python's output");
        let stats = models.enter("other").unwrap();
        models.enter("run").unwrap();
        assert!(forward().equal(&io["y"]), "{fixture}: bit for bit after the reload from the tier");
        let reload = &sink.of_kind(EventKind::Reload)[0];
        assert_eq!(reload.reload_from(), Some(ReloadFrom::HostTier), "{fixture}");
        let load = &sink.of_kind(EventKind::Load)[0];
        assert_eq!(load.bytes(), Some(stats.freed + stats.kept), "{fixture}: what the load counted, freed or kept");
        assert_eq!(reload.bytes(), Some(stats.freed), "{fixture}: the reload fills what the release freed");
        if fixture == "tied" {
            let tensors: std::collections::HashMap<String, Tensor> =
                models.get::<tch::CModule>("m").unwrap().tensors().into_iter().collect();
            assert_eq!(tensors["c2.weight"].data_ptr(), tensors["c3.weight"].data_ptr(), "still one storage");
            assert_eq!(stats.kept, 0);
        } else {
            assert_eq!(stats.kept, 24, "the six-float buffer the checkpoint lacks stays");
        }
    }
}
