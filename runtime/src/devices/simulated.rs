//! Declared GPUs for laptops, CI and demos, the way Ray lets you declare `num_gpus`: the
//! cards exist for lanes, queues and admission, and compute on the CPU. Every activity
//! result and log line says `simulated`.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
};

use gpulane_models::DeviceMemory;

use super::{DeviceError, DeviceInventory, GpuDevice};

/// Parses `COUNTxSIZE` (e.g. `2x16GiB`, `1x8GB`, `4x512MiB`, `1x1073741824`) into a
/// count and a per-card size in bytes.
pub(crate) fn parse_simulate_spec(spec: &str) -> Result<(u32, u64), DeviceError> {
    let bad = |reason: &str| DeviceError::BadSimulation {
        spec: spec.to_owned(),
        reason: format!("{reason}; expected COUNTxSIZE such as 2x16GiB"),
    };
    let (count, size) = spec
        .trim()
        .split_once(['x', 'X'])
        .ok_or_else(|| bad("no 'x'"))?;
    let count: u32 = count
        .trim()
        .parse()
        .map_err(|_| bad("COUNT is not a number"))?;
    if count == 0 {
        return Err(bad("COUNT must be at least 1"));
    }
    let bytes = crate::units::parse_bytes(size).map_err(|e| bad(&e))?;
    if bytes == 0 {
        return Err(bad("SIZE must be positive"));
    }
    Ok((count, bytes))
}

/// One card's line in the memory file.
#[derive(serde::Deserialize)]
#[serde(untagged)]
enum Scripted {
    Free(u64),
    Fail(String),
}

/// What one simulated card (or the simulated host) holds: this process's use (the weights loaded on it and the
/// working memory of forward passes while they run, told by the engines), and what the
/// memory file leaves to it (the rest is another tenant's). A pass that would take the
/// card past its total fails as out of memory, as CUDA's allocator would, so a test can
/// check admission against what engines really hold.
pub(crate) struct SimulatedCard {
    uuid: String,
    /// `card <uuid>`, or `host`, for out-of-memory messages.
    label: String,
    total: u64,
    own: AtomicU64,
    /// Bytes other tenants hold, from the last memory-file reading.
    others: AtomicU64,
    /// The most this process has held at once, for tests and `gpulane status`.
    peak: AtomicU64,
}

impl SimulatedCard {
    fn new(uuid: String, total: u64) -> Self {
        Self {
            label: if uuid == "host" {
                uuid.clone()
            } else {
                format!("card {uuid}")
            },
            uuid,
            total,
            own: AtomicU64::new(0),
            others: AtomicU64::new(0),
            peak: AtomicU64::new(0),
        }
    }

    /// The most this process has held on the card at once.
    #[cfg(test)]
    pub(crate) fn peak(&self) -> u64 {
        self.peak.load(Ordering::Relaxed)
    }
}

impl DeviceMemory for SimulatedCard {
    fn take(&self, bytes: u64) -> Result<(), String> {
        let others = self.others.load(Ordering::Relaxed);
        let room = self.total.saturating_sub(others);
        let mut own = self.own.load(Ordering::Relaxed);
        loop {
            let want = own.saturating_add(bytes);
            if want > room {
                return Err(format!(
                    "simulated {} out of memory: {bytes} bytes asked with {own} held by this \
                     worker and {others} by other tenants, of {}",
                    self.label, self.total
                ));
            }
            match self
                .own
                .compare_exchange_weak(own, want, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => {
                    self.peak.fetch_max(want, Ordering::Relaxed);
                    return Ok(());
                }
                Err(now) => own = now,
            }
        }
    }

    fn hold(&self, bytes: u64) {
        // A tenant scripted by the memory file may fill the card before anything loads
        // (tests start that way); the weights load anyway, as if the tenant came after.
        let now = self.own.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak.fetch_max(now, Ordering::Relaxed);
    }

