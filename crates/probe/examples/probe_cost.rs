//! What each reading costs: `cargo run --release -p stageload-probe --example probe_cost`.
fn main() {
    let mut child = std::process::Command::new("sleep").arg("30").spawn().expect("spawn sleep");
    let (me, pid) = (std::process::id() as i32, child.id() as i32);
    let time = |name: &str, f: &mut dyn FnMut()| {
        let started = std::time::Instant::now();
        for _ in 0..2000 {
            f();
        }
        println!("{name}: {:.1} µs", started.elapsed().as_secs_f64() / 2000.0 * 1e6);
    };
    time("system_memory", &mut || drop(stageload_probe::system_memory()));
    time("process_subtree", &mut || drop(stageload_probe::process_subtree(me)));
    time("process_memory", &mut || drop(stageload_probe::process_memory(pid)));
    time("process_tree (whole table)", &mut || drop(stageload_probe::process_tree()));
    let _ = child.kill();
    let _ = child.wait();
}
