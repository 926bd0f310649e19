//! The one shared-handle type ([`Shared`]) and the one way to take a lock ([`lock`]): a panic on
//! another thread while it held a lock does not make the data unusable here (every structure
//! the registry locks stays consistent between statements), so poisoning is ignored.

use std::sync::{Arc, Mutex, MutexGuard};

pub use stageload_trace::sync::{lock, wait, wait_timeout};

/// A value several owners share and lock to use: a component several models share
/// ([`crate::BuildContext::shared`]), or a generator the registry preserves
/// ([`crate::SharedRng`]).
pub struct Shared<T>(Arc<Mutex<T>>);

impl<T> Shared<T> {
    /// `value`, shared from now on.
    pub fn new(value: T) -> Self {
        Shared(Arc::new(Mutex::new(value)))
    }

    /// Locks the value to use it.
    pub fn lock(&self) -> MutexGuard<'_, T> {
        lock(&self.0)
    }
}

impl<T> Clone for Shared<T> {
    fn clone(&self) -> Self {
        Shared(Arc::clone(&self.0))
    }
}

impl<T: Default> Default for Shared<T> {
    fn default() -> Self {
        Shared::new(T::default())
    }
}

impl<T> std::fmt::Debug for Shared<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Shared<{}>", std::any::type_name::<T>())
    }
}
