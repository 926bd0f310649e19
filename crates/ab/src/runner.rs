//! Alternating runs: round 1 runs every arm once in order, round 2 again, and so on, each run in
//! its own process under the guard (the same rules as `stageload guard`), each given its own
//! trace and latents file through `STAGELOAD_TRACE` and `STAGELOAD_LATENTS` so that a pipeline
//! needs no new flags. A signal to the runner stops the run in progress and the rounds.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use serde::Serialize;
use stageload_guard::{run_guarded_with_env, Clock, GuardConfig, GuardLog, Outcome, Readings, Signals};
use stageload_trace::meter::{LATENTS_ENV, TRACE_ENV};

/// One of the compared commands.
#[derive(Debug, Clone)]
pub struct Arm {
    /// Its name in file names and tables (`eager`, `staged`).
    pub name: String,
    pub command: Vec<OsString>,
}

/// One run and how it ended.
#[derive(Debug, Clone, Serialize)]
pub struct RunRecord {
    /// Index of the arm in the list.
    pub arm: usize,
    /// 1-based round.
    pub round: usize,
    pub trace: PathBuf,
    pub latents: PathBuf,
    #[serde(serialize_with = "outcome_text")]
    pub outcome: Outcome,
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

/// Where run `round` of `arm` writes: `OUT/ARM-ROUND.jsonl` and `.safetensors`.
pub fn files(out: &Path, arm: &Arm, round: usize) -> (PathBuf, PathBuf) {
    let stem = out.join(format!("{}-{round}", arm.name));
    (stem.with_extension("jsonl"), stem.with_extension("safetensors"))
}

/// The guard's parts a run needs.
pub struct Guard<'a> {
    pub config: &'a GuardConfig,
    pub readings: &'a mut dyn Readings,
    pub clock: &'a mut dyn Clock,
    pub log: &'a mut GuardLog,
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
            let (trace, latents) = files(out, arm, round);
            // A file left by an earlier run in the same folder must not pass for this one's.
            let _ = std::fs::remove_file(&trace);
            let _ = std::fs::remove_file(&latents);
            guard.log.note("ab", &format!("{} run {round} of {rounds}", arm.name), None);
            let env = [(OsString::from(TRACE_ENV), trace.clone().into()), (LATENTS_ENV.into(), latents.clone().into())];
            let outcome = run_guarded_with_env(
                &arm.command,
                &env,
                guard.config,
                guard.readings,
                guard.clock,
                guard.log,
                guard.signals,
            );
            let exit = outcome.exit_code();
            records.push(RunRecord { arm: index, round, trace, latents, outcome, exit });
        }
    }
    records
}
