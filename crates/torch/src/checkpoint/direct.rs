//! Reads past the page cache straight into memory (`O_DIRECT`): the disk's DMA writes the bytes
//! where they go, so the CPU does none of a buffered read's work (the kernel's copy out of the
//! page cache, dropping the pages after). Measured beside a two-thread compute on this 2-core
//! machine (`crates/bench/c/read-beside-compute.c`): it slows the compute 1.10-1.12x where
//! buffered reads slow it 1.24-1.35x, but reads the disk at 1.15-1.2 GB/s where buffered reads
//! reach 1.6.

use std::fs::File;
use std::os::unix::fs::FileExt;

use stageload_plan::split::DIRECT_UNIT;

use super::{reopen, Checkpoint, CheckpointError, PIECE};

/// Threads that read one range at once: the C measurement's best CPU per byte with 4 MiB pieces.
const DIRECT_READERS: usize = 4;

/// What [`Checkpoint::read_direct`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Direct {
    /// Every byte read.
    Read,
    /// Nothing read: the file system does not read past its cache (tmpfs, some network file
    /// systems), or the range or memory is not aligned to [`DIRECT_UNIT`]. Read it buffered.
    Unsupported,
}

impl Checkpoint {
    /// Reads `memory.len()` bytes of file `file` from `offset` past the page cache, straight
    /// into `memory`, by up to [`DIRECT_READERS`] threads in [`PIECE`]s through one handle on
    /// the file opened again with `O_DIRECT` (once per checkpoint). The offset, the length and
    /// the memory's address must be multiples of [`DIRECT_UNIT`] and the range inside the file;
    /// otherwise, or where the file cannot be opened that way, nothing is read
    /// ([`Direct::Unsupported`]). `tensor` names the range in an error.
    pub(crate) fn read_direct(
        &self,
        file: usize,
        offset: u64,
        memory: &mut [u8],
        tensor: &str,
    ) -> Result<Direct, CheckpointError> {
        let unit = DIRECT_UNIT as usize;
        let aligned = offset.is_multiple_of(DIRECT_UNIT)
            && memory.len().is_multiple_of(unit)
            && (memory.as_ptr() as usize).is_multiple_of(unit);
        let Some(handle) = self.direct_handle(file).filter(|_| aligned && !memory.is_empty()) else {
            return Ok(Direct::Unsupported);
        };
        let share = memory.len().div_ceil(DIRECT_READERS).div_ceil(unit).saturating_mul(unit).max(unit);
        let outcomes: Vec<std::io::Result<()>> = std::thread::scope(|scope| {
            let mut parts = memory.chunks_mut(share).enumerate();
            let mine = parts.next();
            let at = |i: usize| offset.saturating_add((i * share) as u64);
            let others: Vec<_> = parts.map(|(i, part)| scope.spawn(move || read_pieces(handle, at(i), part))).collect();
            let mut outcomes = vec![mine.map_or(Ok(()), |(_, part)| read_pieces(handle, offset, part))];
            let joined = others
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err(std::io::Error::other("a reader panicked"))));
            outcomes.extend(joined);
            outcomes
        });
        for outcome in outcomes {
            match outcome {
                Ok(()) => {}
                // Refused by the file system for this range after all: read it buffered.
                Err(err) if err.raw_os_error() == Some(nix::libc::EINVAL) => return Ok(Direct::Unsupported),
                Err(source) => {
                    return Err(CheckpointError::Read {
                        tensor: tensor.to_string(),
                        path: self.files[file].clone(),
                        source,
                    })
                }
            }
        }
        Ok(Direct::Read)
    }

    /// File `file` opened again with `O_DIRECT`, on first use; `None` where that fails.
    fn direct_handle(&self, file: usize) -> Option<&File> {
        let (once, shared) = (self.direct_handles.get(file)?, self.handles.get(file)?);
        once.get_or_init(|| reopen(shared, nix::libc::O_DIRECT)).as_ref()
    }

    /// Reads `memory.len()` bytes of file `file` from `offset` through the page cache, then
    /// drops them from it: the ends of a range read past the cache that are not whole units.
    pub(crate) fn read_and_drop(
        &self,
        file: usize,
        offset: u64,
        memory: &mut [u8],
        tensor: &str,
    ) -> Result<(), CheckpointError> {
        let path = self.files.get(file).cloned().unwrap_or_default();
        let read = |source| CheckpointError::Read { tensor: tensor.to_string(), path: path.clone(), source };
        let handle = self.handles.get(file).ok_or_else(|| read(std::io::Error::other("no such file")))?;
        handle.read_exact_at(memory, offset).map_err(read)?;
        self.drop_range(file, offset, memory.len() as u64, tensor)
    }
}

