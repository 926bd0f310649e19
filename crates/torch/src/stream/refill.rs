//! How a streamed block gets its memory and its bytes: a refill (on the thread ahead or on
//! demand) into a slot (CPU: two buffers faulted in once and reused) or the allocator's memory,
//! from the checkpoint (`pread`) or, on CUDA, from pinned host copies by async copies on a side
//! stream; and the release in place after the block ran. On CUDA the memory a release frees and
//! a refill takes is ordered by events on the streams, not by the host waiting ([`super::fences`]).
//!
//! Refills and releases are methods of [`Memory`], what they change (the blocks, the slot
//! buffers and reads in flight, the hot set, the counts), given the [`Setting`] they only read
//! (the model's name, device and sizes, the split, the order, where the bytes come from), never
//! the whole model.

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use stageload_plan::split::DIRECT_UNIT;

use tch::{Device, Tensor};

use super::block::{Ahead, Block, HostBlocks, Job, ReadMode};
use super::direct::DirectRead;
use super::fences::{self, Filled};
use super::hot::HotSet;
use super::order::Order;
use super::slots::BlockSlots;
use super::split::{Sizes, Split};
use super::stats::StreamStats;
use super::torch;
use super::StreamError;
use crate::checkpoint::Checkpoint;
use crate::error::panic_message;
use crate::storage::{self, StorageRecord};

fn shallow(storages: &[StorageRecord]) -> Vec<StorageRecord> {
    storages.iter().map(|s| StorageRecord { id: s.id, nbytes: s.nbytes, tensor: s.tensor.shallow_clone() }).collect()
}

/// What refills read and never change: the model's name, device and block sizes, where its
/// blocks' bytes come from and how they are read, and the split and order its steps run under
/// (both changed only between steps, by the model's options and after a step).
pub(super) struct Setting {
    pub(super) name: String,
    pub(super) device: Device,
    pub(super) sizes: Sizes,
    pub(super) split: Split,
    /// The order the forward runs the blocks in, and whether one is read ahead.
    pub(super) order: Order,
    pub(super) checkpoint: Arc<Checkpoint>,
    /// CUDA: every block's tensors in pinned host memory (the model's host tier), read from the
    /// checkpoint once at set-up; refills copy from them on a side stream. `None`: refills read
    /// the checkpoint (the CPU, or pinning failed).
    pub(super) host: Option<HostBlocks>,
    /// How refills read the checkpoint ([`StreamedModel::uncached`](super::StreamedModel::uncached),
    /// [`StreamedModel::direct_reads`](super::StreamedModel::direct_reads)).
    pub(super) reads: ReadMode,
}

impl Setting {
    /// The block to read ahead while `index` runs, in order: the next streamed block of this
    /// step, or after the last block the next step's first (its read carried across the step
    /// boundary, [`super::slots`]); none without look-ahead, in any order, or once the forward
    /// names its next blocks itself.
    pub(super) fn next_in_order(&self, index: usize) -> Option<usize> {
        if !self.guesses_by_index() {
            return None;
        }
        let next = if index + 1 < self.split.resident { self.split.resident } else { index + 1 };
        // Past the last block only where a read can be carried: into a slot, on the CPU.
        let first = Some(self.split.resident).filter(|_| self.device == Device::Cpu);
        [Some(next), first].into_iter().flatten().find(|&block| block < self.sizes.blocks.len())
    }

    /// Whether the look-ahead reads the next block by index: in order, until the forward names
    /// its next blocks itself ([`super::Step::prefetch`]).
    pub(super) fn guesses_by_index(&self) -> bool {
        self.order.guesses_by_index(self.split)
    }

    /// Reads the model's checkpoint into targets (and, uncached, drops what it read from the
    /// page cache), on any thread.
    fn checkpoint_reader(&self) -> impl Fn(&[(String, Tensor)]) -> Result<(), StreamError> + Send + 'static {
        let model = self.name.clone();
        let checkpoint = Arc::clone(&self.checkpoint);
        let uncached = self.reads.uncached;
        move |targets: &[(String, Tensor)]| {
            checkpoint
                .load_into(targets, |_| {})
                .and_then(|_| match uncached {
                    true => checkpoint.drop_cached(targets.iter().map(|(entry, _)| entry.as_str())),
                    false => Ok(()),
                })
                .map_err(|source| StreamError::Checkpoint { model: model.clone(), source: Box::new(source) })
        }
    }
}

