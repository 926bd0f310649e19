//! Every tensor comes back: TorchScript modules exported from Python the ordinary way
//! (`tests/fixtures/every_tensor.py`, run by the cached environment's Python), each with the
//! checkpoint its library's own tools write, released and reloaded in place. A weight two layers
//! share needs one checkpoint entry, is counted, written and filled once, and is still shared
//! after the reload; a tensor the checkpoint lacks (a non-persistent buffer) stays resident
//! through the release; a reload that could not fill a storage is an error, never a result.
//! The host tier's side of it runs in the library's unit tests (`staged::tier_tests`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use stageload::{
    EventKind, ListSink, LoadReport, ModelSpec, NameRules, ReloadFrom, StageError, StagedModels, StagedModelsBuilder,
    What,
};
use stageload_test_support::torch as support;
use tch::{CModule, Tensor};

/// The fixtures, written once per test process into a folder of the target's.
fn fixtures() -> &'static Path {
    static FIXTURES: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    FIXTURES.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("every-tensor-fixtures");
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/every_tensor.py");
        stageload_test_support::fixtures::write_with_python(&script, &dir);
        dir
    })
}

fn path(name: &str) -> PathBuf {
    fixtures().join(name)
}

/// Python's input to module `name` and the traced module's output on it.
fn io(name: &str) -> (Tensor, Tensor) {
    let io: HashMap<String, Tensor> =
        Tensor::read_safetensors(path(&format!("{name}.io.safetensors"))).unwrap().into_iter().collect();
    (io["x"].shallow_clone(), io["y"].shallow_clone())
}

/// Module `name` alone in stage `run`, stage `other` empty, with `spec`'s checkpoint and rules.
fn registry(
    spec: ModelSpec,
    sink: &Arc<ListSink>,
    more: impl FnOnce(StagedModelsBuilder) -> StagedModelsBuilder,
) -> StagedModels {
    let builder = StagedModels::builder().model(spec).stage("run", ["m"]).stage("other", Vec::<String>::new());
    more(builder.events(sink.clone())).build().unwrap()
}

fn forward(models: &StagedModels, x: &Tensor) -> Result<Tensor, StageError> {
    models.call("m", |m: &mut CModule| m.forward_ts(&[x])).map(|y| y.unwrap())
}

/// The bytes of the one event of `kind`.
fn bytes_of(sink: &ListSink, kind: EventKind) -> u64 {
    let events = sink.of_kind(kind);
    assert_eq!(events.len(), 1, "one {kind:?} event: {events:?}");
    events[0].bytes().unwrap()
}

/// Whether tensors `a` and `b` of the model share one storage (the same memory).
fn shared(models: &StagedModels, a: &str, b: &str) -> bool {
    let tensors: HashMap<String, Tensor> = models.get::<CModule>("m").unwrap().tensors().into_iter().collect();
    tensors[a].data_ptr() == tensors[b].data_ptr()
}

/// Asserts that the load, release and reload events each count `total` bytes (a tied weight once).
fn counted_once(sink: &ListSink, total: u64) {
    for kind in [EventKind::Load, EventKind::Release, EventKind::Reload] {
        assert_eq!(bytes_of(sink, kind), total, "{kind:?} counts the tied weight once");
    }
}

/// Bytes of the module's distinct storages (a tied weight once).
fn distinct_bytes(models: &StagedModels) -> u64 {
    let mut seen = std::collections::HashSet::new();
    let tensors = models.get::<CModule>("m").unwrap().tensors();
    tensors
        .iter()
        .filter(|(_, t)| seen.insert(t.data_ptr() as usize))
        .map(|(_, t)| (t.numel() * t.kind().elt_size_in_bytes()) as u64)
        .sum()
}

