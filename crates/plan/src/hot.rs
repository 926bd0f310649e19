//! Which streamed blocks stay in memory after they run: a streamed model's hot set (gmlx's decode
//! arena), in the room its budget leaves beside the fixed tensors, the resident prefix, the slots
//! and the working memory ([`crate::split::Split::hot`]). Pure and torch-free: the streamer keeps
//! one [`HotSet`] and carries out what it returns (blocks to free); the plan runs the same rules
//! over one step to count what stays.
//!
//! Rules. Each use of a block adds [`USE`] to its score and every step halves every score, so a
//! score is a use count in which recent steps weigh most. A streamed block about to be refilled
//! is kept when the room has space for it, or when evicting held blocks that score strictly less
//! than it does makes the space; otherwise it goes through a slot as before. Ties keep the
//! blocks already held, so a forward that runs every streamed block once per step in order keeps
//! a fixed set and finds it every step (least recently used would evict each block just before
//! its next use and never hit); a mixture of experts keeps the experts its router picks most,
//! and a block used once does not displace them. A block in use, or in flight, is never evicted.

/// What one use adds to a block's score (halved each step).
pub const USE: u32 = 1 << 10;

/// The streamed blocks held in the hot set, and every block's score.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HotSet {
    scores: Vec<u32>,
    held: Vec<bool>,
    bytes: u64,
}

impl HotSet {
    /// Nothing held; every score zero.
    pub fn new(blocks: usize) -> HotSet {
        HotSet { scores: vec![0; blocks], held: vec![false; blocks], bytes: 0 }
    }

    /// Whether block `block` is held.
    pub fn holds(&self, block: usize) -> bool {
        self.held.get(block).copied().unwrap_or(false)
    }

    /// Bytes the held blocks take.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Blocks held now.
    pub fn count(&self) -> usize {
        self.held.iter().filter(|h| **h).count()
    }

    /// Block `block` ran.
    pub fn used(&mut self, block: usize) {
        if let Some(score) = self.scores.get_mut(block) {
            *score = score.saturating_add(USE);
        }
    }

    /// A step ended: every score halves.
    pub fn decay(&mut self) {
        self.scores.iter_mut().for_each(|s| *s >>= 1);
    }

    /// Whether block `block` (of `sizes[block]` bytes) is kept once refilled, within `room`
    /// bytes: `Some(victims)`, the held blocks to free first (possibly none), or `None` when it
    /// goes through a slot. Blocks in `protected` are never victims. Changes nothing; [`keep`]
    /// and [`drop_block`] do.
    ///
    /// [`keep`]: HotSet::keep
    /// [`drop_block`]: HotSet::drop_block
    pub fn admit(&self, block: usize, sizes: &[u64], room: u64, protected: &[usize]) -> Option<Vec<usize>> {
        let size = *sizes.get(block)?;
        if self.holds(block) || size > room {
            return None;
        }
        let mut free = room.saturating_sub(self.bytes);
        if size <= free {
            return Some(Vec::new());
        }
        let score = self.scores.get(block).copied().unwrap_or(0);
        let mut victims = Vec::new();
        for candidate in self.weakest_first(protected) {
            if self.scores[candidate] >= score {
                break;
            }
            victims.push(candidate);
            free = free.saturating_add(sizes.get(candidate).copied().unwrap_or(0));
            if size <= free {
                return Some(victims);
            }
        }
        None
    }

    /// Holds block `block` of `bytes` bytes (after its victims were dropped).
    pub fn keep(&mut self, block: usize, bytes: u64) {
        if let Some(held) = self.held.get_mut(block).filter(|h| !**h) {
            *held = true;
            self.bytes = self.bytes.saturating_add(bytes);
        }
    }

    /// Stops holding block `block` of `bytes` bytes (freed, or resident now).
    pub fn drop_block(&mut self, block: usize, bytes: u64) {
        if let Some(held) = self.held.get_mut(block).filter(|h| **h) {
            *held = false;
            self.bytes = self.bytes.saturating_sub(bytes);
        }
    }

