//! `stageload`: the torch-free command line. `guard` runs one heavy command only when there is
//! room and stops it before it takes the machine down (see [`guard`]); `plan` says before a run
//! whether a staged pipeline fits this machine (see [`plan`]); `summary` and `plot` show where a
//! recorded run's memory went (see [`trace`]).

mod args;
mod guard;
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
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let code = match cli.command {
        Commands::Guard(args) => guard::run(args),
        Commands::Plan(args) => plan::run(args),
        Commands::Summary(args) => trace::summary(args),
        Commands::Plot(args) => trace::plot(args),
    };
    ExitCode::from(u8::try_from(code).unwrap_or(u8::MAX))
}
