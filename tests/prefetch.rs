//! Prefetch on the CPU: the next stage's models load in a background thread while the current
//! stage computes; only loads that draw no random number are started, so a seeded run gives the
//! same numbers with and without prefetch; a failed prefetch surfaces at the `get`; the
//! prefetches running are listed and can be waited for, and load one at a time in the order
//! asked for; closing or dropping the registry gives up the prefetches that have not begun and
//! waits only for a loader already running; a foreground load never waits for a prefetch: a
//! foreground build goes ahead while a prefetch builds, and a prefetched copy pauses between
//! pieces while a foreground load runs.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use stageload::{EventKind, ListSink, ModelSpec, ModelState, PrefetchPace, ReloadFrom, StageError, StagedModels};
use tch::nn::{Module, VarStore};
use tch::{Device, Kind, Tensor};

use stageload_test_support::torch as support;
use support::{build_mlp, mlp, Mlp};

fn within<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (done, finished) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(f());
    });
    finished.recv_timeout(Duration::from_secs(60)).unwrap_or_else(|_| panic!("{what}: not done after 60 s (a hang)"))
}

/// Checkpoints of two width-64 MLPs in `dir`.
fn files(dir: &std::path::Path) -> [std::path::PathBuf; 2] {
    ["a", "b"].map(|name| {
        let vs = VarStore::new(Device::Cpu);
        let _ = mlp(&vs, 64);
        let path = dir.join(format!("{name}.safetensors"));
        stageload::checkpoint::save(&vs.variables().into_iter().collect::<Vec<_>>(), &path).unwrap();
        path
    })
}

fn registry(
    files: &[std::path::PathBuf; 2],
    skip_init: bool,
    prefetch_next: bool,
    sink: Arc<ListSink>,
) -> Arc<StagedModels> {
    let spec = |name: &str, file: &std::path::PathBuf| {
        ModelSpec::new(name, |_| Ok(build_mlp(64))).checkpoint([file]).skip_init(skip_init)
    };
    Arc::new(
        StagedModels::builder()
            .model(spec("a", &files[0]))
            .model(spec("b", &files[1]))
            .stage("first", ["a"])
            .stage("second", ["b"])
            .stage("third", ["a"])
            .prefetch_next(prefetch_next)
            .events(sink)
            .build()
            .unwrap(),
    )
}

/// A seeded run: noise drawn in every stage, each model called on it. With `prefetched`, each
/// stage waits for the prefetch of the next one (begun by its `enter`) to end, so that the next
/// stage's `get` finds the model there instead of racing the background thread to it.
fn run(models: &Arc<StagedModels>, prefetched: bool) -> Vec<Tensor> {
    tch::manual_seed(11);
    let mut outputs = Vec::new();
    let stages = [("first", "a"), ("second", "b"), ("third", "a")];
    for (i, (stage, model)) in stages.into_iter().enumerate() {
        models.enter(stage).unwrap();
        let noise = Tensor::randn([4, 64], (Kind::Float, Device::Cpu));
        let (models, model) = (models.clone(), model.to_string());
        let next = stages.get(i + 1).filter(|_| prefetched).map(|(next, _)| next.to_string());
        outputs.push(within("a call and the next stage's prefetch", move || {
            let output = models.call(&model, |m: &mut Mlp| m.forward(&noise)).unwrap();
            if let Some(next) = next {
                models.wait_prefetch(&next).unwrap();
            }
            output
        }));
    }
    outputs
}

#[test]
fn a_prefetched_run_gives_the_same_numbers_as_one_without() {
    let _one = support::generator();
    let dir = tempfile::TempDir::new().unwrap();
    let files = files(dir.path());
    let plain = run(&registry(&files, true, false, Arc::new(ListSink::new())), false);
    let sink = Arc::new(ListSink::new());
    let prefetched = run(&registry(&files, true, true, sink.clone()), true);
    for (a, b) in plain.iter().zip(&prefetched) {
        assert!(a.equal(b), "prefetch changed a result");
    }
    let prefetches = sink.of_kind(EventKind::Prefetch);
    let names: Vec<(Option<String>, Option<String>)> =
        prefetches.iter().map(|e| (e.stage().map(str::to_string), e.model().map(str::to_string))).collect();
    assert_eq!(names, [(Some("second".into()), Some("b".into())), (Some("third".into()), Some("a".into()))]);
    let loads: Vec<_> = sink.events().into_iter().filter(|e| e.kind().is_load() && e.prefetched()).collect();
    assert_eq!(loads.len(), 2, "both prefetches ended in a load: {loads:?}");
    assert_eq!(loads[1].reload_from(), Some(ReloadFrom::InPlace), "a's return is a refill in place");
}

#[test]
fn builds_that_draw_random_numbers_are_not_prefetched() {
    let _one = support::generator();
    let dir = tempfile::TempDir::new().unwrap();
    let files = files(dir.path());
    let models = registry(&files, false, false, Arc::new(ListSink::new()));
    assert!(models.prefetch("second").unwrap().is_empty(), "b's first build runs its initialisation");
    models.enter("second").unwrap();
    models.load("b").unwrap();
    models.enter("first").unwrap();
    assert_eq!(models.prefetch("second").unwrap(), ["b"], "released with a checkpoint: a refill draws nothing");
    let err = models.prefetch("nowhere").unwrap_err();
    assert!(matches!(&err, StageError::UnknownStage { known, .. } if known.len() == 3), "{err}");
}

#[test]
fn a_prefetch_over_its_budget_is_not_started() {
    let _one = support::generator();
    let dir = tempfile::TempDir::new().unwrap();
    let files = files(dir.path());
    let models = StagedModels::builder()
        .model(ModelSpec::new("b", |_| Ok(build_mlp(64))).checkpoint([&files[1]]).skip_init(true))
        .stage("second", ["b"])
        .prefetch_budget(1024)
        .build()
        .unwrap();
    assert!(models.prefetch("second").unwrap().is_empty(), "33 KiB of weights do not fit in 1 KiB");
}

