//! `stageload`: the torch-free command line. `guard` runs one heavy command only when there is
//! room and stops it before it takes the machine down (see [`guard`]).

mod guard;

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
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let code = match cli.command {
        Commands::Guard(args) => guard::run(args),
    };
    ExitCode::from(u8::try_from(code).unwrap_or(u8::MAX))
}
