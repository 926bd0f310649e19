//! The queue's rules (`stageload run`), as pure functions of the entries of a lane and time, and
//! the wait for a lane's turn over a [`LaneFiles`] that tests script.
//!
//! A lane is a folder under the queue's home; each `run` writes one entry there, named by when it
//! joined and its pid ([`Ticket`]). A command starts when no older entry of its lane is alive and
//! it holds the lane's lock; who goes next among the waiting entries is [`fair_order`]: the owner
//! who started least recently, each owner's entries in the order they joined. The lock is what
//! makes two runs exclusive; the order is what each run reads from the same files, so two runs
//! that read them a moment apart may both think they are next, and the lock then lets one go.

use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use crate::admit::sleep_until;
use crate::log::GuardLog;
use crate::machine::Clock;
use crate::signals::Signals;
use stageload_units::format_bytes;

/// The lane a `run` takes when it names none: the machine's memory.
pub const DEFAULT_LANE: &str = "ram";

/// The longest lane name.
pub const LANE_MAX: usize = 64;

/// A lane's name: one folder name under the queue's home (letters, digits, `.`, `_`, `-`; not
/// `.` or `..`), so no name reaches outside it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Lane(String);

/// A lane name refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LaneError {
    /// No name.
    #[error("the lane name is empty: give one such as '{DEFAULT_LANE}'")]
    Empty,
    /// Longer than [`LANE_MAX`].
    #[error("the lane name is {0} characters long: at most {LANE_MAX}")]
    TooLong(usize),
    /// Not one plain folder name.
    #[error("lane {0:?} is not a plain folder name: use letters, digits, '.', '_' and '-' (no '/', not '.' or '..')")]
    NotAName(String),
}

impl Lane {
    /// Reads a lane name (see the type's docs).
    pub fn parse(text: &str) -> Result<Lane, LaneError> {
        if text.is_empty() {
            return Err(LaneError::Empty);
        }
        let length = text.chars().count();
        if length > LANE_MAX {
            return Err(LaneError::TooLong(length));
        }
        let plain = text.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
        if !plain || text == "." || text == ".." {
            return Err(LaneError::NotAName(text.chars().take(LANE_MAX).collect()));
        }
        Ok(Lane(text.to_string()))
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for Lane {
    type Err = LaneError;
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Lane::parse(text)
    }
}

impl fmt::Display for Lane {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Whose turn a run takes: `owner` when given and not empty, else `who` up to its first dash,
/// else `job`.
pub fn owner_of(who: &str, owner: Option<&str>) -> String {
    let from_who = who.split('-').next().unwrap_or("");
    [owner.unwrap_or(""), from_who].into_iter().find(|o| !o.is_empty()).unwrap_or("job").to_string()
}

/// An entry's name: when it joined (nanoseconds since the Unix epoch) and the pid of the run
/// that wrote it. Entries sort by when they joined, then by pid.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ticket {
    /// When the entry joined, nanoseconds since the Unix epoch.
    pub joined_ns: u64,
    /// The run's pid.
    pub pid: i32,
}

impl Ticket {
    /// The entry's file name: `{joined_ns:020}-{pid}.json`.
    pub fn file_name(&self) -> String {
        format!("{:020}-{}.json", self.joined_ns, self.pid)
    }

    /// The ticket a file name stands for; `None` for any other file (the lock, temporary files).
    pub fn parse(name: &str) -> Option<Ticket> {
        let stem = name.strip_suffix(".json")?;
        let (joined, pid) = stem.split_once('-')?;
        let digits = |text: &str| !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit());
        if joined.len() != 20 || !digits(joined) || !digits(pid) {
            return None;
        }
        let pid: i32 = pid.parse().ok().filter(|pid| *pid > 0)?;
        Some(Ticket { joined_ns: joined.parse().ok()?, pid })
    }
}

