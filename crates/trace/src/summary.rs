//! What a trace says: the overall peak, per-stage windows with their peaks and durations, loads,
//! releases, swap, errors.
//!
//! Stage windows:
//! 1. A window begins at its `stage` event, or, when `release` events follow that event at once
//!    (in event order), at the last of those releases: until they finish, the memory still
//!    belongs to the previous stage.
//! 2. A synthetic `setup` window covers the time from 0 to the first stage (replaced by that
//!    stage when it begins at 0, and merged with it when it is named `setup` too).
//! 3. Consecutive windows of the same name merge (the first start wins).
//! 4. A window runs to the next one's start; the last one to the last sample.
//! 5. Its peak is the largest of the samples in `[start, end)` (the last window includes its
//!    end) and of the exact `peak` records that close it (`start < t ≤ end`).
//! 6. Its weights are the largest `resident` of the events from the one that starts it to the one
//!    that starts the next window (by event order, so events in the same millisecond as a
//!    boundary fall on the right side), and of the last one before (what it inherited).

use serde::{Deserialize, Serialize};

use crate::event::{EventKind, ReloadFrom, Reloaded, Residency, SnapshotAction, SnapshotTaken, TierAction, What};
use crate::reader::Trace;
use crate::record::{millis, EventRecord, Header, PeakRecord, Record, Sample};

/// One stage window.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StageWindow {
    /// The stage entered.
    pub stage: String,
    /// Which occurrence of the pipeline's stage sequence it was (0: the first listed), as the
    /// stage event recorded it; `None` for the setup window and traces written before it was.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub position: Option<usize>,
    /// When it was entered, seconds since the meter started.
    pub start: f64,
    /// How long the window lasted.
    pub seconds: f64,
    /// The window's peak RSS: exact where the kernel's high-water mark was recorded, else the
    /// largest sample; `None` when nothing was measured inside it.
    pub peak: Option<u64>,
    /// The largest sample alone (what 0.25 s sampling saw).
    pub sampled_peak: Option<u64>,
    /// The most model weight resident during the window (from the events' `resident`), when
    /// the trace has it: the peak minus this is the stage's working memory and the process's base.
    #[serde(default)]
    pub weights: Option<u64>,
    /// The window's peak of device memory allocated by tensors (CUDA): exact where the meter
    /// reset the allocator's peak at the window start, else the largest sample.
    #[serde(default)]
    pub device_peak: Option<u64>,
}

/// Loads and reloads.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Loads {
    /// Loads and reloads in all.
    pub count: usize,
    /// Of them, reloads.
    pub reloads: usize,
    /// Reloads refilled from the registry's snapshot of the model (`snapshot_dir`).
    #[serde(default)]
    pub from_snapshot: usize,
    /// Snapshots written.
    #[serde(default)]
    pub snapshots_written: usize,
    /// Releases whose snapshot could not be written, each as `model: why`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub snapshots_not_written: Vec<String>,
    /// Bytes loaded, over every load.
    pub bytes: u64,
    /// Seconds the loads took, summed.
    pub seconds: f64,
    /// bytes / seconds, in 10^9 bytes per second.
    pub gb_per_s: f64,
}

/// Releases.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Releases {
    /// Releases in all.
    pub count: usize,
    /// Bytes freed.
    pub bytes: u64,
}

/// System swap at the first sample, its peak and at the last sample.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Swap {
    /// At the first sample, bytes.
    pub start: u64,
    /// The most seen, bytes.
    pub peak: u64,
    /// At the last sample, bytes.
    pub end: u64,
}

/// A reading that failed during the run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReadingError {
    /// When, seconds since the meter started.
    pub t: f64,
    /// Which reading (`process`, `system`, ...).
    pub source: String,
    /// Its error.
    pub error: String,
}

