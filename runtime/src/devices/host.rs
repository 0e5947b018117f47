//! The host's memory, which the CPU lanes admit by as cards admit by theirs: read through
//! `sysinfo` (the machine's figures) and this process's cgroup (its memory limit when one
//! is set, as under Kubernetes or a systemd unit's `MemoryMax=`), or declared by
//! `--simulated-host-memory` for tests and demos.

use std::{
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
};

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
        let total = cgroup_limit(&sys).map_or(machine, |(limit, _)| limit.min(machine));
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
        Ok(match cgroup_limit(&sys) {
            Some((limit, anon)) => machine.min(limit.saturating_sub(anon)),
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

/// The tightest memory limit over this process's cgroup and its parents, and the
/// anonymous memory of the group it applies to: cgroup v2 read from the process's own
/// group (`/proc/self/cgroup`), so a systemd unit's limit counts as a pod's does; else
/// what `sysinfo` reads at the v1 hierarchy's root. `None` without a limit.
fn cgroup_limit(sys: &System) -> Option<(u64, u64)> {
    let own = std::fs::read_to_string("/proc/self/cgroup").ok();
    own.as_deref()
        .and_then(|own| cgroup_v2_limit(Path::new("/sys/fs/cgroup"), own))
        .or_else(|| {
            sys.cgroup_limits()
                .filter(|c| c.total_memory < sys.total_memory())
                .map(|c| (c.total_memory, c.rss))
        })
}

/// [`cgroup_limit`] for cgroup v2 mounted at `root`, with `self_cgroup` the text of
/// `/proc/self/cgroup`.
fn cgroup_v2_limit(root: &Path, self_cgroup: &str) -> Option<(u64, u64)> {
    let path = self_cgroup.lines().find_map(|l| l.strip_prefix("0::"))?;
    let mut dir: PathBuf = root.join(path.trim().trim_start_matches('/'));
    let mut tightest: Option<(u64, PathBuf)> = None;
    loop {
        // "max" (no limit) does not parse; the root group has no file at all.
        let limit = std::fs::read_to_string(dir.join("memory.max"))
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok());
        if let Some(limit) = limit {
            if tightest.as_ref().is_none_or(|(t, _)| limit < *t) {
                tightest = Some((limit, dir.clone()));
            }
        }
        if dir == root || !dir.pop() || !dir.starts_with(root) {
            break;
        }
    }
    let (limit, at) = tightest?;
    let stat = std::fs::read_to_string(at.join("memory.stat")).ok()?;
    let anon = stat
        .lines()
        .find_map(|l| l.strip_prefix("anon "))
        .and_then(|v| v.trim().parse().ok())?;
    Some((limit, anon))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A systemd unit in a slice with `MemoryMax=` on the slice: the slice's limit and
    /// anonymous memory, read from the process's own group upwards.
    #[test]
    fn the_tightest_limit_over_the_own_cgroup_and_its_parents() {
        let root = tempfile::tempdir().unwrap();
        let slice = root.path().join("system.slice");
        let unit = slice.join("gpulane.service");
        std::fs::create_dir_all(&unit).unwrap();
        std::fs::write(unit.join("memory.max"), "max\n").unwrap();
        std::fs::write(unit.join("memory.stat"), "anon 100\nfile 5\n").unwrap();
        std::fs::write(slice.join("memory.max"), "4096\n").unwrap();
        std::fs::write(slice.join("memory.stat"), "file 7\nanon 300\n").unwrap();
        let own = "0::/system.slice/gpulane.service\n";
        assert_eq!(cgroup_v2_limit(root.path(), own), Some((4096, 300)));
        // The unit's own limit, when tighter, wins with its own anonymous memory.
        std::fs::write(unit.join("memory.max"), "1024\n").unwrap();
        assert_eq!(cgroup_v2_limit(root.path(), own), Some((1024, 100)));
        // No limit anywhere, or a v1-only /proc/self/cgroup: none.
        std::fs::write(unit.join("memory.max"), "max\n").unwrap();
        std::fs::write(slice.join("memory.max"), "max\n").unwrap();
        assert_eq!(cgroup_v2_limit(root.path(), own), None);
        assert_eq!(cgroup_v2_limit(root.path(), "4:memory:/x\n"), None);
    }

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
