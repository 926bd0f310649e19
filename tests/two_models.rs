//! Runs the README example as a user would and checks what it prints.

use std::process::Command;

#[test]
fn the_readme_example_runs_staged() {
    // Integration tests live in target/<profile>/deps; plain `cargo test` builds the example binary into
    // target/<profile>/examples.
    let exe = std::env::current_exe().unwrap();
    let example = exe.parent().unwrap().parent().unwrap().join("examples").join("two_models");
    assert!(
        example.exists(),
        "{} is missing: `cargo test` builds it; `cargo test --examples` does not",
        example.display()
    );
    let folder = tempfile::TempDir::new().unwrap();
    let cache = folder.path();
    let run = || {
        let out = Command::new(&example).args(["--width", "256", "--cache"]).arg(cache).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let first = run();
    assert!(first.contains("resident after encode: [\"encoder\"]"), "{first}");
    assert!(first.contains("resident after decode: [\"decoder\"]"), "{first}");
    assert!(first.contains("event: release encoder 1.0 MiB"), "{first}");
    let fingerprint = |s: &str| s.lines().find(|l| l.starts_with("output")).unwrap().to_string();
    // A second run reads the cached checkpoints and must give the same output bit for bit.
    assert_eq!(fingerprint(&first), fingerprint(&run()));
}
