//! StagedModels: a map of named models where only the current stage's models are resident.
//!
//! A model is built by its loader the first time it is asked for, under preserved RNG state
//! ([`crate::rng`]), and filled from its safetensors checkpoint when it declared one (names
//! matched by its [`crate::NameRules`]). [`StagedModels::enter`] releases, in place, every
//! resident model the new stage does not list and that is not pinned: its storages are freed
//! through the shim, so memory comes back even while other code still holds the model, and
//! every handle to it then gives [`StageError::Released`]. Asked for again, a model with a
//! checkpoint comes back in place (the same object, storages reallocated and refilled, no random
//! number drawn); one without is rebuilt by its loader.
//!
//! The API takes `&self` and is safe to share between threads. No call holds the registry's
//! lock while it waits for another thread: a release of a model that some thread is using is
//! carried out by that thread's guard when it lets go (see `registry` for the lock order).
//!
//! With a host tier ([`StagedModelsBuilder::host_tier`]), a device model's release first copies
//! its weights into host memory (pinned for the device) when the tier's budget has room, and its
//! next `get` copies them back in place: no checkpoint read, no rebuild, no random number drawn.
//!
//! Files (all private; what users need is re-exported here and at the crate root): `decide`
//! (the slot state machine, pure), `slots` (the slot table behind the state lock, and the load
//! transaction's steps under it), `registry` (the registry's parts; stage entry, insert, remove,
//! close), `load` (a load run with the lock let go: builds and refills), `release` (frees in
//! place, in batches; writes snapshots before), `prefetch` (background loads), `placement` (the
//! pipeline file's device and dtype), `tier_copy` (the host tier's copies; its budget, leases and
//! evictions are the pure [`stageload_plan::tier`]), `tier_store` (the registry storing into
//! it), `instance` (a model object, its handle and guard), `spec` (what loaders get and return,
//! and what builds go by), `snapshot` (the snapshot folder's files), `builder`, `error` (every
//! error of the registry, so that no file imports another's for its error).
//!
//! The registry's parts that keep state of their own are owners, each with its fields private
//! to its file, and none of those files reaches back into the registry: the slot table
//! (`slots`), the build turn (`turn`), what builds go by (`spec::Builds`), what prefetches go by
//! and their threads (`background`), the host tier's allocator and test hooks
//! (`tier_copy::TierSide`), the snapshot folder (`snapshot`), the heap's trim (`caches`), the
//! storages refills fill (`fills`). The files that carry the registry's decisions out (`load`,
//! `release`, `prefetch`, `tier_store`) are `impl Inner` blocks that take the state lock through
//! the slot table, for bookkeeping only; a load's own bookkeeping is the slot table's
//! transaction (`Slots::begin_load`, `Slots::finish_load`).

mod background;
mod builder;
mod caches;
mod decide;
mod error;
mod fills;
mod instance;
mod load;
mod mapped;
mod placement;
mod prefetch;
mod registry;
mod release;
mod slots;
mod snapshot;
mod spec;
mod tier_copy;
mod tier_store;
#[cfg(test)]
mod tier_tests;
mod turn;

use std::sync::Arc;

pub use builder::StagedModelsBuilder;
pub use decide::{ModelState, OutOfMemory};
pub use error::{BoxError, SnapshotError, StageError};
pub use instance::{Handle, ModelGuard};
pub use spec::{named_tensors, BuildContext, Built, ModelSpec, Reload};
pub use turn::{PrefetchPace, UnknownPace};

use crate::error::{is_out_of_memory, panic_message};
use crate::storage::ReleaseStats;
use error::Result;
use registry::Inner;
use stageload_trace::event::{Event, LoadReport, Marked};

