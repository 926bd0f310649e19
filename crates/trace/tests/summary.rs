//! Reader and summary on hand-written traces: the original's worked examples, the release tail,
//! repeated stages, exact peak records, loads, errors, and every way a file can be broken.

use std::path::PathBuf;

use stageload_trace::event::{Entered, Loaded, Released, ReloadFrom, Reloaded, What};
use stageload_trace::record::{EventRecord, PeakRecord, Record, Sample};
use stageload_trace::{read_trace, summarize, table, Summary, Trace, TraceError};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn sample(t: f64, rss: u64) -> Record {
    Record::Sample(Sample { t, rss: Some(rss), ..Sample::default() })
}

fn event(t: f64, what: impl Into<What>) -> Record {
    Record::Event(EventRecord::at_t(t, what))
}

fn stage(t: f64, name: &str) -> Record {
    event(t, Entered::new(name))
}

fn release(t: f64) -> Record {
    event(t, Released { model: "m".into(), ..Released::default() })
}

/// A load that leaves `resident` bytes of weights resident.
fn weights(t: f64, resident: u64) -> Record {
    event(t, Loaded { model: "m".into(), resident: Some(resident), ..Loaded::default() })
}

fn summary_of(records: Vec<Record>) -> Summary {
    summarize(&Trace::new("hand.jsonl", records))
}

fn windows(summary: &Summary) -> Vec<(&str, f64, Option<u64>)> {
    summary.stages.iter().map(|w| (w.stage.as_str(), w.seconds, w.peak)).collect()
}

#[test]
fn a_stage_starts_after_the_releases_its_entry_set_off() {
    // structure at 0.1; texture at 2.0 followed by a release at 2.1.
    let summary = summary_of(vec![
        sample(0.0, 100),
        stage(0.1, "structure"),
        sample(1.0, 300),
        stage(2.0, "texture"),
        release(2.1),
        sample(3.0, 250),
        sample(4.0, 120),
    ]);
    assert_eq!(
        windows(&summary),
        [("setup", 0.1, Some(100)), ("structure", 2.0, Some(300)), ("texture", 1.9, Some(250))]
    );
}

#[test]
fn a_sample_during_the_release_tail_belongs_to_the_previous_stage() {
    let summary = summary_of(vec![
        sample(0.0, 10),
        stage(1.0, "texture"),
        sample(1.5, 300),
        stage(5.0, "decode"),
        sample(5.4, 290),
        release(6.0),
        sample(6.5, 40),
        sample(7.5, 60),
    ]);
    assert_eq!(windows(&summary), [("setup", 1.0, Some(10)), ("texture", 5.0, Some(300)), ("decode", 1.5, Some(60))]);
}

#[test]
fn an_explicit_setup_merges_with_the_synthetic_one_and_repeats_merge() {
    let summary = summary_of(vec![
        sample(0.0, 10),
        stage(3.5, "setup"),
        sample(4.0, 30),
        stage(5.0, "structure"),
        stage(5.5, "structure"),
        sample(6.0, 20),
    ]);
    assert_eq!(windows(&summary), [("setup", 5.0, Some(30)), ("structure", 1.0, Some(20))]);
    // A stage entered at 0 replaces the synthetic setup.
    let summary = summary_of(vec![stage(0.0, "load"), sample(0.0, 5), sample(1.0, 7)]);
    assert_eq!(windows(&summary), [("load", 1.0, Some(7))]);
    // A load between the stage event and a release ends the tail.
    let summary = summary_of(vec![
        sample(0.0, 1),
        stage(1.0, "a"),
        event(1.2, Loaded { stage: Some("a".into()), model: "m".into(), ..Loaded::default() }),
        release(1.5),
        sample(2.0, 2),
    ]);
    assert_eq!(summary.stages[1].start, 1.0);
}

fn stage_at(t: f64, name: &str, position: usize) -> Record {
    event(t, Entered { position: Some(position), ..Entered::new(name) })
}

