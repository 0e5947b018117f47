//! The padded attention path's softmax and masks, in plain candle ops (cards, f16/bf16).

use candle_core::{DType, Result, Tensor};

/// Softmax over the last dimension of attention scores `[B, heads, T, T]` plus `bias`,
/// one additive term in the scores' dtype, broadcast over them: the key mask `[B, 1, 1,
/// T]` (0 for real keys, −∞ for padding), or for a sliding-window layer that mask plus
/// the band (see [`band`]), `[B, 1, T, T]`; the caller builds either once per batch. The
/// padded attention path's softmax (CUDA, f16/bf16); the CPU in f32 runs
/// [`attention`](super::attention) instead, so this is plain candle ops.
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
