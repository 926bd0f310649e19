//! The queue's files under `STAGELOAD_HOME` (default `~/.stageload`):
//!
//! ```text
//! queue/LANE/NNNNNNNNNNNNNNNNNNNN-PID.json   one entry per run of the lane (written aside, renamed in)
//! queue/LANE/run.lock                        the lane's lock (flock), inherited by the command
//! queue/LANE/join.lock                       held for an instant while a run joins or looks
//! queue/LANE/owners.json                     when each owner last started in the lane
//! history.jsonl                              one line per finished run
//! traces/                                    each run's trace, unless --trace names another file
//! busy.txt                                   --busy patterns every run of lane `ram` adds, one a line
//! ```
//!
//! Every file is read as untrusted: an entry that does not parse is left out of the order (and
//! removed once its pid is gone), an `owners.json` that does not parse counts as empty, so no
//! corrupt file holds a lane; the lock alone makes runs of a lane exclusive.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use nix::errno::Errno;
use nix::fcntl::{fcntl, FcntlArg, FdFlag, FlockArg};
use regex::Regex;
use serde::{Deserialize, Serialize};
use stageload_guard::queue::{is_stale, Entry, EntryState, Hold, Lane, LaneFiles, LastStarts, Seen, Ticket, TurnWait};

/// The most of any queue file read (an entry is a few hundred bytes): a larger one is corrupt.
const MOST_READ: u64 = 1 << 20;

