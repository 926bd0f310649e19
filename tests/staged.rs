//! StagedModels with real tch models on the CPU: plan validation, lazy loads, release and reload
//! in place, RNG preservation (with its control), threads, failing loaders, shared components,
//! stage hooks.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use stageload::hook::EnterOnCall;
use stageload::{Built, EventKind, ListSink, ModelSpec, ModelState, OutOfMemory, StageError, StagedModels};
use tch::nn::{self, Module, VarStore};
use tch::{Device, Kind, Tensor};

use stageload_test_support::torch as support;
use support::{build_mlp, input, mlp, Mlp};

fn spec(name: &str, width: i64) -> ModelSpec {
    ModelSpec::new(name, move |_| Ok(build_mlp(width)))
}

fn two_stage(sink: Arc<ListSink>) -> StagedModels {
    StagedModels::builder()
        .model(spec("encoder", 16))
        .model(spec("decoder", 16))
        .model(spec("helper", 8))
        .stage("encode", ["encoder"])
        .stage("decode", ["decoder"])
        .events(sink)
        .build()
        .unwrap()
}

#[test]
fn the_plan_is_validated_at_construction() {
    let _generator = support::generator();
    let err =
        StagedModels::builder().model(spec("a", 4)).stage("s", ["a", "ghost"]).pin("phantom").build().err().unwrap();
    match &err {
        StageError::PlanWithoutLoader { names } => {
            assert_eq!(names, &["ghost".to_string(), "phantom".to_string()])
        }
        other => panic!("unexpected {other}"),
    }
    assert!(err.to_string().contains("ghost") && err.to_string().contains("phantom"));
    let err = StagedModels::builder().model(spec("a", 4)).model(spec("a", 4)).build().err().unwrap();
    assert!(matches!(err, StageError::DuplicateModel { .. }), "{err}");
}

#[test]
fn membership_length_and_names_never_load() {
    let _generator = support::generator();
    let sink = Arc::new(ListSink::new());
    let models = two_stage(sink.clone());
    assert!(models.contains("encoder") && !models.contains("nope"));
    assert_eq!(models.len(), 3);
    assert_eq!(models.names(), ["encoder", "decoder", "helper"]);
    assert!(models.resident().is_empty());
    assert!(sink.events().is_empty());
    let err = models.get::<Mlp>("nope").err().unwrap();
    assert!(err.to_string().contains("'nope'") && err.to_string().contains("encoder"), "{err}");
}

#[test]
fn get_loads_once_and_notes_loads_outside_the_stage() {
    let _generator = support::generator();
    let sink = Arc::new(ListSink::new());
    let models = two_stage(sink.clone());
    models.enter("encode").unwrap();
    let encoder = models.get::<Mlp>("encoder").unwrap();
    let again = models.get::<Mlp>("encoder").unwrap();
    let guard = encoder.lock().unwrap();
    let err = again.lock().err().unwrap();
    assert!(
        matches!(err, StageError::LockedTwice { .. }),
        "locking twice on one thread is an error, not a deadlock: {err}"
    );
    drop(guard);
    let first = encoder.lock().unwrap().forward(&input(16));
    let second = again.lock().unwrap().forward(&input(16));
    assert!(first.equal(&second), "both handles reach the same model");
    let loads = sink.of_kind(EventKind::Load);
    assert_eq!(loads.len(), 1, "built once");
    assert_eq!(loads[0].model(), Some("encoder"));
    assert_eq!(loads[0].stage(), Some("encode"));
    assert_eq!(loads[0].bytes(), Some(2 * (16 * 16 + 16) * 4));
    assert!(!loads[0].loaded().unwrap().outside_stage);

    models.get::<Mlp>("helper").unwrap();
    let loads = sink.of_kind(EventKind::Load);
    assert!(loads[1].loaded().unwrap().outside_stage);

    let strict =
        StagedModels::builder().model(spec("a", 4)).model(spec("b", 4)).stage("s", ["a"]).strict(true).build().unwrap();
    strict.enter("s").unwrap();
    let err = strict.get::<Mlp>("b").err().unwrap();
    assert!(matches!(err, StageError::OutsideStage { .. }) && err.to_string().contains("'b'"), "{err}");
    assert!(strict.get::<Mlp>("a").is_ok());

    let err = models.get::<String>("encoder").err().unwrap();
    assert!(matches!(err, StageError::WrongType { .. }), "{err}");
}

