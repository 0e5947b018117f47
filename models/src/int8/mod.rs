//! Dynamic int8 quantization for dense layers on the CPU (the opt-in `int8` CPU dtype).
//!
//! Weights are quantized once at load, symmetric per output channel; activations are
//! quantized per row as each matmul runs, asymmetric (u8 with a zero point, ONNX Runtime's
//! "dynamic" scheme): the inputs after GELU are nearly all positive, and a symmetric
//! range would waste half its levels on them. The product accumulates in i32 and is
//! scaled back to f32, so layer norms and pooling stay f32. Attention's products run on
//! the same tiles where the CPU has VNNI ([`attend`]), else in f32.
//!
//! Why a kernel of our own: candle's Q8_0 matmul quantizes in blocks of 32 and takes its
//! VNNI route only when the inner dimension is a multiple of 256, so MiniLM's 384-wide
//! layers ran 6x slower than f32 there. Here the weights are packed for AVX-512 VNNI's
//! `vpdpbusd` (64 byte products per instruction against 16 f32 FMAs). AVX2 has no such
//! instruction, and `vpmaddubsw`, its usual stand-in, saturates u8 × i8 pair sums at i16
//! (ONNX Runtime asks for 7-bit weights there): its route widens both sides to i16 and
//! sums pairs with `vpmaddwd` into i32, exact, half VNNI's products per instruction, on
//! the same packing. A portable path, the reference in tests, serves other CPUs.

#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(target_arch = "x86_64")]
mod attend;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(test)]
pub(crate) mod tests;

use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
pub(crate) use self::attend::{attend, attend_runs_here, AttendScratch};

#[cfg(test)]
use crate::kernels::gelu;
use crate::{
    dense::{Dst, Epilogue, RowNorm, TaskProduct},
    isa::{cpu_isa, CpuIsa},
    kernels::Products,
};

/// An output not written yet.
type Out = std::mem::MaybeUninit<f32>;

/// Output columns per packed panel: one 512-bit register of i32 accumulators.
const PANEL: usize = 16;
/// An AMX tile: 16 rows of 64 bytes (u8 rows, the weights' 16 groups of 4 inputs × 16
/// columns, or 16 × 16 i32 sums alike).
const TILE_ROWS: usize = 16;
const TILE_BYTES: usize = 64;
/// Activation rows one rayon task quantizes and multiplies: enough to reuse each weight
/// panel from cache, few enough to split a small batch over both cores.
const ROWS_PER_TASK: usize = 32;

/// A dense layer's weight `[out, in]`, quantized and packed for its `TaskProduct` products.
pub(crate) struct QuantLinear {
    /// Inputs (`k`) and outputs (`n`).
    k: usize,
    n: usize,
    /// `k` rounded up to a multiple of 4 (one `vpdpbusd` lane takes 4 bytes).
    k4: usize,
    /// Panels of 16 output columns: `[panel][k4 / 4][16 columns][4 bytes]`, i8.
    packed: Vec<i8>,
    /// Per output column: the dequantization scale, and the sum of its quantized weights
    /// (times a row's zero point, what that row's offset added to the product).
    scale: Vec<f32>,
    sum: Vec<i32>,
}

impl QuantLinear {
    /// Quantizes `w`, row-major `[n, k]` (one row per output).
    pub(crate) fn new(w: &[f32], n: usize, k: usize) -> Self {
        assert!(n > 0 && k > 0, "an empty layer [{n}, {k}]");
        assert_eq!(w.len(), n * k, "weight is not [{n}, {k}]");
        let k4 = k.div_ceil(4) * 4;
        let panels = n.div_ceil(PANEL);
        // The tail: an AMX tile reads 16 groups of a panel at a time, so where `k4` is not
        // a multiple of 64 the last panel's last tile reads up to 15 groups past it. Those
        // products meet the activations' zero padding; they only need to be in bounds.
        let mut packed = vec![0i8; panels * PANEL * k4 + TILE_ROWS * PANEL * 4];
        let mut scale = vec![0f32; n];
        let mut sums = vec![0i32; n];
        for (c, row) in w.chunks_exact(k).enumerate() {
            let max = row.iter().fold(0f32, |m, v| m.max(v.abs()));
            // A column holding NaN or an infinity: its f32 outputs would not be finite, so
            // its scale is NaN (and its weights zeros), which makes every output of it NaN
            // rather than a product of the finite weights alone (`max` skips NaN).
            let s = if row.iter().any(|v| !v.is_finite()) {
                f32::NAN
            } else if max > 0.0 {
                max / 127.0
            } else {
                1.0
            };
            scale[c] = s;
            let (p, col) = (c / PANEL, c % PANEL);
            let mut sum = 0i32;
            for (i, v) in row.iter().enumerate() {
                // NaN (a column with a non-finite value) converts to 0.
                let q = (v / s).round().clamp(-127.0, 127.0) as i8;
                sum += q as i32;
                packed[((p * (k4 / 4) + i / 4) * PANEL + col) * 4 + i % 4] = q;
            }
            sums[c] = sum;
        }
        Self {
            k,
            n,
            k4,
            packed,
            scale,
            sum: sums,
        }
    }