#[test]
fn a_failed_prefetch_surfaces_at_the_get_that_needs_the_model() {
    let _one = support::generator();
    let dir = tempfile::TempDir::new().unwrap();
    let files = files(dir.path());
    let sink = Arc::new(ListSink::new());
    let models = registry(&files, true, false, sink.clone());
    models.enter("second").unwrap();
    models.load("b").unwrap();
    models.enter("first").unwrap();
    std::fs::remove_file(&files[1]).unwrap();
    assert_eq!(models.prefetch("second").unwrap(), ["b"]);
    {
        let models = models.clone();
        within("the failed prefetch", move || models.wait_prefetch("second").unwrap());
    }
    assert_eq!(models.state("b").unwrap(), ModelState::Failed, "the prefetch ended, in a failure");
    assert!(models.prefetching().is_empty());
    models.enter("second").unwrap();
    let err = {
        let models = models.clone();
        within("the get after a failed prefetch", move || models.get::<Mlp>("b").err().unwrap())
    };
    assert!(matches!(err, StageError::Checkpoint { .. }) && err.to_string().contains("b.safetensors"), "{err}");
    assert!(!sink.of_kind(EventKind::Error).is_empty());
}

#[test]
fn a_prefetch_leaves_the_current_stages_working_memory_free() {
    let _one = support::generator();
    let dir = tempfile::TempDir::new().unwrap();
    let files = files(dir.path());
    let with_working = |working: Option<u64>| {
        let mut builder = StagedModels::builder()
            .model(ModelSpec::new("b", |_| Ok(build_mlp(64))).checkpoint([&files[1]]).skip_init(true))
            .stage("first", Vec::<String>::new())
            .stage("second", ["b"])
            .prefetch_budget(200 << 10);
        if let Some(bytes) = working {
            builder = builder.stage_working("first", bytes);
        }
        let models = builder.build().unwrap();
        models.enter("first").unwrap();
        models.prefetch("second").unwrap()
    };
    assert_eq!(with_working(None), ["b"], "33 KiB of weights fit in 200 KiB");
    assert_eq!(with_working(Some(100 << 10)), ["b"], "beside 100 KiB of working memory too");
    assert!(with_working(Some(180 << 10)).is_empty(), "not beside 180 KiB of working memory");
}

#[test]
fn without_a_budget_declared_working_memory_is_left_free_of_what_the_machine_has() {
    let _one = support::generator();
    let dir = tempfile::TempDir::new().unwrap();
    let files = files(dir.path());
    let prefetched = |working: u64| {
        let models = StagedModels::builder()
            .model(ModelSpec::new("b", |_| Ok(build_mlp(64))).checkpoint([&files[1]]).skip_init(true))
            .stage("first", Vec::<String>::new())
            .stage("second", ["b"])
            .stage_working("first", working)
            .build()
            .unwrap();
        models.enter("first").unwrap();
        models.prefetch("second").unwrap()
    };
    assert_eq!(prefetched(1 << 20), ["b"], "1 MiB of working memory leaves room on any machine");
    assert!(prefetched(1 << 50).is_empty(), "a petabyte of working memory leaves none");
}

/// A loader that says when it begins (on `began`), takes `seconds`, then says it finished, and
/// counts its builds: a model prefetchable from the start (`skip_init`, no checkpoint).
fn slow(name: &str, seconds: f64, began: mpsc::Sender<String>, builds: Arc<AtomicUsize>) -> ModelSpec {
    let (name, began) = (name.to_string(), Mutex::new(began));
    let model = name.clone();
    ModelSpec::new(name, move |_| {
        builds.fetch_add(1, Ordering::SeqCst);
        let _ = began.lock().unwrap().send(model.clone());
        std::thread::sleep(Duration::from_secs_f64(seconds));
        Ok(build_mlp(4))
    })
    .skip_init(true)
}

#[test]
fn a_slow_prefetch_is_listed_while_it_runs_and_waited_for_until_it_ends() {
    let _one = support::generator();
    let (began, has_begun) = mpsc::channel();
    let builds = Arc::new(AtomicUsize::new(0));
    let sink = Arc::new(ListSink::new());
    let models = Arc::new(
        StagedModels::builder()
            .model(slow("slow", 0.5, began, builds.clone()))
            .stage("now", Vec::<String>::new())
            .stage("next", ["slow"])
            .events(sink.clone())
            .build()
            .unwrap(),
    );
    models.enter("now").unwrap();
    models.wait_prefetch("next").unwrap();
    assert!(models.prefetching().is_empty(), "nothing started yet: waiting returns at once");
    assert_eq!(models.prefetch("next").unwrap(), ["slow"]);
    assert_eq!(models.prefetching(), ["slow"], "listed as soon as it is started");
    has_begun.recv_timeout(Duration::from_secs(60)).expect("the loader begins");
    assert_eq!(models.prefetching(), ["slow"], "listed while its loader runs");
    assert_eq!(models.state("slow").unwrap(), ModelState::Loading);
    {
        let models = models.clone();
        within("waiting for the prefetch", move || models.wait_prefetch("next").unwrap());
    }
    assert!(models.prefetching().is_empty(), "not listed once it ended");
    assert_eq!(models.state("slow").unwrap(), ModelState::Resident);
    let loads = sink.of_kind(EventKind::Load);
    assert!(loads.len() == 1 && loads[0].prefetched(), "its load event came before the wait returned: {loads:?}");
    assert_eq!(builds.load(Ordering::SeqCst), 1);

    let err = models.wait_prefetch("nowhere").unwrap_err();
    assert!(
        matches!(&err, StageError::UnknownStage { stage, known } if stage == "nowhere" && known.len() == 2),
        "{err}"
    );
    assert!(err.to_string().contains("'nowhere'"), "{err}");
}

