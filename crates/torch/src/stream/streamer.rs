//! The streamed model: its state, its set-up in named steps (the parts of [`super::block`], the
//! split, the host copies, the resident part read), its options and what it reports. The parts
//! of its state that change together are owners of their own, each taken by what changes it:
//! what refills read ([`super::refill::Setting`]: the name, device and sizes, the split, the
//! order of [`super::order::Order`], where the bytes come from) and what they change
//! ([`super::refill::Memory`]: the blocks, the slot buffers and reads in flight of
//! [`super::slots::BlockSlots`], the hot set of [`stageload_plan::hot`], the counts), and the
//! readings of memory and the governors ([`super::readings::Readings`]). Its steps live in
//! [`super::run`], refills in [`super::refill`], the block boundary in [`super::step`].
//!
//! Nothing here takes a lock: the model is `&mut` for a step, and the only other thread is the
//! one refilling the block ahead, whose storages nothing else touches until it is joined (a read
//! into a slot touches none of them: it writes through views of the slot's buffer, which between
//! steps no tensor of the model holds, [`super::slots`]).

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Instant;

use stageload_trace::event::{Event, EventSink, Loaded};
use tch::{Device, Tensor};

use super::block::{pinned_copies, Parts, ReadMode};
use super::blocks::BlockSpec;
use super::order::Order;
use super::readings::{Reading, Readings};
use super::refill::{Memory, Setting};
use super::split::{describe, fit_within, DirectReads, Sizes, Split};
use super::stats::StreamStats;
use super::{torch, StreamError};
use crate::checkpoint::Checkpoint;
use crate::names::NameRules;
use crate::storage::{self, StorageRecord};

/// A streamed model as a pipeline file describes it (`stream = { ... }` in its entry), handed
/// to its loader by [`BuildContext::stream`](crate::BuildContext::stream): the registry gives
/// such a model no checkpoint (it would load it whole); [`StreamedModel::planned`] reads it.
#[derive(Clone)]
pub struct StreamPlan {
    /// The model's checkpoint files.
    pub files: Vec<std::path::PathBuf>,
    /// How its tensors fall into blocks.
    pub spec: BlockSpec,
    /// The byte budget its resident part and one step fit in.
    pub budget: u64,
    /// Bytes a step's working set needs beside the weights.
    pub working: u64,
    /// Whether the forward runs blocks in any order or only some of them.
    pub any_order: bool,
    /// The model's name rules, the file's ignored entries included.
    pub names: NameRules,
    /// The registry's event sink: the model's `residency` events go into the run's trace.
    pub(crate) sink: Option<Arc<dyn EventSink>>,
    /// The registry counts the model as what its split holds (written at set-up and at every
    /// change of the split), not as the storages it had when it was built.
    pub(crate) held: Arc<AtomicU64>,
    /// What the plan counts it to hold once built (what a prefetch of it must find room for).
    pub(crate) planned_held: u64,
    /// The files its first set-up read, as it found them (its registry entry's record).
    pub(crate) first_reads: Arc<crate::source::FirstReads>,
}

impl std::fmt::Debug for StreamPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamPlan")
            .field("files", &self.files)
            .field("spec", &self.spec)
            .field("budget", &self.budget)
            .field("working", &self.working)
            .field("any_order", &self.any_order)
            .finish_non_exhaustive()
    }
}

/// What set-up fits the split to.
struct Fit {
    budget: u64,
    working: u64,
    any_order: bool,
}

