//! Comparing a run against its Python original: the script ([`reference_script`], run by
//! [`run_script`] with the [`python`] given), the largest difference of two tensors
//! ([`Difference`]), and a run's differences and checks against [`TOLERANCE`] ([`Comparison`]).

use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use stageload::BoxError;
use tch::{Device, Kind, Tensor};

/// `scripts/reference/NAME` in this checkout; for a binary carried into a checkout on another
/// machine (the GPU check's device kit), the one in the checkout holding the binary.
pub fn reference_script(name: &str) -> PathBuf {
    let script = Path::new("scripts/reference").join(name);
    let built = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..").join(&script);
    if built.exists() {
        return built;
    }
    let exe = std::env::current_exe().ok();
    exe.and_then(|exe| exe.ancestors().map(|dir| dir.join(&script)).find(|path| path.exists())).unwrap_or(built)
}

/// The Python a comparison runs: `given`, else `$STAGELOAD_PYTHON`, else the cached environment
/// `scripts/setup-libtorch.sh` makes.
pub fn python(given: Option<&Path>) -> PathBuf {
    given
        .map(Path::to_path_buf)
        .or_else(|| std::env::var_os("STAGELOAD_PYTHON").map(PathBuf::from))
        .unwrap_or_else(|| crate::stageload_cache().join("torch-2.13.0/bin/python"))
}

/// The largest difference between two tensors, and the reference's value range.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Difference {
    /// max |rust - reference|.
    pub largest: f64,
    /// max - min of the reference.
    pub range: f64,
}

impl Difference {
    /// `rust` against `reference`: their dtypes and shapes must agree, and neither may be empty.
    pub fn of(what: &str, rust: &Tensor, reference: &Tensor) -> Result<Difference, BoxError> {
        if (rust.kind(), rust.size()) != (reference.kind(), reference.size()) || reference.numel() == 0 {
            return Err(format!(
                "{what}: Rust's {:?} {:?} against the reference's {:?} {:?} (both the same, not empty)",
                rust.kind(),
                rust.size(),
                reference.kind(),
                reference.size()
            )
            .into());
        }
        let (rust, reference) = (rust.to_device(Device::Cpu).to_kind(Kind::Double), reference.to_kind(Kind::Double));
        let largest = (&rust - &reference).abs().f_max()?.f_double_value(&[])?;
        let range = (reference.f_max()? - reference.f_min()?).f_double_value(&[])?;
        Ok(Difference { largest, range })
    }

    /// The largest difference as a fraction of the range.
    pub fn relative(&self) -> f64 {
        if self.range > 0.0 {
            self.largest / self.range
        } else {
            self.largest
        }
    }

    /// Whether the largest difference is within `tolerance` of the range (a NaN on either side
    /// never is).
    pub fn within(&self, tolerance: f64) -> bool {
        self.relative() <= tolerance
    }
}

impl fmt::Display for Difference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:.3e} ({:.3e} of the range {:.4})", self.largest, self.relative(), self.range)
    }
}

/// The largest difference from diffusers allowed, as a fraction of the reference's value range.
pub const TOLERANCE: f64 = 1e-5;

/// A run against the Python original: each compared tensor's largest difference, and the checks
/// that hold or not (the timesteps, a mesh's faces, a video's pixels, ...).
#[derive(Debug, Default)]
pub struct Comparison {
    /// (what, difference) for every tensor both sides have.
    pub differences: Vec<(&'static str, Difference)>,
    /// (what, whether it holds).
    pub equal: Vec<(&'static str, bool)>,
}

impl Comparison {
    /// What is not as the original has it: each check that fails and each tensor whose largest
    /// difference is not within [`TOLERANCE`] of its range. Empty: the run matches.
    pub fn failures(&self) -> Vec<String> {
        let checks = self.equal.iter().filter(|(_, ok)| !ok).map(|(what, _)| format!("{what}: not equal"));
        let tensors = self
            .differences
            .iter()
            .filter(|(_, d)| !d.within(TOLERANCE))
            .map(|(what, d)| format!("{what}: largest difference {d}, over {TOLERANCE:e} of the range"));
        checks.chain(tensors).collect()
    }

    /// Whether every tensor equals the original's (largest difference 0) and every check holds.
    pub fn identical(&self) -> bool {
        self.differences.iter().all(|(_, d)| d.largest == 0.0) && self.equal.iter().all(|(_, ok)| *ok)
    }
}

impl fmt::Display for Comparison {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (what, difference) in &self.differences {
            writeln!(f, "{what:<16} {difference}")?;
        }
        let checks: Vec<String> =
            self.equal.iter().map(|(what, ok)| format!("{what} {}", if *ok { "equal" } else { "DIFFER" })).collect();
        write!(f, "{}", checks.join(", "))
    }
}

/// Runs `command` (a reference script, `what`) offline with its output into `log`, within
/// `deadline`: one that runs past it is killed by its own pid. An error carries the log.
pub fn run_script(mut command: Command, what: &str, log: &Path, deadline: Duration) -> Result<(), String> {
    let stdout = File::create(log).map_err(|e| format!("creating {}: {e}", log.display()))?;
    let stderr = stdout.try_clone().map_err(|e| format!("{}: {e}", log.display()))?;
    let started = Instant::now();
    let mut child = command
        .env("HF_HUB_OFFLINE", "1")
        .stdout(stdout)
        .stderr(stderr)
        .spawn()
        .map_err(|e| format!("could not start {what}: {e}"))?;
    let read_log = || std::fs::read_to_string(log).unwrap_or_default();
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if started.elapsed() < deadline => std::thread::sleep(Duration::from_millis(50)),
            Ok(None) => {
                let pid = child.id();
                // Child::kill sends SIGKILL to this child's pid (never by name).
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "{what} (pid {pid}) ran past {} s and was killed; its output:\n{}",
                    deadline.as_secs(),
                    read_log()
                ));
            }
            Err(e) => return Err(format!("waiting for {what}: {e}")),
        }
    };
    if !status.success() {
        return Err(format!("{what} failed ({status}):\n{}", read_log()));
    }
    Ok(())
}
