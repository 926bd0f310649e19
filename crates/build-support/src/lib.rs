//! Build-script helper for every package that produces a binary, test or example linking
//! libtorch, this workspace's and a user's own crate.
//!
//! Cargo passes neither link arguments nor `DEP_*` variables past a direct dependent, so a
//! package whose binaries link libtorch calls [`link_libtorch`] from its own `build.rs`: one line
//! and one build-dependency. It finds libtorch by itself ([`find_libtorch`]: torch-sys's folder
//! when the package depends on the shim directly, else `LIBTORCH`, the Python torch of
//! `LIBTORCH_USE_PYTORCH`, or the per-user cache that `scripts/setup-libtorch.sh` fills). The
//! shim's build script also checks, with [`check_libtorch_version`], that the libtorch found is the
//! release tch 0.26 is written for. With the `require-libtorch` feature (this workspace's packages
//! that link libtorch) this crate's own build script stops a build without libtorch in its first
//! seconds, with one line naming [`INSTALL_COMMAND`], before torch-sys's build script runs.

#![warn(missing_docs)]

use std::path::Path;

mod find;

pub use find::{find_libtorch, Libtorch, Source, INSTALL_COMMAND, TORCH_VERSION};

/// The libtorch release (major, minor) that tch 0.26 and the shim are written for.
pub const LIBTORCH_WANTED: (u32, u32) = (2, 13);

/// Emits an rpath to libtorch's lib folder (so nothing needs `LD_LIBRARY_PATH`) and, on Linux,
/// `--no-as-needed -ltorch` so that `libtorch_cuda` stays linked and CUDA is seen where present.
/// Stops the build with one line naming the one command to run ([`INSTALL_COMMAND`]) when no
/// libtorch is found.
pub fn link_libtorch() {
    for var in ["LIBTORCH", "LIBTORCH_USE_PYTORCH", "PYTHON", "STAGELOAD_CACHE", "XDG_CACHE_HOME"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    match find_libtorch() {
        Ok(libtorch) => link_libtorch_at(&libtorch.lib()),
        Err(message) => println!("cargo::error={message}"),
    }
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

fn version_field(header: &str, field: &str) -> Option<u32> {
    header.lines().find_map(|line| {
        let rest = line.trim().strip_prefix("#define ")?.strip_prefix(field)?;
        rest.trim().parse().ok()
    })
}

/// Reads the version header under libtorch's `include` folder and returns, when it is not
/// [`LIBTORCH_WANTED`], the message that stops the build: the version found, the one needed and
/// how to point `LIBTORCH` or the set-up script's cache at it.
pub fn check_libtorch_version(include: &Path) -> Result<(), String> {
    // tch's own switch for running against another libtorch release (the GPU machine's 2.11).
    if std::env::var_os("LIBTORCH_BYPASS_VERSION_CHECK").is_some() {
        return Ok(());
    }
    let header_path = include.join("torch/headeronly/version.h");
    let fallback = include.join("torch/csrc/api/include/torch/version.h");
    let text =
        std::fs::read_to_string(&header_path).or_else(|_| std::fs::read_to_string(&fallback)).unwrap_or_default();
    let found = (version_field(&text, "TORCH_VERSION_MAJOR"), version_field(&text, "TORCH_VERSION_MINOR"));
    if found == (Some(LIBTORCH_WANTED.0), Some(LIBTORCH_WANTED.1)) {
        return Ok(());
    }
    let shown = match found {
        (Some(major), Some(minor)) => format!("{major}.{minor}"),
        _ => format!("of an unknown version (neither {} nor {} gives it)", header_path.display(), fallback.display()),
    };
    Err(format!(
        "stageload needs libtorch {}.{} (tch 0.26), but the libtorch at {} is {shown}. \
         Point LIBTORCH at a libtorch 2.13.0 folder, or unset LIBTORCH and run `{}` in the \
         stageload checkout, which installs torch==2.13.0 into the per-user cache (STAGELOAD_CACHE).",
        LIBTORCH_WANTED.0,
        LIBTORCH_WANTED.1,
        include.parent().unwrap_or(include).display(),
        INSTALL_COMMAND
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn libtorch_with_header(relative: &str, major: u32, minor: u32) -> tempfile::TempDir {
        let root = tempfile::TempDir::new().unwrap();
        let header = root.path().join("include").join(relative);
        std::fs::create_dir_all(header.parent().unwrap()).unwrap();
        let text = format!("#pragma once\n#define TORCH_VERSION_MAJOR {major}\n#define TORCH_VERSION_MINOR {minor}\n#define TORCH_VERSION_PATCH 0\n");
        std::fs::write(header, text).unwrap();
        root
    }

    #[test]
    fn the_wanted_release_passes_under_either_header() {
        for relative in ["torch/headeronly/version.h", "torch/csrc/api/include/torch/version.h"] {
            let root = libtorch_with_header(relative, 2, 13);
            assert_eq!(check_libtorch_version(&root.path().join("include")), Ok(()), "{relative}");
        }
    }

    #[test]
    fn another_release_is_refused_naming_both_versions_and_the_way_out() {
        let root = libtorch_with_header("torch/headeronly/version.h", 2, 12);
        let message = check_libtorch_version(&root.path().join("include")).unwrap_err();
        for part in ["needs libtorch 2.13", "is 2.12", "LIBTORCH", "scripts/setup-libtorch.sh", "STAGELOAD_CACHE"] {
            assert!(message.contains(part), "'{part}' missing from: {message}");
        }
        assert!(message.contains(&root.path().display().to_string()), "names the folder: {message}");
    }

    #[test]
    fn a_folder_without_a_version_header_is_refused() {
        let root = tempfile::TempDir::new().unwrap();
        let message = check_libtorch_version(&root.path().join("include")).unwrap_err();
        assert!(message.contains("unknown version") && message.contains("version.h"), "{message}");
    }
}