/// Everything [`summarize`] finds in a trace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// The trace's header (`None`: the first line was not one).
    pub header: Option<Header>,
    /// The trace has its `end` record (the run was not killed).
    pub complete: bool,
    /// Seconds from the first sample to the last.
    pub duration: f64,
    /// The largest RSS seen (samples and exact peaks).
    pub peak: u64,
    /// When it was seen, seconds since the meter started.
    pub peak_t: f64,
    /// The stage windows, in run order.
    pub stages: Vec<StageWindow>,
    /// The loads and reloads.
    pub loads: Loads,
    /// The releases.
    pub releases: Releases,
    /// Models loaded outside the stage that listed them.
    pub outside_stage: Vec<String>,
    /// System swap over the run.
    pub swap: Option<Swap>,
    /// The process's own swapped-out memory at its peak.
    pub process_swap_peak: Option<u64>,
    /// The least system memory available in a sample.
    pub min_available: Option<u64>,
    /// The most device memory allocated by tensors in a sample.
    pub device_allocated_peak: Option<u64>,
    /// The most device memory the caching allocator reserved in a sample.
    pub device_reserved_peak: Option<u64>,
    /// Streamed models, each with its last split and how many times the split was set.
    #[serde(default)]
    pub streamed: Vec<Streamed>,
    /// What the host tier did, when the run had one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_tier: Option<HostTier>,
    /// Readings that failed.
    pub errors: Vec<ReadingError>,
}

/// The host tier over a run, from its `tier` events and the reloads that came from it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct HostTier {
    /// The last budget.
    pub budget: u64,
    /// The most its copies held at once.
    pub peak_used: u64,
    /// Models stored.
    pub stored: usize,
    /// Copies evicted.
    pub evicted: usize,
    /// Releases not stored, each as `model: reason`.
    pub not_stored: Vec<String>,
    /// Reloads from the tier.
    pub reloads: usize,
    /// Their bytes.
    pub reload_bytes: u64,
    /// Their copy speed, in 10^9 bytes per second.
    pub reload_gb_per_s: f64,
}

/// The host tier's activity; `None` when the trace has no tier event.
fn host_tier(events: &[&EventRecord]) -> Option<HostTier> {
    let mut tier = HostTier::default();
    let mut seen = false;
    let mut reload_seconds = 0.0;
    // Every tier event, and every reload from the tier, carries the tier's usage.
    for event in events {
        if let Some(usage) = event.tier() {
            seen = true;
            tier.budget = usage.budget;
            tier.peak_used = tier.peak_used.max(usage.used);
        }
        match &event.what {
            What::Tier(change) => match change.action {
                TierAction::Stored => tier.stored += 1,
                TierAction::Evicted => tier.evicted += 1,
                TierAction::NotStored => {
                    let model = change.model.as_deref().unwrap_or("?");
                    tier.not_stored.push(format!("{model}: {}", change.detail.as_deref().unwrap_or_default()));
                }
                TierAction::Budget => {}
            },
            What::Reload(Reloaded { from: ReloadFrom::HostTier, load, .. }) => {
                tier.reloads += 1;
                tier.reload_bytes += load.bytes.unwrap_or(0);
                reload_seconds += load.seconds.unwrap_or(0.0);
            }
            _ => {}
        }
    }
    if reload_seconds > 0.0 {
        tier.reload_gb_per_s = tier.reload_bytes as f64 / reload_seconds / 1e9;
    }
    seen.then_some(tier)
}

/// A streamed model as its `residency` events left it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Streamed {
    /// The model's name.
    pub model: String,
    /// The last split.
    pub residency: Residency,
    /// The reasons of every split, in order (`start`, `out of memory`, ...).
    pub reasons: Vec<String>,
    /// What its refills moved, summed over its `end` events (one each time the model went).
    #[serde(default)]
    pub moved: Moved,
}

/// Blocks a streamed model refilled and found hot, and the bytes and seconds of the refills.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Moved {
    /// Blocks refilled.
    pub refills: u64,
    /// Blocks found hot (no refill needed).
    pub hot_hits: u64,
    /// Bytes the refills read.
    pub bytes: u64,
    /// Seconds the refills took.
    pub seconds: f64,
}

/// Each streamed model's last split and what it moved, in the order the models first appear.
fn streamed(events: &[&EventRecord]) -> Vec<Streamed> {
    let mut models: Vec<Streamed> = Vec::new();
    for event in events {
        let What::Residency(change) = &event.what else { continue };
        let (model, residency) = (&change.model, &change.residency);
        let position = models.iter().position(|m| m.model == *model).unwrap_or_else(|| {
            models.push(Streamed {
                model: model.clone(),
                residency: residency.clone(),
                reasons: Vec::new(),
                moved: Moved::default(),
            });
            models.len() - 1
        });
        let known = &mut models[position];
        if residency.reason == "end" {
            let moved = &mut known.moved;
            moved.refills = moved.refills.saturating_add(residency.refills);
            moved.hot_hits = moved.hot_hits.saturating_add(residency.hot_hits);
            moved.bytes = moved.bytes.saturating_add(change.bytes.unwrap_or(0));
            moved.seconds += change.seconds.unwrap_or(0.0);
        } else {
            known.reasons.push(residency.reason.clone());
            known.residency = residency.clone();
        }
    }
    models
}

