//! The post-norm encoders with learned absolute positions: BERT, XLM-RoBERTa / RoBERTa,
//! DistilBERT and MPNet. Their layers are the same computation under different weight
//! names; they differ in where positions start, whether token types exist, and MPNet's
//! relative position bias (see `mpnet`).

use candle_core::{Device, Tensor};
use candle_nn::VarBuilder;

use super::{
    act::Act,
    batch::Batch,
    layers::{AttentionBlock, FeedForward, Weight},
    mpnet::RelativeTable,
    Packed, Routing,
};
use crate::{
    batcher::Row,
    config::{Arch, ModelConfig},
    kernels::{Heads, Mask},
    ModelError,
};

/// Where each family keeps a layer's weights, relative to the layer's prefix.
struct Names {
    /// The layers' common prefix, before the layer index.
    layers: &'static str,
    q: &'static str,
    k: &'static str,
    v: &'static str,
    o: &'static str,
    attn_norm: &'static str,
    up: &'static str,
    down: &'static str,
    out_norm: &'static str,
}

const BERT: Names = Names {
    layers: "encoder.layer",
    q: "attention.self.query",
    k: "attention.self.key",
    v: "attention.self.value",
    o: "attention.output.dense",
    attn_norm: "attention.output.LayerNorm",
    up: "intermediate.dense",
    down: "output.dense",
    out_norm: "output.LayerNorm",
};

const DISTILBERT: Names = Names {
    layers: "transformer.layer",
    q: "attention.q_lin",
    k: "attention.k_lin",
    v: "attention.v_lin",
    o: "attention.out_lin",
    attn_norm: "sa_layer_norm",
    up: "ffn.lin1",
    down: "ffn.lin2",
    out_norm: "output_layer_norm",
};

const MPNET: Names = Names {
    layers: "encoder.layer",
    q: "attention.attn.q",
    k: "attention.attn.k",
    v: "attention.attn.v",
    o: "attention.attn.o",
    attn_norm: "attention.LayerNorm",
    up: "intermediate.dense",
    down: "output.dense",
    out_norm: "output.LayerNorm",
};

struct Layer {
    /// `[H, 3H]`: Q (pre-scaled by 1/√d), K, V.
    qkv: Weight,
    /// `[3H]`.
    qkv_bias: Tensor,
    /// `[H, H]`.
    attn_out: Weight,
    /// `[3, H]`: attention output bias, LayerNorm gamma, beta.
    attn_norm: Tensor,
    /// `[H, I]` and `[I]`.
    inter: Weight,
    inter_bias: Tensor,
    /// `[I, H]`.
    out: Weight,
    /// `[3, H]`: output bias, LayerNorm gamma, beta.
    out_norm: Tensor,
}

/// How positions are numbered.
#[derive(Debug, Clone, Copy)]
enum Positions {
    /// BERT, DistilBERT: 0, 1, 2, ...
    FromZero,
    /// RoBERTa, MPNet: `padding_idx + 1`, ... (the position table reserves the first rows).
    AfterPadding(u32),
}

/// What the families' configs say, in one spelling.
struct Spec<'a> {
    hidden: usize,
    heads: usize,
    layers: usize,
    inter: usize,
    vocab: usize,
    max_pos: usize,
    /// Token types, if the family has them.
    types: Option<usize>,
    eps: f64,
    act: &'a str,
    positions: Positions,
    names: &'static Names,
    /// MPNet's relative position buckets.
    buckets: Option<usize>,
}

impl<'a> Spec<'a> {
    fn of(config: &'a ModelConfig) -> Self {
        match &config.arch {
            Arch::Bert(c) | Arch::XlmRoberta(c) => Spec {
                hidden: c.hidden_size,
                heads: c.num_attention_heads,
                layers: c.num_hidden_layers,
                inter: c.intermediate_size,
                vocab: c.vocab_size,
                max_pos: c.max_position_embeddings,
                types: Some(c.type_vocab_size),
                eps: c.layer_norm_eps,
                act: &c.hidden_act,
                positions: match config.arch {
                    Arch::XlmRoberta(_) => Positions::AfterPadding(c.pad_token_id),
                    _ => Positions::FromZero,
                },
                names: &BERT,
                buckets: None,
            },
            Arch::DistilBert(c) => Spec {
                hidden: c.dim,
                heads: c.n_heads,
                layers: c.n_layers,
                inter: c.hidden_dim,
                vocab: c.vocab_size,
                max_pos: c.max_position_embeddings,
                types: None,
                // DistilBERT's LayerNorms are built with eps 1e-12 and its config has no
                // field for it.
                eps: 1e-12,
                act: &c.activation,
                positions: Positions::FromZero,
                names: &DISTILBERT,
                buckets: None,
            },
            Arch::MpNet(c) => Spec {
                hidden: c.hidden_size,
                heads: c.num_attention_heads,
                layers: c.num_hidden_layers,
                inter: c.intermediate_size,
                vocab: c.vocab_size,
                max_pos: c.max_position_embeddings,
                types: None,
                eps: c.layer_norm_eps,
                act: &c.hidden_act,
                positions: Positions::AfterPadding(c.pad_token_id),
                names: &MPNET,
                buckets: Some(c.relative_attention_num_buckets),
            },
            Arch::ModernBert(_) | Arch::Qwen3(_) => {
                unreachable!("Encoder::load sends only post-norm encoders here")
            }
        }
    }
}

