//! Feed-forward activations, by the names transformers' `ACT2FN` gives them.

use candle_core::Tensor;

use crate::{
    feed_forward::GatedRow,
    kernels::{self, CardOps},
    ModelError,
};

/// Which activation a feed-forward layer uses (config.json `hidden_act`, DistilBERT's
/// `activation`, ModernBERT's `hidden_activation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Act {
    /// `gelu`: the exact, erf-based GELU.
    Gelu,
    /// `gelu_new` / `gelu_pytorch_tanh`: the tanh approximation.
    GeluTanh,
    Relu,
    /// `silu` / `swish`.
    Silu,
}

impl Act {
    /// The activation transformers' `ACT2FN` maps `name` to, if gpulane runs it.
    pub(crate) fn parse(name: &str, path: &std::path::Path) -> Result<Self, ModelError> {
        Ok(match name {
            "gelu" => Act::Gelu,
            "gelu_new" | "gelu_pytorch_tanh" => Act::GeluTanh,
            "relu" => Act::Relu,
            "silu" | "swish" => Act::Silu,
            other => {
                return Err(ModelError::Unsupported {
                    path: path.to_owned(),
                    reason: format!(
                        "activation {other:?}; gpulane runs gelu, gelu_new, gelu_pytorch_tanh, relu and silu"
                    ),
                })
            }
        })
    }

    /// `act(input) · gate` of a gated feed-forward's up-projection `[N, 2I]` = `[input |
    /// gate]` (ModernBERT's `Wi`; Qwen3's gate and up projections, gate first): the fused
    /// kernel for GELU, candle ops otherwise.
    pub(crate) fn gated(self, up: &Tensor, ops: CardOps) -> candle_core::Result<Tensor> {
        if self == Act::Gelu {
            return kernels::gated_gelu(up, ops);
        }
        if self == Act::Silu && kernels::cpu_f32(up) {
            return kernels::gated_silu(up);
        }
        let i = up.dim(1)? / 2;
        self.apply(&up.narrow(1, 0, i)?)? * up.narrow(1, i, i)?
    }

    /// The CPU f32 row kernel of [`gated`](Self::gated), where it has one (GELU, SiLU):
    /// what the fused feed-forward applies to each task's rows.
    pub(crate) fn gated_row(self) -> Option<GatedRow> {
        match self {
            Act::Gelu => Some(kernels::gated_gelu_row),
            Act::Silu => Some(kernels::gated_silu_row),
            Act::GeluTanh | Act::Relu => None,
        }
    }

    /// `act(x + bias)`: the fused kernel for GELU, candle ops otherwise.
    pub(crate) fn with_bias(
        self,
        x: &Tensor,
        bias: &Tensor,
        ops: CardOps,
    ) -> candle_core::Result<Tensor> {
        if self == Act::Gelu {
            return kernels::bias_gelu(x, bias, ops);
        }
        self.apply(&x.broadcast_add(bias)?)
    }

    /// The activation, element-wise, through candle ops.
    pub(crate) fn apply(self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Act::Gelu => x.gelu_erf(),
            Act::GeluTanh => x.gelu(),
            Act::Relu => x.relu(),
            Act::Silu => x.silu(),
        }
    }
}
