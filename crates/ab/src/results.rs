//! The runs' result files and every median of a comparison. Each run is given a result file
//! (`STAGELOAD_RESULT`, `OUT/ARM-ROUND.json`) to write a JSON object of what it measured; every
//! top-level number in it is gathered per arm, its median taken and set against the first arm's
//! median. The wall times of the runs go through the same [`medians`], so the benchmarks' medians
//! and ratios all come from here (the median itself is `stageload_trace::aggregate::median`, which
//! the measuring binaries use too).

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
pub use stageload_trace::aggregate::median;

/// One arm's values of one measure, in run order, their median and its ratio to the first arm's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Medians {
    /// The arm's name.
    pub arm: String,
    /// One value per run that gave one, in run order.
    pub values: Vec<f64>,
    /// `None` for no values; the mean of the middle two for an even count.
    pub median: Option<f64>,
    /// `median` / the first arm's median (`None` where either is missing or the first is 0).
    pub ratio: Option<f64>,
}

/// One numeric field of the result files, over every arm.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResultField {
    /// The field's name in the files.
    pub field: String,
    /// Per arm, in the arms' order.
    pub arms: Vec<Medians>,
}

/// Each arm's values (`values[arm]`) with their median and its ratio to the first arm's.
pub fn medians(arms: &[String], values: &[Vec<f64>]) -> Vec<Medians> {
    let reference = values.first().and_then(|v| median(v));
    arms.iter()
        .zip(values)
        .map(|(arm, values)| {
            let median = median(values);
            let ratio = median.zip(reference).filter(|(_, r)| *r != 0.0).map(|(m, r)| m / r);
            Medians { arm: arm.clone(), values: values.clone(), median, ratio }
        })
        .collect()
}

/// Why a run's result file cannot be read; each names the file.
#[derive(Debug, thiserror::Error)]
pub enum ResultFileError {
    /// The file is there and cannot be read.
    #[error("cannot read the result file {}: {source}", .path.display())]
    Read {
        /// The file.
        path: std::path::PathBuf,
        /// The system's reason.
        source: std::io::Error,
    },
    /// The file is not JSON.
    #[error("the result file {} is not JSON: {source}", .path.display())]
    NotJson {
        /// The file.
        path: std::path::PathBuf,
        /// The parser's reason.
        source: serde_json::Error,
    },
    /// The file is JSON, but not an object.
    #[error("the result file {} is JSON but not an object", .path.display())]
    NotObject {
        /// The file.
        path: std::path::PathBuf,
    },
}

/// Reads a run's result file: `Ok(None)` when the run wrote none, an error naming the file when it
/// is not a JSON object.
pub fn read(path: &Path) -> Result<Option<Map<String, Value>>, ResultFileError> {
    let path_buf = || path.to_path_buf();
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(ResultFileError::Read { path: path_buf(), source }),
    };
    match serde_json::from_str(&text) {
        Ok(Value::Object(object)) => Ok(Some(object)),
        Ok(_) => Err(ResultFileError::NotObject { path: path_buf() }),
        Err(source) => Err(ResultFileError::NotJson { path: path_buf(), source }),
    }
}

/// Every top-level numeric field of the arms' result objects (`runs[arm]`), in the order first
/// met, each with its medians per arm. A run whose object lacks the field (or holds something
/// else than a number there) gives no value for it.
pub fn fields(arms: &[String], runs: &[Vec<Map<String, Value>>]) -> Vec<ResultField> {
    let mut names: Vec<&String> = Vec::new();
    for (name, value) in runs.iter().flatten().flatten() {
        if value.is_number() && !names.contains(&name) {
            names.push(name);
        }
    }
    names
        .into_iter()
        .map(|name| {
            let values: Vec<Vec<f64>> =
                runs.iter().map(|arm| arm.iter().filter_map(|run| run.get(name)?.as_f64()).collect()).collect();
            ResultField { field: name.clone(), arms: medians(arms, &values) }
        })
        .collect()
}