/// What refills and releases change: the blocks (their memory, their slot), the slot buffers and
/// the reads in flight, the hot set, and the counts of what moved.
pub(super) struct Memory {
    pub(super) blocks: Vec<Block>,
    /// The slot buffers (CPU), the read ahead and the read carried between steps.
    pub(super) slots: BlockSlots,
    /// Streamed blocks kept after they run, in the split's room for them.
    pub(super) hot: HotSet,
    pub(super) stats: StreamStats,
}

impl Memory {
    /// `blocks` with no slot, nothing hot and nothing moved yet, for `split`.
    pub(super) fn new(blocks: Vec<Block>, split: Split) -> Self {
        Memory { blocks, slots: BlockSlots::default(), hot: HotSet::new(split.blocks), stats: StreamStats::default() }
    }

    /// Waits for the refill ahead, if any; `Ok` once its block is filled (or freed again on
    /// failure, reported here).
    pub(super) fn join_ahead(&mut self, setting: &Setting) -> Result<(), StreamError> {
        let Some(Ahead { block, thread, attach, .. }) = self.slots.take_ahead() else { return Ok(()) };
        let outcome = thread.join().unwrap_or_else(|panic| {
            Err(StreamError::Step { model: setting.name.clone(), message: panic_message(&*panic) })
        });
        let outcome = outcome.and_then(|filled| before_use(setting, filled));
        let outcome = self.attach_read(setting, block, attach, outcome);
        self.settle(setting, block, outcome)
    }

    /// Books a finished refill of `block`: filled, or (failed) its slot free again.
    pub(super) fn settle(
        &mut self,
        setting: &Setting,
        block: usize,
        outcome: Result<f64, StreamError>,
    ) -> Result<(), StreamError> {
        self.blocks[block].allocated = outcome.is_ok();
        if outcome.is_err() {
            self.let_go_of_slot(block);
            self.hot.drop_block(block, setting.sizes.blocks[block]);
        }
        let seconds = outcome?;
        self.stats.refills += 1;
        self.stats.bytes_refilled += storage::layout(&self.blocks[block].storages).1 as u64;
        self.stats.refill_seconds += seconds;
        Ok(())
    }

    /// Starts refilling `index` on its own thread, unless it is filled or a refill runs;
    /// `running` is the block the forward runs meanwhile.
    pub(super) fn start_ahead(&mut self, setting: &Setting, index: usize, running: Option<usize>) {
        if self.slots.ahead().is_some() || index >= self.blocks.len() || self.blocks[index].allocated {
            return;
        }
        let (job, attach) = match self.refill_job(setting, index, running) {
            Ok(job) => job,
            // Refilled (and reported) when the forward reaches the block.
            Err(_) => return,
        };
        self.slots.start_ahead(Ahead { block: index, thread: std::thread::spawn(job), attach, carried: false });
    }

    /// Brings block `index` in for the forward: found hot (counted), or filled by
    /// [`ensure`](Self::ensure); the hot set notes the use.
    pub(super) fn bring_in(&mut self, setting: &Setting, index: usize) -> Result<(), StreamError> {
        let in_flight = self.slots.ahead_block() == Some(index);
        if self.hot.holds(index) && self.blocks[index].allocated && !in_flight {
            self.stats.hot_hits += 1;
        }
        let carried = self.slots.is_carried(index);
        self.ensure(setting, index)?;
        self.stats.carried += u64::from(carried);
        self.hot.used(index);
        Ok(())
    }

    /// Makes block `index` filled: joins its refill ahead, or refills it here.
    pub(super) fn ensure(&mut self, setting: &Setting, index: usize) -> Result<(), StreamError> {
        if self.blocks[index].allocated && self.slots.ahead_block() != Some(index) {
            return Ok(());
        }
        let start = Instant::now();
        let outcome = if self.slots.ahead_block() == Some(index) {
            self.join_ahead(setting)
        } else {
            let outcome = self.refill_job(setting, index, None).and_then(|(job, attach)| {
                let outcome = job().and_then(|filled| before_use(setting, filled));
                self.attach_read(setting, index, attach, outcome)
            });
            self.settle(setting, index, outcome)
        };
        self.stats.waited_seconds += start.elapsed().as_secs_f64();
        outcome
    }

