//! Gives the measuring binaries an rpath to libtorch (see crates/build-support).
fn main() {
    stageload_build::link_libtorch();
}