    /// The held blocks to free, weakest first, so that the rest fit `room` (a shrunk room);
    /// `protected` ones stay even when the rest then does not fit. Changes nothing.
    pub fn over(&self, sizes: &[u64], room: u64, protected: &[usize]) -> Vec<usize> {
        let mut bytes = self.bytes;
        let mut victims = Vec::new();
        for candidate in self.weakest_first(protected) {
            if bytes <= room {
                break;
            }
            victims.push(candidate);
            bytes = bytes.saturating_sub(sizes.get(candidate).copied().unwrap_or(0));
        }
        victims
    }

    /// Held, unprotected blocks by score, lowest first; among equals the later block first.
    fn weakest_first(&self, protected: &[usize]) -> Vec<usize> {
        let mut held: Vec<usize> = (0..self.held.len()).filter(|&b| self.held[b] && !protected.contains(&b)).collect();
        held.sort_by_key(|&b| (self.scores[b], std::cmp::Reverse(b)));
        held
    }
}

/// The blocks a forward that runs `streamed` in that order every step keeps in `room`: the hot
/// set after its first step, which later steps keep (ties keep what is held). What the plan counts.
pub fn steady(sizes: &[u64], streamed: impl IntoIterator<Item = usize>, room: u64) -> HotSet {
    let mut hot = HotSet::new(sizes.len());
    for block in streamed {
        if let Some(victims) = hot.admit(block, sizes, room, &[block]) {
            for victim in victims {
                hot.drop_block(victim, sizes[victim]);
            }
            hot.keep(block, sizes[block]);
        }
        hot.used(block);
    }
    hot
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `steps` of `order` (block indices) through the rules with `room`; refills per step.
    fn simulate(hot: &mut HotSet, sizes: &[u64], room: u64, steps: &[Vec<usize>]) -> Vec<usize> {
        let mut refills = Vec::new();
        for order in steps {
            let mut count = 0;
            for &block in order {
                if !hot.holds(block) {
                    count += 1;
                    if let Some(victims) = hot.admit(block, sizes, room, &[block]) {
                        for v in victims {
                            hot.drop_block(v, sizes[v]);
                        }
                        hot.keep(block, sizes[block]);
                    }
                }
                hot.used(block);
            }
            hot.decay();
            refills.push(count);
        }
        refills
    }

    #[test]
    fn blocks_are_kept_while_the_room_has_space() {
        let sizes = [100; 6];
        let mut hot = HotSet::new(6);
        assert_eq!(hot.admit(2, &sizes, 250, &[]), Some(vec![]));
        hot.keep(2, 100);
        assert_eq!(hot.admit(3, &sizes, 250, &[]), Some(vec![]));
        hot.keep(3, 100);
        assert_eq!(hot.bytes(), 200);
        assert_eq!(hot.admit(4, &sizes, 250, &[]), None, "50 bytes left, both held score the same as it would");
        assert_eq!(hot.admit(3, &sizes, 250, &[]), None, "held already");
        assert_eq!(hot.admit(9, &sizes, 250, &[]), None, "no such block");
    }

    #[test]
    fn a_block_larger_than_the_room_is_never_kept() {
        let hot = HotSet::new(2);
        assert_eq!(hot.admit(0, &[300, 10], 250, &[]), None);
        assert_eq!(hot.admit(1, &[300, 10], 0, &[]), None);
    }

    #[test]
    fn a_sequential_forward_keeps_a_fixed_set_and_hits_it_every_step() {
        // Streamed blocks 4..8 through a room of two: LRU would refill all four every step.
        let sizes = [100; 8];
        let mut hot = HotSet::new(8);
        let steps = vec![(4..8).collect::<Vec<_>>(); 5];
        assert_eq!(simulate(&mut hot, &sizes, 200, &steps), vec![4, 2, 2, 2, 2]);
        assert!(hot.holds(4) && hot.holds(5) && !hot.holds(6) && !hot.holds(7));
        let planned = steady(&sizes, 4..8, 200);
        assert!((0..8).all(|b| planned.holds(b) == hot.holds(b)), "the plan's count is the run's");
    }

    #[test]
    fn experts_used_most_displace_those_used_once() {
        // Eight experts, room for two; every step uses 0 and 1, and one of the others once.
        let sizes = [10; 8];
        let mut hot = HotSet::new(8);
        let steps: Vec<Vec<usize>> = (0..12).map(|s| vec![2 + s % 6, 0, 1]).collect();
        let refills = simulate(&mut hot, &sizes, 20, &steps);
        assert!(hot.holds(0) && hot.holds(1), "{hot:?}");
        assert_eq!(hot.count(), 2);
        assert_eq!(refills[refills.len() - 4..], [1, 1, 1, 1], "only the rare expert is refilled: {refills:?}");
    }

    #[test]
    fn a_stale_block_goes_once_its_score_has_decayed() {
        let sizes = [10; 3];
        let mut hot = HotSet::new(3);
        simulate(&mut hot, &sizes, 10, &[vec![0], vec![0]]);
        assert!(hot.holds(0));
        // Block 1 is used often now; block 0 not at all.
        simulate(&mut hot, &sizes, 10, &[vec![1], vec![1], vec![1]]);
        assert!(hot.holds(1) && !hot.holds(0), "{hot:?}");
    }

    #[test]
    fn protected_blocks_are_never_victims() {
        let sizes = [10; 3];
        let mut hot = HotSet::new(3);
        hot.keep(0, 10);
        assert_eq!(hot.admit(1, &sizes, 10, &[0]), None, "0 scores less but runs now");
        assert_eq!(hot.admit(1, &sizes, 10, &[]), None, "ties keep what is held");
        hot.used(1);
        assert_eq!(hot.admit(1, &sizes, 10, &[]), Some(vec![0]));
        assert_eq!(hot.over(&sizes, 0, &[0]), Vec::<usize>::new());
    }

    #[test]
    fn a_shrunk_room_frees_the_weakest_blocks_until_the_rest_fits() {
        let sizes = [10, 20, 30];
        let mut hot = HotSet::new(3);
        for (b, bytes) in sizes.iter().enumerate() {
            hot.keep(b, *bytes);
        }
        hot.used(1);
        hot.used(1);
        hot.used(2);
        assert_eq!(hot.over(&sizes, 60, &[]), Vec::<usize>::new());
        assert_eq!(hot.over(&sizes, 45, &[]), vec![0, 2], "0 scores least, then 2; 20 bytes left");
        assert_eq!(hot.over(&sizes, 0, &[]), vec![0, 2, 1]);
    }

    proptest::proptest! {
        /// Any sizes, rooms and access orders (indices past the end included): the set never
        /// holds more than its room, its bytes are its blocks' sizes, and a shrunk room is met.
        #[test]
        fn the_hot_set_never_holds_more_than_its_room(
            sizes in proptest::collection::vec(0..1000u64, 1..10),
            room in 0..4000u64,
            shrunk in 0..4000u64,
            steps in proptest::collection::vec(proptest::collection::vec(0..12usize, 1..8), 1..12),
        ) {
            let mut hot = HotSet::new(sizes.len());
            let held_bytes = |hot: &HotSet| (0..sizes.len()).filter(|&b| hot.holds(b)).map(|b| sizes[b]).sum::<u64>();
            for order in &steps {
                for &block in order {
                    if let Some(victims) = hot.admit(block, &sizes, room, &[block]) {
                        proptest::prop_assert!(!victims.contains(&block));
                        for v in victims {
                            hot.drop_block(v, sizes[v]);
                        }
                        hot.keep(block, sizes[block]);
                    }
                    hot.used(block);
                    proptest::prop_assert!(hot.bytes() <= room);
                    proptest::prop_assert_eq!(hot.bytes(), held_bytes(&hot));
                }
                hot.decay();
            }
            for v in hot.over(&sizes, shrunk, &[]) {
                hot.drop_block(v, sizes[v]);
            }
            proptest::prop_assert!(hot.bytes() <= shrunk);
        }
    }

    #[test]
    fn keeping_and_dropping_twice_counts_once() {
        let mut hot = HotSet::new(2);
        hot.keep(0, 10);
        hot.keep(0, 10);
        assert_eq!(hot.bytes(), 10);
        hot.drop_block(0, 10);
        hot.drop_block(0, 10);
        hot.drop_block(5, 10);
        assert_eq!((hot.bytes(), hot.count()), (0, 0));
    }
}
