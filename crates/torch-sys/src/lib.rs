//! The FFI fence: stageload's C++ shim over libtorch, and nothing else.
//!
//! tch does not expose generator states, freeing or reallocating a tensor's storage in place, or
//! the CUDA caching allocator's statistics. `cpp/shim.cpp` does, compiled against the libtorch
//! that torch-sys found. Each extern function below is wrapped exactly once by a safe function
//! that turns the shim's error string into a [`ShimError`] naming the operation. The shim catches
//! every C++ exception, so no libtorch error aborts the process.
//!
//! Everything above this crate (release and reload in place, RNG preservation, CUDA memory in
//! traces) is built from these few safe functions.

#![warn(missing_docs)]

use std::ffi::{c_char, c_int, CStr};
use tch::Tensor;
use torch_sys::C_tensor;

/// A libtorch call made through the shim failed; carries libtorch's own message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("libtorch {operation} failed: {message}")]
pub struct ShimError {
    /// The shim operation, e.g. `"set generator state"`.
    pub operation: &'static str,
    /// libtorch's message (without its C++ backtrace).
    pub message: String,
}

/// Result of a shim call.
pub type ShimResult<T> = Result<T, ShimError>;

mod aoti;
pub use aoti::{aoti_package_metadata, AotiConstant, AotiPackage};
mod mapped;
pub use mapped::{read_mapped, MappedReadError};
mod mapping;
pub use mapping::{attach_mapped, FileMapping};

mod ffi {
    use super::*;
    extern "C" {
        pub fn sl_free(p: *mut std::ffi::c_void);
        pub fn sl_generator_get_state(
            kind: DeviceKind,
            index: c_int,
            out: *mut *mut u8,
            len: *mut usize,
        ) -> *mut c_char;
        pub fn sl_generator_set_state(kind: DeviceKind, index: c_int, data: *const u8, len: usize) -> *mut c_char;
        pub fn sl_cuda_device_count(out: *mut i64) -> *mut c_char;
        pub fn sl_mps_available(out: *mut bool) -> *mut c_char;
        pub fn sl_storage_info(
            t: *const C_tensor,
            id: *mut u64,
            nbytes: *mut usize,
            allocated: *mut bool,
        ) -> *mut c_char;
        pub fn sl_storage_free(t: *const C_tensor, message: *const c_char, freed: *mut usize) -> *mut c_char;
        pub fn sl_storage_realloc(t: *const C_tensor, nbytes: usize) -> *mut c_char;
        pub fn sl_storage_attach(t: *const C_tensor, data: *mut std::ffi::c_void, nbytes: usize) -> *mut c_char;
        pub fn sl_cuda_empty_cache() -> *mut c_char;
        pub fn sl_mps_empty_cache() -> *mut c_char;
        pub fn sl_cuda_memory(
            index: c_int,
            allocated: *mut i64,
            reserved: *mut i64,
            peak_allocated: *mut i64,
            peak_reserved: *mut i64,
        ) -> *mut c_char;
        pub fn sl_cuda_reset_peak(index: c_int) -> *mut c_char;
        pub fn sl_skip_init(mode: c_int, previous: *mut c_int) -> *mut c_char;
        pub fn sl_cuda_use_side_stream(index: c_int, previous_id: *mut i64) -> *mut c_char;
        pub fn sl_cuda_set_stream(index: c_int, id: i64) -> *mut c_char;
        pub fn sl_cuda_sync_current_stream(index: c_int) -> *mut c_char;
        pub fn sl_copy_async(dst: *const C_tensor, src: *const C_tensor) -> *mut c_char;
        pub fn sl_pin_memory(t: *const C_tensor, out: *mut *mut C_tensor) -> *mut c_char;
        pub fn sl_empty_pinned_cache() -> *mut c_char;
        pub fn sl_host_cache_install(min_block: usize, huge_block: usize, installed_now: *mut bool) -> *mut c_char;
        pub fn sl_host_cache_huge_pages(on: bool);
        pub fn sl_host_cache_flush(freed: *mut usize) -> *mut c_char;
        pub fn sl_host_cache_stats(installed: *mut bool, out: *mut usize) -> *mut c_char;
        pub fn sl_host_buffer(bytes: i64, pin: c_int, out: *mut *mut C_tensor, mapped: *mut i64) -> *mut c_char;
        pub fn sl_cuda_event_record(index: c_int, out: *mut *mut std::ffi::c_void) -> *mut c_char;
        pub fn sl_event_synchronize(event: *mut std::ffi::c_void) -> *mut c_char;
        pub fn sl_event_free(event: *mut std::ffi::c_void);
        pub fn sl_module_named_buffers(
            module: *mut std::ffi::c_void,
            data: *mut std::ffi::c_void,
            add: extern "C" fn(*mut std::ffi::c_void, *const c_char, *mut C_tensor),
        ) -> *mut c_char;
        pub fn sl_aoti_package_metadata(
            path: *const c_char,
            data: *mut std::ffi::c_void,
            add: extern "C" fn(*mut std::ffi::c_void, *const c_char, *const c_char),
        ) -> *mut c_char;
        pub fn sl_aoti_load(path: *const c_char, device_index: c_int, out: *mut *mut std::ffi::c_void) -> *mut c_char;
        pub fn sl_aoti_drop(loader: *mut std::ffi::c_void);
        pub fn sl_aoti_constants(
            loader: *mut std::ffi::c_void,
            data: *mut std::ffi::c_void,
            add: extern "C" fn(*mut std::ffi::c_void, *const c_char, i32),
        ) -> *mut c_char;
        pub fn sl_aoti_register(
            loader: *mut std::ffi::c_void,
            fqns: *const *const c_char,
            tensors: *const *const C_tensor,
            count: usize,
        ) -> *mut c_char;
        pub fn sl_aoti_run(
            loader: *mut std::ffi::c_void,
            inputs: *const *const C_tensor,
            count: usize,
            data: *mut std::ffi::c_void,
            add: extern "C" fn(*mut std::ffi::c_void, *mut C_tensor),
        ) -> *mut c_char;
    }
}

