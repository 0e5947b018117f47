//! Attention for one sequence in int8 (the `int8` dtype's, on AVX-512 VNNI): the blocks
//! of `attention::sequence`, with Q·Kᵀ and P·V as `vpdpbusd` products on the dense
//! layers' tiles ([`avx512::matmul`]).
//!
//! Why: with the dense layers in int8, attention's f32 products were a fifth of a long
//! passage's samples and softmax a tenth (MiniLM on the Ice Lake Xeon,
//! benches/RESULTS.md), against a tenth of the multiply-adds. In int8 they took long
//! passages 1.09× there (six alternated rounds), and the worst cosine to
//! sentence-transformers' f32 vectors from 0.9975 to 0.9955.
//!
//! How each side is quantized, per sequence:
//! - each key row symmetric to i8 with its own scale, as a layer's output channel is;
//! - each value column (one dimension of the head over the sequence) the same way;
//! - each query row symmetric too, offset by 128 to the u8 `vpdpbusd` takes;
//! - each row of probabilities as u8 levels of its unnormalized exponentials
//!   ([`softmax_levels`]): their largest is e⁰ = 1, so the levels need no range pass, and
//!   the row's 1 / Σ joins its output scale instead of a normalizing pass.

use std::{arch::x86_64::*, mem::MaybeUninit};

use super::{avx512, Epilogue, Job, Packed, RowScale, PANEL};
use crate::{
    isa::{avx512_lanes, cpu_isa, CpuIsa},
    kernels::{softmax_levels, Heads, Keys},
};

/// Query rows per block, as `attention::sequence`'s: six of the tiles' 8 rows; half that
/// under a window.
const BLOCK: usize = 48;

/// What one thread reuses from sequence to sequence (grown, never shrunk): every head's
/// quantized queries, and packed keys and values with their scales and sums, and one
/// block's scores and probability levels.
#[derive(Default)]
pub(crate) struct AttendScratch {
    keys: Vec<i8>,
    key_scale: Vec<f32>,
    key_sum: Vec<i32>,
    values: Vec<i8>,
    value_scale: Vec<f32>,
    value_sum: Vec<i32>,
    queries: Vec<u8>,
    query_scale: Vec<RowScale>,
    scores: Vec<f32>,
    levels: Vec<u8>,
    level_scale: Vec<RowScale>,
    /// Per value column: its largest magnitude, then the reciprocal of its scale.
    column: Vec<f32>,
}

/// Whether this CPU runs [`attend`] (AVX-512 VNNI; AMX CPUs have it too).
pub(crate) fn attend_runs_here() -> bool {
    cpu_isa() >= CpuIsa::Avx512Vnni
}

/// One row to symmetric levels −127..=127 plus `offset`, as bytes into `q` (`x.len()`
/// of them): 0 for a key row (i8), 128 for a query row (u8 for `vpdpbusd`, 128 its zero
/// point). Returns the scale, max |x| / 127: 1 for a row of zeros, and NaN where the row
/// holds NaN or an infinity (its bytes are then never read for a finite output), as
/// `QuantLinear::new` treats a weight's column.
///
/// Why not [`avx512::quantize_row`] for queries: its range takes three horizontal
/// reductions a row, which cost more than the rest of a 32-value row; this takes one.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn symmetric(x: &[f32], q: *mut u8, offset: i32) -> f32 {
    let (n, p) = (x.len(), x.as_ptr());
    let (mut max, mut bad) = (_mm512_setzero_ps(), 0);
    for i in (0..n).step_by(16) {
        let v = _mm512_maskz_loadu_ps(avx512_lanes(n - i), p.add(i));
        max = _mm512_max_ps(max, _mm512_abs_ps(v));
        bad |= _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
    }
    let max = _mm512_reduce_max_ps(max);
    if bad != 0 || !max.is_finite() {
        return f32::NAN;
    }
    let s = if max > 0.0 { max / 127.0 } else { 1.0 };
    let (inv, offset) = (_mm512_set1_ps(1.0 / s), _mm512_set1_epi32(offset));
    for i in (0..n).step_by(16) {
        let m = avx512_lanes(n - i);
        let v = _mm512_add_epi32(level(_mm512_maskz_loadu_ps(m, p.add(i)), inv), offset);
        _mm512_mask_cvtepi32_storeu_epi8(q.add(i) as *mut _, m, v);
    }
    s
}

