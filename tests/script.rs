//! TorchScript modules in the registry, on files written by torch itself
//! (`tests/fixtures/script_module.py`, run by the cached environment's Python): a traced module
//! with parameters and buffers loads, runs as Python ran it, is released in place (its buffers
//! too), comes back in place from a checkpoint of its own names or from its file, may be
//! prefetched, and every bad file is a typed error naming the model and the file that leaves the
//! registry usable.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use stageload::checkpoint::CheckpointError;
use stageload::script::ScriptError;
use stageload::{EventKind, ListSink, ModelSpec, ModelState, ReloadFrom, StageError, StagedModels};
use stageload_test_support::torch as support;
use tch::{CModule, Kind, Tensor};

/// The fixtures, written once per test process by the cached torch into a folder of the
/// target's (`CARGO_TARGET_TMPDIR`: small files, rewritten by each run; no Python start per test).
struct Fixtures {
    dir: PathBuf,
}

fn fixtures() -> &'static Fixtures {
    static FIXTURES: std::sync::OnceLock<Fixtures> = std::sync::OnceLock::new();
    FIXTURES.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("script-fixtures");
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/script_module.py");
        stageload_test_support::fixtures::write_with_python(&script, &dir);
        Fixtures { dir }
    })
}

impl Fixtures {
    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// Python's input and the traced module's output on it.
    fn io(&self) -> (Tensor, Tensor) {
        let mut io = Tensor::read_safetensors(self.path("io.safetensors")).unwrap();
        io.sort_by(|a, b| a.0.cmp(&b.0));
        let y = io.pop().unwrap().1;
        (io.pop().unwrap().1, y)
    }
}

fn forward(models: &StagedModels, name: &str, x: &Tensor) -> Result<Tensor, StageError> {
    models.call(name, |m: &mut CModule| m.forward_ts(&[x])).map(|y| y.unwrap())
}

/// `m` (the module, with `checkpoint` when given) alone in stage `run`, and stage `other` empty.
fn registry(fixtures: &Fixtures, checkpoint: Option<&str>, sink: Arc<ListSink>) -> StagedModels {
    let mut spec = ModelSpec::torchscript("m", fixtures.path("m.pt"));
    if let Some(file) = checkpoint {
        spec = spec.checkpoint([fixtures.path(file)]);
    }
    StagedModels::builder()
        .model(spec)
        .stage("run", ["m"])
        .stage("other", Vec::<String>::new())
        .events(sink)
        .build()
        .unwrap()
}

const TENSORS: [&str; 8] = [
    "lin.bias",
    "lin.weight",
    "norm.bias",
    "norm.num_batches_tracked",
    "norm.running_mean",
    "norm.running_var",
    "norm.weight",
    "scale",
];

#[test]
fn a_modules_tensors_are_its_parameters_and_its_buffers() {
    let _one = support::generator();
    let fixtures = fixtures();
    let (module, tensors) = stageload::script::load(&fixtures.path("m.pt"), tch::Device::Cpu).unwrap();
    let names: Vec<&str> = tensors.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, TENSORS, "tch lists 4 parameters; the shim adds the 4 buffers");
    // They share the module's storage: a change through them is seen by the module.
    let (x, y) = fixtures.io();
    assert!(module.forward_ts(&[&x]).unwrap().equal(&y), "the traced module's output, as Python computed it");
    let mut scale = tensors.iter().find(|(n, _)| n == "scale").unwrap().1.shallow_clone();
    tch::no_grad(|| scale.copy_(&Tensor::ones([3], (Kind::Float, tch::Device::Cpu))));
    assert!(module.forward_ts(&[&x]).unwrap().allclose(&(&y / 2.0), 1e-6, 1e-6, false));
}

