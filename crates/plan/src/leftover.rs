//! A streamed model without a `budget` of its own takes what its stages leave: the memory the
//! pipeline file gives the run on the model's side (`memory` on the host, `device_memory` on a
//! device), less the reserve, less the weights resident beside it and the stage's working
//! memory, in the tightest stage that holds it. Arithmetic over the checked pipeline only, so
//! the plan and the run (which takes the plan's number) cannot disagree.

use stageload_units::format_bytes;

use crate::pipeline::{Pipeline, Placement};

/// What a model's stages leave it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leftover {
    /// Bytes the tightest stage holding the model leaves it (all the room when it is in no stage).
    pub bytes: u64,
    /// The stage that leaves the least (`None`: the model is in no stage).
    pub stage: Option<String>,
}

/// Why a model's stages leave it no budget.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LeftoverError {
    /// Two models without a budget share a stage: each would wait on the other's.
    #[error("'{model}' and '{other}' both take what stage '{stage}' leaves: give one of them a budget")]
    Shared {
        /// The model whose budget is derived.
        model: String,
        /// The other model without a budget in that stage.
        other: String,
        /// The stage.
        stage: String,
    },
    /// A stage's resident weights and working memory take all the room.
    #[error(
        "stage '{stage}' leaves it nothing of {}: {} resident beside it and {} of working memory take {}{}",
        format_bytes(*.memory), format_bytes(*.weights), format_bytes(*.working),
        format_bytes(.weights.saturating_add(*.working)),
        if .room < .memory { format!(" of the {} the reserve leaves", format_bytes(*.room)) } else { String::new() }
    )]
    Nothing {
        /// The stage.
        stage: String,
        /// The memory the pipeline gives the run on the model's side.
        memory: u64,
        /// What the reserve leaves of it.
        room: u64,
        /// The weights resident beside the model there.
        weights: u64,
        /// The stage's working memory.
        working: u64,
    },
}

/// What the stages holding `model` (on `placement`) leave it of `memory`. `undecided` are the
/// streamed models whose budgets are being derived too: two of them in one stage would each
/// wait on the other's, and are refused.
pub fn leftover(
    pipeline: &Pipeline,
    model: &str,
    placement: Placement,
    memory: u64,
    undecided: &[&str],
) -> Result<Leftover, LeftoverError> {
    let room = pipeline.reserve.map_or(memory, |reserve| reserve.room(memory));
    let mut least = Leftover { bytes: room, stage: None };
    for (index, stage) in pipeline.stages.iter().enumerate() {
        let mut beside: Vec<&String> = stage.models.iter().chain(pipeline.pinned_at(index)).collect();
        beside.sort();
        beside.dedup();
        if !beside.iter().any(|name| *name == model) {
            continue;
        }
        beside.retain(|name| *name != model);
        if let Some(other) = beside.iter().find(|name| undecided.contains(&name.as_str())) {
            return Err(LeftoverError::Shared {
                model: model.to_string(),
                other: other.to_string(),
                stage: stage.name.clone(),
            });
        }
        let others: Vec<_> = beside.iter().filter_map(|name| pipeline.model(name)).collect();
        let weights = crate::plan::bytes_on(&others, placement);
        let working = match placement {
            Placement::Host => stage.working,
            Placement::Device => stage.device_working,
        };
        let taken = weights.saturating_add(working);
        let Some(left) = room.checked_sub(taken).filter(|left| *left > 0) else {
            return Err(LeftoverError::Nothing { stage: stage.name.clone(), memory, room, weights, working });
        };
        if least.stage.is_none() || left < least.bytes {
            least = Leftover { bytes: left, stage: Some(stage.name.clone()) };
        }
    }
    Ok(least)
}