    fn give_back(&self, bytes: u64) {
        // Saturating: a give-back never takes more than was taken.
        let _ = self
            .own
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |o| {
                Some(o.saturating_sub(bytes))
            });
    }
}

/// A declared set of cards with fixed memory.
pub(crate) struct SimulatedInventory {
    devices: Vec<GpuDevice>,
    cards: Vec<Arc<SimulatedCard>>,
    memory_file: Option<PathBuf>,
}

/// A name for this process's simulated cards: unique per process, so that two simulated
/// workers on one host never share a private queue.
fn process_name() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    format!("{:08x}", h.finish() as u32)
}

impl SimulatedInventory {
    /// `count` cards of `bytes` each, with UUIDs `GPU-SIM-<name>-<index>`. `name` keeps
    /// them stable across restarts (as real UUIDs are), for tests and demos that pin to a
    /// card's queue; without it each process gets a random name.
    pub(crate) fn new(count: u32, bytes: u64, name: Option<&str>) -> Self {
        let name = name.map_or_else(process_name, str::to_owned);
        let devices: Vec<GpuDevice> = (0..count)
            .map(|i| GpuDevice {
                uuid: format!("GPU-SIM-{name}-{i}"),
                index: i,
                cuda_ordinal: i as usize,
                name: format!("Simulated GPU {i}"),
                total_memory: bytes,
                simulated: true,
            })
            .collect();
        let cards = devices
            .iter()
            .map(|d| Arc::new(SimulatedCard::new(d.uuid.clone(), bytes)))
            .collect();
        Self {
            devices,
            cards,
            memory_file: None,
        }
    }

    /// Scripts other tenants from a JSON file mapping a card's index (as a string) to the
    /// bytes they leave free, e.g. `{"0": 0, "1": 17179869184}`, read at every memory
    /// refresh so a test or demo can play another tenant filling a card. This process's
    /// own use comes off what is left. Cards it does not name are entirely free. A value
    /// of `"fail"` makes the card's readings fail, as a broken card's NVML calls would.
    pub(crate) fn with_memory_file(mut self, path: Option<PathBuf>) -> Self {
        self.memory_file = path;
        self
    }

    /// Applies a `CUDA_VISIBLE_DEVICES` value, as for real cards.
    pub(crate) fn with_visible(mut self, spec: Option<&str>) -> Self {
        self.devices = super::filter_visible(&self.devices, spec);
        self
    }

    fn card(&self, uuid: &str) -> Option<(&GpuDevice, &Arc<SimulatedCard>)> {
        let dev = self.devices.iter().find(|d| d.uuid == uuid)?;
        let card = self.cards.iter().find(|c| c.uuid == uuid)?;
        Some((dev, card))
    }

    /// Bytes other tenants leave free on `dev`, from the memory file.
    fn left_by_others(&self, dev: &GpuDevice) -> Result<u64, DeviceError> {
        left_by_others(
            self.memory_file.as_deref(),
            &dev.index.to_string(),
            dev.total_memory,
        )
    }
}

/// Bytes other tenants leave free of `total` on the card (its index) or host (`host`)
/// named `key` in the memory file; all of it without a file or a line for `key`.
fn left_by_others(path: Option<&Path>, key: &str, total: u64) -> Result<u64, DeviceError> {
    let Some(path) = path else {
        return Ok(total);
    };
    let bad = |reason: String| DeviceError::SimulationFile {
        path: path.to_owned(),
        reason,
    };
    let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
    let map: HashMap<String, Scripted> = serde_json::from_str(&text).map_err(|e| {
        bad(format!(
            "{e}; expected an object of a card's index (or \"host\") to free bytes (or \"fail\"), like {{\"0\": 0}}"
        ))
    })?;
    match map.get(key) {
        None => Ok(total),
        Some(Scripted::Free(b)) => Ok((*b).min(total)),
        Some(Scripted::Fail(word)) if word == "fail" => {
            Err(bad(format!("{key:?} is scripted to fail its readings")))
        }
        Some(Scripted::Fail(word)) => Err(bad(format!(
            "{key:?}: {word:?} is neither free bytes nor \"fail\""
        ))),
    }
}

