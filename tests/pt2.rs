//! AOTInductor packages in the registry (`ModelSpec::pt2`), on packages the real
//! `torch.export` + `aoti_compile_and_package` wrote (`tests/fixtures/pt2_modules.py` through the
//! export helper `scripts/reference/pt2.py`, compiled once per machine by
//! `scripts/setup-reference.sh`): an MLP, a conv net with a BatchNorm, a transformer encoder
//! layer and a module with a non-persistent buffer give the outputs Python's own loader gives
//! for the same package, bit for bit; they are released and come back in place with the same
//! outputs; staged equals eager with random draws between stages; and every bad package or
//! checkpoint is a typed error naming the model and the file, with the registry still usable.
//! Packages exported the ordinary way (`plain*`: no helper, the checkpoint `ep.state_dict` and
//! `ep.constants` as they are) run the same, and are checked as strictly: a transposed weight of
//! the right size, weights inside the library, another machine, an ISA this CPU lacks.
//! RSS figures are `tests/pt2_rss.rs`'s (a binary of its own).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use stageload::pt2::{Pt2Error, Pt2Module};
use stageload::{EventKind, ListSink, ModelSpec, ModelState, ReloadFrom, StageError, StagedModels};
use stageload_test_support::torch as support;
use tch::{Device, Kind, Tensor};

/// The folder of compiled packages `scripts/setup-reference.sh` made.
fn fixtures() -> PathBuf {
    PathBuf::from(std::env::var("STAGELOAD_PT2_FIXTURES").unwrap_or_else(|_| {
        panic!(
            "STAGELOAD_PT2_FIXTURES is not set: these tests load AOTInductor packages compiled by the cached torch. \
             Run them through cargo xtask test, or first: eval \"$(scripts/setup-libtorch.sh)\"; eval \"$(scripts/setup-reference.sh)\""
        )
    }))
}

fn path(name: &str) -> PathBuf {
    fixtures().join(name)
}

/// The package and checkpoint of fixture `name` as model `name`.
fn spec(name: &str) -> ModelSpec {
    ModelSpec::pt2(name, path(&format!("{name}.pt2")), [path(&format!("{name}.safetensors"))])
}

/// The inputs of fixture `name`, the eager module's output and Python's loader's on them.
fn io(name: &str) -> (Vec<Tensor>, Tensor, Tensor) {
    let io: HashMap<String, Tensor> =
        Tensor::read_safetensors(path(&format!("{name}.io.safetensors"))).unwrap().into_iter().collect();
    let inputs = (0..).map_while(|i| io.get(&format!("x{i}")).map(Tensor::shallow_clone)).collect();
    (inputs, io["eager0"].shallow_clone(), io["y0"].shallow_clone())
}

fn forward(models: &StagedModels, name: &str, inputs: &[Tensor]) -> Result<Tensor, StageError> {
    let inputs: Vec<&Tensor> = inputs.iter().collect();
    models.call(name, |m: &mut Pt2Module| m.forward(&inputs).map(|mut out| out.remove(0))).map(|y| y.unwrap())
}

const MODULES: [&str; 4] = ["mlp", "conv", "block", "buffered"];

#[test]
fn each_exported_module_runs_as_pythons_loader_runs_the_same_package_and_comes_back_in_place() {
    let _one = support::generator();
    for name in MODULES {
        let sink = Arc::new(ListSink::new());
        let models = StagedModels::builder()
            .model(spec(name))
            .stage("run", [name])
            .stage("other", Vec::<String>::new())
            .events(sink.clone())
            .build()
            .unwrap();
        let (x, eager, python) = io(name);
        models.enter("run").unwrap();
        let y = forward(&models, name, &x).unwrap();
        assert!(y.equal(&python), "{name}: Python's aoti_load_package gave the same package other numbers");
        let off = (&y - &eager).abs().max().double_value(&[]);
        assert!(off < 1e-5, "{name}: {off} off the eager module (compiled kernels, another summation order)");
        let report = models.load_report(name).unwrap().unwrap();
        assert!(report.missing.is_empty() && report.unused.is_empty(), "{name}: every constant filled: {report:?}");

        let stats = models.enter("other").unwrap();
        assert_eq!(models.state(name).unwrap(), ModelState::Released);
        let load = &sink.of_kind(EventKind::Load)[0];
        assert_eq!((load.bytes(), stats.kept), (Some(stats.freed), 0), "{name}: every constant freed");
        models.enter("run").unwrap();
        assert!(forward(&models, name, &x).unwrap().equal(&python), "{name}: the same output after the reload");
        let reload = &sink.of_kind(EventKind::Reload)[0];
        assert_eq!((reload.reload_from(), reload.bytes()), (Some(ReloadFrom::InPlace), Some(stats.freed)), "{name}");
    }
}

