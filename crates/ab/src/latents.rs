//! Latent files compared by size: per latent, identical bit for bit, or the largest absolute
//! difference and that difference relative to the reference's largest magnitude. With two or
//! more runs of the reference, their own run-to-run variation is measured too, and every other
//! run is judged against it ("within eager's own variation", or by how much it exceeds it): on a
//! backend that does not repeat itself, that is the question that matters.
//!
//! The files are safetensors, as `stageload::latents::Latents` writes them. Float entries are
//! compared as numbers (f16 and bf16 through `half`), integer and bool entries as numbers too;
//! identical bytes are "identical" whatever the dtype.

use std::io::Read;
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors};
use serde::{Deserialize, Serialize};
use stageload_trace::meter::LATENTS_ORDER_KEY as ORDER_KEY;
use thiserror::Error;

/// Why latents files could not be compared; each names the file (and the latent).
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum LatentError {
    /// The file could not be read, or is not safetensors.
    #[error("cannot read latents {path}: {message}")]
    Read {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// A latent's dtype or shape differs from the reference's.
    #[error("latent '{latent}': {path} has {found}, the reference {reference} has {expected}")]
    Mismatch {
        /// The latent's name.
        latent: String,
        /// The compared file.
        path: PathBuf,
        /// The reference file.
        reference: PathBuf,
        /// Its dtype and shape in the compared file.
        found: String,
        /// Its dtype and shape in the reference.
        expected: String,
    },
    /// The files hold different latents.
    #[error("{path} and the reference {reference} hold different latents: missing {}; extra {}", list(.missing), list(.extra))]
    Names {
        /// The compared file.
        path: PathBuf,
        /// The reference file.
        reference: PathBuf,
        /// Latents the reference has and the compared file lacks.
        missing: Vec<String>,
        /// Latents the compared file has and the reference lacks.
        extra: Vec<String>,
    },
    /// A latent's dtype is not one the comparison reads (floats only).
    #[error("latent '{latent}' in {path} has dtype {dtype:?}, which is not compared")]
    Dtype {
        /// The latent's name.
        latent: String,
        /// The file.
        path: PathBuf,
        /// Its dtype.
        dtype: Dtype,
    },
}

fn list(names: &[String]) -> String {
    if names.is_empty() {
        "none".to_string()
    } else {
        names.join(", ")
    }
}

/// One latent: its dtype, shape, raw bytes.
#[derive(Debug, Clone)]
struct Latent {
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

/// The latents of one run, in the file's order.
#[derive(Debug, Clone)]
pub struct LatentFile {
    /// The file it was read from.
    pub path: PathBuf,
    latents: Vec<(String, Latent)>,
}

impl LatentFile {
    /// Reads a latents file (a regular file; safetensors checks the header against the data).
    pub fn read(path: &Path) -> Result<LatentFile, LatentError> {
        let error = |message: String| LatentError::Read { path: path.to_path_buf(), message };
        let mut bytes = Vec::new();
        stageload_input::open_regular(path)
            .and_then(|mut file| file.read_to_end(&mut bytes))
            .map_err(|e| error(e.to_string()))?;
        let (_, metadata) = SafeTensors::read_metadata(&bytes).map_err(|e| error(e.to_string()))?;
        let file = SafeTensors::deserialize(&bytes).map_err(|e| error(e.to_string()))?;
        // In the order recorded (listed in the metadata by `stageload::latents`), else by name.
        let order: Vec<String> = metadata
            .metadata()
            .as_ref()
            .and_then(|m| m.get(ORDER_KEY))
            .map(|o| o.lines().map(str::to_string).collect())
            .unwrap_or_default();
        let rank = |name: &str| order.iter().position(|n| n == name).unwrap_or(usize::MAX);
        let mut views: Vec<_> = file.tensors();
        views.sort_by(|(a, _), (b, _)| rank(a).cmp(&rank(b)).then_with(|| a.cmp(b)));
        let latents = views
            .into_iter()
            .map(|(name, view)| {
                (name, Latent { dtype: view.dtype(), shape: view.shape().to_vec(), bytes: view.data().to_vec() })
            })
            .collect();
        Ok(LatentFile { path: path.to_path_buf(), latents })
    }

    /// The latents' names, in order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.latents.iter().map(|(name, _)| name.as_str())
    }

    fn get(&self, name: &str) -> Option<&Latent> {
        self.latents.iter().find(|(n, _)| n == name).map(|(_, l)| l)
    }
}

/// The values of a latent as f64, or `None` for a dtype not compared.
fn values(latent: &Latent) -> Option<Vec<f64>> {
    fn each<const N: usize>(bytes: &[u8], f: impl Fn([u8; N]) -> f64) -> Vec<f64> {
        bytes.chunks_exact(N).map(|c| f(c.try_into().unwrap_or([0; N]))).collect()
    }
    let b = &latent.bytes;
    Some(match latent.dtype {
        Dtype::F64 => each(b, f64::from_le_bytes),
        Dtype::F32 => each(b, |c| f64::from(f32::from_le_bytes(c))),
        Dtype::F16 => each(b, |c| f64::from(half::f16::from_le_bytes(c))),
        Dtype::BF16 => each(b, |c| f64::from(half::bf16::from_le_bytes(c))),
        Dtype::I64 => each(b, |c| i64::from_le_bytes(c) as f64),
        Dtype::I32 => each(b, |c| f64::from(i32::from_le_bytes(c))),
        Dtype::I16 => each(b, |c| f64::from(i16::from_le_bytes(c))),
        Dtype::I8 => each(b, |c: [u8; 1]| f64::from(c[0] as i8)),
        Dtype::U8 | Dtype::BOOL => each(b, |c: [u8; 1]| f64::from(c[0])),
        _ => return None,
    })
}

/// How one run's latent compares with the reference's.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Difference {
    /// Bit for bit the same.
    Identical,
    /// Some values differ.
    Differs {
        /// The largest |a − b| (infinite where one side is NaN or infinite and the other not).
        #[serde(deserialize_with = "null_is_infinite")]
        max_abs: f64,
        /// `max_abs` over the reference's largest |a| (infinite when that is 0).
        #[serde(deserialize_with = "null_is_infinite")]
        relative: f64,
    },
}

