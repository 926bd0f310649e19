//! A file a model was first loaded from that changes before a reload: written in place (same
//! size, same header), replaced by a rename (the usual atomic write), or rewritten with the same
//! tensors in another order. For every kind of model (a loader with a checkpoint, refilled in
//! the foreground or by a prefetch; a TorchScript module rebuilt from its file or refilled from
//! its checkpoint; an AOTInductor package's checkpoint; the registry's own snapshot; a streamed
//! model's checkpoint under a live streamer) the reload is refused with a typed error naming the
//! model, the file and what changed, and an `error` event; the model stays released with nothing
//! filled, another model still loads, and only `accept_changed_files` takes the new file (its
//! reload event says so). Without the check each reload would silently return the new values
//! (staged would differ from eager).

use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use stageload::checkpoint::{Checkpoint, CheckpointError};
use stageload::source::FileChange;
use stageload::{EventKind, ListSink, ModelSpec, ModelState, Reload, StageError, StagedModels};
use stageload_test_support::torch::{self as support, build_mlp, input, Mlp};
use tch::nn::Module;
use tch::{Kind, Tensor};

/// How a test changes a file between a release and the reload.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Change {
    /// New values over the old ones: same size, same header, same inode.
    InPlace,
    /// A new file written beside it and renamed over it.
    Rename,
    /// The same tensors, laid out in the reverse order, written over the file in place.
    Reorder,
}

const CHANGES: [Change; 3] = [Change::InPlace, Change::Rename, Change::Reorder];

/// The change each way is seen as.
pub(crate) fn seen_as(change: Change) -> fn(&FileChange) -> bool {
    match change {
        Change::InPlace => |c| matches!(c, FileChange::Modified | FileChange::StatusChanged),
        // Its header's offsets may print shorter or longer.
        Change::Reorder => {
            |c| matches!(c, FileChange::Modified | FileChange::StatusChanged | FileChange::Resized { .. })
        }
        Change::Rename => |c| *c == FileChange::Replaced,
    }
}

/// The entries of the safetensors file at `path`, sorted by name.
pub(crate) fn entries(path: &Path) -> Vec<(String, Tensor)> {
    let mut entries = Tensor::read_safetensors(path).unwrap();
    entries.sort_by(|a, b| a.0.cmp(&b.0));
    entries
}

/// The bytes of `t` (a CPU tensor), as a safetensors file holds them.
fn raw(t: &Tensor) -> Vec<u8> {
    Vec::<u8>::try_from(t.contiguous().reshape([-1]).view_dtype(Kind::Uint8)).unwrap()
}

/// Writes `tensors` (float32 or int64) as safetensors bytes with the data in the order given
/// (the safetensors writers order it themselves).
fn safetensors_bytes(tensors: &[(String, Tensor)]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, t) in tensors {
        let dtype = match t.kind() {
            Kind::Float => "F32",
            Kind::Int64 => "I64",
            other => panic!("{name}: {other:?} is not written here"),
        };
        let start = data.len();
        data.extend(raw(t));
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": dtype, "shape": t.size(), "data_offsets": [start, data.len()]}),
        );
    }
    let mut header = serde_json::to_vec(&header).unwrap();
    header.resize(header.len().next_multiple_of(8), b' ');
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend(header);
    bytes.extend(data);
    bytes
}

/// Changes the checkpoint at `path` as `change` says; returns its entries as they are now. The
/// new values are the old ones plus one (for `Reorder`, the same values).
pub(crate) fn change_checkpoint(path: &Path, change: Change) -> Vec<(String, Tensor)> {
    let old = entries(path);
    let new: Vec<(String, Tensor)> = old.iter().map(|(n, t)| (n.clone(), t.f_add_scalar(1).unwrap())).collect();
    match change {
        Change::InPlace => {
            let bytes = std::fs::read(path).unwrap();
            let data_start = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap());
            let mut file = std::fs::OpenOptions::new().write(true).open(path).unwrap();
            for (name, t) in &new {
                let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
                let info = header.info(name).unwrap();
                file.seek(SeekFrom::Start(data_start + info.data_offsets.0 as u64)).unwrap();
                file.write_all(&raw(t)).unwrap();
            }
            assert_eq!(std::fs::read(path).unwrap().len(), bytes.len(), "same size");
            assert_eq!(
                std::fs::read(path).unwrap()[..data_start as usize],
                bytes[..data_start as usize],
                "same header"
            );
        }
        Change::Rename => {
            let beside = path.with_extension("new");
            std::fs::write(&beside, safetensors_bytes(&new)).unwrap();
            std::fs::rename(&beside, path).unwrap();
        }
        Change::Reorder => {
            let reversed: Vec<(String, Tensor)> =
                old.iter().rev().map(|(n, t)| (n.clone(), t.shallow_clone())).collect();
            let mut file = std::fs::OpenOptions::new().write(true).truncate(true).open(path).unwrap();
            file.write_all(&safetensors_bytes(&reversed)).unwrap();
        }
    }
    entries(path)
}