/// Where an entry is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryState {
    /// Waiting for its turn, or for room.
    Waiting,
    /// Its command runs; it started at this time (nanoseconds since the Unix epoch).
    Running {
        /// When the command started.
        started_ns: u64,
    },
}

/// A live entry of a lane, as the rules see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Its name.
    pub ticket: Ticket,
    /// Who queued it (`--who`), for messages.
    pub who: String,
    /// Whose turn it takes ([`owner_of`]).
    pub owner: String,
    /// Waiting or running.
    pub state: EntryState,
    /// What it declared it will hold at most (its plan's memory limit, or `--memory`), bytes;
    /// `None`: nothing declared, so it runs alone in its lane.
    pub request: Option<u64>,
}

impl Entry {
    /// How messages name the entry: its `who`, else its pid.
    pub fn name(&self) -> String {
        if self.who.is_empty() {
            format!("pid {}", self.ticket.pid)
        } else {
            self.who.clone()
        }
    }
}

/// When each owner last started a command in a lane, nanoseconds since the Unix epoch.
pub type LastStarts = BTreeMap<String, u64>;

/// The order the waiting entries of a lane will start in: the owner who started least recently
/// goes next (a running entry counts as its owner's latest start), ties to the owner whose next
/// entry joined first; each owner's entries keep the order they joined in. One owner's batch
/// so takes turns with the others instead of holding the lane until it is done.
pub fn fair_order(entries: &[Entry], last_starts: &LastStarts) -> Vec<Ticket> {
    let mut clock = last_starts.clone();
    let mut sorted: Vec<&Entry> = entries.iter().collect();
    sorted.sort_by_key(|entry| entry.ticket);
    let mut queues: BTreeMap<&str, VecDeque<Ticket>> = BTreeMap::new();
    for entry in sorted {
        match entry.state {
            EntryState::Running { started_ns } => {
                let last = clock.entry(entry.owner.clone()).or_insert(0);
                *last = (*last).max(started_ns);
            }
            EntryState::Waiting => queues.entry(&entry.owner).or_default().push_back(entry.ticket),
        }
    }
    let mut tick = clock.values().copied().max().unwrap_or(0);
    let mut order = Vec::new();
    loop {
        let next = queues
            .iter()
            .filter_map(|(owner, queue)| {
                queue.front().map(|first| (clock.get(*owner).copied().unwrap_or(0), *first, *owner))
            })
            .min();
        let Some((_, ticket, owner)) = next else {
            return order;
        };
        order.push(ticket);
        if let Some(queue) = queues.get_mut(owner) {
            queue.pop_front();
            if queue.is_empty() {
                queues.remove(owner);
            }
        }
        tick = tick.saturating_add(1);
        clock.insert(owner.to_string(), tick);
    }
}

/// The running entries, then the waiting ones in [`fair_order`]: what `stageload queue` lists.
pub fn listing(entries: &[Entry], last_starts: &LastStarts) -> Vec<Entry> {
    let mut running: Vec<Entry> =
        entries.iter().filter(|e| matches!(e.state, EntryState::Running { .. })).cloned().collect();
    running.sort_by_key(|e| e.ticket);
    let waiting = fair_order(entries, last_starts)
        .into_iter()
        .filter_map(|ticket| entries.iter().find(|e| e.ticket == ticket).cloned());
    running.into_iter().chain(waiting).collect()
}

/// Whether `me` may take the lane's lock now: no running entry and no waiting entry before it in
/// [`fair_order`]. Else the entries ahead of it, running ones first. An entry missing from
/// `entries` (its file was removed under it) waits only for the running ones.
pub fn entries_ahead(entries: &[Entry], last_starts: &LastStarts, me: Ticket) -> Vec<Entry> {
    let order = fair_order(entries, last_starts);
    let mine = order.iter().position(|ticket| *ticket == me).unwrap_or(0);
    listing(entries, last_starts)
        .into_iter()
        .filter(|e| matches!(e.state, EntryState::Running { .. }) || order[..mine].contains(&e.ticket))
        .filter(|e| e.ticket != me)
        .collect()
}

