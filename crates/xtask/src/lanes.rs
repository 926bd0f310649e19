//! The test lanes, in order, stopping at the first that fails: formatting; clippy of the
//! torch-free crates (the workspace's default members: a plain `cargo test` runs them, no
//! libtorch needed); the macOS readings compile-checked for Apple silicon; the torch-free tests.
//! Then, unless `--torch-free`: libtorch, the reference packages and Ray set up (installed on
//! first use), clippy of the whole workspace, the tests of every crate that links libtorch, and
//! the docs lane (every crate's documentation, broken links and bad markup refused).

use crate::shell::{Error, Setup, Shell};

/// The crates that link libtorch: every workspace member that is not a default member.
const TORCH: [&str; 6] = [
    "stageload",
    "stageload-torch-sys",
    "stageload-build",
    "stageload-demo-kit",
    "stageload-bench",
    "stageload-test-support",
];

/// Runs the lanes (see the module docs); `args` go to both `cargo test` runs.
pub fn test(shell: &mut Shell, torch_free: bool, args: &[String]) -> Result<(), Error> {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    shell.run(&mut shell.cargo(&["fmt", "--all", "--check"]))?;
    shell.run(&mut shell.cargo(&["clippy", "--all-targets", "--", "-D", "warnings"]))?;
    mac_check(shell)?;
    shell.run(shell.cargo(&["test", "--no-fail-fast"]).args(&args))?;
    if torch_free {
        return Ok(());
    }
    shell.set_up(&[Setup::Libtorch, Setup::Reference, Setup::Ray])?;
    shell.run(&mut shell.cargo(&["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"]))?;
    let packages = TORCH.iter().flat_map(|p| ["-p", p]);
    shell.run(shell.cargo(&["test", "--no-fail-fast"]).args(packages).args(&args))?;
    shell.run(shell.cargo(&["doc", "--workspace", "--no-deps", "--quiet"]).env("RUSTDOCFLAGS", "-D warnings"))
}

/// The macOS readings (crates/probe/src/macos.rs) compile-checked for Apple silicon, where the
/// target's standard library can be installed; said, not failed, where it cannot.
fn mac_check(shell: &Shell) -> Result<(), Error> {
    const TARGET: &str = "aarch64-apple-darwin";
    let added = shell.cmd("rustup", &["target", "add", TARGET]).output().is_ok_and(|o| o.status.success());
    if !added {
        eprintln!("cargo xtask test: rustup could not install {TARGET} here: the macOS compile check did not run");
        return Ok(());
    }
    let crates = ["-p", "stageload-probe", "-p", "stageload-guard", "-p", "stageload-cli"];
    shell.run(shell.cargo(&["check", "--target", TARGET]).args(crates))
}