/// Asserts `err` is the change of `path` for `model`, seen as `change` is, and that the last
/// `error` event says so.
fn assert_refused(err: &StageError, model: &str, path: &Path, change: Change, sink: &ListSink) {
    let StageError::SourceChanged(changed) = err else { panic!("{change:?}: not a changed source: {err}") };
    assert_eq!((changed.model.as_str(), changed.path.as_path()), (model, path), "{err}");
    assert!(seen_as(change)(&changed.change), "{change:?} seen as {:?}", changed.change);
    let text = err.to_string();
    assert!(text.contains(&format!("'{model}'")) && text.contains(&path.display().to_string()), "{text}");
    assert!(text.contains("accept_changed_files"), "says what to do: {text}");
    let errors = sink.of_kind(EventKind::Error);
    let last = errors.last().expect("an error event");
    assert_eq!(last.model(), Some(model));
    assert!(last.note().is_some_and(|n| n.contains(&path.display().to_string())), "{last}");
}

/// `net` (an MLP of width 8 from `file`) in stage `run`, a loader-only `other` model in stage
/// `other`.
fn mlp_registry(file: &Path, sink: Arc<ListSink>) -> StagedModels {
    mlp_registry_reloading(file, Reload::Copy, sink)
}

/// [`mlp_registry`] with `net` reloading as `reload` says.
pub(crate) fn mlp_registry_reloading(file: &Path, reload: Reload, sink: Arc<ListSink>) -> StagedModels {
    StagedModels::builder()
        .model(ModelSpec::new("net", |_| Ok(build_mlp(8))).checkpoint([file]).reload(reload))
        .model(ModelSpec::new("other", |_| Ok(build_mlp(8))))
        .stage("run", ["net"])
        .stage("other", ["other"])
        .events(sink)
        .build()
        .unwrap()
}

/// `net`'s output on the tests' input.
pub(crate) fn net(models: &StagedModels) -> Result<Tensor, StageError> {
    models.call("net", |m: &mut Mlp| m.forward(&input(8)))
}

/// What an MLP filled with `entries` gives.
pub(crate) fn expected(entries: &[(String, Tensor)]) -> Tensor {
    let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    let mlp = support::mlp(&vs, 8);
    let targets = stageload::named_tensors(&vs);
    tch::no_grad(|| {
        for ((name, target), (entry, value)) in targets.iter().zip(entries) {
            assert_eq!(name, entry);
            target.shallow_clone().copy_(value);
        }
    });
    mlp.forward(&input(8))
}

#[test]
fn a_checkpoint_changed_between_a_release_and_its_reload_is_refused_until_accepted_in_the_foreground_and_by_a_prefetch()
{
    let _one = support::generator();
    for prefetch in [false, true] {
        for change in CHANGES {
            let dir = tempfile::TempDir::new().unwrap();
            let file = dir.path().join("net.safetensors");
            stageload::checkpoint::save(&build_mlp_tensors(), &file).unwrap();
            let first = entries(&file);
            let sink = Arc::new(ListSink::new());
            let models = mlp_registry(&file, sink.clone());
            models.enter("run").unwrap();
            assert!(net(&models).unwrap().equal(&expected(&first)));
            let handle = models.get::<Mlp>("net").unwrap();
            models.enter("other").unwrap();
            assert_eq!(models.state("net").unwrap(), ModelState::Released);

            let now = change_checkpoint(&file, change);
            if prefetch {
                // The prefetch's refill fails in the background: its error event says why,
                // and the model is left to the foreground's get.
                assert_eq!(models.prefetch("run").unwrap(), ["net"]);
                models.wait_prefetch("run").unwrap();
                let errors = sink.of_kind(EventKind::Error);
                let failed = errors.iter().find(|e| e.model() == Some("net")).expect("the prefetch's error event");
                assert!(failed.note().is_some_and(|n| n.contains("net.safetensors")), "{failed}");
                assert_ne!(models.state("net").unwrap(), ModelState::Resident, "{change:?}: nothing filled");
            }
            models.enter("run").unwrap();
            let err = net(&models).unwrap_err();
            assert_refused(&err, "net", &file, change, &sink);
            assert_eq!(models.state("net").unwrap(), ModelState::Failed, "{change:?}");
            assert!(handle.lock().is_err(), "{change:?}: its weights stay freed, nothing half filled");
            models.load("other").unwrap_or_else(|e| panic!("{change:?}: the registry goes on: {e}"));
            assert!(matches!(net(&models), Err(StageError::SourceChanged(_))), "{change:?}: refused again");

            models.accept_changed_files("net").unwrap();
            let y = net(&models).unwrap();
            assert!(y.equal(&expected(&now)), "{change:?}: accepted, the new values");
            let reload = sink.of_kind(EventKind::Reload).pop().expect("a reload");
            assert!(reload.to_string().contains("accepted the changed file"), "{change:?}: {reload}");
            models.enter("other").unwrap();
            models.enter("run").unwrap();
            assert!(net(&models).unwrap().equal(&y), "{change:?}: the accepted file is the model's now");
        }
    }
}

