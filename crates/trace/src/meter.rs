//! The meter: a background thread that writes one `sample` line every interval (0.25 s by
//! default), plus one sample at every event the pipeline reports, to a JSONL trace flushed per
//! line, so a run killed with SIGKILL still leaves a readable trace.
//!
//! Exact per-stage peaks (Linux): the kernel's RSS high-water mark is reset when a window begins
//! and read when it ends, and written as a `peak` record, so a spike between two samples is not
//! lost. A window ends at a `stage` event and again at each `release` that follows it at once
//! (the memory being released still belongs to the previous stage), matching how the summary
//! cuts windows.
//!
//! A reading that fails is written once as an `error` record per source and message; sampling
//! goes on, and the same error after a recovery is written again.

use std::collections::HashMap;
use std::fs::{self, File};
use std::io::{self, Write};
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use serde_json::{Map, Value};
use stageload_probe::{Pressure, ProbeError, ProcessMemory, SystemMemory};

use crate::event::{Event, EventSink, Marked, What};
use crate::record::{millis, ErrorRecord, EventRecord, Header, PeakRecord, Record, Sample, SCHEMA_VERSION};

/// Device memory from the torch side (CUDA's caching allocator).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceMemory {
    /// Bytes allocated to tensors now.
    pub allocated: u64,
    /// Bytes the caching allocator holds (allocated and cached).
    pub reserved: u64,
    /// The most allocated since the last [`MeterReadings::reset_device_peak`], when the device
    /// keeps that statistic (CUDA does).
    pub peak: Option<u64>,
}

/// Where the meter's readings come from. The defaults read this process and this machine;
/// tests inject failing or scripted ones, the torch side adds the device.
pub trait MeterReadings: Send {
    /// This process's memory.
    fn process(&mut self) -> Result<ProcessMemory, ProbeError> {
        stageload_probe::process_memory(std::process::id() as i32)
    }
    /// The machine's memory and swap.
    fn system(&mut self) -> Result<SystemMemory, ProbeError> {
        stageload_probe::system_memory()
    }
    /// Memory pressure (PSI), where the kernel reports it.
    fn pressure(&mut self) -> Result<Option<Pressure>, ProbeError> {
        stageload_probe::pressure()
    }
    /// Resets the process's high-water mark (a new window begins).
    fn reset_peak(&mut self) -> Result<(), ProbeError> {
        stageload_probe::reset_peak()
    }
    /// Device memory, when a device is in use.
    fn device(&mut self) -> Option<Result<DeviceMemory, DeviceError>> {
        None
    }
    /// Resets the device's peak statistic (a new window begins), when it has one.
    fn reset_device_peak(&mut self) -> Option<Result<(), DeviceError>> {
        None
    }
}

/// A device reading's failure, as the device's side gave it (the torch side: libtorch's error
/// through the shim); the trace records its text.
pub type DeviceError = Box<dyn std::error::Error + Send + Sync>;

type DeviceReader = Box<dyn FnMut() -> Result<DeviceMemory, DeviceError> + Send>;
type DeviceReset = Box<dyn FnMut() -> Result<(), DeviceError> + Send>;

/// This process and this machine, plus an optional device reader.
#[derive(Default)]
pub struct SystemMeterReadings {
    device: Option<DeviceReader>,
    reset: Option<DeviceReset>,
}

impl SystemMeterReadings {
    /// Adds a device reader (the torch side gives one for CUDA).
    pub fn with_device(reader: impl FnMut() -> Result<DeviceMemory, DeviceError> + Send + 'static) -> Self {
        SystemMeterReadings { device: Some(Box::new(reader)), reset: None }
    }

    /// Adds what resets the device's peak statistic at each window start, so that each
    /// window's device peak is exact.
    pub fn device_peak_reset(mut self, reset: impl FnMut() -> Result<(), DeviceError> + Send + 'static) -> Self {
        self.reset = Some(Box::new(reset));
        self
    }
}

impl MeterReadings for SystemMeterReadings {
    fn device(&mut self) -> Option<Result<DeviceMemory, DeviceError>> {
        self.device.as_mut().map(|read| read())
    }

    fn reset_device_peak(&mut self) -> Option<Result<(), DeviceError>> {
        self.reset.as_mut().map(|reset| reset())
    }
}

/// How to meter a run.
pub struct MeterOptions {
    /// Time between samples.
    pub interval: Duration,
    /// Where the models run, for the header: `cpu`, `cuda:0`, `mps`.
    pub device: String,
    /// The user's fields for the header (mode, seed, ...); kept under `meta`.
    pub meta: Map<String, Value>,
    /// Where the readings come from.
    pub readings: Box<dyn MeterReadings>,
}

impl Default for MeterOptions {
    fn default() -> Self {
        MeterOptions {
            interval: Duration::from_millis(250),
            device: "cpu".to_string(),
            meta: Map::new(),
            readings: Box::new(SystemMeterReadings::default()),
        }
    }
}

