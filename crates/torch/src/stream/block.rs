//! What a streamed model is made of, and set-up's first steps: its tensors cut into blocks
//! and fixed tensors, every storage owned by one of them, every tensor under its checkpoint
//! entry's name ([`Parts`]); a block's storages and where they sit in a slot ([`Block`]); the
//! refill running ahead ([`Ahead`]); and, on CUDA, every block's tensors in pinned host memory
//! ([`HostBlocks`]). The streamer (`streamer.rs`) owns these once set up; refills
//! (`refill.rs`) change them.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use super::fences::Filled;

use tch::Tensor;

use super::blocks::{assign, BlockSpec};
use super::split::{DirectReads, Sizes};
use super::{torch, StreamError};
use crate::checkpoint::{Checkpoint, CheckpointError};
use crate::names::NameRules;
use crate::pinned::HostCopyError;
use crate::storage::{self, StorageRecord};

/// One block's tensors, as the checkpoint names them, and its storages.
pub(super) struct Block {
    pub(super) name: String,
    /// (checkpoint entry name, tensor).
    pub(super) targets: Vec<(String, Tensor)>,
    /// (model tensor name, shape at set-up).
    pub(super) shapes: Vec<(String, Vec<i64>)>,
    pub(super) storages: Vec<StorageRecord>,
    /// Where each storage starts in a slot.
    pub(super) offsets: Vec<usize>,
    /// Each target's storage: its index in `storages` (and `offsets`).
    pub(super) homes: Vec<usize>,
    pub(super) allocated: bool,
    /// The slot its storages borrow, while they do.
    pub(super) slot: Option<usize>,
    /// Where its storages start in their slot beyond `offsets`: the room a read past the page
    /// cache needs to land them at their file phase ([`FileSpan`]); 0 otherwise.
    pub(super) shift: usize,
    /// Its bytes in the file, where they lie as a slot lays them out (`offsets`).
    pub(super) span: Option<FileSpan>,
}

/// A block whose tensors lie in one file exactly as a slot lays them out, one entry per storage
/// in the file's dtype: the file's bytes from `start` to `end`, read as one range, are the
/// slot's from the block's first storage on, so a read past the page cache can land them in
/// place (`refill.rs`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct FileSpan {
    pub(super) file: usize,
    pub(super) start: u64,
    pub(super) end: u64,
}

impl FileSpan {
    /// The span of a block whose storages sit at `offsets` in a slot, `storages[k]` of `nbytes[k]`
    /// bytes, filled by `targets` (entry, storage index, contiguous from its storage's start in
    /// the entry's dtype): `None` unless each storage is one entry's whole bytes in one file at
    /// its slot offset from the first.
    pub(super) fn of(
        offsets: &[usize],
        nbytes: &[usize],
        targets: &[(&crate::checkpoint::Entry, usize, bool)],
    ) -> Option<FileSpan> {
        if targets.len() != nbytes.len() || targets.is_empty() {
            return None;
        }
        let (first, _, _) = targets.iter().min_by_key(|(entry, _, _)| entry.start)?;
        let (file, start) = (first.file, first.start);
        let mut homes: Vec<usize> = targets.iter().map(|(_, home, _)| *home).collect();
        homes.sort_unstable();
        homes.dedup();
        let each_in_place = targets.iter().all(|(entry, home, whole)| {
            *whole
                && entry.file == file
                && entry.end.checked_sub(entry.start) == Some(nbytes[*home] as u64)
                && entry.start - start == offsets[*home] as u64
        });
        let end = targets.iter().map(|(entry, _, _)| entry.end).max()?;
        (homes.len() == nbytes.len() && each_in_place).then_some(FileSpan { file, start, end })
    }
}

/// A block's refill as a job for any thread: the seconds it took, and on CUDA the fence its
/// copies end at ([`super::fences`]).
pub(super) type Job = Box<dyn FnOnce() -> Result<Filled, StreamError> + Send + 'static>;

/// A refill running on its own thread.
pub(super) struct Ahead {
    pub(super) block: usize,
    pub(super) thread: JoinHandle<Result<Filled, StreamError>>,
    /// The slot it reads into (through views of the slot's buffer), which the block's storages
    /// are pointed into once it is joined; `None`: it gives them memory itself.
    pub(super) attach: Option<usize>,
    /// Started for this step while the step before ended ([`super::slots`]).
    pub(super) carried: bool,
}

