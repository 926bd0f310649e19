//! The host tier through the public API on this machine: what a pipeline file's `host_tier`
//! does to CPU models (nothing, and it says so) and to a budget smaller than a device model (a
//! build error naming both sizes). The tier's copies and rules run in the library's unit tests
//! (`staged::tier_tests`), and on CUDA in `cargo xtask gpu-check`.

use stageload_test_support::torch as support;

use std::sync::Arc;

use stageload::{EventKind, ListSink, ModelSpec, ReloadFrom, StageError, StagedModels};
use support::{input, mlp, Mlp};
use tch::nn::{Module, VarStore};
use tch::Device;

/// A folder with an `encoder` and a `decoder` checkpoint (an Mlp of width 64 each, 66 KiB) and a
/// pipeline file: `header`, both models on `device`, one stage each and back to the encoder.
fn pipeline(header: &str, device: &str) -> (tempfile::TempDir, stageload::Pipeline) {
    let folder = tempfile::TempDir::new().unwrap();
    let vs = VarStore::new(Device::Cpu);
    let _ = mlp(&vs, 64);
    for name in ["encoder", "decoder"] {
        let path = folder.path().join(format!("{name}.safetensors"));
        stageload::checkpoint::save(&stageload::named_tensors(&vs), path).unwrap();
    }
    let text = format!(
        "{header}\n[[models]]\nname = \"encoder\"\nfiles = [\"encoder.safetensors\"]\ndevice = \"{device}\"\n\
         [[models]]\nname = \"decoder\"\nfiles = [\"decoder.safetensors\"]\ndevice = \"{device}\"\n\
         [[stages]]\nname = \"encode\"\nmodels = [\"encoder\"]\n\
         [[stages]]\nname = \"decode\"\nmodels = [\"decoder\"]\n\
         [[stages]]\nname = \"encode\"\nmodels = [\"encoder\"]\n"
    );
    let path = folder.path().join("pipeline.toml");
    std::fs::write(&path, text).unwrap();
    (folder, stageload::Pipeline::load(&path).unwrap())
}

fn spec(name: &str) -> ModelSpec {
    ModelSpec::new(name, |ctx| {
        let vs = VarStore::new(ctx.device().unwrap_or(Device::Cpu));
        let model = mlp(&vs, 64);
        Ok(stageload::Built::new(model, &vs))
    })
}

#[test]
fn cpu_models_are_not_held_by_the_host_tier_and_a_tier_event_says_so_once() {
    let _generator = support::generator();
    let (_folder, pipeline) = pipeline("host_tier = \"1M\"", "cpu");
    let sink = Arc::new(ListSink::new());
    let models = StagedModels::builder()
        .pipeline(&pipeline)
        .model(spec("encoder"))
        .model(spec("decoder"))
        .events(sink.clone())
        .build()
        .unwrap();
    let mut outputs = Vec::new();
    for (stage, model) in [("encode", "encoder"), ("decode", "decoder"), ("encode", "encoder")] {
        models.enter(stage).unwrap();
        outputs.push(models.call(model, |m: &mut Mlp| m.forward(&input(64))).unwrap());
    }
    assert!(outputs[0].equal(&outputs[2]), "the encoder came back with its weights");
    let usage = models.host_tier().unwrap();
    assert_eq!((usage.budget, usage.used), (1 << 20, 0), "nothing held");
    let notes: Vec<String> = sink.of_kind(EventKind::Tier).into_iter().filter_map(|e| e.note()).collect();
    assert_eq!(notes.len(), 1, "said once: {notes:?}");
    assert!(notes[0].contains("'encoder' lives on the CPU"), "{}", notes[0]);
    let reload = sink.of_kind(EventKind::Reload).pop().unwrap();
    assert_eq!(reload.reload_from(), Some(ReloadFrom::InPlace), "from its checkpoint, as without a tier");
}

#[test]
fn a_host_tier_smaller_than_a_device_model_is_refused_at_build_naming_both_sizes() {
    let _generator = support::generator();
    // Built without CUDA: the check reads the checkpoint's header only.
    let (_folder, pipeline) = pipeline("host_tier = \"10K\"", "cuda:0");
    let err = match StagedModels::builder().pipeline(&pipeline).model(spec("encoder")).model(spec("decoder")).build() {
        Ok(_) => panic!("a 10 KiB tier for a 32.5 KiB model was accepted"),
        Err(err) => err,
    };
    let vs = VarStore::new(Device::Cpu);
    let _ = mlp(&vs, 64);
    let weights: u64 = stageload::named_tensors(&vs).iter().map(|(_, t)| t.numel() as u64 * 4).sum();
    assert!(
        matches!(&err, StageError::HostTierTooSmall { model, bytes, budget: 10240 } if model == "encoder" && *bytes == weights),
        "{err}"
    );
    let message = err.to_string();
    assert!(message.contains("10.0 KiB") && message.contains("32.5 KiB"), "{message}");
}
