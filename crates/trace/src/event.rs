//! Events: what a staged pipeline did and when, typed, for any sink (a trace, a log, a test).
//!
//! The registry (`stageload::StagedModels`) makes an [`Event`] for every load, reload, release,
//! stage entry, mark and error and hands it to an [`EventSink`] on the thread that did the work;
//! the [`crate::Meter`] is a sink and writes the same value as a trace line.
//!
//! An event is its time and one [`What`]: a variant per kind, each carrying exactly the fields
//! that kind has (a release has no load report, a stage entry no model, a tier event a
//! [`TierAction`] and never a snapshot's). Readers match on the variant, or use the accessors
//! ([`Event::model`], [`Event::bytes`], ...) for what several kinds share.
//!
//! In a trace an event is one JSON object: `kind` names the variant and its fields sit beside
//! it. Traces of every earlier schema are read: each line is read as the superset of all fields
//! every schema wrote, its free-text notes of schema 1 and 2 are read
//! into the typed fields, and the line becomes its variant; a line that lacks what its kind
//! needs (a load without a model) is refused with the kind and the field.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Mutex;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use stageload_units::format_bytes;

pub use line::MissingField;

mod line;

/// What happened: an event's kind, without its fields. A trace naming any other kind is refused
/// by the reader, with the kind's name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    /// A model was built (and filled from its checkpoint) for the first time.
    Load,
    /// A released model came back; its `from` says how.
    Reload,
    /// A model's storages were freed in place.
    Release,
    /// A stage was entered.
    Stage,
    /// A user mark (for example the end of a stage's work), or the registry's `close`.
    Mark,
    /// Something failed.
    Error,
    /// A background load of a model for a stage began (its `load`/`reload` event, marked
    /// `prefetched`, ends it).
    Prefetch,
    /// A streamed model's split between resident and streamed blocks was set or changed.
    Residency,
    /// The host tier stored, evicted or did not store a model's weights, or changed its budget.
    Tier,
    /// A model's weights were written to the registry's snapshot folder at its first release,
    /// or could not be (the model is rebuilt).
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
    /// The same object, its CPU storages that are one checkpoint entry each given the file's
    /// pages in place (a private mapping), the others reallocated and refilled from it.
    Mapped,
}

impl ReloadFrom {
    /// How an event's line says it: `in place`, `from the host tier`, ...
    pub fn words(self) -> &'static str {
        match self {
            ReloadFrom::InPlace => "in place",
            ReloadFrom::Rebuilt => "rebuilt",
            ReloadFrom::HostTier => "from the host tier",
            ReloadFrom::Snapshot => "from its snapshot",
            ReloadFrom::Mapped => "mapped from its checkpoint",
        }
    }
}

/// What a `tier` event did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TierAction {
    /// The host tier stored the model's weights.
    Stored,
    /// The host tier evicted them to make room.
    Evicted,
    /// The host tier did not store them; the event's `detail` says why.
    NotStored,
    /// The host tier's budget was set.
    Budget,
}

/// What a `snapshot` event did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SnapshotAction {
    /// The snapshot was written; the event's `detail` names the file.
    Written,
    /// The snapshot could not be written; the event's `detail` says why.
    NotWritten,
}

/// What a `mark` is besides its label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MarkAction {
    /// The registry closed: the releases after this mark are the close's, not the tail of the
    /// last stage's entry.
    Close,
}

impl TierAction {
    /// The words a line says it in.
    pub fn word(self) -> &'static str {
        match self {
            TierAction::Stored => "stored",
            TierAction::Evicted => "evicted",
            TierAction::NotStored => "not stored",
            TierAction::Budget => "budget",
        }
    }
}