/// A post-norm encoder (see the module doc).
pub(crate) struct Bert {
    word: Tensor,
    position: Tensor,
    /// None for families without token types.
    token_type: Option<Tensor>,
    embed_gamma: Tensor,
    embed_beta: Tensor,
    layers: Vec<Layer>,
    heads: usize,
    eps: f32,
    act: Act,
    positions: Positions,
    /// Models with one token type (XLM-R) ignore the tokenizer's pair type ids.
    single_type: bool,
    relative: Option<RelativeTable>,
    device: Device,
    /// Which attention route batches take.
    pub(crate) routing: Routing,
}

/// The tensor name prefix of the encoder inside the checkpoint: none for
/// sentence-transformers exports, the family's name inside task models (`bert.`,
/// `roberta.`, `distilbert.`, `mpnet.`).
fn prefix(vb: &VarBuilder) -> Option<&'static str> {
    let bare = "embeddings.word_embeddings.weight";
    ["", "bert", "roberta", "distilbert", "mpnet"]
        .into_iter()
        .find(|p| {
            let name = if p.is_empty() {
                bare.to_owned()
            } else {
                format!("{p}.{bare}")
            };
            vb.contains_tensor(&name)
        })
}

impl Bert {
    /// Loads the encoder of a post-norm checkpoint. `vb` is at the checkpoint's root; the
    /// encoder's own prefix is found by looking.
    pub(crate) fn load(
        config: &ModelConfig,
        vb: VarBuilder,
        path: &std::path::Path,
    ) -> Result<Self, ModelError> {
        let s = Spec::of(config);
        if let Arch::Bert(c) | Arch::XlmRoberta(c) = &config.arch {
            match c.position_embedding_type.as_deref() {
                None | Some("absolute") => {}
                Some(other) => {
                    return Err(ModelError::Unsupported {
                        path: path.to_owned(),
                        reason: format!(
                            "position_embedding_type {other:?}; gpulane runs \"absolute\""
                        ),
                    })
                }
            }
        }
        let act = Act::parse(s.act, path)?;
        let vb = match prefix(&vb) {
            Some("") => vb,
            Some(p) => vb.pp(p),
            None => {
                return Err(ModelError::Unsupported {
                    path: path.to_owned(),
                    reason: "the weights have no embeddings.word_embeddings.weight (bare, or under bert., roberta., distilbert. or mpnet.)".to_owned(),
                })
            }
        };
        let device = vb.device().clone();
        let emb = vb.pp("embeddings");
        let (hidden, heads) = (s.hidden, s.heads);
        // [out, in] in the checkpoint; [in, out] contiguous for `x.matmul(w)`.
        let dense = |vb: &VarBuilder, i: usize, o: usize| -> Result<(Tensor, Tensor), ModelError> {
            let w = vb.get((o, i), "weight")?.t()?.contiguous()?;
            Ok((w, vb.get(o, "bias")?))
        };
        let weight =
            |vb: &VarBuilder, i: usize, o: usize| -> Result<(Weight, Tensor), ModelError> {
                Ok((Weight::load(vb, i, o)?, vb.get(o, "bias")?))
            };
        let norm_params = |bias: Tensor, vb: &VarBuilder| -> Result<Tensor, ModelError> {
            Ok(Tensor::stack(
                &[bias, vb.get(hidden, "weight")?, vb.get(hidden, "bias")?],
                0,
            )?)
        };
        let n = s.names;
        let scale = 1.0 / ((hidden / heads) as f64).sqrt();
        let mut loaded = Vec::with_capacity(s.layers);
        for i in 0..s.layers {
            let l = vb.pp(format!("{}.{i}", n.layers));
            let (wq, bq) = dense(&l.pp(n.q), hidden, hidden)?;
            let (wk, bk) = dense(&l.pp(n.k), hidden, hidden)?;
            let (wv, bv) = dense(&l.pp(n.v), hidden, hidden)?;
            let (wq, bq) = ((wq * scale)?, (bq * scale)?);
            let (attn_out, bo) = weight(&l.pp(n.o), hidden, hidden)?;
            let (inter_w, inter_b) = weight(&l.pp(n.up), hidden, s.inter)?;
            let (out_w, out_b) = weight(&l.pp(n.down), s.inter, hidden)?;
            loaded.push(Layer {
                qkv: Weight::Float(Tensor::cat(&[wq, wk, wv], 1)?.contiguous()?),
                qkv_bias: Tensor::cat(&[bq, bk, bv], 0)?,
                attn_out,
                attn_norm: norm_params(bo, &l.pp(n.attn_norm))?,
                inter: inter_w,
                inter_bias: inter_b,
                out: out_w,
                out_norm: norm_params(out_b, &l.pp(n.out_norm))?,
            });
        }
        let token_type = s
            .types
            .map(|t| emb.get((t, hidden), "token_type_embeddings.weight"))
            .transpose()?;
        let relative = s
            .buckets
            .map(|b| RelativeTable::load(&vb.pp("encoder.relative_attention_bias"), b, heads))
            .transpose()?;
        Ok(Self {
            word: emb.get((s.vocab, hidden), "word_embeddings.weight")?,
            position: emb.get((s.max_pos, hidden), "position_embeddings.weight")?,
            token_type,
            embed_gamma: emb.get(hidden, "LayerNorm.weight")?,
            embed_beta: emb.get(hidden, "LayerNorm.bias")?,
            layers: loaded,
            heads,
            eps: s.eps as f32,
            act,
            positions: s.positions,
            single_type: s.types == Some(1),
            relative,
            device,
            routing: Routing::default(),
        })
    }

