//! Gives the examples and integration tests an rpath to libtorch (see crates/build-support).
fn main() {
    stageload_build::link_libtorch();
}
