//! Devices by name, both ways and in one place: the libtorch device a pipeline file's `device`
//! or a `--device` flag names ([`stageload_plan::DeviceName`], parsed once when the file is
//! checked), and the name traces and messages give a libtorch device.

use stageload_plan::DeviceName;
use tch::Device;

/// The libtorch device `name` means.
pub fn of(name: DeviceName) -> Device {
    match name {
        DeviceName::Cpu => Device::Cpu,
        DeviceName::Cuda(index) => Device::Cuda(index),
        DeviceName::Mps => Device::Mps,
    }
}

/// The device `text` names (`cpu`, `cuda`, `cuda:N`, `mps`); `None` for anything else.
pub fn from_name(text: &str) -> Option<Device> {
    DeviceName::parse(text).map(of)
}

/// A device as traces and pipeline files spell it: `cpu`, `cuda:N`, `mps`, `vulkan`.
pub fn name(device: Device) -> String {
    match device {
        Device::Cpu => "cpu".into(),
        Device::Cuda(index) => format!("cuda:{index}"),
        Device::Mps => "mps".into(),
        Device::Vulkan => "vulkan".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_means_its_device_and_a_device_is_written_as_the_file_would_name_it() {
        assert_eq!(from_name("cuda"), Some(Device::Cuda(0)));
        assert_eq!(from_name("cuda:3"), Some(Device::Cuda(3)));
        assert_eq!(from_name("tpu"), None);
        for device in [Device::Cpu, Device::Cuda(2), Device::Mps] {
            assert_eq!(from_name(&name(device)), Some(device), "{device:?}");
        }
    }
}
