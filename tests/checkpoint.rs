//! Checkpoint I/O against real safetensors files written by the test: round trips for every
//! dtype, conversions, and every bad input leaving the targets as they were.

use stageload::checkpoint::{save, Checkpoint, CheckpointError, HostRead, MAPPED_MIN};
use stageload::source::FileChange;
use stageload_test_support::torch as support;
use tch::{Device, Kind, Tensor};

/// A file path in a folder of its own, removed with its contents when the folder is dropped.
fn tmp(name: &str) -> (tempfile::TempDir, std::path::PathBuf) {
    let folder = tempfile::Builder::new().prefix("stageload-ckpt-").tempdir().unwrap();
    let path = folder.path().join(name);
    (folder, path)
}

fn sample(kind: Kind, shape: &[i64]) -> Tensor {
    let t = Tensor::randn(shape, (Kind::Float, Device::Cpu)) * 50.0;
    match kind {
        Kind::Bool => t.gt(0.0),
        Kind::Uint8 => t.abs().to_kind(Kind::Uint8),
        _ => t.to_kind(kind),
    }
}

fn named(name: &str, t: &Tensor) -> (String, Tensor) {
    (name.to_string(), t.shallow_clone())
}

#[test]
fn every_dtype_round_trips() {
    let _generator = support::generator();
    let kinds = [
        Kind::Bool,
        Kind::Uint8,
        Kind::Int8,
        Kind::Int16,
        Kind::Int,
        Kind::Int64,
        Kind::Half,
        Kind::BFloat16,
        Kind::Float,
        Kind::Double,
    ];
    let originals: Vec<(String, Tensor)> =
        kinds.iter().enumerate().map(|(i, &k)| (format!("t{i}"), sample(k, &[3, 5, 7]))).collect();
    let (_path_folder, path) = tmp("dtypes.safetensors");
    save(&originals, &path).unwrap();
    let targets: Vec<(String, Tensor)> =
        originals.iter().map(|(n, t)| (n.clone(), Tensor::zeros([3, 5, 7], (t.kind(), Device::Cpu)))).collect();
    let report = Checkpoint::open(&[&path]).unwrap().load_into(&targets, |_| {}).unwrap();
    assert_eq!(report.tensors, kinds.len());
    assert!(report.unused.is_empty());
    for ((name, original), (_, loaded)) in originals.iter().zip(&targets) {
        assert!(original.equal(loaded), "{name} ({:?}) differs after the round trip", original.kind());
    }
}

#[test]
fn dtypes_convert_into_the_models_kind() {
    let _generator = support::generator();
    let source = Tensor::randn([64, 33], (Kind::Float, Device::Cpu));
    let ints = Tensor::arange(100, (Kind::Int, Device::Cpu));
    let (_path_folder, path) = tmp("convert.safetensors");
    save(&[named("w", &source), named("half", &source.to_kind(Kind::Half)), named("i", &ints)], &path).unwrap();
    let checkpoint = Checkpoint::open(&[&path]).unwrap();
    for (name, kind) in [
        ("w", Kind::Half),
        ("w", Kind::BFloat16),
        ("w", Kind::Double),
        ("half", Kind::Float),
        ("i", Kind::Int64),
        ("i", Kind::Float),
    ] {
        let entry = &checkpoint.entries()[name];
        let target = Tensor::zeros(entry.shape.as_slice(), (kind, Device::Cpu));
        checkpoint.load_into(&[named(name, &target)], |_| {}).unwrap();
        let reference = match name {
            "w" => source.to_kind(kind),
            "half" => source.to_kind(Kind::Half).to_kind(kind),
            _ => ints.to_kind(kind),
        };
        assert!(target.equal(&reference), "{name} into {kind:?}");
    }
}

