//! Loads: a `get` or a prefetch decides under the state lock ([`super::decide::Slot::get`]), then
//! builds (one build at a time: the build turn), or refills in place from the host tier or the
//! checkpoint, with the lock let go; the out-of-memory policy's one retry; a prefetch that gives
//! up because the registry closes or drops before its build begins.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tch::{Device, Tensor};

use super::decide::ReleaseMark;
use super::decide::{self, Finish, GetAction, GetContext, Refusal, SlotState};
use super::error::{Result, StageError};
use super::fills::Borrow;
use super::instance::{Instance, Weights};
use super::placement::Placement;
use super::registry::Inner;
use super::release::released_message;
use super::spec::{BuildContext, Init, Loader};
use super::tier_copy::{self, HostCopies};
use super::turn::{BuildHold, ForegroundLoad, Pacer, Who};
use crate::checkpoint::{Checkpoint, CheckpointError};
use crate::error::{is_out_of_memory, panic_message};
use crate::names::NameRules;
use crate::source::{changed_source, FirstReads};

use crate::storage::{self, shallow};
use crate::stream::StreamPlan;
use crate::sync::lock;
use stageload_plan::tier::Ticket;
use stageload_trace::event::{Event, Failed, LoadReport, Loaded, ReloadFrom, Reloaded, What};

/// Where a refill's bytes come from: the host tier's `copies` of the model, else its
/// checkpoint (a `prefetch`'s copy pausable between pieces).
#[derive(Clone, Copy)]
struct FillFrom<'a> {
    recipe: &'a Recipe,
    copies: Option<&'a HostCopies>,
    prefetch: bool,
}

/// What [`Inner::refill`] brought in: bytes, the checkpoint's report, and the borrows of the
/// storages the model relies on without having filled them.
struct Refilled<'a> {
    bytes: u64,
    report: Option<LoadReport>,
    borrows: Vec<Borrow<'a>>,
}

/// What a load of one model needs besides its loader, taken from its entry under the lock.
pub(crate) struct Recipe {
    checkpoint: Vec<PathBuf>,
    names: NameRules,
    init: Init,
    from_snapshot: bool,
    placement: Placement,
    stream: Option<Arc<StreamPlan>>,
    first_reads: Arc<FirstReads>,
}

/// How a load meets the model's checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fill {
    /// Copies every entry into the model.
    Whole,
    /// A background copy that holds no build turn (a prefetch's refill, or its build that asked
    /// for no shared component): pauses between pieces while a foreground load runs, and stops
    /// between pieces once the registry closes or drops, with [`StageError::Closed`] (see
    /// [`super::turn`]).
    Background,
    /// Checks names, shapes and dtypes against the model, copies nothing (a deserialised model).
    CheckOnly,
}

/// Why a load runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Purpose {
    /// A `get` (or `load`) of the current stage.
    Use,
    /// A background load for a stage about to begin, on its way there.
    Prefetch(decide::Trip),
}

/// What a load started under the state lock needs once the lock is dropped.
enum LoadPlan {
    Build {
        reload: bool,
        loader: Arc<Loader>,
    },
    /// In place, from the host tier's copies (leased: with the entry's ticket) or else the
    /// checkpoint.
    Refill(Arc<Instance>, Option<(Ticket, HostCopies)>),
}

