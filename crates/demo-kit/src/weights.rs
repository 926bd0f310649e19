//! Demo checkpoints: written once from weights drawn with a fixed seed (same seed, same weights,
//! every time), under a cache folder, and read from there by every later run.

use std::path::{Path, PathBuf};

use stageload::{checkpoint, BoxError};
use tch::nn::VarStore;
use tch::Device;

use crate::models::{ModelShape, Transformer};

/// Where the demos cache their checkpoints: `$STAGELOAD_CACHE`, else `$XDG_CACHE_HOME/stageload`,
/// else `~/.cache/stageload`, else `target/`; then `demo-weights/`.
pub fn cache_root() -> PathBuf {
    let home_cache = || std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cache"));
    std::env::var_os("STAGELOAD_CACHE")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("XDG_CACHE_HOME").map(PathBuf::from).or_else(home_cache).map(|c| c.join("stageload"))
        })
        .unwrap_or_else(|| PathBuf::from("target"))
        .join("demo-weights")
}

/// The stageload cache: the folder holding `demo-weights/` ([`cache_root`]), the cached Python
/// environment (`torch-2.13.0/`) and the pipelines' published-size exports.
pub fn stageload_cache() -> PathBuf {
    let root = cache_root();
    root.parent().map(PathBuf::from).unwrap_or(root)
}

/// Drops `path`'s pages from the page cache (`posix_fadvise(DONTNEED)`): its next read comes
/// from the disk, as on a cold start.
pub fn drop_page_cache(path: &Path) -> std::io::Result<()> {
    let file = std::fs::File::open(path)?;
    nix::fcntl::posix_fadvise(&file, 0, 0, nix::fcntl::PosixFadviseAdvice::POSIX_FADV_DONTNEED)
        .map_err(std::io::Error::from)
}

/// The disk's read rate for `path`, in bytes per second: its pages dropped from the page cache,
/// the file read once as [`read_rate`] reads it, and its pages dropped again, so that what runs
/// next reads the disk as it would have.
pub fn disk_read_rate(path: &Path) -> std::io::Result<f64> {
    drop_page_cache(path)?;
    let rate = read_rate(path)?;
    drop_page_cache(path)?;
    Ok(rate)
}

/// The rate at which `path` reads, in bytes per second, from wherever its pages are now, the way
/// checkpoint loads read it: [`checkpoint::readers`] threads taking [`checkpoint::PIECE`]-byte
/// `pread`s in turn, each into a reused buffer of its own, written before the clock starts (the
/// fastest way to read this virtual disk measured here, which serves more with more requests in
/// flight; from the page cache, the copy rate with the loads' parallelism).
pub fn read_rate(path: &Path) -> std::io::Result<f64> {
    use std::os::unix::fs::FileExt;
    use std::sync::atomic::{AtomicU64, Ordering};
    const PIECE: u64 = checkpoint::PIECE as u64;
    let file = std::fs::File::open(path)?;
    let length = file.metadata()?.len();
    let next = AtomicU64::new(0);
    let mut buffers = vec![vec![1u8; PIECE as usize]; checkpoint::readers()];
    let started = std::time::Instant::now();
    std::thread::scope(|scope| {
        let readers: Vec<_> = buffers
            .iter_mut()
            .map(|buffer| {
                let (file, next) = (&file, &next);
                scope.spawn(move || -> std::io::Result<()> {
                    loop {
                        let offset = next.fetch_add(PIECE, Ordering::Relaxed);
                        if offset >= length {
                            return Ok(());
                        }
                        let size = PIECE.min(length - offset) as usize;
                        file.read_exact_at(&mut buffer[..size], offset)?;
                    }
                })
            })
            .collect();
        readers
            .into_iter()
            .try_for_each(|reader| reader.join().unwrap_or_else(|_| Err(std::io::Error::other("a reader panicked"))))
    })?;
    Ok(length as f64 / started.elapsed().as_secs_f64().max(1e-9))
}

/// The checkpoint of `shape` under `folder`, written once from weights drawn with `seed` (same
/// seed, same weights, every time).
pub fn cached_checkpoint(folder: &Path, shape: &ModelShape, prefix: &[&str], seed: i64) -> Result<PathBuf, BoxError> {
    let path = folder.join(format!("{}-{}x{}.safetensors", shape.name, shape.width, shape.depth));
    cached(&path, seed, |vs| {
        let _ = Transformer::new(prefix.iter().fold(vs.root(), |p, part| p / *part), shape);
    })?;
    Ok(path)
}

/// Writes `path` once from the variables `build` creates with torch seeded by `seed`
/// (`checkpoint::save` writes a temporary name and renames it, so an interrupted write never
/// leaves a file that looks complete).
pub fn cached(path: &Path, seed: i64, build: impl FnOnce(&VarStore)) -> Result<(), BoxError> {
    if path.exists() {
        return Ok(());
    }
    if let Some(folder) = path.parent() {
        std::fs::create_dir_all(folder)?;
    }
    tch::manual_seed(seed);
    let vs = VarStore::new(Device::Cpu);
    build(&vs);
    stageload::checkpoint::save(&stageload::named_tensors(&vs), path)?;
    Ok(())
}