    /// Every dense layer's weight, for the steps that re-lay them all out (int8, the
    /// CPU's packed f32).
    pub(crate) fn dense_weights(&mut self) -> Vec<&mut Weight> {
        self.layers
            .iter_mut()
            .flat_map(|l| [&mut l.qkv, &mut l.attn_out, &mut l.inter, &mut l.out])
            .collect()
    }

    /// Token vectors for `rows`, packed (see the module doc).
    pub(crate) fn forward(&self, rows: &[&Row]) -> Result<Packed, ModelError> {
        let dtype = self.word.dtype();
        let batch = Batch::new(rows, &self.device, dtype, {
            let head = self.word.dim(1)? / self.heads;
            self.routing.pick(&self.device, dtype, head)
        })?;
        let first_position = match self.positions {
            Positions::FromZero => 0,
            Positions::AfterPadding(pad) => pad + 1,
        };
        let pos = batch.position_ids(first_position)?;
        let mut x =
            (self.word.index_select(&batch.ids, 0)? + self.position.index_select(&pos, 0)?)?;
        if let Some(token_type) = &self.token_type {
            let mut types: Vec<u32> = Vec::with_capacity(batch.tokens());
            for r in rows {
                if self.single_type {
                    types.extend(std::iter::repeat_n(0u32, r.len()));
                } else {
                    types.extend_from_slice(&r.types);
                }
            }
            let types = Tensor::from_vec(types, batch.tokens(), &self.device)?;
            x = (x + token_type.index_select(&types, 0)?)?;
        }
        let mut x = candle_nn::ops::layer_norm(&x, &self.embed_gamma, &self.embed_beta, self.eps)?;
        let relative = self
            .relative
            .as_ref()
            .map(|r| r.bias(batch.longest(), batch.route(), &self.device))
            .transpose()?;
        let mask = match &relative {
            Some(r) => Mask::Relative(r),
            None => Mask::Full,
        };
        let heads = Heads::mha(x.dim(1)?, self.heads);
        let ops = self.routing.card_ops();
        for l in &self.layers {
            let attention = AttentionBlock {
                qkv: &l.qkv,
                qkv_bias: &l.qkv_bias,
                out: &l.attn_out,
                norm: &l.attn_norm,
                eps: self.eps,
            };
            x = attention.forward(&x, &batch, heads, mask, ops)?;
            let ffn = FeedForward {
                up: &l.inter,
                up_bias: &l.inter_bias,
                act: self.act,
                down: &l.out,
                norm: &l.out_norm,
                eps: self.eps,
            };
            x = ffn.forward(&x, ops)?;
        }
        Ok(batch.into_packed(x))
    }
}
