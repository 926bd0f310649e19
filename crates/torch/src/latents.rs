//! The latents a pipeline produces, recorded where each stage ends: a fingerprint of each
//! (SHA-256 of its shape and its values as f32 on the CPU: equal fingerprints, equal bits) and,
//! when a file is given, the tensors themselves in a safetensors file, so that two runs can be
//! compared by how much they differ and not only whether (`stageload latents A B ...`).
//!
//! The file comes from the caller or from `STAGELOAD_LATENTS` ([`LATENTS_ENV`]), which is how
//! `stageload ab` gives each run its own without new flags in the pipeline.

use std::io::Write;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use tch::{Device, Kind, Tensor};

use crate::checkpoint::{self, CheckpointError};

/// The environment variable naming the file a run's latents go to, and the metadata key listing
/// the latents in the order recorded.
pub use stageload_trace::meter::{LATENTS_ENV, LATENTS_ORDER_KEY as ORDER_KEY};

/// SHA-256 of a tensor's shape and values (as f32 on the CPU), in hex.
pub fn fingerprint(tensor: &Tensor) -> String {
    let values = tensor.to_device(Device::Cpu).to_kind(Kind::Float).contiguous();
    let mut bytes = vec![0u8; values.numel() * 4];
    values.copy_data_u8(&mut bytes, values.numel());
    let mut hasher = Sha256::new();
    hasher.update(format!("{:?}", values.size()).as_bytes());
    hasher.update(&bytes);
    format!("{:x}", hasher.finalize())
}

/// A run's latents, in the order recorded.
///
/// ```no_run
/// # fn run(latent: &tch::Tensor) -> Result<(), stageload::CheckpointError> {
/// let mut latents = stageload::latents::Latents::with_env(None); // under `stageload ab`, its file
/// let fingerprint = latents.record("denoise", latent); // at a stage's end
/// latents.save()?; // the tensors, and their fingerprints beside them
/// # Ok(()) }
/// ```
#[derive(Debug, Default)]
pub struct Latents {
    file: Option<PathBuf>,
    /// (name, fingerprint, a CPU copy when there is a file to write it to)
    entries: Vec<(String, String, Option<Tensor>)>,
}

impl Latents {
    /// Latents written to `file` when it is given (fingerprints only otherwise).
    pub fn new(file: Option<PathBuf>) -> Self {
        Latents { file, entries: Vec::new() }
    }

    /// Latents written to `file`, or else to `$STAGELOAD_LATENTS` when it is set.
    pub fn with_env(file: Option<PathBuf>) -> Self {
        Self::new(file.or_else(|| std::env::var_os(LATENTS_ENV).filter(|v| !v.is_empty()).map(PathBuf::from)))
    }

    /// Where [`save`](Self::save) writes, if anywhere.
    pub fn file(&self) -> Option<&Path> {
        self.file.as_deref()
    }

    /// Records `tensor` under `name` and returns its fingerprint. A name recorded again replaces
    /// the earlier entry (a stage that runs twice keeps its last latent).
    pub fn record(&mut self, name: &str, tensor: &Tensor) -> String {
        let print = fingerprint(tensor);
        let copy = self.file.is_some().then(|| tensor.detach().to_device(Device::Cpu).contiguous().copy());
        self.entries.retain(|(n, _, _)| n != name);
        self.entries.push((name.to_string(), print.clone(), copy));
        print
    }

    /// (name, fingerprint) of each latent, in the order recorded.
    pub fn fingerprints(&self) -> impl Iterator<Item = (&str, &str)> {
        self.entries.iter().map(|(name, print, _)| (name.as_str(), print.as_str()))
    }

    /// Writes the tensors to the file (safetensors) and their fingerprints beside it
    /// (`FILE.sha256`, one `name fingerprint` line each). Nothing to do without a file.
    pub fn save(&self) -> Result<(), CheckpointError> {
        let Some(file) = &self.file else { return Ok(()) };
        let tensors: Vec<(String, Tensor)> =
            self.entries.iter().filter_map(|(n, _, t)| Some((n.clone(), t.as_ref()?.shallow_clone()))).collect();
        // safetensors orders the data by dtype and name: the order recorded goes in the metadata.
        let order = tensors.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>().join("\n");
        checkpoint::save_with_metadata(&tensors, Some([(ORDER_KEY.to_string(), order)].into()), file)?;
        let sidecar = sidecar(file);
        let write = || -> std::io::Result<()> {
            let mut out = std::fs::File::create(&sidecar)?;
            for (name, print) in self.fingerprints() {
                writeln!(out, "{name} {print}")?;
            }
            Ok(())
        };
        write().map_err(|source| CheckpointError::Write { path: sidecar.clone(), source })
    }
}

/// The fingerprint file beside a latents file: `FILE.sha256`.
pub fn sidecar(file: &Path) -> PathBuf {
    let mut name = file.as_os_str().to_owned();
    name.push(".sha256");
    PathBuf::from(name)
}
