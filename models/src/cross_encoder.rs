//! Cross-encoders (rerankers): a (query, document) pair in, one relevance logit out.
//! `BertForSequenceClassification` (ms-marco MiniLM rerankers),
//! `XLMRobertaForSequenceClassification` (the bge-reranker architecture) and
//! `ModernBertForSequenceClassification` (gte-reranker-modernbert).

use std::path::Path;

use candle_core::{DType, Device, Module};
use candle_nn::{linear, linear_b, Linear, VarBuilder};
use tokenizers::Tokenizer;

use crate::{
    batcher::{refuse_empty, run_now, BatchLimits, Forward, Row},
    config::{Arch, ModernBertConfig},
    encoder::{Act, Attention, Encoder, Norm},
    model_dir::{truncate_at, ModelDir, ModelIdentity},
    st_dir::{default_batch_tokens, read_json, working_bytes, MAX_BATCH_ROWS},
    ModelError, Pooling,
};

/// A cross-encoder's description.
#[derive(Debug, Clone, PartialEq)]
pub struct CrossEncoderInfo {
    /// Which model this is: family, revision, dtype, architecture, parameters.
    pub identity: ModelIdentity,
    /// Longest (query, document) pair in tokens; longer pairs are truncated, longest
    /// side first (`model_max_length` in tokenizer_config.json).
    pub max_length: usize,
    /// Hidden size, for cost estimates.
    pub hidden_size: usize,
    /// Feed-forward width, for cost estimates (doubled for ModernBERT, as in
    /// [`crate::ModelInfo::intermediate_size`]).
    pub intermediate_size: usize,
    /// Attention heads, for cost estimates.
    pub num_heads: usize,
}

impl CrossEncoderInfo {
    /// Working memory of one forward pass at the largest batch; the same formula as
    /// [`crate::ModelInfo::working_bytes`].
    pub fn working_bytes(&self, dtype_bytes: u64) -> u64 {
        working_bytes(
            default_batch_tokens(self.max_length),
            self.max_length,
            self.hidden_size,
            self.intermediate_size,
            self.num_heads,
            dtype_bytes,
        )
    }
}

/// Relevance logits for one query's documents, in input order.
#[derive(Debug, Clone, PartialEq)]
pub struct Scores {
    /// One raw logit per document; the usual score is its sigmoid.
    pub logits: Vec<f32>,
    /// Tokens per pair after truncation, special tokens included.
    pub token_counts: Vec<usize>,
}

/// The classification head over the encoder's token vectors.
enum Head {
    /// BERT and XLM-R: the first token, a tanh dense layer, then one logit. BERT calls
    /// them `bert.pooler.dense` and `classifier`, XLM-R `classifier.dense` and
    /// `classifier.out_proj`.
    Tanh { dense: Linear, out: Linear },
    /// ModernBERT: the first token or the mean of the pair's tokens
    /// (`classifier_pooling`), then `head.dense`, its activation, `head.norm`, and the
    /// `classifier` logit.
    ModernBert {
        pooling: Pooling,
        dense: Linear,
        act: Act,
        norm: Norm,
        eps: f32,
        out: Linear,
    },
}

impl Head {
    /// ModernBERT's head of width `h`, as config.json describes it.
    fn modernbert(
        config: &ModernBertConfig,
        vb: &VarBuilder,
        h: usize,
        dir: &Path,
    ) -> Result<Self, ModelError> {
        let head = vb.pp("head");
        let pooling = match config.classifier_pooling.as_str() {
            "cls" => Pooling::Cls,
            "mean" => Pooling::Mean,
            other => {
                return Err(ModelError::Unsupported {
                    path: dir.to_owned(),
                    reason: format!("classifier_pooling {other:?}; gpulane runs cls and mean"),
                })
            }
        };
        Ok(Head::ModernBert {
            pooling,
            dense: linear_b(h, h, config.classifier_bias, head.pp("dense"))?,
            act: Act::parse(&config.classifier_activation, dir)?,
            norm: Norm::load(head.pp("norm"), h, config.norm_bias)?,
            eps: config.norm_eps as f32,
            out: linear(h, 1, vb.pp("classifier"))?,
        })
    }
}

/// A cross-encoder loaded on one device. Blocking: call it from an engine thread.
pub struct CrossEncoder {
    encoder: Encoder,
    head: Head,
    tokenizer: Tokenizer,
    info: CrossEncoderInfo,
}

impl CrossEncoder {
    /// Quantizes the encoder's dense layers to int8 (f32 CPU models only); the
    /// classifier head stays f32.
    pub fn quantize_int8(&mut self) -> Result<(), ModelError> {
        self.encoder.quantize_int8()?;
        self.info.identity.int8 = true;
        Ok(())
    }

    /// Which attention route the model takes on a card.
    pub(crate) fn set_attention(&mut self, attention: Attention) {
        self.encoder.set_attention(attention);
    }