    /// Whether streamed block `index` is kept hot once refilled (the weaker blocks it displaces
    /// freed first); never displaces `running` or the block in flight ahead.
    pub(super) fn keep_hot(
        &mut self,
        setting: &Setting,
        index: usize,
        running: Option<usize>,
    ) -> Result<bool, StreamError> {
        if !setting.split.is_streamed(index) {
            return Ok(false);
        }
        let protected: Vec<usize> = [Some(index), running, self.slots.ahead_block()].into_iter().flatten().collect();
        let Some(victims) = self.hot.admit(index, &setting.sizes.blocks, setting.split.hot, &protected) else {
            return Ok(false);
        };
        for victim in victims {
            self.drop_hot(setting, victim)?;
        }
        self.hot.keep(index, setting.sizes.blocks[index]);
        Ok(true)
    }

    /// A free slot for streamed block `index` on the CPU, now the block's, or `None` for the
    /// allocator (a resident or hot block, or CUDA). The split's slots always have one
    /// free for the block the forward reaches: the block before it left its slot first, and the
    /// one read ahead takes the other.
    pub(super) fn take_slot(&mut self, setting: &Setting, index: usize) -> Option<usize> {
        if setting.device != Device::Cpu || !self.passes(setting, index) {
            return None;
        }
        let bytes = setting.sizes.blocks[index];
        let free = self.slots.take_for(index, &mut self.blocks[index], bytes);
        if free.is_none() {
            tracing::warn!(
                "streamed model '{}': no free slot for block '{}'; it takes the allocator's memory",
                setting.name,
                self.blocks[index].name
            );
        }
        free
    }

    /// Gives the slot buffers (CPU) what the split needs: each as large as the largest streamed
    /// block ([`Sizes::slot`](super::split::Sizes::slot)), two with a look-ahead, one without,
    /// none when every block is resident; a buffer the split does not use is emptied. Only
    /// between steps, when no block is in a slot. The buffers keep their identity (a registry
    /// that holds them as `stream-slot.N` sees their new memory), and every buffer that changes
    /// is emptied before any is filled, so a change never holds the old and the new at once.
    pub(super) fn fit_slots(&mut self, setting: &Setting) -> Result<(), StreamError> {
        if setting.device != Device::Cpu {
            return Ok(());
        }
        let bytes = i64::try_from(setting.sizes.slot(setting.split.resident)).unwrap_or(i64::MAX);
        Ok(self.slots.fit(bytes, setting.split.slots())?)
    }

    /// Block `index` leaves its slot, if it holds one.
    pub(super) fn let_go_of_slot(&mut self, index: usize) {
        self.slots.let_go(&mut self.blocks[index]);
    }

    /// The refill of block `index` as a job any thread can run (while the forward runs
    /// `running`), and the slot it reads into. Into a slot it reads through views of the slot's
    /// buffer and touches none of the block's storages: [`attach_read`](Self::attach_read)
    /// points them into the slot once the job is done, on the model's thread. Otherwise (kept
    /// hot, no slot free, CUDA) it gives the storages the allocator's memory and reads or
    /// copies into them, freeing them again when that fails. Refused before anything is taken:
    /// a tensor reshaped since set-up.
    pub(super) fn refill_job(
        &mut self,
        setting: &Setting,
        index: usize,
        running: Option<usize>,
    ) -> Result<(Job, Option<usize>), StreamError> {
        let block = &self.blocks[index];
        for ((tensor, was), (_, target)) in block.shapes.iter().zip(&block.targets) {
            let now = target.size();
            if now != *was {
                let (model, block) = (setting.name.clone(), block.name.clone());
                return Err(StreamError::Reshaped { model, block, tensor: tensor.clone(), was: was.clone(), now });
            }
        }
        self.keep_hot(setting, index, running)?;
        let read = setting.checkpoint_reader();
        match self.take_slot(setting, index) {
            Some(slot) => self.slot_job(setting, index, slot, read),
            None => self.allocator_job(setting, index, read),
        }
    }