impl SnapshotAction {
    /// The words a line says it in.
    pub fn word(self) -> &'static str {
        match self {
            SnapshotAction::Written => "written",
            SnapshotAction::NotWritten => "not written",
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

/// A `load`: a model built and filled for the first time. Also the body of a `reload`.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Loaded {
    /// The stage current at the time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stage: Option<String>,
    /// The model.
    pub model: String,
    /// Bytes that came in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
    /// How long it took.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seconds: Option<f64>,
    /// The current stage does not list the model (nor pins it).
    #[serde(default, skip_serializing_if = "is_false")]
    pub outside_stage: bool,
    /// Done in the background by a prefetch.
    #[serde(default, skip_serializing_if = "is_false")]
    pub prefetched: bool,
    /// The resident part of a streamed model (its streamed blocks come in as it runs).
    #[serde(default, skip_serializing_if = "is_false")]
    pub streamed: bool,
    /// From a checkpoint: how its entries met the model's tensors.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub report: Option<Box<LoadReport>>,
    /// Bytes of model weights resident right after it (shared storage counted once).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resident: Option<u64>,
    /// Files it read that had changed since the model's first load, taken as they are now
    /// because the user accepted the change (`path: what changed`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub accepted: Vec<String>,
}

/// A `reload`: a released model came back.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Reloaded {
    /// How.
    pub from: ReloadFrom,
    /// From the host tier: the tier's budget and usage after it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tier: Option<TierUsage>,
    /// What came in, as for a first load.
    #[serde(flatten)]
    pub load: Loaded,
}

/// A `release`: a model's storages freed in place.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Released {
    /// The stage current at the time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stage: Option<String>,
    /// The model.
    pub model: String,
    /// Bytes freed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
    /// How long it took: the frees, and this release's share (by bytes freed) of giving its
    /// batch's memory back to the OS.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seconds: Option<f64>,
    /// Bytes left resident, because another resident model shares them or because nothing
    /// could refill them (tensors the checkpoint lacks: the load report's `missing`).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub kept_bytes: u64,
    /// Bytes of model weights resident right after it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resident: Option<u64>,
}

/// A `stage`: a stage was entered.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Entered {
    /// The stage entered.
    pub stage: String,
    /// Which occurrence of the pipeline's stage sequence was entered, as its place in the
    /// sequence (0: the first stage listed). The registry decides it; the guard, the summary's
    /// windows and `stageload plan --from-trace`/`--check` read it, so that a stage listed twice
    /// (`[a, b, a]`, `[a, a]`) is matched to the right occurrence. `None` in traces written
    /// before it was recorded: readers then count the stage's entries.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub position: Option<usize>,
    /// Bytes of model weights resident as it was entered (before its releases).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resident: Option<u64>,
}

impl Entered {
    /// The entry of `stage`, with no position or resident bytes recorded.
    pub fn new(stage: impl Into<String>) -> Self {
        Entered { stage: stage.into(), ..Entered::default() }
    }
}

/// A `mark`: a user's label, or the registry's close.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Marked {
    /// The stage current at the time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stage: Option<String>,
    /// The label.
    pub note: String,
    /// `close` for the registry's close.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub action: Option<MarkAction>,
    /// Bytes of model weights resident at the mark.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resident: Option<u64>,
}

/// An `error`: something failed.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Failed {
    /// The stage current at the time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stage: Option<String>,
    /// The model it happened to, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// How long the work ran before it failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seconds: Option<f64>,
    /// The error's message.
    pub note: String,
}

/// A `prefetch`: a background load began.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Prefetching {
    /// The stage the model is loaded for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stage: Option<String>,
    /// The model.
    pub model: String,
    /// Its bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
}

/// A `residency`: a streamed model's split was set or changed, or the model went (`end`).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ResidencyChanged {
    /// The stage current at the time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stage: Option<String>,
    /// The model.
    pub model: String,
    /// The split.
    pub residency: Residency,
    /// The one-line report.
    pub note: String,
    /// With `end`: bytes its refills read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
    /// With `end`: how long they took.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seconds: Option<f64>,
}

/// A `tier`: the host tier stored, evicted or did not store a model's weights, or its budget
/// was set (no model).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TierChanged {
    /// The stage current at the time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stage: Option<String>,
    /// The model, except for `budget`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// What happened.
    pub action: TierAction,
    /// Why, for `not stored`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// Bytes stored or evicted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
    /// How long the copy took.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seconds: Option<f64>,
    /// The tier's budget and usage after it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tier: Option<TierUsage>,
}

/// A `snapshot`: a model's weights were written to the snapshot folder, or could not be.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SnapshotTaken {
    /// The stage current at the time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stage: Option<String>,
    /// The model.
    pub model: String,
    /// What happened.
    pub action: SnapshotAction,
    /// The file written, or why none was.
    pub detail: String,
    /// Bytes written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
    /// How long it took.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seconds: Option<f64>,
}

