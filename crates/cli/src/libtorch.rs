//! `stageload libtorch`: finds libtorch the way a build of a crate that uses stageload does
//! (`LIBTORCH`, the Python torch of `LIBTORCH_USE_PYTORCH`, the per-user cache) and prints the
//! line to export so that torch-sys builds against it; `--cargo-config` also writes `LIBTORCH`
//! into a Cargo config's `[env]` table, so that builds of that project find it with nothing
//! exported. It installs nothing: the one installer is `scripts/setup-libtorch.sh`
//! ([`stageload_build::INSTALL_COMMAND`], named when nothing is found). The finding is
//! `stageload_build`'s, the code a build script runs.

use std::path::{Path, PathBuf};

use crate::out;

#[derive(clap::Args)]
#[command(
    about = "Find libtorch for a crate that uses stageload, and print what to export",
    after_help = "Nothing found: run `eval \"$(scripts/setup-libtorch.sh)\"` in the stageload checkout once (it \
                  installs torch 2.13.0, which carries libtorch, into the per-user cache).\n\nExample:\n  \
                  stageload libtorch --cargo-config .cargo/config.toml"
)]
pub struct LibtorchArgs {
    /// Also set LIBTORCH in this Cargo config file's [env] table (made if missing), e.g.
    /// .cargo/config.toml in your project
    #[arg(long, value_name = "FILE")]
    cargo_config: Option<PathBuf>,
}

pub fn run(args: LibtorchArgs) -> i32 {
    let libtorch = match stageload_build::find_libtorch() {
        Ok(libtorch) => libtorch,
        Err(message) => {
            eprintln!("stageload libtorch: {message}");
            return 1;
        }
    };
    if let Some(path) = &args.cargo_config {
        if let Err(message) = set_env(path, &libtorch.root) {
            eprintln!("stageload libtorch: {}: {message}", path.display());
            return 1;
        }
        eprintln!("stageload libtorch: LIBTORCH set in {}", path.display());
    }
    eprintln!("stageload libtorch: libtorch at {} ({:?})", libtorch.root.display(), libtorch.source);
    out::print(&libtorch.exports());
    0
}

/// The largest Cargo config `--cargo-config` reads.
const MAX_CONFIG: u64 = 1 << 20;

/// Sets `[env] LIBTORCH` in the Cargo config at `path`, keeping everything else in it.
fn set_env(path: &Path, root: &Path) -> Result<(), String> {
    // A Cargo config is a few lines; a FIFO or a huge file is refused, not read.
    let text = match stageload_input::read_text(path, MAX_CONFIG) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(e.to_string()),
    };
    let mut document: toml_edit::DocumentMut = text.parse().map_err(|e: toml_edit::TomlError| e.to_string())?;
    let env = document.entry("env").or_insert_with(toml_edit::table);
    let Some(env) = env.as_table_like_mut() else {
        return Err("its `env` is not a table".into());
    };
    env.insert("LIBTORCH", toml_edit::value(root.to_string_lossy().as_ref()));
    if let Some(folder) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(folder).map_err(|e| e.to_string())?;
    }
    std::fs::write(path, document.to_string()).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cargo_config_gets_libtorch_in_its_env_and_keeps_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(".cargo/config.toml");
        set_env(&path, Path::new("/opt/libtorch")).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "[env]\nLIBTORCH = \"/opt/libtorch\"\n");
        std::fs::write(&path, "[build]\njobs = 2\n\n[env]\nOTHER = \"x\"\nLIBTORCH = \"/old\"\n").unwrap();
        set_env(&path, Path::new("/opt/libtorch")).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.contains("jobs = 2") && text.contains("OTHER = \"x\""), "{text}");
        assert!(text.contains("LIBTORCH = \"/opt/libtorch\"") && !text.contains("/old"), "{text}");
    }

    #[test]
    fn a_config_whose_env_is_not_a_table_is_refused_and_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.toml");
        std::fs::write(&path, "env = 3\n").unwrap();
        assert_eq!(set_env(&path, Path::new("/opt/libtorch")), Err("its `env` is not a table".into()));
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "env = 3\n");
    }
}
