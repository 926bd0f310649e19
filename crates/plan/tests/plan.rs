//! Pipeline files and plans over real safetensors files written here: sizes from headers, the
//! staged and eager plans, the verdict's boundaries, every bad input, and the JSON schema.

use std::path::{Path, PathBuf};

use safetensors::tensor::TensorView;
use safetensors::Dtype;
use stageload_plan::{plan, Budget, BudgetSource, Pipeline, PipelineError, Verdict};

/// A folder for one test, removed with its contents when dropped.
fn scratch(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new().prefix(&format!("stageload-plan-{name}-")).tempdir().unwrap()
}

/// A pipeline file in its own folder; the folder goes when this is dropped.
struct Fixture {
    _folder: tempfile::TempDir,
    path: PathBuf,
}

impl std::ops::Deref for Fixture {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.path
    }
}

/// Writes a real safetensors file of zero-filled tensors.
fn checkpoint(path: &Path, tensors: &[(&str, Dtype, &[usize])]) {
    let buffers: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, dtype, shape)| vec![0u8; shape.iter().product::<usize>() * dtype.bitsize() / 8])
        .collect();
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .zip(&buffers)
        .map(|((name, dtype, shape), data)| (name.to_string(), TensorView::new(*dtype, shape.to_vec(), data).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

/// A folder with an encoder (f32, 1 MiB, one file), a decoder split over two files (f16 + f32 +
/// i64) and a backbone (bf16), and a pipeline file around them.
fn fixture(name: &str, pipeline: &str) -> Fixture {
    let folder = scratch(name);
    let dir = folder.path();
    checkpoint(&dir.join("encoder.safetensors"), &[("w", Dtype::F32, &[512, 512])]);
    checkpoint(&dir.join("decoder-1.safetensors"), &[("a", Dtype::F16, &[256, 256]), ("b", Dtype::F32, &[1000])]);
    checkpoint(&dir.join("decoder-2.safetensors"), &[("c", Dtype::I64, &[10, 10])]);
    checkpoint(&dir.join("backbone.safetensors"), &[("x", Dtype::BF16, &[1024, 256])]);
    let path = dir.join("pipeline.toml");
    std::fs::write(&path, pipeline).unwrap();
    Fixture { _folder: folder, path }
}

const MODELS: &str = r#"
[[models]]
name = "encoder"
files = ["encoder.safetensors"]

[[models]]
name = "decoder"
files = ["decoder-1.safetensors", "decoder-2.safetensors"]

[[models]]
name = "backbone"
files = ["backbone.safetensors"]
"#;

const ENCODER: u64 = 512 * 512 * 4;
const DECODER: u64 = 256 * 256 * 2 + 1000 * 4 + 100 * 8;
const BACKBONE: u64 = 1024 * 256 * 2;
const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
/// One of [`streamed_fixture`]'s 1 MiB blocks as a slot counts it (with the room to lay it out at
/// its file phase).
const BLOCK: u64 = MIB + stageload_plan::split::FILE_PHASE_ROOM;

fn stages(extra: &str) -> String {
    format!(
        "pinned = [\"backbone\"]\n{MODELS}{extra}\n\
         [[stages]]\nname = \"setup\"\n\n\
         [[stages]]\nname = \"encode\"\nmodels = [\"backbone\", \"encoder\"]\nworking = \"64K\"\n\n\
         [[stages]]\nname = \"both\"\nmodels = [\"encoder\", \"decoder\"]\n\n\
         [[stages]]\nname = \"decode\"\nmodels = [\"decoder\"]\nworking = \"512K\"\n\n\
         [[stages]]\nname = \"again\"\nmodels = [\"encoder\"]\n"
    )
}

#[test]
fn model_sizes_come_from_the_headers_of_every_file() {
    let path = fixture("sizes", &stages(""));
    let pipeline = Pipeline::load(&path).unwrap();
    let sizes: Vec<(&str, u64, usize, usize)> =
        pipeline.models.iter().map(|m| (m.name.as_str(), m.bytes, m.tensors, m.files.len())).collect();
    assert_eq!(sizes, [("encoder", ENCODER, 1, 1), ("decoder", DECODER, 3, 2), ("backbone", BACKBONE, 1, 1)]);
    assert!(pipeline.models[0].files[0].starts_with(path.parent().unwrap()), "files are relative to the pipeline file");
}

#[test]
fn a_load_dtype_changes_resident_bytes_not_bytes_read() {
    let text =
        stages("").replace("files = [\"encoder.safetensors\"]", "files = [\"encoder.safetensors\"]\ndtype = \"bf16\"");
    let pipeline = Pipeline::load(&fixture("dtype", &text)).unwrap();
    let encoder = pipeline.model("encoder").unwrap();
    assert_eq!((encoder.bytes, encoder.file_bytes), (ENCODER / 2, ENCODER));
}

#[test]
fn only_float_entries_convert_and_ignored_entries_count_nothing() {
    let text = stages("").replace(
        "files = [\"decoder-1.safetensors\", \"decoder-2.safetensors\"]",
        "files = [\"decoder-1.safetensors\", \"decoder-2.safetensors\"]\ndtype = \"bf16\"",
    );
    let decoder = Pipeline::load(&fixture("float-only", &text)).unwrap().model("decoder").unwrap().clone();
    // f16 a and f32 b become 2 bytes an element; the i64 c keeps its 8.
    assert_eq!(decoder.bytes, 256 * 256 * 2 + 1000 * 2 + 100 * 8);
    assert_eq!(decoder.file_bytes, DECODER);
    let text = stages("").replace(
        "files = [\"decoder-1.safetensors\", \"decoder-2.safetensors\"]",
        "files = [\"decoder-1.safetensors\", \"decoder-2.safetensors\"]\nignore = [\"b\", \"c*\"]",
    );
    let decoder = Pipeline::load(&fixture("ignore", &text)).unwrap().model("decoder").unwrap().clone();
    assert_eq!((decoder.tensors, decoder.bytes, decoder.file_bytes), (1, 256 * 256 * 2, 256 * 256 * 2));
}

#[test]
fn a_scoped_pin_holds_from_its_stage_until_its_end_stage_begins() {
    let text = stages("").replace("pinned = [\"backbone\"]", "")
        + "\n[[pins]]\nmodels = [\"backbone\"]\nfrom = \"encode\"\nuntil = \"decode\"\n";
    let pipeline = Pipeline::load(&fixture("scoped", &text)).unwrap();
    let plan = plan(&pipeline, Budget::given(64 * MIB), None);
    let resident = |stage: &str| names(&plan.stages.iter().find(|s| s.name == stage).unwrap().resident).join(",");
    assert_eq!(resident("setup"), "");
    assert_eq!(resident("encode"), "backbone,encoder");
    assert_eq!(resident("both"), "backbone,encoder,decoder", "kept while pinned though not listed");
    assert_eq!(resident("decode"), "decoder", "released when decode begins");
    let decode = plan.stages.iter().find(|s| s.name == "decode").unwrap();
    assert_eq!(names(&decode.released), ["backbone", "encoder"]);
}

#[test]
fn a_stage_that_comes_back_is_planned_at_each_occurrence() {
    let text = stages("") + "\n[[stages]]\nname = \"decode\"\nmodels = [\"decoder\"]\nworking = \"1M\"\n";
    let pipeline = Pipeline::load(&fixture("repeat", &text)).unwrap();
    let plan = plan(&pipeline, Budget::given(64 * MIB), None);
    let occurrences: Vec<&stageload_plan::StagePlan> = plan.stages.iter().filter(|s| s.name == "decode").collect();
    assert_eq!(occurrences.len(), 2);
    assert_eq!(names(&occurrences[0].loaded), Vec::<&str>::new(), "kept from `both`");
    assert_eq!(names(&occurrences[1].reloaded), ["decoder"], "released at `again`, read again");
    assert_eq!(occurrences[1].need, BACKBONE + DECODER + MIB);
}

#[test]
fn a_reserve_is_added_to_every_need() {
    let percent = Pipeline::load(&fixture("reserve-pct", &("reserve = \"10%\"\n".to_string() + &stages("")))).unwrap();
    let plain = Pipeline::load(&fixture("reserve-none", &stages(""))).unwrap();
    let size = Pipeline::load(&fixture("reserve-size", &("reserve = \"1M\"\n".to_string() + &stages("")))).unwrap();
    let need = |p: &Pipeline| plan(p, Budget::given(64 * MIB), None).stages[1].need;
    assert_eq!(need(&size), need(&plain) + MIB);
    assert_eq!(need(&percent), need(&plain) + need(&plain) / 10);
}

fn names(list: &[String]) -> Vec<&str> {
    list.iter().map(String::as_str).collect()
}

#[test]
fn the_staged_plan_counts_kept_models_once_and_reloads_again() {
    let pipeline = Pipeline::load(&fixture("staged", &stages(""))).unwrap();
    let plan = plan(&pipeline, Budget::given(64 * MIB), None);
    // (stage, resident, loaded, released, need)
    type Row<'a> = (&'a str, Vec<&'a str>, Vec<&'a str>, Vec<&'a str>, u64);
    let rows: Vec<Row> = plan
        .stages
        .iter()
        .map(|s| (s.name.as_str(), names(&s.resident), names(&s.loaded), names(&s.released), s.need))
        .collect();
    assert_eq!(
        rows,
        [
            ("setup", vec![], vec![], vec![], 0),
            ("encode", vec!["backbone", "encoder"], vec!["backbone", "encoder"], vec![], BACKBONE + ENCODER + 64 * KIB),
            // The pinned backbone stays; the encoder, listed again, is kept and counted once.
            ("both", vec!["backbone", "encoder", "decoder"], vec!["decoder"], vec![], BACKBONE + ENCODER + DECODER),
            ("decode", vec!["backbone", "decoder"], vec![], vec!["encoder"], BACKBONE + DECODER + 512 * KIB),
            ("again", vec!["backbone", "encoder"], vec!["encoder"], vec!["decoder"], BACKBONE + ENCODER),
        ]
    );
    assert_eq!(plan.stages[4].reloaded, ["encoder"]);
    assert_eq!(plan.read, BACKBONE + 2 * ENCODER + DECODER, "the reload reads the encoder again");
    assert_eq!(plan.eager.read, BACKBONE + ENCODER + DECODER);
    assert_eq!((plan.peak_stage.as_str(), plan.peak_need), ("both", BACKBONE + ENCODER + DECODER));
    assert_eq!(plan.eager.need, BACKBONE + ENCODER + DECODER + 512 * KIB);
    assert_eq!(plan.eager.peak_stage, "decode");
    assert!(plan.fits && plan.stages.iter().all(|s| s.verdict == Verdict::Fits));
    let text = plan.render();
    for expected in ["stage again: resident backbone, encoder", "reloads encoder", "peak stage: both", "=> fits"] {
        assert!(text.contains(expected), "{expected} missing:\n{text}");
    }
}

const SAMPLER: u64 = 300 * KIB;

/// `stages("")` with a model no checkpoint holds (`sampler`, 300K as declared, and `extra` in its
/// entry) used by `encode` and `again`, and `head` on top.
fn with_built_model(name: &str, head: &str, extra: &str) -> Pipeline {
    let text = stages(&format!("\n[[models]]\nname = \"sampler\"\nweights = \"300K\"\n{extra}"))
        .replace("models = [\"backbone\", \"encoder\"]", "models = [\"backbone\", \"encoder\", \"sampler\"]")
        .replace("name = \"again\"\nmodels = [\"encoder\"]", "name = \"again\"\nmodels = [\"encoder\", \"sampler\"]");
    Pipeline::load(&fixture(name, &format!("{head}{text}"))).unwrap()
}

#[test]
fn a_model_without_a_checkpoint_reloads_from_its_snapshot_once_the_file_gives_a_snapshot_dir() {
    let pipeline = with_built_model("snapshot", "snapshot_dir = \"snapshots\"\nsnapshot_keep_free = \"2G\"\n", "");
    let folder = pipeline.path.parent().unwrap();
    assert_eq!(pipeline.snapshot_keep_free, Some(2 << 30));
    assert_eq!(
        pipeline.snapshot_dir.as_deref(),
        Some(folder.join("snapshots").as_path()),
        "taken from the file's folder"
    );
    let sampler = pipeline.model("sampler").unwrap();
    assert!(sampler.built() && sampler.files.is_empty());
    assert_eq!((sampler.bytes, sampler.file_bytes), (SAMPLER, 0));
    let plan = plan(&pipeline, Budget::given(64 * MIB), None);
    let stage = |name: &str| plan.stages.iter().find(|s| s.name == name).unwrap();
    // Its first load is a build: counted in the weights, nothing read.
    assert_eq!((stage("encode").weights, stage("encode").read), (BACKBONE + ENCODER + SAMPLER, BACKBONE + ENCODER));
    // `both` releases it: its snapshot is written as it goes.
    assert_eq!((names(&stage("both").released), names(&stage("both").snapshots)), (vec!["sampler"], vec!["sampler"]));
    // `again` reloads it from the snapshot, read like a checkpoint; the encoder from its file.
    let again = stage("again");
    assert_eq!((names(&again.reloaded), names(&again.from_snapshot)), (vec!["encoder", "sampler"], vec!["sampler"]));
    assert!(again.rebuilt.is_empty() && again.snapshots.is_empty());
    assert_eq!(again.read, ENCODER + SAMPLER);
    assert_eq!(plan.eager.weights, BACKBONE + ENCODER + DECODER + SAMPLER);
    assert_eq!(plan.eager.read, BACKBONE + ENCODER + DECODER, "eager builds it: nothing read");
    let text = plan.render();
    for expected in [
        "model sampler",
        "built by its loader (no checkpoint: size as declared)",
        "releases sampler, writing the snapshot of sampler;",
        "reloads encoder, sampler; from its snapshot: sampler)",
    ] {
        assert!(text.contains(expected), "{expected} missing:\n{text}");
    }
}

#[test]
fn without_a_snapshot_dir_a_model_without_a_checkpoint_is_rebuilt_and_reads_nothing() {
    let plan = plan(&with_built_model("rebuilt", "", ""), Budget::given(64 * MIB), None);
    let again = plan.stages.iter().find(|s| s.name == "again").unwrap();
    assert_eq!((names(&again.rebuilt), again.read), (vec!["sampler"], ENCODER));
    assert!(again.from_snapshot.is_empty() && plan.stages.iter().all(|s| s.snapshots.is_empty()));
    assert!(plan.render().contains("reloads encoder, sampler; rebuilt by its loader: sampler)"), "{}", plan.render());
}

#[test]
fn a_device_model_without_a_checkpoint_that_the_host_tier_holds_writes_no_snapshot() {
    let head = "snapshot_dir = \"snapshots\"\nhost_tier = \"1M\"\n";
    let plan = plan(&with_built_model("tier-snapshot", head, "device = \"cuda:0\"\n"), Budget::given(64 * MIB), None);
    let stage = |name: &str| plan.stages.iter().find(|s| s.name == name).unwrap();
    assert_eq!((stage("both").tier, stage("both").snapshots.len()), (SAMPLER, 0), "the tier holds it instead");
    let again = stage("again");
    assert_eq!(names(&again.from_tier), ["sampler"]);
    assert!(again.from_snapshot.is_empty() && again.rebuilt.is_empty());
    assert_eq!(again.read, ENCODER);
}

#[test]
fn verdict_boundaries() {
    let budget = Budget { total: 100, available: 60, source: BudgetSource::Machine };
    assert_eq!(Verdict::of(60, Some(&budget)), Verdict::Fits);
    assert_eq!(Verdict::of(61, Some(&budget)), Verdict::FitsIfFreed { free: 1 });
    assert_eq!(Verdict::of(100, Some(&budget)), Verdict::FitsIfFreed { free: 40 });
    assert_eq!(Verdict::of(101, Some(&budget)), Verdict::DoesNotFit { by: 1 });
    assert_eq!(Verdict::of(1, None), Verdict::NotChecked);
    assert_eq!(Verdict::of(0, None), Verdict::Fits);
    assert!(Verdict::FitsIfFreed { free: 1 }.fits() && !Verdict::DoesNotFit { by: 1 }.fits());
    assert_eq!(Verdict::DoesNotFit { by: 3 << 30 }.describe(), "does not fit by 3.0 GiB");
}

#[test]
fn staging_fits_where_eager_does_not() {
    let pipeline = Pipeline::load(&fixture("fit", &stages(""))).unwrap();
    let peak = BACKBONE + ENCODER + DECODER;
    let plan = plan(&pipeline, Budget::given(peak), None);
    assert!(plan.fits);
    assert_eq!(plan.eager.verdict, Verdict::DoesNotFit { by: 512 * KIB });
    let plan = stageload_plan::plan(&pipeline, Budget::given(peak - 1), None);
    assert!(!plan.fits);
    assert_eq!(plan.stages[2].verdict, Verdict::DoesNotFit { by: 1 });
    assert!(plan.render().contains("=> does not fit"));
}

#[test]
fn device_models_are_checked_against_the_device_budget() {
    let text = stages("").replace(
        "files = [\"decoder-1.safetensors\", \"decoder-2.safetensors\"]",
        "files = [\"decoder-1.safetensors\", \"decoder-2.safetensors\"]\ndevice = \"cuda:0\"",
    );
    let pipeline = Pipeline::load(&fixture("device", &text)).unwrap();
    let unchecked = plan(&pipeline, Budget::given(64 * MIB), None);
    assert_eq!(unchecked.stages[2].device_verdict, Verdict::NotChecked);
    assert_eq!(unchecked.stages[2].weights, BACKBONE + ENCODER, "the decoder is not in host memory");
    let checked = plan(&pipeline, Budget::given(64 * MIB), Some(Budget::given(DECODER)));
    assert_eq!(checked.stages[2].device_verdict, Verdict::Fits);
    let tight = plan(&pipeline, Budget::given(64 * MIB), Some(Budget::given(DECODER - 1)));
    assert!(!tight.fits);
}

/// The encoder and decoder on cuda:0, a host tier of `tier`.
fn on_device_with_tier(name: &str, tier: &str) -> Pipeline {
    let text = format!("host_tier = \"{tier}\"\n")
        + &stages("")
            .replace("files = [\"encoder.safetensors\"]", "files = [\"encoder.safetensors\"]\ndevice = \"cuda:0\"")
            .replace(
                "files = [\"decoder-1.safetensors\", \"decoder-2.safetensors\"]",
                "files = [\"decoder-1.safetensors\", \"decoder-2.safetensors\"]\ndevice = \"cuda:0\"",
            );
    Pipeline::load(&fixture(name, &text)).unwrap()
}

#[test]
fn released_device_models_are_held_by_the_host_tier_and_come_back_from_it_without_a_read() {
    let pipeline = on_device_with_tier("tier", "2M");
    assert_eq!(pipeline.host_tier, Some(2 * MIB));
    let plan = plan(&pipeline, Budget::given(64 * MIB), None);
    let stage = |name: &str| plan.stages.iter().find(|s| s.name == name).unwrap();
    // decode releases the encoder into the tier: host memory holds it beside the backbone.
    assert_eq!((stage("decode").tier, stage("decode").need), (ENCODER, BACKBONE + ENCODER + 512 * KIB));
    // again releases the decoder and takes the encoder back from the tier: nothing read.
    let again = stage("again");
    assert_eq!((again.tier, names(&again.from_tier), again.read), (ENCODER + DECODER, vec!["encoder"], 0));
    let rendered = plan.render();
    assert!(rendered.contains("host tier: budget 2.0 MiB, largest device model encoder (1.0 MiB) fits"), "{rendered}");
    assert!(rendered.contains("back from it: encoder"), "{rendered}");
    assert!(plan.fits);
}

#[test]
fn a_host_tier_smaller_than_a_device_model_does_not_fit_and_says_what_to_raise_it_to() {
    let plan = plan(&on_device_with_tier("tier-small", "100K"), Budget::given(64 * MIB), None);
    assert!(!plan.fits);
    let rendered = plan.render();
    assert!(rendered.contains("smaller than device model encoder (1.0 MiB)"), "{rendered}");
    assert!(plan.stages.iter().all(|s| s.tier == 0), "nothing fits in it");
}

fn error_of(name: &str, pipeline: &str) -> String {
    match Pipeline::load(&fixture(name, pipeline)) {
        Ok(_) => panic!("{name}: accepted"),
        Err(error) => error.to_string(),
    }
}

#[test]
fn bad_pipeline_files_name_what_is_wrong() {
    let cases = [
        ("dup-model", format!("{MODELS}{MODELS}[[stages]]\nname = \"s\"\n"), "model 'encoder' is described twice"),
        (
            "unknown-pin-stage",
            stages("") + "\n[[pins]]\nmodels = [\"encoder\"]\nfrom = \"nowhere\"\n",
            "pin of encoder: from names unknown stage 'nowhere' (stages: setup, encode, both, decode, again)",
        ),
        (
            "until-before-from",
            stages("") + "\n[[pins]]\nmodels = [\"encoder\"]\nfrom = \"decode\"\nuntil = \"encode\"\n",
            "pin of encoder: until 'encode' does not come after from 'decode'",
        ),
        (
            "until-is-from",
            stages("") + "\n[[pins]]\nmodels = [\"encoder\"]\nfrom = \"both\"\nuntil = \"both\"\n",
            "until 'both' does not come after from 'both'",
        ),
        ("bad-reserve", "reserve = \"lots\"\n".to_string() + &stages(""), "reserve: not a size"),
        ("bad-reserve-percent", "reserve = \"-5%\"\n".to_string() + &stages(""), "not a percent from 0% to 1000%"),
        (
            "bad-ignore",
            stages("").replace("name = \"encoder\"", "name = \"encoder\"\nignore = [\"[\"]"),
            "model 'encoder': ignore",
        ),
        (
            "unknown-model",
            stages("") + "\n[[stages]]\nname = \"x\"\nmodels = [\"vae\"]\n",
            "stage 'x' names unknown model 'vae'",
        ),
        (
            "no-files",
            stages("\n[[models]]\nname = \"empty\"\nfiles = []\n"),
            "model 'empty' has no files: give its safetensors checkpoint(s), or, for a model its loader builds, its size (weights = \"300M\")",
        ),
        (
            "files-and-weights",
            stages("").replace("name = \"encoder\"", "name = \"encoder\"\nweights = \"1M\""),
            "model 'encoder': files and weights together",
        ),
        ("bad-weights", stages("\n[[models]]\nname = \"built\"\nweights = \"heavy\"\n"), "model 'built': weights: not a size"),
        (
            "bad-keep-free",
            "snapshot_dir = \"s\"\nsnapshot_keep_free = \"most\"\n".to_string() + &stages(""),
            "snapshot_keep_free: not a size",
        ),
        (
            "keep-free-without-dir",
            "snapshot_keep_free = \"1G\"\n".to_string() + &stages(""),
            "snapshot_keep_free is set but snapshot_dir is not",
        ),
        (
            "stream-without-files",
            stages("\n[[models]]\nname = \"built\"\nweights = \"1M\"\nstream = { blocks = [\"b.*\"], budget = \"1M\" }\n"),
            "model 'built': stream needs files",
        ),
        (
            "bad-dtype",
            stages("").replace("name = \"encoder\"", "name = \"encoder\"\ndtype = \"f12\""),
            "unknown dtype 'f12'",
        ),
        (
            "int-dtype",
            stages("").replace("name = \"encoder\"", "name = \"encoder\"\ndtype = \"int8\""),
            "unknown dtype 'int8': float entries load as f16, bf16, f32 or f64",
        ),
        (
            "mps-f64",
            stages("").replace("name = \"encoder\"", "name = \"encoder\"\ndevice = \"mps\"\ndtype = \"F64\""),
            "model 'encoder': dtype 'F64': mps cannot hold float64; choose f32",
        ),
        (
            "bad-device",
            stages("").replace("name = \"encoder\"", "name = \"encoder\"\ndevice = \"tpu\""),
            "unknown device 'tpu'",
        ),
        (
            "bad-pin",
            stages("").replace("pinned = [\"backbone\"]", "pinned = [\"vae\"]"),
            "pinned names unknown model 'vae'",
        ),
        (
            "bad-working",
            stages("").replace("working = \"64K\"", "working = \"lots\""),
            "stage 'encode': working: not a size",
        ),
        ("no-stages", MODELS.to_string(), "no stages"),
        (
            "model-twice",
            stages("") + "\n[[stages]]\nname = \"x\"\nmodels = [\"encoder\", \"encoder\"]\n",
            "stage 'x' lists model 'encoder' twice",
        ),
        ("syntax", "[[models]\nname=".to_string(), "is not valid"),
        (
            "unknown-field",
            stages("").replace("name = \"encoder\"", "name = \"encoder\"\nfile = \"x\""),
            "unknown field `file`",
        ),
    ];
    for (name, text, expected) in cases {
        let error = error_of(name, &text);
        assert!(error.contains(expected) && error.contains("pipeline.toml"), "{name}: {error}");
    }
    let missing = Pipeline::load(Path::new("/no/such/pipeline.toml")).unwrap_err();
    assert!(matches!(missing, PipelineError::Read { .. }) && missing.to_string().contains("/no/such/pipeline.toml"));
}

#[test]
fn a_pipeline_path_that_is_not_a_regular_file_is_refused_by_kind_without_blocking() {
    let folder = scratch("kinds");
    let fifo = folder.path().join("pipeline.toml");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
    let cases = [
        (fifo.as_path(), "is a named pipe (FIFO), not a regular file"),
        (Path::new("/dev/zero"), "is a character device, not a regular file"),
        (folder.path(), "is a directory, not a regular file"),
    ];
    for (path, expected) in cases {
        let error = Pipeline::load(path).unwrap_err().to_string();
        assert!(error.contains(expected) && error.contains(&path.display().to_string()), "{error}");
    }
    let big = folder.path().join("big.toml");
    std::fs::File::create(&big).unwrap().set_len(1 << 30).unwrap();
    let error = Pipeline::load(&big).unwrap_err().to_string();
    assert!(error.contains("more than the 16777216 B this file may have"), "{error}");
}

#[test]
fn an_absurd_working_size_saturates_and_does_not_fit_instead_of_wrapping() {
    // Each alone below u64::MAX; with the weights they would wrap round to a few KiB.
    let text = stages("").replace("working = \"64K\"", "working = \"18446744073709000000\"");
    let pipeline = Pipeline::load(&fixture("absurd", &text)).unwrap();
    let plan = plan(&pipeline, Budget::given(64 * MIB), Some(Budget::given(64 * MIB)));
    let encode = plan.stages.iter().find(|s| s.name == "encode").unwrap();
    assert_eq!(encode.need, u64::MAX);
    assert!(!plan.fits && !encode.verdict.fits(), "{:?}", encode.verdict);
}

#[test]
fn bad_checkpoints_name_the_model_and_the_file() {
    let folder = scratch("bad-checkpoints");
    let dir = folder.path();
    let pipeline_for = |file: &str| {
        format!("[[models]]\nname = \"m\"\nfiles = [\"{file}\"]\n[[stages]]\nname = \"s\"\nmodels = [\"m\"]\n")
    };
    let write = |name: &str, bytes: &[u8]| std::fs::write(dir.join(name), bytes).unwrap();
    let header = |json: &str| [&(json.len() as u64).to_le_bytes()[..], json.as_bytes()].concat();
    write("huge-header.safetensors", &[&(1u64 << 40).to_le_bytes()[..], b"{}"].concat());
    write("not-json.safetensors", &header("{not json"));
    write(
        "bad-dtype.safetensors",
        &[header(r#"{"w":{"dtype":"Q7","shape":[2],"data_offsets":[0,2]}}"#), vec![0, 0]].concat(),
    );
    write(
        "truncated.safetensors",
        &[header(r#"{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#), vec![0; 8]].concat(),
    );
    write("tiny.safetensors", b"abc");
    write("long-header.safetensors", &[&(5000u64).to_le_bytes()[..], b"{}"].concat());
    // A sparse file that holds its 4 GiB header length: refused by the cap, never allocated.
    let sparse = std::fs::File::create(dir.join("sparse.safetensors")).unwrap();
    std::io::Write::write_all(&mut &sparse, &(4u64 << 30).to_le_bytes()).unwrap();
    sparse.set_len(5 << 30).unwrap();
    std::fs::create_dir(dir.join("folder.safetensors")).unwrap();
    nix::unistd::mkfifo(&dir.join("fifo.safetensors"), nix::sys::stat::Mode::S_IRWXU).unwrap();
    let cases = [
        ("missing.safetensors", "No such file"),
        ("huge-header.safetensors", "over safetensors' limit of 100000000 B"),
        ("sparse.safetensors", "over safetensors' limit of 100000000 B"),
        ("long-header.safetensors", "header length 5000 B is larger than the file (10 B)"),
        ("folder.safetensors", "is a directory, not a regular file"),
        ("fifo.safetensors", "is a named pipe (FIFO), not a regular file"),
        ("/dev/urandom", "is a character device, not a regular file"),
        ("not-json.safetensors", "not a valid safetensors header"),
        ("bad-dtype.safetensors", "Q7"),
        ("truncated.safetensors", "truncated"),
        ("tiny.safetensors", "too short"),
    ];
    for (file, expected) in cases {
        let path = dir.join(format!("{file}.toml"));
        std::fs::write(&path, pipeline_for(file)).unwrap();
        let error = Pipeline::load(&path).unwrap_err().to_string();
        assert!(error.contains("model 'm'") && error.contains(file) && error.contains(expected), "{file}: {error}");
    }
}

#[test]
fn the_json_schema_is_stable() {
    let pipeline = Pipeline::load(&fixture("json", &stages(""))).unwrap();
    let json = serde_json::to_value(plan(&pipeline, Budget::given(64 * MIB), None)).unwrap();
    let keys = |value: &serde_json::Value| {
        let mut keys: Vec<String> = value.as_object().unwrap().keys().cloned().collect();
        keys.sort();
        keys
    };
    assert_eq!(json["schema"], 1);
    assert_eq!(
        keys(&json),
        [
            "budget",
            "device_budget",
            "device_peak_need",
            "eager",
            "fits",
            "models",
            "peak_need",
            "peak_stage",
            "pipeline",
            "read",
            "schema",
            "stages"
        ]
    );
    assert_eq!(
        keys(&json["stages"][0]),
        [
            "device_need",
            "device_need_before_reserve",
            "device_verdict",
            "device_weights",
            "loaded",
            "name",
            "need",
            "need_before_reserve",
            "read",
            "released",
            "reloaded",
            "resident",
            "verdict",
            "weights"
        ]
    );
    assert_eq!(
        keys(&json["eager"]),
        [
            "device_need",
            "device_need_before_reserve",
            "device_verdict",
            "device_weights",
            "need",
            "need_before_reserve",
            "peak_stage",
            "read",
            "stages",
            "verdict",
            "weights"
        ]
    );
    assert_eq!(
        keys(&json["models"][0]),
        ["bytes", "device", "dtype", "file_bytes", "files", "ignore", "name", "parts", "placement", "tensors"]
    );
    assert_eq!(keys(&json["models"][0]["parts"][0]), ["bytes", "file", "file_bytes", "float_bytes", "float_elements"]);
    assert_eq!(json["stages"][1]["verdict"], serde_json::json!({"kind": "fits"}));
    assert_eq!(json["budget"], serde_json::json!({"total": 64 * MIB, "available": 64 * MIB, "source": "flag"}));
}

#[test]
fn a_file_shared_by_resident_models_is_held_and_read_once() {
    // Two extractors list the same backbone file, each with a head of its own (the encoder's
    // file stands in for a head, the decoder's first file for the other).
    let text = "[[models]]\nname = \"a\"\nfiles = [\"backbone.safetensors\", \"encoder.safetensors\"]\n\n\
                [[models]]\nname = \"b\"\nfiles = [\"backbone.safetensors\", \"decoder-2.safetensors\"]\n\n\
                [[stages]]\nname = \"first\"\nmodels = [\"a\"]\n\n\
                [[stages]]\nname = \"both\"\nmodels = [\"a\", \"b\"]\n\n\
                [[stages]]\nname = \"second\"\nmodels = [\"b\"]\n";
    let pipeline = Pipeline::load(&fixture("shared-file", text)).unwrap();
    let plan = plan(&pipeline, Budget::given(64 * MIB), None);
    let head_b = 100 * 8;
    let rows: Vec<(u64, u64)> = plan.stages.iter().map(|s| (s.weights, s.read)).collect();
    assert_eq!(
        rows,
        [(BACKBONE + ENCODER, BACKBONE + ENCODER), (BACKBONE + ENCODER + head_b, head_b), (BACKBONE + head_b, 0)],
        "the backbone is held once and not read again while a model holding it stays"
    );
    assert_eq!(plan.eager.weights, BACKBONE + ENCODER + head_b);
    assert_eq!(plan.eager.read, BACKBONE + ENCODER + head_b);
}

mod fuzz {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

        /// A valid pipeline file with bytes replaced: an answer, never a panic; a plan of what
        /// loads needs at least its weights.
        #[test]
        fn damaged_pipeline_files_get_an_answer(edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..6)) {
            let mut text = stages("").into_bytes();
            for (at, byte) in edits {
                let at = at % text.len();
                text[at] = byte;
            }
            let fixture = fixture("fuzz", &String::from_utf8_lossy(&text));
            if let Ok(pipeline) = Pipeline::load(&fixture) {
                let plan = plan(&pipeline, Budget::given(64 * MIB), None);
                prop_assert!(plan.stages.iter().all(|s| s.need >= s.weights));
            }
        }

        /// Any sizes in `working`: saturating sums, never a wrap to "fits".
        #[test]
        fn any_working_sizes_plan_without_wrapping(working in proptest::collection::vec(any::<u64>(), 5)) {
            let mut text = stages("");
            text = text.replace("working = \"64K\"", &format!("working = \"{}\"", working[0]));
            text = text.replace("working = \"512K\"", &format!("working = \"{}\"", working[1]));
            if let Ok(pipeline) = Pipeline::load(&fixture("fuzz-working", &text)) {
                let plan = plan(&pipeline, Budget::given(64 * MIB), None);
                for stage in &plan.stages {
                    prop_assert!(stage.need >= stage.weights);
                    prop_assert_eq!(stage.verdict.fits(), stage.need <= 64 * MIB);
                }
            }
        }

        /// The room a reserve leaves is the largest need that fits with the reserve on it.
        #[test]
        fn the_room_a_reserve_leaves_is_the_most_that_fits(memory in any::<u64>(), percent in 0.0f64..=1000.0, bytes in any::<u64>()) {
            for reserve in [stageload_plan::Reserve::Percent(percent), stageload_plan::Reserve::Bytes(bytes)] {
                let room = reserve.room(memory);
                prop_assert!(room == 0 || reserve.on(room) <= memory, "{reserve:?} {memory}: {room}");
                let over = |need: u64| reserve.on(need) > memory || reserve.on(need) == u64::MAX;
                prop_assert!(room == memory || over(room + 1), "{reserve:?} {memory}: {room} is not the most");
            }
        }

        /// Near u64::MAX, where the reserve's sum saturates: an answer at once.
        #[test]
        fn the_room_of_a_huge_memory_is_found_at_once(memory in (u64::MAX - 1_000_000)..=u64::MAX, percent in 0.0f64..=1000.0) {
            let reserve = stageload_plan::Reserve::Percent(percent);
            prop_assert!(reserve.room(memory) <= memory);
        }
    }
}

/// A 4 MiB model of four 1 MiB blocks and a 64 KiB input layer, streamed under `budget`.
fn streamed_fixture(name: &str, stream: &str) -> Fixture {
    let folder = scratch(name);
    let dir = folder.path();
    let mut tensors: Vec<(String, Dtype, &[usize])> = vec![("model.input.w".into(), Dtype::F32, &[128, 128])];
    for i in 0..4 {
        tensors.push((format!("model.blocks.{i}.w"), Dtype::F32, &[512, 512]));
    }
    let named: Vec<(&str, Dtype, &[usize])> = tensors.iter().map(|(n, d, s)| (n.as_str(), *d, *s)).collect();
    checkpoint(&dir.join("flow.safetensors"), &named);
    let path = dir.join("pipeline.toml");
    std::fs::write(
        &path,
        format!(
            "[[models]]\nname = \"flow\"\nfiles = [\"flow.safetensors\"]\nstream = {stream}\n\n[[stages]]\nname = \"denoise\"\nmodels = [\"flow\"]\n"
        ),
    )
    .unwrap();
    Fixture { _folder: folder, path }
}

#[test]
fn a_streamed_model_counts_its_resident_blocks_and_slots_and_fits_where_whole_it_would_not() {
    const MIB: u64 = 1 << 20;
    let fixture =
        streamed_fixture("streamed", r#"{ blocks = ["model.blocks.*"], resident = ["model.input"], budget = "3MiB" }"#);
    let pipeline = Pipeline::load(&fixture).unwrap();
    let model = &pipeline.models[0];
    assert_eq!(model.bytes, 4 * MIB + 64 * 1024);
    let streamed = model.streamed.as_ref().unwrap();
    // 64 KiB fixed + 0 resident + two slots of a block = 2.08 MiB; one resident block more is 3.09.
    assert_eq!((streamed.blocks, streamed.resident_blocks, streamed.look_ahead), (4, 0, true));
    assert_eq!(streamed.held, 2 * BLOCK + 64 * 1024);
    assert_eq!(streamed.per_step, 4 * BLOCK);
    let planned = plan(&pipeline, Budget::given(3 * MIB), None);
    assert_eq!(planned.stages[0].weights, 2 * BLOCK + 64 * 1024);
    assert!(planned.fits, "{}", planned.render());
    let text = planned.render();
    assert!(text.contains("flow streamed: 0 of 4 blocks resident, 0 kept hot, 4.0 MiB per step"), "{text}");
}

#[test]
fn a_model_streamed_in_any_order_keeps_in_its_hot_set_what_a_prefix_would_hold() {
    const MIB: u64 = 1 << 20;
    let streamed = |name: &str, stream: &str| {
        let pipeline = Pipeline::load(&streamed_fixture(name, stream)).unwrap();
        let text = plan(&pipeline, Budget::given(8 * MIB), None).render();
        (pipeline.models[0].streamed.clone().unwrap(), text)
    };
    let (prefix, _) =
        streamed("prefix", r#"{ blocks = ["model.blocks.*"], resident = ["model.input"], budget = "4MiB" }"#);
    let (any, text) = streamed(
        "any-order",
        r#"{ blocks = ["model.blocks.*"], resident = ["model.input"], budget = "4MiB", any_order = true }"#,
    );
    assert_eq!((prefix.resident_blocks, prefix.hot_blocks), (1, 0));
    assert_eq!((any.resident_blocks, any.hot_blocks, any.any_order), (0, 1, true));
    // 64 KiB fixed + two slots + one block, resident or hot; three read per step.
    assert_eq!((any.held, any.per_step), (prefix.held, prefix.per_step));
    assert_eq!((any.held, any.per_step), (3 * BLOCK + 64 * 1024, 3 * BLOCK));
    assert!(
        text.contains("flow streamed in any order: 0 of 4 blocks resident, 1 kept hot, 3.0 MiB per step"),
        "{text}"
    );
}

#[test]
fn a_bad_stream_entry_is_refused_naming_the_model_and_the_sizes() {
    let error = |stream: &str| match Pipeline::load(&streamed_fixture("bad-stream", stream)) {
        Err(PipelineError::Invalid { message, .. }) => message,
        other => panic!("{stream}: {other:?}"),
    };
    let small = error(r#"{ blocks = ["model.blocks.*"], resident = ["model.input"], budget = "512KiB" }"#);
    assert!(small.contains("model 'flow'") && small.contains("512.0 KiB") && small.contains("1.1 MiB"), "{small}");
    let missing = error(r#"{ blocks = ["model.blocks.*"], budget = "3MiB" }"#);
    assert!(missing.contains("'model.input.w'") && missing.contains("no block"), "{missing}");
    let twice =
        error(r#"{ blocks = ["model.blocks.*", "model.blocks.1"], resident = ["model.input"], budget = "3MiB" }"#);
    assert!(twice.contains("'model.blocks.1.w'"), "{twice}");
    let size = error(r#"{ blocks = ["model.blocks.*"], resident = ["model.input"], budget = "lots" }"#);
    assert!(size.contains("budget"), "{size}");
    let fixture = streamed_fixture(
        "stream-dtype",
        r#"{ blocks = ["model.blocks.*"], resident = ["model.input"], budget = "3MiB" }"#,
    );
    let text = std::fs::read_to_string(&fixture.path).unwrap();
    std::fs::write(&fixture.path, text.replace("stream = ", "dtype = \"bf16\"\nstream = ")).unwrap();
    match Pipeline::load(&fixture) {
        Err(PipelineError::Invalid { message, .. }) => {
            assert!(message.contains("model 'flow': dtype and stream together"), "{message}")
        }
        other => panic!("dtype with stream: {other:?}"),
    }
}

#[test]
fn a_streamed_device_model_is_not_held_by_the_host_tier_nor_sized_against_it() {
    let fixture = streamed_fixture(
        "streamed-tier",
        r#"{ blocks = ["model.blocks.*"], resident = ["model.input"], budget = "3MiB" }"#,
    );
    let text = std::fs::read_to_string(&fixture.path).unwrap();
    let text = format!("host_tier = \"1M\"\n{text}")
        .replace("files = [\"flow.safetensors\"]", "files = [\"flow.safetensors\"]\ndevice = \"cuda:0\"")
        + "\n[[stages]]\nname = \"decode\"\nmodels = []\n\n[[stages]]\nname = \"again\"\nmodels = [\"flow\"]\n";
    std::fs::write(&fixture.path, text).unwrap();
    let pipeline = Pipeline::load(&fixture).unwrap();
    let planned = plan(&pipeline, Budget::given(64 * MIB), None);
    // Whole it is 4.06 MiB and streamed it holds 2.08, both over the 1 MiB tier: no matter.
    assert_eq!(planned.host_tier.as_ref().unwrap().largest, None);
    // On the device it holds its fixed tensors and two slots; host memory holds every block's
    // pinned copy (needed beside the host weights, as the tier's copies are).
    let denoise = &planned.stages[0];
    assert_eq!((denoise.device_weights, denoise.weights), (2 * BLOCK + 64 * 1024, 0), "{}", planned.render());
    assert_eq!(denoise.need, 4 * MIB, "{}", planned.render());
    assert!(planned.render().contains("its blocks' pinned copies hold 4.0 MiB of host memory"), "{}", planned.render());
    assert!(planned.stages.iter().all(|s| s.tier == 0 && s.from_tier.is_empty()), "{}", planned.render());
    assert!(planned.fits, "{}", planned.render());
}

/// [`streamed_fixture`]'s flow without a budget (its step's working memory 256 KiB) and a 1 MiB
/// encoder, in three stages: `prompt` (encoder, 1 MiB working), `denoise` (both, 512 KiB),
/// `decode` (flow, 2 MiB); `head` goes first in the file.
fn leftover_fixture(name: &str, head: &str) -> Fixture {
    let fixture =
        streamed_fixture(name, r#"{ blocks = ["model.blocks.*"], resident = ["model.input"], working = "256K" }"#);
    let dir = fixture.path.parent().unwrap().to_path_buf();
    checkpoint(&dir.join("encoder.safetensors"), &[("w", Dtype::F32, &[512, 512])]);
    let text = std::fs::read_to_string(&fixture.path).unwrap();
    let models = text.split("[[stages]]").next().unwrap().to_string();
    std::fs::write(
        &fixture.path,
        format!(
            "{head}\n{models}[[models]]\nname = \"encoder\"\nfiles = [\"encoder.safetensors\"]\n\n\
             [[stages]]\nname = \"prompt\"\nmodels = [\"encoder\"]\nworking = \"1M\"\n\n\
             [[stages]]\nname = \"denoise\"\nmodels = [\"flow\", \"encoder\"]\nworking = \"512K\"\n\n\
             [[stages]]\nname = \"decode\"\nmodels = [\"flow\"]\nworking = \"2M\"\n"
        ),
    )
    .unwrap();
    fixture
}

#[test]
fn a_streamed_model_without_a_budget_takes_what_its_tightest_stage_leaves() {
    let pipeline = Pipeline::load(&leftover_fixture("leftover", "memory = \"6M\"")).unwrap();
    let streamed = pipeline.models[0].streamed.clone().unwrap();
    // denoise leaves 6 - 1 (encoder) - 0.5 = 4.5 MiB, decode 6 - 2 = 4 MiB: decode's, plus the
    // step's own 256 KiB kept free inside the budget.
    assert_eq!(streamed.budget, 4 * MIB + 256 * KIB);
    assert_eq!(streamed.budget_from.as_deref(), Some("what stage 'decode' leaves of memory 6.0 MiB"));
    // 64 KiB fixed + 1 resident block + two slots = 3.09 MiB; two resident would be 4.09 (4.34
    // with the step's 256 KiB).
    assert_eq!((streamed.resident_blocks, streamed.held), (1, 3 * BLOCK + 64 * KIB));
    let planned = plan(&pipeline, Budget::given(6 * MIB), None);
    assert!(planned.fits, "every stage fits the memory the budget came from: {}", planned.render());
    assert!(
        planned.render().contains("(budget 4.2 MiB: what stage 'decode' leaves of memory 6.0 MiB)"),
        "{}",
        planned.render()
    );

    // A reserve of 50% leaves 4 MiB of the 6 to plan in: decode leaves 2 MiB, room for one slot.
    let reserved = Pipeline::load(&leftover_fixture("leftover-reserve", "memory = \"6M\"\nreserve = \"50%\"")).unwrap();
    let streamed = reserved.models[0].streamed.clone().unwrap();
    assert_eq!(streamed.budget, 2 * MIB + 256 * KIB);
    assert_eq!((streamed.resident_blocks, streamed.look_ahead, streamed.held), (0, false, BLOCK + 64 * KIB));
    let planned = plan(&reserved, Budget::given(6 * MIB), None);
    assert!(planned.fits, "{}", planned.render());
}

#[test]
fn a_budget_no_stage_can_leave_is_refused_naming_the_stage_and_the_sizes() {
    let error = |name: &str, head: &str| match Pipeline::load(&leftover_fixture(name, head)) {
        Err(PipelineError::Invalid { message, .. }) => message,
        other => panic!("{head}: {other:?}"),
    };
    let none = error("leftover-none", "");
    assert!(none.contains("model 'flow': stream: no budget: give it one") && none.contains("memory = "), "{none}");
    let lots = error("leftover-lots", "memory = \"lots\"");
    assert!(lots.starts_with("memory: "), "{lots}");
    let nothing = error("leftover-nothing", "memory = \"1M\"");
    assert!(
        nothing.contains("stage 'denoise' leaves it nothing of 1.0 MiB: 1.0 MiB resident beside it and 512.0 KiB"),
        "{nothing}"
    );
    // Pinned, the encoder is beside the flow in decode too: 3 - 1 - 2 = nothing there.
    let pinned = error("leftover-pinned", "memory = \"3M\"\npinned = [\"encoder\"]");
    assert!(pinned.contains("stage 'decode' leaves it nothing"), "{pinned}");
    // On a device the flow takes from device_memory, which this file does not give.
    let fixture = leftover_fixture("leftover-device", "memory = \"6M\"");
    let text = std::fs::read_to_string(&fixture.path).unwrap();
    std::fs::write(
        &fixture.path,
        text.replacen("files = [\"flow.safetensors\"]", "files = [\"flow.safetensors\"]\ndevice = \"cuda\"", 1),
    )
    .unwrap();
    match Pipeline::load(&fixture) {
        Err(PipelineError::Invalid { message, .. }) => assert!(message.contains("device_memory = "), "{message}"),
        other => panic!("{other:?}"),
    }
    std::fs::write(
        &fixture.path,
        format!("device_memory = \"5M\"\n{}", std::fs::read_to_string(&fixture.path).unwrap()),
    )
    .unwrap();
    let pipeline = Pipeline::load(&fixture).unwrap();
    // The encoder is on the host: on the device, denoise and decode leave 5 MiB (no device working).
    assert_eq!(pipeline.models[0].streamed.as_ref().unwrap().budget, 5 * MIB + 256 * KIB);
    assert_eq!(pipeline.device_memory, Some(5 * MIB));
}

#[test]
fn two_streamed_models_without_budgets_in_one_stage_are_refused() {
    let fixture = leftover_fixture("leftover-two", "memory = \"64M\"");
    let text = std::fs::read_to_string(&fixture.path).unwrap();
    let text = text.replacen(
        "files = [\"encoder.safetensors\"]",
        "files = [\"encoder.safetensors\"]\nstream = { blocks = [\"w\"] }",
        1,
    );
    std::fs::write(&fixture.path, text).unwrap();
    match Pipeline::load(&fixture) {
        Err(PipelineError::Invalid { message, .. }) => assert!(
            message.contains("'flow' and 'encoder' both take what stage 'denoise' leaves: give one of them a budget"),
            "{message}"
        ),
        other => panic!("{other:?}"),
    }
}

/// A run of `stages` (name, its place in the sequence, weights resident, RSS peak in MiB) as a
/// trace's records: each stage event, then a sample of its peak.
fn run_of(stages: &[(&str, usize, u64, u64)]) -> stageload_trace::Trace {
    use stageload_trace::event::Entered;
    use stageload_trace::record::{EventRecord, Record, Sample};
    let records = stages
        .iter()
        .enumerate()
        .flat_map(|(i, (name, position, weights, peak))| {
            let t = 1.0 + i as f64;
            [
                Record::Event(EventRecord::at_t(
                    t,
                    Entered { stage: name.to_string(), position: Some(*position), resident: Some(weights * MIB) },
                )),
                Record::Sample(Sample { t: t + 0.5, rss: Some(peak * MIB), ..Sample::default() }),
            ]
        })
        .collect();
    stageload_trace::Trace::new("run.jsonl", records)
}

#[test]
fn a_run_is_matched_to_the_stage_occurrences_its_stage_events_name() {
    use stageload_plan::measured::Measured;
    let parse = |stages: &str| {
        Pipeline::parse(&format!("[[models]]\nname = \"x\"\nweights = \"1M\"\n{stages}"), Path::new("p.toml")).unwrap()
    };
    let working =
        |measured: Measured| -> Vec<Option<u64>> { measured.working.iter().map(|w| w.map(|w| w.host / MIB)).collect() };
    // `[a, a]`: two windows in a row, one per occurrence.
    let pipeline = parse("[[stages]]\nname = \"a\"\nmodels = [\"x\"]\n[[stages]]\nname = \"a\"\nmodels = [\"x\"]\n");
    let run = run_of(&[("a", 0, 1, 11), ("a", 1, 1, 21)]);
    assert_eq!(working(Measured::from_trace(&pipeline, &run).unwrap()), [Some(10), Some(20)]);
    // `[a, b, a]` run as `a, a`: the registry entered the first and the third occurrence; `b`
    // was not run.
    let pipeline = parse(
        "[[stages]]\nname = \"a\"\nmodels = [\"x\"]\n[[stages]]\nname = \"b\"\nmodels = []\n\
         [[stages]]\nname = \"a\"\nmodels = [\"x\"]\n",
    );
    let run = run_of(&[("a", 0, 1, 11), ("a", 2, 1, 31)]);
    assert_eq!(working(Measured::from_trace(&pipeline, &run).unwrap()), [Some(10), None, Some(30)]);
    let run = run_of(&[("a", 0, 1, 11), ("b", 1, 1, 6), ("a", 2, 1, 31)]);
    assert_eq!(working(Measured::from_trace(&pipeline, &run).unwrap()), [Some(10), Some(5), Some(30)]);
}
