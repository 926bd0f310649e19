//! On a CUDA machine, one run: the library's CUDA paths checked, and checkpoint → CUDA loading
//! measured beside its peers (Python's safetensors, pinned and pageable host→device copies) on
//! the same file in the same run. `cargo xtask gpu-check` runs it through the device kit.
//!
//! Checks (each a named pass/fail in the result): a checkpoint loaded into CUDA tensors through
//! the pinned ring equals the same file loaded on the CPU, bit for bit; f16 entries converted to
//! f32 on the device equal the CPU's conversion; a registry model on CUDA built without
//! initialisation draws nothing from the CUDA generator, gives the same output after a release
//! (device memory back to the allocator and the driver) and a reload in place; a model without
//! checkpoint released into a host tier comes back from it (not rebuilt) with the same output,
//! its reload's copy speed reported against the pinned host→device limit of the same run, and
//! its second store (into the tier's registered arena, registering nothing: issue 73) against
//! that limit too, with the page-locked bytes over what the tier booked; a hundred release and
//! reload cycles (a checkpointed model and a host-tier one) end with the device memory within
//! 64 MiB of its level before the first build and the resident set within 5 % of its level
//! after the first cycle, the outputs unchanged; a model the pipeline file streams runs its
//! planned split with the whole model's output, and gives its pinned host copies back when a
//! stage releases it. A group of checks that fails with an error is reported as such and the
//! others still run.
//!
//!     gpu_check --out DIR [--gib 4] [--rounds 5] [--cycles 100] [--python python3]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use clap::Parser;
use stageload::checkpoint::Checkpoint;
use stageload::event::TierAction;
use stageload::pt2::Pt2Module;
use stageload::stream::{Step, StreamError, StreamedModel};
use stageload::{BoxError, Built, EventKind, ListSink, ModelSpec, ReloadFrom, StagedModels, What};
use stageload_bench::median;
use stageload_torch_sys::{cuda_memory, generator_state, GeneratorDevice};
use tch::nn::{self, Module, VarStore};
use tch::{Device, Kind, Tensor};

#[derive(Parser)]
struct Args {
    /// Folder for the results (gpu-check.json, gpu-check.md).
    #[arg(long)]
    out: PathBuf,
    /// Folder for the checkpoints written once (default: the system's temporary folder).
    #[arg(long)]
    scratch: Option<PathBuf>,
    /// Size of the benchmark checkpoint, GiB.
    #[arg(long, default_value_t = 4)]
    gib: usize,
    /// Rounds of each measurement (alternating); medians are reported.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Release and reload cycles of the cycles check.
    #[arg(long, default_value_t = 100)]
    cycles: usize,
    /// Python with torch and safetensors, for the peers.
    #[arg(long, default_value = "python3")]
    python: String,
    /// The peers' script (crates/bench/python/bench_device.py).
    #[arg(long, default_value = "crates/bench/python/bench_device.py")]
    peer: PathBuf,
    /// The other loaders' script (crates/bench/python/bench_peers.py: InstantTensor,
    /// fastsafetensors, the Run:ai streamer, safetensors; warm and from disk), if given.
    #[arg(long)]
    peers: Option<PathBuf>,
    /// Only the speed of checkpoint → CUDA and the copy limits (no correctness checks, no
    /// peers): for comparing ring shapes (STAGELOAD_RING) in one run.
    #[arg(long)]
    load_only: bool,
    /// A folder `python/pt2_cuda.py` wrote on this machine (a CUDA AOTInductor package, its
    /// checkpoint and Python's outputs): checked as a registry model on cuda:0.
    #[arg(long)]
    pt2: Option<PathBuf>,
}

const SIDE: i64 = 8192;

/// Writes `layers` square matrices of `kind` under `layers.N.weight`.
fn write_checkpoint(path: &Path, layers: usize, kind: Kind) -> Result<(), BoxError> {
    if path.exists() {
        return Ok(());
    }
    let tensors: Vec<(String, Tensor)> = (0..layers)
        .map(|i| (format!("layers.{i}.weight"), Tensor::randn([SIDE, SIDE], (Kind::Float, Device::Cpu)).to_kind(kind)))
        .collect();
    stageload::checkpoint::save(&tensors, path)?;
    Ok(())
}

fn targets(file: &Checkpoint, kind: Option<Kind>, device: Device) -> Vec<(String, Tensor)> {
    let mut names: Vec<&String> = file.entries().keys().collect();
    names.sort();
    names
        .into_iter()
        .map(|n| (n.clone(), Tensor::empty(&file.entries()[n].shape, (kind.unwrap_or(file.entries()[n].kind), device))))
        .collect()
}

fn all_equal(a: &[(String, Tensor)], b: &[(String, Tensor)]) -> bool {
    a.iter().zip(b).all(|((_, x), (_, y))| x.to_device(Device::Cpu).equal(&y.to_device(Device::Cpu)))
}

