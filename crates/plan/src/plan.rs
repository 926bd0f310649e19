//! The fit plan: stage by stage, what is resident, loaded and released, what it needs, and
//! whether that fits this machine; the same for eager loading (every model at once).
//!
//! A model kept from one stage to the next (listed by both, or pinned there) stays resident and
//! is counted once; a model a stage does not list and that is not pinned there is released at the
//! stage's entry, and loaded again (read from disk again) if a later stage lists it. Stages are
//! planned in the file's order, repeats included, each occurrence with its own models and pins.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use stageload_units::format_bytes;

use crate::pipeline::{total, Model, Pipeline, Placement};
use crate::tier::{Tier, TierPlan};

mod render;

/// The version of the JSON schema of [`Plan`]; raised on any incompatible change.
pub const SCHEMA_VERSION: u32 = 1;

/// Where the host budget comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BudgetSource {
    /// `MemTotal` / `MemAvailable` of this machine.
    Machine,
    /// The memory-limited cgroup this process runs in.
    Cgroup,
    /// `--memory`: the user's number, taken as both total and available.
    Flag,
}

/// Memory a plan is checked against, bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Budget {
    /// Memory in all, bytes.
    pub total: u64,
    /// Memory available now, bytes.
    pub available: u64,
    /// Where the figures come from.
    pub source: BudgetSource,
}

impl BudgetSource {
    /// `this machine`, `this cgroup's limit`, `--memory`: as the plan names its budget.
    pub fn describe(self) -> &'static str {
        match self {
            BudgetSource::Machine => "this machine",
            BudgetSource::Cgroup => "this cgroup's limit",
            BudgetSource::Flag => "--memory",
        }
    }
}

impl Budget {
    /// This machine's budget now: the cgroup limit inside a limited cgroup, else the machine.
    pub fn of_this_machine() -> Result<Budget, stageload_probe::ProbeError> {
        let memory = stageload_probe::system_memory()?;
        let source = if memory.cgroup.is_some() { BudgetSource::Cgroup } else { BudgetSource::Machine };
        Ok(Budget { total: memory.budget_total(), available: memory.budget_available(), source })
    }

    /// A budget the user gave (`--memory`, `--device-memory`).
    pub fn given(bytes: u64) -> Budget {
        Budget { total: bytes, available: bytes, source: BudgetSource::Flag }
    }
}

/// Whether a need fits a budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Verdict {
    /// Fits in what is available now.
    Fits,
    /// Fits in the total once other processes free `free` bytes.
    FitsIfFreed {
        /// Bytes others must free.
        free: u64,
    },
    /// Larger than the total by `by` bytes.
    DoesNotFit {
        /// Bytes over the total.
        by: u64,
    },
    /// Nothing to check against (device memory without `--device-memory`).
    NotChecked,
}

impl Verdict {
    /// How `need` bytes meet `budget` (`None`: nothing to check against).
    pub fn of(need: u64, budget: Option<&Budget>) -> Verdict {
        match budget {
            None if need == 0 => Verdict::Fits,
            None => Verdict::NotChecked,
            Some(budget) if need <= budget.available => Verdict::Fits,
            Some(budget) if need <= budget.total => Verdict::FitsIfFreed { free: need - budget.available },
            Some(budget) => Verdict::DoesNotFit { by: need - budget.total },
        }
    }

    /// Fits now or once others free memory (or is not checked).
    pub fn fits(&self) -> bool {
        !matches!(self, Verdict::DoesNotFit { .. })
    }

    /// `fits` / `fits if other processes free 1.2 GiB` / `does not fit by 3.0 GiB`.
    pub fn describe(&self) -> String {
        match self {
            Verdict::Fits => "fits".to_string(),
            Verdict::FitsIfFreed { free } => {
                format!("fits if other processes free {}", format_bytes(*free))
            }
            Verdict::DoesNotFit { by } => format!("does not fit by {}", format_bytes(*by)),
            Verdict::NotChecked => "not checked (give --device-memory)".to_string(),
        }
    }
}