/// One thing a staged pipeline did: in the process, and as a trace line (`"type": "event"`).
/// `t` is the end of the work in seconds since the meter started; work that took `seconds`
/// began at `start`. The meter sets `t` and `start` from `at`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "line::EventLine")]
pub struct Event {
    /// When the work ended, in the process (not written).
    #[serde(skip)]
    pub at: Option<Instant>,
    /// When the work ended, seconds since the meter started.
    pub t: f64,
    /// When the work began, seconds since the meter started (work with `seconds`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub start: Option<f64>,
    /// What happened.
    #[serde(flatten)]
    pub what: What,
}

impl From<What> for Event {
    fn from(what: What) -> Self {
        Event { at: None, t: 0.0, start: None, what }
    }
}

/// `What`, a variant per [`EventKind`] of the same name with its body, its `kind`, and the
/// conversions from each body: written once, from one list.
macro_rules! kinds {
    ($($variant:ident($body:ident)),* $(,)?) => {
        /// What happened, with the fields of its kind. Written as `kind` with the fields beside
        /// it; read back only as part of an [`Event`], which reads lines of every schema.
        #[derive(Debug, Clone, PartialEq, Serialize)]
        #[serde(tag = "kind", rename_all = "snake_case")]
        pub enum What {
            $(
                #[doc = concat!("See [`", stringify!($body), "`].")]
                $variant($body),
            )*
        }

        impl What {
            /// Its kind.
            pub fn kind(&self) -> EventKind {
                match self {
                    $(What::$variant(_) => EventKind::$variant,)*
                }
            }
        }

        $(
            impl From<$body> for What {
                fn from(body: $body) -> What {
                    What::$variant(body)
                }
            }

            impl From<$body> for Event {
                fn from(body: $body) -> Event {
                    Event::from(What::$variant(body))
                }
            }
        )*
    };
}

kinds!(
    Load(Loaded),
    Reload(Reloaded),
    Release(Released),
    Stage(Entered),
    Mark(Marked),
    Error(Failed),
    Prefetch(Prefetching),
    Residency(ResidencyChanged),
    Tier(TierChanged),
    Snapshot(SnapshotTaken),
);

/// The fields several kinds carry ([`Event::stage`], [`Event::model`], ...).
#[derive(Default)]
struct Shared<'a> {
    stage: Option<&'a str>,
    model: Option<&'a str>,
    bytes: Option<u64>,
    seconds: Option<f64>,
    resident: Option<u64>,
}

impl Event {
    /// `what`, ending now.
    pub fn now(what: impl Into<What>) -> Self {
        Event { at: Some(Instant::now()), ..Event::from(what.into()) }
    }

    /// `what`, ending at `t` seconds after the meter started (for traces made by hand).
    pub fn at_t(t: f64, what: impl Into<What>) -> Self {
        Event { t, ..Event::from(what.into()) }
    }

    /// Its kind.
    pub fn kind(&self) -> EventKind {
        self.what.kind()
    }

    /// A load's or a reload's fields.
    pub fn loaded(&self) -> Option<&Loaded> {
        match &self.what {
            What::Load(load) | What::Reload(Reloaded { load, .. }) => Some(load),
            _ => None,
        }
    }

