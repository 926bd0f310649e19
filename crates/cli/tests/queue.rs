//! `stageload run` and `stageload queue` as users run them: the real binary, real processes, a
//! home of its own per test. Order is observed through files the commands write and the queue's
//! own listing, never by comparing measured times. Every run has a deadline (`--start-timeout`
//! and a wait that kills it), and every process a test starts is stopped by its pid when the
//! test ends, passed or not.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde_json::Value;
use stageload_test_support::pids::{read_pid, running};

const STAGELOAD: &str = env!("CARGO_BIN_EXE_stageload");

/// Flags that make admission and the watch ignore how busy this shared machine is, with a quick
/// poll and a bounded wait.
const QUICK: [&str; 8] = ["--wait-free", "0", "--kill-free", "0", "--poll", "20ms", "--start-timeout", "60s"];

/// How long any one step may take before the test fails (a wait, never a measurement).
const LIMIT: Duration = Duration::from_secs(60);

/// A home of one test, and the processes it started, stopped by pid when it is dropped.
struct Scene {
    dir: tempfile::TempDir,
    pids: Vec<i32>,
}

/// A `stageload run` the test started; killed and reaped on drop unless it was waited for.
struct Queued {
    child: Option<Child>,
}

impl Scene {
    fn new(name: &str) -> Scene {
        let dir = tempfile::Builder::new().prefix(&format!("stageload-queue-{name}-")).tempdir().unwrap();
        Scene { dir, pids: Vec::new() }
    }

