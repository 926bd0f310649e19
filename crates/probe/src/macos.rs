//! macOS readings: `sysctl` (`hw.memsize`, `vm.swapusage`, `kern.memorystatus_level`),
//! `proc_pid_rusage` for a process's footprint, and `ps` for the process table.

use std::ffi::CStr;
use std::mem::MaybeUninit;

use crate::{Pressure, ProbeError, ProcessEntry, ProcessMemory, SystemMemory};

fn read_error(source_name: &str, message: impl std::fmt::Display) -> ProbeError {
    ProbeError::Read { source_name: source_name.into(), message: message.to_string() }
}

/// Reads a fixed-size sysctl value by name.
fn sysctl<T: Copy>(name: &CStr) -> Result<T, ProbeError> {
    let mut value = MaybeUninit::<T>::uninit();
    let mut size = std::mem::size_of::<T>();
    // SAFETY: `name` is NUL-terminated; `value` has room for `size` bytes and the kernel writes at
    // most `size` bytes; no new value is set (null pointer, length 0).
    let rc =
        unsafe { libc::sysctlbyname(name.as_ptr(), value.as_mut_ptr().cast(), &mut size, std::ptr::null_mut(), 0) };
    if rc != 0 || size != std::mem::size_of::<T>() {
        return Err(read_error(&name.to_string_lossy(), std::io::Error::last_os_error()));
    }
    // SAFETY: the call succeeded and filled exactly size_of::<T>() bytes.
    Ok(unsafe { value.assume_init() })
}

pub fn system_memory() -> Result<SystemMemory, ProbeError> {
    let total: u64 = sysctl(c"hw.memsize")?;
    let level: u32 = sysctl(c"kern.memorystatus_level")?;
    let swap: libc::xsw_usage = sysctl(c"vm.swapusage")?;
    Ok(SystemMemory {
        total,
        available: total / 100 * u64::from(level.min(100)),
        swap_total: swap.xsu_total,
        swap_used: swap.xsu_used,
        cgroup: None,
    })
}

pub fn pressure() -> Result<Option<Pressure>, ProbeError> {
    Ok(None)
}

pub fn process_memory(pid: i32) -> Result<ProcessMemory, ProbeError> {
    let mut info = MaybeUninit::<libc::rusage_info_v4>::uninit();
    // SAFETY: `info` is a rusage_info_v4, the layout RUSAGE_INFO_V4 asks the kernel to fill.
    let rc = unsafe { libc::proc_pid_rusage(pid, libc::RUSAGE_INFO_V4, info.as_mut_ptr().cast()) };
    if rc != 0 {
        return Err(read_error(&format!("proc_pid_rusage({pid})"), std::io::Error::last_os_error()));
    }
    // SAFETY: the call succeeded and filled the structure.
    let info = unsafe { info.assume_init() };
    Ok(ProcessMemory {
        rss: info.ri_resident_size,
        rss_anon: None,
        swap: None,
        peak: Some(info.ri_lifetime_max_phys_footprint),
        footprint: Some(info.ri_phys_footprint),
    })
}

pub fn reset_peak() -> Result<(), ProbeError> {
    Err(ProbeError::Unsupported("resetting the peak footprint"))
}

/// One `ps` either way: command lines cost nothing extra here.
pub fn processes(_with_commands: bool) -> Result<Vec<ProcessEntry>, ProbeError> {
    let output = std::process::Command::new("ps")
        .args(["-axo", "pid=,ppid=,pgid=,stat=,command="])
        .output()
        .map_err(|e| read_error("ps", e))?;
    let text = String::from_utf8_lossy(&output.stdout);
    Ok(text
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let pid = fields.next()?.parse().ok()?;
            let ppid = fields.next()?.parse().ok()?;
            let pgid = fields.next()?.parse().ok()?;
            let zombie = fields.next()?.starts_with('Z');
            let cmdline = fields.collect::<Vec<_>>().join(" ");
            Some(ProcessEntry { pid, ppid, pgid, zombie, cmdline })
        })
        .collect())
}
