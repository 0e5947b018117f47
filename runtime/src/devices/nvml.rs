//! The real inventory, from NVML.

use std::ffi::OsStr;

use nvml_wrapper::Nvml;

use super::{DeviceError, DeviceInventory, GpuDevice};

/// Cards read from NVML at start; free memory read live.
pub(crate) struct NvmlInventory {
    nvml: Nvml,
    devices: Vec<GpuDevice>,
}

impl NvmlInventory {
    /// Opens NVML and lists the cards `CUDA_VISIBLE_DEVICES` (passed in as `visible`)
    /// leaves visible. Fails with [`DeviceError::NvmlUnavailable`] when the library or
    /// driver is absent, which callers treat as "no GPUs".
    /// `lib` overrides where `libnvidia-ml.so` is loaded from.
    pub(crate) fn open(lib: Option<&OsStr>, visible: Option<&str>) -> Result<Self, DeviceError> {
        let mut builder = Nvml::builder();
        if let Some(lib) = lib {
            builder.lib_path(lib);
        }
        let nvml = builder
            .init()
            .map_err(|e| DeviceError::NvmlUnavailable(e.to_string()))?;
        let nvml_err = |call, uuid: &str| {
            let uuid = uuid.to_owned();
            move |source| DeviceError::Nvml { call, uuid, source }
        };
        let count = nvml.device_count().map_err(nvml_err("device_count", "-"))?;
        let mut all = Vec::with_capacity(count as usize);
        for index in 0..count {
            // A card that cannot even be named cannot be served (its queue needs the
            // UUID); it keeps its place, so CUDA ordinals stay right, and is dropped
            // after the CUDA_VISIBLE_DEVICES filter.
            let uuid = match nvml.device_by_index(index).and_then(|d| d.uuid()) {
                Ok(uuid) => uuid,
                Err(e) => {
                    tracing::error!(index, error = %e,
                        "NVML cannot name this card; it is not served");
                    all.push(GpuDevice {
                        uuid: format!("{UNNAMED}{index}"),
                        index,
                        cuda_ordinal: index as usize,
                        name: String::new(),
                        total_memory: 0,
                        simulated: false,
                    });
                    continue;
                }
            };
            // A card whose name or memory cannot be read is listed; its first memory
            // reading fails too, which sets it aside to be retried (not the whole worker).
            let card = GpuDevice {
                uuid,
                index,
                cuda_ordinal: index as usize,
                name: String::new(),
                total_memory: 0,
                simulated: false,
            };
            all.push(read_card(&nvml, &card).unwrap_or(card));
        }
        let devices = super::filter_visible(&all, visible)
            .into_iter()
            .filter(|d| !d.uuid.starts_with(UNNAMED))
            .collect();
        Ok(Self { nvml, devices })
    }
}

/// The placeholder UUID prefix of a card NVML cannot name.
const UNNAMED: &str = "unnamed-nvml-index-";

/// A card's name and total memory, read now.
fn read_card(nvml: &Nvml, card: &GpuDevice) -> Result<GpuDevice, DeviceError> {
    let err = |call| {
        let uuid = card.uuid.clone();
        move |source| DeviceError::Nvml { call, uuid, source }
    };
    let dev = nvml
        .device_by_uuid(card.uuid.as_str())
        .map_err(err("device_by_uuid"))?;
    let name = dev.name().map_err(err("name"))?;
    let mem = dev.memory_info().map_err(err("memory_info"))?;
    Ok(GpuDevice {
        name,
        total_memory: mem.total,
        ..card.clone()
    })
}

impl DeviceInventory for NvmlInventory {
    fn source(&self) -> &'static str {
        "nvml"
    }

    fn devices(&self) -> &[GpuDevice] {
        &self.devices
    }

    fn free_memory(&self, uuid: &str) -> Result<u64, DeviceError> {
        let dev = self
            .nvml
            .device_by_uuid(uuid)
            .map_err(|source| DeviceError::Nvml {
                call: "device_by_uuid",
                uuid: uuid.to_owned(),
                source,
            })?;
        let mem = dev.memory_info().map_err(|source| DeviceError::Nvml {
            call: "memory_info",
            uuid: uuid.to_owned(),
            source,
        })?;
        Ok(mem.free)
    }

    fn own_usage(&self, uuid: &str) -> Option<u64> {
        use nvml_wrapper::enums::device::UsedGpuMemory;
        let dev = self.nvml.device_by_uuid(uuid).ok()?;
        let me = std::process::id();
        // Inside a container with its own PID namespace the driver lists host PIDs, so
        // this process is not found and admission falls back (see the trait).
        dev.running_compute_processes()
            .ok()?
            .into_iter()
            .find(|p| p.pid == me)
            .and_then(|p| match p.used_gpu_memory {
                UsedGpuMemory::Used(b) => Some(b),
                UsedGpuMemory::Unavailable => None,
            })
    }

    fn probe(&self, card: &GpuDevice) -> Result<GpuDevice, DeviceError> {
        read_card(&self.nvml, card)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A machine without the NVML library is normal: opening reports "unavailable", which
    /// the runtime turns into "no GPUs, serve the CPU lane".
    #[test]
    fn missing_library_is_reported_as_unavailable() {
        let lib = OsStr::new("/nonexistent/libnvidia-ml.so.1");
        match NvmlInventory::open(Some(lib), None) {
            Err(DeviceError::NvmlUnavailable(why)) => assert!(!why.is_empty()),
            Err(other) => panic!("expected NvmlUnavailable, got {other}"),
            Ok(_) => panic!("NVML opened from a path that does not exist"),
        }
    }
}
