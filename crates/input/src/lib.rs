//! stageload-input: reading what users hand stageload (pipeline files, checkpoints, traces)
//! without being led astray by it. Torch-free.
//!
//! - [`mod@file`]: opening only regular files, refusing FIFOs, devices, sockets and directories by
//!   kind without blocking on them, and reading text up to a cap.
//! - [`header`]: a safetensors header read and checked without its data, with its length capped
//!   and checked against the file before anything is allocated (`stageload plan` and the
//!   checkpoint loader both read headers through it).

#![warn(missing_docs)]

pub mod file;
pub mod header;

pub use file::{open_regular, read_text};
pub use header::{read_header, Header, HeaderError, MAX_HEADER_LEN};
