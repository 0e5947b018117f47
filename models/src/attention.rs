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

use crate::{
    dense::{self, Epilogue, Panel, NR},
    kernels::{softmax_row, Heads},
};

/// Query rows per block: four of the dense kernel's 12-row AVX-512 tiles (eight AVX2 ones). Under a causal mask a
/// block is scored against the keys up to its last row only: a 256-token row computes
/// 59% of the full square.
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
/// `[Q | K | V]` (Q pre-scaled by 1/√d), `out` its `len` rows of `q·d`. Every query sees
/// every key, or with `causal` the keys at or before it. Panics where [`runs_here`] is
/// false.
pub(crate) fn sequence(
    qkv: &[f32],
    len: usize,
    heads: Heads,
    causal: bool,
    out: &mut [f32],
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
            for i0 in (0..len).step_by(BLOCK) {
                let m = (i0 + BLOCK).min(len) - i0;
                let seen = if causal { i0 + m } else { len };
                for p in 0..seen.div_ceil(NR) {
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
                            y: scores.as_mut_ptr().add(p * NR),
                            ldy: stride,
                            live: (seen - p * NR).min(NR),
                            c0: 0,
                            epi: Epilogue::None,
                        })
                    };
                }
                for (r, s) in scores.chunks_mut(stride).take(m).enumerate() {
                    let own = if causal { i0 + r + 1 } else { len };
                    softmax_row(&mut s[..own]);
                    s[own..seen].fill(0.0);
                }
                for p in 0..value_panels {
                    // SAFETY: as above; score rows have `seen` real columns, value
                    // panel p holds len ≥ seen rows of 32, and the outputs are rows
                    // i0..i0 + m of `out` at this head's columns p·32.. (≤ d of them).
                    unsafe {
                        dense::panel(Panel {
                            x: scores.as_ptr(),
                            lda: stride,
                            rows: m,
                            k: seen,
                            w: values.as_ptr().add(p * len * NR),
                            y: out.as_mut_ptr().add(i0 * h + head * d + p * NR),
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