/// Each key's sum of levels, for the panels of `keys` (`[d4 / 4][16][4]` each) into
/// `sums`: one `vpdpbusd` of ones per group of a panel.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn key_sums(keys: &[i8], d4: usize, sums: &mut [i32]) {
    let ones = _mm512_set1_epi8(1);
    for (panel, sums) in keys
        .chunks_exact(PANEL * d4)
        .zip(sums.chunks_exact_mut(PANEL))
    {
        let mut acc = _mm512_setzero_si512();
        for g in 0..d4 / 4 {
            let w = _mm512_loadu_si512(panel.as_ptr().add(g * PANEL * 4) as *const _);
            acc = _mm512_dpbusd_epi32(acc, ones, w);
        }
        _mm512_storeu_si512(sums.as_mut_ptr() as *mut _, acc);
    }
}

/// `v · inv` rounded to the nearest level (ties to even, the default mode) in −127..=127.
#[inline(always)]
unsafe fn level(v: __m512, inv: __m512) -> __m512i {
    let v = _mm512_cvtps_epi32(_mm512_mul_ps(v, inv));
    _mm512_min_epi32(
        _mm512_max_epi32(v, _mm512_set1_epi32(-127)),
        _mm512_set1_epi32(127),
    )
}

/// Every K/V head's values to symmetric i8 per column, packed as the value product
/// reads them: per head `g.value_cols / 16` panels of 16 columns, `[keys_n / 4][16][4]`
/// each, four keys' levels of a column in one dword. The column scales go to `scale`
/// (NaN for a column holding NaN or an infinity). Rows are read in order, whole (see
/// [`attend`]).
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn pack_values(
    qkv: &[f32],
    g: &Geometry,
    values: &mut [i8],
    scale: &mut [f32],
    column: &mut Vec<f32>,
) {
    let Geometry {
        nkv,
        d,
        row,
        h,
        len,
        keys_n,
        value_cols,
        ..
    } = *g;
    let panels = value_cols / PANEL;
    assert!(values.len() >= nkv * value_cols * keys_n && scale.len() >= nkv * value_cols);
    assert!(qkv.len() >= len * row && len <= keys_n);
    let at = |j: usize, kv: usize, pc: usize| {
        qkv.as_ptr().add(j * row + h + (nkv + kv) * d + pc * PANEL)
    };
    let zero = _mm512_setzero_ps();
    // Each column's largest magnitude, and its finiteness: v · 0 is NaN for NaN or an
    // infinity and 0 otherwise, so one bad value shows in the column's lane.
    let cols = nkv * value_cols;
    column.clear();
    column.resize(2 * cols, 0.0);
    let (max, bad) = column.split_at_mut(cols);
    for j in 0..len {
        for kv in 0..nkv {
            for pc in 0..panels {
                let v = _mm512_maskz_loadu_ps(avx512_lanes(d - pc * PANEL), at(j, kv, pc));
                let c = max.as_mut_ptr().add((kv * panels + pc) * PANEL);
                _mm512_storeu_ps(c, _mm512_max_ps(_mm512_loadu_ps(c), _mm512_abs_ps(v)));
                let c = bad.as_mut_ptr().add((kv * panels + pc) * PANEL);
                _mm512_storeu_ps(c, _mm512_fmadd_ps(v, zero, _mm512_loadu_ps(c)));
            }
        }
    }
    for c in 0..cols {
        scale[c] = if bad[c].is_nan() {
            f32::NAN
        } else if max[c] > 0.0 {
            max[c] / 127.0
        } else {
            1.0
        };
        // A bad column's levels are never used: its NaN scale makes every output NaN.
        max[c] = if scale[c].is_nan() {
            0.0
        } else {
            1.0 / scale[c]
        };
    }
    let byte = _mm512_set1_epi32(0xff);
    for group in 0..len.div_ceil(4) {
        for kv in 0..nkv {
            for pc in 0..panels {
                let m = avx512_lanes(d - pc * PANEL);
                let inv = _mm512_loadu_ps(max.as_ptr().add((kv * panels + pc) * PANEL));
                // Keys 4·group.. of the 16 columns, the last group's keys past len zero.
                let key = |jj: usize| {
                    let j = 4 * group + jj;
                    if j < len {
                        let v = _mm512_maskz_loadu_ps(m, at(j, kv, pc));
                        _mm512_and_si512(level(v, inv), byte)
                    } else {
                        _mm512_setzero_si512()
                    }
                };
                let (k0, k1, k2, k3) = (key(0), key(1), key(2), key(3));
                let four = _mm512_or_si512(
                    _mm512_or_si512(k0, _mm512_slli_epi32::<8>(k1)),
                    _mm512_or_si512(_mm512_slli_epi32::<16>(k2), _mm512_slli_epi32::<24>(k3)),
                );
                let panel = values.as_mut_ptr().add((kv * panels + pc) * PANEL * keys_n);
                _mm512_storeu_si512(panel.add(group * PANEL * 4) as *mut _, four);
            }
        }
    }
}

