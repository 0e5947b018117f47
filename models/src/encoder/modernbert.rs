//! ModernBERT's forward pass (answerdotai/ModernBERT, nomic-ai/modernbert-embed,
//! Alibaba-NLP/gte-modernbert): rotary positions instead of a position table, pre-norm
//! layers (usually without biases), a gated-GELU feed-forward, and attention that
//! alternates between global layers and local ones, where a token sees only the
//! `local_attention / 2` tokens on either side of it.
//!
//! Its config comes in two spellings, both read: the hub's published configs
//! (`global_attn_every_n_layers`, `global_rope_theta`, `local_rope_theta`) and what
//! transformers 5.x `save_pretrained` writes (`layer_types`, `rope_parameters`), which
//! wins where both are present, as in transformers.
//!
//! Like `bert::Bert`, dense layers run on packed real tokens and share `Batch` for
//! attention; Q's 1/√d scale is folded into `Wqkv` (rotation is linear, so scaling before
//! it is the same as after).

use std::path::Path;

use candle_core::{Device, Tensor};
use candle_nn::VarBuilder;

use super::{
    act::Act,
    batch::Batch,
    layers::{GatedFeedForward, Linear, Norm, NormRef, PreNormAttention, Weight},
    rope::Rope,
    Packed, Routing,
};
use crate::{
    batcher::Row,
    config::ModernBertConfig,
    kernels::{Heads, Mask},
    ModelError,
};

/// Which layers are local, and the two rotary bases: everything in config.json that
/// shapes attention.
#[derive(Debug, Clone, PartialEq)]
struct AttentionLayout {
    local: Vec<bool>,
    global_theta: f64,
    local_theta: f64,
    /// Tokens on either side a local layer sees: `local_attention / 2`.
    window: usize,
}

