//! `stageload guard --plan`: the limits a plan sets, what the trace the command writes says while
//! it runs (the stage in progress, its device memory), and the record of a run over its plan.
//!
//! The rules are pure ([`Progress`], [`OverPlan`], [`stage_need`]); [`TraceTail`] reads the file
//! as it grows: only what was appended since the last look, complete lines only.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{json, Value};
use stageload_guard::{GuardConfig, Readings, Stop, SystemReadings};
use stageload_plan::request::{Mode, Request};
use stageload_plan::{plan, Budget, Pipeline, Plan};
use stageload_probe::{ProbeError, ProcessEntry, ProcessMemory, SystemMemory};
use stageload_trace::event::What;
use stageload_trace::{Event, Record};
use stageload_units::format_bytes;

/// Where the run is, from its trace's records in file order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Progress {
    /// The last stage begun, and which occurrence it was.
    stage: Option<(String, Occurrence)>,
    /// How many times each stage began (a stage entered again at once is not a new one).
    begun: HashMap<String, usize>,
    /// The trace's `end` came after the last stage began.
    ended: bool,
    /// The most device memory read since [`Progress::take_device`] last took it.
    device: Option<u64>,
    /// The file pages of the command's resident set at its last sample that had them.
    file_pages: Option<u64>,
}

impl Progress {
    /// One record. A header starts a new trace (a run that appends to the same file).
    pub fn apply(&mut self, record: &Record) {
        match record {
            Record::Header(_) => *self = Progress::default(),
            Record::Event(Event { what: What::Stage(entered), .. }) => {
                let (name, position) = (entered.stage.clone(), entered.position);
                let again = self
                    .stage
                    .as_ref()
                    .is_some_and(|(current, occurrence)| *current == name && occurrence.position == position);
                if !again || self.ended {
                    let count = self.begun.entry(name.clone()).or_default();
                    *count += 1;
                    self.stage = Some((name, Occurrence { position, count: *count }));
                }
                self.ended = false;
            }
            // The allocator's memory, as `stageload plan --check` compares a device run's peaks.
            Record::Sample(sample) => {
                self.saw_device(sample.device_allocated);
                self.file_pages = sample.rss_file.or(self.file_pages);
            }
            Record::Peak(peak) => self.saw_device(peak.device),
            Record::End { .. } => self.ended = true,
            _ => {}
        }
    }

    fn saw_device(&mut self, reading: Option<u64>) {
        if let Some(bytes) = reading {
            self.device = Some(self.device.map_or(bytes, |seen| seen.max(bytes)));
        }
    }

    /// The most device memory read since the last call; `None`: no reading since.
    pub fn take_device(&mut self) -> Option<u64> {
        self.device.take()
    }

    /// The file pages of the command's resident set at its last sample (`RssFile`).
    pub fn file_pages(&self) -> Option<u64> {
        self.file_pages
    }

    /// The stage in progress.
    pub fn stage_at(&self) -> StageAt {
        match &self.stage {
            None => StageAt::BeforeFirst,
            Some((name, occurrence)) => StageAt::In { name: name.clone(), occurrence: *occurrence, ended: self.ended },
        }
    }
}

/// Which occurrence of its stage a run was in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Occurrence {
    /// Its place in the pipeline's sequence, as the stage event recorded it (the registry's
    /// decision); `None` in a trace written before stage events carried it.
    pub position: Option<usize>,
    /// Which time a stage of this name began (1: the first; a stage entered again at once as the
    /// same occurrence is not a new one): the rule for traces without `position`.
    pub count: usize,
}

/// Which stage a run was in.
#[derive(Debug, Clone, PartialEq)]
pub enum StageAt {
    /// Nothing says: why (no `--trace`, not written yet, unreadable).
    Unknown(String),
    /// The trace has no stage yet: the run was setting up.
    BeforeFirst,
    /// Stage `name` was in progress, at `occurrence`; `ended`: the trace had ended after it
    /// began.
    In { name: String, occurrence: Occurrence, ended: bool },
}

