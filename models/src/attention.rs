//! Attention for one sequence on AVX2 and AVX-512 CPUs, through the dense kernel's tiles
//! ([`dense::panel`]): Kᵀ and V of each K/V head are laid out once as 32-column panels,
//! then every query block is two panel products and a softmax.
//!
//! Why not the `gemm` calls of `kernels::attention_seq` here: `gemm` packs both operands
//! again on every call, and K and V sit in the packed QKV rows at a stride of the whole
//! row, so for Qwen3's long passages in int8 packing was a fifth of attention's samples.
//! And the causal mask (decoders) could only be skipped by cutting the queries into small
//! blocks, each of which packed K again, which cost what it saved (measured on the AMD
//! Zen 5, benches/RESULTS.md). Here K and V are packed once per K/V head, shared by the
//! query heads of its group (grouped-query attention) and by every block, so causal blocks
//! can be small and score only the keys up to their last row.
//!
//! [`block`] runs a whole attention block per task of whole sequences on one thread, so
//! the intermediate rows stay in that core's cache: BERT's (QKV product, attention, output
//! product, add-norm) and the pre-norm families' (norm, QKV product, RoPE, attention,
//! output product, residual: ModernBERT's, and Qwen3's with each Q and K head
//! RMS-normalized before its rotation).

use std::{cell::RefCell, mem::MaybeUninit};

use rayon::prelude::*;

use crate::{
    dense::{self, Dst, Epilogue, Panel, RowNorm, TaskProduct, NR},
    feed_forward::PreNorm,
    isa::cpu_isa,
    kernels::{add_into, qk_norm_rope_row, rope_row, softmax_row, Heads, Keys},
};
#[cfg(target_arch = "x86_64")]
use crate::{int8, kernels::Products};

/// Query rows per block: four of the 12-row AVX-512 tiles that attention's 32-column
/// panels take (six of the dense layers' 8-row ones, eight AVX2 ones); half that under a
/// window. Under a causal mask a block is scored against the keys up to its last row
/// only: a 256-token row computes 59% of the full square.
const BLOCK: usize = 48;

/// What one thread reuses from sequence to sequence: one K/V head's packed Kᵀ and V, and
/// one block's scores (grown, never shrunk).
#[derive(Default)]
pub(crate) struct Scratch {
    keys: Vec<f32>,
    values: Vec<f32>,
    pub(crate) scores: Vec<f32>,
}

/// Whether this CPU runs [`sequence`] (the dense kernel's test).
pub(crate) fn runs_here() -> bool {
    dense::runs_here()
}

