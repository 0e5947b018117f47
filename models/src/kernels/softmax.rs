//! One attention row's softmax, in place: intrinsics on AVX-512 and AVX2, else a plain
//! body that vectorizes.

use super::scalar::{exp, max8, sum8, EXP_POLY, LN2_HI, LN2_LO};

#[inline(always)]
pub(super) fn softmax_body(x: &mut [f32]) {
    let max = max8(x);
    for v in x.iter_mut() {
        *v = exp(*v - max);
    }
    let inv = 1.0 / sum8(x);
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// One attention row's softmax, in place, on the CPU's widest route: intrinsics on
/// AVX-512 and AVX2, else the plain body. Built for AVX2, the body vectorizes the
/// reduction and polynomial but turns `n` into 2^n one lane at a time (eight
/// `vcvttss2si` per vector, for the saturating `as i32`); softmax was a quarter of a long
/// passage's time in int8 on AVX-512 and 9% of f32 on AVX2.
pub(crate) fn softmax_row(x: &mut [f32]) {
    softmax_row_on(crate::isa::cpu_isa(), x)
}

/// [`softmax_row`] on `isa`'s route, which the caller knows the CPU has; tests walk every
/// route this CPU runs.
pub(super) fn softmax_row_on(isa: crate::isa::CpuIsa, x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if isa >= crate::isa::CpuIsa::Avx512 {
            // SAFETY: the CPU has AVX-512 F.
            return unsafe { avx512::softmax_row(x) };
        }
        if isa >= crate::isa::CpuIsa::Avx2 {
            // SAFETY: the CPU has AVX2 and FMA.
            return unsafe { avx2::softmax_row(x) };
        }
    }
    let _ = isa;
    softmax_body(x)
}

