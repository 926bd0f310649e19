//! Running a reference script of `scripts/reference/` with the cached Python environment that
//! holds diffusers (`STAGELOAD_PYTHON`), for the tests that compare a port against its original.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use tch::Tensor;

/// Runs `scripts/reference/{script}` with `args` within `deadline` (its log in `folder`), prints
/// the log, and reads the safetensors file `output` it wrote; an error says what to run when
/// `STAGELOAD_PYTHON` is not set.
pub fn run(
    script: &str,
    args: &[&OsStr],
    folder: &Path,
    output: &Path,
    deadline: Duration,
) -> Result<HashMap<String, Tensor>, String> {
    let python = std::env::var("STAGELOAD_PYTHON").map_err(|_| {
        "STAGELOAD_PYTHON is not set: this test compares against diffusers in the cached Python environment. \
         Run it through cargo xtask test, or first: eval \"$(scripts/setup-libtorch.sh)\"; \
         eval \"$(scripts/setup-reference.sh)\" (which installs diffusers there)"
            .to_string()
    })?;
    let log = folder.join("reference.log");
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/reference").join(script);
    let mut command = Command::new(&python);
    command.arg(&script).args(args);
    let ran = stageload_pipelines::compare::run_reference_script(command, "the reference", &log, output, deadline)
        .map_err(|e| e.to_string())?;
    eprintln!("{} in {:.1} s", std::fs::read_to_string(&log).unwrap_or_default().trim(), ran.seconds);
    Ok(ran.tensors)
}
