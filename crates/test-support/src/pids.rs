//! Process helpers for tests that start commands: the pid a command wrote, whether a pid runs,
//! and waiting for a child with a deadline.

use std::path::Path;
use std::time::{Duration, Instant};

/// The pid a test command wrote to `path`, waiting up to 10 s for it.
pub fn read_pid(path: &Path) -> i32 {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(pid) = std::fs::read_to_string(path).ok().and_then(|t| t.trim().parse().ok()) {
            return pid;
        }
        assert!(Instant::now() < deadline, "{} never written", path.display());
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Whether `pid` still runs (a zombie, or a pid now used by nobody, counts as gone).
pub fn running(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|stat| stat.rsplit_once(')').is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z')))
        .unwrap_or(false)
}

/// Waits up to `limit` for `child`, a process the caller started; past it, stops the child by its
/// own pid, reaps it and returns `None`.
pub fn wait_for(child: &mut std::process::Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().expect("wait for the child") {
            return Some(status);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
