//! stageload-trace: where a run's memory went. Torch-free.
//!
//! - [`event`]: typed events of a staged pipeline, their sinks, and how they print.
//! - [`record`]: the JSONL trace format (header, samples, events, exact peaks, errors, end).
//! - [`meter`]: the background sampler writing a trace while the pipeline runs.
//! - [`reader`]: reading a trace back, tolerating a half-written last line.
//! - [`summary`]: per-stage windows and peaks, loads, releases, swap, errors.
//! - [`table`]: summaries as text, and several traces side by side.
//! - [`aggregate`]: per-stage peaks over several runs: min, median, max, ratio of medians.
//! - [`plot`]: memory over time as SVG or PNG.
//! - [`sync`]: the one lock helper (poisoning ignored).

#![warn(missing_docs)]

pub mod aggregate;
pub mod event;
pub mod meter;
pub mod plot;
pub mod reader;
pub mod record;
pub mod summary;
pub mod sync;
pub mod table;

pub use event::{Event, EventKind, EventSink, ListSink, LoadReport, ReloadFrom, TierUsage};
pub use meter::{DeviceError, DeviceMemory, Meter, MeterOptions, MeterReadings, SystemMeterReadings};
pub use reader::{read_trace, Trace, TraceError};
pub use record::{EventRecord, Record};
pub use summary::{summarize, StageWindow, Summary};
