//! Checkpoint loading benchmark: stageload's loader against every loader peer and the limit, side
//! by side in one run.
//!
//!     cargo xtask bench-load -- --cold   (= scripts/setup-load-peers.sh, then
//!                                           cargo run --release -p stageload-bench --bin bench_load)
//!
//! One checkpoint of about 1.04 GB (f32 linear layers of three sizes) is written once, and the same
//! weights as a `.pt` beside it for `torch.load`. Each round loads it with each loader in turn
//! (alternating), into an existing model's parameters on the CPU, warm (the loader's file read
//! whole just before, untimed); with `--cold`, rounds that drop the file's pages first
//! (posix_fadvise) are added. The fraction of the file in the page cache as each load starts is
//! read (`fincore`) and reported. The loaders: the limits (a plain `pread` loop into one reused
//! buffer, and `pread`s with stageload's parallelism, the ratios' reference: the page cache's copy
//! rate warm, the disk's rate cold), stageload (its default, `HostRead::Mapped`: pieces in the
//! page cache copied from mappings, and `HostRead::Pread`: every piece `pread` straight into
//! its target), `tch::nn::VarStore::load`, and the Python
//! peers of `python/bench_load.py` (safetensors, runai-model-streamer, fastsafetensors,
//! instanttensor, torch.load with and without mmap), each a fresh process per load (startup not
//! timed). A peer that cannot be installed or cannot load to the CPU is reported with why, and the
//! rest run. Reported: GB/s (medians), ratios against stageload and the parallel limit in the
//! same run, and the transient peak of anonymous memory over the model (VmHWM reset before each
//! load, pages of the mapped file subtracted; the table also shows the peak with them). Results
//! go to `traces/load-bench.json` and `.md`.

use std::collections::BTreeMap;
use std::error::Error;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use clap::Parser;
use stageload::checkpoint::{Checkpoint, HostRead, Progress};
use stageload_bench::median;
use stageload_probe::ProcessMemory;
use tch::nn::{self, VarStore};
use tch::{Device, Kind, Tensor};

type BoxError = Box<dyn Error + Send + Sync>;

#[derive(Parser)]
struct Args {
    /// Rounds of (every loader), alternating.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Also measure with the file's pages dropped from the page cache before each load.
    #[arg(long)]
    cold: bool,
    /// Where the checkpoint is written once (and its `.pt` beside it).
    #[arg(long, default_value = "target/stageload-bench/model.safetensors")]
    checkpoint: PathBuf,
    /// Python with torch, safetensors and the loader peers (scripts/setup-load-peers.sh exports
    /// STAGELOAD_LOAD_PEERS_PYTHON; without it STAGELOAD_PYTHON, then python3: the peers missing
    /// there are reported as not installed).
    #[arg(long, env = "STAGELOAD_LOAD_PEERS_PYTHON")]
    python: Option<String>,
    /// Output folder for the results.
    #[arg(long, default_value = "traces")]
    out: PathBuf,
    /// Only these loaders besides stageload and the limit (the ratios' references), by their
    /// names in the table (`--only torch.load-mmap,safetensors`); all of them by default.
    #[arg(long, value_delimiter = ',', value_name = "NAMES")]
    only: Vec<String>,
}

/// The limit's one reused buffer. It (and the parallel limit's four 4 MiB buffers) stays in
/// this machine's L3 (300 MiB): the limits are the page cache's copy rate into the cache, above
/// what `pread` into a model's memory reaches (`traces/load-bench-stores/README.md`: 1.35x).
const LIMIT_BUFFER: usize = 16 << 20;

/// A loader the benchmark measures, in the order each round runs them.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Loader {
    /// A `pread` loop into one reused buffer of [`LIMIT_BUFFER`] bytes, one thread.
    Limit,
    /// stageload's checkpoint load, reading host pieces as it says.
    Stageload(HostRead),
    Tch,
    /// A peer of python/bench_load.py, by its name there.
    Python(&'static str),
    /// `pread`s as stageload's loads read (contiguous runs, a handle each), into reused buffers
    /// ([`stageload_demo_kit::weights::read_rate`]): the limit the ratios are taken against.
    Parallel,
}

const LOADERS: [Loader; 11] = [
    Loader::Limit,
    Loader::Parallel,
    Loader::Stageload(HostRead::Mapped),
    Loader::Stageload(HostRead::Pread),
    Loader::Tch,
    Loader::Python("safetensors"),
    Loader::Python("runai-model-streamer"),
    Loader::Python("fastsafetensors"),
    Loader::Python("instanttensor"),
    Loader::Python("torch.load"),
    Loader::Python("torch.load-mmap"),
];