/// How refills read the checkpoint: through the page cache, or past it. Uncached, what they
/// read is dropped from the page cache; after a step limited by its compute, uncached refills
/// into a slot read with `O_DIRECT` straight into it ([`stageload_plan::split::direct_reads`]).
pub(super) struct ReadMode {
    /// Refills drop what they read from the page cache
    /// ([`StreamedModel::uncached`](super::StreamedModel::uncached)).
    pub(super) uncached: bool,
    /// Uncached refills read past the page cache straight into their slots this step.
    direct: bool,
    /// When they do ([`StreamedModel::direct_reads`](super::StreamedModel::direct_reads)).
    mode: DirectReads,
    /// Bytes refills read that way
    /// ([`StreamStats::bytes_direct`](super::StreamStats::bytes_direct)), added to by their
    /// threads.
    pub(super) read_directly: Arc<AtomicU64>,
}

impl ReadMode {
    /// Through the page cache, kept there.
    pub(super) fn new() -> Self {
        ReadMode { uncached: false, direct: false, mode: DirectReads::Adaptive, read_directly: Arc::default() }
    }

    /// Whether a refill into a slot reads past the page cache now.
    pub(super) fn direct_now(&self) -> bool {
        self.uncached && self.direct
    }

    /// After a step of `seconds` that waited `waited` of them for refills: whether the next
    /// step's refills read past the page cache, as the mode says.
    pub(super) fn after_step(&mut self, waited: f64, seconds: f64) {
        self.direct = self.mode.next(self.direct, waited, seconds);
    }

    /// Reads past the page cache as `mode` says, from the next refill on.
    pub(super) fn set_mode(&mut self, mode: DirectReads) {
        self.mode = mode;
        self.direct = match mode {
            DirectReads::Never => false,
            DirectReads::Adaptive => self.direct,
            DirectReads::Always => true,
        };
    }

    /// Bytes read past the page cache so far.
    pub(super) fn bytes_direct(&self) -> u64 {
        self.read_directly.load(Ordering::Relaxed)
    }
}

/// A model's tensors as set-up cuts them: the blocks, and the fixed tensors (in no block,
/// always resident) with their storages, each tensor under the name of the checkpoint entry
/// that fills it.
pub(super) struct Parts {
    pub(super) blocks: Vec<Block>,
    /// (checkpoint entry name, tensor) of each fixed tensor.
    pub(super) fixed: Vec<(String, Tensor)>,
    pub(super) fixed_storages: Vec<StorageRecord>,
}

impl Parts {
    /// Cuts `tensors` into blocks per `spec`, each paired with its entry of `checkpoint` under
    /// `rules`. Refused: a tensor the checkpoint does not hold, a spec that does not fit the
    /// names, a storage two groups share.
    pub(super) fn of(
        model: &str,
        tensors: &[(String, Tensor)],
        checkpoint: &Checkpoint,
        rules: &NameRules,
        spec: &BlockSpec,
    ) -> Result<Parts, StreamError> {
        let checkpoint_error = |source| StreamError::Checkpoint { model: model.to_string(), source: Box::new(source) };
        let names: Vec<&str> = tensors.iter().map(|(n, _)| n.as_str()).collect();
        let layout = assign(spec, &names).map_err(|source| StreamError::Blocks { model: model.to_string(), source })?;
        let found = checkpoint.match_entries(tensors, rules).map_err(checkpoint_error)?;
        // A streamed tensor is refilled at every step: one the checkpoint cannot fill is refused
        // here, whatever the rules' strictness.
        if !found.missing.is_empty() {
            return Err(checkpoint_error(CheckpointError::Missing {
                tensors: found.missing,
                files: checkpoint.files().to_vec(),
            }));
        }
        // Every tensor has its entry now, or is filled through another of its group's (an alias
        // on the same storage, which `Owners::claim` keeps in one group).
        // The members with an entry, by their position among `members`.
        let with_entries = |members: &[usize]| -> Vec<(usize, (String, Tensor))> {
            let entry =
                |&i: &usize| found.pairs.get(names[i]).map(|entry| (entry.clone(), tensors[i].1.shallow_clone()));
            members.iter().enumerate().filter_map(|(k, i)| entry(i).map(|target| (k, target))).collect()
        };
        let targets = |members: &[usize]| with_entries(members).into_iter().map(|(_, target)| target).collect();
        let mut owners = Owners { model, tensors, owner: HashMap::new() };
        let (fixed_storages, _) = owners.claim("the resident tensors", &layout.fixed)?;
        let mut blocks = Vec::with_capacity(layout.blocks.len());
        for (name, members) in &layout.blocks {
            let (storages, storage_of) = owners.claim(name, members)?;
            let (homes, targets): (Vec<usize>, Vec<(String, Tensor)>) =
                with_entries(members).into_iter().map(|(k, target)| (storage_of[k], target)).unzip();
            let offsets = storage::layout(&storages).0;
            let span = file_span(checkpoint, &targets, &homes, &storages, &offsets);
            blocks.push(Block {
                name: name.clone(),
                targets,
                shapes: members.iter().map(|&i| (names[i].to_string(), tensors[i].1.size())).collect(),
                offsets,
                storages,
                homes,
                allocated: true,
                slot: None,
                shift: 0,
                span,
            });
        }
        Ok(Parts { blocks, fixed: targets(&layout.fixed), fixed_storages })
    }

