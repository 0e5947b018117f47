//! Row kernels: each has a plain body (`*_body`, always inlined) and a dispatcher that
//! calls an AVX-512- or AVX2+FMA-compiled copy when the CPU has it.

use super::{
    packed::Heads,
    scalar::{exp, gelu, sum8, sum_sq8},
};

macro_rules! dispatch {
    ($vis:vis $name:ident, $body:ident, ($($arg:ident : $ty:ty),*)) => {
        $vis fn $name($($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            {
                // 16 lanes where the CPU has AVX-512: twice the exp and erf per
                // instruction in softmax and GELU.
                #[target_feature(enable = "avx512f,avx2,fma")]
                unsafe fn widest($($arg: $ty),*) {
                    $body($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn wide($($arg: $ty),*) {
                    $body($($arg),*)
                }
                let isa = crate::isa::cpu_isa();
                if isa >= crate::isa::CpuIsa::Avx512 {
                    // SAFETY: the CPU has the features `widest` was compiled for.
                    return unsafe { widest($($arg),*) };
                }
                if isa >= crate::isa::CpuIsa::Avx2 {
                    // SAFETY: the CPU has the features `wide` was compiled for.
                    return unsafe { wide($($arg),*) };
                }
            }
            $body($($arg),*)
        }
    };
}

#[inline(always)]
fn bias_gelu_body(x: &[f32], bias: &[f32], out: &mut [f32]) {
    for ((o, &v), &b) in out.iter_mut().zip(x).zip(bias) {
        *o = gelu(v + b);
    }
}
dispatch!(pub(super) bias_gelu_row, bias_gelu_body, (x: &[f32], bias: &[f32], out: &mut [f32]));

/// out = GELU(input) · gate for one row of a gated feed-forward's up-projection,
/// `x = [input | gate]` (ModernBERT's `Wi` output, split in halves as its `chunk(2)`).
#[inline(always)]
fn gated_gelu_body(x: &[f32], out: &mut [f32]) {
    let (input, gate) = x.split_at(out.len());
    for ((o, &v), &g) in out.iter_mut().zip(input).zip(gate) {
        *o = gelu(v) * g;
    }
}
dispatch!(pub(crate) gated_gelu_row, gated_gelu_body, (x: &[f32], out: &mut [f32]));

/// out = SiLU(gate) · up for one row of a SwiGLU feed-forward's up-projection,
/// `x = [gate | up]` (Qwen3's `gate_proj` and `up_proj`, concatenated at load).
#[inline(always)]
fn gated_silu_body(x: &[f32], out: &mut [f32]) {
    let (gate, up) = x.split_at(out.len());
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = g / (1.0 + exp(-g)) * u;
    }
}
dispatch!(pub(crate) gated_silu_row, gated_silu_body, (x: &[f32], out: &mut [f32]));

/// One head's d values rotated rotate-half style by a token's `cos` / `sin` (`d/2` each):
/// (x1, x2) → (x1·cos − x2·sin, x2·cos + x1·sin), the products and sums of candle's
/// `rope_thd`, so the same bits.
#[inline(always)]
fn rotate_half(head: &mut [f32], cos: &[f32], sin: &[f32]) {
    let (x1, x2) = head.split_at_mut(head.len() / 2);
    for (((a, b), &c), &s) in x1.iter_mut().zip(x2.iter_mut()).zip(cos).zip(sin) {
        let (u, v) = (*a, *b);
        *a = u * c - v * s;
        *b = v * c + u * s;
    }
}

/// One token's `[Q | K | V]` row in place: every Q and K head rotated by the token's
/// angles; V untouched.
#[inline(always)]
fn rope_body(row: &mut [f32], cos: &[f32], sin: &[f32], heads: Heads) {
    let Heads { q, kv, d } = heads;
    for head in row[..(q + kv) * d].chunks_exact_mut(d) {
        rotate_half(head, cos, sin);
    }
}
dispatch!(pub(crate) rope_row, rope_body, (row: &mut [f32], cos: &[f32], sin: &[f32], heads: Heads));

/// One token's `[Q | K | V]` row in place: each Q head RMS-normalized with `qw`, each K
/// head with `kw` (as candle's `rms_norm`: x / √(mean(x²) + eps) · w), then both rotated
/// by the token's angles; V untouched.
#[inline(always)]
fn qk_norm_rope_body(
    row: &mut [f32],
    qw: &[f32],
    kw: &[f32],
    cos: &[f32],
    sin: &[f32],
    heads: Heads,
    eps: f32,
) {
    let Heads { q, kv, d } = heads;
    for (h, head) in row[..(q + kv) * d].chunks_exact_mut(d).enumerate() {
        let w = if h < q { qw } else { kw };
        let m = (head.iter().map(|v| v * v).sum::<f32>() / d as f32 + eps).sqrt();
        for (v, &w) in head.iter_mut().zip(w) {
            *v = *v / m * w;
        }
        rotate_half(head, cos, sin);
    }
}
dispatch!(pub(crate) qk_norm_rope_row, qk_norm_rope_body, (
    row: &mut [f32], qw: &[f32], kw: &[f32], cos: &[f32], sin: &[f32], heads: Heads, eps: f32
));

/// out = LayerNorm(x + bias + residual) · gamma + beta, for one row.
#[inline(always)]
fn add_norm_body(x: &[f32], res: &[f32], params: &[f32], eps: f32, out: &mut [f32]) {
    let h = x.len();
    for (((o, &v), &r), &b) in out.iter_mut().zip(x).zip(res).zip(&params[..h]) {
        *o = v + r + b;
    }
    norm_body(out, &params[h..], eps);
}

/// [`add_norm_body`] for rows of width `params.len() / 3` whose `x` is already in `rows`,
/// which the results replace: the dense kernel's tasks run it on the rows they have just
/// stored, while those are still in cache. The same operations in the same order, so the
/// same bits as the separate op.
#[inline(always)]
fn add_norm_rows_body(rows: &mut [f32], res: &[f32], params: &[f32], eps: f32) {
    let h = params.len() / 3;
    for (row, res) in rows.chunks_exact_mut(h).zip(res.chunks_exact(h)) {
        for ((o, &r), &b) in row.iter_mut().zip(res).zip(&params[..h]) {
            *o = *o + r + b;
        }
        norm_body(row, &params[h..], eps);
    }
}

/// LayerNorm of one row in place, then `· gamma + beta` (`gamma_beta` = [gamma; beta]).
#[inline(always)]
fn norm_body(out: &mut [f32], gamma_beta: &[f32], eps: f32) {
    let h = out.len();
    let (gamma, beta) = gamma_beta.split_at(h);
    let mean = sum8(out) / h as f32;
    for o in out.iter_mut() {
        *o -= mean;
    }
    let var = sum_sq8(out);
    let inv = 1.0 / (var / h as f32 + eps).sqrt();
    for ((o, &g), &b) in out.iter_mut().zip(gamma).zip(beta) {
        *o = *o * inv * g + b;
    }
}

/// LayerNorm of each `gamma_beta.len() / 2`-wide row in place, then `· gamma + beta`
/// (`gamma_beta` = [gamma; beta]): a pre-norm layer's input norm (ModernBERT's).
#[inline(always)]
fn layer_norm_rows_body(rows: &mut [f32], gamma_beta: &[f32], eps: f32) {
    for row in rows.chunks_exact_mut(gamma_beta.len() / 2) {
        norm_body(row, gamma_beta, eps);
    }
}

/// RMSNorm of each `weight.len()`-wide row in place: x / √(mean(x²) + eps) · w, as
/// candle's `rms_norm` (Qwen3's layer norms), its sum of squares in eight lanes
/// ([`sum_sq8`]).
#[inline(always)]
fn rms_norm_rows_body(rows: &mut [f32], weight: &[f32], eps: f32) {
    let h = weight.len();
    for row in rows.chunks_exact_mut(h) {
        let m = (sum_sq8(row) / h as f32 + eps).sqrt();
        for (v, &w) in row.iter_mut().zip(weight) {
            *v = *v / m * w;
        }
    }
}

/// `y += x`, element-wise: a pre-norm layer's residual, added to the rows a task has just
/// stored. The same single rounding as candle's `x + y`, so the same bits.
#[inline(always)]
fn add_into_body(y: &mut [f32], x: &[f32]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y += x;
    }
}
dispatch!(pub(crate) layer_norm_rows, layer_norm_rows_body,
    (rows: &mut [f32], gamma_beta: &[f32], eps: f32));
dispatch!(pub(crate) rms_norm_rows, rms_norm_rows_body,
    (rows: &mut [f32], weight: &[f32], eps: f32));
dispatch!(pub(crate) add_into, add_into_body, (y: &mut [f32], x: &[f32]));
dispatch!(pub(super) add_norm_row, add_norm_body,
    (x: &[f32], res: &[f32], params: &[f32], eps: f32, out: &mut [f32]));
dispatch!(add_norm_rows_on, add_norm_rows_body,
    (rows: &mut [f32], res: &[f32], params: &[f32], eps: f32));

/// LayerNorm(rows + bias + residual), in place, for whole rows of `params.len() / 3`
/// values, `params` = [bias; gamma; beta]: [`add_norm`](super::add_norm)'s CPU kernel for
/// callers that hold the rows already (the dense kernel, on the rows it has just stored).
pub(crate) fn add_norm_rows(rows: &mut [f32], res: &[f32], params: &[f32], eps: f32) {
    let h = params.len() / 3;
    assert!(
        h > 0 && params.len() == 3 * h && rows.len().is_multiple_of(h) && res.len() == rows.len(),
        "add-norm rows of {} values, residual of {}, params of {}",
        rows.len(),
        res.len(),
        params.len()
    );
    add_norm_rows_on(rows, res, params, eps)
}
