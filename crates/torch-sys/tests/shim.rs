//! The shim against real libtorch on the CPU: generator states, storage release and
//! reallocation in place, storage identity, C++ exceptions turned into errors, CUDA queries on a
//! machine without CUDA.

use std::sync::{Mutex, MutexGuard};

use stageload_torch_sys::*;
use tch::{nn, nn::Module, Device, Kind, Tensor};

/// One test of this binary reads the process's RSS around a free, and every test allocates:
/// each takes this first, so that none allocates or frees beside that one.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn alone() -> MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The process's RSS, read exactly (a page-table walk, no per-CPU counter's slack).
fn rss_bytes() -> u64 {
    stageload_test_support::memory::rss_bytes().max(0) as u64
}

/// What a check of `covered` bytes of RSS allows beside them (at most a quarter of them).
fn slack_for(covered: u64) -> u64 {
    stageload_test_support::memory::rss_slack(i64::try_from(covered).unwrap_or(i64::MAX)).max(0) as u64
}

#[test]
fn cpu_generator_state_round_trip_survives_a_module_build() {
    let _alone = alone();
    tch::manual_seed(1234);
    let state = generator_state(GeneratorDevice::Cpu).unwrap();
    assert_eq!(state.len(), 5056, "mt19937 state of the CPU generator");
    let expected = Tensor::randn([64], (Kind::Float, Device::Cpu));

    set_generator_state(GeneratorDevice::Cpu, &state).unwrap();
    // Building a module draws from the default generator ...
    let vs = nn::VarStore::new(Device::Cpu);
    let layer = nn::linear(vs.root(), 32, 32, Default::default());
    let _ = layer.forward(&Tensor::ones([1, 32], (Kind::Float, Device::Cpu)));
    let drifted = Tensor::randn([64], (Kind::Float, Device::Cpu));
    assert!(!drifted.equal(&expected), "the build must have moved the generator");

    // ... and restoring the saved state gives the same draws as before it.
    set_generator_state(GeneratorDevice::Cpu, &state).unwrap();
    let again = Tensor::randn([64], (Kind::Float, Device::Cpu));
    assert!(again.equal(&expected));
}

#[test]
fn freeing_a_storage_returns_its_memory_and_reallocating_restores_values() {
    let _alone = alone();
    const BYTES: i64 = 256 << 20;
    // Deterministic values: this binary's RNG test must be the only user of the CPU generator.
    let tensor = Tensor::arange(BYTES / 4, (Kind::Float, Device::Cpu));
    let copy = tensor.copy();
    let before = rss_bytes();
    // SAFETY: this test's tensors are used by this thread only, one op at a time.
    let freed = unsafe { free_storage(&tensor, "released by the test") }.unwrap();
    let after = rss_bytes();
    assert_eq!(freed as i64, BYTES);
    // The storage has a mapping of its own (far above glibc's mmap threshold), every page written
    // by `arange`, unmapped by the free: RSS falls by all of it, but for what may move beside it.
    let slack = slack_for(BYTES as u64);
    let dropped = before.saturating_sub(after);
    assert!(dropped + slack >= BYTES as u64, "RSS dropped by {dropped} bytes of {BYTES} (slack {slack})");
    let info = storage_info(&tensor).unwrap();
    assert!(!info.allocated);
    assert_eq!(info.nbytes, 0);
    assert_eq!(tensor.size(), vec![BYTES / 4], "sizes are kept");

    // Using the freed tensor is libtorch's error, never numbers and never a crash.
    let err = tensor.f_sum(Kind::Float).expect_err("sum of a freed tensor");
    assert!(err.to_string().contains("released by the test"), "{err}");
    let view = tensor.shallow_clone();
    assert!(view.f_mul(&view).is_err());

    // SAFETY: filled below before it is read; one thread.
    unsafe { realloc_storage(&tensor, BYTES as usize) }.unwrap();
    assert!(storage_info(&tensor).unwrap().allocated);
    tch::no_grad(|| tensor.shallow_clone().f_copy_(&copy)).unwrap();
    assert!(tensor.equal(&copy));
    // A second reallocation of a live storage is refused.
    // SAFETY: refused (the storage is allocated), so nothing changes.
    let err = unsafe { realloc_storage(&tensor, 16) }.unwrap_err();
    assert_eq!(err.operation, "reallocate storage");
    assert!(err.message.contains("still allocated"), "{err}");
}

