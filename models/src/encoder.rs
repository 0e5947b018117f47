//! gpulane's own encoder forward passes, over *packed* rows: the tokens of every row of a
//! batch concatenated, with no padding. BERT and XLM-RoBERTa share the one here;
//! ModernBERT's is in `modernbert` and shares [`Batch`] (layout and attention).
//!
//! Why not candle-transformers' `BertModel`: it pads every row to the batch's longest and
//! runs every dense layer over the padding too (17% of the tokens of a short-sentence
//! corpus even after length sorting), and its element-wise steps were slow on the CPU
//! (see `kernels`). Here the dense layers (three quarters of the FLOPs) see only real
//! tokens; attention alone pads, per batch, gathering rows into `[B, heads, T, d]` and
//! back. Weights are laid out once at load for the fused steps: Q, K and V as one matrix
//! with the 1/√d scale folded into Q, every matrix transposed to `[in, out]`, and each
//! bias + LayerNorm triple as one `[3, H]` tensor.

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use serde_json::Value;

use crate::{backbone::Family, batcher::Row, kernels, modernbert::ModernBert, ModelError, Pooling};

/// Which activation the feed-forward layer uses (config.json `hidden_act`, ModernBERT's
/// `hidden_activation`).
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
    /// gate]`: the fused kernel for GELU, candle ops otherwise.
    pub(crate) fn gated(self, up: &Tensor) -> candle_core::Result<Tensor> {
        if self == Act::Gelu {
            return kernels::gated_gelu(up);
        }
        let i = up.dim(1)? / 2;
        self.apply(&up.narrow(1, 0, i)?)? * up.narrow(1, i, i)?
    }

    /// `act(x + bias)`: the fused kernel for GELU, candle ops otherwise.
    pub(crate) fn with_bias(self, x: &Tensor, bias: &Tensor) -> candle_core::Result<Tensor> {
        if self == Act::Gelu {
            return kernels::bias_gelu(x, bias);
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

struct Layer {
    /// `[H, 3H]`: Q (pre-scaled by 1/√d), K, V.
    qkv: Tensor,
    /// `[3H]`.
    qkv_bias: Tensor,
    /// `[H, H]`.
    attn_out: Tensor,
    /// `[3, H]`: attention output bias, LayerNorm gamma, beta.
    attn_norm: Tensor,
    /// `[H, I]` and `[I]`.
    inter: Tensor,
    inter_bias: Tensor,
    /// `[I, H]`.
    out: Tensor,
    /// `[3, H]`: output bias, LayerNorm gamma, beta.
    out_norm: Tensor,
}

/// How positions are numbered.
#[derive(Debug, Clone, Copy)]
enum Positions {
    /// BERT: 0, 1, 2, ...
    FromZero,
    /// RoBERTa: `padding_idx + 1`, ... (its position table reserves the first rows).
    AfterPadding(u32),
}

/// A loaded encoder of any family gpulane runs. Blocking: call it from an engine thread.
pub(crate) enum Encoder {
    Bert(Bert),
    ModernBert(ModernBert),
}

impl Encoder {
    /// Loads the encoder of the checkpoint at `vb`, by config.json's `model_type`.
    pub(crate) fn load(
        config: &Value,
        vb: VarBuilder,
        path: &std::path::Path,
    ) -> Result<Self, ModelError> {
        match Family::of(config["model_type"].as_str().unwrap_or("bert")) {
            Some(Family::ModernBert) => {
                Ok(Encoder::ModernBert(ModernBert::load(config, vb, path)?))
            }
            _ => Ok(Encoder::Bert(Bert::load(config, vb, path)?)),
        }
    }

    /// Token vectors for `rows`, packed (see the module doc).
    pub(crate) fn forward(&self, rows: &[&Row]) -> Result<Packed, ModelError> {
        match self {
            Encoder::Bert(m) => m.forward(rows),
            Encoder::ModernBert(m) => m.forward(rows),
        }
    }
}

/// BERT and XLM-RoBERTa: learned absolute positions, post-norm layers.
pub(crate) struct Bert {
    word: Tensor,
    position: Tensor,
    token_type: Tensor,
    embed_gamma: Tensor,
    embed_beta: Tensor,
    layers: Vec<Layer>,
    heads: usize,
    eps: f32,
    act: Act,
    positions: Positions,
    /// Models with one token type (XLM-R) ignore the tokenizer's pair type ids.
    single_type: bool,
    device: Device,
}

/// Token vectors of a packed batch: `[N, H]` for N real tokens, with each row's start.
pub(crate) struct Packed {
    pub(crate) hidden: Tensor,
    pub(crate) starts: Vec<usize>,
    pub(crate) lens: Vec<usize>,
}

fn num(config: &Value, key: &str, path: &std::path::Path) -> Result<usize, ModelError> {
    config[key]
        .as_u64()
        .map(|v| v as usize)
        .ok_or_else(|| ModelError::Unsupported {
            path: path.to_owned(),
            reason: format!("config.json has no {key}"),
        })
}

/// The sizes every encoder family's config.json states, in its common spelling:
/// `(hidden_size, num_attention_heads, num_hidden_layers, intermediate_size,
/// vocab_size)`, with the hidden size a whole number of heads.
pub(crate) fn sizes(
    config: &Value,
    path: &std::path::Path,
) -> Result<(usize, usize, usize, usize, usize), ModelError> {
    let hidden = num(config, "hidden_size", path)?;
    let heads = num(config, "num_attention_heads", path)?;
    if heads == 0 || hidden % heads != 0 {
        return Err(ModelError::Unsupported {
            path: path.to_owned(),
            reason: format!(
                "hidden_size {hidden} is not a multiple of num_attention_heads {heads}"
            ),
        });
    }
    Ok((
        hidden,
        heads,
        num(config, "num_hidden_layers", path)?,
        num(config, "intermediate_size", path)?,
        num(config, "vocab_size", path)?,
    ))
}

/// The tensor name prefix of the encoder inside the checkpoint: none for
/// sentence-transformers exports, `bert.` / `roberta.` inside classification models.
fn prefix(vb: &VarBuilder, model_type: &str) -> String {
    let bare = "embeddings.word_embeddings.weight";
    for p in ["", "bert", "roberta", model_type] {
        let name = if p.is_empty() {
            bare.to_owned()
        } else {
            format!("{p}.{bare}")
        };
        if vb.contains_tensor(&name) {
            return p.to_owned();
        }
    }
    String::new()
}

impl Bert {
    /// Loads the encoder of a BERT or RoBERTa-family checkpoint. `vb` is at the
    /// checkpoint's root; the encoder's own prefix is found by looking.
    pub(crate) fn load(
        config: &Value,
        vb: VarBuilder,
        path: &std::path::Path,
    ) -> Result<Self, ModelError> {
        let unsupported = |reason: String| ModelError::Unsupported {
            path: path.to_owned(),
            reason,
        };
        let model_type = config["model_type"].as_str().unwrap_or("bert");
        let (hidden, heads, layers, inter, vocab) = sizes(config, path)?;
        let max_pos = num(config, "max_position_embeddings", path)?;
        let types = config["type_vocab_size"].as_u64().unwrap_or(2) as usize;
        let eps = config["layer_norm_eps"].as_f64().unwrap_or(1e-12) as f32;
        match config["position_embedding_type"].as_str() {
            None | Some("absolute") => {}
            Some(other) => {
                return Err(unsupported(format!(
                    "position_embedding_type {other:?}; gpulane runs \"absolute\""
                )))
            }
        }
        let act = Act::parse(config["hidden_act"].as_str().unwrap_or("gelu"), path)?;
        let positions = match model_type {
            "xlm-roberta" | "roberta" => {
                Positions::AfterPadding(config["pad_token_id"].as_u64().unwrap_or(1) as u32)
            }
            _ => Positions::FromZero,
        };
        let p = prefix(&vb, model_type);
        let vb = if p.is_empty() { vb } else { vb.pp(p) };
        let device = vb.device().clone();
        let emb = vb.pp("embeddings");
        // [out, in] in the checkpoint; [in, out] contiguous for `x.matmul(w)`.
        let dense = |vb: &VarBuilder, i: usize, o: usize| -> Result<(Tensor, Tensor), ModelError> {
            let w = vb.get((o, i), "weight")?.t()?.contiguous()?;
            Ok((w, vb.get(o, "bias")?))
        };
        let norm_params = |bias: Tensor, vb: &VarBuilder| -> Result<Tensor, ModelError> {
            Ok(Tensor::stack(
                &[bias, vb.get(hidden, "weight")?, vb.get(hidden, "bias")?],
                0,
            )?)
        };
        let scale = 1.0 / ((hidden / heads) as f64).sqrt();
        let mut loaded = Vec::with_capacity(layers);
        for i in 0..layers {
            let l = vb.pp(format!("encoder.layer.{i}"));
            let a = l.pp("attention");
            let (wq, bq) = dense(&a.pp("self.query"), hidden, hidden)?;
            let (wk, bk) = dense(&a.pp("self.key"), hidden, hidden)?;
            let (wv, bv) = dense(&a.pp("self.value"), hidden, hidden)?;
            let (wq, bq) = ((wq * scale)?, (bq * scale)?);
            let (attn_out, bo) = dense(&a.pp("output.dense"), hidden, hidden)?;
            let (inter_w, inter_b) = dense(&l.pp("intermediate.dense"), hidden, inter)?;
            let (out_w, out_b) = dense(&l.pp("output.dense"), inter, hidden)?;
            loaded.push(Layer {
                qkv: Tensor::cat(&[wq, wk, wv], 1)?.contiguous()?,
                qkv_bias: Tensor::cat(&[bq, bk, bv], 0)?,
                attn_out,
                attn_norm: norm_params(bo, &a.pp("output.LayerNorm"))?,
                inter: inter_w,
                inter_bias: inter_b,
                out: out_w,
                out_norm: norm_params(out_b, &l.pp("output.LayerNorm"))?,
            });
        }
        Ok(Self {
            word: emb.get((vocab, hidden), "word_embeddings.weight")?,
            position: emb.get((max_pos, hidden), "position_embeddings.weight")?,
            token_type: emb.get((types, hidden), "token_type_embeddings.weight")?,
            embed_gamma: emb.get(hidden, "LayerNorm.weight")?,
            embed_beta: emb.get(hidden, "LayerNorm.bias")?,
            layers: loaded,
            heads,
            eps,
            act,
            positions,
            single_type: types == 1,
            device,
        })
    }

    /// Token vectors for `rows`, packed (see the module doc).
    pub(crate) fn forward(&self, rows: &[&Row]) -> Result<Packed, ModelError> {
        let batch = Batch::new(rows, &self.device, self.word.dtype())?;
        let first_position = match self.positions {
            Positions::FromZero => 0,
            Positions::AfterPadding(pad) => pad + 1,
        };
        let mut types: Vec<u32> = Vec::with_capacity(batch.tokens());
        for r in rows {
            if self.single_type {
                types.extend(std::iter::repeat_n(0u32, r.len()));
            } else {
                types.extend_from_slice(&r.types);
            }
        }
        let types = Tensor::from_vec(types, batch.tokens(), &self.device)?;
        let pos = batch.position_ids(first_position)?;

        let x = ((self.word.index_select(&batch.ids, 0)?
            + self.position.index_select(&pos, 0)?)?
            + self.token_type.index_select(&types, 0)?)?;
        let mut x = candle_nn::ops::layer_norm(&x, &self.embed_gamma, &self.embed_beta, self.eps)?;
        for l in &self.layers {
            let qkv = x.matmul(&l.qkv)?.broadcast_add(&l.qkv_bias)?;
            let ctx = batch.attend(&qkv, self.heads, None)?;
            let attn = ctx.matmul(&l.attn_out)?;
            x = kernels::add_norm(&attn, &x, &l.attn_norm, self.eps)?;
            let up = self.act.with_bias(&x.matmul(&l.inter)?, &l.inter_bias)?;
            let down = up.matmul(&l.out)?;
            x = kernels::add_norm(&down, &x, &l.out_norm, self.eps)?;
        }
        Ok(batch.into_packed(x))
    }
}

/// One batch's rows laid out for a forward pass: packed token ids, each token's position
/// in its row, each row's start and length, and, off the fused CPU path, what the padded
/// attention path needs.
pub(crate) struct Batch {
    /// `[N]` token ids of every row, concatenated.
    pub(crate) ids: Tensor,
    /// Each packed token's position within its row, from 0.
    positions: Vec<u32>,
    starts: Vec<usize>,
    lens: Vec<usize>,
    pad: Option<Padding>,
}

/// Off the fused CPU path, attention gathers padded `[B, T]` from packed rows and
/// scatters back; padded slots read a real row (the row's last) and are masked out of
/// the softmax.
struct Padding {
    b: usize,
    t: usize,
    gather: Tensor,
    scatter: Tensor,
    /// `[B, 1, 1, T]` in the model's dtype: 0 for real keys, −∞ for padding.
    mask: Tensor,
    /// For local layers, `mask` plus the `[T, T]` sliding-window band, `[B, 1, T, T]`,
    /// with its window: built by the first local layer of a batch, reused by the others
    /// (every local layer of a model has the same window; another window builds its own).
    banded: std::cell::OnceCell<(usize, Tensor)>,
}

impl Batch {
    /// Lays out `rows` for a model on `device` in `dtype`: only the CPU in f32 has the
    /// fused packed attention kernel; everything else takes the padded path.
    pub(crate) fn new(rows: &[&Row], device: &Device, dtype: DType) -> Result<Self, ModelError> {
        let lens: Vec<usize> = rows.iter().map(|r| r.len()).collect();
        let n: usize = lens.iter().sum();
        let (b, t) = (rows.len(), lens.iter().copied().max().unwrap_or(0));
        let padded = !kernels::packed_attention_runs(device, dtype);
        let mut starts = Vec::with_capacity(b);
        let mut ids: Vec<u32> = Vec::with_capacity(n);
        let mut positions: Vec<u32> = Vec::with_capacity(n);
        let (mut gather, mut scatter, mut mask) = (Vec::new(), Vec::new(), Vec::new());
        for (i, r) in rows.iter().enumerate() {
            let start = ids.len();
            starts.push(start);
            ids.extend_from_slice(&r.ids);
            positions.extend(0..r.len() as u32);
            if padded {
                for k in 0..t {
                    gather.push((start + k.min(r.len().saturating_sub(1))) as u32);
                    mask.push(if k < r.len() { 0f32 } else { f32::NEG_INFINITY });
                }
                scatter.extend((0..r.len()).map(|k| (i * t + k) as u32));
            }
        }
        let pad = if padded {
            Some(Padding {
                b,
                t,
                gather: Tensor::from_vec(gather, b * t, device)?,
                scatter: Tensor::from_vec(scatter, n, device)?,
                mask: Tensor::from_vec(mask, (b, 1, 1, t), device)?.to_dtype(dtype)?,
                banded: Default::default(),
            })
        } else {
            None
        };
        Ok(Self {
            ids: Tensor::from_vec(ids, n, device)?,
            positions,
            starts,
            lens,
            pad,
        })
    }

    /// Real tokens in the batch.
    pub(crate) fn tokens(&self) -> usize {
        self.positions.len()
    }

    /// `[N]` each packed token's position id: its place in its row plus `first`.
    pub(crate) fn position_ids(&self, first: u32) -> Result<Tensor, ModelError> {
        let pos: Vec<u32> = self.positions.iter().map(|p| first + p).collect();
        Ok(Tensor::from_vec(pos, self.tokens(), self.ids.device())?)
    }

    /// Self-attention of packed `qkv` (`[N, 3H]`, Q pre-scaled by 1/√d) to its context
    /// `[N, H]`; with a `window` w a token sees only tokens within w positions of it.
    pub(crate) fn attend(
        &self,
        qkv: &Tensor,
        heads: usize,
        window: Option<usize>,
    ) -> Result<Tensor, ModelError> {
        let Some(p) = &self.pad else {
            return Ok(kernels::attention(
                qkv,
                &self.starts,
                &self.lens,
                heads,
                window,
            )?);
        };
        let h = qkv.dim(1)? / 3;
        let (b, t, d) = (p.b, p.t, h / heads);
        // [B*T, 3H] → [3, B, heads, T, d], one copy for Q, K and V together.
        let qkv = qkv
            .index_select(&p.gather, 0)?
            .reshape((b, t, 3, heads, d))?
            .permute((2, 0, 3, 1, 4))?
            .contiguous()?;
        let (q, k, v) = (qkv.get(0)?, qkv.get(1)?, qkv.get(2)?);
        let scores = q.matmul(&k.t()?)?;
        let bias = match window {
            None => p.mask.clone(),
            Some(w) => match p.banded.get() {
                Some((cached, banded)) if *cached == w => banded.clone(),
                _ => {
                    let band = kernels::band(t, w, scores.dtype(), scores.device())?;
                    let banded = p.mask.broadcast_add(&band)?;
                    let _ = p.banded.set((w, banded.clone()));
                    banded
                }
            },
        };
        let probs = kernels::masked_softmax(scores, &bias)?;
        Ok(probs
            .matmul(&v)?
            .transpose(1, 2)?
            .contiguous()?
            .reshape((b * t, h))?
            .index_select(&p.scatter, 0)?)
    }

    /// The batch's final token vectors `hidden` (`[N, H]`), with the rows they belong to.
    pub(crate) fn into_packed(self, hidden: Tensor) -> Packed {
        Packed {
            hidden,
            starts: self.starts,
            lens: self.lens,
        }
    }
}

impl Packed {
    /// The first token's vector of each row (`[CLS]` / `<s>`), `[B, H]`.
    pub(crate) fn first_tokens(&self) -> Result<Tensor, ModelError> {
        let idx: Vec<u32> = self.starts.iter().map(|&s| s as u32).collect();
        let n = idx.len();
        let idx = Tensor::from_vec(idx, n, self.hidden.device())?;
        Ok(self.hidden.index_select(&idx, 0)?)
    }

    /// One vector per row under `pooling`, `[B, H]` in f32.
    pub(crate) fn pool(&self, pooling: Pooling) -> Result<Tensor, ModelError> {
        // CLS converts only the rows it keeps; the others read every token.
        let hidden = || self.hidden.to_dtype(DType::F32);
        Ok(match pooling {
            Pooling::Cls => self.first_tokens()?.to_dtype(DType::F32)?,
            Pooling::Mean | Pooling::MeanSqrtLen => {
                let hidden = hidden()?;
                // A [B, N] weight matrix: one matmul averages every row's own tokens.
                let (b, n) = (self.lens.len(), hidden.dim(0)?);
                let mut w = vec![0f32; b * n];
                for (i, (&s, &len)) in self.starts.iter().zip(&self.lens).enumerate() {
                    // sentence-transformers clamps the count at 1e-9; rows are never empty.
                    let count = (len as f32).max(1e-9);
                    let weight = if pooling == Pooling::Mean {
                        1.0 / count
                    } else {
                        1.0 / count.sqrt()
                    };
                    w[i * n + s..i * n + s + len].fill(weight);
                }
                Tensor::from_vec(w, (b, n), hidden.device())?.matmul(&hidden)?
            }
            Pooling::Max => {
                let hidden = hidden()?;
                let rows = self
                    .starts
                    .iter()
                    .zip(&self.lens)
                    .map(|(&s, &len)| hidden.narrow(0, s, len)?.max(0))
                    .collect::<Result<Vec<_>, _>>()?;
                Tensor::stack(&rows, 0)?
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two packed rows: three tokens, then two.
    fn packed() -> Packed {
        let hidden = Tensor::new(
            &[[1f32, 2.], [3., 4.], [5., 6.], [1., -1.], [3., 1.]],
            &Device::Cpu,
        )
        .unwrap();
        Packed {
            hidden,
            starts: vec![0, 3],
            lens: vec![3, 2],
        }
    }

    fn pool(p: Pooling) -> Vec<Vec<f32>> {
        packed().pool(p).unwrap().to_vec2().unwrap()
    }

    #[test]
    fn mean_averages_each_rows_own_tokens() {
        assert_eq!(pool(Pooling::Mean), vec![vec![3., 4.], vec![2., 0.]]);
    }

    #[test]
    fn cls_takes_each_rows_first_token() {
        assert_eq!(pool(Pooling::Cls), vec![vec![1., 2.], vec![1., -1.]]);
    }

    #[test]
    fn max_stays_within_each_row() {
        assert_eq!(pool(Pooling::Max), vec![vec![5., 6.], vec![3., 1.]]);
    }

    #[test]
    fn mean_sqrt_len_divides_by_root_count() {
        let out = pool(Pooling::MeanSqrtLen);
        assert!((out[1][0] - 4. / 2f32.sqrt()).abs() < 1e-6 && out[1][1].abs() < 1e-6);
        assert!((out[0][0] - 9. / 3f32.sqrt()).abs() < 1e-5);
    }
}