#[test]
fn a_model_split_over_files_loads_and_progress_counts_every_byte() {
    let _generator = support::generator();
    let a = Tensor::randn([256, 256], (Kind::Float, Device::Cpu));
    let b = Tensor::randn([1000], (Kind::Float, Device::Cpu));
    let ((_pa_folder, pa), (_pb_folder, pb)) = (tmp("split-a.safetensors"), tmp("split-b.safetensors"));
    save(&[named("a", &a), named("extra", &b)], &pa).unwrap();
    save(&[named("b", &b)], &pb).unwrap();
    let targets = vec![("a".to_string(), a.zeros_like()), ("b".to_string(), b.zeros_like())];
    let mut last = None;
    let report = Checkpoint::open(&[&pa, &pb]).unwrap().load_into(&targets, |p| last = Some(p)).unwrap();
    assert!(targets[0].1.equal(&a) && targets[1].1.equal(&b));
    assert_eq!(report.unused, vec!["extra".to_string()], "entries the model lacks are reported");
    let last = last.unwrap();
    assert_eq!((last.done, last.total), ((256 * 256 + 1000) * 4, (256 * 256 + 1000) * 4));
    assert_eq!(report.bytes, last.total);
    // The same name in two files is refused.
    let err = Checkpoint::open(&[&pb, &pb]).unwrap_err();
    assert!(matches!(err, CheckpointError::DuplicateTensor { ref tensor, .. } if tensor == "b"), "{err}");
}

/// A failed load must leave every target untouched: targets start at a sentinel value.
fn assert_untouched(targets: &[(String, Tensor)]) {
    for (name, t) in targets {
        assert!(t.equal(&t.full_like(7.0)), "{name} was modified by a failed load");
    }
}

#[test]
fn bad_input_is_a_clear_error_and_changes_nothing() {
    let _generator = support::generator();
    let w = Tensor::randn([8, 4], (Kind::Float, Device::Cpu));
    let (_path_folder, path) = tmp("bad.safetensors");
    save(&[named("w", &w), named("v", &w)], &path).unwrap();
    let checkpoint = Checkpoint::open(&[&path]).unwrap();
    let sentinel = |shape: &[i64], kind| Tensor::full(shape, 7.0, (kind, Device::Cpu));

    // A tensor the files lack: named, with the files; the other target (listed first) untouched.
    let targets =
        vec![("v".into(), sentinel(&[8, 4], Kind::Float)), ("missing.weight".into(), sentinel(&[2], Kind::Float))];
    let err = checkpoint.load_into(&targets, |_| {}).unwrap_err();
    let text = err.to_string();
    assert!(text.contains("'missing.weight'") && text.contains("bad.safetensors"), "{text}");
    assert_untouched(&targets);

    // Shape mismatch: expected against found.
    let targets = vec![("v".into(), sentinel(&[8, 4], Kind::Float)), ("w".into(), sentinel(&[4, 8], Kind::Float))];
    let text = checkpoint.load_into(&targets, |_| {}).unwrap_err().to_string();
    assert!(text.contains("'w'") && text.contains("[4, 8]") && text.contains("[8, 4]"), "{text}");
    assert_untouched(&targets);

    // A float entry does not load into an integer tensor.
    let targets = vec![("v".into(), sentinel(&[8, 4], Kind::Float)), ("w".into(), sentinel(&[8, 4], Kind::Int64))];
    let text = checkpoint.load_into(&targets, |_| {}).unwrap_err().to_string();
    assert!(text.contains("'w'") && text.contains("Int64") && text.contains("Float"), "{text}");
    assert_untouched(&targets);

    // A released target (no storage) is refused before anything is copied.
    let released = sentinel(&[8, 4], Kind::Float);
    // SAFETY: one thread, no op running on the tensor.
    unsafe { stageload_torch_sys::free_storage(&released, "test") }.unwrap();
    let targets = vec![("w".into(), released)];
    assert!(matches!(checkpoint.load_into(&targets, |_| {}), Err(CheckpointError::Unallocated { .. })));
}

