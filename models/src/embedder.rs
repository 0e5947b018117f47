use std::path::Path;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use tokenizers::Tokenizer;

use crate::{
    backbone::{truncate_at, Backbone},
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

/// A sentence-transformers BERT embedder loaded on one device. Blocking: call it from the
/// engine thread, never from the async runtime.
pub struct Embedder {
    model: Backbone,
    /// Encodes with truncation at `max_seq_length`.
    truncating: Tokenizer,
    /// Encodes without truncation, to measure and refuse over-long texts.
    whole: Tokenizer,
    pad_id: u32,
    info: ModelInfo,
    device: Device,
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
        let model = Backbone::load(st.family, &st.config, vb, dir)?;
        Ok(Self {
            model,
            truncating,
            whole,
            pad_id: st.pad_id,
            info: st.info,
            device: device.clone(),
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

    fn encode(&self, texts: &[String], truncate: bool) -> Result<Vec<Vec<u32>>, ModelError> {
        let tok = if truncate {
            &self.truncating
        } else {
            &self.whole
        };
        // sentence-transformers strips each text before tokenizing; with a Metaspace
        // (sentencepiece) pre-tokenizer, "   " and "" tokenize differently, so do the same.
        let inputs: Vec<&str> = texts.iter().map(|t| t.trim()).collect();
        let encodings = tok
            .encode_batch(inputs, true)
            .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        let ids: Vec<Vec<u32>> = encodings
            .into_iter()
            .map(|e| e.get_ids().to_vec())
            .collect();
        let limit = self.info.max_seq_length;
        if let Some((index, t)) = ids.iter().enumerate().find(|(_, t)| t.len() > limit) {
            return Err(ModelError::TextTooLong {
                index,
                tokens: t.len(),
                limit,
            });
        }
        Ok(ids)
    }

    /// Embeds `texts`, in input order.
    pub fn embed(&self, texts: &[String], opts: EmbedOptions) -> Result<Embeddings, ModelError> {
        let ids = self.encode(texts, opts.truncate)?;
        let normalize = opts.normalize.unwrap_or(self.info.normalize);
        let mut order: Vec<usize> = (0..ids.len()).collect();
        // Length-sorted batches waste less compute on padding.
        order.sort_by_key(|&i| ids[i].len());
        let mut vectors = vec![Vec::new(); ids.len()];
        let mut start = 0;
        while start < order.len() {
            let mut end = start + 1;
            while end < order.len()
                && end - start < MAX_BATCH_ROWS
                && (end - start + 1) * ids[order[end]].len() <= self.info.max_batch_tokens()
            {
                end += 1;
            }
            let batch: Vec<&[u32]> = order[start..end].iter().map(|&i| &ids[i][..]).collect();
            let out = self.forward(&batch, normalize)?;
            for (row, &i) in out.into_iter().zip(&order[start..end]) {
                vectors[i] = row;
            }
            start = end;
        }
        Ok(Embeddings {
            vectors,
            token_counts: ids.iter().map(Vec::len).collect(),
        })
    }

    fn forward(&self, batch: &[&[u32]], normalize: bool) -> Result<Vec<Vec<f32>>, ModelError> {
        let width = batch.iter().map(|t| t.len()).max().unwrap_or(0);
        let rows = batch.len();
        let mut input = Vec::with_capacity(rows * width);
        let mut mask = Vec::with_capacity(rows * width);
        for t in batch {
            input.extend_from_slice(t);
            input.extend(std::iter::repeat_n(self.pad_id, width - t.len()));
            mask.extend(std::iter::repeat_n(1u32, t.len()));
            mask.extend(std::iter::repeat_n(0u32, width - t.len()));
        }
        let input = Tensor::from_vec(input, (rows, width), &self.device)?;
        let mask = Tensor::from_vec(mask, (rows, width), &self.device)?;
        let types = input.zeros_like()?;
        let hidden = self.model.forward(&input, &types, &mask)?;
        let mut pooled = self.info.pooling.pool(&hidden, &mask)?;
        if normalize {
            pooled = l2_normalize(&pooled)?;
        }
        Ok(pooled.to_device(&Device::Cpu)?.to_vec2()?)
    }
}
