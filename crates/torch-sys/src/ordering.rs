//! Ordering CUDA work without the host waiting, and registering host memory without leaving an
//! error behind (issue 73): a [`CudaEvent`] queried (`cudaEventQuery`) or waited on by a stream
//! (`cudaStreamWaitEvent`), and page-locked host memory whose failed registration clears the CUDA
//! runtime's last error, which the next kernel launch's check would otherwise report as its own.

use std::ffi::{c_char, c_int};

use tch::Tensor;

use super::{check, cuda_index, host_buffer, CudaEvent, ShimResult};

mod ffi {
    use super::*;
    extern "C" {
        pub fn sl_event_query(event: *mut std::ffi::c_void, done: *mut bool) -> *mut c_char;
        pub fn sl_event_block(event: *mut std::ffi::c_void, index: c_int) -> *mut c_char;
        pub fn sl_cuda_clear_last_error(code: *mut c_int) -> *mut c_char;
    }
}

impl CudaEvent {
    /// Whether the work before the event is done: a query, never a wait.
    pub fn query(&self) -> ShimResult<bool> {
        let mut done = false;
        // SAFETY: `self.0` is a live event owned by this value; the out-pointer is valid for a write.
        let err = unsafe { ffi::sl_event_query(self.0, &mut done) };
        check("query a CUDA event", err)?;
        Ok(done)
    }

    /// Makes this thread's current stream of CUDA device `index` wait for the event before the
    /// work queued on it next (`cudaStreamWaitEvent`): the stream waits, the host goes on.
    pub fn hold_current_stream(&self, index: usize) -> ShimResult<()> {
        // SAFETY: `self.0` is a live event owned by this value; the index is validated by the shim.
        let err = unsafe { ffi::sl_event_block(self.0, cuda_index(index)?) };
        check("make a CUDA stream wait for an event", err)
    }
}

/// Clears the CUDA runtime's last error of this thread (`cudaGetLastError`): the error it held
/// (`Some(0)`: none), or `None` where the process has no CUDA runtime loaded.
pub fn clear_cuda_error() -> ShimResult<Option<i32>> {
    let mut code: c_int = 0;
    // SAFETY: the out-pointer is valid for a write.
    let err = unsafe { ffi::sl_cuda_clear_last_error(&mut code) };
    check("clear the CUDA runtime's last error", err)?;
    Ok((code >= 0).then_some(code))
}

/// [`host_buffer`] page-locked: where the registration fails, the error is returned and the
/// CUDA runtime's last error cleared (a failed `cudaHostRegister` leaves it set, and libtorch's
/// check after the next kernel launch on this thread would throw it).
pub fn registered_host_buffer(bytes: usize) -> ShimResult<(Tensor, u64)> {
    host_buffer(bytes, true).inspect_err(|_| {
        if let Err(err) = clear_cuda_error() {
            tracing::warn!(%err, "clearing CUDA's last error after a failed registration");
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_registration_that_fails_leaves_no_cuda_error_for_the_next_launch() {
        if crate::cuda_device_count().unwrap_or(0) > 0 {
            // A machine with a GPU registers: nothing fails here to clear.
            assert!(registered_host_buffer(1 << 20).is_ok());
            return;
        }
        let err = registered_host_buffer(1 << 20).unwrap_err();
        assert_eq!(err.operation, "map host memory");
        assert!(err.message.contains("CUDA"), "{err}");
        // The failed registration left no error of its own behind for the next launch to report:
        // no runtime, no error, or (no driver here) the runtime's failed start, which it reports
        // again at every call (35: driver insufficient, 100: no device).
        let left = clear_cuda_error().unwrap();
        assert!(matches!(left, None | Some(0 | 35 | 100)), "CUDA error {left:?} left behind");
    }

    #[test]
    fn without_a_gpu_an_event_cannot_be_recorded_so_nothing_is_queried_or_waited_on() {
        if crate::cuda_device_count().unwrap_or(0) > 0 {
            let event = CudaEvent::record(0).unwrap();
            event.hold_current_stream(0).unwrap();
            event.synchronize().unwrap();
            assert!(event.query().unwrap(), "passed once synchronized");
            return;
        }
        let err = CudaEvent::record(0).unwrap_err();
        assert_eq!(err.operation, "record a CUDA event");
    }
}
