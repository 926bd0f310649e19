//! From the file to the checked pipeline: names resolved, sizes parsed, every checkpoint's
//! header read, pins turned into spans of the stage sequence, each streamed model's split
//! decided under its budget (its own, or what its stages leave: [`crate::leftover`]).

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use stageload_units::{format_bytes, parse_size};

use super::header::read_header;
use super::{
    total, DeviceName, LoadDtype, Model, Part, Pin, PinEntry, PinError, Pipeline, PipelineError, PipelineFile,
    Placement, Reserve, Stage, StreamEntry, Streaming, MAX_PIPELINE_FILE,
};

/// A streamed model without a budget, until its stages are known: its index among the models,
/// its stream entry, its entries' names and bytes, whether it is on CUDA.
type Undecided = (usize, StreamEntry, Vec<(String, u64)>, bool);

/// A streamed model's budget: the file's, or what its stages leave (`from` says where).
enum Budget {
    Given(u64),
    Left { bytes: u64, from: String },
}

/// Why a streamed model gets no split.
#[derive(Debug, thiserror::Error)]
enum StreamError {
    #[error("working: {0}")]
    Working(#[source] stageload_units::UnitError),
    #[error(transparent)]
    Blocks(#[from] crate::blocks::BlockError),
    #[error(transparent)]
    TooSmall(#[from] crate::split::TooSmall),
    #[error(transparent)]
    Leftover(#[from] crate::leftover::LeftoverError),
    #[error("no budget: give it one (budget = \"2G\"), or give the pipeline {field} = \"...\" so that it takes what its stages leave")]
    NoBudget { field: &'static str },
}

/// Why a `reserve` is refused.
#[derive(Debug, thiserror::Error)]
enum ReserveError {
    #[error("reserve: '{0}' is not a percent from 0% to 1000%")]
    Percent(String),
    #[error("reserve: {0} (or a percent: 10%)")]
    Size(#[source] stageload_units::UnitError),
}

/// The split a streamed model gets under `budget`, from its entries' names and bytes.
fn streaming(
    stream: &StreamEntry,
    entries: &[(String, u64)],
    on_cuda: bool,
    budget: Budget,
) -> Result<Streaming, StreamError> {
    let working = stream.working.as_deref().map_or(Ok(0), parse_size).map_err(StreamError::Working)?;
    let (budget, budget_from) = match budget {
        Budget::Given(bytes) => (bytes, None),
        // Its own working memory is inside the stage's, and kept free inside its budget.
        Budget::Left { bytes, from } => (bytes.saturating_add(working), Some(from)),
    };
    let spec = crate::blocks::BlockSpec::new(stream.blocks.iter().cloned()).resident(stream.resident.iter().cloned());
    let names: Vec<&str> = entries.iter().map(|(n, _)| n.as_str()).collect();
    let layout = crate::blocks::assign(&spec, &names)?;
    let bytes = |members: &[usize]| members.iter().map(|&i| entries[i].1).collect::<Vec<u64>>();
    // Fixed tensors come from the allocator; a block counts as a slot lays it out.
    let sizes = crate::split::Sizes {
        fixed: total(bytes(&layout.fixed)),
        blocks: layout.blocks.iter().map(|(_, members)| crate::split::block_bytes(bytes(members))).collect(),
    };
    let at_most = if stream.any_order { 0 } else { sizes.blocks.len() };
    let split = crate::split::fit(&sizes, budget, working, at_most)?;
    let holding = sizes.holding(split, stream.any_order);
    Ok(Streaming {
        spec,
        blocks: split.blocks,
        resident_blocks: split.resident,
        look_ahead: split.look_ahead,
        any_order: stream.any_order,
        held: holding.held,
        per_step: holding.per_step,
        hot_blocks: holding.hot_blocks,
        budget,
        budget_from,
        working,
        host_copies: if on_cuda { total(layout.blocks.iter().flat_map(|(_, members)| bytes(members))) } else { 0 },
    })
}

/// A pin's span as indices into the stage sequence: `from` at its first occurrence, `until` at
/// its first occurrence after `from`.
pub fn resolve_pin(pin: &PinEntry, stages: &[&str]) -> Result<Pin, PinError> {
    let unknown = |field: &'static str, name: &str| PinError::UnknownStage {
        models: pin.models.clone(),
        field,
        stage: name.to_string(),
        stages: stages.iter().map(|s| s.to_string()).collect(),
    };
    let from = match &pin.from {
        None => 0,
        Some(name) => stages.iter().position(|s| s == name).ok_or_else(|| unknown("from", name))?,
    };
    let until = match &pin.until {
        None => None,
        Some(name) => {
            let after = stages[from..].iter().skip(1).position(|s| s == name).map(|i| from + 1 + i);
            match after {
                Some(index) => Some(index),
                None if stages.contains(&name.as_str()) => {
                    return Err(PinError::UntilNotAfter {
                        models: pin.models.clone(),
                        until: name.clone(),
                        from: stages[from].to_string(),
                    })
                }
                None => return Err(unknown("until", name)),
            }
        }
    };
    Ok(Pin { models: pin.models.clone(), from, until })
}

/// `10%` or a size.
fn parse_reserve(text: &str) -> Result<Reserve, ReserveError> {
    if let Some(percent) = text.trim().strip_suffix('%') {
        return match percent.trim().parse::<f64>() {
            Ok(p) if (0.0..=1000.0).contains(&p) => Ok(Reserve::Percent(p)),
            _ => Err(ReserveError::Percent(text.to_string())),
        };
    }
    parse_size(text).map(Reserve::Bytes).map_err(ReserveError::Size)
}

impl Pipeline {
    /// Reads and checks a pipeline file and the headers of every checkpoint it names.
    pub fn load(path: &Path) -> Result<Pipeline, PipelineError> {
        let text = stageload_input::read_text(path, MAX_PIPELINE_FILE)
            .map_err(|e| PipelineError::Read { path: path.to_path_buf(), message: e.to_string() })?;
        Self::parse(&text, path)
    }

    /// Checks the text of the pipeline file at `path` (already read) and reads the headers of
    /// every checkpoint it names; relative checkpoint paths are taken from `path`'s folder.
    pub fn parse(text: &str, path: &Path) -> Result<Pipeline, PipelineError> {
        let file: PipelineFile = toml::from_str(text)
            .map_err(|e| PipelineError::Syntax { path: path.to_path_buf(), message: e.to_string() })?;
        let invalid = |message: String| PipelineError::Invalid { path: path.to_path_buf(), message };
        let folder = path.parent().unwrap_or(Path::new("."));

        let mut names = HashSet::new();
        let mut models = Vec::new();
        let mut undecided: Vec<Undecided> = Vec::new();
        for entry in file.models {
            if !names.insert(entry.name.clone()) {
                return Err(invalid(format!("model '{}' is described twice", entry.name)));
            }
            let declared = entry
                .weights
                .as_deref()
                .map(|text| parse_size(text).map_err(|e| invalid(format!("model '{}': weights: {e}", entry.name))))
                .transpose()?;
            match (entry.files.is_empty(), declared.is_some(), entry.stream.is_some()) {
                (true, false, _) => {
                    return Err(invalid(format!(
                        "model '{}' has no files: give its safetensors checkpoint(s), or, for a model its loader builds, its size (weights = \"300M\")",
                        entry.name
                    )))
                }
                (false, true, _) => {
                    return Err(invalid(format!(
                        "model '{}': files and weights together: its checkpoints' headers give its size; leave weights out",
                        entry.name
                    )))
                }
                (true, true, true) => {
                    return Err(invalid(format!(
                        "model '{}': stream needs files: its blocks are read from its checkpoint",
                        entry.name
                    )))
                }
                _ => {}
            }
            let device = DeviceName::parse(&entry.device).ok_or_else(|| {
                invalid(format!("model '{}': unknown device '{}' (cpu, cuda, cuda:N or mps)", entry.name, entry.device))
            })?;
            let dtype = match &entry.dtype {
                Some(dtype) => Some(LoadDtype::parse(dtype).ok_or_else(|| {
                    invalid(format!(
                        "model '{}': unknown dtype '{dtype}': float entries load as f16, bf16, f32 or f64 (integer and bool entries keep theirs)",
                        entry.name
                    ))
                })?),
                None => None,
            };
            let loaded_bits = dtype.map(LoadDtype::bits);
            if dtype == Some(LoadDtype::F64) && device == DeviceName::Mps {
                return Err(invalid(format!(
                    "model '{}': dtype '{}': mps cannot hold float64; choose f32, f16 or bf16",
                    entry.name,
                    entry.dtype.as_deref().unwrap_or_default()
                )));
            }
            let ignore = entry
                .ignore
                .iter()
                .map(|p| glob::Pattern::new(p))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| invalid(format!("model '{}': ignore: {e}", entry.name)))?;
            let files: Vec<PathBuf> = entry.files.iter().map(|f| folder.join(f)).collect();
            let mut parts = Vec::new();
            let mut entries = Vec::new();
            for file in &files {
                let sizes = read_header(file, &ignore, loaded_bits).map_err(|source| PipelineError::Checkpoint {
                    model: entry.name.clone(),
                    file: file.clone(),
                    source,
                })?;
                entries.extend(sizes.loaded);
                parts.push(Part {
                    file: file.clone(),
                    bytes: sizes.resident,
                    file_bytes: sizes.stored,
                    float_bytes: sizes.float_bytes,
                    float_elements: sizes.float_elements,
                });
            }
            let bytes = declared.unwrap_or_else(|| total(parts.iter().map(|p| p.bytes)));
            let file_bytes = total(parts.iter().map(|p| p.file_bytes));
            let tensors = entries.len();
            let streamed = match &entry.stream {
                Some(_) if entry.dtype.is_some() => {
                    return Err(invalid(format!(
                        "model '{}': dtype and stream together: a streamed model's blocks load in the kinds its loader builds them in; build it in that dtype and leave dtype out",
                        entry.name
                    )))
                }
                Some(stream) => {
                    let on_cuda = matches!(device, DeviceName::Cuda(_));
                    match &stream.budget {
                        Some(budget) => {
                            let budget = parse_size(budget)
                                .map_err(|e| invalid(format!("model '{}': stream: budget: {e}", entry.name)))?;
                            Some(
                                streaming(stream, &entries, on_cuda, Budget::Given(budget))
                                    .map_err(|e| invalid(format!("model '{}': stream: {e}", entry.name)))?,
                            )
                        }
                        None => {
                            undecided.push((models.len(), stream.clone(), entries, on_cuda));
                            None
                        }
                    }
                }
                None => None,
            };
            models.push(Model {
                name: entry.name,
                files,
                device,
                placement: device.placement(),
                dtype,
                ignore: entry.ignore,
                tensors,
                bytes,
                file_bytes,
                parts,
                streamed,
            });
        }

        let mut stages = Vec::new();
        for entry in file.stages {
            let mut listed = HashSet::new();
            for model in &entry.models {
                if !names.contains(model) {
                    return Err(invalid(format!("stage '{}' names unknown model '{model}'", entry.name)));
                }
                if !listed.insert(model) {
                    return Err(invalid(format!("stage '{}' lists model '{model}' twice", entry.name)));
                }
            }
            let size = |field: &str, value: &Option<String>| -> Result<u64, PipelineError> {
                value.as_deref().map_or(Ok(0), |text| {
                    parse_size(text).map_err(|e| invalid(format!("stage '{}': {field}: {e}", entry.name)))
                })
            };
            let working = size("working", &entry.working)?;
            let device_working = size("device_working", &entry.device_working)?;
            stages.push(Stage { name: entry.name, models: entry.models, working, device_working });
        }
        if stages.is_empty() {
            return Err(invalid("no stages: add [[stages]] entries with a name and the models they use".into()));
        }
        for pinned in file.pinned.iter().chain(file.pins.iter().flat_map(|p| &p.models)) {
            if !names.contains(pinned) {
                return Err(invalid(format!("pinned names unknown model '{pinned}'")));
            }
        }
        let stage_names: Vec<&str> = stages.iter().map(|s: &Stage| s.name.as_str()).collect();
        let pins = file
            .pins
            .iter()
            .map(|pin| resolve_pin(pin, &stage_names))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| invalid(e.to_string()))?;
        let reserve = file.reserve.as_deref().map(parse_reserve).transpose().map_err(|e| invalid(e.to_string()))?;
        let host_tier = file
            .host_tier
            .as_deref()
            .map(|text| parse_size(text).map_err(|e| invalid(format!("host_tier: {e}"))))
            .transpose()?;
        let memory = |field: &str, value: &Option<String>| -> Result<Option<u64>, PipelineError> {
            value.as_deref().map(|text| parse_size(text).map_err(|e| invalid(format!("{field}: {e}")))).transpose()
        };
        let snapshot_keep_free = memory("snapshot_keep_free", &file.snapshot_keep_free)?;
        let (memory, device_memory) = (memory("memory", &file.memory)?, memory("device_memory", &file.device_memory)?);
        if snapshot_keep_free.is_some() && file.snapshot_dir.is_none() {
            return Err(invalid("snapshot_keep_free is set but snapshot_dir is not: name the snapshot folder, or remove snapshot_keep_free".to_string()));
        }
        if file.cpus == Some(0) {
            return Err(invalid(
                "cpus = 0: a run needs at least one CPU; give cpus = N (N >= 1), or leave it out".into(),
            ));
        }
        let snapshot_dir = file.snapshot_dir.map(|dir| folder.join(dir));
        let mut pipeline = Pipeline {
            path: path.to_path_buf(),
            models,
            stages,
            pinned: file.pinned,
            pins,
            reserve,
            host_tier,
            memory,
            device_memory,
            snapshot_dir,
            snapshot_keep_free,
            cpus: file.cpus,
        };
        pipeline.derive_budgets(undecided).map_err(|(model, e)| invalid(format!("model '{model}': stream: {e}")))?;
        Ok(pipeline)
    }

    /// Gives each streamed model without a budget what its stages leave ([`crate::leftover`]);
    /// an error names the model.
    fn derive_budgets(&mut self, undecided: Vec<Undecided>) -> Result<(), (String, StreamError)> {
        let names: Vec<String> = undecided.iter().map(|(index, ..)| self.models[*index].name.clone()).collect();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let mut derived = Vec::new();
        for (index, stream, entries, on_cuda) in &undecided {
            let model = &self.models[*index];
            let (memory, field) = match model.placement {
                Placement::Host => (self.memory, "memory"),
                Placement::Device => (self.device_memory, "device_memory"),
            };
            let split = || -> Result<Streaming, StreamError> {
                let memory = memory.ok_or(StreamError::NoBudget { field })?;
                let left = crate::leftover::leftover(self, &model.name, model.placement, memory, &names)?;
                let from = match &left.stage {
                    Some(stage) => format!("what stage '{stage}' leaves of {field} {}", format_bytes(memory)),
                    None => format!("{field} {}, in no stage", format_bytes(memory)),
                };
                streaming(stream, entries, *on_cuda, Budget::Left { bytes: left.bytes, from })
            };
            derived.push((*index, split().map_err(|e| (model.name.clone(), e))?));
        }
        for (index, streamed) in derived {
            self.models[index].streamed = Some(streamed);
        }
        Ok(())
    }
}
