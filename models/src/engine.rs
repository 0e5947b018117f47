use std::{
    path::Path,
    sync::{mpsc, Arc},
    thread,
    time::Instant,
};

use candle_core::{DType, Device};
use tokio::sync::oneshot;

use crate::{
    batcher::{self, BatchCounters, Forward, Progress, Request, Row},
    st_dir::{read_json, MAX_BATCH_ROWS},
    CrossEncoder, CrossEncoderInfo, EmbedOptions, Embedder, Embeddings, ModelError, ModelInfo,
    Scores,
};

/// Where an engine runs its model.
#[derive(Debug, Clone)]
pub enum EngineDevice {
    /// The host CPU, float32.
    Cpu,
    /// A CUDA device by ordinal (only with the `cuda` feature).
    Cuda(usize),
}

/// How an engine loads its model.
#[derive(Debug, Clone, Copy)]
pub struct EngineOptions {
    /// Weights and activations dtype (f32 on CPU; f16 / bf16 on CUDA).
    pub dtype: DType,
    /// Embedders: most padded tokens per forward pass; `None` keeps the default.
    pub batch_tokens: Option<usize>,
    /// Most texts (or pairs) per forward pass; `None` keeps the default (32).
    pub batch_rows: Option<usize>,
    /// How long the engine waits for more activities to fill a batch once one is queued;
    /// zero runs each arrival as soon as the model is free.
    pub batch_wait: std::time::Duration,
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            dtype: DType::F32,
            batch_tokens: None,
            batch_rows: None,
            batch_wait: std::time::Duration::from_millis(2),
        }
    }
}

/// What an engine serves, and its description.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelKind {
    /// A sentence-transformers embedder.
    Embedder(ModelInfo),
    /// A cross-encoder (reranker).
    CrossEncoder(CrossEncoderInfo),
}

impl ModelKind {
    /// `embedder` or `cross-encoder`, for messages and listings.
    pub fn label(&self) -> &'static str {
        match self {
            ModelKind::Embedder(_) => "embedder",
            ModelKind::CrossEncoder(_) => "cross-encoder",
        }
    }

    /// Bytes the weights occupy at `dtype_bytes` per parameter.
    pub fn weight_bytes(&self, dtype_bytes: u64) -> u64 {
        match self {
            ModelKind::Embedder(i) => i.weight_bytes(dtype_bytes),
            ModelKind::CrossEncoder(i) => i.parameters * dtype_bytes,
        }
    }

    /// Working memory of one forward pass at the largest batch (see ARCHITECTURE.md).
    pub fn working_bytes(&self, dtype_bytes: u64) -> u64 {
        match self {
            ModelKind::Embedder(i) => i.working_bytes(dtype_bytes),
            ModelKind::CrossEncoder(i) => i.working_bytes(dtype_bytes),
        }
    }
}

/// The loaded model, shared by the engine thread (forward passes) and the handles
/// (tokenizing on the blocking pool, finishing results).
// Boxed: the two differ a lot in size.
enum Loaded {
    Embedder(Box<Embedder>),
    CrossEncoder(Box<CrossEncoder>),
}

impl Forward for Loaded {
    fn forward(&self, rows: &[&Row]) -> Result<Vec<Vec<f32>>, ModelError> {
        match self {
            Loaded::Embedder(m) => m.forward(rows),
            Loaded::CrossEncoder(m) => m.forward(rows),
        }
    }
}

/// One loaded model on one device, owned by a thread of its own so that inference never
/// blocks the async runtime. Concurrent calls are batched together (see the batcher
/// module). Clones share the thread; it stops when the last clone drops.
#[derive(Clone)]
pub struct Engine {
    name: Arc<str>,
    kind: Arc<ModelKind>,
    model: Arc<Loaded>,
    queue: mpsc::Sender<Request>,
    counters: Arc<BatchCounters>,
}

/// A cross-encoder's config.json names a `*ForSequenceClassification` architecture;
/// anything else is loaded as a sentence-transformers embedder.
fn is_cross_encoder(dir: &Path) -> Result<bool, ModelError> {
    let config: serde_json::Value = read_json(&dir.join("config.json"))?;
    Ok(config["architectures"][0]
        .as_str()
        .is_some_and(|a| a.ends_with("ForSequenceClassification")))
}

