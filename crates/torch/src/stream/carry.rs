//! The read carried across a step boundary (CPU). A step's last block would compute with
//! nothing read beside it, and the next step begin by waiting for its first streamed block: from
//! the disk, one block's read per step with nothing to overlap it. So the read ahead goes on past
//! the last block: in order, the look-ahead names the next step's first streamed block while the
//! last one runs; in any order, the forward may name it with [`super::Step::prefetch`] or
//! [`super::Step::prefetch_first`]. A read
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

use tch::Tensor;

use super::block::Ahead;
use super::refill::empty_buffer;
use super::split::Split;
use super::streamer::StreamedModel;
use super::StreamError;

/// A read ahead in flight when its step ended, for the next step.
pub(super) struct Carried {
    /// The read, into the slot `read.attach` names.
    read: Ahead,
    /// That slot's buffer, taken out of it (the slot empty meanwhile).
    buffer: Tensor,
    /// The split it was started under: the read stays only if the next step's is the same.
    split: Split,
}

impl Carried {
    /// Bytes of the buffer it holds.
    pub(super) fn bytes(&self) -> u64 {
        crate::storage::allocated_bytes(&self.buffer)
    }

    /// Waits for the read (the model is going).
    pub(super) fn abandon(self) {
        let _ = self.read.thread.join();
    }
}

impl StreamedModel {
    /// At the end of a step: a read ahead still in flight into a slot goes on as the carried
    /// read, its buffer taken out of the slot; any other read ahead is joined.
    pub(super) fn carry(&mut self) -> Result<(), StreamError> {
        let Some(read) = self.ahead.take() else { return Ok(()) };
        let taken = read.attach.map(|slot| {
            let buffer = self.slots[slot].0.f_alias()?;
            self.slots[slot].0.f_set_data(&empty_buffer()?)?;
            Ok::<_, tch::TchError>(buffer)
        });
        match taken {
            Some(Ok(buffer)) => {
                self.let_go_of_slot(read.block);
                self.carried = Some(Carried { read, buffer, split: self.split });
                Ok(())
            }
            _ => {
                self.ahead = Some(read);
                self.join_ahead()
            }
        }
    }

    /// Puts the carried read's buffer back in its slot. At a step's start (`keep`), under the
    /// split it was started under, the read becomes the read ahead of its block again (pointed
    /// into the slot when joined); otherwise it is joined and thrown away, so that nothing is
    /// in flight in a slot between steps.
    pub(super) fn resume_carried(&mut self, keep: bool) -> Result<(), StreamError> {
        let Some(Carried { read, buffer, split }) = self.carried.take() else { return Ok(()) };
        let (block, slot) = (read.block, read.attach);
        if let Some(slot) = slot {
            if let Err(err) = self.slots[slot].0.f_set_data(&buffer) {
                // The slot stays empty (the next `fit_slots` gives it memory); the read is waited for.
                let _ = read.thread.join();
                return Err(err.into());
            }
            self.slots[slot].1 = Some(block);
            self.blocks[block].slot = Some(slot);
        }
        self.ahead = Some(Ahead { carried: true, ..read });
        if !keep || split != self.split || !self.passes(block) {
            self.discard_ahead()?;
        }
        Ok(())
    }

    /// Whether `index` is the block a carried read brought back for this step.
    pub(super) fn is_carried(&self, index: usize) -> bool {
        self.ahead.as_ref().is_some_and(|a| a.block == index && a.carried)
    }

    /// Throws away the read ahead (a guess not taken): waits for it and frees its block. Its
    /// failure is no error of the caller's, which never asked for that block: it is logged.
    pub(super) fn discard_ahead(&mut self) -> Result<(), StreamError> {
        let Some(block) = self.ahead.as_ref().map(|a| a.block) else { return Ok(()) };
        match self.join_ahead() {
            Ok(()) => self.release(block),
            Err(err) => {
                tracing::warn!("streamed model '{}': a read ahead not used failed: {err}", self.name);
                Ok(())
            }
        }
    }
}
