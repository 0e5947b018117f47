//! Fused, vectorized, multi-threaded CPU kernels for the encoder's element-wise steps,
//! as candle custom ops. candle's own versions were a large share of a CPU forward pass
//! (profile in benches/RESULTS.md): GELU computes `erf` one element at a time on one
//! thread, softmax calls scalar `exp`, and bias-add, residual-add and layer-norm each
//! allocate and walk a full activation tensor.
//!
//! `bias_gelu`, `gated_gelu` and `add_norm` run the fused kernel for contiguous f32
//! tensors on the CPU, gpulane's CUDA kernels on cards (`cuda.rs`, f32/f16/bf16), and the
//! equivalent chain of candle ops elsewhere (the CPU in f16/bf16), so callers never branch
//! on the device; packed `attention` (optionally windowed) is CPU-f32 only (cards have
//! `varlen.rs`; full and causal masks on AVX-512 CPUs go to `attention.rs`'s panels), and
//! `masked_softmax` with its `band` is the padded attention path's plain-candle softmax.
//! Kernels run on rayon's pool, the one candle's matmul uses, and are compiled twice: once
//! for AVX2+FMA (picked at run time) and once for the baseline.

use candle_core::{
    backend::BackendStorage, CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Result,
    Shape, Tensor,
};
use std::mem::MaybeUninit;

use rayon::prelude::*;

use crate::attention::{self, Scratch};

/// Rows handed to one rayon task: big enough to amortise scheduling, small enough to
/// spread a short batch over every thread.
pub(crate) const ROWS_PER_TASK: usize = 8;

// ---------------------------------------------------------------------------------------
// Scalar building blocks, written branch-free so that loops over slices vectorize.

/// erf(x) for f32, as a rational function on [-4, 4] (Eigen's `generic_fast_erf_float`,
/// the one PyTorch and TensorFlow CPU kernels use): max abs error ~1e-7, no `exp`.
#[inline(always)]
#[allow(clippy::excessive_precision)]
fn erf(x: f32) -> f32 {
    let x = x.clamp(-4.0, 4.0);
    let x2 = x * x;
    let mut p = x2 * -2.72614225801306e-10 + 2.77068142495902e-08;
    p = x2 * p + -2.10102402082508e-06;
    p = x2 * p + -5.69250639462346e-05;
    p = x2 * p + -7.34990630326855e-04;
    p = x2 * p + -2.95459980854025e-03;
    p = x2 * p + -1.60960333262415e-02;
    p *= x;
    let mut q = x2 * -1.45660718464996e-05 + -2.13374055278905e-04;
    q = x2 * q + -1.68282697438203e-03;
    q = x2 * q + -7.37332916720468e-03;
    q = x2 * q + -1.42647390514189e-02;
    p / q
}

/// The exact (erf) GELU that BERT's `hidden_act: "gelu"` means.
#[inline(always)]
pub(crate) fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + erf(x * std::f32::consts::FRAC_1_SQRT_2))
}

