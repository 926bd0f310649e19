//! AOTInductor packages as models: a `.pt2` that `torch._inductor.aoti_compile_and_package`
//! wrote from a `torch.export` program (the export PyTorch recommends now that TorchScript is
//! deprecated), run by libtorch's compiled runner, with weights stageload owns.
//!
//! [`ModelSpec::pt2`](crate::ModelSpec::pt2) makes such a model; this module owns reading the
//! package and making its weights. The package carries no weights (exported with
//! `aot_inductor.package_constants_in_so=False`: weights inside its library would stay resident
//! as file pages nothing can release); its constants are tensors made here, one per constant the
//! runner expects, filled from the model's safetensors checkpoint (under the constants' FQNs, as
//! `scripts/reference/pt2.py` writes it) and handed to the runner user-managed: it reads them in
//! place. So release and reload in place work as for any model, and a run after a reload
//! registers the refilled constants again (the runner caches their addresses).
//!
//! Checked at load, before the package's compiled code is loaded or run (`pt2/target.rs`): the
//! platform and machine it was compiled for, and the instructions its code needs
//! (`stageload.target`, recorded by the export helper, or libtorch's own `AOTI_CPU_ISA`), against
//! this one (a clear error instead of an illegal instruction or a library that will not load),
//! its device kind against the model's, that its weights are not inside its library
//! (`pt2/record.rs`), and every constant against the checkpoint: present (a non-persistent buffer is easy to leave
//! out; libtorch would warn and then crash), of the dtype and the shape the package was compiled
//! for (the shape as the package records it for its runner, so a transposed weight of the right
//! size is refused). The checkpoint may hold entries no constant reads (`ep.state_dict`'s
//! `num_batches_tracked`, small tensors Inductor inlined as literals): the load report lists
//! them as unused.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use stageload_torch_sys::{aoti_package_metadata, AotiPackage};
use tch::{Device, Kind, Tensor};

use crate::checkpoint::{paths, quoted, Checkpoint, CheckpointError};

mod record;
mod target;

