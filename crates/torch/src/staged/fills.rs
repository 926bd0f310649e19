//! Storages being filled. Models that share a component share its storages, so two refills (a
//! prefetch's and a foreground load's, or two threads' loads) can find the same storage freed.
//! One owner, [`Fills`], with the set of storages some refill is filling now:
//!
//! 1. A refill reallocates the freed storages of its model and claims them under the one lock
//!    here, so each storage is reallocated and filled by exactly one refill.
//! 2. A storage already reallocated by another refill still filling it is not filled again,
//!    and not used half filled either: once its own storages are filled, the refill waits for
//!    that other fill to end before its model is handed out ([`Fills::wait_for`]). It holds no
//!    claim while it waits, so no two refills wait on each other.
//! 3. A fill that fails frees what it claimed: a refill that waited for it reallocates and
//!    fills those storages itself (its next round of 1 and 2).
//!
//! A foreground load that waits here counts as not loading meanwhile
//! ([`super::turn::ForegroundLoad::waiting`]): a background copy pauses while foreground loads
//! run, and this wait may be for that very copy.

use std::collections::HashSet;
use std::sync::{Condvar, Mutex};

use stageload_torch_sys::ShimError;

use crate::storage::{self, StorageRecord};
use crate::sync::{lock, wait};

/// The storages being filled now (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct Fills {
    filling: Mutex<HashSet<u64>>,
    /// Notified whenever a fill ends.
    ended: Condvar,
}

/// The storages one refill reallocated and fills; they stop counting as being filled when this
/// drops.
#[derive(Debug)]
pub(crate) struct Claim<'a> {
    fills: &'a Fills,
    /// The storages' ids.
    pub(crate) ids: HashSet<u64>,
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        if self.ids.is_empty() {
            return;
        }
        let mut filling = lock(&self.fills.filling);
        filling.retain(|id| !self.ids.contains(id));
        drop(filling);
        self.fills.ended.notify_all();
    }
}

impl Fills {
    /// Reallocates the freed storages among `storages` and claims them for the caller to fill;
    /// with them, the ids of the storages among `storages` another refill is filling now.
    ///
    /// # Safety
    ///
    /// As [`storage::reallocate`]: the caller fills the claimed storages before anything reads
    /// them, and keeps every other user of its model away meanwhile.
    pub(crate) unsafe fn claim(&self, storages: &[StorageRecord]) -> Result<(Claim<'_>, Vec<u64>), ShimError> {
        let mut filling = lock(&self.filling);
        let others: Vec<u64> = storages.iter().map(|s| s.id).filter(|id| filling.contains(id)).collect();
        // A storage another refill claimed stays its own, even freed again by its failure:
        // its claim ends after that, and this refill reallocates it in a later round.
        let free = storages.iter().filter(|s| !filling.contains(&s.id));
        // SAFETY: this function's own precondition; under the lock, so no other refill
        // reallocates the same storage.
        let ids = unsafe { storage::reallocate(free) }?;
        filling.extend(ids.iter().copied());
        Ok((Claim { fills: self, ids }, others))
    }

    /// Waits until no refill is filling any of `ids`.
    pub(crate) fn wait_for(&self, ids: &[u64]) {
        let mut filling = lock(&self.filling);
        while ids.iter().any(|id| filling.contains(id)) {
            filling = wait(&self.ended, filling);
        }
    }

    /// Whether some refill is filling any of `ids` now.
    #[cfg(test)]
    fn any_filling(&self, ids: &[u64]) -> bool {
        let filling = lock(&self.filling);
        ids.iter().any(|id| filling.contains(id))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use tch::{Device, Kind, Tensor};

    use super::*;

    /// A freed storage of `n` floats, as a release leaves it.
    fn freed(n: i64) -> Vec<StorageRecord> {
        let records =
            storage::distinct_storages(&[("w".to_string(), Tensor::ones([n], (Kind::Float, Device::Cpu)))]).unwrap();
        // SAFETY: nothing else holds this tensor.
        unsafe { storage::free_ids(&records, &records.iter().map(|r| r.id).collect(), "freed by the test") }.unwrap();
        records
    }

    #[test]
    fn a_freed_storage_is_reallocated_and_claimed_by_the_first_refill_only() {
        let fills = Fills::default();
        let storages = freed(8);
        let id = storages[0].id;
        // SAFETY: the test fills nothing and reads nothing.
        let (first, others) = unsafe { fills.claim(&storages) }.unwrap();
        assert_eq!((first.ids.iter().copied().collect::<Vec<_>>(), others), (vec![id], vec![]));
        let (second, others) = unsafe { fills.claim(&storages) }.unwrap();
        assert!(second.ids.is_empty(), "allocated already: not reallocated again");
        assert_eq!(others, [id], "the first refill still fills it");
        drop(first);
        assert!(!fills.any_filling(&[id]));
        let (third, others) = unsafe { fills.claim(&storages) }.unwrap();
        assert!(third.ids.is_empty() && others.is_empty(), "filled: nothing to wait for");
    }

    #[test]
    fn a_refill_waits_for_the_fill_of_a_storage_it_shares_until_that_claim_ends() {
        let fills = Arc::new(Fills::default());
        let storages = freed(8);
        let id = storages[0].id;
        let (claim, _) = unsafe { fills.claim(&storages) }.unwrap();
        let (done_tx, done) = std::sync::mpsc::channel();
        let waiter = {
            let fills = Arc::clone(&fills);
            std::thread::spawn(move || {
                fills.wait_for(&[id]);
                let _ = done_tx.send(());
            })
        };
        assert!(done.recv_timeout(Duration::from_millis(200)).is_err(), "still being filled");
        drop(claim);
        done.recv_timeout(Duration::from_secs(30)).expect("the wait ends with the claim");
        waiter.join().unwrap();
    }
}
