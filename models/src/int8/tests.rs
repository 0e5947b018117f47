//! The int8 routes against the f32 product and against each other.

use super::*;
use crate::dense::tests::lcg;

/// `len` deterministic values in [-scale, scale).
fn values(len: usize, seed: &mut u64, scale: f32) -> Vec<f32> {
    (0..len).map(|_| lcg(seed) * scale).collect()
}

fn reference(x: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
    let mut y = vec![0f32; m * n];
    for r in 0..m {
        for c in 0..n {
            y[r * n + c] = (0..k).map(|i| x[r * k + i] * w[c * k + i]).sum::<f32>();
        }
    }
    y
}

/// The routes this CPU runs besides the portable one: AVX2, and VNNI and AMX where it has
/// them.
pub(crate) fn routes() -> Vec<CpuIsa> {
    [CpuIsa::Avx2, CpuIsa::Avx512Vnni, CpuIsa::Amx]
        .into_iter()
        .filter(|&isa| isa.runs_here())
        .collect()
}

/// The layouts of quantized rows this CPU's routes read: `k4`-wide rows, and AMX's whole
/// tiles where it has AMX. Every route but AMX reads either.
fn layouts() -> Vec<CpuIsa> {
    let mut l = vec![CpuIsa::Baseline];
    if CpuIsa::detected() >= CpuIsa::Amx {
        l.push(CpuIsa::Amx);
    }
    l
}

/// Whether `isa`'s route reads rows laid out for `layout`.
fn reads(isa: CpuIsa, layout: CpuIsa) -> bool {
    isa < CpuIsa::Amx || layout >= CpuIsa::Amx
}

/// The product of quantized rows on `isa`'s route (the portable one at `Baseline`).
fn product(q: &QuantLinear, isa: CpuIsa, rows: &Quantized, m: usize, epi: Epilogue) -> Vec<f32> {
    product_over(q, isa, rows, m, epi, f32::NAN)
}

/// [`product`] into outputs first set to `fill` (a finite one, where a test looks for
/// NaN outputs, so that an output left unwritten cannot pass for one).
fn product_over(
    q: &QuantLinear,
    isa: CpuIsa,
    rows: &Quantized,
    m: usize,
    epi: Epilogue,
    fill: f32,
) -> Vec<f32> {
    let mut y = vec![Out::new(fill); m * q.n];
    q.matmul_on(isa, rows, m, &mut y, q.n, epi);
    // SAFETY: initialized above; the kernel overwrote them.
    y.iter().map(|v| unsafe { v.assume_init() }).collect()
}

