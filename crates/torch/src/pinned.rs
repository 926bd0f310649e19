//! Host memory for copies bound to a device, at its exact size: one buffer per set of copies (a
//! model's in the host tier, a streamed model's blocks), carved into tensors, from a mapping of
//! its own (`stageload_torch_sys::host_buffer`: whole pages, page-locked by `cudaHostRegister`)
//! instead of libtorch's caching host allocator, which rounds every block up to a power of two
//! (2.25 GiB asked, 4 GiB pinned, others measured on torch 2.13). What a set books
//! ([`booked`]) is what the machine gives it, and it goes back when the last tensor carved from
//! it goes. Where memory cannot be pinned the buffer is pageable, said once per process.
//!
//! The allocator is behind [`HostMemory`] so that the tier's accounting is tested against a
//! fake that counts what is taken and given back ([`Mapped`] is the real one). The host tier's
//! copies bound to CUDA come first from its registered arena ([`arena`], [`carve_in_arena`]),
//! where a store is only the copy; a buffer of their own is the fallback.

mod arena;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use stageload_torch_sys::ShimError;
use tch::{Kind, TchError, Tensor};

use crate::checkpoint::error::CheckpointError;

pub(crate) use arena::{Arena, MachineRoom, Refused, Registered};

/// What went wrong with host memory for copies bound to a device (the host tier's, a streamed
/// model's pinned blocks, the checkpoint's pinned ring), or with a copy through it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HostCopyError {
    /// A tensor's size in bytes does not fit 64 bits.
    #[error("a tensor's size in bytes overflows")]
    SizeOverflow,
    /// The buffer is larger than this platform can address.
    #[error("{bytes} bytes of host memory are more than this platform can address")]
    TooLarge {
        /// The buffer's size.
        bytes: u64,
    },
    /// The host memory could not be allocated, or not page-locked.
    #[error("allocating {} of {}host memory: {source}", stageload_units::format_bytes(*.bytes), if *.pinned { "page-locked " } else { "" })]
    Allocate {
        /// The buffer's size.
        bytes: u64,
        /// It was to be page-locked.
        pinned: bool,
        /// libtorch's reason.
        source: LibtorchError,
    },
    /// libtorch refused a view of the buffer as a tensor.
    #[error("carving host tensors: {0}")]
    Carve(#[source] TchError),
    /// A target has no copy.
    #[error("the host copies hold no copy of tensor '{tensor}'")]
    NoCopy {
        /// The target's name.
        tensor: String,
    },
    /// A copy between the device and host memory failed.
    #[error("copying {}: {source}", if *.to_host { "to host memory" } else { "from host memory" })]
    Copy {
        /// From the device to the host (else back).
        to_host: bool,
        /// libtorch's reason.
        source: LibtorchError,
    },
    /// Reading the checkpoint into host memory failed.
    #[error("reading the checkpoint into host memory: {0}")]
    Read(#[source] Box<CheckpointError>),
    /// A unit test's hook failed the copy.
    #[cfg(test)]
    #[error("{0}")]
    Injected(String),
}

/// A libtorch failure: through the shim, or through `tch`.
#[derive(Debug, thiserror::Error)]
pub enum LibtorchError {
    /// Through the shim.
    #[error(transparent)]
    Shim(#[from] ShimError),
    /// Through `tch`.
    #[error(transparent)]
    Tch(#[from] TchError),
}

/// Where host memory for copies comes from.
pub(crate) trait HostMemory: Send + Sync {
    /// A uint8 tensor of `bytes` bytes, page-locked when `pin` (an error saying why it cannot
    /// be), and the bytes it takes from the machine.
    fn take(&self, bytes: usize, pin: bool) -> Result<(Tensor, u64), HostCopyError>;

    /// A buffer that took `bytes` is gone (its last tensor dropped).
    fn given_back(&self, _bytes: u64) {}
}

/// The real allocator: a mapping of its own per buffer.
pub(crate) struct Mapped;

impl HostMemory for Mapped {
    fn take(&self, bytes: usize, pin: bool) -> Result<(Tensor, u64), HostCopyError> {
        // A registration refused leaves CUDA's last error cleared (the next launch's check would
        // report it).
        let taken = match pin {
            true => stageload_torch_sys::registered_host_buffer(bytes),
            false => stageload_torch_sys::host_buffer(bytes, false),
        };
        taken.map_err(|source| HostCopyError::Allocate { bytes: bytes as u64, pinned: pin, source: source.into() })
    }
}

/// The page size, for [`booked`] and the arena's pieces.
pub(crate) fn page_size() -> u64 {
    nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE).ok().flatten().map_or(4096, |p| p.max(1) as u64)
}

/// Where each tensor of `sizes` bytes starts in one buffer (aligned as the block slots are:
/// [`crate::storage::aligned_offsets`]), and the buffer's bytes (at least 1).
fn layout(sizes: &[u64]) -> (Vec<u64>, u64) {
    let (offsets, end) =
        crate::storage::aligned_offsets(sizes.iter().map(|&b| usize::try_from(b).unwrap_or(usize::MAX)));
    (offsets.into_iter().map(|o| o as u64).collect(), (end as u64).max(1))
}

/// Bytes a set of copies of `sizes` bytes takes from the machine: its buffer in whole pages.
pub(crate) fn booked(sizes: &[u64]) -> u64 {
    let page = page_size();
    layout(sizes).1.div_ceil(page).saturating_mul(page)
}

/// Tensors carved from one buffer (they hold its memory), and what the buffer took.
pub(crate) struct HostSet {
    /// Declared first: dropped before the last `buffer` reports the memory given back.
    pub(crate) tensors: Vec<Tensor>,
    buffer: Arc<Buffer>,
}

impl HostSet {
    /// The same tensors and buffer, shared: the memory goes back when the last of them goes.
    pub(crate) fn shallow(&self) -> HostSet {
        HostSet { tensors: self.tensors.iter().map(Tensor::shallow_clone).collect(), buffer: Arc::clone(&self.buffer) }
    }

    /// Whether the memory is page-locked.
    pub(crate) fn pinned(&self) -> bool {
        self.buffer.pinned
    }

    /// Bytes the buffer took from the machine.
    pub(crate) fn bytes(&self) -> u64 {
        self.buffer.bytes
    }
}

/// What a buffer took, given back when the last set sharing it goes: told to its allocator, or
/// its ranges back to the arena.
struct Buffer {
    bytes: u64,
    pinned: bool,
    back: Back,
}

/// Where a buffer's memory goes back to.
enum Back {
    /// An allocator of [`HostMemory`], told.
    Memory(Arc<dyn HostMemory>),
    /// The registered arena: the lease gives its ranges back when dropped.
    Arena(#[allow(dead_code)] arena::Lease<Registered>),
}

impl Drop for Buffer {
    fn drop(&mut self) {
        if let Back::Memory(memory) = &self.back {
            memory.given_back(self.bytes);
        }
    }
}

static SAID_PAGEABLE: AtomicBool = AtomicBool::new(false);

/// Host tensors of `shapes` (contiguous) carved from one page-locked buffer of `memory`, or, where
/// memory cannot be pinned, a pageable one (said once per process).
pub(crate) fn carve_pinned_or_pageable(
    memory: &Arc<dyn HostMemory>,
    shapes: &[(Vec<i64>, Kind)],
) -> Result<HostSet, HostCopyError> {
    carve(memory, shapes, true).or_else(|why| {
        if !SAID_PAGEABLE.swap(true, Ordering::Relaxed) {
            tracing::warn!(%why, "pinning host memory failed; host copies use pageable memory (slower copies)");
        }
        carve(memory, shapes, false)
    })
}

/// Host tensors of `shapes` (contiguous) carved from one buffer of `memory`, page-locked when
/// `pin` (an error saying why where it cannot be).
pub(crate) fn carve(
    memory: &Arc<dyn HostMemory>,
    shapes: &[(Vec<i64>, Kind)],
    pin: bool,
) -> Result<HostSet, HostCopyError> {
    let sizes = sizes_of(shapes)?;
    let (offsets, total) = layout(&sizes);
    let total = usize::try_from(total).map_err(|_| HostCopyError::TooLarge { bytes: total })?;
    let (tensor, bytes) = memory.take(total, pin)?;
    let buffer = Arc::new(Buffer { bytes, pinned: pin, back: Back::Memory(Arc::clone(memory)) });
    let tensors = shapes
        .iter()
        .zip(offsets.iter().zip(&sizes))
        .map(|((shape, kind), (&offset, &size))| {
            tensor.f_narrow(0, offset as i64, size as i64)?.f_view_dtype(*kind)?.f_view(shape.as_slice())
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(HostCopyError::Carve)?;
    Ok(HostSet { tensors, buffer })
}

/// The bytes of each of `shapes`.
fn sizes_of(shapes: &[(Vec<i64>, Kind)]) -> Result<Vec<u64>, HostCopyError> {
    shapes
        .iter()
        .map(|(shape, kind)| {
            let elements = shape.iter().try_fold(1u64, |n, &d| n.checked_mul(u64::try_from(d).ok()?));
            elements.and_then(|n| n.checked_mul(kind.elt_size_in_bytes() as u64))
        })
        .collect::<Option<_>>()
        .ok_or(HostCopyError::SizeOverflow)
}

/// Why a set of copies is not in the registered arena: the arena refused it, or cutting its
/// tensors from the arena's pieces failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum NotInArena {
    /// The arena did not take it (its limits, or registering a piece failed).
    #[error("not in the host tier's registered memory: {0}")]
    Refused(#[from] Refused),
    /// Its sizes or views.
    #[error("not in the host tier's registered memory: {0}")]
    Carve(#[from] HostCopyError),
}

/// Host tensors of `shapes` (contiguous) in ranges of the registered `arena` (page-locked),
/// each placed on its own ([`arena`]'s rule 2); the ranges go back to the arena when the last
/// set sharing them goes. Refused, nothing kept, where the arena does not take them.
pub(crate) fn carve_in_arena(
    arena: &Arc<Arena<Registered>>,
    shapes: &[(Vec<i64>, Kind)],
) -> Result<HostSet, NotInArena> {
    let sizes = sizes_of(shapes)?;
    let placed = arena.place(&sizes)?;
    let bytes = placed.lease.ranges().iter().map(|r| r.bytes).sum();
    let tensors = shapes
        .iter()
        .zip(&sizes)
        .zip(&placed.places)
        .map(|(((shape, kind), &size), place)| match place {
            Some((piece, range)) => crate::sync::lock(piece)
                .f_narrow(0, range.offset as i64, size as i64)?
                .f_view_dtype(*kind)?
                .f_view(shape.as_slice()),
            None => Tensor::f_empty(shape.as_slice(), (*kind, tch::Device::Cpu)),
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| NotInArena::Carve(HostCopyError::Carve(e)))?;
    let buffer = Arc::new(Buffer { bytes, pinned: true, back: Back::Arena(placed.lease) });
    Ok(HostSet { tensors, buffer })
}

#[cfg(test)]
pub(crate) mod fake {
    //! A [`HostMemory`] that hands out real pageable buffers and counts what is out.
    use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

    use tch::Tensor;

    use super::{HostCopyError, HostMemory};

    #[derive(Default)]
    pub(crate) struct Counting {
        /// Refuse to pin (as a machine without a driver does).
        pub(crate) refuse_pin: bool,
        pub(crate) out: AtomicU64,
        pub(crate) takes: AtomicUsize,
        pub(crate) pinned_asks: AtomicUsize,
    }

    impl HostMemory for Counting {
        fn take(&self, bytes: usize, pin: bool) -> Result<(Tensor, u64), HostCopyError> {
            if pin {
                self.pinned_asks.fetch_add(1, Ordering::SeqCst);
                if self.refuse_pin {
                    return Err(HostCopyError::Injected("refused by the fake".into()));
                }
            }
            let (tensor, mapped) = stageload_torch_sys::host_buffer(bytes, false).map_err(|source| {
                HostCopyError::Allocate { bytes: bytes as u64, pinned: false, source: source.into() }
            })?;
            self.out.fetch_add(mapped, Ordering::SeqCst);
            self.takes.fetch_add(1, Ordering::SeqCst);
            Ok((tensor, mapped))
        }

        fn given_back(&self, bytes: u64) {
            self.out.fetch_sub(bytes, Ordering::SeqCst);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;
    use std::sync::Arc;

    use tch::{Device, Kind, Tensor};

    use super::{booked, carve, carve_pinned_or_pageable, fake::Counting, HostCopyError, HostMemory, Mapped};

    #[test]
    fn tensors_are_carved_aligned_from_one_buffer_of_whole_pages() {
        let memory: Arc<dyn HostMemory> = Arc::new(Mapped);
        let shapes = vec![(vec![3, 5], Kind::Float), (vec![7], Kind::BFloat16), (vec![0], Kind::Int64)];
        let set = carve(&memory, &shapes, false).unwrap();
        assert!(!set.pinned());
        // 60 bytes, then 14 at offset 64, then none at 128: one page.
        assert_eq!(set.bytes(), booked(&[60, 14, 0]));
        assert_eq!(
            booked(&[60, 14, 0]),
            nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE).unwrap().unwrap() as u64
        );
        let got: Vec<(Vec<i64>, Kind)> = set.tensors.iter().map(|t| (t.size(), t.kind())).collect();
        assert_eq!(got, shapes);
        let base = set.tensors[0].data_ptr() as usize;
        assert_eq!(set.tensors[1].data_ptr() as usize - base, 64);
        // Writable, and each its own bytes.
        let _ = set.tensors[0].shallow_clone().fill_(1.5);
        let _ = set.tensors[1].shallow_clone().fill_(-2.0);
        assert!(set.tensors[0].equal(&Tensor::full([3, 5], 1.5, (Kind::Float, Device::Cpu))));
        assert!(set.tensors[1].equal(&Tensor::full([7], -2.0, (Kind::BFloat16, Device::Cpu))));
    }

    #[test]
    fn memory_asked_pinned_is_pinned_where_a_cuda_driver_is_and_pageable_elsewhere() {
        let memory: Arc<dyn HostMemory> = Arc::new(Mapped);
        let set = carve_pinned_or_pageable(&memory, &[(vec![8], Kind::Float)]).unwrap();
        let gpu = stageload_torch_sys::cuda_device_count().unwrap_or(0) > 0;
        assert_eq!(set.pinned(), gpu);
        assert_eq!(set.tensors[0].size(), [8]);
    }

    #[test]
    fn a_buffer_is_given_back_when_its_last_tensor_goes_not_before() {
        let counting = Arc::new(Counting::default());
        let memory: Arc<dyn HostMemory> = counting.clone();
        let set = carve(&memory, &[(vec![1000], Kind::Float)], false).unwrap();
        assert_eq!(counting.out.load(Ordering::SeqCst), set.bytes());
        drop(set);
        assert_eq!(counting.out.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn a_registration_the_driver_refuses_leaves_the_arena_empty_and_the_copies_take_a_buffer_of_their_own() {
        if stageload_torch_sys::cuda_device_count().unwrap_or(0) > 0 {
            return; // A driver here registers: the refusal is the CPU machine's.
        }
        let arena = super::Arena::new(super::Registered, Box::new(super::MachineRoom), super::page_size());
        arena.set_budget(1 << 30);
        let shapes = vec![(vec![1000], Kind::Float), (vec![3, 3], Kind::BFloat16)];
        let refused = super::carve_in_arena(&arena, &shapes).err().unwrap();
        let why = refused.to_string();
        assert!(matches!(&refused, super::NotInArena::Refused(super::Refused::Register { .. })), "{why}");
        assert!(why.contains("not in the host tier's registered memory: registering"), "{why}");
        assert!(why.contains("CUDA"), "the runtime's reason is kept: {why}");
        assert_eq!(arena.usage(), (0, 0), "nothing registered, nothing placed");
        // The failed registration left no error of its own behind for the next launch to report:
        // no runtime, no error, or (no driver here) the runtime's failed start, which it reports
        // again at every call (35: driver insufficient, 100: no device).
        let left = stageload_torch_sys::clear_cuda_error().unwrap();
        assert!(matches!(left, None | Some(0 | 35 | 100)), "CUDA error {left:?} left behind");
        let memory: Arc<dyn HostMemory> = Arc::new(Mapped);
        let set = carve_pinned_or_pageable(&memory, &shapes).unwrap();
        assert!(!set.pinned());
        assert_eq!(set.tensors[1].size(), [3, 3]);
    }

    #[test]
    fn memory_that_cannot_be_pinned_falls_back_to_pageable_and_is_booked_the_same() {
        let counting = Arc::new(Counting { refuse_pin: true, ..Default::default() });
        let memory: Arc<dyn HostMemory> = counting.clone();
        let refused = carve(&memory, &[(vec![1000], Kind::Float)], true).err().unwrap();
        assert!(matches!(&refused, HostCopyError::Injected(why) if why == "refused by the fake"), "{refused}");
        let set = carve_pinned_or_pageable(&memory, &[(vec![1000], Kind::Float)]).unwrap();
        assert!(!set.pinned());
        // Two asks for pinned memory refused (the strict carve's and the fallback's), one
        // pageable buffer taken.
        assert_eq!((counting.pinned_asks.load(Ordering::SeqCst), counting.takes.load(Ordering::SeqCst)), (2, 1));
        assert_eq!(set.bytes(), booked(&[4000]));
    }
}
