//! The guard's decisions as pure functions of readings and time: may the command start
//! ([`Admission`]), must it be stopped ([`Watch`]). No I/O here, so every rule is tested with
//! scripted readings and a made-up clock.

use std::fmt;
use std::time::Duration;

use regex::Regex;
use stageload_probe::{ProbeError, ProcessEntry, SystemMemory};
use stageload_units::{format_bytes, format_gb};

use crate::config::GuardConfig;

/// Why the command may not start yet.
#[derive(Debug, Clone, PartialEq)]
pub enum Wait {
    /// Available memory (percent of the machine, or of the cgroup limit) under `--wait-free`.
    LowMemory {
        /// Percent available now.
        percent: f64,
        /// Percent `--wait-free` asks for.
        wanted: f64,
    },
    /// Swap already used plus the budget would pass `--swap-limit`.
    SwapLimit {
        /// Swap used now, bytes.
        used: u64,
        /// The command's swap budget, bytes.
        budget: u64,
        /// `--swap-limit`, bytes.
        limit: u64,
    },
    /// Processes matching `--busy` are running (their command lines, at most three, cut to 80
    /// characters).
    Busy(Vec<String>),
    /// No busy process seen for `quiet` of the `needed` `--quiet-for`.
    Quiet {
        /// How long no busy process has been seen.
        quiet: Duration,
        /// How long `--quiet-for` asks for.
        needed: Duration,
    },
    /// The memory reading failed: never start blind.
    Unknown(String),
}

impl fmt::Display for Wait {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Wait::LowMemory { percent, wanted } => {
                write!(f, "memory available {percent:.0}% < {wanted:.0}%")
            }
            Wait::SwapLimit { used, budget, limit } => {
                write!(f, "swap {} + budget {} > limit {}", format_gb(*used), format_gb(*budget), format_gb(*limit))
            }
            Wait::Busy(lines) => write!(f, "busy: {}", lines.join("; ")),
            Wait::Quiet { quiet, needed } => {
                write!(f, "quiet for {:.0} s of {:.0} s", quiet.as_secs_f64(), needed.as_secs_f64())
            }
            Wait::Unknown(error) => write!(f, "memory unknown: {error}"),
        }
    }
}

/// Reasons joined the way the log prints them.
pub fn describe(reasons: &[Wait]) -> String {
    reasons.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
}

/// Command lines in `table` that match any of `patterns` (a regex search, like `pgrep -f`),
/// leaving out `exclude` (the guard and its ancestors: a shell running
/// `stageload guard -- heavy.py` contains the pattern too) and empty command lines.
pub fn busy_commands(patterns: &[Regex], table: &[ProcessEntry], exclude: &[i32]) -> Vec<String> {
    table
        .iter()
        .filter(|e| !e.cmdline.is_empty() && !exclude.contains(&e.pid))
        .filter(|e| patterns.iter().any(|p| p.is_match(&e.cmdline)))
        .map(|e| e.cmdline.chars().take(80).collect())
        .collect()
}

/// The admission rule: every condition holds at one moment. Keeps the quiet timer between checks.
#[derive(Debug, Clone)]
pub struct Admission {
    quiet_since: Option<Duration>,
}

impl Admission {
    /// No quiet time seen yet.
    pub fn new() -> Self {
        Admission { quiet_since: None }
    }