/// Reads `part` from `handle` at `at`, in [`PIECE`]s, each to its end (a short read past the
/// file's end is an error: the range was checked to lie inside it).
fn read_pieces(handle: &File, at: u64, part: &mut [u8]) -> std::io::Result<()> {
    for (i, piece) in part.chunks_mut(PIECE).enumerate() {
        handle.read_exact_at(piece, at.saturating_add((i * PIECE) as u64))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::Direct;
    use crate::checkpoint::Checkpoint;

    /// A checkpoint of one uint8 entry of `bytes` bytes counting up from 0 (mod 251).
    fn counting(bytes: usize) -> (tempfile::TempDir, Checkpoint, Vec<u8>) {
        let data: Vec<u8> = (0..bytes).map(|i| (i % 251) as u8).collect();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.safetensors");
        let view = safetensors::tensor::TensorView::new(safetensors::Dtype::U8, vec![bytes], &data).unwrap();
        safetensors::serialize_to_file([("w", view)], None, &path).unwrap();
        let checkpoint = Checkpoint::open(&[&path]).unwrap();
        let file = std::fs::read(&path).unwrap();
        (dir, checkpoint, file)
    }

    /// Whether the file system of `dir` reads past its cache: all but tmpfs among those this
    /// runs on.
    fn reads_direct(dir: &tempfile::TempDir) -> bool {
        let fs = nix::sys::statfs::statfs(dir.path()).unwrap();
        fs.filesystem_type() != nix::sys::statfs::TMPFS_MAGIC
    }

    /// Memory aligned to a unit: a buffer with a unit to spare, and where the aligned part starts.
    fn aligned(bytes: usize) -> (Vec<u8>, usize) {
        let buffer = vec![0u8; bytes + 4096];
        let at = buffer.as_ptr().align_offset(4096);
        (buffer, at)
    }

    #[test]
    fn a_direct_read_lands_the_files_bytes_in_place_or_says_it_cannot() {
        let (dir, checkpoint, file) = counting(5 << 20);
        let (mut buffer, at) = aligned(4 << 20);
        let memory = &mut buffer[at..at + (4 << 20)];
        match checkpoint.read_direct(0, 4096, memory, "w").unwrap() {
            Direct::Read => assert!(memory == &file[4096..4096 + (4 << 20)], "the bytes differ from the file's"),
            Direct::Unsupported => {
                assert!(!reads_direct(&dir), "a disk's file system read nothing");
                assert!(memory.iter().all(|&b| b == 0));
            }
        }
    }

    #[test]
    fn a_range_or_memory_off_the_unit_is_not_read() {
        let (_dir, checkpoint, _) = counting(1 << 20);
        let (mut buffer, at) = aligned(64 << 10);
        for (offset, range) in [(100u64, at..at + 8192), (4096, at + 64..at + 64 + 8192), (4096, at..at + 5000)] {
            let memory = &mut buffer[range];
            assert_eq!(checkpoint.read_direct(0, offset, memory, "w").unwrap(), Direct::Unsupported);
            assert!(memory.iter().all(|&b| b == 0));
        }
        assert_eq!(checkpoint.read_direct(7, 0, &mut buffer[at..at + 4096], "w").unwrap(), Direct::Unsupported);
    }

    #[test]
    fn a_range_past_the_files_end_is_an_error_naming_the_tensor_and_file() {
        let (dir, checkpoint, _) = counting(1 << 20);
        let (mut buffer, at) = aligned(2 << 20);
        match checkpoint.read_direct(0, 0, &mut buffer[at..at + (2 << 20)], "w") {
            Ok(Direct::Unsupported) => assert!(!reads_direct(&dir), "a disk's file system read nothing"),
            Err(err) => {
                let text = err.to_string();
                assert!(text.contains("'w'") && text.contains("w.safetensors"), "{text}");
            }
            Ok(Direct::Read) => panic!("read 2 MiB from a file of 1 MiB"),
        }
    }
}