/// Turns the shim's return value (null, or a malloc'd message) into a result.
fn check(operation: &'static str, err: *mut c_char) -> ShimResult<()> {
    if err.is_null() {
        return Ok(());
    }
    // SAFETY: a non-null return is a NUL-terminated string the shim malloc'd for us; we copy it
    // and free it exactly once with the shim's own `free`.
    let message = unsafe {
        let text = CStr::from_ptr(err).to_string_lossy().into_owned();
        ffi::sl_free(err.cast());
        text
    };
    Err(ShimError { operation, message })
}

/// A device whose default random generator the shim can read and restore.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GeneratorDevice {
    /// torch's default CPU generator.
    Cpu,
    /// The default generator of CUDA device `n`.
    Cuda(usize),
    /// The MPS generator (macOS).
    Mps,
}

/// A CUDA device index as the shim takes it; one no C `int` holds is an error, not a wrap.
fn cuda_index(index: usize) -> ShimResult<c_int> {
    c_int::try_from(index).map_err(|_| ShimError {
        operation: "name a CUDA device",
        message: format!("CUDA device index {index} out of range"),
    })
}

/// Device kinds as the shim's `SlDeviceKind` numbers them (one enum on each side of the FFI).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(dead_code)] // Constructed only through `GeneratorDevice::code`.
enum DeviceKind {
    Cpu = 0,
    Cuda = 1,
    Mps = 2,
}

impl GeneratorDevice {
    /// The kind and index the shim takes; an index no C `int` holds is an error.
    fn code(self) -> ShimResult<(DeviceKind, c_int)> {
        Ok(match self {
            GeneratorDevice::Cpu => (DeviceKind::Cpu, 0),
            GeneratorDevice::Cuda(i) => (DeviceKind::Cuda, cuda_index(i)?),
            GeneratorDevice::Mps => (DeviceKind::Mps, 0),
        })
    }
}

