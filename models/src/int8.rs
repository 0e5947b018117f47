//! Dynamic int8 quantization for dense layers on the CPU (the opt-in `int8` CPU dtype).
//!
//! Weights are quantized once at load, symmetric per output channel; activations are
//! quantized per row as each matmul runs, asymmetric (u8 with a zero point, ONNX Runtime's
//! "dynamic" scheme): the inputs after GELU are nearly all positive, and a symmetric
//! range would waste half its levels on them. The product accumulates in i32 and is scaled back to f32, so layer norms,
//! attention and pooling stay f32.
//!
//! Why a kernel of our own: candle's Q8_0 matmul quantizes in blocks of 32 and takes its
//! VNNI route only when the inner dimension is a multiple of 256, so MiniLM's 384-wide
//! layers ran 6x slower than f32 there. Here the weights are packed for AVX-512 VNNI's
//! `vpdpbusd` (64 byte products per instruction against 16 f32 FMAs). AVX2 has no such
//! instruction, and `vpmaddubsw`, its usual stand-in, saturates u8 × i8 pair sums at i16
//! (ONNX Runtime asks for 7-bit weights there): its route widens both sides to i16 and
//! sums pairs with `vpmaddwd` into i32, exact, half VNNI's products per instruction, on
//! the same packing. A portable path, the reference in tests, serves other CPUs.

use rayon::prelude::*;

#[cfg(test)]
use crate::kernels::gelu;
use crate::{
    dense::Epilogue,
    isa::{cpu_isa, CpuIsa},
};

/// An output not written yet.
type Out = std::mem::MaybeUninit<f32>;

/// Output columns per packed panel: one 512-bit register of i32 accumulators.
const PANEL: usize = 16;
/// Activation rows one rayon task quantizes and multiplies: enough to reuse each weight
/// panel from cache, few enough to split a small batch over both cores.
const ROWS_PER_TASK: usize = 32;

/// A dense layer's weight `[out, in]`, quantized and packed for [`QuantLinear::forward`].
pub(crate) struct QuantLinear {
    /// Inputs (`k`) and outputs (`n`).
    k: usize,
    n: usize,
    /// `k` rounded up to a multiple of 4 (one `vpdpbusd` lane takes 4 bytes).
    k4: usize,
    /// Panels of 16 output columns: `[panel][k4 / 4][16 columns][4 bytes]`, i8.
    packed: Vec<i8>,
    /// Per output column: the dequantization scale, and the sum of its quantized weights
    /// (times a row's zero point, what that row's offset added to the product).
    scale: Vec<f32>,
    sum: Vec<i32>,
}

impl QuantLinear {
    /// Quantizes `w`, row-major `[n, k]` (one row per output).
    pub(crate) fn new(w: &[f32], n: usize, k: usize) -> Self {
        assert!(n > 0 && k > 0, "an empty layer [{n}, {k}]");
        assert_eq!(w.len(), n * k, "weight is not [{n}, {k}]");
        let k4 = k.div_ceil(4) * 4;
        let panels = n.div_ceil(PANEL);
        let mut packed = vec![0i8; panels * PANEL * k4];
        let mut scale = vec![0f32; n];
        let mut sums = vec![0i32; n];
        for (c, row) in w.chunks_exact(k).enumerate() {
            let max = row.iter().fold(0f32, |m, v| m.max(v.abs()));
            let s = if max > 0.0 { max / 127.0 } else { 1.0 };
            scale[c] = s;
            let (p, col) = (c / PANEL, c % PANEL);
            let mut sum = 0i32;
            for (i, v) in row.iter().enumerate() {
                let q = (v / s).round().clamp(-127.0, 127.0) as i8;
                sum += q as i32;
                packed[((p * (k4 / 4) + i / 4) * PANEL + col) * 4 + i % 4] = q;
            }
            sums[c] = sum;
        }
        Self {
            k,
            n,
            k4,
            packed,
            scale,
            sum: sums,
        }
    }

    /// Outputs.
    pub(crate) fn out_features(&self) -> usize {
        self.n
    }

