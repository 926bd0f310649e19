//! Compiles `cpp/shim.cpp` against the headers of the libtorch that torch-sys found, after
//! checking that it is the 2.13 release tch 0.26 is written for, and republishes the libtorch
//! lib folder as `DEP_STAGELOAD_SHIM_LIBTORCH_LIB` for the build scripts of direct dependents.
use std::path::{Path, PathBuf};

const WANTED: (u32, u32) = (2, 13);

fn version_field(header: &str, field: &str) -> Option<u32> {
    header.lines().find_map(|line| {
        let rest = line.trim().strip_prefix("#define ")?.strip_prefix(field)?;
        rest.trim().parse().ok()
    })
}

fn check_version(include: &Path) {
    let header_path = include.join("torch/headeronly/version.h");
    let fallback = include.join("torch/csrc/api/include/torch/version.h");
    let text = std::fs::read_to_string(&header_path)
        .or_else(|_| std::fs::read_to_string(&fallback))
        .unwrap_or_default();
    let found = (
        version_field(&text, "TORCH_VERSION_MAJOR"),
        version_field(&text, "TORCH_VERSION_MINOR"),
    );
    if found != (Some(WANTED.0), Some(WANTED.1)) {
        let shown = match found {
            (Some(a), Some(b)) => format!("{a}.{b}"),
            _ => format!("an unknown version (no {})", header_path.display()),
        };
        panic!(
            "stageload needs libtorch {}.{} (tch 0.26), but the libtorch at {} is {shown}. \
             Point LIBTORCH at a libtorch 2.13.0 folder, or unset LIBTORCH and run \
             scripts/setup-libtorch.sh, which installs torch==2.13.0 into the per-user cache \
             (STAGELOAD_CACHE).",
            WANTED.0,
            WANTED.1,
            include.parent().unwrap_or(include).display()
        );
    }
}

fn main() {
    let lib = PathBuf::from(
        std::env::var("DEP_TCH_LIBTORCH_LIB")
            .expect("torch-sys did not publish DEP_TCH_LIBTORCH_LIB (is tch 0.26 in use?)"),
    );
    let root = lib.parent().expect("libtorch lib folder has a parent").to_path_buf();
    let include = root.join("include");
    check_version(&include);

    println!("cargo:rerun-if-changed=cpp/shim.cpp");
    println!("cargo:rerun-if-changed=cpp/shim.h");
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
    println!("cargo:libtorch_lib={}", lib.display());
    // The crate's own unit tests link libtorch too.
    stageload_build::link_libtorch_at(&lib);
}
