//! A whole file mapped privately, whose ranges storages use in place ([`attach_mapped`]): the
//! way `safetensors`' own `load_file` and `from_pretrained` hold weights. A reload that maps
//! instead of copying gives the model the page cache's pages themselves: nothing is allocated,
//! zeroed or copied, and the pages come in as they are touched (or at once, [`FileMapping::populate`]).
//!
//! 1. The mapping is private (`MAP_PRIVATE`, readable and writable): a write to a weight copies
//!    that page for this process and never reaches the file.
//! 2. Each storage holding a range keeps the mapping alive (an [`Arc`] handed to the storage's
//!    deleter); the file is unmapped when the last of them lets go (freed or destroyed) and the
//!    last [`Arc`] elsewhere drops.
//! 3. A page not yet copied by a write shows the file as it is now: a file written in place
//!    while mapped changes the weights, and one truncated under a mapping ends the process with
//!    SIGBUS at the next touch of a page past its end. Callers check the file has not changed
//!    before handing such weights out (the staged registry does, each time it hands a model out).

use std::fs::File;
use std::os::fd::AsRawFd;
use std::ptr::NonNull;
use std::sync::Arc;

use tch::Tensor;

use crate::{check, ShimError, ShimResult};

mod ffi {
    extern "C" {
        pub fn sl_storage_attach_owned(
            t: *const torch_sys::C_tensor,
            data: *mut std::ffi::c_void,
            nbytes: usize,
            context: *mut std::ffi::c_void,
            release: extern "C" fn(*mut std::ffi::c_void),
        ) -> *mut std::ffi::c_char;
    }
}

/// A file mapped whole, privately (see the module docs).
#[derive(Debug)]
pub struct FileMapping {
    base: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value until it drops; nothing in it is tied
// to a thread, and this type hands out no reference into it (storages reach it through raw
// pointers under the rules of `attach_mapped`).
unsafe impl Send for FileMapping {}
// SAFETY: as above; `&FileMapping` offers only its length and `populate`, a hint to the kernel.
unsafe impl Sync for FileMapping {}

impl FileMapping {
    /// Maps all of `file` privately. An empty file cannot be mapped (`EINVAL`).
    pub fn map(file: &File) -> std::io::Result<Arc<FileMapping>> {
        let len = usize::try_from(file.metadata()?.len())
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "file too large to map"))?;
        if len == 0 {
            return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
        }
        // SAFETY: a fresh private mapping of an open file; the kernel checks the descriptor and
        // the length, and the result is checked below.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE,
                file.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let base = NonNull::new(base.cast::<u8>()).ok_or_else(|| std::io::Error::from_raw_os_error(libc::EINVAL))?;
        Ok(Arc::new(FileMapping { base, len }))
    }

    /// The file's length when mapped.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: an empty file is not mapped.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Maps in the pages of `len` bytes at `offset` now (`MADV_POPULATE_READ`, reading them
    /// from the disk where they are not cached), so that the first touch finds them. Where
    /// the system cannot (Linux before 5.14), it leaves them to come in as touched, and says so.
    pub fn populate(&self, offset: usize, len: usize) -> std::io::Result<bool> {
        let end = offset.checked_add(len).filter(|&end| end <= self.len).ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::InvalidInput, "range past the end of the mapping")
        })?;
        let page = page_size();
        let start = offset / page * page;
        if end == start {
            return Ok(true);
        }
        // SAFETY: `start..end` lies inside this mapping (checked; `start` rounded down to a page
        // inside it); populating reads pages in and changes no byte.
        let done =
            unsafe { libc::madvise(self.base.as_ptr().add(start).cast(), end - start, libc::MADV_POPULATE_READ) };
        if done == 0 {
            return Ok(true);
        }
        let err = std::io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::EINVAL) | Some(libc::ENOSYS) => Ok(false),
            _ => Err(err),
        }
    }
}

impl Drop for FileMapping {
    fn drop(&mut self) {
        // SAFETY: `base..base + len` is this value's own mapping, and no storage uses it any
        // more (each holds an `Arc` until it lets go).
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
    }
}

fn page_size() -> usize {
    // SAFETY: sysconf reads a constant.
    usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096).max(1)
}

/// Called by a storage letting go of a range of a mapping: drops the `Arc` it held.
extern "C" fn release_mapping(context: *mut std::ffi::c_void) {
    // SAFETY: `context` is the pointer `Arc::into_raw` made in `attach_mapped`, handed to the
    // storage once and released by it once.
    drop(unsafe { Arc::from_raw(context.cast_const().cast::<FileMapping>()) });
}

/// Gives a freed CPU storage the `nbytes` bytes of `mapping` at `offset` in place: the storage
/// holds the mapping alive until it lets go of them (module docs, rule 2).
///
/// Refused (nothing attached) when the range runs past the mapping, is not aligned for the
/// tensor's dtype, or the storage is allocated or not on the CPU.
///
/// # Safety
///
/// As [`crate::realloc_storage`]: no other thread uses the storage meanwhile. Readers of the
/// storage see the file's bytes; the caller is responsible for the file not changing under
/// them (module docs, rule 3).
pub unsafe fn attach_mapped(
    tensor: &Tensor,
    mapping: &Arc<FileMapping>,
    offset: usize,
    nbytes: usize,
) -> ShimResult<()> {
    let refuse = |message: String| Err(ShimError { operation: "attach a file's mapping to a storage", message });
    if offset.checked_add(nbytes).is_none_or(|end| end > mapping.len || nbytes == 0) {
        return refuse(format!("{nbytes} bytes at offset {offset} do not lie inside the {} mapped", mapping.len));
    }
    let align = tensor.kind().elt_size_in_bytes().max(1);
    if !offset.is_multiple_of(align) {
        return refuse(format!("offset {offset} is not aligned for {:?} ({align} bytes)", tensor.kind()));
    }
    let context = Arc::into_raw(Arc::clone(mapping)).cast_mut().cast::<std::ffi::c_void>();
    // SAFETY: `tensor.as_ptr()` is a live `at::Tensor*`; the range lies inside the mapping
    // (checked), which lives while the storage holds `context`; the shim refuses an allocated
    // or non-CPU storage; exclusivity is this function's precondition.
    let err = unsafe {
        ffi::sl_storage_attach_owned(
            tensor.as_ptr(),
            mapping.base.as_ptr().add(offset).cast(),
            nbytes,
            context,
            release_mapping,
        )
    };
    let attached = check("attach a file's mapping to a storage", err);
    if attached.is_err() {
        // The storage did not take it.
        release_mapping(context);
    }
    attached
}
