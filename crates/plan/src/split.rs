//! Which blocks of a streamed model stay resident: pure decisions over byte counts, tested
//! without libtorch (as `guard/src/decide.rs` is).
//!
//! A model of `n` blocks keeps a prefix of `resident` blocks in memory and streams the rest
//! through slots: one for the block that runs and, when the budget allows, one for the block
//! loaded ahead. The budget covers everything the model holds at once: its fixed tensors (those
//! in no block), the resident prefix, the slots, and the working memory a step needs (measured;
//! zero until measured). What the budget leaves beyond those is the hot set's room
//! ([`crate::hot`]): streamed blocks kept after they run. The resident count and the room only go
//! down during a run ([`evict`], [`govern`], [`refit`]) unless the user resets them.

use stageload_units::format_bytes;

/// How a streamed model's blocks are held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Split {
    /// Blocks kept resident: the first `resident` ones.
    pub resident: usize,
    /// Blocks in the model.
    pub blocks: usize,
    /// A streamed block is loaded while the one before it runs (two slots; otherwise one).
    pub look_ahead: bool,
    /// Bytes the hot set may hold: streamed blocks kept after they run.
    pub hot: u64,
}

impl Split {
    /// Blocks released after they run and refilled before.
    pub fn streamed(&self) -> usize {
        self.blocks - self.resident
    }

    /// Whether block `index` is streamed.
    pub fn is_streamed(&self, index: usize) -> bool {
        index >= self.resident
    }

    /// Slots the streamed blocks pass through: two with a look-ahead, one without, none when
    /// every block is resident.
    pub fn slots(&self) -> usize {
        if self.look_ahead {
            2
        } else {
            usize::from(self.streamed() > 0)
        }
    }
}

/// What a split holds once its hot set has settled (after the first step): what the plan counts
/// for a streamed model and what the running model reports to its registry, so the two agree.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Holding {
    /// Bytes held at most: fixed tensors, resident prefix, slots and the blocks kept hot.
    pub held: u64,
    /// Bytes read into the slots per step.
    pub per_step: u64,
    /// Streamed blocks kept hot.
    pub hot_blocks: usize,
}

/// Byte sizes a split is decided from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sizes {
    /// Tensors in no block: always resident.
    pub fixed: u64,
    /// Each block's bytes, in order.
    pub blocks: Vec<u64>,
}

impl Sizes {
    /// Bytes the model holds at most with the first `resident` blocks resident, `slots` slots
    /// for the streamed ones and `working` bytes of working memory.
    pub fn need(&self, resident: usize, slots: usize, working: u64) -> u64 {
        let prefix = sum(&self.blocks[..resident]);
        let slot = self.slot(resident);
        self.fixed.saturating_add(prefix).saturating_add(slot.saturating_mul(slots as u64)).saturating_add(working)
    }

    /// Bytes of one slot when the first `resident` blocks stay: the largest of the blocks that
    /// can land in it, the streamed ones (0 when none is). The streamer sizes its slot buffers
    /// by this, so the slots hold what [`need`](Self::need) counts.
    pub fn slot(&self, resident: usize) -> u64 {
        self.blocks.get(resident..).unwrap_or_default().iter().copied().max().unwrap_or(0)
    }

    /// What `split` holds once its hot set has settled. In order, the hot set keeps the first
    /// streamed blocks that fit its room; in any order it keeps whichever blocks the forward
    /// uses most, and this counts the smallest that fill the room (the most bytes held, the
    /// fewest reads saved).
    pub fn holding(&self, split: Split, any_order: bool) -> Holding {
        let hot = if any_order {
            let mut by_size: Vec<usize> = (0..split.blocks).collect();
            by_size.sort_by_key(|&b| self.blocks[b]);
            crate::hot::steady(&self.blocks, by_size, split.hot)
        } else {
            crate::hot::steady(&self.blocks, split.resident..split.blocks, split.hot)
        };
        Holding {
            held: self.need(split.resident, split.slots(), 0).saturating_add(hot.bytes()),
            per_step: self.streamed_per_step(split.resident).saturating_sub(hot.bytes()),
            hot_blocks: hot.count(),
        }
    }

