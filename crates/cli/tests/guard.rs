//! `stageload guard` as users run it: the real binary, real readings, real signals. Each run has
//! a hard deadline and the commands it starts are bounded (`sleep 60` at most, stopped early).

use std::process::{Child, Command, Output, Stdio};
use std::sync::Once;
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, SigHandler, Signal};
use nix::unistd::Pid;

use stageload_test_support::pids::{read_pid, running};

const STAGELOAD: &str = env!("CARGO_BIN_EXE_stageload");

/// Flags that make admission and the watch ignore how busy this shared machine is.
const ANY_MACHINE: [&str; 4] = ["--wait-free", "0", "--kill-free", "0"];

/// The tests send SIGINT and SIGHUP and type Ctrl-C. A test run started in the background of a
/// non-interactive shell inherits SIGINT ignored, one started under `nohup` SIGHUP, which the
/// guard rightly keeps ignoring (see `a_signal_ignored_when_the_guard_started_stays_ignored`)
/// and its command inherits; such a run gets the default dispositions back first.
fn default_signals() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        for signal in [Signal::SIGINT, Signal::SIGHUP] {
            // SAFETY: sets the disposition to the default; no handler of this process is involved.
            unsafe { nix::sys::signal::signal(signal, SigHandler::SigDfl) }.expect("reset a signal to its default");
        }
    });
}