/// Two models prefetched for `next`, each with a loader of `seconds`, and the channel saying
/// which loader began.
fn two_slow(seconds: f64, builds: &Arc<AtomicUsize>) -> (StagedModels, mpsc::Receiver<String>) {
    let (began, has_begun) = mpsc::channel();
    let models = StagedModels::builder()
        .model(slow("a", seconds, began.clone(), builds.clone()))
        .model(slow("b", seconds, began, builds.clone()))
        .stage("now", Vec::<String>::new())
        .stage("next", ["a", "b"])
        .build()
        .unwrap();
    models.enter("now").unwrap();
    (models, has_begun)
}

#[test]
fn dropping_the_registry_waits_for_the_loader_running_and_cancels_the_prefetch_behind_it() {
    let _one = support::generator();
    let builds = Arc::new(AtomicUsize::new(0));
    let counted = builds.clone();
    let (dropped_after, later) = within("the drop, and a registry after it", move || {
        let (models, has_begun) = two_slow(5.0, &counted);
        assert_eq!(models.prefetch("next").unwrap(), ["a", "b"]);
        // One prefetch at a time, in the order asked for: a's loader runs, b's prefetch waits
        // its turn.
        assert_eq!(has_begun.recv_timeout(Duration::from_secs(30)).as_deref(), Ok("a"), "a's loader begins");
        let started = Instant::now();
        drop(models);
        let dropped_after = started.elapsed();
        assert!(has_begun.try_recv().is_err(), "b's loader never began");
        // The process stays sound: a registry made afterwards prefetches and loads.
        let fresh = Arc::new(AtomicUsize::new(0));
        let (models, _began) = two_slow(0.0, &fresh);
        models.prefetch("next").unwrap();
        models.wait_prefetch("next").unwrap();
        models.enter("next").unwrap();
        let y = models.call("a", |m: &mut Mlp| m.forward(&Tensor::ones([1, 4], (Kind::Float, Device::Cpu))));
        (dropped_after, (y.unwrap().size(), fresh.load(Ordering::SeqCst), models.resident()))
    });
    assert_eq!(builds.load(Ordering::SeqCst), 1, "the prefetch that had not begun was cancelled");
    assert!(
        dropped_after > Duration::from_secs(3) && dropped_after < Duration::from_secs(8),
        "the drop waited for the one loader running (5 s), not for both (10 s): {dropped_after:?}"
    );
    assert_eq!(later, (vec![1, 4], 2, vec!["a".to_string(), "b".to_string()]));
}

#[test]
fn stopping_the_prefetches_waits_for_the_loader_running_cancels_the_one_behind_and_leaves_loads_to_the_foreground() {
    let _one = support::generator();
    let builds = Arc::new(AtomicUsize::new(0));
    let counted = builds.clone();
    let (after_stop, b_began, after_enter) = within("stop_prefetches, then the stage", move || {
        let (models, has_begun) = two_slow(1.0, &counted);
        assert_eq!(models.prefetch("next").unwrap(), ["a", "b"]);
        assert_eq!(has_begun.recv_timeout(Duration::from_secs(30)).as_deref(), Ok("a"), "a's loader begins");
        models.stop_prefetches();
        let after_stop = (
            counted.load(Ordering::SeqCst),
            models.prefetching(),
            models.state("a").unwrap(),
            models.state("b").unwrap(),
        );
        // None starts after: a prefetch asked for now gives up before its load.
        models.prefetch("next").unwrap();
        models.wait_prefetch("next").unwrap();
        let b_began = has_begun.try_recv().ok();
        models.enter("next").unwrap();
        let y = models.call("b", |m: &mut Mlp| m.forward(&Tensor::ones([1, 4], (Kind::Float, Device::Cpu))));
        (after_stop, b_began, (y.unwrap().size(), counted.load(Ordering::SeqCst)))
    });
    assert_eq!(
        after_stop,
        (1, Vec::<String>::new(), ModelState::Resident, ModelState::Unloaded),
        "a's prefetch had ended, loaded; b's never began"
    );
    assert_eq!(b_began, None, "no prefetch loaded b after the stop");
    assert_eq!(after_enter, (vec![1, 4], 2), "the foreground loaded b");
}

#[test]
fn closing_gives_up_at_once_a_prefetch_waiting_for_the_one_before_it() {
    let _one = support::generator();
    let builds = Arc::new(AtomicUsize::new(0));
    let counted = builds.clone();
    let (closed_after, states) = within("close and the prefetches' end", move || {
        let (models, has_begun) = two_slow(3.0, &counted);
        assert_eq!(models.prefetch("next").unwrap(), ["a", "b"]);
        assert_eq!(has_begun.recv_timeout(Duration::from_secs(30)).as_deref(), Ok("a"), "a's loader begins");
        let started = Instant::now();
        models.close();
        let closed_after = started.elapsed();
        models.wait_prefetch("next").unwrap();
        (closed_after, (models.state("a").unwrap(), models.state("b").unwrap()))
    });
    assert!(closed_after < Duration::from_secs(2), "close waited for no loader: {closed_after:?}");
    assert_eq!(builds.load(Ordering::SeqCst), 1, "the prefetch behind the running one never began");
    // The one running finished after close and was released at once; the other is as before.
    assert_eq!(states, (ModelState::Released, ModelState::Unloaded));
}

/// A model whose loader says when it begins (on `began`) and then waits for `go` (at most 60 s,
/// so that a registry that makes it wait for itself fails instead of hanging).
fn gated(name: &str, skip_init: bool, began: mpsc::Sender<String>, go: mpsc::Receiver<()>) -> ModelSpec {
    let (model, began, go) = (name.to_string(), Mutex::new(began), Mutex::new(go));
    ModelSpec::new(name, move |_| {
        let _ = began.lock().unwrap().send(model.clone());
        go.lock().unwrap().recv_timeout(Duration::from_secs(60)).map_err(|_| "not let go within 60 s")?;
        Ok(build_mlp(4))
    })
    .skip_init(skip_init)
}