/// How a run that may start takes the lane's lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hold {
    /// Alone: a run that declared nothing.
    Exclusive,
    /// Beside other runs that declared what they hold.
    Shared,
}

/// What a run asks of its lane: its entry, what it declared it will hold, the margin it wants
/// kept free beside the sum of the plans.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Asking {
    /// Its entry.
    pub ticket: Ticket,
    /// What it declared (`None`: it runs alone).
    pub request: Option<u64>,
    /// The margin, bytes.
    pub margin: u64,
    /// The memory the machine has (its total, or the cgroup's limit), bytes; `None` when it
    /// could not be read, and then nothing starts beside another run.
    pub total: Option<u64>,
}

/// Whether the run `asking` may take its lane now, and how; else why it waits. No entry that
/// joined before it in [`fair_order`] may be waiting (packing never skips the order). With
/// nothing running it goes alone or shared as it declared; beside running entries only when it
/// and every one of them declared what they hold, and the sum of those plus its own plus the
/// margin fits the machine's memory.
pub fn decide_turn(entries: &[Entry], last_starts: &LastStarts, asking: &Asking) -> Result<Hold, TurnWait> {
    let ahead = entries_ahead(entries, last_starts, asking.ticket);
    let waiting_ahead = ahead.iter().filter(|e| e.state == EntryState::Waiting).count();
    let running: Vec<&Entry> = ahead.iter().filter(|e| e.state != EntryState::Waiting).collect();
    let hold = if asking.request.is_some() { Hold::Shared } else { Hold::Exclusive };
    if waiting_ahead > 0 || running.is_empty() {
        return if ahead.is_empty() { Ok(hold) } else { Err(TurnWait::ahead(&ahead)) };
    }
    let planned: Option<Vec<u64>> = running.iter().map(|e| e.request).collect();
    let (Some(request), Some(planned), Some(total)) = (asking.request, planned, asking.total) else {
        return Err(TurnWait::ahead(&ahead));
    };
    let running_sum = planned.iter().fold(0u64, |sum, r| sum.saturating_add(*r));
    let needed = running_sum.saturating_add(request).saturating_add(asking.margin);
    if needed <= total {
        Ok(Hold::Shared)
    } else {
        Err(TurnWait::Memory { running: planned.len(), running_sum, request, margin: asking.margin, total })
    }
}

/// What a look at an entry's pid found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seen {
    /// No such process, or only its zombie.
    Gone,
    /// A live process with this pid, started at this time (clock ticks after boot, Linux's
    /// `/proc/PID/stat` field 22), when that could be read.
    Alive {
        /// Its start time.
        start_time: Option<u64>,
    },
}

/// Whether an entry is stale, to be cleared: its process is gone, or its pid now belongs to a
/// process that started at another time than the one recorded (a reused pid). Without a start
/// time on either side a live pid counts as the entry's.
pub fn is_stale(recorded_start: Option<u64>, seen: Seen) -> bool {
    match (seen, recorded_start) {
        (Seen::Gone, _) => true,
        (Seen::Alive { start_time: Some(now) }, Some(recorded)) => now != recorded,
        (Seen::Alive { .. }, _) => false,
    }
}

