//! Where libtorch is, for a build script or the `stageload libtorch` command: the folder
//! torch-sys found (published to direct dependents of the shim), `LIBTORCH`, the Python torch of
//! `LIBTORCH_USE_PYTORCH`, or the per-user cache that `scripts/setup-libtorch.sh` (the one
//! installer, [`INSTALL_COMMAND`]) fills.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The torch release whose wheel the cache holds (its libtorch is the one tch 0.26 needs).
pub const TORCH_VERSION: &str = "2.13.0";

/// The one command that installs libtorch into the per-user cache (once per machine) and exports
/// what a build needs, run in the stageload checkout.
pub const INSTALL_COMMAND: &str = "eval \"$(scripts/setup-libtorch.sh)\"";

/// Where a libtorch was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// torch-sys's own folder (`DEP_STAGELOAD_SHIM_LIBTORCH_LIB`, for direct dependents of the shim).
    Shim,
    /// `LIBTORCH`.
    Env,
    /// The Python torch of `LIBTORCH_USE_PYTORCH`.
    Python,
    /// The per-user cache.
    Cache,
}

/// A libtorch folder (with `lib/` and `include/`) and where it was found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Libtorch {
    /// The folder holding `lib/` and `include/`.
    pub root: PathBuf,
    /// Where it was found (the shim, `LIBTORCH`, Python torch, the cache).
    pub source: Source,
}

impl Libtorch {
    /// Its shared libraries' folder.
    pub fn lib(&self) -> PathBuf {
        self.root.join("lib")
    }

    /// The shell lines that make torch-sys (and so tch) build against it.
    pub fn exports(&self) -> String {
        format!("export LIBTORCH='{}'\n", self.root.display())
    }
}

/// Reads an environment variable (the process's, or a test's).
type Env<'a> = &'a dyn Fn(&str) -> Option<std::ffi::OsString>;

fn process_env(name: &str) -> Option<std::ffi::OsString> {
    std::env::var_os(name).filter(|v| !v.is_empty())
}

/// The per-user cache: `STAGELOAD_CACHE`, else `$XDG_CACHE_HOME/stageload`, else
/// `$HOME/.cache/stageload`.
fn cache_root_in(env: Env) -> Option<PathBuf> {
    let var = |name: &str| env(name).map(PathBuf::from);
    var("STAGELOAD_CACHE")
        .or_else(|| var("XDG_CACHE_HOME").map(|c| c.join("stageload")))
        .or_else(|| var("HOME").map(|h| h.join(".cache/stageload")))
}

/// The cache's virtual environment for [`TORCH_VERSION`].
fn cache_venv_in(env: Env) -> Option<PathBuf> {
    Some(cache_root_in(env)?.join(format!("torch-{TORCH_VERSION}")))
}

fn is_libtorch(root: &Path) -> bool {
    root.join("lib").is_dir() && root.join("include").is_dir()
}

/// The torch package inside a virtual environment (`lib/python3.*/site-packages/torch`).
fn torch_in_venv(venv: &Path) -> Option<PathBuf> {
    let mut pythons: Vec<PathBuf> = std::fs::read_dir(venv.join("lib")).ok()?.flatten().map(|e| e.path()).collect();
    pythons.sort();
    pythons.into_iter().map(|p| p.join("site-packages/torch")).find(|t| is_libtorch(t))
}

/// The torch package of `python` (`PYTHON`, else `python3`).
fn torch_of_python(env: Env) -> Result<PathBuf, String> {
    let python = env("PYTHON").map_or_else(|| "python3".into(), |p| p.to_string_lossy().into_owned());
    let out = Command::new(&python)
        .args(["-c", "import os, torch; print(os.path.dirname(torch.__file__))"])
        .output()
        .map_err(|e| format!("LIBTORCH_USE_PYTORCH is set, and {python} could not be run: {e}"))?;
    let root = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    match out.status.success() && is_libtorch(&root) {
        true => Ok(root),
        false => Err(format!("LIBTORCH_USE_PYTORCH is set, and {python} has no torch package with lib/ and include/")),
    }
}