/// A model whose blocks stream through memory under a byte budget; see [`super`].
pub struct StreamedModel {
    /// What refills change: the blocks, the slots, the hot set, the counts.
    pub(super) memory: Memory,
    /// What refills read: name, device, sizes, split, order, checkpoint, host copies, reads.
    pub(super) setting: Setting,
    pub(super) budget: u64,
    /// Working memory measured so far (the largest step).
    pub(super) working: u64,
    /// The memory steps are measured in, its high-water mark, and the governors.
    pub(super) readings: Readings,
    pub(super) sink: Option<Arc<dyn EventSink>>,
    /// Where a registry reads what the split holds ([`StreamPlan`]'s `held`).
    pub(super) held_for_registry: Option<Arc<AtomicU64>>,
    /// Bytes and seconds of set-up's load (fixed tensors and resident prefix).
    pub(super) setup: (u64, f64),
    /// The model's tensors by their names, as given.
    pub(super) tensors: Vec<(String, Tensor)>,
    /// The fixed tensors' storages (in no block; always resident).
    pub(super) fixed: Vec<StorageRecord>,
}

impl std::fmt::Debug for StreamedModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamedModel").field("name", &self.setting.name).field("split", &self.setting.split).finish()
    }
}

impl StreamedModel {
    /// The streamed model the pipeline file describes ([`StreamPlan`], from
    /// [`BuildContext::stream`](crate::BuildContext::stream)): its checkpoint, blocks, budget,
    /// working memory and order, so the run is the plan `stageload plan` checked; its
    /// `residency` events go to the registry's sink.
    ///
    /// ```no_run
    /// # use stageload::{named_tensors, stream::StreamedModel, BoxError, BuildContext, Built};
    /// # use stageload_demo_kit::{ModelShape, Transformer};
    /// # use tch::nn::VarStore;
    /// struct Flow {
    ///     net: Transformer,
    ///     streamed: StreamedModel,
    /// }
    ///
    /// // The loader of a model whose pipeline file entry has `stream = { blocks = [...], ... }`;
    /// // called as `models.call("flow", |m: &mut Flow| m.streamed.run(|step| m.net.forward_streamed(&x, step)))`.
    /// fn flow(ctx: &BuildContext, shape: &ModelShape) -> Result<Built, BoxError> {
    ///     let plan = ctx.stream().ok_or("the pipeline file does not stream 'flow'")?;
    ///     let vs = VarStore::new(tch::Device::Cpu);
    ///     let net = stageload_torch_sys::without_fills(|| Transformer::new(vs.root() / "model", shape));
    ///     let streamed = StreamedModel::planned("flow", named_tensors(&vs), plan)?; // reads the resident part
    ///     let tensors = streamed.tensors();
    ///     Ok(Built::from_tensors(Flow { net, streamed }, tensors))
    /// }
    /// ```
    pub fn planned(
        name: impl Into<String>,
        tensors: Vec<(String, Tensor)>,
        plan: &StreamPlan,
    ) -> Result<Self, StreamError> {
        let name = name.into();
        let checkpoint = Checkpoint::open(&plan.files)
            .map_err(|source| StreamError::Checkpoint { model: name.clone(), source: Box::new(source) })?;
        plan.first_reads.meet_all(&name, checkpoint.files(), checkpoint.stamps())?;
        let fit = Fit { budget: plan.budget, working: plan.working, any_order: plan.any_order };
        let mut model = StreamedModel::set_up(name, tensors, checkpoint, &plan.names, &plan.spec, fit)?;
        model.held_for_registry = Some(Arc::clone(&plan.held));
        model.publish_holding();
        // Residency into the run's trace; the registry reports the load itself.
        if let Some(sink) = &plan.sink {
            model.report_to(Arc::clone(sink));
        }
        Ok(model)
    }

    /// Sets up `tensors` (a model's named tensors, e.g. [`crate::named_tensors`] of its
    /// VarStore) as blocks per `spec`, streamed from `checkpoint` (names met under `rules`)
    /// under `budget` bytes: frees the streamed blocks and fills the fixed tensors and the
    /// resident prefix from the checkpoint, which must hold every tensor. Build the model under
    /// [`stageload_torch_sys::without_fills`] so that its construction touches none of its
    /// memory (the peak is then the resident part, never the whole model).
    ///
    /// On the CPU this makes glibc return every freed block of 1 MiB or more to the OS at once
    /// ([`stageload_torch_sys::map_large_host_blocks`], process-wide), so a freed block leaves
    /// the RSS. The checkpoint reads as [`super::REFILL_READS`] says.
    pub fn new(
        name: impl Into<String>,
        tensors: Vec<(String, Tensor)>,
        checkpoint: Checkpoint,
        rules: &NameRules,
        spec: &BlockSpec,
        budget: u64,
    ) -> Result<Self, StreamError> {
        let fit = Fit { budget, working: 0, any_order: false };
        StreamedModel::set_up(name.into(), tensors, checkpoint, rules, spec, fit)
    }