/// GB/s of host→device copies of 1 GiB from pinned and from pageable memory.
fn copy_limits(rounds: usize, device: Device) -> (f64, f64) {
    let bytes = 1i64 << 30;
    let pinned = stageload_torch_sys::pin_memory(&Tensor::empty([bytes], (Kind::Uint8, Device::Cpu)))
        .expect("pinning 1 GiB of host memory");
    let pageable = Tensor::ones([bytes], (Kind::Uint8, Device::Cpu));
    let mut target = Tensor::empty([bytes], (Kind::Uint8, device));
    let mut rate = |source: &Tensor| {
        let mut rates = Vec::new();
        for _ in 0..rounds {
            tch::Cuda::synchronize(0);
            let started = Instant::now();
            target.copy_(source);
            tch::Cuda::synchronize(0);
            rates.push(bytes as f64 / started.elapsed().as_secs_f64() / 1e9);
        }
        median(rates)
    };
    (rate(&pinned), rate(&pageable))
}

/// Writes the freshly initialised weights of the model `build` makes to `file`.
fn save_initialised(file: &Path, build: impl FnOnce(&VarStore)) -> Result<(), BoxError> {
    let vs = VarStore::new(Device::Cpu);
    build(&vs);
    stageload::checkpoint::save(&vs.variables().into_iter().collect::<Vec<_>>(), file)?;
    Ok(())
}

struct Net(nn::Sequential);

fn net(vs: &VarStore) -> Net {
    let mut seq = nn::seq();
    for i in 0..4 {
        seq =
            seq.add(nn::linear(vs.root() / format!("l{i}"), 4096, 4096, Default::default())).add_fn(|x| x.gelu("none"));
    }
    Net(seq)
}

/// The checks' `net` on `device`, built without initial values, its weights from `file`.
fn net_spec(file: &Path, device: Device) -> ModelSpec {
    ModelSpec::new("net", move |_| {
        let vs = VarStore::new(device);
        let model = net(&vs);
        Ok(Built::new(model, &vs))
    })
    .checkpoint([file])
    .skip_init(true)
}

/// The registry on CUDA: skip-init draws nothing, release frees device memory, reload in place
/// repeats the output.
fn registry_checks(scratch: &Path, device: Device) -> Result<BTreeMap<String, serde_json::Value>, BoxError> {
    let file = scratch.join("net.safetensors");
    save_initialised(&file, |vs| drop(net(vs)))?;
    let models = StagedModels::builder()
        .model(net_spec(&file, device))
        .stage("run", ["net"])
        .stage("other", Vec::<String>::new())
        .preserve_rng(false)
        .build()?;
    let x = Tensor::ones([8, 4096], (Kind::Float, device));
    let generator = generator_state(GeneratorDevice::Cuda(0))?;
    models.enter("run")?;
    let started = Instant::now();
    models.load("net")?;
    let load_seconds = started.elapsed().as_secs_f64();
    let draws_nothing = generator_state(GeneratorDevice::Cuda(0))? == generator;
    let y = tch::no_grad(|| models.call("net", |m: &mut Net| m.0.forward(&x)))?;
    let resident = cuda_memory(0)?;
    models.enter("other")?;
    let released = cuda_memory(0)?;
    models.enter("run")?;
    let started = Instant::now();
    let again = tch::no_grad(|| models.call("net", |m: &mut Net| m.0.forward(&x)))?;
    let reload_seconds = started.elapsed().as_secs_f64();
    let bytes = models.resident_bytes();
    let mut r = BTreeMap::new();
    r.insert("skip_init_draws_nothing_on_cuda".into(), draws_nothing.into());
    r.insert("model_bytes".into(), bytes.into());
    r.insert("allocated_resident".into(), resident.allocated.into());
    r.insert("allocated_released".into(), released.allocated.into());
    r.insert("reserved_released".into(), released.reserved.into());
    r.insert(
        "release_frees_device_memory".into(),
        (resident.allocated.saturating_sub(released.allocated) >= bytes * 9 / 10).into(),
    );
    r.insert("identical_after_reload".into(), again.equal(&y).into());
    r.insert("first_load_gb_per_s".into(), (bytes as f64 / load_seconds / 1e9).into());
    r.insert("reload_in_place_gb_per_s".into(), (bytes as f64 / reload_seconds / 1e9).into());
    Ok(r)
}