    /// `epi(x · wᵀ)` for `x` row-major `[m, k]`; returns `[m, n]` row-major.
    #[cfg(test)]
    pub(crate) fn forward(&self, x: &[f32], m: usize, epi: Epilogue) -> Vec<f32> {
        self.forward_on(cpu_isa(), x, m, epi, None)
    }

    /// Rows quantized to u8 (what `vpdpbusd` and `tdpbusd` take on their unsigned side),
    /// laid out as the route of `isa` reads them (see [`Quantized`]), and each row's scale
    /// and zero point.
    fn quantize_rows(&self, isa: CpuIsa, x: &[f32], lda: usize, rows: usize) -> Quantized {
        let (stride, padded) = if isa >= CpuIsa::Amx {
            (
                self.k.div_ceil(TILE_BYTES) * TILE_BYTES,
                rows.div_ceil(TILE_ROWS) * TILE_ROWS,
            )
        } else {
            (self.k4, rows)
        };
        assert!(
            isa.runs_here(),
            "int8 at {isa:?} on a CPU with {:?}",
            CpuIsa::detected()
        );
        let mut q = vec![0u8; padded * stride];
        let mut scales = vec![RowScale::default(); rows];
        for (r, (q, s)) in q
            .chunks_exact_mut(stride)
            .zip(scales.iter_mut())
            .enumerate()
        {
            // SAFETY: checked above.
            *s = unsafe { quantize_row_on(isa, &x[r * lda..][..self.k], &mut q[..self.k]) };
        }
        Quantized { q, stride, scales }
    }

    /// The product of quantized rows on the route of `isa`: AMX, VNNI, AVX2 (their
    /// integer sums are exact, so all agree with the portable route bit for bit), or
    /// portable. Every route but AMX reads any layout
    /// [`quantize_rows`](Self::quantize_rows) makes; AMX needs its own.
    fn matmul_on(
        &self,
        isa: CpuIsa,
        q: &Quantized,
        rows: usize,
        y: &mut [Out],
        ldy: usize,
        epi: Epilogue,
    ) {
        assert!(
            isa.runs_here(),
            "int8 at {isa:?} on a CPU with {:?}",
            CpuIsa::detected()
        );
        assert!(
            q.stride >= self.k4 && q.q.len() >= rows * q.stride && q.scales.len() >= rows,
            "{rows} quantized rows of {} bytes in {}; this is a bug",
            q.stride,
            q.q.len()
        );
        assert!(
            ldy >= self.n && y.len() >= (rows.max(1) - 1) * ldy + self.n,
            "{rows} output rows {ldy} apart in {}; this is a bug",
            y.len()
        );
        #[cfg(target_arch = "x86_64")]
        {
            let j = &Job {
                l: self.packed(),
                qa: &q.q,
                lda: q.stride,
                sa: &q.scales,
                epi,
                ldy,
            };
            if isa >= CpuIsa::Amx {
                assert!(
                    q.stride.is_multiple_of(TILE_BYTES)
                        && q.q.len() >= rows.div_ceil(TILE_ROWS) * TILE_ROWS * q.stride,
                    "AMX reads whole tiles of quantized rows; this is a bug"
                );
                // SAFETY: the CPU has AMX-INT8 and AVX-512 BW, its tiles are enabled for
                // this process (`runs_here`, asserted above), and the rows fill whole tiles
                // (asserted).
                return unsafe { amx::matmul(j, rows, y) };
            } else if isa >= CpuIsa::Avx512Vnni {
                // SAFETY: the CPU has AVX-512 F, BW and VNNI (asserted above).
                return unsafe { avx512::matmul(j, rows, y) };
            } else if isa >= CpuIsa::Avx2 {
                // SAFETY: the CPU has AVX2 (asserted above).
                return unsafe { avx2::matmul(j, rows, y) };
            }
        }
        self.matmul_portable(q, rows, y, ldy, epi);
    }