/// The state of a default generator, as the bytes libtorch serialises it to
/// (5056 bytes for the CPU's mt19937).
pub fn generator_state(device: GeneratorDevice) -> ShimResult<Vec<u8>> {
    let (kind, index) = device.code()?;
    let mut data: *mut u8 = std::ptr::null_mut();
    let mut len = 0usize;
    // SAFETY: the out-pointers are valid for writes; on success the shim stores a malloc'd
    // buffer of `len` bytes that we copy and free once.
    let err = unsafe { ffi::sl_generator_get_state(kind, index, &mut data, &mut len) };
    check("get generator state", err)?;
    // SAFETY: success guarantees `data` points to `len` initialised bytes owned by us.
    let bytes = unsafe {
        let bytes = std::slice::from_raw_parts(data, len).to_vec();
        ffi::sl_free(data.cast());
        bytes
    };
    Ok(bytes)
}

/// Restores a default generator to a state read by [`generator_state`].
pub fn set_generator_state(device: GeneratorDevice, state: &[u8]) -> ShimResult<()> {
    let (kind, index) = device.code()?;
    // SAFETY: `state` is a valid slice for the duration of the call; the shim copies it.
    let err = unsafe { ffi::sl_generator_set_state(kind, index, state.as_ptr(), state.len()) };
    check("set generator state", err)
}

/// Number of CUDA devices; 0 when CUDA is not available (never an error on a CPU machine).
pub fn cuda_device_count() -> ShimResult<usize> {
    let mut n = 0i64;
    // SAFETY: the out-pointer is valid for a write.
    let err = unsafe { ffi::sl_cuda_device_count(&mut n) };
    check("count CUDA devices", err)?;
    Ok(n.max(0) as usize)
}

/// Whether this libtorch was built with MPS and an MPS device is present.
pub fn mps_available() -> ShimResult<bool> {
    let mut available = false;
    // SAFETY: the out-pointer is valid for a write.
    let err = unsafe { ffi::sl_mps_available(&mut available) };
    check("query MPS", err)?;
    Ok(available)
}

/// What the shim reports about the storage behind a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StorageInfo {
    /// Identity of the storage (its `StorageImpl` address): equal for tensors that share it.
    pub id: u64,
    /// Bytes the storage holds now (0 once freed).
    pub nbytes: usize,
    /// Whether the storage has memory behind it.
    pub allocated: bool,
}

/// Identity, size and allocation state of a tensor's storage.
pub fn storage_info(tensor: &Tensor) -> ShimResult<StorageInfo> {
    let mut info = StorageInfo { id: 0, nbytes: 0, allocated: false };
    // SAFETY: `tensor.as_ptr()` is a live `at::Tensor*` borrowed for the call; out-pointers valid.
    let err = unsafe { ffi::sl_storage_info(tensor.as_ptr(), &mut info.id, &mut info.nbytes, &mut info.allocated) };
    check("read storage info", err)?;
    Ok(info)
}

/// Frees a tensor's storage in place, keeping its sizes and dtype. Every tensor sharing that
/// storage sees it gone: any op on them that starts afterwards fails with a libtorch error
/// carrying `message` (say, which model was released and when), never with numbers. Returns the
/// bytes freed.
///
/// # Safety
///
/// No operation on this storage may be running, or start before this returns, in any thread
/// (through this tensor or any other sharing the storage): one that is would read or write
/// freed memory. The registry upholds this by holding the model's body lock.
pub unsafe fn free_storage(tensor: &Tensor, message: &str) -> ShimResult<usize> {
    let message = std::ffi::CString::new(message.replace('\0', " ")).expect("NULs replaced");
    let mut freed = 0usize;
    // SAFETY: `tensor.as_ptr()` is a live `at::Tensor*` and `message` a NUL-terminated string,
    // both valid for the call; the shim swaps the storage's data pointer, which every holder of
    // the storage observes consistently, and copies the message.
    let err = unsafe { ffi::sl_storage_free(tensor.as_ptr(), message.as_ptr(), &mut freed) };
    check("free storage", err)?;
    Ok(freed)
}

/// Gives a freed storage `nbytes` of fresh, uninitialised memory from its own allocator.
///
/// # Safety
///
/// The memory is uninitialised: nothing may read it before the caller has filled it, and no
/// other thread may use the storage meanwhile (the registry holds the model's body lock from
/// here to the end of the refill, and frees the storage again when the refill fails).
pub unsafe fn realloc_storage(tensor: &Tensor, nbytes: usize) -> ShimResult<()> {
    // SAFETY: `tensor.as_ptr()` is a live `at::Tensor*`; the shim refuses an allocated storage;
    // the caller keeps every reader away until it has filled the memory.
    let err = unsafe { ffi::sl_storage_realloc(tensor.as_ptr(), nbytes) };
    check("reallocate storage", err)
}