    /// `epi(x · wᵀ)` for `x` row-major `[m, k]`; returns `[m, n]` row-major.
    pub(crate) fn forward(&self, x: &[f32], m: usize, epi: Epilogue) -> Vec<f32> {
        assert_eq!(x.len(), m * self.k, "input is not [{m}, {}]", self.k);
        if let Epilogue::Bias(b) | Epilogue::BiasGelu(b) = epi {
            assert_eq!(b.len(), self.n, "bias is not [{}]", self.n);
        }
        // Not zeroed first: zeroing every output (tokens × outputs floats per layer) cost
        // a tenth of a long-passage run, and the kernels write every element.
        let mut y: Vec<f32> = Vec::with_capacity(m * self.n);
        let isa = cpu_isa();
        y.spare_capacity_mut()[..m * self.n]
            .par_chunks_mut(ROWS_PER_TASK * self.n)
            .zip(x.par_chunks(ROWS_PER_TASK * self.k))
            .for_each(|(y, x)| {
                let rows = x.len() / self.k;
                let (qa, sa) = self.quantize_rows(x, rows);
                self.matmul_on(isa, &qa, &sa, rows, y, epi);
            });
        // SAFETY: both kernels write every one of the m × n outputs.
        unsafe { y.set_len(m * self.n) };
        y
    }

    /// Rows quantized to u8 (what `vpdpbusd` takes on its unsigned side), `k4` wide (the
    /// padding meets zero weights), and each row's scale and zero point.
    fn quantize_rows(&self, x: &[f32], rows: usize) -> (Vec<u8>, Vec<RowScale>) {
        let mut qa = vec![0u8; rows * self.k4];
        let mut sa = vec![RowScale::default(); rows];
        for ((row, q), s) in x
            .chunks_exact(self.k)
            .zip(qa.chunks_exact_mut(self.k4))
            .zip(sa.iter_mut())
        {
            #[cfg(target_arch = "x86_64")]
            {
                let isa = cpu_isa();
                if isa >= CpuIsa::Avx512Vnni {
                    // SAFETY: the CPU has AVX-512 F and BW.
                    *s = unsafe { avx512::quantize_row(row, q) };
                    continue;
                }
                if isa >= CpuIsa::Avx2 {
                    // SAFETY: the CPU has AVX2.
                    *s = unsafe { avx2::quantize_row(row, q) };
                    continue;
                }
            }
            *s = quantize_row(row, q);
        }
        (qa, sa)
    }

    /// The product of quantized rows on the route of `isa`: VNNI, AVX2 (its integer sums
    /// are exact, like VNNI's, so both agree with the portable route bit for bit), or
    /// portable.
    fn matmul_on(
        &self,
        isa: CpuIsa,
        qa: &[u8],
        sa: &[RowScale],
        rows: usize,
        y: &mut [Out],
        epi: Epilogue,
    ) {
        assert!(
            isa <= CpuIsa::detected(),
            "int8 at {isa:?} on a CPU with {:?}",
            CpuIsa::detected()
        );
        #[cfg(target_arch = "x86_64")]
        {
            let j = &Job {
                l: self,
                qa,
                sa,
                epi,
            };
            if isa >= CpuIsa::Avx512Vnni {
                // SAFETY: the CPU has AVX-512 F, BW and VNNI (asserted above).
                return unsafe { avx512::matmul(j, rows, y) };
            } else if isa >= CpuIsa::Avx2 {
                // SAFETY: the CPU has AVX2 (asserted above).
                return unsafe { avx2::matmul(j, rows, y) };
            }
        }
        self.matmul_portable(qa, sa, rows, y, epi);
    }

    /// Scales one accumulated column back to f32.
    #[inline]
    fn dequantize(&self, acc: i32, row: RowScale, col: usize) -> f32 {
        (acc - row.zero * self.sum[col]) as f32 * row.scale * self.scale[col]
    }