impl Inner {
    /// The instance of `name`, loaded or brought back if needed (see [`decide::Slot::get`]).
    pub(crate) fn instance(self: &Arc<Self>, name: &str) -> Result<Arc<Instance>> {
        match self.instance_for(name, Purpose::Use) {
            Err(StageError::OutOfMemory { .. }) if decide::retry_out_of_memory(self.builds.out_of_memory(), false) => {
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
        let mut positions = state.resident_positions();
        positions.retain(|&p| !state.planned_here(&state.entries()[p].name));
        let instances: Vec<Arc<Instance>> = positions.into_iter().filter_map(|p| state.request_release(p)).collect();
        drop(state);
        self.release_all(instances);
    }

    pub(crate) fn instance_for(self: &Arc<Self>, name: &str, purpose: Purpose) -> Result<Arc<Instance>> {
        let prefetch = matches!(purpose, Purpose::Prefetch(_));
        let mut state = self.state();
        let (ticket, plan, recipe, before) = loop {
            let position = state.position(name)?;
            if let Purpose::Prefetch(trip) = purpose {
                // Closed or dropped, or overtaken by the stages entered since it was asked for:
                // nothing begun (its thread drops this error; the slot is as it was).
                if self.cancelled() || state.overtaken(name, trip) {
                    return Err(StageError::Closed { model: name.to_string() });
                }
            }
            let planned_here = prefetch || state.planned_here(name);
            let in_tier = state.in_tier(name);
            let ctx = GetContext { closed: state.is_closed(), strict: self.builds.strict(), planned_here, in_tier };
            let entry = &state.entries()[position];
            let plan = match entry.slot().get(ctx) {
                GetAction::Use(instance) => return Ok(instance),
                GetAction::Wait => {
                    // A prefetch's paced copy goes at full speed while the foreground waits.
                    let _awaiting = (!prefetch).then(|| self.turns.awaiting());
                    state = self.wait_changed(state);
                    continue;
                }
                GetAction::Revive(instance) => {
                    // The release's claim takes the state lock too, so it cannot begin between
                    // this look at the mark and the revival.
                    let freeing = !matches!(instance.mark(), ReleaseMark::Requested(_));
                    if let Some(resident) = entry.slot().revive(freeing) {
                        state.set_state(position, resident);
                        self.notify_changed();
                        return Ok(instance);
                    }
                    // Its storages are being freed right now: wait for that to finish.
                    state = self.wait_changed(state);
                    continue;
                }
                GetAction::Refuse(Refusal::Closed) => return Err(StageError::Closed { model: name.to_string() }),
                GetAction::Refuse(Refusal::OutsideStage) => {
                    return Err(StageError::OutsideStage {
                        model: name.to_string(),
                        stage: state.current().unwrap_or_default().to_string(),
                    })
                }
                GetAction::Refuse(Refusal::NoLoader { stage }) => {
                    return Err(StageError::NoLoader { model: name.to_string(), stage })
                }
                GetAction::Refill(instance) => {
                    let leased = state.tier_mut().and_then(|tier| tier.lease(name));
                    let copies = leased.map(|(ticket, copies)| (ticket, HostCopies::shallow(copies)));
                    LoadPlan::Refill(instance, copies)
                }
                GetAction::Build { reload } => match &entry.loader {
                    Some(loader) => LoadPlan::Build { reload, loader: Arc::clone(loader) },
                    None => return Err(StageError::NoLoader { model: name.to_string(), stage: None }),
                },
            };
            let ticket = state.take_ticket();
            let entry = &state.entries()[position];
            let before = entry.slot().state.clone();
            let loading = entry.slot().start_load(ticket);
            let recipe = Recipe {
                checkpoint: entry.checkpoint.clone(),
                names: entry.names.clone(),
                init: entry.init,
                from_snapshot: entry.from_snapshot,
                placement: entry.placement,
                stream: entry.stream.clone(),
                first_reads: Arc::clone(&entry.first_reads),
            };
            state.set_state(position, loading);
            break (ticket, plan, recipe, before);
        };
        let stage = state.current().map(str::to_string);
        let outside_stage = !prefetch && !state.planned_here(name);
        drop(state);

        let started = Instant::now();
        // Background copies pause while this lives (see super::turn).
        let foreground = (!prefetch).then(|| self.turns.foreground_load());
        // The storages the model relies on without having filled them, borrowed until it is
        // installed (see super::fills).
        let mut borrows = Vec::new();
        let result = match &plan {
            LoadPlan::Build { loader, .. } => {
                let who = if prefetch { Who::Background } else { Who::Foreground };
                self.build(name, loader, &recipe, who).and_then(|(instance, bytes, report)| {
                    let from = FillFrom { recipe: &recipe, copies: None, prefetch };
                    let refilled = self.refill(&instance, from, foreground.as_ref(), false)?;
                    borrows = refilled.borrows;
                    Ok((instance, bytes + refilled.bytes, report))
                })
            }
            LoadPlan::Refill(instance, copies) => {
                let from = FillFrom { recipe: &recipe, copies: copies.as_ref().map(|(_, copies)| copies), prefetch };
                self.refill(instance, from, foreground.as_ref(), true).map(|refilled| {
                    borrows = refilled.borrows;
                    (Arc::clone(instance), refilled.bytes, refilled.report)
                })
            }
        };
        if prefetch && matches!(result, Err(StageError::Closed { .. })) {
            // The registry closed or dropped while the prefetch waited for the build turn, or
            // during its checkpoint copy, which stopped between pieces: the slot goes back to
            // what it was (a refill freed its storages again, a build's model is dropped).
            self.give_up(name, ticket, before);
            return result.map(|(instance, ..)| instance);
        }
        let seconds = started.elapsed().as_secs_f64();
        let accepted = recipe.first_reads.end_load();

        let mut state = self.state();
        // A reload from the tier gives its copy up (the weights are on the device again); a
        // failed one leaves it for the next try. By the lease's ticket: an insert meanwhile
        // replaced the entry with another instance's, which stays as it is.
        let leased = match &plan {
            LoadPlan::Refill(_, Some((ticket, _))) => Some(*ticket),
            _ => None,
        };
        let from_tier = leased.is_some();
        let mut restored = None;
        if let (Some(ticket), Some(tier)) = (leased, state.tier_mut()) {
            match result {
                Ok(_) => restored = tier.withdraw(name, ticket),
                Err(_) => tier.unlease(name, ticket),
            }
        }
        let tier = if from_tier { state.tier_usage() } else { None };
        let position = state.find(name);
        let outcome = result.as_ref().ok().map(|(instance, ..)| Arc::clone(instance));
        let finish = position.map_or(Finish::Discard, |p| state.entries()[p].slot().finish_load(ticket, outcome));
        self.notify_changed();
        let Finish::Install(installed) = finish else {
            drop(state);
            // An insert or a remove overtook this load: what it built is dropped.
            return match result {
                Ok(_) => self.instance(name),
                Err(err) => Err(err),
            };
        };
        let position = position.expect("a load installs only into a slot that exists");
        state.set_state(position, installed);
        // Installed: the model holds what it relied on, as any resident model does.
        drop(borrows);
        match result {
            Ok((instance, bytes, report)) => {
                state.count_load(position, report.clone());
                // A prefetch that ends after `close` (nobody will ask for the model, and close
                // promised its memory back) or overtaken by the stages entered meanwhile (the
                // current stage's plan does not count it): released at once.
                let overtaken = match purpose {
                    Purpose::Prefetch(trip) => state.is_closed() || state.overtaken(name, trip),
                    Purpose::Use => false,
                };
                let give_back = if overtaken { state.request_release(position) } else { None };
                let resident = state.resident_bytes();
                drop(state);
                drop(restored);
                let load = Loaded {
                    stage,
                    model: name.to_string(),
                    bytes: Some(bytes),
                    seconds: Some(seconds),
                    outside_stage,
                    prefetched: prefetch,
                    streamed: false,
                    report: report.map(Box::new),
                    resident: Some(resident),
                    accepted,
                };
                let from = match plan {
                    LoadPlan::Build { reload: false, .. } => None,
                    LoadPlan::Build { reload: true, .. } => Some(ReloadFrom::Rebuilt),
                    LoadPlan::Refill(_, Some(_)) => Some(ReloadFrom::HostTier),
                    LoadPlan::Refill(_, None) if recipe.from_snapshot => Some(ReloadFrom::Snapshot),
                    LoadPlan::Refill(_, None) => Some(ReloadFrom::InPlace),
                };
                self.emit(Event::now(match from {
                    None => What::Load(load),
                    Some(from) => What::Reload(Reloaded { from, tier, load }),
                }));
                if let Some(released) = give_back {
                    tracing::debug!(model = name, "prefetch ended after close or overtaken: released at once");
                    self.release_all(vec![released]);
                }
                Ok(instance)
            }
            Err(err) => {
                drop(state);
                let err = match err {
                    StageError::OutOfMemory { .. } => err,
                    other if is_out_of_memory(&other.to_string()) => StageError::OutOfMemory {
                        model: name.to_string(),
                        stage: stage.clone(),
                        message: other.to_string(),
                    },
                    other => other,
                };
                self.emit(Event::now(Failed {
                    stage,
                    model: Some(name.to_string()),
                    seconds: Some(seconds),
                    note: err.to_string(),
                }));
                Err(err)
            }
        }
    }

    /// Whether `close` or dropping the registry asked prefetches that have not begun to give up.
    pub(crate) fn cancelled(&self) -> bool {
        self.turns.cancelled()
    }

    /// Puts the slot of a load that gave up before it began back as it was `before`, unless an
    /// insert or a remove took the slot over meanwhile; wakes whoever waits for the load.
    fn give_up(&self, name: &str, ticket: u64, before: SlotState<Arc<Instance>>) {
        let mut state = self.state();
        if let Some(position) = state.find(name) {
            if let Some(back) = state.entries()[position].slot().give_up(ticket, before) {
                state.set_state(position, back);
            }
        }
        self.notify_changed();
    }

    /// Runs a loader (a foreground one under preserved RNG and the build turn), catching
    /// panics, and fills the model from its checkpoint. Returns the instance, the bytes it
    /// brought in, and the load report.
    fn build(
        self: &Arc<Self>,
        name: &str,
        loader: &Arc<Loader>,
        recipe: &Recipe,
        who: Who,
    ) -> Result<(Arc<Instance>, u64, Option<LoadReport>)> {
        let Recipe { checkpoint, names, init, placement, stream, first_reads, .. } = recipe;
        // A prefetch whose build has not begun gives up when the registry closes or drops.
        let hold = BuildHold::new(&self.turns, who).map_err(|_| StageError::Closed { model: name.to_string() })?;
        // A prefetched build draws nothing (skip_init, see decide::Slot::prefetch): it must not
        // save and restore the generators the foreground is drawing from.
        let rng = self.builds.preserve_rng(who == Who::Foreground).map_err(StageError::Rng)?;
        let context = BuildContext {
            hold: &hold,
            components: self.builds.components(),
            model: name,
            device: placement.device,
            shared_tensors: Mutex::new(Vec::new()),
            stream: stream.as_deref(),
            stream_taken: Default::default(),
            first_reads,
        };
        let run = || {
            if *init == Init::Skipped {
                stageload_torch_sys::without_init(|| loader(&context))
            } else {
                loader(&context)
            }
        };
        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(run));
        // The generators are as they were; the turn goes back unless the build has shared
        // components to fill.
        drop(rng);
        hold.loader_done();
        let mut built = match ran {
            Ok(Ok(built)) => built,
            // The registry closed meanwhile (its turn for a shared component refused): it gives up.
            Ok(Err(_)) if who == Who::Background && self.cancelled() => {
                return Err(StageError::Closed { model: name.to_string() })
            }
            // A file it read is not what the model's first load read.
            Ok(Err(source)) => {
                return Err(match changed_source(&*source) {
                    Some(changed) => StageError::SourceChanged(changed),
                    None => StageError::LoaderFailed { model: name.to_string(), source },
                })
            }
            Err(panic) => {
                return Err(StageError::LoaderPanicked { model: name.to_string(), message: panic_message(&*panic) })
            }
        };
        if stream.is_some() && !context.stream_taken.into_inner() {
            // It has no checkpoint: built whole, its weights would stay as the loader left them.
            return Err(StageError::PlanMismatch {
                model: name.to_string(),
                message: "the pipeline file streams it, and its loader did not take the plan: make it with StreamedModel::planned(name, tensors, ctx.stream()) (or take `stream` out of the file)".into(),
            });
        }
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
            // without initial values must get every tensor from the file (entries no tensor
            // reads are refused only by strict rules).
            let names =
                names.clone().filled_elsewhere(shared.iter().filter(|(_, _, fresh)| !fresh).map(|(n, _, _)| n.clone()));
            let names = if *init == Init::Skipped { names.complete() } else { names };
            // The file a deserialised model came from holds its weights: its checkpoint is only
            // checked now (it refills the model after a release). A background build that holds
            // no turn copies as background work.
            let fill = match (*init, who) {
                (Init::Deserialized, _) => Fill::CheckOnly,
                (_, Who::Background) if !hold.holds_turn() => Fill::Background,
                _ => Fill::Whole,
            };
            report = Some(self.load_checkpoint(name, checkpoint, first_reads, &targets, &names, fill)?);
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
        // What the checkpoint lacks, nothing can refill: a release keeps it resident.
        let unrefillable = report.as_ref().map_or(&[][..], |report| &report.missing[..]);
        let instance = Instance::new(name, built, unrefillable, Arc::<Inner>::downgrade(self))?;
        let bytes = instance.storage_sizes.iter().filter(|(id, _)| !reused.contains(id)).map(|(_, bytes)| bytes).sum();
        Ok((instance, bytes, report))
    }

    /// Meets `targets` with the model's checkpoint `files` as `fill` says, once the files are
    /// found to be what the model's first load read (`first_reads`).
    fn load_checkpoint(
        &self,
        model: &str,
        files: &[PathBuf],
        first_reads: &FirstReads,
        targets: &[(String, Tensor)],
        names: &NameRules,
        fill: Fill,
    ) -> Result<LoadReport> {
        let wrap = |source| match source {
            CheckpointError::Stopped { .. } => StageError::Closed { model: model.to_string() },
            source => StageError::Checkpoint { model: model.to_string(), source: Box::new(source) },
        };
        let mut checkpoint = Checkpoint::open(files).map_err(wrap)?;
        first_reads.meet_all(model, checkpoint.files(), checkpoint.stamps())?;
        if fill == Fill::Background {
            let turns = Arc::clone(&self.turns);
            let to_cpu = targets.iter().all(|(_, t)| t.device() == Device::Cpu);
            let compute_threads = usize::try_from(tch::get_num_threads()).unwrap_or(1);
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            let pacer = self
                .background
                .pace()
                .paces(to_cpu, compute_threads, cores)
                .then(|| Pacer::new(crate::checkpoint::readers()));
            checkpoint =
                checkpoint.before_each_piece(Arc::new(move |wait| turns.before_background_piece(wait, pacer.as_ref())));
        }
        let report = match fill {
            Fill::CheckOnly => checkpoint.check_named(targets, names),
            Fill::Whole | Fill::Background => {
                checkpoint.load_named(targets, names, |progress| self.builds.tell_progress(model, progress))
            }
        }
        .map_err(wrap)?;
        if !report.unused.is_empty() || !report.missing.is_empty() {
            tracing::warn!(model, unused = ?report.unused, missing = ?report.missing, "checkpoint and model names differ (lenient load)");
        }
        Ok(report)
    }

    /// Brings an instance's freed storages back: reallocates and fills them (when `first`, it
    /// fills once even if none is freed, for the checkpoint's report), then waits for the
    /// storages it shares that another refill is filling now, again until none is left
    /// ([`super::fills`]); a `foreground` load counts as not loading while it waits. For a
    /// released instance (a refill in place, `first`) and after a build that reused a shared
    /// component (not `first`: nothing of its own is freed). Under the instance's body lock,
    /// which keeps every user of the model away. On failure what the failing round reallocated
    /// is freed again and the instance stays as it was; storages an earlier round filled (after
    /// a wait) stay allocated and filled, since another model may share them.
    fn refill(
        &self,
        instance: &Instance,
        from: FillFrom<'_>,
        foreground: Option<&ForegroundLoad<'_>>,
        mut first: bool,
    ) -> Result<Refilled<'_>> {
        let name = &instance.name;
        let torch = |source| StageError::Torch { model: name.clone(), source };
        // Waits only for a release of this very instance still freeing its storages.
        let _body = lock(&instance.body);
        let weights = lock(&instance.weights);
        let (mut bytes, mut report, mut borrows) = (0, None, Vec::new());
        loop {
            // SAFETY: the body lock keeps every user of the model away until the fill below has
            // filled the claimed storages (or freed them again).
            let (claim, others, borrow) = unsafe { self.fills.claim(&weights.storages) }.map_err(torch)?;
            borrows.push(borrow);
            if first || !claim.ids.is_empty() {
                match self.fill(instance, &weights, &claim.ids, from) {
                    Ok((filled, read)) => (bytes, report) = (bytes + filled, report.or(read)),
                    Err(err) => {
                        let stage = instance.mark().stage().flatten();
                        let message = released_message(name, &stage);
                        // SAFETY: still under the body lock; nothing has used the half-filled
                        // storages. Freed before the claim ends, so a refill waiting for them
                        // finds them freed and fills them itself.
                        unsafe { storage::free_ids(&weights.storages, &claim.ids, &message) }.map_err(torch)?;
                        return Err(err);
                    }
                }
            }
            first = false;
            drop(claim);
            if others.is_empty() {
                // Live again once the slot installs it as resident (`State::set_state`); until
                // then the storages it relies on are borrowed.
                return Ok(Refilled { bytes, report, borrows });
            }
            let _waiting = foreground.map(ForegroundLoad::waiting);
            self.fills.wait_for(&others);
        }
    }

