//! The feed-forward half of an encoder layer on the CPU in f32, each task carrying its
//! rows through both dense layers (and the norm and residual around them) while they sit
//! in its core's cache: BERT's post-norm `norm(GELU(x · up + b) · down + x)`
//! ([`Bert`]) and the pre-norm gated `x + down(act(norm(x) · up))` of ModernBERT
//! and Qwen3 ([`Gated`]). The intermediate rows go to buffers of the thread's
//! instead of out to the layer's widest tensors and back. Batches too short to give every
//! thread tasks of whole rows run the same steps apart, so either way the same bits.

use std::cell::RefCell;

use rayon::prelude::*;

use crate::{
    dense::{fills_the_cores, Dst, Epilogue, PackedLinear, RowNorm, TaskProduct, ROWS_PER_TASK},
    isa::{cpu_isa, CpuIsa},
    kernels::{self, add_into, layer_norm_rows, rms_norm_rows},
};

/// BERT's feed-forward and the add-norm after it: `norm(GELU(x · up + up_bias) · down)`
/// for `x` row-major `[m, k]`, each task carrying its rows through both layers, on packed
/// f32 weights or int8 ones ([`TaskProduct`]). The intermediate rows (a task's 96 × 1,536
/// at MiniLM's widths in f32: 576 KiB) go to a buffer of the thread's, in its core's L2,
/// instead of out to an `[m, I]` tensor (the layer's widest, 48 MiB for 32 passages of
/// 256 tokens: past glibc's largest reuse threshold, so new pages faulted in every time)
/// and back. A batch too short for tasks of whole rows (see [`fills_the_cores`]) runs the
/// two products. Either way the same bits.
#[derive(Clone, Copy)]
pub(crate) struct Bert<'a, W> {
    pub(crate) up: &'a W,
    pub(crate) up_bias: &'a [f32],
    pub(crate) down: &'a W,
}

impl<W: TaskProduct> Bert<'_, W> {
    /// The layer on `m` rows `x`, then `norm` on each output row.
    pub(crate) fn forward(self, x: &[f32], m: usize, norm: RowNorm) -> Vec<f32> {
        self.forward_on(cpu_isa(), x, m, norm)
    }

    /// [`Bert::forward`] on the route of `isa` (tests run each one the CPU has).
    fn forward_on(self, isa: CpuIsa, x: &[f32], m: usize, norm: RowNorm) -> Vec<f32> {
        let Bert { up, up_bias, down } = self;
        let (k, i, n) = (up.in_features(), up.out_features(), down.out_features());
        assert_eq!(
            down.in_features(),
            i,
            "a feed-forward of [{k}, {i}] then [{}, {n}]",
            down.in_features()
        );
        let row_tasks = m.div_ceil(W::TASK_ROWS);
        if !fills_the_cores(row_tasks) {
            let mid = up.forward_on(isa, x, m, Epilogue::BiasGelu(up_bias), None);
            return down.forward_on(isa, &mid, m, Epilogue::None, Some(norm));
        }
        up.assert_inputs(x, m, Epilogue::BiasGelu(up_bias), None);
        norm.assert_fits(m, n);
        // Not zeroed first: the tiles write every output.
        let mut y: Vec<f32> = Vec::with_capacity(m * n);
        let out = Dst(y.as_mut_ptr());
        (0..row_tasks).into_par_iter().for_each(|rt| {
            let rows = rt * W::TASK_ROWS..((rt + 1) * W::TASK_ROWS).min(m);
            INTERMEDIATE.with_borrow_mut(|s| {
                let mid = at_least(&mut s.mid, rows.len() * i);
                // SAFETY: `isa` is the CPU's or one it has (`forward`, tests). The task
                // reads its own rows of `x`, writes and then reads its rows of `mid` (which
                // holds them all), and writes every output of its own rows of `y` (m × n),
                // which no other task touches. Nothing in either product calls into
                // rayon, so no other task runs on this thread while `mid` is borrowed.
                unsafe {
                    let x = x.as_ptr().add(rows.start * k);
                    let gelu = Epilogue::BiasGelu(up_bias);
                    up.rows_into_on(isa, x, k, rows.len(), mid.as_mut_ptr(), i, gelu);
                    let y = out.at(rows.start * n);
                    down.rows_into_on(isa, mid.as_ptr(), i, rows.len(), y, n, Epilogue::None);
                }
            });
            // SAFETY: as above: this task's rows, every output of which it has just stored.
            unsafe { norm.apply_to(out, n, rows) };
        });
        // SAFETY: the tasks cover every row, and each stores every column of its rows.
        unsafe { y.set_len(m * n) };
        y
    }
}