#[test]
fn entering_a_stage_releases_in_place_and_handles_name_the_stage() {
    let _generator = support::generator();
    let sink = Arc::new(ListSink::new());
    let models = two_stage(sink.clone());
    let err = models.enter("nowhere").unwrap_err();
    assert!(
        err.to_string().contains("'nowhere'")
            && err.to_string().contains("decode")
            && err.to_string().contains("encode"),
        "{err}"
    );

    models.enter("encode").unwrap();
    let encoder = models.get::<Mlp>("encoder").unwrap();
    models.pin("helper").unwrap();
    models.get::<Mlp>("helper").unwrap();
    let raw_weight = encoder.lock().unwrap().l1.ws.shallow_clone();

    let stats = models.enter("decode").unwrap();
    assert_eq!(stats.freed, 2 * (16 * 16 + 16) * 4);
    assert_eq!(models.resident(), ["helper"], "pinned helper stays, encoder goes");
    assert!(encoder.is_released());
    let err = encoder.lock().err().unwrap();
    assert!(err.to_string().contains("'encoder' was released when entering stage 'decode'"), "{err}");
    // Code that bypasses the handle gets libtorch's error, never stale numbers.
    let err = raw_weight.f_sum(Kind::Float).unwrap_err();
    assert!(err.to_string().contains("'encoder' was released"), "{err}");

    let kinds: Vec<EventKind> = sink.events().iter().map(|e| e.kind()).collect();
    assert_eq!(kinds, [EventKind::Stage, EventKind::Load, EventKind::Load, EventKind::Stage, EventKind::Release]);

    models.unpin("helper");
    models.enter("decode").unwrap();
    assert!(models.resident().is_empty(), "unpinned helper goes at the next enter");
}

#[test]
fn reload_without_checkpoint_rebuilds_and_old_handles_stay_released() {
    let _generator = support::generator();
    let sink = Arc::new(ListSink::new());
    let models = two_stage(sink.clone());
    models.enter("encode").unwrap();
    let old = models.get::<Mlp>("encoder").unwrap();
    models.enter("decode").unwrap();
    models.enter("encode").unwrap();
    let new = models.get::<Mlp>("encoder").unwrap();
    assert!(old.lock().is_err() && new.lock().is_ok());
    let reload = &sink.of_kind(EventKind::Reload)[0];
    assert_eq!(reload.reload_from(), Some(stageload::ReloadFrom::Rebuilt));
}

#[test]
fn two_threads_asking_for_one_model_build_it_once() {
    let _generator = support::generator();
    let builds = Arc::new(AtomicUsize::new(0));
    let models = Arc::new(
        StagedModels::builder()
            .model(ModelSpec::new("slow", {
                let builds = builds.clone();
                move |_| {
                    builds.fetch_add(1, Ordering::SeqCst);
                    std::thread::sleep(std::time::Duration::from_millis(200));
                    Ok(build_mlp(8))
                }
            }))
            .model(spec("other", 8))
            .build()
            .unwrap(),
    );
    let threads: Vec<_> = (0..2)
        .map(|_| {
            let models = models.clone();
            std::thread::spawn(move || models.get::<Mlp>("slow").unwrap().lock().unwrap().forward(&input(8)))
        })
        .collect();
    let outs: Vec<Tensor> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    assert_eq!(builds.load(Ordering::SeqCst), 1);
    assert!(outs[0].equal(&outs[1]));
    // Two models held at once.
    let (a, b) = (models.get::<Mlp>("slow").unwrap(), models.get::<Mlp>("other").unwrap());
    let (ga, gb) = (a.lock().unwrap(), b.lock().unwrap());
    assert_eq!(ga.forward(&input(8)).size(), gb.forward(&input(8)).size());
}

