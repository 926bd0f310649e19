//! The host tier's copies: a device model's weights out to host memory before a release frees
//! them, and back into its reallocated storages when it reloads.
//!
//! A device model's host copies are placed in the tier's registered arena
//! ([`crate::pinned::carve_in_arena`]: memory page-locked once, in pieces, so that a store is only
//! the copy); where the arena does not take them (its limits, or the driver refused a piece)
//! they are carved from one buffer of [`crate::pinned`] as before, page-locked when the driver
//! allows it, else pageable (said once per process), and the store's event says why. The tier
//! books the bytes of one such buffer either way; the memory goes back (to the arena, or to the
//! machine) when the copies are evicted or the tier closes (and the last reload reading them
//! has ended). On CUDA both directions run on a side stream of
//! the model's device and end at a recorded event; the copy out first waits for the work the
//! model's device already has queued. Tensors that view the same bytes (tied weights) are copied
//! once.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use stageload_torch_sys as shim;
use tch::{Device, Tensor};

use crate::pinned::{self, Arena, HostCopyError, HostMemory, HostSet, LibtorchError, MachineRoom, Registered};

/// A model's tensors as distinct views (tensors that view the same bytes, tied weights, once)
/// and, per tensor name, its view: computed once per release, sized before the tier admits
/// the model, then copied.
pub(crate) struct Views {
    views: Vec<Tensor>,
    names: HashMap<String, usize>,
    /// Tensors whose storage has no memory behind it now (a streamed model's blocks between
    /// steps): a model with any cannot be copied whole.
    unallocated: usize,
}

impl Views {
    pub(crate) fn of(tensors: &[(String, Tensor)]) -> Result<Views, shim::ShimError> {
        let mut keys: HashMap<ViewKey, usize> = HashMap::new();
        let mut views = Vec::new();
        let mut names = HashMap::with_capacity(tensors.len());
        let mut unallocated = 0;
        for (name, tensor) in tensors {
            let info = shim::storage_info(tensor)?;
            if !info.allocated {
                unallocated += 1;
                continue;
            }
            let key = (info.id, tensor.storage_offset(), tensor.size(), tensor.stride(), tensor.kind());
            let index = *keys.entry(key).or_insert_with(|| {
                views.push(tensor.shallow_clone());
                views.len() - 1
            });
            names.entry(name.clone()).or_insert(index);
        }
        Ok(Views { views, names, unallocated })
    }

    /// How many tensors have no memory behind them now.
    pub(crate) fn unallocated(&self) -> usize {
        self.unallocated
    }

    /// Host bytes a copy takes from the machine: its buffer, in whole pages.
    pub(crate) fn bytes(&self) -> u64 {
        pinned::booked(&self.views.iter().map(tensor_bytes).collect::<Vec<_>>())
    }
}

/// A model's weights in host memory: each distinct view once, carved from one buffer, and which
/// view each name has.
pub(crate) struct HostCopies {
    hosts: HostSet,
    names: Arc<HashMap<String, usize>>,
}

impl HostCopies {
    /// The same copies, shared (for a reload that runs with the registry's lock let go): the
    /// buffer goes back when the last of them goes.
    pub(crate) fn shallow(&self) -> HostCopies {
        HostCopies { hosts: self.hosts.shallow(), names: Arc::clone(&self.names) }
    }

    /// Bytes the buffer took from the machine.
    #[cfg(test)]
    pub(crate) fn bytes(&self) -> u64 {
        self.hosts.bytes()
    }
}

impl std::fmt::Debug for HostCopies {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "HostCopies({} tensors, {} bytes, pinned {})",
            self.names.len(),
            self.hosts.bytes(),
            self.hosts.pinned()
        )
    }
}

/// Whether the host tier holds copies of a model on `device`: device models only (a CPU model's
/// weights are host memory already).
pub(crate) fn applies(device: Device) -> bool {
    device != Device::Cpu
}

/// What a view is: storage, offset, sizes, strides, dtype.
type ViewKey = (u64, i64, Vec<i64>, Vec<i64>, tch::Kind);

fn tensor_bytes(tensor: &Tensor) -> u64 {
    (tensor.numel() as u64).saturating_mul(tensor.kind().elt_size_in_bytes() as u64)
}