/// One sequence's sizes, as [`attend`] lays its buffers out.
#[derive(Clone, Copy)]
struct Geometry {
    nq: usize,
    nkv: usize,
    d: usize,
    /// `d` rounded up to a group of four (a query or key row's bytes).
    d4: usize,
    /// Floats from one packed `[Q | K | V]` row to the next, and Q's width (where K
    /// starts; the context's row).
    row: usize,
    h: usize,
    len: usize,
    /// Keys rounded up to a whole panel of 16; value columns likewise.
    keys_n: usize,
    value_cols: usize,
}

/// Attention for one sequence, every head, as `attention::sequence` computes it in f32:
/// `qkv` holds its `len` packed rows of `[Q | K | V]` (Q pre-scaled by 1/√d), `out` its
/// `len` rows of `q·d`; each query sees the keys `keys_seen` names, and a block of
/// queries is scored only against the key panels its rows can see. Panics where
/// [`attend_runs_here`] is false.
pub(crate) fn attend(
    qkv: &[f32],
    len: usize,
    heads: Heads,
    keys_seen: Keys,
    out: &mut [MaybeUninit<f32>],
    s: &mut AttendScratch,
) {
    assert!(
        attend_runs_here(),
        "int8 attention on a CPU without AVX-512 VNNI"
    );
    let Heads { q: nq, kv: nkv, d } = heads;
    let g = Geometry {
        nq,
        nkv,
        d,
        d4: d.div_ceil(4) * 4,
        row: heads.qkv_width(),
        h: nq * d,
        len,
        keys_n: len.div_ceil(PANEL) * PANEL,
        value_cols: d.div_ceil(PANEL) * PANEL,
    };
    let Geometry {
        d4,
        row,
        h,
        keys_n,
        value_cols,
        ..
    } = g;
    assert_eq!(qkv.len(), len * row, "qkv is not [{len}, {row}]");
    assert_eq!(out.len(), len * h, "out is not [{len}, {h}]");
    // Every head's queries, keys and values are quantized up front, reading the rows in
    // order: per head, a row's 32 to 128 floats lie a whole row (4.5 KiB at MiniLM's
    // widths) after the last row's, and a pass per head down such columns spent most of
    // its time waiting on the loads. Queries as u8 rows of d4 bytes; keys as the packed
    // side of Q·Kᵀ (per K/V head, panels of 16 keys, `[d4 / 4][16][4]` each); values as
    // the packed side of P·V. Not zeroed per sequence, as nothing needs it: a query's
    // padding bytes meet the keys' zero padding, the scores of keys past len are never
    // used, and the values of the last group of four keys are written to the end.
    grow(&mut s.keys, nkv * keys_n * d4);
    grow(&mut s.values, nkv * value_cols * keys_n);
    s.key_scale.clear();
    s.key_scale.resize(nkv * keys_n, 0.0);
    s.key_sum.clear();
    s.key_sum.resize(nkv * keys_n, 0);
    s.value_scale.clear();
    s.value_scale.resize(nkv * value_cols, 0.0);
    // A probability row's zero point is 0: the values' sums never count.
    s.value_sum.clear();
    s.value_sum.resize(value_cols, 0);
    grow(&mut s.queries, nq * len * d4);
    s.query_scale.clear();
    s.query_scale.resize(nq * len, RowScale::default());
    s.level_scale.resize(BLOCK, RowScale::default());
    if s.scores.len() < BLOCK * keys_n {
        s.scores.resize(BLOCK * keys_n, 0.0);
        s.levels.resize(BLOCK * keys_n, 0);
    }
    let mut q = vec![0i8; d4];
    for j in 0..len {
        let x = &qkv[j * row..][..row];
        for head in 0..nq {
            let q = &mut s.queries[(head * len + j) * d4..][..d];
            // SAFETY: asserted above (VNNI implies F and BW); q holds d bytes.
            let scale = unsafe { symmetric(&x[head * d..][..d], q.as_mut_ptr(), 128) };
            s.query_scale[head * len + j] = RowScale { scale, zero: 128 };
        }
        for kv in 0..nkv {
            // SAFETY: as above; q holds d4 ≥ d bytes.
            let scale = unsafe { symmetric(&x[h + kv * d..][..d], q.as_mut_ptr().cast(), 0) };
            s.key_scale[kv * keys_n + j] = scale;
            let panel = &mut s.keys[(kv * keys_n + j / PANEL * PANEL) * d4..][..PANEL * d4];
            for (g, four) in q.chunks_exact(4).enumerate() {
                let at = (g * PANEL + j % PANEL) * 4;
                panel[at..at + 4].copy_from_slice(four);
            }
        }
    }
    // SAFETY: as above; keys and key_sum hold nkv · keys_n / 16 whole panels, and
    // `values` and `value_scale` every head's value panels.
    unsafe {
        key_sums(&s.keys, d4, &mut s.key_sum);
        pack_values(qkv, &g, &mut s.values, &mut s.value_scale, &mut s.column);
    }
    let block = match keys_seen {
        Keys::Window(_) => BLOCK / 2,
        Keys::Row | Keys::Causal => BLOCK,
    };
    for head in 0..nq {
        for i0 in (0..len).step_by(block) {
            let m = (i0 + block).min(len) - i0;
            self::block(s, &g, (i0, m), head, keys_seen, out);
        }
    }
}