    /// [`Self::new`] with the working memory and the order known before anything is read, so
    /// set-up reads only the blocks that stay. Its steps: cut the tensors into parts
    /// ([`Parts::of`]), fit the split to the budget, pin the blocks' host copies (CUDA), then
    /// read the resident part ([`Self::fill_resident`]) and size the slots.
    fn set_up(
        name: String,
        tensors: Vec<(String, Tensor)>,
        checkpoint: Checkpoint,
        rules: &NameRules,
        spec: &BlockSpec,
        Fit { budget, working, any_order }: Fit,
    ) -> Result<Self, StreamError> {
        let checkpoint = checkpoint.host_reads(super::REFILL_READS);
        let Parts { blocks, fixed, fixed_storages } = Parts::of(&name, &tensors, &checkpoint, rules, spec)?;
        let sizes = Parts::sizes_of(&fixed_storages, &blocks);
        let split = fit_within(&sizes, budget, working, if any_order { 0 } else { blocks.len() }, true)
            .map_err(|source| StreamError::Budget { model: name.clone(), source })?;
        let device = tensors.first().map_or(Device::Cpu, |(_, t)| t.device());
        if device == Device::Cpu {
            stageload_torch_sys::map_large_host_blocks();
        }
        let setting = Setting {
            name,
            device,
            sizes,
            split,
            order: Order::new(any_order),
            checkpoint: Arc::new(checkpoint),
            host: None,
            reads: ReadMode::new(),
        };
        let mut streamed = StreamedModel {
            memory: Memory::new(blocks, split),
            setting,
            budget,
            working,
            readings: Readings::of(device),
            sink: None,
            held_for_registry: None,
            setup: (0, 0.0),
            tensors: Vec::new(),
            fixed: fixed_storages,
        };
        streamed.pin_host_copies();
        streamed.fill_resident(fixed)?;
        streamed.tensors = tensors;
        // The slots now, so that a registry given `tensors()` frees them with the model.
        streamed.memory.fit_slots(&streamed.setting)?;
        tracing::info!("{}", describe(&streamed.setting.name, &streamed.setting.sizes, split));
        Ok(streamed)
    }

    /// CUDA: every block's tensors read once into pinned host memory, which refills copy from;
    /// where pinning fails, refills read the checkpoint (said once, as a warning).
    fn pin_host_copies(&mut self) {
        if !self.setting.device.is_cuda() {
            return;
        }
        match pinned_copies(&self.memory.blocks, &self.setting.checkpoint) {
            Ok(copies) => self.setting.host = Some(copies),
            Err(reason) => tracing::warn!(
                "streamed model '{}': no pinned host copies ({reason}); its blocks are refilled from the checkpoint",
                self.setting.name
            ),
        }
    }

    /// Frees the streamed blocks first, so that at no time more than the resident part is
    /// filled, then gives the fixed tensors (`fixed`, under their entries' names) and the
    /// resident prefix memory and reads them from the checkpoint (set-up's load).
    fn fill_resident(&mut self, fixed: Vec<(String, Tensor)>) -> Result<(), StreamError> {
        let resident = self.setting.split.resident;
        for index in resident..self.memory.blocks.len() {
            self.memory.release(&self.setting, index)?;
        }
        let prefix = &self.memory.blocks[..resident];
        // Resident storages freed before set-up ([`place`]) get their memory back first.
        for record in self.fixed.iter().chain(prefix.iter().flat_map(|b| &b.storages)) {
            // SAFETY: during set-up no other thread has the model; the load below fills it.
            unsafe { storage::reallocate(std::slice::from_ref(record)) }
                .map_err(torch(&self.setting.name, "give a resident tensor memory"))?;
        }
        let initial: Vec<(String, Tensor)> =
            fixed.into_iter().chain(prefix.iter().flat_map(|b| storage::shallow(&b.targets))).collect();
        let start = Instant::now();
        let report = self
            .setting
            .checkpoint
            .load_into(&initial, |_| {})
            .map_err(|source| StreamError::Checkpoint { model: self.setting.name.clone(), source: Box::new(source) })?;
        self.setup = (report.bytes, start.elapsed().as_secs_f64());
        Ok(())
    }

