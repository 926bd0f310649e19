//! The one way stageload takes a lock: a panic on another thread while it held the lock does not
//! make the data unusable here (every structure locked stays consistent between statements), so
//! poisoning is ignored. The torch crate re-exports it (`stageload::sync::lock`).

use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Duration;

/// Locks `mutex`, ignoring poisoning.
pub fn lock<T: ?Sized>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// Waits on `condvar` with `guard`, ignoring poisoning as [`lock`] does.
pub fn wait<'a, T>(condvar: &Condvar, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
    condvar.wait(guard).unwrap_or_else(|e| e.into_inner())
}

/// Waits on `condvar` with `guard` for at most `timeout`, ignoring poisoning as [`lock`] does
/// (whether it timed out is for the caller to tell from its own state and clock).
pub fn wait_timeout<'a, T>(condvar: &Condvar, guard: MutexGuard<'a, T>, timeout: Duration) -> MutexGuard<'a, T> {
    match condvar.wait_timeout(guard, timeout) {
        Ok((guard, _)) => guard,
        Err(poisoned) => poisoned.into_inner().0,
    }
}
