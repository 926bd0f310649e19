//! Prefetch on the CPU: the next stage's models load in a background thread while the current
//! stage computes; only loads that draw no random number are started, so a seeded run gives the
//! same numbers with and without prefetch; a failed prefetch surfaces at the `get`.

use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use stageload::{EventKind, ListSink, ModelSpec, ReloadFrom, StageError, StagedModels};
use tch::nn::{Module, VarStore};
use tch::{Device, Kind, Tensor};

mod common;
use common::{build_mlp, mlp, Mlp};

/// Every test here reads or draws from torch's process-wide generator: one at a time.
static GENERATOR: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    GENERATOR.lock().unwrap_or_else(|e| e.into_inner())
}

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

/// A seeded run: noise drawn in every stage, each model called on it. With `prefetches`, each
/// stage's call waits (10 s at most) for the prefetches begun so far to end in a load, so that
/// the next stage's `get` finds the model there instead of racing the background thread to it.
fn run(models: &Arc<StagedModels>, prefetches: Option<&ListSink>) -> Vec<Tensor> {
    tch::manual_seed(11);
    let mut outputs = Vec::new();
    for (stage, model) in [("first", "a"), ("second", "b"), ("third", "a")] {
        models.enter(stage).unwrap();
        let noise = Tensor::randn([4, 64], (Kind::Float, Device::Cpu));
        let models = models.clone();
        let model = model.to_string();
        outputs.push(within("a call", move || models.call(&model, |m: &mut Mlp| m.forward(&noise)).unwrap()));
        let Some(sink) = prefetches else { continue };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let loaded = || sink.events().into_iter().filter(|e| e.kind.is_load() && e.prefetched).count();
        while loaded() < sink.of_kind(EventKind::Prefetch).len() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }
    outputs
}

#[test]
fn a_prefetched_run_gives_the_same_numbers_as_one_without() {
    let _one = one_at_a_time();
    let dir = tempfile::TempDir::new().unwrap();
    let files = files(dir.path());
    let plain = run(&registry(&files, true, false, Arc::new(ListSink::new())), None);
    let sink = Arc::new(ListSink::new());
    let prefetched = run(&registry(&files, true, true, sink.clone()), Some(&sink));
    for (a, b) in plain.iter().zip(&prefetched) {
        assert!(a.equal(b), "prefetch changed a result");
    }
    let prefetches = sink.of_kind(EventKind::Prefetch);
    let names: Vec<(Option<String>, Option<String>)> =
        prefetches.iter().map(|e| (e.stage.clone(), e.model.clone())).collect();
    assert_eq!(names, [(Some("second".into()), Some("b".into())), (Some("third".into()), Some("a".into()))]);
    let loads: Vec<_> = sink.events().into_iter().filter(|e| e.kind.is_load() && e.prefetched).collect();
    assert_eq!(loads.len(), 2, "both prefetches ended in a load: {loads:?}");
    assert_eq!(loads[1].from, Some(ReloadFrom::InPlace), "a's return is a refill in place");
}

#[test]
fn builds_that_draw_random_numbers_are_not_prefetched() {
    let _one = one_at_a_time();
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
    let _one = one_at_a_time();
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
    let _one = one_at_a_time();
    let dir = tempfile::TempDir::new().unwrap();
    let files = files(dir.path());
    let sink = Arc::new(ListSink::new());
    let models = registry(&files, true, false, sink.clone());
    models.enter("second").unwrap();
    models.load("b").unwrap();
    models.enter("first").unwrap();
    std::fs::remove_file(&files[1]).unwrap();
    assert_eq!(models.prefetch("second").unwrap(), ["b"]);
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
    let _one = one_at_a_time();
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
    let _one = one_at_a_time();
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
