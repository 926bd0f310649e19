//! What a streamed model reads of the machine: the memory a step is measured in and its
//! high-water mark, and the two governors that stream more when the machine needs memory back
//! (memory available below a floor; memory pressure at a threshold). One owner, [`Readings`];
//! what a reading does to the split is the pure [`stageload_plan::split`] ([`govern`],
//! [`relieve`]). Nothing here takes a lock: the model is `&mut` for a step.

use std::time::Instant;

use tch::Device;

use super::split::{govern, relieve, Sizes, Split};

/// A reading in bytes (`None`: it cannot be read now).
pub(super) type Reading = Box<dyn FnMut() -> Option<u64> + Send>;

/// A reading of memory pressure, in percent of time stalled.
pub(super) type PressureReading = Box<dyn FnMut() -> Option<f64> + Send>;

/// The readings a streamed model takes before steps and at block boundaries.
pub(super) struct Readings {
    /// What a step's working memory is read from: the CUDA allocator's bytes on the model's
    /// device, else the process's RSS.
    memory: Reading,
    /// The high-water mark of the same memory (VmHWM; the CUDA allocator's peak), which sees
    /// the transients inside a block that boundary readings miss. Never reset here: a meter
    /// resets it per stage; a step that raises it says how high it went.
    peak: Reading,
    /// The governor: (bytes the machine must keep available, what it has available now).
    governor: Option<(u64, Reading)>,
    /// The governor on memory pressure (PSI).
    pressure: Option<PressureGovernor>,
}

/// The governor on memory pressure: the threshold (percent), the reading, when it last acted.
struct PressureGovernor {
    threshold: f64,
    reading: PressureReading,
    last: Option<Instant>,
}

impl Readings {
    /// The readings of a model on `device`, without governors.
    pub(super) fn of(device: Device) -> Self {
        let (memory, peak): (Reading, Reading) = match device {
            Device::Cuda(index) => (
                Box::new(move || stageload_torch_sys::cuda_memory(index).ok().map(|m| m.allocated)),
                Box::new(move || stageload_torch_sys::cuda_memory(index).ok().map(|m| m.peak_allocated)),
            ),
            _ => {
                let pid = std::process::id() as i32;
                (
                    Box::new(move || stageload_probe::process_memory(pid).ok().map(|m| m.rss)),
                    Box::new(move || stageload_probe::process_memory(pid).ok().and_then(|m| m.peak)),
                )
            }
        };
        Readings { memory, peak, governor: None, pressure: None }
    }

    /// The memory a step is measured in, now.
    pub(super) fn memory(&mut self) -> Option<u64> {
        (self.memory)()
    }

    /// Its high-water mark, now.
    pub(super) fn peak(&mut self) -> Option<u64> {
        (self.peak)()
    }

    /// Reads the memory from `memory` instead, with no high-water mark.
    pub(super) fn set_memory(&mut self, memory: Reading) {
        self.memory = memory;
        self.peak = Box::new(|| None);
    }

    /// Reads the high-water mark from `peak`.
    pub(super) fn set_peak(&mut self, peak: Reading) {
        self.peak = peak;
    }

    /// The governor: at least `floor` bytes `available`.
    pub(super) fn set_governor(&mut self, floor: u64, available: Reading) {
        self.governor = Some((floor, available));
    }

    /// The governor on pressure: below `threshold` percent by `reading`.
    pub(super) fn set_pressure(&mut self, threshold: f64, reading: PressureReading) {
        self.pressure = Some(PressureGovernor { threshold, reading, last: None });
    }

    /// The split the governor asks for now, if the machine has less than its floor available.
    pub(super) fn by_available(&mut self, sizes: &Sizes, split: Split) -> Option<Split> {
        let (floor, available) = self.governor.as_mut()?;
        available().and_then(|now| govern(sizes, split, now, *floor))
    }

    /// The split the pressure governor asks for now, if the pressure is at its threshold and it
    /// did not act within its window; it notes that it acted.
    pub(super) fn by_pressure(&mut self, sizes: &Sizes, split: Split) -> Option<Split> {
        let governor = self.pressure.as_mut()?;
        let since = governor.last.map(|at| at.elapsed());
        let relief = (governor.reading)().and_then(|now| relieve(sizes, split, now, governor.threshold, since))?;
        governor.last = Some(Instant::now());
        Some(relief)
    }
}