/// Gives a freed CPU storage `nbytes` of memory at `data` that it borrows: the storage never
/// frees it (a later [`free_storage`] only lets go of it), so one buffer serves block after block.
///
/// # Safety
///
/// `data` must be valid for reads and writes of `nbytes` bytes, aligned for the storage's dtype,
/// for as long as the storage holds it: the caller frees the storage before the memory goes
/// away or goes to another storage. As with [`realloc_storage`], nothing may read the storage
/// before the caller has filled it, and no other thread may use it meanwhile.
pub unsafe fn attach_storage(tensor: &Tensor, data: *mut u8, nbytes: usize) -> ShimResult<()> {
    // SAFETY: `tensor.as_ptr()` is a live `at::Tensor*`; the shim refuses an allocated or
    // non-CPU storage; the memory's lifetime and exclusivity are the caller's precondition.
    let err = unsafe { ffi::sl_storage_attach(tensor.as_ptr(), data.cast(), nbytes) };
    check("attach memory to a storage", err)
}

// tch 0.26's `CModule` is a struct of one field, the `*mut CModule_` its C API works on (a
// `torch::jit::script::Module*`; `wrappers/jit.rs`), and tch offers no accessor for it. A
// struct of one pointer-sized field has it at offset 0; this check fails the build if a tch
// release changes the struct's size.
const _: () = assert!(std::mem::size_of::<tch::CModule>() == std::mem::size_of::<*mut std::ffi::c_void>());

/// The buffers of a TorchScript module and of its submodules (the tensors that are not
/// parameters: running statistics, position ids, masks), with their dotted names, each a tensor
/// sharing the buffer's storage. tch lists only the parameters (`CModule::named_parameters`).
pub fn module_buffers(module: &tch::CModule) -> ShimResult<Vec<(String, Tensor)>> {
    extern "C" fn add(data: *mut std::ffi::c_void, name: *const c_char, tensor: *mut C_tensor) {
        // SAFETY: `data` is the `Vec` below, borrowed mutably for the call; `name` a
        // NUL-terminated string valid during the callback; `tensor` a fresh `new at::Tensor`
        // that the `Tensor` made here owns alone.
        unsafe {
            let tensors = &mut *data.cast::<Vec<(String, Tensor)>>();
            tensors.push((CStr::from_ptr(name).to_string_lossy().into_owned(), Tensor::from_ptr(tensor)));
        }
    }
    // SAFETY: see the size check above: the CModule's bytes are its module pointer, live for
    // as long as `module` is borrowed.
    let pointer: *mut std::ffi::c_void = unsafe { std::mem::transmute_copy(module) };
    let mut tensors: Vec<(String, Tensor)> = Vec::new();
    // SAFETY: `pointer` is the live module; `tensors` outlives the call, and `add` is the only
    // code that touches it meanwhile (the shim calls it on this thread).
    let err =
        unsafe { ffi::sl_module_named_buffers(pointer, (&mut tensors as *mut Vec<(String, Tensor)>).cast(), add) };
    check("list a TorchScript module's buffers", err)?;
    Ok(tensors)
}

/// Empties the CUDA caching allocator; "CUDA is not available" on a machine without it.
pub fn cuda_empty_cache() -> ShimResult<()> {
    // SAFETY: no arguments; the shim checks availability.
    let err = unsafe { ffi::sl_cuda_empty_cache() };
    check("empty the CUDA cache", err)
}

/// Empties the MPS allocator's cache (macOS); "MPS is not available" elsewhere.
pub fn mps_empty_cache() -> ShimResult<()> {
    // SAFETY: no arguments; the shim checks availability.
    let err = unsafe { ffi::sl_mps_empty_cache() };
    check("empty the MPS cache", err)
}

