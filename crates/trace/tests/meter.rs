//! The meter with real readings of this process, with injected failing readers, killed with
//! SIGKILL; and the charts drawn from what it wrote. Every test takes `ONE_METER`: some read
//! this process's RSS and reset its high-water mark, both process-wide, and the others allocate
//! (a chart, a trace read back) beside them otherwise.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use stageload_probe::{ProbeError, ProcessMemory, SystemMemory};
use stageload_trace::event::{Entered, Loaded};
use stageload_trace::record::{Record, Sample};
use stageload_trace::{plot::plot, read_trace, summarize, EventKind, Meter, MeterOptions, MeterReadings};

static ONE_METER: Mutex<()> = Mutex::new(());

/// A folder for one test, removed with its contents when dropped.
fn scratch(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new().prefix(&format!("stageload-meter-{name}-")).tempdir().unwrap()
}

/// Enters a stage 20 ms after the previous one, so that no window is empty.
fn stage(meter: &Meter, name: &str) {
    std::thread::sleep(Duration::from_millis(20));
    meter.event(Instant::now(), Entered::new(name).into());
}

#[test]
fn a_run_writes_header_samples_events_and_end() {
    let _alone = ONE_METER.lock().unwrap_or_else(|e| e.into_inner());
    let folder = scratch("run");
    let path = folder.path().join("nested/run.jsonl");
    let options = MeterOptions::default().interval(Duration::from_millis(50)).meta("mode", "staged").meta("pid", 1);
    let meter = Meter::start(&path, options).unwrap();
    stage(&meter, "encode");
    let load = Loaded { model: "encoder".into(), bytes: Some(10), seconds: Some(0.02), ..Loaded::default() };
    meter.event(Instant::now(), load.into());
    std::thread::sleep(Duration::from_millis(300));
    meter.finish();
    let trace = read_trace(&path).unwrap();
    let Record::Header(header) = &trace.records[0] else { panic!("first record {:?}", trace.records[0]) };
    assert_eq!(
        (header.schema, header.pid, header.interval),
        (stageload_trace::record::SCHEMA_VERSION, std::process::id(), 0.05)
    );
    assert_eq!(header.meta["pid"], 1, "user meta stays under meta and cannot overwrite the pid");
    assert!(header.total_memory > 0 && header.command[0].contains("meter"));
    assert!(matches!(trace.records.last(), Some(Record::End { .. })));
    let samples: Vec<&Sample> =
        trace.records.iter().filter_map(|r| if let Record::Sample(s) = r { Some(s) } else { None }).collect();
    assert!(samples.len() >= 6, "background samples every 50 ms plus one per event: {}", samples.len());
    assert!(samples.iter().all(|s| s.rss.unwrap() > 0 && s.available.unwrap() > 0));
    assert!(samples.windows(2).all(|w| w[0].t <= w[1].t), "times never go back");
    // Every event is followed by a sample at its time; a load's start is t - seconds.
    for (i, record) in trace.records.iter().enumerate() {
        if let Record::Event(event) = record {
            assert!(matches!(&trace.records[i + 1], Record::Sample(s) if s.t == event.t), "{record:?}");
            if event.kind() == EventKind::Load {
                assert_eq!(event.start, Some(((event.t - 0.02) * 1000.0).round() / 1000.0));
            }
        }
    }
    let summary = summarize(&trace);
    assert_eq!(summary.stages.iter().map(|w| w.stage.as_str()).collect::<Vec<_>>(), ["setup", "encode"]);
    assert!(summary.complete);
}

#[test]
fn the_exact_stage_peak_catches_a_spike_that_sampling_misses() {
    const BLOCK: u64 = 256 << 20;
    let _alone = ONE_METER.lock().unwrap_or_else(|e| e.into_inner());
    let folder = scratch("spike");
    let path = folder.path().join("spike.jsonl");
    // No background sample will fall inside the spike: the interval is far longer than the run.
    let meter = Meter::start(&path, MeterOptions::default().interval(Duration::from_secs(60))).unwrap();
    stage(&meter, "quiet");
    stage(&meter, "spike");
    // A mapping of its own (above glibc's mmap threshold), one byte written in each of its pages.
    let mut block = vec![0u8; BLOCK as usize];
    for page in block.chunks_mut(4096) {
        page[0] = 1;
    }
    std::hint::black_box(&block);
    drop(block);
    stage(&meter, "after");
    meter.finish();
    let summary = summarize(&read_trace(&path).unwrap());
    let window = |name: &str| summary.stages.iter().find(|w| w.stage == name).unwrap().clone();
    let (quiet, spike, after) = (window("quiet"), window("spike"), window("after"));
    // A reading that saw the block is at least the block over the quiet window's peak, but for
    // what the kernel's per-CPU counters leave out of the two; one that did not is within that of
    // it. Half the block lies between the two cases. The counters' slack must stay under a
    // quarter of the block, or the check could not see the spike missed on this machine.
    let slack = 2 * stageload_probe::rss_counter_slack();
    assert!(
        slack <= BLOCK / 4,
        "this machine's RSS counters may be off by {slack} bytes over two readings, more than a quarter of the {BLOCK} checked: the check cannot tell here"
    );
    let base = quiet.peak.unwrap();
    assert!(spike.peak.unwrap() + slack >= base + BLOCK, "exact peak {spike:?} over {base} (slack {slack})");
    assert!(spike.sampled_peak.unwrap() < base + BLOCK / 2, "the samples missed it: {spike:?} over {base}");
    assert!(after.peak.unwrap() < base + BLOCK / 2, "the spike is not charged to the next stage: {after:?}");
}

