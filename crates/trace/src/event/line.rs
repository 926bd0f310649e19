//! Reading an event line of any schema: read first as [`EventLine`], every field any kind ever
//! had, all optional; its free-text notes of schemas 1 and 2 read into the typed fields; then
//! made into its [`What`], or refused as a [`MissingField`] naming the kind and the field.

use std::fmt;

use serde::Deserialize;

use super::{
    Entered, Event, EventKind, Failed, LoadReport, Loaded, MarkAction, Marked, Prefetching, Released, ReloadFrom,
    Reloaded, Residency, ResidencyChanged, SnapshotAction, SnapshotTaken, TierAction, TierChanged, TierUsage, What,
};

/// An event line as any schema wrote it: every field any kind ever had, all optional. Read
/// first, then made into its [`What`] (see the module's docs).
#[derive(Deserialize)]
pub(super) struct EventLine {
    #[serde(default)]
    t: f64,
    kind: EventKind,
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    stage: Option<String>,
    #[serde(default)]
    position: Option<usize>,
    #[serde(default)]
    bytes: Option<u64>,
    #[serde(default)]
    seconds: Option<f64>,
    #[serde(default)]
    start: Option<f64>,
    #[serde(default)]
    from: Option<ReloadFrom>,
    #[serde(default)]
    outside_stage: bool,
    #[serde(default)]
    prefetched: bool,
    #[serde(default)]
    streamed: bool,
    #[serde(default)]
    kept_bytes: Option<u64>,
    #[serde(default)]
    report: Option<Box<LoadReport>>,
    #[serde(default)]
    note: Option<String>,
    #[serde(default)]
    detail: Option<String>,
    #[serde(default)]
    resident: Option<u64>,
    #[serde(default)]
    residency: Option<Residency>,
    #[serde(default)]
    tier: Option<TierUsage>,
    #[serde(default)]
    action: Option<LineAction>,
    #[serde(default)]
    accepted: Vec<String>,
}

/// Every action any kind's line has named (schema 2 had one list for all kinds).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
enum LineAction {
    Stored,
    Evicted,
    NotStored,
    Budget,
    Written,
    NotWritten,
    Close,
}

/// The note a streamed model's resident-part load carried before `streamed` was a field.
pub(super) const STREAMED_NOTE: &str = "the resident part of a streamed model";

/// An event line that lacks a field its kind needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MissingField {
    /// The line's kind.
    pub kind: EventKind,
    /// The field it lacks.
    pub field: &'static str,
}

impl fmt::Display for MissingField {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a `{}` event needs `{}`", self.kind.name(), self.field)
    }
}

/// `detail` as its own field, or what `note` says after `word` (`not stored: too big`): how
/// traces written before actions were typed said it. `None` when neither says it.
fn detail_after(word: &str, note: Option<&str>) -> Option<String> {
    match note?.strip_prefix(word)? {
        "" => None,
        rest => rest.strip_prefix(": ").map(str::to_string),
    }
}

impl EventLine {
    fn missing(&self, field: &'static str) -> MissingField {
        MissingField { kind: self.kind, field }
    }

    fn model(&mut self) -> Result<String, MissingField> {
        self.model.take().ok_or_else(|| self.missing("model"))
    }

    /// Schema 1 wrote a load's, reload's and release's details as words in `note`
    /// (`in_place,outside_stage`, `kept=4096`); schema 2 a streamed load's as a sentence.
    fn read_note_words(&mut self) {
        let Some(note) = self.note.take() else { return };
        if note == STREAMED_NOTE {
            self.streamed = true;
            return;
        }
        for part in note.split(',').map(str::trim) {
            match part {
                "in_place" => self.from = Some(ReloadFrom::InPlace),
                "rebuilt" => self.from = Some(ReloadFrom::Rebuilt),
                "outside_stage" => self.outside_stage = true,
                other => {
                    if let Some(kept) = other.strip_prefix("kept=").and_then(|n| n.parse().ok()) {
                        self.kept_bytes = Some(kept);
                    }
                }
            }
        }
    }

