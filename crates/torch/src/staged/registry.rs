//! The registry: slots by name, stage entry, loads and releases, carried out as
//! [`super::decide`] says.
//!
//! Locking. The state lock (`Inner::state`) guards the slots, stages, pins and the host tier's
//! bookkeeping (its copies run with the lock let go, see [`super::tier_store`]); it is held for
//! bookkeeping only, never while a model is built, read from disk, freed, or in use, and never
//! while waiting for another thread: a `get` of a model another thread is loading waits on the
//! `changed` condition variable, which gives the lock up while it waits. A release takes the
//! model's own lock with `try_lock`; when a user holds the model (this thread or another), the
//! release is left to that user's guard, which frees the weights when it drops, so `enter` never
//! blocks and the rest of the registry stays usable. Lock order: an instance's `body` → the
//! state lock → an instance's `ctl` / `weights`; `build_lock` (builds are serialised because the
//! RNG state they preserve is process-wide) is taken with no other lock held.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

use tch::{Device, Kind, Tensor};

use super::decide::{self, Finish, GetAction, GetContext, ModelState, Refusal, SlotState};
use super::error::{panic_message, Result, StageError};
use super::instance::{Handle, Instance, ReleaseMark};
use super::spec::{BuildContext, Built, Loader, SharedComponents};
use super::tier_copy::{self, HostCopies};
use crate::checkpoint::{Checkpoint, Progress};
use crate::names::NameRules;
use crate::rng::{PreservedRng, RngSnapshot};
use crate::storage::{self, shallow, ReleaseStats};
use crate::sync::lock;
use stageload_plan::tier::Tier;
use stageload_trace::event::{Event, EventKind, EventSink, LoadReport, ReloadFrom, TierUsage};

/// Told how far a checkpoint load has come: the model and bytes done of the total.
pub(crate) type ProgressHook = dyn Fn(&str, Progress) + Send + Sync;

/// One model's slot and what it needs to (re)load.
pub(crate) struct Entry {
    pub(crate) name: String,
    pub(crate) loader: Option<Arc<Loader>>,
    pub(crate) checkpoint: Vec<PathBuf>,
    pub(crate) names: NameRules,
    pub(crate) placement: Placement,
    pub(crate) skip_init: bool,
    pub(crate) slot: decide::Slot<Arc<Instance>>,
    pub(crate) report: Option<LoadReport>,
}

/// Where the pipeline file puts a model and in which dtype (both optional).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Placement {
    pub(crate) device: Option<Device>,
    pub(crate) kind: Option<Kind>,
}

impl Placement {
    /// From the file's `device` (`cpu`, `cuda`, `cuda:N`, `mps`) and `dtype` (a float dtype).
    pub(crate) fn from_file(device: &str, dtype: Option<&str>) -> std::result::Result<Placement, String> {
        let device = crate::meter::device_from_name(device)
            .ok_or_else(|| format!("unknown device '{device}' (cpu, cuda, cuda:N or mps)"))?;
        let kind = match dtype.map(str::to_ascii_lowercase).as_deref() {
            None => None,
            Some("f16" | "float16" | "half") => Some(Kind::Half),
            Some("bf16" | "bfloat16") => Some(Kind::BFloat16),
            Some("f32" | "float32" | "float") => Some(Kind::Float),
            Some("f64" | "float64" | "double") => Some(Kind::Double),
            Some(other) => {
                return Err(format!("dtype '{other}': the registry converts float entries only (f16, bf16, f32, f64)"))
            }
        };
        if let Some(kind) = kind.filter(|&kind| !crate::checkpoint::device_holds(device, kind)) {
            return Err(format!(
                "dtype {kind:?}: {} cannot hold it; choose f32, f16 or bf16",
                crate::meter::device_name(device)
            ));
        }
        Ok(Placement { device: Some(device), kind })
    }

    /// Checks that `tensors` are on the file's device and converts the float ones to its dtype
    /// (in place: every handle on them sees the new data, as `VarStore::set_kind` does).
    fn apply(&self, model: &str, tensors: &mut [(String, Tensor)]) -> Result<()> {
        let mismatch = |message: String| StageError::PlanMismatch { model: model.to_string(), message };
        for (name, tensor) in tensors.iter_mut() {
            if let Some(device) = self.device {
                if tensor.device() != device {
                    return Err(mismatch(format!(
                        "the file places it on {}, its loader built '{name}' on {}: build on BuildContext::device() (or change the file)",
                        crate::meter::device_name(device),
                        crate::meter::device_name(tensor.device())
                    )));
                }
            }
            if let Some(kind) = self.kind {
                let float = crate::checkpoint::is_float(tensor.kind());
                if float && tensor.kind() != kind {
                    let _no_grad = tch::no_grad_guard();
                    let converted =
                        tensor.f_to_kind(kind).map_err(|e| mismatch(format!("converting '{name}': {e}")))?;
                    tensor.f_set_data(&converted).map_err(|e| mismatch(format!("converting '{name}': {e}")))?;
                }
            }
        }
        Ok(())
    }
}

