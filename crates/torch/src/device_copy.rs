//! Checkpoint entries into CUDA tensors at copy-engine speed: a ring of pinned host buffers.
//!
//! A host→device copy from pageable memory runs at 5.5–8 GB/s on the H200 machine; from pinned
//! memory at 55 GB/s, and pinning costs ~0.8 s per GiB. So the process pins one ring of
//! [`RingShape::slots`] buffers of [`WINDOW`] bytes once (on the first CUDA load) and reuses it. Each entry
//! is cut into pieces of at most one buffer ([`pieces`]), and the loader
//! ([`crate::checkpoint`]) runs them as a pipeline: reader threads `pread` piece `j` into buffer
//! `j % slots` once the CUDA event recorded after the copy that last read that buffer has
//! passed; the loading thread issues each piece's asynchronous copy, in order, as soon as it is
//! read. Entries whose dtype differs from the target's go through one device staging buffer of
//! [`WINDOW`] bytes and are converted on the device. No host copy of the model, no device memory
//! beyond the staging buffer.

use std::sync::{Mutex, OnceLock};

use stageload_torch_sys::ShimError;
use tch::{Device, Kind, Tensor};

use crate::pinned::{HostCopyError, LibtorchError};
use crate::sync::lock;

/// Bytes of one pinned buffer (and of the largest piece) by default, and of the buffer that CPU
/// conversions read through.
pub const WINDOW: usize = 16 << 20;

/// The ring's shape: its pinned buffers, the bytes of each (the largest piece), and the reader
/// threads. By default two buffers per CPU (at most 16 CPUs), so that every CPU reads a piece
/// into one half while the GPU copies the other half out (512 MiB pinned on the 16-core H200
/// machine, 64 MiB on 2 cores), of 16 MiB (`WINDOW`), one reader per CPU. For measuring what the
/// pipeline waits on, `STAGELOAD_RING="slots=N,window=SIZE,readers=N"` (any of the three) sets
/// it for the process, read once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingShape {
    /// Pinned host buffers in the ring.
    pub slots: usize,
    /// Bytes of each buffer (the largest piece of an entry).
    pub window: usize,
    /// Threads reading pieces from the file.
    pub readers: usize,
}

/// Why a ring shape's text (`STAGELOAD_RING`) was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RingShapeError {
    /// A part is not `key=value`.
    #[error("'{0}' is not key=value")]
    NotKeyValue(String),
    /// A count is not a whole number above 0.
    #[error("{key}: '{value}' is not a count above 0")]
    NotACount {
        /// `slots` or `readers`.
        key: &'static str,
        /// The text given.
        value: String,
    },
    /// The window is not a size from 4 KiB to 1 GiB.
    #[error("window: {value} is not from 4 KiB to 1 GiB")]
    Window {
        /// The text given.
        value: String,
    },
    /// The key is none of the three.
    #[error("unknown key '{0}' (slots, window, readers)")]
    UnknownKey(String),
}

impl RingShape {
    /// The default for a machine of `cpus` CPUs.
    pub fn default_for(cpus: usize) -> RingShape {
        RingShape { slots: 2 * cpus.clamp(2, 16), window: WINDOW, readers: cpus.max(1) }
    }

    /// `default` changed by `text` (`slots=N,window=SIZE,readers=N`, any of them, any order).
    pub fn parse(text: &str, default: RingShape) -> Result<RingShape, RingShapeError> {
        let mut shape = default;
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (key, value) = part.split_once('=').ok_or_else(|| RingShapeError::NotKeyValue(part.to_string()))?;
            let count = |key: &'static str| {
                value
                    .trim()
                    .parse::<usize>()
                    .ok()
                    .filter(|&n| n > 0)
                    .ok_or_else(|| RingShapeError::NotACount { key, value: value.to_string() })
            };
            match key.trim() {
                "slots" => shape.slots = count("slots")?,
                "readers" => shape.readers = count("readers")?,
                "window" => {
                    shape.window = stageload_units::parse_size(value)
                        .ok()
                        .and_then(|bytes| usize::try_from(bytes).ok())
                        .filter(|&b| (4096..=1 << 30).contains(&b))
                        .ok_or_else(|| RingShapeError::Window { value: value.trim().to_string() })?;
                }
                other => return Err(RingShapeError::UnknownKey(other.to_string())),
            }
        }
        Ok(shape)
    }

    /// The process's shape: `STAGELOAD_RING` over the default, read once (a value that does not
    /// parse is said once and the default used).
    pub fn get() -> RingShape {
        static SHAPE: OnceLock<RingShape> = OnceLock::new();
        *SHAPE.get_or_init(|| {
            let default = RingShape::default_for(std::thread::available_parallelism().map_or(1, |n| n.get()));
            match std::env::var("STAGELOAD_RING") {
                Ok(text) => RingShape::parse(&text, default).unwrap_or_else(|why| {
                    tracing::warn!(%why, "STAGELOAD_RING ignored: the default ring is used");
                    default
                }),
                Err(_) => default,
            }
        })
    }
}

/// One piece of an entry: `count` elements from element `first`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    pub first: usize,
    pub count: usize,
}

/// Cuts `elements` elements of `element_bytes` each into pieces of at most `window` bytes.
pub fn pieces(elements: usize, element_bytes: usize, window: usize) -> Vec<Piece> {
    let per_piece = (window / element_bytes.max(1)).max(1);
    (0..elements).step_by(per_piece).map(|first| Piece { first, count: per_piece.min(elements - first) }).collect()
}