#[test]
fn staged_gives_what_eager_gives_with_random_draws_between_the_stages() {
    let _one = support::generator();
    let run = |staged: bool| -> Vec<Tensor> {
        let mut builder = StagedModels::builder().model(spec("mlp")).model(spec("wide"));
        builder = if staged {
            builder.stage("first", ["mlp"]).stage("second", ["wide"])
        } else {
            builder.stage("first", ["mlp", "wide"]).stage("second", ["mlp", "wide"])
        };
        let models = builder.build().unwrap();
        tch::manual_seed(5);
        let mut outputs = Vec::new();
        for _ in 0..2 {
            models.enter("first").unwrap();
            let x = Tensor::randn([4, 64], (Kind::Float, Device::Cpu));
            outputs.push(forward(&models, "mlp", &[x]).unwrap());
            models.enter("second").unwrap();
            let x = Tensor::randn([4, 2048], (Kind::Float, Device::Cpu));
            outputs.push(forward(&models, "wide", &[x]).unwrap());
        }
        outputs
    };
    let (eager, staged) = (run(false), run(true));
    for (i, (e, s)) in eager.iter().zip(&staged).enumerate() {
        assert!(e.equal(s), "output {i}: staged differs from eager");
    }
}

/// A registry of `bad` next to the good `mlp`, both in one stage: the error of `bad`'s first
/// call, after which `mlp` still loads and runs.
fn first_call_error(bad: ModelSpec) -> StageError {
    let models = StagedModels::builder().model(bad).model(spec("mlp")).stage("run", ["bad", "mlp"]).build().unwrap();
    models.enter("run").unwrap();
    let (x, _, python) = io("mlp");
    let err = forward(&models, "bad", &x).unwrap_err();
    assert_eq!(models.state("bad").unwrap(), ModelState::Failed);
    assert!(forward(&models, "mlp", &x).unwrap().equal(&python), "the registry stays usable");
    err
}

fn pt2_error(err: &StageError) -> &Pt2Error {
    match err {
        StageError::LoaderFailed { model, source } => {
            assert_eq!(model, "bad", "{err}");
            source.downcast_ref::<Pt2Error>().unwrap_or_else(|| panic!("not a Pt2Error: {err}"))
        }
        other => panic!("not a loader failure: {other}"),
    }
}

/// `mlp.safetensors` with `change` applied to its entries, in `dir`.
fn changed_checkpoint(dir: &Path, change: impl FnOnce(&mut Vec<(String, Tensor)>)) -> PathBuf {
    let mut entries = Tensor::read_safetensors(path("mlp.safetensors")).unwrap();
    change(&mut entries);
    let file = dir.join("changed.safetensors");
    stageload::checkpoint::save(&entries, &file).unwrap();
    file
}

