//! The guard's log: one human line per decision on stderr (`HH:MM:SSZ guard: ...`, as the
//! original printed them) and, with `--log FILE`, one JSON line per decision with the readings
//! behind it, flushed at once so a killed guard leaves a complete log. A `--log` that cannot be
//! written (a full disk) is said on stderr, once per distinct error; the guard keeps guarding.

use std::fs::File;
use std::io::{self, Write};
use std::path::Path;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};
use stageload_probe::SystemMemory;

/// Writes decisions to stderr, to an optional JSON-lines file, and keeps them for callers
/// (tests, `--check`) to read back.
pub struct GuardLog {
    json: Option<(File, String)>,
    /// The last error writing the JSON file, said once.
    json_error: Option<String>,
    start: Instant,
    echo: bool,
    lines: Vec<String>,
}

/// The UTC time of day, `HH:MM:SSZ` (the time part of RFC 3339).
fn utc_stamp() -> String {
    let rfc3339 = humantime::format_rfc3339_seconds(SystemTime::now()).to_string();
    rfc3339.split_once('T').map_or(rfc3339.clone(), |(_, time)| time.to_string())
}

impl GuardLog {
    /// A log to stderr (when `echo`) and to `json_path` if given (created or truncated).
    pub fn new(json_path: Option<&Path>, echo: bool) -> io::Result<Self> {
        let json =
            json_path.map(|path| File::create(path).map(|file| (file, path.display().to_string()))).transpose()?;
        Ok(GuardLog { json, json_error: None, start: Instant::now(), echo, lines: Vec::new() })
    }

    /// A log that only keeps its lines (for tests and library callers).
    pub fn silent() -> Self {
        GuardLog { json: None, json_error: None, start: Instant::now(), echo: false, lines: Vec::new() }
    }

    /// The human lines written so far, without their time stamps.
    pub fn lines(&self) -> &[String] {
        &self.lines
    }

    /// Records a decision: `event` is its machine name (`waiting`, `start`, `stop`, `exit`, ...),
    /// `message` the human line, `memory` the system readings behind it.
    pub fn note(&mut self, event: &str, message: &str, memory: Option<&SystemMemory>) {
        self.record(event, message, memory, Value::Null);
    }

    /// Like [`note`](Self::note), with extra fields for the JSON line (pid, exit code, command
    /// memory, ...).
    pub fn record(&mut self, event: &str, message: &str, memory: Option<&SystemMemory>, extra: Value) {
        let line = format!("guard: {message}");
        if self.echo {
            // A closed stderr must not stop the guard from guarding.
            let _ = writeln!(io::stderr().lock(), "{} {line}", utc_stamp());
        }
        if let Some((file, path)) = &mut self.json {
            let record = json!({
                "t": self.start.elapsed().as_secs_f64(),
                "unix": SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64()),
                "event": event,
                "message": message,
                "memory": memory.map(|m| json!({
                    "total": m.total,
                    "available": m.available,
                    "available_percent": m.available_percent(),
                    "swap_total": m.swap_total,
                    "swap_used": m.swap_used,
                    "cgroup": m.cgroup,
                })),
                "detail": extra,
            });
            if let Err(error) = writeln!(file, "{record}").and_then(|()| file.flush()) {
                let error = format!("cannot write --log {path}: {error}; its lines from here on are lost");
                if self.json_error.as_ref() != Some(&error) {
                    let _ = writeln!(io::stderr().lock(), "{} guard: {error}", utc_stamp());
                    self.json_error = Some(error);
                }
            }
        }
        self.lines.push(line);
    }
}