    /// The bytes the split is decided from: the fixed tensors' storages, and each block as a
    /// slot lays it out (`stageload_plan::split::block_bytes`).
    pub(super) fn sizes_of(fixed_storages: &[StorageRecord], blocks: &[Block]) -> Sizes {
        Sizes {
            fixed: fixed_storages.iter().fold(0u64, |sum, s| sum.saturating_add(s.nbytes as u64)),
            blocks: blocks
                .iter()
                .map(|b| stageload_plan::split::block_bytes(b.storages.iter().map(|s| s.nbytes as u64)))
                .collect(),
        }
    }
}

/// [`FileSpan::of`] a block's `targets` (entry name, tensor), each filling `storages[homes[i]]`.
fn file_span(
    checkpoint: &Checkpoint,
    targets: &[(String, Tensor)],
    homes: &[usize],
    storages: &[StorageRecord],
    offsets: &[usize],
) -> Option<FileSpan> {
    let mut described = Vec::with_capacity(targets.len());
    for ((entry, tensor), &home) in targets.iter().zip(homes) {
        let entry = checkpoint.entries().get(entry)?;
        let whole = entry.kind == tensor.kind() && tensor.is_contiguous() && tensor.storage_offset() == 0;
        described.push((entry, home, whole));
    }
    let nbytes: Vec<usize> = storages.iter().map(|s| s.nbytes).collect();
    // At its file phase each storage sits where its bytes sit in the file, a multiple of the
    // slot alignment from the block's first: aligned for its dtype when the first byte is.
    let element = targets.iter().map(|(_, t)| t.kind().elt_size_in_bytes() as u64).max()?;
    FileSpan::of(offsets, &nbytes, &described).filter(|span| span.start.is_multiple_of(element))
}

/// Which group (a block, or the fixed tensors) owns each storage seen so far.
struct Owners<'a> {
    model: &'a str,
    tensors: &'a [(String, Tensor)],
    owner: HashMap<u64, String>,
}

impl Owners<'_> {
    /// The distinct storages of the tensors at `members`, now `group`'s, and each member's
    /// index among them: refused when another group owns one. A storage freed before set-up
    /// ([`super::place`]) counts what its tensors reach.
    fn claim(&mut self, group: &str, members: &[usize]) -> Result<(Vec<StorageRecord>, Vec<usize>), StreamError> {
        let mut records: Vec<StorageRecord> = Vec::new();
        let mut storage_of = Vec::with_capacity(members.len());
        for &i in members {
            let (tensor, t) = (&self.tensors[i].0, &self.tensors[i].1);
            let info = stageload_torch_sys::storage_info(t).map_err(torch(self.model, "read storage identities"))?;
            if let Some(other) = self.owner.get(&info.id).filter(|owner| *owner != group) {
                return Err(StreamError::SharedStorage {
                    model: self.model.to_string(),
                    block: group.to_string(),
                    other: other.clone(),
                    tensor: tensor.clone(),
                });
            }
            self.owner.insert(info.id, group.to_string());
            let nbytes = if info.allocated { info.nbytes } else { storage::needed_bytes(t) };
            match records.iter().position(|r| r.id == info.id) {
                Some(k) => {
                    records[k].nbytes = records[k].nbytes.max(nbytes);
                    storage_of.push(k);
                }
                None => {
                    storage_of.push(records.len());
                    records.push(StorageRecord { id: info.id, nbytes, tensor: t.shallow_clone() });
                }
            }
        }
        Ok((records, storage_of))
    }
}