/// ln 2 split in two for [`exp`]'s Cody-Waite reduction (`HI` exact in few bits, so
/// `n · HI` is exact), shared with the vector copies.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// e^r's Taylor coefficients on the reduced range, highest degree first (Horner order).
const EXP_POLY: [f32; 7] = [
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
fn exp(x: f32) -> f32 {
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

// ---------------------------------------------------------------------------------------
// Row kernels. Each has a plain body (`*_body`, always inlined) and a dispatcher that
// calls an AVX2+FMA-compiled copy when the CPU has it.

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
dispatch!(bias_gelu_row, bias_gelu_body, (x: &[f32], bias: &[f32], out: &mut [f32]));

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
dispatch!(add_norm_row, add_norm_body,
    (x: &[f32], res: &[f32], params: &[f32], eps: f32, out: &mut [f32]));
dispatch!(add_norm_rows_on, add_norm_rows_body,
    (rows: &mut [f32], res: &[f32], params: &[f32], eps: f32));

/// LayerNorm(rows + bias + residual), in place, for whole rows of `params.len() / 3`
/// values, `params` = [bias; gamma; beta]: [`add_norm`]'s CPU kernel for callers that
/// hold the rows already (the dense kernel, on the rows it has just stored).
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

/// Query rows per block without a window: a whole sequence of BERT's 512 tokens takes two
/// blocks, and an 8,192-token one needs a 256 × 8,192 score buffer per thread, not 8,192².
const GLOBAL_BLOCK: usize = 256;

/// The geometry of one attention: query heads, key/value heads (grouped-query attention:
/// each K/V head serves `q / kv` consecutive query heads) and the head size. Packed rows
/// are `[Q | K | V]`, `(q + 2·kv)·d` wide; the context is `q·d` wide.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Heads {
    pub q: usize,
    pub kv: usize,
    pub d: usize,
}

impl Heads {
    /// Multi-head attention over `hidden` split into `heads` (every encoder).
    pub(crate) fn mha(hidden: usize, heads: usize) -> Self {
        Self {
            q: heads,
            kv: heads,
            d: hidden / heads,
        }
    }

    /// Width of a packed `[Q | K | V]` row.
    pub(crate) fn qkv_width(self) -> usize {
        (self.q + 2 * self.kv) * self.d
    }
}

/// Which keys a query sees, beyond its own row's real tokens.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Mask<'a> {
    /// Every token of the row.
    Full,
    /// Tokens within w positions (ModernBERT's local layers).
    Window(usize),
    /// Tokens at or before it (decoders).
    Causal,
    /// Every token, with an additive per-head bias by relative position (MPNet).
    Relative(&'a RelativeBias),
}

/// Which keys a mask lets each query see, as ranges of its row (a relative bias sees the
/// whole row; its bias is added apart): the packed CPU kernels' blocks and the cards'
/// per-token key ranges (`varlen::key_ranges`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Keys {
    Row,
    Window(usize),
    Causal,
}

impl Keys {
    pub(crate) fn of(mask: &Mask) -> Self {
        match *mask {
            Mask::Full | Mask::Relative(_) => Keys::Row,
            Mask::Window(w) => Keys::Window(w),
            Mask::Causal => Keys::Causal,
        }
    }

    /// These keys in a `len`-token row: a window that spans the whole row is no window.
    pub(crate) fn in_row_of(self, len: usize) -> Self {
        match self {
            Keys::Window(w) if w + 1 >= len => Keys::Row,
            keys => keys,
        }
    }

    /// The keys query `i` of a `len`-token row sees, as positions in the row: the row;
    /// with a window w, max(0, i − w)..min(len, i + w + 1); causal, 0..i + 1.
    pub(crate) fn range(self, i: usize, len: usize) -> std::ops::Range<usize> {
        match self {
            Keys::Row => 0..len,
            Keys::Window(w) => i.saturating_sub(w)..(i + w + 1).min(len),
            Keys::Causal => 0..i + 1,
        }
    }
}

/// An additive attention bias that depends only on the head and the relative position
/// j − i, for rows up to `span` tokens: `table[head · (2·span − 1) + (j − i + span − 1)]`
/// for the packed kernel, the same table on the batch's device for the varlen route, and
/// the same values as `[1, heads, span, span]` for the padded path.
#[derive(Debug)]
pub(crate) struct RelativeBias {
    pub span: usize,
    pub table: Vec<f32>,
    pub on_device: Option<Tensor>,
    pub padded: Option<Tensor>,
}

impl RelativeBias {
    /// Refuses a table that does not reach every row of `lens` or has no row per head.
    pub(crate) fn covers(&self, lens: &[usize], heads: Heads) -> Result<()> {
        if lens.iter().any(|&l| l > self.span) || self.table.len() != heads.q * (2 * self.span - 1)
        {
            candle_core::bail!("attention: relative bias table does not cover the batch");
        }
        Ok(())
    }
}