    /// The job reading block `index` into `slot` through views of the slot's buffer (past the
    /// page cache where this step's refills read that way), touching none of the block's
    /// storages.
    fn slot_job(
        &mut self,
        setting: &Setting,
        index: usize,
        slot: usize,
        read: impl Fn(&[(String, Tensor)]) -> Result<(), StreamError> + Send + 'static,
    ) -> Result<(Job, Option<usize>), StreamError> {
        let direct = self.direct_read(setting, index, slot);
        let views = self.views_in(index, self.slots.buffer(slot)).inspect_err(|_| self.let_go_of_slot(index))?;
        let (checkpoint, model, read_directly) =
            (Arc::clone(&setting.checkpoint), setting.name.clone(), Arc::clone(&setting.reads.read_directly));
        let job = move || {
            let start = Instant::now();
            let direct = match direct {
                Some(direct) => direct
                    .run(&checkpoint)
                    .map_err(|source| StreamError::Checkpoint { model, source: Box::new(source) })?,
                None => None,
            };
            match direct {
                Some(bytes) => _ = read_directly.fetch_add(bytes, Ordering::Relaxed),
                None => read(&views)?,
            }
            Ok(Filled::done(start.elapsed().as_secs_f64()))
        };
        Ok((Box::new(job), Some(slot)))
    }

    /// The job giving block `index`'s storages the allocator's memory (kept hot, no slot free,
    /// CUDA) and reading or copying into them, freeing them again when that fails.
    fn allocator_job(
        &self,
        setting: &Setting,
        index: usize,
        read: impl Fn(&[(String, Tensor)]) -> Result<(), StreamError> + Send + 'static,
    ) -> Result<(Job, Option<usize>), StreamError> {
        let block = &self.blocks[index];
        let model = setting.name.clone();
        let block_name = block.name.clone();
        let targets = storage::shallow(&block.targets);
        let storages = shallow(&block.storages);
        let host: Option<Vec<Tensor>> =
            setting.host.as_ref().map(|copies| copies.block(index).iter().map(Tensor::shallow_clone).collect());
        let device = setting.device;
        let job = move || {
            let start = Instant::now();
            // On CUDA the block's memory comes from a side stream's pool, where its copy runs:
            // memory from the forward stream's pool can be an activation just freed whose kernels
            // are still queued there, and the copy, on another stream, would write under them.
            let _side = match device {
                Device::Cuda(index) if host.is_some() => Some(
                    stageload_torch_sys::cuda_side_stream(index).map_err(torch(&model, "switch to a side stream"))?,
                ),
                _ => None,
            };
            // The block's storages are free and no thread uses them: the forward reaches this
            // block only through `Step::block`, which waits for this job first; the allocator's
            // fresh memory is filled below before use (on CUDA by copies queued after the fences
            // of memory freed under queued kernels, which the forward's stream waits for before
            // the block's first kernel).
            // SAFETY: as just said, nothing reads the storages until they are filled.
            let ids = unsafe { storage::reallocate(&storages) }.map_err(torch(&model, "give a block memory"))?;
            let filled = match (&host, device) {
                (Some(host), Device::Cuda(index)) => {
                    let pairs: Vec<(&Tensor, &Tensor)> = targets.iter().map(|(_, t)| t).zip(host).collect();
                    copy_after_fences(&pairs, index).map_err(torch(&model, "copy a block to the GPU")).map(Some)
                }
                _ => read(&targets).map(|()| None),
            };
            let fence = match filled {
                Ok(fence) => fence,
                Err(err) => {
                    let message = format!("block '{block_name}' of streamed model '{model}' failed to load: {err}");
                    // SAFETY: as above; the memory was never handed out (on CUDA, copies queued
                    // into it before the failure run first on the stream it goes back to).
                    let _ = unsafe { storage::free_ids(&storages, &ids, &message) };
                    return Err(err);
                }
            };
            Ok(Filled { seconds: start.elapsed().as_secs_f64(), fence })
        };
        Ok((Box::new(job), None))
    }