    /// The reasons to wait at time `now` (empty: start). `busy` is what
    /// [`busy_commands`] found now; it is ignored when no `--busy` pattern is set.
    pub fn check(
        &mut self,
        config: &GuardConfig,
        now: Duration,
        memory: Result<&SystemMemory, &ProbeError>,
        busy: &[String],
    ) -> Vec<Wait> {
        let mut reasons = Vec::new();
        match memory {
            Ok(memory) => {
                let percent = memory.available_percent();
                if percent < config.wait_free {
                    reasons.push(Wait::LowMemory { percent, wanted: config.wait_free });
                }
                if let Some(limit) = config.swap_limit {
                    if memory.swap_used.saturating_add(config.swap_budget) > limit {
                        reasons.push(Wait::SwapLimit { used: memory.swap_used, budget: config.swap_budget, limit });
                    }
                }
            }
            Err(error) => reasons.push(Wait::Unknown(error.to_string())),
        }
        if !config.busy.is_empty() {
            if !busy.is_empty() {
                self.quiet_since = None;
                reasons.push(Wait::Busy(busy.iter().take(3).cloned().collect()));
            } else if !config.quiet_for.is_zero() {
                // The quiet timer runs whatever the memory says: quiet is about other jobs.
                let since = *self.quiet_since.get_or_insert(now);
                let quiet = now.saturating_sub(since);
                if quiet < config.quiet_for {
                    reasons.push(Wait::Quiet { quiet, needed: config.quiet_for });
                }
            }
        }
        reasons
    }
}

impl Default for Admission {
    fn default() -> Self {
        Self::new()
    }
}

/// Whether two sets of reasons are the same kind of wait, so the log is not repeated every poll
/// (a quiet countdown, or a reading that moved by a percent, is not news).
pub fn same_kind(a: &[Wait], b: &[Wait]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| std::mem::discriminant(x) == std::mem::discriminant(y))
        && a.iter().zip(b).all(|(x, y)| match (x, y) {
            (Wait::Busy(x), Wait::Busy(y)) => x == y,
            (Wait::Unknown(x), Wait::Unknown(y)) => x == y,
            _ => true,
        })
}

/// Why the guard stopped the command.
#[derive(Debug, Clone, PartialEq)]
pub enum Stop {
    /// System swap passed its level at start plus `--swap-budget` (or `--swap-limit`).
    Swap {
        /// Swap used now, bytes.
        used: u64,
        /// The level it passed, bytes.
        stop_above: u64,
    },
    /// Available memory under `--kill-free` for two samples in a row.
    LowMemory {
        /// Percent available at the second sample.
        percent: f64,
        /// `--kill-free`, percent.
        kill_free: f64,
    },
    /// The command's own memory (resident less file pages, plus swap, over its members) passed
    /// its limit.
    MaxMemory {
        /// Bytes the command held.
        used: u64,
        /// The limit, bytes.
        max: u64,
        /// Who set it.
        from: LimitFrom,
    },
    /// The command's device memory passed its limit.
    MaxDeviceMemory {
        /// Device bytes the command reported.
        used: u64,
        /// The limit, bytes.
        max: u64,
        /// Who set it.
        from: LimitFrom,
    },
}

/// Who set a limit on the command's memory: the stop line names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitFrom {
    /// A flag: `--max-memory`, `--max-device-memory`.
    Flag,
    /// The plan the command is held to (`--plan`): its need plus reserve.
    Plan,
}

impl LimitFrom {
    /// Where `config`'s limits come from.
    pub fn of(config: &GuardConfig) -> LimitFrom {
        if config.limits_from.is_some() {
            LimitFrom::Plan
        } else {
            LimitFrom::Flag
        }
    }

    /// The limit's name in a stop line, for host (`device` false) or device memory.
    fn name(self, device: bool) -> &'static str {
        match (self, device) {
            (LimitFrom::Flag, false) => "--max-memory",
            (LimitFrom::Flag, true) => "--max-device-memory",
            (LimitFrom::Plan, false) => "the plan's memory limit",
            (LimitFrom::Plan, true) => "the plan's device memory limit",
        }
    }
}

impl fmt::Display for Stop {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Stop::Swap { used, stop_above } => {
                write!(f, "swap {} > {}", format_gb(*used), format_gb(*stop_above))
            }
            Stop::LowMemory { percent, kill_free } => {
                write!(f, "memory available {percent:.0}% < {kill_free:.0}% twice")
            }
            Stop::MaxMemory { used, max, from } => {
                write!(f, "command uses {} > {} {}", format_bytes(*used), from.name(false), format_bytes(*max))
            }
            Stop::MaxDeviceMemory { used, max, from } => {
                write!(
                    f,
                    "command's device memory {} > {} {}",
                    format_bytes(*used),
                    from.name(true),
                    format_bytes(*max)
                )
            }
        }
    }
}

