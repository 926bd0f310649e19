//! `stageload`: the torch-free command line. `guard` runs one heavy command only when there is
//! room and stops it before it takes the machine down (see [`guard`]); `run` does the same in
//! turn with the other runs of its lane, and `queue` lists them (see [`queue`]); `plan` says before a run
//! whether a staged pipeline fits this machine (see [`plan`]); `summary` and `plot` show where a
//! recorded run's memory went (see [`trace`]); `ab` runs commands alternately under the guard and
//! compares them, `latents` compares latents files (see [`ab`]); `libtorch` finds or installs
//! libtorch for a crate that uses stageload (see [`libtorch`]). With no arguments it prints
//! [`TOUR`]; each command's `--help` ends with an example line.

mod ab;
mod args;
mod guard;
mod libtorch;
mod out;
mod plan;
mod queue;
mod trace;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "stageload", version, about = "Run staged libtorch pipelines without taking the machine down")]
struct Cli {
    #[command(subcommand)]
    command: Option<Commands>,
}

/// What `stageload` with no arguments prints: each command in one line, in the order a pipeline
/// meets them, and where to read more.
const TOUR: &str = "\
stageload: run staged libtorch pipelines without taking the machine down (torch-free).

A tour, in the order a pipeline meets it:
  stageload plan pipeline.toml                        will the staged pipeline fit, stage by stage?
  stageload guard --max-memory 20G -- python run.py   start when there is room, stop before the machine goes down
  stageload run --lane ram -- python run.py           the same, queued behind the lane's other runs, metered
  stageload queue                                     what runs and what waits, lane by lane
  stageload summary staged.jsonl                      where a recorded run's memory went, stage by stage
  stageload plot eager.jsonl staged.jsonl -o mem.svg  the same as a chart (.svg or .png)
  stageload ab --out ab/ -- CMD_A -- CMD_B            two commands run alternately under the guard, compared
  stageload latents eager.safetensors --against staged.safetensors   the same results, bit for bit?
  stageload libtorch                                  where libtorch is, for a crate that uses stageload

`stageload COMMAND --help` says more and ends with an example; the guide is docs/cli.md.";

#[derive(Subcommand)]
enum Commands {
    Guard(guard::GuardArgs),
    Run(queue::RunArgs),
    Queue(queue::QueueArgs),
    Plan(plan::PlanArgs),
    Summary(trace::SummaryArgs),
    Plot(trace::PlotArgs),
    Ab(ab::AbArgs),
    Latents(ab::LatentsArgs),
    Libtorch(libtorch::LibtorchArgs),
}

fn main() -> ExitCode {
    // What the libraries log (`RUST_LOG`, default warnings) goes to stderr.
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
    let Some(command) = Cli::parse().command else {
        out::line(TOUR);
        return ExitCode::SUCCESS;
    };
    let code = match command {
        Commands::Guard(args) => guard::run(args),
        Commands::Run(args) => queue::run(args),
        Commands::Queue(args) => queue::queue(args),
        Commands::Plan(args) => plan::run(args),
        Commands::Summary(args) => trace::summary(args),
        Commands::Plot(args) => trace::plot(args),
        Commands::Ab(args) => ab::ab(args),
        Commands::Latents(args) => ab::latents(args),
        Commands::Libtorch(args) => libtorch::run(args),
    };
    ExitCode::from(u8::try_from(code).unwrap_or(u8::MAX))
}