/// Copies `views` (a model's weights on `device`) into host memory: on CUDA into `arena`'s
/// registered memory, else (and where the arena does not take them) from `memory`, pinned for a
/// device. With the copies, why they are not in the arena where a CUDA model's are not (for the
/// store's event).
pub(crate) fn copy_out(
    views: Views,
    device: Device,
    memory: &Arc<dyn HostMemory>,
    arena: &Arc<Arena<Registered>>,
) -> Result<(HostCopies, Option<String>), HostCopyError> {
    let Views { views, names, .. } = views;
    let shapes: Vec<(Vec<i64>, tch::Kind)> = views.iter().map(|v| (v.size(), v.kind())).collect();
    let (hosts, not_in_arena) = match device {
        Device::Cpu => (pinned::carve(memory, &shapes, false)?, None),
        Device::Cuda(_) => match pinned::carve_in_arena(arena, &shapes) {
            Ok(hosts) => (hosts, None),
            Err(why) => {
                (pinned::carve_pinned_or_pageable(memory, &shapes)?, Some(format!("{why}; a buffer of its own")))
            }
        },
        _ => (pinned::carve_pinned_or_pageable(memory, &shapes)?, None),
    };
    let pairs: Vec<(&Tensor, &Tensor)> = hosts.tensors.iter().zip(&views).collect();
    copy_all(&pairs, device, hosts.pinned()).map_err(|source| HostCopyError::Copy { to_host: true, source })?;
    Ok((HostCopies { hosts, names: Arc::new(names) }, not_in_arena))
}

/// Copies `copies` back into `targets` (tensors of the model on `device`, their storages
/// reallocated). Every target must have a copy.
pub(crate) fn copy_in(targets: &[(String, Tensor)], copies: &HostCopies, device: Device) -> Result<(), HostCopyError> {
    let mut pairs = Vec::with_capacity(targets.len());
    for (name, target) in targets {
        let host = copies.names.get(name).ok_or_else(|| HostCopyError::NoCopy { tensor: name.clone() })?;
        pairs.push((target, &copies.hosts.tensors[*host]));
    }
    copy_all(&pairs, device, copies.hosts.pinned()).map_err(|source| HostCopyError::Copy { to_host: false, source })
}

/// `dst.copy_(src)` for every pair; on CUDA with pinned host memory, asynchronous on a side
/// stream and waited for at its end.
fn copy_all(pairs: &[(&Tensor, &Tensor)], device: Device, pinned: bool) -> Result<(), LibtorchError> {
    let _no_grad = tch::no_grad_guard();
    match device {
        Device::Cuda(index) if pinned => {
            // The model's last kernels (a build, a fill) may still be queued on this thread's
            // stream: the side stream starts after them.
            shim::cuda_sync_current_stream(index)?;
            Ok(crate::device_copy::copy_on_side_stream(pairs, index)?)
        }
        _ => {
            let _watched = crate::copy_watch::copying(pairs.iter().flat_map(|(dst, src)| [*dst, *src]));
            for (dst, src) in pairs {
                crate::copy_watch::piece();
                let mut dst = dst.shallow_clone();
                dst.f_copy_(src)?;
            }
            Ok(())
        }
    }
}

/// The host tier's side that is not bookkeeping (that is the state's, under its lock): where
/// host copies' memory comes from, and whether the tier said once that it does not hold CPU
/// models.
pub(crate) struct TierSide {
    host_memory: Arc<dyn HostMemory>,
    /// CUDA models' copies: registered once, within the tier's budget ([`crate::pinned::arena`]).
    arena: Arc<Arena<Registered>>,
    said_cpu: AtomicBool,
    /// Unit tests: the host tier holds CPU models too (no device here to test it with).
    #[cfg(test)]
    on_cpu: bool,
    /// Unit tests: runs before each copy into the host tier (`true`) or out of it.
    #[cfg(test)]
    copy_hook: Option<TierCopyHook>,
}

/// Unit tests: what runs before a copy into the host tier (`true`) or out of it, given the
/// model's name.
#[cfg(test)]
pub(crate) type TierCopyHook = Arc<dyn Fn(&str, bool) -> Result<(), String> + Send + Sync>;

impl TierSide {
    pub(crate) fn new(host_memory: Arc<dyn HostMemory>) -> Self {
        let page = pinned::page_size();
        TierSide {
            host_memory,
            arena: Arena::new(Registered, Box::new(MachineRoom), page),
            said_cpu: AtomicBool::new(false),
            #[cfg(test)]
            on_cpu: false,
            #[cfg(test)]
            copy_hook: None,
        }
    }

    /// Where host copies' memory comes from.
    pub(crate) fn host_memory(&self) -> &Arc<dyn HostMemory> {
        &self.host_memory
    }

