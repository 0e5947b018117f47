//! f32 dense layers on AVX2 and AVX-512 CPUs: `epi(x · w)` on weights packed once at load,
//! with the bias (and GELU) applied as each output is stored.
//!
//! Why not candle's matmul here: through candle, a dense layer is a `gemm` call that packs
//! the weight's panels again on every call, then a second pass over the output for the
//! bias. At the few dozen rows of a lone sentence that reached about a third of what the
//! same cores do on large shapes. Here each weight is laid out once, at load, as panels of
//! 48 output columns (AVX-512) or 32 (AVX2), every panel's inner dimension contiguous: a
//! tile of rows reads its panel as one sequential stream (the hardware prefetcher follows
//! it; the `[in, out]` rows read in place were a new 4 KiB page every 128 bytes, and
//! measured 2.4x slower than candle once the weights no longer sat in cache). Sums run
//! over the inner dimension in order with fused multiply-adds; outputs agree with
//! candle's to rounding.
//! AVX-512 tiles are 8 rows by the whole 48-column panel (12 rows by 32 on attention's
//! panels); AVX2, with half the registers of half the width, takes each panel as 16-column
//! parts in tiles of 6 rows (the usual 6×16 AVX2 register tile), on either packing.

use rayon::prelude::*;

use crate::{
    isa::{cpu_isa, l2_bytes, CpuIsa},
    kernels::{self, add_norm_rows, gelu, Products},
};

/// What a dense kernel does to each output before it stores it: the layer's bias, and
/// GELU after it (BERT's feed-forward input), so neither costs another pass.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Epilogue<'a> {
    None,
    Bias(&'a [f32]),
    BiasGelu(&'a [f32]),
}

impl<'a> Epilogue<'a> {
    #[inline(always)]
    pub(crate) fn apply(self, v: f32, col: usize) -> f32 {
        match self {
            Epilogue::None => v,
            Epilogue::Bias(b) => v + b[col],
            Epilogue::BiasGelu(b) => gelu(v + b[col]),
        }
    }

    /// Its bias, when it has one.
    pub(crate) fn bias(self) -> Option<&'a [f32]> {
        match self {
            Epilogue::None => None,
            Epilogue::Bias(b) | Epilogue::BiasGelu(b) => Some(b),
        }
    }
}

/// What a dense kernel does to each whole output row once a task has stored it:
/// LayerNorm(row + bias + residual) with `params` = [bias; gamma; beta] (BERT's
/// add-and-norm after the attention output and the feed-forward). Run by the task that
/// owns the row, it finds the row in its core's cache (inferred from the sizes: a task's
/// 96 rows of 384 are 144 KiB); as a separate pass over the activations it read every row
/// back, from L3 at a long batch's size, into a buffer it zeroed first. Together with
/// attention's unzeroed output: +3.5% on long passages (median of six alternated rounds,
/// 1.00-1.07x; benches/RESULTS.md).
#[derive(Debug, Clone, Copy)]
pub(crate) struct RowNorm<'a> {
    pub(crate) residual: &'a [f32],
    pub(crate) params: &'a [f32],
    pub(crate) eps: f32,
}

impl RowNorm<'_> {
    /// Panics unless the residual is `[m, n]` and the params `[3, n]`.
    pub(crate) fn assert_fits(self, m: usize, n: usize) {
        assert_eq!(self.residual.len(), m * n, "residual is not [{m}, {n}]");
        assert_eq!(self.params.len(), 3 * n, "add-norm params are not [3, {n}]");
    }

    /// Normalizes rows `rows` of the `n`-wide output at `y`, in place, against the same
    /// rows of the residual.
    ///
    /// # Safety
    /// The caller's task owns those rows of `y` whole and has stored every value of them;
    /// no other thread touches them meanwhile.
    pub(crate) unsafe fn apply_to(self, y: Dst, n: usize, rows: std::ops::Range<usize>) {
        let own = std::slice::from_raw_parts_mut(y.at(rows.start * n), rows.len() * n);
        let res = &self.residual[rows.start * n..rows.end * n];
        add_norm_rows(own, res, self.params, self.eps);
    }
}

/// Output columns of a panel that attention packs (its Kᵀ and V), and of a dense layer's
/// on the AVX2 route: two 512-bit registers, four 256-bit ones.
pub(crate) const NR: usize = 32;
/// Output columns of a dense layer's panel on the AVX-512 route: three 512-bit registers,
/// in tiles of 8 rows ([`avx512_rows`]). Per inner step that is 3 weight loads and 8
/// broadcasts for 24 FMAs, where 12 rows × 32 columns take 2 and 12 for the same 24, and a
/// tile's rows take 12 KiB of L1 at k = 384 rather than 18. On the Ice Lake Xeon, against
/// 12 × 32 in one process, paired runs alternated: MiniLM's and Qwen3's products 1.04-1.15x
/// (medians of 20 pairs a shape, three runs), whole models 1.11x (MiniLM and
/// ModernBERT-mini on long passages, Qwen3 on short sentences; benches/RESULTS.md). The
/// width is the route's at load, so AVX2 CPUs keep 32-column panels and their codegen.
const WIDE_NR: usize = 48;
/// How far ahead, in inner-dimension steps (a panel's row: 128 bytes at 32 columns, 192 at
/// 48), a tile asks for its panel: 3 KiB, or 4.5 KiB at 48 (not tuned apart). A model's
/// 24 weights cycle through the cache, so each panel is read from L3 or memory, and the
/// L1 streamer alone lagged the FMAs; on the Intel Xeon this took the kernel from
/// 0.78-0.93x to 0.88-1.03x of `gemm` over the model's rotating weights (anywhere from 16
/// to 40 steps measured the same).
const PREFETCH: usize = 24;
/// Rows an AVX-512 tile takes at most, by its panel's `width`: 12 at [`NR`] and 8 at
/// [`WIDE_NR`], so that the accumulators (24), the weight vectors and a broadcast fit
/// AVX-512's 32 registers.
const fn avx512_rows(width: usize) -> usize {
    if width == WIDE_NR {
        8
    } else {
        12
    }
}