    /// Bytes that pass through the slots in one step when the first `resident` blocks stay.
    pub fn streamed_per_step(&self, resident: usize) -> u64 {
        sum(&self.blocks[resident..])
    }
}

/// A saturating sum (block sizes come from files).
fn sum(bytes: &[u64]) -> u64 {
    bytes.iter().fold(0u64, |a, b| a.saturating_add(*b))
}

/// Where each tensor of a block starts in a slot: at a multiple of this many bytes (libtorch's
/// CPU allocator aligns to 64).
pub const SLOT_ALIGNMENT: u64 = 64;

/// The unit of a read past the page cache (`O_DIRECT`): its file offset, length and memory all
/// multiples of it (the logical block size of the disks this runs on, at most a page).
pub const DIRECT_UNIT: u64 = 4096;

/// Bytes a slot keeps beside a block's tensors so that it can lay them out at their place in
/// the file's [`DIRECT_UNIT`]s, where a read past the page cache lands them straight in the slot:
/// up to one unit to reach the slot buffer's first unit boundary, and one for the block's
/// first byte's place in its unit.
pub const FILE_PHASE_ROOM: u64 = 2 * DIRECT_UNIT;

/// A block's bytes as a slot lays it out: each of its tensors' `bytes`, in order, at a multiple
/// of [`SLOT_ALIGNMENT`], and [`FILE_PHASE_ROOM`]. The size a block counts for in [`Sizes`], in
/// the plan (from a checkpoint's entries) and in the streamer (from the model's storages), so a
/// slot buffer holds exactly what the split counts.
pub fn block_bytes(bytes: impl IntoIterator<Item = u64>) -> u64 {
    bytes.into_iter().fold(FILE_PHASE_ROOM, |total, b| {
        total.saturating_add(b.div_ceil(SLOT_ALIGNMENT).saturating_mul(SLOT_ALIGNMENT))
    })
}

/// Whether the next step's refills read past the page cache straight into their slots
/// (`O_DIRECT`; `direct` now) after a step that waited `waited` of its `step` seconds for
/// refills. A direct read costs the forward's cores almost none of a buffered read's CPU (the
/// kernel's copy out of the page cache, the drop after it) but reads the disk more slowly
/// (`traces/hot-set/archive/direct-reads/`): it pays where the forward, not the disk, is the limit.
/// So a step that waited under [`DIRECT_BELOW`] of its time switches to direct reads, and one
/// that waited over [`BUFFERED_ABOVE`] back to buffered ones; between the two nothing changes.
pub fn direct_reads(direct: bool, waited: f64, step: f64) -> bool {
    if !(step > 0.0 && waited.is_finite()) {
        return direct;
    }
    let share = waited / step;
    match direct {
        false => share < DIRECT_BELOW,
        true => share <= BUFFERED_ABOVE,
    }
}

/// When a streamed model's uncached refills read past the page cache straight into their slots
/// (`O_DIRECT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DirectReads {
    /// Never: every refill reads through the page cache.
    Never,
    /// After a step limited by its compute, until one limited by its reads ([`direct_reads`]).
    #[default]
    Adaptive,
    /// Always, from the next refill on.
    Always,
}

impl DirectReads {
    /// Whether the next step's refills read direct (`direct` now) after a step that waited
    /// `waited` of its `step` seconds for refills.
    pub fn next(self, direct: bool, waited: f64, step: f64) -> bool {
        match self {
            DirectReads::Never => false,
            DirectReads::Adaptive => direct_reads(direct, waited, step),
            DirectReads::Always => true,
        }
    }
}

/// A step that waited less than this share of its time for refills is limited by its compute.
pub const DIRECT_BELOW: f64 = 0.05;

/// A step that waited more than this share of its time for refills is limited by its reads.
pub const BUFFERED_ABOVE: f64 = 0.1;

