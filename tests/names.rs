//! Checkpoint names through the registry: lenient loads report what did not match and keep the
//! loader's values, strict ones refuse naming the model, the file and the names; renames that
//! collide are refused; a model built without initialisation draws nothing.

use std::sync::Arc;

use stageload::{EventKind, ListSink, ModelSpec, NameRules, StageError, StagedModels};
use stageload_torch_sys::{generator_state, without_init, GeneratorDevice};
use tch::nn::{Module, VarStore};
use tch::{Device, Kind, Tensor};

use stageload_test_support::torch as support;
use support::{build_mlp, input, mlp, Mlp};

/// A checkpoint of an Mlp of width 8 with `extra` entries, `l2.bias` left out when `drop_bias`.
fn file(dir: &std::path::Path, drop_bias: bool) -> std::path::PathBuf {
    let vs = VarStore::new(Device::Cpu);
    let _ = mlp(&vs, 8);
    let mut tensors: Vec<(String, Tensor)> =
        vs.variables().into_iter().filter(|(n, _)| !(drop_bias && n == "l2.bias")).collect();
    tensors.push(("pooler.weight".into(), Tensor::ones([2], (Kind::Float, Device::Cpu))));
    let path = dir.join(format!("mlp-{drop_bias}.safetensors"));
    stageload::checkpoint::save(&tensors, &path).unwrap();
    path
}

fn registry(path: &std::path::Path, rules: NameRules, sink: Arc<ListSink>) -> StagedModels {
    StagedModels::builder()
        .model(ModelSpec::new("mlp", |_| Ok(build_mlp(8))).checkpoint([path]).names(rules))
        .events(sink)
        .build()
        .unwrap()
}

#[test]
fn a_lenient_load_reports_unused_and_missing_names_in_its_event_and_the_registry() {
    let _one = support::generator();
    let dir = tempfile::TempDir::new().unwrap();
    let path = file(dir.path(), true);
    let sink = Arc::new(ListSink::new());
    let models = registry(&path, NameRules::default().strict(false), sink.clone());
    let y = models.call("mlp", |m: &mut Mlp| m.forward(&input(8))).unwrap();
    assert_eq!(y.size(), [2, 8]);
    let report = models.load_report("mlp").unwrap().unwrap();
    assert_eq!(
        (report.used, report.unused.clone(), report.missing.clone()),
        (3, vec!["pooler.weight".to_string()], vec!["l2.bias".to_string()])
    );
    let load = &sink.of_kind(EventKind::Load)[0];
    assert_eq!(load.loaded().and_then(|l| l.report.as_deref()), Some(&report));
    let text = load.to_string();
    assert!(
        text.contains("unused entries: pooler.weight") && text.contains("not in the checkpoint: l2.bias"),
        "{text}"
    );
}

#[test]
fn a_strict_load_refuses_naming_the_model_the_file_and_both_sides() {
    let _one = support::generator();
    let dir = tempfile::TempDir::new().unwrap();
    let path = file(dir.path(), true);
    let models = registry(&path, NameRules::default(), Arc::new(ListSink::new()));
    let err = models.load("mlp").unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, StageError::Checkpoint { .. }), "{text}");
    for needle in ["'mlp'", "mlp-true.safetensors", "'l2.bias'", "'pooler.weight'"] {
        assert!(text.contains(needle), "{needle} missing from: {text}");
    }
    // Ignoring the extra entry still leaves the missing tensor: refused.
    let models = registry(&path, NameRules::default().ignore(["pooler.*"]).unwrap(), Arc::new(ListSink::new()));
    assert!(models.load("mlp").unwrap_err().to_string().contains("'l2.bias'"));
    // Whole, with the extra entry ignored, it loads.
    let path = file(dir.path(), false);
    let models = registry(&path, NameRules::default().ignore(["pooler.*"]).unwrap(), Arc::new(ListSink::new()));
    models.load("mlp").unwrap();
    assert_eq!(models.load_report("mlp").unwrap().unwrap().ignored, 1);
}

#[test]
fn renames_that_map_two_entries_onto_one_tensor_are_refused() {
    let _one = support::generator();
    let dir = tempfile::TempDir::new().unwrap();
    let path = file(dir.path(), false);
    let rules = NameRules::default()
        .rename_with(|entry| Some(if entry.starts_with("l1.") { "l1.weight".into() } else { entry.into() }));
    let err = registry(&path, rules, Arc::new(ListSink::new())).load("mlp").unwrap_err().to_string();
    assert!(err.contains("'l1.bias'") && err.contains("'l1.weight'") && err.contains("mlp-false.safetensors"), "{err}");
}

#[test]
fn building_without_initialisation_draws_nothing_and_leaves_deterministic_fills() {
    let _one = support::generator();
    let cpu = (Kind::Float, Device::Cpu);
    let before = generator_state(GeneratorDevice::Cpu).unwrap();
    let (random, filled, zeros) = without_init(|| {
        let random = Tensor::randn([1024], cpu);
        let filled = Tensor::full([16], 3.0, cpu).uniform_(-1.0, 1.0);
        (random, filled, Tensor::zeros([16], cpu))
    });
    assert_eq!(generator_state(GeneratorDevice::Cpu).unwrap(), before, "no draw from the CPU generator");
    assert_eq!(random.size(), [1024]);
    assert!(filled.equal(&Tensor::full([16], 3.0, cpu)), "uniform_ left the tensor as it was");
    assert!(zeros.equal(&Tensor::zeros([16], cpu)), "zeros are still zeros");
    // Outside, initialisation is back.
    let _ = Tensor::randn([4], cpu);
    assert_ne!(generator_state(GeneratorDevice::Cpu).unwrap(), before);
    // And back after a panic inside.
    let _ = std::panic::catch_unwind(|| without_init(|| panic!("loader failed")));
    let drawn = generator_state(GeneratorDevice::Cpu).unwrap();
    let _ = Tensor::rand([4], cpu);
    assert_ne!(generator_state(GeneratorDevice::Cpu).unwrap(), drawn);
}
