//! The int8 product on AVX2: both sides widened to i16, pairs summed by `vpmaddwd` (exact).

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
    // v · 0 is 0 for a finite v and NaN for NaN or an infinity, which `minps`/`maxps`
    // would drop or keep depending on the operand order: summed, one bad lane shows.
    let (none, mut bad) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    for i in (0..full).step_by(8) {
        let v = _mm256_loadu_ps(row.as_ptr().add(i));
        lo = _mm256_min_ps(lo, v);
        hi = _mm256_max_ps(hi, v);
        bad = _mm256_add_ps(bad, _mm256_mul_ps(v, none));
    }
    let (mut l, mut h, mut b) = ([0f32; 8], [0f32; 8], [0f32; 8]);
    _mm256_storeu_ps(l.as_mut_ptr(), lo);
    _mm256_storeu_ps(h.as_mut_ptr(), hi);
    _mm256_storeu_ps(b.as_mut_ptr(), bad);
    if b.iter().chain(&row[full..]).any(|v| !v.is_finite()) {
        q.fill(0);
        return RowScale::NON_FINITE;
    }
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
        lda: j.lda,
        sa: j.sa,
        epi: j.epi,
        ldy: j.ldy,
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
// FMA for the epilogue's GELU (`kernels::gelu` fuses its multiply-adds; the route runs
// where `CpuIsa::Avx2` found both).
#[target_feature(enable = "avx2,fma")]
unsafe fn tile<const R: usize>(j: &Job, r: usize, p: usize, h: usize, y: &mut [Out]) {
    let Job {
        l,
        qa,
        lda,
        sa,
        epi,
        ldy,
    } = *j;
    let groups = l.groups;
    let mut lo = [_mm256_setzero_si256(); R];
    let mut hi = [_mm256_setzero_si256(); R];
    let a = qa.as_ptr().add(r * lda);
    let w = l.w.as_ptr().add(p * l.panel_stride + 8 * h * 4);
    for g in 0..groups {
        let wg = w.add(g * PANEL * 4);
        let w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(wg as *const _));
        let w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(wg.add(16) as *const _));
        // 1 KiB ahead, as the VNNI route does; `wrapping_add`: the hint may point past
        // the buffer, which a prefetch may do but `add` may not.
        _mm_prefetch::<_MM_HINT_T0>(wg.wrapping_add(16 * PANEL * 4));
        for i in 0..R {
            let x = _mm256_set1_epi64x((a.add(i * lda + g * 4) as *const i64).read_unaligned());
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
        crate::isa::avx2_store(y.as_mut_ptr().add(row * ldy + c0) as *mut f32, live, v);
    }
}
