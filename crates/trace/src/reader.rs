//! Reading a trace back. A run killed mid-write leaves a half-written last line: that line alone
//! is skipped. A broken line anywhere else is an error with its line number, and so are a second
//! header (two traces written into one file) and a time outside `0 ..= MAX_T`.
//!
//! Records out of time order (threads that took their time stamps before they took the writer)
//! are sorted by time, file order breaking ties, and the trace says it was reordered: everything
//! that reads a [`Trace`] may rely on its records being in time order.

use std::io::Read;
use std::path::{Path, PathBuf};

use thiserror::Error;

use crate::record::{Record, SCHEMA_VERSION};

/// Why a trace could not be read.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum TraceError {
    /// The file could not be read.
    #[error("cannot read trace {path}: {source}")]
    Read {
        /// The trace file.
        path: PathBuf,
        /// The system's error.
        source: std::io::Error,
    },
    /// A line is not a trace record.
    #[error("trace {path}, line {line}: not a trace record ({message})")]
    Broken {
        /// The trace file.
        path: PathBuf,
        /// The line's number, from 1.
        line: usize,
        /// The parser's message.
        message: String,
    },
    /// The trace is of a newer schema than this reader.
    #[error("trace {path} has schema {found}; this stageload reads up to {SCHEMA_VERSION}: update stageload")]
    Schema {
        /// The trace file.
        path: PathBuf,
        /// Its schema version.
        found: u32,
    },
    /// The file holds no record.
    #[error("trace {path} holds no records")]
    Empty {
        /// The trace file.
        path: PathBuf,
    },
}

/// The latest time a record may have, in seconds (about three years): later is a broken clock or
/// a hand-made file, and would stretch a chart's axis without end.
pub const MAX_T: f64 = 1e8;

/// The records of one trace, in file order.
#[derive(Debug, Clone, PartialEq)]
pub struct Trace {
    /// The trace file.
    pub path: PathBuf,
    /// Its records, in file order.
    pub records: Vec<Record>,
    /// The last line was half-written (the run was killed while writing it) and was skipped.
    pub skipped_last_line: bool,
    /// Some records were out of time order in the file and were sorted.
    pub reordered: bool,
}

impl Trace {
    /// A trace of `records`, sorted by time as [`read_trace`] sorts them.
    pub fn new(path: impl Into<PathBuf>, mut records: Vec<Record>) -> Trace {
        let reordered = sort_by_time(&mut records);
        Trace { path: path.into(), records, skipped_last_line: false, reordered }
    }
}

/// Sorts records by time (stable; a header, which has none, stays first). True if any moved.
fn sort_by_time(records: &mut [Record]) -> bool {
    let in_order = records.windows(2).all(|pair| pair[0].t().unwrap_or(0.0) <= pair[1].t().unwrap_or(0.0));
    if !in_order {
        records.sort_by(|a, b| a.t().unwrap_or(-1.0).total_cmp(&b.t().unwrap_or(-1.0)));
    }
    !in_order
}

/// Reads and parses a trace file.
pub fn read_trace(path: impl AsRef<Path>) -> Result<Trace, TraceError> {
    let path = path.as_ref();
    let read_error = |source| TraceError::Read { path: path.to_path_buf(), source };
    let mut bytes = Vec::new();
    stageload_input::open_regular(path).and_then(|mut file| file.read_to_end(&mut bytes)).map_err(read_error)?;
    let text = String::from_utf8_lossy(&bytes);
    let lines: Vec<(usize, &str)> =
        text.lines().enumerate().map(|(i, line)| (i + 1, line.trim())).filter(|(_, line)| !line.is_empty()).collect();
    let mut records = Vec::with_capacity(lines.len());
    let mut skipped_last_line = false;
    let broken = |line: usize, message: String| TraceError::Broken { path: path.to_path_buf(), line, message };
    for (index, (number, line)) in lines.iter().enumerate() {
        match serde_json::from_str::<Record>(line) {
            Ok(Record::Header(_)) if index > 0 => {
                return Err(broken(
                    *number,
                    "a second header: two traces written into one file? Give each its own".into(),
                ))
            }
            Ok(record) => {
                if let Some(t) = record.t().filter(|t| !(0.0..=MAX_T).contains(t)) {
                    return Err(broken(*number, format!("time {t} s is outside 0 ..= {MAX_T} s")));
                }
                records.push(record)
            }
            Err(_) if index + 1 == lines.len() && index > 0 => skipped_last_line = true,
            Err(error) => return Err(broken(*number, error.to_string())),
        }
    }
    if records.is_empty() {
        return Err(TraceError::Empty { path: path.to_path_buf() });
    }
    if let Some(Record::Header(header)) = records.first() {
        if header.schema > SCHEMA_VERSION {
            return Err(TraceError::Schema { path: path.to_path_buf(), found: header.schema });
        }
    }
    let reordered = sort_by_time(&mut records);
    Ok(Trace { path: path.to_path_buf(), records, skipped_last_line, reordered })
}
