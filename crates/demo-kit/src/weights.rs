//! Demo checkpoints: written once from weights drawn with a fixed seed (same seed, same weights,
//! every time), under a cache folder, and read from there by every later run.

use std::path::{Path, PathBuf};

use stageload::{checkpoint, BoxError};
use tch::nn::VarStore;
use tch::Device;

use crate::models::{ModelShape, Transformer};

/// Where the demos cache their checkpoints: `demo-weights/` in the stageload cache
/// ([`stageload_cache`]: `$STAGELOAD_CACHE`, else `$XDG_CACHE_HOME/stageload`, else
/// `~/.cache/stageload`, else `target/`).
pub fn cache_root() -> PathBuf {
    stageload_cache().join("demo-weights")
}

pub use stageload_pipelines::stageload_cache;

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
/// checkpoint loads read it: [`checkpoint::readers`] threads, each reading one contiguous run of
/// the file (a share of about the same bytes, in [`checkpoint::PIECE`]-byte `pread`s in order)
/// through a handle of its own into a reused buffer of its own, written before the clock starts
/// (from the disk, each run a sequential stream with its own read-ahead: the fastest way to read
/// this virtual disk measured here; from the page cache, the copy rate with the loads'
/// parallelism).
pub fn read_rate(path: &Path) -> std::io::Result<f64> {
    use std::os::unix::fs::FileExt;
    const PIECE: u64 = checkpoint::PIECE as u64;
    let length = std::fs::metadata(path)?.len();
    let readers = checkpoint::readers() as u64;
    // Each run's share, whole pieces.
    let share = length.div_ceil(readers).div_ceil(PIECE).max(1) * PIECE;
    let mut buffers = vec![vec![1u8; PIECE as usize]; readers as usize];
    let files = (0..readers).map(|_| std::fs::File::open(path)).collect::<std::io::Result<Vec<_>>>()?;
    let started = std::time::Instant::now();
    std::thread::scope(|scope| {
        let runs: Vec<_> = buffers
            .iter_mut()
            .zip(&files)
            .zip(0u64..)
            .map(|((buffer, file), run)| {
                scope.spawn(move || -> std::io::Result<()> {
                    let end = length.min(share.saturating_mul(run + 1));
                    let mut offset = share.saturating_mul(run);
                    while offset < end {
                        let size = PIECE.min(end - offset) as usize;
                        file.read_exact_at(&mut buffer[..size], offset)?;
                        offset += size as u64;
                    }
                    Ok(())
                })
            })
            .collect();
        runs.into_iter()
            .try_for_each(|run| run.join().unwrap_or_else(|_| Err(std::io::Error::other("a reader panicked"))))
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
