//! Reading CPU tensors' f32 values in place, for the fused steps and the custom ops.

use candle_core::{backend::BackendStorage, CpuStorage, DType, Layout, Result, Tensor};

/// [`cpu_slice`] for f32: what the custom ops' CPU halves read.
pub(super) fn f32_slice<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<&'a [f32]> {
    cpu_slice::<f32>(s, l, what)
}

/// A contiguous CPU tensor's values of type `T`, at its layout's offsets.
pub(crate) fn cpu_slice<'a, T: candle_core::WithDType>(
    s: &'a CpuStorage,
    l: &Layout,
    what: &str,
) -> Result<&'a [T]> {
    if s.dtype() != T::DTYPE {
        candle_core::bail!("{what}: expected {:?}, got {:?}", T::DTYPE, s.dtype());
    }
    let all = s.as_slice::<T>()?;
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&all[a..b]),
        None => candle_core::bail!("{what}: input must be contiguous"),
    }
}

/// Whether `t` is a contiguous f32 tensor on the CPU: what the CPU-only fused kernels
/// ([`gated_silu`](super::gated_silu), [`qk_norm_rope`](super::qk_norm_rope)) read in
/// place.
pub(crate) fn cpu_f32(t: &Tensor) -> bool {
    t.is_contiguous() && t.device().is_cpu() && t.dtype() == DType::F32
}

/// A contiguous CPU f32 tensor's values, read in place: its storage's read lock and the
/// range its layout covers. A fused step that reads several tensors holds one each, named
/// one after another, instead of nesting a closure per tensor; the lock keeps the storage
/// as `read` found it for as long as the values are borrowed. It is candle's non-recursive
/// read lock: two reads of one storage on one thread could wait on each other behind a
/// queued writer. Nothing in gpulane writes to a tensor in place, and the tensors read
/// together are separate allocations.
pub(crate) struct CpuF32<'a> {
    storage: candle_core::StorageRef<'a>,
    range: std::ops::Range<usize>,
}

impl<'a> CpuF32<'a> {
    /// `t`'s values, or an error naming `what` where `t` is not contiguous f32 on the CPU.
    pub(crate) fn read(t: &'a Tensor, what: &str) -> Result<Self> {
        let (storage, layout) = t.storage_and_layout();
        let candle_core::Storage::Cpu(cpu) = &*storage else {
            candle_core::bail!("{what}: not on the CPU");
        };
        let len = f32_slice(cpu, layout, what)?.len();
        let range = layout.start_offset()..layout.start_offset() + len;
        Ok(Self { storage, range })
    }

    /// `read`'s tensor's values.
    pub(crate) fn values(&self) -> &[f32] {
        match &*self.storage {
            candle_core::Storage::Cpu(CpuStorage::F32(v)) => &v[self.range.clone()],
            // `read` checked both, and the read lock keeps them so.
            _ => unreachable!("CpuF32 holds CPU f32 storage"),
        }
    }
}

/// [`CpuF32::read`] for a tensor that may be absent (an optional bias).
pub(crate) fn read_optional<'a>(t: Option<&'a Tensor>, what: &str) -> Result<Option<CpuF32<'a>>> {
    t.map(|t| CpuF32::read(t, what)).transpose()
}
