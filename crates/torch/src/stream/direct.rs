//! A refill's read past the page cache (`O_DIRECT`) straight into its slot buffer, for a block
//! that lies in its file as the slot lays it out.

use stageload_plan::split::DIRECT_UNIT;
use tch::Tensor;

use super::block::FileSpan;
use crate::checkpoint::{Checkpoint, Direct};

/// A refill read past the page cache straight into its slot: the file's whole units from the
/// one holding the block's first byte, into the slot buffer from its first unit boundary `at`
/// (the block's storages start `shift` into it, as the refill's `direct_read` sets them); the
/// part of the last unit the block ends in through the page cache, dropped after.
pub(super) struct DirectRead {
    pub(super) buffer: Tensor,
    pub(super) at: usize,
    pub(super) span: FileSpan,
    /// The block's first entry, for errors.
    pub(super) name: String,
}

impl DirectRead {
    /// Reads the block; the bytes read past the page cache, or `None` where the file system
    /// cannot read that way (nothing read: read it buffered).
    pub(super) fn run(&self, checkpoint: &Checkpoint) -> Result<Option<u64>, crate::CheckpointError> {
        let FileSpan { file, start, end } = self.span;
        let first = start - start % DIRECT_UNIT;
        let whole = end - end % DIRECT_UNIT;
        let total = usize::try_from(end - first).unwrap_or(usize::MAX);
        if self.at.saturating_add(total) > self.buffer.numel() {
            // Cannot be (`direct_read` checked the layout, which holds the span): read buffered.
            return Ok(None);
        }
        checkpoint.unchanged()?;
        let base = (self.buffer.data_ptr() as *mut u8).wrapping_add(self.at);
        // The slot buffer is the block's alone until its refill is joined (`take_slot` gave it;
        // only `attach_read` or `let_go_of_slot`, after the join, give it up).
        // SAFETY: so no other reference to this memory exists meanwhile; it holds `at + total`
        // bytes (checked above).
        let memory = unsafe { std::slice::from_raw_parts_mut(base, total) };
        let direct = usize::try_from(whole.saturating_sub(first)).unwrap_or(0);
        let (units, rest) = memory.split_at_mut(direct.min(total));
        if !units.is_empty() && checkpoint.read_direct(file, first, units, &self.name)? == Direct::Unsupported {
            return Ok(None);
        }
        // The last unit's part (`rest` starts at `whole`), or a block inside one unit whole:
        // from its first byte on.
        let from = start.max(whole);
        let skip = usize::try_from(from - whole).unwrap_or(0);
        if let Some(tail) = rest.get_mut(skip..).filter(|tail| !tail.is_empty()) {
            checkpoint.read_and_drop(file, from, tail, &self.name)?;
        }
        // Written while it was read: the block may hold a mix of both versions.
        checkpoint.unchanged()?;
        Ok(Some(units.len() as u64))
    }
}
