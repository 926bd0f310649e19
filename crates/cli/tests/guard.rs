//! `stageload guard` as users run it: the real binary, real readings, real signals. Each run has
//! a hard deadline and the commands it starts are bounded (`sleep 60` at most, stopped early).

use std::process::{Child, Command, Output, Stdio};
use std::sync::Once;
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, SigHandler, Signal};
use nix::unistd::Pid;

#[path = "../../guard/tests/support/pids.rs"]
mod pids;
use pids::{read_pid, running};

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