/// The budget cannot hold the model's fixed tensors and one streamed block.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "a budget of {} is smaller than the {} a step needs with every block streamed (fixed tensors {}, one block {}, working memory {}): give it at least that much",
    format_bytes(*budget), format_bytes(*needed), format_bytes(*fixed), format_bytes(*block), format_bytes(*working)
)]
pub struct TooSmall {
    /// The budget, bytes.
    pub budget: u64,
    /// Bytes a step needs with every block streamed.
    pub needed: u64,
    /// Bytes of the fixed (always resident) tensors.
    pub fixed: u64,
    /// Bytes of the largest block.
    pub block: u64,
    /// Working memory of a step, bytes.
    pub working: u64,
}

/// The largest split under `budget` with at most `at_most` resident blocks: as many resident
/// blocks as fit beside the slots, with a look-ahead slot when the budget holds it.
pub fn fit(sizes: &Sizes, budget: u64, working: u64, at_most: usize) -> Result<Split, TooSmall> {
    fit_within(sizes, budget, working, at_most, true)
}

/// [`fit`], with a look-ahead slot only when `look_ahead` allows one (off: one slot, and the
/// room of the other goes to resident blocks or the hot set).
pub fn fit_within(
    sizes: &Sizes,
    budget: u64,
    working: u64,
    at_most: usize,
    look_ahead: bool,
) -> Result<Split, TooSmall> {
    let blocks = sizes.blocks.len();
    let at_most = at_most.min(blocks);
    let slots = |resident: usize| (blocks - resident).min(if look_ahead { 2 } else { 1 });
    let room = |need: u64| budget.saturating_sub(need);
    if let Some(resident) = (0..=at_most).rev().find(|&r| sizes.need(r, slots(r), working) <= budget) {
        let hot = if resident < blocks { room(sizes.need(resident, slots(resident), working)) } else { 0 };
        return Ok(Split { resident, blocks, look_ahead: slots(resident) == 2, hot });
    }
    // No look-ahead: one slot, every block streamed.
    if blocks == 0 || sizes.need(0, 1, working) <= budget {
        return Ok(Split { resident: 0, blocks, look_ahead: false, hot: room(sizes.need(0, 1, working)) });
    }
    Err(TooSmall {
        budget,
        needed: sizes.need(0, 1, working),
        fixed: sizes.fixed,
        block: sizes.blocks.iter().copied().max().unwrap_or(0),
        working,
    })
}

/// After an out-of-memory in a step: the hot set given up, else one more block streamed, or
/// `None` when every block already is and nothing is hot (the eviction cannot help). Never
/// raises what the model holds ([`Sizes::holding`]): the block that starts streaming may be
/// larger than the slots were, so the slot ahead is kept only when two slots of the new size
/// fit in what the model held before; one slot always does (it replaces the block's own bytes).
pub fn evict(sizes: &Sizes, split: Split) -> Option<Split> {
    if split.hot > 0 {
        return Some(Split { hot: 0, ..split });
    }
    let resident = split.resident.checked_sub(1)?;
    let before = sizes.need(split.resident, split.slots(), 0);
    let look_ahead = split.blocks - resident >= 2 && sizes.need(resident, 2, 0) <= before;
    Some(Split { resident, look_ahead, ..split })
}

/// The governor: when the machine has less than `floor` bytes available before a step, the
/// shortfall comes out of the hot set's room, and once that is empty one more block is streamed
/// per step (`None`: the split holds, or every block already is streamed).
pub fn govern(sizes: &Sizes, split: Split, available: u64, floor: u64) -> Option<Split> {
    let short = floor.checked_sub(available).filter(|&s| s > 0)?;
    if split.hot > 0 {
        return Some(Split { hot: split.hot.saturating_sub(short), ..split });
    }
    evict(sizes, split)
}

/// How long a pressure reading takes to show what a change did: the window of PSI's shortest
/// average (`avg10`). The pressure governor acts at most once per window.
pub const PRESSURE_WINDOW: std::time::Duration = std::time::Duration::from_secs(10);