#[test]
fn missing_truncated_and_corrupt_files_are_errors_naming_the_file() {
    let _generator = support::generator();
    let (_missing_folder, missing) = tmp("does-not-exist.safetensors");
    let err = Checkpoint::open(&[&missing]).unwrap_err();
    assert!(matches!(err, CheckpointError::Open { .. }) && err.to_string().contains("does-not-exist"), "{err}");

    let (_good_folder, good) = tmp("whole.safetensors");
    save(&[named("w", &Tensor::randn([128, 128], (Kind::Float, Device::Cpu)))], &good).unwrap();
    let bytes = std::fs::read(&good).unwrap();

    let (_truncated_folder, truncated) = tmp("truncated.safetensors");
    std::fs::write(&truncated, &bytes[..bytes.len() - 100]).unwrap();
    let err = Checkpoint::open(&[&truncated]).unwrap_err();
    assert!(
        matches!(err, CheckpointError::Invalid { .. }) && err.to_string().contains("truncated.safetensors"),
        "{err}"
    );

    let (_huge_header_folder, huge_header) = tmp("huge-header.safetensors");
    let mut b = bytes.clone();
    b[..8].copy_from_slice(&(bytes.len() as u64 * 2).to_le_bytes());
    std::fs::write(&huge_header, &b).unwrap();
    assert!(matches!(Checkpoint::open(&[&huge_header]), Err(CheckpointError::Invalid { .. })));

    let (_not_json_folder, not_json) = tmp("not-json.safetensors");
    let mut b = bytes.clone();
    b[8] = b'!';
    std::fs::write(&not_json, &b).unwrap();
    assert!(matches!(Checkpoint::open(&[&not_json]), Err(CheckpointError::Invalid { .. })));

    let (_tiny_folder, tiny) = tmp("tiny.safetensors");
    std::fs::write(&tiny, [1u8, 2, 3]).unwrap();
    assert!(matches!(Checkpoint::open(&[&tiny]), Err(CheckpointError::Invalid { .. })));
}

#[test]
fn paths_that_are_not_regular_files_and_hostile_header_lengths_are_refused_before_any_allocation() {
    let _generator = support::generator();
    let (folder, fifo) = tmp("fifo.safetensors");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
    let sparse = folder.path().join("sparse.safetensors");
    let file = std::fs::File::create(&sparse).unwrap();
    std::io::Write::write_all(&mut &file, &(8u64 << 30).to_le_bytes()).unwrap();
    file.set_len(9 << 30).unwrap();
    let cases = [
        (fifo.as_path(), "is a named pipe (FIFO), not a regular file"),
        (folder.path(), "is a directory, not a regular file"),
        (std::path::Path::new("/dev/urandom"), "is a character device, not a regular file"),
        (sparse.as_path(), "over safetensors' limit"),
    ];
    for (path, expected) in cases {
        let err = Checkpoint::open(&[path]).unwrap_err().to_string();
        assert!(err.contains(expected) && err.contains(&path.display().to_string()), "{err}");
    }
}

#[test]
fn loads_into_storage_that_was_released_then_reallocated() {
    let _generator = support::generator();
    let w = Tensor::randn([512, 512], (Kind::Float, Device::Cpu));
    let (_path_folder, path) = tmp("realloc.safetensors");
    save(&[named("w", &w)], &path).unwrap();
    let target = w.copy();
    // SAFETY: one thread; the reallocated memory is filled by the load below before it is read.
    let bytes = unsafe { stageload_torch_sys::free_storage(&target, "released") }.unwrap();
    // SAFETY: as above.
    unsafe { stageload_torch_sys::realloc_storage(&target, bytes) }.unwrap();
    Checkpoint::open(&[&path]).unwrap().load_into(&[named("w", &target)], |_| {}).unwrap();
    assert!(target.equal(&w));
}

