//! The pipeline file is the run: stages that come back, pins over a span of stages, the file's
//! dtype converting float entries, its device checked, its ignored entries not loaded; the same
//! in the builder API.

use stageload_test_support::torch as support;

use stageload::{ModelSpec, StageError, StagedModels};
use stageload_plan::pipeline::{DeviceName, LoadDtype};
use support::{input, mlp, Mlp};
use tch::nn::{Module, VarStore};
use tch::{Device, Kind, Tensor};

/// A folder with `encoder`, `decoder` and `helper` checkpoints (an Mlp of width 8 each) and the
/// pipeline file `toml`.
fn pipeline(toml: &str) -> (tempfile::TempDir, stageload::Pipeline) {
    let folder = tempfile::TempDir::new().unwrap();
    let vs = VarStore::new(Device::Cpu);
    let _ = mlp(&vs, 8);
    let mut tensors = stageload::named_tensors(&vs);
    tensors.push(("extra.position_ids".to_string(), Tensor::arange(8, (Kind::Int64, Device::Cpu))));
    for name in ["encoder", "decoder", "helper"] {
        stageload::checkpoint::save(&tensors, folder.path().join(format!("{name}.safetensors"))).unwrap();
    }
    let models = "[[models]]\nname = \"encoder\"\nfiles = [\"encoder.safetensors\"]\nignore = [\"extra.*\"]\n\
                  [[models]]\nname = \"decoder\"\nfiles = [\"decoder.safetensors\"]\nignore = [\"extra.*\"]\n\
                  [[models]]\nname = \"helper\"\nfiles = [\"helper.safetensors\"]\nignore = [\"extra.*\"]\n";
    let path = folder.path().join("pipeline.toml");
    std::fs::write(&path, format!("{toml}\n{models}")).unwrap();
    let pipeline = stageload::Pipeline::load(&path).unwrap();
    (folder, pipeline)
}

/// An Mlp of width 8 built on the file's device (the CPU without one).
fn spec(name: &str) -> ModelSpec {
    ModelSpec::new(name, |ctx| {
        let vs = VarStore::new(ctx.device().unwrap_or(Device::Cpu));
        let model = mlp(&vs, 8);
        Ok(stageload::Built::new(model, &vs))
    })
}

fn registry(pipeline: &stageload::Pipeline) -> StagedModels {
    StagedModels::builder()
        .pipeline(pipeline)
        .model(spec("encoder"))
        .model(spec("decoder"))
        .model(spec("helper"))
        .build()
        .unwrap()
}

const STAGES: &str = "[[stages]]\nname = \"embed\"\nmodels = [\"encoder\"]\n\
                      [[stages]]\nname = \"other\"\nmodels = [\"decoder\"]\n\
                      [[stages]]\nname = \"embed\"\nmodels = [\"encoder\", \"helper\"]\n";

#[test]
fn a_stage_that_comes_back_loads_keeps_and_releases_what_its_occurrence_says() {
    let _generator = support::generator();
    let (_folder, pipeline) = pipeline(STAGES);
    let plan = stageload_plan::plan(&pipeline, stageload_plan::Budget::given(1 << 30), None);
    let models = registry(&pipeline);
    let mut seen = Vec::new();
    for (occurrence, stage) in ["embed", "other", "embed"].into_iter().enumerate() {
        models.enter(stage).unwrap();
        for name in models.stage_models(stage).unwrap() {
            models.load(&name).unwrap();
        }
        if occurrence == 2 {
            models.load("helper").unwrap();
        }
        let mut resident = models.resident();
        resident.sort();
        let mut planned = plan.stages[occurrence].resident.clone();
        planned.sort();
        assert_eq!(resident, planned, "occurrence {occurrence} of {stage}: the registry holds what the plan says");
        seen.push(resident);
    }
    assert_eq!(seen[2], ["encoder", "helper"], "the second embed is its own occurrence");
}

#[test]
fn a_pin_with_a_span_holds_from_its_stage_until_its_end_stage_begins() {
    let _generator = support::generator();
    let toml = format!(
        "[[pins]]\nmodels = [\"helper\"]\nfrom = \"embed\"\nuntil = \"end\"\n{STAGES}\
         [[stages]]\nname = \"end\"\nmodels = [\"decoder\"]\n"
    );
    let (_folder, pipeline) = pipeline(&toml);
    let models = registry(&pipeline);
    models.enter("embed").unwrap();
    models.load("helper").unwrap();
    models.enter("other").unwrap();
    assert!(models.resident().contains(&"helper".to_string()), "pinned through `other`");
    models.enter("embed").unwrap();
    models.enter("end").unwrap();
    assert!(!models.resident().contains(&"helper".to_string()), "released when `end` begins");

    // The builder API, and a span naming a stage there is not.
    let built = StagedModels::builder()
        .model(spec("encoder"))
        .stage("a", ["encoder"])
        .stage("b", Vec::<String>::new())
        .pin_between("encoder", Some("a".into()), Some("nowhere".into()))
        .build();
    let err = built.err().unwrap();
    assert!(matches!(err, StageError::PinSpan { .. }) && err.to_string().contains("unknown stage 'nowhere'"), "{err}");
}

#[test]
fn the_files_dtype_converts_float_entries_and_ignored_entries_are_not_loaded() {
    let _generator = support::generator();
    let toml = STAGES.to_string();
    let (_folder, mut pipeline) = pipeline(&toml);
    pipeline.models[0].dtype = Some(LoadDtype::BF16);
    let models = registry(&pipeline);
    models.enter("embed").unwrap();
    let kinds: Vec<Kind> = models.get::<Mlp>("encoder").unwrap().tensors().iter().map(|(_, t)| t.kind()).collect();
    assert!(kinds.iter().all(|k| *k == Kind::BFloat16), "{kinds:?}");
    let out = models.call("encoder", |m: &mut Mlp| m.forward(&input(8).to_kind(Kind::BFloat16))).unwrap();
    assert_eq!(out.kind(), Kind::BFloat16);
    let report = models.load_report("encoder").unwrap().unwrap();
    assert_eq!(report.ignored, 1, "extra.position_ids is ignored by the file's pattern: {report:?}");
}

#[test]
fn a_model_built_on_another_device_than_the_files_is_refused_by_name() {
    let _generator = support::generator();
    let (_folder, mut pipeline) = pipeline(STAGES);
    pipeline.models[0].device = DeviceName::Cuda(3);
    let models = StagedModels::builder()
        .pipeline(&pipeline)
        .model(ModelSpec::new("encoder", |_| {
            let vs = VarStore::new(Device::Cpu);
            let model = mlp(&vs, 8);
            Ok(stageload::Built::new(model, &vs))
        }))
        .model(spec("decoder"))
        .model(spec("helper"))
        .build()
        .unwrap();
    models.enter("embed").unwrap();
    let err = models.load("encoder").unwrap_err().to_string();
    assert!(err.contains("model 'encoder'") && err.contains("places it on cuda:3") && err.contains("on cpu"), "{err}");
    let mut bad = pipeline.clone();
    // A device that cannot hold the dtype (the file's check refuses it; a pipeline made in code
    // meets the registry's).
    (bad.models[1].device, bad.models[1].dtype) = (DeviceName::Mps, Some(LoadDtype::F64));
    let err = StagedModels::builder()
        .pipeline(&bad)
        .model(spec("encoder"))
        .model(spec("decoder"))
        .model(spec("helper"))
        .build()
        .err()
        .unwrap();
    assert!(err.to_string().contains("mps cannot hold it") && err.to_string().contains("'decoder'"), "{err}");
}