/// Attention for one sequence, every head, where `attention::sequence` does not serve:
/// relative-bias masks (MPNet), and CPUs without AVX2. `qkv` holds its `len`
/// packed rows of `[Q | K | V]` (Q pre-scaled by 1/√d), `out` its `len` rows of `q·d`. Per
/// head, scores = Q·Kᵀ and out = softmax(scores)·V are two single-threaded gemm calls that
/// read Q, K and V in place through strides (the caller runs sequences in parallel); only
/// one score block exists at a time, never the batch's `[B, heads, T, T]`.
///
/// Queries go in blocks, so the score buffer is a block's rows by the keys they see:
/// [`GLOBAL_BLOCK`] rows against every key without a window (against the keys up to the
/// block's last row when causal). With a `window` w, token i attends only to tokens j with
/// |i − j| ≤ w (ModernBERT's local layers): blocks are max(w, 16) rows, each scored
/// against only the keys its rows can see (the block widened by w on either side), so a
/// local layer costs O(len · w) instead of O(len²); keys inside a block's range but outside
/// a row's own window (or after it, when causal) get weight 0, as a −∞ score would give.
fn attention_seq(
    qkv: &[f32],
    len: usize,
    heads: Heads,
    mask: &Mask,
    out: &mut [MaybeUninit<f32>],
    scores: &mut Vec<f32>,
) {
    let Heads { q: nq, kv: nkv, d } = heads;
    let h = nq * d;
    let row = heads.qkv_width() as isize;
    let group = nq / nkv;
    let keys = Keys::of(mask).in_row_of(len);
    let block = match keys {
        Keys::Window(w) => w.max(16),
        Keys::Row | Keys::Causal => GLOBAL_BLOCK,
    };
    for head in 0..nq {
        let kv = head / group;
        let relative = match *mask {
            Mask::Relative(r) => {
                let w = 2 * r.span - 1;
                Some((&r.table[head * w..(head + 1) * w], r.span))
            }
            _ => None,
        };
        for i0 in (0..len).step_by(block) {
            let i1 = (i0 + block).min(len);
            // The keys any row of the block sees.
            let (lo, hi) = (keys.range(i0, len).start, keys.range(i1 - 1, len).end);
            let (m, n) = (i1 - i0, hi - lo);
            // Grown, never cleared: gemm overwrites the m × n it uses (it reads no dst).
            if scores.len() < m * n {
                scores.resize(m * n, 0.0);
            }
            let scores = &mut scores[..m * n];
            let q = qkv[i0 * row as usize + head * d..].as_ptr();
            let k = qkv[lo * row as usize + h + kv * d..].as_ptr();
            let v = qkv[lo * row as usize + h + nkv * d + kv * d..].as_ptr();
            // SAFETY: every index gemm forms stays inside the slices: Q rows i0..i1 and
            // K, V rows lo..hi (all < len) at the packed row stride from their head's
            // column, columns c < d; scores is m × n; the output block is rows i0..i1 of
            // q·d at this head's d columns. Nothing else aliases.
            unsafe {
                // scores[m, n] = Q[i0..i1, d] · K[lo..hi, d]ᵀ
                gemm::gemm(
                    m,
                    n,
                    d,
                    scores.as_mut_ptr(),
                    1,
                    n as isize,
                    false,
                    q,
                    1,
                    row,
                    k,
                    row,
                    1,
                    0.0,
                    1.0,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                );
            }
            for (r, s) in scores.chunks_mut(n).enumerate() {
                let i = i0 + r;
                let own = keys.range(i, len);
                let (a, b) = (own.start - lo, own.end - lo);
                if let Some((bias, span)) = relative {
                    // Key j = lo + c sits at j − i; the table is indexed from −(span − 1).
                    let first = lo + span - 1 - i;
                    for (x, &b) in s.iter_mut().zip(&bias[first..first + n]) {
                        *x += b;
                    }
                }
                softmax_row(&mut s[a..b]);
                s[..a].fill(0.0);
                s[b..].fill(0.0);
            }
            // SAFETY: as above.
            unsafe {
                // out[i0..i1, d] = P[m, n] · V[lo..hi, d]
                gemm::gemm(
                    m,
                    d,
                    n,
                    out[i0 * h + head * d..].as_mut_ptr().cast::<f32>(),
                    1,
                    h as isize,
                    false,
                    scores.as_ptr(),
                    1,
                    n as isize,
                    v,
                    1,
                    row,
                    0.0,
                    1.0,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                );
            }
        }
    }
}

