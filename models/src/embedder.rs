//! Sentence-transformers embedders: the transformer, pooling, any Dense layers, and
//! Normalize, as the model directory's modules.json lists them.

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use tokenizers::Tokenizer;

use crate::{
    batcher::{refuse_empty, run_now, BatchLimits, Forward, Row},
    encoder::{Attention, Encoder, Route},
    model_dir::truncate_at,
    pooling::l2_normalize,
    st_dir::{DenseAct, DenseSpec, SentenceTransformerDir, MAX_BATCH_ROWS},
    ModelError, ModelInfo,
};

/// Per-call options the caller may set.
#[derive(Debug, Clone)]
pub struct EmbedOptions {
    /// L2-normalize the output; `None` follows the model's own pipeline (modules.json).
    pub normalize: Option<bool>,
    /// Truncate texts longer than the model's limit; `false` fails such a call instead.
    pub truncate: bool,
    /// Text put before every input (an instruction, `"query: "`); `None` applies the
    /// model's `default_prompt_name` prompt if it has one, `Some("")` no prompt.
    pub prompt: Option<String>,
    /// Scheduling priority in the engine: lower runs first (Temporal's priority key).
    pub priority: i32,
}

impl Default for EmbedOptions {
    fn default() -> Self {
        Self {
            normalize: None,
            truncate: true,
            prompt: None,
            priority: 0,
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

/// A sentence-transformers `Dense` module: `act(x · W + b)`, in f32 on the model's device.
struct Dense {
    w: Tensor,
    b: Option<Tensor>,
    act: DenseAct,
}

impl Dense {
    fn load(spec: &DenseSpec, device: &Device) -> Result<Self, ModelError> {
        let file = spec.dir.join("model.safetensors");
        // SAFETY: as for the transformer's weights (see `checkpoint`): mapped read-only.
        let vb = unsafe { VarBuilder::from_mmaped_safetensors(&[file], DType::F32, device)? };
        let vb = vb.pp("linear");
        let w = vb
            .get((spec.out_features, spec.in_features), "weight")?
            .t()?
            .contiguous()?;
        let b = if spec.bias {
            Some(vb.get(spec.out_features, "bias")?)
        } else {
            None
        };
        Ok(Self {
            w,
            b,
            act: spec.act,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor, ModelError> {
        let mut y = x.matmul(&self.w)?;
        if let Some(b) = &self.b {
            y = y.broadcast_add(b)?;
        }
        Ok(match self.act {
            DenseAct::Identity => y,
            DenseAct::Tanh => y.tanh()?,
            DenseAct::Gelu => y.gelu_erf()?,
            DenseAct::Relu => y.relu()?,
            DenseAct::Sigmoid => candle_nn::ops::sigmoid(&y)?,
            DenseAct::Silu => y.silu()?,
        })
    }
}

/// A sentence-transformers embedder loaded on one device. Blocking: call it from the
/// engine thread, never from the async runtime.
pub struct Embedder {
    model: Encoder,
    dense: Vec<Dense>,
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
        let whole = st.model.tokenizer.clone();
        let mut truncating = whole.clone();
        truncate_at(&mut truncating, st.info.max_seq_length)?;
        let vb = st.model.var_builder(dtype, device)?;
        let model = Encoder::load(&st.model.config, vb, dir)?;
        let dense = st
            .dense
            .iter()
            .map(|d| Dense::load(d, device))
            .collect::<Result<_, _>>()?;
        let mut info = st.info;
        info.identity.dtype = dtype;
        Ok(Self {
            model,
            dense,
            truncating,
            whole,
            info,
        })
    }

    /// Sets the most padded tokens per forward pass (at least one full-length text).
    pub fn set_batch_tokens(&mut self, tokens: usize) {
        self.info.batch_tokens = tokens.max(self.info.max_seq_length);
    }

    /// Quantizes the encoder's dense layers to int8 (f32 CPU models only); the Dense
    /// heads and everything between the layers stay f32.
    pub fn quantize_int8(&mut self) -> Result<(), ModelError> {
        self.model.quantize_int8()?;
        self.info.identity.int8 = true;
        Ok(())
    }

    /// Runs attention on the padded path (f16/bf16 on the CPU, `--gpu-attention
    /// padded` on cards) even on the CPU in f32: for tests that hold that path to the f32
    /// references.
    #[doc(hidden)]
    pub fn force_padded_attention(&mut self) {
        self.model.force_route(Route::Padded);
    }

    /// Runs attention on the varlen route cards take, on the CPU through the kernel's
    /// Rust twin (`varlen.rs`): for tests that hold its key ranges and head arithmetic to
    /// the f32 references.
    #[doc(hidden)]
    pub fn force_varlen_attention(&mut self) {
        self.model.force_route(Route::Varlen);
    }

    /// Which attention route the model takes on a card.
    pub(crate) fn set_attention(&mut self, attention: Attention) {
        self.model.set_attention(attention);
    }

    /// The model's description.
    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    /// The prompt a call's options resolve to: theirs, else the model's default.
    fn prompt<'a>(&'a self, opts: &'a EmbedOptions) -> &'a str {
        match &opts.prompt {
            Some(p) => p,
            None => self
                .info
                .default_prompt_name
                .as_ref()
                .and_then(|n| self.info.prompts.get(n))
                .map_or("", String::as_str),
        }
    }

    /// Tokenizes `texts`, each after the call's prompt, into rows, truncated at the
    /// model's limit, or refused with [`ModelError::TextTooLong`] when a text is over it
    /// and the call does not truncate. With `include_prompt: false` the prompt's tokens
    /// are marked to be left out of pooling, counted as sentence-transformers counts them:
    /// the prompt tokenized alone, special tokens included, less the last if it is a
    /// special token (so a leading `[CLS]` / `<s>` is left out with the prompt).
    pub(crate) fn encode(
        &self,
        texts: &[String],
        opts: &EmbedOptions,
    ) -> Result<Vec<Row>, ModelError> {
        let tok = if opts.truncate {
            &self.truncating
        } else {
            &self.whole
        };
        let prompt = self.prompt(opts);
        let skip = if prompt.is_empty() || self.info.include_prompt {
            0
        } else {
            let alone = tok
                .encode(prompt, true)
                .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
            let trailing_special = alone.get_special_tokens_mask().last() == Some(&1);
            alone.len() - usize::from(trailing_special)
        };
        // Texts go to the tokenizer as they are, as sentence-transformers sends them: a
        // byte-level BPE (ModernBERT, Qwen3) has tokens for spaces, so trimming would
        // change the result; XLM-R's Metaspace drops edge whitespace itself once the
        // loader has put WhitespaceSplit in front of it.
        let prompted: Vec<String>;
        let inputs: Vec<&str> = if prompt.is_empty() {
            texts.iter().map(String::as_str).collect()
        } else {
            prompted = texts.iter().map(|t| format!("{prompt}{t}")).collect();
            prompted.iter().map(String::as_str).collect()
        };
        let encodings = tok
            .encode_batch(inputs, true)
            .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        let rows: Vec<Row> = encodings
            .into_iter()
            .map(|e| Row::single(e.get_ids().to_vec()).skipping(skip))
            .collect();
        refuse_empty(&rows, "texts", "the model's pooling")?;
        let limit = self.info.max_seq_length;
        if let Some((index, t)) = rows.iter().enumerate().find(|(_, t)| t.len() > limit) {
            return Err(ModelError::TextTooLong {
                field: "texts",
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
        let rows = self.encode(texts, &opts)?;
        let token_counts = rows.iter().map(Row::len).collect();
        let limits = self.limits(MAX_BATCH_ROWS, std::time::Duration::ZERO);
        let vectors = run_now(self, &limits, rows)?;
        Ok(self.finish(vectors, token_counts, &opts))
    }

    /// Pipeline output of one call into its result: normalized when the call or the
    /// model's pipeline asks.
    pub(crate) fn finish(
        &self,
        mut vectors: Vec<Vec<f32>>,
        token_counts: Vec<usize>,
        opts: &EmbedOptions,
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
    /// Pooled vectors through any Dense layers, unnormalized, one per row.
    fn forward(&self, batch: &[&Row]) -> Result<Vec<Vec<f32>>, ModelError> {
        let mut pooled = self.model.forward(batch)?.pool(self.info.pooling)?;
        for d in &self.dense {
            pooled = d.forward(&pooled)?;
        }
        Ok(pooled.to_device(&Device::Cpu)?.to_vec2()?)
    }
}
