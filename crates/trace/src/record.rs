//! The trace format: one JSON object per line, tagged by `type`. Times `t` are seconds since the
//! meter started (monotonic, millisecond precision); sizes are bytes.
//!
//! | `type` | what |
//! |---|---|
//! | `header` | first line: schema version, pid, host, OS, total memory, device, command, interval, user `meta` (its own object, so it cannot overwrite the fields above) |
//! | `sample` | the process's RSS, swap and high-water mark, the system's available memory and swap, cgroup usage and limit, memory pressure, device memory: each present only where the platform has it |
//! | `event` | what the pipeline did ([`crate::event::Event`]): its `kind` (`stage`, `load`, `reload`, `release`, `mark`, `error`, `prefetch`, `residency`, `tier`, `snapshot`) and that kind's fields beside it ([`crate::event::What`]) |
//! | `peak` | the exact RSS high-water mark of the window that ends at `t` (Linux: `VmHWM`, reset at every window start), so a peak between two samples is not lost; on CUDA also the allocator's peak (`device`, reset likewise) |
//! | `error` | a reading that failed, once per distinct error and source |
//! | `end` | last line; absent when the run was killed |

use serde::{Deserialize, Serialize};

pub use crate::event::Event as EventRecord;

/// The version of this format; a reader refuses traces of a newer one.
/// Schema 2 typed the events' details (`from`, `outside_stage`, `kept_bytes`, `report`), which
/// schema 1 wrote as words in `note`; schema 3 gives each kind exactly its own fields (a tier's
/// and a snapshot's `action` and `detail` instead of words in `note`, a streamed load's
/// `streamed`). Lines of every schema are read into schema 3's [`crate::event::What`].
pub const SCHEMA_VERSION: u32 = 3;

/// One line of a trace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Record {
    /// The first line: who, where, what.
    Header(Header),
    /// Readings at one moment.
    Sample(Sample),
    /// An event of the run.
    Event(EventRecord),
    /// A stage window's exact peak.
    Peak(PeakRecord),
    /// A reading that failed.
    Error(ErrorRecord),
    /// The meter stopped.
    End {
        /// When, seconds since the meter started.
        t: f64,
    },
}

impl Record {
    /// The record's time, if it has one (every record but the header).
    pub fn t(&self) -> Option<f64> {
        match self {
            Record::Header(_) => None,
            Record::Sample(s) => Some(s.t),
            Record::Event(e) => Some(e.t),
            Record::Peak(p) => Some(p.t),
            Record::Error(e) => Some(e.t),
            Record::End { t } => Some(*t),
        }
    }
}

/// Who, where and what: the first line of a trace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Header {
    /// The trace format's version ([`SCHEMA_VERSION`] when written).
    pub schema: u32,
    /// Wall-clock start, RFC 3339 UTC to the second.
    pub utc: String,
    /// The metered process's id.
    pub pid: u32,
    /// The machine's host name.
    pub host: String,
    /// The operating system.
    pub os: String,
    /// Physical memory (or the cgroup limit in a limited cgroup), bytes.
    pub total_memory: u64,
    /// Where the models run: `cpu`, `cuda:0`, `mps`.
    pub device: String,
    /// The process's command line.
    pub command: Vec<String>,
    /// Seconds between background samples.
    pub interval: f64,
    /// The user's own fields (mode, seed, pipeline, ...).
    #[serde(default)]
    pub meta: serde_json::Map<String, serde_json::Value>,
}

/// The readings at one moment. Absent fields: not available on this platform, or the reading
/// failed (an `error` record says so).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// Seconds since the meter started.
    pub t: f64,
    /// Process resident set (Linux `VmRSS`; macOS physical footprint).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rss: Option<u64>,
    /// Of `rss`, the file pages (Linux `RssFile`: shared libraries' code, mapped files). The
    /// plan's numbers include them (they come from `rss` and `hwm`); `stageload guard` leaves
    /// them out of the command's memory, since the kernel takes them back under pressure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rss_file: Option<u64>,
    /// Process swapped-out memory (Linux `VmSwap`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub swap: Option<u64>,
    /// Process high-water mark since the current window began (Linux `VmHWM`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hwm: Option<u64>,
    /// System memory available (`MemAvailable`, or the cgroup headroom).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub available: Option<u64>,
    /// System swap used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub swap_used: Option<u64>,
    /// System swap size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub swap_total: Option<u64>,
    /// The memory-limited cgroup's usage, when the process runs in one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cgroup_usage: Option<u64>,
    /// That cgroup's limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cgroup_limit: Option<u64>,
    /// Memory pressure, percent of the last 10 s in which some task waited (PSI `some`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub psi_some: Option<f64>,
    /// The same for all non-idle tasks at once (PSI `full`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub psi_full: Option<f64>,
    /// Device (CUDA) memory allocated by tensors.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_allocated: Option<u64>,
    /// Device memory reserved by the caching allocator.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_reserved: Option<u64>,
}

/// The exact RSS peak of the window of `stage` up to `t`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PeakRecord {
    /// The window's end, seconds since the meter started.
    pub t: f64,
    /// The stage.
    pub stage: String,
    /// The RSS peak, bytes.
    pub rss: u64,
    /// The device's exact allocated peak in the window (CUDA), when the run uses one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<u64>,
}

/// A reading that failed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorRecord {
    /// Seconds since the meter started.
    pub t: f64,
    /// Which reading: `process`, `system`, `pressure`, `device`, `peak`.
    pub source: String,
    /// The reading's error.
    pub error: String,
}

/// Seconds rounded to milliseconds, as every `t` in a trace.
pub fn millis(seconds: f64) -> f64 {
    (seconds * 1000.0).round() / 1000.0
}