#[test]
fn tensors_sharing_a_storage_have_one_identity() {
    let _alone = alone();
    let base = Tensor::zeros([8, 8], (Kind::Float, Device::Cpu));
    let row = base.narrow(0, 2, 1);
    let alias = base.shallow_clone();
    let other = Tensor::zeros([8, 8], (Kind::Float, Device::Cpu));
    let ids: Vec<u64> = [&base, &row, &alias].iter().map(|t| storage_info(t).unwrap().id).collect();
    assert!(ids.iter().all(|&id| id == ids[0]));
    assert_ne!(storage_info(&other).unwrap().id, ids[0]);
    // Counted once: all three report the whole storage's bytes.
    let distinct: std::collections::HashSet<u64> = ids.into_iter().collect();
    assert_eq!(distinct.len(), 1);
    assert_eq!(storage_info(&row).unwrap().nbytes, 8 * 8 * 4);
    // Freeing through one handle frees it for all.
    // SAFETY: one thread, no op running.
    unsafe { free_storage(&row, "row freed") }.unwrap();
    assert!(!storage_info(&base).unwrap().allocated);
    let err = base.f_sum(Kind::Float).unwrap_err();
    assert!(err.to_string().contains("row freed"), "{err}");
    assert!(base.f_matmul(&base).is_err());
    assert!(base.shallow_clone().f_copy_(&Tensor::ones([8, 8], (Kind::Float, Device::Cpu))).is_err());
}

#[test]
fn a_libtorch_exception_becomes_an_error_naming_the_operation() {
    let _alone = alone();
    let err = set_generator_state(GeneratorDevice::Cpu, &[1, 2, 3]).unwrap_err();
    assert_eq!(err.operation, "set generator state");
    assert!(!err.message.is_empty());
    let shown = err.to_string();
    assert!(shown.contains("set generator state"), "{shown}");
    assert!(shown.contains(&err.message), "{shown}");
    // The generator is intact after the refused call.
    assert_eq!(generator_state(GeneratorDevice::Cpu).unwrap().len(), 5056);
    // An undefined tensor is refused, not dereferenced.
    let err = storage_info(&Tensor::new()).unwrap_err();
    assert!(err.message.contains("undefined tensor"), "{err}");
}

#[test]
fn mps_and_async_copies_answer_on_any_machine() {
    let _alone = alone();
    if !mps_available().unwrap() {
        assert!(mps_empty_cache().unwrap_err().message.contains("MPS is not available"));
    }
    let src = Tensor::arange(16, (Kind::Float, Device::Cpu));
    let dst = Tensor::zeros([16], (Kind::Float, Device::Cpu));
    copy_async(&dst, &src).unwrap();
    assert!(dst.equal(&src), "a CPU copy is done when the call returns");
    let err = copy_async(&Tensor::zeros([3], (Kind::Float, Device::Cpu)), &src).unwrap_err();
    assert_eq!(err.operation, "copy asynchronously");
}

