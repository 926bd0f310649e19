//! Reloads that map (`Reload::Map`): a released model comes back on its checkpoint file's pages
//! (a private mapping), bit for bit, in the foreground and by a prefetch; what is not one entry
//! in its dtype is copied; the mapping goes with the last storage on it; a file written in place
//! under a resident model that maps is caught before the model is handed out again, and one
//! renamed over it changes nothing the model holds.

use std::path::Path;
use std::sync::Arc;

use stageload::{EventKind, ListSink, ModelSpec, ModelState, Reload, ReloadFrom, StageError, StagedModels};
use stageload_test_support::torch::{self as support, build_mlp, Mlp};
use tch::Kind;

use crate::changed_files::{
    build_mlp_tensors, change_checkpoint, entries, expected, mlp_registry_reloading, net, seen_as, Change,
};

/// `net` from `file`, loaded, released and loaded again (`Reload::Map`), with its events and
/// its first output, which the reload gave again.
fn reloaded(file: &Path) -> (StagedModels, Arc<ListSink>, tch::Tensor) {
    let sink = Arc::new(ListSink::new());
    let models = mlp_registry_reloading(file, Reload::Map, sink.clone());
    models.enter("run").unwrap();
    let first = net(&models).unwrap();
    models.enter("other").unwrap();
    models.enter("run").unwrap();
    assert!(net(&models).unwrap().equal(&first));
    (models, sink, first)
}

/// How many of `net`'s weights lie in a mapping of `file` (`/proc/self/maps`).
fn weights_on_pages_of(models: &StagedModels, file: &Path) -> usize {
    let file = file.canonicalize().unwrap();
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let ranges: Vec<(usize, usize)> = maps
        .lines()
        .filter(|line| line.split_whitespace().nth(5).is_some_and(|p| Path::new(p) == file))
        .filter_map(|line| {
            let (start, end) = line.split_whitespace().next()?.split_once('-')?;
            Some((usize::from_str_radix(start, 16).ok()?, usize::from_str_radix(end, 16).ok()?))
        })
        .collect();
    let handle = models.get::<Mlp>("net").unwrap();
    let guard = handle.lock().unwrap();
    [&guard.l1.ws, guard.l1.bs.as_ref().unwrap(), &guard.l2.ws, guard.l2.bs.as_ref().unwrap()]
        .into_iter()
        .filter(|t| ranges.iter().any(|&(start, end)| (start..end).contains(&(t.data_ptr() as usize))))
        .count()
}

/// Whether any part of `file` is mapped in this process.
fn mapped_at_all(file: &Path) -> bool {
    let file = file.canonicalize().unwrap();
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines().any(|line| line.split_whitespace().nth(5).is_some_and(|p| Path::new(p) == file))
}

/// A checkpoint of the seeded MLP in a fresh folder.
fn checkpoint() -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::TempDir::new().unwrap();
    let file = dir.path().join("net.safetensors");
    stageload::checkpoint::save(&build_mlp_tensors(), &file).unwrap();
    (dir, file)
}

#[test]
fn a_model_that_maps_comes_back_on_its_files_pages_bit_for_bit_in_the_foreground_and_by_a_prefetch() {
    let _one = support::generator();
    for prefetch in [false, true] {
        let (_dir, file) = checkpoint();
        let sink = Arc::new(ListSink::new());
        let models = mlp_registry_reloading(&file, Reload::Map, sink.clone());
        models.enter("run").unwrap();
        let first = net(&models).unwrap();
        assert!(first.equal(&expected(&entries(&file))));
        assert_eq!(weights_on_pages_of(&models, &file), 0, "the first load copies");
        for round in 0..2 {
            models.enter("other").unwrap();
            assert_eq!(models.state("net").unwrap(), ModelState::Released);
            assert!(!mapped_at_all(&file), "round {round}: unmapped with the last storage on it");
            if prefetch {
                assert_eq!(models.prefetch("run").unwrap(), ["net"]);
                models.wait_prefetch("run").unwrap();
            }
            models.enter("run").unwrap();
            assert!(net(&models).unwrap().equal(&first), "prefetch {prefetch}, round {round}: bit for bit");
            assert_eq!(weights_on_pages_of(&models, &file), 4, "every weight on the file's pages");
            let reload = sink.of_kind(EventKind::Reload).pop().expect("a reload");
            assert_eq!(reload.reload_from(), Some(ReloadFrom::Mapped), "{reload}");
        }
        assert!(sink.of_kind(EventKind::Error).is_empty());
    }
}