impl AttentionLayout {
    fn of(config: &ModernBertConfig, path: &Path) -> Result<Self, ModelError> {
        let layers = config.num_hidden_layers;
        let unsupported = |reason: String| ModelError::Unsupported {
            path: path.to_owned(),
            reason,
        };
        let local = match &config.layer_types {
            Some(types) => {
                let local = types
                    .iter()
                    .map(|t| match t.as_str() {
                        "sliding_attention" => Ok(true),
                        "full_attention" => Ok(false),
                        other => Err(unsupported(format!("layer type {other:?}"))),
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                if local.len() != layers {
                    return Err(unsupported(format!(
                        "{} layer_types for {layers} layers",
                        local.len()
                    )));
                }
                local
            }
            None => {
                let every = config.global_attn_every_n_layers.max(1);
                (0..layers).map(|i| i % every != 0).collect()
            }
        };
        let rope = &config.rope_parameters;
        for kind in ["full_attention", "sliding_attention"] {
            match rope[kind]["rope_type"].as_str() {
                None | Some("default") => {}
                Some(other) => {
                    return Err(unsupported(format!(
                        "rope_type {other:?} for {kind}; gpulane runs \"default\" rotary embeddings"
                    )))
                }
            }
        }
        if !config.rope_scaling.is_null() {
            return Err(unsupported(
                "rope_scaling is set; gpulane runs unscaled rotary embeddings".to_owned(),
            ));
        }
        let theta = |kind: &str, old: Option<f64>, default: f64| {
            rope[kind]["rope_theta"].as_f64().or(old).unwrap_or(default)
        };
        Ok(Self {
            local,
            global_theta: theta("full_attention", config.global_rope_theta, 160_000.0),
            local_theta: theta("sliding_attention", config.local_rope_theta, 10_000.0),
            window: config.local_attention / 2,
        })
    }
}

struct Layer {
    /// None for layer 0, whose input is the embedding norm's output already.
    attn_norm: Option<Norm>,
    /// `[H, 3H]`: Q (pre-scaled by 1/√d), K, V.
    qkv: Linear,
    attn_out: Linear,
    mlp_norm: Norm,
    /// `[H, 2I]`: the feed-forward input, then its gate.
    wi: Linear,
    wo: Linear,
    local: bool,
}

/// A loaded ModernBERT encoder. Blocking: call it from an engine thread.
pub(crate) struct ModernBert {
    word: Tensor,
    embed_norm: Norm,
    layers: Vec<Layer>,
    final_norm: Norm,
    heads: usize,
    eps: f32,
    act: Act,
    global: Rope,
    local: Rope,
    window: usize,
    device: Device,
    /// Which attention route batches take.
    pub(crate) routing: Routing,
}

impl ModernBert {
    /// Loads a ModernBERT checkpoint at `vb`: a bare `ModernBertModel`, or one under
    /// `model.` (`ModernBertForMaskedLM`, `ModernBertForSequenceClassification`).
    pub(crate) fn load(
        config: &ModernBertConfig,
        vb: VarBuilder,
        path: &Path,
    ) -> Result<Self, ModelError> {
        let (hidden, heads, vocab) = (
            config.hidden_size,
            config.num_attention_heads,
            config.vocab_size,
        );
        let (n_layers, inter) = (config.num_hidden_layers, config.intermediate_size);
        let positions = config.max_position_embeddings;
        let eps = config.norm_eps as f32;
        let (norm_bias, attn_bias, mlp_bias) =
            (config.norm_bias, config.attention_bias, config.mlp_bias);
        let d = hidden / heads;
        if d % 2 != 0 {
            return Err(ModelError::Unsupported {
                path: path.to_owned(),
                reason: format!("head size {d} is odd; rotary embeddings turn pairs of values"),
            });
        }
        let act = Act::parse(&config.hidden_activation, path)?;
        let layout = AttentionLayout::of(config, path)?;
        let vb = if vb.contains_tensor("model.embeddings.tok_embeddings.weight") {
            vb.pp("model")
        } else {
            vb
        };
        let device = vb.device().clone();
        let dtype = vb.dtype();
        // Q is the first H columns of Wqkv's [in, 3H]: scale them by 1/√d, keep K and V.
        let scale = 1.0 / (d as f32).sqrt();
        let col_scale: Vec<f32> = (0..3 * hidden)
            .map(|c| if c < hidden { scale } else { 1.0 })
            .collect();
        let col_scale = Tensor::from_vec(col_scale, 3 * hidden, &device)?.to_dtype(dtype)?;
        let mut layers = Vec::with_capacity(n_layers);
        for (i, &local) in layout.local.iter().enumerate() {
            let l = vb.pp(format!("layers.{i}"));
            let mut qkv = Linear::load(l.pp("attn.Wqkv"), hidden, 3 * hidden, attn_bias)?;
            qkv.w.scale_columns(&col_scale)?;
            qkv.b = qkv.b.map(|b| b * &col_scale).transpose()?;
            layers.push(Layer {
                attn_norm: if i == 0 {
                    None
                } else {
                    Some(Norm::load(l.pp("attn_norm"), hidden, norm_bias)?)
                },
                qkv,
                attn_out: Linear::load(l.pp("attn.Wo"), hidden, hidden, attn_bias)?,
                mlp_norm: Norm::load(l.pp("mlp_norm"), hidden, norm_bias)?,
                wi: Linear::load(l.pp("mlp.Wi"), hidden, 2 * inter, mlp_bias)?,
                wo: Linear::load(l.pp("mlp.Wo"), inter, hidden, mlp_bias)?,
                local,
            });
        }
        Ok(Self {
            word: vb.get((vocab, hidden), "embeddings.tok_embeddings.weight")?,
            embed_norm: Norm::load(vb.pp("embeddings.norm"), hidden, norm_bias)?,
            layers,
            final_norm: Norm::load(vb.pp("final_norm"), hidden, norm_bias)?,
            heads,
            eps,
            act,
            global: Rope::new(layout.global_theta, d, positions, &device)?,
            local: Rope::new(layout.local_theta, d, positions, &device)?,
            window: layout.window,
            device,
            routing: Routing::default(),
        })
    }

    /// Every dense layer's weight, for the steps that re-lay them all out (int8, the
    /// CPU's packed f32).
    pub(crate) fn dense_weights(&mut self) -> Vec<&mut Weight> {
        self.layers
            .iter_mut()
            .flat_map(|l| [&mut l.qkv.w, &mut l.attn_out.w, &mut l.wi.w, &mut l.wo.w])
            .collect()
    }

    /// Token vectors for `rows`, packed, after the final norm (what sentence-transformers
    /// pools).
    pub(crate) fn forward(&self, rows: &[&Row]) -> Result<Packed, ModelError> {
        let batch = Batch::new(
            rows,
            &self.device,
            self.word.dtype(),
            self.routing.pick(
                &self.device,
                self.word.dtype(),
                self.word.dim(1)? / self.heads,
            ),
        )?;
        let pos = batch.position_ids(0)?;
        let global = self.global.at(&pos)?;
        let local = self.local.at(&pos)?;
        let mut x = self
            .embed_norm
            .forward(&self.word.index_select(&batch.ids, 0)?, self.eps)?;
        for l in &self.layers {
            let heads = Heads::mha(x.dim(1)?, self.heads);
            let mask = if l.local {
                Mask::Window(self.window)
            } else {
                Mask::Full
            };
            let (cos, sin) = if l.local { &local } else { &global };
            x = PreNormAttention {
                norm: l.attn_norm.as_ref().map(NormRef::Layer),
                eps: self.eps,
                qkv: &l.qkv,
                qk_norm: None,
                out: &l.attn_out,
            }
            .forward(&x, &batch, heads, mask, (cos, sin))?;
            x = GatedFeedForward {
                norm: NormRef::Layer(&l.mlp_norm),
                eps: self.eps,
                up: &l.wi,
                act: self.act,
                down: &l.wo,
            }
            .forward(&x, self.routing.card_ops())?;
        }
        let x = self.final_norm.forward(&x, self.eps)?;
        Ok(batch.into_packed(x))
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{json, Value};

    use super::*;

    fn layout(extra: Value, layers: usize) -> Result<AttentionLayout, ModelError> {
        let mut config = json!({
            "hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": layers,
            "intermediate_size": 8, "vocab_size": 10
        });
        for (k, v) in extra.as_object().unwrap() {
            config[k] = v.clone();
        }
        let config: ModernBertConfig = serde_json::from_value(config).unwrap();
        AttentionLayout::of(&config, Path::new("m"))
    }

    /// A config with neither spelling gets transformers' defaults.
    #[test]
    fn defaults_are_transformers_defaults() {
        let l = layout(json!({}), 7).unwrap();
        assert_eq!(l.local, [false, true, true, false, true, true, false]);
        assert_eq!(
            (l.global_theta, l.local_theta, l.window),
            (160_000.0, 10_000.0, 64)
        );
    }

    /// transformers 5.x's `layer_types` and `rope_parameters` win over the hub spelling.
    #[test]
    fn saved_spelling_wins_over_hub_spelling() {
        let l = layout(
            json!({
                "global_attn_every_n_layers": 3,
                "global_rope_theta": 1.0,
                "local_rope_theta": 2.0,
                "local_attention": 16,
                "layer_types": ["full_attention", "full_attention", "sliding_attention"],
                "rope_parameters": {
                    "full_attention": {"rope_type": "default", "rope_theta": 50.0},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 60.0}
                }
            }),
            3,
        )
        .unwrap();
        assert_eq!(l.local, [false, false, true]);
        assert_eq!((l.global_theta, l.local_theta, l.window), (50.0, 60.0, 8));
    }

    #[test]
    fn scaled_rope_is_refused_by_name() {
        let err = layout(
            json!({"rope_parameters": {"full_attention": {"rope_type": "yarn"}}}),
            3,
        )
        .err()
        .unwrap();
        assert!(err.to_string().contains("yarn"), "{err}");
    }
}