/// Named models loaded on first use and released in place between stages. See the module docs;
/// made by [`StagedModels::builder`].
///
/// ```no_run
/// # use stageload::{ModelSpec, StagedModels};
/// # use tch::nn::{Linear, Module};
/// # fn run(encoder: ModelSpec, decoder: ModelSpec, x: &tch::Tensor) -> Result<(), Box<dyn std::error::Error>> {
/// let models = StagedModels::builder()
///     .model(encoder) // ModelSpec::new("encoder", loader).checkpoint(["encoder.safetensors"])
///     .model(decoder)
///     .stage("encode", ["encoder"])
///     .stage("decode", ["decoder"])
///     .prefetch_next(true) // each `enter` starts loading the next stage's models
///     .build()?;
/// models.enter("encode")?;
/// let encoder = models.get::<Linear>("encoder")?; // a typed handle: the type is checked now
/// let latent = encoder.lock()?.forward(x); // locked for the call, built on first use
/// models.enter("decode")?; // released in place: `encoder.lock()` is now `StageError::Released`
/// let y = models.call("decoder", |m: &mut Linear| m.forward(&latent))?; // get + lock in one
/// println!("{:?}", models.states()); // [("encoder", Released), ("decoder", Resident)]
/// # Ok(()) }
/// ```
pub struct StagedModels {
    inner: Arc<Inner>,
}

/// Stops the prefetches ([`StagedModels::stop_prefetches`]), so that none outlives the registry
/// (or the process's libtorch, when the registry is dropped at the end of `main`).
impl Drop for StagedModels {
    fn drop(&mut self) {
        self.stop_prefetches();
    }
}

