//! The order a streamed model's forward runs its blocks in, as far as the read ahead goes: in
//! order (the next block guessed by index until the forward names its next blocks itself) or in
//! any order (only what the forward names is read ahead), and whether a block is read ahead at
//! all.

use super::split::Split;

/// How the forward runs the blocks, and whether one is read ahead while another runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Order {
    /// The forward runs blocks in any order or only some of them
    /// ([`StreamedModel::any_order`](super::StreamedModel::any_order)).
    any: bool,
    /// The forward has named a block it runs next ([`Step::prefetch`](super::Step::prefetch)):
    /// from then on only what it names is read ahead, in order too (no guess by index).
    named: bool,
    /// A streamed block is read while the one before it runs
    /// ([`StreamedModel::look_ahead`](super::StreamedModel::look_ahead)).
    look_ahead: bool,
}

impl Order {
    /// In any order (`any`) or in order, with a read ahead, nothing named yet.
    pub(super) fn new(any: bool) -> Self {
        Order { any, named: false, look_ahead: true }
    }

    /// Whether the forward runs the blocks in any order.
    pub(super) fn any(self) -> bool {
        self.any
    }

    /// The forward runs the blocks in any order from now on.
    pub(super) fn set_any(&mut self) {
        self.any = true;
    }

    /// The forward names the blocks it runs next from now on.
    pub(super) fn set_named(&mut self) {
        self.named = true;
    }

    /// Whether a block is read ahead while another runs.
    pub(super) fn look_ahead(self) -> bool {
        self.look_ahead
    }

    /// Reads ahead (`on`) or not.
    pub(super) fn set_look_ahead(&mut self, on: bool) {
        self.look_ahead = on;
    }

    /// Whether the read ahead under `split` guesses the next block by index: in order, until
    /// the forward names its next blocks itself.
    pub(super) fn guesses_by_index(self, split: Split) -> bool {
        split.look_ahead && !self.any && !self.named
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(look_ahead: bool) -> Split {
        Split { resident: 0, blocks: 3, look_ahead, hot: 0 }
    }

    #[test]
    fn only_a_forward_in_order_that_named_nothing_yet_is_guessed_by_index() {
        let mut order = Order::new(false);
        assert!(order.guesses_by_index(split(true)));
        assert!(!order.guesses_by_index(split(false)), "no read ahead under the split");
        order.set_named();
        assert!(!order.guesses_by_index(split(true)));
        assert!(!Order::new(true).guesses_by_index(split(true)));
    }
}
