//! How a task runs its commands: from the repository's root, with the environment the set-up
//! scripts give (libtorch, the reference packages, Ray), each command shown before it runs, its
//! output on the terminal and, where a task keeps a log, in the log too. Every failure is an
//! error that names the command.

use std::ffi::{OsStr, OsString};
use std::fmt::Write as _;
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex, PoisonError};

/// What a task fails with: a sentence naming what failed.
pub type Error = String;

/// The set-up scripts, each printing `export` lines for the tasks after it to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Setup {
    /// `scripts/setup-libtorch.sh`: torch (libtorch for tch, Python's safetensors for the peers).
    Libtorch,
    /// `scripts/setup-reference.sh`: diffusers and transformers, the small Stable Diffusion export
    /// and the MiniLM checkpoint (needs `Libtorch` first).
    Reference,
    /// `scripts/setup-ray.sh`: Ray, in its own environment.
    Ray,
    /// `scripts/setup-load-peers.sh`: the load benchmark's loader peers, pinned, in their own
    /// environment over the torch one (needs `Libtorch` first).
    LoadPeers,
    /// `scripts/setup-python.sh`: the Python package (crates/python) built and installed into the
    /// torch environment, with pytest, maturin and ruff (needs `Libtorch` first).
    Python,
}

impl Setup {
    fn script(self) -> &'static str {
        match self {
            Setup::Libtorch => "scripts/setup-libtorch.sh",
            Setup::Reference => "scripts/setup-reference.sh",
            Setup::Ray => "scripts/setup-ray.sh",
            Setup::LoadPeers => "scripts/setup-load-peers.sh",
            Setup::Python => "scripts/setup-python.sh",
        }
    }
}

/// The repository a task works in and the environment its commands get.
pub struct Shell {
    root: PathBuf,
    env: Vec<(OsString, OsString)>,
    /// The set-up scripts already run (each runs once: a second run would add to `PATH` again,
    /// and a changed `PATH` rebuilds torch-sys).
    done: Vec<Setup>,
}

impl Shell {
    /// The repository that holds the current folder (the folder with `crates/xtask`).
    pub fn here() -> Result<Shell, Error> {
        let cwd = std::env::current_dir().map_err(|e| format!("cannot read the current folder: {e}"))?;
        let root = cwd.ancestors().find(|dir| dir.join("crates/xtask").is_dir()).ok_or_else(|| {
            format!("{} is not inside the stageload repository (no crates/xtask above it)", cwd.display())
        })?;
        Ok(Shell { root: root.to_path_buf(), env: Vec::new(), done: Vec::new() })
    }

    /// The repository's root.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Runs the set-up scripts in order that have not run yet (each installs what is missing,
    /// once per machine) and keeps the environment they leave for every command after.
    pub fn set_up(&mut self, scripts: &[Setup]) -> Result<(), Error> {
        let scripts: Vec<Setup> = scripts.iter().copied().filter(|s| !self.done.contains(s)).collect();
        if scripts.is_empty() {
            return Ok(());
        }
        let names: Vec<&str> = scripts.iter().map(|s| s.script()).collect();
        let mut command = Command::new("bash");
        command
            .arg("-c")
            // `eval "$(script)"` alone would hide a failing script: the status is eval's.
            .arg(r#"for script in "$@"; do out=$("$script") || exit 1; eval "$out" || exit 1; done; env -0"#)
            .arg("bash")
            .args(&names)
            .current_dir(&self.root)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stderr(Stdio::inherit());
        let output = command.output().map_err(|e| format!("cannot run bash for {}: {e}", names.join(", ")))?;
        if !output.status.success() {
            return Err(format!("{} failed ({}): see its message above", names.join(" then "), output.status));
        }
        self.env = parse_env(&output.stdout);
        self.done.extend(scripts);
        Ok(())
    }

    /// Sets `name` for every command after.
    pub fn set(&mut self, name: &str, value: &str) {
        self.env.push((name.into(), value.into()));
    }

    /// A value the set-up scripts set (or the process already had).
    pub fn var(&self, name: &str) -> Option<OsString> {
        self.env.iter().rev().find(|(k, _)| k == name).map(|(_, v)| v.clone()).or_else(|| std::env::var_os(name))
    }

    /// `program args...` from the root, with the set-up environment.
    pub fn cmd(&self, program: impl AsRef<OsStr>, args: &[&str]) -> Command {
        let mut command = Command::new(program);
        command.args(args).current_dir(&self.root).envs(self.env.iter().map(|(k, v)| (k, v)));
        command
    }

    /// `cargo args...` (the cargo that runs this task, when it does).
    pub fn cargo(&self, args: &[&str]) -> Command {
        self.cmd(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()), args)
    }

