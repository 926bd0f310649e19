//! Reading a range of a file through a mapping of just that range (`cpp/mapped.cpp`): map the
//! pages, and when they are in the page cache (`mincore`, sampled), read them in with one call
//! (`MADV_POPULATE_READ`), copy them out with non-temporal stores, the widest the CPU has
//! (64 bytes with AVX-512F, 32 with AVX2, else 16), unmap. `pread`'s copy goes through the
//! caches and reads each destination line before writing it; a 64-byte non-temporal store
//! writes a whole line without reading it. A C program filling fresh memory from the page cache
//! this way ran at 1.10x to 1.49x the rate of `pread`s into the same memory with 64-byte stores,
//! depending on the hour, and 0.98x to 1.33x with 16-byte ones
//! (`crates/bench/c/load-bench-mapped-stores.c`, `crates/bench/c/load-bench-mapped.c`).
//!
//! A mapping turns a file that shrinks while it is copied (or a disk that fails) into a SIGBUS,
//! which would end the process. The shim installs a handler (once, chaining to the one before
//! it) that turns a SIGBUS inside a copy in progress into [`MappedReadError::Bus`]; any other
//! SIGBUS goes to the handler that was there before, or ends the process as it would have. A
//! handler installed over the shim's afterwards bypasses the guard.

use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};

mod ffi {
    extern "C" {
        pub fn sl_mapped_read(
            fd: std::ffi::c_int,
            offset: i64,
            dst: *mut std::ffi::c_void,
            len: usize,
            prepare: std::ffi::c_int,
        ) -> std::ffi::c_int;
        #[cfg(test)]
        pub fn sl_stream_copy(
            dst: *mut std::ffi::c_void,
            src: *const std::ffi::c_void,
            n: usize,
            width: std::ffi::c_int,
        ) -> std::ffi::c_int;
    }
}

/// The shim's return codes besides 0 and an errno (`cpp/mapped.cpp`).
const UNSUPPORTED: i32 = -1;
const BUS: i32 = -2;
const NOT_CACHED: i32 = -3;

/// Set once this system has said it cannot populate a mapping; later reads fail at once.
static UNSUPPORTED_HERE: AtomicBool = AtomicBool::new(false);

/// Why [`read_mapped`] did not fill the destination (which may then hold part of the range):
/// the caller reads the range another way, which reports the file's own error if it has one.
#[derive(Debug, thiserror::Error)]
pub enum MappedReadError {
    /// This system cannot read a mapping in with one call (Linux before 5.14, or not Linux).
    #[error("this system cannot populate a file mapping (MADV_POPULATE_READ needs Linux 5.14 or later)")]
    Unsupported,
    /// A page of the range is not in the page cache (of those sampled: one in every 256 and the
    /// last): nothing was copied. From the disk, populating a mapping read slower than `pread`
    /// (1.25 against 1.39 GB/s on the load benchmark's checkpoint).
    #[error("part of the {len} bytes at offset {offset} is not in the page cache")]
    NotCached {
        /// The range's first byte in the file.
        offset: u64,
        /// The range's length.
        len: usize,
    },
    /// Mapping or populating the range failed (e.g. the range runs past the end of the file).
    #[error("mapping {len} bytes of the file at offset {offset} failed: {source}")]
    Map {
        /// The range's first byte in the file.
        offset: u64,
        /// The range's length.
        len: usize,
        /// The system's reason.
        source: std::io::Error,
    },
    /// A SIGBUS stopped the copy: the file shrank while it was copied, or its disk failed.
    #[error("the {len} bytes at offset {offset} could not be read from the file's mapping (SIGBUS: it shrank or its disk failed)")]
    Bus {
        /// The range's first byte in the file.
        offset: u64,
        /// The range's length.
        len: usize,
    },
}

/// Copies `dst.len()` bytes of `file` at `offset` into `dst` through a mapping of just those
/// pages, which the process holds only during the call, when every page is in the page cache
/// (see the module's text).
pub fn read_mapped(file: &std::fs::File, offset: u64, dst: &mut [u8]) -> Result<(), MappedReadError> {
    read(file, offset, dst, true)
}

