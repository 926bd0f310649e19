//! Printing results to stdout. A reader that went away (`stageload plan x | head -1`) ends the
//! command quietly, as the Unix tools do, instead of a panic; any other write error is one line
//! on stderr and exit 2.

use std::io::{self, Write};

/// The exit code after stdout closed under us: 128 + SIGPIPE, what a shell shows for a tool
/// that SIGPIPE ended.
pub const CLOSED: i32 = 128 + 13;

/// Writes `text` to stdout; on failure ends the process (see the module docs).
pub fn print(text: &str) {
    let mut stdout = io::stdout().lock();
    if let Err(error) = stdout.write_all(text.as_bytes()).and_then(|()| stdout.flush()) {
        if error.kind() == io::ErrorKind::BrokenPipe {
            std::process::exit(CLOSED);
        }
        // stderr may be gone too; then there is no one left to tell.
        let _ = writeln!(io::stderr(), "stageload: cannot write to stdout: {error}");
        std::process::exit(2);
    }
}

/// [`print()`] with a line end.
pub fn line(text: &str) {
    print(&format!("{text}\n"));
}
