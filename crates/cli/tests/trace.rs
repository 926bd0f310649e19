//! `stageload summary` and `stageload plot` on fixture traces: output, exit codes, files.

use std::path::PathBuf;
use std::process::{Command, Output};

const STAGELOAD: &str = env!("CARGO_BIN_EXE_stageload");
const GIB: u64 = 1 << 30;

fn fixture(dir: &std::path::Path, mode: &str, decode_peak: u64, complete: bool) -> PathBuf {
    let header = format!(
        "{{\"type\":\"header\",\"schema\":1,\"utc\":\"2026-11-30T12:00:00Z\",\"pid\":7,\"host\":\"h\",\"os\":\"linux\",\
         \"total_memory\":{},\"device\":\"cpu\",\"command\":[\"cascade\"],\"interval\":0.25,\"meta\":{{\"mode\":\"{mode}\"}}}}",
        24 * GIB
    );
    let mut lines = vec![
        header,
        format!("{{\"type\":\"sample\",\"t\":0.0,\"rss\":{}}}", GIB / 2),
        "{\"type\":\"event\",\"t\":1.0,\"kind\":\"stage\",\"stage\":\"encode\"}".to_string(),
        format!("{{\"type\":\"event\",\"t\":2.0,\"kind\":\"load\",\"model\":\"encoder\",\"bytes\":{GIB},\"seconds\":0.5,\"start\":1.5}}"),
        format!("{{\"type\":\"sample\",\"t\":2.0,\"rss\":{}}}", 2 * GIB),
        "{\"type\":\"event\",\"t\":3.0,\"kind\":\"stage\",\"stage\":\"decode\"}".to_string(),
        format!("{{\"type\":\"sample\",\"t\":4.0,\"rss\":{decode_peak}}}"),
    ];
    if complete {
        lines.push("{\"type\":\"end\",\"t\":4.0}".to_string());
    } else {
        lines.push("{\"type\":\"sample\",\"t\":4.5,\"rs".to_string());
    }
    let path = dir.join(format!("{mode}.jsonl"));
    std::fs::write(&path, lines.join("\n")).unwrap();
    path
}

/// A folder for one test, removed with its contents when dropped.
fn scratch(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new().prefix(&format!("stageload-cli-trace-{name}-")).tempdir().unwrap()
}

fn stageload(args: &[&str]) -> (Output, String) {
    let output = Command::new(STAGELOAD).args(args).output().unwrap();
    let text = String::from_utf8_lossy(&output.stdout).into_owned() + &String::from_utf8_lossy(&output.stderr);
    (output, text)
}

