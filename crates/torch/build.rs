//! The library's own tests link libtorch: give them an rpath (see crates/build-support).
fn main() {
    stageload_build::link_libtorch();
}
