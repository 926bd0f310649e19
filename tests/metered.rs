//! A StagedModels run with the meter as its event sink: the trace has every load, release and
//! stage, and the summary's windows and peaks follow the stages. Alone in its binary: it reads
//! and resets this process's RSS high-water mark.

use std::sync::Arc;

use stageload::meter::{self, MeterOptions};
use stageload::{ModelSpec, StagedModels};
use stageload_trace::{read_trace, summarize};

use stageload_test_support::torch as support;
use support::{build_mlp, Mlp};

#[test]
fn a_metered_run_traces_loads_releases_and_stage_peaks() {
    let folder = tempfile::TempDir::new().unwrap();
    let path = folder.path().join("metered.jsonl");
    let meter =
        Arc::new(meter::start(&path, tch::Device::Cpu, MeterOptions::default().meta("mode", "staged")).unwrap());
    // Two 2048-wide MLPs: 32 MiB of weights each.
    let models = StagedModels::builder()
        .model(ModelSpec::new("encoder", |_| Ok(build_mlp(2048))))
        .model(ModelSpec::new("decoder", |_| Ok(build_mlp(2048))))
        .stage("encode", ["encoder"])
        .stage("decode", ["decoder"])
        .events(meter.clone())
        .build()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(30));
    models.enter("encode").unwrap();
    models.get::<Mlp>("encoder").unwrap();
    std::thread::sleep(std::time::Duration::from_millis(30));
    models.enter("decode").unwrap();
    models.get::<Mlp>("decoder").unwrap();
    models.mark("decoded");
    meter.finish();

    let trace = read_trace(&path).unwrap();
    let summary = summarize(&trace);
    let stages: Vec<&str> = summary.stages.iter().map(|w| w.stage.as_str()).collect();
    assert_eq!(stages, ["setup", "encode", "decode"]);
    assert_eq!((summary.loads.count, summary.releases.count), (2, 1));
    let model_bytes = 2 * (2048 * 2048 + 2048) * 4;
    assert_eq!(summary.loads.bytes, 2 * model_bytes);
    assert_eq!(summary.releases.bytes, model_bytes, "the encoder's storage was freed");
    let release_t = trace
        .records
        .iter()
        .find_map(|r| match r {
            stageload_trace::Record::Event(e) if e.kind() == stageload::EventKind::Release => Some(e.t),
            _ => None,
        })
        .unwrap();
    assert_eq!(summary.stages[2].start, release_t, "decode begins when the encoder's release is done");
    // Each stage builds its model after its window opens (the meter samples RSS at every event),
    // so its exact peak is at least that sample and the model's two weight matrices: each has a
    // mapping of its own (above the mmap threshold the registry sets), every page written by its
    // initialisation. The biases may land in heap pages the process already holds. Allowed: what
    // the kernel's per-CPU counters leave out of the sample and of the high-water mark (the
    // figures checked are those counters: the meter reads VmHWM), which must stay under a quarter
    // of what is checked, or the check could not see the matrices missing on this machine.
    let matrices = 2 * 2048 * 2048 * 4;
    let slack = 2 * stageload_probe::rss_counter_slack();
    assert!(
        slack <= matrices / 4,
        "this machine's RSS counters may be off by {slack} bytes over two readings, more than a quarter of the {matrices} checked: the check cannot tell here"
    );
    // The sample written with the last event at the window's start (its stage, or the release
    // that ends the previous window's tail).
    let opening_sample = |window: &stageload_trace::StageWindow| {
        let opening = trace
            .records
            .iter()
            .rposition(|r| matches!(r, stageload_trace::Record::Event(e) if e.t == window.start))
            .unwrap();
        match &trace.records[opening + 1] {
            stageload_trace::Record::Sample(s) if s.t == window.start => s.rss.unwrap(),
            other => panic!("{} is sampled as it opens: {other:?}", window.stage),
        }
    };
    for window in &summary.stages[1..] {
        let (opened, peak) = (opening_sample(window), window.peak.unwrap());
        eprintln!("{}: {opened} as it opened, peak {peak}, {matrices} bytes of matrices", window.stage);
        assert!(
            peak + slack >= opened + matrices,
            "{} holds its model: {opened} as it opened, peak {peak} (slack {slack})",
            window.stage
        );
    }
    assert!(
        summary.complete
            && trace
                .records
                .iter()
                .any(|r| matches!(r, stageload_trace::Record::Event(e) if e.kind() == stageload::EventKind::Mark))
    );
}