#[test]
fn summary_prints_tables_and_a_side_by_side_comparison() {
    let folder = scratch("summary");
    let dir = folder.path();
    let eager = fixture(dir, "eager", 3 * GIB, true);
    let staged = fixture(dir, "staged", GIB, false);
    let (output, text) = stageload(&["summary", eager.to_str().unwrap(), staged.to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(0), "{text}");
    assert!(text.contains("trace") && text.contains("(eager), pid 7 on h"), "{text}");
    assert!(text.contains("ended without its end record"), "the killed staged run says so:\n{text}");
    assert!(text.contains("loads: 1 (0 reloads), 1.0 GiB in 0.50 s (2.15 GB/s)"), "{text}");
    let decode = text.lines().rev().find(|l| l.starts_with("decode")).unwrap();
    assert!(
        decode.contains("3.0 GiB")
            && decode.contains("1.0 GiB")
            && decode.contains("-2.0 GiB")
            && decode.contains("3.00x"),
        "{decode}"
    );

    let (output, text) = stageload(&["summary", "--json", eager.to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(0), "{text}");
    let json: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(json[0]["peak"], 3 * GIB);
    assert_eq!(json[0]["stages"][2]["stage"], "decode");
    assert_eq!(json[0]["header"]["meta"]["mode"], "eager");
}

#[test]
fn summary_lists_a_cascades_setup_stage_once_with_its_weights() {
    // The cascade's registry enters its own `setup` stage (occurrence 0) 4 ms after the meter
    // starts: one row from 0 with the models it loaded, not a zero-length row without weights and
    // then the real one. (Traces written before stage events named their occurrence, such as
    // traces/cascade/'s, never showed it.)
    let trace =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../traces/prefetch/huge-pages/cascade5/staged-1.jsonl");
    let (output, text) = stageload(&["summary", trace.to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(0), "{text}");
    let setups: Vec<&str> = text.lines().filter(|line| line.split_whitespace().next() == Some("setup")).collect();
    assert_eq!(setups.len(), 1, "{text}");
    let cells: Vec<&str> = setups[0].split_whitespace().collect();
    assert_eq!(cells[1], "0.00", "the setup row starts at 0: {}", setups[0]);
    assert_ne!(cells[2], "0.00", "the setup row lasts until the next stage: {}", setups[0]);
    assert!(!setups[0].ends_with(" 0 B"), "the setup row has the weights loaded in it: {}", setups[0]);
}

#[test]
fn summary_and_plot_refuse_missing_and_broken_traces() {
    let folder = scratch("bad");
    let dir = folder.path();
    let (output, text) = stageload(&["summary", "/no/such/trace.jsonl"]);
    assert_eq!(output.status.code(), Some(2));
    assert!(text.contains("/no/such/trace.jsonl"), "{text}");
    let broken = dir.join("broken.jsonl");
    std::fs::write(&broken, "{\"type\":\"sample\",\"t\":0.0}\n{oops\n{\"type\":\"end\",\"t\":1.0}\n").unwrap();
    let (output, text) = stageload(&["summary", broken.to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(2));
    assert!(text.contains("line 2"), "{text}");
    let (output, text) = stageload(&["plot", broken.to_str().unwrap(), "-o", dir.join("x.svg").to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(2), "{text}");
    let (output, _) = stageload(&["summary"]);
    assert_eq!(output.status.code(), Some(2), "a trace is required");
}

#[test]
fn plot_writes_svg_and_png() {
    let folder = scratch("plot");
    let dir = folder.path();
    let eager = fixture(dir, "eager", 3 * GIB, true);
    let staged = fixture(dir, "staged", GIB, true);
    for name in ["memory.svg", "memory.png"] {
        let out = dir.join(name);
        let (output, text) =
            stageload(&["plot", eager.to_str().unwrap(), staged.to_str().unwrap(), "-o", out.to_str().unwrap()]);
        assert_eq!(output.status.code(), Some(0), "{text}");
        assert!(std::fs::metadata(&out).unwrap().len() > 5_000, "{name} is a drawn chart");
    }
    let svg = std::fs::read_to_string(dir.join("memory.svg")).unwrap();
    for expected in ["encode", "decode", "eager: peak 3.00 GB", "staged: peak 2.00 GB"] {
        assert!(svg.contains(expected), "{expected} missing from the SVG");
    }
    let (output, text) = stageload(&["plot", eager.to_str().unwrap(), "-o", dir.join("memory.gif").to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(2));
    assert!(text.contains(".svg or .png"), "{text}");
}

#[test]
fn plot_widths_are_bounded_and_a_trace_that_is_not_a_file_is_refused_by_kind() {
    let folder = scratch("widths");
    let dir = folder.path();
    let eager = fixture(dir, "eager", 3 * GIB, true);
    let out = dir.join("w.png");
    for width in ["0", "199", "8001", "4000000000"] {
        let (output, text) =
            stageload(&["plot", eager.to_str().unwrap(), "-o", out.to_str().unwrap(), "--width", width]);
        assert_eq!(output.status.code(), Some(2), "{width}: {text}");
        assert!(text.contains("--width") && text.contains("200..=8000"), "{width}: {text}");
        assert!(!out.exists(), "no stub file for --width {width}");
    }
    // A sample at the latest time a trace may hold: drawn at once, not tick by tick.
    let far = dir.join("far.jsonl");
    std::fs::write(&far, "{\"type\":\"sample\",\"t\":0,\"rss\":5}\n{\"type\":\"sample\",\"t\":1e8,\"rss\":7}\n")
        .unwrap();
    let started = std::time::Instant::now();
    let (output, text) = stageload(&["plot", far.to_str().unwrap(), "-o", out.to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(0), "{text}");
    assert!(started.elapsed() < std::time::Duration::from_secs(20), "{:?}", started.elapsed());
    let fifo = dir.join("trace.jsonl");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
    for args in [vec!["summary", fifo.to_str().unwrap()], vec!["summary", "/dev/zero"]] {
        let (output, text) = stageload(&args);
        assert_eq!(output.status.code(), Some(2), "{text}");
        assert!(text.contains("not a regular file"), "{text}");
    }
}

/// A trace of `stages` stage windows with a load, a release and two samples each.
fn long_trace(dir: &std::path::Path, stages: u32) -> PathBuf {
    let mut text = String::new();
    for i in 0..stages {
        let t = f64::from(i);
        text += &format!("{{\"type\":\"event\",\"t\":{t},\"kind\":\"stage\",\"stage\":\"s{}\"}}\n", i % 7);
        text += &format!("{{\"type\":\"event\",\"t\":{},\"kind\":\"load\",\"model\":\"m\",\"bytes\":1}}\n", t + 0.1);
        text += &format!("{{\"type\":\"sample\",\"t\":{},\"rss\":{}}}\n", t + 0.2, 1000 + i);
        text += &format!("{{\"type\":\"event\",\"t\":{},\"kind\":\"release\",\"model\":\"m\"}}\n", t + 0.5);
        text += &format!("{{\"type\":\"sample\",\"t\":{},\"rss\":{}}}\n", t + 0.7, 900 + i);
    }
    let path = dir.join("long.jsonl");
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn a_long_trace_is_summarized_and_plotted_in_bounded_time() {
    let folder = scratch("long");
    let dir = folder.path();
    let trace = long_trace(dir, 20_000);
    let started = std::time::Instant::now();
    let (output, text) = stageload(&["summary", "--json", trace.to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(0), "{text}");
    let (output, text) = stageload(&["plot", trace.to_str().unwrap(), "-o", dir.join("long.svg").to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(0), "{text}");
    // Quadratic marker placement and windows took minutes at this size.
    assert!(started.elapsed() < std::time::Duration::from_secs(60), "{:?}", started.elapsed());
}

#[test]
fn a_closed_stdout_ends_every_command_quietly() {
    use std::process::Stdio;
    let folder = scratch("closed");
    let dir = folder.path();
    let trace = long_trace(dir, 3_000);
    // (command, whether it writes more than a pipe holds, so the closed end is always met)
    let commands: [(&[&str], bool); 3] = [
        (&["summary", trace.to_str().unwrap()], true),
        (&["summary", "--json", trace.to_str().unwrap()], true),
        (&["guard", "--check", "--wait-free", "0", "--kill-free", "0"], false),
    ];
    for (args, large) in commands {
        let mut child =
            Command::new(STAGELOAD).args(args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
        drop(child.stdout.take());
        let output = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!stderr.contains("panicked") && !stderr.contains("failed printing"), "{args:?}: {stderr}");
        let expected: &[i32] = if large { &[141] } else { &[0, 141] };
        assert!(expected.contains(&output.status.code().unwrap_or(-1)), "{args:?}: {:?} {stderr}", output.status);
    }
}