/// Runs `m` in `run`, releases it (`other`), reloads it (`run`): each output equal to Python's
/// bit for bit; returns the load report.
fn round_trip(models: &StagedModels, fixture: &str) -> LoadReport {
    let (x, y) = io(fixture);
    models.enter("run").unwrap();
    assert!(forward(models, &x).unwrap().equal(&y), "{fixture}: the first run equals Python's output");
    let report = models.load_report("m").unwrap();
    models.enter("other").unwrap();
    models.enter("run").unwrap();
    assert!(forward(models, &x).unwrap().equal(&y), "{fixture}: after the release and reload, bit for bit");
    report.unwrap_or_default()
}

#[test]
fn a_tied_weight_needs_one_entry_is_counted_once_and_is_still_tied_after_the_reload() {
    let _one = support::generator();
    let sink = Arc::new(ListSink::new());
    let spec = ModelSpec::torchscript("m", path("tied.pt")).checkpoint([path("tied.safetensors")]);
    let models = registry(spec, &sink, |b| b);
    models.enter("run").unwrap();
    assert!(shared(&models, "c2.weight", "c3.weight"), "libtorch lists the tied weight under both names");
    let total = distinct_bytes(&models);

    let report = round_trip(&models, "tied");
    assert_eq!(report.aliases.get("c3.weight").map(String::as_str), Some("c2.weight"), "{report:?}");
    assert!(report.missing.is_empty() && report.unused.is_empty(), "the strict check passes: {report:?}");
    assert!(shared(&models, "c2.weight", "c3.weight"), "one storage behind both names after the reload");
    let reload = sink.of_kind(EventKind::Reload);
    assert_eq!(reload[0].reload_from(), Some(ReloadFrom::InPlace));
    counted_once(&sink, total);
}

#[test]
fn a_language_models_head_tied_to_its_embedding_loads_from_save_pretrained_and_reloads_exactly() {
    let _one = support::generator();
    let sink = Arc::new(ListSink::new());
    let spec = ModelSpec::torchscript("m", path("lm.pt"))
        .checkpoint([path("lm.safetensors")])
        .names(NameRules::default().add_prefix("model."));
    let models = registry(spec, &sink, |b| b);
    models.enter("run").unwrap();
    let (head, embedding) = ("model.lm_head.weight", "model.transformer.wte.weight");
    assert!(shared(&models, head, embedding), "transformers ties the head to the embedding");
    let total = distinct_bytes(&models);

    let report = round_trip(&models, "lm");
    assert_eq!(report.aliases.get(head).map(String::as_str), Some(embedding), "{report:?}");
    assert!(shared(&models, head, embedding), "still tied after the reload");
    counted_once(&sink, total);
}

#[test]
fn a_snapshot_writes_and_counts_a_tied_weight_once_and_its_reload_ties_it_again() {
    let _one = support::generator();
    let sink = Arc::new(ListSink::new());
    let dir = tempfile::TempDir::new().unwrap();
    let spec = ModelSpec::torchscript("m", path("tied.pt"));
    let models = registry(spec, &sink, |b| b.snapshot_dir(dir.path()));
    models.enter("run").unwrap();
    let total = distinct_bytes(&models);

    round_trip(&models, "tied");
    assert_eq!(sink.of_kind(EventKind::Reload)[0].reload_from(), Some(ReloadFrom::Snapshot));
    for kind in [EventKind::Load, EventKind::Snapshot, EventKind::Release, EventKind::Reload] {
        assert_eq!(bytes_of(&sink, kind), total, "{kind:?} counts the tied weight once");
    }
    let written = std::fs::read_dir(dir.path())
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .unwrap();
    let header = stageload::checkpoint::Checkpoint::open(&[written]).unwrap();
    let mut names: Vec<&String> = header.entries().keys().collect();
    names.sort();
    assert_eq!(names, ["c1.bias", "c1.weight", "c2.bias", "c2.weight", "c3.bias"], "the tied weight once");
    assert!(shared(&models, "c2.weight", "c3.weight"), "tied again after the reload from the snapshot");
}