/// Rows one task takes: eight tiles of 12 rows or twelve of 8, so each weight panel a task
/// reads from cache serves them all.
pub(crate) const ROWS_PER_TASK: usize = 96;
/// Inner dimensions up to which an AVX-512 task runs tile by tile across a chunk of
/// panels (tile order), rather than panel by panel across its tiles (panel order). The
/// intent: a tile's rows (12 × k × 4 bytes: 18 KiB at k = 384) stay in L1 while the
/// chunk's panels stream from L2, where in panel order the panel (48 KiB at k = 384, all of
/// L1) would push them out for every tile. That is inferred from the sizes, not counted:
/// the Xeon measured has no cycle counters. Measured there: +3-9% on long passages (median
/// 1.06x, run order alternated), level on short sentences (benches/RESULTS.md). Past 512 a
/// tile's rows outgrow L1 (72 KiB at MiniLM's k = 1,536) and the panel order stays; a tile
/// order over blocks of 512 inputs measured 1-3% slower. Only 384 and 1,536 were
/// measured, so the cut between them is a choice. With 8-row tiles of 48 columns it was
/// measured again on the Ice Lake Xeon (medians of 20 paired products): tile order still
/// 1.03-1.07x at k = 256 and 384 (0.96-0.98x at MiniLM's 384 × 384), and level (0.98-1.03x)
/// at k = 768 to 3,072, where 8 rows would now fit L1 up to k = 1,536. The AVX2 route
/// keeps the panel order: its half-panels (24 KiB) fit L1 beside its 6-row tiles, and the
/// tile order measured 1-3% slower there (capped on the Xeon).
const TILE_ORDER_MAX_K: usize = 512;
/// The share of a core's L2 ([`l2_bytes`]) that a chunk of panels takes, so the chunk
/// stays in L2 for all of a task's tiles: a quarter, 512 KiB on the Xeon measured (2 MiB
/// of L2). There 256 KiB measured no gain, 1 MiB and the whole layer (up to 2.3 MiB at
/// MiniLM's widest) about the same as 512 KiB. AVX-512 CPUs with a 1 MiB L2 (AMD Zen 4/5)
/// get 256 KiB chunks by this rule, which no run has measured there.
const CHUNK_L2_SHARE: usize = 4;

/// Whether the kernel runs on this CPU (AVX2 with FMA at least, under `--cpu-isa`).
/// Elsewhere candle's matmul serves.
pub(crate) fn runs_here() -> bool {
    cpu_isa() >= CpuIsa::Avx2
}

