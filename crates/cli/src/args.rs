//! Value parsers the commands share: sizes and durations as `stageload_units` reads them,
//! with its messages (which give examples), for clap to show next to the flag's name.

use std::time::Duration;

use stageload_units::{parse_duration, parse_size};

pub fn size(text: &str) -> Result<u64, String> {
    parse_size(text).map_err(|e| e.to_string())
}

pub fn duration(text: &str) -> Result<Duration, String> {
    parse_duration(text).map_err(|e| e.to_string())
}