/// Sum with eight independent accumulators: a plain `+=` loop is one serial chain that
/// strict IEEE order forbids the compiler to vectorize (this was most of softmax's time).
#[inline(always)]
fn sum8(x: &[f32]) -> f32 {
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
fn sum_sq8(x: &[f32]) -> f32 {
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
fn max8(x: &[f32]) -> f32 {
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

#[inline(always)]
fn softmax_body(x: &mut [f32]) {
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
fn softmax_row_on(isa: crate::isa::CpuIsa, x: &mut [f32]) {
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

    /// Lanes `i..` that exist in a row of `n`.
    #[inline(always)]
    fn live(n: usize, i: usize) -> __mmask16 {
        crate::isa::avx512_lanes(n - i)
    }

    /// [`super::exp`], sixteen at a time: the same reduction and polynomial, and 2^n by
    /// `vscalefps`.
    #[target_feature(enable = "avx512f")]
    fn exp16(x: __m512) -> __m512 {
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
        let mut p = _mm512_set1_ps(EXP_POLY[0]);
        for &c in &EXP_POLY[1..] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
        }
        _mm512_scalef_ps(p, n)
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn softmax_row(x: &mut [f32]) {
        let (n, p) = (x.len(), x.as_mut_ptr());
        let mut max = _mm512_set1_ps(f32::NEG_INFINITY);
        for i in (0..n).step_by(16) {
            let v = _mm512_mask_loadu_ps(max, live(n, i), p.add(i));
            max = _mm512_max_ps(max, v);
        }
        let max = _mm512_set1_ps(_mm512_reduce_max_ps(max));
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

// ---------------------------------------------------------------------------------------
// Custom ops.

fn f32_slice<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<&'a [f32]> {
    cpu_slice::<f32>(s, l, what)
}

/// A contiguous CPU tensor's values of type `T`, at its layout's offsets.
pub(crate) fn cpu_slice<'a, T: candle_core::WithDType>(
    s: &'a CpuStorage,
    l: &Layout,
    what: &str,
) -> Result<&'a [T]> {
    if s.dtype() != T::DTYPE {
        candle_core::bail!("{what}: expected {:?}, got {:?}", T::DTYPE, s.dtype());
    }
    let all = s.as_slice::<T>()?;
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&all[a..b]),
        None => candle_core::bail!("{what}: input must be contiguous"),
    }
}

struct BiasGelu;

impl CustomOp2 for BiasGelu {
    fn name(&self) -> &'static str {
        "gpulane-bias-gelu"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let x = f32_slice(s1, l1, "bias-gelu x")?;
        let bias = f32_slice(s2, l2, "bias-gelu bias")?;
        let h = bias.len();
        let mut out = vec![0f32; x.len()];
        out.par_chunks_mut(h * ROWS_PER_TASK)
            .zip(x.par_chunks(h * ROWS_PER_TASK))
            .for_each(|(o, x)| {
                for (o, x) in o.chunks_mut(h).zip(x.chunks(h)) {
                    bias_gelu_row(x, bias, o);
                }
            });
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((
            crate::cuda::bias_gelu((s1, l1), (s2, l2))?,
            l1.shape().clone(),
        ))
    }
}

struct GatedGelu;

impl CustomOp1 for GatedGelu {
    fn name(&self) -> &'static str {
        "gpulane-gated-gelu"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = f32_slice(s1, l1, "gated-gelu x")?;
        let (n, two_i) = l1.shape().dims2()?;
        Ok((
            CpuStorage::F32(gated_rows(x, two_i, gated_gelu_row)),
            Shape::from((n, two_i / 2)),
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (n, two_i) = l1.shape().dims2()?;
        Ok((
            crate::cuda::gated_gelu((s1, l1))?,
            Shape::from((n, two_i / 2)),
        ))
    }
}

struct AddNorm {
    eps: f32,
}

impl CustomOp3 for AddNorm {
    fn name(&self) -> &'static str {
        "gpulane-add-layer-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let x = f32_slice(s1, l1, "add-norm x")?;
        let res = f32_slice(s2, l2, "add-norm residual")?;
        let params = f32_slice(s3, l3, "add-norm params")?;
        let h = params.len() / 3;
        let mut out = vec![0f32; x.len()];
        out.par_chunks_mut(h * ROWS_PER_TASK)
            .zip(x.par_chunks(h * ROWS_PER_TASK))
            .zip(res.par_chunks(h * ROWS_PER_TASK))
            .for_each(|((o, x), r)| {
                for ((o, x), r) in o.chunks_mut(h).zip(x.chunks(h)).zip(r.chunks(h)) {
                    add_norm_row(x, r, params, self.eps, o);
                }
            });
        Ok((CpuStorage::F32(out), l1.shape().clone()))
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
        let out = crate::cuda::add_norm((s1, l1), (s2, l2), (s3, l3), self.eps)?;
        Ok((out, l1.shape().clone()))
    }
}