/// What a load of one model needs besides its loader, taken from its entry under the lock.
pub(crate) struct Recipe {
    checkpoint: Vec<PathBuf>,
    names: NameRules,
    skip_init: bool,
    placement: Placement,
}

pub(crate) struct State {
    pub(crate) entries: Vec<Entry>,
    pub(crate) index: HashMap<String, usize>,
    /// Each stage name's models, as its first occurrence lists them.
    pub(crate) stages: BTreeMap<String, BTreeSet<String>>,
    /// The stages in the order the run enters them (a name may come back), each occurrence with
    /// its own models.
    pub(crate) sequence: Vec<(String, BTreeSet<String>)>,
    /// Pins for the whole run (the builder's and `pin`'s).
    pub(crate) pinned: BTreeSet<String>,
    /// Pins over a span of the sequence: (model, from, until).
    pub(crate) spans: Vec<(String, usize, Option<usize>)>,
    pub(crate) current: Option<String>,
    /// The occurrence of the sequence entered last.
    pub(crate) position: Option<usize>,
    pub(crate) closed: bool,
    pub(crate) next_ticket: u64,
    /// Host copies of released device models (`None`: no host tier).
    pub(crate) tier: Option<Tier<HostCopies>>,
}

impl State {
    fn position(&self, name: &str) -> Result<usize> {
        self.index.get(name).copied().ok_or_else(|| StageError::UnknownModel {
            name: name.to_string(),
            known: self.entries.iter().map(|e| e.name.clone()).collect(),
        })
    }

    fn entry_mut(&mut self, name: &str) -> Option<&mut Entry> {
        self.index.get(name).copied().map(|i| &mut self.entries[i])
    }

    fn planned_here(&self, name: &str) -> bool {
        match (&self.current, self.position) {
            (None, _) => true,
            (Some(_), Some(index)) => self.pinned_at(index).contains(name) || self.sequence[index].1.contains(name),
            (Some(stage), None) => {
                self.pinned.contains(name) || self.stages.get(stage).is_some_and(|m| m.contains(name))
            }
        }
    }

    /// The models pinned now: at the occurrence entered last, else for the whole run.
    pub(super) fn pinned_now(&self) -> BTreeSet<String> {
        self.position.map_or_else(|| self.pinned.clone(), |index| self.pinned_at(index))
    }

    pub(super) fn tier_usage(&self) -> Option<TierUsage> {
        self.tier.as_ref().map(|tier| TierUsage { budget: tier.budget(), used: tier.used() })
    }

    /// The models pinned at occurrence `index`: the whole run's and the spans holding there.
    fn pinned_at(&self, index: usize) -> BTreeSet<String> {
        let spans = self.spans.iter().filter(|(_, from, until)| index >= *from && until.is_none_or(|u| index < u));
        self.pinned.iter().cloned().chain(spans.map(|(model, _, _)| model.clone())).collect()
    }

    /// The occurrence `stage` names when entered now: the next one after the current position,
    /// else (a run that starts over, or enters out of order) its first.
    fn occurrence(&self, stage: &str) -> Option<usize> {
        let next = self.position.map_or(0, |p| p + 1);
        let after = self.sequence.iter().skip(next).position(|(s, _)| s == stage).map(|i| next + i);
        after.or_else(|| self.sequence.iter().position(|(s, _)| s == stage))
    }

    /// Instances whose storages are live (resident, or released with the release pending).
    fn holding(&self) -> impl Iterator<Item = &Arc<Instance>> {
        self.entries.iter().filter_map(|e| decide::holds_storage(&e.slot.state))
    }

    fn resident_bytes(&self) -> u64 {
        let mut seen = HashSet::new();
        self.holding()
            .flat_map(|i| i.storage_sizes.iter())
            .filter(|(id, _)| seen.insert(*id))
            .map(|(_, bytes)| bytes)
            .sum()
    }

    fn remove_entry(&mut self, position: usize) -> Entry {
        let entry = self.entries.remove(position);
        self.pinned.remove(&entry.name);
        self.index = self.entries.iter().enumerate().map(|(i, e)| (e.name.clone(), i)).collect();
        entry
    }

    /// Marks `instance` for release at the current stage; the caller carries the release out
    /// with the state lock dropped.
    fn request_release(&mut self, position: usize) -> Option<Arc<Instance>> {
        let stage = self.current.clone();
        let entry = &mut self.entries[position];
        let SlotState::Resident(instance) = &entry.slot.state else {
            return None;
        };
        let instance = Arc::clone(instance);
        lock(&instance.ctl).mark = ReleaseMark::Requested(stage.clone());
        entry.slot.state = SlotState::Released { stage, instance: Arc::clone(&instance), pending: true };
        Some(instance)
    }
}