/// The tile loop for a level [`runs_here`] allowed.
fn panel_fn(isa: CpuIsa) -> unsafe fn(Panel) {
    #[cfg(target_arch = "x86_64")]
    {
        assert!(
            isa >= CpuIsa::Avx2 && isa.runs_here(),
            "the f32 dense kernel at {isa:?} on a CPU with {:?}",
            CpuIsa::detected()
        );
        if isa >= CpuIsa::Avx512 {
            avx512::panel
        } else {
            avx2::panel
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("the f32 dense kernel off x86-64 ({isa:?})")
}

/// A dense layer's f32 weight, packed for its [`TaskProduct`] products.
pub(crate) struct PackedLinear {
    /// Inputs (`k`) and outputs (`n`).
    k: usize,
    n: usize,
    /// Columns a panel ([`NR`] or [`WIDE_NR`]: the route's, at load). Either route runs
    /// either width, so tests can take any route on any packing.
    width: usize,
    /// `[panel][k][width columns]`; the last panel's columns past `n` are zeros.
    packed: Vec<f32>,
}

impl PackedLinear {
    /// Packs `w`, row-major `[k, n]` (the encoder's `[in, out]`), at the width of the
    /// route this CPU runs.
    pub(crate) fn new(w: &[f32], k: usize, n: usize) -> Self {
        let width = if cpu_isa() >= CpuIsa::Avx512 {
            WIDE_NR
        } else {
            NR
        };
        Self::with_width(w, k, n, width)
    }

    /// [`new`](Self::new) in panels of `width` columns, a multiple of 16.
    fn with_width(w: &[f32], k: usize, n: usize, width: usize) -> Self {
        assert!(n > 0 && k > 0, "an empty layer [{k}, {n}]");
        assert_eq!(w.len(), k * n, "weight is not [{k}, {n}]");
        assert!(width > 0 && width.is_multiple_of(16), "panels {width} wide");
        let panels = n.div_ceil(width);
        let mut packed = vec![0f32; panels * k * width];
        for (i, row) in w.chunks_exact(n).enumerate() {
            for (p, cols) in row.chunks(width).enumerate() {
                let at = (p * k + i) * width;
                packed[at..at + cols.len()].copy_from_slice(cols);
            }
        }
        Self {
            k,
            n,
            width,
            packed,
        }
    }

    /// The weight as `[n, k]` rows, one per output (what int8 quantizes from).
    pub(crate) fn rows(&self) -> Vec<f32> {
        let (k, width) = (self.k, self.width);
        let mut rows = vec![0f32; self.n * k];
        for (c, row) in rows.chunks_exact_mut(k).enumerate() {
            let (p, col) = (c / width, c % width);
            for (i, v) in row.iter_mut().enumerate() {
                *v = self.packed[(p * k + i) * width + col];
            }
        }
        rows
    }

    /// `epi(x · w)` for `x` row-major `[m, k]`; returns `[m, n]` row-major. Panics where
    /// [`runs_here`] is false: callers check it before packing. (The layers call
    /// [`TaskProduct::forward_on`].)
    #[cfg(test)]
    pub(crate) fn forward(&self, x: &[f32], m: usize, epi: Epilogue) -> Vec<f32> {
        self.forward_on(cpu_isa(), x, m, epi, None)
    }

    /// `norm(x · w)` for `x` row-major `[m, k]`: [`forward`](Self::forward) with each
    /// output row then normalized by `norm` ([`RowNorm`]) in place.
    #[cfg(test)]
    pub(crate) fn forward_norm(&self, x: &[f32], m: usize, norm: RowNorm) -> Vec<f32> {
        self.forward_on(cpu_isa(), x, m, Epilogue::None, Some(norm))
    }

    /// The task order [`TILE_ORDER_MAX_K`] picks on `isa`'s route: tile order over chunks
    /// of this many panels (one at least, were the L2 smaller than a panel's share), or
    /// panel order (None).
    fn chunk(&self, isa: CpuIsa) -> Option<usize> {
        (isa >= CpuIsa::Avx512 && self.k <= TILE_ORDER_MAX_K).then(|| {
            (l2_bytes() / CHUNK_L2_SHARE / (self.k * self.width * size_of::<f32>())).max(1)
        })
    }

    /// [`forward_on`](Self::forward_on) in panel order (`chunk` None) or in tile order
    /// over chunks of `chunk` panels; every order gives the same bits (tests hold them to
    /// it), since each output's sum runs over the inner dimension in order either way.
    fn forward_in(
        &self,
        isa: CpuIsa,
        x: &[f32],
        m: usize,
        epi: Epilogue,
        norm: Option<RowNorm>,
        chunk: Option<usize>,
    ) -> Vec<f32> {
        let (k, n) = (self.k, self.n);
        // A chunk holds one panel at least (an L2 smaller than a panel's share).
        let chunk = chunk.map(|c| c.max(1));
        let panel = panel_fn(isa);
        self.assert_inputs(x, m, epi, norm);
        // Not zeroed first: the tiles write every output.
        let mut y: Vec<f32> = Vec::with_capacity(m * n);
        let out = Dst(y.as_mut_ptr());
        let panels = n.div_ceil(self.width);
        let row_tasks = m.div_ceil(ROWS_PER_TASK);
        let col_groups = col_groups(row_tasks, panels);
        let per_group = panels.div_ceil(col_groups);
        (0..row_tasks * col_groups).into_par_iter().for_each(|t| {
            let (rt, g) = (t / col_groups, t % col_groups);
            let rows = rt * ROWS_PER_TASK..((rt + 1) * ROWS_PER_TASK).min(m);
            let group = g * per_group..((g + 1) * per_group).min(panels);
            // SAFETY: `panel_fn` checked the CPU has the route's features; the task reads
            // its own rows of `x` and writes only its own rows × panels of `y`, which
            // holds m × n.
            unsafe {
                self.task(
                    panel,
                    x.as_ptr().add(rows.start * k),
                    k,
                    rows.len(),
                    group,
                    out.at(rows.start * n),
                    n,
                    epi,
                    chunk,
                )
            };
            if let (Some(norm), 1) = (norm, col_groups) {
                // SAFETY: this task owns these rows whole (one column group) and has just
                // stored every one of their outputs; no other task touches them.
                unsafe { norm.apply_to(out, n, rows) };
            }
        });
        // SAFETY: the tasks cover every row and every panel once, and each tile stores
        // every real column of its panel.
        unsafe { y.set_len(m * n) };
        if let (Some(norm), 2..) = (norm, col_groups) {
            // A short batch, its rows split across tasks by columns: normalized once every
            // column is in, still in place.
            // As many rows a task as the separate add-norm op takes.
            let rows = n * kernels::ROWS_PER_TASK;
            y.par_chunks_mut(rows)
                .zip(norm.residual.par_chunks(rows))
                .for_each(|(y, res)| add_norm_rows(y, res, norm.params, norm.eps));
        }
        y
    }

    /// One task's share of a product: `rows` rows of `x` (row stride `lda`, `k` inputs
    /// each) through the panels in `group`, into `y` (row stride `ldy`, the first panel's
    /// column 0 at `y`'s first column), in panel order (`chunk` None) or in tile order over
    /// chunks of `chunk` ≥ 1 panels ([`TILE_ORDER_MAX_K`]).
    ///
    /// # Safety
    /// `panel` is [`panel_fn`]'s for a route this CPU has; `x` is readable for `rows` rows
    /// of `k` values, and `y` writable at every row's columns of the panels in `group`, and
    /// no other thread writes them meanwhile.
    #[allow(clippy::too_many_arguments)]
    unsafe fn task(
        &self,
        panel: unsafe fn(Panel),
        x: *const f32,
        lda: usize,
        rows: usize,
        group: std::ops::Range<usize>,
        y: *mut f32,
        ldy: usize,
        epi: Epilogue,
        chunk: Option<usize>,
    ) {
        let (k, n, width) = (self.k, self.n, self.width);
        // `count` rows from row `r0` through panel `p`: rows and panels the caller's.
        let product = |r0: usize, count: usize, p: usize| {
            let c0 = p * width;
            panel(Panel {
                x: x.add(r0 * lda),
                lda,
                rows: count,
                k,
                w: self.packed.as_ptr().add(p * k * width),
                width,
                y: y.add(r0 * ldy + c0),
                ldy,
                live: (n - c0).min(width),
                c0,
                epi,
            })
        };
        let Some(per_chunk) = chunk else {
            for p in group {
                product(0, rows, p);
            }
            return;
        };
        // Near-equal tiles, as `panel` would cut them (25 rows are 9 + 8 + 8 at 12 a
        // tile). Only the AVX-512 route takes this order.
        let tiles = rows.div_ceil(avx512_rows(width));
        for first in group.clone().step_by(per_chunk) {
            let panels = first..first.saturating_add(per_chunk).min(group.end);
            let mut r = 0;
            for tile in 0..tiles {
                let mr = (rows - r).div_ceil(tiles - tile);
                for p in panels.clone() {
                    product(r, mr, p);
                }
                r += mr;
            }
        }
    }
}

/// Whether `tasks` keep every thread of the pool busy: two each, so that one slow task
/// leaves its thread another to take. Fewer, and a product splits columns too
/// ([`col_groups`]) while the fused steps (`feed_forward`'s, `attention::block`) run apart.
pub(crate) fn fills_the_cores(tasks: usize) -> bool {
    tasks >= 2 * rayon::current_num_threads()
}

/// Column groups a layer's `panels` are split into for `row_tasks` tasks of rows: a
/// short batch has too few rows to keep every core busy, so its columns are split too.
fn col_groups(row_tasks: usize, panels: usize) -> usize {
    if fills_the_cores(row_tasks) {
        1
    } else {
        // No rows is no task to split (and no division by zero).
        (2 * rayon::current_num_threads())
            .div_ceil(row_tasks.max(1))
            .min(panels)
    }
}

/// One product of [`panel`]: `epi(x · w)` for `rows` rows of `x` (row stride `lda`, `k`
/// inputs each) and one panel `w` (`k` rows of `width` contiguous columns, [`NR`] or
/// [`WIDE_NR`]), into the first `live` ≤ `width` columns of `y` (row stride `ldy`); `c0` is
/// the panel's first output column, for the epilogue's bias.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Panel<'a> {
    pub(crate) x: *const f32,
    pub(crate) lda: usize,
    pub(crate) rows: usize,
    pub(crate) k: usize,
    pub(crate) w: *const f32,
    pub(crate) width: usize,
    pub(crate) y: *mut f32,
    pub(crate) ldy: usize,
    pub(crate) live: usize,
    pub(crate) c0: usize,
    pub(crate) epi: Epilogue<'a>,
}

/// The tile loop of [`PackedLinear::forward`] for one [`Panel`], for callers with their
/// own panels (attention's Kᵀ and V).
///
/// # Safety
/// [`runs_here`] holds; `x` is readable at `r·lda + i`, `w` at `i·width + c` and `y`
/// writable at `r·ldy + c'`, for every r < rows, i < k, c < width and c' < live; `y`
/// aliases neither; `width` is [`NR`] or [`WIDE_NR`].
pub(crate) unsafe fn panel(p: Panel) {
    panel_fn(cpu_isa())(p)
}

/// A dense layer whose product a task can run on its own rows: gpulane's packed f32
/// ([`PackedLinear`]) and int8 (`int8::QuantLinear`) kernels, which BERT's fused steps
/// (`attention::block`, `feed_forward::Bert`) take either of.
pub(crate) trait TaskProduct: Sync {
    /// Rows one task carries through the layers (each kernel's own tuned count).
    const TASK_ROWS: usize;
    /// What attention's products run in after this layer's QKV product.
    const PRODUCTS: Products;
    /// Inputs and outputs, `(k, n)`.
    fn shape(&self) -> (usize, usize);

    /// Inputs, `k`.
    fn in_features(&self) -> usize {
        self.shape().0
    }

    /// Outputs, `n`.
    fn out_features(&self) -> usize {
        self.shape().1
    }

    /// Panics unless `x` is `m` rows of inputs, the epilogue's bias one per output, and
    /// `norm`, where given, fits the `[m, n]` outputs.
    fn assert_inputs(&self, x: &[f32], m: usize, epi: Epilogue, norm: Option<RowNorm>) {
        let (k, n) = self.shape();
        assert_eq!(x.len(), m * k, "input is not [{m}, {k}]");
        if let Some(b) = epi.bias() {
            assert_eq!(b.len(), n, "bias is not [{n}]");
        }
        if let Some(norm) = norm {
            norm.assert_fits(m, n);
        }
    }

    /// The whole product on `m` rows, each output row then normalized by `norm`.
    fn forward_on(
        &self,
        isa: CpuIsa,
        x: &[f32],
        m: usize,
        epi: Epilogue,
        norm: Option<RowNorm>,
    ) -> Vec<f32>;
    /// One task's rows: `rows` rows of `x` (row stride `lda`) into `y` (row stride `ldy`).
    ///
    /// # Safety
    /// `isa` runs here; `x` is readable and `y` writable for those rows, and no other
    /// thread writes them meanwhile.
    #[allow(clippy::too_many_arguments)]
    unsafe fn rows_into_on(
        &self,
        isa: CpuIsa,
        x: *const f32,
        lda: usize,
        rows: usize,
        y: *mut f32,
        ldy: usize,
        epi: Epilogue,
    );
}

impl TaskProduct for PackedLinear {
    const TASK_ROWS: usize = ROWS_PER_TASK;
    const PRODUCTS: Products = Products::F32;

    fn shape(&self) -> (usize, usize) {
        (self.k, self.n)
    }

    /// `epi(x · w)` for `x` row-major `[m, k]` on the route of `isa` (tests run each one
    /// the CPU has), in the order [`TILE_ORDER_MAX_K`] picks for it, rows then normalized
    /// by `norm`.
    fn forward_on(
        &self,
        isa: CpuIsa,
        x: &[f32],
        m: usize,
        epi: Epilogue,
        norm: Option<RowNorm>,
    ) -> Vec<f32> {
        self.forward_in(isa, x, m, epi, norm, self.chunk(isa))
    }

    /// `epi(x · w)` for `rows` rows of `x` (row stride `lda`) into `y` (row stride
    /// `ldy`), on the calling thread and the route of `isa`, in the order
    /// [`TILE_ORDER_MAX_K`] picks: for callers that carry a task of rows through several
    /// steps (attention's block, the feed-forward's).
    ///
    /// # Safety
    /// The CPU has `isa`'s route; `x` is readable for `rows` rows of `k` values and `y`
    /// writable for `rows` rows of `n`, and no other thread writes either meanwhile.
    #[allow(clippy::too_many_arguments)]
    unsafe fn rows_into_on(
        &self,
        isa: CpuIsa,
        x: *const f32,
        lda: usize,
        rows: usize,
        y: *mut f32,
        ldy: usize,
        epi: Epilogue,
    ) {
        let chunk = self.chunk(isa);
        let panels = 0..self.n.div_ceil(self.width);
        self.task(panel_fn(isa), x, lda, rows, panels, y, ldy, epi, chunk)
    }
}

/// The output buffer, shared by tasks that write disjoint tiles of it.
#[derive(Clone, Copy)]
pub(crate) struct Dst(pub(crate) *mut f32);
// SAFETY: tasks write disjoint elements; `forward` waits for all of them.
unsafe impl Send for Dst {}
unsafe impl Sync for Dst {}

impl Dst {
    /// Element `i` (a method, so closures capture the `Dst`, not its raw pointer).
    ///
    /// # Safety
    /// `i` is within the buffer.
    pub(crate) unsafe fn at(self, i: usize) -> *mut f32 {
        self.0.add(i)
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{avx512_rows, Epilogue, Panel, PREFETCH};
    use crate::isa::avx512_lanes;

    /// [`super::panel`]: the rows in near-equal tiles of at most [`avx512_rows`] (25 rows
    /// at 12 a tile are 9 + 8 + 8, not 12 + 12 + 1), each reading the panel from cache
    /// after the first. A tile takes as many 16-column registers a row as the panel has
    /// real columns for.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn panel(p: Panel) {
        let Panel {
            x,
            lda,
            rows,
            k,
            w,
            width,
            y,
            ldy,
            live,
            c0,
            epi,
        } = p;
        let masks = [0, 16, 32].map(|c| avx512_lanes(live.saturating_sub(c)));
        let vectors = live.div_ceil(16);
        let tiles = rows.div_ceil(avx512_rows(width));
        let mut r = 0;
        for t in 0..tiles {
            let mr = (rows - r).div_ceil(tiles - t);
            let a = x.add(r * lda);
            let d = y.add(r * ldy);
            macro_rules! tile {
                ($($v:literal: $($r:literal)*;)*) => {
                    match (vectors, mr) {
                        $($(($v, $r) => tile::<$r, $v>(a, lda, k, w, width, ldy, d, masks, c0, epi),)*)*
                        _ => unreachable!("a tile of {mr} rows by {vectors} registers"),
                    }
                };
            }
            tile! {
                1: 1 2 3 4 5 6 7 8 9 10 11 12;
                2: 1 2 3 4 5 6 7 8 9 10 11 12;
                3: 1 2 3 4 5 6 7 8;
            }
            r += mr;
        }
    }

    /// One `R`-row by `16·V`-column tile over the whole inner dimension: `x` rows `lda`
    /// apart, `w` the panel, `k` rows of `width` contiguous, `y` rows `ldy` apart. The
    /// masks cover the panel's real columns (padding columns are neither read from the
    /// bias nor stored).
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile<const R: usize, const V: usize>(
        x: *const f32,
        lda: usize,
        k: usize,
        w: *const f32,
        width: usize,
        ldy: usize,
        y: *mut f32,
        masks: [__mmask16; 3],
        c0: usize,
        epi: Epilogue,
    ) {
        let mut acc = [[_mm512_setzero_ps(); V]; R];
        for i in 0..k {
            let wp = w.add(i * width);
            let wv: [__m512; V] = std::array::from_fn(|v| _mm512_loadu_ps(wp.add(16 * v)));
            // `wrapping_add`: near a panel's end this points past the buffer, which a
            // prefetch (a hint, never a fault) may do but `add` may not.
            let ahead = wp.wrapping_add(PREFETCH * width) as *const i8;
            for v in 0..V {
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64 * v));
            }
            for (r, row) in acc.iter_mut().enumerate() {
                let a = _mm512_set1_ps(*x.add(r * lda + i));
                for (acc, w) in row.iter_mut().zip(wv) {
                    *acc = _mm512_fmadd_ps(a, w, *acc);
                }
            }
        }
        for (r, row) in acc.into_iter().enumerate() {
            for (j, acc) in row.into_iter().enumerate() {
                let (c, m) = (c0 + 16 * j, masks[j]);
                let v = match epi {
                    Epilogue::None => acc,
                    Epilogue::Bias(b) => {
                        _mm512_add_ps(acc, _mm512_maskz_loadu_ps(m, b.as_ptr().add(c)))
                    }
                    Epilogue::BiasGelu(b) => {
                        let v = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(m, b.as_ptr().add(c)));
                        let mut lanes = [0f32; 16];
                        _mm512_storeu_ps(lanes.as_mut_ptr(), v);
                        // Sixteen at once: the compiler vectorizes the erf polynomial.
                        for v in &mut lanes {
                            *v = super::gelu(*v);
                        }
                        _mm512_loadu_ps(lanes.as_ptr())
                    }
                };
                _mm512_mask_storeu_ps(y.add(r * ldy + 16 * j), m, v);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{Epilogue, Panel, PREFETCH};

    /// Rows per tile at most: 2 × 6 accumulators, two weight vectors and a broadcast fit
    /// AVX2's 16 registers.
    const MR: usize = 6;

    /// [`super::panel`]: each 16-column part of the panel in turn (two of a 32-column
    /// panel, three of a 48-column one; a part with no real column is skipped), its rows
    /// in near-equal tiles of at most [`MR`], each reading the part from cache after the
    /// first.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn panel(p: Panel) {
        for h in 0..p.live.div_ceil(16) {
            let left = p.live - 16 * h;
            let part = Part {
                w: p.w.add(16 * h),
                width: p.width,
                live: [left.min(8), left.saturating_sub(8).min(8)],
                c0: p.c0 + 16 * h,
            };
            let tiles = p.rows.div_ceil(MR);
            let mut r = 0;
            for t in 0..tiles {
                let mr = (p.rows - r).div_ceil(tiles - t);
                let a = p.x.add(r * p.lda);
                let d = p.y.add(r * p.ldy + 16 * h);
                macro_rules! tile {
                    ($($r:literal)*) => {
                        match mr {
                            $($r => tile::<$r>(a, p.lda, p.k, p.ldy, d, part, p.epi),)*
                            _ => unreachable!("a tile of {mr} rows"),
                        }
                    };
                }
                tile!(1 2 3 4 5 6);
                r += mr;
            }
        }
    }

    /// One 16-column part of a panel: its first weight (row stride `width`, the panel's),
    /// its real columns in each of its two 8-lane registers, and its first output column.
    #[derive(Clone, Copy)]
    struct Part {
        w: *const f32,
        width: usize,
        live: [usize; 2],
        c0: usize,
    }

    /// The first `live` of 8 floats at `p` (mask `m`), zeros after them.
    #[target_feature(enable = "avx2")]
    unsafe fn load(p: *const f32, live: usize, m: __m256i) -> __m256 {
        if live == 8 {
            _mm256_loadu_ps(p)
        } else {
            _mm256_maskload_ps(p, m)
        }
    }

    /// One `R`-row by 16-column tile over the whole inner dimension: `x` rows `lda`
    /// apart, `y` rows `ldy` apart; a register's columns past its `live` are neither read
    /// from the bias nor stored.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn tile<const R: usize>(
        x: *const f32,
        lda: usize,
        k: usize,
        ldy: usize,
        y: *mut f32,
        part: Part,
        epi: Epilogue,
    ) {
        let mut lo = [_mm256_setzero_ps(); R];
        let mut hi = [_mm256_setzero_ps(); R];
        for i in 0..k {
            let wp = part.w.add(i * part.width);
            let w0 = _mm256_loadu_ps(wp);
            let w1 = _mm256_loadu_ps(wp.add(8));
            // Both ends of the part PREFETCH steps ahead: unaligned, it may span two lines.
            // `wrapping_add`: a prefetch may point past the buffer, `add` may not.
            let ahead = wp.wrapping_add(PREFETCH * part.width);
            _mm_prefetch::<_MM_HINT_T0>(ahead as *const i8);
            _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(15) as *const i8);
            for r in 0..R {
                let a = _mm256_broadcast_ss(&*x.add(r * lda + i));
                lo[r] = _mm256_fmadd_ps(a, w0, lo[r]);
                hi[r] = _mm256_fmadd_ps(a, w1, hi[r]);
            }
        }
        for r in 0..R {
            for (j, acc) in [lo[r], hi[r]].into_iter().enumerate() {
                let live = part.live[j];
                if live == 0 {
                    continue;
                }
                let m = crate::isa::avx2_lanes(live);
                let c = part.c0 + 8 * j;
                let v = match epi {
                    Epilogue::None => acc,
                    Epilogue::Bias(b) => _mm256_add_ps(acc, load(b.as_ptr().add(c), live, m)),
                    Epilogue::BiasGelu(b) => {
                        let v = _mm256_add_ps(acc, load(b.as_ptr().add(c), live, m));
                        let mut lanes = [0f32; 8];
                        _mm256_storeu_ps(lanes.as_mut_ptr(), v);
                        // Eight at once: the compiler vectorizes the erf polynomial.
                        for v in &mut lanes {
                            *v = super::gelu(*v);
                        }
                        _mm256_loadu_ps(lanes.as_ptr())
                    }
                };
                crate::isa::avx2_store(y.add(r * ldy + 8 * j), live, v);
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Deterministic values in [-1, 1) for the kernels' tests (this one's and int8's).
    pub(crate) fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// `x · w` in f64, `w` row-major `[k, n]`.
    fn reference(x: &[f32], w: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
        let mut y = vec![0f32; m * n];
        for r in 0..m {
            for c in 0..n {
                y[r * n + c] = (0..k)
                    .map(|i| x[r * k + i] as f64 * w[i * n + c] as f64)
                    .sum::<f64>() as f32;
            }
        }
        y
    }

    /// The kernel's routes this CPU runs (AVX2, and AVX-512 where it has it); none without
    /// AVX2, where candle's matmul serves f32 and these tests have nothing to run.
    pub(crate) fn routes() -> Vec<CpuIsa> {
        let routes: Vec<CpuIsa> = [CpuIsa::Avx2, CpuIsa::Avx512]
            .into_iter()
            .filter(|&isa| isa <= CpuIsa::detected())
            .collect();
        if routes.is_empty() {
            eprintln!("no AVX2 on this CPU: the f32 dense kernel does not run here");
        }
        routes
    }

    /// `n` values from [`lcg`].
    pub(crate) fn values(n: usize, seed: &mut u64) -> Vec<f32> {
        (0..n).map(|_| lcg(seed)).collect()
    }

    /// Whether two outputs are the same, bit for bit.
    pub(crate) fn same_bits(a: &[f32], b: &[f32]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
    }

    /// A pool of `threads`, so that how rows split into tasks is the same on any host.
    pub(crate) fn pool(threads: usize) -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("a thread pool")
    }

    /// Every shape edge: rows not a multiple of a tile or of a task (and more rows than
    /// one task), outputs not a multiple of a panel or of a register, odd inputs; on
    /// AVX-512 both task orders (k up to and past [`TILE_ORDER_MAX_K`]); each panel
    /// width on each route.
    #[test]
    fn matches_the_product_on_every_edge() {
        for isa in routes() {
            for width in [NR, WIDE_NR] {
                matches_the_product_on(isa, width);
            }
        }
    }

    fn matches_the_product_on(isa: CpuIsa, width: usize) {
        let mut seed = 11;
        for &(m, k, n) in &[
            (1, 1, 1),
            (1, 4, 16),
            (5, 7, 17),
            (13, 33, 40),
            (25, 384, 1152),
            (97, 64, 50),
            (200, 384, 1152),
            (200, 1536, 384),
            (9, 16, 33),
            (17, 20, 80),
        ] {
            let x = values(m * k, &mut seed);
            let w = values(k * n, &mut seed);
            let want = reference(&x, &w, m, k, n);
            let l = PackedLinear::with_width(&w, k, n, width);
            let got = l.forward_on(isa, &x, m, Epilogue::None, None);
            assert_eq!(got.len(), m * n);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                // f32 sums of k products of values in [-1, 1]: rounding grows with k.
                let tol = 1e-6 * (k as f32).sqrt() * 8.0 + 1e-6;
                assert!(
                    (g - w).abs() <= tol,
                    "{isa:?} {m}x{k}x{n} in {width}-column panels at {i}: {g} vs {w}"
                );
            }
        }
    }

    /// Tile order gives panel order's bits on every route and at either panel width,
    /// whatever the chunk: one panel, a few, more than a column group holds, and a chunk
    /// that does not divide the group; and either width gives the other's bits.
    /// Shapes span several row tasks with a short last one and a partly filled last panel;
    /// threads are pinned so the column groups, and so the chunks a group splits into, are
    /// the same on any host.
    #[test]
    fn every_task_order_gives_the_same_bits() {
        let pool = pool(2);
        pool.install(|| {
            for isa in routes() {
                let mut seed = 3;
                for &(m, k, n) in &[(25, 384, 1152), (200, 384, 1000), (13, 40, 45)] {
                    let x = values(m * k, &mut seed);
                    let w = values(k * n, &mut seed);
                    let b = values(n, &mut seed);
                    let epi = Epilogue::BiasGelu(&b);
                    let narrow = PackedLinear::with_width(&w, k, n, NR);
                    let want = narrow.forward_in(isa, &x, m, epi, None, None);
                    for width in [NR, WIDE_NR] {
                        let l = PackedLinear::with_width(&w, k, n, width);
                        for chunk in [None, Some(1), Some(2), Some(3), Some(10), Some(usize::MAX)] {
                            if (width, chunk) == (NR, None) {
                                // `want` itself.
                                continue;
                            }
                            // The output is not zeroed, and may reuse the last one's
                            // memory: poison it first, so an output left unwritten cannot
                            // pass.
                            drop(std::hint::black_box(vec![f32::NAN; m * n]));
                            let got = l.forward_in(isa, &x, m, epi, None, chunk);
                            let same = same_bits(&got, &want);
                            assert!(same, "{isa:?} {m}x{k}x{n}, {width} wide, chunks {chunk:?}");
                        }
                    }
                }
            }
        });
    }

    /// The bias and bias+GELU epilogues give the product, then the bias (then GELU),
    /// the partly filled last panel included.
    #[test]
    fn epilogues_match_the_product_then_bias_and_gelu() {
        for isa in routes() {
            for width in [NR, WIDE_NR] {
                epilogues_match_on(isa, width);
            }
        }
    }

    fn epilogues_match_on(isa: CpuIsa, width: usize) {
        let (m, k, n) = (14, 24, 45);
        let mut seed = 5;
        let x = values(m * k, &mut seed);
        let w = values(k * n, &mut seed);
        let b = values(n, &mut seed);
        let l = PackedLinear::with_width(&w, k, n, width);
        let plain = l.forward_on(isa, &x, m, Epilogue::None, None);
        for epi in [Epilogue::Bias(&b), Epilogue::BiasGelu(&b)] {
            let got = l.forward_on(isa, &x, m, epi, None);
            for (i, g) in got.iter().enumerate() {
                let want = epi.apply(plain[i], i % n);
                assert!(
                    (g - want).abs() <= 1e-6,
                    "{isa:?} {epi:?}, {width} wide, at {i}: {g} vs {want}"
                );
            }
        }
    }

    /// The add-norm fused into the product gives the product, then the add-norm, bit for
    /// bit: with the rows split by columns across tasks (a short batch, normalized after)
    /// and whole rows per task (normalized by the task), in both task orders. One thread
    /// pins which of the two each shape takes.
    #[test]
    fn the_fused_add_norm_gives_the_product_then_the_add_norm() {
        let pool = pool(1);
        pool.install(|| {
            for isa in routes() {
                let mut seed = 7;
                // 10 rows: one row task, so two column groups; 200: three row tasks.
                for &(m, k, n) in &[(10, 40, 45), (200, 64, 96), (200, 384, 384)] {
                    let x = values(m * k, &mut seed);
                    let w = values(k * n, &mut seed);
                    let residual = values(m * n, &mut seed);
                    let params = values(3 * n, &mut seed);
                    let l = PackedLinear::new(&w, k, n);
                    let mut want = l.forward_on(isa, &x, m, Epilogue::None, None);
                    add_norm_rows(&mut want, &residual, &params, 1e-12);
                    let norm = RowNorm {
                        residual: &residual,
                        params: &params,
                        eps: 1e-12,
                    };
                    for chunk in [None, Some(2)] {
                        let got = l.forward_in(isa, &x, m, Epilogue::None, Some(norm), chunk);
                        let same = same_bits(&got, &want);
                        assert!(same, "{isa:?} {m}x{k}x{n}, chunks {chunk:?}");
                    }
                }
            }
        });
    }

    /// `rows` gives back the weight one output per row, padding dropped (int8 quantizes
    /// from it).
    #[test]
    fn rows_are_the_weight_transposed() {
        let (k, n) = (3, 35);
        let w: Vec<f32> = (0..k * n).map(|v| v as f32).collect();
        for width in [NR, WIDE_NR] {
            let rows = PackedLinear::with_width(&w, k, n, width).rows();
            for c in 0..n {
                for i in 0..k {
                    let want = w[i * n + c];
                    assert_eq!(rows[c * k + i], want, "{width} wide: output {c}, input {i}");
                }
            }
        }
    }
}
