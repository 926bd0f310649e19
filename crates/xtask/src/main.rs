//! `cargo xtask TASK`: the project's tasks in Rust (the alias is in `.cargo/config.toml`). The
//! README's two commands are `cargo xtask demo` and `cargo xtask test`; `.ci/run` calls the
//! second. Torch-free: the tasks build and run the crates that link libtorch, after the set-up
//! scripts (the only shell left: they install torch, the reference packages and Ray) have said
//! where it is.
//!
//! - [`shell`]: commands from the root with the set-up environment, shown, logged, checked.
//! - [`ab`]: `stageload ab` comparisons and the medians read back from their report.
//! - [`lanes`]: the test lanes.
//! - [`demos`]: the demo, block streaming, Stable Diffusion, Shap-E and Wan2.1 against diffusers.
//! - [`benches`]: the hot set, prefetch, checkpoint loads, the guard, many jobs under Ray.
//! - [`gpu`]: the GPU check, built here and run on a GPU machine without cargo.

mod ab;
mod benches;
mod demos;
mod gpu;
mod lanes;
mod shell;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// The project's tasks.
#[derive(Parser)]
#[command(name = "cargo xtask")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Every check (the README's test command, what CI runs): formatting, clippy, the torch-free
    /// lane, the macOS compile check; then clippy, tests and documentation of everything that
    /// links libtorch (installed on first use)
    Test {
        /// Only formatting, clippy and the torch-free lane
        #[arg(long)]
        torch_free: bool,
        /// More arguments for both `cargo test` runs
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// The README's main job, about 6 minutes on 2 cores after its build: the cascade eager,
    /// staged and staged with prefetch under `stageload ab`, the plan checked against the runs,
    /// then block streaming, and Stable Diffusion, Shap-E and Wan2.1 at small sizes against
    /// diffusers
    Demo {
        /// The folder for every file
        #[arg(long, default_value = "target/demo")]
        out: PathBuf,
        /// The pipelines at their published sizes, streaming's step times and hot set, and Python
        /// beside the original: about an hour on 2 cores, and the exports once more the first time
        #[arg(long)]
        published: bool,
        /// Parts to leave out, comma-separated
        #[arg(long, value_delimiter = ',', value_enum)]
        skip: Vec<demos::Part>,
        /// More cascade arguments for every run (e.g. --scale 0.1)
        #[arg(last = true)]
        cascade: Vec<String>,
    },
    /// One example of the library (examples/), libtorch set up first: `cargo xtask example
    /// two_models` is `eval "$(scripts/setup-libtorch.sh)"` then `cargo run --example two_models`
    Example {
        /// two_models, cascade, text_to_image, stream, minilm, stable_diffusion, shap_e, wan
        name: String,
        /// Build with optimisations
        #[arg(long)]
        release: bool,
        /// The example's arguments
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Block streaming: a model larger than its guard's limit, streamed; step times; the hot set
    StreamDemo {
        #[arg(long, default_value = "target/demo/stream")]
        out: PathBuf,
    },
    /// Stable Diffusion 1.5 at its published sizes, staged, and against diffusers
    SdDemo {
        #[arg(long, default_value = "target/demo/stable-diffusion")]
        out: PathBuf,
    },
    /// Shap-E image-to-3D at its published sizes, staged, and against diffusers
    ShapEDemo {
        #[arg(long, default_value = "target/demo/shap-e")]
        out: PathBuf,
    },
    /// Wan2.1 text-to-video at its published sizes, staged, under the guard, and against diffusers
    WanDemo {
        #[arg(long, default_value = "target/demo/wan")]
        out: PathBuf,
    },
    /// The Python package: Stable Diffusion 1.5 from a diffusers folder, unwrapped, under the
    /// original Python stageload and staged by stageload_rs, side by side
    PythonDemo {
        #[arg(long, default_value = "target/demo/python")]
        out: PathBuf,
        /// Runs of each arm
        #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=100))]
        rounds: u16,
    },
    /// The hot set of a streamed model under a router's access, from the page cache and the disk
    HotSetBench {
        #[arg(long, default_value = "target/hot-set-bench")]
        out: PathBuf,
        /// Runs of each arm
        #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=100))]
        runs: u16,
    },
    /// Staged with prefetch against eager and staged, on a warm and a cold page cache
    PrefetchBench {
        #[arg(long, default_value = "target/prefetch-bench")]
        out: PathBuf,
        /// More cascade arguments (e.g. --scale 0.5)
        #[arg(last = true)]
        cascade: Vec<String>,
    },
    /// Checkpoint loads: stageload against the limits, tch and every Python loader peer
    BenchLoad {
        /// The benchmark's arguments (e.g. --cold)
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// `stageload guard`'s reaction time, overshoot and CPU cost (torch-free)
    BenchGuard {
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Cascade jobs eager and then staged under a local Ray cluster, each inside the guard
    ManyJobs {
        #[arg(long, default_value = "traces/many-jobs")]
        out: PathBuf,
        #[arg(long, default_value_t = 8)]
        jobs: u32,
        #[arg(long, default_value = "0.25")]
        scale: String,
    },
    /// The GPU check: `build` here (the device kit, against the GPU machine's torch), then `run`
    /// there (`target/device-kit/bin/xtask gpu-check run`)
    GpuCheck {
        #[command(subcommand)]
        step: gpu::Step,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let done = shell::Shell::here().and_then(|mut shell| match cli.task {
        Task::Test { torch_free, args } => lanes::test(&mut shell, torch_free, &args),
        Task::Demo { out, published, skip, cascade } => {
            let sizes = if published { demos::Sizes::Published } else { demos::Sizes::Small };
            demos::demo(&mut shell, &out, &skip, &cascade, sizes)
        }
        Task::Example { name, release, args } => demos::example(&mut shell, &name, release, &args),
        Task::StreamDemo { out } => demos::stream_demo(&mut shell, &out),
        Task::SdDemo { out } => demos::sd_demo(&mut shell, &out),
        Task::PythonDemo { out, rounds } => demos::python_demo(&mut shell, &out, rounds),
        Task::ShapEDemo { out } => demos::shap_e_demo(&mut shell, &out),
        Task::WanDemo { out } => demos::wan_demo(&mut shell, &out),
        Task::HotSetBench { out, runs } => benches::hot_set(&mut shell, &out, runs),
        Task::PrefetchBench { out, cascade } => benches::prefetch(&mut shell, &out, &cascade),
        Task::BenchLoad { args } => benches::load(&mut shell, &args),
        Task::BenchGuard { args } => benches::guard(&shell, &args),
        Task::ManyJobs { out, jobs, scale } => benches::many_jobs(&mut shell, &out, jobs, &scale),
        Task::GpuCheck { step } => gpu::task(&mut shell, step),
    });
    match done {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("cargo xtask: {error}");
            ExitCode::FAILURE
        }
    }
}
