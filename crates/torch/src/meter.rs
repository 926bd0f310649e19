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

use std::path::{Path, PathBuf};

use tch::{Device, Kind, Tensor};

pub use stageload_trace::meter::TRACE_ENV;
pub use stageload_trace::{read_trace, summarize, DeviceMemory, Meter, MeterOptions, Summary, SystemMeterReadings};

/// The trace file a run writes: `explicit` when given, else `$STAGELOAD_TRACE` ([`TRACE_ENV`],
/// how `stageload ab` gives each run its own), else none.
pub fn trace_path(explicit: Option<PathBuf>) -> Option<PathBuf> {
    explicit.or_else(|| std::env::var_os(TRACE_ENV).filter(|v| !v.is_empty()).map(PathBuf::from))
}

/// Starts a meter for a pipeline whose models run on `device`: the header names the device, and
/// on CUDA every sample carries the allocator's allocated and reserved bytes.
pub fn start(path: impl AsRef<Path>, device: Device, options: MeterOptions) -> std::io::Result<Meter> {
    let options = options.device(crate::device::name(device));
    let options = match device {
        Device::Cuda(index) => {
            // The allocator's statistics exist once CUDA is initialised on that device; the
            // meter's first sample would otherwise fail ("Invalid device argument").
            let _ = Tensor::f_zeros([1], (Kind::Float, device));
            options.readings(
                SystemMeterReadings::with_device(move || {
                    stageload_torch_sys::cuda_memory(index)
                        .map(|m| DeviceMemory {
                            allocated: m.allocated,
                            reserved: m.reserved,
                            peak: Some(m.peak_allocated),
                        })
                        .map_err(Into::into)
                })
                .device_peak_reset(move || stageload_torch_sys::cuda_reset_peak(index).map_err(Into::into)),
            )
        }
        Device::Mps | Device::Vulkan | Device::Cpu => options,
    };
    Meter::start(path, options)
}