    /// Runs `command` on the terminal and fails unless it exits 0.
    pub fn run(&self, command: &mut Command) -> Result<(), Error> {
        let status = self.status(command, None)?;
        check(command, status)
    }

    /// Runs `command` on the terminal (and into `log`) and returns how it ended.
    pub fn status(&self, command: &mut Command, log: Option<&Log>) -> Result<ExitStatus, Error> {
        let shown = show(command);
        match log {
            None => {
                eprintln!("+ {shown}");
                command.status().map_err(|e| format!("cannot start `{shown}`: {e}"))
            }
            Some(log) => {
                log.line(&format!("+ {shown}"));
                log.follow(command, &shown)
            }
        }
    }

    /// Runs `command` and returns its standard output (its errors go to the terminal).
    pub fn output(&self, command: &mut Command) -> Result<(ExitStatus, String), Error> {
        let shown = show(command);
        eprintln!("+ {shown}");
        let output = command.stderr(Stdio::inherit()).output().map_err(|e| format!("cannot start `{shown}`: {e}"))?;
        Ok((output.status, String::from_utf8_lossy(&output.stdout).into_owned()))
    }

    /// A file of the build: `target/PATH` (under `$CARGO_TARGET_DIR` when it is set).
    pub fn target(&self, path: &str) -> PathBuf {
        let target = self.var("CARGO_TARGET_DIR").map_or_else(|| self.root.join("target"), PathBuf::from);
        self.root.join(target).join(path)
    }

    /// A folder under the root, created.
    pub fn folder(&self, path: &Path) -> Result<PathBuf, Error> {
        let folder = self.root.join(path);
        std::fs::create_dir_all(&folder).map_err(|e| format!("cannot create {}: {e}", folder.display()))?;
        Ok(folder)
    }
}

/// Fails unless `status` is a clean exit.
pub fn check(command: &Command, status: ExitStatus) -> Result<(), Error> {
    if status.success() {
        Ok(())
    } else {
        Err(format!("`{}` failed ({status})", show(command)))
    }
}

/// Bytes free to this user on the file system that holds `path`.
pub fn free_bytes(path: &Path) -> Result<u64, Error> {
    nix::sys::statvfs::statvfs(path)
        .map(|s| s.blocks_available().saturating_mul(s.fragment_size()))
        .map_err(|e| format!("cannot read the free space of {}: {e}", path.display()))
}

/// Words for a command line.
pub fn words(words: &[&str]) -> Vec<String> {
    words.iter().map(|w| w.to_string()).collect()
}

/// Failures so far, said at the end.
#[derive(Default)]
pub struct Failures(Vec<String>);

impl Failures {
    /// Keeps `result`'s error, if any.
    pub fn keep(&mut self, result: Result<(), Error>) {
        if let Err(error) = result {
            eprintln!("FAILED: {error}");
            self.0.push(error);
        }
    }

    /// `Ok` when nothing failed, else every failure.
    pub fn end(self) -> Result<(), Error> {
        match self.0.len() {
            0 => Ok(()),
            n => Err(format!("{n} check(s) failed:\n  {}", self.0.join("\n  "))),
        }
    }
}

/// The `NAME=VALUE` pairs of `env -0`'s output.
fn parse_env(output: &[u8]) -> Vec<(OsString, OsString)> {
    use std::os::unix::ffi::OsStrExt;
    output
        .split(|b| *b == 0)
        .filter_map(|pair| {
            let at = pair.iter().position(|b| *b == b'=')?;
            Some((OsStr::from_bytes(&pair[..at]).to_owned(), OsStr::from_bytes(&pair[at + 1..]).to_owned()))
        })
        .filter(|(name, _)| !name.is_empty())
        .collect()
}

/// A command as a reader would type it (the program's file name, its arguments).
fn show(command: &Command) -> String {
    let program = Path::new(command.get_program()).file_name().unwrap_or(command.get_program());
    let mut text = program.to_string_lossy().into_owned();
    for arg in command.get_args() {
        let _ = write!(text, " {}", arg.to_string_lossy());
    }
    text
}

/// A task's log file: what is written to it also goes to the terminal.
#[derive(Clone)]
pub struct Log {
    file: Arc<Mutex<File>>,
}

impl Log {
    /// A new log at `path` (replacing one there).
    pub fn create(path: &Path) -> Result<Log, Error> {
        let file = File::create(path).map_err(|e| format!("cannot create the log {}: {e}", path.display()))?;
        Ok(Log { file: Arc::new(Mutex::new(file)) })
    }

    /// One line to the terminal and the log.
    pub fn line(&self, text: &str) {
        println!("{text}");
        self.write(format!("{text}\n").as_bytes());
    }

