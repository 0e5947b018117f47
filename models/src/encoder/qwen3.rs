//! Qwen3 as an embedder (Qwen3-Embedding-0.6B/4B/8B; gte-Qwen2 and e5-mistral have the
//! same shape): a decoder, so attention is causal, with grouped-query attention (each K/V
//! head serves several query heads), rotary positions, RMSNorm before each block, RMSNorm
//! on every head's Q and K before rotation, and a SwiGLU feed-forward. Sentence vectors
//! are usually its last token's (`pooling_mode_lasttoken`), the EOS its tokenizer appends.
//!
//! Dense layers run on packed real tokens like the encoders'. Q's 1/√d scale cannot be
//! folded into `q_proj` (the per-head RMSNorm after it would undo it), so it is folded into
//! the Q norm's weight instead; rotation is linear, so scaling before it is the same.

use std::path::Path;

use candle_core::{Device, Tensor};
use candle_nn::VarBuilder;

use super::{
    act::Act,
    batch::Batch,
    layers::{GatedFeedForward, Linear, NormRef, RmsNorm, Weight},
    rope::{rotate, Rope},
    Packed, Routing,
};
use crate::{
    batcher::Row,
    config::Qwen3Config,
    kernels::{self, Heads, Mask},
    ModelError,
};

struct Layer {
    input_norm: RmsNorm,
    /// `[H, (q + 2·kv)·d]`: q_proj, k_proj, v_proj side by side.
    qkv: Linear,
    /// Over each query head's d values, weight pre-scaled by 1/√d.
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    o: Linear,
    post_norm: RmsNorm,
    /// `[H, 2I]`: gate_proj, then up_proj.
    gate_up: Linear,
    down: Linear,
}

/// A loaded Qwen3 decoder. Blocking: call it from an engine thread.
pub(crate) struct Qwen3 {
    embed: Tensor,
    layers: Vec<Layer>,
    norm: RmsNorm,
    heads: Heads,
    eps: f32,
    act: Act,
    rope: Rope,
    device: Device,
    /// Which attention route batches take.
    pub(crate) routing: Routing,
}

impl Qwen3 {
    /// Loads a Qwen3 checkpoint at `vb`: a bare `Qwen3Model`, or one under `model.`.
    pub(crate) fn load(
        config: &Qwen3Config,
        vb: VarBuilder,
        path: &Path,
    ) -> Result<Self, ModelError> {
        let unsupported = |reason: String| ModelError::Unsupported {
            path: path.to_owned(),
            reason,
        };
        let sliding = config
            .layer_types
            .iter()
            .flatten()
            .any(|t| t != "full_attention");
        if config.use_sliding_window || sliding {
            return Err(unsupported(
                "sliding-window layers; gpulane runs Qwen3 with full causal attention".to_owned(),
            ));
        }
        if !config.rope_scaling.is_null() {
            return Err(unsupported(
                "rope_scaling is set; gpulane runs unscaled rotary embeddings".to_owned(),
            ));
        }
        match config.rope_parameters["rope_type"].as_str() {
            None | Some("default") => {}
            Some(other) => {
                return Err(unsupported(format!(
                    "rope_type {other:?}; gpulane runs \"default\" rotary embeddings"
                )))
            }
        }
        let act = Act::parse(&config.hidden_act, path)?;
        let vb = if vb.contains_tensor("model.embed_tokens.weight") {
            vb.pp("model")
        } else {
            vb
        };
        let device = vb.device().clone();
        let hidden = config.hidden_size;
        let heads = Heads {
            q: config.num_attention_heads,
            kv: config.kv_heads(),
            d: config.head_dim(),
        };
        let (q_width, kv_width) = (heads.q * heads.d, heads.kv * heads.d);
        let bias = config.attention_bias;
        let inter = config.intermediate_size;
        let scale = 1.0 / (heads.d as f64).sqrt();
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for i in 0..config.num_hidden_layers {
            let l = vb.pp(format!("layers.{i}"));
            let a = l.pp("self_attn");
            let m = l.pp("mlp");
            let mut q_norm = RmsNorm::load(a.pp("q_norm"), heads.d)?;
            q_norm.weight = (q_norm.weight * scale)?;
            layers.push(Layer {
                input_norm: RmsNorm::load(l.pp("input_layernorm"), hidden)?,
                qkv: Linear::concat(vec![
                    Linear::load(a.pp("q_proj"), hidden, q_width, bias)?,
                    Linear::load(a.pp("k_proj"), hidden, kv_width, bias)?,
                    Linear::load(a.pp("v_proj"), hidden, kv_width, bias)?,
                ])?,
                q_norm,
                k_norm: RmsNorm::load(a.pp("k_norm"), heads.d)?,
                o: Linear::load(a.pp("o_proj"), q_width, hidden, bias)?,
                post_norm: RmsNorm::load(l.pp("post_attention_layernorm"), hidden)?,
                gate_up: Linear::concat(vec![
                    Linear::load(m.pp("gate_proj"), hidden, inter, false)?,
                    Linear::load(m.pp("up_proj"), hidden, inter, false)?,
                ])?,
                down: Linear::load(m.pp("down_proj"), inter, hidden, false)?,
            });
        }
        Ok(Self {
            embed: vb.get((config.vocab_size, hidden), "embed_tokens.weight")?,
            layers,
            norm: RmsNorm::load(vb.pp("norm"), hidden)?,
            heads,
            eps: config.rms_norm_eps as f32,
            act,
            rope: Rope::new(
                config.theta(),
                heads.d,
                config.max_position_embeddings,
                &device,
            )?,
            device,
            routing: Routing::default(),
        })
    }

