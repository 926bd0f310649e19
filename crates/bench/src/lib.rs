//! What the measuring binaries share: the median they report and the process's memory readings.

/// The median of `values` (the project's one median, `stageload_trace::aggregate::median`; NaN for
/// none).
pub fn median(values: Vec<f64>) -> f64 {
    stageload_trace::aggregate::median(&values).unwrap_or(f64::NAN)
}

/// This process's resident set and its high-water mark (VmHWM), in bytes.
pub fn rss_and_peak() -> Result<(u64, u64), Box<dyn std::error::Error + Send + Sync>> {
    let m = stageload_probe::process_memory(std::process::id() as i32)?;
    Ok((m.rss, m.peak.ok_or("this system reports no peak resident set (VmHWM)")?))
}
