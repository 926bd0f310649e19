//! Storages being filled. Models that share a component share its storages, so two refills (a
//! prefetch's and a foreground load's, or two threads' loads) can find the same storage freed.
//! One owner, [`Fills`], with the storages some refill is filling now and those loads in flight
//! rely on:
//!
//! 1. A refill reallocates the freed storages of its model and claims them under the one lock
//!    here, so each storage is reallocated and filled by exactly one refill.
//! 2. A storage already reallocated by another refill still filling it is not filled again,
//!    and not used half filled either: once its own storages are filled, the refill waits for
//!    that other fill to end before its model is handed out ([`Fills::wait_for`]). It holds no
//!    claim while it waits, so no two refills wait on each other.
//! 3. A fill that fails frees what it claimed: a refill that waited for it reallocates and
//!    fills those storages itself (its next round of 1 and 2).
//! 4. The storages a load in flight found allocated and did not fill (another model's, which
//!    it shares) are borrowed until the load is installed ([`Borrow`]): a release frees its
//!    storages under the same lock ([`Fills::release`]) and keeps the borrowed ones, so a model
//!    being loaded never loses a storage it shares to the release of the model that held it.
//!    (Once installed, the model holds them like any resident model.)
//!
//! A foreground load that waits here counts as not loading meanwhile
//! ([`super::turn::ForegroundLoad::waiting`]): a background copy pauses while foreground loads
//! run, and this wait may be for that very copy.

use std::collections::{HashMap, HashSet};
use std::sync::{Condvar, Mutex};

use stageload_torch_sys::ShimError;

use super::mapped::MapPlan;
use crate::storage::{self, ReleaseStats, StorageRecord};
use crate::sync::{lock, wait};

/// The storages being filled now (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct Fills {
    state: Mutex<FillState>,
    /// Notified whenever a fill ends.
    ended: Condvar,
}

#[derive(Debug, Default)]
struct FillState {
    /// Storages a refill reallocated and fills now.
    filling: HashSet<u64>,
    /// Storages loads in flight rely on without filling them, with how many loads do.
    borrowed: HashMap<u64, usize>,
}

/// The storages a load in flight relies on without filling them (rule 4 of the module docs);
/// a release keeps them until this drops, after the load's install.
#[derive(Debug)]
pub(crate) struct Borrow<'a> {
    fills: &'a Fills,
    ids: Vec<u64>,
}

impl Drop for Borrow<'_> {
    fn drop(&mut self) {
        let mut state = lock(&self.fills.state);
        for id in &self.ids {
            if let Some(count) = state.borrowed.get_mut(id) {
                *count = count.saturating_sub(1);
                if *count == 0 {
                    state.borrowed.remove(id);
                }
            }
        }
    }
}

/// The storages one refill reallocated and fills, or gave its file's pages; they stop counting
/// as being filled when this drops.
#[derive(Debug)]
pub(crate) struct Claim<'a> {
    fills: &'a Fills,
    /// The storages' ids.
    pub(crate) ids: HashSet<u64>,
    /// Those of `ids` given their file's pages ([`MapPlan`]): filled already.
    pub(crate) mapped: HashSet<u64>,
}

impl Claim<'_> {
    /// The claimed storages the refill has yet to fill.
    pub(crate) fn to_fill(&self) -> HashSet<u64> {
        self.ids.difference(&self.mapped).copied().collect()
    }
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        if self.ids.is_empty() {
            return;
        }
        let mut state = lock(&self.fills.state);
        state.filling.retain(|id| !self.ids.contains(id));
        drop(state);
        self.fills.ended.notify_all();
    }
}

impl Fills {
    /// Reallocates the freed storages among `storages` (or gives those `plan` maps their file's
    /// pages) and claims them for the caller to fill; with them, the ids of the storages among
    /// `storages` another refill is filling now, and the borrow of the others, allocated already
    /// (rule 4 of the module docs).
    ///
    /// # Safety
    ///
    /// As [`storage::reallocate`]: the caller fills the claimed storages before anything reads
    /// them, and keeps every other user of its model away meanwhile.
    pub(crate) unsafe fn claim(
        &self,
        storages: &[StorageRecord],
        plan: Option<&MapPlan>,
    ) -> Result<(Claim<'_>, Vec<u64>, Borrow<'_>), ShimError> {
        let mut state = lock(&self.state);
        let others: Vec<u64> = storages.iter().map(|s| s.id).filter(|id| state.filling.contains(id)).collect();
        // A storage another refill claimed stays its own, even freed again by its failure:
        // its claim ends after that, and this refill reallocates it in a later round.
        let free: Vec<&StorageRecord> = storages.iter().filter(|s| !state.filling.contains(&s.id)).collect();
        // SAFETY: this function's own precondition; under the lock, so no other refill
        // maps or reallocates the same storage.
        let mapped = match plan {
            Some(plan) => unsafe { plan.attach_free(free.iter().copied()) }?,
            None => HashSet::new(),
        };
        // SAFETY: as above.
        let mut ids = match unsafe { storage::reallocate(free.into_iter().filter(|s| !mapped.contains(&s.id))) } {
            Ok(ids) => ids,
            Err(err) => {
                // SAFETY: as above; nothing has read the mapped storages yet.
                let _ = unsafe { storage::free_ids(storages, &mapped, "stageload: a refill ran out of memory") };
                return Err(err);
            }
        };
        ids.extend(mapped.iter().copied());
        state.filling.extend(ids.iter().copied());
        // Everything else is allocated now (a storage of no bytes never is): borrowed.
        let borrowed: Vec<u64> =
            storages.iter().map(|s| s.id).filter(|id| !ids.contains(id) && !others.contains(id)).collect();
        for id in &borrowed {
            *state.borrowed.entry(*id).or_default() += 1;
        }
        Ok((Claim { fills: self, ids, mapped }, others, Borrow { fills: self, ids: borrowed }))
    }