#[test]
fn a_bad_package_or_checkpoint_is_a_typed_error_naming_the_model_and_the_file() {
    let _one = support::generator();
    let dir = tempfile::TempDir::new().unwrap();
    let package = path("mlp.pt2");
    let checkpoint = || [path("mlp.safetensors")];

    let bytes = std::fs::read(&package).unwrap();
    let truncated = dir.path().join("truncated.pt2");
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    let err = first_call_error(ModelSpec::pt2("bad", &truncated, checkpoint()));
    assert!(matches!(pt2_error(&err), Pt2Error::NotAPackage { path, .. } if *path == truncated), "{err}");
    assert!(err.to_string().contains("'bad'") && err.to_string().contains("truncated.pt2"), "{err}");

    let script = dir.path().join("module.pt");
    let sd = std::env::var("STAGELOAD_SD_SMALL").expect("STAGELOAD_SD_SMALL (scripts/setup-reference.sh)");
    std::fs::copy(Path::new(&sd).join("vae_decoder.pt"), &script).unwrap();
    let err = first_call_error(ModelSpec::pt2("bad", &script, checkpoint()));
    assert!(matches!(pt2_error(&err), Pt2Error::NotAPackage { .. }), "a TorchScript file is no package: {err}");

    // The package compiled for x86-64-v4 runs where the CPU has AVX-512, else it is refused.
    let foreign = first_load(ModelSpec::pt2("bad", path("foreign.pt2"), checkpoint()));
    match (std::arch::is_x86_feature_detected!("avx512f"), &foreign) {
        (true, Ok(())) => {}
        (false, Err(err)) => match pt2_error(err) {
            Pt2Error::Target { target, lacking, .. } => {
                assert_eq!(target, "x86-64-v4");
                assert!(lacking.contains(&"avx512f"), "{err}");
            }
            other => panic!("not a target error: {other}"),
        },
        (avx512, other) => panic!("AVX-512 here: {avx512}; the load gave {other:?}"),
    }

    let without = changed_checkpoint(dir.path(), |e| e.retain(|(n, _)| n != "down.bias"));
    let err = first_call_error(ModelSpec::pt2("bad", &package, [&without]));
    match pt2_error(&err) {
        Pt2Error::MissingConstants { constants, .. } => assert_eq!(constants, &["down.bias"]),
        other => panic!("not a missing constant: {other}"),
    }
    assert!(err.to_string().contains("changed.safetensors"), "{err}");

    let reshaped = changed_checkpoint(dir.path(), |e| {
        for (n, t) in e.iter_mut().filter(|(n, _)| n == "up.weight") {
            *t = Tensor::zeros([64, 128], (Kind::Float, Device::Cpu));
            assert_eq!(n, "up.weight");
        }
    });
    let err = first_call_error(ModelSpec::pt2("bad", &package, [&reshaped]));
    match pt2_error(&err) {
        Pt2Error::Shape { constant, expected, found, .. } => {
            assert_eq!(
                (constant.as_str(), expected.as_slice(), found.as_slice()),
                ("up.weight", &[128, 64][..], &[64, 128][..])
            )
        }
        other => panic!("not a shape error: {other}"),
    }

    let double = changed_checkpoint(dir.path(), |e| {
        for (_, t) in e.iter_mut().filter(|(n, _)| n == "up.bias") {
            *t = t.to_kind(Kind::Double);
        }
    });
    let err = first_call_error(ModelSpec::pt2("bad", &package, [&double]));
    match pt2_error(&err) {
        Pt2Error::Dtype { constant, found, checkpoint, .. } => {
            assert_eq!((constant.as_str(), *found, checkpoint), ("up.bias", Kind::Double, &double))
        }
        other => panic!("not a dtype error: {other}"),
    }
    assert!(err.to_string().contains("changed.safetensors"), "names the checkpoint file: {err}");
}

/// The first load of `bad` alone in a registry.
fn first_load(bad: ModelSpec) -> Result<(), StageError> {
    let models = StagedModels::builder().model(bad).stage("run", ["bad"]).build().unwrap();
    models.enter("run").unwrap();
    models.load("bad")
}

#[test]
fn a_package_exported_the_ordinary_way_runs_as_pythons_loader_runs_it_with_its_checkpoints_extra_entries_unused() {
    let _one = support::generator();
    let sink = Arc::new(ListSink::new());
    let models = StagedModels::builder()
        .model(spec("plain"))
        .stage("run", ["plain"])
        .stage("other", Vec::<String>::new())
        .events(sink.clone())
        .build()
        .unwrap();
    let (x, eager, python) = io("plain");
    models.enter("run").unwrap();
    let y = forward(&models, "plain", &x).unwrap();
    assert!(y.equal(&python), "Python's aoti_load_package gave the same package other numbers");
    assert!((&y - &eager).abs().max().double_value(&[]) < 1e-5);
    let report = models.load_report("plain").unwrap().unwrap();
    assert!(report.missing.is_empty(), "every constant filled: {report:?}");
    assert!(report.unused.contains(&"bn.num_batches_tracked".to_string()), "read by no constant: {report:?}");
    models.enter("other").unwrap();
    models.enter("run").unwrap();
    assert!(forward(&models, "plain", &x).unwrap().equal(&python), "the same after the reload");
}

