//! The weight-holding layers the families share: a dense layer with its weight laid out
//! `[in, out]` once at load, LayerNorm with an optional bias, and RMSNorm.

use candle_core::Tensor;
use candle_nn::VarBuilder;

use crate::ModelError;

/// A dense layer, weight transposed to `[in, out]` at load (contiguous for `x.matmul(w)`),
/// bias optional.
pub(crate) struct Linear {
    pub(crate) w: Tensor,
    pub(crate) b: Option<Tensor>,
}

impl Linear {
    pub(crate) fn load(vb: VarBuilder, i: usize, o: usize, bias: bool) -> Result<Self, ModelError> {
        let w = vb.get((o, i), "weight")?.t()?.contiguous()?;
        let b = if bias { Some(vb.get(o, "bias")?) } else { None };
        Ok(Self { w, b })
    }

    /// Several layers of one input side by side, as one `[in, Σ out]` matrix (Q, K and V;
    /// gate and up), so one matmul serves them all.
    pub(crate) fn concat(parts: Vec<Linear>) -> Result<Self, ModelError> {
        let ws: Vec<Tensor> = parts.iter().map(|p| p.w.clone()).collect();
        let w = Tensor::cat(&ws, 1)?.contiguous()?;
        let b = if parts.iter().all(|p| p.b.is_some()) {
            let bs: Vec<Tensor> = parts.iter().filter_map(|p| p.b.clone()).collect();
            Some(Tensor::cat(&bs, 0)?)
        } else {
            None
        };
        Ok(Self { w, b })
    }

    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor, ModelError> {
        let y = x.matmul(&self.w)?;
        Ok(match &self.b {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }
}

/// LayerNorm with an optional bias (ModernBERT's `norm_bias`, usually false). Not
/// candle_nn's `LayerNorm`: without a bias that one skips its fused op for six separate
/// ones.
pub(crate) struct Norm {
    gamma: Tensor,
    /// Zeros when the checkpoint has no bias, so one candle op serves both.
    beta: Tensor,
}

impl Norm {
    pub(crate) fn load(vb: VarBuilder, hidden: usize, bias: bool) -> Result<Self, ModelError> {
        let gamma = vb.get(hidden, "weight")?;
        let beta = if bias {
            vb.get(hidden, "bias")?
        } else {
            gamma.zeros_like()?
        };
        Ok(Self { gamma, beta })
    }

    pub(crate) fn forward(&self, x: &Tensor, eps: f32) -> Result<Tensor, ModelError> {
        Ok(candle_nn::ops::layer_norm(x, &self.gamma, &self.beta, eps)?)
    }
}

/// RMSNorm over the last dimension (Qwen3's layer norms, and its per-head q/k norms).
pub(crate) struct RmsNorm {
    pub(crate) weight: Tensor,
}

impl RmsNorm {
    pub(crate) fn load(vb: VarBuilder, width: usize) -> Result<Self, ModelError> {
        Ok(Self {
            weight: vb.get(width, "weight")?,
        })
    }

    pub(crate) fn forward(&self, x: &Tensor, eps: f32) -> Result<Tensor, ModelError> {
        Ok(candle_nn::ops::rms_norm(
            &x.contiguous()?,
            &self.weight,
            eps,
        )?)
    }
}