    fn home(&self) -> PathBuf {
        self.dir.path().join("home")
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut command = Command::new(STAGELOAD);
        command
            .args(args)
            .env("STAGELOAD_HOME", self.home())
            .env_remove("STAGELOAD_WHO")
            .env_remove("STAGELOAD_OWNER")
            .current_dir(self.dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        command
    }

    /// `stageload run QUICK... FLAGS -- sh -c SCRIPT`, started.
    fn run(&self, flags: &[&str], script: &str) -> Queued {
        let mut args = vec!["run"];
        args.extend(QUICK);
        args.extend(flags);
        args.extend(["--", "sh", "-c", script]);
        Queued { child: Some(self.command(&args).spawn().unwrap()) }
    }

    /// A command of this machine's queue, run to its end.
    fn output(&self, args: &[&str]) -> Output {
        let mut queued = Queued { child: Some(self.command(args).spawn().unwrap()) };
        queued.finish()
    }

    /// The entries `stageload queue --json` lists, in its order.
    fn listing(&self) -> Vec<Value> {
        let output = self.output(&["queue", "--json"]);
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        serde_json::from_slice::<Value>(&output.stdout).unwrap().as_array().unwrap().clone()
    }

    /// The `who` and state of each listed entry.
    fn states(&self) -> Vec<(String, String)> {
        self.listing()
            .iter()
            .map(|row| (row["who"].as_str().unwrap().into(), row["state"].as_str().unwrap().into()))
            .collect()
    }

    /// Waits until `done` holds, failing after [`LIMIT`] with `what`.
    fn until(&self, what: &str, mut done: impl FnMut() -> bool) {
        let deadline = Instant::now() + LIMIT;
        while !done() {
            assert!(Instant::now() < deadline, "never: {what}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The lines the commands appended to `order`.
    fn order(&self) -> Vec<String> {
        fs::read_to_string(self.path("order")).unwrap_or_default().lines().map(String::from).collect()
    }

    /// The entry files of `lane`.
    fn entry_files(&self, lane: &str) -> Vec<String> {
        let Ok(listing) = fs::read_dir(self.home().join("queue").join(lane)) else { return Vec::new() };
        let mut names: Vec<String> = listing
            .flatten()
            .map(|d| d.file_name().to_string_lossy().into_owned())
            // Tickets only (`<joined ns>-<pid>.json`), not a writer's `.tmp-` file or owners.json.
            .filter(|n| n.ends_with(".json") && n.starts_with(|c: char| c.is_ascii_digit()))
            .collect();
        names.sort();
        names
    }

    /// A pid some command wrote to `name`, stopped when the scene ends.
    fn pid_from(&mut self, name: &str) -> i32 {
        let pid = read_pid(&self.path(name));
        self.pids.push(pid);
        pid
    }

    /// The finished runs of `history.jsonl`.
    fn history(&self) -> Vec<Value> {
        fs::read_to_string(self.home().join("history.jsonl"))
            .unwrap_or_default()
            .lines()
            .map(|line| serde_json::from_str(line).unwrap())
            .collect()
    }
}

impl Drop for Scene {
    fn drop(&mut self) {
        for pid in &self.pids {
            if running(*pid) {
                let _ = kill(Pid::from_raw(*pid), Signal::SIGKILL);
            }
        }
    }
}

impl Queued {
    fn pid(&self) -> i32 {
        self.child.as_ref().unwrap().id() as i32
    }

    /// Waits for the run's end, at most [`LIMIT`].
    fn finish(&mut self) -> Output {
        let mut child = self.child.take().unwrap();
        let deadline = Instant::now() + LIMIT;
        while child.try_wait().unwrap().is_none() {
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("still running after {LIMIT:?}: {:?}", child.wait_with_output().unwrap());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        child.wait_with_output().unwrap()
    }

    /// SIGKILL to the run itself (not its command), then reaps it.
    fn sigkill(&mut self) {
        let mut child = self.child.take().unwrap();
        kill(Pid::from_raw(child.id() as i32), Signal::SIGKILL).unwrap();
        let _ = child.wait();
    }
}

impl Drop for Queued {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// A command that appends `name start` to `order`, waits for the file `gate`, then appends
/// `name end`.
fn gated(name: &str, gate: &str) -> String {
    format!("echo '{name} start' >> order; while [ ! -e {gate} ]; do sleep 0.02; done; echo '{name} end' >> order")
}

#[test]
fn two_runs_racing_for_one_lane_start_one_at_a_time_in_the_order_they_joined() {
    let scene = Scene::new("race");
    let mut first = scene.run(&["--who", "a-1"], &gated("a", "go"));
    let mut second = scene.run(&["--who", "b-1"], &gated("b", "go"));
    scene.until("one command started and the other run waits", || {
        let states = scene.states();
        states.len() == 2 && states[0].1 == "running" && states[1].1 == "waiting" && scene.order().len() == 1
    });
    // The one that runs is the one whose entry joined first.
    let files = scene.entry_files("ram");
    let listing = scene.listing();
    let running_pid = listing[0]["pid"].as_i64().unwrap();
    assert!(files[0].ends_with(&format!("-{running_pid}.json")), "{files:?} {listing:?}");
    let (started, waiting) = if running_pid == first.pid() as i64 { ("a", "b") } else { ("b", "a") };
    assert_eq!(scene.order(), [format!("{started} start")], "the other command has not started");
    fs::write(scene.path("go"), "").unwrap();
    for run in [&mut first, &mut second] {
        let output = run.finish();
        assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    }
    let expected: Vec<String> = [started, started, waiting, waiting]
        .iter()
        .zip(["start", "end", "start", "end"])
        .map(|(n, s)| format!("{n} {s}"))
        .collect();
    assert_eq!(scene.order(), expected);
    assert!(scene.entry_files("ram").is_empty(), "both entries removed");
    assert_eq!(scene.history().len(), 2);
}

#[test]
fn lanes_do_not_wait_for_each_other() {
    let scene = Scene::new("lanes");
    let mut held = scene.run(&["--lane", "gpu"], &gated("gpu", "go"));
    scene.until("the gpu lane's command started", || scene.order().len() == 1);
    let output = scene.run(&["--lane", "ram"], "echo 'ram ran' >> order").finish();
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    assert_eq!(scene.order(), ["gpu start", "ram ran"]);
    fs::write(scene.path("go"), "").unwrap();
    assert_eq!(held.finish().status.code(), Some(0));
}

#[test]
fn a_waiting_run_killed_with_sigkill_leaves_nothing_that_holds_the_lane() {
    let scene = Scene::new("kill-waiting");
    let mut first = scene.run(&["--who", "a"], &gated("a", "go"));
    scene.until("a runs", || scene.order().len() == 1);
    let mut victim = scene.run(&["--who", "victim"], "echo 'victim ran' >> order");
    scene.until("the victim waits", || scene.states().len() == 2);
    victim.sigkill();
    let mut after = scene.run(&["--who", "c"], "echo 'c ran' >> order");
    scene.until("c waits behind a only", || {
        scene.states().iter().map(|(who, _)| who.as_str()).collect::<Vec<_>>() == ["a", "c"]
    });
    fs::write(scene.path("go"), "").unwrap();
    assert_eq!(first.finish().status.code(), Some(0));
    let output = after.finish();
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    assert_eq!(scene.order(), ["a start", "a end", "c ran"], "the killed run's command never ran");
    assert!(scene.entry_files("ram").is_empty(), "the killed run's entry was cleared");
}

#[test]
fn a_running_run_killed_with_sigkill_keeps_the_lane_taken_until_its_commands_processes_end() {
    let mut scene = Scene::new("kill-running");
    // The command leaves a process behind that holds the lane's lock (inherited) until `go`.
    let script = "sh -c 'while [ ! -e go ]; do sleep 0.02; done' & echo $! > holder; echo 'a start' >> order; wait";
    let mut first = scene.run(&["--who", "a"], script);
    let holder = scene.pid_from("holder");
    scene.until("a runs", || scene.order().len() == 1);
    first.sigkill();
    assert!(running(holder), "the process the command left is still there");
    let log = scene.path("b.log");
    let log_flag = log.to_str().unwrap();
    let gate_check = "if [ -e go ]; then echo 'b ran after go' >> order; else echo 'b ran before go' >> order; fi";
    let mut second = scene.run(&["--who", "b", "--log", log_flag], gate_check);
    scene.until("b waits for the lock the command's process holds", || {
        fs::read_to_string(&log).unwrap_or_default().contains("still held by a command whose run is gone")
    });
    assert_eq!(scene.order(), ["a start"], "b has not started");
    assert_eq!(scene.states(), [("b".to_string(), "waiting".to_string())], "a's entry was cleared");
    fs::write(scene.path("go"), "").unwrap();
    let output = second.finish();
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    assert_eq!(scene.order(), ["a start", "b ran after go"]);
}

#[test]
fn the_command_killed_with_sigkill_ends_its_run_with_137_and_frees_the_lane() {
    let mut scene = Scene::new("kill-command");
    let mut first = scene.run(&["--who", "a"], "echo $$ > command; exec sleep 60");
    let command = scene.pid_from("command");
    let mut second = scene.run(&["--who", "b"], "echo 'b ran' >> order");
    scene.until("b waits", || scene.states().len() == 2);
    kill(Pid::from_raw(command), Signal::SIGKILL).unwrap();
    let output = first.finish();
    assert_eq!(output.status.code(), Some(137), "{}", stderr(&output));
    let output = second.finish();
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    assert_eq!(scene.order(), ["b ran"]);
    let history = scene.history();
    assert_eq!(history.iter().map(|h| h["exit"].as_i64().unwrap()).collect::<Vec<_>>(), [137, 0]);
}

#[test]
fn owners_take_turns_over_a_batch_of_five() {
    let scene = Scene::new("fair");
    let mut blocker = scene.run(&["--who", "z"], &gated("z", "go"));
    scene.until("the blocker runs", || scene.order().len() == 1);
    // alice queues a batch of three, then bob two; each joins after the one before is listed.
    let mut runs = Vec::new();
    for (count, who) in ["alice-1", "alice-2", "alice-3", "bob-1", "bob-2"].into_iter().enumerate() {
        runs.push(scene.run(&["--who", who], &format!("echo {who} >> order")));
        scene.until(&format!("{who} joined"), || scene.states().len() == count + 2);
    }
    let waiting: Vec<String> = scene.states().into_iter().skip(1).map(|(who, _)| who).collect();
    assert_eq!(waiting, ["alice-1", "bob-1", "alice-2", "bob-2", "alice-3"], "the listing shows the order to come");
    fs::write(scene.path("go"), "").unwrap();
    assert_eq!(blocker.finish().status.code(), Some(0));
    for run in &mut runs {
        let output = run.finish();
        assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    }
    assert_eq!(scene.order(), ["z start", "z end", "alice-1", "bob-1", "alice-2", "bob-2", "alice-3"]);
}

/// Writes an entry file as a run of pid `pid` would, joined at `joined_ns`.
fn write_entry(scene: &Scene, lane: &str, joined_ns: u64, pid: i32, content: &str) -> PathBuf {
    let dir = scene.home().join("queue").join(lane);
    fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{joined_ns:020}-{pid}.json"));
    fs::write(&path, content).unwrap();
    path
}

fn entry_json(pid: i32, start_time: Option<u64>) -> String {
    serde_json::json!({
        "pid": pid, "start_time": start_time, "who": format!("ghost-{pid}"), "owner": "ghost", "lane": "ram",
        "cmd": "python heavy.py", "since": "2026-01-01T00:00:00Z", "state": "running",
        "started": "2026-01-01T00:00:00Z", "started_ns": 1
    })
    .to_string()
}

/// A pid that was just used and is gone now.
fn gone_pid() -> i32 {
    let mut child = Command::new("true").spawn().unwrap();
    let pid = child.id() as i32;
    child.wait().unwrap();
    pid
}

#[test]
fn a_dead_entry_and_an_entry_whose_pid_was_reused_are_cleared_and_hold_nothing() {
    let scene = Scene::new("dead");
    let dead = write_entry(&scene, "ram", 1, gone_pid(), &entry_json(0, None));
    // This test's own pid, recorded with another start time: a process that reused the pid.
    let me = std::process::id() as i32;
    let reused = write_entry(&scene, "ram", 2, me, &entry_json(me, Some(1)));
    assert_eq!(scene.states(), [], "stageload queue clears them");
    assert!(!dead.exists() && !reused.exists());
    write_entry(&scene, "ram", 1, gone_pid(), &entry_json(0, None));
    let output = scene.run(&[], "echo ran >> order").finish();
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    assert_eq!(scene.order(), ["ran"]);
    assert!(scene.entry_files("ram").is_empty());
}

#[test]
fn a_corrupt_queue_file_never_blocks_a_lane() {
    let scene = Scene::new("corrupt");
    let me = std::process::id() as i32;
    // Garbage under a live pid's name, a half-written entry of a gone run, garbage under a
    // gone pid's name, a corrupt owners.json, and a file that is no entry at all.
    let live_garbage = write_entry(&scene, "ram", 1, me, "{\"pid\": 12, \"state\": \"runn");
    let dir = scene.home().join("queue").join("ram");
    let gone = gone_pid();
    fs::write(dir.join(format!(".tmp-{:020}-{gone}.json", 2)), "{").unwrap();
    let dead_garbage = write_entry(&scene, "ram", 3, gone_pid(), "\u{0}\u{1}binary");
    fs::write(dir.join("owners.json"), "[not, json").unwrap();
    fs::write(dir.join("notes.txt"), "hello").unwrap();
    let output = scene.run(&["--who", "b"], "echo ran >> order").finish();
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    assert_eq!(scene.order(), ["ran"]);
    assert!(live_garbage.exists(), "left alone while its pid lives, and ignored");
    assert!(!dead_garbage.exists() && !dir.join(format!(".tmp-{:020}-{gone}.json", 2)).exists());
    let owners: Value = serde_json::from_str(&fs::read_to_string(dir.join("owners.json")).unwrap()).unwrap();
    assert!(owners["b"].as_u64().is_some(), "owners.json written anew: {owners}");
}

/// Whether `output` failed with exit 2 and one line on stderr containing `words`.
fn refused_in_one_line(output: &Output, words: &str) {
    let text = stderr(output);
    assert_eq!(output.status.code(), Some(2), "{text}");
    assert_eq!(text.trim_end().lines().count(), 1, "one line: {text}");
    assert!(text.contains(words), "{words:?} missing: {text}");
}

#[test]
fn bad_input_is_one_line_and_exit_2() {
    let scene = Scene::new("bad");
    for lane in ["a/b", "..", "../x", "", "a\nb"] {
        let output = scene.output(&["run", "--lane", lane, "--", "true"]);
        let name = if lane.is_empty() { "the lane name is empty".to_string() } else { format!("lane {lane:?}") };
        refused_in_one_line(&output, &name);
        refused_in_one_line(&scene.output(&["queue", "--lane", lane]), &name);
    }
    assert!(!scene.home().exists(), "nothing written for a refused lane");
    // A home that cannot be a folder: a file stands where it would go.
    fs::write(scene.path("file"), "").unwrap();
    let mut command = scene.command(&["run", "--", "true"]);
    command.env("STAGELOAD_HOME", scene.path("file").join("home"));
    let output = Queued { child: Some(command.spawn().unwrap()) }.finish();
    refused_in_one_line(&output, "set STAGELOAD_HOME to a folder you can write");
    // A history line that is not a finished run.
    let ran = scene.run(&["--who", "h"], "true").finish();
    assert_eq!(ran.status.code(), Some(0), "{}", stderr(&ran));
    let history = scene.home().join("history.jsonl");
    let mut text = fs::read_to_string(&history).unwrap();
    text += "{\"end\": oops\n";
    fs::write(&history, &text).unwrap();
    refused_in_one_line(&scene.output(&["queue", "--history", "5"]), "history.jsonl line 2 is not a finished run");
    let output = scene.output(&["queue", "--history", "0"]);
    assert_eq!(output.status.code(), Some(0), "the line is read only when shown");
    let ran = scene.run(&[], "true").finish();
    assert_eq!(ran.status.code(), Some(0), "a bad history line does not hold the lane: {}", stderr(&ran));
    // A busy.txt line that is not a regex.
    fs::write(scene.home().join("busy.txt"), "# engines\nltx(\n").unwrap();
    refused_in_one_line(&scene.output(&["run", "--", "true"]), "busy.txt line 2: bad regex 'ltx('");
}

#[test]
fn a_run_is_metered_into_a_trace_that_summary_reads_and_its_history_line_says_so() {
    let scene = Scene::new("trace");
    let trace = scene.path("run.jsonl");
    let output = scene.run(&["--who", "t-1", "--meter", trace.to_str().unwrap()], "sleep 0.6; exit 3").finish();
    assert_eq!(output.status.code(), Some(3), "{}", stderr(&output));
    let summary = scene.output(&["summary", trace.to_str().unwrap()]);
    assert!(summary.status.success(), "{}", stderr(&summary));
    let history = scene.history();
    assert_eq!(history.len(), 1);
    let line = &history[0];
    assert_eq!(
        (line["exit"].as_i64(), line["who"].as_str(), line["owner"].as_str()),
        (Some(3), Some("t-1"), Some("t"))
    );
    assert_eq!(line["trace"].as_str(), trace.to_str());
    assert!(line["peak_rss"].as_u64().is_some_and(|peak| peak > 0), "{line}");
    let header: Value = serde_json::from_str(fs::read_to_string(&trace).unwrap().lines().next().unwrap()).unwrap();
    assert_eq!(header["meta"]["lane"], "ram");
    let shown = scene.output(&["queue", "--history", "1"]);
    let text = String::from_utf8_lossy(&shown.stdout);
    assert!(text.contains("queue: empty") && text.contains("done   ram    exit 3"), "{text}");
    // --no-meter: no trace, still a history line.
    let output = scene.run(&["--no-meter"], "true").finish();
    assert_eq!(output.status.code(), Some(0));
    assert!(scene.history()[1]["trace"].is_null());
}

#[test]
fn sigterm_to_a_waiting_run_removes_its_entry_and_exits_143() {
    let scene = Scene::new("sigterm");
    let mut first = scene.run(&["--who", "a"], &gated("a", "go"));
    scene.until("a runs", || scene.order().len() == 1);
    let mut second = scene.run(&["--who", "b"], "echo 'b ran' >> order");
    scene.until("b waits", || scene.states().len() == 2);
    kill(Pid::from_raw(second.pid()), Signal::SIGTERM).unwrap();
    let output = second.finish();
    assert_eq!(output.status.code(), Some(143), "{}", stderr(&output));
    assert_eq!(scene.entry_files("ram").len(), 1, "only a's entry is left");
    fs::write(scene.path("go"), "").unwrap();
    assert_eq!(first.finish().status.code(), Some(0));
    assert_eq!(scene.order(), ["a start", "a end"]);
}

/// The command sees the lane's lock file open: it is what keeps the lane taken.
#[cfg(target_os = "linux")]
#[test]
fn the_command_holds_the_lanes_lock_file_open() {
    let scene = Scene::new("inherit");
    let script = "for fd in /proc/$$/fd/*; do readlink $fd || true; done > fds";
    let output = scene.run(&[], script).finish();
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    let fds = fs::read_to_string(scene.path("fds")).unwrap();
    let lock = scene.home().join("queue/ram/run.lock");
    assert!(fds.lines().any(|line| Path::new(line) == lock), "{fds}");
}

#[test]
fn two_runs_whose_plans_fit_together_run_side_by_side_and_a_third_waits_for_memory() {
    let scene = Scene::new("pack");
    // The memory the runs pack into, as the run reads it (the trace's header says it).
    let trace = scene.path("probe.jsonl");
    let probe = scene.run(&["--meter", trace.to_str().unwrap()], "true").finish();
    assert_eq!(probe.status.code(), Some(0), "{}", stderr(&probe));
    let header: Value = serde_json::from_str(fs::read_to_string(&trace).unwrap().lines().next().unwrap()).unwrap();
    let total = header["total_memory"].as_u64().unwrap();
    // Two fit with the margin (2 x 40 % + 10 %), three do not.
    let (request, margin) = ((total / 5 * 2).to_string(), (total / 10).to_string());
    let declared = |who: &'static str| ["--who", who, "--memory", request.as_str(), "--margin", margin.as_str()];
    let mut first = scene.run(&declared("a"), &gated("a", "go"));
    scene.until("a runs", || scene.order().len() == 1);
    let mut second = scene.run(&declared("b"), &gated("b", "go"));
    scene.until("b runs beside a", || scene.order().len() == 2);
    let mut third = scene.run(&declared("c"), &gated("c", "go"));
    scene.until("c waits for memory", || {
        let listing = scene.listing();
        listing.len() == 3 && listing[2]["waits_for"].as_str().is_some_and(|w| w.starts_with("memory: 2 running plan"))
    });
    assert_eq!(scene.order(), ["a start", "b start"], "c has not started");
    let listing = scene.listing();
    assert_eq!(listing[0]["request"].as_u64(), Some(total / 5 * 2), "{listing:?}");
    assert_eq!(
        listing.iter().map(|row| row["state"].as_str().unwrap()).collect::<Vec<_>>(),
        ["running", "running", "waiting"]
    );
    fs::write(scene.path("go"), "").unwrap();
    for run in [&mut first, &mut second, &mut third] {
        let output = run.finish();
        assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    }
    let order = scene.order();
    let first_end = order.iter().position(|line| line.ends_with(" end")).unwrap();
    let c_start = order.iter().position(|line| line == "c start").unwrap();
    assert!(c_start > first_end, "c started only once a or b had ended: {order:?}");
}

#[test]
fn a_run_that_declares_nothing_does_not_start_beside_declared_ones() {
    let scene = Scene::new("pack-alone");
    let mut first = scene.run(&["--who", "a", "--memory", "64M"], &gated("a", "go"));
    scene.until("a runs", || scene.order().len() == 1);
    let mut second = scene.run(&["--who", "b"], &gated("b", "go"));
    scene.until("b waits", || scene.states().len() == 2);
    let mut third = scene.run(&["--who", "c", "--memory", "64M"], &gated("c", "go"));
    scene.until("c waits behind b", || scene.states().len() == 3);
    assert_eq!(scene.order(), ["a start"], "neither b nor c started beside a");
    fs::write(scene.path("go"), "").unwrap();
    for run in [&mut first, &mut second, &mut third] {
        assert_eq!(run.finish().status.code(), Some(0));
    }
    assert_eq!(scene.order(), ["a start", "a end", "b start", "b end", "c start", "c end"]);
}

#[test]
fn declared_runs_pack_beside_each_other_whatever_busy_txt_names() {
    let scene = Scene::new("pack-busy");
    fs::create_dir_all(scene.home()).unwrap();
    // An engine pattern that names the first run's own command: a declared run is held to its
    // plan, not to the busy patterns (as guard --plan skips --busy).
    fs::write(scene.home().join("busy.txt"), "a start\n").unwrap();
    let mut first = scene.run(&["--who", "a", "--memory", "64M"], &gated("a", "go"));
    scene.until("a runs", || scene.order().len() == 1);
    let mut second = scene.run(&["--who", "b", "--memory", "64M"], &gated("b", "go"));
    scene.until("b runs beside a", || scene.order().len() == 2);
    fs::write(scene.path("go"), "").unwrap();
    for run in [&mut first, &mut second] {
        assert_eq!(run.finish().status.code(), Some(0));
    }
}

/// A pipeline of two 1 MiB f32 models used in turn, written into the scene's folder.
fn pipeline(scene: &Scene) -> PathBuf {
    let data = vec![0u8; 1 << 20];
    for model in ["encoder", "decoder"] {
        let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![512, 512], &data).unwrap();
        safetensors::serialize_to_file([("w", view)], None, &scene.path(&format!("{model}.safetensors"))).unwrap();
    }
    let path = scene.path("pipeline.toml");
    fs::write(
        &path,
        "[[models]]\nname = \"encoder\"\nfiles = [\"encoder.safetensors\"]\n\n\
         [[models]]\nname = \"decoder\"\nfiles = [\"decoder.safetensors\"]\n\n\
         [[stages]]\nname = \"encode\"\nmodels = [\"encoder\"]\n\n\
         [[stages]]\nname = \"decode\"\nmodels = [\"decoder\"]\n",
    )
    .unwrap();
    path
}

#[test]
fn runs_declared_by_their_plans_run_side_by_side_each_held_to_its_plan() {
    let scene = Scene::new("plan");
    let file = pipeline(&scene);
    let file = file.to_str().unwrap();
    // The plan's request, as `stageload plan --request json` says it.
    let planned = scene.output(&["plan", file, "--request", "json"]);
    assert!(planned.status.success(), "{}", stderr(&planned));
    let request: Value = serde_json::from_slice(&planned.stdout).unwrap();
    let memory = request["memory"].as_u64().unwrap_or_else(|| panic!("{request}"));
    let plan_flags = |who: &'static str| ["--who", who, "--plan", file];
    // --plan skips --wait-free and --kill-free, as guard --plan does; QUICK's are refused with it.
    let mut first = scene.command(
        &[
            &["run", "--poll", "20ms", "--start-timeout", "60s"][..],
            &plan_flags("a"),
            &["--", "sh", "-c", &gated("a", "go")],
        ]
        .concat(),
    );
    let mut first = Queued { child: Some(first.spawn().unwrap()) };
    scene.until("a runs", || scene.order().len() == 1);
    let mut second = scene.command(
        &[
            &["run", "--poll", "20ms", "--start-timeout", "60s"][..],
            &plan_flags("b"),
            &["--", "sh", "-c", &gated("b", "go")],
        ]
        .concat(),
    );
    let mut second = Queued { child: Some(second.spawn().unwrap()) };
    scene.until("b runs beside a", || scene.order().len() == 2);
    let listing = scene.listing();
    assert_eq!(listing.iter().map(|row| row["request"].as_u64()).collect::<Vec<_>>(), [Some(memory), Some(memory)]);
    fs::write(scene.path("go"), "").unwrap();
    for run in [&mut first, &mut second] {
        let output = run.finish();
        assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
        assert!(stderr(&output).contains("held to plan"), "{}", stderr(&output));
    }
    // The run's own trace is read by `plan --from-trace`: it has no stage window to measure, so
    // the plan keeps the file's working memory.
    let traces: Vec<PathBuf> = fs::read_dir(scene.home().join("traces")).unwrap().flatten().map(|d| d.path()).collect();
    assert_eq!(traces.len(), 2, "{traces:?}");
    let output = scene.output(&["plan", file, "--from-trace", traces[0].to_str().unwrap()]);
    assert!(output.status.success(), "{}", stderr(&output));
    // A file that does not load is refused before joining.
    let output = scene.output(&["run", "--plan", "missing.toml", "--", "true"]);
    refused_in_one_line(&output, "missing.toml");
}

/// A pipeline in the scene's folder whose `denoise` stage runs on CUDA: 1 MiB of weights and
/// 16 MiB of device working memory, a device limit of 17 MiB.
fn cuda_pipeline(scene: &Scene) -> PathBuf {
    let data = vec![0u8; 1 << 20];
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![512, 512], &data).unwrap();
    safetensors::serialize_to_file([("w", view)], None, &scene.path("denoiser.safetensors")).unwrap();
    let path = scene.path("cuda.toml");
    fs::write(
        &path,
        "device_memory = \"1G\"\n\n[[models]]\nname = \"denoiser\"\nfiles = [\"denoiser.safetensors\"]\n\
         device = \"cuda\"\n\n[[stages]]\nname = \"denoise\"\nmodels = [\"denoiser\"]\nworking = \"64M\"\n\
         device_working = \"16M\"\n",
    )
    .unwrap();
    path
}

#[test]
fn a_run_held_to_its_plan_reads_the_commands_trace_and_is_stopped_over_its_device_limit() {
    let scene = Scene::new("device");
    let file = cuda_pipeline(&scene);
    let (trace, log) = (scene.path("command.jsonl"), scene.path("run-log.jsonl"));
    let header = "{\"type\":\"header\",\"schema\":2,\"utc\":\"x\",\"pid\":1,\"host\":\"h\",\"os\":\"linux\",\
                  \"total_memory\":1,\"device\":\"cuda:0\",\"command\":[],\"interval\":0.25,\"meta\":{}}";
    let stage = "{\"type\":\"event\",\"t\":0.0,\"kind\":\"stage\",\"stage\":\"denoise\",\"resident\":0}";
    let over = format!("{{\"type\":\"sample\",\"t\":0.5,\"rss\":1,\"device_allocated\":{}}}", 100u64 << 20);
    // The command writes its trace: the stage, then device memory over the plan; then waits.
    let script = format!("printf '%s\\n' '{header}' '{stage}' '{over}' > command.jsonl; exec sleep 60");
    let flags = ["--plan", file.to_str().unwrap(), "--trace", trace.to_str().unwrap(), "--log", log.to_str().unwrap()];
    let mut args = vec!["run", "--poll", "20ms", "--start-timeout", "60s", "--grace", "1s"];
    args.extend(flags);
    args.extend(["--", "sh", "-c", &script]);
    let output = Queued { child: Some(scene.command(&args).spawn().unwrap()) }.finish();
    let text = stderr(&output);
    assert_eq!(output.status.code(), Some(3), "{text}");
    assert!(text.contains("command's device memory 100.0 MiB > the plan's device memory limit 17.0 MiB"), "{text}");
    let records: Vec<Value> =
        fs::read_to_string(&log).unwrap().lines().map(|line| serde_json::from_str(line).unwrap()).collect();
    let record = records.iter().find(|r| r["event"] == "over_plan").unwrap_or_else(|| panic!("{records:?}"));
    assert_eq!((&record["detail"]["memory"], &record["detail"]["stage"]), (&"device".into(), &"denoise".into()));
    assert_eq!(scene.history()[0]["exit"], 3);
    assert!(
        scene.history()[0]["stopped"].as_str().is_some_and(|s| s.contains("device memory")),
        "{:?}",
        scene.history()
    );
    // --trace is the command's own trace: alone it is refused, naming --meter.
    refused_in_one_line(&scene.output(&["run", "--trace", "x.jsonl", "--", "true"]), "--meter FILE");
}
