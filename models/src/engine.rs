use std::{path::Path, sync::Arc, thread};

use candle_core::{DType, Device};
use tokio::sync::{mpsc, oneshot};

use crate::{EmbedOptions, Embedder, Embeddings, ModelError, ModelInfo};

/// Where an engine runs its model.
#[derive(Debug, Clone)]
pub enum EngineDevice {
    /// The host CPU, float32.
    Cpu,
    /// A CUDA device by ordinal (only with the `cuda` feature).
    Cuda(usize),
}

struct Job {
    texts: Vec<String>,
    opts: EmbedOptions,
    reply: oneshot::Sender<Result<Embeddings, ModelError>>,
    span: tracing::Span,
}

/// One loaded model on one device, owned by a thread of its own so that inference never
/// blocks the async runtime. Clones share the thread; it stops when the last clone drops.
#[derive(Clone)]
pub struct Engine {
    name: Arc<str>,
    info: Arc<ModelInfo>,
    jobs: mpsc::Sender<Job>,
}

impl Engine {
    /// Loads the model in `dir` on `device` and starts its thread. Loading happens before
    /// this returns, so a model that cannot load is reported at start.
    pub fn start(name: &str, dir: &Path, device: &EngineDevice) -> Result<Self, ModelError> {
        let device = match device {
            EngineDevice::Cpu => Device::Cpu,
            EngineDevice::Cuda(ordinal) => Device::new_cuda(*ordinal)?,
        };
        let embedder = Embedder::load(dir, &device, DType::F32)?;
        let info = Arc::new(embedder.info().clone());
        // A short queue: activities wait here for the model, already holding their slot.
        let (tx, mut rx) = mpsc::channel::<Job>(64);
        thread::Builder::new()
            .name(format!("engine-{name}"))
            .spawn(move || {
                while let Some(job) = rx.blocking_recv() {
                    // A caller that gave up (cancelled, timed out) no longer waits: skip it.
                    if job.reply.is_closed() {
                        continue;
                    }
                    let _enter = job.span.enter();
                    let out = embedder
                        .embed(&job.texts, job.opts)
                        .map_err(ModelError::classify);
                    let _ = job.reply.send(out);
                }
            })
            .map_err(ModelError::Spawn)?;
        Ok(Self {
            name: name.into(),
            info,
            jobs: tx,
        })
    }

    /// The name this engine's model is served under.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The model's description.
    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    /// Embeds `texts` on the engine thread. Dropping the future abandons the call; if the
    /// engine has not started it, it never runs.
    pub async fn embed(
        &self,
        texts: Vec<String>,
        opts: EmbedOptions,
    ) -> Result<Embeddings, ModelError> {
        let (reply, rx) = oneshot::channel();
        let job = Job {
            texts,
            opts,
            reply,
            span: tracing::Span::current(),
        };
        self.jobs
            .send(job)
            .await
            .map_err(|_| ModelError::EngineStopped)?;
        rx.await.map_err(|_| ModelError::EngineStopped)?
    }
}