/// Where a window begins.
struct WindowStart {
    stage: String,
    /// The occurrence its stage event recorded.
    position: Option<usize>,
    /// Seconds since the meter started.
    t: f64,
    /// The index of the event that starts it (`None`: the synthetic setup window).
    event: Option<usize>,
}

/// Each stage event's window: it starts after the releases that follow the event.
fn window_starts(events: &[&EventRecord]) -> Vec<WindowStart> {
    let mut starts = Vec::new();
    for (i, event) in events.iter().enumerate() {
        let What::Stage(entered) = &event.what else { continue };
        let tail = events[i + 1..].iter().take_while(|e| e.kind() == EventKind::Release).count();
        let start = i + tail;
        starts.push(WindowStart {
            stage: entered.stage.clone(),
            position: entered.position,
            t: events[start].t,
            event: Some(start),
        });
    }
    starts
}

/// Indices `lo..hi` of the items of a time-sorted slice inside a window: `after(t)` says an item
/// is past the window's start, `before(t)` that it is not past its end.
fn range<T>(items: &[T], time: impl Fn(&T) -> f64, after: impl Fn(f64) -> bool, before: impl Fn(f64) -> bool) -> &[T] {
    let lo = items.partition_point(|item| !after(time(item)));
    let hi = items.partition_point(|item| before(time(item))).max(lo);
    &items[lo..hi]
}

impl Summary {
    /// The run's models were on a device (`cuda:0`, `mps`): its weights are device memory.
    pub fn on_device(&self) -> bool {
        self.header.as_ref().is_some_and(|h| h.device != "cpu")
    }
}