/// Something the watch noticed that does not stop the command but belongs in the log.
#[derive(Debug, Clone, PartialEq)]
pub enum Notice {
    /// Swap devices changed (swapon/swapoff, a zram device): the baseline moved with them.
    SwapRebased {
        /// Swap size before, bytes.
        old_total: u64,
        /// Swap size now, bytes.
        new_total: u64,
    },
    /// The guard did not run for `gap` (suspended, starved): the readings after it are not
    /// read as growth over one poll.
    Stalled {
        /// Time between two polls that should have been one poll apart.
        gap: Duration,
    },
    /// A reading failed; it neither counts toward nor resets the two-sample rule.
    Unknown(String),
}

impl fmt::Display for Notice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Notice::SwapRebased { old_total, new_total } => write!(
                f,
                "swap devices changed ({} -> {}), budget re-based",
                format_gb(*old_total),
                format_gb(*new_total)
            ),
            Notice::Stalled { gap } => write!(f, "stalled for {:.1} s between two readings", gap.as_secs_f64()),
            Notice::Unknown(error) => write!(f, "reading failed, not counted: {error}"),
        }
    }
}

/// The watch rule, fed one sample per poll.
#[derive(Debug, Clone)]
pub struct Watch {
    swap_budget: u64,
    swap_limit: Option<u64>,
    kill_free: f64,
    max_memory: Option<u64>,
    max_device_memory: Option<u64>,
    limits_from: LimitFrom,
    stall_after: Duration,
    /// Swap used when the command started (or when swap devices last changed).
    baseline: u64,
    /// Swap growth made before the last change of swap devices.
    carried: u64,
    last_swap: (u64, u64),
    low_samples: u32,
    last_sample_at: Option<Duration>,
}

impl Watch {
    /// Starts watching with the readings taken just before the command started.
    pub fn new(config: &GuardConfig, at_start: &SystemMemory) -> Self {
        Watch {
            swap_budget: config.swap_budget,
            swap_limit: config.swap_limit,
            kill_free: config.kill_free,
            max_memory: config.max_memory,
            max_device_memory: config.max_device_memory,
            limits_from: LimitFrom::of(config),
            stall_after: config.poll.saturating_mul(5).max(Duration::from_secs(1)),
            baseline: at_start.swap_used,
            carried: 0,
            last_swap: (at_start.swap_used, at_start.swap_total),
            low_samples: 0,
            last_sample_at: None,
        }
    }

    /// The system swap above which the command is stopped.
    pub fn stop_above(&self) -> u64 {
        let budgeted = self.baseline.saturating_add(self.swap_budget).saturating_sub(self.carried);
        self.swap_limit.map_or(budgeted, |limit| budgeted.min(limit))
    }