impl Loader {
    fn name(self) -> &'static str {
        match self {
            Loader::Limit => "limit (pread)",
            Loader::Parallel => "limit (parallel pread)",
            Loader::Stageload(HostRead::Mapped) => "stageload",
            Loader::Stageload(HostRead::Pread) => "stageload (pread)",
            Loader::Tch => "tch",
            Loader::Python(peer) => peer,
        }
    }

    /// The file it reads: the `.pt` for torch.load, the checkpoint for the others.
    fn file(self, checkpoint: &Path) -> PathBuf {
        match self {
            Loader::Python(peer) if peer.starts_with("torch.load") => checkpoint.with_extension("pt"),
            _ => checkpoint.to_path_buf(),
        }
    }
}

/// (out, in) of each layer: 13 × 4096², 8 × 4096×1024, 8 × 1024².
fn layer_shapes() -> Vec<(i64, i64)> {
    let mut shapes = vec![(4096, 4096); 13];
    shapes.extend([(4096, 1024); 8]);
    shapes.extend([(1024, 1024); 8]);
    shapes
}

fn build(vs: &VarStore) {
    for (i, (out, inp)) in layer_shapes().into_iter().enumerate() {
        let _ = nn::linear(vs.root() / "layers" / i, inp, out, Default::default());
    }
}

/// This process's memory now.
fn memory() -> Result<ProcessMemory, BoxError> {
    Ok(stageload_probe::process_memory(std::process::id() as i32)?)
}

/// Resident pages that are not anonymous: mapped files (and shared memory, constant here).
fn file_pages(memory: &ProcessMemory) -> Result<i64, BoxError> {
    Ok(memory.rss as i64 - memory.rss_anon.ok_or("this system reports no RssAnon")? as i64)
}

struct Measure {
    seconds: f64,
    /// Anonymous memory over the model at the peak.
    peak_over: i64,
    /// The same with the checkpoint's mapped page-cache pages counted.
    peak_with_file: i64,
}

/// Runs `load` with the high-water mark reset. The peak over the model counts anonymous memory
/// only: pages of a file still mapped by what `load` returns are subtracted.
fn measured<T>(load: impl FnOnce() -> Result<T, BoxError>) -> Result<Measure, BoxError> {
    let before = memory()?;
    stageload_probe::reset_peak()?;
    let start = Instant::now();
    let still_mapped = load()?;
    let seconds = start.elapsed().as_secs_f64();
    let after = memory()?;
    let file_pages = file_pages(&after)? - file_pages(&before)?;
    let peak = after.peak.ok_or("this system reports no peak resident set (VmHWM)")?;
    let peak_with_file = peak as i64 - before.rss as i64;
    drop(still_mapped);
    Ok(Measure { seconds, peak_over: peak_with_file - file_pages, peak_with_file })
}

/// Reads `path` whole with `pread` into `buffer`, again and again: the rate no loader of it can
/// beat with one thread.
fn pread_all(path: &Path, buffer: &mut [u8]) -> Result<u64, BoxError> {
    let file = File::open(path).map_err(|e| format!("open {}: {e}", path.display()))?;
    let mut offset = 0;
    loop {
        match file.read_at(buffer, offset).map_err(|e| format!("read {} at {offset}: {e}", path.display()))? {
            0 => return Ok(offset),
            n => offset += n as u64,
        }
    }
}

fn drop_page_cache(path: &Path) -> Result<(), BoxError> {
    stageload_demo_kit::weights::drop_page_cache(path)
        .map_err(|e| format!("drop the pages of {} from the page cache: {e}", path.display()).into())
}

/// Reads the file once, so that a warm load finds all of it in the page cache: this machine's
/// DAMON `pageout` scheme takes a file's pages out of the cache within a minute or two of its
/// last read, and a round of every loader takes about that long. Into `buffer`, the limit's own.
fn warm_page_cache(path: &Path, buffer: &mut [u8]) -> Result<(), BoxError> {
    pread_all(path, buffer).map(drop)
}