    /// The registered arena CUDA models' copies go to first.
    pub(crate) fn arena(&self) -> &Arc<Arena<Registered>> {
        &self.arena
    }

    /// Whether this is the first CPU model the tier was asked to hold (it says why it does not,
    /// once).
    pub(crate) fn first_cpu_model(&self) -> bool {
        !self.said_cpu.swap(true, Ordering::Relaxed)
    }

    /// Whether the host tier holds copies of models on `device`.
    pub(crate) fn applies(&self, device: Device) -> bool {
        #[cfg(test)]
        if self.on_cpu {
            return true;
        }
        applies(device)
    }

    /// Unit tests: holds or fails a copy into the tier (`into`) or out of it where it races with
    /// the registry's other calls (the state lock let go); nothing otherwise.
    pub(crate) fn before_copy(&self, _name: &str, _into: bool) -> Result<(), HostCopyError> {
        #[cfg(test)]
        if let Some(hook) = &self.copy_hook {
            return hook(_name, _into).map_err(HostCopyError::Injected);
        }
        Ok(())
    }

    /// Unit tests: the tier holds CPU models (`on_cpu`), `copy_hook` runs before each copy.
    #[cfg(test)]
    pub(crate) fn for_tests(self, on_cpu: bool, copy_hook: Option<TierCopyHook>) -> Self {
        TierSide { on_cpu, copy_hook, ..self }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Kind;

    #[test]
    fn weights_copied_out_and_back_into_freed_storages_are_bit_identical() {
        let w = Tensor::randn([64, 32], (Kind::Float, Device::Cpu));
        let tied = w.shallow_clone();
        let b = Tensor::randn([32], (Kind::BFloat16, Device::Cpu));
        let tensors = vec![("w".to_string(), w.shallow_clone()), ("tied".to_string(), tied), ("b".to_string(), b)];
        let before: Vec<Tensor> = tensors.iter().map(|(_, t)| t.copy()).collect();
        let views = Views::of(&tensors).unwrap();
        assert_eq!(views.bytes(), pinned::booked(&[64 * 32 * 4, 32 * 2]), "the tied view counted once");

        let memory: Arc<dyn HostMemory> = Arc::new(pinned::Mapped);
        let booked = views.bytes();
        let arena = Arena::new(Registered, Box::new(MachineRoom), pinned::page_size());
        let (copies, not_in_arena) = copy_out(views, Device::Cpu, &memory, &arena).unwrap();
        assert!(not_in_arena.is_none(), "a CPU model's copies never ask the arena");
        assert_eq!(arena.usage(), (0, 0));
        assert_eq!(copies.hosts.tensors.len(), 2, "one copy of the tied view");
        assert_eq!(copies.bytes(), booked, "the buffer takes what was booked");
        assert!(!copies.hosts.pinned(), "a CPU model's copies are not pinned");
        let storages = crate::storage::distinct_storages(&tensors).unwrap();
        // SAFETY: these tensors are this test's alone and unused until refilled below.
        unsafe { crate::storage::release(&storages, &Default::default(), "released by the test") }.unwrap();
        // SAFETY: as above.
        unsafe { crate::storage::reallocate(&storages) }.unwrap();
        copy_in(&tensors, &copies.shallow(), Device::Cpu).unwrap();
        for ((name, after), before) in tensors.iter().zip(&before) {
            assert!(after.equal(before), "tensor '{name}' differs after the round trip");
        }
    }

    #[test]
    fn a_target_without_a_copy_is_an_error_naming_the_tensor() {
        let tensors = vec![("w".to_string(), Tensor::zeros([4], (Kind::Float, Device::Cpu)))];
        let memory: Arc<dyn HostMemory> = Arc::new(pinned::Mapped);
        let arena = Arena::new(Registered, Box::new(MachineRoom), pinned::page_size());
        let (copies, _) = copy_out(Views::of(&tensors).unwrap(), Device::Cpu, &memory, &arena).unwrap();
        let other = vec![("v".to_string(), Tensor::zeros([4], (Kind::Float, Device::Cpu)))];
        let err = copy_in(&other, &copies, Device::Cpu).unwrap_err();
        assert!(matches!(&err, HostCopyError::NoCopy { tensor } if tensor == "v"), "{err}");
        assert_eq!(err.to_string(), "the host copies hold no copy of tensor 'v'");
    }

    #[test]
    fn the_tier_holds_device_models_only() {
        assert!(!applies(Device::Cpu));
        assert!(applies(Device::Cuda(0)) && applies(Device::Mps));
    }
}
