//! The test lanes, in order, stopping at the first that fails: formatting; clippy of the
//! torch-free crates (named here: the workspace's default members include the library too, so
//! that `cargo run --example NAME` works at the root); the macOS readings compile-checked for
//! Apple silicon; the torch-free tests.
//! Then, unless `--torch-free`: libtorch, the reference packages, Ray and the Python package set
//! up (installed on first use), clippy of the whole workspace, the tests of every crate that
//! links libtorch, the docs lane (every crate's documentation, broken links and bad markup
//! refused), and the Python lane (the Python package's formatting, clippy and ruff, and its
//! tests under pytest).

use crate::shell::{free_bytes, Error, Setup, Shell};
use stageload_units::format_bytes;

/// The crates that need no libtorch: the torch-free lane's.
const TORCH_FREE: [&str; 9] = [
    "stageload-ab",
    "stageload-cli",
    "stageload-guard",
    "stageload-input",
    "stageload-plan",
    "stageload-probe",
    "stageload-trace",
    "stageload-units",
    "xtask",
];

/// The crates that link libtorch: every other workspace member.
const TORCH: [&str; 7] = [
    "stageload",
    "stageload-torch-sys",
    "stageload-build",
    "stageload-demo-kit",
    "stageload-pipelines",
    "stageload-bench",
    "stageload-test-support",
];

/// Runs the lanes (see the module docs); `args` go to both `cargo test` runs. A failure says how
/// much disk the repository's file system has left: a linker that writes into a full disk dies
/// of SIGBUS ("ld terminated with signal 7"), which does not name the disk.
pub fn test(shell: &mut Shell, torch_free_only: bool, args: &[String]) -> Result<(), Error> {
    lanes(shell, torch_free_only, args).map_err(|e| match free_bytes(shell.root()) {
        Ok(free) => format!("{e} (the file system of {} has {} free now)", shell.root().display(), format_bytes(free)),
        Err(read) => format!("{e} ({read})"),
    })
}

fn lanes(shell: &mut Shell, torch_free_only: bool, args: &[String]) -> Result<(), Error> {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let torch_free = || TORCH_FREE.iter().flat_map(|p| ["-p", p]);
    shell.run(&mut shell.cargo(&["fmt", "--all", "--check"]))?;
    shell.run(shell.cargo(&["clippy"]).args(torch_free()).args(["--all-targets", "--", "-D", "warnings"]))?;
    mac_check(shell)?;
    shell.run(shell.cargo(&["test", "--no-fail-fast"]).args(torch_free()).args(&args))?;
    if torch_free_only {
        return Ok(());
    }
    shell.set_up(&[Setup::Libtorch, Setup::Reference, Setup::Ray, Setup::Python])?;
    shell.run(&mut shell.cargo(&["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"]))?;
    let packages = TORCH.iter().flat_map(|p| ["-p", p]);
    shell.run(shell.cargo(&["test", "--no-fail-fast"]).args(packages).args(&args))?;
    shell.run(shell.cargo(&["doc", "--workspace", "--no-deps", "--quiet"]).env("RUSTDOCFLAGS", "-D warnings"))?;
    python_lane(shell)
}

/// The Python package (crates/python, a workspace of its own built into target/python by
/// `scripts/setup-python.sh`): rustfmt and clippy of its crate, ruff's lint and formatting of its
/// Python and the benchmarks', then its tests under pytest with the torch environment's Python (and the CLI, which
/// they read a trace back with).
fn python_lane(shell: &Shell) -> Result<(), Error> {
    let manifest = ["--manifest-path", "crates/python/Cargo.toml"];
    shell.run(shell.cargo(&["fmt", "--check"]).args(manifest))?;
    let target = shell.target("python");
    let clippy = ["clippy", "--release", "--all-targets", "--", "-D", "warnings"];
    shell.run(shell.cargo(&clippy[..1]).args(manifest).args(&clippy[1..]).env("CARGO_TARGET_DIR", &target))?;
    let ruff = shell.var("STAGELOAD_RUFF").ok_or("scripts/setup-python.sh printed no STAGELOAD_RUFF")?;
    // The benchmarks' Python is held to the package's rules (its pyproject.toml) too.
    let config = ["--config", "crates/python/pyproject.toml"];
    shell.run(shell.cmd(&ruff, &["check", "--quiet", "crates/python", "crates/bench/python"]).args(config))?;
    let format = ["format", "--check", "--quiet", "crates/python", "crates/bench/python"];
    shell.run(shell.cmd(&ruff, &format).args(config))?;
    // The tests read a trace back with the CLI (built by the torch-free lane's tests already).
    shell.run(&mut shell.cargo(&["build", "--quiet", "-p", "stageload-cli", "--bin", "stageload"]))?;
    let python = shell.var("STAGELOAD_PYTHON").ok_or("scripts/setup-libtorch.sh printed no STAGELOAD_PYTHON")?;
    let pytest = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "crates/python/tests"];
    // MKL rounds its matrix products by the operands' addresses unless told not to, and a reload
    // in place puts weights elsewhere than a first load: the comparisons bit for bit need it.
    let mut pytest = shell.cmd(&python, &pytest);
    pytest.env("STAGELOAD_CLI", shell.target("debug/stageload")).env("MKL_CBWR", "COMPATIBLE");
    shell.run(&mut pytest)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The `name` of every workspace member, read from the manifests.
    fn members() -> Vec<String> {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let manifest = std::fs::read_to_string(root.join("Cargo.toml")).unwrap();
        let list = manifest.split("\nmembers = [").nth(1).and_then(|rest| rest.split(']').next()).unwrap();
        let name = |text: &str| {
            let line = text.lines().find(|line| line.starts_with("name = ")).unwrap();
            line.trim_start_matches("name = ").trim_matches('"').to_string()
        };
        list.split(',')
            .map(|entry| entry.trim().trim_matches('"'))
            .filter(|entry| !entry.is_empty())
            .map(|dir| name(&std::fs::read_to_string(root.join(dir).join("Cargo.toml")).unwrap()))
            .collect()
    }

    #[test]
    fn every_workspace_member_is_in_exactly_one_lane() {
        let members = members();
        assert!(members.len() > 10, "{members:?}");
        for member in &members {
            let lanes = [TORCH_FREE.contains(&member.as_str()), TORCH.contains(&member.as_str())];
            assert_eq!(lanes.iter().filter(|&&in_lane| in_lane).count(), 1, "{member} in {lanes:?}");
        }
        for named in TORCH_FREE.iter().chain(&TORCH) {
            assert!(members.iter().any(|m| m == named), "{named} is not a member");
        }
    }
}
