//! The transformer encoders gpulane runs, behind one forward signature: BERT and
//! XLM-RoBERTa (multilingual-e5, bge-m3's dense encoder, bge-reranker). Chosen by
//! config.json's `model_type`, never by the model's name.

use std::path::Path;

use candle_core::Tensor;
use candle_nn::VarBuilder;
use candle_transformers::models::{bert, xlm_roberta};
use serde_json::Value;
use tokenizers::{
    pre_tokenizers::{sequence::Sequence, whitespace::WhitespaceSplit, PreTokenizerWrapper},
    Tokenizer, TruncationDirection, TruncationParams, TruncationStrategy,
};

/// Makes `tok` truncate at `max_length` tokens (special tokens included), longest side
/// first for pairs, as transformers' `truncation=True` does.
pub(crate) fn truncate_at(tok: &mut Tokenizer, max_length: usize) -> Result<(), ModelError> {
    tok.with_truncation(Some(TruncationParams {
        max_length,
        strategy: TruncationStrategy::LongestFirst,
        stride: 0,
        direction: TruncationDirection::Right,
    }))
    .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
    Ok(())
}

use crate::ModelError;

/// Encoder families gpulane can load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Family {
    Bert,
    XlmRoberta,
}

impl Family {
    /// The family of a config.json `model_type`.
    pub(crate) fn of(model_type: &str) -> Option<Self> {
        match model_type {
            "bert" => Some(Family::Bert),
            "xlm-roberta" | "roberta" => Some(Family::XlmRoberta),
            _ => None,
        }
    }

    /// Longest input in tokens the position table allows. RoBERTa positions start after
    /// the padding index, so its table holds `pad_token_id + 1` fewer usable positions.
    pub(crate) fn max_positions(self, config: &Value) -> usize {
        let table = config["max_position_embeddings"].as_u64().unwrap_or(512) as usize;
        match self {
            Family::Bert => table,
            Family::XlmRoberta => {
                let pad = config["pad_token_id"].as_u64().unwrap_or(1) as usize;
                table.saturating_sub(pad + 1)
            }
        }
    }
}

impl Family {
    /// Makes the tokenizer split text as the reference pipeline does. transformers (5.x)
    /// builds XLM-RoBERTa tokenizers with `WhitespaceSplit` before the `Metaspace` that
    /// tokenizer.json declares, so tabs and newlines separate words instead of becoming
    /// pieces of their own; without this, "tabs\tand\nnewlines" tokenizes differently.
    pub(crate) fn align_tokenizer(self, tok: &mut Tokenizer) {
        if self != Family::XlmRoberta {
            return;
        }
        if let Some(PreTokenizerWrapper::Metaspace(m)) = tok.get_pre_tokenizer() {
            let seq = Sequence::new(vec![
                PreTokenizerWrapper::WhitespaceSplit(WhitespaceSplit),
                PreTokenizerWrapper::Metaspace(m.clone()),
            ]);
            tok.with_pre_tokenizer(Some(PreTokenizerWrapper::Sequence(seq)));
        }
    }
}

/// A loaded encoder.
pub(crate) enum Backbone {
    Bert(bert::BertModel),
    XlmRoberta(xlm_roberta::XLMRobertaModel),
}

fn parse<T: for<'de> serde::Deserialize<'de>>(config: Value, path: &Path) -> Result<T, ModelError> {
    serde_json::from_value(config).map_err(|source| ModelError::Json {
        path: path.join("config.json"),
        source,
    })
}

/// config.json as candle's XLM-R config wants it: transformers writes
/// `position_embedding_type: null` (or leaves it out) for the default "absolute".
pub(crate) fn xlmr_config(config: &Value, path: &Path) -> Result<xlm_roberta::Config, ModelError> {
    let mut c = config.clone();
    if c["position_embedding_type"].is_null() {
        c["position_embedding_type"] = Value::from("absolute");
    }
    parse(c, path)
}

impl Backbone {
    /// Loads the encoder of `family` from `vb` (already at the encoder's prefix).
    pub(crate) fn load(
        family: Family,
        config: &Value,
        vb: VarBuilder,
        path: &Path,
    ) -> Result<Self, ModelError> {
        Ok(match family {
            Family::Bert => {
                let cfg: bert::Config = parse(config.clone(), path)?;
                Backbone::Bert(bert::BertModel::load(vb, &cfg)?)
            }
            Family::XlmRoberta => {
                let cfg = xlmr_config(config, path)?;
                Backbone::XlmRoberta(xlm_roberta::XLMRobertaModel::new(&cfg, vb)?)
            }
        })
    }

    /// Token vectors `[batch, seq, hidden]` for `ids` / `types` / `mask` (`[batch, seq]`).
    pub(crate) fn forward(
        &self,
        ids: &Tensor,
        types: &Tensor,
        mask: &Tensor,
    ) -> Result<Tensor, ModelError> {
        Ok(match self {
            Backbone::Bert(m) => m.forward(ids, types, Some(mask))?,
            Backbone::XlmRoberta(m) => m.forward(ids, mask, types, None, None, None)?,
        })
    }
}