/// A progress hook's side that holds one model's copy: once `armed`, each piece of `model`
/// is said on a channel, then waits (at most 60 s) for a go on another; dropping the sender of
/// the goes lets every later piece on at once.
struct HeldPieces {
    model: &'static str,
    armed: Arc<AtomicBool>,
    piece: Mutex<mpsc::Sender<()>>,
    go: Mutex<mpsc::Receiver<()>>,
}

impl HeldPieces {
    /// The holder, the pieces' channel, and the goes' sender.
    fn of(model: &'static str) -> (HeldPieces, mpsc::Receiver<()>, mpsc::Sender<()>) {
        let (piece, pieces) = mpsc::channel();
        let (go_tx, go) = mpsc::channel();
        let armed = Arc::new(AtomicBool::new(false));
        (HeldPieces { model, armed, piece: Mutex::new(piece), go: Mutex::new(go) }, pieces, go_tx)
    }

    /// Called by the hook for a piece of `model`.
    fn piece(&self, model: &str) {
        if model == self.model && self.armed.load(Ordering::SeqCst) {
            let _ = self.piece.lock().unwrap().send(());
            let _ = self.go.lock().unwrap().recv_timeout(Duration::from_secs(60));
        }
    }
}

#[test]
fn a_foreground_build_goes_ahead_while_a_prefetch_build_runs() {
    let _one = support::generator();
    let (began, has_begun) = mpsc::channel();
    let (go, gate) = mpsc::channel();
    let sink = Arc::new(ListSink::new());
    let models = Arc::new(
        StagedModels::builder()
            .model(gated("background", true, began, gate))
            .model(ModelSpec::new("foreground", |_| Ok(build_mlp(4))))
            .stage("now", ["foreground"])
            .stage("next", ["background"])
            .events(sink.clone())
            .build()
            .unwrap(),
    );
    models.enter("now").unwrap();
    assert_eq!(models.prefetch("next").unwrap(), ["background"]);
    assert_eq!(has_begun.recv_timeout(Duration::from_secs(30)).as_deref(), Ok("background"));
    // The prefetch's loader is running and waits for this test: the foreground build must not
    // wait for it (before, it queued behind the prefetch's build turn, and this never returned).
    let (loaded, background_then) = {
        let models = models.clone();
        within("the foreground build beside a running prefetch", move || {
            let loaded = models.load("foreground");
            (loaded, models.state("background").unwrap())
        })
    };
    assert!(loaded.is_ok(), "{loaded:?}");
    assert_eq!(background_then, ModelState::Loading, "the prefetch was still building");
    go.send(()).unwrap();
    {
        let models = models.clone();
        within("the prefetch's end", move || models.wait_prefetch("next").unwrap());
    }
    assert_eq!(models.state("background").unwrap(), ModelState::Resident);
    let loads: Vec<(Option<String>, bool)> =
        sink.of_kind(EventKind::Load).iter().map(|e| (e.model().map(str::to_string), e.prefetched())).collect();
    assert_eq!(loads, [(Some("foreground".to_string()), false), (Some("background".to_string()), true)]);
}

/// A width-64 MLP's checkpoint in f64, `dir/name.safetensors`: loaded into the f32 model, every
/// tensor is converted, one piece after the other on the copying thread, each reported.
fn doubles(dir: &std::path::Path, name: &str) -> std::path::PathBuf {
    let file = dir.join(format!("{name}.safetensors"));
    let vs = VarStore::new(Device::Cpu);
    let _ = mlp(&vs, 64);
    let doubles: Vec<(String, Tensor)> =
        vs.variables().into_iter().map(|(n, t)| (n, t.to_kind(Kind::Double))).collect();
    stageload::checkpoint::save(&doubles, &file).unwrap();
    file
}

#[test]
fn prefetches_load_one_at_a_time_in_the_order_they_were_asked_for_and_the_foreground_does_not_queue() {
    let _one = support::generator();
    let dir = tempfile::tempdir().unwrap();
    let (held, pieces, next_tx) = HeldPieces::of("a");
    let armed = held.armed.clone();
    let copied = Arc::new(Mutex::new(Vec::<String>::new()));
    let log = copied.clone();
    let spec = |name: &str| ModelSpec::new(name, |_| Ok(build_mlp(64))).checkpoint([doubles(dir.path(), name)]);
    let models = Arc::new(
        StagedModels::builder()
            .model(spec("a").skip_init(true))
            .model(spec("b").skip_init(true))
            .model(spec("c").skip_init(true))
            .stage("now", Vec::<String>::new())
            .stage("second", ["a"])
            .stage("third", ["b"])
            .stage("fourth", ["c"])
            .progress(move |model, _| {
                log.lock().unwrap().push(model.to_string());
                held.piece(model);
            })
            .build()
            .unwrap(),
    );
    models.enter("now").unwrap();
    armed.store(true, Ordering::SeqCst);
    assert_eq!(models.prefetch("second").unwrap(), ["a"]);
    pieces.recv_timeout(Duration::from_secs(30)).expect("a's copy begins");
    assert_eq!(models.prefetch("third").unwrap(), ["b"]);
    assert_eq!(models.prefetch("fourth").unwrap(), ["c"]);
    // a's copy is held at its first piece: b's and c's prefetches wait for it.
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(models.prefetching(), ["a", "b", "c"]);
    assert_eq!(models.state("b").unwrap(), ModelState::Unloaded, "b's prefetch has not begun");
    // A foreground load of a model whose prefetch waits its turn does not wait with it.
    let loaded = {
        let models = models.clone();
        within("c's foreground load while a's prefetch is held", move || models.load("c").map(|_| ()))
    };
    assert!(loaded.is_ok(), "{loaded:?}");
    assert_eq!(models.state("b").unwrap(), ModelState::Unloaded, "b's prefetch still waits for a's");
    drop(next_tx);
    {
        let models = models.clone();
        within("the prefetches' end", move || {
            models.wait_prefetch("third").unwrap();
            models.wait_prefetch("fourth").unwrap();
        });
    }
    assert!(["a", "b", "c"].iter().all(|m| models.state(m).unwrap() == ModelState::Resident));
    // Every piece of a's copy came before b's first; c was loaded in the foreground before both
    // (its prefetch found it resident).
    let copied = copied.lock().unwrap().clone();
    let runs: Vec<&str> = copied.chunk_by(|x, y| x == y).map(|run| run[0].as_str()).collect();
    assert_eq!(runs, ["a", "c", "a", "b"], "one copy at a time, in the order asked for: {copied:?}");
}

