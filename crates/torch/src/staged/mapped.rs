//! Reloads that map ([`Reload::Map`](super::Reload::Map)): which freed storages of a model take
//! the checkpoint file's pages in place, and the check that the files under a resident model's
//! pages are still the ones it was loaded from.
//!
//! 1. A storage is mapped when it is on the CPU and exactly one entry of the file: a tensor on
//!    it from its first byte, contiguous, of the entry's dtype and shape, filling the storage to
//!    its last byte, at an offset of the file aligned for the dtype. Every other storage is
//!    allocated and copied as in any reload.
//! 2. A plan is made once per refill, before its claims (a model built without initial values
//!    that maps has its first load's fill made a refill: its build frees what it allocated);
//!    the claim attaches the planned storages under the fills' lock, as it reallocates the
//!    others ([`super::fills`]), so a storage is mapped by exactly one refill. A prefetch maps
//!    its pages in afterwards, outside that lock ([`MapPlan::populate`]); a foreground reload
//!    leaves them to come in as the forward touches them, as `from_pretrained`'s do (the rows
//!    of an embedding table a prompt never reads stay out of memory).
//! 3. A mapped storage holds its file's mapping alive; the file is unmapped when the last storage
//!    on it is freed (a release) or dropped.
//! 4. While a model that maps is resident, every hand-out first compares its files with their
//!    first stamps ([`HeldFiles::changed`]): a file written in place is a change of the weights
//!    themselves (the pages not yet written by this process show the file as it is now). A file
//!    put at the path by a rename, or deleted, leaves the mapped file as it was.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;

use stageload_torch_sys::{FileMapping, ShimError};
use tch::Device;

use super::instance::Weights;
use crate::checkpoint::{Checkpoint, CheckpointError};
use crate::names::NameRules;
use crate::source::{FileChange, FileStamp, FirstReads, SourceChanged};
use crate::storage::StorageRecord;

/// A planned storage's place: `nbytes` at `offset` of `mapping`.
struct Range {
    mapping: Arc<FileMapping>,
    offset: usize,
    nbytes: usize,
}

/// The storages of one refill that map (rule 1), by storage id.
#[derive(Default)]
pub(crate) struct MapPlan {
    ranges: HashMap<u64, Range>,
}

impl MapPlan {
    /// Plans which of `weights`' freed storages map their entry of `checkpoint`, met by name
    /// under `rules` (rule 1); maps each file that has one.
    pub(crate) fn of(checkpoint: &Checkpoint, weights: &Weights, rules: &NameRules) -> Result<Self, CheckpointError> {
        let found = checkpoint.match_entries(&weights.tensors, &rules.clone().strict(false))?;
        let mut mappings: HashMap<usize, Arc<FileMapping>> = HashMap::new();
        let mut ranges = HashMap::new();
        for record in &weights.storages {
            let Some((entry, nbytes)) = weights.tensors.iter().find_map(|(name, tensor)| {
                let entry = checkpoint.entries().get(found.pairs.get(name)?)?;
                let nbytes = usize::try_from(entry.end - entry.start).ok()?;
                let whole = tensor.device() == Device::Cpu
                    && tensor.kind() == entry.kind
                    && tensor.size() == entry.shape
                    && tensor.is_contiguous()
                    && tensor.storage_offset() == 0
                    && nbytes == record.nbytes
                    && nbytes > 0
                    && stageload_torch_sys::storage_info(tensor).is_ok_and(|i| i.id == record.id && !i.allocated)
                    && entry.start.is_multiple_of(tensor.kind().elt_size_in_bytes() as u64);
                whole.then_some((entry, nbytes))
            }) else {
                continue;
            };
            let mapping = match mappings.get(&entry.file) {
                Some(mapping) => Arc::clone(mapping),
                None => {
                    let path = &checkpoint.files()[entry.file];
                    let mapping = FileMapping::map(checkpoint.handle(entry.file))
                        .map_err(|source| CheckpointError::Open { path: path.clone(), source })?;
                    mappings.insert(entry.file, Arc::clone(&mapping));
                    mapping
                }
            };
            let offset = usize::try_from(entry.start).unwrap_or(usize::MAX);
            ranges.insert(record.id, Range { mapping, offset, nbytes });
        }
        // Mapped after the open's stamps were met: written meanwhile, the pages may be new.
        checkpoint.unchanged()?;
        Ok(MapPlan { ranges })
    }

    /// Gives each freed storage of `storages` that the plan maps its range of the file; the ids
    /// given pages. On failure those given pages are freed again
    /// ([`crate::storage::give_memory`]).
    ///
    /// # Safety
    ///
    /// As [`stageload_torch_sys::attach_mapped`]: nothing else uses the storages meanwhile.
    pub(crate) unsafe fn attach_free<'a>(
        &self,
        storages: impl IntoIterator<Item = &'a StorageRecord> + Clone,
    ) -> Result<HashSet<u64>, ShimError> {
        let give = |record: &StorageRecord| {
            let Some(range) = self.ranges.get(&record.id) else { return Ok(false) };
            crate::copy_watch::check_free(record.id, "given a file's pages");
            // SAFETY: this function's own precondition.
            unsafe { stageload_torch_sys::attach_mapped(&record.tensor, &range.mapping, range.offset, range.nbytes) }
                .map(|()| true)
        };
        // SAFETY: as above.
        unsafe { crate::storage::give_memory(storages, give, "stageload: a refill failed") }
    }

    /// Maps in the pages of the storages `ids` now (read from the disk where not cached), so
    /// that the first forward does not fault them in one by one. A failure leaves them to come
    /// in as touched: a note in the log, not an error.
    pub(crate) fn populate(&self, model: &str, ids: impl IntoIterator<Item = u64>) {
        for id in ids {
            let Some(range) = self.ranges.get(&id) else { continue };
            if let Err(err) = range.mapping.populate(range.offset, range.nbytes) {
                tracing::debug!(model, %err, "mapping in a storage's pages failed; they come in as touched");
            }
        }
    }
}

/// The files whose pages a model that maps may hold, with the stamps its first load found
/// (rule 4).
#[derive(Debug)]
pub(crate) struct HeldFiles {
    pub(crate) files: Vec<PathBuf>,
    pub(crate) first_reads: Arc<FirstReads>,
}

impl HeldFiles {
    /// The first of the files written in place since its first stamp (rule 4): its size, its
    /// modification time or its status changed, the same file still at the path.
    pub(crate) fn changed(&self, model: &str) -> Option<SourceChanged> {
        self.files.iter().find_map(|path| {
            let first = self.first_reads.first(path)?;
            let change = FileStamp::at(path).ok()?.change_since(&first)?;
            (change != FileChange::Replaced).then(|| SourceChanged {
                model: model.to_string(),
                path: path.clone(),
                change,
            })
        })
    }
}