    /// Every dense layer's weight, for the steps that re-lay them all out (int8, the
    /// CPU's packed f32).
    pub(crate) fn dense_weights(&mut self) -> Vec<&mut Weight> {
        self.layers
            .iter_mut()
            .flat_map(|l| [&mut l.qkv.w, &mut l.o.w, &mut l.gate_up.w, &mut l.down.w])
            .collect()
    }

    /// Token vectors for `rows`, packed, after the final norm (what sentence-transformers
    /// pools).
    pub(crate) fn forward(&self, rows: &[&Row]) -> Result<Packed, ModelError> {
        let batch = Batch::new(
            rows,
            &self.device,
            self.embed.dtype(),
            self.routing
                .pick(&self.device, self.embed.dtype(), self.heads.d),
        )?;
        let (cos, sin) = self.rope.at(&batch.position_ids(0)?)?;
        // The fused CPU pass reads the angles as slices: taken once here, not per layer.
        let cpu_angles = if kernels::cpu_f32(&cos) {
            Some((cos.flatten_all()?.to_vec1()?, sin.flatten_all()?.to_vec1()?))
        } else {
            None
        };
        let mut x = self.embed.index_select(&batch.ids, 0)?;
        for l in &self.layers {
            let qkv = l.qkv.forward(&l.input_norm.forward(&x, self.eps)?)?;
            let qkv = match &cpu_angles {
                Some((c, s)) if kernels::cpu_f32(&qkv) => kernels::qk_norm_rope(
                    &qkv,
                    &l.q_norm.weight,
                    &l.k_norm.weight,
                    c,
                    s,
                    self.heads,
                    self.eps,
                )?,
                _ => qk_norm_rope(&qkv, &l.q_norm, &l.k_norm, &cos, &sin, self.heads, self.eps)?,
            };
            let ctx = batch.attend(&qkv, self.heads, Mask::Causal)?;
            x = (x + l.o.forward(&ctx)?)?;
            x = GatedFeedForward {
                norm: NormRef::Rms(&l.post_norm),
                eps: self.eps,
                up: &l.gate_up,
                act: self.act,
                down: &l.down,
            }
            .forward(&x, self.routing.card_ops())?;
        }
        let x = self.norm.forward(&x, self.eps)?;
        Ok(batch.into_packed(x))
    }
}

/// Per-head RMSNorm of Q and K, each over its d values, then rotation, as candle ops:
/// cards and f16/bf16 (the CPU in f32 runs `kernels::qk_norm_rope`, one fused pass).
fn qk_norm_rope(
    qkv: &Tensor,
    q_norm: &RmsNorm,
    k_norm: &RmsNorm,
    cos: &Tensor,
    sin: &Tensor,
    heads: Heads,
    eps: f32,
) -> Result<Tensor, ModelError> {
    let Heads { q, kv, d } = heads;
    let n = qkv.dim(0)?;
    let qn = q_norm
        .forward(&qkv.narrow(1, 0, q * d)?.reshape((n, q, d))?, eps)?
        .reshape((n, q * d))?;
    let kn = k_norm
        .forward(&qkv.narrow(1, q * d, kv * d)?.reshape((n, kv, d))?, eps)?
        .reshape((n, kv * d))?;
    let v = qkv.narrow(1, (q + kv) * d, kv * d)?;
    rotate(&Tensor::cat(&[qn, kn, v], 1)?, cos, sin, heads)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The CPU's fused pass (`kernels::qk_norm_rope`) is the candle chain cards and
    /// f16/bf16 run: per-head RMSNorm of Q and K with their own weights, then rotation;
    /// grouped K/V heads, several tokens at their own positions, V untouched.
    #[test]
    fn fused_qk_norm_and_rotation_match_the_candle_chain() {
        let heads = Heads { q: 4, kv: 2, d: 8 };
        let (n, dev) = (5, Device::Cpu);
        let t = |shape: &[usize], scale: f64| {
            (Tensor::randn(0f32, 1f32, shape, &dev).unwrap() * scale).unwrap()
        };
        let qkv = t(&[n, heads.qkv_width()], 3.0);
        let (qw, kw) = (t(&[heads.d], 1.0), t(&[heads.d], 1.0));
        let rope = Rope::new(1e6, heads.d, 64, &dev).unwrap();
        let pos = Tensor::new(&[0u32, 1, 2, 0, 40], &dev).unwrap();
        let (cos, sin) = rope.at(&pos).unwrap();
        let eps = 1e-6;
        let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let got =
            kernels::qk_norm_rope(&qkv, &qw, &kw, &flat(&cos), &flat(&sin), heads, eps).unwrap();
        let (q_norm, k_norm) = (RmsNorm { weight: qw }, RmsNorm { weight: kw });
        let want = qk_norm_rope(&qkv, &q_norm, &k_norm, &cos, &sin, heads, eps).unwrap();

        let diff = kernels::tests::max_diff(&got, &want);
        assert!(diff < 1e-5, "max diff {diff}");
    }
}