    /// Loads the cross-encoder in `dir` onto `device` in `dtype`.
    pub fn load(dir: &Path, device: &Device, dtype: DType) -> Result<Self, ModelError> {
        let unsupported = |reason: String| ModelError::Unsupported {
            path: dir.to_owned(),
            reason,
        };
        let model = ModelDir::open(dir)?;
        let config = &model.config;
        let architecture = config.architecture.as_str();
        if config.num_labels != 1 {
            return Err(unsupported(format!(
                "{} labels; a reranker has one relevance logit",
                config.num_labels
            )));
        }
        let shape = config.shape();
        let tok_cfg: serde_json::Value = read_json(&dir.join("tokenizer_config.json"))?;
        let positions = shape.max_positions;
        let max_length = tok_cfg["model_max_length"]
            .as_u64()
            .map_or(positions, |m| (m as usize).min(positions));
        let mut tokenizer = model.tokenizer.clone();
        truncate_at(&mut tokenizer, max_length)?;

        let vb = model.var_builder(dtype, device)?;
        let h = shape.hidden;
        let head = match (&config.arch, architecture) {
            (Arch::Bert(_), "BertForSequenceClassification") => Head::Tanh {
                dense: linear(h, h, vb.pp("bert.pooler.dense"))?,
                out: linear(h, 1, vb.pp("classifier"))?,
            },
            (Arch::XlmRoberta(_), "XLMRobertaForSequenceClassification") => Head::Tanh {
                dense: linear(h, h, vb.pp("classifier.dense"))?,
                out: linear(h, 1, vb.pp("classifier.out_proj"))?,
            },
            (Arch::ModernBert(c), "ModernBertForSequenceClassification") => {
                Head::modernbert(c, &vb, h, dir)?
            }
            _ => {
                return Err(unsupported(format!(
                    "architecture {architecture:?} ({}); rerankers are BertForSequenceClassification, XLMRobertaForSequenceClassification or ModernBertForSequenceClassification",
                    config.family().as_str()
                )))
            }
        };
        let encoder = Encoder::load(config, vb, dir)?;
        Ok(Self {
            encoder,
            head,
            tokenizer,
            info: CrossEncoderInfo {
                identity: model.identity(dtype)?,
                max_length,
                hidden_size: h,
                intermediate_size: shape.ffn,
                num_heads: shape.heads,
            },
        })
    }

    /// The model's description.
    pub fn info(&self) -> &CrossEncoderInfo {
        &self.info
    }

    /// Tokenizes (query, document) pairs into rows, truncated longest side first.
    pub(crate) fn encode(&self, query: &str, documents: &[String]) -> Result<Vec<Row>, ModelError> {
        let pairs: Vec<(&str, &str)> = documents.iter().map(|d| (query, d.as_str())).collect();
        let enc = self
            .tokenizer
            .encode_batch(pairs, true)
            .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        let rows: Vec<Row> = enc
            .into_iter()
            .map(|e| Row {
                ids: e.get_ids().to_vec(),
                types: e.get_type_ids().to_vec(),
                skip: 0,
            })
            .collect();
        refuse_empty(&rows, "documents", "the reranker's classifier")?;
        Ok(rows)
    }

    /// The default batch budget for this model (the engine may set another row count).
    pub(crate) fn limits(&self, rows: usize, wait: std::time::Duration) -> BatchLimits {
        BatchLimits {
            rows,
            tokens: default_batch_tokens(self.info.max_length),
            wait,
        }
    }

    /// Scores each document against `query` on the calling thread.
    pub fn score(&self, query: &str, documents: &[String]) -> Result<Scores, ModelError> {
        let rows = self.encode(query, documents)?;
        let token_counts = rows.iter().map(Row::len).collect();
        let limits = self.limits(MAX_BATCH_ROWS, std::time::Duration::ZERO);
        let out = run_now(self, &limits, rows)?;
        Ok(Scores::from_rows(out, token_counts))
    }
}

impl Scores {
    /// One call's batcher output (one single-logit row per pair) as scores.
    pub(crate) fn from_rows(rows: Vec<Vec<f32>>, token_counts: Vec<usize>) -> Self {
        Scores {
            logits: rows.into_iter().map(|r| r[0]).collect(),
            token_counts,
        }
    }
}

impl Forward for CrossEncoder {
    /// One single-logit row per pair.
    fn forward(&self, batch: &[&Row]) -> Result<Vec<Vec<f32>>, ModelError> {
        let tokens = self.encoder.forward(batch)?;
        let logits = match &self.head {
            Head::Tanh { dense, out } => {
                out.forward(&dense.forward(&tokens.first_tokens()?)?.tanh()?)?
            }
            Head::ModernBert {
                pooling,
                dense,
                act,
                norm,
                eps,
                out,
            } => {
                let pooled = match pooling {
                    Pooling::Cls => tokens.first_tokens()?,
                    _ => tokens.pool(*pooling)?.to_dtype(tokens.hidden.dtype())?,
                };
                out.forward(&norm.forward(&act.apply(&dense.forward(&pooled)?)?, *eps)?)?
            }
        };
        Ok(logits
            .to_dtype(DType::F32)?
            .to_device(&Device::Cpu)?
            .to_vec2()?)
    }
}
