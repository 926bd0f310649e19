//! The registry across threads, each scenario under a deadline: entering a stage never waits for
//! a model in use elsewhere, and nothing else in the registry waits for it either; loads racing
//! inserts; handles and type checks while a model is locked; the one-call form.

use std::sync::mpsc;
use std::sync::{Arc, Barrier};
use std::time::Duration;

use stageload::{Built, EventKind, ListSink, ModelSpec, ModelState, StageError, StagedModels};
use tch::nn::Module;
use tch::{Kind, Tensor};

use stageload_test_support::torch as support;
use support::{build_mlp, input, Mlp};

const DEADLINE: Duration = Duration::from_secs(60);

/// Runs `f` on a thread of its own and fails the test if it has not returned by `deadline`.
fn within<T: Send + 'static>(deadline: Duration, what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (done, finished) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(f());
    });
    finished.recv_timeout(deadline).unwrap_or_else(|_| panic!("{what}: not done after {deadline:?} (a hang)"))
}

fn registry(sink: Arc<ListSink>) -> Arc<StagedModels> {
    let spec = |name: &str| ModelSpec::new(name, |_| Ok(build_mlp(16)));
    Arc::new(
        StagedModels::builder()
            .model(spec("encoder"))
            .model(spec("decoder"))
            .stage("encode", ["encoder"])
            .stage("decode", ["decoder"])
            .stage("both", ["encoder", "decoder"])
            .events(sink)
            .build()
            .unwrap(),
    )
}

#[test]
fn a_stage_entered_while_another_thread_uses_a_model_it_releases_blocks_no_one() {
    let _generator = support::generator();
    let sink = Arc::new(ListSink::new());
    let models = registry(sink.clone());
    models.enter("encode").unwrap();
    let (locked, is_locked) = mpsc::channel();
    let (entered, has_entered) = mpsc::channel::<()>();
    let user = {
        let models = models.clone();
        std::thread::spawn(move || {
            let encoder = models.get::<Mlp>("encoder").unwrap();
            let guard = encoder.lock().unwrap();
            locked.send(()).unwrap();
            has_entered.recv().unwrap();
            // The registry answers while this thread still holds the encoder.
            let decoder = models.get::<Mlp>("decoder").unwrap();
            let resident = models.resident();
            let y = decoder.lock().unwrap().forward(&guard.forward(&input(16)));
            drop(guard);
            (resident, y.size())
        })
    };
    is_locked.recv_timeout(DEADLINE).unwrap();
    let stats = {
        let models = models.clone();
        within(DEADLINE, "enter while the encoder is in use", move || models.enter("decode").unwrap())
    };
    assert_eq!(stats.freed, 0, "the encoder is in use: its release is left to its user");
    entered.send(()).unwrap();
    let (resident, size) = within(DEADLINE, "the user's calls", move || user.join().unwrap());
    assert_eq!(resident, ["decoder"]);
    assert_eq!(size, [2, 16]);
    assert_eq!(models.states()[0], ("encoder".to_string(), ModelState::Released), "freed when the guard dropped");
    assert_eq!(sink.of_kind(EventKind::Release).len(), 1);
}

#[test]
fn two_threads_use_two_models_for_many_rounds_while_a_third_enters_stages() {
    let _generator = support::generator();
    let models = registry(Arc::new(ListSink::new()));
    models.enter("both").unwrap();
    let reference: Vec<Tensor> = ["encoder", "decoder"]
        .iter()
        .map(|m| models.call(m, |net: &mut Mlp| net.forward(&input(16))).unwrap())
        .collect();
    let start = Arc::new(Barrier::new(3));
    let users: Vec<_> = ["encoder", "decoder"]
        .into_iter()
        .map(|name| {
            let (models, start) = (models.clone(), start.clone());
            std::thread::spawn(move || {
                start.wait();
                let mut computed = 0;
                for _ in 0..300 {
                    match models.call(name, |net: &mut Mlp| net.forward(&input(16))) {
                        Ok(_) => computed += 1,
                        // Released between the get and the lock by the stage thread: fine.
                        Err(StageError::Released { .. }) => {}
                        Err(other) => panic!("{name}: {other}"),
                    }
                }
                computed
            })
        })
        .collect();
    let stages = {
        let (models, start) = (models.clone(), start.clone());
        std::thread::spawn(move || {
            start.wait();
            for round in 0..300 {
                models.enter(["encode", "decode", "both"][round % 3]).unwrap();
            }
        })
    };
    let computed: Vec<i32> = within(DEADLINE, "300 rounds on three threads", move || {
        stages.join().unwrap();
        users.into_iter().map(|u| u.join().unwrap()).collect()
    });
    assert!(computed.iter().all(|&c| c > 0), "both users computed: {computed:?}");
    models.enter("both").unwrap();
    for (name, expected) in ["encoder", "decoder"].iter().zip(&reference) {
        let y = models.call(name, |net: &mut Mlp| net.forward(&input(16))).unwrap();
        assert!(y.equal(expected), "{name}: rebuilt under preserved RNG, the same weights");
    }
}