    /// Sends to `sink` a `load` event for set-up's load (the resident part), a `residency`
    /// event for the split now, and one for every later change.
    ///
    /// Every option of a streamed model takes `&mut self` and returns it (`Result` where it can
    /// fail), so options chain at set-up and can change between steps too.
    pub fn events(&mut self, sink: Arc<dyn EventSink>) -> &mut Self {
        let load = Loaded {
            model: self.setting.name.clone(),
            bytes: Some(self.setup.0),
            seconds: Some(self.setup.1),
            streamed: true,
            ..Loaded::default()
        };
        sink.emit(&Event::now(load));
        self.report_to(sink);
        self
    }

    /// Sends `residency` events to `sink` from now on, starting with the split now.
    fn report_to(&mut self, sink: Arc<dyn EventSink>) {
        self.sink = Some(sink);
        self.announce("start", None);
    }

    /// Measures working memory with `reading` (bytes now) instead of the process's RSS (CPU) or
    /// the CUDA allocator's bytes, and without a high-water mark unless
    /// [`peak_reading`](Self::peak_reading) gives one.
    pub fn reading(&mut self, reading: impl FnMut() -> Option<u64> + Send + 'static) -> &mut Self {
        self.readings.set_memory(Box::new(reading));
        self
    }

    /// The governor: before each step, when the machine has less than `floor` bytes available
    /// (the probe's reading, a cgroup's headroom included), one more block is streamed, so the
    /// model gives memory back while others need it. The count only goes down ([`reset`](Self::reset)).
    pub fn governor(&mut self, floor: u64) -> &mut Self {
        let available: Reading = Box::new(|| stageload_probe::system_memory().ok().map(|m| m.budget_available()));
        self.readings.set_governor(floor, available);
        self
    }

    /// The governor with `available` read from elsewhere (bytes available now).
    pub fn governor_reading(
        &mut self,
        floor: u64,
        available: impl FnMut() -> Option<u64> + Send + 'static,
    ) -> &mut Self {
        self.readings.set_governor(floor, Box::new(available));
        self
    }

    /// The governor on memory pressure: before each step, when the kernel's pressure stall
    /// information (`/proc/pressure/memory`, `some avg10`: the percent of the last 10 s in which
    /// some task waited for memory) is at `threshold` or more, half the hot set's room goes, and
    /// once that is empty one more block is streamed; at most once per
    /// [`PRESSURE_WINDOW`](super::split::PRESSURE_WINDOW), so that the average can show what it
    /// did. Where the kernel has no PSI nothing changes. Refused: a threshold outside (0, 100].
    pub fn governor_pressure(&mut self, threshold: f64) -> Result<&mut Self, StreamError> {
        self.governor_pressure_reading(threshold, || {
            stageload_probe::pressure().ok().flatten().map(|pressure| pressure.some_avg10)
        })
    }

    /// [`governor_pressure`](Self::governor_pressure) with `pressure` read from elsewhere
    /// (percent now).
    pub fn governor_pressure_reading(
        &mut self,
        threshold: f64,
        pressure: impl FnMut() -> Option<f64> + Send + 'static,
    ) -> Result<&mut Self, StreamError> {
        if !(threshold > 0.0 && threshold <= 100.0) {
            return Err(StreamError::Setting {
                model: self.setting.name.clone(),
                message: format!(
                    "a pressure threshold of {threshold} is not a percent of time stalled: give one above 0 and at most 100 (e.g. 10)"
                ),
            });
        }
        self.readings.set_pressure(threshold, Box::new(pressure));
        Ok(self)
    }