#[test]
fn a_torchscript_model_is_released_in_place_and_comes_back_in_place_from_its_checkpoint() {
    let _one = support::generator();
    let fixtures = fixtures();
    let (x, y) = fixtures.io();
    let sink = Arc::new(ListSink::new());
    let models = registry(fixtures, Some("m.safetensors"), sink.clone());
    models.enter("run").unwrap();
    assert!(forward(&models, "m", &x).unwrap().equal(&y), "equal to Python's output");
    let report = models.load_report("m").unwrap().expect("a checkpoint report");
    assert_eq!(report.used, TENSORS.len(), "the checkpoint was checked against every tensor: {report:?}");
    let handle = models.get::<CModule>("m").unwrap();
    let tensors = stageload::script::module_tensors(&handle.lock().unwrap()).unwrap();

    let stats = models.enter("other").unwrap();
    let bytes: u64 = tensors.iter().map(|(_, t)| (t.numel() * t.kind().elt_size_in_bytes()) as u64).sum();
    assert_eq!(stats.freed, bytes, "every parameter and buffer freed");
    assert_eq!(models.state("m").unwrap(), ModelState::Released);
    let err = handle.lock().err().unwrap();
    assert!(err.to_string().contains("'m' was released when entering stage 'other'"), "{err}");
    for (name, tensor) in &tensors {
        let err = tensor.f_sum(Kind::Float).unwrap_err();
        assert!(err.to_string().contains("'m' was released when entering stage 'other'"), "{name}: {err}");
    }

    models.enter("run").unwrap();
    assert!(forward(&models, "m", &x).unwrap().equal(&y), "the same numbers after the reload");
    assert!(!handle.is_released(), "the same module object came back");
    let reloads = sink.of_kind(EventKind::Reload);
    assert_eq!(reloads.len(), 1);
    assert_eq!(reloads[0].reload_from(), Some(ReloadFrom::InPlace));
    assert_eq!(reloads[0].bytes(), Some(bytes));
}

#[test]
fn without_a_checkpoint_a_released_module_is_read_from_its_file_again() {
    let _one = support::generator();
    let fixtures = fixtures();
    let (x, y) = fixtures.io();
    let sink = Arc::new(ListSink::new());
    let models = registry(fixtures, None, sink.clone());
    models.enter("run").unwrap();
    let _ = forward(&models, "m", &x).unwrap();
    models.enter("other").unwrap();
    models.enter("run").unwrap();
    assert!(forward(&models, "m", &x).unwrap().equal(&y));
    let reloads = sink.of_kind(EventKind::Reload);
    assert_eq!(reloads.len(), 1);
    assert_eq!(reloads[0].reload_from(), Some(ReloadFrom::Rebuilt));
}

#[test]
fn a_torchscript_load_draws_nothing_so_it_is_prefetched() {
    let _one = support::generator();
    let fixtures = fixtures();
    let (x, y) = fixtures.io();
    let sink = Arc::new(ListSink::new());
    let models = registry(fixtures, None, sink.clone());
    models.enter("other").unwrap();
    tch::manual_seed(3);
    let expected = Tensor::randn([4], (Kind::Float, tch::Device::Cpu));
    tch::manual_seed(3);
    assert_eq!(models.prefetch("run").unwrap(), ["m"], "a deserialising load is prefetched");
    models.wait_prefetch("run").unwrap();
    assert!(Tensor::randn([4], (Kind::Float, tch::Device::Cpu)).equal(&expected), "the generator did not move");
    models.enter("run").unwrap();
    assert!(forward(&models, "m", &x).unwrap().equal(&y));
    let loads = sink.of_kind(EventKind::Load);
    assert!(loads.len() == 1 && loads[0].prefetched(), "{loads:?}");
}

/// The error of a first call on `m` built from `file` (with `checkpoint`), next to a good model
/// `ok` that then loads and runs.
fn first_call_error(fixtures: &Fixtures, file: &Path, checkpoint: Option<&str>) -> StageError {
    let mut bad = ModelSpec::torchscript("m", file);
    if let Some(name) = checkpoint {
        bad = bad.checkpoint([fixtures.path(name)]);
    }
    let models = StagedModels::builder()
        .model(bad)
        .model(ModelSpec::torchscript("ok", fixtures.path("m.pt")))
        .stage("run", ["m", "ok"])
        .build()
        .unwrap();
    models.enter("run").unwrap();
    let (x, y) = fixtures.io();
    let err = forward(&models, "m", &x).unwrap_err();
    assert_eq!(models.state("m").unwrap(), ModelState::Failed);
    assert!(forward(&models, "ok", &x).unwrap().equal(&y), "the registry stays usable");
    err
}