#[test]
fn a_stage_listed_twice_in_a_row_gets_a_window_per_occurrence_the_registry_entered() {
    // The pipeline `[a, a]`: the stage events say which occurrence each entry was.
    let summary =
        summary_of(vec![sample(0.0, 1), stage_at(1.0, "a", 0), sample(1.5, 5), stage_at(2.0, "a", 1), sample(2.5, 9)]);
    assert_eq!(windows(&summary), [("setup", 1.0, Some(1)), ("a", 1.0, Some(5)), ("a", 0.5, Some(9))]);
    let positions: Vec<Option<usize>> = summary.stages.iter().map(|w| w.position).collect();
    assert_eq!(positions, [None, Some(0), Some(1)]);
    // The same occurrence entered again at once is still one window.
    let summary = summary_of(vec![sample(0.0, 1), stage_at(1.0, "a", 0), stage_at(1.5, "a", 0), sample(2.0, 3)]);
    assert_eq!(windows(&summary), [("setup", 1.0, Some(1)), ("a", 1.0, Some(3))]);
    // `[a, b, a]`: each window with its own occurrence.
    let summary = summary_of(vec![
        sample(0.0, 1),
        stage_at(1.0, "a", 0),
        stage_at(2.0, "b", 1),
        stage_at(3.0, "a", 2),
        sample(3.5, 2),
    ]);
    let occurrences: Vec<(&str, Option<usize>)> =
        summary.stages.iter().map(|w| (w.stage.as_str(), w.position)).collect();
    assert_eq!(occurrences, [("setup", None), ("a", Some(0)), ("b", Some(1)), ("a", Some(2))]);
}

#[test]
fn a_registrys_own_setup_stage_is_one_window_with_the_synthetic_setup_before_it() {
    // The cascade enters `setup` (occurrence 0) 2 ms after the trace begins: one row, not a
    // zero-length synthetic one and then the real one.
    let summary = summary_of(vec![sample(0.0, 1), stage_at(0.002, "setup", 0), sample(0.2, 4), stage_at(0.3, "a", 1)]);
    assert_eq!(windows(&summary), [("setup", 0.3, Some(4)), ("a", 0.0, None)]);
    assert_eq!(summary.stages[0].position, Some(0));
}

#[test]
fn exact_peak_records_raise_a_window_that_sampling_missed() {
    let summary = summary_of(vec![
        sample(0.0, 100),
        Record::Peak(PeakRecord { t: 1.0, stage: "setup".into(), rss: 150, device: None }),
        stage(1.0, "spike"),
        sample(1.0, 100),
        Record::Peak(PeakRecord { t: 2.0, stage: "spike".into(), rss: 900, device: None }),
        stage(2.0, "after"),
        release(2.2),
        Record::Peak(PeakRecord { t: 2.2, stage: "spike".into(), rss: 950, device: None }),
        sample(2.2, 110),
        Record::Peak(PeakRecord { t: 3.0, stage: "after".into(), rss: 120, device: None }),
        sample(3.0, 110),
    ]);
    let peaks: Vec<(&str, Option<u64>, Option<u64>)> =
        summary.stages.iter().map(|w| (w.stage.as_str(), w.peak, w.sampled_peak)).collect();
    assert_eq!(
        peaks,
        [("setup", Some(150), Some(100)), ("spike", Some(950), Some(100)), ("after", Some(120), Some(110))]
    );
    assert_eq!((summary.peak, summary.peak_t), (950, 2.2));
}