/// The host tier on CUDA: a 1 GiB model without checkpoint (random weights, so only the tier or
/// a rebuild can bring it back) released into a 2 GiB tier and reloaded from it.
fn tier_checks(device: Device) -> Result<BTreeMap<String, serde_json::Value>, BoxError> {
    let sink = std::sync::Arc::new(ListSink::new());
    let layers = 16;
    let models = StagedModels::builder()
        .model(ModelSpec::new("net", move |_| {
            let vs = VarStore::new(device);
            let mut seq = nn::seq();
            for i in 0..layers {
                seq = seq.add(nn::linear(vs.root() / format!("l{i}"), 4096, 4096, Default::default()));
            }
            Ok(Built::new(Net(seq), &vs))
        }))
        .stage("run", ["net"])
        .stage("other", Vec::<String>::new())
        .host_tier(2 << 30)
        .events(sink.clone())
        .build()?;
    let x = Tensor::ones([8, 4096], (Kind::Float, device)) / 64.0;
    models.enter("run")?;
    let y = tch::no_grad(|| models.call("net", |m: &mut Net| m.0.forward(&x)))?;
    let resident = cuda_memory(0)?;
    // What the kernel counts of the store: resident set, locked and pinned pages, before and after.
    let memory = || stageload_probe::process_memory(std::process::id() as i32);
    let before_store = memory()?;
    models.enter("other")?;
    let after_store = memory()?;
    let released = cuda_memory(0)?;
    let held = models.host_tier().map_or(0, |t| t.used);
    models.enter("run")?;
    let again = tch::no_grad(|| models.call("net", |m: &mut Net| m.0.forward(&x)))?;
    // Released into the tier again, then the budget shrunk to nothing: the pinned copy's memory
    // leaves the process (libtorch's host allocator cache emptied), not just the tier.
    models.enter("other")?;
    let rss = || stageload_probe::process_memory(std::process::id() as i32).map(|m| m.rss);
    let (held_again, before) = (models.host_tier().map_or(0, |t| t.used), rss()?);
    // The page-locked memory with both stores done (the arena's pieces), before the shrink.
    let after_second = memory()?;
    models.set_host_tier_budget(0)?;
    let after = rss()?;
    let tier = sink.of_kind(EventKind::Tier);
    let stores: Vec<_> =
        tier.iter().filter(|e| matches!(&e.what, What::Tier(t) if t.action == TierAction::Stored)).collect();
    let stored = stores.first().copied();
    // Where a store did not go into the registered arena, its event says why.
    let not_in_arena: Vec<String> = stores
        .iter()
        .filter_map(|e| match &e.what {
            What::Tier(t) => t.detail.clone(),
            _ => None,
        })
        .collect();
    let reload = sink.of_kind(EventKind::Reload).pop();
    let rate = |bytes: Option<u64>, seconds: Option<f64>| match (bytes, seconds) {
        (Some(bytes), Some(seconds)) if seconds > 0.0 => bytes as f64 / seconds / 1e9,
        _ => f64::NAN,
    };
    let mut r = BTreeMap::new();
    r.insert("tier_stored_on_release".into(), (stored.is_some() && held > 0).into());
    r.insert(
        "tier_release_frees_device_memory".into(),
        (resident.allocated.saturating_sub(released.allocated) >= held * 9 / 10).into(),
    );
    r.insert(
        "tier_reload_from_tier".into(),
        reload.as_ref().is_some_and(|e| e.reload_from() == Some(ReloadFrom::HostTier)).into(),
    );
    r.insert("tier_identical_after_reload".into(), again.equal(&y).into());
    r.insert("tier_held_bytes".into(), held.into());
    // #30 part 2: what the store took as the kernel counts it, against what the tier booked
    // (goal 0.98-1.02): the resident set's growth, and VmLck / VmPin where the driver counts them.
    let grew = |f: fn(&stageload_probe::ProcessMemory) -> Option<u64>| {
        f(&after_store).zip(f(&before_store)).map(|(a, b)| a.saturating_sub(b))
    };
    let rss_growth = after_store.rss.saturating_sub(before_store.rss);
    r.insert("tier_store_rss_growth_bytes".into(), rss_growth.into());
    r.insert("tier_store_rss_growth_over_booked".into(), (rss_growth as f64 / held.max(1) as f64).into());
    r.insert("tier_store_vmlck_growth_bytes".into(), grew(|m| m.locked).into());
    r.insert("tier_store_vmpin_growth_bytes".into(), grew(|m| m.pinned).into());
    r.insert(
        "tier_shrink_gives_pinned_memory_back".into(),
        (before.saturating_sub(after) >= held_again * 9 / 10).into(),
    );
    r.insert("tier_shrink_rss_drop_bytes".into(), before.saturating_sub(after).into());
    r.insert("tier_store_gb_per_s".into(), stored.map_or(f64::NAN, |e| rate(e.bytes(), e.seconds())).into());
    // Issue 73: the second store goes into the memory the first registered (the copy only);
    // its ratio to the pinned limit is added once that is measured (`main`).
    let again = stores.get(1).copied();
    r.insert("tier_second_store_gb_per_s".into(), again.map_or(f64::NAN, |e| rate(e.bytes(), e.seconds())).into());
    r.insert("tier_stores_in_arena".into(), not_in_arena.is_empty().into());
    // No CUDA error left for the next kernel launch's check (a registration that failed clears it).
    r.insert("tier_leaves_no_cuda_error".into(), (stageload_torch_sys::clear_cuda_error()? == Some(0)).into());
    if !not_in_arena.is_empty() {
        r.insert("tier_stores_not_in_arena".into(), not_in_arena.into());
    }
    // Page-locked bytes the two stores left (the arena's pieces) over what the tier booked.
    let locked = [after_second.locked, after_second.pinned, before_store.locked, before_store.pinned];
    if let [Some(lck), Some(pin), Some(lck0), Some(pin0)] = locked {
        let grew = lck.saturating_sub(lck0).max(pin.saturating_sub(pin0));
        r.insert("tier_locked_growth_bytes".into(), grew.into());
        r.insert("tier_locked_over_booked".into(), (grew as f64 / held_again.max(1) as f64).into());
    }
    r.extend(store_parts(device)?);
    r.insert("tier_reload_gb_per_s".into(), reload.map_or(f64::NAN, |e| rate(e.bytes(), e.seconds())).into());
    Ok(r)
}

