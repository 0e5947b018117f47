//! The host's memory, which the CPU lanes admit by as cards admit by theirs: read through
//! `sysinfo` (the machine's figures, and its cgroup's limit when one is set, as under
//! Kubernetes or systemd), or declared by `--simulated-host-memory` for tests and demos.

use std::sync::{Arc, Mutex};

use gpulane_models::DeviceMemory;
use sysinfo::{Pid, ProcessRefreshKind, ProcessesToUpdate, System};

use super::DeviceError;

/// The host memory the CPU lanes' budget reads.
pub(crate) trait HostMemory: Send + Sync {
    /// `sysinfo`, `cgroup` or `simulated`, for logs.
    fn source(&self) -> &'static str;
    /// What this process may use in all: the machine's memory, or its cgroup's limit when
    /// that is lower. Fixed for the life of the process.
    fn total(&self) -> u64;
    /// Bytes this process could still take now without the kernel swapping or reaching
    /// the cgroup's limit.
    fn available(&self) -> Result<u64, DeviceError>;
    /// This process's resident memory now, when it can be read.
    fn own_usage(&self) -> Option<u64>;
    /// What engines and tokenizations tell of the memory they take: a simulated host's
    /// accounting. `None` on a real host, where the kernel is the truth.
    fn engine_memory(&self) -> Option<Arc<dyn DeviceMemory>> {
        None
    }
}

/// The real host, through `sysinfo`.
pub(crate) struct SysinfoHost {
    sys: Mutex<System>,
    pid: Option<Pid>,
    total: u64,
    limited: bool,
}

impl SysinfoHost {
    /// Reads the machine's memory and its cgroup's limit once.
    pub(crate) fn new() -> Result<Self, DeviceError> {
        let mut sys = System::new();
        sys.refresh_memory();
        let machine = sys.total_memory();
        if machine == 0 {
            return Err(DeviceError::HostMemory(
                "the kernel reports no memory (is /proc mounted?)".to_owned(),
            ));
        }
        let total = sys
            .cgroup_limits()
            .map_or(machine, |c| c.total_memory.min(machine));
        Ok(Self {
            sys: Mutex::new(sys),
            pid: sysinfo::get_current_pid().ok(),
            total,
            limited: total < machine,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, System> {
        self.sys
            .lock()
            .expect("host memory lock poisoned; this is a bug")
    }
}

impl HostMemory for SysinfoHost {
    fn source(&self) -> &'static str {
        if self.limited {
            "cgroup"
        } else {
            "sysinfo"
        }
    }

    fn total(&self) -> u64 {
        self.total
    }

    fn available(&self) -> Result<u64, DeviceError> {
        let mut sys = self.lock();
        sys.refresh_memory();
        if sys.total_memory() == 0 {
            return Err(DeviceError::HostMemory(
                "the kernel's memory figures could not be read".to_owned(),
            ));
        }
        // MemAvailable: what the kernel can give without swapping (free memory and the
        // page cache it can drop). Under a cgroup limit, what the limit leaves beyond the
        // group's anonymous memory (its page cache is reclaimed before an OOM kill).
        let machine = sys.available_memory();
        Ok(match sys.cgroup_limits() {
            Some(c) => machine.min(c.total_memory.saturating_sub(c.rss)),
            None => machine,
        })
    }

    fn own_usage(&self) -> Option<u64> {
        let pid = self.pid?;
        let mut sys = self.lock();
        sys.refresh_processes_specifics(
            ProcessesToUpdate::Some(&[pid]),
            false,
            ProcessRefreshKind::nothing().with_memory(),
        );
        sys.process(pid).map(sysinfo::Process::memory)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The real host reads: a total, something available within it, and this process's
    /// resident memory, which grows when it touches memory.
    #[test]
    fn the_real_host_reads_its_memory_and_this_process() {
        let host = SysinfoHost::new().unwrap();
        assert!(host.total() > 0);
        let available = host.available().unwrap();
        assert!(available > 0 && available <= host.total(), "{available}");
        let before = host.own_usage().expect("this process's RSS");
        let touched = std::hint::black_box(vec![1u8; 64 << 20]);
        let after = host.own_usage().unwrap();
        assert!(
            after >= before + (32 << 20),
            "RSS {before} -> {after} after touching 64 MiB"
        );
        drop(touched);
    }
}