/// Bytes of the CUDA caching allocator on one device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CudaMemory {
    /// Bytes held by live tensors.
    pub allocated: u64,
    /// Bytes reserved from the driver (allocated plus cached).
    pub reserved: u64,
    /// High-water mark of `allocated` since the last [`cuda_reset_peak`].
    pub peak_allocated: u64,
    /// High-water mark of `reserved` since the last [`cuda_reset_peak`].
    pub peak_reserved: u64,
}

/// The CUDA caching allocator's statistics for `device`.
pub fn cuda_memory(device: usize) -> ShimResult<CudaMemory> {
    let (mut a, mut r, mut pa, mut pr) = (0i64, 0i64, 0i64, 0i64);
    // SAFETY: out-pointers are valid for writes; the shim validates the device index.
    let err = unsafe { ffi::sl_cuda_memory(cuda_index(device)?, &mut a, &mut r, &mut pa, &mut pr) };
    check("read CUDA memory", err)?;
    let bytes = |v: i64| v.max(0) as u64;
    Ok(CudaMemory { allocated: bytes(a), reserved: bytes(r), peak_allocated: bytes(pa), peak_reserved: bytes(pr) })
}

/// Resets the CUDA peak statistics of `device`.
pub fn cuda_reset_peak(device: usize) -> ShimResult<()> {
    // SAFETY: plain integer argument; the shim validates it.
    let err = unsafe { ffi::sl_cuda_reset_peak(cuda_index(device)?) };
    check("reset CUDA peak", err)
}

/// Makes a stream from CUDA device `index`'s pool current for this thread until the returned
/// guard drops (then the thread's previous stream is current again): copies and kernels this
/// thread enqueues then overlap other threads' work on the default stream.
pub fn cuda_side_stream(index: usize) -> ShimResult<SideStream> {
    let (index, mut previous) = (cuda_index(index)?, 0i64);
    // SAFETY: the out-pointer is valid for a write; the shim validates the index.
    let err = unsafe { ffi::sl_cuda_use_side_stream(index, &mut previous) };
    check("switch to a side CUDA stream", err)?;
    Ok(SideStream { index, previous })
}

/// A side stream current for this thread; see [`cuda_side_stream`].
#[derive(Debug)]
pub struct SideStream {
    index: c_int,
    previous: i64,
}

impl Drop for SideStream {
    fn drop(&mut self) {
        // SAFETY: plain integers; the shim validates them.
        let err = unsafe { ffi::sl_cuda_set_stream(self.index, self.previous) };
        if let Err(err) = check("restore the CUDA stream", err) {
            tracing::warn!(%err, "restoring the thread's CUDA stream");
        }
    }
}

/// `dst.copy_(src, non_blocking=true)`: from pinned host memory to a GPU (or back) the copy is
/// only enqueued on the current stream and the call returns at once; the source must stay
/// untouched until the stream has done it ([`cuda_sync_current_stream`]).
pub fn copy_async(dst: &Tensor, src: &Tensor) -> ShimResult<()> {
    // SAFETY: both pointers are live `at::Tensor*` borrowed for the call.
    let err = unsafe { ffi::sl_copy_async(dst.as_ptr(), src.as_ptr()) };
    check("copy asynchronously", err)
}

/// `tensor.pin_memory()`: a copy of a host tensor in page-locked memory, which the GPU's copy
/// engines read at full speed; an error (not a panic) where no accelerator can pin memory.
/// Unlike tch's `pin_memory(device)`, it passes no device, which libtorch 2.3+ warns about on
/// every call.
pub fn pin_memory(tensor: &Tensor) -> ShimResult<Tensor> {
    let mut out = std::ptr::null_mut();
    // SAFETY: `tensor.as_ptr()` is a live `at::Tensor*` borrowed for the call; the out-pointer
    // is valid for a write.
    let err = unsafe { ffi::sl_pin_memory(tensor.as_ptr(), &mut out) };
    check("pin host memory", err)?;
    // SAFETY: on success the shim wrote a fresh `new at::Tensor`, which the returned `Tensor`
    // owns alone and frees with `delete` (tch's `at_free`) when dropped.
    Ok(unsafe { Tensor::from_ptr(out) })
}

