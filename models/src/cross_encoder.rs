//! Cross-encoders (rerankers): a (query, document) pair in, one relevance logit out.
//! `BertForSequenceClassification` (ms-marco MiniLM rerankers) and
//! `XLMRobertaForSequenceClassification` (the bge-reranker architecture).

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{linear, Linear, VarBuilder};
use candle_transformers::models::{bert, xlm_roberta};
use serde_json::Value;
use tokenizers::Tokenizer;

use crate::{
    backbone::{truncate_at, xlmr_config, Family},
    st_dir::{count_parameters, default_batch_tokens, read_json, working_bytes, MAX_BATCH_ROWS},
    ModelError,
};

/// A cross-encoder's description.
#[derive(Debug, Clone, PartialEq)]
pub struct CrossEncoderInfo {
    /// `architectures[0]` from config.json.
    pub architecture: String,
    /// Longest (query, document) pair in tokens; longer pairs are truncated, longest
    /// side first (`model_max_length` in tokenizer_config.json).
    pub max_length: usize,
    /// Hidden size, for cost estimates.
    pub hidden_size: usize,
    /// Floating-point parameters, for cost estimates.
    pub parameters: u64,
    /// Feed-forward width, for cost estimates.
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

enum Head {
    Bert {
        bert: bert::BertModel,
        pooler: Linear,
        classifier: Linear,
    },
    XlmRoberta(xlm_roberta::XLMRobertaForSequenceClassification),
}

/// A cross-encoder loaded on one device. Blocking: call it from an engine thread.
pub struct CrossEncoder {
    head: Head,
    tokenizer: Tokenizer,
    pad_id: u32,
    info: CrossEncoderInfo,
    device: Device,
}

fn missing(path: PathBuf) -> ModelError {
    ModelError::File {
        path,
        source: std::io::Error::from(std::io::ErrorKind::NotFound),
    }
}

impl CrossEncoder {
    /// Loads the cross-encoder in `dir` onto `device` in `dtype`.
    pub fn load(dir: &Path, device: &Device, dtype: DType) -> Result<Self, ModelError> {
        let unsupported = |reason: String| ModelError::Unsupported {
            path: dir.to_owned(),
            reason,
        };
        let config: Value = read_json(&dir.join("config.json"))?;
        let architecture = config["architectures"][0].as_str().unwrap_or("").to_owned();
        let family = Family::of(config["model_type"].as_str().unwrap_or(""));
        let num_labels = config["id2label"].as_object().map_or(1, |m| m.len().max(1));
        if num_labels != 1 {
            return Err(unsupported(format!(
                "{num_labels} labels; a reranker has one relevance logit"
            )));
        }
        let tok_cfg: Value = read_json(&dir.join("tokenizer_config.json"))?;
        let positions = family.map_or(512, |f| f.max_positions(&config));
        let max_length = tok_cfg["model_max_length"]
            .as_u64()
            .map_or(positions, |m| (m as usize).min(positions));

        let tok_path = dir.join("tokenizer.json");
        if !tok_path.is_file() {
            return Err(missing(tok_path));
        }
        let mut tokenizer = Tokenizer::from_file(&tok_path)
            .map_err(|e| ModelError::Tokenizer(format!("{}: {e}", tok_path.display())))?;
        tokenizer.with_padding(None);
        if let Some(f) = family {
            f.align_tokenizer(&mut tokenizer);
        }
        truncate_at(&mut tokenizer, max_length)?;

        let weights = dir.join("model.safetensors");
        if !weights.is_file() {
            return Err(missing(weights));
        }
        let parameters = count_parameters(&weights)?;
        // SAFETY: see Embedder::load; the file is mapped read-only.
        let vb = unsafe { VarBuilder::from_mmaped_safetensors(&[weights], dtype, device)? };
        let head = match (family, architecture.as_str()) {
            (Some(Family::Bert), "BertForSequenceClassification") => {
                let cfg: bert::Config =
                    serde_json::from_value(config.clone()).map_err(|source| ModelError::Json {
                        path: dir.join("config.json"),
                        source,
                    })?;
                let h = cfg.hidden_size;
                Head::Bert {
                    bert: bert::BertModel::load(vb.pp("bert"), &cfg)?,
                    pooler: linear(h, h, vb.pp("bert.pooler.dense"))?,
                    classifier: linear(h, 1, vb.pp("classifier"))?,
                }
            }
            (Some(Family::XlmRoberta), "XLMRobertaForSequenceClassification") => {
                let cfg = xlmr_config(&config, dir)?;
                Head::XlmRoberta(xlm_roberta::XLMRobertaForSequenceClassification::new(
                    1, &cfg, vb,
                )?)
            }
            _ => {
                return Err(unsupported(format!(
                    "architecture {architecture:?}; rerankers are BertForSequenceClassification or XLMRobertaForSequenceClassification"
                )))
            }
        };
        Ok(Self {
            head,
            tokenizer,
            pad_id: config["pad_token_id"].as_u64().unwrap_or(0) as u32,
            info: CrossEncoderInfo {
                architecture,
                max_length,
                hidden_size: config["hidden_size"].as_u64().unwrap_or(0) as usize,
                parameters,
                intermediate_size: config["intermediate_size"].as_u64().unwrap_or(0) as usize,
                num_heads: config["num_attention_heads"].as_u64().unwrap_or(1) as usize,
            },
            device: device.clone(),
        })
    }

