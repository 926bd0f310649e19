//! Per-stage peaks over several runs of each arm: min, median and max of each stage's exact peak
//! (host, and device where the runs measured it), and the ratio of the medians of each arm to
//! the first arm's. Stages are listed in the order the first run of the first arm met them; a
//! stage some run never reached has fewer values (a stopped run is reported where it stopped).

use crate::summary::Summary;
use serde::{Deserialize, Serialize};

/// Min, median and max of some values (`n` of them).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Spread {
    /// The smallest value.
    pub min: u64,
    /// The median.
    pub median: u64,
    /// The largest value.
    pub max: u64,
    /// How many values.
    pub n: usize,
}

impl Spread {
    /// `None` for no values. The median of an even count is the mean of the middle two.
    pub fn of(mut values: Vec<u64>) -> Option<Spread> {
        values.sort_unstable();
        let n = values.len();
        let median = match n {
            0 => return None,
            n if n % 2 == 1 => values[n / 2],
            n => values[n / 2 - 1] / 2 + values[n / 2] / 2 + (values[n / 2 - 1] % 2 + values[n / 2] % 2) / 2,
        };
        Some(Spread { min: values[0], median, max: values[n - 1], n })
    }
}

/// The median of `values`: `None` for none, the mean of the middle two for an even count. Every
/// median the project reports (`stageload ab`'s results and wall times, the benchmarks') is this.
pub fn median(values: &[f64]) -> Option<f64> {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    match n {
        0 => None,
        n if n % 2 == 1 => Some(sorted[n / 2]),
        n => Some((sorted[n / 2 - 1] + sorted[n / 2]) / 2.0),
    }
}

/// One stage over every run of every arm.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StageSpread {
    /// The stage's name.
    pub stage: String,
    /// Per arm, in the arms' order: the host peak's spread (`None`: no run of it reached the stage).
    pub host: Vec<Option<Spread>>,
    /// The same for device memory, where measured.
    pub device: Vec<Option<Spread>>,
    /// Per arm: its host median over the first arm's.
    pub ratio: Vec<Option<f64>>,
}

/// The peak of `stage` in one run (the largest of its windows of that name).
fn peak_of(summary: &Summary, stage: &str, device: bool) -> Option<u64> {
    summary.stages.iter().filter(|w| w.stage == stage).filter_map(|w| if device { w.device_peak } else { w.peak }).max()
}

/// Aggregates `arms` (each: its runs' summaries) stage by stage.
pub fn aggregate(arms: &[Vec<&Summary>]) -> Vec<StageSpread> {
    let mut stages: Vec<String> = Vec::new();
    for summary in arms.iter().flatten() {
        for window in &summary.stages {
            if !stages.contains(&window.stage) {
                stages.push(window.stage.clone());
            }
        }
    }
    stages
        .into_iter()
        .map(|stage| {
            let spread = |device: bool| -> Vec<Option<Spread>> {
                arms.iter()
                    .map(|runs| Spread::of(runs.iter().filter_map(|s| peak_of(s, &stage, device)).collect()))
                    .collect()
            };
            let host = spread(false);
            let base = host.first().copied().flatten().map(|s| s.median);
            let ratio = host
                .iter()
                .map(|s| match (s, base) {
                    (Some(s), Some(base)) if base > 0 => Some(s.median as f64 / base as f64),
                    _ => None,
                })
                .collect();
            StageSpread { device: spread(true), stage, host, ratio }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_median_takes_the_middle_value_or_the_mean_of_the_middle_two() {
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), Some(2.5), "an even count takes the middle two");
        assert_eq!(median(&[f64::NAN, 1.0, 2.0]), Some(2.0), "a NaN sorts last instead of panicking");
    }

    #[test]
    fn the_median_of_an_even_count_is_the_mean_of_the_middle_two_without_overflow() {
        assert_eq!(Spread::of(vec![]), None);
        assert_eq!(Spread::of(vec![5]), Some(Spread { min: 5, median: 5, max: 5, n: 1 }));
        assert_eq!(Spread::of(vec![9, 1, 5]).map(|s| s.median), Some(5));
        assert_eq!(Spread::of(vec![4, 1]).map(|s| s.median), Some(2));
        assert_eq!(Spread::of(vec![3, 1]).map(|s| s.median), Some(2));
        let huge = Spread::of(vec![u64::MAX, u64::MAX - 2]).unwrap();
        assert_eq!(huge.median, u64::MAX - 1);
    }
}

#[cfg(test)]
mod aggregate_tests {
    use super::*;
    use crate::event::Entered;
    use crate::record::{EventRecord, PeakRecord, Record};
    use crate::{summarize, Trace};

    /// A run through `stages`, each with its exact peak (MiB).
    fn run(stages: &[(&str, u64)]) -> Summary {
        let mut records = Vec::new();
        for (i, (stage, peak)) in stages.iter().enumerate() {
            let t = i as f64;
            records.push(Record::Event(EventRecord::at_t(t, Entered::new(*stage))));
            records.push(Record::Peak(PeakRecord {
                t: t + 0.5,
                stage: stage.to_string(),
                rss: peak << 20,
                device: None,
            }));
        }
        summarize(&Trace::new("hand.jsonl", records))
    }

    #[test]
    fn odd_and_even_run_counts_and_a_stage_one_run_never_reached() {
        let eager = [run(&[("a", 10), ("b", 20)]), run(&[("a", 12), ("b", 22)]), run(&[("a", 11)])];
        let staged = [run(&[("a", 4), ("b", 6)]), run(&[("a", 6), ("b", 10)])];
        let arms = vec![eager.iter().collect::<Vec<_>>(), staged.iter().collect()];
        let stages = aggregate(&arms);
        assert_eq!(stages.iter().map(|s| s.stage.as_str()).collect::<Vec<_>>(), ["a", "b"]);
        let mib = |n: u64| n << 20;
        assert_eq!(stages[0].host[0], Some(Spread { min: mib(10), median: mib(11), max: mib(12), n: 3 }));
        assert_eq!(stages[0].host[1], Some(Spread { min: mib(4), median: mib(5), max: mib(6), n: 2 }));
        assert_eq!(
            stages[1].host[0].map(|s| (s.median, s.n)),
            Some((mib(21), 2)),
            "the third eager run stopped before b"
        );
        assert_eq!(stages[1].ratio[1], Some(8.0 / 21.0));
        assert_eq!(stages[1].device, [None, None]);
    }
}
