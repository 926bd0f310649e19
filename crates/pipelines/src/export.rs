//! Reading an export: the folder a script in `scripts/reference/` writes, with a `config.json`
//! and each component's module and checkpoint ([`ComponentFiles`]) in one [`Format`]. One reader
//! ([`ExportDir`]) and one error ([`ExportError`], naming the file and the script that makes it
//! again) serve every pipeline; a pipeline's `Export` adds its own checks on top (and says what
//! it runs: `runner::PipelineExport`).

use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::Deserialize;
use stageload::{BoxError, ModelSpec};

/// A component's TorchScript file and its safetensors checkpoint (the traced module's names),
/// relative to the export's folder.
#[derive(Debug, Clone, Deserialize)]
pub struct ComponentFiles {
    /// The TorchScript file.
    pub file: String,
    /// The safetensors checkpoint.
    pub weights: String,
}

/// How a pipeline's components were exported (the export scripts in `scripts/reference/`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// TorchScript modules traced by the export script (`NAME.pt`, `NAME.safetensors`).
    Torchscript,
    /// AOTInductor packages compiled from the same modules and weights (`sd_pt2.py`,
    /// `shap_e_pt2.py`: `pt2/NAME.pt2`, `pt2/NAME.safetensors`).
    Pt2,
}

/// The scripts in `scripts/reference/` that make a pipeline's export: what an error tells the
/// reader to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scripts {
    /// The export script (`sd_export.py`).
    pub export: &'static str,
    /// Its `--size` choices (`small|sd15`).
    pub sizes: &'static str,
    /// The script compiling the `.pt2` packages into `pt2/`, where the pipeline has one.
    pub pt2: Option<&'static str>,
}

/// Why an export could not be read or is not one its pipeline runs. Each variant names the file;
/// a missing or unreadable one names the script that writes it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ExportError {
    /// A file cannot be read.
    #[error("cannot read {}: {source}; export the components with scripts/reference/{} --size {} --out DIR", path.display(), scripts.export, scripts.sizes)]
    Read {
        /// The file.
        path: PathBuf,
        /// The system's error.
        source: std::io::Error,
        /// The scripts that make the export.
        scripts: Scripts,
    },
    /// `config.json` is not the JSON the export script writes.
    #[error("{} is not the config.json scripts/reference/{} writes: {source}", path.display(), scripts.export)]
    Parse {
        /// The file.
        path: PathBuf,
        /// The JSON parser's error.
        source: serde_json::Error,
        /// The scripts that make the export.
        scripts: Scripts,
    },
    /// The export describes something this pipeline does not run (another scheduler, sizes that
    /// do not agree, a file that is not a regular file).
    #[error("{}: {message}", path.display())]
    Unsupported {
        /// The file.
        path: PathBuf,
        /// What does not agree.
        message: String,
    },
    /// A `.pt2` package is missing: `--format pt2` needs them compiled.
    #[error("cannot read {}: {source}; compile the packages with scripts/reference/{} --components DIR", path.display(), scripts.pt2.unwrap_or("*_pt2.py"))]
    MissingPackage {
        /// The package or its checkpoint.
        path: PathBuf,
        /// The system's error.
        source: std::io::Error,
        /// The scripts that make the export.
        scripts: Scripts,
    },
    /// The scheduler's configuration is not one the port runs.
    #[error("{}: the scheduler: {source}", path.display())]
    Scheduler {
        /// The file.
        path: PathBuf,
        /// The port's error.
        source: BoxError,
    },
    /// The image processor's configuration cannot be read or is not one the port runs.
    #[error("{}: the image processor: {source}", path.display())]
    Preprocessor {
        /// The file.
        path: PathBuf,
        /// The port's error.
        source: crate::clip_image::ClipImageError,
    },
}

/// An export's folder with its `config.json` read as `C`: the one reader every pipeline's
/// `Export` starts from.
#[derive(Debug, Clone)]
pub struct ExportDir<C> {
    dir: PathBuf,
    config: C,
    scripts: Scripts,
}

impl<C: DeserializeOwned> ExportDir<C> {
    /// Reads `dir/config.json` as `C`; `scripts` are named in every error.
    pub fn read(dir: impl Into<PathBuf>, scripts: Scripts) -> Result<ExportDir<C>, ExportError> {
        let dir = dir.into();
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| ExportError::Read {
            path: path.clone(),
            source,
            scripts,
        })?;
        let config = serde_json::from_str(&text).map_err(|source| ExportError::Parse { path, source, scripts })?;
        Ok(ExportDir { dir, config, scripts })
    }
}

impl<C> ExportDir<C> {
    /// The export's folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Its `config.json`, read.
    pub fn config(&self) -> &C {
        &self.config
    }

    /// `config.json`'s path.
    pub fn config_path(&self) -> PathBuf {
        self.dir.join("config.json")
    }

    /// An [`ExportError::Unsupported`] about `config.json`.
    pub fn unsupported(&self, message: impl Into<String>) -> ExportError {
        ExportError::Unsupported { path: self.config_path(), message: message.into() }
    }

    /// `config.json`'s `format` number against the one the pipeline reads.
    pub fn check_format(&self, found: u32, wanted: u32) -> Result<(), ExportError> {
        if found == wanted {
            return Ok(());
        }
        Err(self.unsupported(format!(
            "format {found} is not {wanted}, the one this pipeline reads; export again with scripts/reference/{}",
            self.scripts.export
        )))
    }

    /// Checks that each (model, file) is there and a regular file: a missing file in `pt2/` is a
    /// [`ExportError::MissingPackage`], any other an [`ExportError::Read`].
    pub fn check_files<'a>(&self, files: impl IntoIterator<Item = (&'a str, PathBuf)>) -> Result<(), ExportError> {
        let scripts = self.scripts;
        for (model, file) in files {
            let metadata = std::fs::metadata(&file).map_err(|source| {
                if file.parent() == Some(&self.dir.join("pt2")) {
                    ExportError::MissingPackage { path: file.clone(), source, scripts }
                } else {
                    ExportError::Read { path: file.clone(), source, scripts }
                }
            })?;
            if !metadata.is_file() {
                return Err(self.unsupported(format!("{model}'s {} is not a regular file", file.display())));
            }
        }
        Ok(())
    }
}

/// The registry model of a component: a `.pt2` package with its checkpoint, or a TorchScript
/// module with its safetensors as the checkpoint that refills it after a release (without one, a
/// released module is read from its file again).
pub fn component_spec(name: &str, module: PathBuf, weights: Option<PathBuf>) -> ModelSpec {
    match (module.extension().and_then(|e| e.to_str()), weights) {
        (Some("pt2"), weights) => ModelSpec::pt2(name, module, weights),
        (_, Some(weights)) => ModelSpec::torchscript(name, module).checkpoint([weights]),
        (_, None) => ModelSpec::torchscript(name, module),
    }
}