/// Self-attention over packed rows (see [`attention`]).
struct PackedAttention<'a> {
    starts: &'a [usize],
    lens: &'a [usize],
    heads: Heads,
    mask: Mask<'a>,
    /// Full, causal and windowed masks on `attention::sequence` (AVX2, AVX-512), not
    /// `gemm`.
    panels: bool,
}

impl CustomOp1 for PackedAttention<'_> {
    fn name(&self) -> &'static str {
        "gpulane-packed-attention"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout) -> Result<(CpuStorage, Shape)> {
        let qkv = f32_slice(s1, l1, "attention qkv")?;
        let (n, width) = l1.shape().dims2()?;
        if width != self.heads.qkv_width() {
            candle_core::bail!("attention: rows of {width} values for {:?}", self.heads);
        }
        if self.lens.iter().sum::<usize>() != n || self.starts.len() != self.lens.len() {
            candle_core::bail!("attention: sequence lengths do not cover the {n} packed rows");
        }
        let h = self.heads.q * self.heads.d;
        // Not zeroed first: both routes store every output of every sequence.
        let mut out: Vec<f32> = Vec::with_capacity(n * h);
        // Each sequence's output rows are one contiguous block: split them off in order
        // so sequences run in parallel without sharing anything mutable.
        let mut blocks = Vec::with_capacity(self.lens.len());
        let mut rest = &mut out.spare_capacity_mut()[..n * h];
        for &len in self.lens {
            let (block, tail) = rest.split_at_mut(len * h);
            blocks.push(block);
            rest = tail;
        }
        blocks
            .into_par_iter()
            .zip(self.starts.par_iter().zip(self.lens.par_iter()))
            .for_each_init(Scratch::default, |scratch, (block, (&start, &len))| {
                if len == 0 {
                    return;
                }
                let rows = &qkv[start * width..(start + len) * width];
                if self.panels && !matches!(self.mask, Mask::Relative(_)) {
                    let keys = Keys::of(&self.mask).in_row_of(len);
                    attention::sequence(rows, len, self.heads, keys, block, scratch)
                } else {
                    // The relative bias is attention_seq's alone.
                    let scores = &mut scratch.scores;
                    attention_seq(rows, len, self.heads, &self.mask, block, scores)
                }
            });
        // SAFETY: the sequences' blocks cover all n rows (the lens sum to n, checked
        // above), and each route stores every value of its block.
        unsafe { out.set_len(n * h) };
        Ok((CpuStorage::F32(out), Shape::from((n, h))))
    }
}

/// Self-attention of packed rows: `qkv` is `[N, (q + 2·kv)·d]` (Q pre-scaled), rows
/// `starts[i]..starts[i] + lens[i]` are sequence i, which attends only to itself, and
/// within it only to the keys `mask` lets it see; the result is `[N, q·d]`. CPU f32 only
/// (callers use the padded path elsewhere).
pub(crate) fn attention(
    qkv: &Tensor,
    starts: &[usize],
    lens: &[usize],
    heads: Heads,
    mask: Mask,
) -> Result<Tensor> {
    attention_on(qkv, starts, lens, heads, mask, attention::runs_here())
}

/// [`attention`], with full, causal and windowed masks on `attention::sequence` where
/// `panels` (tests run both routes).
fn attention_on(
    qkv: &Tensor,
    starts: &[usize],
    lens: &[usize],
    heads: Heads,
    mask: Mask,
    panels: bool,
) -> Result<Tensor> {
    if let Mask::Relative(r) = mask {
        r.covers(lens, heads)?;
    }
    qkv.apply_op1_no_bwd(&PackedAttention {
        starts,
        lens,
        heads,
        mask,
        panels,
    })
}

/// Whether packed [`attention`] serves a model on `device` in `dtype` (the CPU in f32);
/// everything else takes the padded path and [`masked_softmax`].
pub(crate) fn packed_attention_runs(device: &candle_core::Device, dtype: DType) -> bool {
    device.is_cpu() && dtype == DType::F32
}

/// Which element-wise kernels a card runs: gpulane's own (`models/cuda/kernels.cu`, with
/// the varlen route), or candle's ops (with `--gpu-attention padded`, the whole route as
/// it was before gpulane's CUDA kernels, to compare with and to fall back on). The CPU
/// runs its own fused kernels in f32 either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CardOps {
    Gpulane,
    Candle,
}