/// What the plan has stage `name` at `occurrence` need, in `mode`, reserve included: host
/// memory, or `device` memory (the plan's own per-stage numbers: [`Plan::stages`], and for an
/// eager run [`stageload_plan::EagerPlan::stages`]). The occurrence is the one the stage event
/// recorded when the plan's stage there has that name; for a trace without it, the stage's
/// `count`-th in the file, or the last of the name when the run entered it more often than
/// the file lists it.
pub fn stage_need(plan: &Plan, mode: Mode, name: &str, occurrence: Occurrence, device: bool) -> Option<u64> {
    let pick = |names: Vec<&str>| {
        if let Some(position) = occurrence.position.filter(|&p| names.get(p) == Some(&name)) {
            return Some(position);
        }
        let indices: Vec<usize> = names.iter().enumerate().filter(|(_, n)| **n == name).map(|(i, _)| i).collect();
        indices.get(occurrence.count.saturating_sub(1)).or(indices.last()).copied()
    };
    match mode {
        Mode::Staged => {
            let stage = &plan.stages[pick(plan.stages.iter().map(|s| s.name.as_str()).collect())?];
            Some(if device { stage.device_need } else { stage.need })
        }
        Mode::Eager => {
            let stage = &plan.eager.stages[pick(plan.eager.stages.iter().map(|s| s.name.as_str()).collect())?];
            Some(if device { stage.device_need } else { stage.need })
        }
    }
}

/// A run the guard stopped for passing its plan's limit: by how much, and in which stage.
#[derive(Debug, Clone, PartialEq)]
pub struct OverPlan {
    /// Device memory (else host memory).
    pub device: bool,
    pub used: u64,
    pub limit: u64,
    pub stage: StageAt,
    /// The stage's own planned need, reserve included.
    pub stage_need: Option<u64>,
    /// Host memory: the file pages of the command's resident set at its last traced sample.
    /// The guard leaves them out of `used`; the plan's numbers, measured from the resident set
    /// and its high-water mark, include them.
    pub file_pages: Option<u64>,
}

impl OverPlan {
    /// The record for a stop, when it is one for the plan's limits.
    pub fn of(stop: &Stop, stage: StageAt, need: impl Fn(&str, Occurrence, bool) -> Option<u64>) -> Option<OverPlan> {
        let (device, used, limit) = match *stop {
            Stop::MaxMemory { used, max, .. } => (false, used, max),
            Stop::MaxDeviceMemory { used, max, .. } => (true, used, max),
            _ => return None,
        };
        let stage_need = match &stage {
            StageAt::In { name, occurrence, .. } => need(name, *occurrence, device),
            _ => None,
        };
        Some(OverPlan { device, used, limit, stage, stage_need, file_pages: None })
    }

    pub fn over(&self) -> u64 {
        self.used.saturating_sub(self.limit)
    }

    /// The log line.
    pub fn message(&self) -> String {
        let what = if self.device { "device memory" } else { "memory" };
        let stage = match &self.stage {
            StageAt::Unknown(why) => format!("in an unknown stage ({why})"),
            StageAt::BeforeFirst => "before its first stage (the trace has no stage yet)".to_string(),
            StageAt::In { name, ended: false, .. } => format!("in stage '{name}'"),
            StageAt::In { name, ended: true, .. } => format!("after its trace ended, in its last stage '{name}'"),
        };
        let need = self
            .stage_need
            .map_or(String::new(), |need| format!(", which the plan gives {} (reserve included)", format_bytes(need)));
        let file_pages = self.file_pages.filter(|_| !self.device).map_or(String::new(), |pages| {
            format!(
                "; the guard counts memory less file pages, the plan's numbers include them ({} at the last sample)",
                format_bytes(pages)
            )
        });
        format!(
            "over its plan by {}: {what} {} > {} {stage}{need}{file_pages}",
            format_bytes(self.over()),
            format_bytes(self.used),
            format_bytes(self.limit)
        )
    }

    /// The JSON record's fields.
    pub fn detail(&self) -> Value {
        let (stage, trace_ended) = match &self.stage {
            StageAt::In { name, ended, .. } => (Some(name.as_str()), *ended),
            _ => (None, false),
        };
        let why = match &self.stage {
            StageAt::Unknown(why) => Some(why.as_str()),
            _ => None,
        };
        json!({
            "memory": if self.device { "device" } else { "host" },
            "used": self.used,
            "limit": self.limit,
            "over": self.over(),
            "stage": stage,
            "stage_need": self.stage_need,
            "file_pages": self.file_pages,
            "trace_ended": trace_ended,
            "stage_unknown": why,
        })
    }
}