    /// The action a line names, or the one its note begins with (traces written before actions
    /// were typed), among `actions`.
    fn action<A: Copy>(&self, actions: &[(LineAction, A, &str)]) -> Option<(A, Option<String>)> {
        let note = self.note.as_deref();
        actions.iter().find_map(|&(line, action, word)| {
            let named = self.action == Some(line);
            let said = self.action.is_none() && note.is_some_and(|n| n == word || n.starts_with(&format!("{word}: ")));
            (named || said).then(|| (action, self.detail.clone().or_else(|| detail_after(word, note))))
        })
    }

    fn loaded(&mut self) -> Result<Loaded, MissingField> {
        self.read_note_words();
        Ok(Loaded {
            stage: self.stage.take(),
            model: self.model()?,
            bytes: self.bytes,
            seconds: self.seconds,
            outside_stage: self.outside_stage,
            prefetched: self.prefetched,
            streamed: self.streamed,
            report: self.report.take(),
            resident: self.resident,
            accepted: std::mem::take(&mut self.accepted),
        })
    }
}

impl TryFrom<EventLine> for Event {
    type Error = MissingField;

    fn try_from(mut line: EventLine) -> Result<Self, MissingField> {
        use LineAction as L;
        let what = match line.kind {
            EventKind::Load => What::Load(line.loaded()?),
            EventKind::Reload => {
                let load = line.loaded()?;
                let from = line.from.ok_or_else(|| line.missing("from"))?;
                What::Reload(Reloaded { from, tier: line.tier, load })
            }
            EventKind::Release => {
                line.read_note_words();
                What::Release(Released {
                    stage: line.stage.take(),
                    model: line.model()?,
                    bytes: line.bytes,
                    seconds: line.seconds,
                    kept_bytes: line.kept_bytes.unwrap_or(0),
                    resident: line.resident,
                })
            }
            EventKind::Stage => What::Stage(Entered {
                stage: line.stage.take().ok_or_else(|| line.missing("stage"))?,
                position: line.position,
                resident: line.resident,
            }),
            EventKind::Mark => What::Mark(Marked {
                action: line.action(&[(L::Close, MarkAction::Close, "close")]).map(|(action, _)| action),
                stage: line.stage.take(),
                note: line.note.take().unwrap_or_default(),
                resident: line.resident,
            }),
            EventKind::Error => What::Error(Failed {
                stage: line.stage.take(),
                model: line.model.take(),
                seconds: line.seconds,
                note: line.note.take().unwrap_or_default(),
            }),
            EventKind::Prefetch => {
                What::Prefetch(Prefetching { stage: line.stage.take(), model: line.model()?, bytes: line.bytes })
            }
            EventKind::Residency => What::Residency(ResidencyChanged {
                stage: line.stage.take(),
                model: line.model()?,
                residency: line.residency.take().ok_or_else(|| line.missing("residency"))?,
                note: line.note.take().unwrap_or_default(),
                bytes: line.bytes,
                seconds: line.seconds,
            }),
            EventKind::Tier => {
                let (action, detail) = line
                    .action(&[
                        (L::Stored, TierAction::Stored, "stored"),
                        (L::Evicted, TierAction::Evicted, "evicted"),
                        (L::NotStored, TierAction::NotStored, "not stored"),
                        (L::Budget, TierAction::Budget, "budget"),
                    ])
                    .ok_or_else(|| line.missing("action"))?;
                What::Tier(TierChanged {
                    stage: line.stage.take(),
                    model: line.model.take(),
                    action,
                    detail,
                    bytes: line.bytes,
                    seconds: line.seconds,
                    tier: line.tier,
                })
            }
            EventKind::Snapshot => {
                let (action, detail) = line
                    .action(&[
                        (L::Written, SnapshotAction::Written, "written"),
                        (L::NotWritten, SnapshotAction::NotWritten, "not written"),
                    ])
                    .ok_or_else(|| line.missing("action"))?;
                What::Snapshot(SnapshotTaken {
                    stage: line.stage.take(),
                    model: line.model()?,
                    action,
                    detail: detail.unwrap_or_default(),
                    bytes: line.bytes,
                    seconds: line.seconds,
                })
            }
        };
        Ok(Event { at: None, t: line.t, start: line.start, what })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(line: &str) -> Event {
        serde_json::from_str(line).unwrap_or_else(|e| panic!("{line}: {e}"))
    }

    #[test]
    fn schema_1_notes_become_typed_fields() {
        let reload = read(r#"{"t":1.0,"kind":"reload","model":"m","note":"in_place,outside_stage"}"#);
        let What::Reload(reload) = reload.what else { panic!("{reload:?}") };
        assert_eq!((reload.from, reload.load.outside_stage), (ReloadFrom::InPlace, true));
        let release = read(r#"{"t":1.0,"kind":"release","model":"m","note":"kept=4096"}"#);
        assert!(matches!(release.what, What::Release(Released { kept_bytes: 4096, .. })), "{release:?}");
        let mark = read(r#"{"t":1.0,"kind":"mark","note":"in_place"}"#);
        assert!(matches!(&mark.what, What::Mark(m) if m.note == "in_place"), "a mark's label is left alone");
        let streamed = read(&format!(r#"{{"t":1.0,"kind":"load","model":"m","note":"{STREAMED_NOTE}"}}"#));
        assert!(streamed.loaded().unwrap().streamed, "{streamed:?}");
    }

    #[test]
    fn a_trace_written_before_actions_were_typed_gets_them_from_its_notes() {
        let tier = |note: &str| match read(&format!(r#"{{"t":1,"kind":"tier","model":"m","note":"{note}"}}"#)).what {
            What::Tier(tier) => (tier.action, tier.detail),
            other => panic!("{other:?}"),
        };
        assert_eq!(tier("stored"), (TierAction::Stored, None));
        assert_eq!(tier("evicted"), (TierAction::Evicted, None));
        assert_eq!(tier("budget"), (TierAction::Budget, None));
        assert_eq!(tier("not stored: too big"), (TierAction::NotStored, Some("too big".into())));
        let snapshot = read(r#"{"t":1,"kind":"snapshot","model":"m","note":"not written: disk full"}"#);
        assert!(
            matches!(&snapshot.what, What::Snapshot(s) if s.action == SnapshotAction::NotWritten && s.detail == "disk full")
        );
        assert!(read(r#"{"t":1,"kind":"mark","note":"close"}"#).is_close());
        assert!(
            !read(r#"{"t":1,"kind":"mark","note":"stored"}"#).is_close(),
            "a user's mark is a label, whatever it says"
        );
        let typed = read(r#"{"t":1,"kind":"tier","model":"m","note":"evicted","action":"stored"}"#);
        assert!(
            matches!(&typed.what, What::Tier(t) if t.action == TierAction::Stored),
            "a typed action wins over the note"
        );
        let unsaid = serde_json::from_str::<Event>(r#"{"t":1,"kind":"tier","model":"m","note":"storedX"}"#);
        assert!(
            unsaid.unwrap_err().to_string().contains("a `tier` event needs `action`"),
            "words end at a colon or the note's end"
        );
    }

    #[test]
    fn a_line_without_what_its_kind_needs_is_refused_with_the_kind_and_the_field() {
        for (line, said) in [
            (r#"{"t":1,"kind":"load","bytes":4}"#, "a `load` event needs `model`"),
            (r#"{"t":1,"kind":"reload","model":"m"}"#, "a `reload` event needs `from`"),
            (r#"{"t":1,"kind":"stage"}"#, "a `stage` event needs `stage`"),
            (r#"{"t":1,"kind":"residency","model":"m"}"#, "a `residency` event needs `residency`"),
        ] {
            let err = serde_json::from_str::<Event>(line).unwrap_err().to_string();
            assert!(err.contains(said), "{line}: {err}");
        }
    }

    #[test]
    fn an_unknown_kind_is_refused_by_name() {
        let err = serde_json::from_str::<Event>(r#"{"t":1.0,"kind":"teleport"}"#).unwrap_err().to_string();
        assert!(err.contains("teleport") && err.contains("reload"), "{err}");
    }
}