#[test]
fn a_model_built_without_initial_values_that_maps_is_on_its_files_pages_from_its_first_load() {
    let _one = support::generator();
    for prefetch in [false, true] {
        let (_dir, file) = checkpoint();
        let sink = Arc::new(ListSink::new());
        let models = StagedModels::builder()
            .model(ModelSpec::new("net", |_| Ok(build_mlp(8))).checkpoint([&file]).skip_init(true).reload(Reload::Map))
            .model(ModelSpec::new("other", |_| Ok(build_mlp(8))))
            .stage("other", ["other"])
            .stage("run", ["net"])
            .events(sink.clone())
            .build()
            .unwrap();
        models.enter("other").unwrap();
        if prefetch {
            assert_eq!(models.prefetch("run").unwrap(), ["net"]);
            models.wait_prefetch("run").unwrap();
        }
        models.enter("run").unwrap();
        assert!(net(&models).unwrap().equal(&expected(&entries(&file))), "prefetch {prefetch}: the file's values");
        assert_eq!(weights_on_pages_of(&models, &file), 4, "prefetch {prefetch}: every weight on the file's pages");
        let load = sink.of_kind(EventKind::Load).into_iter().find(|e| e.model() == Some("net")).expect("a load");
        let bytes: u64 = entries(&file).iter().map(|(_, t)| (t.numel() * t.kind().elt_size_in_bytes()) as u64).sum();
        assert_eq!(load.bytes(), Some(bytes), "{load}: each weight counted once");
        let report = load.loaded().and_then(|l| l.report.as_deref()).expect("the checkpoint's report");
        assert_eq!((report.used, report.missing.len(), report.unused.len()), (4, 0, 0), "{load}");
        models.enter("other").unwrap();
        assert!(!mapped_at_all(&file), "prefetch {prefetch}: unmapped at its release");
        assert!(sink.of_kind(EventKind::Error).is_empty());
    }
}

#[test]
fn a_model_whose_weights_are_not_the_files_entries_in_their_dtype_is_copied_as_before() {
    let _one = support::generator();
    let dir = tempfile::TempDir::new().unwrap();
    let file = dir.path().join("net.safetensors");
    // Double in the file, float in the model: each weight is converted, so none can be mapped.
    let doubles: Vec<(String, tch::Tensor)> =
        build_mlp_tensors().into_iter().map(|(n, t)| (n, t.to_kind(Kind::Double))).collect();
    stageload::checkpoint::save(&doubles, &file).unwrap();
    let (models, _, _) = reloaded(&file);
    assert_eq!(weights_on_pages_of(&models, &file), 0, "copied, not mapped");
    assert!(!mapped_at_all(&file));
}

#[test]
fn a_file_written_in_place_under_a_resident_model_that_maps_releases_it_before_any_further_use() {
    let _one = support::generator();
    let (_dir, file) = checkpoint();
    let (models, sink, _) = reloaded(&file);

    let now = change_checkpoint(&file, Change::InPlace);
    let err = net(&models).unwrap_err();
    let StageError::ChangedUnderModel { source } = &err else { panic!("not a change under the model: {err}") };
    assert_eq!((source.model.as_str(), source.path.as_path()), ("net", file.as_path()));
    assert!(seen_as(Change::InPlace)(&source.change), "{:?}", source.change);
    let text = err.to_string();
    assert!(text.contains("net.safetensors") && text.contains("released"), "{text}");
    assert_eq!(models.state("net").unwrap(), ModelState::Released, "released before any further use");
    assert!(!mapped_at_all(&file), "its pages given back");
    let failed = sink.of_kind(EventKind::Error).pop().expect("an error event");
    assert_eq!(failed.model(), Some("net"));

    // From here it is a changed file like any other: refused until accepted.
    assert!(matches!(net(&models), Err(StageError::SourceChanged(_))));
    models.accept_changed_files("net").unwrap();
    assert!(net(&models).unwrap().equal(&expected(&now)), "accepted: the new values");
}

#[test]
fn a_file_renamed_over_a_resident_model_that_maps_changes_nothing_it_holds() {
    let _one = support::generator();
    let (_dir, file) = checkpoint();
    let (models, _, first) = reloaded(&file);
    assert_eq!(weights_on_pages_of(&models, &file), 4);
    change_checkpoint(&file, Change::Rename);
    // The mapped file is the one first read, whatever is at the path now.
    assert!(net(&models).unwrap().equal(&first), "the pages it holds are the first file's");
    models.enter("other").unwrap();
    models.enter("run").unwrap();
    assert!(matches!(net(&models), Err(StageError::SourceChanged(_))), "its next reload meets the new file");
}