    /// One sample: system memory (or why it could not be read), the command's own memory and
    /// its device memory (each `None` when not measured, unknown or, for the device, nothing
    /// new). Returns the stop decision, if any, and notices.
    pub fn observe(
        &mut self,
        now: Duration,
        memory: Result<&SystemMemory, &ProbeError>,
        command_memory: Option<u64>,
        command_device_memory: Option<u64>,
    ) -> (Option<Stop>, Vec<Notice>) {
        let mut notices = Vec::new();
        if let Some(last) = self.last_sample_at.replace(now) {
            let gap = now.saturating_sub(last);
            if gap > self.stall_after {
                notices.push(Notice::Stalled { gap });
            }
        }
        if let (Some(max), Some(used)) = (self.max_memory, command_memory) {
            if used > max {
                return (Some(Stop::MaxMemory { used, max, from: self.limits_from }), notices);
            }
        }
        if let (Some(max), Some(used)) = (self.max_device_memory, command_device_memory) {
            if used > max {
                return (Some(Stop::MaxDeviceMemory { used, max, from: self.limits_from }), notices);
            }
        }
        let memory = match memory {
            Ok(memory) => memory,
            Err(error) => {
                notices.push(Notice::Unknown(error.to_string()));
                return (None, notices);
            }
        };
        let (last_used, last_total) = self.last_swap;
        if memory.swap_total != last_total {
            // Keep the growth made so far, counted on top of the new level.
            self.carried = self.carried.saturating_add(last_used.saturating_sub(self.baseline));
            self.baseline = memory.swap_used;
            notices.push(Notice::SwapRebased { old_total: last_total, new_total: memory.swap_total });
        }
        self.last_swap = (memory.swap_used, memory.swap_total);
        let percent = memory.available_percent();
        self.low_samples = if percent < self.kill_free { self.low_samples.saturating_add(1) } else { 0 };
        let stop_above = self.stop_above();
        if memory.swap_used > stop_above {
            return (Some(Stop::Swap { used: memory.swap_used, stop_above }), notices);
        }
        if self.low_samples >= 2 {
            return (Some(Stop::LowMemory { percent, kill_free: self.kill_free }), notices);
        }
        (None, notices)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stageload_probe::CgroupMemory;
    use stageload_units::GIB;

    fn memory(available_percent: u64, swap_used_gib: u64) -> SystemMemory {
        SystemMemory {
            total: 100 * GIB,
            available: available_percent * GIB,
            swap_total: 64 * GIB,
            swap_used: swap_used_gib * GIB,
            cgroup: None,
        }
    }

    fn secs(s: f64) -> Duration {
        Duration::from_secs_f64(s)
    }

    fn busy_config(quiet_for: f64) -> GuardConfig {
        GuardConfig {
            busy: vec![Regex::new("ltx-2-mlx").unwrap()],
            quiet_for: secs(quiet_for),
            ..GuardConfig::default()
        }
    }

    #[test]
    fn low_memory_waits_until_there_is_room() {
        let config = GuardConfig::default();
        let mut admission = Admission::new();
        let reasons = admission.check(&config, secs(0.0), Ok(&memory(30, 0)), &[]);
        assert_eq!(describe(&reasons), "memory available 30% < 40%");
        assert!(admission.check(&config, secs(1.0), Ok(&memory(40, 0)), &[]).is_empty());
    }

    #[test]
    fn swap_headroom_under_the_limit() {
        let config = GuardConfig { swap_limit: Some(20 * GIB), ..GuardConfig::default() };
        let mut admission = Admission::new();
        let reasons = admission.check(&config, secs(0.0), Ok(&memory(90, 15)), &[]);
        assert_eq!(describe(&reasons), "swap 15.0 GB + budget 8.0 GB > limit 20.0 GB");
        assert!(admission.check(&config, secs(1.0), Ok(&memory(90, 5)), &[]).is_empty());
    }

    #[test]
    fn an_unknown_reading_never_starts() {
        let mut admission = Admission::new();
        let error = ProbeError::Unsupported("system memory");
        let reasons = admission.check(&GuardConfig::default(), secs(0.0), Err(&error), &[]);
        assert!(describe(&reasons).contains("memory unknown"), "{reasons:?}");
    }

    #[test]
    fn busy_processes_are_matched_on_full_command_lines_excluding_the_guard_and_its_ancestors() {
        let entry =
            |pid, ppid, cmdline: &str| ProcessEntry { pid, ppid, pgid: pid, zombie: false, cmdline: cmdline.into() };
        let table = [
            entry(10, 1, "bash -c stageload guard --busy ltx-2-mlx -- python x.py"),
            entry(11, 10, "stageload guard --busy ltx-2-mlx -- python x.py"),
            entry(20, 1, "python ltx-2-mlx/run.py --steps 30"),
            entry(21, 1, ""),
            entry(22, 1, "vim notes.txt"),
        ];
        let patterns = [Regex::new("ltx-2-mlx").unwrap(), Regex::new("^$").unwrap()];
        let exclude = stageload_probe::ancestors(&table, 11);
        assert_eq!(busy_commands(&patterns, &table, &exclude), vec!["python ltx-2-mlx/run.py --steps 30"]);
        assert!(busy_commands(&patterns, &table[..2], &exclude).is_empty(), "the guard and its shell are ignored");
        let long = entry(30, 1, &format!("python ltx-2-mlx {}", "x".repeat(200)));
        assert_eq!(busy_commands(&patterns, &[long], &[])[0].chars().count(), 80);
    }

    #[test]
    fn a_busy_process_blocks_and_is_named() {
        let config = busy_config(0.0);
        let mut admission = Admission::new();
        let busy = vec!["python ltx-2-mlx/run.py".to_string()];
        let reasons = admission.check(&config, secs(0.0), Ok(&memory(90, 0)), &busy);
        assert_eq!(describe(&reasons), "busy: python ltx-2-mlx/run.py");
        assert!(admission.check(&config, secs(1.0), Ok(&memory(90, 0)), &[]).is_empty());
    }

    #[test]
    fn a_gap_between_two_busy_jobs_is_not_enough_to_start() {
        // Snapshots busy, none, busy, none, none...: quiet for 2 s, one check per second.
        let config = busy_config(2.0);
        let mut admission = Admission::new();
        let busy = vec!["python ltx-2-mlx/run.py".to_string()];
        let script = [true, false, true, false, false, false];
        let starts: Vec<bool> = script
            .iter()
            .enumerate()
            .map(|(t, &is_busy)| {
                let seen = if is_busy { busy.as_slice() } else { &[] };
                admission.check(&config, secs(t as f64), Ok(&memory(90, 0)), seen).is_empty()
            })
            .collect();
        assert_eq!(starts, [false, false, false, false, false, true], "starts at t = 5 s");
        let mut admission = Admission::new();
        let reasons = admission.check(&config, secs(0.0), Ok(&memory(90, 0)), &[]);
        assert_eq!(describe(&reasons), "quiet for 0 s of 2 s");
        // The countdown is one kind of wait: not logged again every poll.
        let later = admission.check(&config, secs(1.0), Ok(&memory(90, 0)), &[]);
        assert!(same_kind(&reasons, &later) && reasons != later);
        assert!(!same_kind(&reasons, &admission.check(&config, secs(1.5), Ok(&memory(10, 0)), &[])));
    }

    #[test]
    fn the_cgroup_limit_is_the_budget_in_a_container() {
        let mut inside = memory(90, 0);
        inside.cgroup = Some(CgroupMemory { path: "/ci".into(), limit: 10 * GIB, usage: 7 * GIB, reclaimable: 0 });
        let reasons = Admission::new().check(&GuardConfig::default(), secs(0.0), Ok(&inside), &[]);
        assert_eq!(describe(&reasons), "memory available 30% < 40%");
    }

    #[test]
    fn a_swap_rise_over_the_budget_stops_the_command() {
        let config = GuardConfig::default();
        let mut watch = Watch::new(&config, &memory(90, 1));
        assert_eq!(watch.stop_above(), 9 * GIB);
        for (t, swap) in [(0.1, 1), (0.2, 2), (0.3, 9)] {
            assert_eq!(watch.observe(secs(t), Ok(&memory(90, swap)), None, None).0, None);
        }
        let (stop, _) = watch.observe(secs(0.4), Ok(&memory(90, 10)), None, None);
        assert_eq!(stop.unwrap().to_string(), "swap 10.0 GB > 9.0 GB");
        // --swap-limit caps the budget.
        let capped = Watch::new(&GuardConfig { swap_limit: Some(5 * GIB), ..config }, &memory(90, 1));
        assert_eq!(capped.stop_above(), 5 * GIB);
    }

    #[test]
    fn two_low_samples_in_a_row_stop_one_does_not_and_unknown_neither_counts_nor_resets() {
        let config = GuardConfig::default();
        let mut watch = Watch::new(&config, &memory(90, 0));
        let error = ProbeError::Unsupported("meminfo");
        let mut verdicts = Vec::new();
        // A sawtooth never stops; unknown between two low samples keeps the count.
        for (t, reading) in
            [(1, Some(5)), (2, Some(50)), (3, Some(5)), (4, Some(50)), (5, Some(5)), (6, None), (7, Some(9))]
        {
            let sample = reading.map(|pct| memory(pct, 0));
            let (stop, notices) = watch.observe(secs(t as f64 * 0.1), sample.as_ref().ok_or(&error), None, None);
            if reading.is_none() {
                assert!(matches!(notices[0], Notice::Unknown(_)));
            }
            verdicts.push(stop.map(|s| s.to_string()));
        }
        let expected: Vec<Option<String>> =
            [None, None, None, None, None, None, Some("memory available 9% < 10% twice".to_string())].into();
        assert_eq!(verdicts, expected);
    }

    #[test]
    fn a_change_of_swap_devices_rebases_the_budget_and_keeps_the_growth() {
        let mut watch = Watch::new(&GuardConfig::default(), &memory(90, 4));
        assert_eq!(watch.observe(secs(0.1), Ok(&memory(90, 6)), None, None).0, None);
        // swapoff moves 5 GB back to RAM and shrinks the total: no stop, growth of 2 GB kept.
        let mut after = memory(90, 1);
        after.swap_total = 32 * GIB;
        let (stop, notices) = watch.observe(secs(0.2), Ok(&after), None, None);
        assert!(stop.is_none() && matches!(notices[0], Notice::SwapRebased { .. }), "{notices:?}");
        assert_eq!(watch.stop_above(), 7 * GIB, "new level 1 GB + budget 8 GB - 2 GB already grown");
    }

    #[test]
    fn max_memory_and_stalls() {
        let config = GuardConfig { max_memory: Some(GIB), ..GuardConfig::default() };
        let mut watch = Watch::new(&config, &memory(90, 0));
        assert_eq!(watch.observe(secs(0.1), Ok(&memory(90, 0)), Some(GIB / 2), None).0, None);
        let (stop, notices) = watch.observe(secs(9.0), Ok(&memory(90, 0)), Some(2 * GIB), None);
        assert_eq!(stop, Some(Stop::MaxMemory { used: 2 * GIB, max: GIB, from: LimitFrom::Flag }));
        assert_eq!(stop.unwrap().to_string(), "command uses 2.0 GiB > --max-memory 1.0 GiB");
        assert!(matches!(notices[0], Notice::Stalled { .. }), "{notices:?}");
    }

    #[test]
    fn device_memory_over_its_limit_stops_the_command_and_no_reading_never_does() {
        let config = GuardConfig { max_device_memory: Some(10 * GIB), ..GuardConfig::default() };
        let mut watch = Watch::new(&config, &memory(90, 0));
        // Scripted readings: nothing new, under, at the limit, nothing new, over.
        let script = [None, Some(9 * GIB), Some(10 * GIB), None, Some(10 * GIB + 1)];
        let stops: Vec<Option<Stop>> = script
            .iter()
            .enumerate()
            .map(|(t, &device)| watch.observe(secs(t as f64 * 0.1), Ok(&memory(90, 0)), None, device).0)
            .collect();
        assert_eq!(stops[..4], [None, None, None, None]);
        let stop = stops[4].clone().unwrap();
        assert_eq!(stop, Stop::MaxDeviceMemory { used: 10 * GIB + 1, max: 10 * GIB, from: LimitFrom::Flag });
        assert_eq!(stop.to_string(), "command's device memory 10.0 GiB > --max-device-memory 10.0 GiB");
        // Under a plan, the line names the plan's limit.
        let planned = GuardConfig { limits_from: Some("held to plan p.toml".into()), ..config };
        let mut watch = Watch::new(&planned, &memory(90, 0));
        let (stop, _) = watch.observe(secs(0.1), Ok(&memory(90, 0)), None, Some(11 * GIB));
        assert_eq!(
            stop.unwrap().to_string(),
            "command's device memory 11.0 GiB > the plan's device memory limit 10.0 GiB"
        );
    }

    #[test]
    fn a_device_reading_without_a_device_limit_is_ignored() {
        let mut watch = Watch::new(&GuardConfig::default(), &memory(90, 0));
        assert_eq!(watch.observe(secs(0.1), Ok(&memory(90, 0)), None, Some(u64::MAX)).0, None);
    }
}