/// One attention row's softmax as the u8 levels the int8 product takes
/// (`int8::attend`): `q` gets e^(x − max x) · 255, rounded, and the sum of the
/// exponentials comes back, so the row's probabilities are `q / (255 · sum)`. Two passes
/// where [`softmax_row`] takes three: the largest exponential is e⁰ = 1, so the levels
/// need no range of their own, and the product's scale takes the 1 / sum. The
/// exponentials take a shorter polynomial than [`softmax_row`]'s, as exact as 8-bit
/// levels need.
///
/// # Safety
/// The CPU has AVX-512 F and BW.
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn softmax_levels(x: &[f32], q: &mut [u8]) -> f32 {
    assert_eq!(
        x.len(),
        q.len(),
        "{} scores for {} levels",
        x.len(),
        q.len()
    );
    // SAFETY: the caller's contract.
    unsafe { avx512::softmax_levels(x, q) }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{EXP_POLY, LN2_HI, LN2_LO};

    /// The lanes of `i..i + 8` that lie inside a row of `n`.
    #[target_feature(enable = "avx2")]
    fn live(n: usize, i: usize) -> __m256i {
        crate::isa::avx2_lanes(n - i)
    }

    /// [`super::exp`], eight at a time: the same clamp, reduction and polynomial, and 2^n
    /// by building the exponent field (n + 127 ∈ [1, 254] after the clamp).
    #[target_feature(enable = "avx2,fma")]
    fn exp8(x: __m256) -> __m256 {
        // NaN as the second operand: `maxps`/`minps` return it, as the scalar clamp does.
        let x = _mm256_min_ps(
            _mm256_set1_ps(88.0),
            _mm256_max_ps(_mm256_set1_ps(-87.0), x),
        );
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
        );
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
        let mut p = _mm256_set1_ps(EXP_POLY[0]);
        for &c in &EXP_POLY[1..] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        let e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
        _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32::<23>(e)))
    }

    /// The eight lanes folded by `f` (max or add) into lane 0.
    #[target_feature(enable = "avx2")]
    fn fold(v: __m256, f: impl Fn(__m128, __m128) -> __m128) -> f32 {
        let v = f(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let v = f(v, _mm_movehl_ps(v, v));
        _mm_cvtss_f32(f(v, _mm_shuffle_ps::<0b01>(v, v)))
    }

    /// Full vectors load and store plainly and only a row's last partial vector takes
    /// the masks: on Zen 2 and 3 a masked 256-bit store (`vmaskmovps`) is microcoded, and
    /// masking every vector left this at 8.6% of a long f32 run on a Zen 3.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn softmax_row(x: &mut [f32]) {
        let (n, p) = (x.len(), x.as_mut_ptr());
        let full = n / 8 * 8;
        let tail = (full < n).then(|| live(n, full));
        let ninf = _mm256_set1_ps(f32::NEG_INFINITY);
        let mut max = ninf;
        for i in (0..full).step_by(8) {
            max = _mm256_max_ps(max, _mm256_loadu_ps(p.add(i)));
        }
        if let Some(m) = tail {
            // Lanes past the row's end load 0; −∞ keeps them out of the max.
            let v = _mm256_blendv_ps(
                ninf,
                _mm256_maskload_ps(p.add(full), m),
                _mm256_castsi256_ps(m),
            );
            max = _mm256_max_ps(max, v);
        }
        let max = _mm256_set1_ps(fold(max, |a, b| _mm_max_ps(a, b)));
        let mut sum = _mm256_setzero_ps();
        for i in (0..full).step_by(8) {
            let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p.add(i)), max));
            sum = _mm256_add_ps(sum, e);
            _mm256_storeu_ps(p.add(i), e);
        }
        if let Some(m) = tail {
            let e = exp8(_mm256_sub_ps(_mm256_maskload_ps(p.add(full), m), max));
            // e^(0 − max) in the lanes past the end must not reach the sum.
            sum = _mm256_add_ps(sum, _mm256_and_ps(e, _mm256_castsi256_ps(m)));
            _mm256_maskstore_ps(p.add(full), m, e);
        }
        let inv = _mm256_set1_ps(1.0 / fold(sum, |a, b| _mm_add_ps(a, b)));
        for i in (0..full).step_by(8) {
            _mm256_storeu_ps(p.add(i), _mm256_mul_ps(_mm256_loadu_ps(p.add(i)), inv));
        }
        if let Some(m) = tail {
            let v = _mm256_mul_ps(_mm256_maskload_ps(p.add(full), m), inv);
            _mm256_maskstore_ps(p.add(full), m, v);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{EXP_POLY, LN2_HI, LN2_LO};
    use crate::isa::store_levels64;

    /// Lanes `i..` that exist in a row of `n`.
    #[inline(always)]
    fn live(n: usize, i: usize) -> __mmask16 {
        crate::isa::avx512_lanes(n - i)
    }

    /// [`super::exp`], sixteen at a time: the same reduction and polynomial, and 2^n by
    /// `vscalefps`.
    #[target_feature(enable = "avx512f")]
    fn exp16(x: __m512) -> __m512 {
        exp16_to(x, &EXP_POLY)
    }

    /// e^r's Taylor polynomial to the fourth degree, highest first: on the reduced range
    /// (|r| ≤ ln 2 / 2) within 6e-5 of e^x relative, where a level step is 1 / 255.
    const LEVEL_POLY: [f32; 5] = [1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0];

    /// [`exp16`] with the polynomial `poly` (Horner order) on the reduced range.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn exp16_to(x: __m512, poly: &[f32]) -> __m512 {
        // NaN as the second operand: `maxps`/`minps` return it, as the scalar clamp does.
        let x = _mm512_min_ps(
            _mm512_set1_ps(88.0),
            _mm512_max_ps(_mm512_set1_ps(-87.0), x),
        );
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
        );
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
        let mut p = _mm512_set1_ps(poly[0]);
        for &c in &poly[1..] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
        }
        _mm512_scalef_ps(p, n)
    }

    /// The row's largest value in every lane.
    #[target_feature(enable = "avx512f")]
    unsafe fn max_of(x: &[f32]) -> __m512 {
        let (n, p) = (x.len(), x.as_ptr());
        let mut max = _mm512_set1_ps(f32::NEG_INFINITY);
        for i in (0..n).step_by(16) {
            let v = _mm512_mask_loadu_ps(max, live(n, i), p.add(i));
            max = _mm512_max_ps(max, v);
        }
        _mm512_set1_ps(_mm512_reduce_max_ps(max))
    }

    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn softmax_levels(x: &[f32], q: &mut [u8]) -> f32 {
        let (n, p, out) = (x.len(), x.as_ptr(), q.as_mut_ptr());
        let max = max_of(x);
        let (mut sum, levels) = (_mm512_setzero_ps(), _mm512_set1_ps(255.0));
        let exp = |i: usize| exp16_to(_mm512_sub_ps(_mm512_loadu_ps(p.add(i)), max), &LEVEL_POLY);
        // To nearest (the default mode); at most 255 · e⁰ = 255. (A row with a non-finite
        // score has a NaN sum, so its levels do not matter.)
        let level = |e: __m512| _mm512_cvtps_epi32(_mm512_mul_ps(e, levels));
        // Whole runs of 64 take one store ([`store_levels64`]). With a narrowing store a
        // vector, as the tail below still takes, this was 9.8% of a long int8 pass on an
        // Ice Lake Xeon (`perf`), a quarter of it at that store. The sum still adds the
        // vectors in order, so it keeps its bits.
        let quad = n / 64 * 64;
        for i in (0..quad).step_by(64) {
            let e = [0, 16, 32, 48].map(|o| exp(i + o));
            for e in e {
                sum = _mm512_add_ps(sum, e);
            }
            store_levels64(out.add(i), e.map(level));
        }
        for i in (quad..n).step_by(16) {
            let m = live(n, i);
            let e = exp16_to(
                _mm512_sub_ps(_mm512_maskz_loadu_ps(m, p.add(i)), max),
                &LEVEL_POLY,
            );
            sum = _mm512_mask_add_ps(sum, m, sum, e);
            // To nearest (the default mode); the unsigned narrowing saturates at 255.
            let l = _mm512_cvtps_epi32(_mm512_mul_ps(e, levels));
            _mm512_mask_cvtusepi32_storeu_epi8(out.add(i) as *mut _, m, l);
        }
        _mm512_reduce_add_ps(sum)
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn softmax_row(x: &mut [f32]) {
        let (n, p) = (x.len(), x.as_mut_ptr());
        let max = max_of(x);
        let mut sum = _mm512_setzero_ps();
        for i in (0..n).step_by(16) {
            let m = live(n, i);
            let e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, p.add(i)), max));
            sum = _mm512_mask_add_ps(sum, m, sum, e);
            _mm512_mask_storeu_ps(p.add(i), m, e);
        }
        let inv = _mm512_set1_ps(1.0 / _mm512_reduce_add_ps(sum));
        for i in (0..n).step_by(16) {
            let m = live(n, i);
            let v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, p.add(i)), inv);
            _mm512_mask_storeu_ps(p.add(i), m, v);
        }
    }
}