#[test]
fn a_prefetched_copy_pauses_between_pieces_while_a_foreground_load_runs() {
    let _one = support::generator();
    let dir = tempfile::tempdir().unwrap();
    // Each of b's converted pieces is asked for before it is read and reported after.
    let file = doubles(dir.path(), "b");
    let (began, has_begun) = mpsc::channel();
    let (go, gate) = mpsc::channel();
    let (held, pieces, next_tx) = HeldPieces::of("b");
    let armed = held.armed.clone();
    let sink = Arc::new(ListSink::new());
    let models = Arc::new(
        StagedModels::builder()
            .model(ModelSpec::new("b", |_| Ok(build_mlp(64))).checkpoint([&file]).skip_init(true))
            // Draws random numbers: loaded in the foreground only.
            .model(gated("a", false, began, gate))
            .stage("uses_b", ["b"])
            .stage("between", Vec::<String>::new())
            .stage("both", ["a", "b"])
            .events(sink.clone())
            // The first piece waits until the foreground load has begun.
            .progress(move |model, _| held.piece(model))
            .build()
            .unwrap(),
    );
    models.enter("uses_b").unwrap();
    models.load("b").unwrap();
    models.enter("between").unwrap();
    assert_eq!(models.state("b").unwrap(), ModelState::Released);
    armed.store(true, Ordering::SeqCst);
    assert_eq!(models.prefetch("both").unwrap(), ["b"], "a draws random numbers: not prefetched");
    pieces.recv_timeout(Duration::from_secs(30)).expect("b's refill copies its first piece");
    models.enter("both").unwrap();
    let foreground = {
        let models = models.clone();
        std::thread::spawn(move || models.load("a"))
    };
    assert_eq!(has_begun.recv_timeout(Duration::from_secs(30)).as_deref(), Ok("a"), "a's foreground load began");
    // Let b's first piece end: its next one must wait while a loads.
    for _ in 0..8 {
        next_tx.send(()).unwrap();
    }
    assert!(
        pieces.recv_timeout(Duration::from_millis(500)).is_err(),
        "b's copy took no further piece while the foreground load ran"
    );
    assert_eq!(models.state("b").unwrap(), ModelState::Loading);
    go.send(()).unwrap();
    let loaded = within("a's foreground load", move || foreground.join().unwrap());
    assert!(loaded.is_ok(), "{loaded:?}");
    pieces.recv_timeout(Duration::from_secs(30)).expect("b's copy resumed once a was loaded");
    drop(next_tx);
    {
        let models = models.clone();
        within("b's refill", move || models.wait_prefetch("both").unwrap());
    }
    assert_eq!(models.state("b").unwrap(), ModelState::Resident);
    let reloaded: Vec<Option<ReloadFrom>> = sink.of_kind(EventKind::Reload).iter().map(|e| e.reload_from()).collect();
    assert_eq!(reloaded, [Some(ReloadFrom::InPlace)], "b refilled in place, once");
    let y = models.call("b", |m: &mut Mlp| m.forward(&Tensor::ones([1, 64], (Kind::Float, Device::Cpu))));
    let expected = forward_of(&file);
    assert!(y.unwrap().equal(&expected), "the paused copy finished with the file's values");
}

/// A fresh width-64 MLP loaded from `file`, on a row of ones: what a model refilled from it gives.
fn forward_of(file: &std::path::Path) -> Tensor {
    let vs = VarStore::new(Device::Cpu);
    let model = mlp(&vs, 64);
    stageload::checkpoint::Checkpoint::open(&[file])
        .unwrap()
        .load_into(&vs.variables().into_iter().collect::<Vec<_>>(), |_| {})
        .unwrap();
    model.forward(&Tensor::ones([1, 64], (Kind::Float, Device::Cpu)))
}

/// This thread's CPU time (user and system).
fn thread_cpu_time() -> Duration {
    Duration::from(nix::time::clock_gettime(nix::time::ClockId::CLOCK_THREAD_CPUTIME_ID).unwrap())
}

