//! The encoder families gpulane runs, BERT, XLM-RoBERTa (multilingual-e5, bge-m3's
//! dense encoder, bge-reranker) and ModernBERT (modernbert-embed, gte-modernbert), chosen
//! by config.json's `model_type`, never by the model's name: what differs between them
//! outside the forward pass (tokenizer alignment, usable positions). The forward passes
//! themselves are `encoder` and `modernbert`.

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
    ModernBert,
}

impl Family {
    /// The feed-forward width that bounds working memory: `intermediate_size`, doubled
    /// for ModernBERT, whose `Wi` produces the input and its gate.
    pub(crate) fn ffn_width(self, config: &Value) -> usize {
        let i = config["intermediate_size"].as_u64().unwrap_or(0) as usize;
        if self == Family::ModernBert {
            2 * i
        } else {
            i
        }
    }

    /// The family of a config.json `model_type`.
    pub(crate) fn of(model_type: &str) -> Option<Self> {
        match model_type {
            "bert" => Some(Family::Bert),
            "xlm-roberta" | "roberta" => Some(Family::XlmRoberta),
            "modernbert" => Some(Family::ModernBert),
            _ => None,
        }
    }

    /// Longest input in tokens the position table allows. RoBERTa positions start after
    /// the padding index, so its table holds `pad_token_id + 1` fewer usable positions;
    /// ModernBERT's rotary positions have no table, and its config states the length it
    /// was trained to.
    pub(crate) fn max_positions(self, config: &Value) -> usize {
        let default = if self == Family::ModernBert {
            8192
        } else {
            512
        };
        let table = config["max_position_embeddings"]
            .as_u64()
            .unwrap_or(default) as usize;
        match self {
            Family::Bert | Family::ModernBert => table,
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
