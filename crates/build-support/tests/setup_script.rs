//! `scripts/setup-libtorch.sh` on bad input: each case ends with exit 1 and a message that says
//! what to do, and nothing touches the real cache (every run gets its own `STAGELOAD_CACHE`).

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Runs the set-up script with `env` over a clean environment (no `LIBTORCH` of the caller), with
/// a hard deadline.
fn setup(cache: &Path, env: &[(&str, &str)]) -> Output {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/setup-libtorch.sh");
    let mut command = Command::new("bash");
    command.arg(script).env_remove("LIBTORCH").env_remove("PYTHON").env("STAGELOAD_CACHE", cache);
    command.envs(env.iter().copied()).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = command.spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(180);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            child.kill().unwrap();
            panic!("setup-libtorch.sh ran past its deadline");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[test]
fn a_libtorch_folder_without_lib_and_include_is_refused() {
    let cache = tempfile::TempDir::new().unwrap();
    let libtorch = tempfile::TempDir::new().unwrap();
    let output = setup(cache.path(), &[("LIBTORCH", libtorch.path().to_str().unwrap())]);
    assert_eq!(output.status.code(), Some(1));
    let message = stderr(&output);
    assert!(
        message.contains("no lib/ and include/") && message.contains("2.13.0") && message.contains("unset it"),
        "{message}"
    );
    assert!(output.stdout.is_empty(), "prints no environment to evaluate");
}

#[test]
fn a_libtorch_of_ones_own_skips_the_install() {
    let cache = tempfile::TempDir::new().unwrap();
    let libtorch = tempfile::TempDir::new().unwrap();
    for folder in ["lib", "include"] {
        std::fs::create_dir(libtorch.path().join(folder)).unwrap();
    }
    let output = setup(cache.path(), &[("LIBTORCH", libtorch.path().to_str().unwrap())]);
    assert!(output.status.success(), "{}", stderr(&output));
    let exports = String::from_utf8(output.stdout).unwrap();
    assert_eq!(exports.trim(), format!("export LIBTORCH='{}'", libtorch.path().display()));
    assert_eq!(std::fs::read_dir(cache.path()).unwrap().count(), 0, "nothing installed");
}

#[test]
fn without_python_the_script_says_what_to_install() {
    let cache = tempfile::TempDir::new().unwrap();
    let output = setup(cache.path(), &[("PYTHON", "/nonexistent/python3")]);
    assert_eq!(output.status.code(), Some(1));
    let message = stderr(&output);
    assert!(message.contains("python3 not found") && message.contains("LIBTORCH"), "{message}");
}

#[test]
fn without_the_package_registry_the_script_says_what_to_install_by_hand() {
    let cache = tempfile::TempDir::new().unwrap();
    // pip may not use any index: the same failure as a machine without network access.
    let output = setup(cache.path(), &[("PIP_NO_INDEX", "1"), ("PIP_FIND_LINKS", "")]);
    assert_eq!(output.status.code(), Some(1));
    let message = stderr(&output);
    for part in ["could not install torch==2.13.0", "install it by hand", "set LIBTORCH"] {
        assert!(message.contains(part), "'{part}' missing from: {message}");
    }
    assert!(output.stdout.is_empty(), "prints no environment to evaluate");
}
