//! Files kept open between readings and read again from their start (`pread` at offset 0): a
//! procfs or cgroupfs file makes its content afresh at every read from offset 0, so a reading
//! that recurs every poll costs one or two reads instead of an open, a stat, reads and a close.
//! A kept `/proc/PID/...` file belongs to the process it was opened for: once that process is
//! gone (reaped), reading it fails (`ESRCH`), it never shows a later process that reuses the pid.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// The size a read buffer starts at: `/proc/PID/status` and `/proc/meminfo` fit in one read.
const FIRST_BUFFER: usize = 8192;

/// The most a kept file is read to: the files kept are a few KiB; one that keeps growing past
/// this is refused rather than followed.
const MOST: usize = 4 << 20;

/// One file kept open, read whole from its start by each [`read`](Kept::read).
#[derive(Debug)]
pub(crate) struct Kept(File);

impl Kept {
    /// Opens `path` for reading.
    pub(crate) fn open(path: &Path) -> io::Result<Kept> {
        File::open(path).map(Kept)
    }

    /// The file's whole content now, read into `buffer` (a scratch buffer the caller keeps, so
    /// that repeated readings allocate nothing: it only grows when a content does not fit).
    pub(crate) fn read<'b>(&self, buffer: &'b mut Vec<u8>) -> io::Result<&'b [u8]> {
        if buffer.len() < FIRST_BUFFER {
            buffer.resize(FIRST_BUFFER, 0);
        }
        let mut filled = 0;
        loop {
            if filled == buffer.len() {
                if buffer.len() >= MOST {
                    return Err(io::Error::new(io::ErrorKind::InvalidData, format!("longer than {MOST} bytes")));
                }
                buffer.resize((2 * buffer.len()).min(MOST), 0);
            }
            // A seq_file may stop a read short of the end (at a record that does not fit), so the
            // end is the read that returns nothing.
            match self.0.read_at(&mut buffer[filled..], filled as u64) {
                Ok(0) => return Ok(&buffer[..filled]),
                Ok(n) => filled += n,
                Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
                Err(error) => return Err(error),
            }
        }
    }
}

/// Whether a read error says the file's process or group is gone (rather than that the file
/// could not be read for another reason): `ESRCH` from a kept `/proc/PID` file of a reaped
/// process, `ENOENT` when a file of it is opened after, `ENODEV` from a removed cgroup's file.
pub(crate) fn is_gone(error: &io::Error) -> bool {
    matches!(error.raw_os_error(), Some(code) if code == ESRCH || code == ENOENT || code == ENODEV)
}

// The Linux (and macOS, for the first two) numbers of the errors above; std names no errno.
const ENOENT: i32 = 2;
const ESRCH: i32 = 3;
const ENODEV: i32 = 19;

/// A decimal number of ASCII digits (`None` for anything else, empty or too large).
pub(crate) fn parse_u64(digits: &[u8]) -> Option<u64> {
    if digits.is_empty() {
        return None;
    }
    digits.iter().try_fold(0u64, |value, &digit| {
        if !digit.is_ascii_digit() {
            return None;
        }
        value.checked_mul(10)?.checked_add(u64::from(digit - b'0'))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kept_file_read_again_gives_its_new_content_and_grows_its_buffer() {
        let folder = tempfile::tempdir().unwrap();
        let path = folder.path().join("memory.current");
        std::fs::write(&path, "100\n").unwrap();
        let kept = Kept::open(&path).unwrap();
        let mut buffer = Vec::new();
        assert_eq!(kept.read(&mut buffer).unwrap(), b"100\n");
        // Rewritten in place (cgroupfs and procfs make theirs afresh at each read from 0).
        std::fs::write(&path, "250\n").unwrap();
        assert_eq!(kept.read(&mut buffer).unwrap(), b"250\n");
        let long = "x".repeat(3 * FIRST_BUFFER + 5);
        std::fs::write(&path, &long).unwrap();
        assert_eq!(kept.read(&mut buffer).unwrap(), long.as_bytes());
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn a_kept_proc_file_follows_its_process_and_fails_once_it_is_reaped() {
        let mut child = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let kept = Kept::open(Path::new(&format!("/proc/{}/stat", child.id()))).unwrap();
        let mut buffer = Vec::new();
        let state = |text: &[u8]| {
            let close = text.iter().rposition(|&b| b == b')').unwrap();
            text[close + 2]
        };
        assert_ne!(state(kept.read(&mut buffer).unwrap()), b'Z');
        child.kill().unwrap();
        // Killed but not reaped: a zombie, read through the same file.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while state(kept.read(&mut buffer).unwrap()) != b'Z' && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!(state(kept.read(&mut buffer).unwrap()), b'Z');
        child.wait().unwrap();
        let error = kept.read(&mut buffer).unwrap_err();
        assert!(is_gone(&error), "{error}");
    }

    #[test]
    fn numbers_are_plain_decimal_digits() {
        assert_eq!(parse_u64(b"0"), Some(0));
        assert_eq!(parse_u64(b"18446744073709551615"), Some(u64::MAX));
        assert_eq!(parse_u64(b"18446744073709551616"), None);
        assert_eq!(parse_u64(b""), None);
        assert_eq!(parse_u64(b"12a"), None);
        assert_eq!(parse_u64(b"-1"), None);
    }
}