/// Whether the fused kernels (`bias_gelu`, `gated_gelu`, `add_norm`) run for this
/// tensor: gpulane's CPU ones in f32, its CUDA ones in f32, f16 and bf16 unless `ops`
/// says candle's.
fn fused(t: &Tensor, ops: CardOps) -> bool {
    cpu_f32(t)
        || (t.is_contiguous()
            && t.device().is_cuda()
            && cfg!(feature = "cuda")
            && ops == CardOps::Gpulane
            && matches!(t.dtype(), DType::F32 | DType::F16 | DType::BF16))
}

/// GELU (erf) of `x + bias`, `bias` broadcast over the last dimension.
pub(crate) fn bias_gelu(x: &Tensor, bias: &Tensor, ops: CardOps) -> Result<Tensor> {
    if fused(x, ops) && fused(bias, ops) {
        x.apply_op2_no_bwd(bias, &BiasGelu)
    } else {
        x.broadcast_add(bias)?.gelu_erf()
    }
}

/// GELU (erf) of the first half of `x`'s last dimension times its second half: `[N, 2I]`
/// in, `[N, I]` out.
pub(crate) fn gated_gelu(x: &Tensor, ops: CardOps) -> Result<Tensor> {
    if fused(x, ops) {
        x.apply_op1_no_bwd(&GatedGelu)
    } else {
        let i = x.dim(candle_core::D::Minus1)? / 2;
        x.narrow(candle_core::D::Minus1, 0, i)?.gelu_erf()?
            * x.narrow(candle_core::D::Minus1, i, i)?
    }
}

/// SiLU of the first half of `x`'s last dimension times its second half: `[N, 2I]` in,
/// `[N, I]` out, on the CPU in f32 only (callers check [`cpu_f32`]; candle's SiLU calls
/// scalar `exp` on one strided half, then multiplies by the other: 15% of a Qwen3 int8
/// forward pass).
pub(crate) fn gated_silu(x: &Tensor) -> Result<Tensor> {
    let (n, two_i) = x.dims2()?;
    let out = gated_rows(
        CpuF32::read(x, "gated-silu x")?.values(),
        two_i,
        gated_silu_row,
    );
    Tensor::from_vec(out, (n, two_i / 2), x.device())
}

/// `row(x, out)` over every `two_i`-wide row of a gated up-projection, in parallel:
/// `[N, 2I]` in, `[N, I]` out.
pub(crate) fn gated_rows(x: &[f32], two_i: usize, row: fn(&[f32], &mut [f32])) -> Vec<f32> {
    let i = two_i / 2;
    let mut out = vec![0f32; x.len() / 2];
    out.par_chunks_mut(i * ROWS_PER_TASK)
        .zip(x.par_chunks(two_i * ROWS_PER_TASK))
        .for_each(|(o, x)| {
            for (o, x) in o.chunks_mut(i).zip(x.chunks(two_i)) {
                row(x, o);
            }
        });
    out
}

/// Per-head RMSNorm of Q (weight `q_norm`, `[d]`) and K (`k_norm`), then rotary
/// rotate-half by each token's angles (`cos`, `sin`: `N × d/2` values, read once per
/// batch by the caller, not once per layer), on a packed `[N, (q + 2·kv)·d]` `qkv`; V
/// passes through. One pass over a copy of `qkv`, on the CPU in f32 only (callers check
/// [`cpu_f32`]): the candle chain it replaces (narrow, copy, norm, concatenate, copy,
/// rotate, concatenate) was a quarter of a Qwen3 int8 pass.
pub(crate) fn qk_norm_rope(
    qkv: &Tensor,
    q_norm: &Tensor,
    k_norm: &Tensor,
    cos: &[f32],
    sin: &[f32],
    heads: Heads,
    eps: f32,
) -> Result<Tensor> {
    if q_norm.elem_count() != heads.d || k_norm.elem_count() != heads.d {
        candle_core::bail!("qk-norm-rope: norms of {heads:?} are not [d]");
    }
    // The norms' weights read in place, like every other weight of the fused CPU paths.
    let (qw, kw) = (
        CpuF32::read(q_norm, "q norm")?,
        CpuF32::read(k_norm, "k norm")?,
    );
    let (qw, kw) = (qw.values(), kw.values());
    rows_with_angles(qkv, cos, sin, heads, |row, c, s| {
        qk_norm_rope_row(row, qw, kw, c, s, heads, eps)
    })
}