/// The lane as the wait for a turn sees it: its live entries and the lock. Each look is
/// [`hold_joins`](LaneFiles::hold_joins), [`entries`](LaneFiles::entries), maybe
/// [`try_lock`](LaneFiles::try_lock), then [`release_joins`](LaneFiles::release_joins), never
/// held across a sleep: a run that joins takes its time and writes its entry under the same
/// hold, so no run takes the lock on a look that misses an older entry being written.
pub trait LaneFiles {
    /// Holds off runs joining the lane for one look (best effort: a hold not had in a moment is
    /// gone without; the lock alone keeps runs exclusive).
    fn hold_joins(&mut self) {}
    /// Lets runs join again.
    fn release_joins(&mut self) {}
    /// The lane's live entries now (stale ones cleared on the way; unreadable ones left out) and
    /// when each owner last started; Err: why the lane could not be read.
    fn entries(&mut self) -> Result<(Vec<Entry>, LastStarts), String>;
    /// Takes the lane's lock without waiting, alone or shared: `Ok(true)` when it is this run's
    /// now, `Ok(false)` when something holds it.
    fn try_lock(&mut self, hold: Hold) -> Result<bool, String>;
    /// This run waits, for this reason now (called when the reason changes).
    fn waiting(&mut self, _why: &TurnWait) {}
}

/// Why a run waits for its turn.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TurnWait {
    /// Entries ahead of it: how many, and the names of the first three.
    Ahead {
        /// How many.
        count: usize,
        /// The first three, as [`Entry::name`] gives them.
        names: Vec<String>,
    },
    /// Its plan would fit beside the running ones' only with more memory than the machine has.
    Memory {
        /// How many run.
        running: usize,
        /// The sum of their plans, bytes.
        running_sum: u64,
        /// Its own plan, bytes.
        request: u64,
        /// The margin asked for, bytes.
        margin: u64,
        /// The machine's memory, bytes.
        total: u64,
    },
    /// No entry ahead, but the lock is held: a command whose run is gone still holds it (its
    /// queuer was killed) until every process of that command has ended.
    LockHeld,
    /// The lane could not be read.
    Unreadable(String),
}

impl TurnWait {
    fn ahead(ahead: &[Entry]) -> TurnWait {
        TurnWait::Ahead { count: ahead.len(), names: ahead.iter().take(3).map(Entry::name).collect() }
    }
}

impl fmt::Display for TurnWait {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TurnWait::Ahead { count, names } => write!(f, "{count} ahead: {}", names.join(", ")),
            TurnWait::Memory { running, running_sum, request, margin, total } => write!(
                f,
                "memory: {running} running plan {} + this plan {} + margin {} > {}",
                format_bytes(*running_sum),
                format_bytes(*request),
                format_bytes(*margin),
                format_bytes(*total)
            ),
            TurnWait::LockHeld => f.write_str("the lane is still held by a command whose run is gone"),
            TurnWait::Unreadable(error) => write!(f, "the lane cannot be read: {error}"),
        }
    }
}

/// How the wait for a turn ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Turn {
    /// The lane's lock is this run's; the time it took.
    Taken(Duration),
    /// The timeout passed; why it was still waiting.
    NoTurn(TurnWait),
    /// The run got this signal while waiting.
    Signal(i32),
}

/// One look at the lane: `Ok` when the run may go and took the lock, else why it waits.
fn look_once(lane: &mut dyn LaneFiles, asking: &Asking) -> Result<(), TurnWait> {
    let (entries, last_starts) = lane.entries().map_err(TurnWait::Unreadable)?;
    let hold = decide_turn(&entries, &last_starts, asking)?;
    match lane.try_lock(hold) {
        Ok(true) => Ok(()),
        Ok(false) => Err(TurnWait::LockHeld),
        Err(error) => Err(TurnWait::Unreadable(error)),
    }
}

