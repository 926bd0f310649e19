//! `stageload plan FILE`: reads a pipeline description and its checkpoints' headers, and says
//! stage by stage whether the pipeline fits this machine, staged and eager.

use std::path::PathBuf;

use clap::Args;
use stageload_plan::{plan, Budget, Pipeline};

use crate::args::size;
use crate::out;

/// Exit codes of `stageload plan`.
const EXIT_CODES: &str = "\
Exit codes: 0 every stage fits (now, or once other processes free memory); 1 a stage does not
fit; 2 bad input (missing or invalid file, unknown model, dtype or device, truncated checkpoint).";

/// Know before a run whether a staged pipeline fits: per stage, what is resident, loaded and
/// released, what it needs, and a verdict; the same for loading every model at once.
#[derive(Args)]
#[command(after_help = EXIT_CODES)]
pub struct PlanArgs {
    /// The pipeline description (TOML; see the README)
    file: PathBuf,
    /// Print the plan as JSON (a stable schema, with "schema": 1)
    #[arg(long)]
    json: bool,
    /// Check against this much host memory instead of this machine's
    #[arg(long, value_name = "SIZE", value_parser = size)]
    memory: Option<u64>,
    /// Device (GPU) memory to check models on cuda or mps against
    #[arg(long, value_name = "SIZE", value_parser = size)]
    device_memory: Option<u64>,
}

pub fn run(args: PlanArgs) -> i32 {
    let pipeline = match Pipeline::load(&args.file) {
        Ok(pipeline) => pipeline,
        Err(error) => {
            eprintln!("stageload plan: {error}");
            return 2;
        }
    };
    let budget = match args.memory {
        Some(bytes) => Budget::given(bytes),
        None => match Budget::of_this_machine() {
            Ok(budget) => budget,
            Err(error) => {
                eprintln!("stageload plan: {error}; give --memory SIZE");
                return 2;
            }
        },
    };
    let plan = plan(&pipeline, budget, args.device_memory.map(Budget::given));
    if args.json {
        out::line(&serde_json::to_string_pretty(&plan).expect("a plan is plain data"));
    } else {
        out::print(&plan.render());
    }
    if plan.fits {
        0
    } else {
        1
    }
}