    /// Fills the storages `ids` of a refilled instance, from its host tier `copies` or its
    /// checkpoint; their bytes, and the checkpoint's load report.
    fn fill(
        &self,
        instance: &Instance,
        weights: &Weights,
        ids: &HashSet<u64>,
        FillFrom { recipe, copies, prefetch }: FillFrom<'_>,
    ) -> Result<(u64, Option<LoadReport>)> {
        let name = &instance.name;
        // The others are filled already, or by another refill: their entries are not unused.
        let (targets, elsewhere): (Vec<_>, Vec<_>) = weights
            .tensors
            .iter()
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .partition(|(_, t)| stageload_torch_sys::storage_info(t).is_ok_and(|i| ids.contains(&i.id)));
        let report = match copies {
            Some(copies) => {
                let device = targets.first().map_or(Device::Cpu, |(_, t)| t.device());
                self.tier_side
                    .before_copy(name, false)
                    .and_then(|()| tier_copy::copy_in(&targets, copies, device))
                    .map(|()| None)
                    .map_err(|source| StageError::HostTier { model: name.clone(), source })
            }
            // Every reallocated storage must be filled: a tensor the checkpoint cannot fill is
            // an error here (its storage should have been kept, see `Instance::kept`).
            None => self
                .load_checkpoint(
                    name,
                    &recipe.checkpoint,
                    &recipe.first_reads,
                    &targets,
                    &recipe.names.clone().complete().filled_elsewhere(elsewhere.into_iter().map(|(n, _)| n)),
                    if prefetch { Fill::Background } else { Fill::Whole },
                )
                .map(Some),
        }?;
        let bytes = weights.storages.iter().filter(|s| ids.contains(&s.id)).map(|s| s.nbytes as u64).sum();
        Ok((bytes, report))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use tch::{Device, Kind, Tensor};

    use super::super::{Built, ModelSpec, StagedModels};

    /// A model of one `[8]` float tensor.
    fn model(name: &str) -> ModelSpec {
        ModelSpec::new(name, |_| {
            let w = Tensor::zeros([8], (Kind::Float, Device::Cpu));
            Ok(Built::from_tensors(w.shallow_clone(), vec![("w".to_string(), w)]))
        })
    }

    /// How many times `f` takes the registry's state lock.
    fn state_locks(models: &StagedModels, f: impl FnOnce()) -> u64 {
        let before = models.inner.state_locks.load(Ordering::Relaxed);
        f();
        models.inner.state_locks.load(Ordering::Relaxed) - before
    }

    #[test]
    fn a_get_takes_the_state_lock_once_to_hand_out_a_resident_model_and_twice_to_load_one() {
        let models = StagedModels::builder()
            .preserve_rng(false)
            .model(model("a"))
            .model(model("b"))
            .stage("one", ["a"])
            .stage("two", ["b"])
            .build()
            .unwrap();
        models.enter("one").unwrap();
        let build = state_locks(&models, || drop(models.get::<Tensor>("a").unwrap()));
        let resident = state_locks(&models, || drop(models.get::<Tensor>("a").unwrap()));
        let enter = state_locks(&models, || _ = models.enter("two").unwrap());
        models.get::<Tensor>("b").unwrap();
        let rebuild = state_locks(&models, || drop(models.get::<Tensor>("a").unwrap()));
        eprintln!("build {build} resident {resident} enter {enter} rebuild {rebuild}");
        assert_eq!((build, resident, enter, rebuild), (2, 1, 2, 2));
    }

    #[test]
    fn a_refill_in_place_takes_the_state_lock_twice() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("a.safetensors");
        crate::checkpoint::save(&[("w".to_string(), Tensor::ones([8], (Kind::Float, Device::Cpu)))], &file).unwrap();
        let models = StagedModels::builder()
            .preserve_rng(false)
            .model(model("a").checkpoint([&file]))
            .stage("one", ["a"])
            .stage("none", Vec::<String>::new())
            .build()
            .unwrap();
        models.enter("one").unwrap();
        models.load("a").unwrap();
        models.enter("none").unwrap();
        models.enter("one").unwrap();
        let refill = state_locks(&models, || models.load("a").unwrap());
        assert_eq!(models.state("a").unwrap(), super::super::ModelState::Resident);
        eprintln!("refill {refill}");
        assert_eq!(refill, 2);
    }
}
