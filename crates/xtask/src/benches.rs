//! The benchmarks: each a `stageload ab` comparison (alternating runs, each in its own process
//! under the guard, medians and ratios from its report) or the benchmark binary that measures
//! against its peer in one run; results where the README cites them.

use std::path::Path;

use crate::ab::{build, cascade_arms, guard_flags, Arm, Comparison};
use crate::shell::{check, words, Error, Failures, Log, Setup, Shell};

/// The hot set's arms: name, and the flags of the bench binary `bench_stream` (the stream
/// example with the benchmark's knobs) for it.
const HOT_SET_ARMS: [(&str, &[&str]); 8] = [
    // The whole model loaded.
    ("resident", &[]),
    // The same with the allocator setting a streamed model makes on the CPU (every block of
    // 1 MiB or more its own mapping, so that freed weights leave the RSS; activations then
    // page-fault on every call): what streaming costs beyond it.
    ("resident-mapped", &["--map-large-blocks"]),
    // Streamed in any order under a 550 MiB budget (two slots, a hot set of about 6 blocks).
    ("hot", &["--budget", "550MiB", "--working", "150MiB", "--any-order"]),
    // The same with no hot set.
    ("no-hot", &["--budget", "550MiB", "--working", "150MiB", "--any-order", "--resident-at-most", "0"]),
    // The same budget as a resident prefix (blocks 0-5, which the router does not favour).
    ("prefix", &["--budget", "550MiB", "--working", "150MiB"]),
    // The whole model with as many blocks read beside its flow as each streamed arm refills
    // (checked against their medians; the route and the policies are fixed, so the counts are
    // too): the least time each can take here, its reads' CPU shared with the compute's.
    ("beside-hot", &["--read-beside", "27"]),
    ("beside-no-hot", &["--read-beside", "96"]),
    ("beside-prefix", &["--read-beside", "34"]),
];

/// Each streamed arm and the arm reading as much beside the whole model's flow.
const BESIDE: [(&str, &str); 3] = [("hot", "beside-hot"), ("no-hot", "beside-no-hot"), ("prefix", "beside-prefix")];

/// The hot set of a streamed model whose forward runs only some blocks per call (a fixed router
/// over texture_flow's 12 blocks at scale 1: blocks 0 and 1 every call, one of the last three and
/// one of the middle seven in turn; `bench_stream --route experts`) on the CPU, the arms of
/// [`HOT_SET_ARMS`]; once with refills from the page cache, once from the disk (`--cold
/// --uncached`: the checkpoint's pages dropped before set-up, and each refill drops what it read,
/// as a model bigger than memory streams). `runs` runs per arm, alternating, under `stageload
/// ab`, which checks the latents against the resident run's; the hot set must read fewer blocks
/// than either other streamed arm. Results in `out`: cache/ and disk/, one comparison each.
pub fn hot_set(shell: &mut Shell, out: &Path, runs: u16) -> Result<(), Error> {
    shell.set_up(&[Setup::Libtorch])?;
    let out = shell.folder(out)?;
    let stageload = build(shell, &["--lib"])?;
    shell.run(&mut shell.cargo(&["build", "-p", "stageload-bench", "--bin", "bench_stream"]))?;
    let stream = shell.target("debug/bench_stream");
    let log = Log::create(&out.join("bench.log"))?;
    let mut failures = Failures::default();
    for source in ["cache", "disk"] {
        let arms = HOT_SET_ARMS
            .iter()
            .map(|(name, flags)| {
                let mut args = words(&["--device", "cpu", "--route", "experts", "--steps", "24", "--tokens", "128"]);
                if source == "disk" {
                    args.extend(words(&["--cold", "--disk-rate"]));
                    if !name.starts_with("resident") {
                        // Refills (and reads beside) drop what they read.
                        args.push("--uncached".into());
                    }
                }
                Arm::new(name, &stream, &[args, words(flags)].concat())
            })
            .collect();
        let comparison =
            Comparison { stageload: &stageload, out: out.join(source), runs, arms, flags: guard_flags(None) };
        log.line(&format!("== from the {source}: {runs} run(s) of each arm, alternating"));
        let report = comparison.run(shell, Some(&log))?;
        failures.keep(report.verdict(&format!("the hot set from the {source}")));
        log.line(&format!("== from the {source}, medians of {runs} run(s): seconds of the flow; blocks and bytes read; peak RSS over set-up"));
        let value = |field: &str, arm: &str| report.median(field, arm).unwrap_or(f64::NAN);
        for (arm, _) in HOT_SET_ARMS {
            log.line(&format!(
                "   {arm:<15} {:.2} s ({:.3}x resident); {:.0} of {:.0} block runs read ({:.2} GiB; {:.0} carried from the call before), {:.0} found hot; peak {:.0} MiB",
                value("seconds", arm),
                report.ratio("seconds", arm).unwrap_or(f64::NAN),
                value("refills", arm),
                value("blocks_run", arm),
                // A streamed arm's refills, or the reads beside a whole model's flow.
                value("bytes_refilled", arm).max(value("bytes_read_beside", arm)) / f64::from(1u32 << 30),
                value("carried", arm),
                value("hot_hits", arm),
                (value("peak_rss", arm) - value("base_rss", arm)) / f64::from(1u32 << 20),
            ));
        }
        beside_limits(&log, &report);
        if source == "disk" {
            disk_limits(&log, &report);
        }
        for (streamed, beside) in BESIDE {
            if report.median("bytes_refilled", streamed) != report.median("bytes_read_beside", beside) {
                failures.keep(Err(format!(
                    "from the {source}: {beside} read another number of blocks than {streamed} refilled: set its --read-beside to {streamed}'s refills ({:.0})",
                    value("refills", streamed)
                )));
            }
        }
        for other in ["no-hot", "prefix"] {
            if value("refills", "hot").partial_cmp(&value("refills", other)) != Some(std::cmp::Ordering::Less) {
                failures.keep(Err(format!("from the {source}: the hot set read no fewer blocks than {other}")));
            }
        }
    }
    failures.end()
}