    /// The fields several kinds carry, as this event has them: one place that knows which
    /// kind has which.
    fn shared(&self) -> Shared<'_> {
        let none = Shared::default();
        match &self.what {
            What::Load(load) | What::Reload(Reloaded { load, .. }) => Shared {
                stage: load.stage.as_deref(),
                model: Some(&load.model),
                bytes: load.bytes,
                seconds: load.seconds,
                resident: load.resident,
            },
            What::Release(r) => Shared {
                stage: r.stage.as_deref(),
                model: Some(&r.model),
                bytes: r.bytes,
                seconds: r.seconds,
                resident: r.resident,
            },
            What::Stage(e) => Shared { stage: Some(&e.stage), resident: e.resident, ..none },
            What::Mark(m) => Shared { stage: m.stage.as_deref(), resident: m.resident, ..none },
            What::Error(f) => {
                Shared { stage: f.stage.as_deref(), model: f.model.as_deref(), seconds: f.seconds, ..none }
            }
            What::Prefetch(p) => Shared { stage: p.stage.as_deref(), model: Some(&p.model), bytes: p.bytes, ..none },
            What::Residency(r) => {
                Shared { stage: r.stage.as_deref(), model: Some(&r.model), bytes: r.bytes, seconds: r.seconds, ..none }
            }
            What::Tier(t) => Shared {
                stage: t.stage.as_deref(),
                model: t.model.as_deref(),
                bytes: t.bytes,
                seconds: t.seconds,
                ..none
            },
            What::Snapshot(s) => {
                Shared { stage: s.stage.as_deref(), model: Some(&s.model), bytes: s.bytes, seconds: s.seconds, ..none }
            }
        }
    }

    /// The stage: the one entered (a `stage` event), the one a prefetch loads for, or the one
    /// current at the time.
    pub fn stage(&self) -> Option<&str> {
        self.shared().stage
    }

    /// The model it happened to, if any.
    pub fn model(&self) -> Option<&str> {
        self.shared().model
    }

    /// Bytes loaded, reloaded, freed, prefetched, stored, written or streamed.
    pub fn bytes(&self) -> Option<u64> {
        self.shared().bytes
    }

    /// How long the work took.
    pub fn seconds(&self) -> Option<f64> {
        self.shared().seconds
    }

    /// Bytes of model weights resident right after it (loads, releases, stage entries, marks).
    pub fn resident(&self) -> Option<u64> {
        self.shared().resident
    }

    /// The host tier's budget and usage after it (tier events, reloads from the tier).
    pub fn tier(&self) -> Option<TierUsage> {
        match &self.what {
            What::Tier(TierChanged { tier, .. }) | What::Reload(Reloaded { tier, .. }) => *tier,
            _ => None,
        }
    }

    /// A load or reload done in the background by a prefetch.
    pub fn prefetched(&self) -> bool {
        self.loaded().is_some_and(|load| load.prefetched)
    }

    /// A residency change's split.
    pub fn residency(&self) -> Option<&Residency> {
        match &self.what {
            What::Residency(change) => Some(&change.residency),
            _ => None,
        }
    }

    /// Where a reload's weights came from.
    pub fn reload_from(&self) -> Option<ReloadFrom> {
        match &self.what {
            What::Reload(reload) => Some(reload.from),
            _ => None,
        }
    }

    /// The words a kind carries: a mark's label, an error's message, a residency change's
    /// report, a tier's or a snapshot's action and detail (`not stored: too big`).
    pub fn note(&self) -> Option<String> {
        match &self.what {
            What::Mark(Marked { note, .. })
            | What::Error(Failed { note, .. })
            | What::Residency(ResidencyChanged { note, .. }) => Some(note.clone()),
            What::Tier(tier) => Some(tier.words()),
            What::Snapshot(snapshot) => Some(snapshot.words()),
            _ => None,
        }
    }

    /// The registry's `close` mark.
    pub fn is_close(&self) -> bool {
        matches!(&self.what, What::Mark(Marked { action: Some(MarkAction::Close), .. }))
    }
}

/// One line: `reload encoder 12.0 MiB in 0.031 s (in place; stage decode; outside the stage)`.
impl fmt::Display for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.kind().name())?;
        if let What::Stage(entered) = &self.what {
            return write!(f, " {}", entered.stage);
        }
        if let Some(model) = self.model() {
            write!(f, " {model}")?;
        }
        if let Some(bytes) = self.bytes() {
            write!(f, " {}", format_bytes(bytes))?;
        }
        if let Some(seconds) = self.seconds() {
            write!(f, " in {seconds:.3} s")?;
        }
        let mut details = Vec::new();
        details.extend(self.reload_from().map(|from| from.words().to_string()));
        if let Some(tier) = self.tier() {
            details.push(format!("host tier {} of {}", format_bytes(tier.used), format_bytes(tier.budget)));
        }
        if let What::Release(Released { kept_bytes: kept @ 1.., .. }) = &self.what {
            details.push(format!("kept {} resident", format_bytes(*kept)));
        }
        if let Some(report) = self.loaded().and_then(|load| load.report.as_deref()) {
            report_details(report, &mut details);
        }
        if let Some(stage) = self.stage() {
            details.push(format!("stage {stage}"));
        }
        if let Some(load) = self.loaded() {
            for (flag, words) in [
                (load.outside_stage, "outside the stage"),
                (load.prefetched, "prefetched"),
                (load.streamed, line::STREAMED_NOTE),
            ] {
                if flag {
                    details.push(words.to_string());
                }
            }
            details.extend(load.accepted.iter().map(|change| format!("accepted the changed file {change}")));
        }
        details.extend(self.note());
        if !details.is_empty() {
            write!(f, " ({})", details.join("; "))?;
        }
        Ok(())
    }
}

