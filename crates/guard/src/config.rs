//! What the guard waits for and watches: [`GuardConfig`], the one place its defaults and the
//! ranges of its numbers are written (the CLI's flags read both from here), and the rules
//! between flags, checked before any waiting.

use std::ops::RangeInclusive;
use std::time::Duration;

use regex::Regex;
use stageload_units::{format_gb, parse_duration, parse_size};

/// The defaults, as the CLI shows them in `--help`.
pub mod defaults {
    /// `--wait-free`: percent of memory available before the command starts.
    pub const WAIT_FREE: &str = "40";
    /// `--swap-budget`: swap the command may add over the level at start.
    pub const SWAP_BUDGET: &str = "8G";
    /// `--kill-free`: percent of memory available under which the command is stopped.
    pub const KILL_FREE: &str = "10";
    /// `--quiet-for`: how long no `--busy` process must be seen.
    pub const QUIET_FOR: &str = "1m";
    /// `--start-timeout`: how long the guard waits for admission.
    pub const START_TIMEOUT: &str = "30m";
    /// `--poll`: time between readings.
    pub const POLL: &str = "100ms";
    /// `--grace`: time between SIGTERM and SIGKILL at a stop.
    pub const GRACE: &str = "5s";
}

/// The ranges of the durations: a poll under 10 ms burns a core, one over a minute watches
/// nothing; a grace or a wait longer than these is a typo, and each stays far from what a
/// clock can add without overflowing.
pub mod ranges {
    use std::ops::RangeInclusive;
    use std::time::Duration;

    const MINUTE: u64 = 60;
    const DAY: u64 = 24 * 60 * MINUTE;
    /// Allowed `--poll` values.
    pub const POLL: RangeInclusive<Duration> = Duration::from_millis(10)..=Duration::from_secs(MINUTE);
    /// Allowed `--grace` values.
    pub const GRACE: RangeInclusive<Duration> = Duration::ZERO..=Duration::from_secs(60 * MINUTE);
    /// Allowed `--start-timeout` values.
    pub const START_TIMEOUT: RangeInclusive<Duration> = Duration::ZERO..=Duration::from_secs(7 * DAY);
    /// Allowed `--quiet-for` values.
    pub const QUIET_FOR: RangeInclusive<Duration> = Duration::ZERO..=Duration::from_secs(DAY);
}

/// What the guard waits for and watches. Percentages are of the machine's memory, or of the
/// cgroup limit when the guard runs in a memory-limited cgroup.
#[derive(Debug, Clone)]
pub struct GuardConfig {
    /// Start only when at least this percent of memory is available.
    pub wait_free: f64,
    /// Swap the system may gain over its level at the command's start before the command is stopped.
    pub swap_budget: u64,
    /// Absolute swap ceiling: caps the budget and is an admission check (swap + budget ≤ limit).
    pub swap_limit: Option<u64>,
    /// Stop the command after two samples in a row under this percent available.
    pub kill_free: f64,
    /// Do not start while a process whose command line matches one of these runs.
    pub busy: Vec<Regex>,
    /// With `busy`: start only after no busy process was seen for this long.
    pub quiet_for: Duration,
    /// Give up waiting after this long (exit 4).
    pub start_timeout: Duration,
    /// Interval of admission and watch readings.
    pub poll: Duration,
    /// Time between SIGTERM and SIGKILL when stopping the command.
    pub grace: Duration,
    /// Stop the command when its own memory (resident less file pages, plus swap, over its
    /// members: [`stageload_probe::ProcessMemory::held`]) passes this.
    pub max_memory: Option<u64>,
    /// Stop the command when its device memory, as [`crate::Readings::command_device_memory`]
    /// reports it, passes this (`stageload guard --plan --trace` on CUDA).
    pub max_device_memory: Option<u64>,
    /// Where the limits come from, for the start line (`held to plan pipeline.toml: ...`);
    /// `None`: the flags.
    pub limits_from: Option<String>,
}

fn default_duration(text: &str) -> Duration {
    parse_duration(text).unwrap_or_else(|error| unreachable!("default {text}: {error}"))
}

impl Default for GuardConfig {
    fn default() -> Self {
        let percent = |text: &str| text.parse::<f64>().unwrap_or_else(|error| unreachable!("default {text}: {error}"));
        GuardConfig {
            wait_free: percent(defaults::WAIT_FREE),
            swap_budget: parse_size(defaults::SWAP_BUDGET).unwrap_or_else(|error| unreachable!("{error}")),
            swap_limit: None,
            kill_free: percent(defaults::KILL_FREE),
            busy: Vec::new(),
            quiet_for: default_duration(defaults::QUIET_FOR),
            start_timeout: default_duration(defaults::START_TIMEOUT),
            poll: default_duration(defaults::POLL),
            grace: default_duration(defaults::GRACE),
            max_memory: None,
            max_device_memory: None,
            limits_from: None,
        }
    }
}

/// A duration outside the range its flag allows.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{} is outside {} ..= {}", show(.value), show(.range.start()), show(.range.end()))]
pub struct OutOfRange {
    /// The duration given.
    pub value: Duration,
    /// The range allowed.
    pub range: RangeInclusive<Duration>,
}

fn show(duration: &Duration) -> String {
    humantime::format_duration(*duration).to_string()
}