#[test]
fn a_paced_prefetch_pauses_while_nothing_waits_for_it_and_goes_at_full_speed_once_its_model_is_asked_for() {
    let _one = support::generator();
    let dir = tempfile::tempdir().unwrap();
    let file = doubles(dir.path(), "b");
    let (piece, pieces) = mpsc::channel();
    let piece = Mutex::new(piece);
    let first = AtomicBool::new(true);
    // b's first converted piece costs its copying thread this much CPU, so that the next one
    // owes a pause (a quarter of a core over the copy's readers: 4 x readers - 1 times the
    // piece) of twice `ASKED`: a `get` that ends within `ASKED` ended the pause.
    const ASKED: Duration = Duration::from_secs(10);
    let owed_per_cpu = u32::try_from(4 * stageload::checkpoint::readers() - 1).unwrap();
    let spin = ASKED * 2 / owed_per_cpu;
    let models = Arc::new(
        StagedModels::builder()
            .model(ModelSpec::new("b", |_| Ok(build_mlp(64))).checkpoint([&file]).skip_init(true))
            .stage("before", Vec::<String>::new())
            .stage("uses_b", ["b"])
            .prefetch_pace(PrefetchPace::Paced)
            .progress(move |model, _| {
                if model == "b" {
                    if first.swap(false, Ordering::SeqCst) {
                        let start = thread_cpu_time();
                        let deadline = Instant::now() + Duration::from_secs(30);
                        while thread_cpu_time() < start + spin && Instant::now() < deadline {
                            std::hint::black_box((0..1000u64).sum::<u64>());
                        }
                    }
                    let _ = piece.lock().unwrap().send(());
                }
            })
            .build()
            .unwrap(),
    );
    models.enter("before").unwrap();
    assert_eq!(models.prefetch("uses_b").unwrap(), ["b"]);
    pieces.recv_timeout(Duration::from_secs(30)).expect("b's first piece");
    assert!(pieces.recv_timeout(Duration::from_millis(500)).is_err(), "paused: nothing waits for b");
    assert_eq!(models.state("b").unwrap(), ModelState::Loading);
    models.enter("uses_b").unwrap();
    let (got, y) = mpsc::channel();
    {
        let models = models.clone();
        std::thread::spawn(move || {
            let _ =
                got.send(models.call("b", |m: &mut Mlp| m.forward(&Tensor::ones([1, 64], (Kind::Float, Device::Cpu)))));
        });
    }
    let y = y.recv_timeout(ASKED).expect("the get ended the pause b owed (twice this wait)");
    let expected = forward_of(&file);
    assert!(y.unwrap().equal(&expected), "the paced copy finished with the file's values");
}

/// How a test lets go of the registry.
#[derive(Clone, Copy, PartialEq)]
enum End {
    Close,
    Drop,
}

/// Model `b` released with its checkpoint, then prefetched (a refill in place); each progress
/// report of that refill sleeps `piece` seconds, so the copy is in flight when the registry
/// closes or drops. Returns how long the close (with the prefetch's end) or the drop took, the
/// progress reports the refill made, b's state after a close, and the refill's reload events.
fn end_during_a_refill(end: End, piece: Duration) -> (Duration, usize, Option<ModelState>, usize) {
    let dir = tempfile::tempdir().unwrap();
    let files = files(dir.path());
    let armed = Arc::new(AtomicBool::new(false));
    let reports = Arc::new(AtomicUsize::new(0));
    let (began, refilling) = mpsc::channel();
    let sink = Arc::new(ListSink::default());
    let models = {
        let (armed, reports, began) = (armed.clone(), reports.clone(), Mutex::new(began));
        StagedModels::builder()
            .model(ModelSpec::new("b", |_| Ok(build_mlp(64))).checkpoint([&files[1]]).skip_init(true))
            .stage("first", Vec::<String>::new())
            .stage("second", ["b"])
            .events(sink.clone())
            .progress(move |model, _| {
                if model == "b" && armed.load(Ordering::SeqCst) {
                    reports.fetch_add(1, Ordering::SeqCst);
                    let _ = began.lock().unwrap().send(());
                    std::thread::sleep(piece);
                }
            })
            .build()
            .unwrap()
    };
    models.enter("second").unwrap();
    models.load("b").unwrap();
    models.enter("first").unwrap();
    assert_eq!(models.state("b").unwrap(), ModelState::Released);
    armed.store(true, Ordering::SeqCst);
    assert_eq!(models.prefetch("second").unwrap(), ["b"]);
    refilling.recv_timeout(Duration::from_secs(30)).expect("the refill reports its first piece");
    let started = Instant::now();
    let state = match end {
        End::Close => {
            models.close();
            models.wait_prefetch("second").unwrap();
            let state = models.state("b").unwrap();
            drop(models);
            Some(state)
        }
        End::Drop => {
            drop(models);
            None
        }
    };
    let took = started.elapsed();
    let reloads = sink.of_kind(EventKind::Reload).len();
    (took, reports.load(Ordering::SeqCst), state, reloads)
}

#[test]
fn closing_or_dropping_the_registry_stops_a_prefetched_refill_at_the_piece_in_flight() {
    let _one = support::generator();
    let piece = Duration::from_millis(1500);
    for end in [End::Close, End::Drop] {
        let (took, reports, state, reloads) = within("a refill stopped by close or drop", move || {
            let ended = end_during_a_refill(end, piece);
            // The process stays sound: a registry made afterwards loads from the same file.
            let dir = tempfile::tempdir().unwrap();
            let files = files(dir.path());
            let sink = Arc::new(ListSink::default());
            let models = registry(&files, true, true, sink);
            models.enter("second").unwrap();
            let y = models.call("b", |m: &mut Mlp| m.forward(&Tensor::ones([1, 64], (Kind::Float, Device::Cpu))));
            assert_eq!(y.unwrap().size(), [1, 64]);
            ended
        });
        // Every piece of the refill reports (the caller's thread reads some, then reports once
        // more at the end): a copy that ran on would report at least twice.
        assert_eq!(reports, 1, "the copy stopped after the piece in flight");
        assert!(took < piece + Duration::from_secs(1), "waited only for that piece ({piece:?}): {took:?}");
        assert_eq!(reloads, 0, "the refill did not finish");
        if end == End::Close {
            assert_eq!(state, Some(ModelState::Released), "b is released as it was before the prefetch");
        }
    }
}

/// The nice value of the thread that calls this (Linux: field 19 of `/proc/thread-self/stat`).
fn this_threads_nice() -> i64 {
    let stat = std::fs::read_to_string("/proc/thread-self/stat").expect("read /proc/thread-self/stat");
    // The command name (field 2) is in parentheses and may hold spaces: count after its end.
    let after = &stat[stat.rfind(')').expect("a command name") + 2..];
    after.split(' ').nth(16).expect("field 19").parse().expect("a number")
}