/// `word`, then `: detail` when there is one.
fn said(word: &str, detail: Option<&str>) -> String {
    match detail.filter(|d| !d.is_empty()) {
        Some(detail) => format!("{word}: {detail}"),
        None => word.to_string(),
    }
}

impl TierChanged {
    /// Its action and why, in words: `not stored: too big`.
    pub fn words(&self) -> String {
        said(self.action.word(), self.detail.as_deref())
    }
}

impl SnapshotTaken {
    /// Its action and the file or why, in words: `written: /tmp/s/m.safetensors`.
    pub fn words(&self) -> String {
        said(self.action.word(), Some(&self.detail))
    }
}

fn report_details(report: &LoadReport, details: &mut Vec<String>) {
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
        self.events().into_iter().filter(|e| e.kind() == kind).collect()
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

    fn read(line: &str) -> Event {
        serde_json::from_str(line).unwrap_or_else(|e| panic!("{line}: {e}"))
    }

    #[test]
    fn every_kind_reads_back_as_it_was_written() {
        let load = Loaded {
            stage: Some("s".into()),
            model: "m".into(),
            bytes: Some(8),
            seconds: Some(0.5),
            outside_stage: true,
            prefetched: true,
            streamed: true,
            report: Some(Box::new(LoadReport { used: 2, ignored: 1, ..LoadReport::default() })),
            resident: Some(8),
            accepted: vec!["m.safetensors: another file was put at its path".into()],
        };
        let residency = Residency { blocks: 4, resident: 1, reason: "end".into(), refills: 3, ..Residency::default() };
        let whats: Vec<What> = vec![
            load.clone().into(),
            Reloaded { from: ReloadFrom::HostTier, tier: Some(TierUsage { budget: 9, used: 8 }), load }.into(),
            Released { model: "m".into(), bytes: Some(8), seconds: Some(0.1), kept_bytes: 2, ..Released::default() }
                .into(),
            Entered { stage: "s".into(), position: Some(2), resident: Some(0) }.into(),
            Marked { note: "close".into(), action: Some(MarkAction::Close), ..Marked::default() }.into(),
            Failed { model: Some("m".into()), note: "boom".into(), ..Failed::default() }.into(),
            Prefetching { stage: Some("s".into()), model: "m".into(), bytes: Some(8) }.into(),
            ResidencyChanged { model: "m".into(), residency, note: "net".into(), bytes: Some(8), ..Default::default() }
                .into(),
            TierChanged {
                stage: None,
                model: Some("m".into()),
                action: TierAction::NotStored,
                detail: Some("too big".into()),
                bytes: Some(8),
                seconds: None,
                tier: Some(TierUsage { budget: 4, used: 0 }),
            }
            .into(),
            SnapshotTaken {
                stage: None,
                model: "m".into(),
                action: SnapshotAction::Written,
                detail: "/s/m.safetensors".into(),
                bytes: Some(8),
                seconds: Some(0.2),
            }
            .into(),
        ];
        for what in whats {
            let mut event = Event::at_t(3.0, what);
            event.start = event.seconds().map(|s| 3.0 - s);
            let line = serde_json::to_string(&event).unwrap();
            assert_eq!(read(&line), event, "{line}");
        }
    }

    #[test]
    fn an_event_prints_as_one_line_with_its_details() {
        let load = Loaded {
            stage: Some("decode".into()),
            model: "encoder".into(),
            bytes: Some(12 << 20),
            seconds: Some(0.031),
            outside_stage: true,
            ..Loaded::default()
        };
        let reload = Event::now(Reloaded { from: ReloadFrom::InPlace, tier: None, load });
        assert_eq!(
            reload.to_string(),
            "reload encoder 12.0 MiB in 0.031 s (in place; stage decode; outside the stage)"
        );
        let accepted = Loaded {
            model: "unet".into(),
            accepted: vec!["unet.safetensors: it was written in place".into()],
            ..Loaded::default()
        };
        assert_eq!(
            Event::now(accepted).to_string(),
            "load unet (accepted the changed file unet.safetensors: it was written in place)"
        );
        assert_eq!(Event::now(Entered { stage: "decode".into(), ..Entered::default() }).to_string(), "stage decode");
        let not_stored = TierChanged {
            stage: None,
            model: Some("m".into()),
            action: TierAction::NotStored,
            detail: Some("too big".into()),
            bytes: None,
            seconds: None,
            tier: None,
        };
        assert_eq!(Event::now(not_stored).to_string(), "tier m (not stored: too big)");
    }
}
