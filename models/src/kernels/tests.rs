//! The kernels against reference paths: the same results through plain candle ops or
//! plain loops (softmax and packed attention on each route this CPU runs).

use candle_core::{DType, Device, Tensor, D};

use super::{
    packed::attention_on,
    scalar::{erf, exp},
    softmax::{softmax_body, softmax_row_on},
    *,
};
use crate::attention;
use Products::F32;

/// The largest absolute difference between two tensors of one shape (the encoder's
/// tests use it too).
pub(crate) fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(D::Minus1)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

fn randn(shape: &[usize], scale: f64) -> Tensor {
    (Tensor::randn(0f32, 1f32, shape, &Device::Cpu).unwrap() * scale).unwrap()
}

/// N(0, 1) values, the same on every run (Box-Muller over the dense tests' LCG), for a
/// check whose bound sits near f32's own rounding of its inputs: candle's CPU `randn`
/// cannot be seeded.
fn seeded_randn(shape: &[usize], mut seed: u64) -> Tensor {
    let n: usize = shape.iter().product();
    let mut uniform = || (crate::dense::tests::lcg(&mut seed) + 1.0).max(1e-7) / 2.0;
    let values: Vec<f32> = (0..n)
        .map(|_| {
            let (u, v) = (uniform(), uniform());
            (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
        })
        .collect();
    Tensor::from_vec(values, shape, &Device::Cpu).unwrap()
}

#[test]
fn erf_matches_libm_closely() {
    let mut worst = 0f64;
    for i in -6000..=6000 {
        let x = i as f64 / 1000.0;
        let want = libm_erf(x);
        worst = worst.max((erf(x as f32) as f64 - want).abs());
    }
    assert!(worst < 5e-7, "worst erf error {worst}");
}

/// GELU against GELU in f64 through [`libm_erf`], relative where |x| > 1.
#[test]
fn gelu_matches_f64_closely() {
    let mut worst = 0f64;
    for i in -8000..=8000 {
        let x = i as f64 / 1000.0;
        let want = 0.5 * x * (1.0 + libm_erf(x / std::f64::consts::SQRT_2));
        worst = worst.max((gelu(x as f32) as f64 - want).abs() / x.abs().max(1.0));
    }
    assert!(worst < 1e-6, "worst GELU error {worst}");
}

/// erf in f64, independent of the kernel's rational approximation: the Taylor series
/// where it converges without cancellation (|x| ≤ 3), the asymptotic erfc beyond.
fn libm_erf(x: f64) -> f64 {
    let a = x.abs();
    if a > 3.0 {
        let x2 = a * a;
        let series = 1.0 - 1.0 / (2.0 * x2) + 3.0 / (4.0 * x2 * x2) - 15.0 / (8.0 * x2 * x2 * x2);
        let erfc = (-x2).exp() / (a * std::f64::consts::PI.sqrt()) * series;
        return x.signum() * (1.0 - erfc);
    }
    let (mut sum, mut term, mut n) = (0f64, x, 0f64);
    while term.abs() > 1e-18 {
        sum += term / (2.0 * n + 1.0);
        n += 1.0;
        term *= -x * x / n;
    }
    sum * 2.0 / std::f64::consts::PI.sqrt()
}

#[test]
fn exp_matches_std_closely() {
    let mut worst = 0f32;
    for i in -8700..=100 {
        let x = i as f32 / 100.0;
        let rel = ((exp(x) - x.exp()) / x.exp()).abs();
        worst = worst.max(rel);
    }
    assert!(worst < 1e-6, "worst relative exp error {worst}");
    assert!(exp(f32::NEG_INFINITY) < 1e-37);
}

/// The int8 attention's softmax levels: each within half a level (and the polynomial's
/// error) of 255 · e^(x − max), and the returned sum within 1e-4 of Σ e^(x − max) in
/// f64, on rows of every length around the vector width, a far-below-max score included
/// (in a row of one, it is the max).
#[cfg(target_arch = "x86_64")]
#[test]
fn softmax_levels_round_the_exponentials() {
    if crate::isa::cpu_isa() < crate::isa::CpuIsa::Avx512Vnni {
        eprintln!("skipped: no AVX-512 VNNI (the only route that takes levels) here");
        return;
    }
    for n in [1, 5, 15, 16, 17, 33, 300] {
        let mut row: Vec<f32> = randn(&[n], 4.0).to_vec1().unwrap();
        row[n / 2] = -1e4;
        let mut q = vec![0u8; n];
        // SAFETY: the CPU has AVX-512 F and BW (VNNI's level implies both).
        let sum = unsafe { super::softmax_levels(&row, &mut q) };
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
        let e: Vec<f64> = row.iter().map(|&v| (v as f64 - max).exp()).collect();
        let want: f64 = e.iter().sum();
        assert!(
            ((sum as f64) - want).abs() <= 1e-4 * want,
            "n={n}: sum {sum} vs {want}"
        );
        for (i, (&l, e)) in q.iter().zip(&e).enumerate() {
            assert!(
                (l as f64 - 255.0 * e).abs() <= 0.52,
                "n={n}: level {l} at {i} for 255 · {e}"
            );
        }
        if n > 1 {
            assert_eq!(q[n / 2], 0, "n={n}: a score far below the max has a level");
        }
        assert!(q.contains(&255), "n={n}: the max is not at level 255");
    }
}

/// Every softmax route this CPU runs (AVX2, AVX-512, the plain body) agrees with the
/// plain body on rows of every length around both vector widths, a far-below-max
/// score included.
#[test]
fn softmax_paths_agree() {
    use crate::isa::CpuIsa;
    let routes: Vec<CpuIsa> = [CpuIsa::Baseline, CpuIsa::Avx2, CpuIsa::Avx512]
        .into_iter()
        .filter(|&isa| isa <= CpuIsa::detected())
        .collect();
    for isa in routes {
        for n in [1, 5, 7, 8, 9, 15, 16, 17, 33, 300] {
            let row: Vec<f32> = randn(&[n], 4.0).to_vec1().unwrap();
            let mut row = row;
            row[n / 2] = -1e4;
            if n == 33 || n == 9 {
                // A NaN score stays NaN on every path (the clamp must not swallow
                // it), wherever it sits in a vector.
                for at in [0, 3, n - 1] {
                    let mut bad = row.clone();
                    bad[at] = f32::NAN;
                    let mut fast = bad.clone();
                    softmax_row_on(isa, &mut fast);
                    softmax_body(&mut bad);
                    assert!(
                        fast.iter().all(|v| v.is_nan()) && bad.iter().all(|v| v.is_nan()),
                        "{isa:?} n={n}: NaN at {at} lost"
                    );
                }
            }
            let mut want = row.clone();
            softmax_body(&mut want);
            let mut got = row.clone();
            softmax_row_on(isa, &mut got);
            let sum: f32 = got.iter().sum();
            assert!((sum - 1.0).abs() < 1e-5, "{isa:?} n={n}: sums to {sum}");
            for (g, w) in got.iter().zip(&want) {
                assert!(
                    (g - w).abs() <= 1e-6 * w.max(1e-3),
                    "{isa:?} n={n}: {g} vs {w}"
                );
            }
        }
    }
}

#[test]
fn bias_gelu_matches_candle() {
    let x = randn(&[37, 48], 3.0);
    let b = randn(&[48], 1.0);
    let want = x.broadcast_add(&b).unwrap().gelu_erf().unwrap();
    let got = bias_gelu(&x, &b, CardOps::Gpulane).unwrap();
    assert!(max_diff(&got, &want) < 1e-5);
}

#[test]
fn add_norm_matches_candle() {
    let x = randn(&[29, 32], 2.0);
    let r = randn(&[29, 32], 2.0);
    let params = randn(&[3, 32], 1.0);
    let got = add_norm(&x, &r, &params, 1e-12, CardOps::Gpulane).unwrap();
    let (bias, g, beta) = (
        params.get(0).unwrap(),
        params.get(1).unwrap(),
        params.get(2).unwrap(),
    );
    let sum = (x.broadcast_add(&bias).unwrap() + &r).unwrap();
    let want = candle_nn::ops::layer_norm_slow(&sum, &g, &beta, 1e-12).unwrap();
    assert!(max_diff(&got, &want) < 1e-5);
}

/// The in-place rows the dense kernel fuses give the separate op's bits.
#[test]
fn add_norm_rows_give_the_op_bits() {
    let x = randn(&[29, 40], 2.0);
    let r = randn(&[29, 40], 2.0);
    let params = randn(&[3, 40], 1.0);
    let want = add_norm(&x, &r, &params, 1e-12, CardOps::Gpulane).unwrap();
    let mut rows = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let res = r.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let p = params.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    add_norm_rows(&mut rows, &res, &p, 1e-12);
    let want = want.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert!(rows
        .iter()
        .zip(&want)
        .all(|(g, w)| g.to_bits() == w.to_bits()));
}

#[test]
fn packed_attention_matches_padded_attention() {
    let (heads, d) = (4, 8);
    let h = heads * d;
    // 300 rows: two query blocks of GLOBAL_BLOCK, the second partial.
    let lens = [7usize, 1, 300, 12, 5];
    let starts: Vec<usize> = lens
        .iter()
        .scan(0, |s, &l| {
            let start = *s;
            *s += l;
            Some(start)
        })
        .collect();
    let n: usize = lens.iter().sum();
    let qkv = randn(&[n, 3 * h], 1.0);
    let got = attention(&qkv, &starts, &lens, Heads::mha(h, heads), Mask::Full, F32).unwrap();
    // Reference: each sequence on its own with plain candle ops.
    for (&s, &len) in starts.iter().zip(&lens) {
        let rows = qkv.narrow(0, s, len).unwrap();
        let part = |k: usize| {
            rows.narrow(1, k * h, h)
                .unwrap()
                .reshape((len, heads, d))
                .unwrap()
                .transpose(0, 1)
                .unwrap()
                .contiguous()
                .unwrap()
        };
        let (q, k, v) = (part(0), part(1), part(2));
        let p = candle_nn::ops::softmax(&q.matmul(&k.t().unwrap()).unwrap(), D::Minus1).unwrap();
        let want = p
            .matmul(&v)
            .unwrap()
            .transpose(0, 1)
            .unwrap()
            .reshape((len, h))
            .unwrap();
        let diff = max_diff(&got.narrow(0, s, len).unwrap(), &want);
        assert!(diff < 1e-5, "sequence at {s}: max diff {diff}");
    }
}

#[test]
fn gated_gelu_matches_candle() {
    let x = randn(&[37, 2 * 24], 2.0);
    let got = gated_gelu(&x, CardOps::Gpulane).unwrap();
    let want = (x.narrow(1, 0, 24).unwrap().gelu_erf().unwrap() * x.narrow(1, 24, 24)).unwrap();
    assert_eq!(got.dims(), &[37, 24]);
    assert!(max_diff(&got, &want) < 1e-5);
}

#[test]
fn gated_silu_matches_candle() {
    // ±12: SiLU's tails, where exp's clamp and the division must still agree.
    let x = randn(&[37, 2 * 24], 12.0);
    let got = gated_silu(&x).unwrap();
    let want = (x.narrow(1, 0, 24).unwrap().silu().unwrap() * x.narrow(1, 24, 24)).unwrap();
    assert_eq!(got.dims(), &[37, 24]);
    let scale = max_diff(&want, &want.zeros_like().unwrap());
    assert!(max_diff(&got, &want) < 1e-5 * scale.max(1.0));
}

/// A sliding window in the packed kernel is the padded path's band mask: the same
/// result for sequences shorter than the window, a little longer, and long enough for
/// several query blocks (blocks are max(w, 16) rows; 70 rows make five, the last
/// partial).
#[test]
fn windowed_packed_attention_matches_banded_padded_attention() {
    // 5: blocks of the 16-row floor; 24: blocks of w rows, as real windows (64) give.
    for window in [5, 24] {
        check_windowed_attention(window);
    }
}

fn check_windowed_attention(window: usize) {
    let (heads, d) = (2, 8);
    let h = heads * d;
    let lens = [70usize, 4, 9, 33];
    let t = 70;
    let n: usize = lens.iter().sum();
    let starts = [0usize, 70, 74, 83];
    let qkv = randn(&[n, 3 * h], 1.0);
    let got = attention(
        &qkv,
        &starts,
        &lens,
        Heads::mha(h, heads),
        Mask::Window(window),
        F32,
    )
    .unwrap();
    let band = band(t, window, DType::F32, &Device::Cpu).unwrap();
    for (&s, &len) in starts.iter().zip(&lens) {
        // Pad the sequence to t rows; padded keys are masked out.
        let rows = qkv.narrow(0, s, len).unwrap();
        let rows = Tensor::cat(
            &[
                rows,
                Tensor::zeros((t - len, 3 * h), DType::F32, &Device::Cpu).unwrap(),
            ],
            0,
        )
        .unwrap();
        let part = |k: usize| {
            rows.narrow(1, k * h, h)
                .unwrap()
                .reshape((1, t, heads, d))
                .unwrap()
                .transpose(1, 2)
                .unwrap()
                .contiguous()
                .unwrap()
        };
        let (q, k, v) = (part(0), part(1), part(2));
        let mask: Vec<f32> = (0..t)
            .map(|j| if j < len { 0.0 } else { f32::NEG_INFINITY })
            .collect();
        let mask = Tensor::from_vec(mask, (1, t), &Device::Cpu).unwrap();
        let scores = q.matmul(&k.t().unwrap()).unwrap();
        let bias = mask
            .reshape((1, 1, 1, t))
            .unwrap()
            .broadcast_add(&band)
            .unwrap();
        let p = masked_softmax(scores, &bias).unwrap();
        let want = p
            .matmul(&v)
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .reshape((t, h))
            .unwrap()
            .narrow(0, 0, len)
            .unwrap();
        let diff = max_diff(&got.narrow(0, s, len).unwrap(), &want);
        assert!(
            diff < 1e-5,
            "window {window}, sequence at {s}: max diff {diff}"
        );
    }
    // The window matters: without it the long sequence comes out different.
    let full = attention(&qkv, &starts, &lens, Heads::mha(h, heads), Mask::Full, F32).unwrap();
    assert!(
        max_diff(
            &full.narrow(0, 0, 70).unwrap(),
            &got.narrow(0, 0, 70).unwrap()
        ) > 1e-3
    );
}

/// An additive attention term by (head, query, key).
type BiasFn<'a> = &'a dyn Fn(usize, usize, usize) -> f32;

/// Plain loops over one sequence's packed rows, for any [`Heads`] and an additive
/// bias per (head, query, key) (−∞ hides a key).
fn naive_attention(rows: &[f32], len: usize, heads: Heads, bias: BiasFn) -> Vec<f32> {
    let w = heads.qkv_width();
    let (h, d) = (heads.q * heads.d, heads.d);
    let mut out = vec![0f32; len * h];
    for head in 0..heads.q {
        let kv = head / (heads.q / heads.kv);
        for i in 0..len {
            let q = &rows[i * w + head * d..][..d];
            let s: Vec<f32> = (0..len)
                .map(|j| {
                    let k = &rows[j * w + h + kv * d..][..d];
                    q.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() + bias(head, i, j)
                })
                .collect();
            let m = s.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f32> = s.iter().map(|x| (x - m).exp()).collect();
            let z: f32 = e.iter().sum();
            for j in 0..len {
                let v = &rows[j * w + h + heads.kv * d + kv * d..][..d];
                for c in 0..d {
                    out[i * h + head * d + c] += e[j] / z * v[c];
                }
            }
        }
    }
    out
}

/// Grouped-query heads, causal and windowed masks (over several query blocks) and a
/// relative bias, against plain loops, on both routes: `gemm`, and where the CPU has AVX-512
/// the panels of `attention::sequence` (heads of 8 dims fill part of one value panel,
/// 40 one and a part, 64 two; 300 keys are nine key panels, the last part-filled).
#[test]
fn packed_attention_handles_grouped_heads_and_causal_windowed_and_relative_masks() {
    let routes: &[bool] = if attention::runs_here() {
        &[false, true]
    } else {
        &[false]
    };
    let shapes = [
        Heads { q: 4, kv: 2, d: 8 },
        Heads { q: 3, kv: 1, d: 40 },
        Heads { q: 2, kv: 2, d: 64 },
    ];
    for &panels in routes {
        for heads in shapes {
            check_attention_against_loops(heads, panels);
        }
    }
}

fn check_attention_against_loops(heads: Heads, panels: bool) {
    let lens = [3usize, 300, 1, 17];
    let starts = [0usize, 3, 303, 304];
    let n: usize = lens.iter().sum();
    let w = heads.qkv_width();
    // Seeded. These scores are not scaled by 1/√d, so at 64 dims they spread ~8, and
    // f32 rounding alone moves the outputs by close to the 1e-5 bound below: over 12
    // unseeded runs the worst diff against this f32 reference was 8.4e-6, and one CI
    // run drew 1.03e-5 (against an f64 reference the kernels read up to 1.7e-5, so the
    // bound is relative to an f32 computation, not exact). This seed's worst is 5.4e-6.
    let qkv = seeded_randn(&[n, w], 14);
    let flat: Vec<f32> = qkv.flatten_all().unwrap().to_vec1().unwrap();
    let span = 300;
    let table: Vec<f32> = (0..heads.q * (2 * span - 1))
        .map(|k| ((k * 7919) % 13) as f32 / 5.0 - 1.2)
        .collect();
    let rel = RelativeBias {
        span,
        table: table.clone(),
        on_device: None,
        padded: None,
    };
    // Windows of 2 and 40 keys either side: the 300-key row's 48-row blocks then see
    // keys from inside a panel (not from its start) to the middle of another, and the
    // 17-key row fits inside 40 (no window).
    let within = |w: usize, i: usize, j: usize| {
        if i.abs_diff(j) <= w {
            0.0
        } else {
            f32::NEG_INFINITY
        }
    };
    let cases: [(Mask, BiasFn); 5] = [
        (Mask::Window(2), &|_, i, j| within(2, i, j)),
        (Mask::Window(40), &|_, i, j| within(40, i, j)),
        (Mask::Full, &|_, _, _| 0.0),
        (Mask::Causal, &|_, i, j| {
            if j <= i {
                0.0
            } else {
                f32::NEG_INFINITY
            }
        }),
        (Mask::Relative(&rel), &|hd, i, j| {
            table[hd * (2 * span - 1) + (j + span - 1 - i)]
        }),
    ];
    for (mask, bias) in cases {
        let got = attention_on(&qkv, &starts, &lens, heads, mask, panels).unwrap();
        assert_eq!(got.dims(), &[n, heads.q * heads.d]);
        let got: Vec<f32> = got.flatten_all().unwrap().to_vec1().unwrap();
        for (&s, &len) in starts.iter().zip(&lens) {
            let want = naive_attention(&flat[s * w..(s + len) * w], len, heads, bias);
            let h = heads.q * heads.d;
            let diff = got[s * h..(s + len) * h]
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(
                diff < 1e-5,
                "{mask:?} {heads:?} panels {panels} at {s}: max diff {diff}"
            );
        }
    }
}

#[test]
fn masked_softmax_matches_candle_and_ignores_padding() {
    let (b, h, t) = (3, 4, 11);
    let scores = randn(&[b, h, t, t], 4.0);
    let mut mask = vec![0f32; b * t];
    for (seq, len) in [(0usize, 11usize), (1, 5), (2, 1)] {
        for k in len..t {
            mask[seq * t + k] = f32::NEG_INFINITY;
        }
    }
    let mask = Tensor::from_vec(mask, (b, t), &Device::Cpu).unwrap();
    let got = masked_softmax(scores.clone(), &mask.reshape((b, 1, 1, t)).unwrap()).unwrap();
    let want = candle_nn::ops::softmax(
        &scores
            .broadcast_add(&mask.reshape((b, 1, 1, t)).unwrap())
            .unwrap(),
        D::Minus1,
    )
    .unwrap();
    assert!(max_diff(&got, &want) < 1e-6);
    // Sequence 1 has 5 real keys: (next to) no weight on the other 6.
    let padded: f32 = got
        .get(1)
        .unwrap()
        .narrow(D::Minus1, 5, 6)
        .unwrap()
        .sum_all()
        .unwrap()
        .to_scalar()
        .unwrap();
    // A masked key gets (next to) no weight.
    assert!(padded < 1e-30, "padding got weight {padded}");
}