/// The fraction of `path` in the page cache now, by util-linux's `fincore`.
fn cached_fraction(path: &Path) -> Result<f64, BoxError> {
    let out = Command::new("fincore")
        .args(["--bytes", "--noheadings", "--raw", "--output", "RES,SIZE"])
        .arg(path)
        .output()
        .map_err(|e| format!("cannot run fincore (util-linux) on {}: {e}", path.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let numbers: Vec<f64> = text.split_whitespace().filter_map(|n| n.parse().ok()).collect();
    match numbers[..] {
        [resident, size] if out.status.success() && size > 0.0 => Ok(resident / size),
        _ => Err(format!("fincore {}: unexpected answer {text:?} ({})", path.display(), out.status).into()),
    }
}

/// Writes zeros into `tensors`.
fn rewrite<'a>(tensors: impl Iterator<Item = &'a Tensor>) {
    tch::no_grad(|| tensors.for_each(|t| drop(t.shallow_clone().zero_())));
}

/// The sum of every parameter in f64: what each Python peer loaded must give the same.
fn checksum(tensors: &[(String, Tensor)]) -> f64 {
    tensors.iter().map(|(_, t)| t.sum(Kind::Double).double_value(&[])).sum()
}

/// One load by a Python peer, or why the peer cannot run here.
struct PythonRun {
    measure: Measure,
    checksum: f64,
    version: String,
    configuration: String,
}

fn python_run(python: &str, peer: &str, checkpoint: &Path, cache: &str) -> Result<PythonRun, String> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("python/bench_load.py");
    let out = Command::new(python)
        .arg(&script)
        .args([peer, &checkpoint.display().to_string(), "1", cache])
        .output()
        .map_err(|e| format!("cannot run {python}: {e}; run scripts/setup-load-peers.sh or pass --python"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let last = stderr.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("no message");
        return Err(format!("{python} {} {peer} failed ({}): {last}", script.display(), out.status));
    }
    let line = stdout.lines().last().ok_or("printed nothing")?;
    let v: serde_json::Value = serde_json::from_str(line).map_err(|e| format!("printed {line:?}, not JSON: {e}"))?;
    if let Some(why) = v["unavailable"].as_str() {
        return Err(why.to_string());
    }
    let number = |k: &str| v[k].as_f64().ok_or_else(|| format!("printed no {k} in {line}"));
    let text = |k: &str| v[k].as_str().map(String::from).ok_or_else(|| format!("printed no {k} in {line}"));
    Ok(PythonRun {
        measure: Measure {
            seconds: number("seconds")?,
            peak_over: number("peak_over")? as i64,
            peak_with_file: number("peak_with_file")? as i64,
        },
        checksum: number("checksum")?,
        version: text("version")?,
        configuration: text("configuration")?,
    })
}

/// The load average over the last minute (/proc/loadavg), for the report.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(String::from))
        .unwrap_or_else(|| "unknown".into())
}

