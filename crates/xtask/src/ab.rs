//! The tasks' comparisons: `stageload ab` runs of two or more arms, and what a task reads back
//! from its report (`ab.json`, read as the ab crate's own [`AbReport`]): the verdict and the
//! medians of the runs' result files. The medians are `stageload ab`'s
//! (crates/ab/src/results.rs); a task only picks them out. The
//! demos' and benchmarks' shared arms, flags and build are here too.

use std::path::{Path, PathBuf};

use serde_json::Value;
use stageload_ab::{AbReport, Medians};

use crate::shell::{words, Error, Log, Shell};

/// One compared command: its name and its words.
pub struct Arm {
    /// The arm's name in file names and tables.
    pub name: String,
    /// The program and its arguments.
    pub command: Vec<String>,
}

impl Arm {
    /// `program args...` as the arm `name`.
    pub fn new(name: &str, program: &Path, args: &[String]) -> Arm {
        let mut command = vec![program.display().to_string()];
        command.extend(args.iter().cloned());
        Arm { name: name.to_string(), command }
    }
}

/// A comparison to run: its arms, runs of each, folder, and `stageload ab` flags of its own.
pub struct Comparison<'a> {
    /// The `stageload` binary.
    pub stageload: &'a Path,
    /// Where every file goes.
    pub out: PathBuf,
    /// Runs of each arm.
    pub runs: u16,
    /// The arms; the first is the reference.
    pub arms: Vec<Arm>,
    /// More `stageload ab` flags (the guard's).
    pub flags: Vec<String>,
}

/// `stageload ab`'s guard flags for the demos: start when 25 % of memory is free, waiting up to
/// ten minutes for it; the guard's decisions also into `log` when given.
pub fn guard_flags(log: Option<&Path>) -> Vec<String> {
    let mut flags = words(&["--wait-free", "25", "--start-timeout", "10m"]);
    if let Some(log) = log {
        flags.extend(["--log".to_string(), log.display().to_string()]);
    }
    flags
}

/// Builds `targets` of the library's package (its examples) and `stageload`; returns the
/// `stageload` binary.
pub fn build(shell: &Shell, targets: &[&str]) -> Result<PathBuf, Error> {
    shell.run(&mut shell.cargo(&[&["build", "-p", "stageload"], targets].concat()))?;
    shell.run(&mut shell.cargo(&["build", "-p", "stageload-cli", "--bin", "stageload"]))?;
    Ok(shell.target("debug/stageload"))
}

/// The cascade eager, staged, and staged with prefetch, each with `extra` arguments.
pub fn cascade_arms(shell: &Shell, extra: &[String]) -> Vec<Arm> {
    let program = shell.target("debug/examples/cascade");
    let arm = |name: &str, mode: &[&str]| Arm::new(name, &program, &[words(mode), extra.to_vec()].concat());
    vec![
        arm("eager", &["--mode", "eager"]),
        arm("staged", &["--mode", "staged"]),
        arm("prefetch", &["--mode", "staged", "--prefetch"]),
    ]
}

/// What `stageload ab` found, read from its `ab.json`.
pub struct Report {
    report: AbReport,
    /// Whether `stageload ab` exited 0 and its report says every run exited 0, its result files
    /// read, and every latent matched.
    passed: bool,
    /// Its text (`summary.txt`).
    summary: PathBuf,
}

impl Comparison<'_> {
    /// Runs the comparison (output to the terminal and `log`) and reads its report. An `ab` that
    /// found a difference is a report that did not pass, not an error; one that could not run
    /// (bad usage, no report written) is an error.
    pub fn run(&self, shell: &Shell, log: Option<&Log>) -> Result<Report, Error> {
        let runs = self.runs.to_string();
        let names: Vec<&str> = self.arms.iter().map(|a| a.name.as_str()).collect();
        let names = names.join(",");
        let out = self.out.display().to_string();
        let mut args = vec!["ab", "--runs", &runs, "--names", &names, "--out", &out];
        args.extend(self.flags.iter().map(String::as_str));
        let mut command = shell.cmd(self.stageload, &args);
        for arm in &self.arms {
            command.arg("--").args(&arm.command);
        }
        let status = shell.status(&mut command, log)?;
        let path = self.out.join("ab.json");
        let report: AbReport = read_json(&path)
            .and_then(|json| {
                serde_json::from_value(json).map_err(|e| format!("{} is not ab's report: {e}", path.display()))
            })
            .map_err(|e| format!("stageload ab ({status}): {e}"))?;
        let passed = status.success() && report.passed;
        Ok(Report { report, passed, summary: self.out.join("summary.txt") })
    }
}

impl Report {
    /// `Ok` when every run exited 0, its result files read and every latent matched; else an
    /// error saying that `what` did not pass, and where to look.
    pub fn verdict(&self, what: &str) -> Result<(), Error> {
        if self.passed {
            Ok(())
        } else {
            Err(format!("{what}: a run failed or a latent differs (see {})", self.summary.display()))
        }
    }