/// JSON has no infinity: `serde_json` writes one as `null`, which reads back as infinite here.
fn null_is_infinite<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(deserializer)?.unwrap_or(f64::INFINITY))
}

impl Difference {
    fn max_abs(&self) -> f64 {
        match self {
            Difference::Identical => 0.0,
            Difference::Differs { max_abs, .. } => *max_abs,
        }
    }
}

/// The verdict on one latent over every compared run.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Verdict {
    /// Every run identical to the reference, bit for bit.
    Identical,
    /// Differences no larger than the reference's own run-to-run variation.
    WithinVariation,
    /// The largest difference is `factor` times the reference's own variation (infinite when
    /// the reference repeats itself exactly).
    Exceeds {
        /// The largest difference over the reference's own variation.
        #[serde(deserialize_with = "null_is_infinite")]
        factor: f64,
    },
    /// Differences, and only one reference run to judge them by.
    Differs,
}

impl Verdict {
    /// Identical, or within the reference's own variation.
    pub fn passes(&self) -> bool {
        matches!(self, Verdict::Identical | Verdict::WithinVariation)
    }
}

/// One latent over every run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LatentReport {
    /// The latent's name.
    pub name: String,
    /// The largest difference between two reference runs (`None` with one reference run).
    pub reference_variation: Option<Difference>,
    /// Each compared run against the first reference run.
    pub runs: Vec<(PathBuf, Difference)>,
    /// What the differences say.
    pub verdict: Verdict,
}

/// `b` against the reference `a` (same dtype and shape, checked by the caller).
fn difference(a: &Latent, b: &Latent) -> Option<Difference> {
    if a.bytes == b.bytes {
        return Some(Difference::Identical);
    }
    let (a, b) = (values(a)?, values(b)?);
    // A NaN against a number is an unbounded difference; NaN against NaN is none.
    let apart = |(x, y): (&f64, &f64)| match (x.is_nan(), y.is_nan()) {
        (false, false) => (x - y).abs(),
        (true, true) => 0.0,
        _ => f64::INFINITY,
    };
    let max_abs = a.iter().zip(&b).map(apart).fold(0.0, f64::max);
    let scale = a.iter().filter(|x| x.is_finite()).map(|x| x.abs()).fold(0.0, f64::max);
    let relative = if scale > 0.0 { max_abs / scale } else { f64::INFINITY };
    Some(Difference::Differs { max_abs, relative })
}