/// Each streamed arm against the whole model's flow with the same blocks read beside it, which
/// waits for none of them: what streaming costs beyond sharing the cores with its reads.
fn beside_limits(log: &Log, report: &crate::ab::Report) {
    log.line("== each streamed arm against the whole model's flow with as many blocks read beside it");
    for (streamed, beside) in BESIDE {
        let (Some(seconds), Some(floor)) = (report.median("seconds", streamed), report.median("seconds", beside))
        else {
            continue;
        };
        log.line(&format!("   {streamed:<15} {seconds:.2} s against {floor:.2} s ({beside}): {:.3}x", seconds / floor));
    }
}

/// Each streamed arm from the disk against its limit: the flow cannot take less than its
/// compute (the resident arm's flow) nor than reading what it refilled at the disk's rate. Each
/// run measures that rate on the checkpoint before its set-up and after its flow
/// (`--disk-rate`) and reports its reading time at it (`reading_seconds`): the limit is the
/// larger of the resident flow's median and the arm's median reading time.
fn disk_limits(log: &Log, report: &crate::ab::Report) {
    let Some(compute) = report.median("seconds", "resident") else {
        log.line("   no resident time in the results: no limits");
        return;
    };
    let rates: Vec<String> = HOT_SET_ARMS
        .iter()
        .filter_map(|(arm, _)| report.median("disk_bytes_per_second", arm))
        .map(|rate| format!("{:.2}", rate / 1e9))
        .collect();
    log.line(&format!(
        "== from the disk, against the limit max(compute, bytes read / disk rate): compute {compute:.2} s (resident); the disk's rate, median per arm: {} GB/s",
        rates.join(", "),
    ));
    for arm in ["hot", "no-hot", "prefix"] {
        let (Some(seconds), Some(bytes), Some(reading)) = (
            report.median("seconds", arm),
            report.median("bytes_refilled", arm),
            report.median("reading_seconds", arm),
        ) else {
            continue;
        };
        let limit = compute.max(reading);
        log.line(&format!(
            "   {arm:<15} {seconds:.2} s against {limit:.2} s ({:.2} GiB read: {reading:.2} s at each run's disk rate, median): {:.3}x the limit",
            bytes / f64::from(1u32 << 30),
            seconds / limit,
        ));
    }
}