#[derive(Debug)]
struct Extractor {
    backbone: stageload::Shared<Mlp>,
    head: nn::Linear,
}

impl Extractor {
    fn forward(&self, xs: &Tensor) -> Tensor {
        self.backbone.lock().forward(xs).apply(&self.head)
    }
}

fn extractor(name: &str, builds: Arc<AtomicUsize>) -> ModelSpec {
    ModelSpec::new(name, move |ctx| {
        let backbone = ctx.shared("backbone", || {
            builds.fetch_add(1, Ordering::SeqCst);
            let vs = VarStore::new(Device::Cpu);
            let model = mlp(&vs, 256);
            Ok((model, vs.variables().into_iter().collect()))
        })?;
        let vs = VarStore::new(Device::Cpu);
        let head = nn::linear(vs.root() / "head", 256, 4, Default::default());
        Ok(Built::new(Extractor { backbone, head }, &vs))
    })
}

#[test]
fn a_shared_backbone_is_built_once_and_freed_after_its_last_user() {
    let _generator = support::generator();
    let builds = Arc::new(AtomicUsize::new(0));
    let sink = Arc::new(ListSink::new());
    let models = StagedModels::builder()
        .model(extractor("ss", builds.clone()))
        .model(extractor("shape", builds.clone()))
        .stage("structure", ["ss", "shape"])
        .stage("shape_only", ["shape"])
        .stage("decode", Vec::<String>::new())
        .events(sink.clone())
        .build()
        .unwrap();
    models.enter("structure").unwrap();
    let ss = models.get::<Extractor>("ss").unwrap();
    let shape = models.get::<Extractor>("shape").unwrap();
    assert_eq!(builds.load(Ordering::SeqCst), 1, "one backbone");
    let backbone_bytes = 2 * (256 * 256 + 256) * 4;
    let head_bytes = (256 * 4 + 4) * 4;
    assert_eq!(models.resident_bytes(), backbone_bytes + 2 * head_bytes, "shared storage counted once");
    let loaded: Vec<Option<u64>> = sink.of_kind(EventKind::Load).iter().map(|e| e.bytes()).collect();
    assert_eq!(
        loaded,
        [Some(backbone_bytes + head_bytes), Some(head_bytes)],
        "the reused backbone is not loaded twice"
    );
    let resident: Vec<Option<u64>> = sink.of_kind(EventKind::Load).iter().map(|e| e.resident()).collect();
    assert_eq!(resident, [Some(backbone_bytes + head_bytes), Some(backbone_bytes + 2 * head_bytes)]);

    let stats = models.enter("shape_only").unwrap();
    assert_eq!((stats.freed, stats.kept), (head_bytes, backbone_bytes), "backbone kept for 'shape'");
    assert!(shape.lock().unwrap().forward(&input(256)).size() == [2, 4]);
    assert!(ss.lock().is_err());

    let stats = models.enter("decode").unwrap();
    assert_eq!((stats.freed, stats.kept), (head_bytes + backbone_bytes, 0), "freed after the last user");
    let release = sink.of_kind(EventKind::Release);
    assert!(matches!(&release[0].what, stageload::What::Release(r) if r.kept_bytes == backbone_bytes), "{release:?}");

    // Needed again: the released backbone is rebuilt, not handed out empty.
    models.enter("shape_only").unwrap();
    let shape = models.get::<Extractor>("shape").unwrap();
    assert!(shape.lock().unwrap().forward(&input(256)).size() == [2, 4]);
    assert_eq!(builds.load(Ordering::SeqCst), 2);
}

#[test]
fn close_releases_pinned_models_and_refuses_later_loads() {
    let _generator = support::generator();
    let sink = Arc::new(ListSink::new());
    let models = two_stage(sink.clone());
    models.pin("helper").unwrap();
    let helper = models.get::<Mlp>("helper").unwrap();
    models.close();
    assert!(helper.lock().is_err());
    let events = sink.events();
    let close = events.iter().position(stageload::Event::is_close).expect("a close mark");
    assert_eq!(events[close].kind(), EventKind::Mark);
    assert!(events[close + 1..].iter().any(|e| e.kind() == EventKind::Release), "the releases come after the mark");
    let err = models.get::<Mlp>("encoder").err().unwrap();
    assert!(matches!(err, StageError::Closed { .. }) && err.to_string().contains("'encoder'"), "{err}");
    assert!(models.pin("ghost").is_err());
}

