//! Events: what a staged pipeline did and when, typed, for any sink (a trace, a log, a test).
//!
//! The registry (`stageload::StagedModels`) makes an [`Event`] for every load, reload, release,
//! stage entry, mark and error and hands it to an [`EventSink`] on the thread that did the work;
//! the [`crate::Meter`] is a sink and writes the same struct as a trace line. Readers (summary,
//! plot) use its typed fields, never the free text of `note`.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Mutex;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use stageload_units::format_bytes;

/// What happened. A trace naming any other kind is refused by the reader, with the kind's name.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    /// A model was built (and filled from its checkpoint) for the first time.
    #[default]
    Load,
    /// A released model came back; `from` says how.
    Reload,
    /// A model's storages were freed in place.
    Release,
    /// A stage was entered.
    Stage,
    /// A user mark (for example the end of a stage's work); `note` is its label.
    Mark,
    /// Something failed; `note` is the message.
    Error,
    /// A background load of `model` for `stage` began (its `load`/`reload` event, marked
    /// `prefetched`, ends it).
    Prefetch,
    /// A streamed model's split between resident and streamed blocks was set or changed;
    /// `residency` has the numbers, `note` the one-line report.
    Residency,
    /// The host tier stored, evicted or did not store a model's weights, or changed its
    /// budget: `action` says which, `note` says it in words (why, when not stored), `tier` the
    /// tier's budget and usage after it.
    Tier,
    /// A model's weights were written to the registry's snapshot folder at its first release,
    /// or could not be (the model is rebuilt): `action` says which, `note` the path or why.
    Snapshot,
}

impl EventKind {
    /// The kind's name as a trace writes it.
    pub fn name(self) -> &'static str {
        match self {
            EventKind::Load => "load",
            EventKind::Reload => "reload",
            EventKind::Release => "release",
            EventKind::Stage => "stage",
            EventKind::Mark => "mark",
            EventKind::Error => "error",
            EventKind::Prefetch => "prefetch",
            EventKind::Residency => "residency",
            EventKind::Tier => "tier",
            EventKind::Snapshot => "snapshot",
        }
    }

    /// A load or a reload: bytes came in.
    pub fn is_load(self) -> bool {
        matches!(self, EventKind::Load | EventKind::Reload)
    }
}

/// Where a reloaded model's weights came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReloadFrom {
    /// The same object, storages reallocated and refilled from the checkpoint.
    InPlace,
    /// Built again by its loader (under preserved RNG).
    Rebuilt,
    /// The same object, storages reallocated and refilled from its copy in the host tier.
    HostTier,
    /// The same object, storages reallocated and refilled from the registry's snapshot of it.
    Snapshot,
}

/// What a `tier` or `snapshot` event did, or that a `mark` is the registry's `close`: typed, so
/// that readers never match `note`'s words. Traces written before it existed say it in `note`
/// only; the trace reader reads it in from there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// The host tier stored the model's weights.
    Stored,
    /// The host tier evicted them to make room.
    Evicted,
    /// The host tier did not store them; `note` says why.
    NotStored,
    /// The host tier's budget was set.
    Budget,
    /// The snapshot was written; `note` names the file.
    Written,
    /// The snapshot could not be written; `note` says why.
    NotWritten,
    /// The registry closed: the releases after this mark are the close's, not the tail of the
    /// last stage's entry.
    Close,
}

impl Action {
    /// The words every note of this action begins with (`stored`, `not stored`, `written`, ...).
    pub fn word(self) -> &'static str {
        match self {
            Action::Stored => "stored",
            Action::Evicted => "evicted",
            Action::NotStored => "not stored",
            Action::Budget => "budget",
            Action::Written => "written",
            Action::NotWritten => "not written",
            Action::Close => "close",
        }
    }

    /// A note of this action: its [`word`](Self::word), then `: detail` when there is one.
    pub fn note(self, detail: Option<&str>) -> String {
        match detail {
            Some(detail) => format!("{}: {detail}", self.word()),
            None => self.word().to_string(),
        }
    }

    /// What a note of this action says after its word (`""` when it is the word alone); `None`
    /// when the note does not begin with the word.
    pub fn detail(self, note: &str) -> Option<&str> {
        match note.strip_prefix(self.word())? {
            "" => Some(""),
            rest => rest.strip_prefix(": "),
        }
    }
}

/// The host tier after an event: its byte budget and the bytes its copies hold.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierUsage {
    /// The tier's budget, bytes.
    pub budget: u64,
    /// Bytes its copies hold.
    pub used: u64,
}