/// A host of declared memory (`--simulated-host-memory`), for tests and demos of the CPU
/// lanes' admission: it accounts what this process's engines and tokenizations tell it,
/// as a simulated card does, and refuses what would not fit. Other tenants are scripted by
/// the memory file's `"host"` line.
pub(crate) struct SimulatedHost {
    memory: Arc<SimulatedCard>,
    memory_file: Option<PathBuf>,
}

impl SimulatedHost {
    /// A host of `total` bytes; `memory_file` as for simulated cards, keyed `"host"`.
    pub(crate) fn new(total: u64, memory_file: Option<PathBuf>) -> Self {
        Self {
            memory: Arc::new(SimulatedCard::new("host".to_owned(), total)),
            memory_file,
        }
    }

    /// The most this process has held at once.
    #[cfg(test)]
    pub(crate) fn peak(&self) -> u64 {
        self.memory.peak()
    }
}

impl super::HostMemory for SimulatedHost {
    fn source(&self) -> &'static str {
        "simulated"
    }

    fn total(&self) -> u64 {
        self.memory.total
    }

    fn available(&self) -> Result<u64, DeviceError> {
        let total = self.memory.total;
        let left = left_by_others(self.memory_file.as_deref(), "host", total)?;
        self.memory.others.store(total - left, Ordering::Relaxed);
        Ok(left.saturating_sub(self.memory.own.load(Ordering::Relaxed)))
    }

    fn own_usage(&self) -> Option<u64> {
        Some(self.memory.own.load(Ordering::Relaxed))
    }

    fn engine_memory(&self) -> Option<Arc<dyn DeviceMemory>> {
        Some(self.memory.clone() as Arc<dyn DeviceMemory>)
    }
}