#[test]
fn a_bad_torchscript_file_or_checkpoint_is_a_typed_error_naming_the_model_and_the_file() {
    let _one = support::generator();
    let fixtures = fixtures();
    let script_error = |err: &StageError| match err {
        StageError::LoaderFailed { model, source } => {
            assert_eq!(model, "m");
            source.downcast_ref::<ScriptError>().map(|e| e.to_string()).unwrap_or_else(|| panic!("{err}"))
        }
        other => panic!("not a loader error: {other}"),
    };

    let text = fixtures.path("not-a-module.pt");
    std::fs::write(&text, "a state dict, maybe").unwrap();
    let err = first_call_error(fixtures, &text, None);
    let message = script_error(&err);
    assert!(message.contains("not-a-module.pt") && message.contains("torch.jit.save"), "{message}");

    let whole = std::fs::read(fixtures.path("m.pt")).unwrap();
    let truncated = fixtures.path("truncated.pt");
    std::fs::write(&truncated, &whole[..whole.len() / 2]).unwrap();
    let message = script_error(&first_call_error(fixtures, &truncated, None));
    assert!(message.contains("truncated.pt") && message.contains("truncated"), "{message}");

    let fifo = fixtures.path("fifo.pt");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
    let message = script_error(&first_call_error(fixtures, &fifo, None));
    assert!(message.contains("fifo.pt"), "refused before libtorch opens it (no hang): {message}");

    let missing = fixtures.path("missing.pt");
    let message = script_error(&first_call_error(fixtures, &missing, None));
    assert!(message.contains("missing.pt"), "{message}");

    let checkpoint_error = |err: StageError| match err {
        StageError::Checkpoint { model, source } => {
            assert_eq!(model, "m");
            *source
        }
        other => panic!("not a checkpoint error: {other}"),
    };
    let m = fixtures.path("m.pt");
    let err = checkpoint_error(first_call_error(fixtures, &m, Some("renamed.safetensors")));
    assert!(matches!(&err, CheckpointError::Names { .. }), "{err}");
    let message = err.to_string();
    assert!(
        message.contains("renamed.safetensors") && message.contains("lin.kernel") && message.contains("lin.weight"),
        "{message}"
    );
    let err = checkpoint_error(first_call_error(fixtures, &m, Some("reshaped.safetensors")));
    assert!(
        matches!(&err, CheckpointError::Shape { tensor, expected, found, .. } if tensor == "lin.weight" && expected == &[3, 4] && found == &[3, 5]),
        "{err}"
    );
    assert!(err.to_string().contains("reshaped.safetensors"), "{err}");
}

#[test]
fn the_first_load_takes_the_files_weights_and_a_reload_the_checkpoints_even_with_skip_init() {
    let _one = support::generator();
    let fixtures = fixtures();
    // A checkpoint whose `scale` is 3× the module's: which one the model holds shows which was read.
    let mut tensors = Tensor::read_safetensors(fixtures.path("m.safetensors")).unwrap();
    for (name, t) in tensors.iter_mut() {
        if name == "scale" {
            *t = &*t * 3.0;
        }
    }
    let tripled = tempfile::Builder::new().suffix(".safetensors").tempfile().unwrap();
    stageload::checkpoint::save(&tensors, tripled.path()).unwrap();
    let models = StagedModels::builder()
        .model(ModelSpec::torchscript("m", fixtures.path("m.pt")).checkpoint([tripled.path()]).skip_init(true))
        .stage("run", ["m"])
        .stage("other", Vec::<String>::new())
        .build()
        .unwrap();
    models.enter("run").unwrap();
    let (x, y) = fixtures.io();
    assert!(
        forward(&models, "m", &x).unwrap().equal(&y),
        "the first load is the file's: the checkpoint was checked, not copied"
    );
    models.enter("other").unwrap();
    models.enter("run").unwrap();
    assert!(
        forward(&models, "m", &x).unwrap().allclose(&(&y * 3.0), 1e-5, 1e-6, false),
        "the reload is the checkpoint's"
    );
}
