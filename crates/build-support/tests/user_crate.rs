//! A new user: a crate outside the workspace, made in a temporary folder from
//! `template/` (the README's "Use it in your crate" lines, checked here to be the same),
//! depending on this checkout by path, built in `target/user-crate` (kept between runs, so only
//! the first build pays for tch and the shim). Its binary must start with no `LD_LIBRARY_PATH`,
//! run the two stages (the encoder released after `enter("decode")`), list libtorch in its
//! dynamic section with an rpath to it (and reach `libtorch_cuda` where the libtorch has it); its
//! own test must pass. Needs libtorch as the README's test command provides it.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn checkout() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap()
}

/// Runs `command` to its end or `limit`, then kills it (by its pid) and fails.
fn run(mut command: Command, limit: Duration) -> Output {
    let shown = format!("{command:?}");
    let child = command.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let pid = child.id();
    let (done, wait) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(child.wait_with_output());
    });
    match wait.recv_timeout(limit) {
        Ok(output) => output.unwrap(),
        Err(_) => {
            let _ = Command::new("kill").args(["-KILL", &pid.to_string()]).status();
            panic!("{shown} ran past {limit:?}");
        }
    }
}

fn check(output: &Output, what: &str) -> String {
    let stdout = String::from_utf8_lossy(&output.stdout).to_string();
    assert!(
        output.status.success(),
        "{what}: {}\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

/// The template's files with `@CHECKOUT@` replaced by `checkout`.
fn template(file: &str, checkout: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("template").join(file);
    std::fs::read_to_string(path).unwrap().replace("@CHECKOUT@", checkout)
}

#[test]
fn the_readme_shows_the_templates_dependency_lines_and_build_script() {
    let readme = std::fs::read_to_string(checkout().join("README.md")).unwrap();
    let manifest = template("Cargo.toml.in", "/path/to/stageload");
    let lines = manifest.split("\n\n").filter(|part| part.contains("dependencies]"));
    for block in lines.chain([template("build.rs", "")].iter().map(String::as_str)) {
        assert!(readme.contains(block.trim_end()), "README.md does not show:\n{block}");
    }
}

#[test]
fn a_crate_of_its_own_builds_starts_and_runs_two_stages_with_libtorch_linked() {
    let root = checkout();
    let folder = tempfile::TempDir::new().unwrap();
    let dir = folder.path();
    std::fs::create_dir_all(dir.join("src")).unwrap();
    std::fs::create_dir_all(dir.join("tests")).unwrap();
    for file in ["build.rs", "src/lib.rs", "src/main.rs", "tests/two_stages.rs"] {
        std::fs::write(dir.join(file), template(file, "")).unwrap();
    }
    std::fs::write(dir.join("Cargo.toml"), template("Cargo.toml.in", &root.to_string_lossy())).unwrap();
    // The workspace's versions, so no dependency is resolved anew.
    std::fs::copy(root.join("Cargo.lock"), dir.join("Cargo.lock")).unwrap();
    let target = root.join("target/user-crate");
    // As the README says: `LIBTORCH` exported as `stageload libtorch` prints it.
    let libtorch = stageload_build::find_libtorch().expect("the test command provides libtorch");
    let cargo = |args: &[&str]| {
        let mut command = Command::new(env!("CARGO"));
        command.args(args).current_dir(dir).env("CARGO_TARGET_DIR", &target).env("LIBTORCH", &libtorch.root);
        command.env_remove("LIBTORCH_USE_PYTORCH").env_remove("LD_LIBRARY_PATH");
        // A second build of stageload: without debug info or incremental files it takes a
        // fraction of the disk (what is checked here is that it builds, links and runs).
        command.env("CARGO_PROFILE_DEV_DEBUG", "false").env("CARGO_INCREMENTAL", "0");
        command
    };
    // The first build compiles tch and the shim's C++ (minutes on 2 cores); later ones reuse them.
    check(&run(cargo(&["build", "--quiet"]), Duration::from_secs(1800)), "cargo build");

    let binary = target.join("debug/my-pipeline");
    let mut start = Command::new(&binary);
    start.env_remove("LD_LIBRARY_PATH");
    let began = Instant::now();
    let stdout = check(&run(start, Duration::from_secs(120)), "the binary");
    assert!(stdout.contains("resident after decode: [\"decoder\"]"), "the encoder is released: {stdout}");
    assert!(stdout.contains("output [8, 256]") && stdout.contains("cuda available:"), "{stdout}");
    eprintln!("the binary ran in {:?}", began.elapsed());

    let dynamic = check(&run(with_args("readelf", &["-d"], &binary), Duration::from_secs(60)), "readelf -d");
    let needed: Vec<&str> = dynamic.lines().filter(|l| l.contains("(NEEDED)")).collect();
    assert!(needed.iter().any(|l| l.contains("[libtorch_cpu.so]")), "{dynamic}");
    assert!(needed.iter().any(|l| l.contains("[libtorch.so]")), "kept by --no-as-needed: {dynamic}");
    let lib = libtorch.lib();
    let runpath = dynamic.lines().find(|l| l.contains("(RUNPATH)") || l.contains("(RPATH)")).unwrap_or_default();
    assert!(runpath.contains(&*lib.to_string_lossy()), "an rpath to {}: {dynamic}", lib.display());
    if lib.join("libtorch_cuda.so").exists() {
        let linked = check(&run(with_args("ldd", &[], &binary), Duration::from_secs(60)), "ldd");
        assert!(linked.contains("libtorch_cuda.so"), "libtorch_cuda reached: {linked}");
    }

    check(&run(cargo(&["test", "--quiet"]), Duration::from_secs(1800)), "cargo test of the crate");
}

fn with_args(program: &str, args: &[&str], file: &Path) -> Command {
    let mut command = Command::new(program);
    command.args(args).arg(file);
    command
}