#[test]
fn an_async_copy_fills_a_parameter_that_requires_grad() {
    // A block streamed to the GPU is a VarStore's parameter: autograd would refuse an in-place
    // copy into a leaf that requires grad, but a copy of weights is not part of a computation.
    let src = Tensor::arange(16, (Kind::Float, Device::Cpu));
    let parameter = Tensor::zeros([16], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    copy_async(&parameter, &src).unwrap();
    assert!(parameter.equal(&src));
    assert!(parameter.requires_grad(), "the parameter is still one");
}

#[test]
fn giving_back_pinned_memory_without_an_accelerator_is_an_error_naming_why() {
    let _alone = alone();
    if tch::Cuda::is_available() || mps_available().unwrap() {
        return; // tested with CUDA below; MPS keeps no pinned cache to test here
    }
    let err = empty_pinned_cache().unwrap_err();
    assert_eq!(err.operation, "give cached pinned memory back");
    assert!(err.message.contains("no accelerator"), "{err}");
}

#[test]
fn cuda_queries_answer_not_available_without_cuda() {
    let _alone = alone();
    let count = cuda_device_count().unwrap();
    if count == 0 {
        for err in [
            cuda_empty_cache().unwrap_err(),
            cuda_memory(0).unwrap_err(),
            cuda_reset_peak(0).unwrap_err(),
            generator_state(GeneratorDevice::Cuda(0)).unwrap_err(),
            cuda_side_stream(0).unwrap_err(),
            cuda_sync_current_stream(0).unwrap_err(),
            CudaEvent::record(0).unwrap_err(),
        ] {
            assert!(err.message.contains("CUDA is not available"), "{err}");
        }
    } else {
        // On a CUDA machine the same calls work, and an out-of-range device is an error.
        let t = Tensor::ones([1 << 20], (Kind::Float, Device::Cuda(0)));
        let mem = cuda_memory(0).unwrap();
        assert!(mem.allocated >= 4 << 20);
        drop(t);
        cuda_empty_cache().unwrap();
        cuda_reset_peak(0).unwrap();
        assert!(!generator_state(GeneratorDevice::Cuda(0)).unwrap().is_empty());
        assert!(cuda_memory(count).unwrap_err().message.contains("out of range"));
        // Pinned memory freed goes back to the OS through the host allocator's cache.
        drop(pin_memory(&Tensor::ones([1 << 20], (Kind::Float, Device::Cpu))).unwrap());
        empty_pinned_cache().unwrap();
    }
    assert_eq!(tch::Cuda::device_count() as usize, count, "shim and tch agree");
}

#[test]
fn a_host_buffer_maps_exactly_its_pages_and_gives_them_back_when_its_tensor_goes() {
    let _alone = alone();
    const BYTES: usize = (64 << 20) + 1;
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64;
    let slack = slack_for(BYTES as u64);
    // The fill below is this process's first op for some test orders: its thread pool starts
    // here, outside the measurement.
    let _ = Tensor::zeros([1 << 20], (Kind::Uint8, Device::Cpu)).fill_(1);
    let before = rss_bytes();
    let (buffer, mapped) = host_buffer(BYTES, false).unwrap();
    assert_eq!(mapped, (BYTES as u64).div_ceil(page) * page, "whole pages, no power of two");
    assert_eq!((buffer.size(), buffer.kind(), buffer.device()), (vec![BYTES as i64], Kind::Uint8, Device::Cpu));
    let _ = buffer.shallow_clone().fill_(7);
    let grown = rss_bytes().saturating_sub(before);
    assert!(grown + slack >= mapped && grown <= mapped + slack, "RSS grew by {grown} for a mapping of {mapped}");
    assert_eq!(buffer.sum(Kind::Int64).int64_value(&[]), 7 * BYTES as i64);
    // (After the sum, whose own allocations stay in both readings.)
    let filled = rss_bytes();
    drop(buffer);
    let dropped = filled.saturating_sub(rss_bytes());
    assert!(dropped + slack >= mapped, "RSS fell by {dropped} of {mapped}: the mapping is gone with the tensor");
    assert!(host_buffer(0, false).is_err(), "an empty buffer is refused");
    assert!(host_buffer(usize::MAX, false).unwrap_err().message.contains("too large"));
}

#[test]
fn pinning_a_host_buffer_without_a_gpu_is_an_error_saying_why() {
    let _alone = alone();
    match (cuda_device_count().unwrap(), host_buffer(1 << 20, true)) {
        // No CUDA runtime loaded (a CPU libtorch), or one with no driver or device behind it.
        (0, Err(err)) => {
            assert_eq!(err.operation, "map host memory");
            let why = ["no CUDA runtime in this process", "cudaHostRegister of 1048576 bytes failed: "];
            assert!(why.iter().any(|w| err.message.contains(w)), "{err}");
        }
        (0, Ok(_)) => panic!("host memory pinned on a machine without CUDA"),
        (_, result) => assert!(result.unwrap().0.is_pinned(Device::Cuda(0)), "registered memory is pinned for CUDA"),
    }
}

/// A file of `values` as f32 after a 16-byte prefix, written in a fresh temporary folder.
fn float_file(values: &[f32]) -> (tempfile::TempDir, std::fs::File) {
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("weights.bin");
    let mut file = std::fs::File::create(&path).unwrap();
    file.write_all(&[0u8; 16]).unwrap();
    for v in values {
        file.write_all(&v.to_le_bytes()).unwrap();
    }
    drop(file);
    (dir, std::fs::OpenOptions::new().read(true).write(true).open(path).unwrap())
}

#[test]
fn a_storage_attached_to_a_mapping_reads_the_file_and_writes_to_it_stay_private() {
    use std::os::unix::fs::FileExt;
    let _alone = alone();
    let values: Vec<f32> = (0..1024).map(|i| i as f32 * 0.5).collect();
    let (_dir, file) = float_file(&values);
    let weight = Tensor::zeros([1024], (Kind::Float, Device::Cpu));
    // SAFETY: nothing else holds `weight`.
    unsafe { free_storage(&weight, "released by the test") }.unwrap();
    let mapping = FileMapping::map(&file).unwrap();
    assert!(mapping.populate(16, 4096).unwrap() || cfg!(not(target_os = "linux")));
    // SAFETY: as above.
    unsafe { attach_mapped(&weight, &mapping, 16, 4096) }.unwrap();
    assert_eq!(Vec::<f32>::try_from(&weight).unwrap(), values, "the file's bytes, in place");
    let _ = weight.get(0).fill_(7.0);
    assert_eq!(weight.double_value(&[0]), 7.0);
    let mut first = [0u8; 4];
    file.read_exact_at(&mut first, 16).unwrap();
    assert_eq!(f32::from_le_bytes(first), 0.0, "a write to the weight never reaches the file");
}

#[test]
fn a_mapping_lives_while_a_storage_holds_it_and_goes_with_the_last_one() {
    let _alone = alone();
    let (_dir, file) = float_file(&[1.0; 64]);
    let mapping = FileMapping::map(&file).unwrap();
    let weak = std::sync::Arc::downgrade(&mapping);
    let (a, b) = (Tensor::zeros([32], (Kind::Float, Device::Cpu)), Tensor::zeros([32], (Kind::Float, Device::Cpu)));
    for (tensor, offset) in [(&a, 16), (&b, 144)] {
        // SAFETY: nothing else holds these tensors.
        unsafe { free_storage(tensor, "released by the test") }.unwrap();
        // SAFETY: as above.
        unsafe { attach_mapped(tensor, &mapping, offset, 128) }.unwrap();
    }
    drop(mapping);
    assert_eq!(weak.strong_count(), 2, "one per storage");
    // SAFETY: as above.
    unsafe { free_storage(&a, "released by the test") }.unwrap();
    assert_eq!(weak.strong_count(), 1);
    assert_eq!(b.sum(Kind::Float).double_value(&[]), 32.0, "the other storage still reads the file");
    drop(b);
    assert_eq!(weak.strong_count(), 0, "unmapped with the last storage");
}

#[test]
fn a_range_outside_the_mapping_or_misaligned_or_an_allocated_storage_is_refused_and_holds_nothing() {
    let _alone = alone();
    let (_dir, file) = float_file(&[1.0; 16]);
    let mapping = FileMapping::map(&file).unwrap();
    let freed = Tensor::zeros([16], (Kind::Float, Device::Cpu));
    // SAFETY: nothing else holds it.
    unsafe { free_storage(&freed, "released by the test") }.unwrap();
    let allocated = Tensor::zeros([16], (Kind::Float, Device::Cpu));
    for (tensor, offset, nbytes, why) in [
        (&freed, 16, 128, "do not lie inside"),
        (&freed, 18, 32, "not aligned"),
        (&allocated, 16, 64, "still allocated"),
    ] {
        // SAFETY: as above.
        let err = unsafe { attach_mapped(tensor, &mapping, offset, nbytes) }.unwrap_err();
        assert!(err.message.contains(why), "{err}");
    }
    assert_eq!(std::sync::Arc::strong_count(&mapping), 1, "no refused attach keeps the mapping");
}