    /// The high-water mark of what [`reading`](Self::reading) reads.
    pub fn peak_reading(&mut self, peak: impl FnMut() -> Option<u64> + Send + 'static) -> &mut Self {
        self.readings.set_peak(Box::new(peak));
        self
    }

    /// Declares the working memory a step needs (measured in an earlier run's trace: its peak
    /// less its weights): the split keeps room for it from the first step. Measurement at block
    /// boundaries sees what a step holds between blocks, not the transients inside one
    /// (attention scores), so a declared figure is the safer one on the CPU.
    pub fn working_memory(&mut self, bytes: u64) -> Result<&mut Self, StreamError> {
        self.working = self.working.max(bytes);
        self.refit_to(self.setting.split.resident, self.setting.split.hot, "working memory")?;
        // The blocks set-up read that no longer stay go now, not at the first step.
        self.let_go()?;
        Ok(self)
    }

    /// Every tensor of the model, and the slots as `stream-slot.N`: what a registry frees to
    /// release the model (`Built::from_tensors(model, streamed.tensors())`; declare no
    /// checkpoint on its spec, so that it comes back by a rebuild, which reads only the resident
    /// part again). Between steps nothing runs on any of them.
    pub fn tensors(&self) -> Vec<(String, Tensor)> {
        storage::shallow(&self.tensors).into_iter().chain(self.memory.slots.named()).collect()
    }

    /// The model's name.
    pub fn name(&self) -> &str {
        &self.setting.name
    }

    /// How the blocks are held now.
    pub fn split(&self) -> Split {
        self.setting.split
    }

    /// The bytes the split was decided from.
    pub fn sizes(&self) -> &Sizes {
        &self.setting.sizes
    }

    /// The largest working memory a step was measured to need.
    pub fn working(&self) -> u64 {
        self.working
    }

    /// What has moved so far.
    pub fn stats(&self) -> StreamStats {
        StreamStats { bytes_direct: self.setting.reads.bytes_direct(), ..self.memory.stats }
    }

    /// `NoSuchBlock` unless the model has block `index`.
    pub(super) fn check_index(&self, index: usize) -> Result<(), StreamError> {
        match index < self.memory.blocks.len() {
            true => Ok(()),
            false => Err(StreamError::NoSuchBlock {
                model: self.setting.name.clone(),
                index,
                blocks: self.memory.blocks.len(),
            }),
        }
    }

    /// The residency line (`flow: 6 of 12 blocks resident, 6 streamed, …`); in any order, the
    /// bytes per step are those of a step that runs every block.
    pub fn residency(&self) -> String {
        let line = describe(&self.setting.name, &self.setting.sizes, self.setting.split);
        match self.setting.order.any() {
            true => line + "; in any order (a step reads only the blocks it runs and does not find hot)",
            false => line,
        }
    }

    /// Forgets the measured working memory and keeps as many blocks resident, and as large a
    /// hot set, as the budget holds again; released prefix blocks come back as the next step
    /// reaches them.
    pub fn reset(&mut self) -> Result<(), StreamError> {
        self.working = 0;
        self.refit_to(self.memory.blocks.len(), u64::MAX, "reset")
    }

    /// What the model holds now, counted from its storages, not from the split's formula: the
    /// fixed tensors, every block with memory outside a slot (resident, hot, or on CUDA being
    /// refilled ahead: counted at its size) and the slot buffers, filled or not (their pages
    /// stay). Bytes on the model's device; on CUDA the pinned host copies refills copy from are
    /// [`pinned_bytes`](Self::pinned_bytes). What the budget bounds (see [`super`]).
    pub fn held_bytes(&self) -> u64 {
        let ahead = self.memory.slots.ahead().filter(|a| self.memory.blocks[a.block].slot.is_none());
        self.held_outside_ahead().saturating_add(ahead.map_or(0, |a| self.setting.sizes.blocks[a.block]))
    }

