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