#[test]
fn registered_models_removal_and_hand_over() {
    let _generator = support::generator();
    let models = two_stage(Arc::new(ListSink::new()));
    models.insert("prebuilt", build_mlp(4)).unwrap();
    assert_eq!(models.len(), 4);
    let prebuilt = models.get::<Mlp>("prebuilt").unwrap();
    models.enter("encode").unwrap();
    assert!(prebuilt.lock().is_err());
    let err = models.get::<Mlp>("prebuilt").err().unwrap();
    assert!(matches!(err, StageError::NoLoader { .. }) && err.to_string().contains("cannot come back"), "{err}");

    models.remove("prebuilt").unwrap();
    assert!(!models.contains("prebuilt"));

    let taken = models.take::<Mlp>("decoder").unwrap();
    assert!(!models.contains("decoder"));
    models.enter("encode").unwrap();
    assert!(taken.lock().is_ok(), "a handed-over model is never released by the registry");
}

#[test]
fn a_model_locked_by_this_thread_is_released_when_its_guard_drops() {
    let _generator = support::generator();
    let sink = Arc::new(ListSink::new());
    let models = two_stage(sink.clone());
    models.enter("encode").unwrap();
    let encoder = models.get::<Mlp>("encoder").unwrap();
    let guard = encoder.lock().unwrap();
    let stats = models.enter("decode").unwrap();
    assert_eq!(stats.freed, 0, "nothing is freed under a live guard");
    assert!(guard.forward(&input(16)).f_sum(Kind::Float).is_ok(), "the guard's holder keeps computing");
    assert_eq!(models.states()[0], ("encoder".to_string(), ModelState::ReleasePending));
    assert!(sink.of_kind(EventKind::Release).is_empty());
    drop(guard);
    assert!(encoder.is_released());
    let release = sink.of_kind(EventKind::Release);
    assert_eq!(release.len(), 1, "the drop carried the release out");
    assert!(release[0].bytes().unwrap() > 0 && release[0].stage() == Some("decode"));
    assert_eq!(models.states()[0], ("encoder".to_string(), ModelState::Released));
}

#[test]
fn a_wrapped_module_enters_its_stage_when_called() {
    let _generator = support::generator();
    let sink = Arc::new(ListSink::new());
    let models = Arc::new(two_stage(sink.clone()));
    models.enter("encode").unwrap();
    let encoder = models.get::<Mlp>("encoder").unwrap();
    let decode_step = EnterOnCall::new(models.clone(), "decode", Tensor::ones([16, 16], (Kind::Float, Device::Cpu)))
        .mark_end("decode done");
    // The pipeline's own code only calls the wrapped value.
    let out = decode_step.call(|w| input(16).matmul(w)).unwrap();
    assert_eq!(out.size(), [2, 16]);
    assert_eq!(models.current_stage().as_deref(), Some("decode"));
    assert!(encoder.is_released());
    decode_step.call(|_| ()).unwrap();
    assert_eq!(sink.of_kind(EventKind::Stage).len(), 2, "calling again in the same stage enters nothing");
    assert_eq!(sink.of_kind(EventKind::Mark).len(), 2);

    // As a tch Module.
    let layer = EnterOnCall::new(
        models.clone(),
        "encode",
        nn::linear(VarStore::new(Device::Cpu).root(), 16, 16, Default::default()),
    );
    let _ = layer.forward(&input(16));
    assert_eq!(models.current_stage().as_deref(), Some("encode"));
}

