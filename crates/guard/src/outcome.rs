//! How a guarded run ends, and the guard's exit code for each ending.

use crate::decide::Stop;

/// Exit codes of `stageload guard`, besides the command's own and 128 + N for a signal N.
pub mod exit {
    /// The guard stopped the command (swap, low memory, `--max-memory`, or the device limit of
    /// `--plan`).
    pub const STOPPED: i32 = 3;
    /// No room within `--start-timeout`, or `--check` says it would not start now.
    pub const NO_ROOM: i32 = 4;
    /// Bad usage: unknown or invalid flag, no command.
    pub const USAGE: i32 = 2;
    /// The command was found but cannot be executed.
    pub const NOT_EXECUTABLE: i32 = 126;
    /// The command was not found.
    pub const NOT_FOUND: i32 = 127;
    /// The command ended in a way the guard could not read (an unexpected wait status).
    pub const UNEXPLAINED: i32 = 125;
}

/// How a guarded run ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// The command exited with this code.
    Exited(i32),
    /// A signal ended the command.
    Signaled(i32),
    /// The guard stopped the command.
    Stopped(Stop),
    /// The guard got this signal (and stopped the command first, if it had started).
    GuardSignal(i32),
    /// No room within the start timeout.
    NoRoom,
    /// The command could not be started; the exit code says why (126 or 127).
    CannotStart(i32),
    /// The command ended in a way the guard could not read (the wait status, in words).
    Unexplained(String),
}

impl Outcome {
    /// The guard's exit code for this outcome.
    pub fn exit_code(&self) -> i32 {
        match self {
            Outcome::Exited(code) | Outcome::CannotStart(code) => *code,
            Outcome::Signaled(signal) | Outcome::GuardSignal(signal) => 128 + signal,
            Outcome::Stopped(_) => exit::STOPPED,
            Outcome::NoRoom => exit::NO_ROOM,
            Outcome::Unexplained(_) => exit::UNEXPLAINED,
        }
    }
}
