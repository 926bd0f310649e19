//! Slow copies (`stageload::copy_watch::slow_copies`): every copy piece waits first, and the
//! storages copies use are watched. With it on, a streamed model refilled ahead of its forward
//! and a pipeline whose prefetches are overtaken by stages that do not list their models give
//! the outputs of the same work at full speed, bit for bit, and no storage is freed or given new
//! memory while a copy uses it. The mode is process-wide: this binary holds only these tests,
//! one at a time. (The host tier's copies run on the CPU only inside the library's own tests:
//! `staged::tier_tests` checks them the same way, in a child process.)

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use stageload::checkpoint::Checkpoint;
use stageload::copy_watch::{slow_copies, violations};
use stageload::stream::{BlockSpec, StreamedModel};
use stageload::{ModelSpec, NameRules, StagedModels};
use tch::nn::{Module, VarStore};
use tch::{Device, Kind, Tensor};

use stageload_test_support::torch as support;
use support::{build_mlp, mlp, Mlp};

/// The wait before every copy piece.
const DELAY: Duration = Duration::from_millis(20);
const WIDTH: i64 = 256;
/// Bytes of one layer (a block of the streamed model): weight and bias, f32.
const LAYER: u64 = ((WIDTH * WIDTH + WIDTH) * 4) as u64;

/// One test at a time (the mode is the process's), the mode off again at the end, even after a
/// failure.
struct Slow(#[allow(dead_code)] std::sync::MutexGuard<'static, ()>);

impl Slow {
    fn begin() -> Slow {
        static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let guard = ONE.lock().unwrap_or_else(|e| e.into_inner());
        slow_copies(DELAY);
        Slow(guard)
    }
}

impl Drop for Slow {
    fn drop(&mut self) {
        slow_copies(Duration::ZERO);
    }
}

/// `f` on a thread of its own, failing after `seconds` instead of hanging.
fn within<T: Send + 'static>(seconds: u64, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (done, finished) = mpsc::channel();
    let thread = std::thread::spawn(move || {
        let _ = done.send(f());
    });
    match finished.recv_timeout(Duration::from_secs(seconds)) {
        Ok(value) => value,
        // It panicked: its panic is the test's.
        Err(mpsc::RecvTimeoutError::Disconnected) => std::panic::resume_unwind(thread.join().unwrap_err()),
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("not done after {seconds} s (a hang)"),
    }
}

/// Checkpoints of seeded width-256 MLPs `names` in `dir`.
fn checkpoints(dir: &Path, names: &[&str]) -> Vec<PathBuf> {
    tch::manual_seed(3);
    names
        .iter()
        .map(|name| {
            let vs = VarStore::new(Device::Cpu);
            let _ = mlp(&vs, WIDTH);
            let path = dir.join(format!("{name}.safetensors"));
            stageload::checkpoint::save(&vs.variables().into_iter().collect::<Vec<_>>(), &path).unwrap();
            path
        })
        .collect()
}

/// The MLP of `file`, loaded whole, at full speed.
fn resident(file: &Path) -> Mlp {
    let vs = VarStore::new(Device::Cpu);
    let net = mlp(&vs, WIDTH);
    Checkpoint::open(&[file]).unwrap().load_into(&stageload::named_tensors(&vs), |_| {}).unwrap();
    net
}

fn inputs(seed: i64) -> Vec<Tensor> {
    tch::manual_seed(seed);
    (0..3).map(|_| Tensor::randn([8, WIDTH], (Kind::Float, Device::Cpu))).collect()
}

