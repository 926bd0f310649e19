//! Test fixtures written by a Python script of the workspace with the cached environment's Python
//! (`STAGELOAD_PYTHON`, which `scripts/setup-libtorch.sh` exports): modules exported by torch
//! itself, for tests that load what users load.

use std::path::Path;
use std::process::Command;

/// Runs `script` with the cached Python to write its fixtures into `dir` (emptied first).
/// Panics, saying what to run, when `STAGELOAD_PYTHON` is not set or the script fails.
pub fn write_with_python(script: &Path, dir: &Path) {
    let python = std::env::var("STAGELOAD_PYTHON").unwrap_or_else(|_| {
        panic!(
            "STAGELOAD_PYTHON is not set: these tests write their fixtures with the cached torch ({}). \
             Run them through cargo xtask test, or first: eval \"$(scripts/setup-libtorch.sh)\"",
            script.display()
        )
    });
    if dir.exists() {
        std::fs::remove_dir_all(dir).unwrap();
    }
    std::fs::create_dir_all(dir).unwrap();
    let out = Command::new(&python).arg(script).arg(dir).output().unwrap();
    assert!(out.status.success(), "{python} {}: {}", script.display(), String::from_utf8_lossy(&out.stderr));
}