    /// The packed weights as the tiles read them.
    #[cfg(target_arch = "x86_64")]
    fn packed(&self) -> Packed<'_> {
        Packed {
            groups: self.k4 / 4,
            panel_stride: PANEL * self.k4,
            n: self.n,
            w: &self.packed,
            scale: &self.scale,
            sum: &self.sum,
        }
    }

    /// Scales one accumulated column back to f32.
    #[inline]
    fn dequantize(&self, acc: i32, row: RowScale, col: usize) -> f32 {
        (acc - row.zero * self.sum[col]) as f32 * row.scale * self.scale[col]
    }

    /// The same product in plain Rust: any CPU, and the reference the VNNI path is
    /// tested against.
    fn matmul_portable(
        &self,
        q: &Quantized,
        rows: usize,
        y: &mut [Out],
        ldy: usize,
        epi: Epilogue,
    ) {
        let (k4, sa) = (self.k4, &q.scales);
        for r in 0..rows {
            let a = &q.q[r * q.stride..r * q.stride + k4];
            for c in 0..self.n {
                let (p, col) = (c / PANEL, c % PANEL);
                let panel = &self.packed[p * PANEL * k4..(p + 1) * PANEL * k4];
                let mut acc = 0i32;
                for g in 0..k4 / 4 {
                    let w = &panel[(g * PANEL + col) * 4..(g * PANEL + col) * 4 + 4];
                    for j in 0..4 {
                        acc += a[g * 4 + j] as i32 * w[j] as i32;
                    }
                }
                y[r * ldy + c].write(epi.apply(self.dequantize(acc, sa[r], c), c));
            }
        }
    }
}

/// The i8 side of a product as the tiles read it, borrowed: a layer's weights, or
/// attention's keys or values ([`attend`]), of which a block reads a range of panels
/// (keys) or of inputs (values) only. Panels of 16 output columns, each `[groups][16][4]`,
/// `panel_stride` values from one panel's start to the next.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Packed<'a> {
    groups: usize,
    panel_stride: usize,
    /// Output columns; per column, the dequantization scale and the sum of its values
    /// (what a row's zero point adds to the product).
    n: usize,
    w: &'a [i8],
    scale: &'a [f32],
    sum: &'a [i32],
}

/// One task's product, for the tiles: the packed side, the quantized rows (`A`: u8 as
/// VNNI and AMX take them, or widened to i16 for AVX2's `vpmaddwd`) `lda` apart, their
/// scales, what to do with the outputs, and the outputs' row stride.
#[cfg(target_arch = "x86_64")]
struct Job<'a, A> {
    l: Packed<'a>,
    qa: &'a [A],
    lda: usize,
    sa: &'a [RowScale],
    epi: Epilogue<'a>,
    ldy: usize,
}

impl TaskProduct for QuantLinear {
    const TASK_ROWS: usize = ROWS_PER_TASK;
    const PRODUCTS: Products = Products::Int8;

    fn shape(&self) -> (usize, usize) {
        (self.k, self.n)
    }

    /// `epi(x · wᵀ)` for `x` row-major `[m, k]` on the route of `isa`, returned `[m, n]`
    /// row-major; each output row then normalized by `norm` where given, in the task that
    /// stored it while the row is in its core's cache (as `PackedLinear::forward_on`
    /// does: a separate add-norm pass read every row back, into a buffer it zeroed first).
    fn forward_on(
        &self,
        isa: CpuIsa,
        x: &[f32],
        m: usize,
        epi: Epilogue,
        norm: Option<RowNorm>,
    ) -> Vec<f32> {
        let n = self.n;
        self.assert_inputs(x, m, epi, norm);
        // Not zeroed first: zeroing every output (tokens × outputs floats per layer) cost
        // a tenth of a long-passage run, and the kernels write every element.
        let mut y: Vec<f32> = Vec::with_capacity(m * n);
        let out = Dst(y.as_mut_ptr());
        (0..m.div_ceil(ROWS_PER_TASK))
            .into_par_iter()
            .for_each(|t| {
                let rows = t * ROWS_PER_TASK..((t + 1) * ROWS_PER_TASK).min(m);
                // SAFETY: each task reads its own rows of x (asserted [m, k]) and writes
                // every output of its own rows of y (m × n), which no other task touches;
                // then it normalizes those rows.
                unsafe {
                    let x = x.as_ptr().add(rows.start * self.k);
                    let y = out.at(rows.start * n);
                    self.rows_into_on(isa, x, self.k, rows.len(), y, n, epi);
                    if let Some(norm) = norm {
                        norm.apply_to(out, n, rows);
                    }
                }
            });
        // SAFETY: the tasks cover every row, and each stores every column of its rows.
        unsafe { y.set_len(m * n) };
        y
    }