/// Staged + prefetch wall time against eager and staged, on a warm and on a cold page cache: the
/// cascade under `stageload ab`, first with the checkpoints in the page cache, then with each run
/// dropping them first (`--cold`, posix_fadvise DONTNEED: every load reads the disk). Results in
/// `out`: warm/ and cold/, each one comparison (wall time per run and per arm, ratios to eager,
/// peaks per stage, latents compared).
pub fn prefetch(shell: &mut Shell, out: &Path, cascade: &[String]) -> Result<(), Error> {
    shell.set_up(&[Setup::Libtorch])?;
    let out = shell.folder(out)?;
    let stageload = build(shell, &["--example", "cascade"])?;
    let mut failures = Failures::default();
    for cache in ["warm", "cold"] {
        let folder = shell.folder(&out.join(cache))?;
        let mut extra = if cache == "cold" { vec!["--cold".to_string()] } else { Vec::new() };
        extra.extend(cascade.iter().cloned());
        let comparison = Comparison {
            stageload: &stageload,
            out: folder.clone(),
            runs: 2,
            arms: cascade_arms(shell, &extra),
            flags: guard_flags(None),
        };
        println!("== {cache} page cache: eager, staged, prefetch, twice each, alternating");
        let log = Log::create(&folder.join("ab.log"))?;
        let report = comparison.run(shell, Some(&log))?;
        failures.keep(report.verdict(&format!("prefetch, {cache} page cache")));
        for arm in ["eager", "staged", "prefetch"] {
            let median = report.median_wall(arm).map_or("-".into(), |s| format!("{s:.1} s"));
            let ratio = report.wall_ratio(arm).map_or("-".into(), |r| format!("{r:.3}"));
            println!("   {arm:<9} wall {median:>8}, ratio to eager {ratio}");
        }
    }
    failures.end()
}

/// The checkpoint load benchmark: stageload against the page cache's and the disk's limits, tch's
/// VarStore::load and the Python loader peers (installed here, pinned, only for this), in one run
/// (results in traces/).
pub fn load(shell: &mut Shell, args: &[String]) -> Result<(), Error> {
    shell.set_up(&[Setup::Libtorch, Setup::LoadPeers])?;
    shell.run(shell.cargo(&["run", "--release", "-p", "stageload-bench", "--bin", "bench_load", "--"]).args(args))
}

/// `stageload guard`'s benchmark: reaction time and overshoot against a child allocating as fast
/// as it can, and CPU per hour of watching (traces/guard-bench.md and .json). Torch-free.
pub fn guard(shell: &Shell, args: &[String]) -> Result<(), Error> {
    let build = ["build", "--release", "-p", "stageload-cli", "--bin", "stageload", "--example", "bench_guard"];
    shell.run(&mut shell.cargo(&build))?;
    let bench = shell.target("release/examples/bench_guard");
    shell.run(shell.cmd(bench, &[]).args(args))
}

/// Many jobs under a real scheduler: a local Ray cluster with a node memory resource of two eager
/// requests, `jobs` cascade jobs eager and then staged, each task's memory from `stageload plan
/// --request ray` and each run inside `stageload guard --plan` (scripts/many_jobs.py); then the
/// same requests in Slurm and Kubernetes words. Results in `out` (replaced).
pub fn many_jobs(shell: &mut Shell, out: &Path, jobs: u32, scale: &str) -> Result<(), Error> {
    shell.set_up(&[Setup::Libtorch, Setup::Ray])?;
    let stageload = build(shell, &["--example", "cascade"])?;
    let out = shell.root().join(out);
    if out.exists() {
        std::fs::remove_dir_all(&out).map_err(|e| format!("cannot clear {}: {e}", out.display()))?;
    }
    let python = shell.var("STAGELOAD_RAY_PYTHON").ok_or("scripts/setup-ray.sh set no STAGELOAD_RAY_PYTHON")?;
    let mut driver = shell.cmd(python, &["scripts/many_jobs.py", "--stageload"]);
    driver.arg(&stageload).arg("--cascade").arg(shell.target("debug/examples/cascade"));
    driver.args(["--jobs", &jobs.to_string(), "--scale", scale, "--out"]).arg(&out);
    shell.run(&mut driver)?;
    for format in ["slurm", "kubernetes"] {
        let mut request = shell.cmd(&stageload, &["plan", "--request", format]);
        request.arg(out.join("jobs.toml"));
        let (status, text) = shell.output(&mut request)?;
        check(&request, status)?;
        let file = out.join(format!("request.{format}"));
        std::fs::write(&file, text).map_err(|e| format!("cannot write {}: {e}", file.display()))?;
    }
    Ok(())
}