/// Host memory of `bytes` bytes as a uint8 tensor, in a mapping of its own of `bytes` rounded up
/// to whole pages (returned beside it: what the machine gives), not from libtorch's caching host
/// allocator, which rounds each block up to a power of two. With `pin`, page-locked for CUDA
/// (registered with the CUDA runtime libtorch loaded), or an error saying why not (no CUDA
/// runtime here, or the driver refused); the memory is unregistered and unmapped when the
/// tensor's storage goes.
pub fn host_buffer(bytes: usize, pin: bool) -> ShimResult<(Tensor, u64)> {
    let bytes = i64::try_from(bytes)
        .map_err(|_| ShimError { operation: "map host memory", message: format!("{bytes} bytes: too large") })?;
    let (mut out, mut mapped) = (std::ptr::null_mut(), 0i64);
    // SAFETY: both out-pointers are valid for a write; the shim checks the size.
    let err = unsafe { ffi::sl_host_buffer(bytes, c_int::from(pin), &mut out, &mut mapped) };
    check("map host memory", err)?;
    // SAFETY: on success the shim wrote a fresh `new at::Tensor`, which the returned `Tensor`
    // owns alone and frees with `delete` (tch's `at_free`) when dropped; its storage's deleter
    // unmaps the memory.
    Ok((unsafe { Tensor::from_ptr(out) }, mapped.unsigned_abs()))
}

/// Gives the pinned host memory libtorch's host allocator keeps cached for the accelerator
/// (blocks no tensor uses any more, once their copies are done) back to the OS; an error (not a
/// panic) where there is no accelerator.
pub fn empty_pinned_cache() -> ShimResult<()> {
    // SAFETY: no arguments; the shim checks that an accelerator and its allocator exist.
    let err = unsafe { ffi::sl_empty_pinned_cache() };
    check("give cached pinned memory back", err)
}

/// A point in a CUDA stream's work: everything enqueued on it before the event was recorded.
#[derive(Debug)]
pub struct CudaEvent(*mut std::ffi::c_void);

// SAFETY: the pointer is an owned `c10::Event`; recording happened at creation, and the only
// other calls, synchronize (cudaEventSynchronize) and the final delete, are safe from any thread.
unsafe impl Send for CudaEvent {}
// SAFETY: `synchronize` takes `&self` and cudaEventSynchronize may be called concurrently.
unsafe impl Sync for CudaEvent {}

impl CudaEvent {
    /// Records an event on this thread's current stream of CUDA device `index`.
    pub fn record(index: usize) -> ShimResult<Self> {
        let mut event = std::ptr::null_mut();
        // SAFETY: the out-pointer is valid for a write; on success it holds an owned event.
        let err = unsafe { ffi::sl_cuda_event_record(cuda_index(index)?, &mut event) };
        check("record a CUDA event", err)?;
        Ok(CudaEvent(event))
    }

    /// Waits until the work before the event is done.
    pub fn synchronize(&self) -> ShimResult<()> {
        // SAFETY: `self.0` is a live event owned by this value.
        let err = unsafe { ffi::sl_event_synchronize(self.0) };
        check("wait for a CUDA event", err)
    }
}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        // SAFETY: `self.0` came from sl_cuda_event_record and is freed exactly once, here.
        unsafe { ffi::sl_event_free(self.0) }
    }
}

/// Waits until everything this thread enqueued on its current stream of CUDA device `index` is
/// done (not the whole device: other threads' streams keep running).
pub fn cuda_sync_current_stream(index: usize) -> ShimResult<()> {
    // SAFETY: plain integer argument; the shim validates it.
    let err = unsafe { ffi::sl_cuda_sync_current_stream(cuda_index(index)?) };
    check("wait for the current CUDA stream", err)
}

/// What a build skips ([`without_init`], [`without_fills`]); the shim's modes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
enum SkipInit {
    Nothing = 0,
    RandomFills = 1,
    EveryFill = 2,
}

/// Sets this thread's skip-init mode; returns the previous one.
fn set_skip_init(mode: SkipInit) -> ShimResult<SkipInit> {
    let mut previous: c_int = 0;
    // SAFETY: the out-pointer is valid for a write; the shim checks the mode and only sets
    // thread-local state.
    let err = unsafe { ffi::sl_skip_init(mode as c_int, &mut previous) };
    check("switch random initialisation", err)?;
    Ok(match previous {
        1 => SkipInit::RandomFills,
        2 => SkipInit::EveryFill,
        _ => SkipInit::Nothing,
    })
}

