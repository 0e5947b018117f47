use std::path::Path;

use candle_core::{DType, Device};
use candle_nn::VarBuilder;
use tokenizers::Tokenizer;

use crate::{
    backbone::truncate_at,
    batcher::{run_now, BatchLimits, Forward, Row},
    encoder::Encoder,
    pooling::l2_normalize,
    st_dir::{SentenceTransformerDir, MAX_BATCH_ROWS},
    ModelError, ModelInfo,
};

/// Per-call options the caller may set.
#[derive(Debug, Clone, Copy)]
pub struct EmbedOptions {
    /// L2-normalize the output; `None` follows the model's own pipeline (modules.json).
    pub normalize: Option<bool>,
    /// Truncate texts longer than the model's limit; `false` fails such a call instead.
    pub truncate: bool,
}

impl Default for EmbedOptions {
    fn default() -> Self {
        Self {
            normalize: None,
            truncate: true,
        }
    }
}

/// The vectors for one call, in input order, and the tokens they cost.
#[derive(Debug, Clone, PartialEq)]
pub struct Embeddings {
    /// One vector per input text, in input order.
    pub vectors: Vec<Vec<f32>>,
    /// Token count per text after truncation, special tokens included.
    pub token_counts: Vec<usize>,
}

/// A sentence-transformers embedder (BERT, XLM-RoBERTa or ModernBERT) loaded on one
/// device. Blocking: call it from the engine thread, never from the async runtime.
pub struct Embedder {
    model: Encoder,
    /// Encodes with truncation at `max_seq_length`.
    truncating: Tokenizer,
    /// Encodes without truncation, to measure and refuse over-long texts.
    whole: Tokenizer,
    info: ModelInfo,
}

impl Embedder {
    /// Loads the model in `dir` onto `device` in `dtype`.
    pub fn load(dir: &Path, device: &Device, dtype: DType) -> Result<Self, ModelError> {
        let st = SentenceTransformerDir::open(dir)?;
        let tok_path = dir.join("tokenizer.json");
        if !tok_path.is_file() {
            return Err(ModelError::File {
                path: tok_path,
                source: std::io::Error::from(std::io::ErrorKind::NotFound),
            });
        }
        let mut whole = Tokenizer::from_file(&tok_path)
            .map_err(|e| ModelError::Tokenizer(format!("{}: {e}", tok_path.display())))?;
        // tokenizer.json files often ship fixed padding and a truncation length that is
        // not the model's (all-MiniLM-L6-v2 ships 128 for a 256-token model). We pad per
        // batch ourselves and truncate at sentence-transformers' max_seq_length.
        whole.with_padding(None);
        st.family.align_tokenizer(&mut whole);
        whole
            .with_truncation(None)
            .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        let mut truncating = whole.clone();
        truncate_at(&mut truncating, st.info.max_seq_length)?;

        let weights = dir.join("model.safetensors");
        if !weights.is_file() {
            return Err(ModelError::File {
                path: weights,
                source: std::io::Error::from(std::io::ErrorKind::NotFound),
            });
        }
        // SAFETY: the file is mapped read-only; gpulane does not write model files while
        // serving, and a user who rewrites them underneath a running worker gets garbage
        // embeddings, not memory unsafety in practice (candle copies into tensors).
        let vb = unsafe { VarBuilder::from_mmaped_safetensors(&[weights], dtype, device)? };
        let model = Encoder::load(&st.config, vb, dir)?;
        Ok(Self {
            model,
            truncating,
            whole,
            info: st.info,
        })
    }

    /// Sets the most padded tokens per forward pass (at least one full-length text).
    pub fn set_batch_tokens(&mut self, tokens: usize) {
        self.info.batch_tokens = tokens.max(self.info.max_seq_length);
    }

    /// The model's description.
    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    /// Tokenizes `texts` into rows, truncated at the model's limit when `truncate`, or
    /// refused with [`ModelError::TextTooLong`] when a text is over it and not `truncate`.
    pub(crate) fn encode(&self, texts: &[String], truncate: bool) -> Result<Vec<Row>, ModelError> {
        let tok = if truncate {
            &self.truncating
        } else {
            &self.whole
        };
        // Texts go to the tokenizer as they are, as sentence-transformers sends them: a
        // byte-level BPE (ModernBERT) has tokens for spaces, so trimming would change the
        // result; XLM-R's Metaspace drops edge whitespace itself once `align_tokenizer` has
        // put WhitespaceSplit in front of it.
        let inputs: Vec<&str> = texts.iter().map(String::as_str).collect();
        let encodings = tok
            .encode_batch(inputs, true)
            .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        let rows: Vec<Row> = encodings
            .into_iter()
            .map(|e| Row::single(e.get_ids().to_vec()))
            .collect();
        let limit = self.info.max_seq_length;
        if let Some((index, t)) = rows.iter().enumerate().find(|(_, t)| t.len() > limit) {
            return Err(ModelError::TextTooLong {
                index,
                tokens: t.len(),
                limit,
            });
        }
        Ok(rows)
    }

    /// The default batch budget for this model (the engine may set another row count).
    pub(crate) fn limits(&self, rows: usize, wait: std::time::Duration) -> BatchLimits {
        BatchLimits {
            rows,
            tokens: self.info.max_batch_tokens(),
            wait,
        }
    }

    /// Embeds `texts`, in input order, on the calling thread (no cross-call batching:
    /// that is the [`crate::Engine`]'s job).
    pub fn embed(&self, texts: &[String], opts: EmbedOptions) -> Result<Embeddings, ModelError> {
        let rows = self.encode(texts, opts.truncate)?;
        let token_counts = rows.iter().map(Row::len).collect();
        let limits = self.limits(MAX_BATCH_ROWS, std::time::Duration::ZERO);
        let vectors = run_now(self, &limits, rows)?;
        Ok(self.finish(vectors, token_counts, opts))
    }

    /// Pooled vectors of one call into its result: normalized when the call or the
    /// model's pipeline asks.
    pub(crate) fn finish(
        &self,
        mut vectors: Vec<Vec<f32>>,
        token_counts: Vec<usize>,
        opts: EmbedOptions,
    ) -> Embeddings {
        if opts.normalize.unwrap_or(self.info.normalize) {
            vectors.iter_mut().for_each(|v| l2_normalize(v));
        }
        Embeddings {
            vectors,
            token_counts,
        }
    }
}

impl Forward for Embedder {
    /// Pooled, unnormalized vectors, one per row.
    fn forward(&self, batch: &[&Row]) -> Result<Vec<Vec<f32>>, ModelError> {
        let pooled = self.model.forward(batch)?.pool(self.info.pooling)?;
        Ok(pooled.to_device(&Device::Cpu)?.to_vec2()?)
    }
}
