//! The blocks' slots and the reads in flight: one owner, [`BlockSlots`], with its state private.
//! On the CPU a streamed block is read into one of two buffers faulted in once and reused (the
//! slots), so that a refill runs at the page cache's speed instead of the page faults' of fresh
//! memory; one refill at a time runs ahead of the forward, on its own thread.
//!
//! The rules:
//!
//! 1. **A slot has one holder**, the block whose storages point into it (or that a read ahead
//!    fills), and a block holds at most one slot (its `slot`); both sides change together
//!    ([`BlockSlots::take_for`], [`BlockSlots::let_go`]).
//! 2. **One read ahead** at a time ([`BlockSlots::ahead`]): taken by whoever joins it (the
//!    model's refills, [`super::refill`]), which points the block's storages into its slot.
//! 3. **A read is carried across a step boundary.** A step's last block would compute with
//!    nothing read beside it, and the next step begin by waiting for its first streamed block:
//!    from the disk, one block's read per step with nothing to overlap it. So the read ahead
//!    goes on past the last block: in order, the look-ahead names the next step's first streamed
//!    block while the last one runs; in any order, the forward may name it with
//!    [`super::Step::prefetch`] or [`super::Step::prefetch_first`]. A read still in flight when
//!    the step ends is carried to the next step ([`BlockSlots::carry`]).
//! 4. **Between steps no read touches a tensor of the model.** The model may then be released
//!    by a registry (which frees every tensor it was given, the slots among them) or changed by
//!    its options. A read into a slot writes through views of the slot's buffer (the block's
//!    storages are pointed into the slot only when the read is joined), and at the step's end
//!    its buffer is taken out of the slot (the slot's tensor left empty, the buffer held by the
//!    read alone): nothing frees memory being written, and a release frees what the model holds
//!    less that buffer, which goes with the model. Whatever next changes the slots (the model's
//!    `let_go`, at the next step's start or an option's change) first puts the buffer back
//!    ([`BlockSlots::resume`]): at a step's start, under the same split, the read is again the
//!    read ahead of its block; otherwise it is joined and freed. A step whose first streamed
//!    block is another frees it first ([`super::Step::block`]).
//! 5. **Slots change size only between steps**, when no block is in one ([`BlockSlots::fit`]);
//!    they keep their identity (a registry holding them as `stream-slot.N` sees their new memory).

use tch::{Device, Tensor};

use super::block::{Ahead, Block};
use super::split::Split;

/// The slot buffers (CPU), the read ahead, and the read carried between steps.
#[derive(Default)]
pub(super) struct BlockSlots {
    /// The buffers the streamed blocks are read into, with the block each one holds. Sized by
    /// the split ([`Sizes::slot`](super::split::Sizes::slot)): a buffer the split does not use
    /// is empty.
    buffers: Vec<(Tensor, Option<usize>)>,
    /// The refill running ahead of the forward, if any.
    ahead: Option<Ahead>,
    /// CPU, between steps: the read ahead in flight when the last step ended, for the next.
    carried: Option<Carried>,
}

/// A read ahead in flight when its step ended, for the next step.
struct Carried {
    /// The read, into the slot `read.attach` names.
    read: Ahead,
    /// That slot's buffer, taken out of it (the slot empty meanwhile).
    buffer: Tensor,
    /// The split it was started under: the read stays only if the next step's is the same.
    split: Split,
}

impl BlockSlots {
    /// The read ahead, if one runs (rule 2).
    pub(super) fn ahead(&self) -> Option<&Ahead> {
        self.ahead.as_ref()
    }

    /// The block read ahead, if one is.
    pub(super) fn ahead_block(&self) -> Option<usize> {
        self.ahead.as_ref().map(|a| a.block)
    }

    /// Takes the read ahead, to join it.
    pub(super) fn take_ahead(&mut self) -> Option<Ahead> {
        self.ahead.take()
    }

    /// Starts `read` as the read ahead (none runs).
    pub(super) fn start_ahead(&mut self, read: Ahead) {
        debug_assert!(self.ahead.is_none(), "two reads ahead");
        self.ahead = Some(read);
    }

    /// Whether `index` is the block a carried read brought back for this step.
    pub(super) fn is_carried(&self, index: usize) -> bool {
        self.ahead.as_ref().is_some_and(|a| a.block == index && a.carried)
    }

    /// Slot `slot`'s buffer.
    pub(super) fn buffer(&self, slot: usize) -> &Tensor {
        &self.buffers[slot].0
    }