/// A run held to its plan: the pipeline, its plan on this machine, and the request (the limits,
/// from [`Request::of`], the same numbers as `stageload plan --request`).
pub struct Held {
    pub file: PathBuf,
    pub plan: Plan,
    pub request: Request,
    /// The trace the command writes (`--trace`).
    pub trace: Option<PathBuf>,
}

impl Held {
    /// Loads `file` and plans it against this machine; Err: why not (the file, or the plan does
    /// not fit), for a refusal at start.
    pub fn load(file: &Path, mode: Mode, trace: Option<&Path>) -> Result<Held, String> {
        let pipeline = Pipeline::load(file).map_err(|error| format!("--plan {}: {error}", file.display()))?;
        let budget = Budget::of_this_machine()
            .map_err(|error| format!("--plan {}: cannot read this machine's memory: {error}", file.display()))?;
        let plan = plan(&pipeline, budget, pipeline.device_memory.map(Budget::given));
        let request =
            Request::of(&pipeline, &plan, mode).map_err(|no_fit| format!("--plan {}: {no_fit}", file.display()))?;
        Ok(Held { file: file.to_path_buf(), plan, request, trace: trace.map(Path::to_path_buf) })
    }

    /// The device limit the guard enforces: the request's, when the trace carries the readings.
    pub fn device_limit(&self) -> Option<u64> {
        (self.request.device_memory > 0 && self.trace.is_some()).then_some(self.request.device_memory)
    }

    /// `config` with the plan's limits, and without the rules a scheduler's node has no use for:
    /// admission on free memory (`--wait-free` 0), on other processes (`--busy`, `--quiet-for`),
    /// and the machine-wide low-memory stop (`--kill-free` 0), which would stop whichever job it
    /// watches rather than the one over its plan. The swap rules stay.
    pub fn hold(&self, config: &mut GuardConfig) {
        config.wait_free = 0.0;
        config.kill_free = 0.0;
        config.busy.clear();
        config.quiet_for = Duration::ZERO;
        config.max_memory = Some(self.request.memory);
        config.max_device_memory = self.device_limit();
        config.limits_from = Some(limits_from(&self.file, &self.request, self.device_limit()));
    }

    /// The over-plan record for `stop`, the stage taken from `tail` as the watch's last poll
    /// read it, at the stop (what the command writes while it is stopped is not its stage).
    pub fn over_plan(&self, stop: &Stop, tail: Option<&TraceTail>) -> Option<OverPlan> {
        let stage = match tail {
            Some(tail) => tail.stage_at(),
            None => StageAt::Unknown("no --trace: give --trace FILE, the trace the command writes".to_string()),
        };
        let mode = self.request.mode;
        let over = OverPlan::of(stop, stage, |name, occurrence, device| {
            stage_need(&self.plan, mode, name, occurrence, device)
        });
        over.map(|over| OverPlan { file_pages: tail.and_then(TraceTail::file_pages).filter(|_| !over.device), ..over })
    }
}

/// The start line's words for a run held to `request` from plan `file`.
pub fn limits_from(file: &Path, request: &Request, device_limit: Option<u64>) -> String {
    let mode = match request.mode {
        Mode::Staged => "",
        Mode::Eager => ", eager: every model loaded up front",
    };
    let mut text = format!(
        "held to plan {}: at most {} (the need of stage '{}', reserve included{mode})",
        file.display(),
        format_bytes(request.memory),
        request.stage
    );
    match device_limit {
        Some(limit) => text += &format!(", device memory at most {} (read from the trace)", format_bytes(limit)),
        None if request.device_memory > 0 => {
            text += &format!(
                ", device memory {} not enforced: give --trace, the trace the command writes",
                format_bytes(request.device_memory)
            )
        }
        None => {}
    }
    text
}