#[test]
fn large_entries_load_in_pieces_with_and_without_conversion() {
    let _generator = support::generator();
    // 20 MiB and 6 MiB entries: several pieces shared out over the CPUs.
    let big = Tensor::randn([5 << 20], (Kind::Float, Device::Cpu));
    let medium = Tensor::randn([1536, 1024], (Kind::Float, Device::Cpu));
    let small = Tensor::randn([3, 7], (Kind::Float, Device::Cpu));
    let (_folder, path) = tmp("large.safetensors");
    save(
        &[
            named("big", &big),
            named("medium", &medium),
            named("small", &small),
            named("half", &big.to_kind(Kind::Half)),
            named("scalar", &Tensor::from(2.5f32)),
        ],
        &path,
    )
    .unwrap();
    let checkpoint = Checkpoint::open(&[&path]).unwrap();

    let targets = vec![
        named("big", &big.zeros_like()),
        named("medium", &medium.zeros_like()),
        named("small", &small.zeros_like()),
    ];
    let mut seen = Vec::new();
    let report = checkpoint.load_into(&targets, |p| seen.push(p)).unwrap();
    assert!(targets[0].1.equal(&big) && targets[1].1.equal(&medium) && targets[2].1.equal(&small));
    assert!(seen.windows(2).all(|w| w[0].done <= w[1].done), "progress only goes forward");
    let total = ((5 << 20) + 1536 * 1024 + 21) * 4;
    assert_eq!(seen.last().map(|p| (p.done, p.total)), Some((total, total)));
    assert_eq!((report.bytes, report.tensors), (total, 3));

    // A conversion over several 16 MiB windows of rows, into a contiguous target and into a
    // strided one; a 0-d entry.
    let converted = big.zeros_like();
    checkpoint.load_into(&[named("half", &converted)], |_| {}).unwrap();
    assert!(converted.equal(&big.to_kind(Kind::Half).to_kind(Kind::Float)));
    let widened = Tensor::zeros([5 << 20], (Kind::Double, Device::Cpu));
    checkpoint.load_into(&[named("big", &widened)], |_| {}).unwrap();
    assert!(widened.equal(&big.to_kind(Kind::Double)), "20 MiB entry converted in two windows");
    let storage = Tensor::zeros([1024, 1536], (Kind::Double, Device::Cpu));
    let strided = storage.tr();
    checkpoint.load_into(&[named("medium", &strided)], |_| {}).unwrap();
    assert!(strided.equal(&medium.to_kind(Kind::Double)), "a transposed target gets the values in its own layout");
    let scalar = Tensor::from(0.0f64);
    checkpoint.load_into(&[named("scalar", &scalar)], |_| {}).unwrap();
    assert_eq!(scalar.double_value(&[]), 2.5);
}

#[test]
fn tied_targets_sharing_memory_load_one_after_the_other() {
    let _generator = support::generator();
    // Two entries of different values for two names of one tensor (tied embeddings): copied one
    // after the other, the tensor holds the one listed last, never a mix of chunks of both.
    let embed = Tensor::randn([10 << 20], (Kind::Float, Device::Cpu));
    let head = embed.neg();
    let (_folder, path) = tmp("tied.safetensors");
    save(&[named("embed", &embed), named("lm_head", &head), named("part", &embed.narrow(0, 0, 1 << 20))], &path)
        .unwrap();
    let checkpoint = Checkpoint::open(&[&path]).unwrap();
    let tied = embed.zeros_like();
    let report = checkpoint.load_into(&[named("embed", &tied), named("lm_head", &tied)], |_| {}).unwrap();
    assert!(tied.equal(&head), "the last listed entry wins, whole");
    assert_eq!(report.tensors, 2);
    // A target overlapping part of another.
    let whole = embed.zeros_like();
    checkpoint.load_into(&[named("lm_head", &whole), named("part", &whole.narrow(0, 0, 1 << 20))], |_| {}).unwrap();
    assert!(
        whole.narrow(0, 0, 1 << 20).equal(&embed.narrow(0, 0, 1 << 20))
            && whole.narrow(0, 1 << 20, 9 << 20).equal(&head.narrow(0, 1 << 20, 9 << 20))
    );
    // A strided view (copied through libtorch) listed before the contiguous tensor it views.
    let square = Tensor::randn([512, 512], (Kind::Float, Device::Cpu));
    let (_folder2, path2) = tmp("tied-strided.safetensors");
    save(&[named("transposed", &square.neg()), named("square", &square)], &path2).unwrap();
    let base = square.zeros_like();
    Checkpoint::open(&[&path2])
        .unwrap()
        .load_into(&[named("transposed", &base.tr()), named("square", &base)], |_| {})
        .unwrap();
    assert!(base.equal(&square), "the contiguous target listed last wins over the strided one");
}