/// Issue 73's hundred cycles: a checkpointed model (256 MiB, reloaded in place from its file)
/// and a model without checkpoint (1 GiB, through a 2 GiB host tier) released and reloaded
/// `cycles` times. Device memory after the last release against its level before the first
/// build (goal: within 64 MiB), the resident set after the last against after the first (goal:
/// within 5 %), the outputs of the last cycle against the first's.
fn cycle_checks(
    scratch: &Path,
    device: Device,
    cycles: usize,
) -> Result<BTreeMap<String, serde_json::Value>, BoxError> {
    let file = scratch.join("net.safetensors");
    save_initialised(&file, |vs| drop(net(vs)))?;
    let _ = stageload_torch_sys::cuda_empty_cache();
    let device_before = cuda_memory(0)?;
    let models = StagedModels::builder()
        .model(net_spec(&file, device))
        .model(ModelSpec::new("big", move |_| {
            let vs = VarStore::new(device);
            let mut seq = nn::seq();
            for i in 0..16 {
                seq = seq.add(nn::linear(vs.root() / format!("l{i}"), 4096, 4096, Default::default()));
            }
            Ok(Built::new(Net(seq), &vs))
        }))
        .stage("run", ["net", "big"])
        .stage("other", Vec::<String>::new())
        .host_tier(2 << 30)
        .build()?;
    let x = Tensor::ones([8, 4096], (Kind::Float, device)) / 64.0;
    let rss = || stageload_probe::process_memory(std::process::id() as i32).map(|m| m.rss);
    let mut first: Option<(Tensor, Tensor, u64)> = None;
    let mut last = None;
    let started = Instant::now();
    for _ in 0..cycles {
        models.enter("run")?;
        let a = tch::no_grad(|| models.call("net", |m: &mut Net| m.0.forward(&x)))?;
        let b = tch::no_grad(|| models.call("big", |m: &mut Net| m.0.forward(&x)))?;
        models.enter("other")?;
        match first {
            None => first = Some((a, b, rss()?)),
            Some(_) => last = Some((a, b)),
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    let device_after = cuda_memory(0)?;
    let rss_after = rss()?;
    let (a0, b0, rss_first) = first.ok_or("no cycle ran")?;
    let same = last.is_none_or(|(a, b)| a.equal(&a0) && b.equal(&b0));
    let grew = |after: i64, before: i64| after.saturating_sub(before);
    let reserved_growth = grew(device_after.reserved as i64, device_before.reserved as i64);
    let allocated_growth = grew(device_after.allocated as i64, device_before.allocated as i64);
    let mut r = BTreeMap::new();
    r.insert("cycles".into(), cycles.into());
    r.insert("cycles_seconds".into(), seconds.into());
    r.insert("cycles_device_reserved_growth_bytes".into(), reserved_growth.into());
    r.insert("cycles_device_allocated_growth_bytes".into(), allocated_growth.into());
    r.insert("cycles_device_within_64mib".into(), (reserved_growth.max(allocated_growth) <= 64 << 20).into());
    r.insert("cycles_rss_after_first_bytes".into(), rss_first.into());
    r.insert("cycles_rss_after_last_bytes".into(), rss_after.into());
    r.insert("cycles_rss_over_first".into(), (rss_after as f64 / rss_first.max(1) as f64).into());
    r.insert("cycles_rss_within_5_percent".into(), (rss_after as f64 <= rss_first as f64 * 1.05).into());
    r.insert("cycles_identical_outputs".into(), same.into());
    Ok(r)
}

/// What a host-tier store of 1 GiB is made of: mapping and page-locking the buffer
/// (`host_buffer`), the device → host copy into it the first time (its pages new) and again.
fn store_parts(device: Device) -> Result<BTreeMap<String, serde_json::Value>, BoxError> {
    let bytes = 1usize << 30;
    let source = Tensor::ones([bytes as i64], (Kind::Uint8, device));
    let timed = |f: &mut dyn FnMut() -> Result<(), BoxError>| -> Result<f64, BoxError> {
        tch::Cuda::synchronize(0);
        let started = Instant::now();
        f()?;
        tch::Cuda::synchronize(0);
        Ok(started.elapsed().as_secs_f64())
    };
    let mut r = BTreeMap::new();
    for (name, pin) in [("registered", true), ("pageable", false)] {
        let mut buffer = None;
        let map = timed(&mut || {
            buffer = Some(stageload_torch_sys::host_buffer(bytes, pin)?.0);
            Ok(())
        })?;
        let buffer = buffer.ok_or("no buffer")?;
        let first = timed(&mut || Ok(stageload_torch_sys::copy_async(&buffer, &source)?))?;
        let again = timed(&mut || Ok(stageload_torch_sys::copy_async(&buffer, &source)?))?;
        r.insert(format!("store_1gib_{name}_map_seconds"), map.into());
        r.insert(format!("store_1gib_{name}_first_copy_gb_per_s"), (bytes as f64 / first / 1e9).into());
        r.insert(format!("store_1gib_{name}_again_copy_gb_per_s"), (bytes as f64 / again / 1e9).into());
    }
    Ok(r)
}

/// Eight 64 MiB blocks, streamed.
struct Blocks(Vec<nn::Linear>);

fn blocks(vs: &VarStore) -> Blocks {
    Blocks((0..8).map(|i| nn::linear(vs.root() / "blocks" / i, 4096, 4096, Default::default())).collect())
}

impl Blocks {
    fn forward(&self, x: &Tensor, step: Option<&mut Step<'_>>) -> Result<Tensor, StreamError> {
        let mut x = x.shallow_clone();
        let mut step = step;
        for (i, block) in self.0.iter().enumerate() {
            if let Some(step) = step.as_deref_mut() {
                step.block(i)?;
            }
            x = block.forward(&x).gelu("none");
        }
        Ok(x)
    }
}

/// A model the pipeline file streams on CUDA, inside the registry: the file's split (2 of 8
/// blocks resident under 330 MiB with 64 MiB working memory), the same output as the model whole, its pinned host copies
/// given back to the OS when a stage releases it, the same output again once rebuilt.
fn streamed_registry_checks(scratch: &Path, device: Device) -> Result<BTreeMap<String, serde_json::Value>, BoxError> {
    let file = scratch.join("blocks.safetensors");
    save_initialised(&file, |vs| drop(blocks(vs)))?;
    let x = Tensor::ones([8, 4096], (Kind::Float, device)) / 64.0;
    let whole = {
        let mut vs = VarStore::new(device);
        let model = blocks(&vs);
        vs.load(&file)?;
        tch::no_grad(|| model.forward(&x, None))?
    };
    let entry = format!(
        "files = [\"blocks.safetensors\"]\ndevice = \"{}\"\n\
         stream = {{ blocks = [\"blocks.*\"], budget = \"330MiB\", working = \"64MiB\" }}",
        stageload::device::name(device)
    );
    let pipeline = run_other_run(&scratch.join("streamed.toml"), "flow", &entry)?;
    let planned = pipeline.models[0].streamed.clone().ok_or("the file streams flow")?;
    struct Flow(Blocks, StreamedModel);
    let models = StagedModels::builder()
        .pipeline(&pipeline)
        .model(ModelSpec::new("flow", |ctx| {
            let plan = ctx.stream().ok_or("the file streams flow")?;
            let vs = VarStore::new(Device::Cpu);
            let model = stageload_torch_sys::without_fills(|| blocks(&vs));
            let tensors = stageload::named_tensors(&vs);
            stageload::stream::place("flow", &tensors, ctx.device().unwrap_or(Device::Cpu))?;
            let streamed = StreamedModel::planned("flow", tensors, plan)?;
            let tensors = streamed.tensors();
            Ok(Built::from_tensors(Flow(model, streamed), tensors))
        }))
        .build()?;
    let run = || -> Result<(Tensor, usize), BoxError> {
        let (y, resident) = models.call("flow", |m: &mut Flow| {
            let y = tch::no_grad(|| m.1.run(|step| m.0.forward(&x, Some(step))));
            (y, m.1.split().resident)
        })?;
        Ok((y?, resident))
    };
    let rss = || stageload_probe::process_memory(std::process::id() as i32).map(|m| m.rss);
    models.enter("run")?;
    let (y, resident) = run()?;
    let counted = models.resident_bytes();
    let before = rss()?;
    models.enter("other")?;
    let after = rss()?;
    models.enter("run")?;
    let (again, _) = run()?;
    let host_copies = planned.host_copies;
    let mut r = BTreeMap::new();
    r.insert("streamed_keeps_the_planned_blocks".into(), (resident == planned.resident_blocks).into());
    r.insert("streamed_equals_whole_on_cuda".into(), y.equal(&whole).into());
    r.insert("streamed_counted_as_planned".into(), (counted == planned.held).into());
    r.insert(
        "streamed_release_gives_pinned_copies_back".into(),
        (before.saturating_sub(after) >= host_copies * 9 / 10).into(),
    );
    r.insert("streamed_release_rss_drop_bytes".into(), before.saturating_sub(after).into());
    r.insert("streamed_identical_after_rebuild".into(), again.equal(&y).into());
    Ok(r)
}

/// An AOTInductor package compiled for CUDA (`python/pt2_cuda.py`, in `dir`) as a registry model
/// on cuda:0, placed there by a pipeline file: the output of Python's own loader on the same
/// package and weights bit for bit (where it ran), within float error of the eager module's; its constants' device memory counted by the meter when
/// loaded, freed by a release, back with a reload in place (no rebuild), the same output again.
fn pt2_checks(dir: &Path) -> Result<BTreeMap<String, serde_json::Value>, BoxError> {
    let pipeline = run_other_run(&dir.join("pt2.toml"), "mlp", "files = [\"mlp.safetensors\"]\ndevice = \"cuda:0\"")?;
    let sink = std::sync::Arc::new(ListSink::new());
    let models = StagedModels::builder()
        .pipeline(&pipeline)
        .model(ModelSpec::pt2("mlp", dir.join("mlp.pt2"), [dir.join("mlp.safetensors")]))
        .events(sink.clone())
        .build()?;
    let mut io: BTreeMap<String, Tensor> =
        Tensor::read_safetensors(dir.join("mlp.io.safetensors"))?.into_iter().collect();
    let (Some(x), Some(eager)) = (io.remove("x0"), io.remove("eager0")) else {
        return Err("mlp.io.safetensors lacks x0 or eager0".into());
    };
    let x = x.to_device(Device::Cuda(0));
    // Python's loader's output, if it ran to the end.
    let python =
        Tensor::read_safetensors(dir.join("mlp.python.safetensors")).ok().and_then(|mut t| t.pop()).map(|t| t.1);
    let forward = || -> Result<Tensor, BoxError> {
        Ok(models.call("mlp", |m: &mut Pt2Module| m.forward(&[&x]))??.remove(0).to_device(Device::Cpu))
    };
    let timed_load = || -> Result<f64, BoxError> {
        tch::Cuda::synchronize(0);
        let started = Instant::now();
        models.load("mlp")?;
        tch::Cuda::synchronize(0);
        Ok(started.elapsed().as_secs_f64())
    };
    let before = cuda_memory(0)?;
    models.enter("run")?;
    let load_seconds = timed_load()?;
    let y = forward()?;
    let resident = cuda_memory(0)?;
    let bytes = models.resident_bytes();
    models.enter("other")?;
    let released = cuda_memory(0)?;
    models.enter("run")?;
    let reload_seconds = timed_load()?;
    let again = forward()?;
    let reload = sink.of_kind(EventKind::Reload).pop();
    let mut r = BTreeMap::new();
    r.insert("pt2_constant_bytes".into(), bytes.into());
    match python {
        Some(python) => r.insert("pt2_equals_python_loader".into(), y.equal(&python).into()),
        None => r.insert("pt2_python_loader".into(), "did not run to the end (see the log)".into()),
    };
    r.insert("pt2_max_diff_to_eager".into(), (&y - &eager).abs().max().double_value(&[]).into());
    r.insert(
        "pt2_weights_visible_to_device_meter".into(),
        (resident.allocated.saturating_sub(before.allocated) >= bytes).into(),
    );
    r.insert("pt2_allocated_resident".into(), resident.allocated.into());
    r.insert("pt2_allocated_released".into(), released.allocated.into());
    r.insert("pt2_reserved_released".into(), released.reserved.into());
    r.insert(
        "pt2_release_frees_device_memory".into(),
        (resident.allocated.saturating_sub(released.allocated) >= bytes).into(),
    );
    r.insert("pt2_reload_in_place".into(), reload.is_some_and(|e| e.reload_from() == Some(ReloadFrom::InPlace)).into());
    r.insert("pt2_identical_after_reload".into(), again.equal(&y).into());
    r.insert("pt2_first_load_gb_per_s".into(), (bytes as f64 / load_seconds / 1e9).into());
    r.insert("pt2_reload_gb_per_s".into(), (bytes as f64 / reload_seconds / 1e9).into());
    if let Ok(compiled) = std::fs::read(dir.join("mlp.json")) {
        r.insert("pt2_compiled".into(), serde_json::from_slice(&compiled).unwrap_or_default());
    }
    Ok(r)
}

/// Writes and reads the pipeline file `path`: model `model` (its entry's other lines `entry`,
/// files relative to the file's folder) in stages `run`, `other` (empty) and `run` again.
fn run_other_run(path: &Path, model: &str, entry: &str) -> Result<stageload::Pipeline, BoxError> {
    let stage = |name: &str, models: &str| format!("[[stages]]\nname = \"{name}\"\nmodels = [{models}]\n");
    let listed = format!("\"{model}\"");
    let text = format!(
        "[[models]]\nname = \"{model}\"\n{entry}\n\n{}\n{}\n{}",
        stage("run", &listed),
        stage("other", ""),
        stage("run", &listed)
    );
    std::fs::write(path, text)?;
    Ok(stageload::Pipeline::load(path)?)
}

/// A group of checks; an error becomes `<group>_error` in the result, and the rest still run.
fn checks(
    result: &mut BTreeMap<String, serde_json::Value>,
    group: &str,
    run: impl FnOnce() -> Result<BTreeMap<String, serde_json::Value>, BoxError>,
) {
    match run() {
        Ok(values) => result.extend(values),
        Err(err) => {
            eprintln!("{group}: {err}");
            result.insert(format!("{group}_error"), err.to_string().into());
            result.insert(format!("{group}_ran"), false.into());
        }
    }
}

/// The CUDA paths checked: the pinned ring against the CPU path (same kind, and f16 converted
/// to f32 on the device), then the registry, the host tier, `cycles` release and reload cycles
/// and a streamed model in the registry.
fn correctness(
    cycles: usize,
    file: &Checkpoint,
    on_cuda: &[(String, Tensor)],
    half: &Path,
    scratch: &Path,
    device: Device,
    result: &mut BTreeMap<String, serde_json::Value>,
) -> Result<(), BoxError> {
    let on_cpu = targets(file, None, Device::Cpu);
    file.load_into(on_cuda, |_| {})?;
    file.load_into(&on_cpu, |_| {})?;
    result.insert("cuda_load_equals_cpu_load".into(), all_equal(on_cuda, &on_cpu).into());
    drop(on_cpu);
    let halves = Checkpoint::open(&[half])?;
    let converted_cuda = targets(&halves, Some(Kind::Float), device);
    let converted_cpu = targets(&halves, Some(Kind::Float), Device::Cpu);
    halves.load_into(&converted_cuda, |_| {})?;
    halves.load_into(&converted_cpu, |_| {})?;
    result.insert("f16_to_f32_on_device_equals_cpu".into(), all_equal(&converted_cuda, &converted_cpu).into());
    drop((converted_cuda, converted_cpu));
    checks(result, "registry", || registry_checks(scratch, device));
    checks(result, "tier", || tier_checks(device));
    checks(result, "cycles", || cycle_checks(scratch, device, cycles));
    checks(result, "streamed_registry", || streamed_registry_checks(scratch, device));
    Ok(())
}

fn main() -> Result<(), BoxError> {
    stageload_demo_kit::logging::init();
    let args = Args::parse();
    if stageload_torch_sys::cuda_device_count().unwrap_or(0) == 0 {
        eprintln!("gpu_check needs a CUDA device; this machine has none");
        std::process::exit(2);
    }
    let device = Device::Cuda(0);
    std::fs::create_dir_all(&args.out)?;
    let scratch = args.scratch.clone().unwrap_or_else(std::env::temp_dir).join("stageload-gpu-check");
    std::fs::create_dir_all(&scratch)?;
    let big = scratch.join(format!("f32-{}gib.safetensors", args.gib));
    let half = scratch.join("f16-512mib.safetensors");
    let started = Instant::now();
    write_checkpoint(&big, args.gib * 4, Kind::Float)?;
    write_checkpoint(&half, 4, Kind::Half)?;
    println!("checkpoints written in {:.1} s", started.elapsed().as_secs_f64());

    let mut result: BTreeMap<String, serde_json::Value> = BTreeMap::new();
    let shape = stageload::checkpoint::RingShape::get();
    result.insert(
        "ring".into(),
        format!("slots={},window={},readers={}", shape.slots, shape.window, shape.readers).into(),
    );
    let file = Checkpoint::open(&[&big])?;
    let on_cuda = targets(&file, None, device);
    if !args.load_only {
        correctness(args.cycles, &file, &on_cuda, &half, &scratch, device, &mut result)?;
    }
    if let Some(dir) = &args.pt2 {
        checks(&mut result, "pt2", || pt2_checks(dir));
    }

    // Speed: checkpoint → CUDA (targets allocated once), then the peers, alternating.
    let bytes = std::fs::metadata(&big)?.len() as f64;
    let mut stageload_rates = Vec::new();
    for _ in 0..args.rounds {
        tch::Cuda::synchronize(0);
        let started = Instant::now();
        Checkpoint::open(&[&big])?.load_into(&on_cuda, |_| {})?;
        tch::Cuda::synchronize(0);
        stageload_rates.push(bytes / started.elapsed().as_secs_f64() / 1e9);
    }
    // From disk: the file's pages dropped from the page cache before each round (fsync'd first,
    // so that none is dirty), as the peers' script does.
    let mut cold_rates = Vec::new();
    if !args.load_only {
        std::fs::File::open(&big)?.sync_all()?;
        for _ in 0..args.rounds.min(3) {
            let opened = Checkpoint::open(&[&big])?;
            opened.drop_cached(opened.entries().keys().map(String::as_str))?;
            tch::Cuda::synchronize(0);
            let started = Instant::now();
            opened.load_into(&on_cuda, |_| {})?;
            tch::Cuda::synchronize(0);
            cold_rates.push(bytes / started.elapsed().as_secs_f64() / 1e9);
        }
    }
    drop(on_cuda);
    let _ = stageload_torch_sys::cuda_empty_cache();
    let (pinned, pageable) = copy_limits(args.rounds, device);
    let peers: serde_json::Value = match args.load_only {
        true => "not run (--load-only)".into(),
        false => match Command::new(&args.python).arg(&args.peer).arg(&big).arg(args.rounds.to_string()).output() {
            Ok(out) if out.status.success() => {
                serde_json::from_slice(&out.stdout).unwrap_or_else(|e| format!("unreadable: {e}").into())
            }
            Ok(out) => format!("failed: {}", String::from_utf8_lossy(&out.stderr)).into(),
            Err(e) => format!("not run: {e}").into(),
        },
    };
    let others: serde_json::Value = match (&args.peers, args.load_only) {
        (Some(script), false) => {
            match Command::new(&args.python).arg(script).arg(&big).arg(args.rounds.min(3).to_string()).output() {
                Ok(out) if out.status.success() => {
                    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| format!("unreadable: {e}").into())
                }
                Ok(out) => format!("failed: {}", String::from_utf8_lossy(&out.stderr)).into(),
                Err(e) => format!("not run: {e}").into(),
            }
        }
        _ => "not run".into(),
    };
    let stageload_rate = median(stageload_rates.clone());
    result.insert("checkpoint_gib".into(), args.gib.into());
    result.insert("stageload_to_cuda_gb_per_s".into(), stageload_rate.into());
    result.insert("stageload_rounds_gb_per_s".into(), stageload_rates.into());
    result.insert("pinned_h2d_gb_per_s".into(), pinned.into());
    result.insert("pageable_h2d_gb_per_s".into(), pageable.into());
    result.insert("stageload_over_pinned_limit".into(), (stageload_rate / pinned).into());
    for (rate, ratio) in [
        ("tier_reload_gb_per_s", "tier_reload_over_pinned_limit"),
        ("tier_store_gb_per_s", "tier_store_over_pinned_limit"),
        ("tier_second_store_gb_per_s", "tier_second_store_over_pinned_limit"),
    ] {
        if let Some(gb_per_s) = result.get(rate).and_then(|v| v.as_f64()) {
            result.insert(ratio.into(), (gb_per_s / pinned).into());
        }
    }
    result.insert("python".into(), peers.clone());
    if !cold_rates.is_empty() {
        let cold = median(cold_rates.clone());
        result.insert("stageload_cold_to_cuda_gb_per_s".into(), cold.into());
        result.insert("stageload_cold_rounds_gb_per_s".into(), cold_rates.into());
        result.insert("stageload_cold_over_pinned_limit".into(), (cold / pinned).into());
    }
    // Each other loader, warm and from disk: its rate over the pinned limit, and ours over it.
    if let Some(loaders) = others.as_object() {
        let cold = result.get("stageload_cold_to_cuda_gb_per_s").and_then(|v| v.as_f64());
        let mut ratios = serde_json::Map::new();
        for (name, entry) in loaders.iter().filter(|(_, e)| e.is_object()) {
            let field = |key: &str| entry.get(key).and_then(|v| v.as_f64());
            let (warm_peer, cold_peer) = (field("warm_gb_per_s"), field("cold_gb_per_s"));
            ratios.insert(
                name.clone(),
                serde_json::json!({
                    "warm_over_pinned": warm_peer.map(|r| r / pinned),
                    "cold_over_pinned": cold_peer.map(|r| r / pinned),
                    "stageload_over_it_warm": warm_peer.map(|r| stageload_rate / r),
                    "stageload_over_it_cold": cold_peer.zip(cold).map(|(r, c)| c / r),
                }),
            );
        }
        result.insert("loaders_ratios".into(), ratios.into());
    }
    result.insert("loaders".into(), others);
    if let Some(best) =
        ["load_file_cuda", "load_file_then_to_cuda"].iter().filter_map(|k| peers.get(k)?.as_f64()).reduce(f64::max)
    {
        result.insert("stageload_over_best_python".into(), (stageload_rate / best).into());
    }
    let text = serde_json::to_string_pretty(&result)?;
    std::fs::write(args.out.join("gpu-check.json"), &text)?;
    println!("{text}");
    let failed: Vec<&String> = result.iter().filter(|(_, v)| v.as_bool() == Some(false)).map(|(k, _)| k).collect();
    if !failed.is_empty() {
        eprintln!("failed: {failed:?}");
        std::process::exit(1);
    }
    Ok(())
}
