//! `stageload ab` (two or more commands run alternately under the guard, their traces and result
//! files aggregated and their latents compared, all in one folder with charts) and `stageload latents` (latents
//! files compared by size).

use std::ffi::OsString;
use std::path::PathBuf;

use clap::Args;
use stageload_ab::latents::{compare, render, LatentFile};
use stageload_ab::runner::{run, Arm, Guard};
use stageload_guard::{exit, SystemClock, SystemReadings};
use stageload_trace::{plot, Summary};

use crate::guard::{log_and_signals, GuardFlags};
use crate::out;

const AB_HELP: &str = "\
Each run gets STAGELOAD_TRACE, STAGELOAD_LATENTS and STAGELOAD_RESULT naming OUT/NAME-ROUND.jsonl,
.safetensors and .json (the meter, stageload::latents::Latents and the demos' --result read them;
a result file is a JSON object of what the run measured). OUT gets every trace, latents and
result file, summary.txt and ab.json (runs, wall times, per-stage min / median / max of the exact
peak, the median of every numeric field of the result files, ratios of medians to the first
arm's, latents against the first arm's), bars.svg/.png (peak per stage) and memory.svg/.png (the
first run of each arm over time).

Exit codes: 0 every run exited 0, every result file it wrote is a JSON object, and every latent
is identical or within the first arm's own variation; 1 otherwise; 2 bad usage; 128+N the runner got signal N (the run in progress is
stopped first).

Example:
  stageload ab --runs 2 --names eager,staged --out ab/ \\
      -- target/release/examples/cascade --mode eager -- target/release/examples/cascade --mode staged";

/// Run two or more commands alternately, N times each, each in its own process under the guard,
/// and compare them: per-stage peaks (median and spread) and latents.
#[derive(Args)]
#[command(after_help = AB_HELP)]
pub struct AbArgs {
    #[command(flatten)]
    flags: GuardFlags,
    /// Runs of each command
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=100))]
    runs: u16,
    /// The folder for every file of the comparison
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// The commands' names, comma-separated, in order (default: a, b, c, ...); the first is the reference
    #[arg(long, value_delimiter = ',')]
    names: Vec<String>,
    /// Also write the guard's decisions as JSON lines to FILE
    #[arg(long, value_name = "FILE")]
    log: Option<PathBuf>,
    /// The commands, each after its own --: -- CMD_A ARGS... -- CMD_B ARGS...
    #[arg(last = true, value_name = "COMMANDS", allow_hyphen_values = true)]
    commands: Vec<OsString>,
}

/// Splits `-- A... -- B...` (clap has taken the first `--`) into the arms.
fn arms(commands: Vec<OsString>, names: &[String]) -> Result<Vec<Arm>, String> {
    let parts: Vec<Vec<OsString>> = commands.split(|word| word == "--").map(<[OsString]>::to_vec).collect();
    if parts.len() < 2 || parts.iter().any(Vec::is_empty) {
        return Err(
            "give two or more commands, each after its own --: stageload ab --out DIR -- CMD_A ... -- CMD_B ...".into(),
        );
    }
    if !names.is_empty() && names.len() != parts.len() {
        return Err(format!("--names gives {} names for {} commands", names.len(), parts.len()));
    }
    let mut arms = Vec::new();
    for (index, command) in parts.into_iter().enumerate() {
        let name = names.get(index).cloned().unwrap_or_else(|| char::from(b'a' + (index % 26) as u8).to_string());
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-') {
            return Err(format!("--names: '{name}' is not a name for files (letters, digits, _ and -)"));
        }
        if arms.iter().any(|a: &Arm| a.name == name) {
            return Err(format!("--names: '{name}' is given twice"));
        }
        arms.push(Arm { name, command });
    }
    Ok(arms)
}