/// A queue file that cannot be used; each names the file and what to do.
#[derive(Debug, thiserror::Error)]
pub enum QueueError {
    /// Neither `STAGELOAD_HOME` nor `HOME` is set.
    #[error("neither STAGELOAD_HOME nor HOME is set: set STAGELOAD_HOME to a folder for the queue")]
    NoHome,
    /// A file or folder of the home cannot be written.
    #[error("cannot write {}: {source}; set STAGELOAD_HOME to a folder you can write", .path.display())]
    Write {
        /// What could not be written.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// A file of the home cannot be read.
    #[error("cannot read {}: {source}", .path.display())]
    Read {
        /// What could not be read.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// A line of `history.jsonl` that is not a finished run.
    #[error("{} line {line} is not a finished run ({error}): fix or remove that line", .path.display())]
    History {
        /// The history file.
        path: PathBuf,
        /// Its line, from 1.
        line: usize,
        /// What is wrong with it.
        error: String,
    },
    /// A line of `busy.txt` that is not a regex.
    #[error("{} line {line}: bad regex '{pattern}': {error}; fix or remove that line", .path.display())]
    Busy {
        /// The busy file.
        path: PathBuf,
        /// Its line, from 1.
        line: usize,
        /// The line.
        pattern: String,
        /// The regex error.
        error: String,
    },
}

/// Nanoseconds since the Unix epoch now.
pub fn now_ns() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// The UTC time now, RFC 3339 to the second.
pub fn utc_now() -> String {
    humantime::format_rfc3339_seconds(SystemTime::now()).to_string()
}

/// Reads at most [`MOST_READ`] bytes of `path` as text.
fn read_small(path: &Path) -> io::Result<String> {
    let mut text = String::new();
    File::open(path)?.take(MOST_READ).read_to_string(&mut text)?;
    Ok(text)
}

/// What `owners.json` is written as before it is renamed over it, followed by the writer's pid.
const OWNERS_ASIDE: &str = ".owners-";

/// Writes `data` beside `path` and renames it into place: a reader sees the old file or the new
/// one, never half of one.
fn write_atomic(path: &Path, data: &[u8]) -> io::Result<()> {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let aside = path.with_file_name(format!(".tmp-{name}"));
    fs::write(&aside, data)?;
    fs::rename(&aside, path)
}

/// The queue's home.
#[derive(Debug, Clone)]
pub struct Home {
    root: PathBuf,
}

impl Home {
    /// `STAGELOAD_HOME`, else `$HOME/.stageload`.
    pub fn from_env() -> Result<Home, QueueError> {
        let set = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
        let root = set("STAGELOAD_HOME").or_else(|| set("HOME").map(|home| home.join(".stageload")));
        root.map(|root| Home { root }).ok_or(QueueError::NoHome)
    }

    /// The folder of every lane.
    fn queue(&self) -> PathBuf {
        self.root.join("queue")
    }

    /// The finished runs, one JSON line each.
    pub fn history(&self) -> PathBuf {
        self.root.join("history.jsonl")
    }

    /// Where a run's trace goes by default: `traces/STAMP-WHO-PID.jsonl`.
    pub fn default_trace(&self, who: &str) -> PathBuf {
        let stamp = utc_now().replace([':', '-'], "");
        let name: String = who
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') { c } else { '_' })
            .collect();
        let name = if name.is_empty() { "job".to_string() } else { name };
        self.root.join("traces").join(format!("{stamp}-{name}-{}.jsonl", std::process::id()))
    }

    /// The patterns of `busy.txt` (none when it does not exist); `#` starts a comment line.
    pub fn busy_patterns(&self) -> Result<Vec<Regex>, QueueError> {
        let path = self.root.join("busy.txt");
        let text = match read_small(&path) {
            Ok(text) => text,
            Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(source) => return Err(QueueError::Read { path, source }),
        };
        let mut patterns = Vec::new();
        for (index, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let regex = Regex::new(line).map_err(|error| QueueError::Busy {
                path: path.clone(),
                line: index + 1,
                pattern: line.to_string(),
                // The regex's own message spans lines; its last says what is wrong.
                error: error.to_string().lines().last().unwrap_or("").trim().to_string(),
            })?;
            patterns.push(regex);
        }
        Ok(patterns)
    }

    /// A lane's folder, created if needed.
    pub fn lane(&self, lane: &Lane) -> Result<LaneDir, QueueError> {
        let path = self.queue().join(lane.as_str());
        fs::create_dir_all(&path).map_err(|source| QueueError::Write { path: path.clone(), source })?;
        Ok(LaneDir { path, lane: lane.clone() })
    }

    /// The lanes that exist, by name (folders that are not lane names are left out).
    pub fn lanes(&self) -> Result<Vec<LaneDir>, QueueError> {
        let root = self.queue();
        let listing = match fs::read_dir(&root) {
            Ok(listing) => listing,
            Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(source) => return Err(QueueError::Read { path: root, source }),
        };
        let mut lanes: Vec<LaneDir> = listing
            .flatten()
            .filter(|d| d.file_type().is_ok_and(|t| t.is_dir()))
            .filter_map(|d| Lane::parse(&d.file_name().to_string_lossy()).ok())
            .map(|lane| LaneDir { path: root.join(lane.as_str()), lane })
            .collect();
        lanes.sort_by(|a, b| a.lane.cmp(&b.lane));
        Ok(lanes)
    }

    /// The pids of every entry of every lane, by their file names: the runs waiting or watching.
    pub fn queued_pids(&self) -> Vec<i32> {
        let lanes = self.lanes().unwrap_or_default();
        lanes
            .iter()
            .filter_map(|lane| fs::read_dir(&lane.path).ok())
            .flat_map(|listing| listing.flatten())
            .filter_map(|d| Ticket::parse(&d.file_name().to_string_lossy()))
            .map(|ticket| ticket.pid)
            .collect()
    }

    /// The last `count` finished runs, oldest first; a line among them that does not parse is
    /// an error naming it.
    pub fn last_finished(&self, count: usize) -> Result<Vec<Finished>, QueueError> {
        let path = self.history();
        let mut bytes = Vec::new();
        match File::open(&path).and_then(|mut file| file.read_to_end(&mut bytes)) {
            Ok(_) => {}
            Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(source) => return Err(QueueError::Read { path, source }),
        }
        let lines: Vec<(usize, &[u8])> =
            bytes.split(|b| *b == b'\n').enumerate().filter(|(_, line)| !line.trim_ascii().is_empty()).collect();
        let first = lines.len().saturating_sub(count);
        lines[first..]
            .iter()
            .map(|(index, line)| {
                serde_json::from_slice::<Finished>(line).map_err(|error| QueueError::History {
                    path: path.clone(),
                    line: index + 1,
                    error: error.to_string(),
                })
            })
            .collect()
    }

    /// Appends one finished run to `history.jsonl` (one write of one line).
    pub fn append_finished(&self, finished: &Finished) -> Result<(), QueueError> {
        let path = self.history();
        let mut line = serde_json::to_string(finished).unwrap_or_default();
        line.push('\n');
        OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .and_then(|mut file| file.write_all(line.as_bytes()))
            .map_err(|source| QueueError::Write { path, source })
    }
}

/// Where an entry is, as its file says.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "lowercase")]
pub enum FileState {
    /// Waiting for its turn or for room.
    Waiting,
    /// It holds the lane and waits for room (the guard's admission).
    Starting {
        /// When it took the lane, nanoseconds since the Unix epoch.
        took_ns: u64,
    },
    /// Its command runs.
    Running {
        /// When it started, RFC 3339.
        started: String,
        /// The same in nanoseconds since the Unix epoch.
        started_ns: u64,
    },
}

/// An entry's file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EntryFile {
    /// The run's pid.
    pub pid: i32,
    /// The run's start time (Linux: clock ticks after boot), to tell a reused pid.
    #[serde(default)]
    pub start_time: Option<u64>,
    /// `--who`.
    #[serde(default)]
    pub who: String,
    /// Whose turn it takes.
    pub owner: String,
    /// The lane.
    pub lane: String,
    /// The command, as one line cut to 300 characters.
    pub cmd: String,
    /// When it joined, RFC 3339.
    pub since: String,
    /// Waiting, starting or running.
    #[serde(flatten)]
    pub state: FileState,
    /// What it declared it will hold (`--plan`, `--memory`), bytes; none: it runs alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request: Option<u64>,
    /// What it waits for, as it last said.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waits_for: Option<String>,
}

/// A live entry read back: the rules' view and its file.
#[derive(Debug, Clone)]
pub struct Live {
    /// What the rules see.
    pub entry: Entry,
    /// The file.
    pub file: EntryFile,
}

/// What a look at `pid` finds (Linux: `/proc/PID/stat`; a zombie is gone).
pub fn look(pid: i32) -> Seen {
    #[cfg(target_os = "linux")]
    {
        let stat = match fs::read_to_string(format!("/proc/{pid}/stat")) {
            Ok(stat) => stat,
            Err(error) if error.kind() == io::ErrorKind::NotFound => return Seen::Gone,
            // Not readable here (hidepid, no file handles left): alive unless the kernel says
            // there is no such process, never removed on a reading that failed.
            Err(_) => {
                return match nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None) {
                    Err(Errno::ESRCH) => Seen::Gone,
                    _ => Seen::Alive { start_time: None },
                }
            }
        };
        // Fields after the command name, which may hold spaces and parentheses: state is the
        // first, the start time the 20th.
        let fields: Vec<&str> =
            stat.rsplit_once(')').map(|(_, rest)| rest.split_whitespace().collect()).unwrap_or_default();
        match fields.first() {
            Some(&"Z") | Some(&"X") => Seen::Gone,
            _ => Seen::Alive { start_time: fields.get(19).and_then(|t| t.parse().ok()) },
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        match nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None) {
            Err(Errno::ESRCH) => Seen::Gone,
            _ => Seen::Alive { start_time: None },
        }
    }
}

