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
//! Kernels run on rayon's pool, the one candle's matmul uses; the row kernels are compiled
//! for AVX-512 and for AVX2+FMA (picked at run time) and for the baseline.
//!
//! `scalar` holds the branch-free building blocks (erf, `exp`, eight-lane sums), `rows` the
//! per-row kernels built from them, `softmax` one attention row's softmax in intrinsics,
//! `packed` the packed CPU attention, `ops` the custom ops and their card and candle
//! fallbacks, `read` the in-place reads of CPU tensors, `padded` the padded path's masks.

mod ops;
mod packed;
mod padded;
mod read;
mod rows;
mod scalar;
mod softmax;
#[cfg(test)]
pub(crate) mod tests;

#[cfg(target_arch = "x86_64")]
pub(crate) use self::softmax::softmax_levels;
pub(crate) use self::{
    ops::{add_norm, bias_gelu, gated_gelu, gated_rows, gated_silu, qk_norm_rope, rope, CardOps},
    packed::{attention, packed_attention_runs, Heads, Keys, Mask, Products, RelativeBias},
    padded::{band, causal, masked_softmax},
    read::{cpu_f32, cpu_slice, read_optional, CpuF32},
    rows::{
        add_into, add_norm_rows, gated_gelu_row, gated_silu_row, layer_norm_rows, qk_norm_rope_row,
        rms_norm_rows, rope_row,
    },
    scalar::gelu,
    softmax::softmax_row,
};

/// Rows handed to one rayon task: big enough to amortise scheduling, small enough to
/// spread a short batch over every thread.
pub(crate) const ROWS_PER_TASK: usize = 8;