    /// The read past the page cache of block `index` into `slot`, when this step's refills read
    /// that way ([`stageload_plan::split::direct_reads`]) and the block lies in its file as the
    /// slot lays it out ([`FileSpan`](super::block::FileSpan)): the block then sits in the slot
    /// at its file phase (`shift`; 0 for any other read), in the room
    /// [`FILE_PHASE_ROOM`](stageload_plan::split::FILE_PHASE_ROOM) keeps for it.
    fn direct_read(&mut self, setting: &Setting, index: usize, slot: usize) -> Option<DirectRead> {
        let buffer = self.slots.buffer(slot);
        let block = &mut self.blocks[index];
        block.shift = 0;
        let span = block.span.clone().filter(|_| setting.reads.direct_now())?;
        let unit = DIRECT_UNIT as usize;
        let at = (unit - buffer.data_ptr() as usize % unit) % unit;
        let shift = at + (span.start % DIRECT_UNIT) as usize;
        let layout = block.offsets.last().zip(block.storages.last()).map(|(o, s)| o + s.nbytes)?;
        if shift.saturating_add(layout) > buffer.numel() {
            return None;
        }
        block.shift = shift;
        let name = block.targets.first().map(|(entry, _)| entry.clone())?;
        Some(DirectRead { buffer: buffer.shallow_clone(), at, span, name })
    }

    /// Block `index`'s tensors (under their entries' names) as views of `buffer` where the
    /// block's layout puts them: each storage at its offset (beyond the block's shift), each
    /// tensor at its own offset and strides in it. They hold the buffer, never the block's
    /// storages.
    pub(super) fn views_in(&self, index: usize, buffer: &Tensor) -> Result<Vec<(String, Tensor)>, StreamError> {
        let block = &self.blocks[index];
        let mut views = Vec::with_capacity(block.targets.len());
        for ((entry, tensor), &home) in block.targets.iter().zip(&block.homes) {
            let (offset, nbytes) = (block.shift + block.offsets[home], block.storages[home].nbytes);
            let kind = tensor.kind();
            // Offsets are multiples of the slot alignment (64), so of every element size; a
            // shift keeps each storage at its file offset's place, a multiple of its element size.
            let start = (offset / kind.elt_size_in_bytes()) as i64;
            let storage = buffer.f_narrow(0, offset as i64, nbytes as i64)?.f_view_dtype(kind)?;
            let view = storage.f_as_strided(tensor.size(), tensor.stride(), Some(start + tensor.storage_offset()))?;
            views.push((entry.clone(), view));
        }
        Ok(views)
    }

    /// A finished read of block `index` into `slot` (when it read into one): points the
    /// block's storages into the slot, where the read put their bytes.
    pub(super) fn attach_read(
        &mut self,
        setting: &Setting,
        index: usize,
        slot: Option<usize>,
        outcome: Result<f64, StreamError>,
    ) -> Result<f64, StreamError> {
        let (Some(slot), Ok(seconds)) = (slot, &outcome) else { return outcome };
        let block = &self.blocks[index];
        let base = (self.slots.buffer(slot).data_ptr() as *mut u8).wrapping_add(block.shift);
        // The slot's buffer is this block's alone while the block is its holder, as large as the
        // block's layout beyond its shift, and each storage's place is aligned for its dtype (the
        // allocator aligns to 64, the offsets are multiples of 64, and a shift is taken only where
        // the block's first byte in the file is aligned for every dtype in it, `file_span`);
        // the model frees every block in a slot before the slot changes or goes (`fit_slots`, `Drop`).
        // SAFETY: as said above, the buffer at `base` holds the layout for as long as the storages do.
        unsafe { storage::attach(&block.storages, base, &block.offsets) }
            .map(|_| *seconds)
            .map_err(torch(&setting.name, "give a block its slot"))
    }

    /// At the end of a step: a read ahead still in flight into a slot goes on as the carried
    /// read ([`BlockSlots::carry`](super::slots::BlockSlots::carry)); any other read ahead is
    /// joined.
    pub(super) fn carry(&mut self, setting: &Setting) -> Result<(), StreamError> {
        match self.slots.carry(&mut self.blocks, setting.split) {
            true => Ok(()),
            false => self.join_ahead(setting),
        }
    }

