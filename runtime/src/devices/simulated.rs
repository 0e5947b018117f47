//! Declared GPUs for laptops, CI and demos, the way Ray lets you declare `num_gpus`: the
//! cards exist for lanes, queues and admission, and compute on the CPU. Every activity
//! result and log line says `simulated`.

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
    let size = size.trim();
    let split = size
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(size.len());
    let (num, unit) = size.split_at(split);
    let num: f64 = num.parse().map_err(|_| bad("SIZE is not a number"))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        _ => return Err(bad("unknown unit (use B, KiB, MiB, GiB, KB, MB or GB)")),
    };
    let bytes = (num * mult) as u64;
    if bytes == 0 {
        return Err(bad("SIZE must be positive"));
    }
    Ok((count, bytes))
}

/// A declared set of cards with fixed memory.
pub(crate) struct SimulatedInventory {
    devices: Vec<GpuDevice>,
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
        Self { devices }
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
        self.devices
            .iter()
            .find(|d| d.uuid == uuid)
            .map(|d| d.total_memory)
            .ok_or_else(|| DeviceError::UnknownDevice(uuid.to_owned()))
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
        for bad in ["", "2", "0x1GiB", "ax1GiB", "2x", "2x1PB"] {
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
}