#[test]
fn loads_releases_outside_stage_swap_and_errors() {
    let load = |model: &str, bytes: u64, seconds: f64, outside_stage: bool| Loaded {
        model: model.into(),
        bytes: Some(bytes),
        seconds: Some(seconds),
        outside_stage,
        ..Loaded::default()
    };
    let reload = Reloaded { from: ReloadFrom::InPlace, tier: None, load: load("encoder", 2_000_000_000, 0.5, false) };
    let summary = summary_of(vec![
        Record::Sample(Sample {
            t: 0.0,
            rss: Some(1),
            swap_used: Some(100),
            available: Some(900),
            ..Sample::default()
        }),
        event(1.0, load("encoder", 2_000_000_000, 1.0, false)),
        event(2.0, reload),
        event(2.5, load("helper", 1_000_000_000, 0.5, true)),
        event(3.0, Released { model: "encoder".into(), bytes: Some(2_000_000_000), ..Released::default() }),
        Record::Error(stageload_trace::record::ErrorRecord {
            t: 3.1,
            source: "system".into(),
            error: "cannot read /proc/meminfo".into(),
        }),
        Record::Sample(Sample {
            t: 4.0,
            rss: Some(2),
            swap_used: Some(400),
            available: Some(500),
            ..Sample::default()
        }),
        Record::Sample(Sample { t: 5.0, rss: Some(1), swap_used: Some(300), ..Sample::default() }),
        Record::End { t: 5.0 },
    ]);
    assert_eq!((summary.loads.count, summary.loads.reloads, summary.loads.bytes), (3, 1, 5_000_000_000));
    assert_eq!((summary.loads.seconds, summary.loads.gb_per_s), (2.0, 2.5));
    assert_eq!((summary.releases.count, summary.releases.bytes), (1, 2_000_000_000));
    assert_eq!(summary.outside_stage, ["helper"]);
    let swap = summary.swap.unwrap();
    assert_eq!((swap.start, swap.peak, swap.end), (100, 400, 300));
    assert_eq!(summary.min_available, Some(500));
    assert_eq!(summary.errors.len(), 1);
    assert!(summary.complete && summary.duration == 5.0);
    let text = table::render(&summary, std::path::Path::new("run.jsonl"));
    for expected in
        ["loads: 3 (1 reloads)", "2.50 GB/s", "loaded outside their stage: helper", "reading failed at 3.1 s (system)"]
    {
        assert!(text.contains(expected), "{expected} missing:\n{text}");
    }
}

#[test]
fn side_by_side_table_gives_differences_and_ratios() {
    let eager = summary_of(vec![sample(0.0, 4 << 30), stage(1.0, "decode"), sample(2.0, 6 << 30)]);
    let staged = summary_of(vec![sample(0.0, 1 << 30), stage(1.0, "decode"), sample(2.0, 2 << 30)]);
    let text = table::compare(&[("eager".into(), &eager), ("staged".into(), &staged)]);
    assert!(text.contains("staged - eager") && text.contains("eager/staged"), "{text}");
    let decode = text.lines().find(|l| l.starts_with("decode")).unwrap();
    assert!(
        decode.contains("6.0 GiB")
            && decode.contains("2.0 GiB")
            && decode.contains("-4.0 GiB")
            && decode.contains("3.00x"),
        "{decode}"
    );
}