/// Compares every latent of `reference[0]` with the same latent in the other reference runs
/// (their own variation) and in `others`.
pub fn compare(reference: &[LatentFile], others: &[LatentFile]) -> Result<Vec<LatentReport>, LatentError> {
    let Some(base) = reference.first() else { return Ok(Vec::new()) };
    for file in reference[1..].iter().chain(others) {
        let missing: Vec<String> = base.names().filter(|n| file.get(n).is_none()).map(str::to_string).collect();
        let extra: Vec<String> = file.names().filter(|n| base.get(n).is_none()).map(str::to_string).collect();
        if !missing.is_empty() || !extra.is_empty() {
            return Err(LatentError::Names { path: file.path.clone(), reference: base.path.clone(), missing, extra });
        }
    }
    let mut reports = Vec::new();
    for (name, latent) in &base.latents {
        let against = |file: &LatentFile| -> Result<Difference, LatentError> {
            // The names were compared above; this only keeps the lookup total.
            let other = file.get(name).ok_or_else(|| LatentError::Names {
                path: file.path.clone(),
                reference: base.path.clone(),
                missing: vec![name.clone()],
                extra: Vec::new(),
            })?;
            if (other.dtype, &other.shape) != (latent.dtype, &latent.shape) {
                return Err(LatentError::Mismatch {
                    latent: name.clone(),
                    path: file.path.clone(),
                    reference: base.path.clone(),
                    found: format!("{:?} {:?}", other.dtype, other.shape),
                    expected: format!("{:?} {:?}", latent.dtype, latent.shape),
                });
            }
            difference(latent, other).ok_or_else(|| LatentError::Dtype {
                latent: name.clone(),
                path: file.path.clone(),
                dtype: latent.dtype,
            })
        };
        let variation = reference[1..].iter().map(against).collect::<Result<Vec<_>, _>>()?;
        let reference_variation = (reference.len() > 1)
            .then(|| variation.iter().copied().max_by(|x, y| x.max_abs().total_cmp(&y.max_abs())))
            .flatten();
        let runs = others.iter().map(|f| Ok((f.path.clone(), against(f)?))).collect::<Result<Vec<_>, LatentError>>()?;
        let largest = runs.iter().map(|(_, d)| d.max_abs()).fold(0.0, f64::max);
        let verdict = if runs.iter().all(|(_, d)| *d == Difference::Identical) {
            Verdict::Identical
        } else {
            match reference_variation {
                None => Verdict::Differs,
                Some(variation) if largest <= variation.max_abs() => Verdict::WithinVariation,
                Some(variation) => Verdict::Exceeds { factor: largest / variation.max_abs() },
            }
        };
        reports.push(LatentReport { name: name.clone(), reference_variation, runs, verdict });
    }
    Ok(reports)
}

fn describe(difference: &Difference) -> String {
    match difference {
        Difference::Identical => "identical".to_string(),
        Difference::Differs { max_abs, relative } => format!("max |diff| {max_abs:.3e} (relative {relative:.3e})"),
    }
}

/// The reports as text: one line per latent, and the differences under a latent that has any.
pub fn render(reports: &[LatentReport], reference_name: &str) -> String {
    let mut out = String::new();
    for report in reports {
        let verdict = match report.verdict {
            Verdict::Identical => "identical bit for bit".to_string(),
            Verdict::WithinVariation => format!("within {reference_name}'s own variation"),
            Verdict::Exceeds { factor } => format!("exceeds {reference_name}'s own variation {factor:.2}x"),
            Verdict::Differs => format!("differs (one {reference_name} run: no variation to judge by)"),
        };
        out += &format!("  {}: {verdict} ({} runs)\n", report.name, report.runs.len());
        if report.verdict == Verdict::Identical {
            continue;
        }
        if let Some(variation) = &report.reference_variation {
            out += &format!("    {reference_name}'s own variation: {}\n", describe(variation));
        }
        for (path, difference) in &report.runs {
            out += &format!("    {}: {}\n", path.display(), describe(difference));
        }
    }
    out
}
