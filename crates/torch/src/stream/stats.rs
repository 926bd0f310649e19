//! What a streamed model has moved so far: the counts a step, a refill and a read past the page
//! cache add to.

/// What a streamed model has moved so far.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StreamStats {
    /// Steps completed.
    pub steps: u64,
    /// Block refills (ahead or on demand).
    pub refills: u64,
    /// Bytes refilled.
    pub bytes_refilled: u64,
    /// Seconds the refills took, wherever they ran.
    pub refill_seconds: f64,
    /// Seconds [`Step::block`](super::Step::block) waited for a block (a refill not finished, or not started).
    pub waited_seconds: f64,
    /// Refills read for a step while the step before it ended, its last block running (counted
    /// once the forward used them; among [`refills`](Self::refills)).
    pub carried: u64,
    /// Steps run again after an out-of-memory.
    pub retries: u64,
    /// Streamed blocks found in the hot set when the forward reached them (refills saved).
    pub hot_hits: u64,
    /// The most the model held at any block boundary or step's start, from its storages
    /// ([`StreamedModel::held_bytes`](super::StreamedModel::held_bytes)).
    pub most_held: u64,
    /// Bytes refills read past the page cache straight into their slots (`O_DIRECT`; among
    /// [`bytes_refilled`](Self::bytes_refilled)): with
    /// [`StreamedModel::uncached`](super::StreamedModel::uncached), after a step limited by its
    /// compute ([`stageload_plan::split::direct_reads`]).
    pub bytes_direct: u64,
}
