//! Slow copies, for tests: a mode in which every copy piece waits a set time before it moves
//! (a checkpoint piece read into a model, a host-tier copy, an asynchronous copy issued on a
//! side stream), and every copy's storages are watched while it runs. Freeing or reallocating
//! a storage that a copy may still read or write is then a violation: counted, logged, and
//! listed by [`violations`]. A slow copy must change no output and cause no violation; the
//! tests of `tests/slow_copies.rs` run the streamed, prefetched and host-tier paths so.
//!
//! Off unless [`slow_copies`] turned it on: then each copy costs one relaxed atomic load. The
//! mode is process-wide (background refills run on threads of their own), so a test that turns
//! it on runs in a process of its own.
//!
//! On CUDA the wait is on the host, before each asynchronous copy is issued; the watch lasts
//! until the copy's event has passed.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use tch::Tensor;

use crate::sync::lock;

/// The wait before each copy piece, in microseconds; 0: the mode is off.
static DELAY_MICROS: AtomicU64 = AtomicU64::new(0);
/// Storages copies are reading or writing now, with how many copies each.
static IN_FLIGHT: Mutex<Option<HashMap<u64, usize>>> = Mutex::new(None);
/// How many storages `IN_FLIGHT` holds: a free looks at the map only when some are.
static WATCHED: AtomicUsize = AtomicUsize::new(0);
static VIOLATIONS: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Turns the slow-copy mode on for the rest of the process: every copy piece waits `delay`
/// first, and frees of storages a copy is using are violations. `Duration::ZERO` turns it off.
pub fn slow_copies(delay: Duration) {
    DELAY_MICROS.store(u64::try_from(delay.as_micros()).unwrap_or(u64::MAX), Ordering::Relaxed);
}

/// Whether the mode is on.
pub(crate) fn on() -> bool {
    DELAY_MICROS.load(Ordering::Relaxed) > 0
}

/// Every violation so far: a storage freed or given new memory while a copy used it, each
/// naming what freed it.
pub fn violations() -> Vec<String> {
    lock(&VIOLATIONS).clone()
}

/// Waits the mode's delay (nothing when off): called before each copy piece.
pub(crate) fn piece() {
    let micros = DELAY_MICROS.load(Ordering::Relaxed);
    if micros > 0 {
        std::thread::sleep(Duration::from_micros(micros));
    }
}

/// The storages one copy uses, watched until this is dropped.
#[must_use = "the storages are watched only while this lives"]
pub(crate) struct InFlight {
    ids: Vec<u64>,
}

/// Watches the storages of `tensors` (a copy's sources and targets) while the returned value
/// lives, when the mode is on.
pub(crate) fn copying<'a>(tensors: impl IntoIterator<Item = &'a Tensor>) -> InFlight {
    if !on() {
        return InFlight { ids: Vec::new() };
    }
    watch(tensors)
}

/// Watches the storages of `tensors`, whatever the mode.
pub(crate) fn watch<'a>(tensors: impl IntoIterator<Item = &'a Tensor>) -> InFlight {
    let mut ids: Vec<u64> =
        tensors.into_iter().filter_map(|t| stageload_torch_sys::storage_info(t).ok()).map(|info| info.id).collect();
    ids.sort_unstable();
    ids.dedup();
    let mut map = lock(&IN_FLIGHT);
    let map = map.get_or_insert_with(HashMap::new);
    for &id in &ids {
        let count = map.entry(id).or_insert(0);
        if *count == 0 {
            WATCHED.fetch_add(1, Ordering::Relaxed);
        }
        *count += 1;
    }
    InFlight { ids }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if self.ids.is_empty() {
            return;
        }
        let mut map = lock(&IN_FLIGHT);
        let Some(map) = map.as_mut() else { return };
        for id in &self.ids {
            if let Some(count) = map.get_mut(id) {
                *count -= 1;
                if *count == 0 {
                    map.remove(id);
                    WATCHED.fetch_sub(1, Ordering::Relaxed);
                }
            }
        }
    }
}

/// Records a violation if a copy is using storage `id`, which `what` is about to free or give
/// new memory.
pub(crate) fn check_free(id: u64, what: &str) {
    if WATCHED.load(Ordering::Relaxed) == 0 {
        return;
    }
    let busy = lock(&IN_FLIGHT).as_ref().is_some_and(|map| map.contains_key(&id));
    if busy {
        let violation = format!("storage {id:#x}: {what} while a copy uses it");
        tracing::error!("{violation}");
        lock(&VIOLATIONS).push(violation);
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use tch::{Device, Kind, Tensor};

    use super::{violations, watch};
    use crate::storage;

    #[test]
    fn freeing_a_storage_a_copy_uses_is_a_violation_and_one_no_copy_uses_is_not() {
        let tensor = Tensor::zeros([256], (Kind::Float, Device::Cpu));
        let records = storage::distinct_storages(&[("t".to_string(), tensor.shallow_clone())]).unwrap();
        let before = violations().len();
        {
            let _watched = watch([&tensor]);
            // SAFETY: nothing runs on the tensor; the "copy" is only watched.
            unsafe { storage::release(&records, &HashSet::new(), "freed by the test") }.unwrap();
        }
        let found = violations();
        assert_eq!(found.len(), before + 1, "{found:?}");
        assert!(found[before].ends_with("freed while a copy uses it"), "{}", found[before]);
        // SAFETY: as above; the watch has ended.
        unsafe { storage::reallocate(&records) }.unwrap();
        assert_eq!(violations().len(), before + 1, "no copy uses it any more");
    }
}