/// The registry's shared inside; [`super::StagedModels`] is its face.
pub(crate) struct Inner {
    pub(crate) state: Mutex<State>,
    pub(crate) changed: Condvar,
    pub(crate) build_lock: Mutex<()>,
    pub(crate) components: SharedComponents,
    pub(crate) sink: Option<Arc<dyn EventSink>>,
    pub(crate) rngs: Vec<Arc<dyn RngSnapshot>>,
    pub(crate) preserve_rng: bool,
    pub(crate) strict: bool,
    pub(crate) progress: Option<Arc<ProgressHook>>,
    /// After each `enter`, prefetch the next stage of the plan.
    pub(crate) prefetch_next: bool,
    /// Prefetch only while the resident weights, the stage's working memory and the prefetched
    /// ones stay within this.
    pub(crate) prefetch_budget: Option<u64>,
    /// Working memory per stage (declared or measured), left free by a prefetch.
    pub(crate) stage_working: std::collections::BTreeMap<String, u64>,
    /// What a load that runs out of memory does.
    pub(crate) out_of_memory: decide::OutOfMemory,
    /// Background loads still running (joined when the registry is dropped).
    pub(crate) prefetching: Mutex<Vec<std::thread::JoinHandle<()>>>,
    /// The host tier said once that it does not hold CPU models.
    pub(crate) tier_said_cpu: std::sync::atomic::AtomicBool,
    /// Unit tests: the host tier holds CPU models too (no device here to test it with).
    #[cfg(test)]
    pub(crate) tier_on_cpu: bool,
}

/// Why a load runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Purpose {
    /// A `get` (or `load`) of the current stage.
    Use,
    /// A background load for a stage about to begin.
    Prefetch,
}

/// What a load started under the state lock needs once the lock is dropped.
enum LoadPlan {
    Build {
        reload: bool,
        loader: Arc<Loader>,
    },
    /// In place, from the host tier's copies (leased) or else the checkpoint.
    Refill(Arc<Instance>, Option<HostCopies>),
}

