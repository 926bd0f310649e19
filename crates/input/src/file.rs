//! Opening a path a user named, only when it is a regular file. A FIFO would block the open or
//! the read until some writer comes; `/dev/zero` or `/dev/urandom` would be read forever; a
//! directory opens fine on Linux and then fails with a misleading error. Each is refused by its
//! kind, and the message says which kind it is.

use std::fs::{File, FileType, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;

/// What a file that is not a regular file is, in words for an error message.
fn kind_of(kind: FileType) -> &'static str {
    if kind.is_dir() {
        "a directory"
    } else if kind.is_fifo() {
        "a named pipe (FIFO)"
    } else if kind.is_char_device() {
        "a character device"
    } else if kind.is_block_device() {
        "a block device"
    } else if kind.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    }
}

fn refuse(kind: FileType) -> io::Result<()> {
    if kind.is_file() {
        return Ok(());
    }
    let message = format!("is {}, not a regular file; give a file", kind_of(kind));
    Err(io::Error::new(io::ErrorKind::InvalidInput, message))
}

/// Opens `path` for reading if it is a regular file (symbolic links followed). The kind is
/// checked before the open (so a FIFO is never opened) and again on the open file (so a path
/// swapped in between is caught); the open itself does not block (`O_NONBLOCK`, which regular
/// files ignore).
pub fn open_regular(path: &Path) -> io::Result<File> {
    refuse(std::fs::metadata(path)?.file_type())?;
    let file = OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(path)?;
    refuse(file.metadata()?.file_type())?;
    Ok(file)
}

/// Reads a regular file of UTF-8 text of at most `cap` bytes. A larger file is refused before
/// it is read; a file that grows while it is read is cut at `cap + 1` bytes and refused.
pub fn read_text(path: &Path, cap: u64) -> io::Result<String> {
    let file = open_regular(path)?;
    let too_large = |length: u64| {
        io::Error::new(io::ErrorKind::InvalidData, format!("is {length} B, more than the {cap} B this file may have"))
    };
    let length = file.metadata()?.len();
    if length > cap {
        return Err(too_large(length));
    }
    let mut text = String::new();
    file.take(cap.saturating_add(1)).read_to_string(&mut text)?;
    if text.len() as u64 > cap {
        return Err(too_large(text.len() as u64));
    }
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::sys::stat::Mode;

    #[test]
    fn a_regular_file_opens_and_reads() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.toml");
        std::fs::write(&path, "x = 1\n").unwrap();
        assert_eq!(read_text(&path, 100).unwrap(), "x = 1\n");
    }

    #[test]
    fn a_fifo_is_refused_by_kind_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pipe");
        nix::unistd::mkfifo(&path, Mode::S_IRUSR | Mode::S_IWUSR).unwrap();
        let error = open_regular(&path).unwrap_err();
        assert_eq!(error.to_string(), "is a named pipe (FIFO), not a regular file; give a file");
    }

    #[test]
    fn a_directory_and_devices_are_refused_by_kind() {
        let dir = tempfile::tempdir().unwrap();
        assert!(open_regular(dir.path()).unwrap_err().to_string().starts_with("is a directory"));
        for device in ["/dev/zero", "/dev/urandom", "/dev/null"] {
            let error = read_text(Path::new(device), 1 << 20).unwrap_err();
            assert!(error.to_string().starts_with("is a character device"), "{device}: {error}");
        }
    }

    #[test]
    fn a_file_over_the_cap_is_refused_before_reading() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("big");
        let file = File::create(&path).unwrap();
        // Sparse: a terabyte that takes no disk, refused by its length alone.
        file.set_len(1 << 40).unwrap();
        let error = read_text(&path, 1 << 20).unwrap_err();
        assert_eq!(error.to_string(), "is 1099511627776 B, more than the 1048576 B this file may have");
    }

    #[test]
    fn a_missing_file_keeps_the_system_error() {
        let error = open_regular(Path::new("/nonexistent/x")).unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::NotFound);
    }
}
