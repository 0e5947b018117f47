//! The one loader every model kind starts from: a directory's config.json (typed, once),
//! its tokenizer (with the directory's own padding and truncation switched off), and its
//! weights. Embedders add the sentence-transformers pipeline (`st_dir`), cross-encoders
//! their classification head.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device};
use candle_nn::VarBuilder;
use tokenizers::{
    pre_tokenizers::{sequence::Sequence, whitespace::WhitespaceSplit, PreTokenizerWrapper},
    Tokenizer, TruncationDirection, TruncationParams, TruncationStrategy,
};

use crate::{
    checkpoint::Checkpoint,
    config::{Family, ModelConfig},
    ModelError,
};

/// Which model made a result: stored vectors outlive deployments, so a result names its
/// model's family, revision and dtype along with the name it was served by.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelIdentity {
    /// `architectures[0]` from config.json (e.g. `BertModel`).
    pub architecture: String,
    /// The family that ran it.
    pub family: Family,
    /// The Hugging Face commit when the directory is a hub snapshot, else `sha256:` and
    /// the hash of the weight files.
    pub revision: String,
    /// The dtype the model computes in on this engine.
    pub dtype: DType,
    /// Its dense layers run in dynamic int8 (the CPU's opt-in `int8`); `dtype` is then
    /// what everything else computes in (f32).
    pub int8: bool,
    /// Floating-point parameters in the weights.
    pub parameters: u64,
    /// The name the model gives itself: the hub id its README card loads it by, else
    /// config.json's `_name_or_path` when that is a hub id (not a local path); None when
    /// it gives none.
    pub self_name: Option<String>,
}

impl ModelIdentity {
    /// What results name as their dtype: `int8` for a quantized model, else `f32`,
    /// `f16` or `bf16`.
    pub fn precision(&self) -> &'static str {
        if self.int8 {
            "int8"
        } else {
            self.dtype.as_str()
        }
    }
}

/// A model directory, opened.
pub(crate) struct ModelDir {
    pub path: PathBuf,
    pub config: ModelConfig,
    pub checkpoint: Checkpoint,
    /// Encodes without padding or truncation; callers set their own truncation.
    pub tokenizer: Tokenizer,
}

impl ModelDir {
    /// Opens `dir`, failing naming the file that is missing or wrong, so a worker that
    /// cannot serve a declared model stops at start.
    pub(crate) fn open(dir: &Path) -> Result<Self, ModelError> {
        let config = ModelConfig::open(dir)?;
        let tok_path = dir.join("tokenizer.json");
        if !tok_path.is_file() {
            return Err(ModelError::File {
                path: tok_path,
                source: std::io::Error::from(std::io::ErrorKind::NotFound),
            });
        }
        let mut tokenizer = Tokenizer::from_file(&tok_path)
            .map_err(|e| ModelError::Tokenizer(format!("{}: {e}", tok_path.display())))?;
        // tokenizer.json files often ship fixed padding and a truncation length that is
        // not the model's (all-MiniLM-L6-v2 ships 128 for a 256-token model). We pad per
        // batch ourselves and truncate at the model's own limit.
        tokenizer.with_padding(None);
        tokenizer
            .with_truncation(None)
            .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        align_tokenizer(config.family(), &mut tokenizer);
        Ok(Self {
            path: dir.to_owned(),
            checkpoint: Checkpoint::open(dir)?,
            config,
            tokenizer,
        })
    }

    /// The weights, mapped for `dtype` on `device`.
    pub(crate) fn var_builder(
        &self,
        dtype: DType,
        device: &Device,
    ) -> Result<VarBuilder<'static>, ModelError> {
        self.checkpoint.var_builder(dtype, device)
    }

    /// Who the model is, computing in `dtype`.
    pub(crate) fn identity(&self, dtype: DType) -> Result<ModelIdentity, ModelError> {
        Ok(ModelIdentity {
            architecture: self.config.architecture.clone(),
            family: self.config.family(),
            revision: self.checkpoint.revision(&self.path)?,
            dtype,
            int8: false,
            parameters: self.checkpoint.parameters,
            self_name: self_name(&self.path, self.config.name_or_path.as_deref()),
        })
    }
}

/// The name a model directory gives itself (see [`ModelIdentity::self_name`]), reduced to
/// the part after the organisation (`sentence-transformers/all-MiniLM-L6-v2` →
/// `all-MiniLM-L6-v2`).
pub fn self_name(dir: &Path, name_or_path: Option<&str>) -> Option<String> {
    let from_card = std::fs::read_to_string(dir.join("README.md"))
        .ok()
        .and_then(|card| card_name(&card));
    let from_config = name_or_path.filter(|n| is_hub_id(n)).map(str::to_owned);
    from_card
        .or(from_config)
        .map(|id| match id.rsplit_once('/') {
            Some((_, name)) => name.to_owned(),
            None => id,
        })
}

/// `org/name` with neither part empty nor a path's markers.
fn is_hub_id(s: &str) -> bool {
    let mut parts = s.split('/');
    let (Some(org), Some(name), None) = (parts.next(), parts.next(), parts.next()) else {
        return false;
    };
    let ok = |p: &str| {
        !p.is_empty()
            && p != "."
            && p != ".."
            && p.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
    };
    ok(org) && ok(name)
}

/// The hub id a model card loads its model by: the first `SentenceTransformer("org/name")`
/// (or `CrossEncoder(...)`) in it.
fn card_name(card: &str) -> Option<String> {
    for call in ["SentenceTransformer(", "CrossEncoder("] {
        for (i, _) in card.match_indices(call) {
            let rest = &card[i + call.len()..];
            let quote = rest.chars().next()?;
            if quote != '"' && quote != '\'' {
                continue;
            }
            let inner = &rest[1..];
            if let Some(end) = inner.find(quote) {
                let id = &inner[..end];
                if is_hub_id(id) {
                    return Some(id.to_owned());
                }
            }
        }
    }
    None
}

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

/// Makes the tokenizer split text as the reference pipeline does. transformers (5.x)
/// builds XLM-RoBERTa tokenizers with `WhitespaceSplit` before the `Metaspace` that
/// tokenizer.json declares, so tabs and newlines separate words instead of becoming
/// pieces of their own; without this, "tabs\tand\nnewlines" tokenizes differently.
fn align_tokenizer(family: Family, tok: &mut Tokenizer) {
    if family != Family::XlmRoberta {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_card_names_its_model_by_the_id_it_loads() {
        let card = "# all-MiniLM-L6-v2\n```python\nmodel = SentenceTransformer('sentence-transformers/all-MiniLM-L6-v2')\n```";
        assert_eq!(
            card_name(card).as_deref(),
            Some("sentence-transformers/all-MiniLM-L6-v2")
        );
        assert_eq!(card_name("model = SentenceTransformer(model_id)"), None);
        assert_eq!(card_name("SentenceTransformer('{MODEL_NAME}')"), None);
    }

    #[test]
    fn the_self_name_prefers_the_card_and_ignores_local_paths() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(self_name(dir.path(), Some("/tmp/out")), None);
        assert_eq!(self_name(dir.path(), Some("./out")), None);
        assert_eq!(
            self_name(dir.path(), Some("BAAI/bge-small-en-v1.5")).as_deref(),
            Some("bge-small-en-v1.5")
        );
        std::fs::write(
            dir.path().join("README.md"),
            "SentenceTransformer(\"org/from-card\")",
        )
        .unwrap();
        assert_eq!(
            self_name(dir.path(), Some("BAAI/bge-small-en-v1.5")).as_deref(),
            Some("from-card")
        );
    }
}