/// One lane's folder.
#[derive(Debug, Clone)]
pub struct LaneDir {
    path: PathBuf,
    lane: Lane,
}

impl LaneDir {
    /// The lane.
    pub fn lane(&self) -> &Lane {
        &self.lane
    }

    fn owners_path(&self) -> PathBuf {
        self.path.join("owners.json")
    }

    /// When each owner last started in this lane (empty when the file is missing or corrupt).
    pub fn last_starts(&self) -> LastStarts {
        read_small(&self.owners_path()).ok().and_then(|text| serde_json::from_str(&text).ok()).unwrap_or_default()
    }

    /// Notes that `owner` started now. Runs packed side by side hold the lane's lock together,
    /// so the read and the write happen under [`hold_joins`](Self::hold_joins).
    pub fn note_start(&self, owner: &str, at_ns: u64) -> Result<(), QueueError> {
        let _hold = self.hold_joins();
        let mut starts = self.last_starts();
        starts.insert(owner.to_string(), at_ns);
        let path = self.owners_path();
        let text = serde_json::to_vec(&starts).unwrap_or_default();
        // Written aside under this run's pid (two writers never share one file, should the hold
        // not be had), then renamed over the file whole.
        let aside = self.path.join(format!("{OWNERS_ASIDE}{}.json", std::process::id()));
        fs::write(&aside, &text)
            .and_then(|()| fs::rename(&aside, &path))
            .map_err(|source| QueueError::Write { path, source })
    }

