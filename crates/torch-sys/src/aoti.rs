//! AOTInductor packages (`.pt2`, written by `torch._inductor.aoti_compile_and_package`) through
//! libtorch's `AOTIModelPackageLoader`: their metadata, the constants their runner expects, the
//! caller's tensors registered as those constants (user-managed: the runner reads their memory
//! in place, no copy), and runs.
//!
//! The runner keeps each constant's data pointer from its registration. A storage freed and
//! given new memory in place (stageload's release and reload) moves it: [`AotiPackage::run`]
//! registers the constants again whenever one moved, and refuses to run while one has no memory,
//! so no run ever reads freed memory.

use std::collections::HashMap;
use std::ffi::{c_char, c_void, CStr, CString};
use std::path::Path;
use std::ptr::NonNull;

use tch::{Kind, Tensor};
use torch_sys::C_tensor;

use super::{check, ffi, storage_info, ShimError, ShimResult};

/// A constant an AOTInductor package's runner expects: the name its weights are saved under
/// (the exported program's FQN) and the dtype it was compiled for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AotiConstant {
    /// The constant's fully qualified name, as `ep.state_dict` / `ep.constants` name it.
    pub fqn: String,
    /// The dtype the package was compiled for; `None` for a dtype tch has no kind for.
    pub kind: Option<Kind>,
}

fn c_path(operation: &'static str, path: &Path) -> ShimResult<CString> {
    CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| ShimError { operation, message: format!("{} holds a NUL byte", path.display()) })
}

/// The metadata the package at `path` records (`AOTI_DEVICE_KEY`, `AOTI_CPU_ISA`, and what its
/// exporter added), read from the archive without loading its compiled library.
pub fn aoti_package_metadata(path: &Path) -> ShimResult<HashMap<String, String>> {
    extern "C" fn add(data: *mut c_void, key: *const c_char, value: *const c_char) {
        // SAFETY: `data` is the map below, borrowed mutably for the call; `key` and `value` are
        // NUL-terminated strings valid during the callback.
        unsafe {
            let map = &mut *data.cast::<HashMap<String, String>>();
            map.insert(
                CStr::from_ptr(key).to_string_lossy().into_owned(),
                CStr::from_ptr(value).to_string_lossy().into_owned(),
            );
        }
    }
    const OPERATION: &str = "read an AOTInductor package's metadata";
    let path = c_path(OPERATION, path)?;
    let mut map = HashMap::new();
    // SAFETY: `path` is NUL-terminated; `map` outlives the call and only `add` touches it.
    let err = unsafe { ffi::sl_aoti_package_metadata(path.as_ptr(), (&mut map as *mut HashMap<_, _>).cast(), add) };
    check(OPERATION, err)?;
    Ok(map)
}

/// A loaded AOTInductor package and the tensors registered as its constants.
pub struct AotiPackage {
    loader: NonNull<c_void>,
    /// (FQN, tensor, its data pointer when registered) of each registered constant.
    constants: Vec<(CString, Tensor, usize)>,
}

// SAFETY: the loader has no thread affinity; every call goes through `&mut self` (or `&self`
// for reads of the runner's fixed tables), so one thread at a time uses it.
unsafe impl Send for AotiPackage {}

impl std::fmt::Debug for AotiPackage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AotiPackage({} constants registered)", self.constants.len())
    }
}

impl AotiPackage {
    /// Loads the package at `path` (unpacks it into a temporary folder and loads its compiled
    /// library) for CUDA device `device_index`, or the CPU with `-1`. Its constants have no
    /// value until [`register`](Self::register).
    pub fn load(path: &Path, device_index: i32) -> ShimResult<AotiPackage> {
        const OPERATION: &str = "load an AOTInductor package";
        let c = c_path(OPERATION, path)?;
        let mut loader = std::ptr::null_mut();
        // SAFETY: `c` is NUL-terminated; `loader` receives a new loader on success.
        let err = unsafe { ffi::sl_aoti_load(c.as_ptr(), device_index, &mut loader) };
        check(OPERATION, err)?;
        let loader = NonNull::new(loader)
            .ok_or_else(|| ShimError { operation: OPERATION, message: "libtorch returned no loader".into() })?;
        Ok(AotiPackage { loader, constants: Vec::new() })
    }

    /// Every constant the package's runner expects, in the runner's order.
    pub fn constants(&self) -> ShimResult<Vec<AotiConstant>> {
        extern "C" fn add(data: *mut c_void, fqn: *const c_char, dtype: i32) {
            // SAFETY: `data` is the `Vec` below, borrowed mutably for the call; `fqn` is a
            // NUL-terminated string valid during the callback.
            unsafe {
                let list = &mut *data.cast::<Vec<AotiConstant>>();
                list.push(AotiConstant {
                    fqn: CStr::from_ptr(fqn).to_string_lossy().into_owned(),
                    kind: kind_of(dtype),
                });
            }
        }
        let mut list: Vec<AotiConstant> = Vec::new();
        // SAFETY: the loader is live; `list` outlives the call and only `add` touches it.
        let err = unsafe { ffi::sl_aoti_constants(self.loader.as_ptr(), (&mut list as *mut Vec<_>).cast(), add) };
        check("list an AOTInductor package's constants", err)?;
        list.sort_by(|a, b| a.fqn.cmp(&b.fqn));
        Ok(list)
    }