/// One stage of the staged run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StagePlan {
    /// The stage's name.
    pub name: String,
    /// Models resident during the stage (listed, kept, or pinned).
    pub resident: Vec<String>,
    /// Models loaded during the stage (first loads and reloads).
    pub loaded: Vec<String>,
    /// Of `loaded`, those released earlier and read again.
    pub reloaded: Vec<String>,
    /// Models released at the stage's entry.
    pub released: Vec<String>,
    /// Of `reloaded`, those that come back from the host tier (nothing read from disk).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub from_tier: Vec<String>,
    /// Of `reloaded`, models without a checkpoint that come back from their snapshot (read from
    /// the pipeline's `snapshot_dir`, counted in `read`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub from_snapshot: Vec<String>,
    /// Of `reloaded`, models without a checkpoint that their loaders build again (no tier copy,
    /// no snapshot).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rebuilt: Vec<String>,
    /// Of `released`, models without a checkpoint whose snapshot is written as they go.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub snapshots: Vec<String>,
    /// Host bytes the tier's copies hold once the stage's releases are stored (counted in
    /// `need`; absent without a tier).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub tier: u64,
    /// Host bytes of the resident weights.
    pub weights: u64,
    /// Host bytes the stage needs: `weights` with its working memory (and the tier's copies,
    /// and a streamed CUDA model's pinned block copies) plus the pipeline's reserve.
    pub need: u64,
    /// Device bytes of the resident weights.
    pub device_weights: u64,
    /// Device bytes the stage needs, as `need`.
    pub device_need: u64,
    /// `need` and `device_need` before the reserve is added: what the stage is expected to
    /// use, where `need` is what it may use (a scheduler's request and limit,
    /// [`crate::request`]).
    #[serde(default)]
    pub need_before_reserve: u64,
    /// `device_need` before the reserve is added.
    #[serde(default)]
    pub device_need_before_reserve: u64,
    /// Bytes read from disk by the stage's loads.
    pub read: u64,
    /// How `need` meets the host budget.
    pub verdict: Verdict,
    /// How `device_need` meets the device budget.
    pub device_verdict: Verdict,
    /// What would make the stage fit, when it does not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remedy: Option<Remedy>,
}

fn is_zero(bytes: &u64) -> bool {
    *bytes == 0
}

/// Ways to make a stage that does not fit fit, each with the bytes it saves.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Remedy {
    /// How much the stage is over its budget (the larger of host and device).
    pub short_by: u64,
    /// (what to do, bytes it saves)
    pub options: Vec<(String, u64)>,
    /// All the options together make it fit.
    pub together_fits: bool,
}

/// Bytes `model` would save with its float entries as bf16 (2 bytes each), counting only files
/// no other model of `resident` lists (a shared component is built once, by whichever model
/// comes first, in its own dtype).
fn bf16_saving(model: &Model, resident: &[&Model]) -> u64 {
    let own = model.parts.iter().filter(|part| {
        !resident.iter().any(|other| other.name != model.name && other.parts.iter().any(|p| p.file == part.file))
    });
    total(own.map(|p| p.float_bytes.saturating_sub(p.float_elements.saturating_mul(2))))
}

