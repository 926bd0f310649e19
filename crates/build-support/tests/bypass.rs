//! `LIBTORCH_BYPASS_VERSION_CHECK` (tch's switch, which the device kit sets to build against the
//! GPU machine's torch 2.11) lets another release through. In a binary of its own: the variable
//! is process-wide, and the unit tests of the refusal must not see it.

#[test]
fn the_bypass_variable_lets_another_release_through() {
    let root = tempfile::TempDir::new().unwrap();
    let header = root.path().join("include/torch/headeronly/version.h");
    std::fs::create_dir_all(header.parent().unwrap()).unwrap();
    std::fs::write(&header, "#define TORCH_VERSION_MAJOR 2\n#define TORCH_VERSION_MINOR 11\n").unwrap();
    let include = root.path().join("include");
    std::env::remove_var("LIBTORCH_BYPASS_VERSION_CHECK");
    assert!(stageload_build::check_libtorch_version(&include).is_err(), "2.11 is refused by default");
    std::env::set_var("LIBTORCH_BYPASS_VERSION_CHECK", "1");
    assert_eq!(stageload_build::check_libtorch_version(&include), Ok(()));
}
