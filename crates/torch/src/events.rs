//! Events: what StagedModels did and when, for any sink (a trace, a log, a test).
//!
//! Every load, reload, release, stage entry and mark becomes one [`Event`]. A sink receives it
//! synchronously from the thread that did the work; it must not call back into the registry.

use std::sync::Mutex;
use std::time::{Instant, SystemTime};

/// What happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    /// A model was built (and filled from its checkpoint) for the first time.
    Load,
    /// A released model came back: in place from its checkpoint, or rebuilt by its loader.
    Reload,
    /// A model's storages were freed in place.
    Release,
    /// A stage was entered.
    Stage,
    /// A user mark (for example the end of a stage's work).
    Mark,
    /// Something failed; `note` says what.
    Error,
}

/// One record of what StagedModels did. `at` is the end of the work; for loads and releases
/// the work began `seconds` earlier.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Event {
    /// Monotonic time at which the work ended.
    #[serde(skip)]
    pub at: Instant,
    /// Wall-clock time at which the work ended.
    #[serde(skip)]
    pub wall: SystemTime,
    pub kind: EventKind,
    /// The stage current when it happened (for `Stage`: the stage entered).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stage: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Bytes loaded, reloaded or freed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
    /// Duration of the work.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seconds: Option<f64>,
    /// Extra detail: `outside_stage`, `kept=N bytes`, `in_place`, `rebuilt`, an error message.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    /// Bytes of weights the registry holds right after this event (loads, reloads, releases and
    /// stage entries), shared storage counted once.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resident: Option<u64>,
}

impl Event {
    /// An event of `kind` ending now, with no other fields.
    pub fn now(kind: EventKind) -> Self {
        Event {
            at: Instant::now(),
            wall: SystemTime::now(),
            kind,
            stage: None,
            model: None,
            bytes: None,
            seconds: None,
            note: None,
            resident: None,
        }
    }
}

/// Receives events. Implemented by the meter (traces), [`ListSink`], and any closure.
pub trait EventSink: Send + Sync {
    fn emit(&self, event: &Event);
}

impl<F: Fn(&Event) + Send + Sync> EventSink for F {
    fn emit(&self, event: &Event) {
        self(event)
    }
}

/// Keeps every event in order; for tests and small tools.
#[derive(Debug, Default)]
pub struct ListSink {
    events: Mutex<Vec<Event>>,
}

impl ListSink {
    pub fn new() -> Self {
        Self::default()
    }

    /// A copy of the events received so far.
    pub fn events(&self) -> Vec<Event> {
        self.events.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The events of one kind, in order.
    pub fn of_kind(&self, kind: EventKind) -> Vec<Event> {
        self.events().into_iter().filter(|e| e.kind == kind).collect()
    }
}

impl EventSink for ListSink {
    fn emit(&self, event: &Event) {
        self.events.lock().unwrap_or_else(|e| e.into_inner()).push(event.clone());
    }
}
