//! Checkpoint → CUDA through the pinned ring of [`crate::device_copy`]: reader threads `pread`
//! pieces into ring slots while this thread issues each piece's asynchronous copy (and, when
//! the dtypes differ, a conversion on the device through a staging buffer), slots reused as the
//! events after their copies complete.

use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use tch::{Device, Kind, Tensor};

use super::{Checkpoint, CheckpointError, Entry, PieceWait};
use crate::device_copy;
use crate::pinned::HostCopyError;
use crate::sync::lock;

/// Where the ring's pipeline stands: which pieces are read (and how), how many copies are
/// issued, the event after the last copy out of each slot.
struct Flow {
    read: Vec<Option<Result<(), CheckpointError>>>,
    issued: usize,
    fences: Vec<Option<Arc<stageload_torch_sys::CudaEvent>>>,
    stopped: bool,
}

impl Checkpoint {
    /// Copies entries into contiguous CUDA targets through the pinned ring (see
    /// [`crate::device_copy`]). `Ok(Err(reason))` when no host memory could be pinned: nothing
    /// was copied, the caller takes the pageable path.
    pub(super) fn copy_to_cuda(
        &self,
        items: &[(&str, &Tensor, &Entry)],
        done: &AtomicU64,
        progress: &mut dyn FnMut(u64),
    ) -> Result<Result<(), HostCopyError>, CheckpointError> {
        let mut devices: Vec<usize> = items
            .iter()
            .filter_map(|(_, t, _)| match t.device() {
                Device::Cuda(i) => Some(i),
                _ => None,
            })
            .collect();
        devices.sort_unstable();
        devices.dedup();
        for index in devices {
            let on_this: Vec<&(&str, &Tensor, &Entry)> =
                items.iter().filter(|(_, t, _)| t.device() == Device::Cuda(index)).collect();
            let copied = device_copy::with_ring(|ring| {
                tch::no_grad(|| self.copy_through_ring(ring, index, &on_this, done, progress))
            });
            match copied {
                Ok(result) => result?,
                Err(reason) => return Ok(Err(reason)),
            }
        }
        Ok(Ok(()))
    }