/// Attention for one sequence, every head: `qkv` holds its `len` packed rows of
/// `[Q | K | V]` (Q pre-scaled by 1/√d), `out` its `len` rows of `q·d`; each query sees
/// the keys `keys_seen` names. A block of queries is scored only against the key panels
/// its rows can see: up to its last row when causal, and within w of its rows under a
/// window, so a local layer costs O(len · w), not O(len²). Panics where [`runs_here`] is
/// false.
pub(crate) fn sequence(
    qkv: &[f32],
    len: usize,
    heads: Heads,
    keys_seen: Keys,
    out: &mut [MaybeUninit<f32>],
    scratch: &mut Scratch,
) {
    assert!(runs_here(), "panel attention on a CPU without AVX2");
    let Heads { q: nq, kv: nkv, d } = heads;
    let (h, row) = (nq * d, heads.qkv_width());
    assert_eq!(qkv.len(), len * row, "qkv is not [{len}, {row}]");
    assert_eq!(out.len(), len * h, "out is not [{len}, {h}]");
    let group = nq / nkv;
    // Key panels: Kᵀ as [len / 32][d][32]; value panels: V as [d / 32][len][32]. Their
    // padding (keys past len, value columns past d) stays zero: only real ones are written.
    let (key_panels, value_panels) = (len.div_ceil(NR), d.div_ceil(NR));
    let stride = key_panels * NR;
    let Scratch {
        keys,
        values,
        scores,
    } = scratch;
    keys.clear();
    keys.resize(key_panels * d * NR, 0.0);
    values.clear();
    values.resize(value_panels * len * NR, 0.0);
    if scores.len() < BLOCK * stride {
        scores.resize(BLOCK * stride, 0.0);
    }
    // A block sees its rows' keys and w more either side, of which each row uses 2w + 1:
    // at ModernBERT's w = 64, 48 rows score about 1.5 keys per key used and 24 rows 1.3
    // (a 0.7% faster pass over long passages on an AMD Zen 4, benches/RESULTS.md).
    let block = match keys_seen {
        Keys::Window(_) => BLOCK / 2,
        Keys::Row | Keys::Causal => BLOCK,
    };
    for kv in 0..nkv {
        let (k_col, v_col) = (h + kv * d, h + (nkv + kv) * d);
        for j in 0..len {
            let (p, jj) = (j / NR, j % NR);
            for (c, &x) in qkv[j * row + k_col..][..d].iter().enumerate() {
                keys[(p * d + c) * NR + jj] = x;
            }
            for (p, cols) in qkv[j * row + v_col..][..d].chunks(NR).enumerate() {
                let at = (p * len + j) * NR;
                values[at..at + cols.len()].copy_from_slice(cols);
            }
        }
        for head in kv * group..(kv + 1) * group {
            for i0 in (0..len).step_by(block) {
                let m = (i0 + block).min(len) - i0;
                // The keys any row of the block sees, from the start of their first panel:
                // score column c is key `first + c`.
                let seen = keys_seen.range(i0, len).start..keys_seen.range(i0 + m - 1, len).end;
                let first = seen.start / NR * NR;
                for p in first / NR..seen.end.div_ceil(NR) {
                    // SAFETY: `runs_here` holds. Q rows i0..i0 + m at this head's d
                    // columns, the row stride apart, lie inside `qkv`; key panel p holds
                    // d × 32; scores hold BLOCK rows of `stride` ≥ every panel's columns.
                    unsafe {
                        dense::panel(Panel {
                            x: qkv.as_ptr().add(i0 * row + head * d),
                            lda: row,
                            rows: m,
                            k: d,
                            w: keys.as_ptr().add(p * d * NR),
                            width: NR,
                            y: scores.as_mut_ptr().add(p * NR - first),
                            ldy: stride,
                            live: (seen.end - p * NR).min(NR),
                            c0: 0,
                            epi: Epilogue::None,
                        })
                    };
                }
                let width = seen.end - first;
                for (r, s) in scores.chunks_mut(stride).take(m).enumerate() {
                    let own = keys_seen.range(i0 + r, len);
                    let (a, b) = (own.start - first, own.end - first);
                    softmax_row(&mut s[a..b]);
                    s[..a].fill(0.0);
                    s[b..width].fill(0.0);
                }
                for p in 0..value_panels {
                    // SAFETY: as above; score rows have `width` real columns, value
                    // panel p holds len ≥ first + width rows of 32 (read from row
                    // `first`), and the outputs are rows i0..i0 + m of `out` at this
                    // head's columns p·32.. (≤ d of them).
                    unsafe {
                        dense::panel(Panel {
                            x: scores.as_ptr(),
                            lda: stride,
                            rows: m,
                            k: width,
                            w: values.as_ptr().add((p * len + first) * NR),
                            width: NR,
                            y: out.as_mut_ptr().add(i0 * h + head * d + p * NR).cast(),
                            ldy: h,
                            live: (d - p * NR).min(NR),
                            c0: 0,
                            epi: Epilogue::None,
                        })
                    };
                }
            }
        }
    }
}

/// The weights of an attention block, packed for the dense kernel (f32 or int8): the QKV
/// projection (Q's columns pre-scaled by 1/√d) and the output projection, each with its
/// bias if it has one (BERT's output bias is in its add-norm's params instead).
pub(crate) struct BlockWeights<'a, W> {
    pub(crate) qkv: &'a W,
    pub(crate) qkv_bias: Option<&'a [f32]>,
    pub(crate) out: &'a W,
    pub(crate) out_bias: Option<&'a [f32]>,
}

// Not derived: a derive would ask `W: Copy` of the weights behind the references.
impl<W> Clone for BlockWeights<'_, W> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<W> Copy for BlockWeights<'_, W> {}