/// The governor on memory pressure (PSI's `some avg10`: the percent of the last 10 s in which
/// some task stalled waiting for memory): at `threshold` or more, when the last relief was at
/// least a [`PRESSURE_WINDOW`] ago (`since_last`; `None`: never), half the hot set's room goes,
/// and once that is empty one more block is streamed. PSI says how much the machine suffers,
/// not how many bytes it lacks: a half at a time, then time for the average to show it.
pub fn relieve(
    sizes: &Sizes,
    split: Split,
    pressure: f64,
    threshold: f64,
    since_last: Option<std::time::Duration>,
) -> Option<Split> {
    // A NaN reading compares false: nothing to act on.
    let pressed = pressure >= threshold;
    if !pressed || since_last.is_some_and(|since| since < PRESSURE_WINDOW) {
        return None;
    }
    if split.hot > 0 {
        return Some(Split { hot: split.hot / 2, ..split });
    }
    evict(sizes, split)
}

/// What a measured working memory means for the next step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refit {
    /// The split holds.
    Keep,
    /// Fewer resident blocks (or no look-ahead) make the next step fit.
    Shrink(Split),
    /// Even with every block streamed the step passes the budget by `over` bytes.
    Over {
        /// The split with every block streamed.
        split: Split,
        /// Bytes over the budget.
        over: u64,
    },
}

/// The split for the next step once a step measured `working` bytes of working memory: never
/// more resident blocks, nor a larger hot set, than now.
pub fn refit(sizes: &Sizes, split: Split, budget: u64, working: u64) -> Refit {
    match fit(sizes, budget, working, split.resident) {
        Ok(next) => {
            let next = Split { hot: next.hot.min(split.hot), ..next };
            if next == split {
                Refit::Keep
            } else {
                Refit::Shrink(next)
            }
        }
        Err(too_small) => Refit::Over {
            split: Split { resident: 0, blocks: split.blocks, look_ahead: false, hot: 0 },
            over: too_small.needed - budget,
        },
    }
}