    /// The pipeline: reader threads take pieces in order and `pread` each into slot
    /// `piece % slots` once the copy that last read that slot is done (its event); this thread
    /// issues each piece's asynchronous copy as soon as it is read, in order, and records an
    /// event after it. Reads and copies overlap continuously; at most one ring of pieces is in
    /// flight.
    fn copy_through_ring(
        &self,
        ring: &mut device_copy::Ring,
        index: usize,
        items: &[&(&str, &Tensor, &Entry)],
        done: &AtomicU64,
        progress: &mut dyn FnMut(u64),
    ) -> Result<(), CheckpointError> {
        let work: Vec<(usize, device_copy::Piece)> = items
            .iter()
            .enumerate()
            .flat_map(|(i, (_, target, entry))| {
                device_copy::pieces(
                    target.numel(),
                    entry.kind.elt_size_in_bytes(),
                    device_copy::RingShape::get().window,
                )
                .into_iter()
                .map(move |p| (i, p))
            })
            .collect();
        let slots: Vec<usize> = ring.slots.iter().map(|t| t.data_ptr() as usize).collect();
        let n = slots.len();
        let reads: Vec<(&str, &Entry, u64, usize)> = work
            .iter()
            .map(|(i, piece)| {
                let (name, _, entry) = *items[*i];
                let size = entry.kind.elt_size_in_bytes();
                (name, entry, entry.start + (piece.first * size) as u64, piece.count * size)
            })
            .collect();
        let flow = Mutex::new(Flow {
            read: (0..reads.len()).map(|_| None).collect(),
            issued: 0,
            fences: vec![None; n],
            stopped: false,
        });
        let changed = Condvar::new();
        let next = AtomicUsize::new(0);
        let workers = device_copy::RingShape::get().readers.min(n).min(reads.len()).max(1);
        let result = std::thread::scope(|scope| {
            for _ in 0..workers {
                scope.spawn(|| loop {
                    let j = next.fetch_add(1, Ordering::Relaxed);
                    let Some(&(name, entry, offset, length)) = reads.get(j) else { return };
                    let fence = {
                        let mut flow = lock(&flow);
                        while !flow.stopped && j >= n && flow.issued <= j - n {
                            flow = crate::sync::wait(&changed, flow);
                        }
                        if flow.stopped {
                            return;
                        }
                        flow.fences[j % n].clone()
                    };
                    let outcome = match fence.map(|f| f.synchronize()) {
                        Some(Err(e)) => Err(self.stream_error(name, entry, e)),
                        _ => {
                            // SAFETY: a ring slot of `window` bytes, length ≤ window; its last copy is
                            // done (event above); no other piece uses it until this one's copy is issued.
                            let memory = unsafe { std::slice::from_raw_parts_mut(slots[j % n] as *mut u8, length) };
                            self.handles[entry.file]
                                .read_exact_at(memory, offset)
                                .map_err(|e| self.read_error(name, entry, e))
                        }
                    };
                    lock(&flow).read[j] = Some(outcome);
                    changed.notify_all();
                });
            }
            let stop = |err: CheckpointError| {
                lock(&flow).stopped = true;
                changed.notify_all();
                Err(err)
            };
            for (j, (i, piece)) in work.iter().enumerate() {
                // The ring is this load's until it ends: no pause here, only a stop.
                if let Err(stopped) = self.go_on(PieceWait::MustNot) {
                    return stop(stopped);
                }
                let outcome = {
                    let mut flow = lock(&flow);
                    loop {
                        if let Some(outcome) = flow.read[j].take() {
                            break outcome;
                        }
                        flow = crate::sync::wait(&changed, flow);
                    }
                };
                if let Err(err) = outcome {
                    return stop(err);
                }
                let (name, target, entry) = *items[*i];
                crate::copy_watch::piece();
                if let Err(err) = self.issue_copy(ring, index, name, target, entry, *piece, j % n) {
                    return stop(err);
                }
                let fence = match stageload_torch_sys::CudaEvent::record(index) {
                    Ok(fence) => Arc::new(fence),
                    Err(e) => return stop(self.stream_error(name, entry, e)),
                };
                {
                    let mut flow = lock(&flow);
                    flow.fences[j % n] = Some(fence);
                    flow.issued = j + 1;
                }
                changed.notify_all();
                let bytes = (piece.count * target.kind().elt_size_in_bytes()) as u64;
                progress(done.fetch_add(bytes, Ordering::Relaxed) + bytes);
            }
            Ok(())
        });
        // Nothing may still read the ring when it is handed to the next load.
        let synced = stageload_torch_sys::cuda_sync_current_stream(index);
        result?;
        match (reads.last(), synced) {
            (Some(&(name, entry, ..)), Err(e)) => Err(self.stream_error(name, entry, e)),
            _ => Ok(()),
        }
    }

    /// Enqueues the copy of one piece, read into ring slot `slot`, into its target (through the
    /// staging buffer and a conversion on the device when the dtypes differ).
    #[allow(clippy::too_many_arguments)]
    fn issue_copy(
        &self,
        ring: &mut device_copy::Ring,
        index: usize,
        name: &str,
        target: &Tensor,
        entry: &Entry,
        piece: device_copy::Piece,
        slot: usize,
    ) -> Result<(), CheckpointError> {
        let copy_error =
            |source| CheckpointError::Copy { tensor: name.to_string(), path: self.files[entry.file].clone(), source };
        let length = (piece.count * entry.kind.elt_size_in_bytes()) as i64;
        let source = ring.slots[slot].f_narrow(0, 0, length).map_err(copy_error)?;
        let destination = target
            .f_view([-1])
            .and_then(|t| t.f_narrow(0, piece.first as i64, piece.count as i64))
            .map_err(copy_error)?;
        if target.kind() == entry.kind {
            let bytes_view = destination.f_view_dtype(Kind::Uint8).map_err(copy_error)?;
            return stageload_torch_sys::copy_async(&bytes_view, &source)
                .map_err(|e| self.stream_error(name, entry, e));
        }
        let staging = ring.staging(index).and_then(|s| s.f_narrow(0, 0, length)).map_err(copy_error)?;
        stageload_torch_sys::copy_async(&staging, &source).map_err(|e| self.stream_error(name, entry, e))?;
        // Ordered after the copy on the same stream; converts on the device.
        destination
            .shallow_clone()
            .f_copy_(&staging.f_view_dtype(entry.kind).map_err(copy_error)?)
            .map_err(copy_error)?;
        Ok(())
    }

    fn stream_error(&self, name: &str, entry: &Entry, source: stageload_torch_sys::ShimError) -> CheckpointError {
        CheckpointError::Stream { tensor: name.to_string(), path: self.files[entry.file].clone(), source }
    }
}
