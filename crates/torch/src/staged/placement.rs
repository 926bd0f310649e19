//! Where the pipeline file puts a model and in which dtype: read from the file, checked
//! against where the loader built it, float tensors converted in place.

use tch::{Device, Kind, Tensor};

use super::error::{Result, StageError};
use stageload_plan::pipeline::LoadDtype;

/// Where the pipeline file puts a model and in which dtype (both optional).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Placement {
    pub(crate) device: Option<Device>,
    pub(crate) kind: Option<Kind>,
}

impl Placement {
    /// From the file's `device` (`cpu`, `cuda`, `cuda:N`, `mps`) and `dtype` (a float dtype).
    pub(crate) fn from_file(device: &str, dtype: Option<&str>) -> std::result::Result<Placement, String> {
        let device = crate::meter::device_from_name(device)
            .ok_or_else(|| format!("unknown device '{device}' (cpu, cuda, cuda:N or mps)"))?;
        let kind = match dtype.map(|name| (name, LoadDtype::parse(name))) {
            None => None,
            Some((_, Some(LoadDtype::F16))) => Some(Kind::Half),
            Some((_, Some(LoadDtype::BF16))) => Some(Kind::BFloat16),
            Some((_, Some(LoadDtype::F32))) => Some(Kind::Float),
            Some((_, Some(LoadDtype::F64))) => Some(Kind::Double),
            Some((other, None)) => {
                return Err(format!(
                    "dtype '{}': the registry converts float entries only (f16, bf16, f32, f64)",
                    other.to_ascii_lowercase()
                ))
            }
        };
        if let Some(kind) = kind.filter(|&kind| !crate::checkpoint::device_holds(device, kind)) {
            return Err(format!(
                "dtype {kind:?}: {} cannot hold it; choose f32, f16 or bf16",
                crate::meter::device_name(device)
            ));
        }
        Ok(Placement { device: Some(device), kind })
    }

    /// Checks that `tensors` are on the file's device and converts the float ones to its dtype
    /// (in place: every handle on them sees the new data, as `VarStore::set_kind` does).
    pub(super) fn apply(&self, model: &str, tensors: &mut [(String, Tensor)]) -> Result<()> {
        let mismatch = |message: String| StageError::PlanMismatch { model: model.to_string(), message };
        for (name, tensor) in tensors.iter_mut() {
            if let Some(device) = self.device {
                if tensor.device() != device {
                    return Err(mismatch(format!(
                        "the file places it on {}, its loader built '{name}' on {}: build on BuildContext::device() (or change the file)",
                        crate::meter::device_name(device),
                        crate::meter::device_name(tensor.device())
                    )));
                }
            }
            if let Some(kind) = self.kind {
                let float = crate::checkpoint::is_float(tensor.kind());
                if float && tensor.kind() != kind {
                    let _no_grad = tch::no_grad_guard();
                    let converted =
                        tensor.f_to_kind(kind).map_err(|e| mismatch(format!("converting '{name}': {e}")))?;
                    tensor.f_set_data(&converted).map_err(|e| mismatch(format!("converting '{name}': {e}")))?;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_files_device_and_dtype_are_read_and_integer_dtypes_refused() {
        let placement = Placement::from_file("cuda:1", Some("BF16")).unwrap();
        assert_eq!(placement, Placement { device: Some(Device::Cuda(1)), kind: Some(Kind::BFloat16) });
        assert_eq!(Placement::from_file("mps", None).unwrap().device, Some(Device::Mps));
        assert!(Placement::from_file("tpu", None).unwrap_err().contains("unknown device 'tpu'"));
        assert!(Placement::from_file("cpu", Some("i64")).unwrap_err().contains("float entries only"));
        let refused = Placement::from_file("mps", Some("f64")).unwrap_err();
        assert!(refused.contains("mps cannot hold it; choose f32"), "{refused}");
        assert!(Placement::from_file("cuda", Some("f64")).is_ok());
    }
}