/// `prepare` false (tests): copies without looking at the page cache or populating first.
fn read(file: &std::fs::File, offset: u64, dst: &mut [u8], prepare: bool) -> Result<(), MappedReadError> {
    if UNSUPPORTED_HERE.load(Ordering::Relaxed) {
        return Err(MappedReadError::Unsupported);
    }
    let len = dst.len();
    let too_far = || MappedReadError::Map {
        offset,
        len,
        source: std::io::Error::new(std::io::ErrorKind::InvalidInput, "the offset is past what a file offset holds"),
    };
    let at = i64::try_from(offset).map_err(|_| too_far())?;
    // SAFETY: `dst` is valid for `len` bytes of writes and borrowed exclusively for the call; the
    // shim maps the file's pages read-only, copies into `dst` only, and unmaps before returning.
    let code = unsafe { ffi::sl_mapped_read(file.as_raw_fd(), at, dst.as_mut_ptr().cast(), len, prepare.into()) };
    match code {
        0 => Ok(()),
        UNSUPPORTED => {
            UNSUPPORTED_HERE.store(true, Ordering::Relaxed);
            Err(MappedReadError::Unsupported)
        }
        BUS => Err(MappedReadError::Bus { offset, len }),
        NOT_CACHED => Err(MappedReadError::NotCached { offset, len }),
        errno => Err(MappedReadError::Map { offset, len, source: std::io::Error::from_raw_os_error(errno) }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn file_of(bytes: &[u8]) -> std::fs::File {
        let path = std::env::temp_dir().join(format!("stageload-mapped-{}-{}", std::process::id(), bytes.len()));
        std::fs::File::create(&path).unwrap().write_all(bytes).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        file
    }

    fn pattern(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 7 + i / 251) as u8).collect()
    }

    #[test]
    fn a_range_at_any_offset_and_length_is_copied_exactly() {
        let bytes = pattern((9 << 20) + 123);
        let file = file_of(&bytes);
        for (offset, len) in [(0, bytes.len()), (1, 4 << 20), (4095, 4097), (8 << 20, (1 << 20) + 123), (77, 0), (5, 3)]
        {
            let mut dst = vec![0u8; len + 1];
            read_mapped(&file, offset as u64, &mut dst[1..]).unwrap();
            assert_eq!(dst[0], 0, "a byte before the destination was written");
            assert!(dst[1..] == bytes[offset..offset + len], "range {offset}+{len} differs");
        }
    }

    #[test]
    fn every_store_width_the_cpu_runs_copies_any_alignment_and_length_exactly() {
        let source = pattern(4 << 10);
        let mut ran = Vec::new();
        for width in [16, 32, 64] {
            for (from, to, len) in [(0, 0, 4000), (1, 0, 3000), (0, 1, 1000), (13, 37, 2049), (5, 63, 127), (3, 9, 0)] {
                let mut dst = vec![0u8; len + 128];
                let target = &mut dst[to..to + len];
                // SAFETY: both ranges are valid for `len` bytes, and distinct.
                let code = unsafe {
                    ffi::sl_stream_copy(target.as_mut_ptr().cast(), source[from..].as_ptr().cast(), len, width)
                };
                if code == UNSUPPORTED {
                    continue;
                }
                assert_eq!(code, 0, "{width}-byte stores");
                assert!(dst[to..to + len] == source[from..from + len], "{width}-byte stores: {from}->{to}+{len}");
                assert!(dst[..to].iter().chain(&dst[to + len..]).all(|&b| b == 0), "{width}: wrote outside");
                ran.push(width);
            }
        }
        // 16-byte stores are part of x86-64 itself.
        if cfg!(target_arch = "x86_64") {
            assert!(ran.contains(&16), "ran {ran:?}");
        }
    }

    #[test]
    fn a_range_past_the_end_of_the_file_is_an_error() {
        let file = file_of(&pattern(10_000));
        let mut dst = vec![0u8; 20_000];
        // The pages past the end are in no cache.
        let err = read_mapped(&file, 4096, &mut dst).unwrap_err();
        assert!(matches!(err, MappedReadError::NotCached { offset: 4096, len: 20_000 }), "{err}");
        assert!(matches!(read_mapped(&file, u64::MAX, &mut dst[..1]), Err(MappedReadError::Map { .. })));
    }

    #[test]
    fn a_range_not_in_the_page_cache_is_left_to_the_caller_until_it_is() {
        let bytes = pattern(1 << 20);
        let file = file_of(&bytes);
        file.sync_all().unwrap();
        use std::os::fd::AsRawFd;
        // SAFETY: posix_fadvise only advises the kernel about this file's pages.
        let dropped = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        assert_eq!(dropped, 0);
        let mut dst = vec![0u8; bytes.len()];
        let err = read_mapped(&file, 0, &mut dst).unwrap_err();
        assert!(matches!(err, MappedReadError::NotCached { offset: 0, .. }), "{err}");
        assert!(dst.iter().all(|&b| b == 0), "nothing copied");
        std::os::unix::fs::FileExt::read_exact_at(&file, &mut dst, 0).unwrap();
        dst.fill(0);
        read_mapped(&file, 0, &mut dst).unwrap();
        assert!(dst == bytes);
    }

    #[test]
    fn a_sigbus_during_the_copy_is_an_error_and_the_process_goes_on() {
        // Unprepared, the pages past the file's end fault during the copy itself: a SIGBUS, as
        // when a file shrinks between the populate and the copy.
        let page = 4096;
        let file = file_of(&pattern(page));
        let mut dst = vec![0u8; 3 * page];
        for _ in 0..3 {
            let err = read(&file, 0, &mut dst, false).unwrap_err();
            assert!(matches!(err, MappedReadError::Bus { offset: 0, len } if len == 3 * page), "{err}");
        }
        // The copy ran until the fault: a block's loads all come before its stores, so at most
        // one block (128 bytes with 64-byte stores) before the faulting load is not written.
        let before_fault = page - 128;
        assert!(dst[..before_fault] == pattern(page)[..before_fault], "the copy stopped before the page's end");
        // The guard is gone and reads go on as before.
        let mut one = vec![0u8; page];
        read_mapped(&file, 0, &mut one).unwrap();
        assert!(one == pattern(page));
    }

    #[test]
    fn a_sigbus_in_one_thread_leaves_the_copies_of_the_others_alone() {
        let page = 4096;
        let bytes = pattern(64 * page);
        let file = file_of(&bytes);
        std::thread::scope(|scope| {
            for thread in 0..4 {
                let (file, bytes) = (&file, &bytes);
                scope.spawn(move || {
                    for _ in 0..50 {
                        if thread % 2 == 0 {
                            let mut dst = vec![0u8; 16 * page];
                            read_mapped(file, (thread * page) as u64, &mut dst).unwrap();
                            assert!(dst[..] == bytes[thread * page..(thread + 16) * page]);
                        } else {
                            let mut dst = vec![0u8; 2 * page];
                            let err = read(file, (63 * page) as u64, &mut dst, false).unwrap_err();
                            assert!(matches!(err, MappedReadError::Bus { .. }), "{err}");
                        }
                    }
                });
            }
        });
    }

    /// Run by the test below in a process of its own: a SIGBUS outside any copy.
    #[test]
    #[ignore = "run by a_sigbus_outside_a_copy_still_ends_the_process"]
    fn fault_outside_a_copy() {
        let file = file_of(&pattern(8));
        // The handler is installed.
        read_mapped(&file, 0, &mut [0u8; 8]).unwrap();
        // SAFETY: none: this maps a page past the end of the file and reads it, which raises
        // SIGBUS, to show that the guard does not swallow it; the process is meant to end here.
        unsafe {
            let map = libc::mmap(std::ptr::null_mut(), 8192, libc::PROT_READ, libc::MAP_SHARED, file.as_raw_fd(), 0);
            assert_ne!(map, libc::MAP_FAILED);
            std::ptr::read_volatile(map.cast::<u8>().add(4096));
        }
        println!("still running after the fault");
    }

    #[test]
    fn a_sigbus_outside_a_copy_still_ends_the_process() {
        use std::os::unix::process::ExitStatusExt;
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--ignored", "--exact", "mapped::tests::fault_outside_a_copy", "--nocapture", "--test-threads=1"])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let status = stageload_test_support::pids::wait_for(&mut child, std::time::Duration::from_secs(60))
            .expect("the faulting child ends within 60 s");
        let mut stdout = String::new();
        std::io::Read::read_to_string(&mut child.stdout.take().unwrap(), &mut stdout).unwrap();
        assert_eq!(status.signal(), Some(libc::SIGBUS), "{status:?}: {stdout}");
        assert!(!stdout.contains("still running"), "{stdout}");
    }
}
