//! What a pipeline runs on: a registry of its models for a [`Loading`] ([`registry`]), the stages
//! and calls a run makes ([`StageRunner`]), and one model's forward in its export's format
//! ([`forward`]); what every pipeline's export gives to run ([`PipelineExport`]).

use std::sync::Arc;

use stageload::pt2::Pt2Module;
use stageload::{BoxError, EventSink, ModelSpec, StagedModels};
use tch::{CModule, Tensor};

use crate::export::Format;

/// How the registry loads the models.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Loading {
    /// Every model loaded up front and kept.
    Eager,
    /// Each stage's model loaded when the stage calls it; the others released when a stage
    /// begins.
    Staged,
    /// Staged, and each stage's entry starts loading the next stage's model in the background.
    Prefetch,
}

impl Loading {
    /// `eager`, `staged` or `prefetch`.
    pub fn name(self) -> &'static str {
        match self {
            Loading::Eager => "eager",
            Loading::Staged => "staged",
            Loading::Prefetch => "prefetch",
        }
    }
}

/// A registry of `specs` with `stages` (each with the models it runs) for `loading`, its events to
/// `events`. Eager: every model pinned and loaded now, so nothing is ever released. (The command
/// line places models on other devices through `DemoRun`'s pipeline file.)
pub fn registry<'a>(
    specs: Vec<ModelSpec>,
    stages: impl IntoIterator<Item = (&'a str, &'a [&'a str])>,
    loading: Loading,
    events: Option<Arc<dyn EventSink>>,
) -> Result<StagedModels, BoxError> {
    let names: Vec<String> = specs.iter().map(|spec| spec.name().to_string()).collect();
    let mut builder = StagedModels::builder().prefetch_next(loading == Loading::Prefetch);
    if let Some(sink) = events {
        builder = builder.events(sink);
    }
    for spec in specs {
        builder = builder.model(spec);
    }
    for (stage, models) in stages {
        builder = builder.stage(stage, models.iter().copied());
    }
    if loading == Loading::Eager {
        for model in &names {
            builder = builder.pin(model);
        }
    }
    let models = builder.build()?;
    if loading == Loading::Eager {
        for model in &names {
            models.load(model)?;
        }
    }
    Ok(models)
}

/// What the pipeline runs on: stages to enter and models to call (a registry, or a demo run with
/// its meter and checks). Tests wrap one to watch every call.
pub trait StageRunner {
    /// Enters `stage` (releasing what it does not list).
    fn enter(&self, stage: &str) -> Result<(), BoxError>;
    /// Calls `f` on the model `model`, loaded if needed.
    fn call<M: 'static, R>(&self, model: &str, f: impl FnOnce(&mut M) -> R) -> Result<R, BoxError>;
}

impl StageRunner for StagedModels {
    fn enter(&self, stage: &str) -> Result<(), BoxError> {
        StagedModels::enter(self, stage)?;
        Ok(())
    }

    fn call<M: 'static, R>(&self, model: &str, f: impl FnOnce(&mut M) -> R) -> Result<R, BoxError> {
        Ok(StagedModels::call(self, model, f)?)
    }
}

/// Runs the model `model` (of `format`) on `inputs`; a failing forward is an error naming it.
pub fn forward(runner: &impl StageRunner, format: Format, model: &str, inputs: &[Tensor]) -> Result<Tensor, BoxError> {
    let failed = |e: &dyn std::fmt::Display| format!("{model}: forward failed: {e}");
    match format {
        Format::Torchscript => {
            runner.call(model, |m: &mut CModule| m.forward_ts(inputs))?.map_err(|e| failed(&e).into())
        }
        Format::Pt2 => {
            let inputs: Vec<&Tensor> = inputs.iter().collect();
            let mut outputs = runner.call(model, |m: &mut Pt2Module| m.forward(&inputs))?.map_err(|e| failed(&e))?;
            match outputs.len() {
                1 => Ok(outputs.remove(0)),
                n => Err(failed(&format!("{n} outputs, not one")).into()),
            }
        }
    }
}

/// What every pipeline's export gives: its stages in run order (each with the models it calls),
/// its models, and a registry of them.
pub trait PipelineExport {
    /// The stages in run order, each with the models it calls (a stage may call none).
    const STAGES: &'static [(&'static str, &'static [&'static str])];

    /// The models, each its module with its checkpoint ([`component_spec`](crate::export::component_spec)).
    fn model_specs(&self) -> Vec<ModelSpec>;

    /// A registry of the models on the CPU with [`STAGES`](Self::STAGES) for `loading`, its events
    /// to `events`. Eager: every model pinned and loaded now, so nothing is ever released. (The
    /// examples place models on other devices through their demo's pipeline file.)
    fn registry(&self, loading: Loading, events: Option<Arc<dyn EventSink>>) -> Result<StagedModels, BoxError> {
        registry(self.model_specs(), Self::STAGES.iter().copied(), loading, events)
    }
}