impl Inner {
    pub(crate) fn state(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    pub(crate) fn emit(&self, event: Event) {
        if let Some(sink) = &self.sink {
            sink.emit(&event);
        }
    }

    /// The instance of `name`, loaded or brought back if needed (see [`decide::on_get`]).
    pub(crate) fn instance(self: &Arc<Self>, name: &str) -> Result<Arc<Instance>> {
        match self.instance_for(name, Purpose::Use) {
            Err(StageError::OutOfMemory { .. }) if decide::retry_out_of_memory(self.out_of_memory, false) => {
                self.release_unlisted();
                self.instance_for(name, Purpose::Use)
            }
            other => other,
        }
    }

    /// Releases the unpinned resident models the current stage does not list (the
    /// out-of-memory policy's remedy).
    fn release_unlisted(&self) {
        let mut state = self.state();
        let positions: Vec<usize> =
            (0..state.entries.len()).filter(|&p| !state.planned_here(&state.entries[p].name)).collect();
        let instances: Vec<Arc<Instance>> = positions.into_iter().filter_map(|p| state.request_release(p)).collect();
        drop(state);
        self.release_all(instances);
    }

    pub(crate) fn instance_for(self: &Arc<Self>, name: &str, purpose: Purpose) -> Result<Arc<Instance>> {
        let prefetch = purpose == Purpose::Prefetch;
        let mut state = self.state();
        let (ticket, plan, recipe) = loop {
            let position = state.position(name)?;
            let planned_here = prefetch || state.planned_here(name);
            let in_tier = state.tier.as_ref().is_some_and(|tier| tier.ready(name));
            let ctx = GetContext { closed: state.closed, strict: self.strict, planned_here, in_tier };
            let entry = &state.entries[position];
            let plan = match decide::on_get(&entry.slot, ctx) {
                GetAction::Use(instance) => return Ok(instance),
                GetAction::Wait => {
                    state = crate::sync::wait(&self.changed, state);
                    continue;
                }
                GetAction::Revive(instance) => {
                    let mut ctl = lock(&instance.ctl);
                    if matches!(ctl.mark, ReleaseMark::Requested(_)) {
                        ctl.mark = ReleaseMark::Live;
                        drop(ctl);
                        state.entries[position].slot.state = SlotState::Resident(Arc::clone(&instance));
                        self.changed.notify_all();
                        return Ok(instance);
                    }
                    // Its storages are being freed right now: wait for that to finish.
                    drop(ctl);
                    state = crate::sync::wait(&self.changed, state);
                    continue;
                }
                GetAction::Refuse(Refusal::Closed) => return Err(StageError::Closed { model: name.to_string() }),
                GetAction::Refuse(Refusal::OutsideStage) => {
                    return Err(StageError::OutsideStage {
                        model: name.to_string(),
                        stage: state.current.clone().unwrap_or_default(),
                    })
                }
                GetAction::Refuse(Refusal::NoLoader { stage }) => {
                    return Err(StageError::NoLoader { model: name.to_string(), stage })
                }
                GetAction::Refill(instance) => {
                    let copies = state.tier.as_mut().and_then(|tier| tier.lease(name)).map(HostCopies::shallow);
                    LoadPlan::Refill(instance, copies)
                }
                GetAction::Build { reload } => match &entry.loader {
                    Some(loader) => LoadPlan::Build { reload, loader: Arc::clone(loader) },
                    None => return Err(StageError::NoLoader { model: name.to_string(), stage: None }),
                },
            };
            state.next_ticket += 1;
            let ticket = state.next_ticket;
            let entry = &mut state.entries[position];
            entry.slot.state = decide::start_load(&entry.slot, ticket);
            let recipe = Recipe {
                checkpoint: entry.checkpoint.clone(),
                names: entry.names.clone(),
                skip_init: entry.skip_init,
                placement: entry.placement,
            };
            break (ticket, plan, recipe);
        };
        let stage = state.current.clone();
        let outside_stage = !prefetch && !state.planned_here(name);
        drop(state);

        let started = Instant::now();
        let result = match &plan {
            LoadPlan::Build { loader, .. } => {
                let _one_build_at_a_time = lock(&self.build_lock);
                // A prefetched build draws nothing (skip_init, see decide::on_prefetch): it must
                // not save and restore the generators the foreground is drawing from.
                self.build(name, loader, &recipe, self.preserve_rng && !prefetch)
            }
            LoadPlan::Refill(instance, copies) => self
                .refill(instance, &recipe.checkpoint, &recipe.names, copies.as_ref())
                .map(|(bytes, report)| (Arc::clone(instance), bytes, report)),
        };
        let seconds = started.elapsed().as_secs_f64();

        let mut state = self.state();
        // A reload from the tier gives its copy up (the weights are on the device again); a
        // failed one leaves it for the next try.
        let from_tier = matches!(plan, LoadPlan::Refill(_, Some(_)));
        let mut restored = None;
        if let (true, Some(tier)) = (from_tier, state.tier.as_mut()) {
            match result {
                Ok(_) => restored = tier.forget(name),
                Err(_) => tier.unlease(name),
            }
        }
        let tier = if from_tier { state.tier_usage() } else { None };
        let position = state.index.get(name).copied();
        let outcome = result.as_ref().map(|(instance, ..)| Arc::clone(instance)).map_err(|e| e.to_string());
        let finish = decide::on_load_finished(position.map(|p| &state.entries[p].slot), ticket, outcome);
        self.changed.notify_all();
        let Finish::Install(installed) = finish else {
            drop(state);
            // An insert or a remove overtook this load: what it built is dropped.
            return match result {
                Ok(_) => self.instance(name),
                Err(err) => Err(err),
            };
        };
        let entry = &mut state.entries[position.expect("a load installs only into a slot that exists")];
        entry.slot.state = installed;
        match result {
            Ok((instance, bytes, report)) => {
                entry.slot.loads += 1;
                entry.report = report.clone();
                let resident = state.resident_bytes();
                drop(state);
                drop(restored);
                let (kind, from) = match plan {
                    LoadPlan::Build { reload: false, .. } => (EventKind::Load, None),
                    LoadPlan::Build { reload: true, .. } => (EventKind::Reload, Some(ReloadFrom::Rebuilt)),
                    LoadPlan::Refill(_, Some(_)) => (EventKind::Reload, Some(ReloadFrom::HostTier)),
                    LoadPlan::Refill(_, None) => (EventKind::Reload, Some(ReloadFrom::InPlace)),
                };
                self.emit(Event {
                    stage,
                    model: Some(name.to_string()),
                    bytes: Some(bytes),
                    seconds: Some(seconds),
                    from,
                    outside_stage,
                    prefetched: prefetch,
                    report,
                    resident: Some(resident),
                    tier,
                    ..Event::now(kind)
                });
                Ok(instance)
            }
            Err(err) => {
                drop(state);
                let err = match err {
                    StageError::OutOfMemory { .. } => err,
                    other if decide::is_out_of_memory(&other.to_string()) => StageError::OutOfMemory {
                        model: name.to_string(),
                        stage: stage.clone(),
                        message: other.to_string(),
                    },
                    other => other,
                };
                self.emit(Event {
                    stage,
                    model: Some(name.to_string()),
                    seconds: Some(seconds),
                    note: Some(err.to_string()),
                    ..Event::now(EventKind::Error)
                });
                Err(err)
            }
        }
    }

    /// Runs a loader under preserved RNG, catching panics, and fills the model from its
    /// checkpoint. Returns the instance, the bytes it brought in, and the load report.
    fn build(
        self: &Arc<Self>,
        name: &str,
        loader: &Arc<Loader>,
        recipe: &Recipe,
        preserve_rng: bool,
    ) -> Result<(Arc<Instance>, u64, Option<LoadReport>)> {
        let Recipe { checkpoint, names, skip_init, placement } = recipe;
        let _rng = if preserve_rng { Some(PreservedRng::save(&self.rngs).map_err(StageError::Rng)?) } else { None };
        let context = BuildContext {
            components: &self.components,
            model: name,
            device: placement.device,
            shared_tensors: Mutex::new(Vec::new()),
        };
        let run = || {
            if *skip_init {
                stageload_torch_sys::without_init(|| loader(&context))
            } else {
                loader(&context)
            }
        };
        let mut built = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)) {
            Ok(Ok(built)) => built,
            Ok(Err(source)) => return Err(StageError::LoaderFailed { model: name.to_string(), source }),
            Err(panic) => {
                return Err(StageError::LoaderPanicked { model: name.to_string(), message: panic_message(&*panic) })
            }
        };
        let shared = context.shared_tensors.into_inner().unwrap_or_else(|e| e.into_inner());
        // Shared components built by this build are this model's to place and convert too
        // (shallow copies: the conversion reaches every holder).
        let mut fresh: Vec<(String, Tensor)> =
            shared.iter().filter(|(_, _, fresh)| *fresh).map(|(n, t, _)| (n.clone(), t.shallow_clone())).collect();
        placement.apply(name, &mut built.tensors)?;
        placement.apply(name, &mut fresh)?;
        let mut report = None;
        if !checkpoint.is_empty() {
            let mut targets = shallow(&built.tensors);
            targets.extend(fresh);
            // Shared components another model loaded are not filled again, and a model built
            // without initial values must get every tensor from the file.
            let names = names
                .clone()
                .filled_elsewhere(shared.iter().filter(|(_, _, fresh)| !fresh).map(|(n, _, _)| n.clone()))
                .strict(names.strict || *skip_init);
            report = Some(self.load_checkpoint(name, checkpoint, &targets, &names)?);
        }
        // Shared components another model already built are not loaded again: not counted.
        let reused: Vec<(String, Tensor)> =
            shared.iter().filter(|(_, _, fresh)| !fresh).map(|(n, t, _)| (n.clone(), t.shallow_clone())).collect();
        let reused: HashSet<u64> = storage::distinct_storages(&reused)
            .map_err(|source| StageError::Torch { model: name.to_string(), source })?
            .iter()
            .map(|r| r.id)
            .collect();
        built.tensors.extend(shared.into_iter().map(|(n, t, _)| (n, t)));
        let instance = Instance::new(name, built, Arc::downgrade(self))?;
        let bytes = instance.storage_sizes.iter().filter(|(id, _)| !reused.contains(id)).map(|(_, bytes)| bytes).sum();
        Ok((instance, bytes, report))
    }

    fn load_checkpoint(
        &self,
        model: &str,
        files: &[PathBuf],
        targets: &[(String, Tensor)],
        names: &NameRules,
    ) -> Result<LoadReport> {
        let wrap = |source| StageError::Checkpoint { model: model.to_string(), source: Box::new(source) };
        let checkpoint = Checkpoint::open(files).map_err(wrap)?;
        let report = checkpoint
            .load_named(targets, names, |progress| {
                if let Some(hook) = &self.progress {
                    hook(model, progress)
                }
            })
            .map_err(wrap)?;
        if !report.unused.is_empty() || !report.missing.is_empty() {
            tracing::warn!(model, unused = ?report.unused, missing = ?report.missing, "checkpoint and model names differ (lenient load)");
        }
        Ok(report)
    }

    /// Brings a released instance back in place: reallocates its freed storages and refills
    /// them from its host tier `copies` when it has them, else from the checkpoint. On failure
    /// the instance stays released as it was.
    fn refill(
        &self,
        instance: &Arc<Instance>,
        checkpoint: &[PathBuf],
        names: &NameRules,
        copies: Option<&HostCopies>,
    ) -> Result<(u64, Option<LoadReport>)> {
        let name = &instance.name;
        let torch = |source| StageError::Torch { model: name.clone(), source };
        // Waits only for a release of this very instance still freeing its storages.
        let body = lock(&instance.body);
        let weights = lock(&instance.weights);
        // SAFETY: the body lock keeps every caller of the model away until the refill below has
        // filled these storages (or freed them again).
        let reallocated = unsafe { storage::reallocate(&weights.storages) }.map_err(torch)?;
        let targets: Vec<(String, Tensor)> = weights
            .tensors
            .iter()
            .filter(|(_, t)| stageload_torch_sys::storage_info(t).is_ok_and(|i| reallocated.contains(&i.id)))
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect();
        let filled = match copies {
            Some(copies) => {
                let device = targets.first().map_or(Device::Cpu, |(_, t)| t.device());
                tier_copy::copy_in(&targets, copies, device)
                    .map(|()| None)
                    .map_err(|message| StageError::HostTier { model: name.clone(), message })
            }
            None => self.load_checkpoint(name, checkpoint, &targets, names).map(Some),
        };
        let report = match filled {
            Ok(report) => report,
            Err(err) => {
                let stage = instance.mark().stage().flatten();
                let message = released_message(name, &stage);
                // SAFETY: still under the body lock; nothing has used the half-filled storages.
                unsafe { storage::free_ids(&weights.storages, &reallocated, &message) }.map_err(torch)?;
                return Err(err);
            }
        };
        let bytes = weights.storages.iter().filter(|s| reallocated.contains(&s.id)).map(|s| s.nbytes as u64).sum();
        drop(weights);
        lock(&instance.ctl).mark = ReleaseMark::Live;
        drop(body);
        Ok((bytes, report))
    }

    /// Frees a released instance's storages now, or leaves that to the guard holding it (see the
    /// module docs). Returns what was freed, or `None` when the release was left to a guard or
    /// the model was taken back meanwhile.
    pub(crate) fn release_instance(&self, instance: &Arc<Instance>) -> Option<ReleaseStats> {
        let mut ctl = lock(&instance.ctl);
        let ReleaseMark::Requested(stage) = ctl.mark.clone() else {
            return None;
        };
        let body = instance.try_body();
        if decide::on_release(body.is_some()) == decide::ReleaseWhen::WhenUnlocked {
            return None;
        }
        let body = body?;
        ctl.mark = ReleaseMark::Freed(stage.clone());
        drop(ctl);

        self.store_in_tier(instance, &stage);
        let started = Instant::now();
        let keep: HashSet<u64> =
            self.state().holding().filter(|i| !Arc::ptr_eq(i, instance)).flat_map(|i| i.storage_ids()).collect();
        let message = released_message(&instance.name, &stage);
        // SAFETY: the body lock is held, so no caller of this model runs; storages another
        // resident model holds are in `keep` and stay.
        let result = unsafe { storage::release(&lock(&instance.weights).storages, &keep, &message) };
        if result.as_ref().is_ok_and(|stats| stats.freed > 0) {
            // Before the event, so that a meter reading at the event sees the memory gone.
            stageload_torch_sys::trim_host_heap();
            // Device allocators keep freed blocks cached: hand them back to the device.
            if stageload_torch_sys::cuda_device_count().unwrap_or(0) > 0 {
                if let Err(err) = stageload_torch_sys::cuda_empty_cache() {
                    tracing::warn!(%err, "emptying the CUDA cache after a release failed");
                }
            }
            if stageload_torch_sys::mps_available().unwrap_or(false) {
                if let Err(err) = stageload_torch_sys::mps_empty_cache() {
                    tracing::warn!(%err, "emptying the MPS cache after a release failed");
                }
            }
        }
        // Settled either way: a failed free leaves what it could not free allocated, and the
        // next `get` refills the rest; nobody waits for this release any longer.
        let mut state = self.state();
        if let Some(entry) = state.entry_mut(&instance.name) {
            if let SlotState::Released { instance: held, pending, .. } = &mut entry.slot.state {
                if Arc::ptr_eq(held, instance) {
                    *pending = false;
                }
            }
        }
        let resident = state.resident_bytes();
        self.changed.notify_all();
        drop(state);
        drop(body);
        let stats = match result {
            Ok(stats) => stats,
            Err(source) => {
                let err = StageError::Torch { model: instance.name.clone(), source };
                self.emit(Event {
                    stage,
                    model: Some(instance.name.clone()),
                    note: Some(err.to_string()),
                    ..Event::now(EventKind::Error)
                });
                return None;
            }
        };
        self.emit(Event {
            stage,
            model: Some(instance.name.clone()),
            bytes: Some(stats.freed),
            seconds: Some(started.elapsed().as_secs_f64()),
            kept_bytes: (stats.kept > 0).then_some(stats.kept),
            resident: Some(resident),
            ..Event::now(EventKind::Release)
        });
        Some(stats)
    }

    /// Releases `instances` (already marked), adding up what was freed now.
    pub(crate) fn release_all(&self, instances: Vec<Arc<Instance>>) -> ReleaseStats {
        let mut total = ReleaseStats::default();
        for instance in instances {
            if let Some(stats) = self.release_instance(&instance) {
                total.freed += stats.freed;
                total.kept += stats.kept;
            }
        }
        total
    }

    /// Starts background loads of `stage`'s models (see [`super::StagedModels::prefetch`]): of
    /// the occurrence that entering it now would enter. Returns the models started.
    pub(crate) fn prefetch(self: &Arc<Self>, stage: &str) -> Result<Vec<String>> {
        let state = self.state();
        let Some(index) = state.occurrence(stage) else {
            return Err(StageError::UnknownStage {
                stage: stage.to_string(),
                known: state.stages.keys().cloned().collect(),
            });
        };
        let planned = &state.sequence[index].1;
        let resident = state.resident_bytes();
        let working = state.current.as_ref().and_then(|s| self.stage_working.get(s)).copied().unwrap_or(0);
        // (name, bytes of its released instance, or its checkpoint files to measure, its CUDA
        // device) — the files are measured once the state lock is dropped.
        let mut candidates = Vec::new();
        for name in planned {
            let Some(&position) = state.index.get(name) else { continue };
            let entry = &state.entries[position];
            let in_tier = state.tier.as_ref().is_some_and(|tier| tier.ready(name));
            match decide::on_prefetch(&entry.slot, state.closed, entry.skip_init, in_tier) {
                Ok(()) => {
                    candidates.push((name.clone(), instance_bytes(entry), entry.checkpoint.clone(), cuda_device(entry)))
                }
                Err(skip) => tracing::debug!(model = name.as_str(), stage, ?skip, "not prefetched"),
            }
        }
        drop(state);
        let mut budget_left = match self.prefetch_budget {
            Some(budget) => Some(budget.saturating_sub(resident).saturating_sub(working)),
            // Working memory declared and no budget: what the machine has available now (the
            // resident weights are already out of it), less that working memory.
            None if working > 0 => {
                stageload_probe::system_memory().ok().map(|m| m.budget_available().saturating_sub(working))
            }
            None => None,
        };
        let mut started = Vec::new();
        for (name, known, files, cuda) in candidates {
            let bytes =
                known.unwrap_or_else(|| files.iter().filter_map(|f| std::fs::metadata(f).ok()).map(|m| m.len()).sum());
            if let Some(left) = budget_left.as_mut() {
                if bytes > *left {
                    tracing::debug!(
                        model = name.as_str(),
                        stage,
                        bytes,
                        left = *left,
                        "not prefetched: over the prefetch budget"
                    );
                    continue;
                }
                *left -= bytes;
            }
            started.push((name, bytes, cuda));
        }
        for (name, bytes, cuda) in &started {
            self.emit(Event {
                stage: Some(stage.to_string()),
                model: Some(name.clone()),
                bytes: Some(*bytes),
                ..Event::now(EventKind::Prefetch)
            });
            let (inner, name, cuda) = (Arc::clone(self), name.clone(), *cuda);
            let handle = std::thread::spawn(move || {
                // On CUDA the copies go on a side stream of the model's device (device 0 when
                // neither the file nor an earlier load says which), beside the foreground's kernels.
                let _side = (stageload_torch_sys::cuda_device_count().unwrap_or(0) > 0)
                    .then(|| stageload_torch_sys::cuda_side_stream(cuda.unwrap_or(0)).ok())
                    .flatten();
                // A failure stays in the slot and surfaces at the `get` that needs the model.
                let _ = inner.instance_for(&name, Purpose::Prefetch);
            });
            let mut running = lock(&self.prefetching);
            running.retain(|h| !h.is_finished());
            running.push(handle);
        }
        Ok(started.into_iter().map(|(name, _, _)| name).collect())
    }

    /// The stage after the one entered last, in the plan's sequence.
    pub(crate) fn next_stage(&self) -> Option<String> {
        let state = self.state();
        let position = state.position?;
        state.sequence.get(position + 1).map(|(name, _)| name.clone())
    }

    /// Enters `stage` (see [`super::StagedModels::enter`]).
    pub(crate) fn enter(&self, stage: &str) -> Result<ReleaseStats> {
        let mut state = self.state();
        let Some(index) = state.occurrence(stage) else {
            return Err(StageError::UnknownStage {
                stage: stage.to_string(),
                known: state.stages.keys().cloned().collect(),
            });
        };
        let planned = state.sequence[index].1.clone();
        let pinned = state.pinned_at(index);
        state.current = Some(stage.to_string());
        state.position = Some(index);
        let resident_names: Vec<&str> = state
            .entries
            .iter()
            .filter(|e| matches!(e.slot.state, SlotState::Resident(_)))
            .map(|e| e.name.as_str())
            .collect();
        let leaving = decide::leaving(resident_names, &planned, &pinned);
        let resident = state.resident_bytes();
        let positions: Vec<usize> = leaving.iter().filter_map(|n| state.index.get(n).copied()).collect();
        let instances: Vec<Arc<Instance>> = positions.into_iter().filter_map(|p| state.request_release(p)).collect();
        drop(state);
        self.emit(Event { stage: Some(stage.to_string()), resident: Some(resident), ..Event::now(EventKind::Stage) });
        Ok(self.release_all(instances))
    }

    /// Releases everything and refuses later loads (see [`super::StagedModels::close`]).
    pub(crate) fn close(&self) -> ReleaseStats {
        let mut state = self.state();
        let stage = state.current.clone();
        let resident = state.resident_bytes();
        let positions: Vec<usize> = (0..state.entries.len()).collect();
        let instances: Vec<Arc<Instance>> = positions.into_iter().filter_map(|p| state.request_release(p)).collect();
        state.current = None;
        state.closed = true;
        let copies = state.tier.as_mut().map(Tier::clear).unwrap_or_default();
        drop(state);
        tier_copy::drop_giving_back(copies);
        // A `close` mark first, so a trace does not read these releases as the tail of the last
        // stage's entry.
        self.emit(Event { stage, note: Some("close".into()), resident: Some(resident), ..Event::now(EventKind::Mark) });
        self.release_all(instances)
    }

    /// Registers a built model under `name`, replacing (and releasing) what was there.
    pub(crate) fn insert(self: &Arc<Self>, name: &str, built: Built) -> Result<()> {
        let instance = Instance::new(name, built, Arc::downgrade(self))?;
        let mut state = self.state();
        let stale = state.tier.as_mut().and_then(|tier| tier.forget(name));
        let old = match state.index.get(name).copied() {
            Some(position) => {
                let old = state.request_release(position);
                let entry = &mut state.entries[position];
                entry.slot = decide::Slot {
                    state: SlotState::Resident(instance),
                    has_loader: false,
                    has_checkpoint: false,
                    loads: 1,
                };
                entry.loader = None;
                entry.checkpoint.clear();
                entry.report = None;
                old
            }
            None => {
                let position = state.entries.len();
                state.index.insert(name.to_string(), position);
                state.entries.push(Entry {
                    name: name.to_string(),
                    loader: None,
                    checkpoint: Vec::new(),
                    names: NameRules::default(),
                    placement: Placement::default(),
                    skip_init: false,
                    slot: decide::Slot {
                        state: SlotState::Resident(instance),
                        has_loader: false,
                        has_checkpoint: false,
                        loads: 1,
                    },
                    report: None,
                });
                None
            }
        };
        self.changed.notify_all();
        drop(state);
        drop(stale);
        self.release_all(old.into_iter().collect());
        Ok(())
    }

    /// Waits until `name` is not loading; the state lock comes back held.
    fn settled(&self, name: &str) -> Result<(MutexGuard<'_, State>, usize)> {
        let mut state = self.state();
        loop {
            let position = state.position(name)?;
            if !matches!(state.entries[position].slot.state, SlotState::Loading { .. }) {
                return Ok((state, position));
            }
            state = crate::sync::wait(&self.changed, state);
        }
    }

    /// Forgets `name`; releases it first when `release`.
    pub(crate) fn remove(&self, name: &str, release: bool) -> Result<()> {
        let (mut state, position) = self.settled(name)?;
        let old = if release { state.request_release(position) } else { None };
        state.remove_entry(position);
        let stale = state.tier.as_mut().and_then(|tier| tier.forget(name));
        self.changed.notify_all();
        drop(state);
        drop(stale);
        self.release_all(old.into_iter().collect());
        Ok(())
    }

    pub(crate) fn states(&self) -> Vec<(String, ModelState)> {
        self.state().entries.iter().map(|e| (e.name.clone(), decide::model_state(&e.slot.state))).collect()
    }

    pub(crate) fn load_report(&self, name: &str) -> Result<Option<LoadReport>> {
        let state = self.state();
        let position = state.position(name)?;
        Ok(state.entries[position].report.clone())
    }

    pub(crate) fn resident_bytes(&self) -> u64 {
        self.state().resident_bytes()
    }

    pub(crate) fn handle<M: 'static>(self: &Arc<Self>, name: &str) -> Result<Handle<M>> {
        self.instance(name)?.handle::<M>()
    }
}