/// A number for a table: integers whole (bytes, counts), the rest to four significant digits.
pub fn number(value: f64) -> String {
    if value.fract() == 0.0 && value.abs() < 1e15 {
        format!("{value:.0}")
    } else {
        let digits = 3 - value.abs().log10().floor().clamp(-6.0, 3.0) as i32;
        format!("{value:.*}", digits.max(0) as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn names(arms: &[&str]) -> Vec<String> {
        arms.iter().map(|a| a.to_string()).collect()
    }

    fn object(value: Value) -> Map<String, Value> {
        value.as_object().unwrap().clone()
    }

    #[test]
    fn each_arms_median_is_set_against_the_first_arms() {
        let walls = medians(&names(&["eager", "staged", "none"]), &[vec![40.0, 42.0], vec![30.0, 31.0, 29.0], vec![]]);
        assert_eq!(walls[0].median, Some(41.0), "an even count takes the middle two");
        assert_eq!(walls[1].median, Some(30.0));
        assert!((walls[1].ratio.unwrap() - 30.0 / 41.0).abs() < 1e-12);
        assert_eq!((walls[2].median, walls[2].ratio), (None, None), "an arm without values has no median");
        assert_eq!(walls[0].ratio, Some(1.0));
    }

    #[test]
    fn a_first_arm_of_zero_gives_no_ratio() {
        let refills = medians(&names(&["resident", "streamed"]), &[vec![0.0], vec![12.0]]);
        assert_eq!(refills[1].median, Some(12.0));
        assert_eq!(refills[1].ratio, None);
    }

    #[test]
    fn every_numeric_field_is_gathered_per_arm_and_the_rest_left_out() {
        let runs = vec![
            vec![object(json!({"seconds": 2.0, "mode": "resident", "refills": 0})), object(json!({"seconds": 4.0}))],
            vec![
                object(json!({"seconds": 3.0, "refills": 10, "residency": null})),
                object(json!({"seconds": 5.0, "refills": 14, "flag": true})),
            ],
        ];
        let fields = fields(&names(&["resident", "streamed"]), &runs);
        let found: Vec<&str> = fields.iter().map(|f| f.field.as_str()).collect();
        assert_eq!(found, ["refills", "seconds"], "strings, nulls and booleans are not measures");
        let seconds = &fields[1].arms;
        assert_eq!((seconds[0].median, seconds[1].median), (Some(3.0), Some(4.0)));
        assert!((seconds[1].ratio.unwrap() - 4.0 / 3.0).abs() < 1e-12);
        assert_eq!(fields[0].arms[0].values, [0.0], "a run without the field gives no value");
        assert_eq!(fields[0].arms[1].median, Some(12.0));
    }

    #[test]
    fn a_missing_result_file_is_no_result_and_a_bad_one_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        assert!(matches!(read(&dir.path().join("absent.json")), Ok(None)));
        let bad = dir.path().join("bad.json");
        std::fs::write(&bad, "[1, 2]").unwrap();
        let error = read(&bad).unwrap_err();
        assert!(matches!(error, ResultFileError::NotObject { .. }), "{error:?}");
        assert!(error.to_string().contains("bad.json") && error.to_string().contains("not an object"), "{error}");
        std::fs::write(&bad, "{\"seconds\": ").unwrap();
        assert!(matches!(read(&bad).unwrap_err(), ResultFileError::NotJson { .. }));
        std::fs::write(&bad, "{\"seconds\": 1.5}").unwrap();
        assert_eq!(read(&bad).unwrap().unwrap()["seconds"], 1.5);
    }

    #[test]
    fn numbers_read_whole_or_to_four_significant_digits() {
        assert_eq!(number(1_288_490_188.0), "1288490188");
        assert_eq!(number(12.3456), "12.35");
        assert_eq!(number(0.0123456), "0.01235");
        assert_eq!(number(1.0), "1");
        assert_eq!(number(-2.5), "-2.500");
    }
}
