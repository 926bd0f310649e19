//! Gives the demo binaries and their tests an rpath to libtorch (see crates/build-support).
fn main() {
    stageload_build::link_libtorch();
}