impl StagedModels {
    /// Calls `f` on the model `name`, loaded (or brought back) if needed and locked for the
    /// call: the one-call form of [`get`](Self::get) + [`Handle::lock`]. A panic inside `f` is
    /// caught and returned as [`StageError::CallPanicked`] ([`StageError::OutOfMemory`] when it
    /// says the device ran out of memory); the model is unlocked and the registry stays usable.
    ///
    /// ```no_run
    /// # fn f(models: &stageload::StagedModels, x: &tch::Tensor) -> Result<(), stageload::StageError> {
    /// let y = models.call("encoder", |m: &mut tch::nn::Sequential| tch::nn::Module::forward(m, x))?;
    /// # Ok(()) }
    /// ```
    pub fn call<M: 'static, R>(&self, name: &str, f: impl FnOnce(&mut M) -> R) -> Result<R> {
        let handle = self.get::<M>(name)?;
        let mut guard = handle.lock()?;
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&mut guard))).map_err(|panic| {
            let message = panic_message(&*panic);
            if is_out_of_memory(&message) {
                StageError::OutOfMemory { model: name.to_string(), stage: self.current_stage(), message }
            } else {
                StageError::CallPanicked { model: name.to_string(), message }
            }
        })
    }

    /// The model `name`, built (or brought back) on first use, as a typed handle. Emits `load`
    /// or `reload`. [`StageError::WrongType`] when the model is not an `M`.
    pub fn get<M: 'static>(&self, name: &str) -> Result<Handle<M>> {
        self.inner.handle::<M>(name)
    }

    /// Builds (or brings back) `name` now without handing out a handle: for loading models up
    /// front (eager runs) or ahead of the stage that uses them.
    pub fn load(&self, name: &str) -> Result<()> {
        self.inner.instance(name).map(drop)
    }

    /// Enters `stage`: records it, then releases every resident model it does not list and that
    /// is not pinned. Emits `stage`, then one `release` per model. A model some thread holds
    /// locked is released when that thread drops its guard (its `release` event comes then);
    /// the stats returned count what was freed now.
    pub fn enter(&self, stage: &str) -> Result<ReleaseStats> {
        let stats = self.inner.enter(stage)?;
        if self.inner.background.after_enter() {
            if let Some(next) = self.inner.next_stage() {
                self.inner.prefetch(&next)?;
            }
        }
        Ok(stats)
    }

    /// Starts loading `stage`'s models in the background (a thread each; on CUDA a side
    /// stream), while the current stage computes: a `prefetch` event each, then their
    /// `load`/`reload` event marked `prefetched`. A `get` of a model still in flight waits for
    /// it; a prefetch that fails says why in an `error` event, and the `get` that needs the model
    /// loads it again (its caller gets the error if that fails too). Only loads
    /// that draw no random number are started (a refill in place from the checkpoint, or a
    /// build with `skip_init`), so seeded runs stay bit-identical; within
    /// [`prefetch_budget`](StagedModelsBuilder::prefetch_budget) if one is set. Returns the
    /// models started; [`prefetching`](Self::prefetching) lists them until their loads end,
    /// [`wait_prefetch`](Self::wait_prefetch) waits for that.
    pub fn prefetch(&self, stage: &str) -> Result<Vec<String>> {
        self.inner.prefetch(stage)
    }

    /// The models being prefetched now: from the [`prefetch`](Self::prefetch) (or
    /// `prefetch_next`'s) that started them until their background load has ended (loaded,
    /// failed, or given up when the registry closed), in the order they started (never loads).
    pub fn prefetching(&self) -> Vec<String> {
        self.inner.prefetching()
    }

    /// Waits until every prefetch started for `stage` so far has ended (loaded or failed: a
    /// failure is left to the `get` that needs the model); returns at once when none runs.
    /// Afterwards the `load`/`reload` events of those prefetches have been emitted. Waits on the
    /// registry's condition variable, holding no lock. [`StageError::UnknownStage`] for a stage
    /// the plan does not have.
    pub fn wait_prefetch(&self, stage: &str) -> Result<()> {
        self.inner.wait_prefetch(stage)
    }

    /// Cancels the prefetches that have not begun their load (a thread not yet going, a build
    /// waiting for its turn, a prefetch waiting for another load of its model), waits for those
    /// already running, and starts no more: what dropping the registry does first, for a host
    /// that ends the process without dropping it (Python's interpreter, whose exit stops other
    /// threads in the middle of a torch call and so aborts the process). Builds run one at a
    /// time, so the wait is bounded by the one loader running (it is not interrupted: a loader
    /// is the user's code), or by a refill in place already reading its checkpoint or copying
    /// from the host tier, whichever takes longest. Foreground loads go on as before. Called on a
    /// prefetch's own thread (from an event sink), it waits for the others.
    pub fn stop_prefetches(&self) {
        self.inner.cancel_prefetches();
        let me = std::thread::current().id();
        for handle in self.inner.background.take_threads() {
            if handle.thread().id() != me {
                let _ = handle.join();
            }
        }
    }

    /// Every model with its state, in definition order (never loads).
    pub fn states(&self) -> Vec<(String, ModelState)> {
        self.inner.states()
    }

    /// The state of the model `name` (never loads); [`StageError::UnknownModel`] when there is
    /// none of that name.
    pub fn state(&self, name: &str) -> Result<ModelState> {
        self.inner.slots.lock().model_state(name)
    }

    /// How the last load of `name` met its checkpoint (used, converted, unused, ignored,
    /// missing); `None` before the first load or without a checkpoint.
    pub fn load_report(&self, name: &str) -> Result<Option<LoadReport>> {
        self.inner.load_report(name)
    }

    /// Takes the files of `name` that changed since its first load as they are now, at its next
    /// load only: that load records them anew and says which in its event (`accepted`). Without
    /// this, a load that finds a file the model was first loaded from written, resized or
    /// replaced since is refused with [`StageError::SourceChanged`] (the model stays as it was),
    /// since the reload would differ from the first load.
    ///
    /// ```no_run
    /// # fn run(models: &stageload::StagedModels) -> Result<(), stageload::StageError> {
    /// models.enter("decode")?;
    /// match models.load("decoder") {
    ///     Err(stageload::StageError::SourceChanged(changed)) => {
    ///         eprintln!("{changed}; taking the new weights");
    ///         models.accept_changed_files(&changed.model)?;
    ///         models.load("decoder")?;
    ///     }
    ///     other => other?,
    /// }
    /// # Ok(()) }
    /// ```
    pub fn accept_changed_files(&self, name: &str) -> Result<()> {
        let state = self.inner.slots.lock();
        let position = state.position(name)?;
        state.entries()[position].first_reads.accept_changes();
        Ok(())
    }

    /// Whether a model of that name exists (never loads).
    pub fn contains(&self, name: &str) -> bool {
        self.inner.slots.lock().find(name).is_some()
    }

    /// Number of models (never loads).
    pub fn len(&self) -> usize {
        self.inner.slots.lock().entries().len()
    }

    /// Whether the registry has no model (never loads).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Model names in definition order (never loads).
    pub fn names(&self) -> Vec<String> {
        self.states().into_iter().map(|(name, _)| name).collect()
    }

    /// Names of the resident models, in definition order.
    pub fn resident(&self) -> Vec<String> {
        self.inner.resident()
    }

    /// The stage entered last, if any.
    pub fn current_stage(&self) -> Option<String> {
        self.inner.slots.lock().current().map(str::to_string)
    }

    /// The models a stage lists.
    pub fn stage_models(&self, stage: &str) -> Result<Vec<String>> {
        Ok(self.inner.slots.lock().stage_models(stage)?.iter().cloned().collect())
    }

    /// Sets the host tier's byte budget at run time (a registry built without a tier gets one).
    /// Shrinking evicts least recently used copies down to the new budget; when copies in flight
    /// or of pinned models alone hold more, it is refused
    /// ([`StageError::HostTierBudget`]) and nothing changes. A `tier` event records the change.
    pub fn set_host_tier_budget(&self, bytes: u64) -> Result<()> {
        self.inner.set_tier_budget(bytes)
    }

    /// The host tier's budget and the bytes its copies hold (`None`: no tier).
    pub fn host_tier(&self) -> Option<stageload_trace::event::TierUsage> {
        self.inner.tier_usage()
    }

    /// Bytes of the distinct storages of every model holding weights (shared storage once).
    pub fn resident_bytes(&self) -> u64 {
        self.inner.resident_bytes()
    }

    /// Keeps `name` resident across stages. Does not load it.
    pub fn pin(&self, name: &str) -> Result<()> {
        let mut state = self.inner.slots.lock();
        if !state.set_pin(name, true) {
            return Err(StageError::UnknownModel {
                name: name.to_string(),
                known: state.entries().iter().map(|e| e.name.clone()).collect(),
            });
        }
        Ok(())
    }

    /// Ends a pin; the next `enter` releases the model if its stage does not list it.
    pub fn unpin(&self, name: &str) {
        self.inner.slots.lock().set_pin(name, false);
    }

    /// Emits a `mark` event with `label`.
    pub fn mark(&self, label: &str) {
        let stage = self.current_stage();
        self.inner.emit(Event::now(Marked { stage, note: label.to_string(), ..Marked::default() }));
    }

    /// Releases every resident model, pinned ones too, and refuses further loads. Emits a `close`
    /// mark, then one `release` per model. Returns without waiting for prefetches: those that
    /// have not begun their load give up, and a loader or refill already running finishes on
    /// its thread, its model then released at once (dropping the registry waits for it: see
    /// its `Drop`). Returns what was freed now. Cannot fail: a release that fails is reported
    /// as an `error` event and its bytes are not counted.
    pub fn close(&self) -> ReleaseStats {
        self.inner.close()
    }

    /// Registers an already-built model with no loader: once released it cannot come back. A
    /// model already under that name is released (storage it shares with `built` is kept); a
    /// load of that name in flight installs nothing.
    pub fn insert(&self, name: &str, built: Built) -> Result<()> {
        self.inner.insert(name, built)
    }

    /// Removes a model: releases it if resident, forgets its slot and its pin.
    pub fn remove(&self, name: &str) -> Result<()> {
        self.inner.remove(name, true)
    }

    /// Hands a live model over and forgets it: loads it if needed, then removes its slot and
    /// pin without releasing. The handle returned is never released by the registry.
    pub fn take<M: 'static>(&self, name: &str) -> Result<Handle<M>> {
        let handle = self.get::<M>(name)?;
        self.inner.remove(name, false)?;
        Ok(handle)
    }
}