    /// Frees `storages` but those in `keep` and those loads in flight borrow (counted as kept),
    /// under the lock claims and borrows are made under.
    ///
    /// # Safety
    ///
    /// As [`storage::release`].
    pub(crate) unsafe fn release(
        &self,
        storages: &[StorageRecord],
        keep: &HashSet<u64>,
        message: &str,
    ) -> Result<ReleaseStats, ShimError> {
        let state = lock(&self.state);
        let borrowed = storages.iter().map(|s| s.id).filter(|id| state.borrowed.contains_key(id));
        let keep: HashSet<u64> = keep.iter().copied().chain(borrowed).collect();
        // SAFETY: this function's own precondition.
        unsafe { storage::release(storages, &keep, message) }
    }

    /// Waits until no refill is filling any of `ids`.
    pub(crate) fn wait_for(&self, ids: &[u64]) {
        let mut state = lock(&self.state);
        while ids.iter().any(|id| state.filling.contains(id)) {
            state = wait(&self.ended, state);
        }
    }

    /// Whether some refill is filling any of `ids` now.
    #[cfg(test)]
    fn any_filling(&self, ids: &[u64]) -> bool {
        let state = lock(&self.state);
        ids.iter().any(|id| state.filling.contains(id))
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
        let (first, others, _) = unsafe { fills.claim(&storages, None) }.unwrap();
        assert_eq!((first.ids.iter().copied().collect::<Vec<_>>(), others), (vec![id], vec![]));
        // SAFETY: as above.
        let (second, others, _) = unsafe { fills.claim(&storages, None) }.unwrap();
        assert!(second.ids.is_empty(), "allocated already: not reallocated again");
        assert_eq!(others, [id], "the first refill still fills it");
        drop(first);
        assert!(!fills.any_filling(&[id]));
        // SAFETY: as above.
        let (third, others, _) = unsafe { fills.claim(&storages, None) }.unwrap();
        assert!(third.ids.is_empty() && others.is_empty(), "filled: nothing to wait for");
    }

    #[test]
    fn a_storage_a_load_in_flight_relies_on_is_kept_by_a_release_until_that_load_lets_go() {
        let fills = Fills::default();
        // Another model's storage, allocated: the load finds it and does not fill it.
        let storages =
            storage::distinct_storages(&[("w".to_string(), Tensor::ones([8], (Kind::Float, Device::Cpu)))]).unwrap();
        let allocated = || stageload_torch_sys::storage_info(&storages[0].tensor).unwrap().allocated;
        // SAFETY: the test fills nothing and reads nothing.
        let (claim, others, borrow) = unsafe { fills.claim(&storages, None) }.unwrap();
        assert!(claim.ids.is_empty() && others.is_empty());
        // SAFETY: nothing runs on the storage.
        let kept = unsafe { fills.release(&storages, &HashSet::new(), "released by the test") }.unwrap();
        assert_eq!((kept.freed, kept.kept, allocated()), (0, 32, true), "borrowed: kept");
        drop(borrow);
        // SAFETY: as above.
        let freed = unsafe { fills.release(&storages, &HashSet::new(), "released by the test") }.unwrap();
        assert_eq!((freed.freed, allocated()), (32, false), "the borrow ended: freed");
    }

    #[test]
    fn a_refill_waits_for_the_fill_of_a_storage_it_shares_until_that_claim_ends() {
        let fills = Arc::new(Fills::default());
        let storages = freed(8);
        let id = storages[0].id;
        // SAFETY: the test fills nothing and reads nothing.
        let (claim, _, _) = unsafe { fills.claim(&storages, None) }.unwrap();
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