thread_local! {
    /// A task's intermediate rows, kept from task to task: a fresh 576 KiB allocation is
    /// a mapping of new pages, each faulted in, every time.
    static INTERMEDIATE: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// A thread's buffers for its feed-forward tasks: the up-projection's rows, and for the
/// gated form the normalized input and the activation's rows.
#[derive(Default)]
struct Scratch {
    mid: Vec<f32>,
    normed: Vec<f32>,
    gated: Vec<f32>,
}

/// `v` holding `len` values at least (grown, never shrunk, between releases).
fn at_least(v: &mut Vec<f32>, len: usize) -> &mut [f32] {
    if v.len() < len {
        v.resize(len, 0.0);
    }
    &mut v[..len]
}

/// Frees this thread's feed-forward buffers (an idle engine hands them back).
pub(crate) fn release_thread_buffer() {
    // Left for next time, not a panic, were it ever borrowed here (see
    // `attention::release_thread_buffer`).
    INTERMEDIATE.with(|s| {
        if let Ok(mut s) = s.try_borrow_mut() {
            *s = Scratch::default();
        }
    });
}

/// A gated activation's row kernel: one row of the up-projection `[2I]` in, its `[I]`
/// activations out (`kernels::gated_gelu_row`, `kernels::gated_silu_row`).
pub(crate) type GatedRow = fn(&[f32], &mut [f32]);

/// The norm a pre-norm layer puts its input through before the feed-forward.
#[derive(Debug, Clone, Copy)]
pub(crate) enum PreNorm<'a> {
    /// LayerNorm, `[gamma; beta]` (ModernBERT's, beta zeros where it has no bias).
    Layer(&'a [f32]),
    /// RMSNorm with this weight (Qwen3's).
    Rms(&'a [f32]),
}

impl PreNorm<'_> {
    /// The width of the rows it normalizes.
    pub(crate) fn width(self) -> usize {
        match self {
            PreNorm::Layer(gamma_beta) => gamma_beta.len() / 2,
            PreNorm::Rms(w) => w.len(),
        }
    }

    /// Normalizes whole rows in place.
    pub(crate) fn apply(self, rows: &mut [f32], eps: f32) {
        match self {
            PreNorm::Layer(gamma_beta) => layer_norm_rows(rows, gamma_beta, eps),
            PreNorm::Rms(w) => rms_norm_rows(rows, w, eps),
        }
    }
}

/// A pre-norm layer's gated feed-forward and its residual: `x + down(gate(norm(x) · up))`
/// for `x` row-major `[m, k]`, where `up` gives `[m, 2I]` and `gate` makes each row's
/// `I` outputs from its two halves (`kernels::gated_gelu_row`: ModernBERT's GELU(input) ·
/// gate; `kernels::gated_silu_row`: Qwen3's SiLU(gate) · up). Each task carries its rows
/// through the norm, both products, the gate and the residual on one thread, in its
/// buffers (at ModernBERT-mini's widths a task's normed rows, `[96, 1,536]` and `[96, 768]`
/// take 1 MiB, within a core's L2), instead of through four `[m, ·]` tensors and a
/// separate norm and add. A batch too short for tasks of whole rows runs the same steps
/// apart, each over all rows: the same bits.
#[derive(Clone, Copy)]
pub(crate) struct Gated<'a> {
    pub(crate) norm: PreNorm<'a>,
    pub(crate) eps: f32,
    pub(crate) up: &'a PackedLinear,
    pub(crate) gate: GatedRow,
    pub(crate) down: &'a PackedLinear,
}

