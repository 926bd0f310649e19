//! A torch-free stand-in for a staged run, metered: each stage allocates and touches a block,
//! holds it, then frees it as the next stage begins. Shows the meter's API without libtorch, and
//! serves the tests that kill a metered run.
//!
//! `cargo run -p stageload-trace --example metered_stages -- --trace run.jsonl --stages 3`

use std::time::{Duration, Instant};

use stageload_trace::event::{Entered, Loaded, Released};
use stageload_trace::{Meter, MeterOptions};

fn main() {
    let mut args = std::env::args().skip(1);
    let (mut trace, mut stages, mut block_mib, mut hold_ms) = ("metered.jsonl".to_string(), 3usize, 64usize, 300u64);
    while let Some(flag) = args.next() {
        let mut value = || args.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--trace" => trace = value(),
            "--stages" => stages = value().parse().expect("--stages N"),
            "--block-mib" => block_mib = value().parse().expect("--block-mib N"),
            "--hold-ms" => hold_ms = value().parse().expect("--hold-ms N"),
            other => panic!("unknown flag {other} (--trace FILE, --stages N, --block-mib N, --hold-ms N)"),
        }
    }
    let meter = Meter::start(&trace, MeterOptions::default().meta("mode", "demo")).expect("start the meter");
    let mut held: Option<Vec<u8>> = None;
    for index in 0..stages {
        let name = format!("stage_{index}");
        meter.event(Instant::now(), Entered::new(name.clone()).into());
        if let Some(block) = held.take() {
            let bytes = block.len() as u64;
            drop(block);
            let release = Released { model: format!("block_{}", index - 1), bytes: Some(bytes), ..Released::default() };
            meter.event(Instant::now(), release.into());
        }
        let started = Instant::now();
        let mut block = vec![0u8; block_mib << 20];
        for page in block.chunks_mut(4096) {
            page[0] = 1;
        }
        let load = Loaded {
            stage: Some(name),
            model: format!("block_{index}"),
            bytes: Some(block.len() as u64),
            seconds: Some(started.elapsed().as_secs_f64()),
            ..Loaded::default()
        };
        meter.event(Instant::now(), load.into());
        held = Some(block);
        std::thread::sleep(Duration::from_millis(hold_ms));
    }
    meter.finish();
    println!("trace written to {trace}");
}