impl Engine {
    /// Loads the model in `dir` on `device` and starts its thread. Loading happens before
    /// this returns, so a model that cannot load is reported at start.
    pub fn start(
        name: &str,
        dir: &Path,
        device: &EngineDevice,
        opts: EngineOptions,
    ) -> Result<Self, ModelError> {
        let device = match device {
            EngineDevice::Cpu => Device::Cpu,
            EngineDevice::Cuda(ordinal) => Device::new_cuda(*ordinal)?,
        };
        let rows = opts.batch_rows.unwrap_or(MAX_BATCH_ROWS).max(1);
        let (model, kind, limits) = if is_cross_encoder(dir)? {
            let m = CrossEncoder::load(dir, &device, opts.dtype)?;
            let kind = ModelKind::CrossEncoder(m.info().clone());
            let mut limits = m.limits(rows, opts.batch_wait);
            if let Some(t) = opts.batch_tokens {
                limits.tokens = t;
            }
            (Loaded::CrossEncoder(Box::new(m)), kind, limits)
        } else {
            let mut m = Embedder::load(dir, &device, opts.dtype)?;
            if let Some(t) = opts.batch_tokens {
                m.set_batch_tokens(t);
            }
            let kind = ModelKind::Embedder(m.info().clone());
            let limits = m.limits(rows, opts.batch_wait);
            (Loaded::Embedder(Box::new(m)), kind, limits)
        };
        let model = Arc::new(model);
        // Unbounded: the runtime's slots bound how many calls can be waiting.
        let (tx, rx) = mpsc::channel::<Request>();
        let on_thread = model.clone();
        let counters = Arc::new(BatchCounters::default());
        let thread_counters = counters.clone();
        thread::Builder::new()
            .name(format!("engine-{name}"))
            .spawn(move || batcher::serve(&*on_thread, limits, rx, &thread_counters))
            .map_err(ModelError::Spawn)?;
        Ok(Self {
            name: name.into(),
            kind: Arc::new(kind),
            model,
            queue: tx,
            counters,
        })
    }

    /// The name this engine's model is served under.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its forward-pass counters (batches, rows, tokens, seconds), for metrics. A holder
    /// of the counters does not keep the engine (its thread and weights) alive.
    pub fn counters(&self) -> Arc<BatchCounters> {
        self.counters.clone()
    }

    /// What the model is.
    pub fn kind(&self) -> &ModelKind {
        &self.kind
    }

    /// Tokenizes on the blocking pool (it can take a while for big calls, and it runs in
    /// parallel with the engine thread's forward passes), then queues the rows.
    async fn submit(
        &self,
        encode: impl FnOnce(&Loaded) -> Result<Vec<Row>, ModelError> + Send + 'static,
        progress: &Progress,
    ) -> Result<(Vec<Vec<f32>>, Vec<usize>), ModelError> {
        let model = self.model.clone();
        let rows = tokio::task::spawn_blocking(move || encode(&model))
            .await
            .map_err(|e| ModelError::Tokenizer(format!("tokenizing panicked: {e}")))??;
        let token_counts = rows.iter().map(Row::len).collect();
        let (reply, rx) = oneshot::channel();
        let request = Request {
            rows,
            reply,
            progress: progress.clone(),
            span: tracing::Span::current(),
            arrived: Instant::now(),
        };
        self.queue
            .send(request)
            .map_err(|_| ModelError::EngineStopped)?;
        let out = rx.await.map_err(|_| ModelError::EngineStopped)??;
        Ok((out, token_counts))
    }

    /// Embeds `texts`, batched with other concurrent calls. `progress` counts finished
    /// texts. Dropping the future abandons the call: its texts leave the engine's queue.
    pub async fn embed(
        &self,
        texts: Vec<String>,
        opts: EmbedOptions,
        progress: &Progress,
    ) -> Result<Embeddings, ModelError> {
        if !matches!(*self.model, Loaded::Embedder(_)) {
            return Err(ModelError::WrongKind("a cross-encoder cannot embed"));
        }
        let (vectors, counts) = self
            .submit(
                move |m| match m {
                    Loaded::Embedder(e) => e.encode(&texts, opts.truncate),
                    Loaded::CrossEncoder(_) => unreachable!("checked above"),
                },
                progress,
            )
            .await?;
        match &*self.model {
            Loaded::Embedder(e) => Ok(e.finish(vectors, counts, opts)),
            Loaded::CrossEncoder(_) => unreachable!("checked above"),
        }
    }

    /// Scores `documents` against `query` (cross-encoders only), batched with other
    /// concurrent calls; `progress` counts finished documents.
    pub async fn score(
        &self,
        query: String,
        documents: Vec<String>,
        progress: &Progress,
    ) -> Result<Scores, ModelError> {
        if !matches!(*self.model, Loaded::CrossEncoder(_)) {
            return Err(ModelError::WrongKind("an embedder cannot rerank"));
        }
        let (rows, counts) = self
            .submit(
                move |m| match m {
                    Loaded::CrossEncoder(c) => c.encode(&query, &documents),
                    Loaded::Embedder(_) => unreachable!("checked above"),
                },
                progress,
            )
            .await?;
        Ok(Scores::from_rows(rows, counts))
    }
}
