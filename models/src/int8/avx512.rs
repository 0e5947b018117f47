//! The int8 product on AVX-512 VNNI: `vpdpbusd` against 8-row by 3-panel register tiles.

use std::arch::x86_64::*;

use super::{Epilogue, Out, RowScale, PANEL};
use crate::isa::{avx512_lanes, store_levels64};

pub(super) type Job<'a> = super::Job<'a, u8>;

/// Rows per register tile; with three panels that is 24 accumulators of 32 registers.
const MR: usize = 8;
const NV: usize = 3;

/// [`super::quantize_row`] sixteen values at a time, and 64 to a store
/// ([`store_levels64`]; only a row's tail takes masks): with each vector narrowed by its
/// own masked store, quantizing was a tenth of an int8 pass once AMX took the products.
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn quantize_row(row: &[f32], q: &mut [u8]) -> RowScale {
    let (k, x) = (row.len(), row.as_ptr());
    let full = k / 16 * 16;
    let tail = avx512_lanes(k - full);
    // Four of each running value, so that the range pass is not one chain of `minps`
    // (4 cycles each on Intel) a vector: min and max are exact in any order, so the range
    // keeps its bits. The tail's masked-off lanes load as 0, which the range holds anyway.
    let (mut lo, mut hi) = ([_mm512_setzero_ps(); 4], [_mm512_setzero_ps(); 4]);
    // v · 0 is 0 for a finite v and NaN for NaN or an infinity, which `minps`/`maxps`
    // would drop or keep depending on the operand order: summed, one bad lane shows.
    let (none, mut bad) = (_mm512_setzero_ps(), [_mm512_setzero_ps(); 4]);
    let mut take = |j: usize, v: __m512| {
        lo[j] = _mm512_min_ps(lo[j], v);
        hi[j] = _mm512_max_ps(hi[j], v);
        bad[j] = _mm512_fmadd_ps(v, none, bad[j]);
    };
    let quad = k / 64 * 64;
    for i in (0..quad).step_by(64) {
        for j in 0..4 {
            take(j, _mm512_loadu_ps(x.add(i + 16 * j)));
        }
    }
    for i in (quad..full).step_by(16) {
        take(0, _mm512_loadu_ps(x.add(i)));
    }
    take(1, _mm512_maskz_loadu_ps(tail, x.add(full)));
    let lo = _mm512_min_ps(_mm512_min_ps(lo[0], lo[1]), _mm512_min_ps(lo[2], lo[3]));
    let hi = _mm512_max_ps(_mm512_max_ps(hi[0], hi[1]), _mm512_max_ps(hi[2], hi[3]));
    let bad = _mm512_add_ps(_mm512_add_ps(bad[0], bad[1]), _mm512_add_ps(bad[2], bad[3]));
    if _mm512_reduce_add_ps(bad).is_nan() {
        q.fill(0);
        return RowScale::NON_FINITE;
    }
    let rs = RowScale::of(_mm512_reduce_min_ps(lo), _mm512_reduce_max_ps(hi));
    let inv = _mm512_set1_ps(1.0 / rs.scale);
    let zero = _mm512_set1_epi32(rs.zero);
    let (floor, ceil) = (_mm512_setzero_si512(), _mm512_set1_epi32(255));
    let level = |v: __m512| {
        // The default rounding mode is to nearest, ties to even.
        let v = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v, inv)), zero);
        _mm512_min_epi32(_mm512_max_epi32(v, floor), ceil)
    };
    for i in (0..quad).step_by(64) {
        let levels = [0, 16, 32, 48].map(|o| level(_mm512_loadu_ps(x.add(i + o))));
        store_levels64(q.as_mut_ptr().add(i), levels);
    }
    for i in (quad..k).step_by(16) {
        let m = avx512_lanes(k - i);
        let v = level(_mm512_maskz_loadu_ps(m, x.add(i)));
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
    let Job {
        l,
        qa,
        lda,
        sa,
        epi: _,
        ldy,
    } = *j;
    let (groups, stride) = (l.groups, l.panel_stride);
    let mut acc = [[_mm512_setzero_si512(); V]; R];
    let a = qa.as_ptr().add(r * lda);
    let w = l.w.as_ptr().add(p * stride);
    for g in 0..groups {
        let mut b = [_mm512_setzero_si512(); V];
        for (v, b) in b.iter_mut().enumerate() {
            *b = _mm512_loadu_si512(w.add(v * stride + g * PANEL * 4) as *const _);
        }
        // Each panel 1 KiB ahead: the weights stream from L3 or memory, as in the
        // f32 kernel (`dense::PREFETCH`); on the Intel Xeon, 1-6% over Qwen3-shaped
        // rotating weights. `wrapping_add`: past a panel's end the hint may point
        // outside the buffer, which a prefetch (never a fault) may do but `add` may not.
        for v in 0..V {
            _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add(v * stride + (g + 16) * PANEL * 4));
        }
        for (i, acc) in acc.iter_mut().enumerate() {
            let x = _mm512_set1_epi32((a.add(i * lda + g * 4) as *const i32).read_unaligned());
            for (acc, b) in acc.iter_mut().zip(b.iter()) {
                *acc = _mm512_dpbusd_epi32(*acc, x, *b);
            }
        }
    }
    // By value: read by reference here, the accumulators lived on the stack, zeroed by a
    // 1.5 KiB `memset` at every tile and loaded back before the loop (`perf annotate`).
    for (i, acc) in acc.into_iter().enumerate() {
        let row = r + i;
        let dst = y.as_mut_ptr().add(row * ldy) as *mut f32;
        for (v, acc) in acc.into_iter().enumerate() {
            store(j, sa[row], acc, (p + v) * PANEL, dst);
        }
    }
}

/// Scales one row's sums for the panel at column `c0` back to f32, applies the epilogue
/// and stores the panel's real columns into the output row `dst` (the last panel may be
/// partly padding: only its real columns are read and written). The VNNI and AMX tiles
/// share it.
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn store(j: &Job, row: RowScale, acc: __m512i, c0: usize, dst: *mut f32) {
    let (l, epi) = (j.l, j.epi);
    let mask = avx512_lanes(l.n.saturating_sub(c0));
    let sum = _mm512_maskz_loadu_epi32(mask, l.sum.as_ptr().add(c0));
    let offset = _mm512_mullo_epi32(sum, _mm512_set1_epi32(row.zero));
    let scale = _mm512_maskz_loadu_ps(mask, l.scale.as_ptr().add(c0));
    let v = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc, offset));
    let v = _mm512_mul_ps(_mm512_mul_ps(v, _mm512_set1_ps(row.scale)), scale);
    let v = match epi {
        Epilogue::None => v,
        Epilogue::Bias(b) => _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, b.as_ptr().add(c0))),
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