#[test]
fn a_file_truncated_after_it_was_opened_is_an_error_not_a_crash() {
    let _generator = support::generator();
    let big = Tensor::randn([3 << 20], (Kind::Float, Device::Cpu));
    let (_folder, path) = tmp("shrinks.safetensors");
    save(&[named("big", &big)], &path).unwrap();
    let checkpoint = Checkpoint::open(&[&path]).unwrap();
    let length = std::fs::metadata(&path).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(length / 2).unwrap();
    // Seen before the first read (a file cut while it is read is a `Read` error of the tensor).
    let err = checkpoint.load_into(&[named("big", &big.zeros_like())], |_| {}).unwrap_err();
    let half = FileChange::Resized { from: length, to: length / 2 };
    assert!(matches!(err, CheckpointError::Changed { path: ref at, change } if *at == path && change == half), "{err}");
    assert!(err.to_string().contains("shrinks.safetensors"), "{err}");
}

#[test]
fn both_host_read_paths_load_the_same_bytes_from_any_offset() {
    let _generator = support::generator();
    // A 3-byte entry first puts every later entry at an offset no page or vector boundary
    // aligns; the sizes straddle the smallest mapped piece and the 4 MiB piece.
    let odd = sample(Kind::Uint8, &[3]);
    let sizes = [MAPPED_MIN as i64 / 4 - 1, MAPPED_MIN as i64 / 4, (4 << 20) / 4 + 5, 3 << 20, 17];
    let tensors: Vec<Tensor> = sizes.iter().map(|&n| sample(Kind::Float, &[n])).collect();
    let mut entries = vec![named("odd", &odd)];
    entries.extend(tensors.iter().enumerate().map(|(i, t)| named(&format!("t{i}"), t)));
    let (_folder, path) = tmp("offsets.safetensors");
    save(&entries, &path).unwrap();
    for how in [HostRead::Mapped, HostRead::Pread] {
        let targets: Vec<(String, Tensor)> = entries.iter().map(|(name, t)| (name.clone(), t.full_like(7))).collect();
        Checkpoint::open(&[&path]).unwrap().host_reads(how).load_into(&targets, |_| {}).unwrap();
        for ((name, target), (_, want)) in targets.iter().zip(&entries) {
            assert!(target.equal(want), "{how:?}: {name} differs");
        }
    }
}

#[test]
fn a_file_truncated_during_a_load_is_an_error_not_a_crash() {
    let _generator = support::generator();
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    // 48 MiB in 12 pieces; the hook asked before the third piece cuts the file to a third, while
    // other readers may be copying theirs (from a mapping, the cut pages fault: SIGBUS).
    let big = sample(Kind::Float, &[12, 1 << 20]);
    for how in [HostRead::Mapped, HostRead::Pread] {
        let (_folder, path) = tmp("shrinking.safetensors");
        save(&[named("big", &big)], &path).unwrap();
        let length = std::fs::metadata(&path).unwrap().len();
        let asked = Arc::new(AtomicUsize::new(0));
        let cut = path.clone();
        let checkpoint = Checkpoint::open(&[&path]).unwrap().host_reads(how).before_each_piece(Arc::new(move |_| {
            if asked.fetch_add(1, Ordering::SeqCst) == 2 {
                std::fs::OpenOptions::new().write(true).open(&cut).unwrap().set_len(length / 3).unwrap();
            }
            true
        }));
        let err = checkpoint.load_into(&[named("big", &big.zeros_like())], |_| {}).unwrap_err();
        assert!(matches!(err, CheckpointError::Read { ref tensor, .. } if tensor == "big"), "{how:?}: {err}");
        assert!(err.to_string().contains("shrinking.safetensors"), "{err}");
    }
}