/// Summarizes a trace's records in O(n log n): every window's readings are found by binary search
/// in the records, which [`Trace`] keeps in time order.
pub fn summarize(trace: &Trace) -> Summary {
    let records = &trace.records;
    let samples: Vec<&Sample> =
        records.iter().filter_map(|r| if let Record::Sample(s) = r { Some(s) } else { None }).collect();
    let events: Vec<&EventRecord> =
        records.iter().filter_map(|r| if let Record::Event(e) = r { Some(e) } else { None }).collect();
    let peaks: Vec<&PeakRecord> =
        records.iter().filter_map(|r| if let Record::Peak(p) = r { Some(p) } else { None }).collect();
    let last_t =
        samples.last().map(|s| s.t).or_else(|| records.iter().filter_map(Record::t).reduce(f64::max)).unwrap_or(0.0);
    // The resident weights as of each event: `held[k]` is what the events before `k` last said.
    let held: Vec<Option<u64>> = std::iter::once(None)
        .chain(events.iter().scan(None, |last, e| {
            *last = e.resident().or(*last);
            Some(*last)
        }))
        .collect();

    // Windows: synthetic setup, release-aware starts, a stage entered again at once merged into
    // its window unless the stage event says it is another occurrence (`[a, a]`).
    let mut windows = vec![WindowStart { stage: "setup".to_string(), position: None, t: 0.0, event: None }];
    for start in window_starts(&events) {
        // The first stage replaces the synthetic setup when it begins at 0 or is a setup
        // itself (whichever occurrence its event names: one window, from 0).
        let synthetic = windows.len() == 1 && windows[0].event.is_none();
        if synthetic && (start.t <= 0.0 || start.stage == windows[0].stage) {
            windows[0] = WindowStart { t: 0.0, ..start };
        } else if windows.last().is_some_and(|last| last.stage == start.stage && last.position == start.position) {
            continue;
        } else {
            windows.push(start);
        }
    }
    let stages = windows
        .iter()
        .enumerate()
        .map(|(i, window)| {
            let (start, last) = (window.t, i + 1 == windows.len());
            let end = windows.get(i + 1).map_or(last_t, |next| next.t);
            // Its events: from the one after its start to the one that starts the next window.
            let lo = window.event.map_or(0, |e| e + 1);
            let hi = windows.get(i + 1).and_then(|next| next.event).map_or(events.len(), |e| e + 1).max(lo);
            let inside = range(&samples, |s| s.t, |t| t >= start, |t| t < end || (last && t <= end));
            let closing = range(&peaks, |p| p.t, |t| t > start || i == 0, |t| t <= end);
            let sampled_peak = inside.iter().filter_map(|s| s.rss).max();
            let exact = closing.iter().map(|p| p.rss).max();
            let sampled_device = inside.iter().filter_map(|s| s.device_allocated).max();
            let exact_device = closing.iter().filter_map(|p| p.device).max();
            let inherited = held[lo];
            let during = events[lo..hi].iter().filter_map(|e| e.resident()).max();
            StageWindow {
                stage: window.stage.clone(),
                position: window.position,
                start,
                seconds: millis((end - start).max(0.0)),
                peak: sampled_peak.max(exact),
                sampled_peak,
                weights: inherited.max(during),
                device_peak: sampled_device.max(exact_device),
            }
        })
        .collect();

    let (peak_t, peak) = samples
        .iter()
        .filter_map(|s| s.rss.map(|rss| (s.t, rss)))
        .chain(peaks.iter().map(|p| (p.t, p.rss)))
        .max_by_key(|(_, rss)| *rss)
        .unwrap_or((0.0, 0));
    let loaded: Vec<_> = events.iter().filter_map(|e| e.loaded()).collect();
    let (bytes, seconds) =
        (loaded.iter().filter_map(|l| l.bytes).sum::<u64>(), loaded.iter().filter_map(|l| l.seconds).sum::<f64>());
    let reloads: Vec<&Reloaded> =
        events.iter().filter_map(|e| if let What::Reload(r) = &e.what { Some(r) } else { None }).collect();
    let snapshots: Vec<&SnapshotTaken> =
        events.iter().filter_map(|e| if let What::Snapshot(s) = &e.what { Some(s) } else { None }).collect();
    let loads = Loads {
        count: loaded.len(),
        reloads: reloads.len(),
        from_snapshot: reloads.iter().filter(|r| r.from == ReloadFrom::Snapshot).count(),
        snapshots_written: snapshots.iter().filter(|s| s.action == SnapshotAction::Written).count(),
        snapshots_not_written: snapshots
            .iter()
            .filter(|s| s.action == SnapshotAction::NotWritten)
            .map(|s| format!("{}: {}", s.model, s.detail))
            .collect(),
        bytes,
        seconds: millis(seconds),
        gb_per_s: if seconds > 0.0 { bytes as f64 / seconds / 1e9 } else { 0.0 },
    };
    let released: Vec<&&EventRecord> = events.iter().filter(|e| e.kind() == EventKind::Release).collect();
    let mut outside_stage: Vec<String> = loaded.iter().filter(|l| l.outside_stage).map(|l| l.model.clone()).collect();
    outside_stage.sort();
    outside_stage.dedup();
    let swaps: Vec<u64> = samples.iter().filter_map(|s| s.swap_used).collect();
    Summary {
        header: records.iter().find_map(|r| if let Record::Header(h) = r { Some(h.clone()) } else { None }),
        complete: records.iter().any(|r| matches!(r, Record::End { .. })),
        duration: millis(samples.last().map_or(0.0, |l| l.t - samples[0].t)),
        peak,
        peak_t,
        stages,
        loads,
        releases: Releases { count: released.len(), bytes: released.iter().filter_map(|e| e.bytes()).sum() },
        outside_stage,
        streamed: streamed(&events),
        host_tier: host_tier(&events),
        swap: (!swaps.is_empty()).then(|| Swap {
            start: swaps[0],
            peak: swaps.iter().copied().max().unwrap_or(0),
            end: swaps[swaps.len() - 1],
        }),
        process_swap_peak: samples.iter().filter_map(|s| s.swap).max(),
        min_available: samples.iter().filter_map(|s| s.available).min(),
        device_allocated_peak: samples.iter().filter_map(|s| s.device_allocated).max(),
        device_reserved_peak: samples.iter().filter_map(|s| s.device_reserved).max(),
        errors: records
            .iter()
            .filter_map(|r| match r {
                Record::Error(e) => Some(ReadingError { t: e.t, source: e.source.clone(), error: e.error.clone() }),
                _ => None,
            })
            .collect(),
    }
}