/// Waits until `asking` may go in `lane` ([`decide_turn`]) and holds its lock, polling every `poll`, at most
/// `timeout`, ending early on a signal. Logs why it waits whenever that changes.
#[allow(clippy::too_many_arguments)]
pub fn wait_turn(
    lane: &mut dyn LaneFiles,
    name: &Lane,
    asking: &Asking,
    poll: Duration,
    timeout: Duration,
    clock: &mut dyn Clock,
    log: &mut GuardLog,
    signals: &Signals,
) -> Turn {
    let began = clock.now();
    let deadline = began.saturating_add(timeout);
    let mut last: Option<TurnWait> = None;
    loop {
        if let Some(signal) = signals.received() {
            return Turn::Signal(signal);
        }
        lane.hold_joins();
        let look = look_once(lane, asking);
        lane.release_joins();
        let wait = match look {
            Ok(()) => return Turn::Taken(clock.now().saturating_sub(began)),
            Err(wait) => wait,
        };
        if last.as_ref() != Some(&wait) {
            lane.waiting(&wait);
            log.note("queue_waiting", &format!("waiting in lane {name} ({wait})"), None);
            last = Some(wait.clone());
        }
        let now = clock.now();
        if now >= deadline {
            let message =
                format!("no turn in lane {name} after {:.0} s ({wait})", now.saturating_sub(began).as_secs_f64());
            log.note("no_turn", &message, None);
            return Turn::NoTurn(wait);
        }
        sleep_until(clock, now.saturating_add(poll).min(deadline), || signals.received().is_some());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::machine::FakeClock;

    fn ticket(joined_ns: u64, pid: i32) -> Ticket {
        Ticket { joined_ns, pid }
    }

    fn waiting(joined_ns: u64, owner: &str) -> Entry {
        Entry {
            ticket: ticket(joined_ns, 100 + joined_ns as i32),
            who: format!("{owner}-{joined_ns}"),
            owner: owner.into(),
            state: EntryState::Waiting,
            request: None,
        }
    }

    fn declared(entry: Entry, request: u64) -> Entry {
        Entry { request: Some(request), ..entry }
    }

    fn asking(entry: &Entry, margin: u64, total: u64) -> Asking {
        Asking { ticket: entry.ticket, request: entry.request, margin, total: Some(total) }
    }

    fn running(joined_ns: u64, owner: &str, started_ns: u64) -> Entry {
        Entry { state: EntryState::Running { started_ns }, ..waiting(joined_ns, owner) }
    }

    fn owners(order: &[Ticket], entries: &[Entry]) -> Vec<String> {
        order.iter().map(|t| entries.iter().find(|e| e.ticket == *t).unwrap().owner.clone()).collect()
    }

    #[test]
    fn lane_names_are_one_plain_folder_name() {
        for good in ["ram", "gpu-0", "codex.v2", "a_b", &"x".repeat(LANE_MAX)] {
            assert_eq!(Lane::parse(good).map(|l| l.to_string()), Ok(good.to_string()));
        }
        assert_eq!(Lane::parse(""), Err(LaneError::Empty));
        assert_eq!(Lane::parse(&"x".repeat(LANE_MAX + 1)), Err(LaneError::TooLong(LANE_MAX + 1)));
        for bad in ["..", ".", "a/b", "../etc", "/abs", "a b", "lane\0", "é"] {
            let error = Lane::parse(bad).unwrap_err();
            assert!(matches!(error, LaneError::NotAName(_)), "{bad:?}: {error}");
        }
        assert!(Lane::parse("a/b").unwrap_err().to_string().starts_with("lane \"a/b\" is not a plain folder name"));
        assert!(!Lane::parse("a\nb").unwrap_err().to_string().contains('\n'), "one line, whatever the name holds");
    }

    #[test]
    fn the_owner_is_the_flag_else_who_up_to_its_first_dash_else_job() {
        assert_eq!(owner_of("alice-batch-3", Some("team")), "team");
        assert_eq!(owner_of("alice-batch-3", None), "alice");
        assert_eq!(owner_of("alice-batch-3", Some("")), "alice");
        assert_eq!(owner_of("bob", None), "bob");
        assert_eq!(owner_of("", None), "job");
        assert_eq!(owner_of("-x", None), "job");
    }

    #[test]
    fn tickets_are_read_back_from_their_own_file_names_and_nothing_else() {
        let t = ticket(1_765_000_000_123_456_789, 4242);
        assert_eq!(t.file_name(), "01765000000123456789-4242.json");
        assert_eq!(Ticket::parse(&t.file_name()), Some(t));
        for other in [
            "run.lock",
            "owners.json",
            ".tmp-01765000000123456789-4242.json",
            "1-2.json",
            "01765000000123456789-.json",
            "01765000000123456789-0.json",
            "01765000000123456789-99999999999.json",
            "0176500000012345678x-1.json",
        ] {
            assert_eq!(Ticket::parse(other), None, "{other}");
        }
    }

    #[test]
    fn one_owner_alone_keeps_its_join_order() {
        let entries = [waiting(3, "a"), waiting(1, "a"), waiting(2, "a")];
        let order = fair_order(&entries, &LastStarts::new());
        assert_eq!(order, [entries[1].ticket, entries[2].ticket, entries[0].ticket]);
    }

    #[test]
    fn owners_take_turns_and_the_one_who_started_least_recently_goes_first() {
        // a queued a batch of three first; b queued two after; b never started, a did.
        let entries = [waiting(1, "a"), waiting(2, "a"), waiting(3, "a"), waiting(4, "b"), waiting(5, "b")];
        let last = LastStarts::from([("a".to_string(), 10)]);
        assert_eq!(owners(&fair_order(&entries, &last), &entries), ["b", "a", "b", "a", "a"]);
        // Neither started before: the owner whose next entry joined first goes first.
        assert_eq!(owners(&fair_order(&entries, &LastStarts::new()), &entries), ["a", "b", "a", "b", "a"]);
    }

    #[test]
    fn a_running_entry_counts_as_its_owners_latest_start() {
        let entries = [running(1, "a", 50), waiting(2, "a"), waiting(3, "b")];
        let last = LastStarts::from([("a".to_string(), 10), ("b".to_string(), 20)]);
        assert_eq!(owners(&fair_order(&entries, &last), &entries), ["b", "a"]);
        let listed: Vec<Ticket> = listing(&entries, &last).iter().map(|e| e.ticket).collect();
        assert_eq!(listed, [entries[0].ticket, entries[2].ticket, entries[1].ticket], "running first");
    }

    #[test]
    fn a_run_goes_only_when_nothing_runs_and_nobody_is_before_it() {
        let entries = [waiting(1, "a"), waiting(2, "b")];
        let none = LastStarts::new();
        assert!(entries_ahead(&entries, &none, entries[0].ticket).is_empty());
        let ahead = entries_ahead(&entries, &none, entries[1].ticket);
        assert_eq!(ahead.iter().map(Entry::name).collect::<Vec<_>>(), ["a-1"]);
        let with_running = [running(0, "c", 5), waiting(1, "a")];
        assert_eq!(entries_ahead(&with_running, &none, with_running[1].ticket).len(), 1);
        // An entry whose file vanished waits for the running ones only.
        assert_eq!(entries_ahead(&with_running, &none, ticket(99, 9)).len(), 1);
        assert!(entries_ahead(&entries[..0], &none, ticket(99, 9)).is_empty());
    }

    #[test]
    fn a_declared_run_starts_beside_declared_runs_when_their_plans_and_the_margin_fit() {
        let gib = 1u64 << 30;
        let one = declared(running(1, "a", 5), 4 * gib);
        let two = declared(running(2, "b", 6), 4 * gib);
        let third = declared(waiting(3, "c"), 4 * gib);
        let none = LastStarts::new();
        assert_eq!(decide_turn(&[one.clone(), third.clone()], &none, &asking(&third, gib, 10 * gib)), Ok(Hold::Shared));
        let full = decide_turn(&[one.clone(), two.clone(), third.clone()], &none, &asking(&third, gib, 10 * gib));
        assert_eq!(
            full.unwrap_err().to_string(),
            "memory: 2 running plan 8.0 GiB + this plan 4.0 GiB + margin 1.0 GiB > 10.0 GiB"
        );
        // The margin counts: 4 + 4 + 3 > 10.
        let tight = decide_turn(&[one.clone(), third.clone()], &none, &asking(&third, 3 * gib, 10 * gib));
        assert!(matches!(tight, Err(TurnWait::Memory { .. })), "{tight:?}");
        // Nothing running: it goes, and shares the lock with whoever declares next.
        assert_eq!(decide_turn(std::slice::from_ref(&third), &none, &asking(&third, 0, gib)), Ok(Hold::Shared));
        // An unknown total never packs.
        let blind = Asking { total: None, ..asking(&third, 0, 10 * gib) };
        assert!(matches!(decide_turn(&[one, third], &none, &blind), Err(TurnWait::Ahead { .. })));
    }

    #[test]
    fn a_run_that_declares_nothing_runs_alone_and_nothing_starts_beside_it() {
        let gib = 1u64 << 30;
        let undeclared = running(1, "a", 5);
        let small = declared(waiting(2, "b"), gib);
        let none = LastStarts::new();
        let beside = decide_turn(&[undeclared.clone(), small.clone()], &none, &asking(&small, 0, 100 * gib));
        assert!(matches!(beside, Err(TurnWait::Ahead { count: 1, .. })), "{beside:?}");
        let alone = waiting(3, "c");
        let planned = declared(running(1, "a", 5), gib);
        let after = decide_turn(&[planned, alone.clone()], &none, &asking(&alone, 0, 100 * gib));
        assert!(matches!(after, Err(TurnWait::Ahead { count: 1, .. })), "{after:?}");
        assert_eq!(
            decide_turn(std::slice::from_ref(&alone), &none, &asking(&alone, 0, 100 * gib)),
            Ok(Hold::Exclusive)
        );
    }

    #[test]
    fn packing_never_skips_the_order() {
        let gib = 1u64 << 30;
        let running_one = declared(running(1, "a", 5), 6 * gib);
        let big = declared(waiting(2, "b"), 6 * gib);
        let small = declared(waiting(3, "c"), gib);
        let entries = [running_one, big, small.clone()];
        let turn = decide_turn(&entries, &LastStarts::new(), &asking(&small, 0, 10 * gib));
        assert_eq!(turn.unwrap_err().to_string(), "2 ahead: a-1, b-2", "the small one waits behind the big one");
    }

    #[test]
    fn an_entry_is_stale_when_its_process_is_gone_or_its_pid_was_reused() {
        assert!(is_stale(Some(7), Seen::Gone));
        assert!(is_stale(None, Seen::Gone));
        assert!(!is_stale(Some(7), Seen::Alive { start_time: Some(7) }));
        assert!(is_stale(Some(7), Seen::Alive { start_time: Some(8) }), "another process has the pid now");
        assert!(!is_stale(None, Seen::Alive { start_time: Some(8) }));
        assert!(!is_stale(Some(7), Seen::Alive { start_time: None }));
    }

    /// A lane whose entries and lock follow a script, one step per look; the clock moves only
    /// when the wait sleeps.
    struct Scripted {
        looks: VecDeque<(Result<Vec<Entry>, String>, bool)>,
        locks_tried: usize,
        lock_free: bool,
        /// Holds taken and not released; the most seen at once.
        holding: usize,
        most_held: usize,
    }

    impl LaneFiles for Scripted {
        fn hold_joins(&mut self) {
            self.holding += 1;
            self.most_held = self.most_held.max(self.holding);
        }
        fn release_joins(&mut self) {
            self.holding -= 1;
        }
        fn entries(&mut self) -> Result<(Vec<Entry>, LastStarts), String> {
            assert_eq!(self.holding, 1, "read under the hold");
            let (entries, lock_free) = self.looks.pop_front().unwrap_or((Ok(Vec::new()), true));
            self.lock_free = lock_free;
            entries.map(|e| (e, LastStarts::new()))
        }
        fn try_lock(&mut self, _: Hold) -> Result<bool, String> {
            assert_eq!(self.holding, 1, "locked under the hold");
            self.locks_tried += 1;
            Ok(self.lock_free)
        }
    }

    fn wait(lane: &mut Scripted, me: Ticket, timeout: Duration, signals: &Signals) -> (Turn, Vec<String>) {
        let mut log = GuardLog::silent();
        let lane_name = Lane::parse("ram").unwrap();
        let poll = Duration::from_millis(100);
        let asking = Asking { ticket: me, request: None, margin: 0, total: None };
        let turn = wait_turn(
            lane,
            &lane_name,
            &asking,
            poll,
            timeout,
            &mut FakeClock(Duration::from_secs(5)),
            &mut log,
            signals,
        );
        (turn, log.lines().to_vec())
    }

    #[test]
    fn the_turn_comes_when_the_entries_ahead_are_gone_and_the_lock_is_free() {
        let me = waiting(2, "b");
        let ahead = waiting(1, "a");
        let mut lane = Scripted {
            looks: VecDeque::from([
                (Ok(vec![ahead.clone(), me.clone()]), true),
                (Ok(vec![ahead.clone(), me.clone()]), true),
                (Ok(vec![me.clone()]), false),
                (Ok(vec![me.clone()]), true),
            ]),
            locks_tried: 0,
            lock_free: false,
            holding: 0,
            most_held: 0,
        };
        let (turn, lines) = wait(&mut lane, me.ticket, Duration::from_secs(60), &Signals::none());
        assert_eq!(turn, Turn::Taken(Duration::from_millis(300)));
        assert_eq!(lane.locks_tried, 2, "the lock is tried only when nobody is ahead");
        assert_eq!((lane.holding, lane.most_held), (0, 1), "joins held for each look, never across a sleep");
        assert_eq!(
            lines,
            [
                "guard: waiting in lane ram (1 ahead: a-1)",
                "guard: waiting in lane ram (the lane is still held by a command whose run is gone)"
            ]
        );
    }

    #[test]
    fn a_lane_that_never_frees_ends_the_wait_at_the_timeout_and_an_unreadable_one_too() {
        let me = waiting(2, "b");
        let held = (Ok(vec![me.clone()]), false);
        let mut lane = Scripted {
            looks: VecDeque::from(vec![held; 100]),
            locks_tried: 0,
            lock_free: false,
            holding: 0,
            most_held: 0,
        };
        let (turn, lines) = wait(&mut lane, me.ticket, Duration::from_secs(1), &Signals::none());
        assert_eq!(turn, Turn::NoTurn(TurnWait::LockHeld));
        assert_eq!(lane.holding, 0);
        assert!(lines.last().unwrap().starts_with("guard: no turn in lane ram after 1 s"), "{lines:?}");
        let unreadable = (Err("permission denied".to_string()), true);
        let mut lane = Scripted {
            looks: VecDeque::from(vec![unreadable; 100]),
            locks_tried: 0,
            lock_free: true,
            holding: 0,
            most_held: 0,
        };
        let (turn, _) = wait(&mut lane, me.ticket, Duration::from_millis(500), &Signals::none());
        assert_eq!(turn, Turn::NoTurn(TurnWait::Unreadable("permission denied".into())));
        assert_eq!(lane.locks_tried, 0);
    }

    #[test]
    fn a_signal_while_waiting_ends_the_wait_at_once() {
        let me = waiting(2, "b");
        let mut lane = Scripted {
            looks: VecDeque::from(vec![(Ok(vec![waiting(1, "a"), me.clone()]), true); 10]),
            locks_tried: 0,
            lock_free: true,
            holding: 0,
            most_held: 0,
        };
        let signals = Signals::none();
        signals.simulate(libc::SIGTERM);
        let (turn, _) = wait(&mut lane, me.ticket, Duration::from_secs(60), &signals);
        assert_eq!(turn, Turn::Signal(libc::SIGTERM));
    }
}