fn write(folder: &tempfile::TempDir, name: &str, text: &str) -> PathBuf {
    let path = folder.path().join(format!("{name}.jsonl"));
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn the_reader_skips_only_a_half_written_last_line() {
    let folder = tempfile::Builder::new().prefix("stageload-reader-").tempdir().unwrap();
    let write = |name: &str, text: &str| write(&folder, name, text);
    let good = "{\"type\":\"sample\",\"t\":0.0,\"rss\":5}\n{\"type\":\"sample\",\"t\":0.5,\"rss\":7}\n";
    let trace = read_trace(write("half", &format!("{good}{{\"type\":\"sam"))).unwrap();
    assert!(trace.skipped_last_line && trace.records.len() == 2);
    assert_eq!(summarize(&trace).peak, 7);
    let error =
        read_trace(write("broken", &format!("{{\"type\":\"sample\",\"t\":0.0}}\nnot json\n{good}"))).unwrap_err();
    assert!(matches!(error, TraceError::Broken { line: 2, .. }), "{error}");
    assert!(error.to_string().contains("line 2"));
    let error =
        read_trace(write("unknown-type", &format!("{good}{{\"type\":\"weird\",\"t\":1}}\n{good}"))).unwrap_err();
    assert!(matches!(error, TraceError::Broken { line: 3, .. }), "{error}");
    let newer = "{\"type\":\"header\",\"schema\":9,\"utc\":\"x\",\"pid\":1,\"host\":\"h\",\"os\":\"linux\",\"total_memory\":1,\"device\":\"cpu\",\"command\":[],\"interval\":0.25}\n";
    assert!(matches!(read_trace(write("newer", newer)).unwrap_err(), TraceError::Schema { found: 9, .. }));
    assert!(matches!(read_trace(write("empty", "\n\n")).unwrap_err(), TraceError::Empty { .. }));
    assert!(read_trace("/no/such/trace.jsonl").unwrap_err().to_string().contains("/no/such/trace.jsonl"));
}

#[test]
fn the_committed_traces_are_read_summarized_and_plotted_with_typed_events() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../traces");
    let mut traces = Vec::new();
    let mut folders = vec![root];
    while let Some(folder) = folders.pop() {
        for entry in std::fs::read_dir(&folder).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                folders.push(path);
            } else if path.extension().is_some_and(|e| e == "jsonl") {
                traces.push(path);
            }
        }
    }
    assert!(traces.len() >= 2, "the cascade's eager and staged traces are committed: {traces:?}");
    let mut reloads_in_place = 0;
    let out = tempfile::TempDir::new().unwrap();
    for path in &traces {
        let trace = read_trace(path).unwrap_or_else(|e| panic!("{e}"));
        let summary = summarize(&trace);
        // A run may be one stage from its first millisecond (the streamed demo's): no setup window.
        assert!(summary.loads.count > 0 && !summary.stages.is_empty(), "{}", path.display());
        // One window per stage entry: `setup` once at most (a cascade's own setup stage merges
        // with the synthetic window before it), and never one occurrence in two windows.
        let setups = summary.stages.iter().filter(|window| window.stage == "setup").count();
        assert!(setups <= 1, "{}: setup listed {setups} times", path.display());
        for pair in summary.stages.windows(2) {
            assert!(
                (&pair[0].stage, pair[0].position) != (&pair[1].stage, pair[1].position),
                "{}: `{}` listed twice in a row",
                path.display(),
                pair[0].stage
            );
        }
        reloads_in_place += trace
            .records
            .iter()
            .filter(|r| matches!(r, Record::Event(e) if matches!(&e.what, What::Reload(r) if r.from == ReloadFrom::InPlace)))
            .count();
        let chart = out.path().join(format!("{}.svg", path.file_stem().unwrap().to_string_lossy()));
        stageload_trace::plot::plot(&[("run".to_string(), &trace, &summary)], &chart, 800).unwrap();
        assert!(std::fs::metadata(&chart).unwrap().len() > 1000);
    }
    assert!(reloads_in_place >= 1, "the staged runs reload the shape decoder in place, typed");
}

/// A run on `cuda:0` in two stages: host RSS flat, device weights `weights` and a device spike.
fn device_run(weights: [u64; 2], spikes: [u64; 2]) -> Summary {
    let header = stageload_trace::record::Header {
        schema: stageload_trace::record::SCHEMA_VERSION,
        utc: String::new(),
        pid: 1,
        host: "h".into(),
        os: "linux".into(),
        total_memory: 1 << 40,
        device: "cuda:0".into(),
        command: vec![],
        interval: 0.25,
        meta: Default::default(),
    };
    let device = |t: f64, bytes: u64| {
        Record::Sample(Sample { t, rss: Some(500), device_allocated: Some(bytes), ..Sample::default() })
    };
    summary_of(vec![
        Record::Header(header),
        stage(0.0, "a"),
        self::weights(0.1, weights[0]),
        device(0.2, weights[0]),
        // The exact device peak of the window, reset at its start: the spike between samples.
        Record::Peak(PeakRecord { t: 1.0, stage: "a".into(), rss: 500, device: Some(weights[0] + spikes[0]) }),
        stage(1.0, "b"),
        self::weights(1.1, weights[1]),
        device(1.2, weights[1]),
        Record::Peak(PeakRecord { t: 2.0, stage: "b".into(), rss: 500, device: Some(weights[1] + spikes[1]) }),
        device(2.0, weights[1]),
    ])
}

#[test]
fn on_a_device_each_stage_has_its_exact_device_peak_and_is_checked_against_it() {
    let eager = device_run([3000, 3000], [100, 200]);
    let staged = device_run([1000, 2000], [100, 200]);
    let device_peaks: Vec<Option<u64>> = staged.stages.iter().map(|w| w.device_peak).collect();
    assert_eq!(device_peaks, [Some(1100), Some(2200)], "the exact peaks, above every sample");
    let checks = table::against_eager(&eager, &staged);
    assert!(checks.iter().all(|c| c.memory == "device"), "{checks:?}");
    // Working memory from the eager run's device peak less its device weights: 100 and 200.
    assert_eq!(checks.iter().map(|c| (c.expected, c.staged_peak)).collect::<Vec<_>>(), [(1100, 1100), (2200, 2200)]);
    assert!(checks.iter().all(|c| (c.ratio() - 1.0).abs() < 1e-9));
    let text = table::render(&staged, std::path::Path::new("staged.jsonl"));
    assert!(text.contains("device peak") && text.contains("host peak"), "{text}");
}