#[test]
fn a_replacement_that_shares_weights_keeps_them_and_removal_unpins() {
    let _generator = support::generator();
    let models = two_stage(Arc::new(ListSink::new()));
    let vs = VarStore::new(Device::Cpu);
    let first = mlp(&vs, 4);
    let shared_weight = first.l1.ws.shallow_clone();
    models.insert("swap", Built::new(first, &vs)).unwrap();
    // The replacement shares l1's weight with the model it replaces.
    let replacement =
        Built::from_tensors(shared_weight.shallow_clone(), vec![("w".into(), shared_weight.shallow_clone())]);
    models.insert("swap", replacement).unwrap();
    assert!(shared_weight.f_sum(Kind::Float).is_ok(), "shared weight kept");
    assert!(models.get::<Tensor>("swap").unwrap().lock().is_ok());

    models.pin("swap").unwrap();
    models.remove("swap").unwrap();
    models.insert("swap", build_mlp(4)).unwrap();
    models.enter("encode").unwrap();
    assert!(!models.resident().contains(&"swap".to_string()), "the removed pin does not come back with the name");
}

#[test]
fn the_pipeline_file_that_plan_checks_is_the_plan_that_runs() {
    let _generator = support::generator();
    let folder = tempfile::TempDir::new().unwrap();
    let dir = folder.path();
    // Checkpoints written from a reference model; the loaders below build fresh random ones.
    let vs = VarStore::new(Device::Cpu);
    let reference = mlp(&vs, 16);
    let reference_out = reference.forward(&input(16));
    let tensors: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    for name in ["encoder", "decoder"] {
        stageload::checkpoint::save(&tensors, dir.join(format!("{name}.safetensors"))).unwrap();
    }
    let toml = "pinned = [\"encoder\"]\n\
        [[models]]\nname = \"encoder\"\nfiles = [\"encoder.safetensors\"]\n\
        [[models]]\nname = \"decoder\"\nfiles = [\"decoder.safetensors\"]\n\
        [[stages]]\nname = \"encode\"\nmodels = [\"encoder\"]\n\
        [[stages]]\nname = \"decode\"\nmodels = [\"decoder\"]\n";
    let path = dir.join("pipeline.toml");
    std::fs::write(&path, toml).unwrap();
    let pipeline = stageload::Pipeline::load(&path).unwrap();

    let models = StagedModels::builder()
        .pipeline(&pipeline)
        .model(spec("encoder", 16))
        .model(spec("decoder", 16))
        .build()
        .unwrap();
    assert_eq!(models.stage_models("decode").unwrap(), ["decoder"]);
    models.enter("encode").unwrap();
    let encoder = models.get::<Mlp>("encoder").unwrap();
    assert!(
        encoder.lock().unwrap().forward(&input(16)).equal(&reference_out),
        "weights came from the file's checkpoint"
    );
    models.enter("decode").unwrap();
    models.get::<Mlp>("decoder").unwrap();
    assert_eq!(models.resident(), ["encoder", "decoder"], "the file's pin holds");

    // A model of the file without a loader is refused, by name.
    let err = StagedModels::builder().pipeline(&pipeline).model(spec("encoder", 16)).build().err().unwrap();
    assert!(matches!(&err, StageError::PlanWithoutLoader { names } if names == &["decoder"]), "{err}");
}

/// A loader that runs out of memory the first `failures` times, as a CUDA build would.
fn tight(failures: usize) -> ModelSpec {
    let calls = Arc::new(AtomicUsize::new(0));
    ModelSpec::new("big", move |_| {
        if calls.fetch_add(1, Ordering::SeqCst) < failures {
            return Err("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 2.0 GiB free)".into());
        }
        Ok(build_mlp(8))
    })
}