    /// Notes what the model holds now in [`StreamStats::most_held`].
    pub(super) fn note_held(&mut self) {
        self.memory.stats.most_held = self.memory.stats.most_held.max(self.held_bytes());
    }

    /// Bytes of host memory pinned for the blocks' copies (CUDA; 0 on the CPU or when pinning
    /// failed): their buffer, in whole pages.
    pub fn pinned_bytes(&self) -> u64 {
        self.setting.host.as_ref().map_or(0, |copies| copies.bytes())
    }

    /// [`held_bytes`](Self::held_bytes) less the block being refilled ahead, whose storages its
    /// refill thread owns until joined: read without touching them.
    pub(super) fn held_outside_ahead(&self) -> u64 {
        let ahead = self.memory.slots.ahead_block();
        let blocks = self.memory.blocks.iter().enumerate().filter(|(i, b)| b.slot.is_none() && Some(*i) != ahead);
        let storages = self.fixed.iter().chain(blocks.flat_map(|(_, b)| &b.storages));
        storages.map(|s| storage::allocated_bytes(&s.tensor)).fold(self.memory.slots.bytes(), u64::saturating_add)
    }

    /// Keeps at most `resident` blocks resident, and none hot, from the next step on (to stream
    /// more than the budget asks, say for a benchmark); [`reset`](Self::reset) lifts it.
    pub fn limit_resident(&mut self, resident: usize) -> Result<&mut Self, StreamError> {
        self.refit_to(resident.min(self.setting.split.resident), 0, "limit")?;
        Ok(self)
    }

    /// Whether a streamed block is read while the one before it runs (on by default). Off, the
    /// model has one slot instead of two and every refill runs when the forward reaches its
    /// block (the step waits for each); the split is fitted again as set-up fits it (the working
    /// memory measured so far kept), so the slot's bytes go to resident blocks or the hot set.
    /// From the next step on.
    pub fn look_ahead(&mut self, on: bool) -> Result<&mut Self, StreamError> {
        self.setting.order.set_look_ahead(on);
        self.refit_to(self.memory.blocks.len(), u64::MAX, if on { "look-ahead on" } else { "look-ahead off" })?;
        Ok(self)
    }

    /// Declares that the forward runs the blocks in any order, or only some of them each step
    /// (a mixture of experts' experts): no block is kept for its position; the room the budget
    /// leaves beside the fixed tensors, the slots and the working memory holds the blocks used
    /// most (the hot set, [`stageload_plan::hot`]), and the block loaded ahead is the one the
    /// forward names with [`Step::prefetch`](super::Step::prefetch) (none is guessed).
    pub fn any_order(&mut self) -> Result<&mut Self, StreamError> {
        self.setting.order.set_any();
        self.refit_to(0, u64::MAX, "any order")?;
        // The prefix set-up read stays, as hot blocks, while the room holds it; the rest goes.
        for index in 0..self.memory.blocks.len() {
            if self.memory.blocks[index].allocated && self.memory.blocks[index].slot.is_none() {
                self.memory.keep_hot(&self.setting, index, None)?;
            }
        }
        self.let_go()?;
        Ok(self)
    }

    /// Refills from the checkpoint read past the page cache: each drops the block's bytes from
    /// it once read ([`Checkpoint::drop_cached`]), so streaming a model bigger than the machine's
    /// memory does not push other programs' files out, and every refill reads the disk (what
    /// such a model costs; the hot set then saves disk reads). After a step limited by its
    /// compute, not its reads ([`stageload_plan::split::direct_reads`]), a block that lies in its
    /// file as its slot lays it out is read with `O_DIRECT` straight into the slot instead
    /// ([`StreamStats::bytes_direct`]), which leaves the forward's cores the CPU a buffered
    /// read takes.
    pub fn uncached(&mut self) -> &mut Self {
        self.setting.reads.uncached = true;
        self
    }