/// A seeded MLP's tensors, as a checkpoint holds them.
pub(crate) fn build_mlp_tensors() -> Vec<(String, Tensor)> {
    tch::manual_seed(3);
    let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    let _ = support::mlp(&vs, 8);
    stageload::named_tensors(&vs)
}

#[test]
fn an_unchanged_checkpoint_touched_by_nobody_reloads_without_a_word() {
    let _one = support::generator();
    let dir = tempfile::TempDir::new().unwrap();
    let file = dir.path().join("net.safetensors");
    stageload::checkpoint::save(&build_mlp_tensors(), &file).unwrap();
    let sink = Arc::new(ListSink::new());
    let models = mlp_registry(&file, sink.clone());
    for _ in 0..3 {
        models.enter("run").unwrap();
        assert!(net(&models).unwrap().equal(&expected(&entries(&file))));
        models.enter("other").unwrap();
    }
    assert!(sink.of_kind(EventKind::Error).is_empty());
    assert_eq!(sink.of_kind(EventKind::Reload).len(), 2);
}

#[test]
fn a_file_written_in_place_under_an_open_checkpoint_is_refused_before_and_after_a_load() {
    let _one = support::generator();
    let dir = tempfile::TempDir::new().unwrap();
    let file = dir.path().join("net.safetensors");
    stageload::checkpoint::save(&build_mlp_tensors(), &file).unwrap();
    let checkpoint = Checkpoint::open(&[&file]).unwrap();
    let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    let _ = support::mlp(&vs, 8);
    let targets = stageload::named_tensors(&vs);
    checkpoint.load_into(&targets, |_| {}).unwrap();
    change_checkpoint(&file, Change::InPlace);
    let err = checkpoint.load_into(&targets, |_| {}).unwrap_err();
    assert!(matches!(&err, CheckpointError::Changed { path, change: FileChange::Modified } if *path == file), "{err}");
    assert!(err.to_string().contains("net.safetensors"), "{err}");
}

/// The TorchScript fixtures of `tests/script.rs` (a traced module, its checkpoint), copied into
/// `dir`.
fn script_fixtures(dir: &Path) -> (PathBuf, PathBuf) {
    let source = Path::new(env!("CARGO_TARGET_TMPDIR")).join("changed-files-script");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/script_module.py");
    static WRITTEN: std::sync::Once = std::sync::Once::new();
    WRITTEN.call_once(|| stageload_test_support::fixtures::write_with_python(&script, &source));
    let (module, checkpoint) = (dir.join("m.pt"), dir.join("m.safetensors"));
    std::fs::copy(source.join("m.pt"), &module).unwrap();
    std::fs::copy(source.join("m.safetensors"), &checkpoint).unwrap();
    (module, checkpoint)
}

fn script_registry(module: &Path, checkpoint: Option<&Path>, sink: Arc<ListSink>) -> StagedModels {
    let mut spec = ModelSpec::torchscript("m", module);
    if let Some(file) = checkpoint {
        spec = spec.checkpoint([file]);
    }
    StagedModels::builder()
        .model(spec)
        .model(ModelSpec::new("other", |_| Ok(build_mlp(8))))
        .stage("run", ["m"])
        .stage("other", ["other"])
        .events(sink)
        .build()
        .unwrap()
}

fn script_forward(models: &StagedModels) -> Result<Tensor, StageError> {
    let x = Tensor::ones([2, 4], (Kind::Float, tch::Device::Cpu));
    models.call("m", |m: &mut tch::CModule| m.forward_ts(&[x]).unwrap())
}