    /// The same product in plain Rust: any CPU, and the reference the VNNI path is
    /// tested against.
    fn matmul_portable(
        &self,
        qa: &[u8],
        sa: &[RowScale],
        rows: usize,
        y: &mut [Out],
        epi: Epilogue,
    ) {
        let k4 = self.k4;
        for r in 0..rows {
            let a = &qa[r * k4..(r + 1) * k4];
            for c in 0..self.n {
                let (p, col) = (c / PANEL, c % PANEL);
                let panel = &self.packed[p * PANEL * k4..(p + 1) * PANEL * k4];
                let mut acc = 0i32;
                for g in 0..k4 / 4 {
                    let w = &panel[(g * PANEL + col) * 4..(g * PANEL + col) * 4 + 4];
                    for j in 0..4 {
                        acc += a[g * 4 + j] as i32 * w[j] as i32;
                    }
                }
                y[r * self.n + c].write(epi.apply(self.dequantize(acc, sa[r], c), c));
            }
        }
    }
}

/// One task's product, for the tiles: the layer, its quantized rows (`A`: u8 as VNNI takes
/// them, or widened to i16 for AVX2's `vpmaddwd`), their scales and what to do with the
/// outputs.
#[cfg(target_arch = "x86_64")]
struct Job<'a, A> {
    l: &'a QuantLinear,
    qa: &'a [A],
    sa: &'a [RowScale],
    epi: Epilogue<'a>,
}

/// One activation row's quantization: `x ≈ scale · (q − zero)`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct RowScale {
    scale: f32,
    zero: i32,
}

impl RowScale {
    /// The range `[min, max]` (widened to hold 0, so zero stays exact) over 255 levels.
    fn of(min: f32, max: f32) -> Self {
        let (min, max) = (min.min(0.0), max.max(0.0));
        // A range so small that its reciprocal would overflow is a row of zeros.
        let scale = (max - min) / 255.0;
        let scale = if (1.0 / scale).is_finite() {
            scale
        } else {
            1.0
        };
        let zero = (-min / scale).round_ties_even().clamp(0.0, 255.0) as i32;
        Self { scale, zero }
    }
}

/// One row to u8 and its scale, in plain Rust. Rounds ties to even, as the vector path's
/// conversion does, so the two agree bit for bit.
fn quantize_row(row: &[f32], q: &mut [u8]) -> RowScale {
    let (min, max) = row
        .iter()
        .fold((0f32, 0f32), |(lo, hi), &v| (lo.min(v), hi.max(v)));
    let rs = RowScale::of(min, max);
    let inv = 1.0 / rs.scale;
    for (q, v) in q.iter_mut().zip(row) {
        *q = ((v * inv).round_ties_even() as i32 + rs.zero).clamp(0, 255) as u8;
    }
    rs
}

