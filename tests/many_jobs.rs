//! Many jobs under a real scheduler, at the smallest scale: `scripts/many_jobs.py` starts a local
//! Ray cluster (bound to 127.0.0.1), submits three cascade jobs eager and then three staged, each
//! with the resources `stageload plan --request ray` gives and inside `stageload guard --plan`.
//! Every job ends by itself, none goes above its request, every job's latents equal the reference
//! run's, the staged jobs run at least as many at once as the eager ones, and the cluster the run
//! started is gone afterwards (stopped by its pid; killed here if it was not). Needs Ray as the
//! README's test command installs it (`scripts/setup-ray.sh`: STAGELOAD_RAY_PYTHON).

use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use stageload_test_support::build::{binary, checkout, example};

/// Whether any live process of the group `pgid` is left (a zombie waiting for its reaper holds
/// nothing and runs nothing).
fn group_alive(pgid: i32) -> bool {
    let table = stageload_probe::process_tree().expect("read the process table");
    table.iter().any(|entry| entry.pgid == pgid && !entry.zombie)
}

#[test]
fn three_jobs_a_mode_on_a_local_ray_cluster_stay_within_their_requests_and_give_the_reference_latents() {
    let python = std::env::var("STAGELOAD_RAY_PYTHON")
        .expect("STAGELOAD_RAY_PYTHON is not set: run the README's test command, or eval \"$(scripts/setup-ray.sh)\"");
    let folder = tempfile::Builder::new().prefix("stageload-many-jobs-").tempdir().unwrap();
    let out = folder.path().join("out");
    let said_path = folder.path().join("driver.log");
    let said = std::fs::File::create(&said_path).unwrap();
    let mut child = Command::new(&python)
        .arg(checkout().join("scripts/many_jobs.py"))
        .arg("--stageload")
        .arg(binary("stageload-cli", "stageload"))
        .arg("--cascade")
        .arg(example("cascade"))
        .args(["--jobs", "3", "--scale", "0.01", "--deadline", "300", "--out"])
        .arg(&out)
        .arg("--cache")
        .arg(folder.path().join("weights"))
        // To a file, not a pipe: a pipe nobody reads while the run goes could fill and stall it.
        .stdout(Stdio::from(said.try_clone().unwrap()))
        .stderr(Stdio::from(said.try_clone().unwrap()))
        .process_group(0)
        .spawn()
        .unwrap();
    let leader = child.id() as i32;
    let deadline = Instant::now() + Duration::from_secs(900);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if Instant::now() > deadline {
            // SIGTERM first: the driver stops its cluster on the way out; SIGKILL if it is late.
            let _ = killpg(Pid::from_raw(leader), Signal::SIGTERM);
            let grace = Instant::now() + Duration::from_secs(60);
            while child.try_wait().unwrap().is_none() && Instant::now() < grace {
                std::thread::sleep(Duration::from_millis(200));
            }
            let _ = killpg(Pid::from_raw(leader), Signal::SIGKILL);
            break None;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    // The cluster the driver started: its whole process group (head, GCS, raylet, workers and
    // the guards they ran; the head leads it) gone, or killed here by the pid it wrote.
    let ray = std::fs::read_to_string(out.join("ray/ray.pid")).ok().and_then(|p| p.trim().parse::<i32>().ok());
    let ray_left = ray.filter(|&pid| group_alive(pid));
    if let Some(pid) = ray_left {
        let _ = killpg(Pid::from_raw(pid), Signal::SIGKILL);
    }
    let _ = child.wait();
    let said = std::fs::read_to_string(&said_path).unwrap_or_default();
    let status = status.unwrap_or_else(|| panic!("the many-jobs run did not end within 900 s:\n{said}"));
    assert!(status.success(), "the many-jobs run failed ({status}):\n{said}");
    assert!(ray.is_some(), "the run wrote no ray.pid:\n{said}");
    assert_eq!(ray_left, None, "the run left its Ray cluster running");

    let results: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("many-jobs.json")).unwrap()).unwrap();
    assert_eq!(results["failures"].as_array().map(Vec::len), Some(0), "{results:#}");
    let mut at_once = Vec::new();
    for mode in ["eager", "staged"] {
        let m = &results["modes"][mode];
        let jobs = m["jobs"].as_array().unwrap();
        assert_eq!(jobs.len(), 3, "{mode}: every job ended");
        let request = results["requests"][mode]["memory"].as_u64().unwrap();
        for job in jobs {
            assert_eq!(job["exit"], 0, "{mode}: {job:#}");
            let peak = job["peak"].as_u64().unwrap();
            assert!(peak > 0 && peak <= request, "{mode}: peak {peak} above the request {request}");
            assert_eq!(job["latents_equal"], true, "{mode}: {job:#}");
        }
        at_once.push(m["most_at_once"].as_u64().unwrap());
    }
    let (eager, staged) =
        (results["requests"]["eager"]["memory"].as_u64(), results["requests"]["staged"]["memory"].as_u64());
    assert!(staged < eager, "the staged plan requests less than the eager one: {staged:?} {eager:?}");
    assert!(at_once[0] >= 1 && at_once[1] >= at_once[0], "jobs at once, eager then staged: {at_once:?}");
}