/// `value` if inside `range`, else what is wrong with it, for a message naming the flag.
pub fn within(value: Duration, range: &RangeInclusive<Duration>) -> Result<Duration, OutOfRange> {
    if range.contains(&value) {
        Ok(value)
    } else {
        Err(OutOfRange { value, range: range.clone() })
    }
}

/// A configuration refused at start: each names its flags and what to change.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A duration outside its range.
    #[error("{flag}: {source}")]
    Duration {
        /// The flag.
        flag: &'static str,
        /// The value and its range.
        source: OutOfRange,
    },
    /// A percent outside 0 to 100.
    #[error("{flag}: {value} is not a percent (0 to 100)")]
    Percent {
        /// The flag.
        flag: &'static str,
        /// The value given.
        value: f64,
    },
    /// `--kill-free` at or over `--wait-free`.
    #[error(
        "--kill-free {kill_free} must be under --wait-free {wait_free}: the command would be stopped as soon as it starts (or give --kill-free 0 to stop only on swap)"
    )]
    KillFreeOverWaitFree {
        /// `--kill-free`.
        kill_free: f64,
        /// `--wait-free`.
        wait_free: f64,
    },
    /// `--swap-budget` over `--swap-limit`.
    #[error(
        "--swap-budget {} is over --swap-limit {}: swap + budget could never fit under the limit, so the command could never start; give a --swap-budget (default {}) at most the limit",
        format_gb(*.budget), format_gb(*.limit), defaults::SWAP_BUDGET
    )]
    SwapBudgetOverLimit {
        /// `--swap-budget`, bytes.
        budget: u64,
        /// `--swap-limit`, bytes.
        limit: u64,
    },
}

impl GuardConfig {
    /// The rules between flags and the ranges of the durations, checked for a refusal at start.
    pub fn check(&self) -> Result<(), ConfigError> {
        for (flag, value, range) in [
            ("--poll", self.poll, ranges::POLL),
            ("--grace", self.grace, ranges::GRACE),
            ("--start-timeout", self.start_timeout, ranges::START_TIMEOUT),
            ("--quiet-for", self.quiet_for, ranges::QUIET_FOR),
        ] {
            within(value, &range).map_err(|source| ConfigError::Duration { flag, source })?;
        }
        for (flag, value) in [("--wait-free", self.wait_free), ("--kill-free", self.kill_free)] {
            if !(0.0..=100.0).contains(&value) {
                return Err(ConfigError::Percent { flag, value });
            }
        }
        if self.kill_free > 0.0 && self.kill_free >= self.wait_free {
            return Err(ConfigError::KillFreeOverWaitFree { kill_free: self.kill_free, wait_free: self.wait_free });
        }
        match self.swap_limit {
            Some(limit) if self.swap_budget > limit => {
                Err(ConfigError::SwapBudgetOverLimit { budget: self.swap_budget, limit })
            }
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_parse_and_pass_their_own_rules() {
        let config = GuardConfig::default();
        assert_eq!(config.poll, Duration::from_millis(100));
        assert_eq!(config.swap_budget, 8 << 30);
        assert_eq!(config.check(), Ok(()));
    }

    #[test]
    fn durations_outside_their_ranges_are_refused_naming_the_flag() {
        let huge = Duration::from_secs(u64::MAX);
        let cases = [
            (GuardConfig { grace: huge, ..GuardConfig::default() }, "--grace"),
            (GuardConfig { poll: huge, ..GuardConfig::default() }, "--poll"),
            (GuardConfig { poll: Duration::from_millis(1), ..GuardConfig::default() }, "--poll: 1ms is outside 10ms"),
            (GuardConfig { start_timeout: huge, ..GuardConfig::default() }, "--start-timeout"),
            (GuardConfig { quiet_for: huge, ..GuardConfig::default() }, "--quiet-for"),
        ];
        for (config, expected) in cases {
            let error = config.check().unwrap_err();
            assert!(matches!(error, ConfigError::Duration { .. }), "{error}");
            assert!(error.to_string().starts_with(expected), "{error}");
        }
    }

    #[test]
    fn kill_free_must_be_under_wait_free_unless_it_is_zero() {
        let refused = GuardConfig { kill_free: 40.0, wait_free: 40.0, ..GuardConfig::default() }.check().unwrap_err();
        assert_eq!(refused, ConfigError::KillFreeOverWaitFree { kill_free: 40.0, wait_free: 40.0 });
        assert!(refused.to_string().starts_with("--kill-free 40 must be under --wait-free 40"), "{refused}");
        assert!(GuardConfig { kill_free: 0.0, wait_free: 0.0, ..GuardConfig::default() }.check().is_ok());
        assert!(GuardConfig { kill_free: 39.0, wait_free: 40.0, ..GuardConfig::default() }.check().is_ok());
    }

    #[test]
    fn a_swap_limit_under_the_budget_is_refused_instead_of_waiting_forever() {
        let config = GuardConfig { swap_limit: Some(2 << 30), ..GuardConfig::default() };
        let error = config.check().unwrap_err();
        assert!(error.to_string().starts_with("--swap-budget 8.0 GB is over --swap-limit 2.0 GB"), "{error}");
        let fits = GuardConfig { swap_limit: Some(2 << 30), swap_budget: 2 << 30, ..GuardConfig::default() };
        assert!(fits.check().is_ok());
    }
}