fn main() -> Result<(), BoxError> {
    stageload_demo_kit::logging::init();
    let args = Args::parse();
    if let Some(unknown) = args.only.iter().find(|n| !LOADERS.iter().any(|l| l.name() == n.as_str())) {
        let names: Vec<&str> = LOADERS.iter().map(|l| l.name()).collect();
        return Err(format!("--only: no loader '{unknown}' (the loaders: {})", names.join(", ")).into());
    }
    let loaders: Vec<Loader> = LOADERS
        .into_iter()
        .filter(|l| {
            matches!(l, Loader::Limit | Loader::Parallel | Loader::Stageload(HostRead::Mapped))
                || args.only.is_empty()
                || args.only.iter().any(|n| n == l.name())
        })
        .collect();
    let python =
        args.python.clone().or_else(|| std::env::var("STAGELOAD_PYTHON").ok()).unwrap_or_else(|| "python3".into());
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2);
    tch::set_num_threads(cores as i32);
    let checkpoint = &args.checkpoint;
    if !checkpoint.exists() {
        let folder = checkpoint.parent().unwrap_or(Path::new("."));
        std::fs::create_dir_all(folder).map_err(|e| format!("create {}: {e}", folder.display()))?;
        let vs = VarStore::new(Device::Cpu);
        build(&vs);
        let vars: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        stageload::checkpoint::save(&vars, checkpoint)?;
    }
    let pt = Loader::Python("torch.load").file(checkpoint);
    if !pt.exists() {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("python/bench_load.py");
        let status = Command::new(&python).arg(script).arg("--write-pt").arg(checkpoint).status();
        if !matches!(status, Ok(s) if s.success()) {
            eprintln!("could not write {} with {python} ({status:?}); torch.load is reported as failing", pt.display());
        }
    }
    let vs = VarStore::new(Device::Cpu);
    build(&vs);
    let mut vs_tch = VarStore::new(Device::Cpu);
    build(&vs_tch);
    let targets: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    let model_bytes: i64 = targets.iter().map(|(_, t)| (t.numel() * 4) as i64).sum();
    let gb = model_bytes as f64 / 1e9;
    let load_at_start = load_average();
    println!("model: {} tensors, {gb:.3} GB; {} rounds; load average {load_at_start}", targets.len(), args.rounds);

    let show_bar = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let mut buffer = vec![1u8; LIMIT_BUFFER];
    // (loader, cache, the fraction of its file cached at the start, the measure)
    let mut results: Vec<(Loader, &str, f64, Measure)> = Vec::new();
    let mut unavailable: BTreeMap<&str, String> = BTreeMap::new();
    // peer -> (version, configuration -> the caches it ran in)
    let mut configurations: BTreeMap<&str, (String, BTreeMap<String, Vec<&str>>)> = BTreeMap::new();
    let mut loaded_sum = None;
    let modes: &[&str] = if args.cold { &["warm", "cold"] } else { &["warm"] };
    for &mode in modes {
        for round in 0..args.rounds {
            for &loader in &loaders {
                if unavailable.contains_key(loader.name()) {
                    continue;
                }
                let file = loader.file(checkpoint);
                let cached = if file.exists() {
                    match mode {
                        "cold" => drop_page_cache(&file)?,
                        _ => warm_page_cache(&file, &mut buffer)?,
                    }
                    cached_fraction(&file)?
                } else {
                    f64::NAN
                };
                // Each destination written just before its load, as the Python peers' models are
                // (made and zeroed in their own process).
                match loader {
                    Loader::Limit => buffer.fill(1),
                    Loader::Stageload(_) => rewrite(targets.iter().map(|(_, t)| t)),
                    Loader::Tch => rewrite(vs_tch.variables().values()),
                    Loader::Parallel | Loader::Python(_) => {}
                }
                let measure = match loader {
                    Loader::Limit => {
                        let mut m = measured(|| pread_all(&file, &mut buffer))?;
                        // The buffer is allocated once, before: it is what the loop needs.
                        m.peak_over += LIMIT_BUFFER as i64;
                        m.peak_with_file += LIMIT_BUFFER as i64;
                        m
                    }
                    Loader::Parallel => {
                        let rate = stageload_demo_kit::weights::read_rate(&file)
                            .map_err(|e| format!("read {} with parallel preads: {e}", file.display()))?;
                        let length = file.metadata().map_err(|e| format!("stat {}: {e}", file.display()))?.len();
                        // Its buffers, allocated and written before the clock starts.
                        let buffers = (stageload::checkpoint::readers() * stageload::checkpoint::PIECE) as i64;
                        Measure { seconds: length as f64 / rate, peak_over: buffers, peak_with_file: buffers }
                    }
                    Loader::Stageload(how) => {
                        let bar = show_bar.then(|| indicatif::ProgressBar::new(model_bytes as u64));
                        let m = measured(|| {
                            let opened = Checkpoint::open(&[&file])?.host_reads(how);
                            opened.load_into(&targets, |p: Progress| {
                                if let Some(bar) = &bar {
                                    bar.set_position(p.done)
                                }
                            })?;
                            Ok(opened)
                        })?;
                        if let Some(bar) = bar {
                            bar.finish_and_clear();
                        }
                        let sum = checksum(&targets);
                        if *loaded_sum.get_or_insert(sum) != sum {
                            return Err(
                                format!("{} loaded other numbers than stageload's other arm", loader.name()).into()
                            );
                        }
                        m
                    }
                    Loader::Tch => measured(|| Ok(vs_tch.load(&file)?))?,
                    Loader::Python(peer) => match python_run(&python, peer, checkpoint, mode) {
                        Ok(run) => {
                            let expected = loaded_sum.unwrap_or(f64::NAN);
                            if (run.checksum - expected).abs() > 1e-9 * expected.abs().max(1.0) {
                                let why = format!(
                                    "loaded other numbers: checksum {} against stageload's {expected}",
                                    run.checksum
                                );
                                unavailable.insert(peer, why);
                                continue;
                            }
                            let (_, by_configuration) =
                                configurations.entry(peer).or_insert_with(|| (run.version, BTreeMap::new()));
                            let caches = by_configuration.entry(run.configuration).or_default();
                            if !caches.contains(&mode) {
                                caches.push(mode);
                            }
                            run.measure
                        }
                        Err(why) => {
                            eprintln!("{peer}: not measured: {why}");
                            unavailable.insert(peer, why);
                            continue;
                        }
                    },
                };
                results.push((loader, mode, cached, measure));
            }
            eprintln!("{mode} round {} done", round + 1);
        }
    }
    // Verify tch loaded what stageload did (the Python peers were checked by their checksums).
    let tch_vars = vs_tch.variables();
    for (name, t) in targets.iter().filter(|_| loaders.contains(&Loader::Tch)) {
        let other = tch_vars.get(name).ok_or_else(|| format!("tch loaded no {name}"))?;
        if !t.equal(other) {
            return Err(format!("stageload and tch disagree on {name}").into());
        }
    }

    let mut summary = serde_json::Map::new();
    let mut table = String::from(
        "| loader | cache | file in page cache at start (min-max) | GB/s (median) | GB/s runs | × stageload | × limit | peak over model, anonymous (median) | with mapped file pages (median) |\n|---|---|---|---|---|---|---|---|---|\n",
    );
    for &mode in modes {
        let rate_of = |loader: Loader| {
            let runs: Vec<(f64, &Measure)> =
                results.iter().filter(|(l, m, ..)| *l == loader && *m == mode).map(|(_, _, c, m)| (*c, m)).collect();
            (median(runs.iter().map(|(_, m)| gb / m.seconds).collect()), runs)
        };
        let (stageload, _) = rate_of(Loader::Stageload(HostRead::Mapped));
        let (limit, _) = rate_of(Loader::Parallel);
        for &loader in loaders.iter().filter(|l| !unavailable.contains_key(l.name())) {
            let name = loader.name();
            let (rate, runs) = rate_of(loader);
            let percent = |bytes: i64| 100.0 * bytes as f64 / model_bytes as f64;
            let over = median(runs.iter().map(|(_, m)| percent(m.peak_over)).collect());
            let with_file = median(runs.iter().map(|(_, m)| percent(m.peak_with_file)).collect());
            let rates: Vec<String> = runs.iter().map(|(_, m)| format!("{:.2}", gb / m.seconds)).collect();
            let cached = runs.iter().map(|(cached, _)| 100.0 * cached);
            let (least, most) = (cached.clone().fold(f64::NAN, f64::min), cached.fold(f64::NAN, f64::max));
            table += &format!(
                "| {name} | {mode} | {least:.1}-{most:.1} % | {rate:.2} | {} | {:.2} | {:.2} | {over:.1} % | {with_file:.1} % |\n",
                rates.join(", "),
                rate / stageload,
                rate / limit
            );
            summary.insert(format!("{name}_{mode}_gbps"), rate.into());
            summary.insert(format!("{name}_{mode}_peak_over_pct"), over.into());
            summary.insert(format!("{name}_{mode}_peak_with_file_pct"), with_file.into());
        }
    }
    let mut notes = String::new();
    for (peer, (version, by_configuration)) in &configurations {
        for (configuration, caches) in by_configuration {
            let caches = if by_configuration.len() > 1 { format!(" ({})", caches.join(", ")) } else { String::new() };
            notes += &format!("- {peer} {version}{caches}: {configuration}\n");
        }
        summary.insert(format!("{peer}_version"), version.as_str().into());
    }
    for (peer, why) in &unavailable {
        notes += &format!("- {peer}: not measured: {why}\n");
        summary.insert(format!("{peer}_unavailable"), why.as_str().into());
    }
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let report = format!(
        "# Checkpoint load benchmark\n\nCommand: `cargo xtask bench-load -- {}` ({command})\n\n\
         Model: {} f32 tensors, {gb:.3} GB, {cores} cores; load average at start {load_at_start}.\n\n{table}\n\
         × stageload and × limit: each median against stageload's and the parallel limit's in the same run and \
         cache. The limits: one thread `pread`ing the file into one reused {} MiB buffer, and {readers} threads \
         each reading a contiguous share of the file in {} MiB `pread`s through a handle and into a reused buffer \
         of its own, as stageload's loads read (warm: \
         the page cache's copy rate; cold: the disk's rate). Warm: the file read whole just before each load, \
         untimed. stageload: {readers} reader threads; tch: {cores} threads.\n\n{notes}",
        std::env::args().skip(1).collect::<Vec<_>>().join(" "),
        targets.len(),
        LIMIT_BUFFER >> 20,
        stageload::checkpoint::PIECE >> 20,
        readers = stageload::checkpoint::readers()
    );
    let write = |name: &str, text: &str| {
        let path = args.out.join(name);
        std::fs::write(&path, text).map_err(|e| format!("write {}: {e}", path.display()))
    };
    std::fs::create_dir_all(&args.out).map_err(|e| format!("create {}: {e}", args.out.display()))?;
    write("load-bench.md", &report)?;
    summary.insert("command".into(), command.into());
    summary.insert("model_bytes".into(), model_bytes.into());
    summary.insert("load_average_at_start".into(), load_at_start.into());
    write("load-bench.json", &serde_json::to_string_pretty(&summary)?)?;
    print!("{report}");
    Ok(())
}