/// Why an AOTInductor package could not be loaded or run. Each variant names the package.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Pt2Error {
    /// The file cannot be opened, or is not a regular file.
    #[error("cannot open AOTInductor package {path}: {source}")]
    Open {
        /// The package.
        path: PathBuf,
        /// The system's error.
        source: std::io::Error,
    },
    /// libtorch could not read the file as a package.
    #[error(
        "{path} is not an AOTInductor package libtorch can read ({message}); write it with torch._inductor.aoti_compile_and_package (scripts/reference/pt2.py does), and whole (it may be truncated)"
    )]
    NotAPackage {
        /// The package.
        path: PathBuf,
        /// libtorch's message.
        message: String,
    },
    /// The package was compiled for instructions this CPU lacks.
    #[error(
        "{path} was compiled for {target}, and this CPU lacks {}: export it again for this machine's level (scripts/reference/pt2.py's target) on any machine",
        lacking.join(", ")
    )]
    Target {
        /// The package.
        path: PathBuf,
        /// What it records it was compiled for.
        target: String,
        /// The instruction sets this CPU lacks.
        lacking: Vec<&'static str>,
    },
    /// The package records a target stageload does not know how to check.
    #[error("{path} records the target '{target}', which stageload cannot check against this machine ({this}); export it on this kind of machine, or for x86-64-v2, x86-64-v3 or x86-64-v4 with scripts/reference/pt2.py")]
    UnknownTarget {
        /// The package.
        path: PathBuf,
        /// What it records.
        target: String,
        /// This machine: platform, architecture, widest vector ISA.
        this: String,
    },
    /// The package was compiled for another platform or machine.
    #[error("{path} was compiled for {recorded}, and this machine is {this}: export it again on (or for) this kind of machine")]
    Machine {
        /// The package.
        path: PathBuf,
        /// The platform and machine it records (`AOTI_PLATFORM`, `AOTI_MACHINE`).
        recorded: String,
        /// This machine's.
        this: String,
    },
    /// The package's weights are compiled into its library: no release could free them.
    #[error(
        "{path} holds its weights inside its compiled library (aot_inductor.package_constants_in_so=True, the default), where they stay resident as file pages that no release frees: export it again with inductor_configs={{\"aot_inductor.package_constants_in_so\": False}} and its weights as a safetensors checkpoint of ep.state_dict and ep.constants (scripts/reference/pt2.py does both)"
    )]
    WeightsInside {
        /// The package.
        path: PathBuf,
    },
    /// The package was compiled for another kind of device than the model's.
    #[error("{path} was compiled for '{compiled}' and the model is on {device:?}: compile it on and for that device")]
    Device {
        /// The package.
        path: PathBuf,
        /// The device kind it records (`AOTI_DEVICE_KEY`).
        compiled: String,
        /// The model's device.
        device: Device,
    },
    /// libtorch could not load the package's compiled library or its runner.
    #[error("loading AOTInductor package {path} failed: {message}")]
    Load {
        /// The package.
        path: PathBuf,
        /// libtorch's message.
        message: String,
    },
    /// The checkpoint could not be opened.
    #[error("AOTInductor package {path}: {source}")]
    Checkpoint {
        /// The package.
        path: PathBuf,
        /// The checkpoint's error.
        source: Box<CheckpointError>,
    },
    /// Constants the runner expects are in no checkpoint file.
    #[error(
        "AOTInductor package {path} expects constant(s) {} that none of {} holds; write the checkpoint from the exported program's state_dict and constants (non-persistent buffers are in ep.constants), as scripts/reference/pt2.py does",
        quoted(constants), paths(checkpoint)
    )]
    MissingConstants {
        /// The package.
        path: PathBuf,
        /// The checkpoint's files.
        checkpoint: Vec<PathBuf>,
        /// The constants without an entry.
        constants: Vec<String>,
    },
    /// What the package records of its constants for its runner (their shapes, where its weights
    /// are) cannot be read: nothing could check the checkpoint against it.
    #[error(
        "AOTInductor package {path}: what it records of its constants cannot be read ({message}); write it whole with torch._inductor.aoti_compile_and_package"
    )]
    Metadata {
        /// The package.
        path: PathBuf,
        /// What is wrong with the record.
        message: String,
    },
    /// A checkpoint entry has another shape than the package recorded for its constant.
    #[error("AOTInductor package {path}: constant '{constant}' was compiled with shape {expected:?}, and {checkpoint} has {found:?}")]
    Shape {
        /// The package.
        path: PathBuf,
        /// The checkpoint file holding the entry.
        checkpoint: PathBuf,
        /// The constant.
        constant: String,
        /// The shape the package records.
        expected: Vec<i64>,
        /// The entry's shape.
        found: Vec<i64>,
    },
    /// A checkpoint entry has another dtype than the package was compiled for.
    #[error(
        "AOTInductor package {path}: constant '{constant}' was compiled as {expected}, and {checkpoint} has {found:?}"
    )]
    Dtype {
        /// The package.
        path: PathBuf,
        /// The checkpoint file holding the entry.
        checkpoint: PathBuf,
        /// The constant.
        constant: String,
        /// The dtype the package was compiled for.
        expected: String,
        /// The entry's kind.
        found: Kind,
    },
    /// The package's constants could not be listed or registered, or a run failed.
    #[error("AOTInductor package {path}: {source}")]
    Runner {
        /// The package.
        path: PathBuf,
        /// libtorch's error, naming the operation.
        source: stageload_torch_sys::ShimError,
    },
}

/// An AOTInductor package with its constants: call [`forward`](Self::forward). In a pipeline,
/// [`ModelSpec::pt2`](crate::ModelSpec::pt2) makes it and fills its constants; alone:
///
/// ```no_run
/// # use std::path::{Path, PathBuf};
/// # use tch::{Device, Kind, Tensor};
/// let files = [PathBuf::from("mlp.safetensors")];
/// let (mut module, constants) = stageload::pt2::load(Path::new("mlp.pt2"), Device::Cpu, &files)?;
/// stageload::checkpoint::Checkpoint::open(&files)?.load_into(&constants, |_| ())?; // fill them
/// let outputs = module.forward(&[&Tensor::zeros([1, 16], (Kind::Float, Device::Cpu))])?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct Pt2Module {
    package: AotiPackage,
    path: PathBuf,
}

