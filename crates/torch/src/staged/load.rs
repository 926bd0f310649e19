//! Loads: the transaction a `get` or a prefetch runs for a model that is not resident. Begun
//! under the state lock ([`Slots::begin_load`](super::slots::Slots::begin_load): the decision,
//! the ticket, the tier's lease, the recipe), run with the lock let go ([`Inner::run_load`]),
//! finished under it once more ([`Slots::finish_load`](super::slots::Slots::finish_load)), then
//! told ([`Inner::announce`]). Running it builds (the loader,
//! then its checkpoint) or refills in place from the host tier or the checkpoint; a foreground
//! load pauses background copies while it lasts ([`super::turn`]). Out of memory is typed where
//! libtorch's error or the loader's is caught ([`Failing`]); the policy's one retry releases the
//! models the stage does not list. A prefetch that gives up because the registry closes or
//! drops puts the slot back as it was.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tch::{Device, Tensor};

use super::decide;
use super::error::{BoxError, Result, StageError};
use super::fills::Borrow;
use super::instance::{Instance, Weights};
use super::mapped::{HeldFiles, MapPlan};
use super::registry::Inner;
use super::release::released_message;
use super::slots::{Begin, Begun, Finished, Installed, Landed, Plan, Purpose, Ran, Recipe};
use super::spec::{BuildContext, Built, Init, Loader, Reload};
use super::tier_copy::{self, HostCopies};
use super::turn::{BuildHold, ForegroundLoad, Pacer, Who};
use crate::checkpoint::{Checkpoint, CheckpointError};
use crate::error::{is_out_of_memory, panic_message};
use crate::names::NameRules;
use crate::source::{changed_source, FirstReads};
use crate::storage::{self, shallow};
use crate::sync::lock;
use stageload_torch_sys::ShimError;
use stageload_trace::event::{Event, Failed, LoadReport, Loaded, ReloadFrom, Reloaded, What};

/// Where a refill's bytes come from: the host tier's `copies` of the model, else its
/// checkpoint (a `prefetch`'s copy pausable between pieces).
#[derive(Clone, Copy)]
struct FillFrom<'a> {
    begun: &'a Begun,
    copies: Option<&'a HostCopies>,
}

/// What [`Inner::refill`] brought in: bytes, the checkpoint's report, and the borrows of the
/// storages the model relies on without having filled them.
struct Refilled<'a> {
    bytes: u64,
    report: Option<LoadReport>,
    borrows: Vec<Borrow<'a>>,
}

/// The shared components a build used: name, tensor, and whether this build made it.
type SharedUsed = Vec<(String, Tensor, bool)>;

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

/// The model a load is for and the stage it began in: what an error caught in the load needs
/// to be typed, out of memory included, where it is caught.
#[derive(Clone, Copy)]
struct Failing<'a> {
    model: &'a str,
    stage: &'a Option<String>,
}

impl<'a> Failing<'a> {
    fn of(begun: &'a Begun) -> Self {
        Failing { model: &begun.name, stage: &begun.stage }
    }

    /// `err`, or [`StageError::OutOfMemory`] with its text when `said` (what libtorch, or the
    /// loader, said) is that memory ran out.
    fn typed(self, said: &str, err: StageError) -> StageError {
        if is_out_of_memory(said) {
            StageError::OutOfMemory {
                model: self.model.to_string(),
                stage: self.stage.clone(),
                message: err.to_string(),
            }
        } else {
            err
        }
    }

    /// A storage operation's error (a reallocation's, typically).
    fn torch(self, source: ShimError) -> StageError {
        let said = source.to_string();
        self.typed(&said, StageError::Torch { model: self.model.to_string(), source })
    }

