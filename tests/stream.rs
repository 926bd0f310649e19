//! Block streaming on the CPU with real libtorch and a real checkpoint: outputs bit-identical to
//! the fully resident model for 0, 1, half and all blocks streamed, never more than the resident
//! prefix and two slots filled, eviction when activations do not fit (out of memory, or measured
//! working memory over the budget), and bad input refused with names and sizes.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use stageload::checkpoint::Checkpoint;
use stageload::stream::{BlockSpec, DirectReads, Step, StreamError, StreamStats, StreamedModel};
use stageload::{EventKind, ListSink, NameRules};
use stageload_test_support::torch as support;
use tch::nn::{self, VarStore};
use tch::{Device, Kind, Tensor};

const WIDTH: i64 = 128;
const DEPTH: usize = 8;
/// Bytes of one block's tensors: two WIDTH×WIDTH weights and their biases, f32.
const BLOCK_TENSORS: u64 = (2 * WIDTH * WIDTH + 2 * WIDTH) as u64 * 4;
/// Bytes one block counts for in a split: its tensors, and the room a slot keeps to lay them out
/// at their file phase.
const BLOCK: u64 = BLOCK_TENSORS + stageload_plan::split::FILE_PHASE_ROOM;
/// Bytes of the tensors in no block: input and output layers.
const FIXED: u64 = 2 * (WIDTH * WIDTH + WIDTH) as u64 * 4;

#[derive(Debug)]
struct Net {
    input: nn::Linear,
    blocks: Vec<(nn::Linear, nn::Linear)>,
    output: nn::Linear,
}

impl Net {
    fn new(vs: &VarStore) -> Net {
        let p = vs.root();
        let linear = |path: nn::Path| nn::linear(path, WIDTH, WIDTH, Default::default());
        Net {
            input: linear(&p / "input"),
            blocks: (0..DEPTH)
                .map(|i| (linear(&p / "blocks" / i / "fc1"), linear(&p / "blocks" / i / "fc2")))
                .collect(),
            output: linear(&p / "output"),
        }
    }

    fn block(&self, i: usize, x: &Tensor) -> Tensor {
        let (fc1, fc2) = &self.blocks[i];
        x + x.apply(fc1).gelu("none").apply(fc2)
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        let x = (0..DEPTH).fold(x.apply(&self.input), |x, i| self.block(i, &x));
        x.apply(&self.output)
    }

    /// The same forward with a call at each block boundary.
    fn forward_streamed(&self, x: &Tensor, step: &mut Step<'_>) -> Result<Tensor, StreamError> {
        self.forward_observed(x, step, |_| {})
    }

    /// [`Self::forward_streamed`], with `seen(i)` called once block `i` is in memory.
    fn forward_observed(
        &self,
        x: &Tensor,
        step: &mut Step<'_>,
        mut seen: impl FnMut(usize),
    ) -> Result<Tensor, StreamError> {
        let mut x = x.apply(&self.input);
        for i in 0..DEPTH {
            step.block(i)?;
            seen(i);
            x = self.block(i, &x);
        }
        Ok(x.apply(&self.output))
    }
}

fn checkpoint(dir: &Path) -> PathBuf {
    tch::manual_seed(7);
    let vs = VarStore::new(Device::Cpu);
    let _ = Net::new(&vs);
    let path = dir.join("net.safetensors");
    stageload::checkpoint::save(&vs.variables().into_iter().collect::<Vec<_>>(), &path).unwrap();
    path
}

/// One test at a time, and the net's checkpoint in a folder that goes with the test.
fn setup() -> (std::sync::MutexGuard<'static, ()>, tempfile::TempDir, PathBuf) {
    let one = support::generator();
    let dir = tempfile::tempdir().unwrap();
    let file = checkpoint(dir.path());
    (one, dir, file)
}

fn spec() -> BlockSpec {
    BlockSpec::new(["blocks.*"]).resident(["input", "output"])
}

/// The model built without touching its memory, as a streamed model is, and its tensors.
/// A streamed net, and the tensors behind it (to look at their storages).
type WithTensors = (Net, StreamedModel, Vec<(String, Tensor)>);

fn streamed_with_tensors(file: &Path, budget: u64) -> Result<WithTensors, StreamError> {
    let vs = VarStore::new(Device::Cpu);
    let net = stageload_torch_sys::without_fills(|| Net::new(&vs));
    let checkpoint = Checkpoint::open(&[file]).unwrap();
    let tensors = stageload::named_tensors(&vs);
    let shallow = tensors.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect();
    let mut model = StreamedModel::new("net", shallow, checkpoint, &NameRules::default(), &spec(), budget)?;
    // The process's RSS moves with the other tests' threads: these tests measure no working
    // memory unless they script it.
    model.reading(|| None);
    Ok((net, model, tensors))
}

fn streamed(file: &Path, budget: u64) -> Result<(Net, StreamedModel), StreamError> {
    streamed_with_tensors(file, budget).map(|(net, model, _)| (net, model))
}

/// Three steps on seeded noise: the outputs of each.
fn reference(file: &Path) -> Vec<Tensor> {
    reference_steps(file, 3)
}

/// `steps` steps on seeded noise: the outputs of each.
fn reference_steps(file: &Path, steps: usize) -> Vec<Tensor> {
    let vs = VarStore::new(Device::Cpu);
    let net = Net::new(&vs);
    let mut variables: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    variables.sort_by(|a, b| a.0.cmp(&b.0));
    Checkpoint::open(&[file]).unwrap().load_into(&variables, |_| {}).unwrap();
    tch::manual_seed(11);
    (0..steps).map(|_| tch::no_grad(|| net.forward(&Tensor::randn([16, WIDTH], (Kind::Float, Device::Cpu))))).collect()
}

/// `steps` steps on seeded noise through the blocks `route(s)` names for step `s` (and not the
/// output layer), the whole net loaded: the outputs of each.
fn routed_reference(file: &Path, steps: usize, route: impl Fn(usize) -> Vec<usize>) -> Vec<Tensor> {
    let vs = VarStore::new(Device::Cpu);
    let net = Net::new(&vs);
    let mut variables: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    variables.sort_by(|a, b| a.0.cmp(&b.0));
    Checkpoint::open(&[file]).unwrap().load_into(&variables, |_| {}).unwrap();
    tch::manual_seed(11);
    (0..steps)
        .map(|s| {
            let x = Tensor::randn([16, WIDTH], (Kind::Float, Device::Cpu));
            tch::no_grad(|| route(s).iter().fold(x.apply(&net.input), |x, &i| net.block(i, &x)))
        })
        .collect()
}