impl Pt2Module {
    /// Runs the package on `inputs` (its flattened tensor inputs, in the exported program's
    /// order) and returns its flattened outputs. Refused with an error while the model's weights
    /// are released (the registry's handles refuse before that).
    pub fn forward(&mut self, inputs: &[&Tensor]) -> Result<Vec<Tensor>, Pt2Error> {
        self.package.run(inputs).map_err(|source| Pt2Error::Runner { path: self.path.clone(), source })
    }

    /// The package's file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Loads the package at `path` for `device`, with one tensor per constant (shaped as the
/// `checkpoint` files' entries, uninitialised: the caller fills them) registered with its
/// runner; returns the module and those tensors under their FQNs.
pub fn load(
    path: &Path,
    device: Device,
    checkpoint: &[PathBuf],
) -> Result<(Pt2Module, Vec<(String, Tensor)>), Pt2Error> {
    drop(stageload_input::open_regular(path).map_err(|source| Pt2Error::Open { path: path.into(), source })?);
    let metadata =
        aoti_package_metadata(path).map_err(|e| Pt2Error::NotAPackage { path: path.into(), message: e.message })?;
    if !metadata.contains_key("AOTI_DEVICE_KEY") {
        let message = "it records no AOTInductor model (no AOTI_DEVICE_KEY in its metadata)".to_string();
        return Err(Pt2Error::NotAPackage { path: path.into(), message });
    }
    target::check(path, &metadata)?;
    check_device(path, &metadata, device)?;
    let record = record::read(path).map_err(|message| Pt2Error::Metadata { path: path.into(), message })?;
    if record.weights_inside {
        return Err(Pt2Error::WeightsInside { path: path.into() });
    }
    let index = match device {
        Device::Cuda(i) => i32::try_from(i).unwrap_or(i32::MAX),
        _ => -1,
    };
    let mut package =
        AotiPackage::load(path, index).map_err(|e| Pt2Error::Load { path: path.into(), message: e.message })?;
    let runner = |source| Pt2Error::Runner { path: path.into(), source };
    let constants = package.constants().map_err(runner)?;
    let files = Checkpoint::open(checkpoint)
        .map_err(|source| Pt2Error::Checkpoint { path: path.into(), source: Box::new(source) })?;
    let missing: Vec<String> =
        constants.iter().filter(|c| !files.entries().contains_key(&c.fqn)).map(|c| c.fqn.clone()).collect();
    if !missing.is_empty() {
        return Err(Pt2Error::MissingConstants {
            path: path.into(),
            checkpoint: checkpoint.to_vec(),
            constants: missing,
        });
    }
    let mut tensors = Vec::with_capacity(constants.len());
    for constant in &constants {
        let entry = &files.entries()[&constant.fqn];
        let checkpoint = files.files()[entry.file].clone();
        if constant.kind != Some(entry.kind) {
            return Err(Pt2Error::Dtype {
                path: path.into(),
                checkpoint,
                constant: constant.fqn.clone(),
                expected: constant.kind.map_or_else(|| "a dtype tch has no kind for".into(), |k| format!("{k:?}")),
                found: entry.kind,
            });
        }
        let expected = record.shapes.get(&constant.fqn).ok_or_else(|| Pt2Error::Metadata {
            path: path.into(),
            message: format!("its runner expects constant '{}', for which it records no shape", constant.fqn),
        })?;
        if *expected != entry.shape {
            return Err(Pt2Error::Shape {
                path: path.into(),
                checkpoint,
                constant: constant.fqn.clone(),
                expected: expected.clone(),
                found: entry.shape.clone(),
            });
        }
        tensors.push((constant.fqn.clone(), Tensor::empty(entry.shape.as_slice(), (entry.kind, device))));
    }
    package.register(crate::storage::shallow(&tensors)).map_err(runner)?;
    Ok((Pt2Module { package, path: path.into() }, tensors))
}

/// The device kind the package was compiled for against the model's.
fn check_device(path: &Path, metadata: &HashMap<String, String>, device: Device) -> Result<(), Pt2Error> {
    let compiled = metadata.get("AOTI_DEVICE_KEY").map_or("", String::as_str);
    let fits = matches!((device, compiled), (Device::Cpu, "cpu") | (Device::Cuda(_), "cuda") | (Device::Mps, "mps"));
    if !fits {
        return Err(Pt2Error::Device { path: path.into(), compiled: compiled.to_string(), device });
    }
    Ok(())
}
