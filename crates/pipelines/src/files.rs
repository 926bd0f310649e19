//! Writing an output file whole or not at all ([`write_atomically`]), and why one could not be
//! written ([`FileError`]).

use std::fs::File;
use std::io::BufWriter;
use std::path::{Path, PathBuf};

/// Why an output file could not be written; names the file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FileError {
    /// Writing, flushing or renaming failed.
    #[error("writing {}: {source}", path.display())]
    Io {
        /// The destination.
        path: PathBuf,
        /// The system's error.
        source: std::io::Error,
    },
    /// Encoding the image failed.
    #[error("encoding {}: {source}", path.display())]
    Encode {
        /// The destination.
        path: PathBuf,
        /// The encoder's error.
        source: image::ImageError,
    },
    /// The tensors do not have the shapes this writer takes, or a count does not fit its field.
    #[error("{}: {message}", path.display())]
    Shape {
        /// The destination.
        path: PathBuf,
        /// What does not fit.
        message: String,
    },
}

/// Runs `write` into a temporary file beside `path` and renames it over `path` once complete.
pub fn write_atomically(
    path: &Path,
    write: impl FnOnce(&mut BufWriter<File>) -> std::io::Result<()>,
) -> Result<(), FileError> {
    let io = |source| FileError::Io { path: path.to_path_buf(), source };
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let temporary = path.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
    let result = (|| {
        let mut out = BufWriter::new(File::create(&temporary)?);
        write(&mut out)?;
        out.into_inner().map_err(|e| e.into_error())?.sync_all()?;
        std::fs::rename(&temporary, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&temporary);
    }
    result.map_err(io)
}