/// Puts the thread's skip-init mode back, also when the closure unwinds.
struct RestoreSkipInit(SkipInit);

impl Drop for RestoreSkipInit {
    fn drop(&mut self) {
        if let Err(err) = set_skip_init(self.0) {
            tracing::warn!(%err, "restoring random initialisation");
        }
    }
}

fn skipping<R>(mode: SkipInit, f: impl FnOnce() -> R) -> R {
    let _restore = match set_skip_init(mode) {
        Ok(previous) => Some(RestoreSkipInit(previous)),
        Err(err) => {
            tracing::warn!(%err, "could not skip initialisation; building with it");
            None
        }
    };
    f()
}

/// Runs `f` with random initialisation skipped on this thread: random fills (`uniform_`,
/// `normal_`, `bernoulli_`, ...) leave their tensor as it is and random factories (`randn`,
/// `rand`) return uninitialised memory. Nothing is drawn from any generator. Deterministic
/// fills (`zeros`, `ones`, `fill_`) still run, so buffers a loader computes stay right. For
/// building a model whose every weight then comes from a checkpoint. If the shim cannot switch
/// (it always can on a libtorch it compiled against), `f` runs with initialisation on.
pub fn without_init<R>(f: impl FnOnce() -> R) -> R {
    skipping(SkipInit::RandomFills, f)
}

/// Like [`without_init`], and deterministic fills and factories (`zero_`, `fill_`, `zeros`,
/// `ones`, `full`) are skipped too: building touches none of the model's memory, so a model
/// bigger than the machine's RAM can be built when its weights then stream from a checkpoint
/// ([`crate`] users: `stageload::stream`). Every tensor of such a model is garbage until filled.
pub fn without_fills<R>(f: impl FnOnce() -> R) -> R {
    skipping(SkipInit::EveryFill, f)
}

/// The allocation size from which [`map_large_host_blocks`] makes glibc serve each block with its
/// own mapping.
pub const HOST_MMAP_THRESHOLD: usize = 1 << 20;

/// Makes glibc serve every host allocation of [`HOST_MMAP_THRESHOLD`] or more with its own
/// mapping, returned to the OS when freed, for the whole process. By default glibc raises its
/// mmap threshold each time a mapped block is freed (up to 32 MiB), after which weight-sized and
/// activation-sized blocks land in the heap: freed memory then stays in the process until a trim,
/// and how much stays depends on the order of frees (the working memory of one run differed by
/// 70 MiB from the next). A fixed threshold turns that off. Returns whether the setting took
/// (false where the C library is not glibc).
pub fn map_large_host_blocks() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets a parameter of glibc's allocator; M_MMAP_THRESHOLD accepts any
    // value up to 32 MiB on 64-bit targets and takes effect for later allocations.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, HOST_MMAP_THRESHOLD as libc::c_int) == 1
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    false
}

/// Makes libtorch's CPU tensors allocate through the host block cache, for the whole process
/// (once; later calls do nothing and return false): freed blocks of [`HOST_MMAP_THRESHOLD`] or
/// more are kept and handed to the next request of the same size (rounded up to whole pages)
/// instead of going back to the OS, so a forward that allocates the same activations at every
/// step stops faulting their pages in again at every step (a diffusion step spent a third of its
/// CPU time in the kernel doing that). A request the cache cannot serve first frees its oldest
/// kept blocks until live plus kept blocks are at most [`HostCacheStats::bound`]: the most the
/// live blocks reached since the last [`flush_host_cache`] plus two of the largest block asked for
/// since. Tensors allocated before the call keep libtorch's own allocator.
pub fn cache_host_blocks() -> ShimResult<bool> {
    let mut installed_now = false;
    // SAFETY: the out-pointer is valid for the call; the shim installs its allocator once.
    let err = unsafe { ffi::sl_host_cache_install(HOST_MMAP_THRESHOLD, HUGE_PAGE, &mut installed_now) };
    check("install the host block cache", err)?;
    Ok(installed_now)
}

