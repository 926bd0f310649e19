//! Sizes and durations as people type them on a command line (`8G`, `1.5GiB`, `2GB`, `250ms`,
//! `30m`), and bytes as people read them.
//!
//! Written by hand rather than taken from a crate: the grammar is the original tool's (a bare
//! number is bytes or seconds, `K/M/G/T` are binary, `m` means minutes in a duration) plus
//! decimal `KB/MB/GB/TB`, and the crates we looked at (bytesize, humantime) give `G`, `GB` and
//! fractional durations other meanings.

#![warn(missing_docs)]

use std::time::Duration;

use thiserror::Error;

/// One gibibyte (2^30 bytes): the unit every message and table of stageload uses for "GB".
pub const GIB: u64 = 1 << 30;

/// A value that is not a size or not a duration; the message gives examples of what is.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum UnitError {
    /// Not a size; the text given.
    #[error("not a size: '{0}' (examples: 8G, 512M, 1.5GiB, 2GB)")]
    Size(String),
    /// Not a duration; the text given.
    #[error("not a duration: '{0}' (examples: 250ms, 90s, 30m, 2h)")]
    Duration(String),
}

/// Splits "  1.5 GiB " into (1.5, "GiB"); `None` when the number part is missing or signed.
fn split_number(text: &str) -> Option<(f64, &str)> {
    let text = text.trim();
    let end = text.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(text.len());
    let (number, unit) = text.split_at(end);
    if number.is_empty() || number.starts_with('.') && number.len() == 1 {
        return None;
    }
    let value: f64 = number.parse().ok()?;
    Some((value, unit.trim()))
}

/// Parses a size in bytes. `K/M/G/T`, `KiB/MiB/GiB/TiB` (any case) are binary (`8G` is 8 GiB,
/// as in the original tool); `KB/MB/GB/TB` are decimal (`2GB` is 2 000 000 000); `B` or no unit
/// is bytes. Fractions are allowed (`1.5G`); the result is rounded down to whole bytes.
pub fn parse_size(text: &str) -> Result<u64, UnitError> {
    let bad = || UnitError::Size(text.to_string());
    let (value, unit) = split_number(text).ok_or_else(bad)?;
    let unit = unit.to_ascii_lowercase();
    let factor: f64 = match unit.as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024f64.powi(2),
        "g" | "gib" => 1024f64.powi(3),
        "t" | "tib" => 1024f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        _ => return Err(bad()),
    };
    let bytes = value * factor;
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err(bad());
    }
    Ok(bytes as u64)
}

/// Parses a duration: `ms`, `s`, `m` (minutes), `h` (any case); a bare number is seconds.
pub fn parse_duration(text: &str) -> Result<Duration, UnitError> {
    let bad = || UnitError::Duration(text.to_string());
    let (value, unit) = split_number(text).ok_or_else(bad)?;
    let seconds = match unit.to_ascii_lowercase().as_str() {
        "ms" => value / 1000.0,
        "" | "s" => value,
        "m" => value * 60.0,
        "h" => value * 3600.0,
        _ => return Err(bad()),
    };
    Duration::try_from_secs_f64(seconds).map_err(|_| bad())
}

/// Bytes as GiB with one decimal, the way every log line and table prints them: `12.5 GB`.
pub fn format_gb(bytes: u64) -> String {
    format!("{:.1} GB", bytes as f64 / GIB as f64)
}

/// Bytes with the largest binary unit that keeps the number at or above 1: `512.0 MiB`.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_in_binary_and_decimal_units() {
        assert_eq!(parse_size("8G"), Ok(8 * GIB));
        assert_eq!(parse_size("512M"), Ok(512 << 20));
        assert_eq!(parse_size("1.5g"), Ok(GIB + GIB / 2));
        assert_eq!(parse_size("100"), Ok(100));
        assert_eq!(parse_size("2GiB"), Ok(2 * GIB));
        assert_eq!(parse_size(" 2 GB "), Ok(2_000_000_000));
        assert_eq!(parse_size("64kb"), Ok(64_000));
        assert_eq!(parse_size("3B"), Ok(3));
    }

    #[test]
    fn bad_sizes_are_refused_with_examples() {
        for bad in ["", "G8", "8X", "-1G", "lots", ".", "8 G B", "1e3"] {
            let err = parse_size(bad).unwrap_err();
            assert!(err.to_string().contains("not a size") && err.to_string().contains("8G"), "{bad}: {err}");
        }
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("30m"), Ok(Duration::from_secs(1800)));
        assert_eq!(parse_duration("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("2h"), Ok(Duration::from_secs(7200)));
        assert_eq!(parse_duration("5"), Ok(Duration::from_secs(5)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        for bad in ["", "-1s", "5d", "ms", "soon"] {
            assert!(parse_duration(bad).unwrap_err().to_string().contains("not a duration"), "{bad}");
        }
    }

    #[test]
    fn formatting() {
        assert_eq!(format_gb(12 * GIB + GIB / 2), "12.5 GB");
        assert_eq!(format_bytes(512 << 20), "512.0 MiB");
        assert_eq!(format_bytes(17), "17 B");
    }
}