/// The instance a released (or failed) slot keeps for a refill in place.
pub(super) fn released(entry: &Entry) -> Option<&Arc<Instance>> {
    match &entry.slot.state {
        SlotState::Released { instance, .. } => Some(instance),
        SlotState::Failed { instance, .. } => instance.as_ref(),
        _ => None,
    }
}

/// The bytes of the released instance a load of `entry` would bring back, if it has one.
fn instance_bytes(entry: &Entry) -> Option<u64> {
    Some(released(entry)?.storage_sizes.iter().map(|(_, bytes)| bytes).sum())
}

/// The CUDA device a model lives on: the pipeline file's, else that of its released weights.
fn cuda_device(entry: &Entry) -> Option<usize> {
    let device = entry.placement.device.or_else(|| {
        let weights = lock(&released(entry)?.weights);
        weights.tensors.first().map(|(_, t)| t.device())
    })?;
    match device {
        Device::Cuda(index) => Some(index),
        _ => None,
    }
}

fn released_message(model: &str, stage: &Option<String>) -> String {
    let at = stage.as_ref().map(|s| format!(" when entering stage '{s}'")).unwrap_or_default();
    format!("stageload: model '{model}' was released{at} and its weights are gone; get it from the registry again")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(placement: Placement, state: SlotState<Arc<Instance>>) -> Entry {
        Entry {
            name: "m".into(),
            loader: None,
            checkpoint: Vec::new(),
            names: NameRules::default(),
            placement,
            skip_init: false,
            slot: decide::Slot { state, has_loader: false, has_checkpoint: false, loads: 0 },
            report: None,
        }
    }

    #[test]
    fn a_prefetch_copies_on_the_side_stream_of_the_models_own_cuda_device() {
        let on = |device| Placement { device: Some(device), kind: None };
        assert_eq!(cuda_device(&entry(on(Device::Cuda(2)), SlotState::Unloaded)), Some(2), "the file's device");
        assert_eq!(cuda_device(&entry(on(Device::Cpu), SlotState::Unloaded)), None);
        assert_eq!(cuda_device(&entry(Placement::default(), SlotState::Unloaded)), None, "not known yet");
        // Without a file, a released model's own weights say where it lives (the CPU here).
        let weights = Tensor::zeros([2], (Kind::Float, Device::Cpu));
        let built = Built::from_tensors((), vec![("w".to_string(), weights)]);
        let instance = Instance::new("m", built, std::sync::Weak::new()).unwrap();
        let released = SlotState::Released { instance, stage: None, pending: false };
        assert_eq!(cuda_device(&entry(Placement::default(), released)), None);
    }

    #[test]
    fn the_files_device_and_dtype_are_read_and_integer_dtypes_refused() {
        let placement = Placement::from_file("cuda:1", Some("BF16")).unwrap();
        assert_eq!(placement, Placement { device: Some(Device::Cuda(1)), kind: Some(Kind::BFloat16) });
        assert_eq!(Placement::from_file("mps", None).unwrap().device, Some(Device::Mps));
        assert!(Placement::from_file("tpu", None).unwrap_err().contains("unknown device 'tpu'"));
        assert!(Placement::from_file("cpu", Some("i64")).unwrap_err().contains("float entries only"));
        let refused = Placement::from_file("mps", Some("f64")).unwrap_err();
        assert!(refused.contains("mps cannot hold it; choose f32"), "{refused}");
        assert!(Placement::from_file("cuda", Some("f64")).is_ok());
    }
}