/// At most this much of the trace is read in one look; the rest at the next.
const READ_CAP: u64 = 4 << 20;
/// A line longer than this is no trace record: dropped up to its end.
const LINE_CAP: usize = 4 << 20;

/// A file's identity and state: it is the same file, unchanged, while this does not change.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Stamp {
    dev: u64,
    ino: u64,
    len: u64,
    mtime: (i64, i64),
}

impl Stamp {
    fn of(meta: &std::fs::Metadata) -> Stamp {
        Stamp { dev: meta.dev(), ino: meta.ino(), len: meta.len(), mtime: (meta.mtime(), meta.mtime_nsec()) }
    }
}

/// The trace a command writes, read as it grows. Each look reads only what was appended since
/// the last one (at most [`READ_CAP`]); a line is taken once its newline is written (a
/// half-written last line waits for the next look); a complete line that is no trace record is
/// skipped. A file that is there before the command starts is a previous run's and is skipped
/// until it changes; a file truncated or replaced is read again from its start.
pub struct TraceTail {
    path: PathBuf,
    stale: Option<Stamp>,
    /// The (device, inode) being read, and how far.
    file: Option<(u64, u64)>,
    offset: u64,
    partial: Vec<u8>,
    /// Dropping an overlong line up to its newline.
    discarding: bool,
    progress: Progress,
    records: usize,
    /// Why the last look read nothing, when it could not.
    problem: Option<String>,
    /// A device reading was taken at least once.
    device_seen: bool,
}

