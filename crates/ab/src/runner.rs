//! Alternating runs: round 1 runs every arm once in order, round 2 again, and so on, each run in
//! its own process under the guard (the same rules as `stageload guard`), each given its own
//! trace, latents and result file through `STAGELOAD_TRACE`, `STAGELOAD_LATENTS` and
//! `STAGELOAD_RESULT` so that a pipeline needs no new flags. A signal to the runner stops the
//! run in progress and the rounds.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use serde::Serialize;
use stageload_guard::{run_guarded_with_env, Clock, GuardConfig, GuardLog, Outcome, Readings, Signals};
use stageload_trace::meter::{LATENTS_ENV, RESULT_ENV, TRACE_ENV};

/// One of the compared commands.
#[derive(Debug, Clone)]
pub struct Arm {
    /// Its name in file names and tables (`eager`, `staged`).
    pub name: String,
    /// The program and its arguments.
    pub command: Vec<OsString>,
}

/// One run and how it ended.
#[derive(Debug, Clone, Serialize)]
pub struct RunRecord {
    /// Index of the arm in the list.
    pub arm: usize,
    /// 1-based round.
    pub round: usize,
    /// What it was told to write.
    #[serde(flatten)]
    pub files: RunFiles,
    /// How it ended.
    #[serde(serialize_with = "outcome_text")]
    pub outcome: Outcome,
    /// Its exit code ([`Outcome::exit_code`]).
    pub exit: i32,
}

fn outcome_text<S: serde::Serializer>(outcome: &Outcome, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_str(&describe(outcome))
}

/// An outcome in words.
pub fn describe(outcome: &Outcome) -> String {
    match outcome {
        Outcome::Exited(code) => format!("exit {code}"),
        Outcome::Signaled(signal) => format!("ended by signal {signal}"),
        Outcome::Stopped(stop) => format!("stopped by the guard ({stop})"),
        Outcome::GuardSignal(signal) => format!("stopped: the runner got signal {signal}"),
        Outcome::NoRoom => "never started: no room within --start-timeout".to_string(),
        Outcome::CannotStart(code) => format!("cannot start (exit {code})"),
        Outcome::Unexplained(status) => format!("ended unreadably ({status})"),
    }
}

/// Where one run writes: `OUT/ARM-ROUND.jsonl`, `.safetensors` and `.json`.
#[derive(Debug, Clone, Serialize)]
pub struct RunFiles {
    /// Its trace (`STAGELOAD_TRACE`).
    pub trace: PathBuf,
    /// Its latents (`STAGELOAD_LATENTS`).
    pub latents: PathBuf,
    /// Its result, a JSON object (`STAGELOAD_RESULT`).
    pub result: PathBuf,
}

impl RunFiles {
    /// The files of run `round` of `arm` in `out`.
    pub fn of(out: &Path, arm: &Arm, round: usize) -> RunFiles {
        let stem = out.join(format!("{}-{round}", arm.name));
        RunFiles {
            trace: stem.with_extension("jsonl"),
            latents: stem.with_extension("safetensors"),
            result: stem.with_extension("json"),
        }
    }

    /// What the run is told through its environment.
    fn env(&self) -> [(OsString, OsString); 3] {
        [
            (TRACE_ENV.into(), self.trace.clone().into()),
            (LATENTS_ENV.into(), self.latents.clone().into()),
            (RESULT_ENV.into(), self.result.clone().into()),
        ]
    }
}

/// The guard's parts a run needs.
pub struct Guard<'a> {
    /// Its rules (`stageload guard`'s flags).
    pub config: &'a GuardConfig,
    /// The machine's memory.
    pub readings: &'a mut dyn Readings,
    /// Time.
    pub clock: &'a mut dyn Clock,
    /// Where its decisions go.
    pub log: &'a mut GuardLog,
    /// The signals the runner got.
    pub signals: &'a Signals,
}

/// Runs every arm `rounds` times, alternating, writing into `out` (see the module docs).
pub fn run(arms: &[Arm], rounds: usize, out: &Path, guard: &mut Guard<'_>) -> Vec<RunRecord> {
    let mut records = Vec::new();
    for round in 1..=rounds {
        for (index, arm) in arms.iter().enumerate() {
            if guard.signals.received().is_some() {
                return records;
            }
            let files = RunFiles::of(out, arm, round);
            // A file left by an earlier run in the same folder must not pass for this one's.
            for file in [&files.trace, &files.latents, &files.result] {
                let _ = std::fs::remove_file(file);
            }
            guard.log.note("ab", &format!("{} run {round} of {rounds}", arm.name), None);
            let outcome = run_guarded_with_env(
                &arm.command,
                &files.env(),
                guard.config,
                guard.readings,
                guard.clock,
                guard.log,
                guard.signals,
            );
            let exit = outcome.exit_code();
            records.push(RunRecord { arm: index, round, files, outcome, exit });
        }
    }
    records
}
