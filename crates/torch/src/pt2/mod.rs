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
//! Checked at load, before the package's compiled code is loaded or run: the CPU it was compiled
//! for (`stageload.target`, recorded by the export helper, or libtorch's own `AOTI_CPU_ISA`) against
//! this one (a clear error instead of an illegal instruction), its device kind against the
//! model's, and every constant against the checkpoint: present (a non-persistent buffer is easy
//! to leave out; libtorch would warn and then crash), of the dtype the package was compiled for
//! and, where the package records it, of its shape.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use stageload_torch_sys::{aoti_package_metadata, AotiPackage};
use tch::{Device, Kind, Tensor};

use crate::checkpoint::{paths, quoted, Checkpoint, CheckpointError};

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
    #[error("{path} records the target '{target}', which stageload cannot check on this machine; export it for x86-64-v2, x86-64-v3 or x86-64-v4")]
    UnknownTarget {
        /// The package.
        path: PathBuf,
        /// What it records.
        target: String,
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
    /// The package's `stageload.constants` record (written by the export helper) is not the
    /// JSON it writes: nothing checks the checkpoint's shapes against a record that cannot be read.
    #[error(
        "AOTInductor package {path}: its stageload.constants record cannot be read ({message}); export it again with scripts/reference/pt2.py"
    )]
    Metadata {
        /// The package.
        path: PathBuf,
        /// What is wrong with the record.
        message: String,
    },
    /// A checkpoint entry has another shape than the package recorded for its constant.
    #[error("AOTInductor package {path}: constant '{constant}' was compiled with shape {expected:?}, the checkpoint has {found:?}")]
    Shape {
        /// The package.
        path: PathBuf,
        /// The constant.
        constant: String,
        /// The shape the package records.
        expected: Vec<i64>,
        /// The entry's shape.
        found: Vec<i64>,
    },
    /// A checkpoint entry has another dtype than the package was compiled for.
    #[error(
        "AOTInductor package {path}: constant '{constant}' was compiled as {expected}, the checkpoint has {found:?}"
    )]
    Dtype {
        /// The package.
        path: PathBuf,
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
    check_target(path, &metadata)?;
    check_device(path, &metadata, device)?;
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
    let recorded = recorded_shapes(path, &metadata)?;
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
        if constant.kind != Some(entry.kind) {
            return Err(Pt2Error::Dtype {
                path: path.into(),
                constant: constant.fqn.clone(),
                expected: constant.kind.map_or_else(|| "a dtype tch has no kind for".into(), |k| format!("{k:?}")),
                found: entry.kind,
            });
        }
        if let Some(expected) = recorded.get(&constant.fqn).filter(|shape| **shape != entry.shape) {
            return Err(Pt2Error::Shape {
                path: path.into(),
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

/// Each constant's shape as the export helper recorded it in the package (`stageload.constants`);
/// empty for a package written otherwise, an error for a record that cannot be read.
fn recorded_shapes(path: &Path, metadata: &HashMap<String, String>) -> Result<HashMap<String, Vec<i64>>, Pt2Error> {
    #[derive(serde::Deserialize)]
    struct Recorded {
        shape: Vec<i64>,
    }
    let Some(text) = metadata.get("stageload.constants") else { return Ok(HashMap::new()) };
    let parsed: HashMap<String, Recorded> =
        serde_json::from_str(text).map_err(|e| Pt2Error::Metadata { path: path.into(), message: e.to_string() })?;
    Ok(parsed.into_iter().map(|(name, r)| (name, r.shape)).collect())
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

/// The CPU the package was compiled for against this one: the export helper's
/// `stageload.target` (a `-march` level), else libtorch's `AOTI_CPU_ISA`.
fn check_target(path: &Path, metadata: &HashMap<String, String>) -> Result<(), Pt2Error> {
    let (target, needs) = match (metadata.get("stageload.target"), metadata.get("AOTI_CPU_ISA")) {
        (Some(target), _) => match level_features(target) {
            Some(needs) => (target.clone(), needs),
            None => return Err(Pt2Error::UnknownTarget { path: path.into(), target: target.clone() }),
        },
        (None, Some(isa)) => (format!("the CPU capability {isa}"), isa_features(isa)),
        (None, None) => return Ok(()),
    };
    let lacking: Vec<&'static str> = needs.into_iter().filter(|f| !cpu_has(f)).collect();
    if !lacking.is_empty() {
        return Err(Pt2Error::Target { path: path.into(), target, lacking });
    }
    Ok(())
}

const V2: &[&str] = &["sse3", "ssse3", "sse4.1", "sse4.2", "popcnt", "cmpxchg16b"];
const V3: &[&str] = &["avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "lzcnt", "movbe"];
const V4: &[&str] = &["avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"];

/// The instruction sets an x86-64 `-march` level needs (`None`: not a level this knows).
fn level_features(level: &str) -> Option<Vec<&'static str>> {
    let levels: &[&[&str]] = match level {
        "x86-64" => &[],
        "x86-64-v2" => &[V2],
        "x86-64-v3" => &[V2, V3],
        "x86-64-v4" => &[V2, V3, V4],
        _ => return None,
    };
    Some(levels.concat())
}

/// The instruction sets libtorch's CPU capability names need (`AVX2`, `AVX512 AVX512_VNNI`).
fn isa_features(isa: &str) -> Vec<&'static str> {
    let mut needs = Vec::new();
    if isa.contains("AVX2") || isa.contains("AVX512") {
        needs.extend(["avx2", "fma"]);
    }
    if isa.contains("AVX512") {
        needs.extend(V4);
    }
    needs
}

/// Whether this CPU has instruction set `feature` (x86-64 only; elsewhere none of these).
fn cpu_has(feature: &str) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        macro_rules! detect {
            ($($name:tt),*) => {
                match feature {
                    $($name => std::arch::is_x86_feature_detected!($name),)*
                    _ => false,
                }
            };
        }
        detect!(
            "sse3",
            "ssse3",
            "sse4.1",
            "sse4.2",
            "popcnt",
            "cmpxchg16b",
            "avx",
            "avx2",
            "bmi1",
            "bmi2",
            "f16c",
            "fma",
            "lzcnt",
            "movbe",
            "avx512f",
            "avx512bw",
            "avx512cd",
            "avx512dq",
            "avx512vl"
        )
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = feature;
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_level_needs_the_ones_below_it_and_an_unknown_level_is_none() {
        let v3 = level_features("x86-64-v3").unwrap();
        assert!(v3.contains(&"sse4.2") && v3.contains(&"avx2") && !v3.contains(&"avx512f"));
        assert!(level_features("x86-64-v4").unwrap().contains(&"avx512f"));
        assert_eq!(level_features("native"), None, "native is no level: it names no instruction set");
    }

    #[test]
    fn a_shape_record_that_cannot_be_read_is_an_error_and_no_record_checks_nothing() {
        let path = Path::new("m.pt2");
        let record = |text: &str| HashMap::from([("stageload.constants".to_string(), text.to_string())]);
        let shapes = recorded_shapes(path, &record(r#"{"w": {"shape": [4, 2], "dtype": "float32"}}"#)).unwrap();
        assert_eq!(shapes["w"], [4, 2]);
        assert!(recorded_shapes(path, &HashMap::new()).unwrap().is_empty());
        for bad in [r#"{"w": {"shape": "4x2"}}"#, "[", r#"{"w": {}}"#] {
            let err = recorded_shapes(path, &record(bad)).unwrap_err();
            assert!(matches!(err, Pt2Error::Metadata { .. }), "{bad}: {err}");
            assert!(err.to_string().contains("m.pt2") && err.to_string().contains("stageload.constants"), "{err}");
        }
    }

    #[test]
    fn libtorchs_capability_names_map_to_their_instruction_sets() {
        assert_eq!(isa_features("AVX2"), ["avx2", "fma"]);
        assert!(isa_features("AVX512 AVX512_VNNI").contains(&"avx512bw"));
        assert!(isa_features("DEFAULT").is_empty());
    }

    #[test]
    fn a_package_for_a_level_this_cpu_lacks_is_refused_naming_what_it_lacks() {
        let metadata = HashMap::from([("stageload.target".to_string(), "x86-64-v4".to_string())]);
        match check_target(Path::new("m.pt2"), &metadata) {
            // A CPU with AVX-512 runs it: nothing to refuse here.
            Ok(()) => assert!(V4.iter().all(|f| cpu_has(f))),
            Err(err) => {
                let text = err.to_string();
                assert!(text.contains("m.pt2") && text.contains("x86-64-v4") && text.contains("avx512"), "{text}");
            }
        }
        let unknown = HashMap::from([("stageload.target".to_string(), "native".to_string())]);
        assert!(matches!(check_target(Path::new("m.pt2"), &unknown), Err(Pt2Error::UnknownTarget { .. })));
    }
}
