fn main() {
    stageload_build::link_libtorch();
}