/// One step through `blocks` in their order on `x` (not the output layer), `name(step, k)`
/// called after `step.block(blocks[k])` (what the forward names ahead): the output.
fn routed_step(
    net: &Net,
    model: &mut StreamedModel,
    x: &Tensor,
    blocks: &[usize],
    mut name: impl FnMut(&mut Step<'_>, usize) -> Result<(), StreamError>,
) -> Tensor {
    tch::no_grad(|| {
        model.run(|step| {
            let mut x = x.apply(&net.input);
            for (k, &i) in blocks.iter().enumerate() {
                step.block(i)?;
                name(step, k)?;
                x = net.block(i, &x);
            }
            Ok(x)
        })
    })
    .unwrap()
}

fn run_steps(net: &Net, model: &mut StreamedModel, steps: usize) -> Vec<Tensor> {
    tch::manual_seed(11);
    (0..steps)
        .map(|_| {
            let x = Tensor::randn([16, WIDTH], (Kind::Float, Device::Cpu));
            tch::no_grad(|| model.run(|step| net.forward_streamed(&x, step))).unwrap()
        })
        .collect()
}

/// Budget for `resident` resident blocks with two slots.
fn budget_for(resident: usize) -> u64 {
    FIXED + BLOCK * (resident as u64 + 2)
}

#[test]
fn outputs_are_bit_identical_with_none_one_half_and_all_blocks_streamed() {
    let (_one, _dir, file) = setup();
    let expected = reference(&file);
    let whole = FIXED + BLOCK * DEPTH as u64;
    // (budget, resident limit, blocks streamed)
    for (budget, limit, streamed_blocks) in [
        (whole, DEPTH, 0),
        // With equal blocks one streamed block needs as much as none; the limit asks for it.
        (whole, DEPTH - 1, 1),
        (budget_for(DEPTH / 2 - 2) + BLOCK, DEPTH, DEPTH / 2 + 1),
        (budget_for(DEPTH / 2), DEPTH, DEPTH / 2),
        (budget_for(0), DEPTH, DEPTH),
        (FIXED + BLOCK, DEPTH, DEPTH),
    ] {
        let (net, mut model) = streamed(&file, budget).unwrap();
        model.limit_resident(limit).unwrap();
        assert_eq!(model.split().streamed(), streamed_blocks, "budget {budget}: {}", model.residency());
        let outputs = run_steps(&net, &mut model, 3);
        for (step, (got, want)) in outputs.iter().zip(&expected).enumerate() {
            assert!(got.equal(want), "step {step} differs with {}", model.residency());
        }
        // Torch's generator is where the fully resident run left it: streaming drew nothing.
        let after = Tensor::randn([4], (Kind::Float, Device::Cpu));
        tch::manual_seed(11);
        for _ in 0..3 {
            let _ = Tensor::randn([16, WIDTH], (Kind::Float, Device::Cpu));
        }
        assert!(after.equal(&Tensor::randn([4], (Kind::Float, Device::Cpu))));
        let stats = model.stats();
        assert_eq!(stats.steps, 3);
        assert_eq!(
            stats.bytes_refilled,
            3 * BLOCK_TENSORS * streamed_blocks as u64,
            "each streamed block once per step"
        );
    }
}

/// Blocks of the model whose storage is filled now.
fn filled(vs_tensors: &[(String, Tensor)]) -> usize {
    (0..DEPTH).filter(|&i| is_filled(vs_tensors, i)).count()
}

fn is_filled(vs_tensors: &[(String, Tensor)], block: usize) -> bool {
    let name = format!("blocks.{block}.fc1.weight");
    let (_, t) = vs_tensors.iter().find(|(n, _)| *n == name).unwrap();
    stageload_torch_sys::storage_info(t).unwrap().allocated
}

#[test]
fn at_no_boundary_are_more_than_the_prefix_and_two_slots_filled() {
    let (_one, _dir, file) = setup();
    let (net, mut model, tensors) = streamed_with_tensors(&file, budget_for(2)).unwrap();
    assert_eq!(filled(&tensors), 2, "set-up fills the resident prefix only");
    let x = Tensor::randn([16, WIDTH], (Kind::Float, Device::Cpu));
    let mut most = 0;
    let mut addresses = std::collections::HashSet::new();
    for _ in 0..3 {
        let _ = tch::no_grad(|| {
            model.run(|step| {
                net.forward_observed(&x, step, |i| {
                    most = most.max(filled(&tensors));
                    if i >= 2 {
                        addresses.insert(net.blocks[i].0.ws.data_ptr() as usize);
                    }
                })
            })
        })
        .unwrap();
    }
    assert!((3..=4).contains(&most), "two resident blocks, the running one and the one ahead: {most}");
    assert_eq!(filled(&tensors), 2, "between steps: the prefix alone (the carried read is in no tensor)");
    assert_eq!(addresses.len(), 2, "18 refills of 6 streamed blocks, all into the same two slots");
    let stats = model.stats();
    assert_eq!(stats.refills, 3 * 6);
    assert!(stats.refill_seconds > 0.0);
}

/// Runs `steps` steps of the net in order and checks each against `expected`; after each,
/// no block of the model has memory (the prefix aside) and it holds no more than `budget`.
fn steps_between_which_no_block_is_filled(
    net: &Net,
    model: &mut StreamedModel,
    tensors: &[(String, Tensor)],
    expected: &[Tensor],
    budget: u64,
) {
    let resident = model.split().resident;
    for (s, want) in expected.iter().enumerate() {
        let x = Tensor::randn([16, WIDTH], (Kind::Float, Device::Cpu));
        let got = tch::no_grad(|| model.run(|step| net.forward_streamed(&x, step))).unwrap();
        assert!(got.equal(want), "step {s} differs");
        assert_eq!(filled(tensors), resident, "after step {s}: the carried read is in no tensor of the model");
        assert!(model.held_bytes() <= budget, "after step {s}: {} > {budget}", model.held_bytes());
    }
}

#[test]
fn a_step_ends_by_reading_the_next_steps_first_streamed_block_and_no_block_reads_twice() {
    let (_one, _dir, file) = setup();
    let expected = reference_steps(&file, 5);
    let budget = budget_for(2);
    let (net, mut model, tensors) = streamed_with_tensors(&file, budget).unwrap();
    tch::manual_seed(11);
    steps_between_which_no_block_is_filled(&net, &mut model, &tensors, &expected, budget);
    let stats = model.stats();
    // While block 7 runs, block 2 (the first streamed) is read for the next step: steps 2 to 5
    // find it read (the read for a sixth is in flight, not counted).
    assert_eq!(stats.carried, 4, "{stats:?}");
    assert_eq!(stats.refills, 5 * 6, "each step reads its 6 streamed blocks once: {stats:?}");
}

/// Four steps of the whole forward under the budget for two resident blocks, no block filled
/// between steps, with `between(model, tensors)` after the third (while the read for the fourth
/// is carried): the model's stats at the end.
fn carried_across(between: impl FnOnce(&mut StreamedModel, &[(String, Tensor)])) -> StreamStats {
    let (_one, _dir, file) = setup();
    let expected = reference_steps(&file, 4);
    let budget = budget_for(2);
    let (net, mut model, tensors) = streamed_with_tensors(&file, budget).unwrap();
    tch::manual_seed(11);
    steps_between_which_no_block_is_filled(&net, &mut model, &tensors, &expected[..3], budget);
    between(&mut model, &tensors);
    steps_between_which_no_block_is_filled(&net, &mut model, &tensors, &expected[3..], budget);
    model.stats()
}

#[test]
fn a_split_changed_between_steps_frees_the_carried_read_and_the_next_step_gives_the_same_result() {
    let stats = carried_across(|model, _| {
        assert_eq!(model.stats().carried, 2);
        // Block 2 is being read for step 4; with no block resident step 4 begins with block 0.
        model.limit_resident(0).unwrap();
    });
    assert_eq!(stats.carried, 2, "the read for the old split is not used: {stats:?}");
    assert_eq!(stats.refills, 3 * 6 + 1 + 8, "it cost one read: {stats:?}");
}

#[test]
fn an_option_that_frees_blocks_between_steps_first_waits_for_the_carried_read() {
    let stats = carried_across(|model, tensors| {
        // Block 2 is being read for step 4; declared working memory frees block 1 now and sizes
        // the slots again, the taken-out one included.
        model.working_memory(BLOCK).unwrap();
        assert_eq!((model.split().resident, filled(tensors)), (1, 1));
        assert!(model.held_bytes() <= budget_for(2), "{} > {}", model.held_bytes(), budget_for(2));
    });
    assert_eq!(stats.carried, 2, "{stats:?}");
    assert_eq!(stats.refills, 3 * 6 + 1 + 7, "{stats:?}");
}

#[test]
fn a_forward_in_order_that_names_its_blocks_reads_only_those_it_names_once_it_names_one() {
    let (_one, _dir, file) = setup();
    // A resident prefix (blocks 0 and 1) and a router: step s runs 0, 1 and one of the six
    // streamed blocks, naming each next block and, at its last, the next step's route.
    let route = |s: usize| vec![0, 1, 2 + (5 * s) % 6];
    let steps = 7;
    let expected = routed_reference(&file, steps, route);
    let (net, mut model, _tensors) = streamed_with_tensors(&file, budget_for(2)).unwrap();
    assert_eq!(model.split().resident, 2);
    tch::manual_seed(11);
    for (s, want) in expected.iter().enumerate() {
        let x = Tensor::randn([16, WIDTH], (Kind::Float, Device::Cpu));
        let blocks = route(s);
        let got = routed_step(&net, &mut model, &x, &blocks, |step, k| match blocks.get(k + 1) {
            Some(&next) => step.prefetch(next),
            None => step.prefetch_first(&route(s + 1)),
        });
        assert!(got.equal(want), "step {s} differs");
    }
    let stats = model.stats();
    // Guessing by index would read block 2 after block 1 at every step, and block 2 again at
    // every step's start: each step reads its one streamed block, named by the step before from
    // the second on (the first step's guess by index, block 2, was the block it ran).
    assert_eq!(stats.refills, steps as u64, "{stats:?}");
    assert_eq!(stats.carried, steps as u64 - 1, "{stats:?}");
}

#[test]
fn a_carried_read_that_guessed_wrong_is_freed_before_the_step_needs_its_slot() {
    let (_one, _dir, file) = setup();
    // Any order with no room for a hot set: step s runs block first(s), then 5, and names
    // first(s) ahead while 5 runs, guessing that the next step begins as this one did.
    let first = [0, 0, 3, 3, 3];
    let budget = FIXED + 2 * BLOCK;
    let expected = routed_reference(&file, first.len(), |s| vec![first[s], 5]);
    let (net, mut model, _tensors) = any_order(&file, budget);
    assert_eq!(model.split().hot, 0);
    tch::manual_seed(11);
    let mut most = 0;
    for (s, want) in expected.iter().enumerate() {
        let x = Tensor::randn([16, WIDTH], (Kind::Float, Device::Cpu));
        let got = routed_step(&net, &mut model, &x, &[first[s], 5], |step, k| {
            step.prefetch(if k == 0 { 5 } else { first[s] })?;
            most = most.max(step.held_bytes());
            Ok(())
        });
        assert!(got.equal(want), "step {s} differs");
    }
    assert!(most <= budget, "the wrong guess never held a third slot: {most} > {budget}");
    let stats = model.stats();
    // Block 0 read for steps 2 and 3, used by step 2 only; block 3 for steps 4 and 5, used.
    assert_eq!(stats.carried, 3, "{stats:?}");
    assert_eq!(stats.refills, 5 * 2 + 1, "the wrong guess cost one read: {stats:?}");
}

#[test]
fn an_out_of_memory_streams_one_more_block_and_the_step_gives_the_same_result() {
    let (_one, _dir, file) = setup();
    let expected = reference(&file);
    let (net, model) = streamed(&file, FIXED + BLOCK * DEPTH as u64).unwrap();
    let sink = Arc::new(ListSink::new());
    let mut model = model;
    model.events(sink.clone());
    assert_eq!(model.split().resident, DEPTH);
    tch::manual_seed(11);
    let x = Tensor::randn([16, WIDTH], (Kind::Float, Device::Cpu));
    // The activations "do not fit" while more than 5 blocks are resident: a real libtorch
    // out-of-memory (a petabyte) raised inside the step.
    let y = tch::no_grad(|| {
        model.run(|step| {
            if step.split().resident > 5 {
                let _ = Tensor::f_empty([1i64 << 48], (Kind::Float, Device::Cpu))?;
            }
            net.forward_streamed(&x, step)
        })
    })
    .unwrap();
    assert!(y.equal(&expected[0]));
    assert_eq!(model.split().resident, 5, "one more block per out-of-memory, three in all");
    assert_eq!(model.stats().retries, 3);
    let residency = sink.of_kind(EventKind::Residency);
    let reasons: Vec<&str> = residency.iter().map(|e| e.residency().unwrap().reason.as_str()).collect();
    assert_eq!(reasons, ["start", "out of memory", "out of memory", "out of memory"]);
    let last = residency.last().unwrap().residency().cloned().unwrap();
    assert_eq!((last.blocks, last.resident, last.streamed_per_step), (DEPTH, 5, 3 * BLOCK));
    assert!(residency
        .last()
        .unwrap()
        .note()
        .as_deref()
        .unwrap()
        .starts_with("net: 5 of 8 blocks resident, 3 streamed"));
    // The count only goes down: the next step keeps 5.
    let _ = tch::no_grad(|| model.run(|step| net.forward_streamed(&x, step))).unwrap();
    assert_eq!(model.split().resident, 5);
    model.reset().unwrap();
    assert_eq!(model.split().resident, DEPTH, "reset keeps what the budget holds again");
    let again = tch::no_grad(|| model.run(|step| net.forward_streamed(&x, step))).unwrap();
    assert!(again.equal(&expected[0]), "prefix blocks come back as the step reaches them");
}

#[test]
fn an_out_of_memory_with_every_block_streamed_is_the_error_with_the_residency_numbers() {
    let (_one, _dir, file) = setup();
    let (net, mut model) = streamed(&file, budget_for(1)).unwrap();
    let x = Tensor::randn([16, WIDTH], (Kind::Float, Device::Cpu));
    let err = tch::no_grad(|| {
        model.run(|step| {
            let _ = Tensor::f_empty([1i64 << 48], (Kind::Float, Device::Cpu))?;
            net.forward_streamed(&x, step)
        })
    })
    .unwrap_err();
    let message = err.to_string();
    assert!(matches!(err, StreamError::OutOfMemory { .. }), "{message}");
    assert!(message.contains("net: 0 of 8 blocks resident, 8 streamed"), "{message}");
    assert!(message.contains("can't allocate memory"), "the original error: {message}");
    assert!(!message.contains("frame #"), "without libtorch's C++ backtrace: {message}");
    // Still usable.
    tch::manual_seed(11);
    let expected = reference(&file);
    tch::manual_seed(11);
    let x = Tensor::randn([16, WIDTH], (Kind::Float, Device::Cpu));
    let y = tch::no_grad(|| model.run(|step| net.forward_streamed(&x, step))).unwrap();
    assert!(y.equal(&expected[0]));
}

#[test]
fn measured_working_memory_over_the_budget_streams_more_blocks_for_the_next_step() {
    let (_one, _dir, file) = setup();
    let expected = reference(&file);
    let (net, model) = streamed(&file, budget_for(4)).unwrap();
    // A scripted reading: three blocks' worth of activations appear after the first block.
    use std::sync::atomic::{AtomicU64, Ordering};
    let reading = Arc::new(AtomicU64::new(0));
    let scripted = Arc::clone(&reading);
    let mut model = model;
    model.reading(move || Some(scripted.load(Ordering::Relaxed)));
    assert_eq!(model.split().resident, 4);
    tch::manual_seed(11);
    let mut outputs = Vec::new();
    for _ in 0..3 {
        let x = Tensor::randn([16, WIDTH], (Kind::Float, Device::Cpu));
        reading.store(0, Ordering::Relaxed);
        let y = tch::no_grad(|| {
            model.run(|step| {
                net.forward_observed(&x, step, |i| {
                    if i == 0 {
                        reading.fetch_add(3 * BLOCK, Ordering::Relaxed);
                    }
                })
            })
        });
        outputs.push(y.unwrap());
    }
    assert_eq!(model.working(), 3 * BLOCK);
    // 1 resident + 2 slots + 3 blocks of working memory = the budget of 4 resident + 2 slots.
    assert_eq!(model.split().resident, 1, "{}", model.residency());
    for (got, want) in outputs.iter().zip(&expected) {
        assert!(got.equal(want));
    }
}

#[test]
fn a_block_list_that_misses_tensors_or_names_one_twice_is_refused_by_name() {
    let (_one, _dir, file) = setup();
    let try_spec = |spec: BlockSpec| {
        let vs = VarStore::new(Device::Cpu);
        let _net = Net::new(&vs);
        let checkpoint = Checkpoint::open(&[&file]).unwrap();
        StreamedModel::new("net", stageload::named_tensors(&vs), checkpoint, &NameRules::default(), &spec, u64::MAX)
            .unwrap_err()
            .to_string()
    };
    let missing = try_spec(BlockSpec::new(["blocks.*"]).resident(["input"]));
    assert!(missing.contains("'net'") && missing.contains("'output.weight'"), "{missing}");
    let twice = try_spec(BlockSpec::new(["blocks.*", "blocks.3"]).resident(["input", "output"]));
    assert!(twice.contains("'blocks.3.") && twice.contains("both"), "{twice}");
}

#[test]
fn a_budget_smaller_than_one_block_is_refused_naming_both_sizes() {
    let (_one, _dir, file) = setup();
    let err = streamed(&file, FIXED + BLOCK / 2).unwrap_err();
    let message = err.to_string();
    assert!(matches!(err, StreamError::Budget { .. }), "{message}");
    let needed = stageload_units::format_bytes(FIXED + BLOCK);
    let budget = stageload_units::format_bytes(FIXED + BLOCK / 2);
    assert!(message.contains(&needed) && message.contains(&budget), "{message}");
}

#[test]
fn a_block_that_changes_shape_between_steps_is_refused_and_nothing_is_computed_with_it() {
    let (_one, _dir, file) = setup();
    let (net, mut model) = streamed(&file, budget_for(0)).unwrap();
    let x = Tensor::randn([16, WIDTH], (Kind::Float, Device::Cpu));
    let _ = tch::no_grad(|| model.run(|step| net.forward_streamed(&x, step))).unwrap();
    // Someone reshapes a streamed weight while it is out.
    let mut weight = net.blocks[5].0.ws.shallow_clone();
    weight.set_data(&Tensor::zeros([WIDTH, WIDTH / 2], (Kind::Float, Device::Cpu)));
    let err = tch::no_grad(|| model.run(|step| net.forward_streamed(&x, step))).unwrap_err();
    let message = err.to_string();
    assert!(message.contains("blocks.5.fc1.weight") && message.contains("changed shape"), "{message}");
    let err = tch::no_grad(|| model.run(|step| step.block(DEPTH))).unwrap_err();
    assert!(err.to_string().contains("asked for block 8"), "{err}");
}

#[test]
fn tied_storage_across_blocks_is_refused() {
    let (_one, _dir, file) = setup();
    let vs = VarStore::new(Device::Cpu);
    let _net = Net::new(&vs);
    let mut tensors = stageload::named_tensors(&vs);
    // blocks.1.fc1.weight becomes a view of blocks.0.fc1.weight's storage.
    let tied = tensors.iter().find(|(n, _)| n == "blocks.0.fc1.weight").unwrap().1.shallow_clone();
    for (name, tensor) in tensors.iter_mut() {
        if name == "blocks.1.fc1.weight" {
            *tensor = tied.shallow_clone();
        }
    }
    let checkpoint = Checkpoint::open(&[&file]).unwrap();
    let err = StreamedModel::new("net", tensors, checkpoint, &NameRules::default(), &spec(), u64::MAX).unwrap_err();
    assert!(matches!(err, StreamError::SharedStorage { .. }), "{err}");
    assert!(err.to_string().contains("'blocks.1.fc1.weight'"), "{err}");
}

/// Ties each block's second weight to its first (`fc2.weight = fc1.weight`), as a module whose
/// layers share a weight is; returns its tensors as libtorch lists them: both names, one storage.
fn tie(vs: &VarStore, net: &mut Net) -> Vec<(String, Tensor)> {
    for (fc1, fc2) in &mut net.blocks {
        fc2.ws = fc1.ws.shallow_clone();
    }
    let mut tensors = stageload::named_tensors(vs);
    for (name, tensor) in tensors.iter_mut() {
        let block = name.strip_prefix("blocks.").and_then(|rest| rest.strip_suffix(".fc2.weight"));
        if let Some(i) = block.and_then(|i| i.parse::<usize>().ok()) {
            *tensor = net.blocks[i].0.ws.shallow_clone();
        }
    }
    tensors
}

#[test]
fn a_weight_tied_inside_a_block_needs_one_entry_and_streams_bit_identical() {
    let _one = support::generator();
    let dir = tempfile::tempdir().unwrap();
    tch::manual_seed(7);
    let vs = VarStore::new(Device::Cpu);
    let mut net = Net::new(&vs);
    let tensors = tie(&vs, &mut net);
    // The checkpoint as safetensors' save_model writes a tied model: the shared weight once.
    let file = dir.path().join("tied.safetensors");
    let entries: Vec<(String, Tensor)> = tensors
        .iter()
        .filter(|(n, _)| !n.ends_with("fc2.weight"))
        .map(|(n, t)| (n.clone(), t.shallow_clone()))
        .collect();
    stageload::checkpoint::save(&entries, &file).unwrap();
    tch::manual_seed(11);
    let inputs: Vec<Tensor> = (0..2).map(|_| Tensor::randn([16, WIDTH], (Kind::Float, Device::Cpu))).collect();
    let expected: Vec<Tensor> = inputs.iter().map(|x| tch::no_grad(|| net.forward(x))).collect();

    let vs = VarStore::new(Device::Cpu);
    let mut net = stageload_torch_sys::without_fills(|| Net::new(&vs));
    let tensors = tie(&vs, &mut net);
    let checkpoint = Checkpoint::open(&[&file]).unwrap();
    let mut model =
        StreamedModel::new("net", tensors, checkpoint, &NameRules::default(), &spec(), budget_for(0)).unwrap();
    model.reading(|| None);
    for (x, expected) in inputs.iter().zip(&expected) {
        let y = tch::no_grad(|| model.run(|step| net.forward_streamed(x, step))).unwrap();
        assert!(y.equal(expected), "every block streamed through its one entry, bit for bit");
    }
    assert!(model.stats().refills >= DEPTH as u64, "the blocks were refilled: {:?}", model.stats());
    let storage = |t: &Tensor| stageload_torch_sys::storage_info(t).unwrap().id;
    assert_eq!(storage(&net.blocks[3].0.ws), storage(&net.blocks[3].1.ws), "still one storage");
}

/// A streamed model as a registry holds it: the forward's modules and their streamer.
struct StreamedNet {
    net: Net,
    streamed: StreamedModel,
}

#[test]
fn a_streamed_model_in_staged_models_is_released_with_its_stage_and_rebuilt_the_same() {
    use stageload::{Built, ModelSpec, ModelState, ReloadFrom, StagedModels};
    let (_one, _dir, file) = setup();
    let expected = reference(&file);
    let loader_file = file.clone();
    let sink = Arc::new(ListSink::new());
    let models = StagedModels::builder()
        .model(ModelSpec::new("flow", move |_| {
            let vs = VarStore::new(Device::Cpu);
            let net = stageload_torch_sys::without_fills(|| Net::new(&vs));
            let checkpoint = Checkpoint::open(&[&loader_file])?;
            let mut streamed = StreamedModel::new(
                "flow",
                stageload::named_tensors(&vs),
                checkpoint,
                &NameRules::default(),
                &spec(),
                budget_for(2),
            )?;
            streamed.reading(|| None);
            let tensors = streamed.tensors();
            Ok(Built::from_tensors(StreamedNet { net, streamed }, tensors))
        }))
        .model(ModelSpec::new("decoder", |_| {
            let vs = VarStore::new(Device::Cpu);
            let decoder = nn::linear(vs.root() / "w", WIDTH, WIDTH, Default::default());
            Ok(Built::new(decoder, &vs))
        }))
        .stage("denoise", ["flow"])
        .stage("decode", ["decoder"])
        .stage("denoise", ["flow"])
        .events(sink.clone())
        .build()
        .unwrap();
    let step = |x: &Tensor| {
        models
            .call("flow", |m: &mut StreamedNet| tch::no_grad(|| m.streamed.run(|step| m.net.forward_streamed(x, step))))
            .unwrap()
            .unwrap()
    };
    tch::manual_seed(11);
    let x = Tensor::randn([16, WIDTH], (Kind::Float, Device::Cpu));
    models.enter("denoise").unwrap();
    assert!(step(&x).equal(&expected[0]));
    let held = models.resident_bytes();
    // Resident part and two slots: the fixed layers, 2 blocks, 2 slots; never the whole model.
    assert!(held >= FIXED + 2 * BLOCK_TENSORS + 2 * BLOCK && held < FIXED + DEPTH as u64 * BLOCK, "{held}");
    models.enter("decode").unwrap();
    let states: std::collections::HashMap<String, ModelState> = models.states().into_iter().collect();
    assert_eq!(states["flow"], ModelState::Released);
    // The step ended with block 2's read for the next carried, its slot's buffer out of the slot:
    // the registry frees the rest, and that buffer goes with the model object.
    let released = sink.of_kind(EventKind::Release);
    let freed = released.iter().find(|e| e.model() == Some("flow")).and_then(|e| e.bytes());
    assert_eq!(freed, Some(held - BLOCK), "{released:?}");
    models.enter("denoise").unwrap();
    assert!(step(&x).equal(&expected[0]), "rebuilt, the same output");
    let reloads = sink.of_kind(EventKind::Reload);
    assert!(reloads.iter().any(|e| e.model() == Some("flow") && e.reload_from() == Some(ReloadFrom::Rebuilt)));
}

#[test]
fn declared_working_memory_frees_at_once_the_blocks_it_no_longer_keeps() {
    let (_one, _dir, file) = setup();
    let (_net, model, tensors) = streamed_with_tensors(&file, budget_for(4) + BLOCK / 2).unwrap();
    let allocated = |block: usize| {
        let name = format!("blocks.{block}.fc1.weight");
        let (_, tensor) = tensors.iter().find(|(n, _)| *n == name).unwrap();
        stageload_torch_sys::storage_info(tensor).unwrap().allocated
    };
    assert_eq!(model.split().resident, 4);
    assert!(allocated(3));
    let mut model = model;
    model.working_memory(BLOCK).unwrap();
    assert_eq!(model.split().resident, 3);
    assert!(!allocated(3), "block 3 freed before any step");
    assert!(allocated(2));
}

/// A pipeline file in `dir` streaming the net (`net.safetensors` there) as `flow` in stage
/// `denoise`; with its working memory one block fits fewer: 3 resident, not 4. `budget`: the
/// budget in the stream entry, else what the stage leaves of the file's `memory`.
fn streaming_pipeline(dir: &Path, budget: bool) -> stageload::Pipeline {
    let path = dir.join("pipeline.toml");
    let (memory, budget) = match budget {
        true => (String::new(), format!(", budget = \"{}\"", budget_for(3) + BLOCK)),
        false => (format!("memory = \"{}\"\n", budget_for(3)), String::new()),
    };
    let stream = format!(r#"{{ blocks = ["blocks.*"], resident = ["input", "output"], working = "{BLOCK}"{budget} }}"#);
    std::fs::write(
        &path,
        format!(
            "{memory}[[models]]\nname = \"flow\"\nfiles = [\"net.safetensors\"]\nstream = {stream}\n\n\
             [[stages]]\nname = \"denoise\"\nmodels = [\"flow\"]\n"
        ),
    )
    .unwrap();
    stageload::Pipeline::load(&path).unwrap()
}

/// `flow` of [`streaming_pipeline`] in a registry sending events to `sink`, its working memory
/// read from `reading` (bytes now).
fn staged_flow(
    pipeline: &stageload::Pipeline,
    sink: Arc<ListSink>,
    reading: Arc<std::sync::atomic::AtomicU64>,
) -> stageload::StagedModels {
    flow_builder(pipeline, sink, reading).build().unwrap()
}

/// [`staged_flow`]'s builder, to add to.
fn flow_builder(
    pipeline: &stageload::Pipeline,
    sink: Arc<dyn stageload::EventSink>,
    reading: Arc<std::sync::atomic::AtomicU64>,
) -> stageload::StagedModelsBuilder {
    use stageload::{Built, ModelSpec, StagedModels};
    StagedModels::builder().pipeline(pipeline).events(sink).model(
        ModelSpec::new("flow", move |ctx| {
            let plan = ctx.stream().ok_or("the file streams flow")?;
            let vs = VarStore::new(Device::Cpu);
            let net = stageload_torch_sys::without_fills(|| Net::new(&vs));
            let reading = Arc::clone(&reading);
            let mut streamed = StreamedModel::planned("flow", stageload::named_tensors(&vs), plan)?;
            streamed.reading(move || Some(reading.load(std::sync::atomic::Ordering::Relaxed)));
            let tensors = streamed.tensors();
            Ok(Built::from_tensors(StreamedNet { net, streamed }, tensors))
        })
        // It draws nothing (built without fills, filled by the streamer): it may be prefetched.
        .skip_init(true),
    )
}

#[test]
fn a_streamed_model_of_the_pipeline_file_runs_the_split_its_plan_counts() {
    let (_one, dir, file) = setup();
    let expected = reference(&file);
    // Its own budget, or what its stage leaves of the run's memory: the same split.
    for budget in [true, false] {
        let pipeline = streaming_pipeline(dir.path(), budget);
        let planned = stageload_plan::plan(&pipeline, stageload_plan::Budget::given(1 << 30), None);
        let split = pipeline.models[0].streamed.clone().unwrap();
        assert_eq!((split.resident_blocks, split.blocks, split.budget_from.is_none()), (3, DEPTH, budget));

        let sink = Arc::new(ListSink::new());
        let models = staged_flow(&pipeline, sink.clone(), Default::default());
        models.enter("denoise").unwrap();
        tch::manual_seed(11);
        let x = Tensor::randn([16, WIDTH], (Kind::Float, Device::Cpu));
        let (y, resident) = models
            .call("flow", |m: &mut StreamedNet| {
                let y = tch::no_grad(|| m.streamed.run(|step| m.net.forward_streamed(&x, step)));
                (y, m.streamed.split().resident)
            })
            .unwrap();
        assert!(y.unwrap().equal(&expected[0]), "the file's checkpoint, read by the streamer");
        assert_eq!(resident, split.resident_blocks, "the run keeps what the plan counts");
        assert_eq!(
            models.resident_bytes(),
            planned.stages[0].weights,
            "held: what the plan counts, not the whole model"
        );
        let of_flow = |kind| sink.of_kind(kind).into_iter().filter(|e| e.model() == Some("flow")).count();
        assert_eq!(of_flow(EventKind::Load), 1, "the registry's load, not a second one");
        assert!(of_flow(EventKind::Residency) >= 1, "its split in the run's trace");
    }
}

#[test]
fn a_streamed_model_is_prefetched_as_what_its_plan_holds_not_as_nothing() {
    let (_one, dir, _file) = setup();
    let pipeline = streaming_pipeline(dir.path(), true);
    let held = pipeline.models[0].streamed.as_ref().unwrap().held;
    for (budget, started) in [(held - 1, false), (held, true)] {
        let sink = Arc::new(ListSink::new());
        let models = flow_builder(&pipeline, sink.clone(), Default::default()).prefetch_budget(budget).build().unwrap();
        let prefetched = models.prefetch("denoise").unwrap();
        assert_eq!(prefetched == ["flow"], started, "a prefetch budget of {budget} for {held}: {prefetched:?}");
        // The background build done (10 s at most) before the stage asks for the model.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while started && sink.of_kind(EventKind::Load).is_empty() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        models.enter("denoise").unwrap();
        models.call("flow", |_: &mut StreamedNet| ()).unwrap();
        let load = sink.of_kind(EventKind::Load).pop().unwrap();
        assert_eq!(load.prefetched(), started, "{load:?}");
        assert_eq!(models.resident_bytes(), held);
    }
}

#[test]
fn the_plan_checked_against_a_streamed_runs_trace_finds_its_weights_exactly() {
    let (_one, dir, _file) = setup();
    let pipeline = streaming_pipeline(dir.path(), false);
    let planned = stageload_plan::plan(&pipeline, stageload_plan::Budget::given(1 << 30), None);
    let path = dir.path().join("run.jsonl");
    let meter = Arc::new(stageload::meter::start(&path, Device::Cpu, Default::default()).unwrap());
    let models = flow_builder(&pipeline, meter.clone(), Default::default()).build().unwrap();
    models.enter("denoise").unwrap();
    tch::manual_seed(11);
    let x = Tensor::randn([16, WIDTH], (Kind::Float, Device::Cpu));
    let y = models
        .call("flow", |m: &mut StreamedNet| tch::no_grad(|| m.streamed.run(|step| m.net.forward_streamed(&x, step))))
        .unwrap();
    assert!(y.is_ok());
    models.close();
    meter.finish();
    let trace = stageload_trace::read_trace(&path).unwrap();
    let checks = stageload_plan::measured::check(&pipeline, &planned, &trace).unwrap();
    assert_eq!(checks.len(), 1);
    assert_eq!(checks[0].run_weights, Some(checks[0].planned_weights), "{checks:?}");
}

#[test]
fn the_registry_counts_a_streamed_model_by_what_its_split_holds_after_an_eviction() {
    use std::sync::atomic::Ordering;
    let (_one, dir, file) = setup();
    let expected = reference(&file);
    let pipeline = streaming_pipeline(dir.path(), true);
    let reading = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let sink = Arc::new(ListSink::new());
    let models = staged_flow(&pipeline, sink.clone(), Arc::clone(&reading));
    models.enter("denoise").unwrap();
    // Planned: 3 resident, 2 slots, one block of working memory; the step measures two blocks'
    // worth more, so one more block is streamed from the next step on.
    tch::manual_seed(11);
    for want in &expected[..2] {
        let x = Tensor::randn([16, WIDTH], (Kind::Float, Device::Cpu));
        reading.store(0, Ordering::Relaxed);
        let y = models
            .call("flow", |m: &mut StreamedNet| {
                tch::no_grad(|| {
                    m.streamed.run(|step| {
                        m.net.forward_observed(&x, step, |i| {
                            if i == 0 {
                                reading.fetch_add(2 * BLOCK, Ordering::Relaxed);
                            }
                        })
                    })
                })
            })
            .unwrap();
        assert!(y.unwrap().equal(want), "the same output with one block less resident");
    }
    let resident = models.call("flow", |m: &mut StreamedNet| m.streamed.split().resident).unwrap();
    assert_eq!(resident, 2);
    assert_eq!(models.resident_bytes(), FIXED + 4 * BLOCK, "the freed block is no longer counted");
    models.enter("denoise").unwrap();
    let stage = sink.of_kind(EventKind::Stage).pop().unwrap();
    assert_eq!(stage.resident(), Some(FIXED + 4 * BLOCK), "what the trace's window reads");
}

#[test]
fn a_loader_that_ignores_the_files_stream_plan_is_refused_not_left_with_its_initial_weights() {
    use stageload::{Built, ModelSpec, StageError, StagedModels};
    let (_one, dir, _file) = setup();
    let models = StagedModels::builder()
        .pipeline(&streaming_pipeline(dir.path(), true))
        .model(ModelSpec::new("flow", |_| {
            let vs = VarStore::new(Device::Cpu);
            let net = Net::new(&vs);
            Ok(Built::new(net, &vs))
        }))
        .build()
        .unwrap();
    models.enter("denoise").unwrap();
    let err = models.get::<Net>("flow").err().unwrap();
    assert!(matches!(err, StageError::PlanMismatch { .. }), "{err}");
    assert!(err.to_string().contains("StreamedModel::planned(name, tensors, ctx.stream())"), "{err}");
}

#[test]
fn a_transient_inside_a_block_seen_by_the_high_water_mark_counts_as_working_memory() {
    use std::sync::atomic::{AtomicU64, Ordering};
    let (_one, _dir, file) = setup();
    let (net, model) = streamed(&file, budget_for(4)).unwrap();
    // Boundaries see nothing; the high-water mark rises by three blocks inside block 3.
    let mark = Arc::new(AtomicU64::new(100));
    let scripted = Arc::clone(&mark);
    let mut model = model;
    model.reading(|| Some(100)).peak_reading(move || Some(scripted.load(Ordering::Relaxed)));
    let x = Tensor::randn([16, WIDTH], (Kind::Float, Device::Cpu));
    let _ = tch::no_grad(|| {
        model.run(|step| {
            net.forward_observed(&x, step, |i| {
                if i == 3 {
                    mark.fetch_add(3 * BLOCK, Ordering::Relaxed);
                }
            })
        })
    })
    .unwrap();
    assert_eq!(model.working(), 3 * BLOCK, "boundaries alone would say 0");
    assert_eq!(model.split().resident, 1, "{}", model.residency());
    // A step that does not raise the mark measures nothing new.
    let _ = tch::no_grad(|| model.run(|step| net.forward_streamed(&x, step))).unwrap();
    assert_eq!(model.working(), 3 * BLOCK);
}

#[test]
fn a_model_placed_without_memory_is_set_up_from_nothing_and_gives_the_same_outputs() {
    let (_one, _dir, file) = setup();
    let expected = reference(&file);
    let vs = VarStore::new(Device::Cpu);
    let net = stageload_torch_sys::without_fills(|| Net::new(&vs));
    let tensors = stageload::named_tensors(&vs);
    // On a GPU this is the move to the device, one tensor at a time; here it proves the
    // mechanism: every tensor ends without memory, the modules still see it.
    stageload::stream::place("net", &tensors, Device::Cpu).unwrap();
    assert_eq!(filled(&tensors), 0);
    assert!(tensors.iter().all(|(_, t)| !stageload_torch_sys::storage_info(t).unwrap().allocated));
    let checkpoint = Checkpoint::open(&[&file]).unwrap();
    let shallow = tensors.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect();
    let mut model =
        StreamedModel::new("net", shallow, checkpoint, &NameRules::default(), &spec(), budget_for(2)).unwrap();
    model.reading(|| None);
    assert_eq!(filled(&tensors), 2, "the resident prefix got its memory back");
    let outputs = run_steps(&net, &mut model, 3);
    for (got, want) in outputs.iter().zip(&expected) {
        assert!(got.equal(want));
    }
}

#[test]
fn the_governor_streams_one_more_block_each_step_while_the_machine_is_short_and_the_result_holds() {
    use std::sync::atomic::{AtomicU64, Ordering};
    let (_one, _dir, file) = setup();
    let expected = reference(&file);
    let (net, model) = streamed(&file, FIXED + BLOCK * DEPTH as u64).unwrap();
    let available = Arc::new(AtomicU64::new(100 << 20));
    let reading = Arc::clone(&available);
    let sink = Arc::new(ListSink::new());
    let mut model = model;
    model.governor_reading(64 << 20, move || Some(reading.load(Ordering::Relaxed))).events(sink.clone());
    tch::manual_seed(11);
    let mut outputs = Vec::new();
    for step in 0..3 {
        // Memory runs short after the first step.
        if step == 1 {
            available.store(32 << 20, Ordering::Relaxed);
        }
        let x = Tensor::randn([16, WIDTH], (Kind::Float, Device::Cpu));
        outputs.push(tch::no_grad(|| model.run(|s| net.forward_streamed(&x, s))).unwrap());
    }
    assert_eq!(model.split().resident, DEPTH - 2, "one block per short step: {}", model.residency());
    let reasons: Vec<String> =
        sink.of_kind(EventKind::Residency).iter().map(|e| e.residency().unwrap().reason.clone()).collect();
    assert_eq!(reasons, ["start", "memory pressure", "memory pressure"]);
    for (got, want) in outputs.iter().zip(&expected) {
        assert!(got.equal(want));
    }
}

/// A streamed net whose forward runs its blocks in any order: no prefix, the room is the hot set.
fn any_order(file: &Path, budget: u64) -> WithTensors {
    let (net, mut model, tensors) = streamed_with_tensors(file, budget).unwrap();
    model.any_order().unwrap();
    (net, model, tensors)
}

#[test]
fn a_forward_in_order_keeps_the_blocks_it_kept_first_hot_and_refills_only_the_others() {
    let (_one, _dir, file) = setup();
    let expected = reference(&file);
    // Two slots and room for three blocks.
    let (net, model, tensors) = any_order(&file, budget_for(3));
    let sink = Arc::new(ListSink::new());
    let mut model = model;
    model.events(sink.clone());
    assert_eq!((model.split().resident, model.split().hot), (0, 3 * BLOCK), "{}", model.residency());
    assert!(model.residency().ends_with("in any order (a step reads only the blocks it runs and does not find hot)"));
    assert_eq!(filled(&tensors), 3, "the prefix set-up read is kept hot");
    let outputs = run_steps(&net, &mut model, 3);
    for (step, (got, want)) in outputs.iter().zip(&expected).enumerate() {
        assert!(got.equal(want), "step {step} differs");
    }
    assert_eq!(filled(&tensors), 3, "between steps the hot set stays");
    let stats = model.stats();
    assert_eq!((stats.refills, stats.hot_hits), (3 * 5, 3 * 3), "the three found every step, the five read");
    // When the model goes, one `end` event says what it moved.
    drop(model);
    let end = sink.of_kind(EventKind::Residency).pop().unwrap();
    let totals = end.residency().cloned().unwrap();
    assert_eq!((totals.reason.as_str(), totals.refills, totals.hot_hits), ("end", 15, 9));
    assert_eq!((end.bytes(), end.seconds()), (Some(stats.bytes_refilled), Some(stats.refill_seconds)));
    // The prefix under the same budget moves the same bytes: in order, the hot set is that prefix.
    let (net, mut prefix) = streamed(&file, budget_for(3)).unwrap();
    let _ = run_steps(&net, &mut prefix, 3);
    assert_eq!(stats.bytes_refilled, prefix.stats().bytes_refilled);

    // Without room (a budget for the slots only) every block is read every step.
    let (net, mut cold, tensors) = any_order(&file, budget_for(0));
    assert_eq!((filled(&tensors), cold.split().hot), (0, 0));
    let _ = run_steps(&net, &mut cold, 2);
    assert_eq!((cold.stats().refills, cold.stats().hot_hits), (2 * 8, 0));
}

#[test]
fn experts_used_every_step_stay_hot_while_one_used_once_goes_through_a_slot() {
    let (_one, _dir, file) = setup();
    // Step s runs block s % 6 (a rare expert), then 6 and 7 (used every step), naming each next
    // block ahead; the room holds two (at first 0 and 1, set-up's prefix).
    let order = |s: usize| [s % 6, 6, 7];
    let steps = 8;
    let expected = routed_reference(&file, steps, |s| order(s).to_vec());
    let (net, mut model, tensors) = any_order(&file, budget_for(2));
    tch::manual_seed(11);
    let mut refills = Vec::new();
    for (s, want) in expected.iter().enumerate() {
        let x = Tensor::randn([16, WIDTH], (Kind::Float, Device::Cpu));
        let before = model.stats().refills;
        let blocks = order(s);
        let got = routed_step(&net, &mut model, &x, &blocks, |step, k| match blocks.get(k + 1) {
            Some(&next) => step.prefetch(next),
            None => Ok(()),
        });
        assert!(got.equal(want), "step {s} differs");
        refills.push(model.stats().refills - before);
    }
    assert_eq!(refills[3..], [1; 5], "from the fourth step only the rare expert is read: {refills:?}");
    assert_eq!(filled(&tensors), 2);
    assert!(is_filled(&tensors, 6) && is_filled(&tensors, 7), "the two experts used every step stay");
    assert!(model.stats().hot_hits >= 10, "{:?}", model.stats());
    let err = tch::no_grad(|| model.run(|step| step.prefetch(DEPTH))).unwrap_err();
    assert!(matches!(err, StreamError::NoSuchBlock { index: DEPTH, .. }), "{err}");
}

#[test]
fn the_next_steps_blocks_named_ahead_read_the_first_not_hot_while_the_hot_ones_run() {
    let (_one, _dir, file) = setup();
    // Step s runs 6 and 7 (used every step, soon hot), then a rare expert s % 6; each block
    // names what runs after it, the next step's blocks included.
    let order = |s: usize| [6, 7, s % 6];
    let steps = 8;
    let expected = routed_reference(&file, steps, |s| order(s).to_vec());
    let (net, mut model, tensors) = any_order(&file, budget_for(2));
    tch::manual_seed(11);
    let mut carried = Vec::new();
    for (s, want) in expected.iter().enumerate() {
        let x = Tensor::randn([16, WIDTH], (Kind::Float, Device::Cpu));
        let before = model.stats().carried;
        let blocks = order(s);
        let got = routed_step(&net, &mut model, &x, &blocks, |step, k| {
            let ahead: Vec<usize> = blocks[k + 1..].iter().chain(&order(s + 1)).copied().collect();
            step.prefetch_first(&ahead)
        });
        assert!(got.equal(want), "step {s} differs");
        carried.push(model.stats().carried - before);
    }
    assert!(is_filled(&tensors, 6) && is_filled(&tensors, 7), "the two used every step stay hot");
    // Once 6 and 7 are hot, the rare expert of each step was read while the step before ended.
    assert_eq!(carried[4..], [1; 4], "{carried:?}");
    let err = tch::no_grad(|| model.run(|step| step.prefetch_first(&[0, DEPTH]))).unwrap_err();
    assert!(matches!(err, StreamError::NoSuchBlock { index: DEPTH, .. }), "{err}");
}

#[test]
fn naming_the_block_that_runs_now_for_the_next_step_reads_nothing_past_it() {
    let (_one, _dir, file) = setup();
    let (net, mut model, _tensors) = any_order(&file, FIXED + 2 * BLOCK);
    let x = Tensor::randn([16, WIDTH], (Kind::Float, Device::Cpu));
    for _ in 0..4 {
        // Each step runs block 3 alone and names 3 (then 4) for the next: 3 cannot be read
        // while it runs, and reading 4 instead would be thrown away when the next step begins with 3.
        let _ = tch::no_grad(|| {
            model.run(|step| {
                step.block(3)?;
                step.prefetch_first(&[3, 4])?;
                Ok(net.block(3, &x))
            })
        })
        .unwrap();
    }
    let stats = model.stats();
    assert_eq!((stats.refills, stats.carried), (4, 0), "{stats:?}");
}

#[test]
fn an_out_of_memory_gives_up_the_hot_set_first_and_the_step_gives_the_same_result() {
    let (_one, _dir, file) = setup();
    let expected = reference(&file);
    let (net, model, tensors) = any_order(&file, budget_for(3));
    let sink = Arc::new(ListSink::new());
    let mut model = model;
    model.events(sink.clone());
    tch::manual_seed(11);
    let x = Tensor::randn([16, WIDTH], (Kind::Float, Device::Cpu));
    let y = tch::no_grad(|| {
        model.run(|step| {
            if step.split().hot > 0 {
                let _ = Tensor::f_empty([1i64 << 48], (Kind::Float, Device::Cpu))?;
            }
            net.forward_streamed(&x, step)
        })
    })
    .unwrap();
    assert!(y.equal(&expected[0]));
    assert_eq!((model.split().resident, model.split().hot, model.stats().retries), (0, 0, 1));
    assert_eq!(filled(&tensors), 0, "nothing kept hot after the retry");
    let reasons: Vec<String> =
        sink.of_kind(EventKind::Residency).iter().map(|e| e.residency().unwrap().reason.clone()).collect();
    assert_eq!(reasons, ["start", "out of memory"]);
    let err = tch::no_grad(|| {
        model.run(|step| {
            let _ = Tensor::f_empty([1i64 << 48], (Kind::Float, Device::Cpu))?;
            net.forward_streamed(&x, step)
        })
    })
    .unwrap_err();
    assert!(matches!(err, StreamError::OutOfMemory { .. }), "no hot set, nothing resident: {err}");
}

#[test]
fn the_governor_frees_hot_blocks_for_the_shortfall_before_it_streams_resident_ones() {
    use std::sync::atomic::{AtomicU64, Ordering};
    let (_one, _dir, file) = setup();
    let expected = reference(&file);
    let (net, model, tensors) = any_order(&file, budget_for(3));
    let floor = 64 << 20;
    let available = Arc::new(AtomicU64::new(floor));
    let reading = Arc::clone(&available);
    let mut model = model;
    model.governor_reading(floor, move || Some(reading.load(Ordering::Relaxed)));
    tch::manual_seed(11);
    let mut held = Vec::new();
    for (step, want) in expected.iter().enumerate() {
        // A block and a half short before the second step, enough again before the third.
        available.store(if step == 1 { floor - BLOCK * 3 / 2 } else { floor }, Ordering::Relaxed);
        let x = Tensor::randn([16, WIDTH], (Kind::Float, Device::Cpu));
        let y = tch::no_grad(|| model.run(|s| net.forward_streamed(&x, s))).unwrap();
        assert!(y.equal(want), "step {step}");
        held.push(filled(&tensors));
    }
    assert_eq!(held, [3, 1, 1], "two hot blocks go for 1.5 blocks short; the room stays shrunk");
    assert_eq!(model.split().hot, 3 * BLOCK - BLOCK * 3 / 2);
}

#[test]
fn under_memory_pressure_the_hot_set_halves_once_per_window_and_the_result_holds() {
    use std::sync::atomic::{AtomicU64, Ordering};
    let (_one, _dir, file) = setup();
    let expected = reference(&file);
    let (net, model, tensors) = any_order(&file, budget_for(3));
    // Percent stalled, scripted (in hundredths); PSI's own reading drives `governor_pressure`.
    let stalled = Arc::new(AtomicU64::new(0));
    let reading = Arc::clone(&stalled);
    let mut model = model;
    model.governor_pressure_reading(10.0, move || Some(reading.load(Ordering::Relaxed) as f64 / 100.0)).unwrap();
    tch::manual_seed(11);
    let mut held = Vec::new();
    for (step, want) in expected.iter().enumerate() {
        // Pressed from the second step on: the second halves the room, the third is inside the
        // window in which the average has not yet seen it.
        stalled.store(if step == 0 { 0 } else { 4_000 }, Ordering::Relaxed);
        let x = Tensor::randn([16, WIDTH], (Kind::Float, Device::Cpu));
        let y = tch::no_grad(|| model.run(|s| net.forward_streamed(&x, s))).unwrap();
        assert!(y.equal(want), "step {step}");
        held.push(filled(&tensors));
    }
    assert_eq!(held, [3, 1, 1], "3 hot blocks, then room for 1.5 of them");
    assert_eq!(model.split().hot, 3 * BLOCK / 2);
    // The kernel's own reading (no pressure on a test machine, or none at all): same outputs.
    let (net, model, _) = any_order(&file, budget_for(3));
    let mut model = model;
    model.governor_pressure(10.0).unwrap();
    tch::manual_seed(11);
    let x = Tensor::randn([16, WIDTH], (Kind::Float, Device::Cpu));
    assert!(tch::no_grad(|| model.run(|s| net.forward_streamed(&x, s))).unwrap().equal(&expected[0]));
}

#[test]
fn a_pressure_threshold_that_is_not_a_percent_is_refused_by_name() {
    let (_one, _dir, file) = setup();
    for threshold in [0.0, -5.0, 100.5, f64::NAN] {
        let (_, mut model, _) = streamed_with_tensors(&file, budget_for(3)).unwrap();
        let error = model.governor_pressure(threshold).unwrap_err().to_string();
        assert!(
            error.starts_with("streamed model 'net': a pressure threshold of") && error.contains("at most 100"),
            "{error}"
        );
    }
}

#[test]
fn refills_past_the_page_cache_give_the_same_outputs() {
    let (_one, _dir, file) = setup();
    let expected = reference(&file);
    let (net, model) = streamed(&file, budget_for(2)).unwrap();
    let mut model = model;
    model.uncached();
    let outputs = run_steps(&net, &mut model, 3);
    for (step, (got, want)) in outputs.iter().zip(&expected).enumerate() {
        assert!(got.equal(want), "step {step} differs");
    }
    assert_eq!(model.stats().refills, 3 * 6);
    // Dropping pages of entries it has and skipping names it has not is not an error.
    let checkpoint = Checkpoint::open(&[&file]).unwrap();
    checkpoint.drop_cached(["blocks.0.fc1.weight", "no.such.tensor"]).unwrap();
}

#[test]
fn refills_past_the_page_cache_read_direct_into_their_slots_when_asked_and_buffered_when_not() {
    let (_one, _dir, file) = setup();
    let expected = reference_steps(&file, 5);
    let (net, mut model) = streamed(&file, budget_for(2)).unwrap();
    model.uncached();
    // Every block lies in the file as its slot lays it out (f32 tensors of whole 64-byte lines);
    // where the file system has no O_DIRECT (tmpfs) every read stays buffered.
    let reads_direct = nix::sys::statfs::statfs(&file).unwrap().filesystem_type() != nix::sys::statfs::TMPFS_MAGIC;
    tch::manual_seed(11);
    let step = |model: &mut StreamedModel, i: usize| {
        let x = Tensor::randn([16, WIDTH], (Kind::Float, Device::Cpu));
        let out = tch::no_grad(|| model.run(|step| net.forward_streamed(&x, step))).unwrap();
        assert!(out.equal(&expected[i]), "step {i}");
        model.stats().bytes_direct
    };
    // Adaptive (the default) reads buffered until a step has shown it is limited by its compute
    // (when it is is decided from the measured waits, `stageload_plan::split::direct_reads`,
    // tested there).
    assert_eq!(step(&mut model, 0), 0, "the first step reads buffered");
    // Always: every refill from the next on lands in its slot from the disk, the same outputs.
    model.direct_reads(DirectReads::Always);
    let after_second = step(&mut model, 1);
    assert_eq!(after_second > 0, reads_direct, "bytes read direct: {after_second}");
    // Never: the next step reads buffered but for the read the step before carried into it,
    // already direct; the one after reads buffered only.
    model.direct_reads(DirectReads::Never);
    let after: Vec<u64> = (2..5).map(|i| step(&mut model, i)).collect();
    assert_eq!(after[2], after[1], "turned off, every read buffered");
}

/// Hidden widths of the uneven net's six blocks: the largest first, in the middle, last.
const UNEVEN: [[i64; 6]; 3] = [[512, 64, 128, 64, 256, 64], [64, 128, 512, 64, 256, 64], [64, 128, 64, 256, 64, 512]];

/// A net whose blocks differ in size: block `i` widens to `widths[i]` and back.
struct Uneven {
    input: nn::Linear,
    blocks: Vec<(nn::Linear, nn::Linear)>,
    output: nn::Linear,
}

impl Uneven {
    fn new(vs: &VarStore, widths: &[i64]) -> Uneven {
        let p = vs.root();
        let linear = |path: nn::Path, i, o| nn::linear(path, i, o, Default::default());
        Uneven {
            input: linear(&p / "input", WIDTH, WIDTH),
            blocks: widths
                .iter()
                .enumerate()
                .map(|(i, &w)| {
                    (linear(&p / "blocks" / i / "fc1", WIDTH, w), linear(&p / "blocks" / i / "fc2", w, WIDTH))
                })
                .collect(),
            output: linear(&p / "output", WIDTH, WIDTH),
        }
    }

    /// The forward, with a call at each block boundary when streamed.
    fn forward(&self, x: &Tensor, mut step: Option<&mut Step<'_>>) -> Result<Tensor, StreamError> {
        let mut x = x.apply(&self.input);
        for (i, (fc1, fc2)) in self.blocks.iter().enumerate() {
            if let Some(step) = step.as_mut() {
                step.block(i)?;
            }
            x = &x + x.apply(fc1).gelu("none").apply(fc2);
        }
        Ok(x.apply(&self.output))
    }
}

/// The uneven net's checkpoint, seeded noise, and the net's output on it loaded whole.
fn uneven_checkpoint(dir: &Path, widths: &[i64]) -> (PathBuf, Tensor, Tensor) {
    tch::manual_seed(7);
    let vs = VarStore::new(Device::Cpu);
    let net = Uneven::new(&vs, widths);
    let path = dir.join("uneven.safetensors");
    stageload::checkpoint::save(&vs.variables().into_iter().collect::<Vec<_>>(), &path).unwrap();
    tch::manual_seed(11);
    let x = Tensor::randn([16, WIDTH], (Kind::Float, Device::Cpu));
    let y = tch::no_grad(|| net.forward(&x, None)).unwrap();
    (path, x, y)
}

fn uneven_streamed(file: &Path, widths: &[i64], budget: u64) -> (Uneven, StreamedModel) {
    let vs = VarStore::new(Device::Cpu);
    let net = stageload_torch_sys::without_fills(|| Uneven::new(&vs, widths));
    let checkpoint = Checkpoint::open(&[file]).unwrap();
    let mut model =
        StreamedModel::new("uneven", stageload::named_tensors(&vs), checkpoint, &NameRules::default(), &spec(), budget)
            .unwrap();
    model.reading(|| None);
    (net, model)
}

#[test]
fn what_a_streamed_model_holds_by_its_storages_stays_within_its_budget_whatever_the_order_of_its_block_sizes() {
    let (_one, dir, _) = setup();
    for widths in UNEVEN {
        let (file, x, expected) = uneven_checkpoint(dir.path(), &widths);
        let n = widths.len();
        let sizes = uneven_streamed(&file, &widths, u64::MAX).1.sizes().clone();
        for resident in [0, 1, n / 2, n - 1] {
            // What `resident` blocks and their slots need, and room for the smallest block hot.
            let slots = (n - resident).min(2);
            let budget = sizes.need(resident, slots, 0) + sizes.blocks.iter().copied().min().unwrap();
            let (net, mut model) = uneven_streamed(&file, &widths, budget);
            if model.split().resident > resident {
                model.limit_resident(resident).unwrap();
            }
            let case = format!("widths {widths:?}, {resident} resident, budget {budget}");
            assert!(model.held_bytes() <= budget, "{case}: set-up holds {}", model.held_bytes());
            // One step (a real libtorch out-of-memory inside it first when `fail`); what the
            // model holds after it.
            let step = |model: &mut StreamedModel, mut fail: bool| {
                let y = tch::no_grad(|| {
                    model.run(|step| {
                        if std::mem::take(&mut fail) {
                            let _ = Tensor::f_empty([1i64 << 48], (Kind::Float, Device::Cpu))?;
                        }
                        net.forward(&x, Some(step))
                    })
                })
                .unwrap();
                assert!(y.equal(&expected), "{case}: the output differs");
                assert!(
                    model.stats().most_held <= budget,
                    "{case}: {} held at a block boundary",
                    model.stats().most_held
                );
                model.held_bytes()
            };
            let held = (0..2).map(|_| step(&mut model, false)).max().unwrap();
            assert_eq!(model.split().resident, resident, "{case}");
            // Evictions until every block streams: none raises what the model holds.
            let mut before = held;
            while model.split().resident > 0 || model.split().hot > 0 {
                let split = model.split();
                let after = step(&mut model, true);
                assert!(after <= before, "{case}: {split:?} held {before}, then {:?} {after}", model.split());
                before = after;
            }
            model.reset().unwrap();
            step(&mut model, false);
            assert!(model.held_bytes() <= budget, "{case}: {} held after reset", model.held_bytes());
        }
    }
}

#[test]
fn a_checkpoint_written_in_place_under_a_live_streamer_fails_the_next_refill_instead_of_mixing_versions() {
    let (_one, _dir, file) = setup();
    let expected = reference(&file);
    let (net, mut model) = streamed(&file, budget_for(1)).unwrap();
    tch::manual_seed(11);
    let x = Tensor::randn([16, WIDTH], (Kind::Float, Device::Cpu));
    let y = tch::no_grad(|| model.run(|step| net.forward_streamed(&x, step))).unwrap();
    assert!(y.equal(&expected[0]), "the blocks refilled from the file as it was");
    // The same bytes written over it, in place: the file the streamer keeps open changed.
    let bytes = std::fs::read(&file).unwrap();
    std::io::Write::write_all(&mut std::fs::OpenOptions::new().write(true).open(&file).unwrap(), &bytes).unwrap();
    let err = tch::no_grad(|| model.run(|step| net.forward_streamed(&x, step))).unwrap_err();
    match &err {
        StreamError::Checkpoint { model, source } => {
            assert_eq!(model, "net");
            assert!(matches!(**source, stageload::CheckpointError::Changed { ref path, .. } if *path == file), "{err}");
        }
        other => panic!("not a changed checkpoint: {other}"),
    }
}

#[test]
fn a_streamed_models_checkpoint_replaced_between_a_release_and_its_rebuild_is_refused_naming_the_file() {
    let (_one, dir, file) = setup();
    let stream = format!(
        r#"{{ blocks = ["blocks.*"], resident = ["input", "output"], working = "{BLOCK}", budget = "{}" }}"#,
        budget_for(3) + BLOCK
    );
    let path = dir.path().join("pipeline.toml");
    std::fs::write(
        &path,
        format!(
            "[[models]]\nname = \"flow\"\nfiles = [\"net.safetensors\"]\nstream = {stream}\n\n\
             [[stages]]\nname = \"denoise\"\nmodels = [\"flow\"]\n\n[[stages]]\nname = \"other\"\nmodels = []\n"
        ),
    )
    .unwrap();
    let pipeline = stageload::Pipeline::load(&path).unwrap();
    let sink = Arc::new(ListSink::new());
    let models = flow_builder(&pipeline, sink.clone(), Default::default()).build().unwrap();
    models.enter("denoise").unwrap();
    models.call("flow", |_: &mut StreamedNet| ()).unwrap();
    models.enter("other").unwrap();
    // Another checkpoint of the same names and shapes renamed over it (a re-export).
    let beside = dir.path().join("new.safetensors");
    std::fs::copy(&file, &beside).unwrap();
    std::fs::rename(&beside, &file).unwrap();
    models.enter("denoise").unwrap();
    match models.call("flow", |_: &mut StreamedNet| ()) {
        Err(stageload::StageError::SourceChanged(changed)) => {
            assert_eq!((changed.model.as_str(), changed.path.as_path()), ("flow", file.as_path()));
            assert_eq!(changed.change, stageload::source::FileChange::Replaced);
        }
        other => panic!("not a changed source: {other:?}"),
    }
    assert!(sink.of_kind(EventKind::Error).iter().any(|e| e.model() == Some("flow")), "an error event");
    models.accept_changed_files("flow").unwrap();
    models.call("flow", |_: &mut StreamedNet| ()).unwrap();
}