#[test]
fn the_chart_draws_device_memory_beside_host_memory() {
    let staged = device_run([1000, 2000], [100, 200]);
    let trace = Trace::new("hand.jsonl", vec![]);
    let records = vec![
        Record::Sample(Sample { t: 0.0, rss: Some(500), device_allocated: Some(1000), ..Sample::default() }),
        Record::Sample(Sample { t: 1.0, rss: Some(500), device_allocated: Some(2000), ..Sample::default() }),
    ];
    let trace = Trace { records, ..trace };
    let dir = tempfile::TempDir::new().unwrap();
    let chart = dir.path().join("memory.svg");
    stageload_trace::plot::plot(&[("staged".to_string(), &trace, &staged)], &chart, 800).unwrap();
    assert!(std::fs::read_to_string(&chart).unwrap().contains("staged (device)"));
}

#[test]
fn records_out_of_time_order_are_sorted_and_the_trace_says_so() {
    let folder = tempfile::Builder::new().prefix("stageload-order-").tempdir().unwrap();
    let text = "{\"type\":\"sample\",\"t\":0.0,\"rss\":5}\n\
                {\"type\":\"event\",\"t\":2.0,\"kind\":\"stage\",\"stage\":\"b\"}\n\
                {\"type\":\"sample\",\"t\":3.0,\"rss\":9}\n\
                {\"type\":\"event\",\"t\":1.0,\"kind\":\"stage\",\"stage\":\"a\"}\n\
                {\"type\":\"sample\",\"t\":1.5,\"rss\":7}\n";
    let trace = read_trace(write(&folder, "backwards", text)).unwrap();
    assert!(trace.reordered);
    let times: Vec<f64> = trace.records.iter().filter_map(Record::t).collect();
    assert_eq!(times, [0.0, 1.0, 1.5, 2.0, 3.0]);
    let summary = summarize(&trace);
    assert_eq!(windows(&summary), [("setup", 1.0, Some(5)), ("a", 1.0, Some(7)), ("b", 1.0, Some(9))]);
    assert!(summary.stages.iter().all(|w| w.seconds >= 0.0));
    let in_order = read_trace(write(&folder, "forwards", "{\"type\":\"sample\",\"t\":0.0,\"rss\":5}\n")).unwrap();
    assert!(!in_order.reordered);
}

#[test]
fn a_second_header_and_an_absurd_time_are_refused_with_their_line() {
    let folder = tempfile::Builder::new().prefix("stageload-hostile-").tempdir().unwrap();
    let header = "{\"type\":\"header\",\"schema\":2,\"utc\":\"x\",\"pid\":1,\"host\":\"h\",\"os\":\"linux\",\"total_memory\":1,\"device\":\"cpu\",\"command\":[],\"interval\":0.25}\n";
    let sample = "{\"type\":\"sample\",\"t\":0.5,\"rss\":7}\n";
    let twice = read_trace(write(&folder, "twice", &format!("{header}{sample}{header}{sample}"))).unwrap_err();
    assert!(matches!(twice, TraceError::Broken { line: 3, .. }), "{twice}");
    assert!(twice.to_string().contains("a second header"), "{twice}");
    let absurd = format!("{header}{sample}{{\"type\":\"sample\",\"t\":1e300,\"rss\":7}}\n{sample}");
    let error = read_trace(write(&folder, "absurd", &absurd)).unwrap_err();
    assert!(error.to_string().contains("line 3") && error.to_string().contains("is outside 0 ..="), "{error}");
    let negative = format!("{header}{{\"type\":\"event\",\"t\":-4,\"kind\":\"stage\",\"stage\":\"x\"}}\n{sample}");
    assert!(read_trace(write(&folder, "negative", &negative)).unwrap_err().to_string().contains("line 2"));
    let error = read_trace(folder.path()).unwrap_err().to_string();
    assert!(error.contains("is a directory, not a regular file"), "{error}");
}

