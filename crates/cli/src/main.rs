//! `stageload`: the torch-free command line. `guard` runs one heavy command only when there is
//! room and stops it before it takes the machine down (see [`guard`]); `plan` says before a run
//! whether a staged pipeline fits this machine (see [`plan`]); `summary` and `plot` show where a
//! recorded run's memory went (see [`trace`]); `ab` runs commands alternately under the guard and
//! compares them, `latents` compares latents files (see [`ab`]); `libtorch` finds or installs
//! libtorch for a crate that uses stageload (see [`libtorch`]).

mod ab;
mod args;
mod guard;
mod libtorch;
mod out;
mod plan;
mod trace;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "stageload", version, about = "Run staged libtorch pipelines without taking the machine down")]
struct Cli {
    #[command(subcommand)]
    command: Commands,
}

#[derive(Subcommand)]
enum Commands {
    Guard(guard::GuardArgs),
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
    let cli = Cli::parse();
    let code = match cli.command {
        Commands::Guard(args) => guard::run(args),
        Commands::Plan(args) => plan::run(args),
        Commands::Summary(args) => trace::summary(args),
        Commands::Plot(args) => trace::plot(args),
        Commands::Ab(args) => ab::ab(args),
        Commands::Latents(args) => ab::latents(args),
        Commands::Libtorch(args) => libtorch::run(args),
    };
    ExitCode::from(u8::try_from(code).unwrap_or(u8::MAX))
}