/// Q and K of a packed `[N, (q + 2·kv)·d]` `qkv` rotated rotate-half style by each
/// token's angles (`cos`, `sin`: `N × d/2` values); V passes through. One pass over a copy
/// of `qkv`, on the CPU in f32 only (callers check [`cpu_f32`]), with the bits of the
/// candle chain cards run, which copies Q and K out, rotates them in a scalar loop that
/// strides over heads, and concatenates them back with V (three passes; 2-4% of a
/// ModernBERT-mini pass over long passages by a profile).
pub(crate) fn rope(qkv: &Tensor, cos: &[f32], sin: &[f32], heads: Heads) -> Result<Tensor> {
    rows_with_angles(qkv, cos, sin, heads, |row, c, s| rope_row(row, c, s, heads))
}

/// `row(token's row, its cos, its sin)` on each row of a copy of `qkv`, tasks of
/// [`ROWS_PER_TASK`] rows in parallel, after checking that `qkv` is `heads`' packed rows
/// and that the angles cover every token.
fn rows_with_angles(
    qkv: &Tensor,
    cos: &[f32],
    sin: &[f32],
    heads: Heads,
    row: impl Fn(&mut [f32], &[f32], &[f32]) + Sync,
) -> Result<Tensor> {
    let (n, width) = qkv.dims2()?;
    if width != heads.qkv_width() || !heads.d.is_multiple_of(2) {
        candle_core::bail!("rope: qkv [{n}, {width}] does not fit {heads:?}");
    }
    let half = heads.d / 2;
    if cos.len() != n * half || sin.len() != n * half {
        candle_core::bail!("rope: angles for {} tokens, not {n}", cos.len() / half);
    }
    let mut out = CpuF32::read(qkv, "rope qkv")?.values().to_vec();
    out.par_chunks_mut(width * ROWS_PER_TASK)
        .zip(cos.par_chunks(half * ROWS_PER_TASK))
        .zip(sin.par_chunks(half * ROWS_PER_TASK))
        .for_each(|((o, c), s)| {
            for ((r, c), s) in o.chunks_mut(width).zip(c.chunks(half)).zip(s.chunks(half)) {
                row(r, c, s);
            }
        });
    Tensor::from_vec(out, (n, width), qkv.device())
}

/// Whether `t` is a contiguous f32 tensor on the CPU: what the CPU-only fused kernels
/// ([`gated_silu`], [`qk_norm_rope`]) read in place.
pub(crate) fn cpu_f32(t: &Tensor) -> bool {
    t.is_contiguous() && t.device().is_cpu() && t.dtype() == DType::F32
}

/// A contiguous CPU f32 tensor's values, read in place: its storage's read lock and the
/// range its layout covers. A fused step that reads several tensors holds one each, named
/// one after another, instead of nesting a closure per tensor; the lock keeps the storage
/// as `read` found it for as long as the values are borrowed. It is candle's non-recursive
/// read lock: two reads of one storage on one thread could wait on each other behind a
/// queued writer. Nothing in gpulane writes to a tensor in place, and the tensors read
/// together are separate allocations.
pub(crate) struct CpuF32<'a> {
    storage: candle_core::StorageRef<'a>,
    range: std::ops::Range<usize>,
}

impl<'a> CpuF32<'a> {
    /// `t`'s values, or an error naming `what` where `t` is not contiguous f32 on the CPU.
    pub(crate) fn read(t: &'a Tensor, what: &str) -> Result<Self> {
        let (storage, layout) = t.storage_and_layout();
        let candle_core::Storage::Cpu(cpu) = &*storage else {
            candle_core::bail!("{what}: not on the CPU");
        };
        let len = f32_slice(cpu, layout, what)?.len();
        let range = layout.start_offset()..layout.start_offset() + len;
        Ok(Self { storage, range })
    }

    /// `read`'s tensor's values.
    pub(crate) fn values(&self) -> &[f32] {
        match &*self.storage {
            candle_core::Storage::Cpu(CpuStorage::F32(v)) => &v[self.range.clone()],
            // `read` checked both, and the read lock keeps them so.
            _ => unreachable!("CpuF32 holds CPU f32 storage"),
        }
    }
}

/// [`CpuF32::read`] for a tensor that may be absent (an optional bias).
pub(crate) fn read_optional<'a>(t: Option<&'a Tensor>, what: &str) -> Result<Option<CpuF32<'a>>> {
    t.map(|t| CpuF32::read(t, what)).transpose()
}