fn guard(args: &[&str]) -> Command {
    default_signals();
    let mut command = Command::new(STAGELOAD);
    command.arg("guard").args(args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    command
}

/// Waits for `child` at most `deadline`, killing it if it is late.
fn finish(mut child: Child, deadline: Duration) -> Output {
    let until = Instant::now() + deadline;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > until {
            let _ = child.kill();
            panic!("guard still running after {deadline:?}: {:?}", child.wait_with_output().unwrap());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    child.wait_with_output().unwrap()
}

fn run(args: &[&str]) -> Output {
    finish(guard(args).spawn().unwrap(), Duration::from_secs(30))
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// A folder for one test, removed with its contents when dropped.
fn scratch(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new().prefix(&format!("stageload-cli-guard-{name}-")).tempdir().unwrap()
}

/// Whether `pid` still runs (zombies and vanished pids count as gone), waiting up to 5 s for it to go.
fn gone_soon(pid: i32) -> bool {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if !running(pid) {
            return true;
        }
        if Instant::now() > deadline {
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn guard_needs_a_command() {
    for args in [&["--"][..], &[][..]] {
        let output = run(args);
        assert_eq!(output.status.code(), Some(2));
        assert!(stderr(&output).contains("needs a command"), "{}", stderr(&output));
    }
}

#[test]
fn bad_flags_are_refused_before_any_waiting_naming_the_flag() {
    let cases = [
        (["--wait-free", "140"], "--wait-free", "out of range"),
        (["--kill-free", "ten"], "--kill-free", "whole percent"),
        (["--poll", "0s"], "--poll", "0s is outside 10ms ..= 1m"),
        (["--poll", "1ms"], "--poll", "1ms is outside 10ms ..= 1m"),
        (["--poll", "99999999999h"], "--poll", "is outside 10ms ..= 1m"),
        (["--grace", "1000000000s"], "--grace", "is outside 0s ..= 1h"),
        (["--quiet-for", "400000h"], "--quiet-for", "is outside 0s ..= 1day"),
        (["--start-timeout", "8000h"], "--start-timeout", "is outside 0s ..= 7days"),
        (["--busy", "ltx("], "--busy", "bad regex"),
        (["--swap-budget", "lots"], "--swap-budget", "not a size"),
        (["--max-memory", "1.5X"], "--max-memory", "not a size"),
        (["--start-timeout", "soon"], "--start-timeout", "not a duration"),
    ];
    for (flags, flag, message) in cases {
        let started = Instant::now();
        let output = run(&[flags[0], flags[1], "--", "true"]);
        let text = stderr(&output);
        assert_eq!(output.status.code(), Some(2), "{flags:?}: {text}");
        assert!(text.contains(flag) && text.contains(message), "{flags:?}: {text}");
        assert!(started.elapsed() < Duration::from_secs(5));
    }
    let output = run(&["--no-such-flag", "--", "true"]);
    assert_eq!(output.status.code(), Some(2));
}

#[test]
fn flags_that_contradict_each_other_are_refused_at_start_not_waited_out() {
    let cases: [(&[&str], &str); 3] = [
        (&["--swap-limit", "2G"], "--swap-budget 8.0 GB is over --swap-limit 2.0 GB"),
        (&["--kill-free", "50", "--wait-free", "40"], "--kill-free 50 must be under --wait-free 40"),
        (&["--kill-free", "40", "--wait-free", "40"], "--kill-free 40 must be under --wait-free 40"),
    ];
    for (flags, message) in cases {
        let started = Instant::now();
        let mut args = flags.to_vec();
        args.extend(["--start-timeout", "1m", "--", "true"]);
        let output = run(&args);
        assert_eq!(output.status.code(), Some(2), "{flags:?}: {}", stderr(&output));
        assert!(stderr(&output).contains(message), "{flags:?}: {}", stderr(&output));
        assert!(started.elapsed() < Duration::from_secs(5), "refused at once");
    }
    let mut args = ANY_MACHINE.to_vec();
    args.extend(["--swap-limit", "2G", "--swap-budget", "1G", "--", "true"]);
    assert_eq!(run(&args).status.code(), Some(0), "a budget under the limit is fine");
}

#[test]
fn a_log_that_cannot_be_written_is_said_once_and_the_command_still_runs() {
    let mut args = ANY_MACHINE.to_vec();
    args.extend(["--log", "/dev/full", "--", "sh", "-c", "exit 6"]);
    let output = run(&args);
    let text = stderr(&output);
    assert_eq!(output.status.code(), Some(6), "{text}");
    let said = text.matches("cannot write --log /dev/full: No space left on device").count();
    assert_eq!(said, 1, "{text}");
}

#[test]
fn help_documents_the_exit_codes() {
    let output = Command::new(STAGELOAD).args(["guard", "--help"]).output().unwrap();
    let text = String::from_utf8_lossy(&output.stdout);
    for code in ["128+N", "  3 ", "  4 ", "126", "127", "  2 "] {
        assert!(text.contains(code), "{code} missing from:\n{text}");
    }
}

#[test]
fn exit_codes_pass_through_and_start_failures_are_named() {
    let with = |command: &[&str]| {
        let mut args = ANY_MACHINE.to_vec();
        args.push("--");
        args.extend_from_slice(command);
        run(&args)
    };
    assert_eq!(with(&["sh", "-c", "exit 7"]).status.code(), Some(7));
    assert_eq!(with(&["sh", "-c", "kill -TERM $$; sleep 5"]).status.code(), Some(143));
    let output = with(&["/no/such/program"]);
    assert_eq!(output.status.code(), Some(127));
    assert!(stderr(&output).contains("cannot start '/no/such/program'"), "{}", stderr(&output));
    let folder = scratch("not-executable");
    let dir = folder.path();
    let script = dir.join("script.sh");
    std::fs::write(&script, "#!/bin/sh\nexit 0\n").unwrap();
    assert_eq!(with(&[script.to_str().unwrap()]).status.code(), Some(126));
}

#[test]
fn no_room_exits_4_after_the_start_timeout_and_check_says_why() {
    // 100 % available never happens on a running machine.
    let output = run(&["--wait-free", "100", "--start-timeout", "300ms", "--poll", "50ms", "--", "true"]);
    assert_eq!(output.status.code(), Some(4));
    assert!(stderr(&output).contains("no room after") && stderr(&output).contains("< 100%"), "{}", stderr(&output));

    let output = run(&["--wait-free", "100", "--check"]);
    assert_eq!(output.status.code(), Some(4));
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(text.contains("would wait: memory available") && text.contains("memory:"), "{text}");
    let output = run(&["--wait-free", "0", "--kill-free", "0", "--check", "--", "true"]);
    assert_eq!(output.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&output.stdout).contains("would start now"));
}

#[test]
fn sigterm_to_the_guard_stops_its_command_first_and_exits_143() {
    let folder = scratch("sigterm");
    let dir = folder.path();
    let pid_file = dir.join("pid");
    let script = format!("echo $$ > {}; exec sleep 60", pid_file.display());
    let child = guard(&[&ANY_MACHINE[..], &["--", "sh", "-c", &script]].concat()).spawn().unwrap();
    let guard_pid = child.id() as i32;
    let command = read_pid(&pid_file);
    kill(Pid::from_raw(guard_pid), Signal::SIGTERM).unwrap();
    let output = finish(child, Duration::from_secs(15));
    assert_eq!(output.status.code(), Some(143), "{}", stderr(&output));
    assert!(stderr(&output).contains("got SIGTERM, stopping pid"), "{}", stderr(&output));
    assert!(gone_soon(command), "the command {command} is gone");
}

#[test]
fn a_signal_while_waiting_exits_without_starting() {
    let folder = scratch("sighup-waiting");
    let dir = folder.path();
    let marker = dir.join("started");
    let child = guard(&["--wait-free", "100", "--", "touch", marker.to_str().unwrap()]).spawn().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    kill(Pid::from_raw(child.id() as i32), Signal::SIGHUP).unwrap();
    let output = finish(child, Duration::from_secs(10));
    assert_eq!(output.status.code(), Some(129), "{}", stderr(&output));
    assert!(stderr(&output).contains("got SIGHUP before starting the command"));
    assert!(!marker.exists());
}

#[test]
fn a_guard_killed_with_sigkill_does_not_leave_its_command_running() {
    let folder = scratch("sigkill");
    let dir = folder.path();
    let pid_file = dir.join("pid");
    let script = format!("echo $$ > {}; exec sleep 60", pid_file.display());
    let child = guard(&[&ANY_MACHINE[..], &["--", "sh", "-c", &script]].concat()).spawn().unwrap();
    let command = read_pid(&pid_file);
    kill(Pid::from_raw(child.id() as i32), Signal::SIGKILL).unwrap();
    let output = finish(child, Duration::from_secs(10));
    assert_eq!(output.status.code(), None, "killed");
    assert!(gone_soon(command), "the command {command} died with its guard");
}

#[test]
fn max_memory_stops_an_allocating_command_and_the_log_has_the_readings() {
    let folder = scratch("max-memory");
    let dir = folder.path();
    let log = dir.join("guard.jsonl");
    // 32 MiB more every 50 ms, 512 MiB at most.
    let program = "import time\nblocks = []\nfor _ in range(16):\n    blocks.append(b'x' * (32 << 20))\n    time.sleep(0.05)\ntime.sleep(30)\n";
    let args = [
        &ANY_MACHINE[..],
        &["--max-memory", "128M", "--grace", "1s", "--log", log.to_str().unwrap(), "--", "python3", "-c", program],
    ]
    .concat();
    let output = finish(guard(&args).spawn().unwrap(), Duration::from_secs(30));
    assert_eq!(output.status.code(), Some(3), "{}", stderr(&output));
    assert!(stderr(&output).contains("> --max-memory 128.0 MiB"), "{}", stderr(&output));
    let records: Vec<serde_json::Value> =
        std::fs::read_to_string(&log).unwrap().lines().map(|line| serde_json::from_str(line).unwrap()).collect();
    let events: Vec<&str> = records.iter().map(|r| r["event"].as_str().unwrap()).collect();
    assert_eq!(events, ["start", "started", "stop"], "{records:?}");
    let stop = &records[2];
    let used = stop["detail"]["command_memory"].as_u64().unwrap();
    // Stopped on the way up: over the limit (what a stop means), and short of the 16 blocks
    // alone, which the whole program (its interpreter's own memory on top) would pass.
    assert!(used > 128 << 20 && used < 16 * (32 << 20), "{stop}");
    assert!(stop["memory"]["available"].as_u64().unwrap() > 0, "{stop}");
}

#[test]
fn a_second_signal_skips_the_grace() {
    let folder = scratch("double-signal");
    let dir = folder.path();
    let pid_file = dir.join("pid");
    let script = format!("trap '' TERM; echo $$ > {}; sleep 60", pid_file.display());
    let args = [&ANY_MACHINE[..], &["--grace", "30s", "--", "sh", "-c", &script]].concat();
    let child = guard(&args).spawn().unwrap();
    let guard_pid = Pid::from_raw(child.id() as i32);
    let command = read_pid(&pid_file);
    let started = Instant::now();
    kill(guard_pid, Signal::SIGINT).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    kill(guard_pid, Signal::SIGINT).unwrap();
    let output = finish(child, Duration::from_secs(20));
    assert_eq!(output.status.code(), Some(130), "{}", stderr(&output));
    assert!(started.elapsed() < Duration::from_secs(10), "the 30 s grace was cut short: {:?}", started.elapsed());
    assert!(gone_soon(command));
}

#[test]
fn a_signal_ignored_when_the_guard_started_stays_ignored() {
    let folder = scratch("ignored-signal");
    let pid_file = folder.path().join("pid");
    // As under `nohup` or in a shell's background: SIGINT ignored before the guard starts.
    let script = format!(
        "trap '' INT; exec {STAGELOAD} guard {} -- sh -c 'echo $$ > {}; sleep 60'",
        ANY_MACHINE.join(" "),
        pid_file.display()
    );
    let mut child =
        Command::new("sh").args(["-c", &script]).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let guard_pid = Pid::from_raw(child.id() as i32);
    let command = read_pid(&pid_file);
    kill(guard_pid, Signal::SIGINT).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    assert!(child.try_wait().unwrap().is_none(), "the guard kept running");
    assert_eq!(kill(Pid::from_raw(command), None), Ok(()), "and so did its command");
    kill(guard_pid, Signal::SIGTERM).unwrap();
    let output = finish(child, Duration::from_secs(20));
    assert_eq!(output.status.code(), Some(143), "{}", stderr(&output));
    assert!(gone_soon(command));
}

/// Runs the guard on a pseudo-terminal (Python's pty module), types `keys` into it once the
/// command runs, and returns what the terminal showed and the guard's exit code.
fn on_a_terminal(command: &str, keys: &str) -> (String, i32) {
    default_signals();
    let driver = r#"
import os, pty, sys, time, select
pid, fd = pty.fork()
if pid == 0:
    os.execv(sys.argv[1], [sys.argv[1], "guard", "--wait-free", "0", "--kill-free", "0", "--", "sh", "-c", sys.argv[2]])
out = b""
deadline = time.monotonic() + 10
def pump(until):
    global out
    while time.monotonic() < until:
        ready, _, _ = select.select([fd], [], [], 0.05)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                return
            if not chunk:
                return
            out += chunk
pump(time.monotonic() + 1.0)
os.write(fd, sys.argv[3].encode())
pump(deadline)
done, status = os.waitpid(pid, os.WNOHANG)
if done == 0:
    os.killpg(pid, 9)  # the guard is its session's leader: its whole group goes
    _, status = os.waitpid(pid, 0)
sys.stdout.write(out.decode(errors="replace"))
sys.stdout.write("\nEXIT %d\n" % os.waitstatus_to_exitcode(status))
"#;
    let output =
        Command::new("python3").args(["-c", driver, STAGELOAD, command, keys]).stdin(Stdio::null()).output().unwrap();
    let text = String::from_utf8_lossy(&output.stdout).into_owned();
    let code = text.rsplit_once("EXIT ").and_then(|(_, code)| code.trim().parse().ok()).unwrap_or(-1);
    (text, code)
}

#[test]
fn at_a_terminal_the_command_reads_it_and_gets_ctrl_c() {
    // Without the terminal handed to the command's group, `read` would stop on SIGTTIN and hang.
    let (text, code) = on_a_terminal("read line; echo got:$line", "hello\n");
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("got:hello"), "{text}");
    // Ctrl-C reaches the command (its shell dies of SIGINT), the guard passes 130 on.
    let (text, code) = on_a_terminal("sleep 30", "\x03");
    assert_eq!(code, 130, "{text}");
    assert!(text.contains("guard: exit 130"), "{text}");
}

const MIB: u64 = 1 << 20;

/// A pipeline file in `dir`: `encoder` (1 MiB, on the host) for stage `encode`, then `denoiser`
/// (1 MiB, on `denoiser_device`) for stage `denoise`; each stage has 64 MiB of host working
/// memory, so the plan's limit is 65 MiB: above an interpreter's own memory, under what the
/// tests' commands allocate. `extra`: more top-level lines and the denoise stage's own.
fn plan_file(dir: &std::path::Path, denoiser_device: &str, extra: &str, denoise_extra: &str) -> std::path::PathBuf {
    use safetensors::tensor::TensorView;
    let data = vec![0u8; MIB as usize];
    for model in ["encoder", "denoiser"] {
        let view = TensorView::new(safetensors::Dtype::F32, vec![512, 512], &data).unwrap();
        safetensors::serialize_to_file([("w", view)], None, &dir.join(format!("{model}.safetensors"))).unwrap();
    }
    let path = dir.join("pipeline.toml");
    std::fs::write(
        &path,
        format!(
            "{extra}\n[[models]]\nname = \"encoder\"\nfiles = [\"encoder.safetensors\"]\n\n\
             [[models]]\nname = \"denoiser\"\nfiles = [\"denoiser.safetensors\"]\ndevice = \"{denoiser_device}\"\n\n\
             [[stages]]\nname = \"encode\"\nmodels = [\"encoder\"]\nworking = \"64M\"\n\n\
             [[stages]]\nname = \"denoise\"\nmodels = [\"denoiser\"]\nworking = \"64M\"\n{denoise_extra}\n"
        ),
    )
    .unwrap();
    path
}

/// Trace lines as a stageload run writes them: a header, then `lines`.
fn trace_lines(lines: &[&str]) -> String {
    let header = "{\"type\":\"header\",\"schema\":2,\"utc\":\"x\",\"pid\":1,\"host\":\"h\",\"os\":\"linux\",\
                  \"total_memory\":1,\"device\":\"cpu\",\"command\":[],\"interval\":0.25,\"meta\":{}}";
    let mut text = format!("{header}\n");
    for line in lines {
        text += line;
        text += "\n";
    }
    text
}

fn stage_event(t: f64, stage: &str) -> String {
    format!("{{\"type\":\"event\",\"t\":{t},\"kind\":\"stage\",\"stage\":\"{stage}\",\"resident\":0}}")
}

/// `guard --plan PLAN [--trace TRACE] --grace 1s --log LOG -- python3 -c PROGRAM ARGS...`: a
/// Python program held to a plan.
fn held_python(
    plan: &std::path::Path,
    trace: Option<&std::path::Path>,
    log: &std::path::Path,
    program: &str,
    program_args: &[&str],
) -> Output {
    let mut args = vec!["--plan", plan.to_str().unwrap()];
    if let Some(trace) = trace {
        args.extend(["--trace", trace.to_str().unwrap()]);
    }
    args.extend(["--grace", "1s", "--log", log.to_str().unwrap(), "--", "python3", "-c", program]);
    args.extend(program_args);
    run(&args)
}

fn log_records(path: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path).unwrap().lines().map(|line| serde_json::from_str(line).unwrap()).collect()
}

#[test]
fn a_run_over_its_plan_is_stopped_and_the_log_says_by_how_much_in_which_stage() {
    let folder = scratch("over-plan");
    let dir = folder.path();
    let pipeline = plan_file(dir, "cpu", "", "");
    let (log, trace) = (dir.join("guard.jsonl"), dir.join("run.jsonl"));
    // The command writes its trace (encode, then denoise, then a half-written last line, as a
    // run killed mid-write leaves it), then holds 256 MiB: over the plan's 65 MiB.
    let sample = format!("{{\"type\":\"sample\",\"t\":0.6,\"rss\":1,\"rss_file\":{}}}", 3 * MIB);
    let text = trace_lines(&[&stage_event(0.0, "encode"), &stage_event(0.5, "denoise"), &sample])
        + "{\"type\":\"sample\",\"t\":0.7,\"rs";
    let program =
        "import sys, time\nopen(sys.argv[1], 'w').write(sys.argv[2])\nheld = b'x' * (256 << 20)\ntime.sleep(30)\n";
    let output = held_python(&pipeline, Some(&trace), &log, program, &[trace.to_str().unwrap(), &text]);
    let text = stderr(&output);
    assert_eq!(output.status.code(), Some(3), "{text}");
    assert!(
        text.contains(&format!("held to plan {}: at most 65.0 MiB (the need of stage '", pipeline.display())),
        "{text}"
    );
    assert!(!text.contains("available twice"), "no low-memory rule under a plan: {text}");
    assert!(text.contains("> the plan's memory limit 65.0 MiB"), "{text}");
    let records = log_records(&log);
    let events: Vec<&str> = records.iter().map(|r| r["event"].as_str().unwrap()).collect();
    assert_eq!(events.first(), Some(&"start"), "admitted at once: {events:?}");
    assert_eq!(records[0]["detail"]["max_memory"], 65 * MIB);
    let over = records.iter().find(|r| r["event"] == "over_plan").unwrap_or_else(|| panic!("{records:?}"));
    let detail = &over["detail"];
    assert_eq!(detail["stage"], "denoise", "{over}");
    assert_eq!(detail["memory"], "host", "{over}");
    assert_eq!(detail["limit"], 65 * MIB, "{over}");
    assert_eq!(detail["stage_need"], 65 * MIB, "{over}");
    let (used, by) = (detail["used"].as_u64().unwrap(), detail["over"].as_u64().unwrap());
    assert!(used > 65 * MIB && by == used - 65 * MIB, "{over}");
    let message = over["message"].as_str().unwrap();
    assert!(message.starts_with("over its plan by ") && message.contains("in stage 'denoise'"), "{message}");
    // What the guard leaves out and the plan counts, with the figure.
    assert_eq!(detail["file_pages"], 3 * MIB, "{over}");
    assert!(
        message.ends_with(
            "the guard counts memory less file pages, the plan's numbers include them (3.0 MiB at the last sample)"
        ),
        "{message}"
    );
}

#[test]
fn without_a_trace_a_run_over_its_plan_is_in_an_unknown_stage() {
    let folder = scratch("over-plan-no-trace");
    let dir = folder.path();
    let pipeline = plan_file(dir, "cpu", "", "");
    let log = dir.join("guard.jsonl");
    let program = "import time\nheld = b'x' * (256 << 20)\ntime.sleep(30)\n";
    let output = held_python(&pipeline, None, &log, program, &[]);
    assert_eq!(output.status.code(), Some(3), "{}", stderr(&output));
    let records = log_records(&log);
    let over = records.iter().find(|r| r["event"] == "over_plan").unwrap_or_else(|| panic!("{records:?}"));
    assert_eq!(over["detail"]["stage"], serde_json::Value::Null, "{over}");
    assert!(over["message"].as_str().unwrap().contains("unknown stage (no --trace: give --trace FILE"), "{over}");
}

/// A trace's lines for the `denoise` stage within 10 MiB of device memory, and the line that
/// takes it to 100 MiB.
fn device_trace_over() -> (String, String) {
    let sample =
        |t: f64, mib: u64| format!("{{\"type\":\"sample\",\"t\":{t},\"rss\":1,\"device_allocated\":{}}}", mib * MIB);
    (trace_lines(&[&stage_event(0.0, "denoise"), &sample(0.1, 10)]), sample(0.5, 100) + "\n")
}

/// A Python program that writes its second argument to the file of its first, half a second
/// later its third, then sleeps.
const WRITE_THEN_GO_OVER: &str = "import sys, time\nf = open(sys.argv[1], 'w')\nf.write(sys.argv[2]); f.flush()\n\
                                  time.sleep(0.5)\nf.write(sys.argv[3]); f.flush()\ntime.sleep(30)\n";

#[test]
fn device_memory_over_the_plan_read_from_the_trace_stops_the_run() {
    let folder = scratch("over-plan-device");
    let dir = folder.path();
    // The denoiser on CUDA: 1 MiB of weights and 16 MiB of device working memory, a 17 MiB limit.
    let pipeline = plan_file(dir, "cuda", "device_memory = \"1G\"", "device_working = \"16M\"");
    let (log, trace) = (dir.join("guard.jsonl"), dir.join("run.jsonl"));
    let (within, over) = device_trace_over();
    // Within the plan for a few polls, then over it; its host memory stays within.
    let program = WRITE_THEN_GO_OVER;
    let started = Instant::now();
    let output = held_python(&pipeline, Some(&trace), &log, program, &[trace.to_str().unwrap(), &within, &over]);
    let text = stderr(&output);
    assert_eq!(output.status.code(), Some(3), "{text}");
    assert!(started.elapsed() >= Duration::from_millis(500), "not stopped before it went over");
    assert!(text.contains("device memory at most 17.0 MiB (read from the trace)"), "{text}");
    assert!(text.contains("command's device memory 100.0 MiB > the plan's device memory limit 17.0 MiB"), "{text}");
    let records = log_records(&log);
    let over = records.iter().find(|r| r["event"] == "over_plan").unwrap_or_else(|| panic!("{records:?}"));
    let detail = &over["detail"];
    assert_eq!((&detail["memory"], &detail["stage"]), (&"device".into(), &"denoise".into()), "{over}");
    assert_eq!((detail["used"].as_u64(), detail["over"].as_u64()), (Some(100 * MIB), Some(83 * MIB)), "{over}");
    assert_eq!(detail["stage_need"], 17 * MIB, "{over}");
}

#[test]
fn under_a_plan_a_run_within_it_starts_at_once_and_desktop_rules_cannot_be_given() {
    let folder = scratch("within-plan");
    let dir = folder.path();
    let pipeline = plan_file(dir, "cpu", "", "");
    let file = pipeline.to_str().unwrap();
    let output = run(&["--plan", file, "--", "sh", "-c", "exit 0"]);
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    for (flag, value) in
        [("--wait-free", "10"), ("--kill-free", "5"), ("--max-memory", "1G"), ("--busy", "x"), ("--quiet-for", "1s")]
    {
        let output = run(&["--plan", file, flag, value, "--", "true"]);
        let text = stderr(&output);
        assert_eq!(output.status.code(), Some(2), "{flag}: {text}");
        assert!(text.contains("'--plan <FILE>' cannot be used with") && text.contains(flag), "{flag}: {text}");
    }
    // One look: it would start (admission rules are skipped), with the plan's limits.
    let output = run(&["--plan", file, "--check"]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(0), "{stdout}{}", stderr(&output));
    assert!(
        stdout.contains("held to plan") && stdout.contains("at most 65.0 MiB") && stdout.contains("would start now"),
        "{stdout}"
    );
    // Eager: both models' weights with the larger working memory.
    let output = run(&["--plan", file, "--eager", "--check"]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("at most 66.0 MiB") && stdout.contains("eager: every model loaded up front"), "{stdout}");
}

#[test]
fn eager_needs_a_plan_and_trace_a_plan_or_a_device_limit() {
    let output = run(&["--eager", "--", "true"]);
    let text = stderr(&output);
    assert_eq!(output.status.code(), Some(2), "{text}");
    assert!(text.contains("required arguments were not provided") && text.contains("--plan <FILE>"), "{text}");
    let output = run(&["--trace", "run.jsonl", "--", "true"]);
    let text = stderr(&output);
    assert_eq!(output.status.code(), Some(2), "{text}");
    assert!(text.contains("--trace is read for --plan or --max-device-memory"), "{text}");
    // The device limit is read from the trace, so it needs one; a plan sets its own.
    let output = run(&["--max-device-memory", "1G", "--", "true"]);
    let text = stderr(&output);
    assert_eq!(output.status.code(), Some(2), "{text}");
    assert!(text.contains("required arguments were not provided") && text.contains("--trace <FILE>"), "{text}");
    let output = run(&["--max-device-memory", "1X", "--trace", "t.jsonl", "--", "true"]);
    assert!(
        stderr(&output).contains("--max-device-memory") && stderr(&output).contains("not a size"),
        "{}",
        stderr(&output)
    );
}

#[test]
fn max_device_memory_stops_a_run_whose_trace_passes_it_and_names_the_flag() {
    let folder = scratch("max-device-memory");
    let dir = folder.path();
    let (log, trace) = (dir.join("guard.jsonl"), dir.join("run.jsonl"));
    let (within, over) = device_trace_over();
    let program = WRITE_THEN_GO_OVER;
    let trace_arg = trace.to_str().unwrap();
    let mut args = vec!["--max-device-memory", "64M", "--trace", trace_arg, "--grace", "1s"];
    args.extend(ANY_MACHINE);
    args.extend(["--log", log.to_str().unwrap(), "--", "python3", "-c", program, trace_arg, &within, &over]);
    let started = Instant::now();
    let output = run(&args);
    let text = stderr(&output);
    assert_eq!(output.status.code(), Some(3), "{text}");
    assert!(started.elapsed() >= Duration::from_millis(500), "not stopped before it went over");
    assert!(text.contains("or when its device memory passes 64.0 MiB"), "{text}");
    assert!(text.contains("command's device memory 100.0 MiB > --max-device-memory 64.0 MiB"), "{text}");
    assert!(!log_records(&log).iter().any(|r| r["event"] == "over_plan"), "no plan, no over-plan record");
}

#[test]
fn a_plan_that_does_not_load_is_refused_at_start_naming_the_file() {
    let folder = scratch("bad-plan");
    let dir = folder.path();
    let pipeline = plan_file(dir, "cpu", "", "");
    std::fs::remove_file(dir.join("encoder.safetensors")).unwrap();
    let marker = dir.join("started");
    let started = Instant::now();
    let output = run(&["--plan", pipeline.to_str().unwrap(), "--", "touch", marker.to_str().unwrap()]);
    let text = stderr(&output);
    assert_eq!(output.status.code(), Some(2), "{text}");
    assert!(text.contains(&format!("--plan {}", pipeline.display())) && text.contains("encoder.safetensors"), "{text}");
    assert!(!marker.exists() && started.elapsed() < Duration::from_secs(5), "refused before starting anything");
}