    /// The model's description.
    pub fn info(&self) -> &CrossEncoderInfo {
        &self.info
    }

    /// Scores each document against `query`.
    pub fn score(&self, query: &str, documents: &[String]) -> Result<Scores, ModelError> {
        let pairs: Vec<(&str, &str)> = documents.iter().map(|d| (query, d.as_str())).collect();
        let enc = self
            .tokenizer
            .encode_batch(pairs, true)
            .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        let mut order: Vec<usize> = (0..enc.len()).collect();
        order.sort_by_key(|&i| enc[i].get_ids().len());
        let mut logits = vec![0f32; enc.len()];
        for chunk in order.chunks(MAX_BATCH_ROWS) {
            let width = chunk
                .iter()
                .map(|&i| enc[i].get_ids().len())
                .max()
                .unwrap_or(0);
            let rows = chunk.len();
            let (mut ids, mut types, mut mask) = (
                Vec::with_capacity(rows * width),
                Vec::with_capacity(rows * width),
                Vec::with_capacity(rows * width),
            );
            for &i in chunk {
                let e = &enc[i];
                let pad = width - e.get_ids().len();
                ids.extend_from_slice(e.get_ids());
                ids.extend(std::iter::repeat_n(self.pad_id, pad));
                types.extend_from_slice(e.get_type_ids());
                types.extend(std::iter::repeat_n(0u32, pad));
                mask.extend(std::iter::repeat_n(1u32, e.get_ids().len()));
                mask.extend(std::iter::repeat_n(0u32, pad));
            }
            let ids = Tensor::from_vec(ids, (rows, width), &self.device)?;
            let types = Tensor::from_vec(types, (rows, width), &self.device)?;
            let mask = Tensor::from_vec(mask, (rows, width), &self.device)?;
            let out = match &self.head {
                Head::Bert {
                    bert,
                    pooler,
                    classifier,
                } => {
                    let hidden = bert.forward(&ids, &types, Some(&mask))?;
                    let cls = hidden.narrow(1, 0, 1)?.squeeze(1)?;
                    classifier.forward(&pooler.forward(&cls)?.tanh()?)?
                }
                Head::XlmRoberta(m) => m.forward(&ids, &mask, &types)?,
            };
            let out: Vec<f32> = out
                .to_dtype(DType::F32)?
                .to_device(&Device::Cpu)?
                .flatten_all()?
                .to_vec1()?;
            for (&i, v) in chunk.iter().zip(out) {
                logits[i] = v;
            }
        }
        Ok(Scores {
            logits,
            token_counts: enc.iter().map(|e| e.get_ids().len()).collect(),
        })
    }
}
