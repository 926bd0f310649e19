//! Binaries and examples of this workspace, built now so that a test never runs a stale one (a
//! plain `cargo test` has built them already, and the nested build only checks; `cargo test
//! --test NAME` alone has not). Nested builds are safe: cargo holds no lock on the target folder
//! while tests run. Each build has a deadline; past it the build is stopped by its pid and the
//! test fails saying so.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long one nested build may take: a cold one links every example against libtorch, a few
/// minutes on two cores; a warm one is a check of seconds.
const DEADLINE: Duration = Duration::from_secs(900);

/// The workspace's root folder.
pub fn checkout() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().expect("the workspace's root folder")
}

/// Example `name` of the root package, built with every other example once per test process.
pub fn example(name: &str) -> PathBuf {
    static EXAMPLES: OnceLock<Result<(), String>> = OnceLock::new();
    // `-p stageload`: the examples are the root package's (named, so that the build does not
    // depend on which packages the workspace's default members are).
    if let Err(e) = EXAMPLES.get_or_init(|| cargo_build(&["-p", "stageload", "--examples"])) {
        panic!("{e}");
    }
    profile_dir().join("examples").join(name)
}

/// Binary `bin` of package `package`, built now.
pub fn binary(package: &str, bin: &str) -> PathBuf {
    // One nested build at a time: two at once would only wait for each other's lock.
    static ONE: Mutex<()> = Mutex::new(());
    let _one = ONE.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Err(e) = cargo_build(&["-p", package, "--bin", bin]) {
        panic!("{e}");
    }
    profile_dir().join(bin)
}

/// The folder of this test's profile (`target/debug` for a plain `cargo test`): the test binary
/// is `PROFILE_DIR/deps/NAME-HASH`.
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("this test binary's path");
    exe.parent().and_then(Path::parent).expect("a test binary lives in PROFILE_DIR/deps").to_path_buf()
}

fn cargo_build(what: &[&str]) -> Result<(), String> {
    let profile_dir = profile_dir();
    // `cargo test` builds examples and binaries with the `test` profile, in `target/debug`.
    let profile = match profile_dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") => "test",
        Some(other) => other,
        None => return Err(format!("no profile folder in {}", profile_dir.display())),
    };
    let target_dir = profile_dir.parent().expect("a profile folder lies in the target folder");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| env!("CARGO").into());
    let mut child = Command::new(cargo)
        .args(["build", "--quiet", "--profile", profile, "--target-dir"])
        .arg(target_dir)
        .args(what)
        .current_dir(checkout())
        .stdin(Stdio::null())
        .spawn()
        .map_err(|e| format!("starting cargo build {}: {e}", what.join(" ")))?;
    let deadline = Instant::now() + DEADLINE;
    loop {
        if let Some(status) = child.try_wait().map_err(|e| format!("waiting for cargo build: {e}"))? {
            return if status.success() {
                Ok(())
            } else {
                Err(format!("cargo build {} failed ({status})", what.join(" ")))
            };
        }
        if Instant::now() > deadline {
            // Our own child, by its pid.
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("cargo build {} ran past {} s and was stopped", what.join(" "), DEADLINE.as_secs()));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}