/// Every block's tensors, read once from the checkpoint into one pinned host buffer
/// ([`crate::pinned`]: exactly its pages).
pub(super) struct HostBlocks {
    set: crate::pinned::HostSet,
    /// Block `i`'s tensors are `set.tensors[ranges[i]]`.
    ranges: Vec<std::ops::Range<usize>>,
}

impl HostBlocks {
    pub(super) fn block(&self, index: usize) -> &[Tensor] {
        &self.set.tensors[self.ranges[index].clone()]
    }

    /// Bytes pinned for them.
    pub(super) fn bytes(&self) -> u64 {
        self.set.bytes()
    }
}

/// Every block's tensors read once from the checkpoint into pinned host memory (an error, not
/// pageable memory, when it cannot be pinned: refills then read the checkpoint).
pub(super) fn pinned_copies(blocks: &[Block], checkpoint: &Checkpoint) -> Result<HostBlocks, HostCopyError> {
    let shapes: Vec<(Vec<i64>, tch::Kind)> =
        blocks.iter().flat_map(|b| &b.targets).map(|(_, t)| (t.size(), t.kind())).collect();
    let memory: Arc<dyn crate::pinned::HostMemory> = Arc::new(crate::pinned::Mapped);
    let set = crate::pinned::carve(&memory, &shapes, true)?;
    let mut ranges = Vec::with_capacity(blocks.len());
    let mut targets = Vec::with_capacity(set.tensors.len());
    let mut hosts = set.tensors.iter();
    for block in blocks {
        ranges.push(targets.len()..targets.len() + block.targets.len());
        for ((entry, _), host) in block.targets.iter().zip(hosts.by_ref()) {
            targets.push((entry.clone(), host.shallow_clone()));
        }
    }
    checkpoint.load_into(&targets, |_| {}).map_err(|e| HostCopyError::Read(Box::new(e)))?;
    Ok(HostBlocks { set, ranges })
}

#[cfg(test)]
mod tests {
    use super::FileSpan;
    use crate::checkpoint::Entry;

    fn entry(file: usize, start: u64, end: u64) -> Entry {
        Entry { file, kind: tch::Kind::Uint8, shape: vec![(end - start) as i64], start, end }
    }

    #[test]
    fn a_block_whose_entries_lie_in_one_file_as_its_slot_lays_them_out_has_a_span() {
        // Two storages of 128 and 64 bytes at 0 and 128 in the slot, their entries from 1000 on,
        // listed in either order.
        let (a, b) = (entry(0, 1000, 1128), entry(0, 1128, 1192));
        let span = FileSpan { file: 0, start: 1000, end: 1192 };
        assert_eq!(FileSpan::of(&[0, 128], &[128, 64], &[(&a, 0, true), (&b, 1, true)]), Some(span.clone()));
        assert_eq!(FileSpan::of(&[0, 128], &[128, 64], &[(&b, 1, true), (&a, 0, true)]), Some(span));
    }

    #[test]
    fn a_gap_another_file_a_partial_entry_or_a_storage_without_one_has_no_span() {
        let a = entry(0, 1000, 1128);
        // The slot pads a 100-byte storage to 128; the file does not.
        let short = entry(0, 1128, 1228);
        let after_short = entry(0, 1228, 1292);
        assert_eq!(FileSpan::of(&[0, 128], &[100, 64], &[(&short, 0, true), (&after_short, 1, true)]), None);
        let elsewhere = entry(1, 1128, 1192);
        assert_eq!(FileSpan::of(&[0, 128], &[128, 64], &[(&a, 0, true), (&elsewhere, 1, true)]), None);
        let b = entry(0, 1128, 1192);
        assert_eq!(FileSpan::of(&[0, 128], &[128, 64], &[(&a, 0, true), (&b, 1, false)]), None);
        assert_eq!(FileSpan::of(&[0, 128], &[128, 64], &[(&a, 0, true)]), None);
        assert_eq!(FileSpan::of(&[0, 128], &[128, 64], &[(&a, 0, true), (&b, 0, true)]), None);
        assert_eq!(FileSpan::of(&[], &[], &[]), None);
    }
}
