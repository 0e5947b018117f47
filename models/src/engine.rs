use std::{
    fmt,
    path::Path,
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        mpsc, Arc,
    },
    thread,
    time::{Duration, Instant},
};

use candle_core::{DType, Device};
use tokio::sync::{oneshot, watch};

use crate::{
    batcher::{self, BatchCounters, BatchObserver, Forward, Progress, Request, Row},
    encoder::Attention,
    st_dir::{read_json, MAX_BATCH_ROWS},
    tokenizing::Tokenizing,
    CrossEncoder, CrossEncoderInfo, EmbedOptions, Embedder, Embeddings, ModelError, ModelIdentity,
    ModelInfo, Scores,
};

/// Where an engine runs its model.
#[derive(Debug, Clone)]
pub enum EngineDevice {
    /// The host CPU, float32.
    Cpu,
    /// A CUDA device by ordinal (only with the `cuda` feature).
    Cuda(usize),
}

impl EngineDevice {
    /// candle's device for it (a CUDA context, for a card).
    pub fn open(&self) -> Result<Device, ModelError> {
        Ok(match self {
            EngineDevice::Cpu => Device::Cpu,
            EngineDevice::Cuda(ordinal) => Device::new_cuda(*ordinal)?,
        })
    }
}

/// How an engine loads its model.
#[derive(Clone)]
pub struct EngineOptions {
    /// Weights and activations dtype (f32 on CPU; f16 / bf16 on CUDA).
    pub dtype: DType,
    /// Quantize the dense layers to dynamic int8 at load: opt-in, CPU and f32 only.
    pub int8: bool,
    /// How attention runs on a card (the CPU in f32 always runs its packed kernel).
    pub attention: Attention,
    /// Embedders: most padded tokens per forward pass; `None` keeps the default.
    pub batch_tokens: Option<usize>,
    /// Most texts (or pairs) per forward pass; `None` keeps the default (32).
    pub batch_rows: Option<usize>,
    /// How long the engine waits for more activities to fill a batch once one is queued;
    /// zero runs each arrival as soon as the model is free.
    pub batch_wait: Duration,
    /// Told about every forward pass and queue wait (the runtime's metrics), besides the
    /// engine's own [`BatchCounters`].
    pub observer: Option<Arc<dyn BatchObserver>>,
    /// Honour [`Engine::inject_panic`]: for tests of supervision only, never in service.
    pub fault_hooks: bool,
    /// Told the working memory of every forward pass before and after it runs (a
    /// simulated card accounts it, and may refuse it as out of memory).
    pub memory: Option<Arc<dyn DeviceMemory>>,
    /// Tokenization slots shared with the process's other engines; `None` tokenizes
    /// every call at once.
    pub tokenizing: Option<Arc<Tokenizing>>,
}

/// The device memory a forward pass takes, told before and after each pass on the engine
/// thread. A simulated card keeps its used memory from it, so that admission can be
/// checked against what engines really hold without a GPU. Implementations must be quick.
pub trait DeviceMemory: Send + Sync {
    /// A pass that needs `bytes` of working memory is about to run. An error fails the
    /// pass as out of memory, as CUDA's allocator would.
    fn take(&self, bytes: u64) -> Result<(), String>;
    /// The pass that took `bytes` has ended, however it ended.
    fn give_back(&self, bytes: u64);
    /// Weights of `bytes` are loaded and stay for the engine's life. Not checked against
    /// the room left: loading has already succeeded or failed by then.
    fn hold(&self, bytes: u64);
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            dtype: DType::F32,
            int8: false,
            attention: Attention::default(),
            batch_tokens: None,
            batch_rows: None,
            batch_wait: Duration::from_millis(2),
            observer: None,
            fault_hooks: false,
            memory: None,
            tokenizing: None,
        }
    }
}

impl fmt::Debug for EngineOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EngineOptions")
            .field("dtype", &self.dtype)
            .field("int8", &self.int8)
            .field("attention", &self.attention)
            .field("batch_tokens", &self.batch_tokens)
            .field("batch_rows", &self.batch_rows)
            .field("batch_wait", &self.batch_wait)
            .field("observer", &self.observer.is_some())
            .field("fault_hooks", &self.fault_hooks)
            .field("memory", &self.memory.is_some())
            .field("tokenizing", &self.tokenizing.is_some())
            .finish()
    }
}

