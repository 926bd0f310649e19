//! Traces of a StagedModels run: the meter of `stageload-trace` is an [`crate::EventSink`]
//! (every load, reload, release and stage entry becomes a trace line followed by a sample), and
//! its samples include CUDA allocator memory when the models run on a GPU.
//!
//! ```no_run
//! # use std::sync::Arc;
//! # use stageload::{meter, StagedModels};
//! let meter = Arc::new(meter::start("run.jsonl", tch::Device::Cpu, meter::MeterOptions::default().meta("mode", "staged"))?);
//! let models = StagedModels::builder().events(meter.clone()) /* models, stages */ .build()?;
//! // ... run the pipeline ...
//! meter.finish();
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::path::Path;

use tch::{Device, Kind, Tensor};

pub use stageload_trace::{read_trace, summarize, DeviceMemory, Meter, MeterOptions, Summary, SystemMeterReadings};

/// Starts a meter for a pipeline whose models run on `device`: the header names the device, and
/// on CUDA every sample carries the allocator's allocated and reserved bytes.
pub fn start(path: impl AsRef<Path>, device: Device, options: MeterOptions) -> std::io::Result<Meter> {
    let options = match device {
        Device::Cuda(index) => {
            // The allocator's statistics exist once CUDA is initialised on that device; the
            // meter's first sample would otherwise fail ("Invalid device argument").
            let _ = Tensor::f_zeros([1], (Kind::Float, device));
            options.device(format!("cuda:{index}")).readings(
                SystemMeterReadings::with_device(move || {
                    stageload_torch_sys::cuda_memory(index)
                        .map(|m| DeviceMemory {
                            allocated: m.allocated,
                            reserved: m.reserved,
                            peak: Some(m.peak_allocated),
                        })
                        .map_err(|e| e.to_string())
                })
                .device_peak_reset(move || stageload_torch_sys::cuda_reset_peak(index).map_err(|e| e.to_string())),
            )
        }
        Device::Mps => options.device("mps"),
        Device::Vulkan => options.device("vulkan"),
        Device::Cpu => options.device("cpu"),
    };
    Meter::start(path, options)
}
