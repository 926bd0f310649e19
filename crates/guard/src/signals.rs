//! SIGINT, SIGTERM and SIGHUP sent to the guard: recorded by a handler that only stores numbers
//! (async-signal-safe), and acted on by the guard's loops within one 50 ms slice. A signal that
//! was ignored when the guard started (SIGHUP under `nohup`) stays ignored.

use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
use std::sync::Arc;

use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook::SigId;

#[derive(Default)]
struct Received {
    last: AtomicI32,
    count: AtomicUsize,
}

/// The signals the guard has received. Dropping it removes the handlers it installed.
pub struct Signals {
    received: Arc<Received>,
    handlers: Vec<SigId>,
}

/// Whether `signal` is set to be ignored in this process now.
fn ignored(signal: i32) -> bool {
    let mut current = std::mem::MaybeUninit::<libc::sigaction>::zeroed();
    // SAFETY: a null new action only queries; `current` is a valid sigaction to write into.
    let rc = unsafe { libc::sigaction(signal, std::ptr::null(), current.as_mut_ptr()) };
    // SAFETY: zero-initialised and, on success, filled by the kernel.
    rc == 0 && unsafe { current.assume_init() }.sa_sigaction == libc::SIG_IGN
}

impl Signals {
    /// Installs the handlers for SIGINT, SIGTERM and SIGHUP (those not ignored now).
    pub fn install() -> std::io::Result<Self> {
        let received = Arc::new(Received::default());
        let mut handlers = Vec::new();
        for signal in [SIGINT, SIGTERM, SIGHUP] {
            if ignored(signal) {
                continue;
            }
            let received = received.clone();
            // SAFETY: the action only stores into atomics, which is async-signal-safe; it does
            // not allocate, lock or panic.
            let id = unsafe {
                signal_hook::low_level::register(signal, move || {
                    received.last.store(signal, Ordering::SeqCst);
                    received.count.fetch_add(1, Ordering::SeqCst);
                })
            }?;
            handlers.push(id);
        }
        Ok(Signals { received, handlers })
    }

    /// No handlers: nothing is ever received (library callers that handle signals themselves,
    /// tests).
    pub fn none() -> Self {
        Signals { received: Arc::default(), handlers: Vec::new() }
    }

    /// The last signal received, if any.
    pub fn received(&self) -> Option<i32> {
        match self.received.last.load(Ordering::SeqCst) {
            0 => None,
            signal => Some(signal),
        }
    }

    /// Records `signal` as if its handler had run (tests of what the guard does with one).
    #[cfg(test)]
    pub(crate) fn simulate(&self, signal: i32) {
        self.received.last.store(signal, Ordering::SeqCst);
        self.received.count.fetch_add(1, Ordering::SeqCst);
    }

    /// How many signals have been received in all.
    pub fn count(&self) -> usize {
        self.received.count.load(Ordering::SeqCst)
    }
}

impl Drop for Signals {
    fn drop(&mut self) {
        for id in self.handlers.drain(..) {
            signal_hook::low_level::unregister(id);
        }
    }
}

/// The conventional name of a signal (`SIGTERM`), for log lines.
pub fn name(signal: i32) -> String {
    nix::sys::signal::Signal::try_from(signal).map_or_else(|_| format!("signal {signal}"), |s| s.as_str().to_string())
}