/// How a streamed model holds its blocks (a `residency` event).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Residency {
    /// Blocks in the model.
    pub blocks: usize,
    /// Blocks kept resident (a prefix); the others are streamed.
    pub resident: usize,
    /// Bytes that pass through the slots in one step.
    pub streamed_per_step: u64,
    /// Bytes of the budget's room where streamed blocks are kept hot after they run.
    #[serde(default)]
    pub hot: u64,
    /// The model's byte budget.
    pub budget: u64,
    /// Working memory a step was measured to need (0 until measured).
    #[serde(default)]
    pub working: u64,
    /// Bytes the model holds on its device now, counted from its storages (fixed tensors,
    /// blocks with memory, slot buffers): what the budget bounds.
    #[serde(default)]
    pub held: u64,
    /// Bytes of host memory pinned for the blocks' copies (CUDA).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub pinned: u64,
    /// Why the split changed: `start`, `out of memory`, `working memory`, `reset`; `end` when
    /// the model goes, with its totals (the event's `bytes` and `seconds`: what its refills read
    /// and how long they took).
    pub reason: String,
    /// With `end`: blocks refilled over the model's life.
    #[serde(default)]
    pub refills: u64,
    /// With `end`: streamed blocks found in the hot set when the forward reached them.
    #[serde(default)]
    pub hot_hits: u64,
}

/// How a checkpoint's entries met a model's tensors in one load.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadReport {
    /// Model tensors filled from the files.
    pub used: usize,
    /// Of those, the ones converted from another dtype: `name: from -> to`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub converted: Vec<String>,
    /// File entries no model tensor asked for and no `ignore` pattern covers (an error when the
    /// model loads strictly).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unused: Vec<String>,
    /// File entries skipped by the model's `ignore` patterns.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub ignored: usize,
    /// Model tensors no file entry filled (an error when the model loads strictly; otherwise
    /// they keep what the loader gave them, and a release keeps their storage resident, since
    /// no refill source holds their values).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub missing: Vec<String>,
    /// Model tensors filled through another name, which needs no entry of its own: alias →
    /// the tensor whose entry fills its storage (tied weights, a view of a filled weight).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub aliases: BTreeMap<String, String>,
}

fn is_zero<T: Default + PartialEq>(n: &T) -> bool {
    *n == T::default()
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// One thing a staged pipeline did: in the process, and as a trace line (`"type": "event"`).
/// `t` is the end of the work in seconds since the meter started; loads and releases began
/// `seconds` earlier, at `start`. The meter sets `t` and `start` from `at`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// When the work ended, in the process (not written).
    #[serde(skip)]
    pub at: Option<Instant>,
    /// When the work ended, seconds since the meter started.
    #[serde(default)]
    pub t: f64,
    /// What happened.
    pub kind: EventKind,
    /// The model it happened to, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// The stage current at the time (for `stage`: the stage entered).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stage: Option<String>,
    /// Stage events: which occurrence of the pipeline's stage sequence was entered, as its place
    /// in the sequence (0: the first stage listed). The registry decides it; the guard, the
    /// summary's windows and `stageload plan --from-trace`/`--check` read it, so that a stage
    /// listed twice (`[a, b, a]`, `[a, a]`) is matched to the right occurrence. `None` in traces
    /// written before it was recorded: readers then count the stage's entries.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub position: Option<usize>,
    /// Bytes loaded, reloaded or freed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
    /// How long the work took.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seconds: Option<f64>,
    /// When the work began, seconds since the meter started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start: Option<f64>,
    /// Reloads: in place from the checkpoint, or rebuilt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<ReloadFrom>,
    /// Loads: the current stage does not list the model (nor pins it).
    #[serde(default, skip_serializing_if = "is_false")]
    pub outside_stage: bool,
    /// Loads: done in the background by a prefetch.
    #[serde(default, skip_serializing_if = "is_false")]
    pub prefetched: bool,
    /// Releases: bytes left resident, because another resident model shares them or because
    /// nothing could refill them (tensors the checkpoint lacks: the load report's `missing`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kept_bytes: Option<u64>,
    /// Loads from a checkpoint: how its entries met the model's tensors.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub report: Option<Box<LoadReport>>,
    /// A mark's label or an error's message.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    /// Bytes of model weights resident right after the event (shared storage counted once).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resident: Option<u64>,
    /// Residency events: a streamed model's split.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub residency: Option<Residency>,
    /// Tier events, and reloads from the tier: the host tier's budget and usage after it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tier: Option<TierUsage>,
    /// Tier and snapshot events, and the `close` mark: what happened.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub action: Option<Action>,
}