    /// The lane's live entries, oldest first; entries of processes that are gone (or whose pid
    /// was reused) are removed, and so are files left half-written by them. An entry that does
    /// not parse is left out while its pid lives.
    pub fn live(&self) -> Result<Vec<Live>, QueueError> {
        let listing =
            fs::read_dir(&self.path).map_err(|source| QueueError::Read { path: self.path.clone(), source })?;
        let mut live = Vec::new();
        for item in listing.flatten() {
            let name = item.file_name().to_string_lossy().into_owned();
            if let Some(ticket) = name.strip_prefix(".tmp-").and_then(Ticket::parse) {
                if look(ticket.pid) == Seen::Gone {
                    let _ = fs::remove_file(item.path());
                }
                continue;
            }
            let aside = name.strip_prefix(OWNERS_ASIDE).and_then(|rest| rest.strip_suffix(".json"));
            if let Some(writer) = aside.and_then(|pid| pid.parse::<i32>().ok()) {
                if look(writer) == Seen::Gone {
                    let _ = fs::remove_file(item.path());
                }
                continue;
            }
            let Some(ticket) = Ticket::parse(&name) else { continue };
            let seen = look(ticket.pid);
            let file = read_small(&item.path()).ok().and_then(|text| serde_json::from_str::<EntryFile>(&text).ok());
            let stale = match &file {
                Some(file) => is_stale(file.start_time, seen),
                None => seen == Seen::Gone,
            };
            if stale {
                let _ = fs::remove_file(item.path());
                continue;
            }
            if let Some(file) = file {
                let state = match file.state {
                    FileState::Waiting => EntryState::Waiting,
                    // A run that holds the lane counts as running from then on.
                    FileState::Starting { took_ns } => EntryState::Running { started_ns: took_ns },
                    FileState::Running { started_ns, .. } => EntryState::Running { started_ns },
                };
                let entry =
                    Entry { ticket, who: file.who.clone(), owner: file.owner.clone(), state, request: file.request };
                live.push(Live { entry, file });
            }
        }
        live.sort_by_key(|l| l.entry.ticket);
        Ok(live)
    }

    /// Holds off joins to this lane for one look (see [`LaneFiles`]): an `flock` on
    /// `join.lock`, tried for at most a second and gone without after that (the lane's own lock
    /// keeps runs exclusive; this only keeps the order exact). Held while the result lives.
    pub fn hold_joins(&self) -> Option<JoinHold> {
        let file = OpenOptions::new().create(true).append(true).open(self.path.join("join.lock")).ok()?;
        for _ in 0..500 {
            #[allow(deprecated)]
            match nix::fcntl::flock(file.as_raw_fd(), FlockArg::LockExclusiveNonblock) {
                Ok(()) => return Some(JoinHold { _file: file }),
                Err(Errno::EWOULDBLOCK) => std::thread::sleep(std::time::Duration::from_millis(2)),
                Err(_) => return None,
            }
        }
        None
    }

    /// Writes this run's entry, named by the time now and `pid` (taken under
    /// [`hold_joins`](Self::hold_joins), so no look sees a later entry without this one); it is
    /// removed when the returned [`Joined`] is dropped.
    pub fn join(&self, pid: i32, file: &EntryFile) -> Result<(Joined, Ticket), QueueError> {
        let hold = self.hold_joins();
        let ticket = Ticket { joined_ns: now_ns(), pid };
        let joined = Joined { path: self.path.join(ticket.file_name()) };
        joined.write(file)?;
        drop(hold);
        Ok((joined, ticket))
    }

    /// Opens the lane's lock file (not locked yet).
    pub fn lock_file(&self) -> Result<LaneLock, QueueError> {
        let path = self.path.join("run.lock");
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|source| QueueError::Write { path: path.clone(), source })?;
        Ok(LaneLock { file, path })
    }
}

/// Joins to a lane held off; closing the file lets them go (it is opened close-on-exec and
/// dropped before any command starts, so no other process shares it).
pub struct JoinHold {
    _file: File,
}

/// This run's entry file; removed on drop.
pub struct Joined {
    path: PathBuf,
}

impl Joined {
    /// Writes (or rewrites) the entry.
    pub fn write(&self, file: &EntryFile) -> Result<(), QueueError> {
        let text = serde_json::to_vec(file).unwrap_or_default();
        write_atomic(&self.path, &text).map_err(|source| QueueError::Write { path: self.path.clone(), source })
    }

    /// Whether the entry's file is still there.
    pub fn exists(&self) -> bool {
        self.path.exists()
    }
}

impl Drop for Joined {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.path);
    }
}

/// The lane's lock file. The lock is an `flock` on it: it belongs to the open file, so the
/// command, which inherits the open file, keeps the lane taken after this process is gone, and
/// it is let go only when every process holding the file has closed it (by exiting). Never
/// unlocked explicitly once the command may hold it: an unlock would free the lane for everyone
/// sharing the open file, the command's surviving processes included ([`let_go`](Self::let_go)
/// is for a lock taken and not passed on).
pub struct LaneLock {
    file: File,
    path: PathBuf,
}