#[test]
fn pieces_in_the_page_cache_come_from_mappings_and_a_reader_that_meets_the_disk_keeps_to_pread() {
    let _generator = support::generator();
    use stageload::checkpoint::{readers, PIECE};
    // Eight entries of one piece each; every page in the page cache but those of the first.
    let pieces = 8;
    let entries: Vec<(String, Tensor)> =
        (0..pieces).map(|i| named(&format!("t{i}"), &sample(Kind::Float, &[PIECE as i64 / 4]))).collect();
    let (_folder, path) = tmp("half-cached.safetensors");
    save(&entries, &path).unwrap();
    // Written back, so that its pages can be dropped.
    std::fs::File::open(&path).unwrap().sync_all().unwrap();
    let targets: Vec<(String, Tensor)> = entries.iter().map(|(n, t)| (n.clone(), t.zeros_like())).collect();
    let total = (pieces * PIECE) as u64;

    std::fs::read(&path).unwrap();
    let report = Checkpoint::open(&[&path]).unwrap().load_into(&targets, |_| {}).unwrap();
    assert_eq!(report.mapped, total, "a load whose file is all in the page cache maps every piece");

    let checkpoint = Checkpoint::open(&[&path]).unwrap();
    std::fs::read(&path).unwrap();
    checkpoint.drop_cached(["t0"]).unwrap();
    let report = checkpoint.load_into(&targets, |_| {}).unwrap();
    // The first reader's run starts at t0, on the disk: it reads its whole run with pread (the
    // kernel's read-ahead keeps that run one sequential stream); every other reader maps.
    let threads = readers().min(pieces);
    let first_run = pieces.div_ceil(threads) * PIECE;
    assert_eq!(report.mapped, total - first_run as u64, "{threads} readers");
    for ((name, target), (_, want)) in targets.iter().zip(&entries) {
        assert!(target.equal(want), "{name} differs");
    }
    let report = Checkpoint::open(&[&path]).unwrap().host_reads(HostRead::Pread).load_into(&targets, |_| {}).unwrap();
    assert_eq!(report.mapped, 0, "HostRead::Pread maps nothing");
}

#[test]
fn a_load_stops_at_the_first_piece_that_finds_its_stop_flag_set() {
    let _generator = support::generator();
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    // 48 MiB in pieces, one converted entry (f32 → f64, the sequential path) beside.
    let big = sample(Kind::Float, &[12, 1 << 20]);
    let small = sample(Kind::Float, &[4, 4]);
    let (_folder, path) = tmp("stop.safetensors");
    save(&[named("big", &big), named("small", &small)], &path).unwrap();
    let targets = || {
        vec![named("big", &big.zeros_like()), ("small".to_string(), Tensor::zeros([4, 4], (Kind::Double, Device::Cpu)))]
    };
    let stop = Arc::new(AtomicBool::new(false));
    let checkpoint = Checkpoint::open(&[&path]).unwrap().stop_when(stop.clone());

    let whole = targets();
    checkpoint.load_into(&whole, |_| {}).unwrap();
    assert!(whole[0].1.equal(&big) && whole[1].1.equal(&small.to_kind(Kind::Double)), "unset: loads as without it");

    // Set by the first progress report: what is read afterwards is at most the pieces already
    // taken by the other readers, never the whole file.
    let stopped = targets();
    let mut reports = 0;
    let err = checkpoint
        .load_into(&stopped, |_| {
            reports += 1;
            stop.store(true, Ordering::SeqCst);
        })
        .unwrap_err();
    assert!(matches!(&err, CheckpointError::Stopped { files } if files == std::slice::from_ref(&path)), "{err}");
    assert!(err.to_string().contains("stopped"), "{err}");
    assert_eq!(reports, 1, "no report after the stop");
    assert!(
        stopped[1].1.equal(&Tensor::zeros([4, 4], (Kind::Double, Device::Cpu))),
        "the converted entry was not copied"
    );
}