    /// Registers `constants` (FQN, tensor) as the runner's constants, user-managed: the runner
    /// reads their memory in place. Every constant the runner expects must be among them (the
    /// caller checks names, shapes and dtypes against [`constants`](Self::constants) first).
    pub fn register(&mut self, constants: Vec<(String, Tensor)>) -> ShimResult<()> {
        const OPERATION: &str = "register an AOTInductor package's constants";
        let mut registered = Vec::with_capacity(constants.len());
        for (fqn, tensor) in constants {
            let fqn = CString::new(fqn)
                .map_err(|e| ShimError { operation: OPERATION, message: format!("constant name with a NUL: {e}") })?;
            registered.push((fqn, tensor, 0));
        }
        self.constants = registered;
        self.register_again()
    }

    /// Registers the constants again, noting where their memory is now.
    fn register_again(&mut self) -> ShimResult<()> {
        const OPERATION: &str = "register an AOTInductor package's constants";
        for (fqn, tensor, _) in &self.constants {
            if tensor.numel() > 0 && !storage_info(tensor)?.allocated {
                return Err(released(OPERATION, fqn));
            }
        }
        let fqns: Vec<*const c_char> = self.constants.iter().map(|(f, _, _)| f.as_ptr()).collect();
        let tensors: Vec<*const C_tensor> = self.constants.iter().map(|(_, t, _)| t.as_ptr()).collect();
        // SAFETY: the loader is live; both arrays hold `len` valid pointers for the call, and the
        // tensors stay alive in `self.constants` for as long as the runner may read them.
        let err = unsafe { ffi::sl_aoti_register(self.loader.as_ptr(), fqns.as_ptr(), tensors.as_ptr(), fqns.len()) };
        check(OPERATION, err)?;
        for (_, tensor, at) in self.constants.iter_mut().filter(|(_, t, _)| t.numel() > 0) {
            *at = tensor.data_ptr() as usize;
        }
        Ok(())
    }

    /// Runs the package on `inputs`. Refused while a registered constant has no memory; when
    /// one was given new memory since its registration (a reload in place), the constants are
    /// registered again first.
    pub fn run(&mut self, inputs: &[&Tensor]) -> ShimResult<Vec<Tensor>> {
        extern "C" fn add(data: *mut c_void, tensor: *mut C_tensor) {
            // SAFETY: `data` is the `Vec` below, borrowed mutably for the call; `tensor` is a
            // fresh `new at::Tensor` that the `Tensor` made here owns alone.
            unsafe { (*data.cast::<Vec<Tensor>>()).push(Tensor::from_ptr(tensor)) }
        }
        let mut moved = false;
        for (fqn, tensor, at) in &self.constants {
            if tensor.numel() == 0 {
                continue;
            }
            if !storage_info(tensor)?.allocated {
                return Err(released("run an AOTInductor package", fqn));
            }
            moved |= tensor.data_ptr() as usize != *at;
        }
        if moved {
            self.register_again()?;
        }
        let pointers: Vec<*const C_tensor> = inputs.iter().map(|t| t.as_ptr()).collect();
        let mut outputs: Vec<Tensor> = Vec::new();
        // SAFETY: the loader is live; `pointers` holds valid tensors for the call; every
        // registered constant has memory, registered where it is now (checked above), and
        // `&mut self` keeps it so during the run; `outputs` outlives the call.
        let err = unsafe {
            ffi::sl_aoti_run(
                self.loader.as_ptr(),
                pointers.as_ptr(),
                pointers.len(),
                (&mut outputs as *mut Vec<Tensor>).cast(),
                add,
            )
        };
        check("run an AOTInductor package", err)?;
        Ok(outputs)
    }
}

impl Drop for AotiPackage {
    fn drop(&mut self) {
        // libtorch 2.13's runner keeps a reference to every user-managed constant it was given
        // and never drops it (fixed upstream after 2.13): freed in place, their memory goes back
        // now, not never.
        for (fqn, tensor, _) in &self.constants {
            let message = format!("the AOTInductor package holding constant '{}' was dropped", fqn.to_string_lossy());
            if storage_info(tensor).is_ok_and(|info| info.allocated) {
                // SAFETY: `&mut self` at drop: no run uses the constants, and their other holders
                // (the model's owner) let go of the model, so nothing computes with them now.
                let _ = unsafe { super::free_storage(tensor, &message) };
            }
        }
        // SAFETY: the loader was made by `sl_aoti_load` and is dropped exactly once.
        unsafe { ffi::sl_aoti_drop(self.loader.as_ptr()) }
    }
}

/// A constant without memory: the package cannot run until it is reloaded.
fn released(operation: &'static str, fqn: &CStr) -> ShimError {
    ShimError {
        operation,
        message: format!("constant '{}' has no memory (released): reload the model first", fqn.to_string_lossy()),
    }
}

/// tch's kind for a `c10::ScalarType` number (tch keeps its own conversion private).
fn kind_of(code: i32) -> Option<Kind> {
    Some(match code {
        0 => Kind::Uint8,
        1 => Kind::Int8,
        2 => Kind::Int16,
        3 => Kind::Int,
        4 => Kind::Int64,
        5 => Kind::Half,
        6 => Kind::Float,
        7 => Kind::Double,
        8 => Kind::ComplexHalf,
        9 => Kind::ComplexFloat,
        10 => Kind::ComplexDouble,
        11 => Kind::Bool,
        15 => Kind::BFloat16,
        23 => Kind::Float8e5m2,
        24 => Kind::Float8e4m3fn,
        _ => return None,
    })
}