#[test]
fn out_of_memory_is_a_typed_error_and_the_policy_releases_others_and_retries_once() {
    let _generator = support::generator();
    let registry = |failures, policy| {
        let sink = Arc::new(ListSink::new());
        let models = StagedModels::builder()
            .model(tight(failures))
            .model(spec("stray", 8))
            .stage("s", ["big"])
            .on_out_of_memory(policy)
            .events(sink.clone())
            .build()
            .unwrap();
        models.enter("s").unwrap();
        models.load("stray").unwrap(); // outside the stage: the policy's candidate
        (models, sink)
    };
    let (models, _) = registry(1, OutOfMemory::Fail);
    let err = models.load("big").unwrap_err();
    assert!(
        matches!(&err, StageError::OutOfMemory { model, stage, .. } if model == "big" && stage.as_deref() == Some("s")),
        "{err}"
    );
    assert!(
        err.to_string().contains("Tried to allocate 2.00 GiB") && err.to_string().contains("ReleaseOthersAndRetry")
    );
    assert_eq!(models.resident(), ["stray"], "nothing released without the policy");

    let (models, sink) = registry(1, OutOfMemory::ReleaseOthersAndRetry);
    models.load("big").unwrap();
    assert_eq!(models.resident(), ["big"], "the stray model went, the retry fitted");
    assert_eq!(sink.of_kind(EventKind::Release)[0].model(), Some("stray"));

    let (models, _) = registry(2, OutOfMemory::ReleaseOthersAndRetry);
    assert!(matches!(models.load("big"), Err(StageError::OutOfMemory { .. })), "retried once only");

    let (models, _) = registry(0, OutOfMemory::Fail);
    let err =
        models.call("big", |_: &mut Mlp| -> () { panic!("CUDA out of memory. Tried to allocate 1 GiB") }).unwrap_err();
    assert!(matches!(err, StageError::OutOfMemory { .. }), "{err}");
}

/// A model object that counts its drops.
struct Counted {
    mlp: Mlp,
    dropped: Arc<AtomicUsize>,
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.dropped.fetch_add(1, Ordering::SeqCst);
    }
}

fn counted(name: &str, checkpoint: Option<&std::path::Path>, dropped: Arc<AtomicUsize>) -> ModelSpec {
    let spec = ModelSpec::new(name, move |_| {
        let vs = VarStore::new(Device::Cpu);
        let model = Counted { mlp: mlp(&vs, 8), dropped: Arc::clone(&dropped) };
        Ok(Built::new(model, &vs))
    });
    match checkpoint {
        Some(file) => spec.checkpoint([file]),
        None => spec,
    }
}

#[test]
fn a_released_model_that_will_be_rebuilt_drops_its_object_at_once_and_one_refilled_in_place_keeps_it() {
    let _generator = support::generator();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("mlp.safetensors");
    let vs = VarStore::new(Device::Cpu);
    let _ = mlp(&vs, 8);
    stageload::checkpoint::save(&vs.variables().into_iter().collect::<Vec<_>>(), &file).unwrap();
    let (rebuilt, refilled) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let sink = Arc::new(ListSink::new());
    let models = StagedModels::builder()
        .model(counted("rebuilt", None, Arc::clone(&rebuilt)))
        .model(counted("refilled", Some(&file), Arc::clone(&refilled)))
        .model(spec("other", 4))
        .stage("both", ["rebuilt", "refilled"])
        .stage("other", ["other"])
        .stage("both", ["rebuilt", "refilled"])
        .events(sink.clone())
        .build()
        .unwrap();
    let forward = |name: &str| models.call(name, |m: &mut Counted| m.mlp.forward(&input(8))).unwrap();
    models.enter("both").unwrap();
    let (first_rebuilt, first_refilled) = (forward("rebuilt"), forward("refilled"));
    let handle = models.get::<Counted>("rebuilt").unwrap();
    models.enter("other").unwrap();
    // Nothing of the first object is used again: it went with the release, not at the rebuild.
    assert_eq!(rebuilt.load(Ordering::SeqCst), 1, "dropped at its release");
    assert_eq!(refilled.load(Ordering::SeqCst), 0, "kept to be refilled in place");
    assert!(matches!(handle.lock().err().unwrap(), StageError::Released { .. }), "an old handle says so");

    models.enter("both").unwrap();
    assert!(forward("refilled").equal(&first_refilled), "the same object, refilled from its file");
    assert_eq!(refilled.load(Ordering::SeqCst), 0);
    assert_eq!(forward("rebuilt").size(), first_rebuilt.size(), "a new object");
    let reloads = sink.of_kind(EventKind::Reload);
    let from: Vec<_> = reloads.iter().map(|e| (e.model().unwrap(), e.reload_from().unwrap())).collect();
    assert_eq!(from, [("refilled", stageload::ReloadFrom::InPlace), ("rebuilt", stageload::ReloadFrom::Rebuilt)]);
    drop(models);
    assert_eq!((rebuilt.load(Ordering::SeqCst), refilled.load(Ordering::SeqCst)), (2, 1), "each object dropped once");
}

