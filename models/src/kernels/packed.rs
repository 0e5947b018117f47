//! Packed self-attention on the CPU: every sequence of a batch attends only to itself,
//! with no padding, under a full, windowed, causal or relative-bias mask; its products in
//! f32, or in int8 for the int8 dtype where the CPU has VNNI.

use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;
use std::mem::MaybeUninit;

use super::{read::f32_slice, softmax::softmax_row};
use crate::attention::{self, Scratch};
#[cfg(target_arch = "x86_64")]
use crate::int8;

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

/// What attention's two products (Q·Kᵀ and P·V) multiply in: f32, every dtype's on the
/// CPU and exact; or int8, the int8 dtype's (`int8::attend`) where the CPU has AVX-512
/// VNNI and the mask has no relative bias, f32 elsewhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Products {
    F32,
    Int8,
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

/// Self-attention over packed rows (see [`attention`]).
struct PackedAttention<'a> {
    starts: &'a [usize],
    lens: &'a [usize],
    heads: Heads,
    mask: Mask<'a>,
    /// Full, causal and windowed masks on `attention::sequence` (AVX2, AVX-512), not
    /// `gemm`.
    panels: bool,
    products: Products,
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
            .for_each_init(Scratches::default, |scratch, (block, (&start, &len))| {
                if len == 0 {
                    return;
                }
                let rows = &qkv[start * width..(start + len) * width];
                let keys = Keys::of(&self.mask).in_row_of(len);
                let relative = matches!(self.mask, Mask::Relative(_));
                #[cfg(target_arch = "x86_64")]
                if self.products == Products::Int8 && !relative && int8::attend_runs_here() {
                    return int8::attend(rows, len, self.heads, keys, block, &mut scratch.int8);
                }
                let scratch = &mut scratch.f32;
                if self.panels && !relative {
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

/// One thread's buffers for either route of [`PackedAttention`].
#[derive(Default)]
struct Scratches {
    f32: Scratch,
    #[cfg(target_arch = "x86_64")]
    int8: int8::AttendScratch,
}

/// Self-attention of packed rows: `qkv` is `[N, (q + 2·kv)·d]` (Q pre-scaled), rows
/// `starts[i]..starts[i] + lens[i]` are sequence i, which attends only to itself, and
/// within it only to the keys `mask` lets it see; the result is `[N, q·d]`, its products
/// in `products`. CPU f32 tensors only (callers use the padded path elsewhere).
pub(crate) fn attention(
    qkv: &Tensor,
    starts: &[usize],
    lens: &[usize],
    heads: Heads,
    mask: Mask,
    products: Products,
) -> Result<Tensor> {
    let panels = attention::runs_here();
    attention_with(qkv, (starts, lens), heads, mask, panels, products)
}

/// [`attention`], with full, causal and windowed masks on `attention::sequence` where
/// `panels` (tests run both routes).
#[cfg(test)]
pub(super) fn attention_on(
    qkv: &Tensor,
    starts: &[usize],
    lens: &[usize],
    heads: Heads,
    mask: Mask,
    panels: bool,
) -> Result<Tensor> {
    attention_with(qkv, (starts, lens), heads, mask, panels, Products::F32)
}

/// [`attention_on`] with its products in `products`.
pub(super) fn attention_with(
    qkv: &Tensor,
    (starts, lens): (&[usize], &[usize]),
    heads: Heads,
    mask: Mask,
    panels: bool,
    products: Products,
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
        products,
    })
}

/// Whether packed [`attention`] serves a model on `device` in `dtype` (the CPU in f32);
/// everything else takes the padded path and [`masked_softmax`](super::masked_softmax).
pub(crate) fn packed_attention_runs(device: &candle_core::Device, dtype: DType) -> bool {
    device.is_cpu() && dtype == DType::F32
}
