//! A StagedModels run with the meter as its event sink: the trace has every load, release and
//! stage, and the summary's windows and peaks follow the stages. Alone in its binary: it reads
//! and resets this process's RSS high-water mark.

use std::sync::Arc;

use stageload::meter::{self, MeterOptions};
use stageload::{ModelSpec, StagedModels};
use stageload_trace::{read_trace, summarize};

mod common;
use common::{build_mlp, Mlp};

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
            stageload_trace::Record::Event(e) if e.kind == stageload::EventKind::Release => Some(e.t),
            _ => None,
        })
        .unwrap();
    assert_eq!(summary.stages[2].start, release_t, "decode begins when the encoder's release is done");
    let setup = summary.stages[0].peak.unwrap();
    let encode = summary.stages[1].peak.unwrap();
    assert!(encode >= setup + model_bytes * 9 / 10, "encode holds the encoder: {setup} -> {encode}");
    assert!(
        summary.complete
            && trace
                .records
                .iter()
                .any(|r| matches!(r, stageload_trace::Record::Event(e) if e.kind == stageload::EventKind::Mark))
    );
}
