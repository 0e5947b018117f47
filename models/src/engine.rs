use std::{path::Path, sync::Arc, thread};

use candle_core::{DType, Device};
use tokio::sync::{mpsc, oneshot};

use crate::{
    st_dir::read_json, CrossEncoder, CrossEncoderInfo, EmbedOptions, Embedder, Embeddings,
    ModelError, ModelInfo, Scores,
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

// Boxed: the two differ a lot in size and one lives per engine thread.
enum Loaded {
    Embedder(Box<Embedder>),
    CrossEncoder(Box<CrossEncoder>),
}

enum Work {
    Embed {
        texts: Vec<String>,
        opts: EmbedOptions,
        reply: oneshot::Sender<Result<Embeddings, ModelError>>,
    },
    Score {
        query: String,
        documents: Vec<String>,
        reply: oneshot::Sender<Result<Scores, ModelError>>,
    },
}

struct Job {
    work: Work,
    span: tracing::Span,
}

/// One loaded model on one device, owned by a thread of its own so that inference never
/// blocks the async runtime. Clones share the thread; it stops when the last clone drops.
#[derive(Clone)]
pub struct Engine {
    name: Arc<str>,
    kind: Arc<ModelKind>,
    jobs: mpsc::Sender<Job>,
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
        let (model, kind) = if is_cross_encoder(dir)? {
            let m = CrossEncoder::load(dir, &device, opts.dtype)?;
            let kind = ModelKind::CrossEncoder(m.info().clone());
            (Loaded::CrossEncoder(Box::new(m)), kind)
        } else {
            let mut m = Embedder::load(dir, &device, opts.dtype)?;
            if let Some(t) = opts.batch_tokens {
                m.set_batch_tokens(t);
            }
            let kind = ModelKind::Embedder(m.info().clone());
            (Loaded::Embedder(Box::new(m)), kind)
        };
        // A short queue: activities wait here for the model, already holding their slot.
        let (tx, mut rx) = mpsc::channel::<Job>(64);
        thread::Builder::new()
            .name(format!("engine-{name}"))
            .spawn(move || {
                while let Some(job) = rx.blocking_recv() {
                    let _enter = job.span.enter();
                    // A caller that gave up (cancelled, timed out) no longer waits: skip it.
                    match (job.work, &model) {
                        (Work::Embed { texts, opts, reply }, Loaded::Embedder(m)) => {
                            if !reply.is_closed() {
                                let _ =
                                    reply.send(m.embed(&texts, opts).map_err(ModelError::classify));
                            }
                        }
                        (
                            Work::Score {
                                query,
                                documents,
                                reply,
                            },
                            Loaded::CrossEncoder(m),
                        ) => {
                            if !reply.is_closed() {
                                let _ = reply.send(
                                    m.score(&query, &documents).map_err(ModelError::classify),
                                );
                            }
                        }
                        (Work::Embed { reply, .. }, _) => {
                            let _ = reply
                                .send(Err(ModelError::WrongKind("a cross-encoder cannot embed")));
                        }
                        (Work::Score { reply, .. }, _) => {
                            let _ =
                                reply.send(Err(ModelError::WrongKind("an embedder cannot rerank")));
                        }
                    }
                }
            })
            .map_err(ModelError::Spawn)?;
        Ok(Self {
            name: name.into(),
            kind: Arc::new(kind),
            jobs: tx,
        })
    }

    /// The name this engine's model is served under.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// What the model is.
    pub fn kind(&self) -> &ModelKind {
        &self.kind
    }

    async fn submit<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<Result<T, ModelError>>) -> Work,
    ) -> Result<T, ModelError> {
        let (reply, rx) = oneshot::channel();
        let job = Job {
            work: make(reply),
            span: tracing::Span::current(),
        };
        self.jobs
            .send(job)
            .await
            .map_err(|_| ModelError::EngineStopped)?;
        rx.await.map_err(|_| ModelError::EngineStopped)?
    }

    /// Embeds `texts` on the engine thread. Dropping the future abandons the call; if the
    /// engine has not started it, it never runs.
    pub async fn embed(
        &self,
        texts: Vec<String>,
        opts: EmbedOptions,
    ) -> Result<Embeddings, ModelError> {
        self.submit(|reply| Work::Embed { texts, opts, reply })
            .await
    }

    /// Scores `documents` against `query` on the engine thread (cross-encoders only).
    pub async fn score(&self, query: String, documents: Vec<String>) -> Result<Scores, ModelError> {
        self.submit(|reply| Work::Score {
            query,
            documents,
            reply,
        })
        .await
    }
}