/// `v` at least `n` long.
fn grow<T: Copy + Default>(v: &mut Vec<T>, n: usize) {
    if v.len() < n {
        v.resize(n, T::default());
    }
}

/// Rows `i0..i0 + m` of one query head against its K/V head, as packed in `s`.
fn block(
    s: &mut AttendScratch,
    g: &Geometry,
    (i0, m): (usize, usize),
    head: usize,
    keys_seen: Keys,
    out: &mut [MaybeUninit<f32>],
) {
    let Geometry {
        nq,
        nkv,
        d,
        d4,
        h,
        len,
        keys_n,
        value_cols,
        ..
    } = *g;
    let kv = head / (nq / nkv);
    // The keys any row of the block sees, from the start of their first panel: score
    // column c is key `first + c`.
    let seen = keys_seen.range(i0, len).start..keys_seen.range(i0 + m - 1, len).end;
    let first = seen.start / PANEL * PANEL;
    let width = seen.end - first;
    let key = kv * keys_n + first;
    let scores = Job {
        l: Packed {
            groups: d4 / 4,
            panel_stride: PANEL * d4,
            n: width,
            w: &s.keys[key * d4..],
            scale: &s.key_scale[key..],
            sum: &s.key_sum[key..],
        },
        qa: &s.queries[(head * len + i0) * d4..],
        lda: d4,
        sa: &s.query_scale[head * len + i0..][..m],
        epi: Epilogue::None,
        ldy: keys_n,
    };
    // SAFETY: the CPU has AVX-512 F, BW and VNNI (asserted in `attend`); the m query rows
    // hold d4 bytes each, the key panels from `first` hold `width` keys' d4 groups, and
    // the m score rows of keys_n ≥ width floats lie inside `scores`.
    unsafe {
        let y = std::slice::from_raw_parts_mut(s.scores.as_mut_ptr().cast(), m * keys_n);
        avx512::matmul(&scores, m, y);
    }
    // Probability rows run to a whole group of four keys; past the row's own keys, 0.
    let width4 = width.div_ceil(4) * 4;
    for r in 0..m {
        let own = keys_seen.range(i0 + r, len);
        let (a, b) = (own.start - first, own.end - first);
        let levels = &mut s.levels[r * keys_n..][..width4];
        levels[..a].fill(0);
        levels[b..].fill(0);
        let scores = &s.scores[r * keys_n + a..][..b - a];
        // SAFETY: as above.
        let sum = unsafe { softmax_levels(scores, &mut levels[a..b]) };
        s.level_scale[r] = RowScale {
            scale: 1.0 / (255.0 * sum),
            zero: 0,
        };
    }
    let context = Job {
        l: Packed {
            groups: width4 / 4,
            panel_stride: PANEL * keys_n,
            n: d,
            w: &s.values[kv * value_cols * keys_n + first * PANEL..],
            scale: &s.value_scale[kv * value_cols..],
            sum: &s.value_sum,
        },
        qa: &s.levels,
        lda: keys_n,
        sa: &s.level_scale[..m],
        epi: Epilogue::None,
        ldy: h,
    };
    // SAFETY: as above; each value panel holds keys_n ≥ first + width4 keys, and the
    // outputs are rows i0..i0 + m of `out` at this head's d columns, h apart.
    unsafe { avx512::matmul(&context, m, &mut out[i0 * h + head * d..]) };
}