/// The size from which the host block cache's own blocks may get huge pages
/// ([`huge_host_pages`]).
pub const HUGE_PAGE: usize = 2 << 20;

/// Whether the host block cache's blocks of [`HUGE_PAGE`] or more allocated from now on start at
/// a 2 MiB boundary and are advised as huge-page candidates (`MADV_HUGEPAGE`, as libtorch's own
/// allocator does with `C10_THP_MEM_ALLOC_ENABLE=1`), for the whole process; on by default.
/// Where the kernel gives advised memory huge pages (`/sys/kernel/mm/transparent_hugepage/enabled`
/// is `always` or `madvise`), the first touch of such a block takes one page fault per 2 MiB
/// instead of 512, which is most of the time of a load into fresh memory. Only whole, aligned
/// 2 MiB ranges of a block get a huge page, at their first touch, and then all of the range is
/// resident: the same memory for a tensor that is written whole, as weights and activations are.
pub fn huge_host_pages(on: bool) {
    // SAFETY: the call stores a flag; it cannot fail.
    unsafe { ffi::sl_host_cache_huge_pages(on) }
}

/// Frees every block the host block cache keeps (see [`cache_host_blocks`]); returns their bytes
/// (0 when the cache is not installed).
pub fn flush_host_cache() -> ShimResult<u64> {
    let mut freed = 0usize;
    // SAFETY: the out-pointer is valid for the call.
    let err = unsafe { ffi::sl_host_cache_flush(&mut freed) };
    check("flush the host block cache", err)?;
    Ok(freed as u64)
}

/// The host block cache's counters (see [`cache_host_blocks`]); bytes count whole pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HostCacheStats {
    /// Whether the cache is installed.
    pub installed: bool,
    /// Bytes of freed blocks kept for reuse now.
    pub kept: u64,
    /// Bytes of the blocks the cache handed out that are still in use.
    pub live: u64,
    /// The most `live` reached since the last flush.
    pub high: u64,
    /// The largest block asked for since the last flush.
    pub largest: u64,
    /// Requests served with a kept block, since the cache was installed.
    pub hits: u64,
    /// Requests of a cached size that found no kept block of their size.
    pub misses: u64,
}

impl HostCacheStats {
    /// What live plus kept blocks stay within: `high` plus two of `largest`.
    pub fn bound(&self) -> u64 {
        self.high.saturating_add(self.largest.saturating_mul(2))
    }
}

/// Reads the host block cache's counters.
pub fn host_cache_stats() -> ShimResult<HostCacheStats> {
    let mut installed = false;
    let mut out = [0usize; 6];
    // SAFETY: `out` has the six counters' room the shim writes.
    let err = unsafe { ffi::sl_host_cache_stats(&mut installed, out.as_mut_ptr()) };
    check("read the host block cache's counters", err)?;
    let [kept, live, high, largest, hits, misses] = out.map(|n| n as u64);
    Ok(HostCacheStats { installed, kept, live, high, largest, hits, misses })
}

/// Hands free heap memory back to the OS. libtorch's CPU allocator uses `malloc`; glibc keeps
/// freed blocks below its mmap threshold in its heap, so without a trim a released model's
/// smaller tensors would still count in the process RSS. A no-op where the C library is not
/// glibc.
pub fn trim_host_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks glibc's own arenas; it has no preconditions.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Sets the calling thread's nice value to `nice` (Linux: `setpriority(PRIO_PROCESS, tid)`,
/// which applies to one thread; threads it starts afterwards inherit it). Raising the value needs
/// no privilege; lowering it below where it was does. Err: the system's reason, or `Unsupported`
/// where a thread's own priority cannot be set this way.
pub fn set_thread_nice(nice: i32) -> std::io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: gettid and setpriority take and return plain integers and touch no memory of
        // this process's; `who` is this thread's id, so no other thread is affected.
        let done = unsafe {
            let tid = libc::gettid();
            libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, nice)
        };
        if done == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = nice;
        Err(std::io::Error::new(std::io::ErrorKind::Unsupported, "a thread's own nice value is set on Linux only"))
    }
}

// Issue 73: CUDA events queried and waited on by a stream, host registration errors cleared.
mod ordering;
pub use ordering::{clear_cuda_error, registered_host_buffer};