impl Event {
    /// An event of `kind` ending now, with no other fields.
    pub fn now(kind: EventKind) -> Self {
        Event { at: Some(Instant::now()), kind, ..Event::default() }
    }

    /// Reads the action of a trace written before events carried it from the words its `note`
    /// began with (`stored`, `evicted`, `not stored: …`, `budget`; `written: …`,
    /// `not written: …`; a mark's `close`). The note stays as it was.
    pub(crate) fn upgrade_action_note(&mut self) {
        if self.action.is_some() {
            return;
        }
        let note = self.note.as_deref().unwrap_or_default();
        let actions: &[Action] = match self.kind {
            EventKind::Tier => &[Action::Stored, Action::Evicted, Action::Budget, Action::NotStored],
            EventKind::Snapshot => &[Action::Written, Action::NotWritten],
            EventKind::Mark => &[Action::Close],
            _ => &[],
        };
        self.action = actions.iter().copied().find(|action| action.detail(note).is_some());
    }

    /// Reads the free-text notes of schema-1 traces (`in_place`, `rebuilt`, `outside_stage`,
    /// `kept=N`) into the typed fields.
    pub(crate) fn upgrade_v1_note(&mut self) {
        if !matches!(self.kind, EventKind::Load | EventKind::Reload | EventKind::Release) {
            return;
        }
        let Some(note) = self.note.take() else { return };
        for part in note.split(',') {
            match part.trim() {
                "in_place" => self.from = Some(ReloadFrom::InPlace),
                "rebuilt" => self.from = Some(ReloadFrom::Rebuilt),
                "outside_stage" => self.outside_stage = true,
                other => match other.strip_prefix("kept=").and_then(|n| n.parse().ok()) {
                    Some(kept) => self.kept_bytes = Some(kept),
                    None => self.note = Some(note.clone()),
                },
            }
        }
    }
}

/// One line: `reload encoder 12.0 MiB in 0.031 s (in place; stage decode, outside the stage)`.
impl fmt::Display for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.kind.name())?;
        if self.kind == EventKind::Stage {
            return write!(f, " {}", self.stage.as_deref().unwrap_or("?"));
        }
        if let Some(model) = &self.model {
            write!(f, " {model}")?;
        }
        if let Some(bytes) = self.bytes {
            write!(f, " {}", format_bytes(bytes))?;
        }
        if let Some(seconds) = self.seconds {
            write!(f, " in {seconds:.3} s")?;
        }
        let mut details = Vec::new();
        match self.from {
            Some(ReloadFrom::InPlace) => details.push("in place".to_string()),
            Some(ReloadFrom::Rebuilt) => details.push("rebuilt".to_string()),
            Some(ReloadFrom::HostTier) => details.push("from the host tier".to_string()),
            Some(ReloadFrom::Snapshot) => details.push("from its snapshot".to_string()),
            None => {}
        }
        if let Some(tier) = self.tier {
            details.push(format!("host tier {} of {}", format_bytes(tier.used), format_bytes(tier.budget)));
        }
        if let Some(kept) = self.kept_bytes.filter(|k| *k > 0) {
            details.push(format!("kept {} resident", format_bytes(kept)));
        }
        if let Some(report) = &self.report {
            details.push(format!("{} tensors from the checkpoint", report.used));
            if !report.converted.is_empty() {
                details.push(format!("{} converted", report.converted.len()));
            }
            if report.ignored > 0 {
                details.push(format!("{} entries ignored", report.ignored));
            }
            if !report.unused.is_empty() {
                details.push(format!("unused entries: {}", report.unused.join(", ")));
            }
            if !report.missing.is_empty() {
                details.push(format!("not in the checkpoint: {}", report.missing.join(", ")));
            }
            if !report.aliases.is_empty() {
                let tied: Vec<String> = report.aliases.iter().map(|(alias, via)| format!("{alias} = {via}")).collect();
                details.push(format!("tied: {}", tied.join(", ")));
            }
        }
        if let Some(stage) = &self.stage {
            details.push(format!("stage {stage}"));
        }
        if self.outside_stage {
            details.push("outside the stage".to_string());
        }
        if self.prefetched {
            details.push("prefetched".to_string());
        }
        if let Some(note) = &self.note {
            details.push(note.clone());
        }
        if !details.is_empty() {
            write!(f, " ({})", details.join("; "))?;
        }
        Ok(())
    }
}