#[test]
fn state_gives_one_models_state_and_names_an_unknown_one() {
    let _generator = support::generator();
    let models = two_stage(Arc::new(ListSink::new()));
    assert_eq!(models.state("encoder").unwrap(), ModelState::Unloaded, "asking never loads");
    models.enter("encode").unwrap();
    models.load("encoder").unwrap();
    assert_eq!(models.state("encoder").unwrap(), ModelState::Resident);
    models.enter("decode").unwrap();
    assert_eq!(models.state("encoder").unwrap(), ModelState::Released);
    for (name, state) in models.states() {
        assert_eq!(models.state(&name).unwrap(), state, "{name}: the same as states() says");
    }
    let err = models.state("ghost").unwrap_err();
    assert!(matches!(&err, StageError::UnknownModel { name, known } if name == "ghost" && known.len() == 3), "{err}");
    assert!(err.to_string().contains("'ghost'") && err.to_string().contains("encoder"), "{err}");
}

/// A model of one `[n]` float tensor (the model object is the tensor itself).
fn floats(name: &str, n: i64) -> ModelSpec {
    ModelSpec::new(name, move |_| {
        let w = Tensor::zeros([n], (Kind::Float, Device::Cpu));
        Ok(Built::from_tensors(w.shallow_clone(), vec![("w".to_string(), w)]))
    })
}

/// A model of a `[n]` head and a backbone of `BACKBONE` floats it shares with the other models
/// built with it (one storage, counted once).
fn sharing(name: &str, n: i64) -> ModelSpec {
    ModelSpec::new(name, move |ctx| {
        let backbone = ctx.shared("backbone", || {
            let w = Tensor::zeros([BACKBONE], (Kind::Float, Device::Cpu));
            Ok((w.shallow_clone(), vec![("w".to_string(), w)]))
        })?;
        let head = Tensor::zeros([n], (Kind::Float, Device::Cpu));
        Ok(Built::from_tensors((backbone, head.shallow_clone()), vec![("head".to_string(), head)]))
    })
}

const BACKBONE: i64 = 64;

/// The bytes the models holding storage hold, counted from scratch from `states()` and each
/// model's own size (`own`), the backbone once when a model sharing it holds storage; checked
/// against the registry's indexed figures: `resident_bytes()` and `resident()`.
fn check_index(models: &StagedModels, own: &std::collections::HashMap<String, u64>, what: &str) {
    let states = models.states();
    let holding: Vec<&String> = states
        .iter()
        .filter(|(_, s)| matches!(s, ModelState::Resident | ModelState::ReleasePending))
        .map(|(name, _)| name)
        .collect();
    let shared = holding.iter().any(|name| name.starts_with('u'));
    let expected: u64 =
        holding.iter().map(|name| own[*name]).sum::<u64>() + if shared { BACKBONE as u64 * 4 } else { 0 };
    assert_eq!(models.resident_bytes(), expected, "{what}: resident bytes against a count over {states:?}");
    let resident: Vec<String> =
        states.iter().filter(|(_, s)| *s == ModelState::Resident).map(|(name, _)| name.clone()).collect();
    assert_eq!(models.resident(), resident, "{what}: resident() against states()");
}