/// Finds libtorch: torch-sys's folder when published, else `LIBTORCH`, else the Python torch of
/// `LIBTORCH_USE_PYTORCH`, else the per-user cache. The error says what was looked at and names
/// the one command to run.
pub fn find_libtorch() -> Result<Libtorch, String> {
    find_in(&process_env)
}

fn find_in(env: Env) -> Result<Libtorch, String> {
    if let Some(lib) = env("DEP_STAGELOAD_SHIM_LIBTORCH_LIB") {
        let root = Path::new(&lib).parent().map(Path::to_path_buf).unwrap_or_default();
        return Ok(Libtorch { root, source: Source::Shim });
    }
    if let Some(root) = env("LIBTORCH").map(PathBuf::from) {
        return match is_libtorch(&root) {
            true => Ok(Libtorch { root, source: Source::Env }),
            false => Err(format!(
                "LIBTORCH={} has no lib/ and include/ folders: point it at a libtorch {TORCH_VERSION} folder, or unset it and run `{INSTALL_COMMAND}`",
                root.display()
            )),
        };
    }
    if env("LIBTORCH_USE_PYTORCH").is_some() {
        return torch_of_python(env).map(|root| Libtorch { root, source: Source::Python });
    }
    let venv = cache_venv_in(env);
    if let Some(root) = venv.as_deref().and_then(torch_in_venv) {
        return Ok(Libtorch { root, source: Source::Cache });
    }
    let cache = venv.map_or_else(|| "the per-user cache (no HOME)".to_string(), |v| v.display().to_string());
    Err(format!(
        "no libtorch {TORCH_VERSION} found (LIBTORCH and LIBTORCH_USE_PYTORCH are not set, {cache} holds none): \
         run `{INSTALL_COMMAND}` in the stageload checkout"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env_of(pairs: &[(&str, &Path)]) -> impl Fn(&str) -> Option<std::ffi::OsString> {
        let pairs: Vec<(String, PathBuf)> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_path_buf())).collect();
        move |name| pairs.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone().into_os_string())
    }

    fn libtorch_at(root: &Path) {
        std::fs::create_dir_all(root.join("lib")).unwrap();
        std::fs::create_dir_all(root.join("include")).unwrap();
    }

    #[test]
    fn with_nothing_set_and_an_empty_cache_the_error_names_the_one_command_to_run() {
        let cache = tempfile::tempdir().unwrap();
        let message = find_in(&env_of(&[("STAGELOAD_CACHE", cache.path())])).unwrap_err();
        assert!(message.contains(INSTALL_COMMAND) && message.contains(&*cache.path().to_string_lossy()), "{message}");
    }

    #[test]
    fn the_per_user_cache_is_found_without_any_variable_but_its_root() {
        let cache = tempfile::tempdir().unwrap();
        let torch = cache.path().join(format!("torch-{TORCH_VERSION}/lib/python3.11/site-packages/torch"));
        libtorch_at(&torch);
        let found = find_in(&env_of(&[("HOME", Path::new("/nonexistent")), ("STAGELOAD_CACHE", cache.path())]));
        assert_eq!(found, Ok(Libtorch { root: torch.clone(), source: Source::Cache }));
        assert_eq!(found.unwrap().lib(), torch.join("lib"));
    }

    #[test]
    fn libtorch_set_wins_over_the_cache_and_a_folder_without_lib_is_refused_by_name() {
        let (own, cache) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        libtorch_at(own.path());
        libtorch_at(&cache.path().join(format!("torch-{TORCH_VERSION}/lib/python3.11/site-packages/torch")));
        let env = env_of(&[("LIBTORCH", own.path()), ("STAGELOAD_CACHE", cache.path())]);
        assert_eq!(find_in(&env).map(|t| t.source), Ok(Source::Env));
        let empty = tempfile::tempdir().unwrap();
        let message = find_in(&env_of(&[("LIBTORCH", empty.path())])).unwrap_err();
        assert!(message.contains("has no lib/ and include/") && message.contains(INSTALL_COMMAND), "{message}");
    }

    #[test]
    fn the_exports_set_libtorch_to_the_folder() {
        let libtorch = Libtorch { root: PathBuf::from("/opt/torch"), source: Source::Cache };
        assert_eq!(libtorch.exports(), "export LIBTORCH='/opt/torch'\n");
    }
}
