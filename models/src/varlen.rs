//! Packed (varlen) attention for cards: every row's tokens attend to their own row, with no
//! padding and no `[b, heads, t, t]` tensor, in one kernel launch per layer
//! (`models/cuda/kernels.cu`, `varlen_attention`).
//!
//! The host side is here: for each packed token, the range of packed key indices it sees
//! ([`key_ranges`]: its row, its window, or causal up to itself), built once per batch and
//! mask and uploaded as one `[N, 2]` u32 tensor; the kernel knows nothing else about rows.
//! The op's CPU forward ([`VarlenAttention`]'s `cpu_fwd`) is the kernel's loop written in
//! Rust over the same ranges, so the CPU tests check the ranges and the head arithmetic
//! against the fused CPU kernel for every mask, and the emulated kernel against both
//! (`simt_tests.rs`).

use std::cell::OnceCell;

use candle_core::{CpuStorage, CustomOp3, DType, Device, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::kernels::{cpu_slice, Heads, Keys, Mask};

/// For each packed token of rows at `starts` with `lens`, in order, `[lo, hi)`: the packed
/// indices of the keys it attends to. Token i of a row (packed index s + i) sees the row
/// s..s + len; with a window w, s + max(0, i − w)..s + min(len, i + w + 1); causal,
/// s..s + i + 1.
pub(crate) fn key_ranges(starts: &[usize], lens: &[usize], keys: Keys) -> Vec<u32> {
    let n: usize = lens.iter().sum();
    let mut out = Vec::with_capacity(2 * n);
    for (&s, &len) in starts.iter().zip(lens) {
        for i in 0..len {
            let seen = keys.range(i, len);
            out.push((s + seen.start) as u32);
            out.push((s + seen.end) as u32);
        }
    }
    out
}

/// Where each row of `lens` starts among the packed tokens.
pub(crate) fn row_starts(lens: &[usize]) -> Vec<usize> {
    lens.iter()
        .scan(0, |s, &l| {
            let at = *s;
            *s += l;
            Some(at)
        })
        .collect()
}

/// A batch's key ranges on its device: the whole-row ones, and those of one other mask
/// (every local layer of a model has the same window), built on first use.
/// The rows are the batch's own (`starts`, `lens`), passed to each call.
pub(crate) struct Varlen {
    row: Tensor,
    other: OnceCell<(Keys, Tensor)>,
}

impl Varlen {
    pub(crate) fn new(starts: &[usize], lens: &[usize], device: &Device) -> Result<Self> {
        Ok(Self {
            row: ranges_tensor(starts, lens, Keys::Row, device)?,
            other: OnceCell::new(),
        })
    }

    /// Attention of packed `qkv` (`[N, (q + 2·kv)·d]`, Q pre-scaled) to `[N, q·d]`, for
    /// the rows this was made for.
    pub(crate) fn attend(
        &self,
        qkv: &Tensor,
        (starts, lens): (&[usize], &[usize]),
        heads: Heads,
        mask: Mask,
    ) -> Result<Tensor> {
        let keys = Keys::of(&mask);
        let ranges = match keys {
            Keys::Row => self.row.clone(),
            _ => match self.other.get() {
                Some((k, t)) if *k == keys => t.clone(),
                _ => {
                    let t = ranges_tensor(starts, lens, keys, qkv.device())?;
                    let _ = self.other.set((keys, t.clone()));
                    t
                }
            },
        };
        let (span, table) = match mask {
            Mask::Relative(r) => {
                r.covers(lens, heads)?;
                let table = r.on_device.clone().ok_or_else(|| {
                    candle_core::Error::Msg(
                        "attention: relative bias not laid out for the varlen route; this is a bug"
                            .into(),
                    )
                })?;
                (r.span, table)
            }
            // Unread by the kernel when span is 0; any tensor on the device will do.
            _ => (0, ranges.clone()),
        };
        qkv.apply_op3_no_bwd(&ranges, &table, &VarlenAttention { heads, span })
    }
}

fn ranges_tensor(starts: &[usize], lens: &[usize], keys: Keys, device: &Device) -> Result<Tensor> {
    let r = key_ranges(starts, lens, keys);
    let n = r.len() / 2;
    Tensor::from_vec(r, (n, 2), device)
}

/// The op: `qkv` `[N, (q + 2·kv)·d]`, key ranges `[N, 2]` u32, and with `span > 0` the
/// relative bias table `[q · (2·span − 1)]` f32.
pub(crate) struct VarlenAttention {
    pub(crate) heads: Heads,
    pub(crate) span: usize,
}

impl VarlenAttention {
    fn check(&self, l1: &Layout, l2: &Layout) -> Result<usize> {
        let (n, width) = l1.shape().dims2()?;
        if width != self.heads.qkv_width() {
            candle_core::bail!("attention: rows of {width} values for {:?}", self.heads);
        }
        if l2.shape().dims2()? != (n, 2) {
            candle_core::bail!("attention: key ranges {:?} for {n} tokens", l2.shape());
        }
        if self.heads.kv == 0 || !self.heads.q.is_multiple_of(self.heads.kv) {
            candle_core::bail!("attention: {:?} do not group", self.heads);
        }
        Ok(n)
    }
}

impl CustomOp3 for VarlenAttention {
    fn name(&self) -> &'static str {
        "gpulane-varlen-attention"
    }

    /// The kernel's loop in Rust, f32: per (token, head), an online softmax over the
    /// token's key range, scores and values read at the same offsets the kernel uses.
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let n = self.check(l1, l2)?;
        let qkv = cpu_slice::<f32>(s1, l1, "varlen qkv")?;
        let ranges = cpu_slice::<u32>(s2, l2, "varlen key ranges")?;
        let rel = if self.span > 0 {
            cpu_slice::<f32>(s3, l3, "varlen relative bias")?
        } else {
            &[]
        };
        let Heads { q: nq, kv: nkv, d } = self.heads;
        let width = self.heads.qkv_width();
        let group = nq / nkv;
        let span = self.span;
        let mut out = vec![0f32; n * nq * d];
        out.par_chunks_mut(nq * d).enumerate().for_each(|(t, o)| {
            let (lo, hi) = (ranges[2 * t] as usize, ranges[2 * t + 1] as usize);
            for h in 0..nq {
                let kvh = h / group;
                let q = &qkv[t * width + h * d..][..d];
                let (mut m, mut l) = (f32::NEG_INFINITY, 0f32);
                let acc = &mut o[h * d..(h + 1) * d];
                for j in lo..hi {
                    let k = &qkv[j * width + (nq + kvh) * d..][..d];
                    let mut s: f32 = q.iter().zip(k).map(|(a, b)| a * b).sum();
                    if span > 0 {
                        s += rel[h * (2 * span - 1) + (span - 1) + j - t];
                    }
                    let m2 = m.max(s);
                    let corr = (m - m2).exp();
                    let p = (s - m2).exp();
                    l = l * corr + p;
                    let v = &qkv[j * width + (nq + nkv + kvh) * d..][..d];
                    for (a, &v) in acc.iter_mut().zip(v) {
                        *a = *a * corr + p * v;
                    }
                    m = m2;
                }
                let inv = 1.0 / l;
                acc.iter_mut().for_each(|a| *a *= inv);
            }
        });
        Ok((CpuStorage::F32(out), Shape::from((n, nq * d))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let n = self.check(l1, l2)?;
        let rel = (self.span > 0).then_some((s3, l3));
        let out = crate::cuda::varlen_attention(&crate::cuda::VarlenArgs {
            qkv: (s1, l1),
            ranges: (s2, l2),
            rel,
            n,
            heads: self.heads,
            span: self.span,
        })?;
        Ok((out, Shape::from((n, self.heads.q * self.heads.d))))
    }
}

/// Threads per block for the warp-per-item kernels (4 warps), and the blocks for `items`
/// warps' worth of work: the geometry models/src/cuda.rs launches with and the emulated
/// kernels run under in the tests.
#[cfg(any(test, feature = "cuda"))]
pub(crate) fn launch_geometry(items: usize) -> (u32, u32) {
    const BLOCK: usize = 128;
    let warps_per_block = BLOCK / 32;
    let blocks = u32::try_from(items.div_ceil(warps_per_block))
        .expect("a grid past 2^32 blocks is 2^34 warps of work; this is a bug");
    (blocks, BLOCK as u32)
}

/// Dims each lane holds for a head of `d` (the kernel's template instance), or `None` past
/// 256.
pub(crate) fn dims_per_lane(d: usize) -> Option<u32> {
    match d.div_ceil(32) {
        0 | 1 => Some(1),
        2 => Some(2),
        3 | 4 => Some(4),
        5..=8 => Some(8),
        _ => None,
    }
}

/// Whether the card kernel serves `dtype` (f32, f16, bf16) and heads of `head` dims (up
/// to 256). The CPU twin is only ever forced (tests, `kernel-check`), in f32.
pub(crate) fn serves(dtype: DType, head: usize) -> bool {
    dims_per_lane(head).is_some() && matches!(dtype, DType::F32 | DType::F16 | DType::BF16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_ranges_stay_in_each_row() {
        let starts = [0, 3, 4];
        let lens = [3, 1, 5];
        assert_eq!(
            key_ranges(&starts, &lens, Keys::Row),
            [0, 3, 0, 3, 0, 3, 3, 4, 4, 9, 4, 9, 4, 9, 4, 9, 4, 9]
        );
        assert_eq!(
            key_ranges(&starts, &lens, Keys::Causal),
            [0, 1, 0, 2, 0, 3, 3, 4, 4, 5, 4, 6, 4, 7, 4, 8, 4, 9]
        );
        assert_eq!(
            key_ranges(&starts, &lens, Keys::Window(1)),
            [0, 2, 0, 3, 1, 3, 3, 4, 4, 6, 4, 7, 5, 8, 6, 9, 7, 9]
        );
    }

    #[test]
    fn heads_past_256_have_no_kernel() {
        assert_eq!(dims_per_lane(32), Some(1));
        assert_eq!(dims_per_lane(64), Some(2));
        assert_eq!(dims_per_lane(96), Some(4));
        assert_eq!(dims_per_lane(128), Some(4));
        assert_eq!(dims_per_lane(256), Some(8));
        assert_eq!(dims_per_lane(257), None);
        assert_eq!(launch_geometry(9), (3, 128));
        assert!(serves(DType::F16, 256));
        assert!(!serves(DType::F16, 320));
        assert!(!serves(DType::U32, 64));
    }
}
