//! `stageload ab` and `stageload latents` with real processes: small Python programs that write
//! the trace, latents and result files the runner names in STAGELOAD_TRACE, STAGELOAD_LATENTS and
//! STAGELOAD_RESULT.

use std::path::Path;
use std::process::{Command, Output};

const STAGELOAD: &str = env!("CARGO_BIN_EXE_stageload");
const ANY_MACHINE: [&str; 4] = ["--wait-free", "0", "--kill-free", "0"];

/// A pipeline stand-in: two stages with peaks `peaks` (MiB), latents `x` written as safetensors,
/// (when asked) a result file with the second peak, its round's share of it and the mode; with `allocate`,
/// first 400 MiB held (for the guard's --max-memory to stop).
fn program(mode: &str, peaks: [u64; 2], x: [f32; 2], allocate: bool) -> String {
    format!(
        r#"
import json, os, struct, time
mib = 1 << 20
with open(os.environ["STAGELOAD_TRACE"], "w") as t:
    def line(record): t.write(json.dumps(record) + "\n"); t.flush()
    line({{"type": "header", "schema": 2, "utc": "x", "pid": os.getpid(), "host": "h", "os": "linux",
          "total_memory": 1, "device": "cpu", "command": [], "interval": 0.25, "meta": {{"mode": "{mode}"}}}})
    line({{"type": "event", "t": 0.0, "kind": "stage", "stage": "encode"}})
    line({{"type": "sample", "t": 0.5, "rss": {p0} * mib}})
    line({{"type": "event", "t": 1.0, "kind": "stage", "stage": "decode"}})
    if {allocate}:
        hold = bytearray(400 * mib)
        for i in range(0, len(hold), 4096): hold[i] = 1
        time.sleep(30)
    line({{"type": "sample", "t": 1.5, "rss": {p1} * mib}})
    line({{"type": "end", "t": 2.0}})
data = struct.pack("<2f", {x0}, {x1})
header = json.dumps({{"x": {{"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}}}).encode()
with open(os.environ["STAGELOAD_LATENTS"], "wb") as f:
    f.write(struct.pack("<Q", len(header)) + header + data)
if "STAGELOAD_RESULT" in os.environ:
    round = int(os.environ["STAGELOAD_RESULT"].rsplit("-", 1)[1].split(".")[0])
    with open(os.environ["STAGELOAD_RESULT"], "w") as f:
        json.dump({{"decode_mib": {p1}, "share": {p1} * round / 10, "mode": "{mode}"}}, f)
"#,
        p0 = peaks[0],
        p1 = peaks[1],
        x0 = x[0],
        x1 = x[1],
        allocate = if allocate { "True" } else { "False" },
    )
}

fn ab(out: &Path, extra: &[&str], commands: &[String]) -> (Output, String) {
    let mut command = Command::new(STAGELOAD);
    command.arg("ab").args(ANY_MACHINE).args(["--runs", "2", "--names", "eager,staged", "--out"]).arg(out).args(extra);
    for program in commands {
        command.args(["--", "python3", "-c", program]);
    }
    let output = command.output().unwrap();
    let text = String::from_utf8_lossy(&output.stdout).into_owned() + &String::from_utf8_lossy(&output.stderr);
    (output, text)
}

#[test]
fn two_commands_run_alternately_and_are_aggregated_compared_and_charted() {
    let folder = tempfile::tempdir().unwrap();
    let out = folder.path().join("ab");
    let eager = program("eager", [300, 320], [1.0, 2.0], false);
    let staged = program("staged", [100, 160], [1.0, 2.0], false);
    let (output, text) = ab(&out, &[], &[eager, staged]);
    assert_eq!(output.status.code(), Some(0), "{text}");
    let text_json = std::fs::read_to_string(out.join("ab.json")).unwrap();
    // The report's own types read it back (what cargo xtask's tasks read).
    let typed: stageload_ab::AbReport = serde_json::from_str(&text_json).unwrap();
    assert!(typed.passed && typed.arms == ["eager", "staged"], "{typed:?}");
    let report: serde_json::Value = serde_json::from_str(&text_json).unwrap();
    let order: Vec<String> = report["runs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| format!("{}-{}", r["arm"].as_str().unwrap(), r["round"]))
        .collect();
    assert_eq!(order, ["eager-1", "staged-1", "eager-2", "staged-2"], "alternating");
    let decode = report["stages"].as_array().unwrap().iter().find(|s| s["stage"] == "decode").unwrap();
    assert_eq!(decode["host"][0]["median"], 320u64 << 20);
    assert_eq!(decode["host"][1]["n"], 2);
    assert!((decode["ratio"][1].as_f64().unwrap() - 0.5).abs() < 1e-9, "{decode}");
    assert_eq!(report["latents"][0][1][0]["verdict"]["kind"], "identical", "{report:#}");
    let fields: Vec<&str> =
        report["results"].as_array().unwrap().iter().map(|f| f["field"].as_str().unwrap()).collect();
    assert_eq!(fields, ["decode_mib", "share"], "the numeric fields of the result files, the mode left out");
    let share = &report["results"][1]["arms"];
    assert_eq!(share[0]["values"], serde_json::json!([32.0, 64.0]), "one value per run, in run order");
    assert_eq!(share[0]["median"], 48.0);
    assert_eq!(share[1]["median"], 24.0);
    assert_eq!(share[1]["ratio"], 0.5);
    assert!(text.contains("decode_mib") && text.contains("staged/eager"), "{text}");
    for file in [
        "summary.txt",
        "bars.svg",
        "bars.png",
        "memory.svg",
        "memory.png",
        "eager-2.jsonl",
        "staged-1.safetensors",
        "staged-2.json",
    ] {
        assert!(out.join(file).is_file(), "{file} missing");
    }
    assert!(text.contains("verdict: every run finished and every latent matches"), "{text}");
}

#[test]
fn a_run_the_guard_stops_is_reported_at_its_stage_and_a_changed_latent_fails() {
    let folder = tempfile::tempdir().unwrap();
    let out = folder.path().join("ab");
    let eager = program("eager", [300, 320], [1.0, 2.0], false);
    let staged = program("staged", [100, 160], [1.0, 2.5], false);
    let (output, text) = ab(&out, &[], &[eager.clone(), staged]);
    assert_eq!(output.status.code(), Some(1), "{text}");
    assert!(text.contains("exceeds eager's own variation"), "eager repeats itself exactly:\n{text}");

    let out = folder.path().join("stopped");
    let heavy = program("eager", [300, 320], [1.0, 2.0], true);
    let light = program("staged", [100, 160], [1.0, 2.0], false);
    // A limit far above what an interpreter running the light program holds (its own 10-20 MiB)
    // and far below the 400 MiB the heavy one writes.
    let (output, text) = ab(&out, &["--max-memory", "128M", "--grace", "1s"], &[heavy, light]);
    assert_eq!(output.status.code(), Some(1), "{text}");
    assert!(
        text.contains("eager 1: stopped by the guard (command uses") && text.contains("last stage decode"),
        "{text}"
    );
    assert!(text.contains("staged 2: exit 0"), "{text}");

    // A run that crashes is reported with its exit status; the others are still aggregated.
    let out = folder.path().join("crashed");
    let crashing = format!("{}\nimport sys; sys.exit(7)", program("eager", [300, 320], [1.0, 2.0], false));
    let (output, text) = ab(&out, &[], &[crashing, program("staged", [100, 160], [1.0, 2.0], false)]);
    assert_eq!(output.status.code(), Some(1), "{text}");
    assert!(text.contains("eager 1: exit 7") && text.contains("eager 2: exit 7"), "{text}");
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("ab.json")).unwrap()).unwrap();
    let decode = report["stages"].as_array().unwrap().iter().find(|s| s["stage"] == "decode").unwrap();
    assert_eq!((decode["host"][0]["n"].as_u64(), decode["host"][1]["n"].as_u64()), (Some(2), Some(2)), "{decode}");
}

#[test]
fn a_result_file_that_does_not_read_fails_the_comparison_and_is_named() {
    let folder = tempfile::tempdir().unwrap();
    let out = folder.path().join("ab");
    let eager = program("eager", [300, 320], [1.0, 2.0], false);
    let broken = program("staged", [100, 160], [1.0, 2.0], false)
        + "open(os.environ['STAGELOAD_RESULT'], 'w').write('{\"seconds\": ')\n";
    let (output, text) = ab(&out, &[], &[eager, broken]);
    assert_eq!(output.status.code(), Some(1), "{text}");
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("ab.json")).unwrap()).unwrap();
    let error = report["runs"][1]["result_error"].as_str().unwrap();
    assert!(error.contains("staged-1.json") && error.contains("not JSON"), "{error}");
    assert_eq!(report["runs"][0]["result_error"], serde_json::Value::Null);
    assert!(text.contains("verdict: FAILED"), "{text}");
}

#[test]
fn bad_usage_is_refused_before_any_run() {
    let folder = tempfile::tempdir().unwrap();
    let out = folder.path().join("ab");
    let one = program("eager", [1, 1], [0.0, 0.0], false);
    let cases: [(Vec<&str>, &str); 4] = [
        (vec!["--runs", "0", "--", "true", "--", "true"], "--runs"),
        (vec!["--", "true"], "two or more commands"),
        (vec!["--names", "a,b,c", "--", "true", "--", "true"], "--names gives 3 names for 2 commands"),
        (vec!["--names", "a/b,c", "--", "true", "--", "true"], "not a name for files"),
    ];
    for (args, expected) in cases {
        let output = Command::new(STAGELOAD).args(["ab", "--out"]).arg(&out).args(&args).output().unwrap();
        let text = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {text}");
        assert!(text.contains(expected), "{args:?}: {text}");
    }
    assert!(!out.join("a-1.jsonl").exists() && !one.is_empty());
}

#[test]
fn latents_files_compare_by_size_with_exit_codes_for_scripts() {
    let folder = tempfile::tempdir().unwrap();
    let dir = folder.path();
    let write = |name: &str, x: [f32; 2]| {
        let path = dir.join(name);
        let status = Command::new("python3")
            .args(["-c", &program("m", [1, 1], x, false)])
            .env("STAGELOAD_TRACE", dir.join(format!("{name}.jsonl")))
            .env("STAGELOAD_LATENTS", &path)
            .status()
            .unwrap();
        assert!(status.success());
        path.to_str().unwrap().to_string()
    };
    let (e1, e2, s1, s2) =
        (write("e1", [1.0, 2.0]), write("e2", [1.0, 2.1]), write("s1", [1.0, 2.05]), write("s2", [1.0, 3.0]));
    let latents = |args: &[&str]| {
        let output = Command::new(STAGELOAD).arg("latents").args(args).output().unwrap();
        (
            output.status.code(),
            String::from_utf8_lossy(&output.stdout).into_owned() + &String::from_utf8_lossy(&output.stderr),
        )
    };
    let (code, text) = latents(&[&e1, &e2, "--name", "eager", "--against", &s1]);
    assert_eq!(code, Some(0), "{text}");
    assert!(
        text.contains("eager's own variation: max |diff|") && text.contains("within eager's own variation"),
        "{text}"
    );
    let (code, text) = latents(&[&e1, &e2, "--name", "eager", "--against", &s1, &s2]);
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("exceeds eager's own variation"), "{text}");
    let (code, text) = latents(&[&e1, "--against", "/no/such.safetensors"]);
    assert_eq!(code, Some(2), "{text}");
    assert!(text.contains("/no/such.safetensors"), "{text}");
}
