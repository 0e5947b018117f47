//! Scalar building blocks of the row kernels, written branch-free so that loops over
//! slices vectorize: erf and GELU, `exp`, and eight-lane sums and max.

/// erf(x) for f32, as a rational function on [-4, 4] (Eigen's `generic_fast_erf_float`,
/// the one PyTorch and TensorFlow CPU kernels use): max abs error ~1e-7, no `exp`.
///
/// Its multiply-adds are fused (`mul_add`): each rounds once, the same on every route (a
/// vector FMA, or `fmaf` on a CPU without one), so routes still agree bit for bit, and
/// GELU takes 18 vector operations instead of 29. GELU was a quarter of
/// int8's up product on VNNI; fused, long passages ran 1.03× faster in f32 and 1.05× in
/// int8 on AMX (benches/RESULTS.md).
#[inline(always)]
#[allow(clippy::excessive_precision)]
pub(super) fn erf(x: f32) -> f32 {
    let x = x.clamp(-4.0, 4.0);
    let x2 = x * x;
    let mut p = x2.mul_add(-2.72614225801306e-10, 2.77068142495902e-08);
    p = x2.mul_add(p, -2.10102402082508e-06);
    p = x2.mul_add(p, -5.69250639462346e-05);
    p = x2.mul_add(p, -7.34990630326855e-04);
    p = x2.mul_add(p, -2.95459980854025e-03);
    p = x2.mul_add(p, -1.60960333262415e-02);
    p *= x;
    let mut q = x2.mul_add(-1.45660718464996e-05, -2.13374055278905e-04);
    q = x2.mul_add(q, -1.68282697438203e-03);
    q = x2.mul_add(q, -7.37332916720468e-03);
    q = x2.mul_add(q, -1.42647390514189e-02);
    p / q
}

/// The exact (erf) GELU that BERT's `hidden_act: "gelu"` means, as `x/2 + x/2 · erf`
/// with one fused step, as [`erf`].
#[inline(always)]
pub(crate) fn gelu(x: f32) -> f32 {
    let h = 0.5 * x;
    h.mul_add(erf(x * std::f32::consts::FRAC_1_SQRT_2), h)
}

/// ln 2 split in two for [`exp`]'s Cody-Waite reduction (`HI` exact in few bits, so
/// `n · HI` is exact), shared with the vector copies.
pub(super) const LN2_HI: f32 = 0.693_359_4;
pub(super) const LN2_LO: f32 = -2.121_944_4e-4;
/// e^r's Taylor coefficients on the reduced range, highest degree first (Horner order).
pub(super) const EXP_POLY: [f32; 7] = [
    1.0 / 720.0,
    1.0 / 120.0,
    1.0 / 24.0,
    1.0 / 6.0,
    0.5,
    1.0,
    1.0,
];

/// e^x for x ≤ ~88 (softmax feeds it x − max ≤ 0): Cody-Waite reduction to
/// r ∈ [−ln2/2, ln2/2] and a degree-6 polynomial; relative error ~2e-7.
#[inline(always)]
pub(super) fn exp(x: f32) -> f32 {
    let x = x.clamp(-87.0, 88.0);
    let n = (x * std::f32::consts::LOG2_E + 0.5).floor();
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = EXP_POLY[0];
    for c in &EXP_POLY[1..] {
        p = p * r + c;
    }
    // 2^n by building the float's exponent field; n ∈ [−126, 127] after the clamp.
    p * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// Sum with eight independent accumulators: a plain `+=` loop is one serial chain that
/// strict IEEE order forbids the compiler to vectorize (this was most of softmax's time).
#[inline(always)]
pub(super) fn sum8(x: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = x.chunks_exact(8);
    let tail: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for k in 0..8 {
            acc[k] += c[k];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// Sum of squares with eight independent accumulators, as [`sum8`] (the norms' variance).
#[inline(always)]
pub(super) fn sum_sq8(x: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = x.chunks_exact(8);
    let tail: f32 = chunks.remainder().iter().map(|v| v * v).sum();
    for c in chunks {
        for k in 0..8 {
            acc[k] += c[k] * c[k];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// Max with eight lanes and a compare-select the compiler turns into `maxps`.
#[inline(always)]
pub(super) fn max8(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 8];
    let chunks = x.chunks_exact(8);
    let mut m = f32::NEG_INFINITY;
    for &v in chunks.remainder() {
        m = if v > m { v } else { m };
    }
    for c in chunks {
        for k in 0..8 {
            acc[k] = if c[k] > acc[k] { c[k] } else { acc[k] };
        }
    }
    acc.iter().fold(m, |m, &v| if v > m { v } else { m })
}
