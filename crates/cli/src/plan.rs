//! `stageload plan FILE`: reads a pipeline description and its checkpoints' headers, and says
//! stage by stage whether the pipeline fits this machine, staged and eager; with `--request`,
//! what one run asks a scheduler for.

use std::path::PathBuf;

use clap::{Args, ValueEnum};
use stageload_plan::measured::{check, render_checks, Measured, PlanReport};
use stageload_plan::request::{Mode, Request};
use stageload_plan::{plan, Budget, Pipeline};
use stageload_trace::read_trace;

use crate::args::size;
use crate::out;

/// Exit codes of `stageload plan`.
const EXIT_CODES: &str = "\
Exit codes: 0 every stage fits (now, or once other processes free memory), and with --check the
run matches the plan; 1 a stage does not fit (with --request: nothing is printed but why), or
--check finds a stage off; 2 bad input (missing or invalid file, unknown model, dtype or device,
truncated checkpoint, a trace of another pipeline).

Example:
  stageload plan pipeline.toml --memory 16GiB";

/// How `--request` spells one run's request.
#[derive(Clone, Copy, ValueEnum)]
enum Format {
    /// The request's numbers (bytes) as JSON
    Json,
    /// Ray task options as JSON: memory (bytes), num_cpus, num_gpus, resources.device_memory_mib
    Ray,
    /// #SBATCH lines: --mem, --cpus-per-task, --gres=gpu:N
    Slurm,
    /// A container's resources block: requests = the need, limits = the need plus the reserve
    Kubernetes,
}

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
    /// Device (GPU) memory to check models on cuda or mps against (default: the pipeline
    /// file's device_memory)
    #[arg(long, value_name = "SIZE", value_parser = size)]
    device_memory: Option<u64>,
    /// Take each stage's working memory (peak minus resident weights) from this recorded run
    /// instead of the file (the eager run's trace predicts the staged run)
    #[arg(long, value_name = "RUN.jsonl")]
    from_trace: Option<PathBuf>,
    /// Compare the plan with this recorded run, stage by stage: weights exactly, peak within 5 %
    #[arg(long, value_name = "RUN.jsonl")]
    check: Option<PathBuf>,
    /// With --check: a stage whose peak is more than 5 % below the plan's need passes (the plan
    /// errs on the safe side; its row says so)
    #[arg(long, requires = "check")]
    check_allow_below: bool,
    /// Print what one run asks a scheduler for instead of the plan: host memory (the largest
    /// stage need plus the reserve), device memory, GPUs, CPUs (the file's `cpus`)
    /// (not with --from-trace: write the measured working memory into the file, `stageload
    /// summary RUN --write-working FILE`, so `stageload guard --plan FILE` holds the run to the
    /// same numbers)
    #[arg(long, value_name = "FORMAT", conflicts_with_all = ["json", "check", "from_trace"])]
    request: Option<Format>,
    /// With --request: the request of an eager run (every model loaded up front)
    #[arg(long, requires = "request")]
    eager: bool,
}

/// Says `error` and gives exit code 2.
fn bad(error: impl std::fmt::Display) -> i32 {
    eprintln!("stageload plan: {error}");
    2
}

pub fn run(args: PlanArgs) -> i32 {
    let pipeline = match Pipeline::load(&args.file) {
        Ok(pipeline) => pipeline,
        Err(error) => return bad(error),
    };
    let (pipeline, source) = match &args.from_trace {
        None => (pipeline, None),
        Some(path) => {
            match read_trace(path)
                .map_err(|e| e.to_string())
                .and_then(|t| Measured::from_trace(&pipeline, &t).map_err(|e| e.to_string()))
            {
                Ok(measured) => (measured.apply(&pipeline), Some(measured.describe(&pipeline))),
                Err(error) => return bad(error),
            }
        }
    };
    let run = match args.check.as_deref().map(read_trace).transpose() {
        Ok(run) => run,
        Err(error) => return bad(error),
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
    let device_memory = args.device_memory.or(pipeline.device_memory);
    let mut plan = plan(&pipeline, budget, device_memory.map(Budget::given));
    plan.working_from = source;
    let check = match run.as_ref().map(|run| check(&pipeline, &plan, run)).transpose() {
        Ok(checks) => checks,
        Err(error) => return bad(error),
    };
    if let Some(format) = args.request {
        let mode = if args.eager { Mode::Eager } else { Mode::Staged };
        return match Request::of(&pipeline, &plan, mode) {
            Ok(request) => {
                out::line(&match format {
                    Format::Json => serde_json::to_string_pretty(&request).expect("a request is plain data"),
                    Format::Ray => request.ray(),
                    Format::Slurm => request.slurm(),
                    Format::Kubernetes => request.kubernetes(),
                });
                0
            }
            Err(no_fit) => {
                eprintln!("stageload plan: {}: {no_fit}", args.file.display());
                1
            }
        };
    }
    let report = PlanReport { plan, check, allow_below: args.check_allow_below };
    if args.json {
        out::line(&serde_json::to_string_pretty(&report).expect("a plan is plain data"));
    } else {
        out::print(report.plan.working_from.as_deref().unwrap_or_default());
        out::print(&report.plan.render());
        if let (Some(checks), Some(path)) = (&report.check, &args.check) {
            out::print(&format!("\n{}", render_checks(checks, path, report.allow_below)));
        }
    }
    if report.ok() {
        0
    } else {
        1
    }
}
