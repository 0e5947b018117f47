//! The machine's GPUs and host memory, each behind one narrow trait so the rest of the
//! runtime (lanes, slot suppliers, metrics) never knows whether NVML, `sysinfo` or a
//! simulation answers. NVML is read through `nvml-wrapper`, which loads
//! `libnvidia-ml.so` at run time: a machine without it, or without cards, is normal and
//! serves the CPU lane.

use std::sync::Arc;

use gpulane_models::DeviceMemory;

mod cuda;
mod host;
mod nvml;
mod simulated;
mod visible;

pub(crate) use cuda::check_cuda_ordinal;
pub(crate) use host::{HostMemory, SysinfoHost};
pub(crate) use nvml::NvmlInventory;
pub(crate) use simulated::{parse_simulate_spec, SimulatedHost, SimulatedInventory};
pub(crate) use visible::filter_visible;

/// One GPU as the runtime sees it, keyed by UUID.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct GpuDevice {
    /// The card's UUID (`GPU-…`), stable across reboots and PCI re-ordering.
    pub uuid: String,
    /// NVML's index of the card (PCI bus order).
    pub index: u32,
    /// The CUDA ordinal this process must use for the card: its position in
    /// `CUDA_VISIBLE_DEVICES` when set. Valid only under `CUDA_DEVICE_ORDER=PCI_BUS_ID`,
    /// which the runtime sets before any CUDA call.
    pub cuda_ordinal: usize,
    /// Marketing name, e.g. `NVIDIA H200`.
    pub name: String,
    /// Total memory in bytes.
    pub total_memory: u64,
    /// True for cards declared by `--simulate-gpus`; they compute on the CPU.
    pub simulated: bool,
}

/// Errors reading the device inventory.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// NVML is absent or refused to start. Not an error for the worker: it serves the CPU
    /// lane and says why. Not retryable within this process.
    #[error("NVML unavailable: {0}")]
    NvmlUnavailable(String),
    /// An NVML call on a card failed. Retryable: the next refresh may succeed; meanwhile
    /// the card admits no work.
    #[error("NVML call {call} failed for {uuid}: {source}")]
    Nvml {
        /// What was asked.
        call: &'static str,
        /// The card, or `-` before a card is known.
        uuid: String,
        /// NVML's error.
        #[source]
        source: nvml_wrapper::error::NvmlError,
    },
    /// The card's CUDA ordinal does not open that card, or the driver could not say which
    /// card it opens. Not retryable: CUDA and NVML number the cards differently
    /// (`CUDA_DEVICE_ORDER`, `CUDA_VISIBLE_DEVICES`), so work would land on the wrong card.
    #[error("card {uuid} (CUDA ordinal {ordinal}): {reason}")]
    CudaOrdinal {
        /// The card, by NVML UUID.
        uuid: String,
        /// The ordinal computed for it.
        ordinal: usize,
        /// What the driver said.
        reason: String,
    },
    /// The card is not in the inventory. Not retryable; this is a bug in the caller.
    #[error("no such GPU: {0}")]
    UnknownDevice(String),
    /// The `--simulated-memory` file is missing or malformed. Retryable: the card admits
    /// nothing until the file reads again.
    #[error("simulated memory file {path}: {reason}")]
    SimulationFile {
        /// The file.
        path: std::path::PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The host's memory figures could not be read. Retryable: the CPU lanes admit
    /// nothing until a reading succeeds.
    #[error("host memory: {0}")]
    HostMemory(String),
    /// A `--simulate-gpus` value that does not parse. Not retryable: fix the flag.
    #[error("--simulate-gpus {spec:?}: {reason}")]
    BadSimulation {
        /// The flag value.
        spec: String,
        /// What is wrong and what would be right.
        reason: String,
    },
}

/// Reads the machine's GPUs. One implementation talks to NVML, one is declared by flags;
/// tests and `--simulate-gpus` use the latter.
pub(crate) trait DeviceInventory: Send + Sync {
    /// `nvml` or `simulated`, for logs and `gpulane devices`.
    fn source(&self) -> &'static str;
    /// The visible cards, fixed for the life of the process.
    fn devices(&self) -> &[GpuDevice];
    /// Live free memory of one card, in bytes.
    fn free_memory(&self, uuid: &str) -> Result<u64, DeviceError>;
    /// Reads a card again (name, total memory, a memory reading), for a card that could
    /// not be read at start: the card as it is now, or why it still cannot be read.
    fn probe(&self, card: &GpuDevice) -> Result<GpuDevice, DeviceError>;
    /// Bytes this process itself holds on the card now (weights, live activations, the
    /// CUDA context), when the inventory can tell: a simulated card always can; NVML can
    /// where the driver lists per-process use (not in every container). `None` makes
    /// admission assume the reading holds the loaded weights and nothing else of ours.
    fn own_usage(&self, _uuid: &str) -> Option<u64> {
        None
    }
    /// What the card's engines tell about each forward pass's memory: a simulated card's
    /// accounting. `None` for real cards, where CUDA's allocator is the truth.
    fn engine_memory(&self, _uuid: &str) -> Option<Arc<dyn DeviceMemory>> {
        None
    }
    /// A simulated card's highest use by this process so far; `None` for real cards.
    #[cfg(test)]
    fn simulated_peak(&self, _uuid: &str) -> Option<u64> {
        None
    }
}