#[test]
fn a_prefetch_loads_at_the_lowest_priority_and_the_foreground_at_its_own() {
    let _one = support::generator();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let spec = |name: &'static str| {
        let seen = seen.clone();
        ModelSpec::new(name, move |_| {
            seen.lock().unwrap().push((name, this_threads_nice()));
            Ok(build_mlp(4))
        })
        .skip_init(true)
    };
    let models = StagedModels::builder()
        .model(spec("now"))
        .model(spec("next"))
        .stage("first", ["now"])
        .stage("second", ["next"])
        .build()
        .unwrap();
    let own = this_threads_nice();
    models.enter("first").unwrap();
    models.load("now").unwrap();
    assert_eq!(models.prefetch("second").unwrap(), ["next"]);
    models.wait_prefetch("second").unwrap();
    assert_eq!(*seen.lock().unwrap(), [("now", own), ("next", 19)], "the stage's own load keeps its priority");
    assert_eq!(this_threads_nice(), own, "the caller's thread is left as it was");
}

/// A model of its own `head` and the component `shared` (a `[rows, 1024]` weight), built once
/// and held by every model built with it; its checkpoint `file` holds both.
fn sharing(name: &str, rows: i64, file: &std::path::Path) -> ModelSpec {
    ModelSpec::new(name, move |ctx| {
        let head = Tensor::zeros([16], (Kind::Float, Device::Cpu));
        let shared = ctx.shared("shared", || {
            let w = Tensor::zeros([rows, 1024], (Kind::Float, Device::Cpu));
            Ok((w.shallow_clone(), vec![("w".to_string(), w)]))
        })?;
        Ok(stageload::Built::from_tensors((head.shallow_clone(), shared), vec![("head".to_string(), head)]))
    })
    .checkpoint([file])
    .skip_init(true)
}

/// What [`sharing`] builds.
type Sharing = (Tensor, stageload::Shared<Tensor>);

/// Checkpoints in `dir` for [`sharing`] models `a` and `b` (heads of ones and twos) with one
/// shared weight of `rows`, each entry's name after `prefix`; that weight, and the files.
fn sharing_files(dir: &std::path::Path, rows: i64, prefix: &str) -> (Tensor, [std::path::PathBuf; 2]) {
    let weight = Tensor::arange(rows * 1024, (Kind::Float, Device::Cpu)).reshape([rows, 1024]);
    let files = ["a", "b"].map(|name| {
        let path = dir.join(format!("{name}.safetensors"));
        let head = Tensor::full([16], if name == "a" { 1.0 } else { 2.0 }, (Kind::Float, Device::Cpu));
        let entries = [(format!("{prefix}head"), head), (format!("{prefix}shared.w"), weight.copy())];
        stageload::checkpoint::save(&entries, &path).unwrap();
        path
    });
    (weight, files)
}

#[test]
fn a_model_refilled_while_another_keeps_their_shared_component_takes_only_its_own_entries() {
    for prefix in ["", "net."] {
        refilled_beside_its_shared_component(prefix);
    }
}

/// `a` released while `b` keeps their shared weight, then refilled; their files' entries named
/// after `prefix`, which the models' name rules strip.
fn refilled_beside_its_shared_component(prefix: &str) {
    let dir = tempfile::tempdir().unwrap();
    let (weight, [a_file, b_file]) = sharing_files(dir.path(), 64, prefix);
    let named = |spec: ModelSpec| spec.names(stageload::NameRules::default().strip_prefix(prefix));
    let models = StagedModels::builder()
        .model(named(sharing("a", 64, &a_file)))
        .model(named(sharing("b", 64, &b_file)))
        .stage("both", ["a", "b"])
        .stage("uses_b", ["b"])
        .build()
        .unwrap();
    models.enter("both").unwrap();
    models.load("a").unwrap();
    models.load("b").unwrap();
    let stats = models.enter("uses_b").unwrap();
    assert_eq!((stats.freed, stats.kept), (4 * 16, 4 * 64 * 1024), "the shared weight stays for b");
    models.enter("both").unwrap();
    // Strict: the file's shared entry fills no freed tensor, and is not an unused entry.
    let (head, shared) = models.call("a", |(head, shared): &mut Sharing| (head.copy(), shared.lock().copy())).unwrap();
    assert!(head.equal(&Tensor::ones([16], (Kind::Float, Device::Cpu))) && shared.equal(&weight));
}

#[test]
fn a_model_sharing_a_component_a_prefetch_is_refilling_is_used_only_once_that_copy_ends() {
    // `a` refilled in place, `c` built for the first time: both take the shared weight b's
    // refill is filling.
    for model in ["a", "c"] {
        loaded_while_a_prefetch_refills_what_it_shares(model);
    }
}