    /// The buffers, under the names a registry holds them by (`stream-slot.N`).
    pub(super) fn named(&self) -> impl Iterator<Item = (String, Tensor)> + '_ {
        self.buffers.iter().enumerate().map(|(i, (buffer, _))| (format!("stream-slot.{i}"), buffer.shallow_clone()))
    }

    /// Bytes the buffers hold, filled or not, and the buffer a carried read holds.
    pub(super) fn bytes(&self) -> u64 {
        let buffers = self.buffers.iter().map(|(buffer, _)| crate::storage::allocated_bytes(buffer));
        let carried = self.carried.as_ref().map(|c| crate::storage::allocated_bytes(&c.buffer));
        buffers.chain(carried).fold(0u64, u64::saturating_add)
    }

    /// A free slot of at least `bytes` for `block` (`index`), now its (rule 1); `None` when none
    /// is free.
    pub(super) fn take_for(&mut self, index: usize, block: &mut Block, bytes: u64) -> Option<usize> {
        let fits = |(buffer, holder): &(Tensor, Option<usize>)| holder.is_none() && buffer.numel() as u64 >= bytes;
        let free = self.buffers.iter().position(fits)?;
        self.buffers[free].1 = Some(index);
        block.slot = Some(free);
        Some(free)
    }

    /// `block` leaves its slot, if it holds one (rule 1).
    pub(super) fn let_go(&mut self, block: &mut Block) {
        if let Some(slot) = block.slot.take() {
            self.buffers[slot].1 = None;
        }
    }

    /// Gives the buffers what the split needs: the first `used` as large as `bytes`, the others
    /// empty, two at least (rule 5). Every buffer that changes is emptied before any is filled,
    /// so a change never holds the old and the new at once.
    pub(super) fn fit(&mut self, bytes: i64, used: usize) -> Result<(), tch::TchError> {
        while self.buffers.len() < 2 {
            self.buffers.push((empty_buffer()?, None));
        }
        let wanted: Vec<i64> = (0..self.buffers.len()).map(|i| if i < used { bytes } else { 0 }).collect();
        let changing: Vec<usize> =
            (0..self.buffers.len()).filter(|&i| self.buffers[i].0.numel() as i64 != wanted[i]).collect();
        debug_assert!(changing.iter().all(|&i| self.buffers[i].1.is_none()), "a slot resized while in use");
        for &i in &changing {
            self.buffers[i].0.f_set_data(&empty_buffer()?)?;
        }
        for &i in &changing {
            // Zeroed, so that its pages are faulted in once, here.
            let buffer = Tensor::f_zeros([wanted[i]], (tch::Kind::Uint8, Device::Cpu))?;
            self.buffers[i].0.f_set_data(&buffer)?;
        }
        Ok(())
    }

    /// At the end of a step (rule 3): a read ahead still in flight into a slot goes on as the
    /// carried read, its buffer taken out of the slot and the block out of it (rule 4); `false`
    /// when a read ahead is left that is not carried (the caller joins it).
    pub(super) fn carry(&mut self, blocks: &mut [Block], split: Split) -> bool {
        let Some(read) = self.ahead.take() else { return true };
        let taken = read.attach.map(|slot| {
            let buffer = self.buffers[slot].0.f_alias()?;
            self.buffers[slot].0.f_set_data(&empty_buffer()?)?;
            Ok::<_, tch::TchError>(buffer)
        });
        match taken {
            Some(Ok(buffer)) => {
                self.let_go(&mut blocks[read.block]);
                self.carried = Some(Carried { read, buffer, split });
                true
            }
            _ => {
                self.ahead = Some(read);
                false
            }
        }
    }

    /// Puts the carried read's buffer back in its slot, and the read back as the read ahead
    /// (pointed into the slot when joined) (rule 4). The split it was started under, to tell
    /// whether it stays; `None` when none was carried.
    pub(super) fn resume(&mut self, blocks: &mut [Block]) -> Result<Option<Split>, tch::TchError> {
        let Some(Carried { read, buffer, split }) = self.carried.take() else { return Ok(None) };
        let (block, slot) = (read.block, read.attach);
        if let Some(slot) = slot {
            if let Err(err) = self.buffers[slot].0.f_set_data(&buffer) {
                // The slot stays empty (the next `fit` gives it memory); the read is waited for.
                let _ = read.thread.join();
                return Err(err);
            }
            self.buffers[slot].1 = Some(block);
            blocks[block].slot = Some(slot);
        }
        self.ahead = Some(Ahead { carried: true, ..read });
        Ok(Some(split))
    }

    /// The model goes: waits for a carried read, which nothing will take back.
    pub(super) fn abandon_carried(&mut self) {
        if let Some(carried) = self.carried.take() {
            let _ = carried.read.thread.join();
        }
    }

    /// Keeps slot `slot`'s memory for the process's life: a storage that could not be freed
    /// still points into it.
    pub(super) fn leak(&self, slot: usize) {
        std::mem::forget(self.buffers[slot].0.shallow_clone());
    }
}