impl MeterOptions {
    /// Sets the time between samples (default 250 ms).
    pub fn interval(mut self, interval: Duration) -> Self {
        self.interval = interval;
        self
    }
    /// Sets the device the header names.
    pub fn device(mut self, device: impl Into<String>) -> Self {
        self.device = device.into();
        self
    }
    /// Adds a field to the header's `meta`.
    pub fn meta(mut self, key: impl Into<String>, value: impl Into<Value>) -> Self {
        self.meta.insert(key.into(), value.into());
        self
    }
    /// Sets where the readings come from.
    pub fn readings(mut self, readings: impl MeterReadings + 'static) -> Self {
        self.readings = Box::new(readings);
        self
    }
}

/// What the writer side holds under one lock: the file, the readers, and the window state.
struct Writer {
    file: File,
    readings: Box<dyn MeterReadings>,
    /// The last error written per source; cleared when the source reads again.
    errors: HashMap<&'static str, String>,
    /// The stage whose window is open.
    window: String,
    /// Right after a stage event, releases still belong to this (previous) window.
    release_tail: Option<String>,
    /// Whether the peak can be reset here (Linux); else no `peak` records.
    exact_peaks: bool,
    finished: bool,
}

struct Shared {
    origin: Instant,
    writer: Mutex<Writer>,
    stop: Mutex<bool>,
    wake: Condvar,
}

/// A running meter. [`finish`](Meter::finish) (or dropping it) writes the last sample and the
/// `end` record.
pub struct Meter {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Writer {
    fn write(&mut self, record: &Record) {
        let mut line = serde_json::to_string(record).expect("records are plain data");
        line.push('\n');
        // One write per line, flushed at once: a killed run leaves whole lines. A full disk must
        // not take the pipeline down; the line is lost.
        let _ = self.file.write_all(line.as_bytes()).and_then(|()| self.file.flush());
    }

    /// Notes a reading's outcome: an error is written once per source and message (the trace
    /// keeps its text).
    fn outcome<T, E: std::fmt::Display>(&mut self, t: f64, source: &'static str, result: Result<T, E>) -> Option<T> {
        match result {
            Ok(value) => {
                self.errors.remove(source);
                Some(value)
            }
            Err(error) => {
                let error = error.to_string();
                if self.errors.get(source) != Some(&error) {
                    self.errors.insert(source, error.clone());
                    self.write(&Record::Error(ErrorRecord { t, source: source.to_string(), error }));
                }
                None
            }
        }
    }

    fn sample(&mut self, t: f64) {
        let process = self.readings.process();
        let process = self.outcome(t, "process", process);
        let system = self.readings.system();
        let system = self.outcome(t, "system", system);
        let pressure = self.readings.pressure();
        let pressure = self.outcome(t, "pressure", pressure).flatten();
        let device = self.readings.device();
        let device = device.and_then(|result| self.outcome(t, "device", result));
        self.write(&Record::Sample(Sample {
            t,
            rss: process.map(|p| p.footprint.unwrap_or(p.rss)),
            rss_file: process.and_then(|p| p.rss_file),
            swap: process.and_then(|p| p.swap),
            hwm: process.and_then(|p| p.peak),
            available: system.as_ref().map(SystemMemory::budget_available),
            swap_used: system.as_ref().map(|s| s.swap_used),
            swap_total: system.as_ref().map(|s| s.swap_total),
            cgroup_usage: system.as_ref().and_then(|s| s.cgroup.as_ref().map(|c| c.usage)),
            cgroup_limit: system.as_ref().and_then(|s| s.cgroup.as_ref().map(|c| c.limit)),
            psi_some: pressure.map(|p| p.some_avg10),
            psi_full: pressure.map(|p| p.full_avg10),
            device_allocated: device.map(|d| d.allocated),
            device_reserved: device.map(|d| d.reserved),
        }));
    }