/// Models `a`, `b` and `c` share a weight; `a` and `b` were loaded and released; `b`'s refill
/// (a prefetch) is held after each piece while `model` loads in the foreground, and before it
/// `d`, which shares nothing (the control).
///
/// What shows the wait, with no window of time: a background copy pauses at its next piece
/// while a foreground load runs, and a foreground load that waits for another load's fill of a
/// storage it shares counts as not running meanwhile (`staged::turn`, rule 3). So once the
/// foreground load has copied a piece of its own, b's copy takes its next piece only when that
/// load has ended (it is resident then: it counts as running until installed) or waits for a
/// fill; for `model`, still loading then, that fill can only be b's. The control shows that the
/// same observation sees a load that does not wait: `d` is resident when b's copy goes on.
fn loaded_while_a_prefetch_refills_what_it_shares(model: &'static str) {
    let _one = support::generator();
    let dir = tempfile::tempdir().unwrap();
    // 64 MiB of shared weight: several pieces of the refill's copy.
    let rows = 16 * 1024;
    let (weight, [a_file, b_file]) = sharing_files(dir.path(), rows, "");
    let (held, pieces, next_tx) = HeldPieces::of("b");
    let armed = held.armed.clone();
    // Every piece of another model than b, by the model's name.
    let (other_piece, other_pieces) = mpsc::channel::<String>();
    let other_piece = Mutex::new(other_piece);
    let models = Arc::new(
        StagedModels::builder()
            .model(sharing("a", rows, &a_file))
            .model(sharing("b", rows, &b_file))
            .model(sharing("c", rows, &a_file))
            .model(ModelSpec::new("d", |_| Ok(build_mlp(64))).checkpoint([doubles(dir.path(), "d")]).skip_init(true))
            .stage("both", ["a", "b"])
            .stage("uses_a", ["a", "c", "d"])
            .stage("uses_b", ["b"])
            .stage("between", Vec::<String>::new())
            // Each piece of b's refill waits until the test lets it go.
            .progress(move |name, _| {
                if name != "b" {
                    let _ = other_piece.lock().unwrap().send(name.to_string());
                }
                held.piece(name)
            })
            .build()
            .unwrap(),
    );
    models.enter("both").unwrap();
    models.load("a").unwrap();
    models.load("b").unwrap();
    let shared_bytes = 4 * (rows * 1024) as u64;
    assert_eq!(models.resident_bytes(), shared_bytes + 2 * 4 * 16, "the shared weight counted once");
    models.enter("between").unwrap();
    assert_eq!(models.resident_bytes(), 0, "both released: the shared weight freed with the last of them");
    while other_pieces.try_recv().is_ok() {}
    armed.store(true, Ordering::SeqCst);
    models.enter("uses_a").unwrap();
    assert_eq!(models.prefetch("uses_b").unwrap(), ["b"]);
    pieces.recv_timeout(Duration::from_secs(30)).expect("b's refill copied its first piece and waits");

    // Loads `name` in the foreground; once it has copied a piece of its own, lets b's copy end
    // its held piece and waits for b's next one; returns the load's thread and `name`'s state then.
    let load_beside_b = |name: &'static str| {
        let foreground = {
            let models = models.clone();
            std::thread::spawn(move || {
                let loaded = models.load(name);
                // What the load handed out, read as soon as it returns (b's copy is held then,
                // unless the load waited for it): a `Sharing` model's head and shared weight.
                let values = models.call(name, |(head, shared): &mut Sharing| (head.copy(), shared.lock().copy()));
                (loaded, values.ok())
            })
        };
        let piece = other_pieces.recv_timeout(Duration::from_secs(30));
        assert_eq!(piece.as_deref(), Ok(name), "{name}'s load copies a piece of its own");
        next_tx.send(()).unwrap();
        pieces
            .recv_timeout(Duration::from_secs(30))
            .unwrap_or_else(|_| panic!("b's copy took no next piece within 30 s of {name}'s load copying its own"));
        (foreground, models.state(name).unwrap())
    };

    // The control: d shares nothing with b; b's copy goes on once d's load has ended.
    let (control, d_then) = load_beside_b("d");
    assert_eq!(d_then, ModelState::Resident, "control: b's copy went on only once d's foreground load ended");
    assert!(within("d's load", move || control.join().unwrap().0.is_ok()));
    while other_pieces.try_recv().is_ok() {} // d's later pieces

    // b's refill has the shared weight's memory back but not its values: the load of `model`
    // must not hand it out half filled, and waits for b's copy instead, which goes on meanwhile.
    let (foreground, then) = load_beside_b(model);
    assert_eq!(then, ModelState::Loading, "{model}'s load waits for b's copy of the weight they share, still loading");
    drop(next_tx);
    let (loaded, values) = within("the load once b's copy ends", move || foreground.join().unwrap());
    assert!(loaded.is_ok(), "{model}: {loaded:?}");
    let (head, shared) = values.expect("the loaded model's values");
    assert!(head.equal(&Tensor::ones([16], (Kind::Float, Device::Cpu))), "{model}'s own head");
    assert!(shared.equal(&weight), "{model}'s load handed out the shared weight with the file's values");
    {
        let models = models.clone();
        within("b's refill", move || models.wait_prefetch("uses_b").unwrap());
    }
}

#[test]
fn a_release_keeps_a_storage_a_prefetch_in_flight_shares_until_that_model_is_installed() {
    let _one = support::generator();
    let dir = tempfile::tempdir().unwrap();
    let (weight, [a_file, b_file]) = sharing_files(dir.path(), 64, "");
    let (held, pieces, next_tx) = HeldPieces::of("a");
    let armed = held.armed.clone();
    let models = Arc::new(
        StagedModels::builder()
            .model(sharing("a", 64, &a_file))
            .model(sharing("b", 64, &b_file))
            .stage("both", ["a", "b"])
            .stage("uses_b", ["b"])
            .stage("uses_a", ["a"])
            .progress(move |model, _| held.piece(model))
            .build()
            .unwrap(),
    );
    models.enter("both").unwrap();
    models.load("a").unwrap();
    models.load("b").unwrap();
    models.enter("uses_b").unwrap();
    armed.store(true, Ordering::SeqCst);
    assert_eq!(models.prefetch("uses_a").unwrap(), ["a"]);
    pieces.recv_timeout(Duration::from_secs(30)).expect("a's refill copied its own head and waits");
    // a's refill relies on the weight b holds; entering `uses_a` releases b meanwhile.
    let stats = models.enter("uses_a").unwrap();
    let shared_bytes = 4 * 64 * 1024;
    assert_eq!((stats.freed, stats.kept), (4 * 16, shared_bytes), "b's head freed, the weight a relies on kept");
    drop(next_tx);
    {
        let models = models.clone();
        within("a's refill", move || models.wait_prefetch("uses_a").unwrap());
    }
    let (head, shared) = models.call("a", |(head, shared): &mut Sharing| (head.copy(), shared.lock().copy())).unwrap();
    assert!(head.equal(&Tensor::ones([16], (Kind::Float, Device::Cpu))));
    assert!(shared.equal(&weight), "a uses the weight with the file's values");
    assert_eq!(models.resident_bytes(), shared_bytes + 4 * 16, "a holds the weight it relied on");
}