    /// One task's product: `epi(x · wᵀ)` for `rows` rows of `x` (row stride `lda`, `k`
    /// inputs each) into `y` (row stride `ldy`, `n` outputs each), on the route of `isa`.
    ///
    /// # Safety
    /// `x` is readable for `rows` rows of `lda ≥ k` values, `y` writable for `rows` rows of
    /// `ldy ≥ n`, and no other thread writes those outputs meanwhile.
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
        assert!(
            lda >= self.k && ldy >= self.n,
            "strides {lda}, {ldy} for [{}, {}]",
            self.k,
            self.n
        );
        // In chunks of a task's rows, whatever the caller's task: a chunk's quantized rows
        // (12 KiB at MiniLM's 384 inputs) stay in L1 while every weight panel passes
        // them, where a whole 256-token passage's would not.
        for r0 in (0..rows).step_by(ROWS_PER_TASK) {
            let rows = (rows - r0).min(ROWS_PER_TASK);
            let x = std::slice::from_raw_parts(x.add(r0 * lda), (rows - 1) * lda + self.k);
            let y = y.add(r0 * ldy).cast::<Out>();
            let y = std::slice::from_raw_parts_mut(y, (rows - 1) * ldy + self.n);
            let q = self.quantize_rows(isa, x, lda, rows);
            self.matmul_on(isa, &q, rows, y, ldy, epi);
        }
    }
}

/// A task's activation rows in u8, as [`QuantLinear::quantize_rows`] lays them out for a
/// route: rows `stride` bytes apart, at least `k4` (VNNI and AVX2 take `k4`; AMX a whole
/// number of 64-byte tiles), the padding zeros. Those zeros are what keep the sums exact:
/// bytes up to `k4` meet zero weights, but on AMX bytes past `k4` meet the next panel's
/// first weights (or the packing's tail). For AMX, zero rows follow the real ones up to a
/// whole 16-row tile; their outputs are never stored.
struct Quantized {
    q: Vec<u8>,
    stride: usize,
    /// Each real row's scale and zero point.
    scales: Vec<RowScale>,
}

/// One activation row's quantization: `x ≈ scale · (q − zero)`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct RowScale {
    scale: f32,
    zero: i32,
}

impl RowScale {
    /// A row holding NaN or an infinity. No range represents it, and its f32 product
    /// would not be finite either, so every output of the row comes out NaN (this scale)
    /// on every route, instead of finite numbers from a range that skipped the bad values
    /// (which is what the routes' min/max did, each differently).
    const NON_FINITE: Self = Self {
        scale: f32::NAN,
        zero: 0,
    };

    /// The range `[min, max]` (widened to hold 0, so zero stays exact) over 255 levels.
    fn of(min: f32, max: f32) -> Self {
        let (min, max) = (min.min(0.0), max.max(0.0));
        // A range so small that its reciprocal would overflow is a row of zeros.
        let scale = (max - min) / 255.0;
        let scale = if (1.0 / scale).is_finite() {
            scale
        } else {
            1.0
        };
        let zero = (-min / scale).round_ties_even().clamp(0.0, 255.0) as i32;
        Self { scale, zero }
    }
}

/// One row to u8 and its scale, in plain Rust. Rounds ties to even, as the vector path's
/// conversion does, so the two agree bit for bit; a row with NaN or an infinity is zeros
/// and [`RowScale::NON_FINITE`] on every route.
fn quantize_row(row: &[f32], q: &mut [u8]) -> RowScale {
    if row.iter().any(|v| !v.is_finite()) {
        q.fill(0);
        return RowScale::NON_FINITE;
    }
    let (min, max) = row
        .iter()
        .fold((0f32, 0f32), |(lo, hi), &v| (lo.min(v), hi.max(v)));
    let rs = RowScale::of(min, max);
    let inv = 1.0 / rs.scale;
    for (q, v) in q.iter_mut().zip(row) {
        *q = ((v * inv).round_ties_even() as i32 + rs.zero).clamp(0, 255) as u8;
    }
    rs
}

/// One row quantized by the route of `isa` (AMX rows take the VNNI route's quantizer);
/// every route gives the same bytes and scale.
///
/// # Safety
/// `isa.runs_here()`: callers check it once, not per row.
unsafe fn quantize_row_on(isa: CpuIsa, row: &[f32], q: &mut [u8]) -> RowScale {
    #[cfg(target_arch = "x86_64")]
    {
        if isa >= CpuIsa::Avx512Vnni {
            // SAFETY: the CPU has AVX-512 F and BW (the caller's contract).
            return unsafe { avx512::quantize_row(row, q) };
        }
        if isa >= CpuIsa::Avx2 {
            // SAFETY: the CPU has AVX2 (the caller's contract).
            return unsafe { avx2::quantize_row(row, q) };
        }
    }
    quantize_row(row, q)
}

/// Whether a tuned kernel (AMX, VNNI or AVX2) runs here; else the portable one.
pub(crate) fn tuned() -> bool {
    cpu_isa() >= CpuIsa::Avx2
}