#[test]
fn sixty_thousand_stage_windows_are_summarized_in_linear_ish_time() {
    // Quadratic before: 60,000 windows took 41 s.
    let mut records = Vec::new();
    for i in 0..60_000u32 {
        let t = f64::from(i);
        records.push(stage(t, if i % 2 == 0 { "even" } else { "odd" }));
        records.push(sample(t + 0.5, u64::from(i)));
        records.push(Record::Peak(PeakRecord {
            t: t + 0.9,
            stage: String::new(),
            rss: u64::from(i) + 1,
            device: None,
        }));
    }
    let started = std::time::Instant::now();
    let summary = summary_of(records);
    let elapsed = started.elapsed();
    assert_eq!(summary.stages.len(), 60_000);
    assert_eq!(summary.stages[59_998].peak, Some(59_999), "the exact peak that closes the window");
    assert!(elapsed < std::time::Duration::from_secs(3), "{elapsed:?}");
}

mod fuzz {
    use proptest::prelude::*;

    use super::*;

    /// One line of a trace: a valid record at some time (negative and absurd included), or junk.
    fn line() -> impl Strategy<Value = String> {
        let time = prop_oneof![0.0..100.0f64, Just(-1.0), Just(1e300), Just(0.0)];
        prop_oneof![
            (time.clone(), any::<u32>()).prop_map(|(t, rss)| format!("{{\"type\":\"sample\",\"t\":{t},\"rss\":{rss}}}")),
            (time.clone(), 0..4u8).prop_map(|(t, s)| format!(
                "{{\"type\":\"event\",\"t\":{t},\"kind\":\"stage\",\"stage\":\"s{s}\"}}"
            )),
            time.clone().prop_map(|t| format!("{{\"type\":\"event\",\"t\":{t},\"kind\":\"release\",\"model\":\"m\"}}")),
            (time.clone(), any::<u32>()).prop_map(|(t, rss)| format!(
                "{{\"type\":\"peak\",\"t\":{t},\"stage\":\"s\",\"rss\":{rss}}}"
            )),
            time.prop_map(|t| format!("{{\"type\":\"end\",\"t\":{t}}}")),
            Just("{\"type\":\"header\",\"schema\":2,\"utc\":\"x\",\"pid\":1,\"host\":\"h\",\"os\":\"linux\",\"total_memory\":1,\"device\":\"cpu\",\"command\":[],\"interval\":0.25}".to_string()),
            "[ -~]{0,20}",
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

        /// Any mix of lines: an error or a time-ordered trace whose summary and table are sane.
        #[test]
        fn any_trace_gets_an_answer(lines in proptest::collection::vec(line(), 0..40)) {
            let folder = tempfile::Builder::new().prefix("stageload-fuzz-").tempdir().unwrap();
            let path = write(&folder, "fuzz", &lines.join("\n"));
            if let Ok(trace) = read_trace(&path) {
                let times: Vec<f64> = trace.records.iter().filter_map(Record::t).collect();
                prop_assert!(times.windows(2).all(|pair| pair[0] <= pair[1]));
                let summary = summarize(&trace);
                prop_assert!(summary.stages.iter().all(|w| w.seconds >= 0.0));
                let _ = table::render(&summary, &path);
            }
        }
    }
}

#[test]
fn a_load_in_the_same_millisecond_as_the_next_stage_counts_in_its_own_window() {
    let load = weights;
    let summary = summary_of(vec![
        stage(0.003, "setup"),
        load(0.040, 100),
        load(0.042, 130),
        stage(0.042, "structure"),
        load(0.098, 500),
        sample(0.1, 900),
    ]);
    let weights: Vec<(&str, Option<u64>)> = summary.stages.iter().map(|w| (w.stage.as_str(), w.weights)).collect();
    assert_eq!(weights, [("setup", Some(130)), ("structure", Some(500))]);
}

#[test]
fn a_streamed_model_shows_its_last_split_every_reason_it_changed_and_what_it_moved() {
    use stageload_trace::event::{Residency, ResidencyChanged};
    let split = |resident: usize, reason: &str| ResidencyChanged {
        model: "flow".into(),
        residency: Residency {
            blocks: 12,
            resident,
            streamed_per_step: (12 - resident) as u64 * 48 * MIB,
            hot: if resident == 1 { 20 * MIB } else { 0 },
            budget: 500 * MIB,
            working: 0,
            reason: reason.into(),
            ..Residency::default()
        },
        ..ResidencyChanged::default()
    };
    let residency = |t: f64, resident: usize, reason: &str| event(t, split(resident, reason));
    // The model went twice (released and rebuilt): its totals add up.
    let end = |t: f64, refills: u64, hot_hits: u64| {
        let mut end = split(1, "end");
        (end.bytes, end.seconds) = (Some(refills * 48 * MIB), Some(refills as f64 * 0.01));
        (end.residency.refills, end.residency.hot_hits) = (refills, hot_hits);
        event(t, end)
    };
    let summary = summary_of(vec![
        sample(0.0, 100 * MIB),
        residency(0.5, 2, "start"),
        residency(1.0, 1, "working memory"),
        end(1.5, 20, 4),
        end(1.8, 11, 0),
        sample(2.0, 400 * MIB),
    ]);
    assert_eq!(summary.streamed.len(), 1);
    let flow = &summary.streamed[0];
    assert_eq!(flow.residency.resident, 1);
    assert_eq!(flow.reasons, ["start", "working memory"], "`end` is no split change");
    assert_eq!((flow.moved.refills, flow.moved.hot_hits, flow.moved.bytes), (31, 4, 31 * 48 * MIB));
    let table = table::render(&summary, std::path::Path::new("hand.jsonl"));
    assert!(
        table.contains("streamed flow: 1 of 12 blocks resident, 11 streamed, 528.0 MiB per step, budget 500.0 MiB, hot set room 20.0 MiB (split set 2 time(s): start, working memory)"),
        "{table}"
    );
    assert!(table.contains("  read 31 block(s), 1.5 GiB at 5.03 GB/s; 4 found hot"), "{table}");
}

#[test]
fn the_host_tier_shows_its_budget_peak_stores_evictions_and_reloads_from_it() {
    use stageload_trace::event::{TierAction, TierChanged, TierUsage};
    let tier = |t: f64, model: &str, action: TierAction, detail: Option<&str>, used: u64| {
        let change = TierChanged {
            stage: Some("decode".into()),
            model: Some(model.into()),
            action,
            detail: detail.map(Into::into),
            bytes: None,
            seconds: None,
            tier: Some(TierUsage { budget: 2 * GIB, used }),
        };
        event(t, change)
    };
    let load = Loaded {
        stage: Some("encode".into()),
        model: "encoder".into(),
        bytes: Some(GIB),
        seconds: Some(0.02),
        ..Loaded::default()
    };
    let reload =
        event(3.0, Reloaded { from: ReloadFrom::HostTier, tier: Some(TierUsage { budget: 2 * GIB, used: 0 }), load });
    let summary = summary_of(vec![
        sample(0.0, 100 * MIB),
        tier(1.0, "encoder", TierAction::Stored, None, GIB),
        tier(2.0, "encoder", TierAction::Evicted, None, 0),
        tier(2.1, "decoder", TierAction::Stored, None, 2 * GIB),
        tier(
            2.2,
            "vae",
            TierAction::NotStored,
            Some("its 3.0 GiB are more than the host tier's budget of 2.0 GiB"),
            2 * GIB,
        ),
        reload,
        sample(4.0, 100 * MIB),
    ]);
    let host = summary.host_tier.clone().unwrap();
    assert_eq!((host.budget, host.peak_used, host.stored, host.evicted, host.reloads), (2 * GIB, 2 * GIB, 2, 1, 1));
    assert!((host.reload_gb_per_s - GIB as f64 / 0.02 / 1e9).abs() < 1e-9);
    let table = table::render(&summary, std::path::Path::new("hand.jsonl"));
    assert!(table.contains("host tier: budget 2.0 GiB, held at most 2.0 GiB; 2 stored, 1 evicted, 1 reload(s) from it (1.0 GiB at 53.69 GB/s)"), "{table}");
    assert!(table.contains("  not stored: vae: its 3.0 GiB are more"), "{table}");
    assert!(summary_of(vec![sample(0.0, MIB)]).host_tier.is_none(), "no tier, no line");
}
