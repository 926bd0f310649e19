//! Build-script helper for every package that produces a binary, test or example linking libtorch.
//!
//! Cargo does not pass link arguments from a dependency to its dependents, so each such package
//! calls [`link_libtorch`] from its own `build.rs`. The package must depend directly on
//! `stageload-torch-sys`, whose build script publishes the libtorch folder as
//! `DEP_STAGELOAD_SHIM_LIBTORCH_LIB`.

/// Emits an rpath to libtorch's lib folder (so nothing needs `LD_LIBRARY_PATH`) and, on Linux,
/// `--no-as-needed -ltorch` so that `libtorch_cuda` stays linked and CUDA is seen where present.
pub fn link_libtorch() {
    let Ok(lib) = std::env::var("DEP_STAGELOAD_SHIM_LIBTORCH_LIB") else {
        panic!(
            "DEP_STAGELOAD_SHIM_LIBTORCH_LIB is not set: this package must depend directly on \
             stageload-torch-sys to link libtorch"
        );
    };
    link_libtorch_at(std::path::Path::new(&lib));
}

/// As [`link_libtorch`], for a known libtorch lib folder (used by the shim's own build script).
pub fn link_libtorch_at(lib: &std::path::Path) {
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
        println!("cargo:rustc-link-arg=-ltorch");
        println!("cargo:rustc-link-arg=-Wl,--as-needed");
    }
}
