//! TorchScript modules as models: a `tch::CModule` read from a file that `torch.jit.save` (or
//! `torch.jit.trace(...).save`) wrote, loaded on its model's device, whose parameters and
//! buffers are the tensors the registry releases and refills in place.
//!
//! [`ModelSpec::torchscript`](crate::ModelSpec::torchscript) makes such a model; this module
//! owns reading the file and listing the module's tensors. A TorchScript load deserialises: it
//! draws no random number, so the registry may prefetch it, and the file's own weights are the
//! first load's. A checkpoint declared beside it (safetensors under the module's own tensor
//! names, [`NameRules`](crate::NameRules) apply) is checked against the module at each build
//! (names, shapes, dtypes: headers only) and refills it after a release.

use std::path::{Path, PathBuf};

use tch::{CModule, Device, Tensor};

/// Why a TorchScript module could not be loaded. Each variant names the file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ScriptError {
    /// The file cannot be opened, or is not a regular file.
    #[error("cannot open TorchScript module {path}: {source}")]
    Open {
        /// The module's file.
        path: PathBuf,
        /// The system's error.
        source: std::io::Error,
    },
    /// libtorch refused the file as a TorchScript module.
    #[error(
        "{path} is not a TorchScript module libtorch can load ({source}); write it with torch.jit.save or torch.jit.trace(...).save (a state dict or a pickled model is not one), and whole (it may be truncated)"
    )]
    Load {
        /// The module's file.
        path: PathBuf,
        /// libtorch's error.
        source: tch::TchError,
    },
    /// The loaded module's parameters and buffers could not be listed.
    #[error("TorchScript module {path}: cannot list its tensors: {source}")]
    Tensors {
        /// The module's file.
        path: PathBuf,
        /// libtorch's error.
        source: crate::pinned::LibtorchError,
    },
}

/// Loads the module at `path` on `device`, in evaluation mode, with its tensors (see
/// [`module_tensors`]). The path must be a regular file (a FIFO or a folder is refused before
/// libtorch opens it). In a pipeline, [`ModelSpec::torchscript`](crate::ModelSpec::torchscript)
/// calls it.
///
/// ```no_run
/// let (module, tensors) = stageload::script::load("unet.pt".as_ref(), tch::Device::Cpu)?;
/// println!("{} parameters and buffers", tensors.len());
/// # Ok::<(), stageload::script::ScriptError>(())
/// ```
pub fn load(path: &Path, device: Device) -> Result<(CModule, Vec<(String, Tensor)>), ScriptError> {
    drop(stageload_input::open_regular(path).map_err(|source| ScriptError::Open { path: path.into(), source })?);
    let load = |source| ScriptError::Load { path: path.into(), source };
    let mut module = CModule::load_on_device(path, device).map_err(load)?;
    module.f_set_eval().map_err(load)?;
    let tensors = module_tensors(&module).map_err(|source| ScriptError::Tensors { path: path.into(), source })?;
    Ok((module, tensors))
}

/// Every parameter and buffer of a module and its submodules, with its dotted name, sorted by
/// name: each shares its storage with the module, so freeing or refilling it frees or refills
/// the module's own.
pub fn module_tensors(module: &CModule) -> Result<Vec<(String, Tensor)>, crate::pinned::LibtorchError> {
    let mut tensors = module.named_parameters()?;
    tensors.extend(stageload_torch_sys::module_buffers(module)?);
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(tensors)
}