#[test]
fn an_ordinary_package_refuses_a_transposed_weight_weights_inside_its_library_and_another_machine() {
    let _one = support::generator();
    let dir = tempfile::TempDir::new().unwrap();
    let checkpoint = || [path("plain.safetensors")];

    // The right byte count, the wrong shape: what the package records for its runner says so.
    let mut entries = Tensor::read_safetensors(path("plain.safetensors")).unwrap();
    for (_, t) in entries.iter_mut().filter(|(n, _)| n == "up.weight") {
        *t = t.tr().contiguous();
    }
    let transposed = dir.path().join("transposed.safetensors");
    stageload::checkpoint::save(&entries, &transposed).unwrap();
    let err = first_load(ModelSpec::pt2("bad", path("plain.pt2"), [&transposed])).unwrap_err();
    match pt2_error(&err) {
        Pt2Error::Shape { constant, expected, found, checkpoint, .. } => {
            assert_eq!(
                (constant.as_str(), expected.as_slice(), found.as_slice()),
                ("up.weight", &[128, 64][..], &[64, 128][..])
            );
            assert_eq!(checkpoint, &transposed);
        }
        other => panic!("not a shape error: {other}"),
    }
    assert!(err.to_string().contains("transposed.safetensors"), "{err}");

    let err = first_load(ModelSpec::pt2("bad", path("plain_inside.pt2"), checkpoint())).unwrap_err();
    assert!(matches!(pt2_error(&err), Pt2Error::WeightsInside { .. }), "{err}");
    assert!(err.to_string().contains("package_constants_in_so"), "says what to do: {err}");

    let err = first_load(ModelSpec::pt2("bad", path("plain_arm.pt2"), checkpoint())).unwrap_err();
    match pt2_error(&err) {
        Pt2Error::Machine { recorded, this, .. } => {
            assert_eq!(recorded, &format!("{} aarch64", std::env::consts::OS));
            assert!(this.contains(std::env::consts::ARCH), "{err}");
        }
        other => panic!("not a machine error: {other}"),
    }

    // The first vector ISA this CPU lacks, recorded in the package: refused, naming what it
    // lacks. On a CPU that has them all (AMX included) every one is accepted, and the kernel's
    // flags must say it has them; the refusal itself is then the unit tests' (`pt2::target`,
    // against a CPU without them).
    let lacked = ["isa_avx2", "isa_avx512", "isa_vnni", "isa_amx"]
        .into_iter()
        .map(|name| (name, first_load(ModelSpec::pt2("bad", path(&format!("{name}.pt2")), checkpoint()))))
        .find(|(_, loaded)| loaded.is_err());
    match lacked {
        Some((name, Err(err))) => match pt2_error(&err) {
            Pt2Error::Target { lacking, .. } => assert!(!lacking.is_empty(), "{name}: {err}"),
            other => panic!("{name}: not a target error: {other}"),
        },
        _ => {
            let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap();
            let flags: Vec<&str> = cpuinfo
                .lines()
                .find_map(|line| line.strip_prefix("flags").and_then(|rest| rest.split_once(':')))
                .map(|(_, flags)| flags.split_whitespace().collect())
                .unwrap_or_default();
            for flag in ["avx2", "avx512f", "avx512_vnni", "amx_tile"] {
                assert!(
                    flags.contains(&flag),
                    "every ISA package was accepted, and the kernel says this CPU lacks {flag}"
                );
            }
        }
    }
}

#[test]
fn a_pt2_load_draws_nothing_so_it_is_prefetched() {
    let _one = support::generator();
    let sink = Arc::new(ListSink::new());
    let models = StagedModels::builder()
        .model(spec("conv"))
        .stage("other", Vec::<String>::new())
        .stage("run", ["conv"])
        .events(sink.clone())
        .build()
        .unwrap();
    models.enter("other").unwrap();
    tch::manual_seed(3);
    let expected = Tensor::randn([4], (Kind::Float, Device::Cpu));
    tch::manual_seed(3);
    assert_eq!(models.prefetch("run").unwrap(), ["conv"]);
    models.wait_prefetch("run").unwrap();
    assert!(Tensor::randn([4], (Kind::Float, Device::Cpu)).equal(&expected), "the generator did not move");
    models.enter("run").unwrap();
    let (x, _, python) = io("conv");
    assert!(forward(&models, "conv", &x).unwrap().equal(&python));
    assert!(sink.of_kind(EventKind::Load)[0].prefetched());
}