#[test]
fn the_indexed_resident_figures_agree_with_a_count_from_scratch_through_every_kind_of_change() {
    let _generator = support::generator();
    let dir = tempfile::tempdir().unwrap();
    let mut own = std::collections::HashMap::new();
    let mut builder = StagedModels::builder();
    // c*: a checkpoint each (refilled in place, prefetchable); r*: rebuilt; u*: a shared backbone.
    for i in 0..4 {
        let (c, r) = (format!("c{i}"), format!("r{i}"));
        let file = dir.path().join(format!("{c}.safetensors"));
        stageload::checkpoint::save(&[("w".to_string(), Tensor::ones([20 + i], (Kind::Float, Device::Cpu)))], &file)
            .unwrap();
        builder = builder.model(floats(&c, 20 + i).checkpoint([file]).skip_init(true)).model(floats(&r, 10 + i));
        own.insert(c, 4 * (20 + i) as u64);
        own.insert(r, 4 * (10 + i) as u64);
    }
    for i in 0..2 {
        builder = builder.model(sharing(&format!("u{i}"), 30 + i));
        own.insert(format!("u{i}"), 4 * (30 + i) as u64);
    }
    let models = builder
        .stage("one", ["c0", "r0", "u0"])
        .stage("two", ["c1", "r1", "u1", "c0"])
        .stage("three", ["c2", "c3", "r3"])
        .pin_between("r2", Some("two".to_string()), Some("three".to_string()))
        .build()
        .unwrap();
    let call = |names: &[&str]| {
        for &name in names {
            if name.starts_with('u') {
                models.call(name, |m: &mut (stageload::Shared<Tensor>, Tensor)| m.1.numel()).unwrap();
            } else {
                models.call(name, |w: &mut Tensor| w.numel()).unwrap();
            }
        }
    };
    check_index(&models, &own, "built");
    models.enter("one").unwrap();
    call(&["c0", "r0", "u0"]);
    check_index(&models, &own, "stage one loaded");
    models.enter("two").unwrap();
    call(&["c1", "r1", "u1", "r2"]);
    check_index(&models, &own, "stage two: c0 stays, r2 pinned by its span");

    // A release pending while a guard holds the model, carried out when it drops.
    let r1 = models.get::<Tensor>("r1").unwrap();
    let guard = r1.lock().unwrap();
    models.enter("three").unwrap();
    assert_eq!(models.state("r1").unwrap(), ModelState::ReleasePending);
    check_index(&models, &own, "r1's release pending");
    drop(guard);
    check_index(&models, &own, "r1 released by its guard");
    assert_eq!(models.state("r2").unwrap(), ModelState::Released, "its span ended at 'three', which does not list it");

    // insert, and insert over it.
    models
        .insert("x", Built::from_tensors((), vec![("w".into(), Tensor::zeros([7], (Kind::Float, Device::Cpu)))]))
        .unwrap();
    own.insert("x".into(), 28);
    check_index(&models, &own, "inserted");
    models
        .insert("x", Built::from_tensors((), vec![("w".into(), Tensor::zeros([9], (Kind::Float, Device::Cpu)))]))
        .unwrap();
    own.insert("x".into(), 36);
    check_index(&models, &own, "inserted over");
    // A load outside the stage (a refill in place), a pin across the next stage.
    models.load("c0").unwrap();
    models.pin("c0").unwrap();
    check_index(&models, &own, "c0 loaded outside its stage");
    models.enter("one").unwrap();
    check_index(&models, &own, "c0 pinned, x released");

    // remove and take shift the positions of every slot after them.
    models.remove("r0").unwrap();
    check_index(&models, &own, "r0 removed");
    let taken = models.take::<(stageload::Shared<Tensor>, Tensor)>("u0").unwrap();
    check_index(&models, &own, "u0 taken (its storage is no longer the registry's)");
    models.remove("x").unwrap();
    check_index(&models, &own, "x removed");

    // Prefetch: refills and a skip_init build in the background.
    let prefetched = models.prefetch("three").unwrap();
    assert_eq!(prefetched, ["c2", "c3"], "the r* builds draw random numbers: not prefetched");
    models.wait_prefetch("three").unwrap();
    check_index(&models, &own, "c2 and c3 prefetched");
    models.enter("three").unwrap();
    call(&["c2", "c3", "r3"]);
    check_index(&models, &own, "stage three loaded, c0 pinned");

    models.close();
    check_index(&models, &own, "closed");
    assert_eq!(models.resident_bytes(), 0, "closing releases every model");
    assert!(taken.lock().is_ok(), "a taken model is never released by the registry");
}
