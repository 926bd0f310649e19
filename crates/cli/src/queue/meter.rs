//! A queued run's trace, in the project's trace schema (`stageload summary`, `plot` and `plan
//! --from-trace` read it): the trace crate's meter, its process readings taken over every process
//! below this one (the command and whatever it started: the run is a child subreaper, so the
//! ones that left its group are there too), summed.

use std::io;
use std::path::{Path, PathBuf};

use serde_json::Value;
use stageload_probe::{Probe, ProbeError, ProcessMemory, SystemMemory};
use stageload_trace::summary::Swap;
use stageload_trace::{read_trace, summarize, Meter, MeterOptions, MeterReadings};

/// The memory of every live process below `root`, summed, and the machine's, read through a
/// [`Probe`] (their files kept open between samples).
struct Tree {
    root: i32,
    probe: Probe,
}

fn add(total: &mut Option<u64>, part: Option<u64>) {
    if let Some(part) = part {
        *total = Some(total.unwrap_or(0).saturating_add(part));
    }
}

impl MeterReadings for Tree {
    fn process(&mut self) -> Result<ProcessMemory, ProbeError> {
        let members = self.probe.subtree(self.root)?;
        let mut sum = ProcessMemory {
            rss: 0,
            rss_anon: None,
            rss_file: None,
            swap: None,
            peak: None,
            footprint: None,
            locked: None,
            pinned: None,
        };
        // A member that ended between the listing and its reading counts as nothing.
        for memory in members
            .iter()
            .filter(|m| !m.zombie && m.pid != self.root)
            .filter_map(|m| self.probe.process_memory(m.pid).ok())
        {
            sum.rss = sum.rss.saturating_add(memory.rss);
            add(&mut sum.rss_anon, memory.rss_anon);
            add(&mut sum.rss_file, memory.rss_file);
            add(&mut sum.swap, memory.swap);
            add(&mut sum.footprint, memory.footprint);
        }
        Ok(sum)
    }

    fn system(&mut self) -> Result<SystemMemory, ProbeError> {
        self.probe.system_memory()
    }

    fn reset_peak(&mut self) -> Result<(), ProbeError> {
        // No kernel high-water mark covers a tree: samples only, no `peak` records.
        Err(ProbeError::Unsupported("a high-water mark over a process tree"))
    }
}

/// A running meter and its file.
pub struct RunMeter {
    meter: Meter,
    path: PathBuf,
}

/// What the history keeps of a run's trace.
#[derive(Debug, Default, Clone, Copy)]
pub struct Footprint {
    /// The most resident memory the command's processes held together at a sample.
    pub peak_rss: Option<u64>,
    /// System swap at the start, its most, at the end.
    pub swap: Option<Swap>,
    /// The least memory available at a sample.
    pub min_available: Option<u64>,
}

/// Starts metering the processes below this one into `path` (created with its folders),
/// `meta` in the header.
pub fn start(path: &Path, meta: Value) -> io::Result<RunMeter> {
    let mut options = MeterOptions::default().readings(Tree { root: std::process::id() as i32, probe: Probe::new() });
    if let Value::Object(fields) = meta {
        options.meta = fields;
    }
    Ok(RunMeter { meter: Meter::start(path, options)?, path: path.to_path_buf() })
}

impl RunMeter {
    /// Ends the trace and reads back what the history keeps of it.
    pub fn finish(self) -> Footprint {
        self.meter.finish();
        let Ok(trace) = read_trace(&self.path) else {
            return Footprint::default();
        };
        let summary = summarize(&trace);
        Footprint {
            peak_rss: Some(summary.peak).filter(|peak| *peak > 0),
            swap: summary.swap,
            min_available: summary.min_available,
        }
    }
}