/// The engine's own counters and the runtime's observer, both told of every batch.
struct Observers {
    counters: Arc<BatchCounters>,
    extra: Option<Arc<dyn BatchObserver>>,
    /// Whether the engine's passes run on the CPU, whose kernel buffers an idle engine
    /// frees (a card's engine leaves CPU engines' buffers, and candle's pool, alone).
    cpu: bool,
}

impl BatchObserver for Observers {
    fn started(&self) {
        self.counters.started();
        if let Some(o) = &self.extra {
            o.started();
        }
    }

    fn batch(&self, rows: usize, tokens: usize, took: Duration) {
        self.counters.batch(rows, tokens, took);
        if let Some(o) = &self.extra {
            o.batch(rows, tokens, took);
        }
    }

    fn queued(&self, waited: Duration) {
        if let Some(o) = &self.extra {
            o.queued(waited);
        }
    }

    fn idle(&self) {
        // On every thread of the pool the CPU passes run on (see `Driven::pass`), so that
        // the fused steps' per-thread buffers are freed before the observer trims the heap.
        if self.cpu {
            Device::Cpu.with_context(|| {
                rayon::broadcast(|_| {
                    crate::attention::release_thread_buffer();
                    crate::feed_forward::release_thread_buffer();
                })
            });
        }
        if let Some(o) = &self.extra {
            o.idle();
        }
    }
}

/// The model as the engine thread drives it, with the test-only fault hook in front.
struct Driven {
    model: Arc<Loaded>,
    panic_next: Arc<AtomicBool>,
    kind: Arc<ModelKind>,
    dtype_bytes: u64,
    memory: Option<Arc<dyn DeviceMemory>>,
    /// The model's device, whose context each pass runs in (see [`Driven::pass`]).
    device: Device,
}

impl Driven {
    /// One forward pass, in candle's device context. On the CPU that runs the whole pass on
    /// a worker of candle's own rayon pool, instead of each of its parallel ops (every
    /// matmul, attention and row kernel) being handed over from this thread and waited for:
    /// that hand-off woke a worker and put this thread to sleep per op, and left three
    /// threads contending for the cores. On 2 cores it made one-row passes 1.2-1.4x slower
    /// (benches/RESULTS.md, "One pass on the pool"). A card's context is this thread.
    fn pass(&self, rows: &[&Row]) -> Result<Vec<Vec<f32>>, ModelError> {
        self.device.with_context(|| self.model.forward(rows))
    }
}

impl Forward for Driven {
    fn forward(&self, rows: &[&Row]) -> Result<Vec<Vec<f32>>, ModelError> {
        if self.panic_next.swap(false, Ordering::Relaxed) {
            panic!("engine fault injected by Engine::inject_panic (a supervision test hook)");
        }
        let Some(memory) = &self.memory else {
            return self.pass(rows);
        };
        let longest = rows.iter().map(|r| r.len()).max().unwrap_or(0);
        let bytes = self
            .kind
            .pass_bytes(rows.len() * longest, longest, self.dtype_bytes);
        memory.take(bytes).map_err(ModelError::OutOfMemory)?;
        let _give_back = GiveBack(memory.clone(), bytes);
        self.pass(rows)
    }
}

/// Memory taken from a [`DeviceMemory`], given back however the work ends, a panic
/// included.
pub(crate) struct GiveBack(pub Arc<dyn DeviceMemory>, pub u64);

impl Drop for GiveBack {
    fn drop(&mut self) {
        self.0.give_back(self.1);
    }
}

/// Whether an engine's thread still runs, without keeping the engine alive: supervisors
/// hold this, not the [`Engine`], so that dropping every engine still ends its thread.
#[derive(Clone)]
pub struct EngineLife(watch::Receiver<()>);

impl EngineLife {
    /// False once the thread has ended (it panicked, or every engine handle was dropped).
    pub fn is_alive(&self) -> bool {
        self.0.has_changed().is_ok()
    }