/// Whether a tuned kernel (VNNI or AVX2) runs here; else the portable one.
pub(crate) fn tuned() -> bool {
    cpu_isa() >= CpuIsa::Avx2
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{Epilogue, Out, RowScale, PANEL};

    type Job<'a> = super::Job<'a, u8>;

    /// Rows per register tile; with three panels that is 24 accumulators of 32 registers.
    const MR: usize = 8;
    const NV: usize = 3;

    /// [`super::quantize_row`] sixteen values at a time.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn quantize_row(row: &[f32], q: &mut [u8]) -> RowScale {
        let k = row.len();
        let mask = |i: usize| -> __mmask16 {
            let live = (k - i).min(16);
            if live == 16 {
                !0
            } else {
                (1u16 << live) - 1
            }
        };
        // Masked-off lanes load as 0, which the range holds anyway.
        let (mut lo, mut hi) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        for i in (0..k).step_by(16) {
            let v = _mm512_maskz_loadu_ps(mask(i), row.as_ptr().add(i));
            lo = _mm512_min_ps(lo, v);
            hi = _mm512_max_ps(hi, v);
        }
        let rs = RowScale::of(_mm512_reduce_min_ps(lo), _mm512_reduce_max_ps(hi));
        let inv = _mm512_set1_ps(1.0 / rs.scale);
        let zero = _mm512_set1_epi32(rs.zero);
        let (floor, ceil) = (_mm512_setzero_si512(), _mm512_set1_epi32(255));
        for i in (0..k).step_by(16) {
            let m = mask(i);
            let v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, row.as_ptr().add(i)), inv);
            // The default rounding mode is to nearest, ties to even.
            let v = _mm512_add_epi32(_mm512_cvtps_epi32(v), zero);
            let v = _mm512_min_epi32(_mm512_max_epi32(v, floor), ceil);
            _mm512_mask_cvtusepi32_storeu_epi8(q.as_mut_ptr().add(i) as *mut _, m, v);
        }
        rs
    }

    /// `y = epi(dequant(qa · packedᵀ))` for `rows` quantized rows, tile by tile.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn matmul(j: &Job, rows: usize, y: &mut [Out]) {
        let l = j.l;
        let panels = l.n.div_ceil(PANEL);
        let mut p = 0;
        while p < panels {
            let nv = (panels - p).min(NV);
            let mut r = 0;
            while r < rows {
                let mr = (rows - r).min(MR);
                // Const-sized tiles keep the accumulators in registers; the edges take
                // the smaller instances.
                match (mr, nv) {
                    (MR, NV) => tile::<MR, NV>(j, r, p, y),
                    (MR, 2) => tile::<MR, 2>(j, r, p, y),
                    (MR, 1) => tile::<MR, 1>(j, r, p, y),
                    (4..=7, _) => {
                        edge::<4>(j, r, p, nv, y);
                        for rr in (r + 4)..(r + mr) {
                            edge::<1>(j, rr, p, nv, y);
                        }
                    }
                    _ => {
                        for rr in r..(r + mr) {
                            edge::<1>(j, rr, p, nv, y);
                        }
                    }
                }
                r += mr;
            }
            p += nv;
        }
    }

    /// Edge rows: `R` rows against `nv` panels, one panel at a time.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn edge<const R: usize>(j: &Job, r: usize, p: usize, nv: usize, y: &mut [Out]) {
        for pp in p..p + nv {
            tile::<R, 1>(j, r, pp, y);
        }
    }

    /// One `R`-row by `V`-panel tile over the whole inner dimension.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn tile<const R: usize, const V: usize>(j: &Job, r: usize, p: usize, y: &mut [Out]) {
        let Job { l, qa, sa, epi } = *j;
        let k4 = l.k4;
        let groups = k4 / 4;
        let mut acc = [[_mm512_setzero_si512(); V]; R];
        let a = qa.as_ptr().add(r * k4);
        let w = l.packed.as_ptr().add(p * PANEL * k4);
        for g in 0..groups {
            let mut b = [_mm512_setzero_si512(); V];
            for (v, b) in b.iter_mut().enumerate() {
                *b = _mm512_loadu_si512(w.add((v * groups + g) * PANEL * 4) as *const _);
            }
            // Each panel 1 KiB ahead: the weights stream from L3 or memory, as in the
            // f32 kernel (`dense::PREFETCH`); on the Intel Xeon, 1-6% over Qwen3-shaped
            // rotating weights. `wrapping_add`: past a panel's end the hint may point
            // outside the buffer, which a prefetch (never a fault) may do but `add` may not.
            for v in 0..V {
                _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add((v * groups + g + 16) * PANEL * 4));
            }
            for (i, acc) in acc.iter_mut().enumerate() {
                let x = _mm512_set1_epi32((a.add(i * k4 + g * 4) as *const i32).read_unaligned());
                for (acc, b) in acc.iter_mut().zip(b.iter()) {
                    *acc = _mm512_dpbusd_epi32(*acc, x, *b);
                }
            }
        }
        for (i, acc) in acc.iter().enumerate() {
            let row = r + i;
            let row_scale = _mm512_set1_ps(sa[row].scale);
            let row_zero = _mm512_set1_epi32(sa[row].zero);
            let dst = y.as_mut_ptr().add(row * l.n) as *mut f32;
            for (v, acc) in acc.iter().enumerate() {
                let c0 = (p + v) * PANEL;
                // The last panel may be partly padding: only its real columns are read
                // and written.
                let live = l.n.saturating_sub(c0).min(PANEL);
                let mask: __mmask16 = if live == PANEL {
                    !0
                } else {
                    (1u16 << live) - 1
                };
                let sum = _mm512_maskz_loadu_epi32(mask, l.sum.as_ptr().add(c0));
                let offset = _mm512_mullo_epi32(sum, row_zero);
                let scale = _mm512_maskz_loadu_ps(mask, l.scale.as_ptr().add(c0));
                let v = _mm512_cvtepi32_ps(_mm512_sub_epi32(*acc, offset));
                let v = _mm512_mul_ps(_mm512_mul_ps(v, row_scale), scale);
                let v = match epi {
                    Epilogue::None => v,
                    Epilogue::Bias(b) => {
                        _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, b.as_ptr().add(c0)))
                    }
                    Epilogue::BiasGelu(b) => {
                        let v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, b.as_ptr().add(c0)));
                        let mut lanes = [0f32; PANEL];
                        _mm512_storeu_ps(lanes.as_mut_ptr(), v);
                        // Sixteen at once: the compiler vectorizes the erf polynomial.
                        for x in &mut lanes {
                            *x = crate::kernels::gelu(*x);
                        }
                        _mm512_loadu_ps(lanes.as_ptr())
                    }
                };
                _mm512_mask_storeu_ps(dst.add(c0), mask, v);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{Epilogue, Out, RowScale, PANEL};

    type Job<'a> = super::Job<'a, i16>;

    /// Rows per register tile: 2 × 6 accumulators, two weight registers and a broadcast
    /// fit AVX2's 16.
    const MR: usize = 6;

    /// [`super::quantize_row`] eight values at a time. Without it, the portable body's
    /// rounding was a `rintf` call per value (baseline x86-64 has no vector rounding):
    /// a third of an AVX2 int8 run.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn quantize_row(row: &[f32], q: &mut [u8]) -> RowScale {
        let k = row.len();
        let full = k / 8 * 8;
        let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        for i in (0..full).step_by(8) {
            let v = _mm256_loadu_ps(row.as_ptr().add(i));
            lo = _mm256_min_ps(lo, v);
            hi = _mm256_max_ps(hi, v);
        }
        let (mut l, mut h) = ([0f32; 8], [0f32; 8]);
        _mm256_storeu_ps(l.as_mut_ptr(), lo);
        _mm256_storeu_ps(h.as_mut_ptr(), hi);
        let (mut min, mut max) = (0f32, 0f32);
        for (&a, &b) in l.iter().zip(&h) {
            (min, max) = (min.min(a), max.max(b));
        }
        for &v in &row[full..] {
            (min, max) = (min.min(v), max.max(v));
        }
        let rs = RowScale::of(min, max);
        let inv = 1.0 / rs.scale;
        let (vinv, zero) = (_mm256_set1_ps(inv), _mm256_set1_epi32(rs.zero));
        let (floor, ceil) = (_mm256_setzero_si256(), _mm256_set1_epi32(255));
        let mut lanes = [0i32; 8];
        for i in (0..full).step_by(8) {
            let v = _mm256_mul_ps(_mm256_loadu_ps(row.as_ptr().add(i)), vinv);
            // The default rounding mode is to nearest, ties to even, as the portable body.
            let v = _mm256_add_epi32(_mm256_cvtps_epi32(v), zero);
            let v = _mm256_min_epi32(_mm256_max_epi32(v, floor), ceil);
            _mm256_storeu_si256(lanes.as_mut_ptr() as *mut _, v);
            for (q, &v) in q[i..i + 8].iter_mut().zip(&lanes) {
                *q = v as u8;
            }
        }
        for (q, &v) in q[full..k].iter_mut().zip(&row[full..]) {
            *q = ((v * inv).round_ties_even() as i32 + rs.zero).clamp(0, 255) as u8;
        }
        rs
    }

    /// `y = epi(dequant(qa · packedᵀ))` for `rows` quantized rows: each panel's two
    /// 8-column halves in turn, the rows in near-equal tiles of at most [`MR`].
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn matmul(j: &super::Job<u8>, rows: usize, y: &mut [Out]) {
        let (l, qa) = (j.l, j.qa);
        // Widened once per task: every tile then broadcasts a group's four inputs with
        // one 64-bit load.
        let mut wide = vec![0i16; qa.len()];
        let full = qa.len() / 16 * 16;
        for i in (0..full).step_by(16) {
            let v = _mm256_cvtepu8_epi16(_mm_loadu_si128(qa.as_ptr().add(i) as *const _));
            _mm256_storeu_si256(wide.as_mut_ptr().add(i) as *mut _, v);
        }
        for i in full..qa.len() {
            wide[i] = qa[i] as i16;
        }
        let j = &Job {
            l,
            qa: &wide,
            sa: j.sa,
            epi: j.epi,
        };
        let tiles = rows.div_ceil(MR);
        for p in 0..l.n.div_ceil(PANEL) {
            for h in 0..2 {
                let c0 = p * PANEL + 8 * h;
                if c0 >= l.n {
                    break;
                }
                let mut r = 0;
                for t in 0..tiles {
                    let mr = (rows - r).div_ceil(tiles - t);
                    match mr {
                        1 => tile::<1>(j, r, p, h, y),
                        2 => tile::<2>(j, r, p, h, y),
                        3 => tile::<3>(j, r, p, h, y),
                        4 => tile::<4>(j, r, p, h, y),
                        5 => tile::<5>(j, r, p, h, y),
                        6 => tile::<6>(j, r, p, h, y),
                        _ => unreachable!("a tile of {mr} rows"),
                    }
                    r += mr;
                }
            }
        }
    }

    /// One `R`-row by 8-column tile (half `h` of panel `p`) over the whole inner
    /// dimension. Each 16 packed weight bytes (four columns' four inputs) widen to one
    /// register; `vpmaddwd` against a row's four inputs, repeated, leaves each column's
    /// two pair sums in adjacent lanes, which one `vphaddd` joins at the end.
    #[target_feature(enable = "avx2")]
    unsafe fn tile<const R: usize>(j: &Job, r: usize, p: usize, h: usize, y: &mut [Out]) {
        let Job { l, qa, sa, epi } = *j;
        let k4 = l.k4;
        let groups = k4 / 4;
        let mut lo = [_mm256_setzero_si256(); R];
        let mut hi = [_mm256_setzero_si256(); R];
        let a = qa.as_ptr().add(r * k4);
        let w = l.packed.as_ptr().add(p * PANEL * k4 + 8 * h * 4);
        for g in 0..groups {
            let wg = w.add(g * PANEL * 4);
            let w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(wg as *const _));
            let w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(wg.add(16) as *const _));
            // 1 KiB ahead, as the VNNI route does; `wrapping_add`: the hint may point past
            // the buffer, which a prefetch may do but `add` may not.
            _mm_prefetch::<_MM_HINT_T0>(wg.wrapping_add(16 * PANEL * 4));
            for i in 0..R {
                let x = _mm256_set1_epi64x((a.add(i * k4 + g * 4) as *const i64).read_unaligned());
                lo[i] = _mm256_add_epi32(lo[i], _mm256_madd_epi16(x, w0));
                hi[i] = _mm256_add_epi32(hi[i], _mm256_madd_epi16(x, w1));
            }
        }
        let c0 = p * PANEL + 8 * h;
        // Only the real columns of a partly padded last panel are read and written.
        let live = (l.n - c0).min(8);
        let mask = crate::isa::avx2_lanes(live);
        let sum = _mm256_maskload_epi32(l.sum.as_ptr().add(c0), mask);
        let scale = _mm256_maskload_ps(l.scale.as_ptr().add(c0), mask);
        let bias = match epi.bias() {
            Some(b) => _mm256_maskload_ps(b.as_ptr().add(c0), mask),
            None => _mm256_setzero_ps(),
        };
        for i in 0..R {
            let row = r + i;
            // [c0 c1 c4 c5 | c2 c3 c6 c7] after the pair sums, back into column order.
            let acc = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_hadd_epi32(lo[i], hi[i]));
            let offset = _mm256_mullo_epi32(sum, _mm256_set1_epi32(sa[row].zero));
            let v = _mm256_cvtepi32_ps(_mm256_sub_epi32(acc, offset));
            let v = _mm256_mul_ps(_mm256_mul_ps(v, _mm256_set1_ps(sa[row].scale)), scale);
            let v = match epi {
                Epilogue::None => v,
                Epilogue::Bias(_) => _mm256_add_ps(v, bias),
                Epilogue::BiasGelu(_) => {
                    let mut lanes = [0f32; 8];
                    _mm256_storeu_ps(lanes.as_mut_ptr(), _mm256_add_ps(v, bias));
                    // Eight at once: the compiler vectorizes the erf polynomial.
                    for x in &mut lanes {
                        *x = crate::kernels::gelu(*x);
                    }
                    _mm256_loadu_ps(lanes.as_ptr())
                }
            };
            crate::isa::avx2_store(y.as_mut_ptr().add(row * l.n + c0) as *mut f32, live, v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dense::tests::lcg;

    fn reference(x: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
        let mut y = vec![0f32; m * n];
        for r in 0..m {
            for c in 0..n {
                y[r * n + c] = (0..k).map(|i| x[r * k + i] * w[c * k + i]).sum::<f32>();
            }
        }
        y
    }

    /// The routes this CPU runs besides the portable one: AVX2, and VNNI where it has it.
    fn routes() -> Vec<CpuIsa> {
        [CpuIsa::Avx2, CpuIsa::Avx512Vnni]
            .into_iter()
            .filter(|&isa| isa <= CpuIsa::detected())
            .collect()
    }

    /// The product of quantized rows on `isa`'s route (the portable one at `Baseline`).
    fn product(
        q: &QuantLinear,
        isa: CpuIsa,
        (qa, sa): (&[u8], &[RowScale]),
        m: usize,
        epi: Epilogue,
    ) -> Vec<f32> {
        let mut y = vec![Out::new(f32::NAN); m * q.n];
        q.matmul_on(isa, qa, sa, m, &mut y, epi);
        // SAFETY: initialized above; the kernel overwrote them.
        y.iter().map(|v| unsafe { v.assume_init() }).collect()
    }

    /// Every shape edge (rows not a multiple of the tile or of a task, outputs not a
    /// multiple of a panel or of a half panel, inputs not a multiple of 4) lands close to
    /// the f32 product, on the portable route and on the AVX2 and VNNI ones (where the CPU
    /// has them), which agree with it exactly.
    #[test]
    fn matches_f32_product_on_every_edge() {
        let mut seed = 7;
        for &(m, n, k) in &[
            (1, 16, 4),
            (5, 17, 7),
            (7, 8, 12),
            (13, 29, 20),
            (9, 40, 384),
            (45, 50, 33),
            (70, 384, 64),
        ] {
            let x: Vec<f32> = (0..m * k).map(|_| lcg(&mut seed)).collect();
            let w: Vec<f32> = (0..n * k).map(|_| lcg(&mut seed) * 0.1).collect();
            let q = QuantLinear::new(&w, n, k);
            let want = reference(&x, &w, m, n, k);
            let got = q.forward(&x, m, Epilogue::None);
            let (qa, sa) = q.quantize_rows(&x, m);
            let portable = product(&q, CpuIsa::Baseline, (&qa, &sa), m, Epilogue::None);
            for isa in routes() {
                let routed = product(&q, isa, (&qa, &sa), m, Epilogue::None);
                assert_eq!(
                    routed, portable,
                    "{isa:?} and portable differ at {m}x{n}x{k}"
                );
            }
            if m <= ROWS_PER_TASK {
                assert_eq!(got, portable, "forward and portable differ at {m}x{n}x{k}");
            }
            let scale = want.iter().fold(0f32, |a, v| a.max(v.abs()));
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (g - w).abs() <= 0.02 * scale,
                    "{m}x{n}x{k} at {i}: {g} vs {w}"
                );
            }
        }
    }

    /// The bias and bias+GELU epilogues give what adding the bias (and GELU) after the
    /// product gives, on every route, the partly-padded last panel included.
    #[test]
    fn epilogues_match_the_product_then_bias_and_gelu() {
        let (m, n, k) = (11, 40, 24);
        let mut seed = 3;
        let x: Vec<f32> = (0..m * k).map(|_| lcg(&mut seed)).collect();
        let w: Vec<f32> = (0..n * k).map(|_| lcg(&mut seed) * 0.3).collect();
        let b: Vec<f32> = (0..n).map(|_| lcg(&mut seed)).collect();
        let q = QuantLinear::new(&w, n, k);
        let plain = q.forward(&x, m, Epilogue::None);
        let (qa, sa) = q.quantize_rows(&x, m);
        for (epi, f) in [
            (Epilogue::Bias(&b), (|v| v) as fn(f32) -> f32),
            (Epilogue::BiasGelu(&b), gelu as fn(f32) -> f32),
        ] {
            let got = q.forward(&x, m, epi);
            let portable = product(&q, CpuIsa::Baseline, (&qa, &sa), m, epi);
            for (i, g) in got.iter().enumerate() {
                let want = f(plain[i] + b[i % n]);
                assert!((g - want).abs() <= 1e-5, "{epi:?} at {i}: {g} vs {want}");
                assert_eq!(*g, portable[i], "{epi:?} at {i}");
            }
            for isa in routes() {
                let routed = product(&q, isa, (&qa, &sa), m, epi);
                assert_eq!(routed, portable, "{isa:?} {epi:?}");
            }
        }
    }

    /// A row whose range is below what a reciprocal can hold quantizes like zeros, on
    /// both paths alike, instead of overflowing.
    #[test]
    fn a_subnormal_range_is_a_row_of_zeros() {
        let q = QuantLinear::new(&[1.0; 4], 1, 4);
        let x = [1e-38, -1e-38, 0.0, 2e-38];
        assert_eq!(q.forward(&x, 1, Epilogue::None), vec![0.0]);
        let mut scalar = [0u8; 4];
        let rs = quantize_row(&x, &mut scalar);
        let (qa, sa) = q.quantize_rows(&x, 1);
        assert_eq!((&qa[..], sa[0]), (&scalar[..], rs));
    }

    /// Every route's row quantizer gives the portable one's bytes and scale, tails (rows
    /// not a multiple of 8 or 16) included.
    #[test]
    fn quantizers_agree_bit_for_bit() {
        let mut seed = 9;
        for k in [1, 7, 8, 17, 33, 384] {
            let row: Vec<f32> = (0..k).map(|_| lcg(&mut seed) * 3.0).collect();
            let mut want = vec![0u8; k];
            let rs = quantize_row(&row, &mut want);
            #[cfg(target_arch = "x86_64")]
            for isa in routes() {
                let mut got = vec![0u8; k];
                // SAFETY: `routes` lists only what the CPU has.
                let gs = unsafe {
                    match isa {
                        CpuIsa::Avx512Vnni => avx512::quantize_row(&row, &mut got),
                        _ => avx2::quantize_row(&row, &mut got),
                    }
                };
                assert_eq!((got, gs), (want.clone(), rs), "{isa:?}, k = {k}");
            }
        }
    }

    /// A zero row or column quantizes with scale 1, not a division by zero.
    #[test]
    fn zero_rows_and_columns_stay_zero() {
        let q = QuantLinear::new(&[0.0; 8], 2, 4);
        assert_eq!(
            q.forward(&[0.0, 0.0, 0.0, 0.0, 1.0, 2.0, 3.0, 4.0], 2, Epilogue::None),
            vec![0.0; 4]
        );
    }
}