/// Receives events. Implemented by the meter (traces), [`ListSink`], and any closure. Called on
/// the thread that did the work; it must not call back into the registry.
pub trait EventSink: Send + Sync {
    /// Takes one event.
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
    /// An empty list.
    pub fn new() -> Self {
        Self::default()
    }

    /// A copy of the events received so far.
    pub fn events(&self) -> Vec<Event> {
        crate::sync::lock(&self.events).clone()
    }

    /// The events of one kind, in order.
    pub fn of_kind(&self, kind: EventKind) -> Vec<Event> {
        self.events().into_iter().filter(|e| e.kind == kind).collect()
    }
}

impl EventSink for ListSink {
    fn emit(&self, event: &Event) {
        crate::sync::lock(&self.events).push(event.clone());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schema_1_notes_become_typed_fields() {
        let mut reload =
            Event { kind: EventKind::Reload, note: Some("in_place,outside_stage".into()), ..Event::default() };
        reload.upgrade_v1_note();
        assert_eq!((reload.from, reload.outside_stage, reload.note), (Some(ReloadFrom::InPlace), true, None));
        let mut release = Event { kind: EventKind::Release, note: Some("kept=4096".into()), ..Event::default() };
        release.upgrade_v1_note();
        assert_eq!((release.kept_bytes, release.note), (Some(4096), None));
        let mut mark = Event { kind: EventKind::Mark, note: Some("in_place".into()), ..Event::default() };
        mark.upgrade_v1_note();
        assert_eq!(mark.note.as_deref(), Some("in_place"), "a mark's label is left alone");
    }

    #[test]
    fn a_note_is_its_actions_words_and_its_detail_reads_back_without_them() {
        assert_eq!(Action::NotStored.note(Some("too big")), "not stored: too big");
        assert_eq!(Action::Stored.note(None), "stored");
        assert_eq!(Action::NotStored.detail("not stored: too big"), Some("too big"));
        assert_eq!(Action::Stored.detail("stored"), Some(""));
        assert_eq!(Action::Stored.detail("not stored: too big"), None);
        assert_eq!(Action::Written.detail("writtenX"), None, "the words end at a colon or the note's end");
    }

    #[test]
    fn a_trace_written_before_actions_were_typed_gets_them_from_its_notes() {
        let upgraded = |kind: EventKind, note: &str| {
            let mut event = Event { kind, note: Some(note.into()), ..Event::default() };
            event.upgrade_action_note();
            assert_eq!(event.note.as_deref(), Some(note), "the note stays");
            event.action
        };
        assert_eq!(upgraded(EventKind::Tier, "stored"), Some(Action::Stored));
        assert_eq!(upgraded(EventKind::Tier, "evicted"), Some(Action::Evicted));
        assert_eq!(upgraded(EventKind::Tier, "budget"), Some(Action::Budget));
        assert_eq!(upgraded(EventKind::Tier, "not stored: too big"), Some(Action::NotStored));
        assert_eq!(upgraded(EventKind::Snapshot, "written: /tmp/s/m.safetensors"), Some(Action::Written));
        assert_eq!(upgraded(EventKind::Snapshot, "not written: disk full"), Some(Action::NotWritten));
        assert_eq!(upgraded(EventKind::Mark, "close"), Some(Action::Close));
        assert_eq!(upgraded(EventKind::Mark, "stored"), None, "a user's mark is a label, whatever it says");
        let mut typed = Event {
            kind: EventKind::Tier,
            note: Some("evicted".into()),
            action: Some(Action::Stored),
            ..Event::default()
        };
        typed.upgrade_action_note();
        assert_eq!(typed.action, Some(Action::Stored), "a typed action is never overwritten");
    }

    #[test]
    fn an_unknown_kind_is_refused_by_name() {
        let err = serde_json::from_str::<Event>(r#"{"t":1.0,"kind":"teleport"}"#).unwrap_err().to_string();
        assert!(err.contains("teleport") && err.contains("reload"), "{err}");
    }

    #[test]
    fn an_event_prints_as_one_line_with_its_details() {
        let event = Event {
            kind: EventKind::Reload,
            model: Some("encoder".into()),
            bytes: Some(12 << 20),
            seconds: Some(0.031),
            from: Some(ReloadFrom::InPlace),
            stage: Some("decode".into()),
            outside_stage: true,
            ..Event::default()
        };
        assert_eq!(event.to_string(), "reload encoder 12.0 MiB in 0.031 s (in place; stage decode; outside the stage)");
        assert_eq!(
            Event { kind: EventKind::Stage, stage: Some("decode".into()), ..Event::default() }.to_string(),
            "stage decode"
        );
    }
}