impl TraceTail {
    /// Starts watching `path`; what is there now (a previous run's trace) is skipped until it changes.
    pub fn new(path: &Path) -> TraceTail {
        let stale = std::fs::metadata(path).ok().map(|meta| Stamp::of(&meta));
        TraceTail {
            path: path.to_path_buf(),
            stale,
            file: None,
            offset: 0,
            partial: Vec::new(),
            discarding: false,
            progress: Progress::default(),
            records: 0,
            problem: None,
            device_seen: false,
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reads what was appended since the last look.
    pub fn poll(&mut self) {
        self.problem = match self.read_new() {
            Ok(()) => None,
            Err(error) if error.kind() == io::ErrorKind::NotFound => Some("not written yet".to_string()),
            Err(error) => Some(error.to_string()),
        };
    }

    fn read_new(&mut self) -> io::Result<()> {
        let mut file = stageload_input::open_regular(&self.path)?;
        let meta = file.metadata()?;
        let stamp = Stamp::of(&meta);
        if self.stale == Some(stamp) {
            return Err(io::Error::other("unchanged since before the command started (a previous run's)"));
        }
        self.stale = None;
        if self.file != Some((stamp.dev, stamp.ino)) || stamp.len < self.offset {
            // Replaced or truncated: a new trace.
            self.file = Some((stamp.dev, stamp.ino));
            self.offset = 0;
            self.partial.clear();
            self.discarding = false;
            self.progress = Progress::default();
        }
        let appended = stamp.len.saturating_sub(self.offset).min(READ_CAP);
        if appended == 0 {
            return Ok(());
        }
        file.seek(SeekFrom::Start(self.offset))?;
        let mut bytes = Vec::with_capacity(appended as usize);
        Read::take(&mut file as &mut File, appended).read_to_end(&mut bytes)?;
        self.offset += bytes.len() as u64;
        self.take(&bytes);
        Ok(())
    }

    /// Splits `bytes` into complete lines after what was pending, and applies each.
    fn take(&mut self, mut bytes: &[u8]) {
        while let Some(end) = bytes.iter().position(|&b| b == b'\n') {
            if !std::mem::take(&mut self.discarding) {
                self.partial.extend_from_slice(&bytes[..end]);
                let line = std::mem::take(&mut self.partial);
                self.apply_line(&line);
            }
            bytes = &bytes[end + 1..];
        }
        if !self.discarding {
            self.partial.extend_from_slice(bytes);
            if self.partial.len() > LINE_CAP {
                self.partial.clear();
                self.discarding = true;
            }
        }
    }

    fn apply_line(&mut self, line: &[u8]) {
        if line.iter().all(u8::is_ascii_whitespace) {
            return;
        }
        // A complete line that is no record (a hand edit, another writer) is skipped.
        if let Ok(record) = serde_json::from_slice::<Record>(line) {
            self.records += 1;
            self.progress.apply(&record);
        }
    }

    /// The stage in progress, as far as the trace read so far says.
    pub fn stage_at(&self) -> StageAt {
        match (&self.problem, self.records) {
            (_, n) if n > 0 => self.progress.stage_at(),
            (Some(problem), _) => StageAt::Unknown(format!("trace {}: {problem}", self.path.display())),
            (None, _) => StageAt::Unknown(format!("trace {} has no record yet", self.path.display())),
        }
    }

    /// The file pages of the command's resident set at the last sample read.
    pub fn file_pages(&self) -> Option<u64> {
        self.progress.file_pages()
    }

    /// No device reading was ever taken from the trace.
    pub fn never_read_device(&self) -> bool {
        !self.device_seen
    }
}

impl TraceTail {
    /// The most device memory the trace reported since the last call; `None` when nothing new
    /// was (what [`Readings::command_device_memory`] asks every poll).
    pub fn command_device_memory(&mut self) -> Option<u64> {
        self.poll();
        let reading = self.progress.take_device();
        self.device_seen |= reading.is_some();
        reading
    }
}

/// The machine's readings (kept open between polls), and the command's device memory from its
/// trace when `--trace` names one.
#[derive(Default)]
pub struct CommandReadings {
    machine: SystemReadings,
    /// The command's own trace.
    pub tail: Option<TraceTail>,
}

impl CommandReadings {
    /// The machine's readings, and the trace at `trace` if any (made before the command starts:
    /// a trace already there is a previous run's).
    pub fn new(trace: Option<&Path>) -> Self {
        CommandReadings { machine: SystemReadings::new(), tail: trace.map(TraceTail::new) }
    }
}

impl Readings for CommandReadings {
    fn memory(&mut self) -> Result<SystemMemory, ProbeError> {
        self.machine.memory()
    }
    fn subtree(&mut self, root: i32) -> Result<Vec<ProcessEntry>, ProbeError> {
        self.machine.subtree(root)
    }
    fn process_memory(&mut self, pid: i32) -> Result<ProcessMemory, ProbeError> {
        self.machine.process_memory(pid)
    }
    fn command_device_memory(&mut self) -> Option<u64> {
        self.tail.as_mut().and_then(TraceTail::command_device_memory)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stageload_guard::LimitFrom;
    use stageload_trace::event::Entered;
    use stageload_trace::record::{Header, PeakRecord, Sample};

    fn stage(name: &str) -> Record {
        Record::Event(Entered::new(name).into())
    }

    fn header() -> Record {
        Record::Header(Header {
            schema: 2,
            utc: "x".into(),
            pid: 1,
            host: "h".into(),
            os: "linux".into(),
            total_memory: 1,
            device: "cuda:0".into(),
            command: vec![],
            interval: 0.25,
            meta: Default::default(),
        })
    }

    fn device_sample(bytes: u64) -> Record {
        Record::Sample(Sample { device_allocated: Some(bytes), device_reserved: Some(bytes * 2), ..Sample::default() })
    }

    fn progress(records: &[Record]) -> Progress {
        let mut progress = Progress::default();
        records.iter().for_each(|r| progress.apply(r));
        progress
    }

    fn in_stage(name: &str, count: usize, ended: bool) -> StageAt {
        StageAt::In { name: name.into(), occurrence: Occurrence { position: None, count }, ended }
    }

    #[test]
    fn the_stage_in_progress_is_the_last_one_begun() {
        assert_eq!(progress(&[header()]).stage_at(), StageAt::BeforeFirst);
        assert_eq!(progress(&[header(), stage("encode"), stage("denoise")]).stage_at(), in_stage("denoise", 1, false));
    }

    #[test]
    fn a_stage_that_comes_back_is_counted_and_entering_it_again_at_once_is_not() {
        let records = [stage("embed"), stage("embed"), stage("other"), stage("embed")];
        assert_eq!(progress(&records).stage_at(), in_stage("embed", 2, false));
    }

    fn stage_at(name: &str, position: usize) -> Record {
        Record::Event(Entered { position: Some(position), ..Entered::new(name) }.into())
    }

    fn at(name: &str, position: usize, count: usize) -> StageAt {
        StageAt::In { name: name.into(), occurrence: Occurrence { position: Some(position), count }, ended: false }
    }

    /// Models `x` (1 MiB) and `y` (2 MiB); each stage's working memory is its number in MiB.
    fn plan_of(stages: &[(&str, &str, u64)]) -> Plan {
        let mut text =
            String::from("[[models]]\nname = \"x\"\nweights = \"1M\"\n\n[[models]]\nname = \"y\"\nweights = \"2M\"\n");
        for (name, model, working) in stages {
            text += &format!("\n[[stages]]\nname = \"{name}\"\nmodels = [\"{model}\"]\nworking = \"{working}M\"\n");
        }
        let pipeline = Pipeline::parse(&text, Path::new("pipeline.toml")).unwrap();
        plan(&pipeline, Budget::given(1 << 30), None)
    }

    #[test]
    fn a_stage_listed_twice_is_held_to_the_occurrence_the_trace_says_it_entered() {
        const MIB: u64 = 1 << 20;
        // `[a, a]`: entered twice in a row, two occurrences, two needs.
        let plan = plan_of(&[("a", "x", 10), ("a", "y", 20)]);
        let entered = progress(&[stage_at("a", 0), stage_at("a", 1)]).stage_at();
        assert_eq!(entered, at("a", 1, 2));
        let StageAt::In { occurrence, .. } = entered else { unreachable!() };
        assert_eq!(stage_need(&plan, Mode::Staged, "a", occurrence, false), Some(22 * MIB));
        assert_eq!(stage_need(&plan, Mode::Eager, "a", occurrence, false), Some(23 * MIB), "x and y, and 20M");
        // The same occurrence entered again is still that one.
        assert_eq!(progress(&[stage_at("a", 0), stage_at("a", 0)]).stage_at(), at("a", 0, 1));

        // `[a, b, a]`: the second `a` is the third occurrence.
        let plan = plan_of(&[("a", "x", 10), ("b", "y", 5), ("a", "y", 30)]);
        let entered = progress(&[stage_at("a", 0), stage_at("b", 1), stage_at("a", 2)]).stage_at();
        assert_eq!(entered, at("a", 2, 2));
        let StageAt::In { occurrence, .. } = entered else { unreachable!() };
        assert_eq!(stage_need(&plan, Mode::Staged, "a", occurrence, false), Some(32 * MIB));
        assert_eq!(plan.stages[2].need, 32 * MIB, "the plan's own number");

        // A position whose stage has another name (a program whose sequence is not the file's)
        // falls back to counting: the first `a`.
        let occurrence = Occurrence { position: Some(1), count: 1 };
        assert_eq!(stage_need(&plan, Mode::Staged, "a", occurrence, false), Some(11 * MIB));
        // A trace without positions: the count rule, the last of the name past the file's.
        let occurrence = Occurrence { position: None, count: 5 };
        assert_eq!(stage_need(&plan, Mode::Staged, "a", occurrence, false), Some(32 * MIB));
    }

    #[test]
    fn after_the_trace_ends_the_last_stage_is_said_as_ended() {
        let records = [stage("denoise"), Record::End { t: 2.0 }];
        assert_eq!(progress(&records).stage_at(), in_stage("denoise", 1, true));
    }

    #[test]
    fn a_new_header_starts_over() {
        assert_eq!(progress(&[stage("denoise"), header()]).stage_at(), StageAt::BeforeFirst);
    }

    #[test]
    fn the_device_reading_is_the_most_allocated_since_it_was_last_taken() {
        let mut progress = progress(&[device_sample(5), device_sample(9), device_sample(7)]);
        assert_eq!(progress.take_device(), Some(9));
        assert_eq!(progress.take_device(), None, "nothing new");
        progress.apply(&Record::Peak(PeakRecord { t: 1.0, stage: "s".into(), rss: 1, device: Some(12) }));
        progress.apply(&Record::Sample(Sample::default()));
        assert_eq!(progress.take_device(), Some(12), "an exact peak counts, a sample without a device does not");
    }

    #[test]
    fn the_over_plan_line_says_by_how_much_and_in_which_stage() {
        let stop = Stop::MaxMemory { used: 300 << 20, max: 100 << 20, from: LimitFrom::Plan };
        let over = OverPlan::of(&stop, in_stage("denoise", 1, false), |name, _, device| {
            assert!(name == "denoise" && !device);
            Some(80 << 20)
        })
        .unwrap();
        assert_eq!(
            over.message(),
            "over its plan by 200.0 MiB: memory 300.0 MiB > 100.0 MiB in stage 'denoise', \
             which the plan gives 80.0 MiB (reserve included)"
        );
        let detail = over.detail();
        assert_eq!((detail["over"].as_u64(), detail["stage"].as_str()), (Some(200 << 20), Some("denoise")));
        assert_eq!(detail["stage_need"].as_u64(), Some(80 << 20));
    }

    #[test]
    fn without_a_trace_the_stage_is_unknown_and_says_why() {
        let stop = Stop::MaxDeviceMemory { used: 3 << 30, max: 2 << 30, from: LimitFrom::Plan };
        let over = OverPlan::of(&stop, StageAt::Unknown("give --trace".into()), |_, _, _| unreachable!()).unwrap();
        assert_eq!(
            over.message(),
            "over its plan by 1.0 GiB: device memory 3.0 GiB > 2.0 GiB in an unknown stage (give --trace)"
        );
        assert_eq!(over.detail()["stage"], Value::Null);
        assert_eq!(over.detail()["memory"], "device");
    }

    #[test]
    fn a_stop_for_swap_is_no_over_plan() {
        let stop = Stop::Swap { used: 2, stop_above: 1 };
        assert_eq!(OverPlan::of(&stop, StageAt::BeforeFirst, |_, _, _| None), None);
    }

    fn line(record: &Record) -> String {
        format!("{}\n", serde_json::to_string(record).unwrap())
    }

    fn append(path: &Path, text: &str) {
        use std::io::Write;
        std::fs::OpenOptions::new().create(true).append(true).open(path).unwrap().write_all(text.as_bytes()).unwrap();
    }

    #[test]
    fn a_growing_trace_is_read_line_by_line_and_a_half_written_line_waits() {
        let folder = tempfile::tempdir().unwrap();
        let path = folder.path().join("run.jsonl");
        let mut tail = TraceTail::new(&path);
        tail.poll();
        assert!(matches!(tail.stage_at(), StageAt::Unknown(why) if why.ends_with("not written yet")));
        let denoise = line(&stage("denoise"));
        let (first, second) = denoise.split_at(10);
        append(&path, &format!("{}{}{first}", line(&header()), line(&stage("encode"))));
        tail.poll();
        assert_eq!(tail.stage_at(), in_stage("encode", 1, false), "the half-written line is not read yet");
        append(&path, &format!("{second}not a record\n{}", line(&device_sample(42))));
        assert_eq!(tail.command_device_memory(), Some(42));
        assert_eq!(tail.stage_at(), in_stage("denoise", 1, false), "the broken line is skipped");
        assert_eq!(tail.command_device_memory(), None, "nothing appended");
    }

    #[test]
    fn a_previous_runs_trace_is_skipped_until_it_is_rewritten() {
        let folder = tempfile::tempdir().unwrap();
        let path = folder.path().join("run.jsonl");
        std::fs::write(&path, format!("{}{}{}", line(&header()), line(&stage("old")), line(&device_sample(1 << 40))))
            .unwrap();
        let mut tail = TraceTail::new(&path);
        assert_eq!(tail.command_device_memory(), None, "the old run's readings never stop this one");
        assert!(matches!(tail.stage_at(), StageAt::Unknown(why) if why.contains("previous run")));
        // The new run truncates it and writes its own.
        std::fs::write(&path, format!("{}{}", line(&header()), line(&stage("new")))).unwrap();
        tail.poll();
        assert_eq!(tail.stage_at(), in_stage("new", 1, false));
        // Truncated again, shorter: read from the start.
        std::fs::write(&path, line(&stage("x"))).unwrap();
        tail.poll();
        assert_eq!(tail.stage_at(), in_stage("x", 1, false));
    }
}
