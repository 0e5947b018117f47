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
    layers::{GatedFeedForward, Linear, NormRef, PreNormAttention, RmsNorm, Weight},
    rope::Rope,
    Packed, Routing,
};
use crate::{
    batcher::Row,
    config::Qwen3Config,
    kernels::{Heads, Mask},
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
        let mut x = self.embed.index_select(&batch.ids, 0)?;
        for l in &self.layers {
            x = PreNormAttention {
                norm: Some(NormRef::Rms(&l.input_norm)),
                eps: self.eps,
                qkv: &l.qkv,
                qk_norm: Some((&l.q_norm, &l.k_norm)),
                out: &l.o,
            }
            .forward(&x, &batch, self.heads, Mask::Causal, (&cos, &sin))?;
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