/// One residency line: `shape_flow: 26 of 30 blocks resident, 4 streamed, 1.4 GiB per step
/// through the slot`.
pub fn describe(model: &str, sizes: &Sizes, split: Split) -> String {
    let mut line =
        format!("{model}: {} of {} blocks resident, {} streamed", split.resident, split.blocks, split.streamed());
    if split.streamed() > 0 {
        let slots = if split.look_ahead { "two slots (one ahead)" } else { "one slot" };
        line += &format!(", {} per step through {slots}", format_bytes(sizes.streamed_per_step(split.resident)));
        if split.hot > 0 {
            line += &format!(", {} of room to keep blocks hot", format_bytes(split.hot));
        }
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    const MB: u64 = 1 << 20;

    fn sizes(fixed: u64, blocks: &[u64]) -> Sizes {
        Sizes { fixed: fixed * MB, blocks: blocks.iter().map(|b| b * MB).collect() }
    }

    #[test]
    fn a_budget_over_the_whole_model_keeps_every_block() {
        let s = sizes(10, &[100; 8]);
        assert_eq!(fit(&s, 810 * MB, 0, 8), Ok(Split { resident: 8, blocks: 8, look_ahead: false, hot: 0 }));
    }

    #[test]
    fn the_resident_prefix_leaves_room_for_two_slots() {
        let s = sizes(10, &[100; 8]);
        // 10 + 4 × 100 + 2 slots × 100 = 610.
        assert_eq!(fit(&s, 650 * MB, 0, 8), Ok(Split { resident: 4, blocks: 8, look_ahead: true, hot: 40 * MB }));
        assert_eq!(s.need(4, 2, 0), 610 * MB);
        assert_eq!(s.streamed_per_step(4), 400 * MB);
    }

    #[test]
    fn a_single_streamed_block_needs_one_slot() {
        let s = sizes(0, &[100; 4]);
        assert_eq!(fit(&s, 399 * MB, 0, 4), Ok(Split { resident: 1, blocks: 4, look_ahead: true, hot: 99 * MB }));
        assert_eq!(fit(&s, 400 * MB, 0, 4), Ok(Split { resident: 4, blocks: 4, look_ahead: false, hot: 0 }));
        let s = sizes(0, &[100, 100, 100, 50]);
        assert_eq!(fit(&s, 350 * MB, 0, 4), Ok(Split { resident: 4, blocks: 4, look_ahead: false, hot: 0 }));
        // Two resident with one slot (300) would fit too; a slot ahead is worth a resident block.
        assert_eq!(fit(&s, 349 * MB, 0, 4), Ok(Split { resident: 1, blocks: 4, look_ahead: true, hot: 49 * MB }));
    }

    #[test]
    fn without_look_ahead_the_second_slot_goes_to_a_resident_block() {
        let s = sizes(10, &[100; 8]);
        assert_eq!(fit(&s, 650 * MB, 0, 8).unwrap().resident, 4);
        assert_eq!(
            fit_within(&s, 650 * MB, 0, 8, false),
            Ok(Split { resident: 5, blocks: 8, look_ahead: false, hot: 40 * MB })
        );
    }

    #[test]
    fn a_budget_for_one_slot_only_streams_everything_without_look_ahead() {
        let s = sizes(10, &[100; 8]);
        assert_eq!(fit(&s, 150 * MB, 0, 8), Ok(Split { resident: 0, blocks: 8, look_ahead: false, hot: 40 * MB }));
    }

    #[test]
    fn a_budget_under_one_block_is_refused_naming_both_sizes() {
        let s = sizes(10, &[100; 8]);
        let err = fit(&s, 50 * MB, 0, 8).unwrap_err();
        assert_eq!(err.needed, 110 * MB);
        assert_eq!(err.block, 100 * MB);
        let message = err.to_string();
        assert!(message.contains("50.0 MiB") && message.contains("110.0 MiB"), "{message}");
    }

    #[test]
    fn working_memory_counts_in_the_budget() {
        let s = sizes(0, &[100; 8]);
        assert_eq!(fit(&s, 600 * MB, 0, 8).unwrap().resident, 4);
        assert_eq!(fit(&s, 600 * MB, 150 * MB, 8).unwrap().resident, 2);
    }

    #[test]
    fn the_resident_count_never_grows_past_the_current_one() {
        let s = sizes(0, &[100; 8]);
        assert_eq!(fit(&s, 10_000 * MB, 0, 3).unwrap().resident, 3);
        let split = Split { resident: 3, blocks: 8, look_ahead: true, hot: 0 };
        assert_eq!(refit(&s, split, 10_000 * MB, 0), Refit::Keep, "nor does the hot set's room");
    }

    #[test]
    fn eviction_gives_up_the_hot_set_then_streams_one_more_block_until_none_is_left() {
        let s = sizes(0, &[100; 3]);
        let split = Split { resident: 2, blocks: 3, look_ahead: false, hot: 10 * MB };
        let cold = evict(&s, split).unwrap();
        assert_eq!(cold, Split { hot: 0, ..split });
        let once = evict(&s, cold).unwrap();
        assert_eq!(once, Split { resident: 1, blocks: 3, look_ahead: true, hot: 0 });
        let twice = evict(&s, once).unwrap();
        assert_eq!(twice.resident, 0);
        assert_eq!(evict(&s, twice), None, "every block streamed: eviction cannot help");
    }

    #[test]
    fn slots_are_as_large_as_the_largest_streamed_block_not_the_largest_block() {
        let s = sizes(0, &[10, 10, 50, 10, 20, 10]);
        assert_eq!(s.slot(3), 20 * MB, "the 50 is resident: it never lands in a slot");
        assert_eq!(s.slot(2), 50 * MB);
        assert_eq!(s.slot(6), 0, "nothing streamed");
        assert_eq!(s.need(3, 2, 0), (70 + 40) * MB);
    }

    #[test]
    fn streaming_a_block_larger_than_the_slots_drops_the_slot_ahead_rather_than_hold_more() {
        // Resident 10 + 10 + 50, two slots of 10: 90. Streaming the 50 with two slots of 50
        // would hold 120; one slot of 50 holds 70.
        let s = sizes(0, &[10, 10, 50, 10, 10]);
        let split = Split { resident: 3, blocks: 5, look_ahead: true, hot: 0 };
        let next = evict(&s, split).unwrap();
        assert_eq!(next, Split { resident: 2, blocks: 5, look_ahead: false, hot: 0 });
        assert!(s.holding(next, false).held <= s.holding(split, false).held);
        // Streaming one more (a 10) with two slots of 50 would hold 10 + 100 against 10 + 10 + 50.
        assert!(!evict(&s, next).unwrap().look_ahead, "110 > 70: still one slot");
    }

    proptest::proptest! {
        #[test]
        fn an_eviction_never_raises_what_the_model_holds(
            blocks in proptest::collection::vec(1..1000u64, 1..12),
            fixed in 0..1000u64,
            resident_seed in 0..12usize,
            look_ahead: bool,
            hot in 0..3000u64,
        ) {
            let s = Sizes { fixed, blocks };
            let n = s.blocks.len();
            let resident = resident_seed % (n + 1);
            let mut split = Split { resident, blocks: n, look_ahead: look_ahead && n - resident >= 2, hot };
            while let Some(next) = evict(&s, split) {
                proptest::prop_assert!(s.holding(next, false).held <= s.holding(split, false).held, "{split:?} -> {next:?}");
                proptest::prop_assert!(s.holding(next, true).held <= s.holding(split, true).held);
                split = next;
            }
            proptest::prop_assert_eq!(split.resident, 0);
        }
    }

    #[test]
    fn a_measured_working_memory_shrinks_the_prefix_for_the_next_step() {
        let s = sizes(0, &[100; 8]);
        let split = fit(&s, 600 * MB, 0, 8).unwrap();
        assert_eq!(
            refit(&s, split, 600 * MB, 50 * MB),
            Refit::Shrink(Split { resident: 3, blocks: 8, look_ahead: true, hot: 0 })
        );
        match refit(&s, split, 600 * MB, 550 * MB) {
            Refit::Over { split, over } => {
                assert_eq!(split.resident, 0);
                assert_eq!(over, 50 * MB, "one slot of 100 + 550 working against 600");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_governor_shrinks_the_hot_set_by_the_shortfall_then_streams_one_more_block_per_step() {
        let s = sizes(0, &[100; 8]);
        let split = Split { resident: 3, blocks: 8, look_ahead: true, hot: 0 };
        assert_eq!(govern(&s, split, 2048 * MB, 1024 * MB), None, "enough available: the split holds");
        assert_eq!(govern(&s, split, 1024 * MB, 1024 * MB), None, "exactly the floor is enough");
        assert_eq!(govern(&s, split, 512 * MB, 1024 * MB), Some(Split { resident: 2, ..split }));
        let all = Split { resident: 0, blocks: 8, look_ahead: true, hot: 0 };
        assert_eq!(govern(&s, all, 0, 1024 * MB), None, "nothing left to stream");
        let hot = Split { hot: 700 * MB, ..split };
        assert_eq!(govern(&s, hot, 512 * MB, 1024 * MB), Some(Split { hot: 188 * MB, ..split }));
        assert_eq!(govern(&s, Split { hot: 188 * MB, ..split }, 512 * MB, 1024 * MB), Some(split));
        assert_eq!(govern(&s, split, 512 * MB, 1024 * MB), Some(Split { resident: 2, ..split }));
    }

    #[test]
    fn under_memory_pressure_the_hot_set_halves_then_one_more_block_streams_once_per_window() {
        use std::time::Duration;
        let s = sizes(0, &[100; 8]);
        let split = Split { resident: 3, blocks: 8, look_ahead: true, hot: 400 * MB };
        let long_ago = Some(PRESSURE_WINDOW);
        assert_eq!(relieve(&s, split, 9.9, 10.0, None), None, "under the threshold: the split holds");
        assert_eq!(relieve(&s, split, f64::NAN, 10.0, None), None, "no reading to act on");
        assert_eq!(relieve(&s, split, 10.0, 10.0, None), Some(Split { hot: 200 * MB, ..split }));
        let halved = Split { hot: 200 * MB, ..split };
        assert_eq!(
            relieve(&s, halved, 80.0, 10.0, Some(Duration::from_secs(3))),
            None,
            "the average has not seen it yet"
        );
        assert_eq!(relieve(&s, halved, 80.0, 10.0, long_ago), Some(Split { hot: 100 * MB, ..split }));
        let cold = Split { hot: 0, ..split };
        assert_eq!(relieve(&s, cold, 80.0, 10.0, long_ago), Some(Split { resident: 2, ..cold }));
        let all = Split { resident: 0, blocks: 8, look_ahead: true, hot: 0 };
        assert_eq!(relieve(&s, all, 100.0, 10.0, long_ago), None, "nothing left to stream");
    }

    #[test]
    fn a_block_counts_its_tensors_at_slot_alignment_and_the_room_for_its_file_phase() {
        assert_eq!(block_bytes([64, 1, 100]), 64 + 64 + 128 + FILE_PHASE_ROOM);
        assert_eq!(block_bytes([]), FILE_PHASE_ROOM);
        assert_eq!(block_bytes([u64::MAX, 64]), u64::MAX);
    }

    #[test]
    fn reads_go_direct_after_a_step_limited_by_its_compute_and_back_after_one_limited_by_its_reads() {
        // Buffered: a step that waited 4 % of its time switches; 5 % or more does not.
        assert!(direct_reads(false, 0.04, 1.0));
        assert!(!direct_reads(false, 0.05, 1.0));
        // Direct: kept up to a tenth of the step waiting, so that its slower reads do not flip
        // it back and forth; past that, buffered again.
        assert!(direct_reads(true, 0.1, 1.0));
        assert!(!direct_reads(true, 0.11, 1.0));
        // A step without a measured time, or a wait that is not a number, changes nothing.
        for direct in [false, true] {
            assert_eq!(direct_reads(direct, 0.0, 0.0), direct);
            assert_eq!(direct_reads(direct, f64::NAN, 1.0), direct);
        }
    }

    #[test]
    fn reads_never_or_always_direct_whatever_a_step_waited() {
        for (direct, waited) in [(false, 0.0), (false, 0.9), (true, 0.0), (true, 0.9)] {
            assert!(!DirectReads::Never.next(direct, waited, 1.0));
            assert!(DirectReads::Always.next(direct, waited, 1.0));
            assert_eq!(DirectReads::Adaptive.next(direct, waited, 1.0), direct_reads(direct, waited, 1.0));
        }
    }

    #[test]
    fn sums_saturate_instead_of_wrapping() {
        let s = Sizes { fixed: u64::MAX, blocks: vec![u64::MAX, u64::MAX] };
        assert_eq!(s.need(1, 1, u64::MAX), u64::MAX);
        assert!(fit(&s, u64::MAX - 1, 0, 2).is_err());
    }

    #[test]
    fn the_residency_line_says_counts_and_bytes_per_step() {
        let s = sizes(0, &[100; 30]);
        let line = describe("shape_flow", &s, Split { resident: 26, blocks: 30, look_ahead: true, hot: 0 });
        assert_eq!(
            line,
            "shape_flow: 26 of 30 blocks resident, 4 streamed, 400.0 MiB per step through two slots (one ahead)"
        );
        let line = describe("m", &s, Split { resident: 30, blocks: 30, look_ahead: false, hot: 0 });
        assert_eq!(line, "m: 30 of 30 blocks resident, 0 streamed");
        let line = describe("m", &s, Split { resident: 0, blocks: 30, look_ahead: true, hot: 250 * MB });
        assert!(line.ends_with("through two slots (one ahead), 250.0 MiB of room to keep blocks hot"), "{line}");
    }
}