/// A slot buffer without memory.
pub(super) fn empty_buffer() -> Result<Tensor, tch::TchError> {
    Tensor::f_zeros([0], (tch::Kind::Uint8, Device::Cpu))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A block with no tensors (what the slots look at is its `slot`).
    fn block(name: &str) -> Block {
        Block {
            name: name.to_string(),
            targets: Vec::new(),
            shapes: Vec::new(),
            storages: Vec::new(),
            offsets: Vec::new(),
            homes: Vec::new(),
            allocated: false,
            slot: None,
            shift: 0,
            span: None,
        }
    }

    fn split() -> Split {
        Split { resident: 0, blocks: 3, look_ahead: true, hot: 0 }
    }

    /// Two slots of 64 bytes, three blocks.
    fn slots() -> (BlockSlots, Vec<Block>) {
        let mut slots = BlockSlots::default();
        slots.fit(64, 2).unwrap();
        (slots, vec![block("b0"), block("b1"), block("b2")])
    }

    #[test]
    fn a_slot_has_one_holder_and_a_block_that_leaves_it_frees_it_for_the_next() {
        let (mut slots, mut blocks) = slots();
        assert_eq!(slots.take_for(0, &mut blocks[0], 64), Some(0));
        assert_eq!(slots.take_for(1, &mut blocks[1], 64), Some(1));
        assert_eq!(slots.take_for(2, &mut blocks[2], 64), None, "both slots are held");
        slots.let_go(&mut blocks[0]);
        assert_eq!(blocks[0].slot, None);
        assert_eq!(slots.take_for(2, &mut blocks[2], 64), Some(0));
        assert_eq!((blocks[1].slot, blocks[2].slot), (Some(1), Some(0)));
    }

    #[test]
    fn a_slot_smaller_than_the_block_is_not_taken() {
        let (mut slots, mut blocks) = slots();
        assert_eq!(slots.take_for(0, &mut blocks[0], 65), None);
        assert_eq!(blocks[0].slot, None);
    }

    #[test]
    fn a_slot_the_split_does_not_use_is_emptied_and_keeps_its_place() {
        let (mut slots, _) = slots();
        assert_eq!(slots.bytes(), 128);
        slots.fit(64, 1).unwrap();
        assert_eq!(slots.bytes(), 64);
        assert_eq!(slots.named().map(|(name, _)| name).collect::<Vec<_>>(), ["stream-slot.0", "stream-slot.1"]);
    }

    #[test]
    fn a_read_in_flight_at_a_steps_end_is_carried_out_of_its_slot_and_comes_back_as_the_read_ahead() {
        let (mut slots, mut blocks) = slots();
        let slot = slots.take_for(2, &mut blocks[2], 64).unwrap();
        let thread = std::thread::spawn(|| Ok(super::super::fences::Filled::done(0.0)));
        slots.start_ahead(Ahead { block: 2, thread, attach: Some(slot), carried: false });
        assert!(slots.carry(&mut blocks, split()));
        // Between steps: the block holds no slot, the slot no buffer; the read holds it.
        assert_eq!((blocks[2].slot, slots.ahead_block()), (None, None));
        assert_eq!(slots.buffer(slot).numel(), 0);
        assert_eq!(slots.bytes(), 128, "the carried buffer still counts");
        assert_eq!(slots.resume(&mut blocks).unwrap(), Some(split()));
        assert_eq!((blocks[2].slot, slots.buffer(slot).numel()), (Some(slot), 64));
        assert!(slots.is_carried(2));
        assert!(slots.take_ahead().unwrap().thread.join().unwrap().is_ok());
    }

    #[test]
    fn with_no_read_in_flight_a_steps_end_carries_nothing() {
        let (mut slots, mut blocks) = slots();
        assert!(slots.carry(&mut blocks, split()));
        assert_eq!(slots.resume(&mut blocks).unwrap(), None);
    }
}
