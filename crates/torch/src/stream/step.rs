//! One step of a streamed model's forward: the call at each block boundary, and the working
//! memory the step showed (boundary readings and the high-water mark).

use super::split::Split;
use super::streamer::StreamedModel;
use super::StreamError;

/// One step of a streamed model's forward; see [`StreamedModel::run`].
pub struct Step<'a> {
    pub(super) model: &'a mut StreamedModel,
    /// The block that runs now.
    pub(super) active: Option<usize>,
    /// Reading and held weights when the step began.
    pub(super) base: Option<(u64, u64)>,
    /// The high-water mark when the step began.
    pub(super) peak: Option<u64>,
    /// The most weight bytes held at any boundary.
    pub(super) most_held: u64,
    /// The largest working memory seen at a block boundary.
    pub(super) working: u64,
    /// Whether a streamed block has run in this step.
    pub(super) streamed_yet: bool,
}

impl Step<'_> {
    /// Call before block `index` runs: frees the block that ran before it (when streamed and
    /// not hot), brings `index` in (found hot, waiting for its refill ahead, or refilling it
    /// now) and starts the next streamed block's refill (in order; with
    /// [`StreamedModel::any_order`], only the one [`prefetch`](Self::prefetch) names).
    pub fn block(&mut self, index: usize) -> Result<(), StreamError> {
        let model = &mut *self.model;
        model.check_index(index)?;
        if let Some(previous) = self.active.filter(|&p| p != index && model.memory.passes(&model.setting, p)) {
            model.memory.release(&model.setting, previous)?;
        }
        if !self.streamed_yet && model.memory.passes(&model.setting, index) {
            self.streamed_yet = true;
            // A read carried from the step before for another block guessed wrong: its slot
            // is needed.
            if model.memory.slots.ahead().is_some_and(|a| a.carried && a.block != index) {
                model.memory.discard_ahead(&model.setting)?;
            }
        }
        model.memory.bring_in(&model.setting, index)?;
        self.active = Some(index);
        self.sample();
        let model = &mut *self.model;
        if let Some(next) = model.setting.next_in_order(index) {
            model.memory.start_ahead(&model.setting, next, Some(index));
        }
        model.note_held();
        Ok(())
    }

    /// Starts reading block `index` ahead while the current block runs (when a slot for it is
    /// free and nothing else is read ahead): the forward's guess at the block it runs next; a
    /// wrong guess costs a read, never a result. With [`StreamedModel::any_order`] nothing else
    /// is read ahead. In order, the blocks are read ahead by index until the forward first names
    /// one (here or with [`prefetch_first`](Self::prefetch_first)), and from then on only what
    /// it names: a router's model with a resident prefix reads the blocks its router picks.
    pub fn prefetch(&mut self, index: usize) -> Result<(), StreamError> {
        let model = &mut *self.model;
        model.check_index(index)?;
        model.setting.order.set_named();
        if model.split().look_ahead && Some(index) != self.active {
            model.memory.start_ahead(&model.setting, index, self.active);
        }
        Ok(())
    }

    /// [`prefetch`](Self::prefetch) of the first of `next` that is neither in memory nor being
    /// read: `next` lists the blocks the forward runs next, in order, this step's and, when it
    /// knows them, the next step's (a read still in flight when the step ends is carried into
    /// it). Blocks kept hot or resident are passed over, so that a read goes on while they run;
    /// at the block running now, freed after it runs, nothing is read (it cannot be read again
    /// while it runs).
    pub fn prefetch_first(&mut self, next: &[usize]) -> Result<(), StreamError> {
        for &index in next {
            self.model.check_index(index)?;
        }
        self.model.setting.order.set_named();
        let model = &*self.model;
        let coming = |index: usize| model.memory.slots.ahead_block() == Some(index);
        let running = |index: usize| Some(index) == self.active && model.memory.passes(&model.setting, index);
        let wanted = next.iter().copied().find(|&i| running(i) || !model.memory.blocks[i].allocated && !coming(i));
        match wanted {
            Some(index) if Some(index) != self.active => self.prefetch(index),
            _ => Ok(()),
        }
    }

    /// How the blocks are held in this step.
    pub fn split(&self) -> Split {
        self.model.split()
    }

    /// What the model holds now, from its storages ([`StreamedModel::held_bytes`]): the block
    /// read ahead included.
    pub fn held_bytes(&self) -> u64 {
        self.model.held_bytes()
    }

    /// Notes the working memory now: growth of the reading beyond the growth of held weights.
    fn sample(&mut self) {
        let Some((base_reading, base_held)) = self.base else { return };
        let Some((reading, held)) = self.model.measure_point() else { return };
        self.most_held = self.most_held.max(held);
        self.note(reading, base_reading, held, base_held);
    }

    /// Working memory: growth of a reading beyond the growth of held weights.
    fn note(&mut self, reading: u64, base_reading: u64, held: u64, base_held: u64) {
        let grown = i128::from(reading) - i128::from(base_reading) - (i128::from(held) - i128::from(base_held));
        self.working = self.working.max(u64::try_from(grown.max(0)).unwrap_or(u64::MAX));
    }

    /// When the step raised the high-water mark, its peak over the start, beyond the most
    /// weights held, is working memory too.
    fn note_peak(&mut self) {
        let (Some((base_reading, base_held)), Some(before)) = (self.base, self.peak) else { return };
        match self.model.peak_now() {
            Some(after) if after > before => self.note(after, base_reading, self.most_held.max(base_held), base_held),
            _ => {}
        }
    }

    /// Ends the step: samples once more, frees the last streamed block. The working memory seen.
    pub(super) fn finish(mut self) -> Result<u64, StreamError> {
        self.sample();
        self.note_peak();
        if let Some(last) = self.active.filter(|&a| self.model.memory.passes(&self.model.setting, a)) {
            self.model.memory.release(&self.model.setting, last)?;
        }
        Ok(self.working)
    }
}
