//! Compiles `cpp/shim.cpp` against the headers of the libtorch that torch-sys found, after
//! checking that it is the 2.13 release tch 0.26 is written for, and republishes the libtorch
//! lib folder as `DEP_STAGELOAD_SHIM_LIBTORCH_LIB` for the build scripts of direct dependents.
use std::path::PathBuf;

fn main() {
    let lib = PathBuf::from(
        std::env::var("DEP_TCH_LIBTORCH_LIB")
            .expect("torch-sys did not publish DEP_TCH_LIBTORCH_LIB (is tch 0.26 in use?)"),
    );
    let root = lib.parent().expect("libtorch lib folder has a parent").to_path_buf();
    let include = root.join("include");
    if let Err(message) = stageload_build::check_libtorch_version(&include) {
        panic!("{message}");
    }

    println!("cargo:rerun-if-changed=cpp/shim.cpp");
    println!("cargo:rerun-if-env-changed=LIBTORCH_BYPASS_VERSION_CHECK");
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    let abi = std::env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".into());
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .pic(true)
        .std("c++17")
        .include(&include)
        .include(include.join("torch/csrc/api/include"))
        .define("_GLIBCXX_USE_CXX11_ABI", abi.as_str())
        .define("GLOG_USE_GLOG_EXPORT", None)
        .warnings(false)
        .file("cpp/shim.cpp");
    build.compile("stageload_shim");
    // The mapped read needs no libtorch header.
    println!("cargo:rerun-if-changed=cpp/mapped.cpp");
    cc::Build::new().cpp(true).pic(true).std("c++17").warnings(true).file("cpp/mapped.cpp").compile("stageload_mapped");
    println!("cargo:libtorch_lib={}", lib.display());
    // The crate's own unit tests link libtorch too.
    stageload_build::link_libtorch_at(&lib);
}