    fn write(&self, bytes: &[u8]) {
        // A log that cannot be written loses its copy only: the terminal has the output.
        let _ = self.file.lock().unwrap_or_else(PoisonError::into_inner).write_all(bytes);
    }

    /// Runs `command` with its output and errors copied, as they come, to the terminal and the log.
    fn follow(&self, command: &mut Command, shown: &str) -> Result<ExitStatus, Error> {
        let mut child = command
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start `{shown}`: {e}"))?;
        let copy = |mut from: Box<dyn Read + Send>, to_err: bool| {
            let log = self.clone();
            std::thread::spawn(move || {
                let mut buffer = [0u8; 8192];
                while let Ok(n @ 1..) = from.read(&mut buffer) {
                    let _ = if to_err {
                        std::io::stderr().write_all(&buffer[..n])
                    } else {
                        std::io::stdout().write_all(&buffer[..n])
                    };
                    log.write(&buffer[..n]);
                }
            })
        };
        let out = child.stdout.take().map(|s| copy(Box::new(s), false));
        let err = child.stderr.take().map(|s| copy(Box::new(s), true));
        let status = child.wait().map_err(|e| format!("waiting for `{shown}`: {e}"));
        for thread in [out, err].into_iter().flatten() {
            let _ = thread.join();
        }
        status
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_are_kept_going_and_all_said_at_the_end() {
        let mut failures = Failures::default();
        failures.keep(Ok(()));
        assert_eq!(Failures::default().end(), Ok(()));
        failures.keep(Err("the plan did not match".into()));
        failures.keep(Ok(()));
        failures.keep(Err("latents differ".into()));
        let said = failures.end().unwrap_err();
        assert_eq!(said, "2 check(s) failed:\n  the plan did not match\n  latents differ");
    }

    #[test]
    fn each_set_up_script_runs_once_and_its_environment_reaches_every_command() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("scripts")).unwrap();
        let script = dir.path().join("scripts/setup-libtorch.sh");
        std::fs::write(
            &script,
            r#"#!/bin/sh
echo "export XTASK_TEST_PATH='/venv':\"\${XTASK_TEST_PATH:-}\""
"#,
        )
        .unwrap();
        let mut permissions = std::fs::metadata(&script).unwrap().permissions();
        std::os::unix::fs::PermissionsExt::set_mode(&mut permissions, 0o755);
        std::fs::set_permissions(&script, permissions).unwrap();
        let mut shell = Shell { root: dir.path().to_path_buf(), env: Vec::new(), done: Vec::new() };
        shell.set_up(&[Setup::Libtorch]).unwrap();
        shell.set_up(&[Setup::Libtorch]).unwrap();
        assert_eq!(shell.var("XTASK_TEST_PATH").unwrap(), "/venv:", "run once, not prepended twice");
        let (status, out) = shell.output(&mut shell.cmd("sh", &["-c", "echo $XTASK_TEST_PATH"])).unwrap();
        assert!(status.success() && out == "/venv:\n", "{out}");
        let error = shell.set_up(&[Setup::Ray]).unwrap_err();
        assert!(error.contains("scripts/setup-ray.sh failed"), "{error}");
    }

    #[test]
    fn the_environment_reads_back_from_env_dash_0() {
        let pairs = parse_env(b"PATH=/a:/b\0EMPTY=\0WITH=EQUALS=x\0\0=junk\0");
        let text: Vec<(String, String)> =
            pairs.iter().map(|(k, v)| (k.to_string_lossy().into_owned(), v.to_string_lossy().into_owned())).collect();
        assert_eq!(
            text,
            [("PATH".into(), "/a:/b".into()), ("EMPTY".into(), String::new()), ("WITH".into(), "EQUALS=x".into())]
        );
    }

    #[test]
    fn a_failing_command_is_an_error_naming_it_and_a_log_keeps_its_output() {
        let dir = tempfile::tempdir().unwrap();
        let shell =
            Shell { root: dir.path().to_path_buf(), env: vec![("GREETING".into(), "hello".into())], done: Vec::new() };
        let log = Log::create(&dir.path().join("log.txt")).unwrap();
        let mut command = shell.cmd("sh", &["-c", "echo $GREETING; echo oops >&2; exit 3"]);
        let status = shell.status(&mut command, Some(&log)).unwrap();
        let error = check(&command, status).unwrap_err();
        assert!(error.starts_with("`sh -c echo $GREETING;") && error.contains("exit status: 3"), "{error}");
        let text = std::fs::read_to_string(dir.path().join("log.txt")).unwrap();
        assert!(text.starts_with("+ sh -c") && text.contains("hello\n") && text.contains("oops\n"), "{text}");
        let missing = shell.run(&mut shell.cmd("/no/such/program", &[])).unwrap_err();
        assert!(missing.contains("cannot start `program`"), "{missing}");
    }
}
