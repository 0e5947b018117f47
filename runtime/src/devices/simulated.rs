//! Declared GPUs for laptops, CI and demos, the way Ray lets you declare `num_gpus`: the
//! cards exist for lanes, queues and admission, and compute on the CPU. Every activity
//! result and log line says `simulated`.

use std::{collections::HashMap, path::PathBuf};

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

/// A declared set of cards with fixed memory.
pub(crate) struct SimulatedInventory {
    devices: Vec<GpuDevice>,
    memory_file: Option<PathBuf>,
}

impl SimulatedInventory {
    /// `count` cards of `bytes` each. UUIDs are fixed (`GPU-SIM-0`, …) so queue names stay
    /// stable across restarts, as real UUIDs do.
    pub(crate) fn new(count: u32, bytes: u64) -> Self {
        let devices = (0..count)
            .map(|i| GpuDevice {
                uuid: format!("GPU-SIM-{i}"),
                index: i,
                cuda_ordinal: i as usize,
                name: format!("Simulated GPU {i}"),
                total_memory: bytes,
                simulated: true,
            })
            .collect();
        Self {
            devices,
            memory_file: None,
        }
    }

    /// Scripts free memory from a JSON file mapping a card's index (as a string) to its
    /// free bytes, e.g. `{"0": 0, "1": 17179869184}`, read at every memory refresh so a
    /// test or demo can play another tenant filling a card. Cards it does not name are
    /// entirely free. A value of `"fail"` makes the card's readings fail, as a broken
    /// card's NVML calls would.
    pub(crate) fn with_memory_file(mut self, path: Option<PathBuf>) -> Self {
        self.memory_file = path;
        self
    }

    /// Applies a `CUDA_VISIBLE_DEVICES` value, as for real cards.
    pub(crate) fn with_visible(mut self, spec: Option<&str>) -> Self {
        self.devices = super::filter_visible(&self.devices, spec);
        self
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
        let dev = self
            .devices
            .iter()
            .find(|d| d.uuid == uuid)
            .ok_or_else(|| DeviceError::UnknownDevice(uuid.to_owned()))?;
        let Some(path) = &self.memory_file else {
            return Ok(dev.total_memory);
        };
        let bad = |reason: String| DeviceError::SimulationFile {
            path: path.clone(),
            reason,
        };
        let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
        let map: HashMap<String, Scripted> = serde_json::from_str(&text).map_err(|e| {
            bad(format!(
                "{e}; expected an object of index to free bytes (or \"fail\"), like {{\"0\": 0}}"
            ))
        })?;
        match map.get(&dev.index.to_string()) {
            None => Ok(dev.total_memory),
            Some(Scripted::Free(b)) => Ok((*b).min(dev.total_memory)),
            Some(Scripted::Fail(word)) if word == "fail" => Err(bad(format!(
                "card {} is scripted to fail its readings",
                dev.index
            ))),
            Some(Scripted::Fail(word)) => Err(bad(format!(
                "card {}: {word:?} is neither free bytes nor \"fail\"",
                dev.index
            ))),
        }
    }

    fn probe(&self, card: &GpuDevice) -> Result<GpuDevice, DeviceError> {
        self.free_memory(&card.uuid).map(|_| card.clone())
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
        let inv = SimulatedInventory::new(2, 16 << 30);
        assert_eq!(inv.source(), "simulated");
        let d = inv.devices();
        assert_eq!(d.len(), 2);
        assert_eq!(d[1].uuid, "GPU-SIM-1");
        assert!(d.iter().all(|d| d.simulated));
        assert_eq!(inv.free_memory("GPU-SIM-0").unwrap(), 16 << 30);
        assert!(inv.free_memory("GPU-X").is_err());
        let only1 = SimulatedInventory::new(2, 1).with_visible(Some("1"));
        assert_eq!(only1.devices()[0].uuid, "GPU-SIM-1");
        assert_eq!(only1.devices()[0].cuda_ordinal, 0);
    }

    #[test]
    fn memory_file_scripts_free_bytes_and_bad_files_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("mem.json");
        let inv = SimulatedInventory::new(2, 8 << 30).with_memory_file(Some(file.clone()));
        assert!(
            inv.free_memory("GPU-SIM-0").is_err(),
            "a missing file is a read error"
        );
        std::fs::write(&file, r#"{"0": 0}"#).unwrap();
        assert_eq!(inv.free_memory("GPU-SIM-0").unwrap(), 0);
        assert_eq!(
            inv.free_memory("GPU-SIM-1").unwrap(),
            8 << 30,
            "unnamed cards are free"
        );
        std::fs::write(&file, r#"{"0": 1073741824}"#).unwrap();
        assert_eq!(
            inv.free_memory("GPU-SIM-0").unwrap(),
            1 << 30,
            "re-read on every call"
        );
        std::fs::write(&file, r#"{"1": "fail"}"#).unwrap();
        let e = inv.free_memory("GPU-SIM-1").unwrap_err().to_string();
        assert!(e.contains("scripted to fail"), "{e}");
        assert!(inv.probe(&inv.devices()[1]).is_err());
        assert!(inv.probe(&inv.devices()[0]).is_ok());
        std::fs::write(&file, "not json").unwrap();
        let e = inv.free_memory("GPU-SIM-0").unwrap_err().to_string();
        assert!(e.contains("mem.json"), "{e}");
    }
}