    /// The median of result field `field` over arm `arm`'s runs.
    pub fn median(&self, field: &str, arm: &str) -> Option<f64> {
        self.medians(field, arm)?.median
    }

    /// That median over the first arm's.
    pub fn ratio(&self, field: &str, arm: &str) -> Option<f64> {
        self.medians(field, arm)?.ratio
    }

    /// The median wall time of arm `arm`'s runs, seconds.
    pub fn median_wall(&self, arm: &str) -> Option<f64> {
        Self::of_arm(&self.report.wall, arm)?.median
    }

    /// That median over the first arm's.
    pub fn wall_ratio(&self, arm: &str) -> Option<f64> {
        Self::of_arm(&self.report.wall, arm)?.ratio
    }

    fn medians(&self, field: &str, arm: &str) -> Option<&Medians> {
        Self::of_arm(&self.report.results.iter().find(|f| f.field == field)?.arms, arm)
    }

    fn of_arm<'a>(medians: &'a [Medians], arm: &str) -> Option<&'a Medians> {
        medians.iter().find(|m| m.arm == arm)
    }

    /// The highest of arm `arm`'s per-stage host peaks (each the median over its runs), bytes.
    pub fn peak(&self, arm: &str) -> Option<f64> {
        let index = self.report.arms.iter().position(|a| a == arm)?;
        let peaks = self.report.stages.iter().filter_map(|stage| stage.host.get(index).copied().flatten());
        peaks.map(|spread| spread.median).max().map(|bytes| bytes as f64)
    }

    /// A string field of the first run's result file of `arm` (`OUT/ARM-1.json`).
    pub fn first_run(out: &Path, arm: &str, field: &str) -> Result<String, Error> {
        string_field(&out.join(format!("{arm}-1.json")), field)
    }
}

/// The JSON in `path`.
pub fn read_json(path: &Path) -> Result<Value, Error> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    serde_json::from_str(&text).map_err(|e| format!("{} is not JSON: {e}", path.display()))
}

/// A string field of the result file (a run's JSON object, read by the ab crate's reader) in
/// `path`.
pub fn string_field(path: &Path, field: &str) -> Result<String, Error> {
    let object = stageload_ab::results::read(path)
        .map_err(|e| e.to_string())?
        .ok_or_else(|| format!("cannot read {}: no such file", path.display()))?;
    object
        .get(field)
        .and_then(Value::as_str)
        .map(str::to_string)
        .ok_or_else(|| format!("{} has no \"{field}\"", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_measure_is_picked_out_of_the_report_by_field_and_arm() {
        let spread = |median: u64| serde_json::json!({"min": median, "median": median, "max": median, "n": 1});
        let json = serde_json::json!({"passed": true, "wall": [{"arm": "resident", "values": [4.0], "median": 4.0, "ratio": 1.0}],
            "arms": ["resident", "half"], "runs": [], "latents": [], "latents_error": null, "stages": [
            {"stage": "a", "host": [spread(5), spread(2)], "device": [null, null], "ratio": [1.0, 0.4]},
            {"stage": "b", "host": [spread(1), spread(7)], "device": [null, null], "ratio": [1.0, 7.0]}], "results": [
            {"field": "seconds", "arms": [
                {"arm": "resident", "values": [2.0], "median": 2.0, "ratio": 1.0},
                {"arm": "half", "values": [3.0], "median": 3.0, "ratio": 1.5}]}]});
        let report =
            Report { report: serde_json::from_value(json).unwrap(), passed: false, summary: "out/summary.txt".into() };
        assert_eq!(
            report.verdict("the bench").unwrap_err(),
            "the bench: a run failed or a latent differs (see out/summary.txt)"
        );
        assert_eq!(report.median("seconds", "half"), Some(3.0));
        assert_eq!(report.ratio("seconds", "half"), Some(1.5));
        assert_eq!(report.median("seconds", "prefix"), None);
        assert_eq!(report.median("refills", "half"), None);
        assert_eq!(report.peak("half"), Some(7.0));
        assert_eq!(report.peak("resident"), Some(5.0));
        assert_eq!(report.peak("prefix"), None);
        assert_eq!((report.median_wall("resident"), report.wall_ratio("half")), (Some(4.0), None));
    }

    #[test]
    fn a_first_runs_field_is_read_or_named_missing() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("eager-1.json"), r#"{"description": "/x/cascade.toml"}"#).unwrap();
        assert_eq!(Report::first_run(dir.path(), "eager", "description").unwrap(), "/x/cascade.toml");
        let error = Report::first_run(dir.path(), "eager", "fingerprint").unwrap_err();
        assert!(error.contains("eager-1.json") && error.contains("\"fingerprint\""), "{error}");
        assert!(Report::first_run(dir.path(), "staged", "description").unwrap_err().contains("staged-1.json"));
    }
}
