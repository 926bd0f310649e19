//! Where stageload keeps what it downloads or writes once: the cached Python environment
//! (`torch-2.13.0/`), the pipelines' published-size exports, and the demos' checkpoints
//! (`demo-weights/`).

use std::path::PathBuf;

/// The stageload cache: `$STAGELOAD_CACHE`, else `$XDG_CACHE_HOME/stageload`, else
/// `~/.cache/stageload`, else `target/`.
pub fn stageload_cache() -> PathBuf {
    let home_cache = || std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cache"));
    std::env::var_os("STAGELOAD_CACHE")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("XDG_CACHE_HOME").map(PathBuf::from).or_else(home_cache).map(|c| c.join("stageload"))
        })
        .unwrap_or_else(|| PathBuf::from("target"))
}