    /// Resolves when the thread ends.
    pub async fn ended(mut self) {
        while self.0.changed().await.is_ok() {}
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

    /// Which model this is.
    pub fn identity(&self) -> &ModelIdentity {
        match self {
            ModelKind::Embedder(i) => &i.identity,
            ModelKind::CrossEncoder(i) => &i.identity,
        }
    }

    /// Bytes the weights occupy at `dtype_bytes` per parameter.
    pub fn weight_bytes(&self, dtype_bytes: u64) -> u64 {
        match self {
            ModelKind::Embedder(i) => i.weight_bytes(dtype_bytes),
            ModelKind::CrossEncoder(i) => i.identity.parameters * dtype_bytes,
        }
    }

    /// Working memory of one forward pass over `tokens` tokens (padding included) whose
    /// longest row has `longest`, by the formula of [`ModelKind::working_bytes`].
    pub fn pass_bytes(&self, tokens: usize, longest: usize, dtype_bytes: u64) -> u64 {
        let (hidden, inter, heads) = match self {
            ModelKind::Embedder(i) => (i.hidden_size, i.intermediate_size, i.num_heads),
            ModelKind::CrossEncoder(i) => (i.hidden_size, i.intermediate_size, i.num_heads),
        };
        crate::st_dir::working_bytes(tokens, longest, hidden, inter, heads, dtype_bytes)
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
    life: EngineLife,
    pending: Arc<AtomicUsize>,
    panic_next: Arc<AtomicBool>,
    fault_hooks: bool,
    tokenizing: Option<Arc<Tokenizing>>,
}

/// Whether an engine has work, read from any thread (see [`Engine::load`]).
#[derive(Clone, Default)]
pub struct EngineLoad(Arc<AtomicUsize>);

impl EngineLoad {
    /// Rows of calls waiting for or in the engine now.
    pub fn rows(&self) -> usize {
        self.0.load(Ordering::Relaxed)
    }

    /// A load that reads `rows`, for tests of admission.
    pub fn fixed(rows: Arc<AtomicUsize>) -> Self {
        Self(rows)
    }
}

/// Takes a call's rows off the engine's pending count when the call ends, however it
/// ends (answered, failed, or abandoned by a dropped future).
struct PendingRows(Arc<AtomicUsize>, usize);

impl Drop for PendingRows {
    fn drop(&mut self) {
        self.0.fetch_sub(self.1, Ordering::Relaxed);
    }
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
        if opts.int8 && (!matches!(device, EngineDevice::Cpu) || opts.dtype != DType::F32) {
            return Err(ModelError::Unsupported {
                path: dir.to_owned(),
                reason: format!(
                    "int8 quantizes f32 weights on the CPU, not {} on {device:?}",
                    opts.dtype.as_str()
                ),
            });
        }
        if opts.int8 && !crate::int8::tuned() {
            tracing::warn!(model = name, "int8 on a CPU without AVX2 runs the portable kernel, which is not tuned: f32 may be faster here");
        }
        let device = device.open()?;
        let rows = opts.batch_rows.unwrap_or(MAX_BATCH_ROWS).max(1);
        let (model, kind, limits) = if is_cross_encoder(dir)? {
            let mut m = CrossEncoder::load(dir, &device, opts.dtype)?;
            if opts.int8 {
                m.quantize_int8()?;
            }
            m.set_attention(opts.attention);
            let kind = ModelKind::CrossEncoder(m.info().clone());
            let mut limits = m.limits(rows, opts.batch_wait);
            if let Some(t) = opts.batch_tokens {
                limits.tokens = t;
            }
            (Loaded::CrossEncoder(Box::new(m)), kind, limits)
        } else {
            let mut m = Embedder::load(dir, &device, opts.dtype)?;
            if opts.int8 {
                m.quantize_int8()?;
            }
            m.set_attention(opts.attention);
            if let Some(t) = opts.batch_tokens {
                m.set_batch_tokens(t);
            }
            let kind = ModelKind::Embedder(m.info().clone());
            let limits = m.limits(rows, opts.batch_wait);
            (Loaded::Embedder(Box::new(m)), kind, limits)
        };
        let model = Arc::new(model);
        let kind = Arc::new(kind);
        // Unbounded: the runtime's slots bound how many calls can be waiting.
        let (tx, rx) = mpsc::channel::<Request>();
        let panic_next = Arc::new(AtomicBool::new(false));
        let driven = Driven {
            model: model.clone(),
            panic_next: panic_next.clone(),
            kind: kind.clone(),
            dtype_bytes: opts.dtype.size_in_bytes() as u64,
            memory: opts.memory.clone(),
            device: device.clone(),
        };
        let counters = Arc::new(BatchCounters::default());
        let observers = Observers {
            counters: counters.clone(),
            extra: opts.observer.clone(),
            cpu: device.is_cpu(),
        };
        // The thread owns the sender; when the thread ends, by a panic too, it drops and
        // every EngineLife sees it.
        let (alive, life) = watch::channel(());
        thread::Builder::new()
            .name(format!("engine-{name}"))
            .spawn(move || {
                let _alive = alive;
                batcher::serve(&driven, limits, rx, &observers)
            })
            .map_err(ModelError::Spawn)?;
        Ok(Self {
            name: name.into(),
            kind,
            model,
            queue: tx,
            counters,
            life: EngineLife(life),
            pending: Arc::default(),
            panic_next,
            fault_hooks: opts.fault_hooks,
            tokenizing: opts.tokenizing,
        })
    }

    /// Watches the engine's thread without keeping the engine alive.
    pub fn life(&self) -> EngineLife {
        self.life.clone()
    }

    /// Rows of calls waiting for or in the engine now.
    pub fn pending_rows(&self) -> usize {
        self.pending.load(Ordering::Relaxed)
    }

    /// A reader of [`Engine::pending_rows`] that does not keep the engine alive: card
    /// admission holds one per engine to know which engines have work (and so a working
    /// set in use).
    pub fn load(&self) -> EngineLoad {
        EngineLoad(self.pending.clone())
    }

    /// Makes the engine thread panic at its next forward pass, if the engine was started
    /// with `fault_hooks`; returns whether it will. Supervision tests use it to kill an
    /// engine the way a bug would.
    pub fn inject_panic(&self) -> bool {
        if self.fault_hooks {
            self.panic_next.store(true, Ordering::Relaxed);
        }
        self.fault_hooks
    }

    /// A tiny forward pass (one short text, or one pair), as health checks run it; it is
    /// not counted in the engine's batch metrics.
    pub async fn probe(&self) -> Result<(), ModelError> {
        let progress = Progress::default();
        match &*self.model {
            Loaded::Embedder(_) => self
                .embed_call(
                    vec!["ok".to_owned()],
                    EmbedOptions::default(),
                    &progress,
                    true,
                )
                .await
                .map(drop),
            Loaded::CrossEncoder(_) => self
                .score_call("ok".to_owned(), vec!["ok".to_owned()], &progress, true, 0)
                .await
                .map(drop),
        }
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

    /// Tokenizes `chars` characters on the blocking pool (it can take a while for big
    /// calls, and it runs in parallel with the engine thread's forward passes), in one of
    /// the process's tokenizing slots, then queues the rows.
    async fn submit(
        &self,
        chars: usize,
        encode: impl FnOnce(&Loaded) -> Result<Vec<Row>, ModelError> + Send + 'static,
        progress: &Progress,
        probe: bool,
        priority: i32,
        field: &'static str,
    ) -> Result<(Vec<Vec<f32>>, Vec<usize>), ModelError> {
        let model = self.model.clone();
        let encode = move || encode(&model);
        let rows = match &self.tokenizing {
            Some(t) => t.run(chars, encode).await?,
            None => crate::tokenizing::blocking(encode).await?,
        };
        let token_counts = rows.iter().map(Row::len).collect();
        self.pending.fetch_add(rows.len(), Ordering::Relaxed);
        let _pending = PendingRows(self.pending.clone(), rows.len());
        let (reply, rx) = oneshot::channel();
        let request = Request {
            rows,
            reply,
            progress: progress.clone(),
            span: tracing::Span::current(),
            arrived: Instant::now(),
            probe,
            priority,
        };
        self.queue
            .send(request)
            .map_err(|_| ModelError::EngineStopped)?;
        let out = rx.await.map_err(|_| ModelError::EngineStopped)??;
        if let Some(index) = out.iter().position(|v| v.iter().any(|x| !x.is_finite())) {
            return Err(self.non_finite(field, index));
        }
        Ok((out, token_counts))
    }

    /// The failure for an output that is not finite, with the likely cause for the model's
    /// precision: f16 overflows where f32 does not; bf16 and f32 (int8 keeps activations in
    /// f32) share a range, so there the checkpoint is the suspect. What to do about it is
    /// the activities layer's to say (it knows the lanes and the models file).
    fn non_finite(&self, field: &'static str, index: usize) -> ModelError {
        let identity = self.kind.identity();
        let cause = match identity.dtype {
            DType::F16 => "most likely f16 overflowed (it tops out at 65,504), else the checkpoint holds NaN or infinite values",
            // bf16 has f32's range: overflow is as unlikely as in f32.
            _ => "the checkpoint most likely holds NaN or infinite values (f32's range does not overflow on sane weights)",
        };
        ModelError::NonFiniteOutput {
            field,
            index,
            precision: identity.precision(),
            cause,
        }
    }

    /// Embeds `texts`, batched with other concurrent calls. `progress` counts finished
    /// texts. Dropping the future abandons the call: its texts leave the engine's queue.
    pub async fn embed(
        &self,
        texts: Vec<String>,
        opts: EmbedOptions,
        progress: &Progress,
    ) -> Result<Embeddings, ModelError> {
        self.embed_call(texts, opts, progress, false).await
    }

    async fn embed_call(
        &self,
        texts: Vec<String>,
        opts: EmbedOptions,
        progress: &Progress,
        probe: bool,
    ) -> Result<Embeddings, ModelError> {
        if !matches!(*self.model, Loaded::Embedder(_)) {
            return Err(ModelError::WrongKind("a cross-encoder cannot embed"));
        }
        let call_opts = opts.clone();
        let priority = opts.priority;
        let chars = texts.iter().map(|t| t.chars().count()).sum();
        let (vectors, counts) = self
            .submit(
                chars,
                move |m| match m {
                    Loaded::Embedder(e) => e.encode(&texts, &call_opts),
                    Loaded::CrossEncoder(_) => unreachable!("checked above"),
                },
                progress,
                probe,
                priority,
                "texts",
            )
            .await?;
        match &*self.model {
            Loaded::Embedder(e) => Ok(e.finish(vectors, counts, &opts)),
            Loaded::CrossEncoder(_) => unreachable!("checked above"),
        }
    }

    /// Scores `documents` against `query` (cross-encoders only), batched with other
    /// concurrent calls; `progress` counts finished documents; lower `priority` runs
    /// first.
    pub async fn score(
        &self,
        query: String,
        documents: Vec<String>,
        progress: &Progress,
        priority: i32,
    ) -> Result<Scores, ModelError> {
        self.score_call(query, documents, progress, false, priority)
            .await
    }

    async fn score_call(
        &self,
        query: String,
        documents: Vec<String>,
        progress: &Progress,
        probe: bool,
        priority: i32,
    ) -> Result<Scores, ModelError> {
        if !matches!(*self.model, Loaded::CrossEncoder(_)) {
            return Err(ModelError::WrongKind("an embedder cannot rerank"));
        }
        // Each pair holds the query again.
        let query_chars = query.chars().count();
        let chars = documents
            .iter()
            .map(|d| d.chars().count() + query_chars)
            .sum();
        let (rows, counts) = self
            .submit(
                chars,
                move |m| match m {
                    Loaded::CrossEncoder(c) => c.encode(&query, &documents),
                    Loaded::Embedder(_) => unreachable!("checked above"),
                },
                progress,
                probe,
                priority,
                "documents",
            )
            .await?;
        Ok(Scores::from_rows(rows, counts))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    // What `Driven::pass` relies on candle's CPU context for: if it stopped moving the
    // work onto a rayon worker, every pass would hand its ops over one by one again.
    #[test]
    fn a_cpu_pass_runs_on_a_rayon_worker() {
        // The engine thread is not a rayon worker; the pass must be, so that its parallel
        // ops start where they run instead of being handed over one by one.
        let cpu = std::thread::spawn(|| Device::Cpu.with_context(rayon::current_thread_index))
            .join()
            .unwrap();
        assert!(cpu.is_some(), "a CPU pass ran off rayon's pool");
    }

    #[test]
    fn a_panic_in_a_pooled_pass_reaches_the_engine_thread() {
        let caught = std::thread::spawn(|| {
            std::panic::catch_unwind(|| Device::Cpu.with_context(|| panic!("injected")))
        })
        .join()
        .unwrap();
        assert!(caught.is_err());
    }
}