#[test]
fn a_torchscript_file_rebuilt_after_a_release_and_its_checkpoint_refilled_after_one_are_both_checked() {
    let _one = support::generator();
    // Without a checkpoint the module file itself is read again: rewritten in place, or
    // another file renamed over it (a TorchScript file of other weights).
    for change in [Change::InPlace, Change::Rename] {
        let dir = tempfile::TempDir::new().unwrap();
        let (module, _) = script_fixtures(dir.path());
        let sink = Arc::new(ListSink::new());
        let models = script_registry(&module, None, sink.clone());
        models.enter("run").unwrap();
        let first = script_forward(&models).unwrap();
        models.enter("other").unwrap();
        let bytes = std::fs::read(&module).unwrap();
        match change {
            Change::Rename => {
                let beside = dir.path().join("new.pt");
                std::fs::write(&beside, &bytes).unwrap();
                std::fs::rename(&beside, &module).unwrap();
            }
            _ => std::fs::OpenOptions::new().write(true).open(&module).unwrap().write_all(&bytes).unwrap(),
        }
        models.enter("run").unwrap();
        let err = script_forward(&models).unwrap_err();
        assert_refused(&err, "m", &module, change, &sink);
        assert_eq!(models.state("m").unwrap(), ModelState::Failed, "{change:?}");
        models.load("other").unwrap();
        models.accept_changed_files("m").unwrap();
        assert!(script_forward(&models).unwrap().equal(&first), "{change:?}: the same bytes, accepted");
    }
    for change in CHANGES {
        let dir = tempfile::TempDir::new().unwrap();
        let (module, checkpoint) = script_fixtures(dir.path());
        let sink = Arc::new(ListSink::new());
        let models = script_registry(&module, Some(&checkpoint), sink.clone());
        models.enter("run").unwrap();
        let _ = script_forward(&models).unwrap();
        models.enter("other").unwrap();
        change_checkpoint(&checkpoint, change);
        models.enter("run").unwrap();
        let err = script_forward(&models).unwrap_err();
        assert_refused(&err, "m", &checkpoint, change, &sink);
        assert_eq!(models.state("m").unwrap(), ModelState::Failed, "{change:?}");
    }
}

#[test]
fn an_aotinductor_packages_checkpoint_changed_after_a_release_is_refused() {
    let _one = support::generator();
    let fixtures = PathBuf::from(std::env::var("STAGELOAD_PT2_FIXTURES").expect(
        "STAGELOAD_PT2_FIXTURES is not set: run through cargo xtask test, or eval \"$(scripts/setup-reference.sh)\" first",
    ));
    for change in CHANGES {
        let dir = tempfile::TempDir::new().unwrap();
        let checkpoint = dir.path().join("mlp.safetensors");
        std::fs::copy(fixtures.join("mlp.safetensors"), &checkpoint).unwrap();
        let sink = Arc::new(ListSink::new());
        let models = StagedModels::builder()
            .model(ModelSpec::pt2("mlp", fixtures.join("mlp.pt2"), [&checkpoint]))
            .stage("run", ["mlp"])
            .stage("other", Vec::<String>::new())
            .events(sink.clone())
            .build()
            .unwrap();
        let x = Tensor::ones([4, 64], (Kind::Float, tch::Device::Cpu));
        let run = |models: &StagedModels| {
            models.call("mlp", |m: &mut stageload::pt2::Pt2Module| m.forward(&[&x]).unwrap().remove(0))
        };
        models.enter("run").unwrap();
        let _ = run(&models).unwrap();
        models.enter("other").unwrap();
        change_checkpoint(&checkpoint, change);
        models.enter("run").unwrap();
        let err = run(&models).unwrap_err();
        assert_refused(&err, "mlp", &checkpoint, change, &sink);
        assert_eq!(models.state("mlp").unwrap(), ModelState::Failed, "{change:?}");
    }
}

#[test]
fn a_snapshot_changed_after_it_was_written_is_refused() {
    let _one = support::generator();
    let dir = tempfile::TempDir::new().unwrap();
    let sink = Arc::new(ListSink::new());
    let models = StagedModels::builder()
        .model(ModelSpec::new("m", |_| Ok(build_mlp(8))))
        .stage("run", ["m"])
        .stage("other", Vec::<String>::new())
        .snapshot_dir(dir.path())
        .snapshot_keep_free(0)
        .events(sink.clone())
        .build()
        .unwrap();
    models.enter("run").unwrap();
    let _ = models.call("m", |m: &mut Mlp| m.forward(&input(8))).unwrap();
    models.enter("other").unwrap();
    let snapshot = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .expect("the snapshot written at the release");
    change_checkpoint(&snapshot, Change::InPlace);
    models.enter("run").unwrap();
    let err = models.call("m", |m: &mut Mlp| m.forward(&input(8))).unwrap_err();
    assert_refused(&err, "m", &snapshot, Change::InPlace, &sink);
    assert_eq!(models.state("m").unwrap(), ModelState::Failed);
}
