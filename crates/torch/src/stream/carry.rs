//! The read carried across a step boundary (CPU). A step's last block would compute with
//! nothing read beside it, and the next step begin by waiting for its first streamed block: from
//! the disk, one block's read per step with nothing to overlap it. So the read ahead goes on past
//! the last block: in order, the look-ahead names the next step's first streamed block while the
//! last one runs; in any order, the forward may name it with [`super::Step::prefetch`]. A read
//! still in flight when the step ends is carried to the next step.
//!
//! Between steps the model may be released by a registry (which frees every tensor it was given,
//! the slots among them) or changed by its options. So no read in flight then touches a tensor
//! of the model: a read into a slot writes through views of the slot's buffer (the block's
//! storages are pointed into the slot only when the read is joined), and at the step's end its
//! buffer is taken out of the slot (the slot's tensor left empty, the buffer held by the read
//! alone): nothing frees memory being written, and a release frees what the model holds less that
//! buffer, which goes with the model. Whatever next changes the slots ([`StreamedModel::let_go`],
//! at the next step's start or an option's change) first puts the buffer back: at a step's start,
//! under the same split, the read is again the read ahead of its block; otherwise it is joined
//! and freed. A step whose first streamed block is another frees it first
//! ([`super::Step::block`]).

use std::thread::JoinHandle;

use tch::{Device, Tensor};

use super::block::Ahead;
use super::split::Split;
use super::streamer::StreamedModel;
use super::{torch, StreamError};

/// A read ahead in flight when its step ended, for the next step.
pub(super) struct Carried {
    block: usize,
    /// The slot whose buffer it reads into, empty meanwhile.
    slot: usize,
    /// The slot's buffer, taken out of it.
    buffer: Tensor,
    /// The split it was started under: the read stays only if the next step's is the same.
    split: Split,
    thread: JoinHandle<Result<f64, StreamError>>,
}

impl Carried {
    /// Bytes of the buffer it holds.
    pub(super) fn bytes(&self) -> u64 {
        crate::storage::allocated_bytes(&self.buffer)
    }

    /// Waits for the read (the model is going).
    pub(super) fn abandon(self) {
        let _ = self.thread.join();
    }
}

impl StreamedModel {
    /// At the end of a step: a read ahead still in flight into a slot goes on as the carried
    /// read, its buffer taken out of the slot; any other read ahead is joined.
    pub(super) fn carry(&mut self) -> Result<(), StreamError> {
        let Some(slot) = self.ahead.as_ref().and_then(|ahead| ahead.attach) else { return self.join_ahead() };
        let taken = self.slots[slot].0.f_alias().and_then(|buffer| {
            self.slots[slot].0.f_set_data(&Tensor::f_zeros([0], (tch::Kind::Uint8, Device::Cpu))?)?;
            Ok(buffer)
        });
        let Ok(buffer) = taken else { return self.join_ahead() };
        let Some(Ahead { block, thread, .. }) = self.ahead.take() else { return Ok(()) };
        self.let_go_of_slot(block);
        self.carried = Some(Carried { block, slot, buffer, split: self.split, thread });
        Ok(())
    }

    /// Block `index`'s tensors (under their entries' names) as views of `buffer` where the
    /// block's layout puts them: each storage at its offset, each tensor at its own offset and
    /// strides in it. They hold the buffer, never the block's storages.
    pub(super) fn views_in(&self, index: usize, buffer: &Tensor) -> Result<Vec<(String, Tensor)>, StreamError> {
        let block = &self.blocks[index];
        let mut views = Vec::with_capacity(block.targets.len());
        for (entry, tensor) in &block.targets {
            let id =
                stageload_torch_sys::storage_info(tensor).map_err(torch(&self.name, "read storage identities"))?.id;
            let position = block.storages.iter().position(|s| s.id == id);
            let Some(position) = position else {
                return Err(StreamError::Step {
                    model: self.name.clone(),
                    message: format!("tensor '{entry}' of block '{}' is in none of its storages", block.name),
                });
            };
            let (offset, nbytes) = (block.offsets[position], block.storages[position].nbytes);
            let kind = tensor.kind();
            let element = kind.elt_size_in_bytes().max(1);
            let start = i64::try_from(offset / element).unwrap_or(i64::MAX);
            let whole = buffer.f_narrow(0, offset as i64, nbytes as i64)?.f_view_dtype(kind)?;
            let view = whole.f_as_strided(tensor.size(), tensor.stride(), Some(start + tensor.storage_offset()))?;
            views.push((entry.clone(), view));
        }
        Ok(views)
    }

    /// Puts the carried read's buffer back in its slot. At a step's start (`keep`), under the
    /// split it was started under, the read becomes the read ahead of its block (pointed into
    /// the slot when joined); otherwise it is joined and freed, so that nothing is in flight in
    /// a slot between steps.
    pub(super) fn resume_carried(&mut self, keep: bool) -> Result<(), StreamError> {
        let Some(Carried { block, slot, buffer, split, thread }) = self.carried.take() else { return Ok(()) };
        self.slots[slot].0.f_set_data(&buffer)?;
        self.slots[slot].1 = Some(block);
        self.blocks[block].slot = Some(slot);
        self.ahead = Some(Ahead { block, thread, attach: Some(slot), carried: true });
        if !keep || split != self.split || !self.passes(block) {
            self.release(block)?;
        }
        Ok(())
    }

    /// Whether `index` is the block a carried read brought back for this step.
    pub(super) fn is_carried(&self, index: usize) -> bool {
        self.ahead.as_ref().is_some_and(|a| a.block == index && a.carried)
    }
}
