//! macOS readings. `sysinfo` gives what it covers: physical memory, swap, each process's resident
//! size, parent and state, and the process table with command lines. By hand, only what it
//! lacks: `kern.memorystatus_level` (the percentage of memory the kernel counts as available,
//! the figure the original tool used), a process's footprint and lifetime peak
//! (`proc_pid_rusage`), and process groups (`getpgid`).

use std::ffi::CStr;
use std::mem::MaybeUninit;

use sysinfo::{MemoryRefreshKind, Pid, ProcessRefreshKind, ProcessStatus, ProcessesToUpdate, System, UpdateKind};

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
    let mut system = System::new().map_err(|e| read_error("sysinfo", e))?;
    system.refresh_memory_specifics(MemoryRefreshKind::nothing().with_ram().with_swap());
    let total = system.total_memory();
    if total == 0 {
        return Err(read_error("sysinfo", "physical memory reads as 0"));
    }
    let level: u32 = sysctl(c"kern.memorystatus_level")?;
    Ok(SystemMemory {
        total,
        available: total / 100 * u64::from(level.min(100)),
        swap_total: system.total_swap(),
        swap_used: system.used_swap(),
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
    let mut system = System::new().map_err(|e| read_error("sysinfo", e))?;
    let target = Pid::from_u32(u32::try_from(pid).map_err(|_| read_error("sysinfo", format!("pid {pid}")))?);
    system.refresh_processes_specifics(
        ProcessesToUpdate::Some(&[target]),
        true,
        ProcessRefreshKind::nothing().with_memory(),
    );
    let rss = system.process(target).map_or(info.ri_resident_size, |p| p.memory());
    Ok(ProcessMemory {
        rss,
        rss_anon: None,
        rss_file: None,
        swap: None,
        peak: Some(info.ri_lifetime_max_phys_footprint),
        footprint: Some(info.ri_phys_footprint),
        locked: None,
        pinned: None,
    })
}

pub fn reset_peak() -> Result<(), ProbeError> {
    Err(ProbeError::Unsupported("resetting the peak footprint"))
}

pub fn processes(with_commands: bool) -> Result<Vec<ProcessEntry>, ProbeError> {
    let mut system = System::new().map_err(|e| read_error("sysinfo", e))?;
    let commands = if with_commands { UpdateKind::OnlyIfNotSet } else { UpdateKind::Never };
    system.refresh_processes_specifics(ProcessesToUpdate::All, true, ProcessRefreshKind::nothing().with_cmd(commands));
    let as_i32 = |pid: Pid| i32::try_from(pid.as_u32()).ok();
    Ok(system
        .processes()
        .iter()
        .filter_map(|(pid, process)| {
            let pid = as_i32(*pid)?;
            // SAFETY: getpgid only reads the kernel's process table; an exited pid gives -1.
            let pgid = unsafe { libc::getpgid(pid) };
            let cmdline = process.cmd().iter().map(|arg| arg.to_string_lossy()).collect::<Vec<_>>().join(" ");
            Some(ProcessEntry {
                pid,
                ppid: process.parent().and_then(as_i32).unwrap_or(0),
                pgid,
                zombie: process.status() == ProcessStatus::Zombie,
                cmdline,
            })
        })
        .collect())
}

pub fn rss_counter_slack() -> u64 {
    // The task's resident size and footprint are read from its own totals.
    0
}