impl Gated<'_> {
    /// The layer and its residual on `m` rows `x`.
    pub(crate) fn forward(self, x: &[f32], m: usize) -> Vec<f32> {
        self.forward_on(cpu_isa(), x, m)
    }

    /// [`Gated::forward`] on the route of `isa` (tests run each one the CPU has).
    fn forward_on(self, isa: CpuIsa, x: &[f32], m: usize) -> Vec<f32> {
        let Gated {
            norm,
            eps,
            up,
            gate,
            down,
        } = self;
        let (k, two_i, n) = (up.in_features(), up.out_features(), down.out_features());
        let i = two_i / 2;
        assert!(
            two_i % 2 == 0 && down.in_features() == i && n == k && norm.width() == k,
            "a gated feed-forward of [{k}, {two_i}] then [{}, {n}], norm over {}",
            down.in_features(),
            norm.width()
        );
        assert_eq!(x.len(), m * k, "input is not [{m}, {k}]");
        let row_tasks = m.div_ceil(ROWS_PER_TASK);
        if !fills_the_cores(row_tasks) {
            let mut normed = x.to_vec();
            normed
                .par_chunks_mut(k * kernels::ROWS_PER_TASK)
                .for_each(|rows| norm.apply(rows, eps));
            let mid = up.forward_on(isa, &normed, m, Epilogue::None, None);
            let gated = kernels::gated_rows(&mid, two_i, gate);
            let mut y = down.forward_on(isa, &gated, m, Epilogue::None, None);
            y.par_chunks_mut(n * kernels::ROWS_PER_TASK)
                .zip(x.par_chunks(n * kernels::ROWS_PER_TASK))
                .for_each(|(y, x)| add_into(y, x));
            return y;
        }
        // Not zeroed first: the tiles write every output.
        let mut y: Vec<f32> = Vec::with_capacity(m * n);
        let out = Dst(y.as_mut_ptr());
        (0..row_tasks).into_par_iter().for_each(|rt| {
            let rows = rt * ROWS_PER_TASK..((rt + 1) * ROWS_PER_TASK).min(m);
            let count = rows.len();
            let x = &x[rows.start * k..rows.end * k];
            INTERMEDIATE.with_borrow_mut(|s| {
                let Scratch { mid, normed, gated } = s;
                let normed = at_least(normed, count * k);
                normed.copy_from_slice(x);
                norm.apply(normed, eps);
                let mid = at_least(mid, count * two_i);
                let gated = at_least(gated, count * i);
                // SAFETY: `panel_fn` checked the CPU has the route's features. The task reads
                // its own buffers, sized above, and writes every panel of its own rows of `y`
                // (m × n), which no other task touches. Nothing in the products calls into
                // rayon, so no other task runs on this thread while the buffers are borrowed.
                unsafe {
                    let (none, mp) = (Epilogue::None, mid.as_mut_ptr());
                    up.rows_into_on(isa, normed.as_ptr(), k, count, mp, two_i, none);
                    for (g, mid) in gated.chunks_exact_mut(i).zip(mid.chunks_exact(two_i)) {
                        gate(mid, g);
                    }
                    let y = out.at(rows.start * n);
                    down.rows_into_on(isa, gated.as_ptr(), i, count, y, n, none);
                }
            });
            // SAFETY: this task's rows, every output of which it has just stored; no other
            // task touches them.
            let own = unsafe { std::slice::from_raw_parts_mut(out.at(rows.start * n), count * n) };
            add_into(own, x);
        });
        // SAFETY: the tasks cover every row, and each stores every column of its rows.
        unsafe { y.set_len(m * n) };
        y
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        dense::tests::{pool, routes, same_bits, values},
        int8::{self, QuantLinear},
        kernels::{gated_gelu_row, gated_silu_row},
    };

    /// The feed-forward fused per task gives the two products' bits: whole-row tasks
    /// (200 rows on one thread) and a batch too short for them (10 rows), partly filled
    /// last panels in both layers; on packed f32 weights and on int8 ones, every route
    /// the CPU has.
    #[test]
    fn the_fused_feed_forward_gives_the_two_products() {
        let (k, i, n) = (64, 150, 45);
        let mut seed = 9;
        let up_w = values(k * i, &mut seed);
        let down_w = values(i * n, &mut seed);
        let f32_layers = (
            PackedLinear::new(&up_w, k, i),
            PackedLinear::new(&down_w, i, n),
        );
        // QuantLinear takes its weight `[out, in]`, as `rows` gives it.
        let int8_layers = (
            QuantLinear::new(&f32_layers.0.rows(), i, k),
            QuantLinear::new(&f32_layers.1.rows(), n, i),
        );
        let int8_routes = std::iter::once(CpuIsa::Baseline).chain(int8::tests::routes());
        for isa in routes() {
            fused_matches_apart(isa, &f32_layers, &mut seed);
        }
        for isa in int8_routes {
            fused_matches_apart(isa, &int8_layers, &mut seed);
        }
    }

    /// [`Bert::forward_on`] against its two products, on one thread.
    fn fused_matches_apart<W: TaskProduct>(isa: CpuIsa, (up, down): &(W, W), seed: &mut u64) {
        let (k, i, n) = (up.in_features(), up.out_features(), down.out_features());
        let bias = values(i, seed);
        let params = values(3 * n, seed);
        pool(1).install(|| {
            for m in [10, 200] {
                let x = values(m * k, seed);
                let residual = values(m * n, seed);
                let norm = RowNorm {
                    residual: &residual,
                    params: &params,
                    eps: 1e-12,
                };
                let mid = up.forward_on(isa, &x, m, Epilogue::BiasGelu(&bias), None);
                let want = down.forward_on(isa, &mid, m, Epilogue::None, Some(norm));
                // Poison what the output may reuse, so a value left unwritten fails.
                drop(std::hint::black_box(vec![f32::NAN; m * n]));
                let layer = Bert {
                    up,
                    up_bias: &bias,
                    down,
                };
                let got = layer.forward_on(isa, &x, m, norm);
                let same = same_bits(&got, &want);
                assert!(same, "{isa:?}, {m} rows");
                // Both could leave the same poison in place: every output is finite, so
                // neither did.
                assert!(got.iter().all(|v| v.is_finite()), "{isa:?}, {m} rows");
            }
        });
    }

    /// The gated feed-forward fused per task gives the steps' bits (whole-row tasks: 200
    /// rows on one thread; steps apart: 10 rows), with either norm and either gate, and
    /// both come within rounding of the layer computed the plain way in f64.
    #[test]
    fn the_gated_feed_forward_gives_the_steps_and_the_layer() {
        let pool = pool(1);
        pool.install(|| {
            for isa in routes() {
                let mut seed = 13;
                let (k, i) = (64, 75);
                // Scaled by 1/√inputs, as trained weights are, so that every sum stays
                // near 1 and rounding is judged against values of that size.
                let scaled = |n: usize, inputs: usize, seed: &mut u64| -> Vec<f32> {
                    let s = 1.0 / (inputs as f32).sqrt();
                    values(n, seed).into_iter().map(|v| v * s).collect()
                };
                let up_w = scaled(k * 2 * i, k, &mut seed);
                let down_w = scaled(i * k, i, &mut seed);
                let (up, down) = (
                    PackedLinear::new(&up_w, k, 2 * i),
                    PackedLinear::new(&down_w, i, k),
                );
                let gamma_beta = values(2 * k, &mut seed);
                let weight = values(k, &mut seed);
                type Gate64 = fn(f64, f64) -> f64;
                let gates: [(GatedRow, Gate64); 2] = [
                    (gated_gelu_row, |a, b| {
                        0.5 * a * (1.0 + erf(a / 2f64.sqrt())) * b
                    }),
                    (gated_silu_row, |a, b| a / (1.0 + (-a).exp()) * b),
                ];
                for m in [10, 200] {
                    let x = values(m * k, &mut seed);
                    for norm in [PreNorm::Layer(&gamma_beta), PreNorm::Rms(&weight)] {
                        for (gate, gate64) in gates {
                            drop(std::hint::black_box(vec![f32::NAN; m * k]));
                            let layer = Gated {
                                norm,
                                eps: 1e-5,
                                up: &up,
                                gate,
                                down: &down,
                            };
                            let got = layer.forward_on(isa, &x, m);
                            let want = layer64(norm, &up_w, gate64, &down_w, &x, k, i);
                            for (j, (g, w)) in got.iter().zip(&want).enumerate() {
                                let tol = 2e-4 * (1.0 + w.abs());
                                assert!(
                                    (g - w).abs() <= tol,
                                    "{isa:?} {norm:?}, {m} rows, at {j}: {g} vs {w}"
                                );
                            }
                            if m == 200 {
                                // The same rows as a short batch's steps, 10 at a time.
                                let apart: Vec<f32> = x
                                    .chunks(10 * k)
                                    .flat_map(|x| layer.forward_on(isa, x, 10))
                                    .collect();
                                assert!(same_bits(&got, &apart), "{isa:?} {norm:?}");
                            }
                        }
                    }
                }
            }
        });
    }

    /// erf in f64 from its Taylor series below 3; past that 1, within 2.3e-5 of it.
    fn erf(x: f64) -> f64 {
        let t = x.abs();
        let r = if t < 3.0 {
            let (mut sum, mut term, mut n) = (t, t, 0.0);
            while term.abs() > 1e-17 * sum.abs() {
                n += 1.0;
                term *= -t * t / n;
                sum += term / (2.0 * n + 1.0);
            }
            sum * 2.0 / std::f64::consts::PI.sqrt()
        } else {
            1.0
        };
        r.copysign(x)
    }

    /// `x + down(gate(norm(x) · up))` in f64, weights row-major `[in, out]`.
    fn layer64(
        norm: PreNorm,
        up: &[f32],
        gate: fn(f64, f64) -> f64,
        down: &[f32],
        x: &[f32],
        k: usize,
        i: usize,
    ) -> Vec<f32> {
        let mut out = Vec::with_capacity(x.len());
        for row in x.chunks(k) {
            let row: Vec<f64> = row.iter().map(|&v| v as f64).collect();
            let normed: Vec<f64> = match norm {
                PreNorm::Layer(gb) => {
                    let mean = row.iter().sum::<f64>() / k as f64;
                    let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / k as f64;
                    let inv = 1.0 / (var + 1e-5).sqrt();
                    (0..k)
                        .map(|c| (row[c] - mean) * inv * gb[c] as f64 + gb[k + c] as f64)
                        .collect()
                }
                PreNorm::Rms(w) => {
                    let ms = row.iter().map(|v| v * v).sum::<f64>() / k as f64;
                    let m = (ms + 1e-5).sqrt();
                    (0..k).map(|c| row[c] / m * w[c] as f64).collect()
                }
            };
            let mid: Vec<f64> = (0..2 * i)
                .map(|c| (0..k).map(|r| normed[r] * up[r * 2 * i + c] as f64).sum())
                .collect();
            let gated: Vec<f64> = (0..i).map(|c| gate(mid[c], mid[i + c])).collect();
            for c in 0..k {
                let d: f64 = (0..i).map(|r| gated[r] * down[r * k + c] as f64).sum();
                out.push((row[c] + d) as f32);
            }
        }
        out
    }
}