/// Readings that fail on a script: the system reading fails at calls 2-4 (one message), works,
/// then fails again with the same message.
struct Flaky {
    calls: usize,
}

impl MeterReadings for Flaky {
    fn process(&mut self) -> Result<ProcessMemory, ProbeError> {
        Ok(ProcessMemory {
            rss: 1 << 20,
            rss_anon: None,
            rss_file: None,
            swap: None,
            peak: Some(1 << 20),
            footprint: None,
            locked: None,
            pinned: None,
        })
    }
    fn system(&mut self) -> Result<SystemMemory, ProbeError> {
        self.calls += 1;
        if (2..=4).contains(&self.calls) || self.calls >= 6 {
            return Err(ProbeError::Read { source_name: "/proc/meminfo".into(), message: "injected".into() });
        }
        Ok(SystemMemory { total: 8 << 30, available: 4 << 30, swap_total: 0, swap_used: 0, cgroup: None })
    }
    fn pressure(&mut self) -> Result<Option<stageload_probe::Pressure>, ProbeError> {
        Ok(None)
    }
    fn reset_peak(&mut self) -> Result<(), ProbeError> {
        Err(ProbeError::Unsupported("peak reset"))
    }
}

#[test]
fn a_failing_reading_is_recorded_once_per_error_and_again_after_recovery() {
    let _alone = ONE_METER.lock().unwrap_or_else(|e| e.into_inner());
    let folder = scratch("flaky");
    let path = folder.path().join("flaky.jsonl");
    let meter =
        Meter::start(&path, MeterOptions::default().interval(Duration::from_secs(60)).readings(Flaky { calls: 0 }))
            .unwrap();
    for name in ["a", "b", "c", "d", "e", "f"] {
        stage(&meter, name);
    }
    meter.finish();
    let trace = read_trace(&path).unwrap();
    let errors: Vec<&Record> = trace.records.iter().filter(|r| matches!(r, Record::Error(_))).collect();
    assert_eq!(errors.len(), 2, "once for calls 2-4, again after the recovery at 5: {errors:?}");
    let samples = trace.records.iter().filter(|r| matches!(r, Record::Sample(_))).count();
    assert_eq!(samples, 8, "sampling went on: start, six events, finish");
    assert!(
        !trace.records.iter().any(|r| matches!(r, Record::Peak(_))),
        "no exact peaks where the mark cannot be reset"
    );
    let summary = summarize(&trace);
    assert_eq!(summary.errors[0].source, "system");
    assert!(summary.errors[0].error.contains("injected"));
}

fn example(name: &str) -> PathBuf {
    // Integration tests run from target/<profile>/deps; `cargo test` builds examples beside it.
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().join("examples").join(name)
}

#[test]
fn a_run_killed_with_sigkill_leaves_a_trace_that_summary_and_plot_read() {
    let _alone = ONE_METER.lock().unwrap_or_else(|e| e.into_inner());
    let folder = scratch("killed");
    let dir = folder.path();
    let path = dir.join("killed.jsonl");
    let mut child = Command::new(example("metered_stages"))
        .args(["--trace", path.to_str().unwrap(), "--stages", "50", "--block-mib", "16", "--hold-ms", "100"])
        .stdout(Stdio::null())
        .spawn()
        .expect("the metered_stages example is built by cargo test");
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::fs::read_to_string(&path).map_or(0, |t| t.matches("\"kind\":\"stage\"").count()) < 3 {
        assert!(Instant::now() < deadline, "no stages written");
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let trace = read_trace(&path).unwrap();
    let summary = summarize(&trace);
    assert!(!summary.complete);
    assert!(summary.stages.len() >= 3 && summary.loads.count >= 2, "{summary:?}");
    let svg = dir.join("killed.svg");
    plot(&[("killed".into(), &trace, &summary)], &svg, 900).unwrap();
    assert!(std::fs::read_to_string(&svg).unwrap().contains("stopped (no end record)"));
}

#[test]
fn plot_writes_real_svg_and_png() {
    let _alone = ONE_METER.lock().unwrap_or_else(|e| e.into_inner());
    let folder = scratch("plot");
    let dir = folder.path();
    let status = Command::new(example("metered_stages"))
        .args([
            "--trace",
            dir.join("run.jsonl").to_str().unwrap(),
            "--stages",
            "3",
            "--block-mib",
            "32",
            "--hold-ms",
            "150",
        ])
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
    let trace = read_trace(dir.join("run.jsonl")).unwrap();
    let summary = summarize(&trace);
    let traces = [("eager".to_string(), &trace, &summary), ("staged".to_string(), &trace, &summary)];
    let svg = dir.join("memory.svg");
    plot(&traces, &svg, 1000).unwrap();
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.starts_with("<svg") && text.contains("width=\"1000\""), "{}", &text[..200.min(text.len())]);
    for name in ["stage_0", "stage_1", "stage_2", "eager: peak", "staged: peak", "seconds", "GB"] {
        assert!(text.contains(name), "{name} missing from the SVG");
    }
    let png = dir.join("memory.png");
    plot(&traces, &png, 1000).unwrap();
    let bytes = std::fs::read(&png).unwrap();
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    let (width, height) =
        (u32::from_be_bytes(bytes[16..20].try_into().unwrap()), u32::from_be_bytes(bytes[20..24].try_into().unwrap()));
    assert_eq!((width, height), (1000, 640));
    assert!(bytes.len() > 10_000, "a drawn chart, not an empty image: {} bytes", bytes.len());
    let error = plot(&traces, &dir.join("memory.jpg"), 1000).unwrap_err();
    assert!(error.to_string().contains(".svg or .png"));
}
