//! Where the pipeline file puts a model and in which dtype: read from the file, checked
//! against where the loader built it, float tensors converted in place.

use tch::{Device, Kind, Tensor};

use super::error::{Result, StageError};
use stageload_plan::pipeline::{DeviceName, LoadDtype};

/// A dtype the file's device cannot hold.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("dtype {kind:?}: {device} cannot hold it; choose f32, f16 or bf16")]
pub(crate) struct NotHeld {
    kind: Kind,
    device: String,
}

/// Where the pipeline file puts a model and in which dtype (both optional).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Placement {
    pub(crate) device: Option<Device>,
    pub(crate) kind: Option<Kind>,
}

impl Placement {
    /// From the checked file's `device` and `dtype`; refused: a dtype the device cannot hold.
    pub(crate) fn from_file(device: DeviceName, dtype: Option<LoadDtype>) -> std::result::Result<Placement, NotHeld> {
        let device = crate::device::of(device);
        let kind = dtype.map(|dtype| match dtype {
            LoadDtype::F16 => Kind::Half,
            LoadDtype::BF16 => Kind::BFloat16,
            LoadDtype::F32 => Kind::Float,
            LoadDtype::F64 => Kind::Double,
        });
        if let Some(kind) = kind.filter(|&kind| !crate::checkpoint::device_holds(device, kind)) {
            return Err(NotHeld { kind, device: crate::device::name(device) });
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
                        crate::device::name(device),
                        crate::device::name(tensor.device())
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
    fn the_files_device_and_dtype_become_the_placement_and_a_dtype_the_device_cannot_hold_is_refused() {
        let placement = Placement::from_file(DeviceName::Cuda(1), Some(LoadDtype::BF16)).unwrap();
        assert_eq!(placement, Placement { device: Some(Device::Cuda(1)), kind: Some(Kind::BFloat16) });
        assert_eq!(Placement::from_file(DeviceName::Mps, None).unwrap().device, Some(Device::Mps));
        let refused = Placement::from_file(DeviceName::Mps, Some(LoadDtype::F64)).unwrap_err();
        assert!(refused.to_string().contains("mps cannot hold it; choose f32"), "{refused}");
        assert!(Placement::from_file(DeviceName::Cuda(0), Some(LoadDtype::F64)).is_ok());
    }
}