pub fn ab(args: AbArgs) -> i32 {
    let usage = |message: String| {
        eprintln!("stageload ab: {message}");
        exit::USAGE
    };
    let arms = match arms(args.commands, &args.names) {
        Ok(arms) => arms,
        Err(message) => return usage(message),
    };
    let config = match args.flags.config() {
        Ok(config) => config,
        Err(message) => return usage(message),
    };
    if let Err(error) = std::fs::create_dir_all(&args.out) {
        return usage(format!("cannot create --out {}: {error}", args.out.display()));
    }
    let (mut log, signals) = match log_and_signals("ab", args.log.as_deref(), true) {
        Ok(both) => both,
        Err(code) => return code,
    };
    let mut guard = Guard {
        config: &config,
        readings: &mut SystemReadings::new(),
        clock: &mut SystemClock::new(),
        log: &mut log,
        signals: &signals,
    };
    let records = run(&arms, usize::from(args.runs), &args.out, &mut guard);
    let (report, traces) = stageload_ab::report(&arms, &records);
    let text = stageload_ab::report::render(&report);
    out::print(&text);
    let mut code = if report.passed { 0 } else { 1 };
    let written = std::fs::write(args.out.join("summary.txt"), &text).and_then(|()| {
        std::fs::write(args.out.join("ab.json"), serde_json::to_string_pretty(&report).unwrap_or_default())
    });
    if let Err(error) = written {
        eprintln!("stageload ab: cannot write into {}: {error}", args.out.display());
        code = exit::USAGE;
    }
    let groups: Vec<(String, Vec<&Summary>)> =
        arms.iter().zip(&traces).map(|(arm, runs)| (arm.name.clone(), runs.iter().map(|(_, s)| s).collect())).collect();
    let firsts: Vec<(String, &stageload_trace::Trace, &Summary)> = arms
        .iter()
        .zip(&traces)
        .filter_map(|(arm, runs)| runs.first().map(|(t, s)| (arm.name.clone(), t, s)))
        .collect();
    for extension in ["svg", "png"] {
        let charts = plot::bars(&groups, &args.out.join(format!("bars.{extension}")), 1200)
            .and_then(|()| plot::plot(&firsts, &args.out.join(format!("memory.{extension}")), 1200));
        if let Err(error) = charts {
            eprintln!("stageload ab: {error}");
            code = exit::USAGE;
        }
    }
    out::line(&format!("everything is in {}/", args.out.display()));
    match signals.received() {
        Some(signal) => 128 + signal,
        None => code,
    }
}

/// Compare latents files: each AGAINST file with the first REFERENCE, judged by the references'
/// own run-to-run variation when two or more are given.
#[derive(Args)]
#[command(
    after_help = "Exit codes: 0 every latent identical or within the reference's own variation; 1 otherwise;\n2 a file is missing, not safetensors, or its latents do not match the reference's names, dtypes or shapes.\n\nExample:\n  stageload latents ab/eager-1.safetensors ab/eager-2.safetensors --against ab/staged-1.safetensors"
)]
pub struct LatentsArgs {
    /// Latents files of the reference mode (eager), one per run
    #[arg(required = true, value_name = "REFERENCE")]
    reference: Vec<PathBuf>,
    /// Latents files of the mode under test (staged), one per run
    #[arg(long, num_args = 1.., required = true, value_name = "FILE")]
    against: Vec<PathBuf>,
    /// The reference mode's name in the verdicts
    #[arg(long, default_value = "the reference")]
    name: String,
}

pub fn latents(args: LatentsArgs) -> i32 {
    let read = |paths: &[PathBuf]| paths.iter().map(|p| LatentFile::read(p)).collect::<Result<Vec<_>, _>>();
    let reports = read(&args.reference).and_then(|reference| compare(&reference, &read(&args.against)?));
    match reports {
        Ok(reports) => {
            out::print(&render(&reports, &args.name));
            if reports.iter().all(|r| r.verdict.passes()) {
                0
            } else {
                1
            }
        }
        Err(error) => {
            eprintln!("stageload latents: {error}");
            exit::USAGE
        }
    }
}
