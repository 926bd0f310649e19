//! Which tensor kinds a checkpoint entry maps to, converts to, and a device can hold.

use safetensors::Dtype;
use tch::{Device, Kind};

/// The tch kind of a safetensors dtype, for the dtypes libtorch has.
pub(crate) fn kind_of(dtype: Dtype) -> Option<Kind> {
    Some(match dtype {
        Dtype::BOOL => Kind::Bool,
        Dtype::U8 => Kind::Uint8,
        Dtype::I8 => Kind::Int8,
        Dtype::I16 => Kind::Int16,
        Dtype::I32 => Kind::Int,
        Dtype::I64 => Kind::Int64,
        Dtype::F16 => Kind::Half,
        Dtype::BF16 => Kind::BFloat16,
        Dtype::F32 => Kind::Float,
        Dtype::F64 => Kind::Double,
        _ => return None,
    })
}

/// The safetensors dtype of a tch kind.
pub(crate) fn dtype_of(kind: Kind) -> Option<Dtype> {
    Some(match kind {
        Kind::Bool => Dtype::BOOL,
        Kind::Uint8 => Dtype::U8,
        Kind::Int8 => Dtype::I8,
        Kind::Int16 => Dtype::I16,
        Kind::Int => Dtype::I32,
        Kind::Int64 => Dtype::I64,
        Kind::Half => Dtype::F16,
        Kind::BFloat16 => Dtype::BF16,
        Kind::Float => Dtype::F32,
        Kind::Double => Dtype::F64,
        _ => return None,
    })
}

/// The float kinds a checkpoint holds and a pipeline file may convert to.
pub(crate) fn is_float(kind: Kind) -> bool {
    matches!(kind, Kind::Half | Kind::BFloat16 | Kind::Float | Kind::Double)
}

/// Whether a checkpoint entry of kind `from` may be loaded into a tensor of kind `to`: any float
/// to any float (precision is the model's choice), integers to integers or floats, bool to bool.
pub(crate) fn converts(from: Kind, to: Kind) -> bool {
    from == to || (is_float(from) && is_float(to)) || (!is_float(from) && from != Kind::Bool && to != Kind::Bool)
}

/// Whether a `device` can hold tensors of `kind`: MPS has no float64.
pub(crate) fn device_holds(device: Device, kind: Kind) -> bool {
    !(device == Device::Mps && kind == Kind::Double)
}

#[cfg(test)]
mod tests {
    use super::device_holds;
    use tch::{Device, Kind};

    #[test]
    fn mps_holds_no_float64_and_other_devices_hold_every_kind() {
        assert!(!device_holds(Device::Mps, Kind::Double));
        assert!(device_holds(Device::Mps, Kind::Float) && device_holds(Device::Mps, Kind::BFloat16));
        assert!(device_holds(Device::Cuda(0), Kind::Double) && device_holds(Device::Cpu, Kind::Double));
    }
}