impl LaneLock {
    /// Takes the lock without waiting, alone or shared: `Ok(false)` when another open file
    /// holds it in a way that excludes this.
    pub fn try_lock(&self, hold: Hold) -> Result<bool, String> {
        let how = match hold {
            Hold::Exclusive => FlockArg::LockExclusiveNonblock,
            Hold::Shared => FlockArg::LockSharedNonblock,
        };
        // `Flock` would unlock when dropped (see the type's docs); the plain call leaves the
        // lock to the open file's lifetime.
        #[allow(deprecated)]
        match nix::fcntl::flock(self.file.as_raw_fd(), how) {
            Ok(()) => Ok(true),
            Err(Errno::EWOULDBLOCK) => Ok(false),
            Err(error) => Err(format!("cannot lock {}: {error}", self.path.display())),
        }
    }

    /// Lets go of a lock this run took and has not passed on yet (a look that cannot say it
    /// holds the lane must not keep it).
    pub fn let_go(&self) {
        #[allow(deprecated)]
        let _ = nix::fcntl::flock(self.file.as_raw_fd(), FlockArg::Unlock);
    }

    /// Lets the next program this process starts inherit the open lock file (clears its
    /// close-on-exec flag), so the command holds the lane too.
    pub fn inherit(&self) -> Result<(), String> {
        fcntl(&self.file, FcntlArg::F_SETFD(FdFlag::empty()))
            .map(drop)
            .map_err(|error| format!("cannot pass {} to the command: {error}", self.path.display()))
    }
}

/// A lane as the wait for a turn reads it.
pub struct LaneView<'a> {
    /// The lane's folder.
    pub dir: &'a LaneDir,
    /// Its lock file.
    pub lock: &'a LaneLock,
    /// This run's entry, written again if it disappears while waiting.
    pub joined: &'a Joined,
    /// What it holds; written again as it waits and when it takes the lane.
    pub file: EntryFile,
    /// Joins held off during a look.
    pub hold: Option<JoinHold>,
}

impl LaneFiles for LaneView<'_> {
    fn hold_joins(&mut self) {
        self.hold = self.dir.hold_joins();
    }

    fn release_joins(&mut self) {
        self.hold = None;
    }

    fn entries(&mut self) -> Result<(Vec<Entry>, LastStarts), String> {
        if !self.joined.exists() {
            self.joined.write(&self.file).map_err(|e| e.to_string())?;
        }
        let live = self.dir.live().map_err(|e| e.to_string())?;
        Ok((live.into_iter().map(|l| l.entry).collect(), self.dir.last_starts()))
    }

    fn try_lock(&mut self, hold: Hold) -> Result<bool, String> {
        // Without the join hold a run joining now could be missed, and runs sharing the lane
        // could both find room: this look takes nothing, the next one tries again.
        if self.hold.is_none() {
            return Err(format!(
                "{} was not had within a second; looking again",
                self.dir.path.join("join.lock").display()
            ));
        }
        let taken = self.lock.try_lock(hold)?;
        if taken {
            // Still under the join hold: the next look sees this run holding the lane.
            self.file.state = FileState::Starting { took_ns: now_ns() };
            self.file.waits_for = Some("room (the guard's admission)".to_string());
            if let Err(error) = self.joined.write(&self.file) {
                // Not said in its entry, so not held: the others could not see it.
                self.lock.let_go();
                return Err(error.to_string());
            }
        }
        Ok(taken)
    }

    fn waiting(&mut self, why: &TurnWait) {
        self.file.waits_for = Some(why.to_string());
        // Shown by `stageload queue`; a failed write only leaves the last reason there.
        let _ = self.joined.write(&self.file);
    }
}

/// One finished run, a line of `history.jsonl`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Finished {
    /// When it ended, RFC 3339.
    pub end: String,
    /// The lane.
    pub lane: String,
    /// `--who`.
    #[serde(default)]
    pub who: String,
    /// Whose turn it took.
    #[serde(default)]
    pub owner: String,
    /// The command, one line.
    pub cmd: String,
    /// The run's exit code.
    pub exit: i32,
    /// Why the guard stopped it, when it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stopped: Option<String>,
    /// Seconds from joining to the start.
    pub waited_s: f64,
    /// Seconds the command ran.
    pub run_s: f64,
    /// The most resident memory its processes held together at a sample.
    #[serde(default)]
    pub peak_rss: Option<u64>,
    /// System swap used at the start.
    #[serde(default)]
    pub swap_start: Option<u64>,
    /// The most system swap used at a sample.
    #[serde(default)]
    pub swap_peak: Option<u64>,
    /// System swap used at the end.
    #[serde(default)]
    pub swap_end: Option<u64>,
    /// The least memory available at a sample.
    #[serde(default)]
    pub min_available: Option<u64>,
    /// The run's trace.
    #[serde(default)]
    pub trace: Option<String>,
}
