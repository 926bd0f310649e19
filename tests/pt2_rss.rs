//! AOTInductor packages' release and reload measured on the process RSS. A binary of its own, so
//! that no other test allocates or frees memory between the readings; its two tests take turns.
//! The packages are those of `tests/pt2.rs` (compiled by `scripts/setup-reference.sh`).

use std::path::PathBuf;
use std::sync::Mutex;

use stageload::pt2::Pt2Module;
use stageload::{ModelSpec, StagedModels};
use stageload_test_support::torch::{assert_rss_moved, rss_bytes, rss_slack};
use tch::Tensor;

/// One test at a time: each reads the process's RSS.
static ONE: Mutex<()> = Mutex::new(());

fn path(name: &str) -> PathBuf {
    let dir = std::env::var("STAGELOAD_PT2_FIXTURES").unwrap_or_else(|_| {
        panic!(
            "STAGELOAD_PT2_FIXTURES is not set: run through cargo xtask test, or first: \
             eval \"$(scripts/setup-libtorch.sh)\"; eval \"$(scripts/setup-reference.sh)\""
        )
    });
    PathBuf::from(dir).join(name)
}

/// Model `name` alone in stage `run`, stage `other` empty, and its first input.
fn registry(name: &str) -> (StagedModels, Tensor) {
    let spec = ModelSpec::pt2(name, path(&format!("{name}.pt2")), [path(&format!("{name}.safetensors"))]);
    let models = StagedModels::builder().model(spec).stage("run", [name]).stage("other", Vec::<String>::new()).build();
    let io = Tensor::read_safetensors(path(&format!("{name}.io.safetensors"))).unwrap();
    let x = io.into_iter().find(|(n, _)| n == "x0").unwrap().1;
    (models.unwrap(), x)
}

fn forward(models: &StagedModels, name: &str, x: &Tensor) -> Tensor {
    models.call(name, |m: &mut Pt2Module| m.forward(&[x]).unwrap().remove(0)).unwrap()
}

#[test]
fn a_released_package_gives_its_weights_back_and_a_reload_brings_them_back_with_the_same_output() {
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    let (models, x) = registry("wide");
    models.enter("run").unwrap();
    let before = forward(&models, "wide", &x);
    // What RSS must move by: the two 2048x2048 f32 matrices, each in a mapping of its own (above
    // the mmap threshold the registry sets), unmapped by the release and mapped and filled again
    // by the reload; the biases live in the heap, which may keep their pages. Allowed: what the
    // code between the readings may touch or free beside them, capped at a quarter of the
    // matrices (`assert_rss_moved`, `rss_slack`).
    let matrices = 2 * 2048 * 2048 * 4;

    let resident = rss_bytes();
    models.enter("other").unwrap();
    let released = rss_bytes();
    assert_rss_moved("fell", resident - released, matrices);
    models.enter("run").unwrap();
    let after = forward(&models, "wide", &x);
    assert_rss_moved("came back", rss_bytes() - released, matrices);
    assert!(after.equal(&before), "the same output after the reload in place");
}

#[test]
fn a_thousand_release_and_reload_cycles_do_not_grow_rss() {
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    const CYCLES: i64 = 1000;
    let (models, x) = registry("mlp");
    let cycle = || {
        models.enter("run").unwrap();
        let y = forward(&models, "mlp", &x);
        models.enter("other").unwrap();
        y
    };
    // The allocator's free lists and the registry's own bookkeeping settle in the first cycles.
    let first = cycle();
    models.enter("run").unwrap();
    models.load("mlp").unwrap();
    let weight_bytes = models.resident_bytes() as i64;
    assert!(weight_bytes > 64 << 10, "the mlp's weights: {weight_bytes} bytes");
    models.enter("other").unwrap();
    for _ in 0..10 {
        let _ = cycle();
    }
    let start = rss_bytes();
    for _ in 0..CYCLES {
        assert!(cycle().equal(&first), "every reload gives the same output");
    }
    let grown = rss_bytes() - start;
    eprintln!("RSS grew by {grown} bytes over {CYCLES} cycles");
    // libtorch 2.13's runner keeps one `at::Tensor` handle per constant per registration and
    // never frees it (fixed upstream after 2.13); each is a heap chunk of glibc's smallest size,
    // 32 bytes. Allowed: those handles for the four constants at every cycle, and what else the
    // cycles may touch beside the weights (`rss_slack`), capped at a quarter of the weights over
    // the run. The weights themselves (66 KiB a cycle, 66 MiB over the run) must not grow it.
    let handles = 4 * CYCLES * 32;
    let weights = CYCLES * weight_bytes;
    let slack = rss_slack(weights);
    assert!(grown <= handles + slack, "RSS grew by {grown} bytes over {CYCLES} cycles (allowed {handles} + {slack})");
}