#[test]
fn an_insert_during_a_build_wins_and_the_build_installs_nothing() {
    let _generator = support::generator();
    let (started, has_started) = mpsc::channel();
    let go = Arc::new(Barrier::new(2));
    let loader_go = go.clone();
    let sink = Arc::new(ListSink::new());
    let models = Arc::new(
        StagedModels::builder()
            .model(ModelSpec::new("slow", move |_| {
                started.send(()).unwrap();
                loader_go.wait();
                Ok(Built::from_tensors("built".to_string(), vec![]))
            }))
            .events(sink.clone())
            .build()
            .unwrap(),
    );
    let getter = {
        let models = models.clone();
        std::thread::spawn(move || models.call("slow", |s: &mut String| s.clone()))
    };
    has_started.recv_timeout(DEADLINE).unwrap();
    assert_eq!(models.states(), [("slow".to_string(), ModelState::Loading)]);
    {
        let models = models.clone();
        within(DEADLINE, "insert during a build", move || {
            models.insert("slow", Built::from_tensors("inserted".to_string(), vec![])).unwrap()
        });
    }
    go.wait();
    let got = within(DEADLINE, "the get that started the build", move || getter.join().unwrap()).unwrap();
    assert_eq!(got, "inserted", "the inserted model stands; the build's result was dropped");
    assert!(sink.of_kind(EventKind::Load).is_empty(), "a discarded build reports no load");
}

#[test]
fn tensors_and_the_type_check_answer_while_the_model_is_locked() {
    let _generator = support::generator();
    let models = registry(Arc::new(ListSink::new()));
    let encoder = models.get::<Mlp>("encoder").unwrap();
    let guard = encoder.lock().unwrap();
    let tensors = {
        let encoder = encoder.clone();
        within(DEADLINE, "tensors() beside a guard", move || encoder.tensors().len())
    };
    assert_eq!(tensors, 4, "two linear layers, weight and bias each");
    assert_eq!(encoder.tensors().len(), 4, "on the guard's own thread too");
    let err = {
        let models = models.clone();
        within(DEADLINE, "a typed get of a locked model", move || models.get::<String>("encoder").err().unwrap())
    };
    assert!(matches!(&err, StageError::WrongType { actual, .. } if actual.contains("Mlp")), "{err}");
    let err = encoder.lock().err().unwrap();
    assert!(matches!(err, StageError::LockedTwice { .. }), "{err}");
    drop(guard);
}

/// A model with state that changes as it is called (a KV cache, a sampler's step).
struct Counter {
    calls: u32,
}

#[test]
fn call_gives_the_model_mutably_and_survives_a_panic_inside() {
    let _generator = support::generator();
    let models = StagedModels::builder()
        .model(ModelSpec::new("counter", |_| Ok(Built::from_tensors(Counter { calls: 0 }, vec![]))))
        .build()
        .unwrap();
    for expected in 1..=3 {
        assert_eq!(
            models
                .call("counter", |c: &mut Counter| {
                    c.calls += 1;
                    c.calls
                })
                .unwrap(),
            expected
        );
    }
    let err = models.call("counter", |_: &mut Counter| -> u32 { panic!("sampler blew up") }).unwrap_err();
    assert!(
        matches!(&err, StageError::CallPanicked { model, message } if model == "counter" && message == "sampler blew up")
    );
    assert_eq!(models.call("counter", |c: &mut Counter| c.calls).unwrap(), 3, "unlocked and usable after the panic");
    let err = models.call("nobody", |c: &mut Counter| c.calls).unwrap_err();
    assert!(matches!(&err, StageError::UnknownModel { known, .. } if known == &["counter"]), "{err}");
    let err = models.call("counter", |t: &mut Tensor| t.sum(Kind::Float)).unwrap_err();
    assert!(err.to_string().contains("Counter") && err.to_string().contains("Tensor"), "{err}");
}