/// LayerNorm(x + bias + residual) with `params` = [bias; gamma; beta] as one `[3, H]`
/// tensor (one operand instead of three).
pub(crate) fn add_norm(
    x: &Tensor,
    residual: &Tensor,
    params: &Tensor,
    eps: f32,
    ops: CardOps,
) -> Result<Tensor> {
    if fused(x, ops) && fused(residual, ops) && fused(params, ops) {
        x.apply_op3_no_bwd(residual, params, &AddNorm { eps })
    } else {
        let (bias, gamma, beta) = (params.get(0)?, params.get(1)?, params.get(2)?);
        let sum = (x.broadcast_add(&bias)? + residual)?;
        candle_nn::ops::layer_norm(&sum, &gamma, &beta, eps)
    }
}

/// Softmax over the last dimension of attention scores `[B, heads, T, T]` plus `bias`,
/// one additive term in the scores' dtype, broadcast over them: the key mask `[B, 1, 1,
/// T]` (0 for real keys, −∞ for padding), or for a sliding-window layer that mask plus
/// the band (see [`band`]), `[B, 1, T, T]`; the caller builds either once per batch. The
/// padded attention path's softmax (CUDA, f16/bf16); the CPU in f32 runs [`attention`]
/// instead, so this is plain candle ops.
///
/// `scores` is taken by value and dropped once masked, so no more than two score-sized
/// tensors are alive at once: the count `ModelInfo::working_bytes` charges.
pub(crate) fn masked_softmax(scores: Tensor, bias: &Tensor) -> Result<Tensor> {
    let masked = scores.broadcast_add(bias)?;
    drop(scores);
    candle_nn::ops::softmax_last_dim(&masked)
}

/// What the band adds outside a window: finite, so that a padded query slot whose window
/// holds no real key still gets a defined softmax (its row is discarded), and so far below
/// any attention score that its weight is exactly 0 in f16, bf16 and f32.
const OUTSIDE_WINDOW: f64 = -30_000.0;

/// The additive `[T, T]` mask of a sliding window, in `dtype`, built on `device`: 0 where
/// |i − j| ≤ `window`, [`OUTSIDE_WINDOW`] beyond.
pub(crate) fn band(
    t: usize,
    window: usize,
    dtype: DType,
    device: &candle_core::Device,
) -> Result<Tensor> {
    let pos = Tensor::arange(0f32, t as f32, device)?;
    let distance = pos
        .reshape((t, 1))?
        .broadcast_sub(&pos.reshape((1, t))?)?
        .abs()?;
    distance
        .gt(window as f64)?
        .to_dtype(dtype)?
        .affine(OUTSIDE_WINDOW, 0.0)
}

/// The additive `[T, T]` causal mask, in `dtype`, built on `device`: 0 where key j ≤
/// query i, [`OUTSIDE_WINDOW`] after (finite, for the same reason as the band's).
pub(crate) fn causal(t: usize, dtype: DType, device: &candle_core::Device) -> Result<Tensor> {
    let pos = Tensor::arange(0f32, t as f32, device)?;
    pos.reshape((1, t))?
        .broadcast_gt(&pos.reshape((t, 1))?)?
        .to_dtype(dtype)?
        .affine(OUTSIDE_WINDOW, 0.0)
}

/// The reference paths, for tests: the same results through plain candle ops.
#[cfg(test)]
pub(crate) mod tests {
    use candle_core::{Device, D};

    use super::*;

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

    /// erf in f64, independent of the kernel's rational approximation: the Taylor series
    /// where it converges without cancellation (|x| ≤ 3), the asymptotic erfc beyond.
    fn libm_erf(x: f64) -> f64 {
        let a = x.abs();
        if a > 3.0 {
            let x2 = a * a;
            let series =
                1.0 - 1.0 / (2.0 * x2) + 3.0 / (4.0 * x2 * x2) - 15.0 / (8.0 * x2 * x2 * x2);
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
        let got = attention(&qkv, &starts, &lens, Heads::mha(h, heads), Mask::Full).unwrap();
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
            let p =
                candle_nn::ops::softmax(&q.matmul(&k.t().unwrap()).unwrap(), D::Minus1).unwrap();
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
        let full = attention(&qkv, &starts, &lens, Heads::mha(h, heads), Mask::Full).unwrap();
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
}