    /// When uncached refills read with `O_DIRECT` straight into their slots (see
    /// [`uncached`](Self::uncached)): after a step limited by its compute
    /// ([`DirectReads::Adaptive`], the default), [`Never`](DirectReads::Never) (every refill
    /// through the page cache: for a file system whose direct reads are slow, or to measure what
    /// they save) or [`Always`](DirectReads::Always). From the next refill on.
    pub fn direct_reads(&mut self, mode: DirectReads) -> &mut Self {
        self.setting.reads.set_mode(mode);
        self
    }

    /// The split under the budget with the working memory known now, at most `at_most`
    /// resident blocks and a hot set's room of at most `hot_at_most`; a change is announced, and
    /// the next step's `begin` frees what it drops.
    fn refit_to(&mut self, at_most: usize, hot_at_most: u64, reason: &str) -> Result<(), StreamError> {
        let at_most = if self.setting.order.any() { 0 } else { at_most };
        let split =
            fit_within(&self.setting.sizes, self.budget, self.working, at_most, self.setting.order.look_ahead())
                .map_err(|source| StreamError::Budget { model: self.setting.name.clone(), source })?;
        self.set_split(Split { hot: split.hot.min(hot_at_most), ..split }, reason, None);
        Ok(())
    }

    /// The one place the split changes: `split` (without its look-ahead when that is off) from
    /// the next step on, announced when it differs (`over`: a step needs that much more than the
    /// budget even so). The next step's `begin` frees what it drops and sizes the slots.
    pub(super) fn set_split(&mut self, split: Split, reason: &str, over: Option<u64>) {
        let split = Split { look_ahead: split.look_ahead && self.setting.order.look_ahead(), ..split };
        if split != self.setting.split || over.is_some() {
            self.setting.split = split;
            self.announce(reason, over);
        }
    }
}

impl Drop for StreamedModel {
    /// Joins the refill ahead, says what the model moved (an `end` residency event), then frees
    /// every block in a slot before the slots go. On CUDA the host waits here, outside any step,
    /// for the refills' copies queued on this thread's stream, before the pinned host copies
    /// they read go with the model.
    fn drop(&mut self) {
        self.memory.slots.abandon_carried();
        let _ = self.memory.join_ahead(&self.setting);
        if let Device::Cuda(index) = self.setting.device {
            if let Err(err) = stageload_torch_sys::CudaEvent::record(index).and_then(|done| done.synchronize()) {
                tracing::warn!(%err, "streamed model '{}': waiting for its last refills", self.setting.name);
            }
        }
        self.announce_totals();
        for index in 0..self.memory.blocks.len() {
            if self.memory.blocks[index].slot.is_some() && self.memory.release(&self.setting, index).is_err() {
                // The storage still points into the slot: keep the slot's memory alive.
                if let Some(slot) = self.memory.blocks[index].slot {
                    self.memory.slots.leak(slot);
                }
            }
        }
    }
}

/// Moves a model built on the CPU (under [`stageload_torch_sys::without_fills`], so that none
/// of its memory was touched) to `device` one tensor at a time, each left without memory there:
/// at no time does the device hold more than one tensor, so a model bigger than the device can
/// then be set up as a [`StreamedModel`], which gives the resident part its memory back and
/// streams the rest. Each tensor keeps its identity (the model's modules see the move); tensors
/// that shared a storage get one each.
pub fn place(model: &str, tensors: &[(String, Tensor)], device: Device) -> Result<(), StreamError> {
    for (name, tensor) in tensors {
        let mut moved = tensor.shallow_clone();
        let fresh = Tensor::f_empty(tensor.size(), (tensor.kind(), device))?;
        moved.f_set_data(&fresh)?;
        drop(fresh);
        let message = format!("tensor '{name}' of streamed model '{model}' was placed on {device:?} without memory");
        // SAFETY: the storage was made just above for this tensor alone; nothing runs on it.
        unsafe { stageload_torch_sys::free_storage(&moved, &message) }.map_err(torch(model, "place a tensor"))?;
    }
    Ok(())
}