/// What would make `stage` (at occurrence `index`) fit: unpinning the models it keeps without
/// using them, and loading the models it uses in bf16.
fn remedy(
    pipeline: &Pipeline,
    index: usize,
    stage: &StagePlan,
    budget: &Budget,
    device: Option<&Budget>,
) -> Option<Remedy> {
    let over = |need: u64, budget: Option<&Budget>| match Verdict::of(need, budget) {
        Verdict::DoesNotFit { by } => Some(by),
        _ => None,
    };
    let (short_by, placement) = match (over(stage.need, Some(budget)), over(stage.device_need, device)) {
        (Some(host), Some(dev)) if dev > host => (dev, Placement::Device),
        (Some(host), _) => (host, Placement::Host),
        (None, Some(dev)) => (dev, Placement::Device),
        (None, None) => return None,
    };
    let listed = &pipeline.stages[index].models;
    let resident: Vec<&Model> = stage.resident.iter().filter_map(|name| pipeline.model(name)).collect();
    let (used, kept): (Vec<&Model>, Vec<&Model>) = resident.iter().partition(|m| listed.contains(&m.name));
    let mut options = Vec::new();
    let unpin = bytes_on(&resident, placement).saturating_sub(bytes_on(&used, placement));
    if unpin > 0 {
        let names: Vec<&str> = kept.iter().map(|m| m.name.as_str()).collect();
        options.push((format!("unpin {} here (kept, not used by this stage)", names.join(", ")), unpin));
    }
    for model in used.iter().filter(|m| m.placement == placement) {
        let saves = bf16_saving(model, &used);
        if saves > 0 {
            options.push((format!("load {} as bf16 (dtype = \"bf16\")", model.name), saves));
        }
    }
    let together_fits = total(options.iter().map(|(_, saves)| *saves)) >= short_by;
    Some(Remedy { short_by, options, together_fits })
}

/// The same pipeline with every model loaded up front.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EagerPlan {
    /// Host bytes of every model's weights.
    pub weights: u64,
    /// Device bytes of every model's weights.
    pub device_weights: u64,
    /// The largest need over the stages: every weight plus the stage's working memory, plus the
    /// pipeline's reserve.
    pub need: u64,
    /// The same on the device.
    pub device_need: u64,
    /// `need` and `device_need` before the reserve is added.
    #[serde(default)]
    pub need_before_reserve: u64,
    /// `device_need` before the reserve is added.
    #[serde(default)]
    pub device_need_before_reserve: u64,
    /// The stage where the largest need falls.
    pub peak_stage: String,
    /// Each stage occurrence's need with every model loaded, in the file's order (what the guard
    /// holds an eager run's stage to).
    #[serde(default)]
    pub stages: Vec<EagerStage>,
    /// Bytes read from disk: every model's checkpoints, once.
    pub read: u64,
    /// How `need` meets the host budget.
    pub verdict: Verdict,
    /// How `device_need` meets the device budget.
    pub device_verdict: Verdict,
}

/// One stage occurrence of the eager run: every model's weights plus the stage's working
/// memory, plus the pipeline's reserve.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EagerStage {
    /// The stage's name.
    pub name: String,
    /// Host bytes.
    pub need: u64,
    /// Device bytes.
    pub device_need: u64,
}

/// The whole plan; its JSON form is `stageload plan --json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// Version of this JSON form.
    pub schema: u32,
    /// The pipeline file planned.
    pub pipeline: PathBuf,
    /// The checked models.
    pub models: Vec<Model>,
    /// The host memory checked against.
    pub budget: Budget,
    /// The device memory checked against (`None`: not given).
    pub device_budget: Option<Budget>,
    /// The staged run, stage by stage.
    pub stages: Vec<StagePlan>,
    /// The stage with the largest host need.
    pub peak_stage: String,
    /// That need, bytes.
    pub peak_need: u64,
    /// The largest device need over the stages, bytes.
    pub device_peak_need: u64,
    /// Bytes read from disk over the whole staged run, reloads included.
    pub read: u64,
    /// The same pipeline loaded up front, for comparison.
    pub eager: EagerPlan,
    /// Every stage fits (now, or once other processes free memory) on the host and the device.
    pub fits: bool,
    /// Where the working memory came from, when a recorded run gave it (`--from-trace`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub working_from: Option<String>,
    /// The pipeline's host tier against its largest device model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_tier: Option<TierPlan>,
}

/// Bytes the models on `placement` hold together, a file several of them list counted once.
pub(crate) fn bytes_on(models: &[&Model], placement: Placement) -> u64 {
    let mut seen = std::collections::HashSet::new();
    let on = models.iter().filter(|m| m.placement == placement);
    let whole =
        on.clone().filter(|m| m.streamed.is_none()).flat_map(|m| &m.parts).filter(|part| seen.insert(&part.file));
    let built = on.clone().filter(|m| m.built()).map(|m| m.bytes);
    let streamed = on.filter_map(|m| m.streamed.as_ref().map(|s| s.held));
    total(whole.map(|part| part.bytes).chain(built).chain(streamed))
}