/// `dst.copy_(src)` for every pair, asynchronous on a side stream of CUDA device `index`, and
/// waited for at its end (a recorded event): the sources are pinned host memory (or the
/// targets are, copying back), and the caller's stream is free to run kernels meanwhile.
pub(crate) fn copy_on_side_stream(pairs: &[(&Tensor, &Tensor)], index: usize) -> Result<(), ShimError> {
    let _side = stageload_torch_sys::cuda_side_stream(index)?;
    copy_and_wait(pairs, index)
}

/// `dst.copy_(src)` for every pair, asynchronous on this thread's current stream of CUDA device
/// `index`, and waited for at its end (a recorded event).
fn copy_and_wait(pairs: &[(&Tensor, &Tensor)], index: usize) -> Result<(), ShimError> {
    copy_queued(pairs, index)?.synchronize()
}

/// `dst.copy_(src)` for every pair, queued on this thread's current stream of CUDA device
/// `index`, and the event after the last of them; the host does not wait (the sources must stay
/// untouched until the event has passed).
pub(crate) fn copy_queued(
    pairs: &[(&Tensor, &Tensor)],
    index: usize,
) -> Result<stageload_torch_sys::CudaEvent, ShimError> {
    let _watched = crate::copy_watch::copying(pairs.iter().flat_map(|(dst, src)| [*dst, *src]));
    for (dst, src) in pairs {
        crate::copy_watch::piece();
        stageload_torch_sys::copy_async(dst, src)?;
    }
    stageload_torch_sys::CudaEvent::record(index)
}

/// The pinned ring, allocated once per process; `None` when pinning failed (no driver).
pub(crate) struct Ring {
    pub(crate) slots: Vec<Tensor>,
    /// A device buffer for converting pieces, per device index.
    staging: Vec<(usize, Tensor)>,
}

static RING: OnceLock<Mutex<Option<Ring>>> = OnceLock::new();

/// An uninitialised host tensor of `size` and `kind` in pinned (page-locked) memory; `Err` with
/// libtorch's reason where memory cannot be pinned (no driver).
pub(crate) fn pinned_empty(size: &[i64], kind: Kind) -> Result<Tensor, LibtorchError> {
    let host = Tensor::f_empty(size, (kind, Device::Cpu))?;
    Ok(stageload_torch_sys::pin_memory(&host)?)
}

/// Runs `f` with the process's pinned ring (pinned on first use); `Err` with the
/// reason when host memory cannot be pinned, so the caller falls back to pageable copies.
pub(crate) fn with_ring<R>(f: impl FnOnce(&mut Ring) -> R) -> Result<R, HostCopyError> {
    let cell = RING.get_or_init(|| Mutex::new(None));
    let mut ring = lock(cell);
    if ring.is_none() {
        let RingShape { slots: count, window, .. } = RingShape::get();
        let mut slots = Vec::with_capacity(count);
        for _ in 0..count {
            let slot = pinned_empty(&[window as i64], Kind::Uint8).map_err(|source| HostCopyError::Allocate {
                bytes: (count as u64).saturating_mul(window as u64),
                pinned: true,
                source,
            })?;
            slots.push(slot);
        }
        *ring = Some(Ring { slots, staging: Vec::new() });
    }
    Ok(f(ring.as_mut().expect("allocated above")))
}

impl Ring {
    /// The staging buffer on CUDA device `index`.
    pub(crate) fn staging(&mut self, index: usize) -> Result<&Tensor, tch::TchError> {
        if let Some(position) = self.staging.iter().position(|(i, _)| *i == index) {
            return Ok(&self.staging[position].1);
        }
        let buffer = Tensor::f_empty([RingShape::get().window as i64], (Kind::Uint8, Device::Cuda(index)))?;
        self.staging.push((index, buffer));
        Ok(&self.staging.last().expect("pushed").1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ring_shape_changes_only_what_its_text_names_and_refuses_what_it_cannot_use() {
        let default = RingShape::default_for(16);
        assert_eq!(default, RingShape { slots: 32, window: WINDOW, readers: 16 });
        assert_eq!(RingShape::default_for(1).slots, 4, "two per CPU, at least two CPUs' worth");
        assert_eq!(RingShape::parse("", default), Ok(default));
        assert_eq!(
            RingShape::parse("window=32M, slots=8", default),
            Ok(RingShape { slots: 8, window: 32 << 20, readers: 16 })
        );
        assert_eq!(RingShape::parse("readers=4", default).unwrap().readers, 4);
        for (text, why) in [
            ("slots=0", "slots: '0' is not a count above 0"),
            ("window=1K", "window: 1K is not from 4 KiB to 1 GiB"),
            ("window=2G", "not from 4 KiB to 1 GiB"),
            ("speed=fast", "unknown key 'speed'"),
            ("slots", "'slots' is not key=value"),
        ] {
            let err = RingShape::parse(text, default).unwrap_err().to_string();
            assert!(err.contains(why), "{text}: {err}");
        }
    }

    #[test]
    fn an_entry_is_cut_into_window_sized_pieces_on_element_boundaries() {
        assert_eq!(
            pieces(10, 4, 16),
            [Piece { first: 0, count: 4 }, Piece { first: 4, count: 4 }, Piece { first: 8, count: 2 }]
        );
        assert_eq!(pieces(3, 2, 1 << 20), [Piece { first: 0, count: 3 }], "a small entry is one piece");
        assert!(pieces(0, 4, 16).is_empty(), "an empty entry has no piece");
        assert_eq!(pieces(5, 8, 4).len(), 5, "an element larger than the window still moves, one per piece");
        let big = pieces(100_000_000, 2, WINDOW);
        assert_eq!(big.iter().map(|p| p.count).sum::<usize>(), 100_000_000);
        assert!(big.iter().all(|p| p.count * 2 <= WINDOW));
    }
}
