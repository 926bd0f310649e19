//! Comparing a run against its Python original: the script ([`reference_script`], its command
//! line begun by [`reference_command`], run by
//! [`run_script`] with the [`python`] given, or by [`run_reference_script`], which reads back the
//! tensors it wrote), the largest difference of two tensors ([`Difference`]), and a run's
//! differences and checks against [`TOLERANCE`] ([`Comparison`]). Every failure is a
//! [`CompareError`] naming the script, file or tensor.

use std::collections::HashMap;
use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::time::{Duration, Instant};

use tch::{Device, Kind, TchError, Tensor};

/// Why a reference script did not give its outputs, or two tensors could not be compared.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CompareError {
    /// The script's log file could not be created.
    #[error("{what}: could not create its log {}: {source}", log.display())]
    Log {
        /// The script.
        what: String,
        /// The log file.
        log: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The Python could not be started.
    #[error(
        "could not start {what} with {}: {source} (give --python, set STAGELOAD_PYTHON, or make the cached \
         environment: eval \"$(scripts/setup-libtorch.sh)\"; eval \"$(scripts/setup-reference.sh)\")",
        python.display()
    )]
    Start {
        /// The script.
        what: String,
        /// The program it was run with.
        python: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The script ran past its deadline and was killed.
    #[error(
        "{what} (pid {pid}) ran past {seconds} s and was killed (give it a longer deadline); its output:\n{output}"
    )]
    Deadline {
        /// The script.
        what: String,
        /// Its process id.
        pid: u32,
        /// The deadline in seconds.
        seconds: u64,
        /// Its log.
        output: String,
    },
    /// Waiting for the script failed.
    #[error("waiting for {what}: {source}")]
    Wait {
        /// The script.
        what: String,
        /// Why.
        source: std::io::Error,
    },
    /// The script exited with a failure.
    #[error("{what} failed ({status}); its output:\n{output}")]
    Failed {
        /// The script.
        what: String,
        /// Its exit status.
        status: ExitStatus,
        /// Its log.
        output: String,
    },
    /// A file the script wrote could not be read.
    #[error("reading {}, which the reference script writes: {source}", file.display())]
    Read {
        /// The file.
        file: PathBuf,
        /// Why.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The script's output holds no tensor of this name.
    #[error("the reference wrote no {name}: is its script (scripts/reference/) of this checkout's version?")]
    Missing {
        /// The tensor.
        name: String,
    },
    /// The two sides of a comparison differ in dtype or shape, or the reference's is empty.
    #[error(
        "{what}: Rust's {rust_kind:?} {rust_shape:?} against the reference's {kind:?} {shape:?} (both the same, not empty)"
    )]
    Mismatch {
        /// The tensor compared.
        what: String,
        /// Rust's dtype and shape.
        rust_kind: Kind,
        /// Rust's shape.
        rust_shape: Vec<i64>,
        /// The reference's dtype.
        kind: Kind,
        /// The reference's shape.
        shape: Vec<i64>,
    },
    /// libtorch failed on a compared tensor.
    #[error("{what}: {source}")]
    Tensor {
        /// The tensor compared.
        what: String,
        /// Why.
        source: TchError,
    },
}

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

/// `python scripts/reference/{script} --components {components} --steps {steps} --guidance
/// {guidance} --out {output}`: what every pipeline's reference run is given; the pipeline adds
/// its own arguments.
pub fn reference_command(
    python: &Path,
    script: &str,
    components: &Path,
    steps: impl fmt::Display,
    guidance: impl fmt::Display,
    output: &Path,
) -> Command {
    let mut command = Command::new(python);
    command
        .arg(reference_script(script))
        .arg("--components")
        .arg(components)
        .args(["--steps", &steps.to_string(), "--guidance", &guidance.to_string()])
        .arg("--out")
        .arg(output);
    command
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
    pub fn of(what: &str, rust: &Tensor, reference: &Tensor) -> Result<Difference, CompareError> {
        if (rust.kind(), rust.size()) != (reference.kind(), reference.size()) || reference.numel() == 0 {
            return Err(CompareError::Mismatch {
                what: what.to_string(),
                rust_kind: rust.kind(),
                rust_shape: rust.size(),
                kind: reference.kind(),
                shape: reference.size(),
            });
        }
        let measure = || -> Result<Difference, TchError> {
            let (rust, reference) =
                (rust.to_device(Device::Cpu).to_kind(Kind::Double), reference.to_kind(Kind::Double));
            let largest = (&rust - &reference).abs().f_max()?.f_double_value(&[])?;
            let range = (reference.f_max()? - reference.f_min()?).f_double_value(&[])?;
            Ok(Difference { largest, range })
        };
        measure().map_err(|source| CompareError::Tensor { what: what.to_string(), source })
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
pub fn run_script(mut command: Command, what: &str, log: &Path, deadline: Duration) -> Result<(), CompareError> {
    let log_error = |source| CompareError::Log { what: what.to_string(), log: log.to_path_buf(), source };
    let stdout = File::create(log).map_err(log_error)?;
    let stderr = stdout.try_clone().map_err(log_error)?;
    let started = Instant::now();
    let python = PathBuf::from(command.get_program());
    let mut child = command
        .env("HF_HUB_OFFLINE", "1")
        .stdout(stdout)
        .stderr(stderr)
        .spawn()
        .map_err(|source| CompareError::Start { what: what.to_string(), python, source })?;
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
                return Err(CompareError::Deadline {
                    what: what.to_string(),
                    pid,
                    seconds: deadline.as_secs(),
                    output: read_log(),
                });
            }
            Err(source) => return Err(CompareError::Wait { what: what.to_string(), source }),
        }
    };
    if !status.success() {
        return Err(CompareError::Failed { what: what.to_string(), status, output: read_log() });
    }
    Ok(())
}

/// What a reference script wrote: its tensors by name, and how long it ran.
#[derive(Debug)]
pub struct ScriptOutput {
    /// The tensors of its output file.
    pub tensors: HashMap<String, Tensor>,
    /// Its wall time, start to exit.
    pub seconds: f64,
}

/// The tensor `name` a reference script wrote; its absence is an error naming it.
pub fn reference_tensor<'a>(tensors: &'a HashMap<String, Tensor>, name: &str) -> Result<&'a Tensor, CompareError> {
    tensors.get(name).ok_or_else(|| CompareError::Missing { name: name.to_string() })
}

/// Runs `command` as [`run_script`] does (its output into `log`), then reads the safetensors file
/// it wrote to `output`.
pub fn run_reference_script(
    command: Command,
    what: &str,
    log: &Path,
    output: &Path,
    deadline: Duration,
) -> Result<ScriptOutput, CompareError> {
    let started = Instant::now();
    run_script(command, what, log, deadline)?;
    let seconds = started.elapsed().as_secs_f64();
    let tensors = Tensor::read_safetensors(output)
        .map_err(|source| CompareError::Read { file: output.to_path_buf(), source: source.into() })?;
    Ok(ScriptOutput { tensors: tensors.into_iter().collect(), seconds })
}

/// The JSON summary a reference script wrote to `file`.
pub fn read_summary(file: &Path) -> Result<serde_json::Value, CompareError> {
    let read =
        |source: Box<dyn std::error::Error + Send + Sync>| CompareError::Read { file: file.to_path_buf(), source };
    let text = std::fs::read_to_string(file).map_err(|e| read(e.into()))?;
    serde_json::from_str(&text).map_err(|e| read(e.into()))
}
