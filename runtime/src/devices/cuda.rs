//! The check that a card's CUDA ordinal really is that card.
//!
//! gpulane knows cards by NVML UUID, but candle opens them by CUDA ordinal. The rule that
//! ties the two: with `CUDA_DEVICE_ORDER=PCI_BUS_ID` (set by `main` before any CUDA call),
//! CUDA numbers the cards in PCI bus order, as NVML does; `CUDA_VISIBLE_DEVICES` then
//! keeps the cards it lists, in the order it lists them, numbered from 0
//! ([`super::filter_visible`] computes exactly that). Anything that breaks the rule (a
//! `CUDA_DEVICE_ORDER` set by a wrapper after start, a MIG instance, a driver that numbers
//! differently) would silently put a card's work, and its memory, on another card. So
//! with the `cuda` feature each card's ordinal is asked for its UUID through the driver
//! before an engine is loaded on it, and a mismatch stops the worker.
//!
//! The driver is asked through cudarc, the binding candle itself uses (same version and
//! features, so it is built once), rather than through FFI of our own.

use super::{DeviceError, GpuDevice};

#[cfg(feature = "cuda")]
mod driver {
    use cudarc::driver::result;

    /// The 16 UUID bytes of the card CUDA numbers `ordinal`, or what the driver said.
    pub(super) fn uuid_bytes(ordinal: usize) -> Result<[u8; 16], String> {
        let ordinal = i32::try_from(ordinal).map_err(|_| format!("ordinal {ordinal}"))?;
        // cuInit may be called any number of times, from any thread.
        result::init().map_err(|e| format!("cuInit: {e}"))?;
        let dev =
            result::device::get(ordinal).map_err(|e| format!("cuDeviceGet({ordinal}): {e}"))?;
        let uuid = result::device::get_uuid(dev)
            .map_err(|e| format!("cuDeviceGetUuid({ordinal}): {e}"))?;
        // c_char is i8 on x86-64 and u8 on aarch64: the same bits either way.
        Ok(uuid.bytes.map(|b| b as u8))
    }
}

#[cfg(not(feature = "cuda"))]
mod driver {
    /// Never called: without the `cuda` feature no card is opened, so none is checked.
    pub(super) fn uuid_bytes(_ordinal: usize) -> Result<[u8; 16], String> {
        Err("built without the `cuda` feature".to_owned())
    }
}

/// NVML's spelling of a UUID: `GPU-` and 8-4-4-4-12 lowercase hex digits.
fn format_uuid(bytes: &[u8; 16]) -> String {
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

/// Compares the UUID CUDA reports for `gpu.cuda_ordinal` with the card's NVML UUID.
/// `Ok(false)` for a build without the `cuda` feature (nothing to check: such a build
/// never opens a card) and for simulated cards.
pub(crate) fn check_cuda_ordinal(gpu: &GpuDevice) -> Result<bool, DeviceError> {
    if gpu.simulated || !cfg!(feature = "cuda") {
        return Ok(false);
    }
    let fail = |reason: String| DeviceError::CudaOrdinal {
        uuid: gpu.uuid.clone(),
        ordinal: gpu.cuda_ordinal,
        reason,
    };
    let found = format_uuid(&driver::uuid_bytes(gpu.cuda_ordinal).map_err(fail)?);
    if !found.eq_ignore_ascii_case(&gpu.uuid) {
        return Err(fail(format!(
            "CUDA ordinal {ord} is {found}, but NVML's card {index} is {uuid}: CUDA and NVML \
             disagree on the numbering (is CUDA_DEVICE_ORDER=PCI_BUS_ID in effect, and \
             CUDA_VISIBLE_DEVICES the same for both?); refusing to load a model on the wrong card",
            ord = gpu.cuda_ordinal,
            index = gpu.index,
            uuid = gpu.uuid,
        )));
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuids_are_spelled_like_nvml() {
        let bytes: [u8; 16] = [
            0x5b, 0x1f, 0x0a, 0x2c, 0x9d, 0x3e, 0x4f, 0x50, 0x61, 0x72, 0x83, 0x94, 0xa5, 0xb6,
            0xc7, 0xd8,
        ];
        assert_eq!(
            format_uuid(&bytes),
            "GPU-5b1f0a2c-9d3e-4f50-6172-8394a5b6c7d8"
        );
    }

    #[test]
    fn simulated_cards_are_not_checked() {
        let g = GpuDevice {
            uuid: "GPU-SIM-0".into(),
            index: 0,
            cuda_ordinal: 0,
            name: "sim".into(),
            total_memory: 1 << 30,
            simulated: true,
        };
        assert!(matches!(check_cuda_ordinal(&g), Ok(false)));
    }
}