    /// A checkpoint's error: a copy stopped between pieces is [`StageError::Closed`]; a copy
    /// that ran out of memory is typed by libtorch's own error.
    fn checkpoint(self, source: CheckpointError) -> StageError {
        let said = match &source {
            CheckpointError::Stopped { .. } => return StageError::Closed { model: self.model.to_string() },
            CheckpointError::Copy { source, .. } => source.to_string(),
            CheckpointError::Stream { source, .. } | CheckpointError::Storage { source, .. } => source.to_string(),
            _ => String::new(),
        };
        self.typed(&said, StageError::Checkpoint { model: self.model.to_string(), source: Box::new(source) })
    }

    /// A loader's own error (libtorch's, typically, when it ran out of memory).
    fn loader_failed(self, source: BoxError) -> StageError {
        match changed_source(&*source) {
            // A file it read is not what the model's first load read.
            Some(changed) => StageError::SourceChanged(changed),
            None => {
                let said = source.to_string();
                self.typed(&said, StageError::LoaderFailed { model: self.model.to_string(), source })
            }
        }
    }

    /// A loader's panic.
    fn loader_panicked(self, panic: &(dyn std::any::Any + Send)) -> StageError {
        let message = panic_message(panic);
        let said = message.clone();
        self.typed(&said, StageError::LoaderPanicked { model: self.model.to_string(), message })
    }
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
        let mut state = self.slots.lock();
        let mut positions = state.resident_positions();
        positions.retain(|&p| !state.planned_here(&state.entries()[p].name));
        let instances: Vec<Arc<Instance>> = positions.into_iter().filter_map(|p| state.request_release(p)).collect();
        drop(state);
        self.release_all(instances);
    }

    /// The instance of `name` for `purpose`: the load transaction (see the module docs), or
    /// the resident instance.
    pub(crate) fn instance_for(self: &Arc<Self>, name: &str, purpose: Purpose) -> Result<Arc<Instance>> {
        let begun = match self.slots.begin_load(name, purpose, &self.turns, self.builds.strict())? {
            Begin::Use(instance) => return self.still_its_files(instance),
            Begin::Load(begun) => begun,
        };
        let started = Instant::now();
        // Background copies pause while this lives (see super::turn).
        let foreground = (!purpose.is_prefetch()).then(|| self.turns.foreground_load());
        let ran = self.run_load(&begun, foreground.as_ref());
        if purpose.is_prefetch() && matches!(ran, Err(StageError::Closed { .. })) {
            // The registry closed or dropped while the prefetch waited for the build turn, or
            // during its checkpoint copy, which stopped between pieces: the slot goes back to
            // what it was (a refill freed its storages again, a build's model is dropped).
            let Err(closed) = ran else { unreachable!() };
            self.slots.give_up(*begun);
            return Err(closed);
        }
        let seconds = started.elapsed().as_secs_f64();
        let accepted = begun.recipe.first_reads.end_load();
        let Finished { landed, restored } = self.slots.finish_load(&begun, ran);
        drop(restored);
        match landed {
            Landed::Loaded(installed) => Ok(self.announce(&begun, installed, seconds, accepted)),
            Landed::Failed(err) => {
                self.emit(Event::now(Failed {
                    stage: begun.stage.clone(),
                    model: Some(begun.name.clone()),
                    seconds: Some(seconds),
                    note: err.to_string(),
                }));
                Err(err)
            }
            // An insert or a remove overtook this load: what it built is dropped.
            Landed::Overtaken(ran) => ran.and_then(|()| self.instance(name)),
        }
    }

    /// `instance`, resident, to hand out, once the files whose pages it may hold are found as
    /// its first load read them ([`super::mapped`], rule 4); one written in place since makes
    /// this release it and answer [`StageError::ChangedUnderModel`].
    fn still_its_files(&self, instance: Arc<Instance>) -> Result<Arc<Instance>> {
        let Some(changed) = instance.held.as_ref().and_then(|held| held.changed(&instance.name)) else {
            return Ok(instance);
        };
        let mut state = self.slots.lock();
        let requested = state.position(&instance.name).ok().and_then(|p| state.request_release(p));
        let stage = state.current().map(str::to_string);
        drop(state);
        self.release_all(requested.into_iter().collect());
        let err = StageError::ChangedUnderModel { source: changed };
        self.emit(Event::now(Failed {
            stage,
            model: Some(instance.name.clone()),
            seconds: None,
            note: err.to_string(),
        }));
        Err(err)
    }

    /// Runs a load begun, with the state lock let go: builds (then fills what shared storages
    /// another refill is filling), or refills in place. A `foreground` load counts as not
    /// loading while it waits for another refill.
    fn run_load(self: &Arc<Self>, begun: &Begun, foreground: Option<&ForegroundLoad<'_>>) -> Result<Ran<'_>> {
        match &begun.plan {
            Plan::Build { loader, .. } => {
                let who = if begun.purpose.is_prefetch() { Who::Background } else { Who::Foreground };
                let (instance, bytes, filled) = self.build(begun, loader, who)?;
                // A build that maps left every storage to this first refill (its bytes and
                // report); any other fills here only what another refill shared was filling.
                let maps = matches!(filled, BuildFill::ToMap);
                let refilled = self.refill(&instance, FillFrom { begun, copies: None }, foreground, maps)?;
                let (bytes, report) = match filled {
                    BuildFill::ToMap => (refilled.bytes, refilled.report),
                    BuildFill::Done(report) => (bytes + refilled.bytes, report),
                };
                Ok(Ran { instance, bytes, report, borrows: refilled.borrows })
            }
            Plan::Refill(instance, lease) => {
                let from = FillFrom { begun, copies: lease.as_ref().map(|(_, copies)| copies) };
                let refilled = self.refill(instance, from, foreground, true)?;
                let Refilled { bytes, report, borrows } = refilled;
                Ok(Ran { instance: Arc::clone(instance), bytes, report, borrows })
            }
        }
    }

    /// Tells a load installed in a `load` or `reload` event, then carries out the release of a
    /// prefetch that ended after `close` or overtaken; the instance to hand out.
    fn announce(&self, begun: &Begun, installed: Installed, seconds: f64, accepted: Vec<String>) -> Arc<Instance> {
        let Installed { instance, bytes, report, resident, tier, give_back } = installed;
        let load = Loaded {
            stage: begun.stage.clone(),
            model: begun.name.clone(),
            bytes: Some(bytes),
            seconds: Some(seconds),
            outside_stage: begun.outside_stage,
            prefetched: begun.purpose.is_prefetch(),
            streamed: false,
            report: report.map(Box::new),
            resident: Some(resident),
            accepted,
        };
        let from = match begun.plan {
            Plan::Build { reload: false, .. } => None,
            Plan::Build { reload: true, .. } => Some(ReloadFrom::Rebuilt),
            Plan::Refill(_, Some(_)) => Some(ReloadFrom::HostTier),
            Plan::Refill(_, None) if begun.recipe.from_snapshot => Some(ReloadFrom::Snapshot),
            Plan::Refill(_, None) if begun.recipe.reload == Reload::Map => Some(ReloadFrom::Mapped),
            Plan::Refill(_, None) => Some(ReloadFrom::InPlace),
        };
        self.emit(Event::now(match from {
            None => What::Load(load),
            Some(from) => What::Reload(Reloaded { from, tier, load }),
        }));
        if let Some(released) = give_back {
            tracing::debug!(model = begun.name.as_str(), "prefetch ended after close or overtaken: released at once");
            self.release_all(vec![released]);
        }
        instance
    }

    /// Whether `close` or dropping the registry asked prefetches that have not begun to give up.
    pub(crate) fn cancelled(&self) -> bool {
        self.turns.cancelled()
    }

    /// Builds the model begun: runs its loader ([`Self::run_loader`]), places its tensors and
    /// the shared components it made, fills them from its checkpoint; or, for a model that maps
    /// at its build ([`maps_at_build`]) and shares nothing, frees them for its first refill to
    /// give them the file's pages. Returns the instance, the bytes it brought in, and how its
    /// checkpoint was met.
    fn build(
        self: &Arc<Self>,
        begun: &Begun,
        loader: &Arc<Loader>,
        who: Who,
    ) -> Result<(Arc<Instance>, u64, BuildFill)> {
        let (name, failing) = (begun.name.as_str(), Failing::of(begun));
        let Recipe { checkpoint, names, init, placement, first_reads, .. } = &begun.recipe;
        // A prefetch whose build has not begun gives up when the registry closes or drops.
        let hold = BuildHold::new(&self.turns, who).map_err(|_| StageError::Closed { model: name.to_string() })?;
        let (mut built, shared) = self.run_loader(begun, loader, &hold, who)?;
        // Built without initial values, a model that maps gets its file's pages as a reload
        // does (the first refill, `run_load`); one that shares components is filled here.
        let maps = maps_at_build(&begun.recipe) && shared.is_empty();
        // Shared components built by this build are this model's to place and convert too
        // (shallow copies: the conversion reaches every holder).
        let mut fresh: Vec<(String, Tensor)> =
            shared.iter().filter(|(_, _, fresh)| *fresh).map(|(n, t, _)| (n.clone(), t.shallow_clone())).collect();
        for tensors in [&mut built.tensors, &mut fresh] {
            // A conversion to the file's dtype allocates: it may run out of memory.
            placement.apply(name, tensors).map_err(|err| failing.typed(&err.to_string(), err))?;
        }
        let mut report = None;
        if !checkpoint.is_empty() && !maps {
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
            report = Some(self.load_checkpoint(failing, checkpoint, first_reads, &targets, &names, fill)?);
        }
        let held = (begun.recipe.reload == Reload::Map
            && !checkpoint.is_empty()
            && built.tensors.iter().any(|(_, t)| t.device() == Device::Cpu))
        .then(|| HeldFiles { files: checkpoint.clone(), first_reads: Arc::clone(first_reads) });
        let (instance, bytes, report) = self.built_instance(name, built, shared, report, held)?;
        if !maps {
            return Ok((instance, bytes, BuildFill::Done(report)));
        }
        {
            let weights = lock(&instance.weights);
            let ids = weights.storages.iter().map(|s| s.id).collect();
            // SAFETY: nothing has the instance yet, and its storages hold no values.
            unsafe { storage::free_ids(&weights.storages, &ids, &released_message(name, &begun.stage)) }
                .map_err(|source| failing.torch(source))?;
        }
        Ok((instance, bytes, BuildFill::ToMap))
    }

    /// Runs `loader` for the model begun (a foreground one under preserved RNG, the turn held
    /// for its run; without initial values when its recipe says so), catching panics. Returns
    /// the model built and the shared components it used (name, tensor, made by this build).
    fn run_loader(
        &self,
        begun: &Begun,
        loader: &Arc<Loader>,
        hold: &BuildHold,
        who: Who,
    ) -> Result<(Built, SharedUsed)> {
        let Recipe { init, placement, stream, first_reads, .. } = &begun.recipe;
        let name = begun.name.as_str();
        // A prefetched build draws nothing (skip_init, see decide::Slot::prefetch): it must not
        // save and restore the generators the foreground is drawing from.
        let rng = self.builds.preserve_rng(who == Who::Foreground).map_err(StageError::Rng)?;
        let context = BuildContext {
            hold,
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
        let built = match ran {
            Ok(Ok(built)) => built,
            // The registry closed meanwhile (its turn for a shared component refused): it gives up.
            Ok(Err(_)) if who == Who::Background && self.cancelled() => {
                return Err(StageError::Closed { model: name.to_string() })
            }
            Ok(Err(source)) => return Err(Failing::of(begun).loader_failed(source)),
            Err(panic) => return Err(Failing::of(begun).loader_panicked(&*panic)),
        };
        if stream.is_some() && !context.stream_taken.into_inner() {
            // It has no checkpoint: built whole, its weights would stay as the loader left them.
            return Err(StageError::PlanMismatch {
                model: name.to_string(),
                message: "the pipeline file streams it, and its loader did not take the plan: make it with StreamedModel::planned(name, tensors, ctx.stream()) (or take `stream` out of the file)".into(),
            });
        }
        let shared = context.shared_tensors.into_inner().unwrap_or_else(|e| e.into_inner());
        Ok((built, shared))
    }

    /// The instance of a model built, with the `shared` components it used, and the bytes it
    /// brought in: shared components another model already built are not loaded again, so not
    /// counted; what the checkpoint lacks (`report`'s missing), nothing can refill, so a release
    /// keeps it resident.
    fn built_instance(
        self: &Arc<Self>,
        name: &str,
        mut built: Built,
        shared: SharedUsed,
        report: Option<LoadReport>,
        held: Option<HeldFiles>,
    ) -> Result<(Arc<Instance>, u64, Option<LoadReport>)> {
        let reused: Vec<(String, Tensor)> =
            shared.iter().filter(|(_, _, fresh)| !fresh).map(|(n, t, _)| (n.clone(), t.shallow_clone())).collect();
        let reused: HashSet<u64> = storage::distinct_storages(&reused)
            .map_err(|source| StageError::Torch { model: name.to_string(), source })?
            .iter()
            .map(|r| r.id)
            .collect();
        built.tensors.extend(shared.into_iter().map(|(n, t, _)| (n, t)));
        let unrefillable = report.as_ref().map_or(&[][..], |report| &report.missing[..]);
        let instance = Instance::new(name, built, unrefillable, Arc::<Inner>::downgrade(self), held)?;
        let bytes = instance.storage_sizes.iter().filter(|(id, _)| !reused.contains(id)).map(|(_, bytes)| bytes).sum();
        Ok((instance, bytes, report))
    }

    /// Meets `targets` with the model's checkpoint `files` as `fill` says, once the files are
    /// found to be what the model's first load read (`first_reads`).
    fn load_checkpoint(
        &self,
        failing: Failing<'_>,
        files: &[PathBuf],
        first_reads: &FirstReads,
        targets: &[(String, Tensor)],
        names: &NameRules,
        fill: Fill,
    ) -> Result<LoadReport> {
        let model = failing.model;
        let mut checkpoint = Checkpoint::open(files).map_err(|source| failing.checkpoint(source))?;
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
        .map_err(|source| failing.checkpoint(source))?;
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
        let failing = Failing::of(from.begun);
        // Waits only for a release of this very instance still freeing its storages.
        let _body = lock(&instance.body);
        let weights = lock(&instance.weights);
        let plan = self.map_plan(&weights, from)?;
        let begun_prefetch = from.begun.purpose.is_prefetch();
        let (mut bytes, mut report, mut borrows) = (0, None, Vec::new());
        loop {
            // SAFETY: the body lock keeps every user of the model away until the fill below has
            // filled the claimed storages (or freed them again).
            let (claim, others, borrow) = unsafe { self.fills.claim(&weights.storages, plan.as_ref()) }
                .map_err(|source| failing.torch(source))?;
            borrows.push(borrow);
            // A prefetch maps the pages in now, off the critical path; the foreground leaves
            // them to come in as the forward touches them (as `from_pretrained`'s do), so the
            // pages it never reads (most rows of an embedding table) stay out of memory.
            if let (Some(plan), true) = (&plan, begun_prefetch) {
                plan.populate(name, claim.mapped.iter().copied());
            }
            if first || !claim.ids.is_empty() {
                match self.fill(instance, &weights, &claim.to_fill(), from) {
                    Ok((filled, mut read)) => {
                        let mapped: u64 = weights
                            .storages
                            .iter()
                            .filter(|s| claim.mapped.contains(&s.id))
                            .map(|s| s.nbytes as u64)
                            .sum();
                        if let Some(read) = read.as_mut() {
                            // The tensors on the file's pages were filled by the file too.
                            read.used += weights
                                .tensors
                                .iter()
                                .filter(|(_, t)| {
                                    stageload_torch_sys::storage_info(t).is_ok_and(|i| claim.mapped.contains(&i.id))
                                })
                                .count();
                        }
                        (bytes, report) = (bytes + filled + mapped, report.or(read));
                    }
                    Err(err) => {
                        let stage = instance.mark().stage().flatten();
                        let message = released_message(name, &stage);
                        // SAFETY: still under the body lock; nothing has used the half-filled
                        // storages. Freed before the claim ends, so a refill waiting for them
                        // finds them freed and fills them itself.
                        unsafe { storage::free_ids(&weights.storages, &claim.ids, &message) }
                            .map_err(|source| failing.torch(source))?;
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

    /// For a refill from the checkpoint of a model that maps ([`Reload::Map`]), which of its
    /// storages take the file's pages ([`MapPlan`]), once the files are found to be what the
    /// model's first load read.
    fn map_plan(&self, weights: &Weights, FillFrom { begun, copies }: FillFrom<'_>) -> Result<Option<MapPlan>> {
        let recipe = &begun.recipe;
        if recipe.reload != Reload::Map || copies.is_some() || recipe.from_snapshot || recipe.checkpoint.is_empty() {
            return Ok(None);
        }
        let failing = Failing::of(begun);
        let checkpoint = Checkpoint::open(&recipe.checkpoint).map_err(|source| failing.checkpoint(source))?;
        recipe.first_reads.meet_all(failing.model, checkpoint.files(), checkpoint.stamps())?;
        let plan = MapPlan::of(&checkpoint, weights, &recipe.names).map_err(|source| failing.checkpoint(source))?;
        Ok(Some(plan))
    }

    /// Fills the storages `ids` of a refilled instance, from its host tier `copies` or its
    /// checkpoint; their bytes, and the checkpoint's load report.
    fn fill(
        &self,
        instance: &Instance,
        weights: &Weights,
        ids: &HashSet<u64>,
        FillFrom { begun, copies }: FillFrom<'_>,
    ) -> Result<(u64, Option<LoadReport>)> {
        let (name, recipe, failing) = (&instance.name, &begun.recipe, Failing::of(begun));
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
                    .map_err(|source| {
                        let said = source.to_string();
                        failing.typed(&said, StageError::HostTier { model: name.clone(), source })
                    })
            }
            // Every reallocated storage must be filled: a tensor the checkpoint cannot fill is
            // an error here (its storage should have been kept, see `Instance::kept`).
            None => self
                .load_checkpoint(
                    failing,
                    &recipe.checkpoint,
                    &recipe.first_reads,
                    &targets,
                    &recipe.names.clone().complete().filled_elsewhere(elsewhere.into_iter().map(|(n, _)| n)),
                    if begun.purpose.is_prefetch() { Fill::Background } else { Fill::Whole },
                )
                .map(Some),
        }?;
        let bytes = weights.storages.iter().filter(|s| ids.contains(&s.id)).map(|s| s.nbytes as u64).sum();
        Ok((bytes, report))
    }
}

/// How a build met its checkpoint.
enum BuildFill {
    /// Filled (or checked) from it, with its report where it has one.
    Done(Option<LoadReport>),
    /// Its storages freed for the first refill, which maps them ([`maps_at_build`]).
    ToMap,
}

/// Whether a build of `recipe` leaves its weights to the first refill, which gives them the
/// checkpoint's pages ([`Reload::Map`], [`MapPlan`]) as a reload would: a model built without
/// initial values ([`Init::Skipped`]) from a checkpoint of its own, not streamed.
fn maps_at_build(recipe: &Recipe) -> bool {
    recipe.init == Init::Skipped
        && recipe.reload == Reload::Map
        && !recipe.checkpoint.is_empty()
        && !recipe.from_snapshot
        && recipe.stream.is_none()
}

#[cfg(test)]
mod tests {
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
        let before = models.inner.slots.locks();
        f();
        models.inner.slots.locks() - before
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
        assert_eq!(refill, 2);
    }
}