/// What a [`block`] does around its attention.
#[derive(Clone, Copy)]
pub(crate) enum Around<'a> {
    /// BERT's post-norm: `norm.apply` (add-norm with the residual, which is the block's
    /// input) after the output product.
    PostNorm(RowNorm<'a>),
    /// A pre-norm layer's (ModernBERT's, Qwen3's): the input through `norm` (none in
    /// ModernBERT's first layer) before the QKV product, Q and K rotated by each token's
    /// angles (`cos` and `sin`, `[rows, d/2]`, as `kernels::rope`), each Q and K head first
    /// RMS-normalized with `qk_norm`'s weights where given (Qwen3's, as
    /// `kernels::qk_norm_rope`), and the input added back after the output product.
    PreNorm {
        norm: Option<(PreNorm<'a>, f32)>,
        qk_norm: Option<(&'a [f32], &'a [f32], f32)>,
        cos: &'a [f32],
        sin: &'a [f32],
    },
}

/// What one thread reuses from task to task in [`block`]: its rows normalized (pre-norm
/// only), their QKV, their context, and the attention's own scratch (f32's, or int8's).
#[derive(Default)]
struct BlockScratch {
    normed: Vec<f32>,
    qkv: Vec<f32>,
    ctx: Vec<f32>,
    attention: Scratch,
    #[cfg(target_arch = "x86_64")]
    int8: int8::AttendScratch,
}

thread_local! {
    static BLOCK_SCRATCH: RefCell<BlockScratch> = RefCell::new(BlockScratch::default());
}

/// Frees this thread's [`block`] buffers (an idle engine hands them back on every thread
/// of its pool before the heap is trimmed: up to a few MiB a thread at BERT-large's
/// widths).
pub(crate) fn release_thread_buffer() {
    // Never borrowed here (nothing inside a borrow calls into rayon, where this could
    // run); were it, the buffer is left for next time rather than the engine panicking.
    BLOCK_SCRATCH.with(|s| {
        if let Ok(mut s) = s.try_borrow_mut() {
            *s = BlockScratch::default();
        }
    });
}

/// An attention block over packed rows, each query seeing `keys` of its row: for `x` the
/// `[Σ lens, k]` rows of sequences of `lens` tokens in turn, BERT's
/// `norm(attention(x · qkv + qkv_bias) · out)` or a pre-norm layer's
/// `x + attention(rope(norm(x) · qkv + qkv_bias)) · out + out_bias` (see [`Around`]; the
/// biases where the weights have them). Each task takes whole sequences,
/// [`TaskProduct::TASK_ROWS`] rows or more (the last task what is left), through every
/// step on one thread, their QKV (a 256-token passage's: 1.1 MiB at MiniLM's widths) and
/// context in the thread's buffers, so its core's L2 (inferred from the sizes), rather
/// than out to `[N, 3H]` and `[N, H]` tensors (36 and 12 MiB for 32 such passages) and
/// back. Measured for BERT: +3.8% on long passages, +2.8% on short sentences
/// (benches/RESULTS.md). The same kernels in the same order as the steps apart, so the
/// same bits (on the CPU every norm is `kernels::layer_norm_rows` / `rms_norm_rows`,
/// fused or not). None where the batch makes too few tasks to keep every core busy: the
/// caller runs the steps apart, whose products also split columns across tasks; or where
/// this CPU runs neither attention route (no AVX2). On int8 weights attention runs in
/// int8 where the CPU has VNNI (`int8::attend`), as `kernels::attention` runs it apart.
pub(crate) fn block<W: TaskProduct>(
    w: BlockWeights<W>,
    x: &[f32],
    lens: &[usize],
    heads: Heads,
    keys: Keys,
    around: Around,
) -> Option<Vec<f32>> {
    let (k, width, h, n) = (
        w.qkv.in_features(),
        heads.qkv_width(),
        heads.q * heads.d,
        w.out.out_features(),
    );
    let m: usize = lens.iter().sum();
    assert_eq!(w.qkv.out_features(), width, "QKV is not [{k}, {width}]");
    assert!(
        w.qkv_bias.is_none_or(|b| b.len() == width),
        "QKV bias is not [{width}]"
    );
    assert_eq!(
        w.out.in_features(),
        h,
        "the output projection is not [{h}, {n}]"
    );
    assert!(
        w.out_bias.is_none_or(|b| b.len() == n),
        "output bias is not [{n}]"
    );
    assert_eq!(x.len(), m * k, "input is not [{m}, {k}]");
    let half = heads.d / 2;
    match around {
        Around::PostNorm(norm) => {
            norm.assert_fits(m, n);
        }
        Around::PreNorm {
            norm,
            qk_norm,
            cos,
            sin,
        } => {
            assert_eq!(n, k, "a pre-norm block's residual is its input: [{m}, {k}]");
            assert!(
                qk_norm.is_none_or(|(q, k, _)| q.len() == heads.d && k.len() == heads.d),
                "q/k norms are not [{}]",
                heads.d
            );
            assert!(
                norm.is_none_or(|(p, _)| p.width() == k),
                "norm is not [{k}]"
            );
            assert!(
                heads.d.is_multiple_of(2),
                "RoPE on heads of odd width {}",
                heads.d
            );
            assert_eq!(cos.len(), m * half, "cos is not [{m}, {half}]");
            assert_eq!(sin.len(), m * half, "sin is not [{m}, {half}]");
        }
    }
    let (qkv_epi, out_epi) = (
        w.qkv_bias.map_or(Epilogue::None, Epilogue::Bias),
        w.out_bias.map_or(Epilogue::None, Epilogue::Bias),
    );
    // (first sequence, first row, sequences, rows) of each task.
    let mut tasks = Vec::new();
    let (mut seq, mut row) = (0, 0);
    while seq < lens.len() {
        let (first_seq, first_row) = (seq, row);
        while seq < lens.len() && row - first_row < W::TASK_ROWS {
            row += lens[seq];
            seq += 1;
        }
        tasks.push((first_seq, first_row, seq - first_seq, row - first_row));
    }
    if !dense::fills_the_cores(tasks.len()) || !runs_here() {
        return None;
    }
    let isa = cpu_isa();
    #[cfg(target_arch = "x86_64")]
    let int8_attention = W::PRODUCTS == Products::Int8 && int8::attend_runs_here();
    // Not zeroed first: every task stores every output of its rows.
    let mut y: Vec<f32> = Vec::with_capacity(m * n);
    let out = Dst(y.as_mut_ptr());
    tasks.into_par_iter().for_each(|(s0, r0, seqs, rows)| {
        BLOCK_SCRATCH.with_borrow_mut(|scratch| {
            let BlockScratch {
                normed,
                qkv,
                ctx,
                attention,
                #[cfg(target_arch = "x86_64")]
                int8,
            } = scratch;
            if qkv.len() < rows * width {
                qkv.resize(rows * width, 0.0);
            }
            if ctx.len() < rows * h {
                ctx.resize(rows * h, 0.0);
            }
            let mut input = &x[r0 * k..(r0 + rows) * k];
            if let Around::PreNorm {
                norm: Some((norm, eps)),
                ..
            } = around
            {
                normed.clear();
                normed.extend_from_slice(input);
                norm.apply(normed, eps);
                input = normed;
            }
            // SAFETY: `isa` is this CPU's. The task reads its own rows of the input and
            // writes its rows of the thread's `qkv` (which holds them); nothing here
            // calls into rayon, so no other task runs on this thread while the scratch is
            // borrowed.
            unsafe {
                let (x, y) = (input.as_ptr(), qkv.as_mut_ptr());
                w.qkv.rows_into_on(isa, x, k, rows, y, width, qkv_epi);
            }
            if let Around::PreNorm {
                qk_norm, cos, sin, ..
            } = around
            {
                let angles = cos[r0 * half..]
                    .chunks(half)
                    .zip(sin[r0 * half..].chunks(half));
                for (row, (c, s)) in qkv[..rows * width].chunks_exact_mut(width).zip(angles) {
                    match qk_norm {
                        Some((qw, kw, eps)) => qk_norm_rope_row(row, qw, kw, c, s, heads, eps),
                        None => rope_row(row, c, s, heads),
                    }
                }
            }
            let mut at = 0;
            for &len in &lens[s0..s0 + seqs] {
                let (first, at_end) = (at, at + len);
                at = at_end;
                if len == 0 {
                    continue;
                }
                let rows_qkv = &qkv[first * width..at_end * width];
                let rows_ctx = &mut ctx[first * h..at_end * h];
                // SAFETY: a view of initialized floats as maybe-uninitialized ones, into
                // which either route writes only floats.
                let rows_ctx = unsafe { &mut *(rows_ctx as *mut [f32] as *mut [MaybeUninit<f32>]) };
                let keys = keys.in_row_of(len);
                #[cfg(target_arch = "x86_64")]
                if int8_attention {
                    int8::attend(rows_qkv, len, heads, keys, rows_ctx, int8);
                    continue;
                }
                sequence(rows_qkv, len, heads, keys, rows_ctx, attention);
            }
            // SAFETY: as above; the task writes only its own rows of `y` (m × n).
            unsafe {
                w.out
                    .rows_into_on(isa, ctx.as_ptr(), h, rows, out.at(r0 * n), n, out_epi)
            };
        });
        match around {
            // SAFETY: this task's rows, every output of which it has just stored.
            Around::PostNorm(norm) => unsafe { norm.apply_to(out, n, r0..r0 + rows) },
            Around::PreNorm { .. } => {
                // SAFETY: as above; the task owns these rows of `y` whole, and `rows_into_on`
                // has just stored every value of them, so they are initialized floats.
                let own = unsafe { std::slice::from_raw_parts_mut(out.at(r0 * n), rows * n) };
                add_into(own, &x[r0 * n..(r0 + rows) * n]);
            }
        }
    });
    // SAFETY: the tasks cover every row, and each stores every column of its rows.
    unsafe { y.set_len(m * n) };
    Some(y)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        dense::{
            tests::{pool, same_bits, values},
            PackedLinear,
        },
        int8::QuantLinear,
    };

    /// A block's weights at `hidden` = 64, two heads of 32: QKV, output, QKV bias and the
    /// add-norm's params.
    fn weights(seed: &mut u64) -> (PackedLinear, PackedLinear, Vec<f32>, Vec<f32>) {
        let (hidden, width) = (64, HEADS.qkv_width());
        (
            PackedLinear::new(&values(hidden * width, seed), hidden, width),
            PackedLinear::new(&values(hidden * hidden, seed), hidden, hidden),
            values(width, seed),
            values(3 * hidden, seed),
        )
    }

    /// BERT's block over [`weights`]: QKV with its bias, the output without (the add-norm's
    /// params carry its bias).
    fn bert_weights(
        w: &(PackedLinear, PackedLinear, Vec<f32>, Vec<f32>),
    ) -> BlockWeights<'_, PackedLinear> {
        BlockWeights {
            qkv: &w.0,
            qkv_bias: Some(&w.2),
            out: &w.1,
            out_bias: None,
        }
    }

    const HEADS: Heads = Heads { q: 2, kv: 2, d: 32 };

    /// The attention step apart: each of `lens`' sequences of the packed `mixed` QKV rows
    /// through [`sequence`] under `keys`, as `kernels::attention` runs it.
    fn sequences(mixed: &[f32], lens: &[usize], heads: Heads, keys: Keys) -> Vec<f32> {
        let mut scratch = Scratch::default();
        each_sequence(mixed, lens, heads, |rows, len, c| {
            sequence(rows, len, heads, keys.in_row_of(len), c, &mut scratch)
        })
    }

    /// The context rows of `lens`' sequences of the packed `mixed` QKV rows, each
    /// non-empty one through `attend(rows, len, out)`.
    fn each_sequence(
        mixed: &[f32],
        lens: &[usize],
        heads: Heads,
        mut attend: impl FnMut(&[f32], usize, &mut [MaybeUninit<f32>]),
    ) -> Vec<f32> {
        let (width, h) = (heads.qkv_width(), heads.q * heads.d);
        let mut ctx = vec![0f32; lens.iter().sum::<usize>() * h];
        let mut at = 0;
        for &len in lens {
            let rows = &mixed[at * width..(at + len) * width];
            let c = &mut ctx[at * h..(at + len) * h];
            // SAFETY: floats viewed as maybe-uninitialized ones, written as floats.
            let c = unsafe { &mut *(c as *mut [f32] as *mut [MaybeUninit<f32>]) };
            if len > 0 {
                attend(rows, len, c);
            }
            at += len;
        }
        ctx
    }

    /// The block carried through per task gives the steps' bits: QKV with its bias, each
    /// sequence's attention, the output projection with the add-norm. Tasks here take a
    /// sequence of 100 rows, then 3 + 250, then an empty one + 40 + 97; a batch of two
    /// short rows makes too few tasks and is left to the caller.
    #[test]
    fn the_block_gives_the_steps_bits() {
        if !runs_here() {
            eprintln!("no AVX2 on this CPU: panel attention does not run here");
            return;
        }
        pool(1).install(|| {
            let mut seed = 5;
            let (hidden, heads) = (64, HEADS);
            let bert = weights(&mut seed);
            let (w, (qkv, out, qkv_bias, params)) = (bert_weights(&bert), &bert);
            assert!(block_on(w, &[5, 7], heads, params, &mut seed).is_none());
            let lens = [100, 3, 250, 0, 40, 97];
            let m: usize = lens.iter().sum();
            let x = values(m * hidden, &mut seed);
            let norm = RowNorm {
                residual: &x,
                params,
                eps: 1e-12,
            };
            let mixed = qkv.forward(&x, m, Epilogue::Bias(qkv_bias));
            let ctx = sequences(&mixed, &lens, heads, Keys::Row);
            let want = out.forward_norm(&ctx, m, norm);
            // Poison what the output may reuse, so a value left unwritten fails.
            drop(std::hint::black_box(vec![f32::NAN; m * hidden]));
            let got = block(w, &x, &lens, heads, Keys::Row, Around::PostNorm(norm))
                .expect("three tasks on one thread");
            let same = same_bits(&got, &want);
            assert!(same, "the block's bits differ from the steps'");
            // An idle engine's release frees what the block kept on the pool's thread.
            let held = || rayon::broadcast(|_| BLOCK_SCRATCH.with_borrow(|s| s.qkv.capacity()));
            assert!(held()[0] > 0, "the block kept no buffer to release");
            rayon::broadcast(|_| release_thread_buffer());
            assert_eq!(held(), vec![0], "the block's buffer outlived the release");
        });
    }

    /// On int8 weights too the block gives the steps' bits: the int8 QKV product, each
    /// sequence's attention as `kernels::attention` runs it for int8 (int8's own where
    /// the CPU has VNNI, else f32's), the int8 output product with the add-norm. Tasks of
    /// int8's 32 rows or more: 100, 3 + 250, 0 + 40, 97.
    #[test]
    fn the_int8_block_gives_the_steps_bits() {
        if !runs_here() {
            eprintln!("no AVX2 on this CPU: panel attention does not run here");
            return;
        }
        pool(1).install(|| {
            let mut seed = 6;
            let (hidden, heads) = (64, HEADS);
            let width = heads.qkv_width();
            // QuantLinear takes its weight `[out, in]`.
            let qkv = QuantLinear::new(&values(width * hidden, &mut seed), width, hidden);
            let out = QuantLinear::new(&values(hidden * hidden, &mut seed), hidden, hidden);
            let (qkv_bias, params) = (values(width, &mut seed), values(3 * hidden, &mut seed));
            let w = BlockWeights {
                qkv: &qkv,
                qkv_bias: Some(&qkv_bias),
                out: &out,
                out_bias: None,
            };
            let lens = [100, 3, 250, 0, 40, 97];
            let m: usize = lens.iter().sum();
            let x = values(m * hidden, &mut seed);
            let norm = RowNorm {
                residual: &x,
                params: &params,
                eps: 1e-12,
            };
            let isa = cpu_isa();
            let mixed = qkv.forward_on(isa, &x, m, Epilogue::Bias(&qkv_bias), None);
            let ctx = sequences_int8(&mixed, &lens, heads);
            let want = out.forward_on(isa, &ctx, m, Epilogue::None, Some(norm));
            // Poison what the output may reuse, so a value left unwritten fails.
            drop(std::hint::black_box(vec![f32::NAN; m * hidden]));
            let got = block(w, &x, &lens, heads, Keys::Row, Around::PostNorm(norm))
                .expect("tasks enough for one thread");
            assert!(
                same_bits(&got, &want),
                "the int8 block's bits differ from the steps'"
            );
            assert!(got.iter().all(|v| v.is_finite()));
        });
    }

    /// [`sequences`] as `kernels::attention` runs them after an int8 QKV product.
    fn sequences_int8(mixed: &[f32], lens: &[usize], heads: Heads) -> Vec<f32> {
        #[cfg(target_arch = "x86_64")]
        if int8::attend_runs_here() {
            let mut scratch = int8::AttendScratch::default();
            return each_sequence(mixed, lens, heads, |rows, len, c| {
                int8::attend(rows, len, heads, Keys::Row, c, &mut scratch)
            });
        }
        sequences(mixed, lens, heads, Keys::Row)
    }

    /// The pre-norm blocks carried through per task give their steps' bits (see
    /// [`PreNormCase::steps`]). ModernBERT's under a window of 5 and with every key, with
    /// and without the norm (its first layer has none); Qwen3's with causal keys.
    #[test]
    fn the_pre_norm_blocks_give_the_steps_bits() {
        if !runs_here() {
            eprintln!("no AVX2 on this CPU: panel attention does not run here");
            return;
        }
        let mut seed = 11;
        let lens = [100, 3, 250, 0, 40, 97];
        let modernbert = PreNormCase::modernbert(&lens, &mut seed);
        let qwen3 = PreNormCase::qwen3(&lens, &mut seed);
        let cases = [
            (&modernbert, true, Keys::Window(5)),
            (&modernbert, true, Keys::Row),
            (&modernbert, false, Keys::Window(5)),
            (&modernbert, false, Keys::Row),
            (&qwen3, true, Keys::Causal),
        ];
        pool(1).install(|| {
            for (case, norm, keys) in cases {
                let want = case.steps(norm, keys);
                // Poison what the output may reuse, so a value left unwritten fails.
                drop(std::hint::black_box(vec![f32::NAN; want.len()]));
                let got = case.run(norm, keys).expect("three tasks");
                let same = same_bits(&got, &want);
                assert!(same, "{:?}, {keys:?}, norm {norm}: bits differ", case.heads);
            }
        });
    }

    /// Tasks running at once on four threads (twelve of them, one sequence each) give
    /// what one thread gives, which `the_block_gives_the_steps_bits` holds to the steps.
    #[test]
    fn the_block_gives_the_same_bits_on_four_threads() {
        if !runs_here() {
            return;
        }
        let mut seed = 8;
        let (hidden, heads) = (64, HEADS);
        let bert = weights(&mut seed);
        let (w, params) = (bert_weights(&bert), &bert.3);
        let lens: Vec<usize> = (0..12).map(|i| 96 + 7 * i).collect();
        let x = values(lens.iter().sum::<usize>() * hidden, &mut seed);
        let norm = RowNorm {
            residual: &x,
            params,
            eps: 1e-12,
        };
        let on = |threads: usize| {
            pool(threads)
                .install(|| block(w, &x, &lens, heads, Keys::Row, Around::PostNorm(norm)))
                .expect("enough tasks for the pool")
        };
        let (one, four) = (on(1), on(4));
        assert!(same_bits(&one, &four));
    }

    /// Both pre-norm blocks, ModernBERT's (windowed, then global) and Qwen3's (causal,
    /// per-head norms, grouped heads), give on four threads at once (twelve tasks, one
    /// sequence each) the bits they give on one, which
    /// `the_pre_norm_blocks_give_the_steps_bits` holds to the steps.
    #[test]
    fn the_pre_norm_blocks_give_the_same_bits_on_four_threads() {
        if !runs_here() {
            return;
        }
        let mut seed = 17;
        let lens: Vec<usize> = (0..12).map(|i| 96 + 7 * i).collect();
        let modernbert = PreNormCase::modernbert(&lens, &mut seed);
        let qwen3 = PreNormCase::qwen3(&lens, &mut seed);
        let cases = [
            (&modernbert, Keys::Window(5)),
            (&modernbert, Keys::Row),
            (&qwen3, Keys::Causal),
        ];
        for (case, keys) in cases {
            let on = |threads: usize| {
                pool(threads)
                    .install(|| case.run(true, keys))
                    .expect("enough tasks")
            };
            assert!(same_bits(&on(1), &on(4)), "{:?}, {keys:?}", case.heads);
        }
    }

    /// Four query heads of 32, two to each K/V head, as Qwen3 groups them: their context
    /// (128 wide) is wider than the hidden size (64), as Qwen3's is, so a block that took
    /// one width for the other fails.
    const GROUPED: Heads = Heads { q: 4, kv: 2, d: 32 };

    /// A pre-norm block at `hidden` = 64 and its rows, in ModernBERT's shape (LayerNorm at
    /// eps 1e-5, [`HEADS`], and biases, which real ModernBERTs mostly lack, so the bias
    /// path is covered) or Qwen3's, the one with q/k norms (RMSNorm and the per-head q/k
    /// RMSNorm at eps 1e-6, no biases, [`GROUPED`] heads).
    struct PreNormCase {
        heads: Heads,
        qkv: PackedLinear,
        out: PackedLinear,
        /// QKV's and the output's.
        biases: Option<(Vec<f32>, Vec<f32>)>,
        /// [gamma; beta] (ModernBERT) or the RMSNorm weight (Qwen3).
        norm: Vec<f32>,
        qk_norm: Option<(Vec<f32>, Vec<f32>)>,
        eps: f32,
        x: Vec<f32>,
        cos: Vec<f32>,
        sin: Vec<f32>,
        lens: Vec<usize>,
    }

    impl PreNormCase {
        fn modernbert(lens: &[usize], seed: &mut u64) -> Self {
            let (qkv, out, qkv_bias, _) = weights(seed);
            let out_bias = values(64, seed);
            let norm = values(2 * 64, seed);
            Self::with_rows(
                HEADS,
                (qkv, out),
                Some((qkv_bias, out_bias)),
                norm,
                None,
                lens,
                seed,
            )
        }

        fn qwen3(lens: &[usize], seed: &mut u64) -> Self {
            let (heads, hidden) = (GROUPED, 64);
            let (width, h) = (heads.qkv_width(), heads.q * heads.d);
            let qkv = PackedLinear::new(&values(hidden * width, seed), hidden, width);
            let out = PackedLinear::new(&values(h * hidden, seed), h, hidden);
            let norm = values(hidden, seed);
            let qk_norm = Some((values(heads.d, seed), values(heads.d, seed)));
            Self::with_rows(heads, (qkv, out), None, norm, qk_norm, lens, seed)
        }

        fn with_rows(
            heads: Heads,
            (qkv, out): (PackedLinear, PackedLinear),
            biases: Option<(Vec<f32>, Vec<f32>)>,
            norm: Vec<f32>,
            qk_norm: Option<(Vec<f32>, Vec<f32>)>,
            lens: &[usize],
            seed: &mut u64,
        ) -> Self {
            let m: usize = lens.iter().sum();
            let eps = if qk_norm.is_some() { 1e-6 } else { 1e-5 };
            Self {
                x: values(m * qkv.in_features(), seed),
                cos: values(m * heads.d / 2, seed),
                sin: values(m * heads.d / 2, seed),
                lens: lens.to_vec(),
                heads,
                qkv,
                out,
                biases,
                norm,
                qk_norm,
                eps,
            }
        }

        /// Its norm as the block takes it, or none.
        fn pre_norm(&self, norm: bool) -> Option<(PreNorm<'_>, f32)> {
            let n = match self.qk_norm {
                Some(_) => PreNorm::Rms(&self.norm),
                None => PreNorm::Layer(&self.norm),
            };
            norm.then_some((n, self.eps))
        }

        fn epilogue(&self, bias: impl Fn(&(Vec<f32>, Vec<f32>)) -> &Vec<f32>) -> Epilogue<'_> {
            self.biases
                .as_ref()
                .map_or(Epilogue::None, |b| Epilogue::Bias(bias(b)))
        }

        /// [`block`] on these rows, on the calling pool.
        fn run(&self, norm: bool, keys: Keys) -> Option<Vec<f32>> {
            let w = BlockWeights {
                qkv: &self.qkv,
                qkv_bias: self.biases.as_ref().map(|b| &b.0[..]),
                out: &self.out,
                out_bias: self.biases.as_ref().map(|b| &b.1[..]),
            };
            let around = Around::PreNorm {
                norm: self.pre_norm(norm),
                qk_norm: self
                    .qk_norm
                    .as_ref()
                    .map(|(q, k)| (&q[..], &k[..], self.eps)),
                cos: &self.cos,
                sin: &self.sin,
            };
            block(w, &self.x, &self.lens, self.heads, keys, around)
        }

        /// The steps apart: the norm, QKV with its bias, each Q and K head normalized
        /// (Qwen3) and rotated at its token's angles, each sequence's attention, the
        /// output projection with its bias, the residual.
        fn steps(&self, norm: bool, keys: Keys) -> Vec<f32> {
            let (heads, m) = (self.heads, self.lens.iter().sum());
            let (width, half) = (heads.qkv_width(), heads.d / 2);
            let mut normed = self.x.clone();
            if let Some((n, eps)) = self.pre_norm(norm) {
                n.apply(&mut normed, eps);
            }
            let mut mixed = self.qkv.forward(&normed, m, self.epilogue(|b| &b.0));
            let angles = self.cos.chunks(half).zip(self.sin.chunks(half));
            for (row, (c, s)) in mixed.chunks_exact_mut(width).zip(angles) {
                match &self.qk_norm {
                    Some((q, k)) => qk_norm_rope_row(row, q, k, c, s, heads, self.eps),
                    None => rope_row(row, c, s, heads),
                }
            }
            let ctx = sequences(&mixed, &self.lens, heads, keys);
            let mut out = self.out.forward(&ctx, m, self.epilogue(|b| &b.1));
            add_into(&mut out, &self.x);
            out
        }
    }

    /// [`block`] on fresh rows of `lens`.
    fn block_on(
        w: BlockWeights<PackedLinear>,
        lens: &[usize],
        heads: Heads,
        params: &[f32],
        seed: &mut u64,
    ) -> Option<Vec<f32>> {
        let m: usize = lens.iter().sum();
        let x = values(m * w.qkv.in_features(), seed);
        let norm = RowNorm {
            residual: &x,
            params,
            eps: 1e-12,
        };
        block(w, &x, lens, heads, Keys::Row, Around::PostNorm(norm))
    }
}
