//! A streamed model's steps: each begins by freeing what the split no longer holds, runs the
//! forward (again, with one block more streamed or the hot set given up, after an
//! out-of-memory), and ends by keeping the split under the budget with the working memory it
//! measured; each change is announced (a log line and a `residency` event). Nothing here takes a
//! lock (see [`super::streamer`]).

use std::sync::atomic::Ordering;
use std::time::Instant;

use stageload_trace::event::{Event, Residency, ResidencyChanged};
use tch::Device;

use super::split::{evict, refit, Refit};
use super::step::Step;
use super::streamer::StreamedModel;
use super::StreamError;
use crate::error::{is_out_of_memory, panic_message};

impl StreamedModel {
    /// Runs one step of the forward: `f` calls [`Step::block`] before each block. On an
    /// out-of-memory (an error or panic of `f` saying so) the hot set is given up, else one more
    /// block is streamed, and `f` runs again, so `f` should compute from its inputs only (draw noise outside it). Other
    /// errors and panics come back as errors; the model stays usable.
    pub fn run<R>(&mut self, mut f: impl FnMut(&mut Step<'_>) -> Result<R, StreamError>) -> Result<R, StreamError> {
        loop {
            if let Err(err) = self.begin() {
                // A read carried into this step may be in flight again: nothing is, after.
                let _ = self.memory.join_ahead(&self.setting);
                return Err(err);
            }
            let base = self.measure_point();
            let peak = self.peak_now();
            let (started, waited) = (Instant::now(), self.memory.stats.waited_seconds);
            let mut step =
                Step { model: &mut *self, active: None, base, peak, most_held: 0, working: 0, streamed_yet: false };
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&mut step)));
            let working = step.finish();
            // A read ahead still in flight is carried to the next step after a step that ran.
            let tidy = match (&outcome, &working) {
                (Ok(Ok(_)), Ok(_)) => self.memory.carry(&self.setting),
                _ => self.memory.join_ahead(&self.setting),
            };
            let working = working.and_then(|working| tidy.map(|()| working));
            let error = match outcome {
                Ok(Ok(result)) => {
                    let working = working?;
                    self.memory.stats.steps += 1;
                    let waited = self.memory.stats.waited_seconds - waited;
                    let seconds = started.elapsed().as_secs_f64();
                    self.setting.reads.after_step(waited, seconds);
                    self.after_step(working);
                    return Ok(result);
                }
                Ok(Err(error)) => error,
                Err(panic) => StreamError::Step { model: self.setting.name.clone(), message: panic_message(&*panic) },
            };
            // The step's own error says more than a failure to tidy up after it.
            drop(working);
            let message = error.to_string();
            if !is_out_of_memory(&message) {
                return Err(error);
            }
            match evict(&self.setting.sizes, self.setting.split) {
                Some(next) => {
                    self.memory.stats.retries += 1;
                    if let Device::Cuda(_) = self.setting.device {
                        let _ = stageload_torch_sys::cuda_empty_cache();
                    }
                    self.set_split(next, "out of memory", None);
                }
                None => {
                    // The error's first line; libtorch appends its C++ backtrace.
                    let message = message.lines().next().unwrap_or_default().to_string();
                    return Err(StreamError::OutOfMemory {
                        model: self.setting.name.clone(),
                        residency: self.residency(),
                        message,
                    });
                }
            }
        }
    }

    /// Frees what the split no longer holds (a block that became resident leaves its slot and
    /// comes back from the allocator; streamed blocks a shrunk split still held go; hot blocks
    /// past a shrunk room go, weakest first), sizes the slots for it and, in order, starts the
    /// first streamed block's refill (unless a read carried from the step before has it,
    /// [`super::slots`], or the forward names its blocks itself).
    fn begin(&mut self) -> Result<(), StreamError> {
        if let Some(next) = self.readings.by_available(&self.setting.sizes, self.setting.split) {
            self.set_split(next, "memory pressure", None);
        }
        if let Some(next) = self.readings.by_pressure(&self.setting.sizes, self.setting.split) {
            self.set_split(next, "memory pressure (PSI)", None);
        }
        self.memory.resume_carried(&self.setting, true)?;
        self.let_go()?;
        if self.setting.guesses_by_index() {
            self.memory.start_ahead(&self.setting, self.setting.split.resident, None);
        }
        self.note_held();
        Ok(())
    }

    /// Frees what the split no longer holds: hot blocks past the room (weakest first), and
    /// every streamed block not kept hot or still in a slot (a read carried from the step
    /// before stays when the step's start took it, [`super::slots`]); then sizes the slots for
    /// the split. Nothing may run on the blocks.
    pub(super) fn let_go(&mut self) -> Result<(), StreamError> {
        self.memory.resume_carried(&self.setting, false)?;
        for victim in self.memory.hot.over(&self.setting.sizes.blocks, self.setting.split.hot, &[]) {
            self.memory.drop_hot(&self.setting, victim)?;
        }
        for index in 0..self.memory.blocks.len() {
            if !self.setting.split.is_streamed(index) {
                // Resident now: its memory stays, wherever it came from.
                self.memory.hot.drop_block(index, self.setting.sizes.blocks[index]);
            }
            if (self.memory.passes(&self.setting, index) || self.memory.blocks[index].slot.is_some())
                && !self.memory.slots.is_carried(index)
            {
                self.memory.release(&self.setting, index)?;
            }
        }
        self.memory.fit_slots(&self.setting)
    }

    fn after_step(&mut self, working: u64) {
        self.memory.hot.decay();
        if working <= self.working {
            return;
        }
        self.working = working;
        match refit(&self.setting.sizes, self.setting.split, self.budget, working) {
            Refit::Keep => {}
            Refit::Shrink(next) => self.set_split(next, "working memory", None),
            Refit::Over { split, over } => self.set_split(split, "working memory", Some(over)),
        }
    }

    /// Logs the residency line and sends the event.
    pub(super) fn announce(&self, reason: &str, over: Option<u64>) {
        self.publish_holding();
        let mut line = self.residency();
        if let Some(over) = over {
            line += &format!(
                "; a step needs {} more than the budget of {} even so",
                stageload_units::format_bytes(over),
                stageload_units::format_bytes(self.budget)
            );
            tracing::warn!("{line}");
        } else {
            tracing::info!("{line} ({reason})");
        }
        self.residency_event(reason, line, |_| {});
    }

    /// Tells the registry (a planned model's) what the split holds now.
    pub(super) fn publish_holding(&self) {
        if let Some(held) = &self.held_for_registry {
            held.store(
                self.setting.sizes.holding(self.setting.split, self.setting.order.any()).held,
                Ordering::Relaxed,
            );
        }
    }

    /// Sends an `end` residency event with the model's totals (when it goes).
    pub(super) fn announce_totals(&self) {
        let stats = self.memory.stats;
        self.residency_event("end", self.residency(), |change| {
            (change.bytes, change.seconds) = (Some(stats.bytes_refilled), Some(stats.refill_seconds));
            (change.residency.refills, change.residency.hot_hits) = (stats.refills, stats.hot_hits);
        });
    }

    /// A `residency` event with the split now, `line` as its note, finished by `finish`.
    fn residency_event(&self, reason: &str, line: String, finish: impl FnOnce(&mut ResidencyChanged)) {
        let Some(sink) = &self.sink else { return };
        let mut change =
            ResidencyChanged { model: self.setting.name.clone(), note: line, ..ResidencyChanged::default() };
        change.residency = Residency {
            blocks: self.setting.split.blocks,
            resident: self.setting.split.resident,
            streamed_per_step: self.setting.sizes.streamed_per_step(self.setting.split.resident),
            hot: self.setting.split.hot,
            budget: self.budget,
            working: self.working,
            held: self.held_bytes(),
            pinned: self.pinned_bytes(),
            reason: reason.to_string(),
            ..Residency::default()
        };
        finish(&mut change);
        sink.emit(&Event::now(change));
    }

    /// The high-water mark of the memory steps are measured in, now.
    pub(super) fn peak_now(&mut self) -> Option<u64> {
        self.readings.peak()
    }

    /// The reading and the weights held now (the block in flight ahead left out: its refill
    /// may not have taken its memory yet), for working-memory estimates.
    pub(super) fn measure_point(&mut self) -> Option<(u64, u64)> {
        let reading = self.readings.memory()?;
        Some((reading, self.held_outside_ahead()))
    }
}
