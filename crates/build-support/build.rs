//! With the `require-libtorch` feature (the workspace's packages that link libtorch turn it on),
//! stops the build at once, with one line naming the set-up command, when no libtorch is found:
//! this runs in the first seconds of a build, before torch-sys's own build script could fail
//! with a page of its own. Without the feature (the torch-free CLI) it does nothing.

// The library's finder, compiled into this script as well; the script uses only a part of it.
#[allow(dead_code)]
#[path = "src/find.rs"]
mod find;

fn main() {
    println!("cargo::rerun-if-changed=src/find.rs");
    if std::env::var_os("CARGO_FEATURE_REQUIRE_LIBTORCH").is_none() {
        return;
    }
    for var in ["LIBTORCH", "LIBTORCH_USE_PYTORCH", "PYTHON", "STAGELOAD_CACHE", "XDG_CACHE_HOME", "HOME"] {
        println!("cargo::rerun-if-env-changed={var}");
    }
    // torch-sys (tch's build) reads LIBTORCH or LIBTORCH_USE_PYTORCH only: a libtorch found in
    // the cache and not exported would still fail there.
    match find::find_libtorch() {
        Ok(libtorch) if libtorch.source == find::Source::Cache => println!(
            "cargo::error=libtorch is in the per-user cache ({}) but not exported: run `{}` in the stageload checkout",
            libtorch.root.display(),
            find::INSTALL_COMMAND
        ),
        Ok(_) => {}
        Err(message) => println!("cargo::error={message}"),
    }
}
