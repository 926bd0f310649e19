//! stageload-guard: start one heavy command only when there is memory for it, in its own process
//! group, and stop that group (and nothing else) before it takes the machine down. Torch-free.
//!
//! - [`config`]: what the guard waits for and watches, its defaults and ranges, the rules
//!   between flags.
//! - [`decide`]: the rules, pure functions of readings and time.
//! - [`admit`]: admission, polling until the rules say start (or the timeout, exit 4).
//! - [`supervise`]: spawning and watching the command's process group and the descendants that
//!   left it; [`stop`]: stopping them (SIGTERM, grace, SIGKILL) over a [`stop::Group`] that tests
//!   script.
//! - [`machine`]: where readings and time come from.
//! - [`outcome`]: how a run ends, and the exit codes.
//! - [`log`]: every decision as a stderr line and, with `--log`, a JSON line with its readings.
//! - [`signals`]: SIGINT/SIGTERM/SIGHUP to the guard, recorded and acted on between polls.
//! - [`queue`]: the queue's rules (`stageload run`): lane names, who goes next, stale entries,
//!   and the wait for a lane's turn.
//!
//! One guarded command per process at a time: the guard makes its process a child subreaper and
//! counts every process below it as the command's.

#![warn(missing_docs)]

pub mod admit;
pub mod config;
pub mod decide;
pub mod log;
pub mod machine;
pub mod outcome;
pub mod queue;
pub mod signals;
pub mod stop;
pub mod supervise;

pub use admit::{check_once, wait_for_room, Admitted};
pub use config::{ConfigError, GuardConfig, OutOfRange};
pub use decide::{Admission, LimitFrom, Notice, Stop, Wait, Watch};
pub use log::GuardLog;
pub use machine::{Clock, FakeClock, Readings, SystemClock, SystemReadings};
pub use outcome::{exit, Outcome};
pub use signals::Signals;
pub use supervise::{run_admitted, run_guarded, run_guarded_with_env, signalled_before_start};