    /// Puts the carried read back as the read ahead of its block
    /// ([`BlockSlots::resume`](super::slots::BlockSlots::resume)). It stays only at a step's start
    /// (`keep`), under the split it was started under, for a block that passes; otherwise it is
    /// joined and thrown away, so that nothing is in flight in a slot between steps.
    pub(super) fn resume_carried(&mut self, setting: &Setting, keep: bool) -> Result<(), StreamError> {
        let Some(split) = self.slots.resume(&mut self.blocks)? else { return Ok(()) };
        let stays = |block: usize| keep && split == setting.split && self.passes(setting, block);
        if !self.slots.ahead_block().is_some_and(stays) {
            self.discard_ahead(setting)?;
        }
        Ok(())
    }

    /// Throws away the read ahead (a guess not taken): waits for it and frees its block. Its
    /// failure is no error of the caller's, which never asked for that block: it is logged.
    pub(super) fn discard_ahead(&mut self, setting: &Setting) -> Result<(), StreamError> {
        let Some(block) = self.slots.ahead_block() else { return Ok(()) };
        match self.join_ahead(setting) {
            Ok(()) => self.release(setting, block),
            Err(err) => {
                tracing::warn!("streamed model '{}': a read ahead not used failed: {err}", setting.name);
                Ok(())
            }
        }
    }

    /// Whether block `index` is freed after it runs: streamed and not held hot.
    pub(super) fn passes(&self, setting: &Setting, index: usize) -> bool {
        setting.split.is_streamed(index) && !self.hot.holds(index)
    }

    /// Frees hot block `index` and forgets it.
    pub(super) fn drop_hot(&mut self, setting: &Setting, index: usize) -> Result<(), StreamError> {
        self.release(setting, index)?;
        self.hot.drop_block(index, setting.sizes.blocks[index]);
        Ok(())
    }

    /// Frees block `index` in place (after its refill ahead, if one runs).
    pub(super) fn release(&mut self, setting: &Setting, index: usize) -> Result<(), StreamError> {
        if self.slots.ahead_block() == Some(index) {
            self.join_ahead(setting)?;
        }
        if !self.blocks[index].allocated {
            return Ok(());
        }
        if let Device::Cuda(device) = setting.device {
            // The kernels that read the block may still be queued: its memory is written by a
            // refill only after this fence (fences' rule 1), and the host goes on.
            let fence = stageload_torch_sys::CudaEvent::record(device)
                .map_err(torch(&setting.name, "record a fence after a block"))?;
            fences::cuda().freed(fence);
        }
        let block = &self.blocks[index];
        let message = format!(
            "block '{}' of streamed model '{}' is streamed: call Step::block({index}) before using it",
            block.name, setting.name
        );
        // Nothing runs on the block that its next user does not wait for: the forward has moved
        // past it (CPU ops return when done; on CUDA its queued kernels are behind the fence
        // above, which every refill's copy waits on before writing) and its refill, if any, was
        // joined above.
        // SAFETY: as just said, no thread uses the storages when they are freed.
        unsafe { storage::release(&block.storages, &HashSet::new(), &message) }
            .map_err(torch(&setting.name, "free a block"))?;
        self.blocks[index].allocated = false;
        self.let_go_of_slot(index);
        Ok(())
    }
}

/// The block's copies from pinned host memory, queued on this thread's current stream of CUDA
/// device `index` (a refill's side stream) after that stream waits on every fence of memory
/// freed under queued kernels (fences' rule 2), ended by the fence the forward waits on (rule 4).
/// The host waits for none of it.
fn copy_after_fences(
    pairs: &[(&Tensor, &Tensor)],
    index: usize,
) -> Result<stageload_torch_sys::CudaEvent, stageload_torch_sys::ShimError> {
    for fence in fences::cuda().before_write() {
        fence.hold_current_stream(index)?;
    }
    crate::device_copy::copy_queued(pairs, index)
}

/// A joined refill's seconds, once the forward may use its block: on CUDA its stream waits on
/// the refill's fence (fences' rule 4), the host does not.
fn before_use(setting: &Setting, filled: Filled) -> Result<f64, StreamError> {
    if let (Some(fence), Device::Cuda(index)) = (&filled.fence, setting.device) {
        fence.hold_current_stream(index).map_err(torch(&setting.name, "order a block after its refill"))?;
    }
    Ok(filled.seconds)
}