impl DeviceInventory for SimulatedInventory {
    fn source(&self) -> &'static str {
        "simulated"
    }

    fn devices(&self) -> &[GpuDevice] {
        &self.devices
    }

    fn free_memory(&self, uuid: &str) -> Result<u64, DeviceError> {
        let (dev, card) = self
            .card(uuid)
            .ok_or_else(|| DeviceError::UnknownDevice(uuid.to_owned()))?;
        let left = self.left_by_others(dev)?;
        card.others
            .store(dev.total_memory - left, Ordering::Relaxed);
        Ok(left.saturating_sub(card.own.load(Ordering::Relaxed)))
    }

    fn probe(&self, card: &GpuDevice) -> Result<GpuDevice, DeviceError> {
        self.free_memory(&card.uuid).map(|_| card.clone())
    }

    fn own_usage(&self, uuid: &str) -> Option<u64> {
        self.card(uuid).map(|(_, c)| c.own.load(Ordering::Relaxed))
    }

    fn engine_memory(&self, uuid: &str) -> Option<Arc<dyn DeviceMemory>> {
        self.card(uuid)
            .map(|(_, c)| c.clone() as Arc<dyn DeviceMemory>)
    }

    #[cfg(test)]
    fn simulated_peak(&self, uuid: &str) -> Option<u64> {
        self.card(uuid).map(|(_, c)| c.peak())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_counts_and_units() {
        assert_eq!(parse_simulate_spec("2x16GiB").unwrap(), (2, 16 << 30));
        assert_eq!(parse_simulate_spec("1x8GB").unwrap(), (1, 8_000_000_000));
        assert_eq!(parse_simulate_spec("3X512MiB").unwrap(), (3, 512 << 20));
        assert_eq!(parse_simulate_spec("1x1024").unwrap(), (1, 1024));
    }

    #[test]
    fn rejects_nonsense_with_the_expected_shape() {
        for bad in ["", "2", "0x1GiB", "ax1GiB", "2x", "2x1PB", "2x0"] {
            let e = parse_simulate_spec(bad).unwrap_err().to_string();
            assert!(e.contains("COUNTxSIZE"), "{bad}: {e}");
        }
    }

    #[test]
    fn declares_stable_visible_cards() {
        let inv = SimulatedInventory::new(2, 16 << 30, Some("t"));
        assert_eq!(inv.source(), "simulated");
        let d = inv.devices();
        assert_eq!(d.len(), 2);
        assert_eq!(d[1].uuid, "GPU-SIM-t-1");
        assert!(d.iter().all(|d| d.simulated));
        assert_eq!(inv.free_memory("GPU-SIM-t-0").unwrap(), 16 << 30);
        assert!(inv.free_memory("GPU-X").is_err());
        let only1 = SimulatedInventory::new(2, 1, Some("t")).with_visible(Some("1"));
        assert_eq!(only1.devices()[0].uuid, "GPU-SIM-t-1");
        assert_eq!(only1.devices()[0].cuda_ordinal, 0);
    }

    /// Regression: every process named its simulated cards GPU-SIM-0, so two simulated
    /// workers on one host served the same private queues.
    #[test]
    fn unnamed_simulations_differ_per_process_name() {
        let a = SimulatedInventory::new(1, 1, None);
        let b = SimulatedInventory::new(1, 1, None);
        assert!(a.devices()[0].uuid.starts_with("GPU-SIM-"));
        assert_ne!(a.devices()[0].uuid, b.devices()[0].uuid);
    }

    #[test]
    fn a_card_follows_its_engines_and_refuses_what_does_not_fit() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("mem.json");
        std::fs::write(&file, r#"{"0": 12}"#).unwrap(); // another tenant holds 4 of 16
        let inv = SimulatedInventory::new(1, 16, Some("t")).with_memory_file(Some(file));
        let uuid = "GPU-SIM-t-0";
        assert_eq!(inv.free_memory(uuid).unwrap(), 12);
        let mem = inv.engine_memory(uuid).unwrap();
        mem.hold(5); // weights
        assert_eq!(inv.own_usage(uuid), Some(5));
        assert_eq!(inv.free_memory(uuid).unwrap(), 7);
        mem.take(7).unwrap(); // a pass that just fits
        assert_eq!(inv.free_memory(uuid).unwrap(), 0);
        let e = mem.take(1).unwrap_err();
        assert!(
            e.contains("out of memory") && e.contains("GPU-SIM-t-0"),
            "{e}"
        );
        mem.give_back(7);
        assert_eq!(inv.own_usage(uuid), Some(5));
        assert_eq!(inv.simulated_peak(uuid), Some(12));
    }

    #[test]
    fn memory_file_scripts_free_bytes_and_bad_files_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("mem.json");
        let inv =
            SimulatedInventory::new(2, 8 << 30, Some("SIM")).with_memory_file(Some(file.clone()));
        assert!(
            inv.free_memory("GPU-SIM-SIM-0").is_err(),
            "a missing file is a read error"
        );
        std::fs::write(&file, r#"{"0": 0}"#).unwrap();
        assert_eq!(inv.free_memory("GPU-SIM-SIM-0").unwrap(), 0);
        assert_eq!(
            inv.free_memory("GPU-SIM-SIM-1").unwrap(),
            8 << 30,
            "unnamed cards are free"
        );
        std::fs::write(&file, r#"{"0": 1073741824}"#).unwrap();
        assert_eq!(
            inv.free_memory("GPU-SIM-SIM-0").unwrap(),
            1 << 30,
            "re-read on every call"
        );
        std::fs::write(&file, r#"{"1": "fail"}"#).unwrap();
        let e = inv.free_memory("GPU-SIM-SIM-1").unwrap_err().to_string();
        assert!(e.contains("scripted to fail"), "{e}");
        assert!(inv.probe(&inv.devices()[1]).is_err());
        assert!(inv.probe(&inv.devices()[0]).is_ok());
        std::fs::write(&file, "not json").unwrap();
        let e = inv.free_memory("GPU-SIM-SIM-0").unwrap_err().to_string();
        assert!(e.contains("mem.json"), "{e}");
    }
}