/// Bytes read to load `loading` while `resident` are held: files already held are not read again.
fn read_for(loading: &[&Model], resident: &[&Model]) -> u64 {
    let mut held: std::collections::HashSet<&PathBuf> =
        resident.iter().flat_map(|m| m.parts.iter().map(|p| &p.file)).collect();
    total(loading.iter().flat_map(|m| &m.parts).filter(|part| held.insert(&part.file)).map(|part| part.file_bytes))
}

/// The stage with the largest `need` (host or device), the earliest on a tie: the plan's peak,
/// and the stage a request names ([`crate::request`]).
pub fn peak(stages: &[StagePlan], need: impl Fn(&StagePlan) -> u64) -> Option<&StagePlan> {
    // `max_by_key` keeps the last of equal keys, hence `rev`.
    stages.iter().rev().max_by_key(|s| need(s))
}

/// Plans `pipeline` against `budget` (and `device_budget` for models on a GPU).
pub fn plan(pipeline: &Pipeline, budget: Budget, device_budget: Option<Budget>) -> Plan {
    // A pipeline from `Pipeline::load` names only its own models; unknown names count nothing.
    let models_of =
        |names: &[String]| -> Vec<&Model> { names.iter().filter_map(|name| pipeline.model(name)).collect() };
    let mut resident: Vec<String> = Vec::new();
    let mut ever_loaded: Vec<String> = Vec::new();
    let mut stages = Vec::new();
    let reserve = |need: u64| pipeline.reserve.map_or(need, |r| r.on(need));
    let mut tier = pipeline.host_tier.map(Tier::<()>::new);
    // Models without a checkpoint whose snapshot is written, as the registry writes them.
    let mut snapshotted: Vec<String> = Vec::new();
    let built = |name: &String| pipeline.model(name).is_some_and(Model::built);
    for (index, stage) in pipeline.stages.iter().enumerate() {
        let pinned = pipeline.pinned_at(index);
        let keep = |name: &String| stage.models.contains(name) || pinned.contains(&name);
        let released: Vec<String> = resident.iter().filter(|name| !keep(name)).cloned().collect();
        resident.retain(|name| keep(name));
        let loaded: Vec<String> = stage.models.iter().filter(|name| !resident.contains(name)).cloned().collect();
        let reloaded: Vec<String> = loaded.iter().filter(|name| ever_loaded.contains(name)).cloned().collect();
        let (from_tier, tier_bytes) = match tier.as_mut() {
            Some(tier) => {
                // As the registry: each release stored when it fits (oldest copies evicted), each
                // reload from the tier gives its copy up.
                for model in models_of(&released).into_iter().filter(|m| m.tiered()) {
                    if let Ok(admitted) = tier.admit(&model.name, model.held(), &Default::default()) {
                        tier.fill(&model.name, admitted.ticket, ());
                    }
                }
                let held = tier.used();
                (reloaded.iter().filter(|name| tier.forget(name).is_some()).cloned().collect(), held)
            }
            None => (Vec::new(), 0),
        };
        // As the registry: a release that leaves no tier copy writes the model's snapshot once.
        let in_tier = |name: &String| tier.as_ref().is_some_and(|tier| tier.ready(name));
        let snapshots: Vec<String> = match pipeline.snapshot_dir {
            Some(_) => {
                released.iter().filter(|n| built(n) && !in_tier(n) && !snapshotted.contains(n)).cloned().collect()
            }
            None => Vec::new(),
        };
        snapshotted.extend(snapshots.iter().cloned());
        let not_in_tier = reloaded.iter().filter(|name| !from_tier.contains(name) && built(name));
        let (from_snapshot, rebuilt): (Vec<String>, Vec<String>) =
            not_in_tier.cloned().partition(|name| snapshotted.contains(name));
        let from_disk: Vec<String> = loaded.iter().filter(|name| !from_tier.contains(name)).cloned().collect();
        let snapshot_reads = total(models_of(&from_snapshot).iter().map(|m| m.bytes));
        let read = read_for(&models_of(&from_disk), &models_of(&resident)).saturating_add(snapshot_reads);
        resident.extend(loaded.iter().cloned());
        ever_loaded.extend(loaded.iter().filter(|name| !ever_loaded.contains(name)).cloned().collect::<Vec<_>>());
        let resident_models = models_of(&resident);
        let weights = bytes_on(&resident_models, Placement::Host);
        let device_weights = bytes_on(&resident_models, Placement::Device);
        // A streamed model on CUDA keeps every block's pinned copy in host memory: like the
        // tier's copies, host memory the stage needs beside its weights.
        let pinned_copies = total(resident_models.iter().filter_map(|m| m.streamed.as_ref().map(|s| s.host_copies)));
        let need_before_reserve = total([weights, tier_bytes, pinned_copies, stage.working]);
        let device_need_before_reserve = device_weights.saturating_add(stage.device_working);
        let (need, device_need) = (reserve(need_before_reserve), reserve(device_need_before_reserve));
        stages.push(StagePlan {
            name: stage.name.clone(),
            resident: resident.clone(),
            read,
            loaded,
            reloaded,
            released,
            from_tier,
            from_snapshot,
            rebuilt,
            snapshots,
            tier: tier_bytes,
            weights,
            need,
            device_weights,
            device_need,
            need_before_reserve,
            device_need_before_reserve,
            verdict: Verdict::of(need, Some(&budget)),
            device_verdict: Verdict::of(device_need, device_budget.as_ref()),
            remedy: None,
        });
        let planned = stages.len() - 1;
        stages[planned].remedy = remedy(pipeline, index, &stages[planned], &budget, device_budget.as_ref());
    }
    let (peak_stage, peak_need) = peak(&stages, |s| s.need).map_or((String::new(), 0), |s| (s.name.clone(), s.need));
    let all: Vec<&Model> = pipeline.models.iter().collect();
    let (all_host, all_device) = (bytes_on(&all, Placement::Host), bytes_on(&all, Placement::Device));
    let (eager_stage, eager_working) = pipeline
        .stages
        .iter()
        .rev()
        .max_by_key(|s| s.working)
        .map_or((String::new(), 0), |s| (s.name.clone(), s.working));
    let eager_before_reserve = all_host.saturating_add(eager_working);
    let eager_device_before_reserve =
        all_device.saturating_add(pipeline.stages.iter().map(|s| s.device_working).max().unwrap_or(0));
    let (eager_need, eager_device_need) = (reserve(eager_before_reserve), reserve(eager_device_before_reserve));
    let eager = EagerPlan {
        weights: all_host,
        device_weights: all_device,
        need: eager_need,
        device_need: eager_device_need,
        need_before_reserve: eager_before_reserve,
        device_need_before_reserve: eager_device_before_reserve,
        peak_stage: eager_stage,
        stages: pipeline
            .stages
            .iter()
            .map(|stage| EagerStage {
                name: stage.name.clone(),
                need: reserve(all_host.saturating_add(stage.working)),
                device_need: reserve(all_device.saturating_add(stage.device_working)),
            })
            .collect(),
        read: read_for(&all, &[]),
        verdict: Verdict::of(eager_need, Some(&budget)),
        device_verdict: Verdict::of(eager_device_need, device_budget.as_ref()),
    };
    let host_tier = pipeline.host_tier.map(|budget| TierPlan::of(pipeline, budget));
    Plan {
        schema: SCHEMA_VERSION,
        pipeline: pipeline.path.clone(),
        models: pipeline.models.clone(),
        budget,
        device_budget,
        peak_stage,
        peak_need,
        device_peak_need: peak(&stages, |s| s.device_need).map_or(0, |s| s.device_need),
        read: total(stages.iter().map(|s| s.read)),
        fits: stages.iter().all(|s| s.verdict.fits() && s.device_verdict.fits())
            && host_tier.as_ref().is_none_or(TierPlan::fits),
        host_tier,
        stages,
        eager,
        working_from: None,
    }
}