    /// Ends the window of `stage` at `t`: writes its exact peak and starts a new one.
    fn close_window(&mut self, t: f64, stage: String) {
        if !self.exact_peaks {
            return;
        }
        let peak = self.readings.process().map_err(|e| e.to_string());
        let device = self.readings.device().and_then(|result| self.outcome(t, "device", result)).and_then(|d| d.peak);
        if let Some(rss) = self.outcome(t, "peak", peak).and_then(|p| p.peak) {
            self.write(&Record::Peak(PeakRecord { t, stage, rss, device }));
        }
        let reset = self.readings.reset_peak();
        self.outcome(t, "peak", reset);
        if let Some(reset) = self.readings.reset_device_peak() {
            self.outcome(t, "device", reset);
        }
    }
}

impl Meter {
    /// Creates (or truncates) the trace at `path`, writes the header and a first sample, and
    /// starts sampling in the background.
    pub fn start(path: impl AsRef<Path>, options: MeterOptions) -> io::Result<Meter> {
        let path = path.as_ref();
        if let Some(folder) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            fs::create_dir_all(folder)?;
        }
        let file = File::create(path)?;
        let mut readings = options.readings;
        let exact_peaks = readings.reset_peak().is_ok();
        let total_memory = readings.system().map(|s| s.budget_total()).unwrap_or(0);
        let mut writer = Writer {
            file,
            readings,
            errors: HashMap::new(),
            window: "setup".to_string(),
            release_tail: None,
            exact_peaks,
            finished: false,
        };
        writer.write(&Record::Header(Header {
            schema: SCHEMA_VERSION,
            utc: humantime::format_rfc3339_seconds(SystemTime::now()).to_string(),
            pid: std::process::id(),
            host: nix::unistd::gethostname().map(|h| h.to_string_lossy().into_owned()).unwrap_or_default(),
            os: std::env::consts::OS.to_string(),
            total_memory,
            device: options.device,
            command: std::env::args().collect(),
            interval: options.interval.as_secs_f64(),
            meta: options.meta,
        }));
        let origin = Instant::now();
        writer.sample(0.0);
        let shared =
            Arc::new(Shared { origin, writer: Mutex::new(writer), stop: Mutex::new(false), wake: Condvar::new() });
        let background = shared.clone();
        let interval = options.interval;
        let thread = std::thread::Builder::new().name("stageload-meter".into()).spawn(move || loop {
            // Returns at once when finish() has already asked to stop, also while this thread
            // was sampling (the flag is looked at before waiting).
            let stop = crate::sync::lock(&background.stop);
            let (stop, _) = background
                .wake
                .wait_timeout_while(stop, interval, |stopped| !*stopped)
                .unwrap_or_else(|e| e.into_inner());
            if *stop {
                return;
            }
            // The flag's lock is let go before the sample's I/O: `finish` never waits for a write.
            drop(stop);
            let t = millis(background.origin.elapsed().as_secs_f64());
            background.lock().sample(t);
        })?;
        Ok(Meter { shared, thread: Mutex::new(Some(thread)) })
    }

    /// Seconds since the meter started, for `at`.
    pub fn t(&self, at: Instant) -> f64 {
        millis(at.saturating_duration_since(self.shared.origin).as_secs_f64())
    }

    /// Writes an event that ended at `at`, then a sample. `record.t` and `record.start` are set
    /// here.
    pub fn event(&self, at: Instant, mut record: EventRecord) {
        let t = self.t(at);
        record.t = t;
        record.start = record.seconds().map(|s| millis(t - s));
        let mut writer = self.shared.lock();
        if writer.finished {
            return;
        }
        match &record.what {
            What::Stage(entered) => {
                let previous = std::mem::replace(&mut writer.window, entered.stage.clone());
                writer.close_window(t, previous.clone());
                writer.release_tail = Some(previous);
            }
            What::Release(_) => {
                if let Some(previous) = writer.release_tail.clone() {
                    writer.close_window(t, previous);
                }
            }
            _ => writer.release_tail = None,
        }
        writer.write(&Record::Event(record));
        writer.sample(t);
    }

    /// A `mark` event with a label (for example "pipeline loaded").
    pub fn mark(&self, label: &str) {
        self.event(Instant::now(), Marked { note: label.into(), ..Marked::default() }.into());
    }

    /// Takes one sample now.
    pub fn sample(&self) {
        let t = self.t(Instant::now());
        self.shared.lock().sample(t);
    }

    /// Stops sampling, writes the last window's peak, a last sample and the `end` record.
    pub fn finish(&self) {
        *crate::sync::lock(&self.shared.stop) = true;
        self.shared.wake.notify_all();
        // Taken out of its lock first: the join waits for the thread's last sample, not the lock.
        let thread = crate::sync::lock(&self.thread).take();
        if let Some(thread) = thread {
            let _ = thread.join();
        }
        let t = self.t(Instant::now());
        let mut writer = self.shared.lock();
        if writer.finished {
            return;
        }
        let window = writer.window.clone();
        writer.close_window(t, window);
        writer.sample(t);
        writer.write(&Record::End { t });
        writer.finished = true;
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Writer> {
        crate::sync::lock(&self.writer)
    }
}

impl Drop for Meter {
    fn drop(&mut self) {
        self.finish();
    }
}

/// A registry's events go into the trace (each followed by a sample).
impl EventSink for Meter {
    fn emit(&self, event: &Event) {
        self.event(event.at.unwrap_or_else(Instant::now), event.clone());
    }
}

/// The environment variable through which a runner (`stageload ab`) gives each run its own trace
/// file; the demos' `--trace` defaults to it.
pub const TRACE_ENV: &str = "STAGELOAD_TRACE";
/// The same for the run's latents file (`stageload::latents::Latents::with_env` reads it).
pub const LATENTS_ENV: &str = "STAGELOAD_LATENTS";
/// The same for the run's result file: a JSON object of what the run measured, whose numeric
/// fields `stageload ab` takes the medians of (the demos' `--result` defaults to it).
pub const RESULT_ENV: &str = "STAGELOAD_RESULT";
/// The metadata key under which a latents file lists its latents in the order recorded (one name
/// per line): `stageload::latents` writes it, `stageload latents` reads it.
pub const LATENTS_ORDER_KEY: &str = "stageload.latents.order";