#[test]
fn a_streamed_model_refilled_slowly_ahead_of_its_forward_gives_the_resident_output_bit_for_bit() {
    let _slow = Slow::begin();
    let dir = tempfile::tempdir().unwrap();
    let file = checkpoints(dir.path(), &["net"]).remove(0);
    let before = violations().len();
    let expected: Vec<Tensor> = {
        slow_copies(Duration::ZERO);
        let net = resident(&file);
        let outputs = inputs(5).iter().map(|x| tch::no_grad(|| net.forward(x))).collect();
        slow_copies(DELAY);
        outputs
    };
    let (outputs, stats) = within(60, move || {
        let vs = VarStore::new(Device::Cpu);
        let net = stageload_torch_sys::without_fills(|| mlp(&vs, WIDTH));
        let checkpoint = Checkpoint::open(&[&file]).unwrap();
        let spec = BlockSpec::new(["l1", "l2"]);
        // Both layers streamed, two slots: the second is read while the first runs.
        let mut model = StreamedModel::new(
            "net",
            stageload::named_tensors(&vs),
            checkpoint,
            &NameRules::default(),
            &spec,
            2 * LAYER,
        )
        .unwrap();
        model.reading(|| None);
        model.limit_resident(0).unwrap();
        assert_eq!(model.split().streamed(), 2, "{}", model.residency());
        let outputs: Vec<Tensor> = inputs(5)
            .iter()
            .map(|x| {
                tch::no_grad(|| {
                    model.run(|step| {
                        step.block(0)?;
                        let hidden = x.apply(&net.l1).relu();
                        step.block(1)?;
                        Ok(hidden.apply(&net.l2))
                    })
                })
                .unwrap()
            })
            .collect();
        (outputs, model.stats())
    });
    for (step, (got, want)) in outputs.iter().zip(&expected).enumerate() {
        assert!(got.equal(want), "step {step}: the slow streamed output differs from the resident one");
    }
    assert_eq!(stats.refills, 6, "each layer refilled once per step");
    // Each refill reads two tensors, pieces that waited DELAY first (side by side on two
    // CPUs): the mode was on.
    assert!(stats.refill_seconds >= 6.0 * DELAY.as_secs_f64(), "{stats:?}");
    assert_eq!(violations()[before..], [] as [String; 0], "a storage was freed or reused while a copy used it");
}

/// Models `a` and `b` (checkpointed MLPs, skip_init: every load draws nothing, so each may be
/// prefetched) in stages `first` and `second`, and a stage `neither` that lists none.
fn pipeline(files: &[PathBuf]) -> StagedModels {
    let spec =
        |name: &str, file: &PathBuf| ModelSpec::new(name, |_| Ok(build_mlp(WIDTH))).checkpoint([file]).skip_init(true);
    StagedModels::builder()
        .model(spec("a", &files[0]))
        .model(spec("b", &files[1]))
        .stage("first", ["a"])
        .stage("second", ["b"])
        .stage("neither", Vec::<String>::new())
        .build()
        .unwrap()
}

#[test]
fn prefetches_overtaken_by_a_stage_that_does_not_list_their_model_change_no_output_and_free_nothing_in_use() {
    let _slow = Slow::begin();
    let dir = tempfile::tempdir().unwrap();
    let files = checkpoints(dir.path(), &["a", "b"]);
    let before = violations().len();
    let x = inputs(9).remove(0);
    let expected: Vec<Tensor> = {
        slow_copies(Duration::ZERO);
        let outputs = files.iter().map(|file| tch::no_grad(|| resident(file).forward(&x))).collect();
        slow_copies(DELAY);
        outputs
    };
    let (outputs, reload_seconds) = within(120, move || {
        let models = pipeline(&files);
        let call = |name: &str| models.call(name, |m: &mut Mlp| tch::no_grad(|| m.forward(&x))).unwrap();
        let mut outputs = Vec::new();
        models.enter("first").unwrap();
        outputs.push(("a", call("a")));
        let mut reload_seconds = 0.0;
        for round in 0..2 {
            // b's load (a build, then a refill) runs slowly in the background ...
            assert_eq!(models.prefetch("second").unwrap(), ["b"], "round {round}: {:?}", models.states());
            // ... while a stage that lists neither releases a, and b's copy is still running.
            models.enter("neither").unwrap();
            models.enter("second").unwrap();
            outputs.push(("b", call("b")));
            // a comes back in place, in the foreground, at the slow pace.
            models.enter("first").unwrap();
            let started = Instant::now();
            outputs.push(("a", call("a")));
            reload_seconds = started.elapsed().as_secs_f64();
        }
        models.close();
        (outputs, reload_seconds)
    });
    for (i, (name, got)) in outputs.iter().enumerate() {
        let want = &expected[usize::from(*name == "b")];
        assert!(got.equal(want), "call {i} of {name}: the output differs from the model loaded at full speed");
    }
    // Four tensors, each a piece that waited DELAY first (side by side on as many CPUs): the
    // reload ran at the slow pace.
    assert!(reload_seconds >= DELAY.as_secs_f64(), "a's reload took {reload_seconds:.3} s");
    assert_eq!(violations()[before..], [] as [String; 0], "a storage was freed or reused while a copy used it");
}
