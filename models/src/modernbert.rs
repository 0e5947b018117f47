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
//! Like `encoder::Bert`, dense layers run on packed real tokens and share `Batch` for
//! attention; Q's 1/√d scale is folded into `Wqkv` (rotation is linear, so scaling before
//! it is the same as after).

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use serde_json::Value;

use crate::{
    backbone::Family,
    batcher::Row,
    encoder::{sizes, Act, Batch, Packed},
    ModelError,
};

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

/// A dense layer, weight transposed to `[in, out]` at load, bias optional.
struct Dense {
    w: Tensor,
    b: Option<Tensor>,
}

impl Dense {
    fn load(vb: VarBuilder, i: usize, o: usize, bias: bool) -> Result<Self, ModelError> {
        let w = vb.get((o, i), "weight")?.t()?.contiguous()?;
        let b = if bias { Some(vb.get(o, "bias")?) } else { None };
        Ok(Self { w, b })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor, ModelError> {
        let y = x.matmul(&self.w)?;
        Ok(match &self.b {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }
}

/// cos and sin of every position's rotation angles, `[positions, d/2]`, in f32: Q and K
/// are rotated in f32 whatever the model's dtype, as transformers does.
struct Rope {
    cos: Tensor,
    sin: Tensor,
}

impl Rope {
    /// The angles transformers computes: `inv_freq = 1 / theta^(2k/d)` and
    /// `angle = position · inv_freq`, both in f32 as there (at position 8000 an f64 angle
    /// would differ from the reference by ~1e-3 rad), then cos and sin of that f32 angle.
    fn new(theta: f64, d: usize, positions: usize, dev: &Device) -> Result<Self, ModelError> {
        let half = d / 2;
        let inv: Vec<f32> = (0..half)
            .map(|k| 1.0 / (theta as f32).powf((2 * k) as f32 / d as f32))
            .collect();
        let mut cos = Vec::with_capacity(positions * half);
        let mut sin = Vec::with_capacity(positions * half);
        for p in 0..positions {
            for &f in &inv {
                let angle = (p as f32 * f) as f64;
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        Ok(Self {
            cos: Tensor::from_vec(cos, (positions, half), dev)?,
            sin: Tensor::from_vec(sin, (positions, half), dev)?,
        })
    }

    /// Each packed token's cos and sin, `[N, 1, d/2]`: one "batch" per token, so candle's
    /// rotary kernel spreads tokens over threads and each gets its own position.
    fn at(&self, pos: &Tensor) -> Result<(Tensor, Tensor), ModelError> {
        let n = pos.dim(0)?;
        let half = self.cos.dim(1)?;
        Ok((
            self.cos.index_select(pos, 0)?.reshape((n, 1, half))?,
            self.sin.index_select(pos, 0)?.reshape((n, 1, half))?,
        ))
    }
}

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
    fn of(config: &Value, layers: usize, path: &Path) -> Result<Self, ModelError> {
        let unsupported = |reason: String| ModelError::Unsupported {
            path: path.to_owned(),
            reason,
        };
        let local = match config["layer_types"].as_array() {
            Some(types) => {
                let local = types
                    .iter()
                    .map(|t| match t.as_str() {
                        Some("sliding_attention") => Ok(true),
                        Some("full_attention") => Ok(false),
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
                let every = config["global_attn_every_n_layers"]
                    .as_u64()
                    .unwrap_or(3)
                    .max(1) as usize;
                (0..layers).map(|i| i % every != 0).collect()
            }
        };
        let rope = &config["rope_parameters"];
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
        if !config["rope_scaling"].is_null() {
            return Err(unsupported(
                "rope_scaling is set; gpulane runs unscaled rotary embeddings".to_owned(),
            ));
        }
        let theta = |new: &Value, old: &str, default: f64| {
            new.as_f64()
                .or_else(|| config[old].as_f64())
                .unwrap_or(default)
        };
        Ok(Self {
            local,
            global_theta: theta(
                &rope["full_attention"]["rope_theta"],
                "global_rope_theta",
                160_000.0,
            ),
            local_theta: theta(
                &rope["sliding_attention"]["rope_theta"],
                "local_rope_theta",
                10_000.0,
            ),
            window: config["local_attention"].as_u64().unwrap_or(128) as usize / 2,
        })
    }
}

struct Layer {
    /// None for layer 0, whose input is the embedding norm's output already.
    attn_norm: Option<Norm>,
    /// `[H, 3H]`: Q (pre-scaled by 1/√d), K, V.
    qkv: Dense,
    attn_out: Dense,
    mlp_norm: Norm,
    /// `[H, 2I]`: the feed-forward input, then its gate.
    wi: Dense,
    wo: Dense,
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
}

impl ModernBert {
    /// Loads a ModernBERT checkpoint at `vb`: a bare `ModernBertModel`, or one under
    /// `model.` (`ModernBertForMaskedLM`, `ModernBertForSequenceClassification`).
    pub(crate) fn load(config: &Value, vb: VarBuilder, path: &Path) -> Result<Self, ModelError> {
        let (hidden, heads, n_layers, inter, vocab) = sizes(config, path)?;
        let positions = Family::ModernBert.max_positions(config);
        let eps = config["norm_eps"].as_f64().unwrap_or(1e-5) as f32;
        let flag = |key: &str| config[key].as_bool().unwrap_or(false);
        let (norm_bias, attn_bias, mlp_bias) =
            (flag("norm_bias"), flag("attention_bias"), flag("mlp_bias"));
        let d = hidden / heads;
        if d % 2 != 0 {
            return Err(ModelError::Unsupported {
                path: path.to_owned(),
                reason: format!("head size {d} is odd; rotary embeddings turn pairs of values"),
            });
        }
        let act = Act::parse(config["hidden_activation"].as_str().unwrap_or("gelu"), path)?;
        let layout = AttentionLayout::of(config, n_layers, path)?;
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
            let mut qkv = Dense::load(l.pp("attn.Wqkv"), hidden, 3 * hidden, attn_bias)?;
            qkv.w = qkv.w.broadcast_mul(&col_scale)?;
            qkv.b = qkv.b.map(|b| b * &col_scale).transpose()?;
            layers.push(Layer {
                attn_norm: if i == 0 {
                    None
                } else {
                    Some(Norm::load(l.pp("attn_norm"), hidden, norm_bias)?)
                },
                qkv,
                attn_out: Dense::load(l.pp("attn.Wo"), hidden, hidden, attn_bias)?,
                mlp_norm: Norm::load(l.pp("mlp_norm"), hidden, norm_bias)?,
                wi: Dense::load(l.pp("mlp.Wi"), hidden, 2 * inter, mlp_bias)?,
                wo: Dense::load(l.pp("mlp.Wo"), inter, hidden, mlp_bias)?,
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
        })
    }

    /// Token vectors for `rows`, packed, after the final norm (what sentence-transformers
    /// pools).
    pub(crate) fn forward(&self, rows: &[&Row]) -> Result<Packed, ModelError> {
        let batch = Batch::new(rows, &self.device, self.word.dtype())?;
        let pos = batch.position_ids(0)?;
        let global = self.global.at(&pos)?;
        let local = self.local.at(&pos)?;
        let mut x = self
            .embed_norm
            .forward(&self.word.index_select(&batch.ids, 0)?, self.eps)?;
        for l in &self.layers {
            let normed = match &l.attn_norm {
                Some(norm) => norm.forward(&x, self.eps)?,
                None => x.clone(),
            };
            let (cos, sin) = if l.local { &local } else { &global };
            let qkv = rotate(&l.qkv.forward(&normed)?, cos, sin, self.heads)?;
            let ctx = batch.attend(&qkv, self.heads, l.local.then_some(self.window))?;
            x = (x + l.attn_out.forward(&ctx)?)?;
            let up = l.wi.forward(&l.mlp_norm.forward(&x, self.eps)?)?;
            x = (x + l.wo.forward(&self.act.gated(&up)?)?)?;
        }
        let x = self.final_norm.forward(&x, self.eps)?;
        Ok(batch.into_packed(x))
    }
}

/// Rotates Q and K of packed `qkv` (`[N, 3H]`) by each token's angles (`[N, 1, d/2]`,
/// f32), rotate-half style as transformers' `apply_rotary_pos_emb`, in f32 and rounded
/// back to `qkv`'s dtype once, as there; V passes through.
fn rotate(qkv: &Tensor, cos: &Tensor, sin: &Tensor, heads: usize) -> Result<Tensor, ModelError> {
    let (n, h3) = qkv.dims2()?;
    let h = h3 / 3;
    let qk = qkv
        .narrow(1, 0, 2 * h)?
        .to_dtype(DType::F32)?
        .contiguous()?
        .reshape((n, 1, 2 * heads, h / heads))?;
    let qk = candle_nn::rotary_emb::rope_thd(&qk, cos, sin)?
        .reshape((n, 2 * h))?
        .to_dtype(qkv.dtype())?;
    Ok(Tensor::cat(&[qk, qkv.narrow(1, 2 * h, h)?], 1)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(config: Value, layers: usize) -> AttentionLayout {
        AttentionLayout::of(&config, layers, Path::new("m")).unwrap()
    }

    /// A config with neither spelling gets transformers' defaults.
    #[test]
    fn defaults_are_transformers_defaults() {
        let l = layout(serde_json::json!({}), 7);
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
            serde_json::json!({
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
        );
        assert_eq!(l.local, [false, false, true]);
        assert_eq!((l.global_theta, l.local_theta, l.window), (50.0, 60.0, 8));
    }

    #[test]
    fn scaled_rope_is_refused_by_name() {
        let err = AttentionLayout::of(
            &serde_json::json!({"rope_parameters": {"full_attention": {"rope_type": "yarn"}}}),
            3,
            Path::new("m"),
        )
        .unwrap_err();
        assert!(err.to_string().contains("yarn"), "{err}");
    }

    /// The rotation is transformers' rotate-half: (x1, x2) → (x1·cos − x2·sin,
    /// x2·cos + x1·sin) per head, on Q and K only.
    #[test]
    fn rotate_turns_q_and_k_halves_and_keeps_v() {
        let (heads, d) = (2, 4);
        let h = heads * d;
        let qkv: Vec<f32> = (0..3 * h).map(|i| i as f32 + 1.0).collect();
        let qkv = Tensor::from_vec(qkv.clone(), (1, 3 * h), &Device::Cpu).unwrap();
        let (c, s) = (0.6f32, 0.8f32);
        let cos = Tensor::new(&[[[c, c]]], &Device::Cpu).unwrap();
        let sin = Tensor::new(&[[[s, s]]], &Device::Cpu).unwrap();
        let got: Vec<f32> = rotate(&qkv, &cos, &sin, heads)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let x: Vec<f32> = qkv.flatten_all().unwrap().to_vec1().unwrap();
        for head in 0..2 * heads {
            let b = head * d;
            for k in 0..d / 2 {
                let (x1, x2) = (x[b + k], x[b + k + d / 2]);
                assert!((got[b + k] - (x1 * c - x2 * s)).abs() < 1e-5);
                assert!((got[b + k + d / 2] - (x2 * c + x1 * s)).abs() < 1e-5);
            }
        }
        assert_eq!(&got[2 * h..], &x[2 * h..]);
    }
}
