//! Reading a trace back. A run killed mid-write leaves a half-written last line: that line alone
//! is skipped. A broken line anywhere else is an error with its line number.

use std::path::{Path, PathBuf};

use thiserror::Error;

use crate::record::{Record, SCHEMA_VERSION};

#[derive(Debug, Error)]
pub enum TraceError {
    #[error("cannot read trace {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("trace {path}, line {line}: not a trace record ({message})")]
    Broken { path: PathBuf, line: usize, message: String },
    #[error("trace {path} has schema {found}; this stageload reads up to {SCHEMA_VERSION}: update stageload")]
    Schema { path: PathBuf, found: u32 },
    #[error("trace {path} holds no records")]
    Empty { path: PathBuf },
}

/// The records of one trace, in file order.
#[derive(Debug, Clone, PartialEq)]
pub struct Trace {
    pub path: PathBuf,
    pub records: Vec<Record>,
    /// The last line was half-written (the run was killed while writing it) and was skipped.
    pub skipped_last_line: bool,
}

/// Reads and parses a trace file.
pub fn read_trace(path: impl AsRef<Path>) -> Result<Trace, TraceError> {
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(|source| TraceError::Read { path: path.to_path_buf(), source })?;
    let text = String::from_utf8_lossy(&bytes);
    let lines: Vec<(usize, &str)> =
        text.lines().enumerate().map(|(i, line)| (i + 1, line.trim())).filter(|(_, line)| !line.is_empty()).collect();
    let mut records = Vec::with_capacity(lines.len());
    let mut skipped_last_line = false;
    for (index, (number, line)) in lines.iter().enumerate() {
        match serde_json::from_str::<Record>(line) {
            Ok(record) => records.push(record),
            Err(_) if index + 1 == lines.len() && index > 0 => skipped_last_line = true,
            Err(error) => {
                return Err(TraceError::Broken { path: path.to_path_buf(), line: *number, message: error.to_string() })
            }
        }
    }
    if records.is_empty() {
        return Err(TraceError::Empty { path: path.to_path_buf() });
    }
    if let Some(Record::Header(header)) = records.first() {
        if header.schema > SCHEMA_VERSION {
            return Err(TraceError::Schema { path: path.to_path_buf(), found: header.schema });
        }
        if header.schema < 2 {
            for record in &mut records {
                if let Record::Event(event) = record {
                    event.upgrade_v1_note();
                }
            }
        }
    }
    Ok(Trace { path: path.to_path_buf(), records, skipped_last_line })
}