#[test]
fn a_buffer_the_checkpoint_lacks_stays_resident_through_a_release_so_the_reload_is_exact() {
    let _one = support::generator();
    let sink = Arc::new(ListSink::new());
    let spec = ModelSpec::torchscript("m", path("buffers.pt"))
        .checkpoint([path("buffers.safetensors")])
        .names(NameRules::default().strict(false));
    let models = registry(spec, &sink, |b| b);
    models.enter("run").unwrap();
    let total = distinct_bytes(&models);
    let before: HashMap<String, Tensor> =
        models.get::<CModule>("m").unwrap().tensors().into_iter().map(|(n, t)| (n, t.copy())).collect();
    assert_eq!(before["norm.num_batches_tracked"].int64_value(&[]), 3, "the int64 step counter of three steps");

    let (x, y) = io("buffers");
    assert!(forward(&models, &x).unwrap().equal(&y));
    let report = models.load_report("m").unwrap().unwrap();
    assert_eq!(report.missing, ["freqs"], "state_dict() leaves the non-persistent buffer out: {report:?}");
    let stats = models.enter("other").unwrap();
    let kept = (before["freqs"].numel() * 4) as u64;
    assert_eq!((stats.freed, stats.kept), (total - kept, kept), "everything but the buffer no source holds");
    let release = &sink.of_kind(EventKind::Release)[0];
    let What::Release(release) = &release.what else { panic!("{release:?}") };
    assert_eq!((release.bytes, release.kept_bytes), (Some(total - kept), kept));
    assert_eq!(models.resident_bytes(), kept, "the kept buffer counts as resident");

    models.enter("run").unwrap();
    assert!(forward(&models, &x).unwrap().equal(&y), "bit for bit after the reload");
    assert_eq!(bytes_of(&sink, EventKind::Load), total);
    assert_eq!(bytes_of(&sink, EventKind::Reload), total - kept, "the reload fills what the release freed");
    for (name, tensor) in models.get::<CModule>("m").unwrap().tensors() {
        assert!(tensor.equal(&before[&name]), "tensor '{name}' is as the first load left it");
    }
}

#[test]
fn a_reload_that_would_leave_a_tensor_unfilled_is_an_error_naming_the_model_and_the_tensor() {
    let _one = support::generator();
    let sink = Arc::new(ListSink::new());
    let dir = tempfile::TempDir::new().unwrap();
    let checkpoint = dir.path().join("buffers.safetensors");
    std::fs::copy(path("buffers.safetensors"), &checkpoint).unwrap();
    let spec = ModelSpec::torchscript("m", path("buffers.pt"))
        .checkpoint([&checkpoint])
        .names(NameRules::default().strict(false));
    let models = registry(spec, &sink, |b| b);
    let (x, y) = io("buffers");
    models.enter("run").unwrap();
    assert!(forward(&models, &x).unwrap().equal(&y));
    models.enter("other").unwrap();
    // The file changes under the released model: it no longer holds `lin.bias`.
    let entries: Vec<(String, Tensor)> = Tensor::read_safetensors(path("buffers.safetensors"))
        .unwrap()
        .into_iter()
        .filter(|(n, _)| n != "lin.bias")
        .collect();
    stageload::checkpoint::save(&entries, &checkpoint).unwrap();

    models.enter("run").unwrap();
    // A changed file is refused as such first; taken as it is now, it lacks the tensor.
    assert!(matches!(forward(&models, &x), Err(StageError::SourceChanged(_))));
    models.accept_changed_files("m").unwrap();
    let err = forward(&models, &x).unwrap_err();
    let text = err.to_string();
    assert!(text.contains("'m'") && text.contains("'lin.bias'"), "{text}");
    let events = sink.of_kind(EventKind::Error);
    assert!(events.iter().any(|e| e.model() == Some("m")), "an error event: {events:?}");
    // Put back (and accepted again), the next call refills it whole.
    std::fs::copy(path("buffers.safetensors"), &checkpoint).unwrap();
    models.accept_changed_files("m").unwrap();
    assert!(forward(&models, &x).unwrap().equal(&y), "a later call reloads it exactly");
}