/// Every shape edge (rows not a multiple of the tile or of a task, outputs not a
/// multiple of a panel or of a half panel, inputs not a multiple of 4) lands close to
/// the f32 product, on the portable route and on the AVX2, VNNI and AMX ones (where the
/// CPU has them), which agree with it exactly, from either layout of the rows. For AMX
/// the edges are a last tile of rows or of inputs partly padding, an odd last panel, and
/// one or several 64-byte tiles of inputs.
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
        (33, 48, 200),
        (16, 32, 128),
        (47, 1536, 384),
        (3, 384, 1536),
    ] {
        let x = values(m * k, &mut seed, 1.0);
        let w = values(n * k, &mut seed, 0.1);
        let q = QuantLinear::new(&w, n, k);
        let want = reference(&x, &w, m, n, k);
        let got = q.forward(&x, m, Epilogue::None);
        let mut portable = vec![];
        for layout in layouts() {
            let rows = q.quantize_rows(layout, &x, k, m);
            portable = product(&q, CpuIsa::Baseline, &rows, m, Epilogue::None);
            for isa in routes().into_iter().filter(|&isa| reads(isa, layout)) {
                let routed = product(&q, isa, &rows, m, Epilogue::None);
                assert_eq!(
                    routed, portable,
                    "{isa:?} and portable differ at {m}x{n}x{k} ({layout:?} layout)"
                );
            }
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
    let x = values(m * k, &mut seed, 1.0);
    let w = values(n * k, &mut seed, 0.3);
    let b = values(n, &mut seed, 1.0);
    let q = QuantLinear::new(&w, n, k);
    let plain = q.forward(&x, m, Epilogue::None);
    let rows = q.quantize_rows(CpuIsa::detected(), &x, k, m);
    for (epi, f) in [
        (Epilogue::Bias(&b), (|v| v) as fn(f32) -> f32),
        (Epilogue::BiasGelu(&b), gelu as fn(f32) -> f32),
    ] {
        let got = q.forward(&x, m, epi);
        let portable = product(&q, CpuIsa::Baseline, &rows, m, epi);
        for (i, g) in got.iter().enumerate() {
            let want = f(plain[i] + b[i % n]);
            assert!((g - want).abs() <= 1e-5, "{epi:?} at {i}: {g} vs {want}");
            assert_eq!(*g, portable[i], "{epi:?} at {i}");
        }
        for isa in routes() {
            let routed = product(&q, isa, &rows, m, epi);
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
    for layout in layouts() {
        let rows = q.quantize_rows(layout, &x, 4, 1);
        assert_eq!((&rows.q[..4], rows.scales[0]), (&scalar[..], rs));
    }
}

/// Every route's row quantizer gives the portable one's bytes and scale, tails (rows
/// not a multiple of 8 or 16) included.
#[test]
fn quantizers_agree_bit_for_bit() {
    let mut seed = 9;
    for k in [1, 7, 8, 17, 33, 64, 81, 200, 384] {
        let row = values(k, &mut seed, 3.0);
        let mut want = vec![0u8; k];
        let rs = quantize_row(&row, &mut want);
        for isa in routes() {
            let mut got = vec![0u8; k];
            // SAFETY: `routes` lists only what runs here.
            let gs = unsafe { quantize_row_on(isa, &row, &mut got) };
            assert_eq!(
                (got, bits(gs)),
                (want.clone(), bits(rs)),
                "{isa:?}, k = {k}"
            );
        }
    }
}

/// A scale's bits and zero point: NaN scales compare equal when they are the same NaN.
fn bits(rs: RowScale) -> (u32, i32) {
    (rs.scale.to_bits(), rs.zero)
}

/// A row holding NaN or an infinity, in a whole vector or in the tail, in any place of
/// it, is zeros with [`RowScale::NON_FINITE`] on every route, so that all of its outputs
/// are NaN (as its f32 product would not be finite either); the other rows of the batch
/// come out as they do without it, bit for bit. Before, `minps`/`maxps` dropped a NaN in
/// some lanes and kept it in others, so the routes gave different finite numbers.
#[test]
fn non_finite_rows_come_out_nan_on_every_route() {
    let (m, n, k) = (5, 40, 81);
    let mut seed = 13;
    let x = values(m * k, &mut seed, 1.0);
    let w = values(n * k, &mut seed, 0.1);
    let q = QuantLinear::new(&w, n, k);
    let clean = q.forward(&x, m, Epilogue::None);
    let b = values(n, &mut seed, 1.0);
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        // The first lane, a middle one, the last of a 64-value group (the AVX-512
        // quantizer's wide store), and the tail's (k = 81: one past five whole vectors).
        for at in [0, 9, 63, 80] {
            let row = 2;
            let mut x = x.clone();
            x[row * k + at] = bad;
            let mut scalar = vec![0u8; k];
            assert_eq!(
                bits(quantize_row(&x[row * k..(row + 1) * k], &mut scalar)),
                bits(RowScale::NON_FINITE),
                "{bad} at {at}"
            );
            assert_eq!(scalar, vec![0u8; k], "{bad} at {at}");
            for isa in routes() {
                let mut got = vec![7u8; k];
                // SAFETY: `routes` lists only what runs here.
                let rs = unsafe { quantize_row_on(isa, &x[row * k..(row + 1) * k], &mut got) };
                assert_eq!(
                    (got, bits(rs)),
                    (scalar.clone(), bits(RowScale::NON_FINITE))
                );
            }
            for epi in [Epilogue::None, Epilogue::BiasGelu(&b)] {
                let want = q.forward(
                    &x.iter()
                        .map(|v| if v.is_finite() { *v } else { 0.0 })
                        .collect::<Vec<_>>(),
                    m,
                    epi,
                );
                for layout in layouts() {
                    let rows = q.quantize_rows(layout, &x, k, m);
                    let mut isas = vec![CpuIsa::Baseline];
                    isas.extend(routes().into_iter().filter(|&isa| reads(isa, layout)));
                    for isa in isas {
                        let got = product_over(&q, isa, &rows, m, epi, 12.5);
                        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                            if i / n == row {
                                assert!(
                                    g.is_nan(),
                                    "{isa:?} {epi:?}: {bad} at {at}, output {i} is {g}"
                                );
                            } else {
                                assert_eq!(
                                    g.to_bits(),
                                    w.to_bits(),
                                    "{isa:?} {epi:?}: {bad} at {at}, output {i}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
    // And through `forward`, the route and task split this CPU takes in service.
    let mut x = x;
    x[2 * k + 40] = f32::NAN;
    let got = q.forward(&x, m, Epilogue::None);
    for (i, (g, c)) in got.iter().zip(&clean).enumerate() {
        if i / n == 2 {
            assert!(g.is_nan(), "forward: output {i} is {g}");
        } else {
            assert_eq!(g.to_bits(), c.to_bits(), "forward: output {i}");
        }
    }
}

/// A weight column holding NaN or an infinity makes that output NaN for every row, as
/// its f32 product would not be finite either; the other columns are unchanged.
#[test]
fn a_non_finite_weight_column_comes_out_nan() {
    let (m, n, k) = (3, 20, 70);
    let mut seed = 17;
    let x = values(m * k, &mut seed, 1.0);
    let w = values(n * k, &mut seed, 0.1);
    let clean = QuantLinear::new(&w, n, k).forward(&x, m, Epilogue::None);
    for bad in [f32::NAN, f32::INFINITY] {
        let mut w = w.clone();
        w[5 * k + 33] = bad;
        let got = QuantLinear::new(&w, n, k).forward(&x, m, Epilogue::None);
        for (i, (g, c)) in got.iter().zip(&clean).enumerate() {
            if i % n == 5 {
                assert!(g.is_nan(), "{bad}: output {i} is {g}");
            } else {
                assert_eq!(g.to_bits(), c.to_bits(), "{bad}: output {i}");
            }
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

/// Int8 attention against the f32 panels of `attention::sequence`, where this CPU runs
/// both: grouped heads, every mask, rows of one key to 300 (nineteen key panels of 16, the
/// last part-filled), heads of 6 dims (padded to 8 for the products), 8, 40 and 64.
#[cfg(target_arch = "x86_64")]
#[test]
fn int8_attention_follows_the_f32_route() {
    use crate::{
        attention,
        kernels::{Heads, Keys},
    };
    if !(attend_runs_here() && attention::runs_here()) {
        eprintln!("skipped: no AVX-512 VNNI here");
        return;
    }
    let shapes = [
        Heads { q: 2, kv: 1, d: 6 },
        Heads { q: 4, kv: 2, d: 8 },
        Heads { q: 3, kv: 1, d: 40 },
        Heads { q: 2, kv: 2, d: 64 },
    ];
    let (mut f32s, mut int8s) = (attention::Scratch::default(), AttendScratch::default());
    let mut seed = 41;
    for heads in shapes {
        for len in [1usize, 3, 17, 300] {
            let w = heads.qkv_width();
            let mut qkv = values(len * w, &mut seed, 1.0);
            // Q pre-scaled by 1/√d, as the QKV projection leaves it.
            let scale = 1.0 / (heads.d as f32).sqrt();
            for row in qkv.chunks_exact_mut(w) {
                row[..heads.q * heads.d]
                    .iter_mut()
                    .for_each(|v| *v *= scale * 4.0);
            }
            for keys in [Keys::Row, Keys::Causal, Keys::Window(2), Keys::Window(40)] {
                let keys = keys.in_row_of(len);
                let h = heads.q * heads.d;
                let mut want = vec![Out::new(f32::NAN); len * h];
                attention::sequence(&qkv, len, heads, keys, &mut want, &mut f32s);
                let mut got = vec![Out::new(f32::NAN); len * h];
                attend(&qkv, len, heads, keys, &mut got, &mut int8s);
                // SAFETY: both routes write every output (NaN marks any left).
                let (want, got) = unsafe {
                    (
                        want.iter().map(|v| v.assume_init()).collect::<Vec<_>>(),
                        got.iter().map(|v| v.assume_init()).collect::<Vec<_>>(),
                    )
                };
                let worst = want
                    .iter()
                    .zip(&got)
                    .map(|(a, b)| (a - b).abs())
                    .fold(
                        0f32,
                        |m, d| if d.is_nan() { f32::INFINITY } else { m.max(d) },
                    );
                // Values lie in [-1, 1], whose i8 step is 1/127 ≈ 0.008; a masked key let
                // in, or a key or value packed in the wrong place, moves outputs by tenths.
                assert!(
                    worst <= 0.025,
                    "{heads:?}, {len} keys, {keys:?}: off by {worst} from f32"
                );
            }
        }
    }
}
