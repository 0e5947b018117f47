use std::sync::Arc;

use base64::Engine as _;
use gpulane_models::{EmbedOptions, Engine, ModelKind, Progress};
use gpulane_proto::{
    activity, model_queue, valid_model_name, DeviceInfo, EmbedRequest, EmbedResponse,
    EmbeddingsOut, RerankRequest, RerankResponse, RerankResult, Usage, MODEL_NAME_MAX,
};

use crate::{
    dataset::{DataRoots, DatasetMemory, DatasetObserver},
    embed::parse_embed,
    input::{invalid, quote},
    rerank::parse_rerank,
    ActivityError, Limits,
};

/// With fault hooks on (the runtime's hidden `--test-faults`), an `embed` whose first text
/// is this kills the model's engine thread, as a bug in a forward pass would.
const FAULT_ENGINE_PANIC: &str = "gpulane-test-fault:engine-panic";
/// With fault hooks on, an `embed` whose first text is this panics inside the activity.
const FAULT_ACTIVITY_PANIC: &str = "gpulane-test-fault:activity-panic";

/// The kind of queue a task came on, which decides what a model this worker lacks means.
/// The queue name is the capability contract: every worker polling a queue must be able
/// to serve what arrives there, or must hand it back for another worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// A shared lane (`gpu-tools`, `cpu-tools`), named here. Workers with other models
    /// may poll it, so a model this worker lacks is handed back, retryably
    /// ([`ActivityError::ModelNotServed`]).
    Shared(String),
    /// A model queue (`gpu-tools@<model>`): only workers serving the model poll it, and a
    /// task there uses that model.
    Model {
        /// The queue.
        queue: String,
        /// The model it serves.
        model: String,
    },
    /// A device's private queue: only this worker polls it, so a model it lacks fails
    /// for good ([`ActivityError::UnknownModel`]).
    Private,
}

/// What one activity did: the model it used (known once the input named one this worker
/// serves, for metrics) and its JSON result or error.
#[derive(Debug)]
pub struct Ran {
    /// The served model's name, when the activity got that far.
    pub model: Option<String>,
    /// The JSON result, or why it failed.
    pub result: Result<Vec<u8>, ActivityError>,
}

/// How one task reached this worker: its queue's kind, its progress (for heartbeats), the
/// details of the last heartbeat of an earlier attempt, and its Temporal priority.
pub struct Call<'a> {
    /// The kind of queue the task came on.
    pub route: &'a Route,
    /// Counts rows done and carries a job's heartbeat details.
    pub progress: &'a Progress,
    /// The last heartbeat's details of an earlier attempt (JSON), if any: where a retried
    /// `embed_dataset` resumes.
    pub last_heartbeat: Option<&'a [u8]>,
    /// Temporal's priority key, 1 (most urgent) to 5; unset (0) means the default, 3.
    pub priority_key: i32,
}

impl Call<'_> {
    /// The engine priority: the priority key, with Temporal's default for unset.
    pub(crate) fn priority(&self) -> i32 {
        if self.priority_key <= 0 {
            3
        } else {
            self.priority_key
        }
    }
}

/// The embedding options `embed` and `embed_dataset` share.
pub(crate) struct EmbedSpec {
    pub normalize: Option<bool>,
    pub truncate: Option<bool>,
    pub dimensions: Option<usize>,
    pub prompt: Option<String>,
    pub prompt_name: Option<String>,
}

impl EmbedSpec {
    /// The options checked against `engine`'s model (dimensions, prompt names), before any
    /// text is embedded.
    pub(crate) fn resolve(&self, engine: &Engine) -> Result<Resolved, ActivityError> {
        let ModelKind::Embedder(info) = engine.kind() else {
            unreachable!("embedding options are resolved for embedders only; this is a bug")
        };
        let full = info.dimensions;
        let dimensions = match self.dimensions {
            Some(d) if d > full || d == 0 => {
                return Err(ActivityError::InvalidInput(format!(
                    "field \"dimensions\" is {d}, outside 1 to the model's {full}: pass at most {full} or omit it"
                )))
            }
            Some(d) => d,
            None => full,
        };
        let prefix = match (&self.prompt, &self.prompt_name) {
            (Some(p), _) => Some(p.clone()),
            (None, Some(name)) => Some(info.prompts.get(name).cloned().ok_or_else(|| {
                ActivityError::InvalidInput(format!(
                    "field \"prompt_name\" is {}; this model's prompts are {:?} (config_sentence_transformers.json); or pass \"prompt\" text",
                    quote(name),
                    info.prompts.keys().collect::<Vec<_>>()
                ))
            })?),
            (None, None) => None,
        };
        // No prompt named: the model's default prompt (if it has one) applies, in the
        // models layer, and counts against the limits like any other.
        let default_prompt = info
            .default_prompt_name
            .as_ref()
            .and_then(|n| info.prompts.get(n))
            .cloned();
        Ok(Resolved {
            dimensions,
            full,
            normalize: self.normalize.unwrap_or(info.normalize),
            truncate: self.truncate.unwrap_or(true),
            prefix,
            default_prompt,
        })
    }
}

/// [`EmbedSpec`] checked against a model: what its texts are embedded with.
pub(crate) struct Resolved {
    /// The width the vectors are cut to.
    pub dimensions: usize,
    /// The model's own width.
    full: usize,
    normalize: bool,
    truncate: bool,
    /// The caller's prompt, given or named.
    prefix: Option<String>,
    /// The model's default prompt, which the models layer applies when `prefix` is none.
    default_prompt: Option<String>,
}

impl Resolved {
    /// The prompt that goes before every text, if any: it counts against the limits.
    pub(crate) fn prompt_in_effect(&self) -> Option<&str> {
        self.prefix.as_deref().or(self.default_prompt.as_deref())
    }
}

/// Vectors of one call after the options: cut to `dimensions`, normalized as asked.
pub(crate) struct Embedded {
    pub vectors: Vec<Vec<f32>>,
    pub token_counts: Vec<usize>,
    pub dimensions: usize,
}

/// Which kind of model an activity needs.
#[derive(Clone, Copy)]
enum Need {
    Embedder,
    CrossEncoder,
}

impl Need {
    fn fits(self, kind: &ModelKind) -> bool {
        matches!(
            (self, kind),
            (Need::Embedder, ModelKind::Embedder(_))
                | (Need::CrossEncoder, ModelKind::CrossEncoder(_))
        )
    }

    fn label(self) -> &'static str {
        match self {
            Need::Embedder => "embedder",
            Need::CrossEncoder => "cross-encoder",
        }
    }
}

/// The models one device serves, by name. The first is the default embedder.
#[derive(Clone, Default)]
pub struct ModelSet {
    engines: Vec<Engine>,
}

impl ModelSet {
    /// A set from engines already started on one device, in declaration order.
    pub fn new(engines: Vec<Engine>) -> Self {
        Self { engines }
    }

    /// The engines, in declaration order.
    pub fn engines(&self) -> &[Engine] {
        &self.engines
    }

    /// The served names, in declaration order.
    pub fn names(&self) -> Vec<String> {
        self.engines.iter().map(|e| e.name().to_owned()).collect()
    }

    /// The engine for `name`, or the default of the needed kind when `name` is absent,
    /// judged by the queue the task came on (see [`Route`]).
    fn get(&self, name: Option<&str>, need: Need, route: &Route) -> Result<&Engine, ActivityError> {
        let of_kind = || -> Vec<String> {
            self.engines
                .iter()
                .filter(|e| need.fits(e.kind()))
                .map(|e| e.name().to_owned())
                .collect()
        };
        // A model this worker lacks: handed back on a shared queue, final elsewhere.
        let missing = |shown: String, named: Option<&str>| match route {
            Route::Shared(queue) => ActivityError::ModelNotServed {
                name: shown,
                known: self.names(),
                queue: queue.clone(),
                model_queue: named
                    .map_or_else(|| format!("{queue}@<model>"), |n| model_queue(queue, n)),
            },
            Route::Model { .. } | Route::Private => ActivityError::UnknownModel {
                name: shown,
                known: self.names(),
            },
        };
        let wanted = match (name, route) {
            (Some(n), _) if !valid_model_name(n) => {
                return Err(invalid(format!(
                    "field \"model\" is {}, which is not a model name (1 to {MODEL_NAME_MAX} \
                     ASCII letters, digits, '-', '_' or '.'); pass a served model's name or omit it",
                    quote(n)
                )))
            }
            (Some(n), Route::Model { model, queue }) if n != model => {
                return Err(invalid(format!(
                    "field \"model\" is {} but the task came on {queue:?}, the queue of model \
                     {model:?}: omit \"model\" there, or schedule the task on the queue of the \
                     model you want",
                    quote(n)
                )))
            }
            (Some(n), _) => n,
            (None, Route::Model { model, .. }) => model.as_str(),
            (None, _) => {
                return self
                    .engines
                    .iter()
                    .find(|e| need.fits(e.kind()))
                    .ok_or_else(|| missing(format!("<the default {}>", need.label()), None))
            }
        };
        match self.engines.iter().find(|e| e.name() == wanted) {
            Some(e) if need.fits(e.kind()) => Ok(e),
            Some(e) => Err(invalid(format!(
                "field \"model\": {wanted:?} is a {}, this activity needs a {}: pass one of {:?}",
                e.kind().label(),
                need.label(),
                of_kind()
            ))),
            None => Err(missing(quote(wanted), Some(wanted))),
        }
    }
}

/// Everything the activities of one device need: its models, where results say they ran,
/// and the input limits. Both lanes of a card (shared and private queue) use the same one.
#[derive(Clone)]
pub struct DeviceActivities {
    inner: Arc<Inner>,
}

struct Inner {
    models: ModelSet,
    device: DeviceInfo,
    host_task_queue: String,
    limits: Limits,
    fault_hooks: bool,
    data_roots: DataRoots,
    dataset_memory: DatasetMemory,
    dataset_observer: Option<Arc<dyn DatasetObserver>>,
}

impl DeviceActivities {
    /// Activities for one device. `host_task_queue` is the device's private queue, which
    /// every result names so a workflow can pin its next call here.
    pub fn new(
        models: ModelSet,
        device: DeviceInfo,
        host_task_queue: String,
        limits: Limits,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                models,
                device,
                host_task_queue,
                limits,
                fault_hooks: false,
                data_roots: DataRoots::default(),
                // With no roots no dataset is read; `with_datasets` sets both.
                dataset_memory: DatasetMemory::new(0),
                dataset_observer: None,
            }),
        }
    }

    /// Honours the test-only fault texts (an engine or activity panic on purpose), for
    /// supervision tests; never in service.
    pub fn with_fault_hooks(mut self, on: bool) -> Self {
        Arc::get_mut(&mut self.inner)
            .expect("fault hooks are set before the activities are shared; this is a bug")
            .fault_hooks = on;
        self
    }

    /// Where `embed_dataset` may read and write, the memory its jobs hold their sources in
    /// (see `--max-dataset-bytes`; one for the worker, shared by every device), and who
    /// hears about its parts.
    pub fn with_datasets(
        mut self,
        roots: DataRoots,
        memory: DatasetMemory,
        observer: Option<Arc<dyn DatasetObserver>>,
    ) -> Self {
        let inner = Arc::get_mut(&mut self.inner)
            .expect("data roots are set before the activities are shared; this is a bug");
        inner.data_roots = roots;
        inner.dataset_memory = memory;
        inner.dataset_observer = observer;
        self
    }

    pub(crate) fn data_roots(&self) -> &DataRoots {
        &self.inner.data_roots
    }

    pub(crate) fn dataset_memory(&self) -> &DatasetMemory {
        &self.inner.dataset_memory
    }

    pub(crate) fn dataset_observer(&self) -> Option<Arc<dyn DatasetObserver>> {
        self.inner.dataset_observer.clone()
    }

    pub(crate) fn limits(&self) -> &Limits {
        &self.inner.limits
    }

    /// The activity types served.
    pub fn activity_types() -> Vec<&'static str> {
        vec![activity::EMBED, activity::RERANK, activity::EMBED_DATASET]
    }

    /// The models served.
    pub fn models(&self) -> &ModelSet {
        &self.inner.models
    }

    /// The device results are attributed to.
    pub fn device(&self) -> &DeviceInfo {
        &self.inner.device
    }

    /// Runs `activity_type` on a JSON `input` that reached this worker as `call` says, and
    /// returns the JSON output.
    pub async fn run(&self, activity_type: &str, input: &[u8], call: &Call<'_>) -> Ran {
        let limits = &self.inner.limits;
        let models = &self.inner.models;
        let (route, progress) = (call.route, call.progress);
        match activity_type {
            activity::EMBED => {
                let picked = parse_embed(input, limits).and_then(|req| {
                    let engine = models.get(req.model.as_deref(), Need::Embedder, route)?;
                    Ok((req, engine))
                });
                self.finish(picked, |engine, req| self.embed_on(engine, req, call),
                    "send fewer texts per call, ask for \"encoding\": \"base64\" (about 3x smaller), or fewer \"dimensions\"")
                    .await
            }
            activity::RERANK => {
                let picked = parse_rerank(input, limits).and_then(|req| {
                    let engine = models.get(req.model.as_deref(), Need::CrossEncoder, route)?;
                    Ok((req, engine))
                });
                self.finish(picked, |engine, req| self.rerank_on(engine, req, progress, call.priority()),
                    "send fewer documents per call, set \"top_n\", or leave \"return_documents\" off")
                    .await
            }
            activity::EMBED_DATASET => {
                let picked = crate::dataset::parse(input).and_then(|req| {
                    let engine = models.get(req.model.as_deref(), Need::Embedder, route)?;
                    Ok((req, engine))
                });
                self.finish(
                    picked,
                    |engine, req| crate::dataset::run(self, engine, req, call),
                    "a manifest lists one entry per part: raise \"part_rows\" or split the job into shards",
                )
                .await
            }
            other => Ran {
                model: None,
                result: Err(ActivityError::UnknownActivity {
                    name: quote(other),
                    known: Self::activity_types(),
                }),
            },
        }
    }

    /// Runs a parsed request on its engine and measures its JSON; `fix` says how to
    /// shrink a result over the limit.
    async fn finish<'a, Req, Out, Fut>(
        &self,
        picked: Result<(Req, &'a Engine), ActivityError>,
        run: impl FnOnce(&'a Engine, Req) -> Fut,
        fix: &'static str,
    ) -> Ran
    where
        Out: serde::Serialize,
        Fut: std::future::Future<Output = Result<Out, ActivityError>>,
    {
        let (req, engine) = match picked {
            Ok(p) => p,
            Err(e) => {
                return Ran {
                    model: None,
                    result: Err(e),
                }
            }
        };
        let result = run(engine, req).await.and_then(|out| {
            let json = serde_json::to_vec(&out).expect("results serialize; this is a bug");
            self.check_size(json, fix)
        });
        Ran {
            model: Some(engine.name().to_owned()),
            result,
        }
    }

    /// The prompt goes before every text, so it counts against the per-text limit with
    /// each text and against the per-call limit once per text: a long prompt times many
    /// texts must not make the strings the limits exist to bound.
    fn check_prompted(&self, prompt: &str, texts: &[String]) -> Result<(), ActivityError> {
        let limits = &self.inner.limits;
        let p = prompt.chars().count();
        let mut total = 0usize;
        for (i, t) in texts.iter().enumerate() {
            let n = p + t.chars().count();
            if n > limits.max_text_chars {
                return Err(invalid(format!(
                    "texts[{i}] with its prompt has {n} characters ({p} of prompt), over the \
                     limit of {} per text: shorten the prompt or the text",
                    limits.max_text_chars
                )));
            }
            total += n;
        }
        if total > limits.max_total_chars {
            return Err(invalid(format!(
                "the texts with the prompt before each have {total} characters in all ({p} of \
                 prompt times {} texts), over the limit of {} per call: shorten the prompt or \
                 send fewer texts per call",
                texts.len(),
                limits.max_total_chars
            )));
        }
        Ok(())
    }

    fn check_size(&self, json: Vec<u8>, fix: &'static str) -> Result<Vec<u8>, ActivityError> {
        let limit = self.inner.limits.max_result_bytes;
        if json.len() > limit {
            return Err(ActivityError::ResultTooLarge {
                size: json.len(),
                limit,
                fix,
            });
        }
        Ok(json)
    }

    /// The `embed` activity on an already-validated request and its chosen embedder.
    async fn embed_on(
        &self,
        engine: &Engine,
        req: EmbedRequest,
        call: &Call<'_>,
    ) -> Result<EmbedResponse, ActivityError> {
        let ModelKind::Embedder(info) = engine.kind() else {
            unreachable!("get() returned a non-embedder for Need::Embedder; this is a bug")
        };
        if self.inner.fault_hooks {
            match req.texts.first().map(String::as_str) {
                Some(FAULT_ENGINE_PANIC) => {
                    tracing::warn!(
                        model = engine.name(),
                        "test fault hook: killing the engine thread"
                    );
                    engine.inject_panic();
                }
                Some(FAULT_ACTIVITY_PANIC) => {
                    panic!("activity fault injected by the test hook {FAULT_ACTIVITY_PANIC:?}")
                }
                _ => {}
            }
        }
        let spec = EmbedSpec {
            normalize: req.normalize,
            truncate: req.truncate,
            dimensions: req.dimensions,
            prompt: req.prompt,
            prompt_name: req.prompt_name,
        };
        let out = self
            .embed_texts(engine, &spec, req.texts, call.progress, call.priority())
            .await?;
        let (vectors, dimensions) = (out.vectors, out.dimensions);
        let embeddings = if req.encoding.as_deref() == Some("base64") {
            EmbeddingsOut::Base64(
                vectors
                    .iter()
                    .map(|v| {
                        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                        base64::engine::general_purpose::STANDARD.encode(bytes)
                    })
                    .collect(),
            )
        } else {
            EmbeddingsOut::Float(vectors)
        };
        Ok(EmbedResponse {
            dimensions,
            embeddings,
            model: engine.name().to_owned(),
            revision: info.identity.revision.clone(),
            dtype: info.identity.precision().to_owned(),
            family: info.identity.family.as_str().to_owned(),
            device: self.inner.device.clone(),
            host_task_queue: self.inner.host_task_queue.clone(),
            usage: Usage {
                tokens: out.token_counts.iter().map(|&c| c as u64).sum(),
            },
        })
    }

    /// Embeds `texts` on `engine` under `spec`: checks the options against the model
    /// ([`EmbedSpec::resolve`]) and the prompt with the texts against the per-text and
    /// per-call limits, then [`DeviceActivities::embed_resolved`]. `embed`'s path.
    pub(crate) async fn embed_texts(
        &self,
        engine: &Engine,
        spec: &EmbedSpec,
        texts: Vec<String>,
        progress: &Progress,
        priority: i32,
    ) -> Result<Embedded, ActivityError> {
        let resolved = spec.resolve(engine)?;
        if let Some(p) = resolved.prompt_in_effect() {
            self.check_prompted(p, &texts)?;
        }
        self.embed_resolved(engine, &resolved, texts, progress, priority)
            .await
    }

    /// Embeds `texts` on `engine` under options already checked against it and against the
    /// limits, then cuts and re-normalizes Matryoshka prefixes. `embed_dataset` calls it
    /// for each chunk of rows, having checked every row of its range up front.
    pub(crate) async fn embed_resolved(
        &self,
        engine: &Engine,
        resolved: &Resolved,
        texts: Vec<String>,
        progress: &Progress,
        priority: i32,
    ) -> Result<Embedded, ActivityError> {
        let (dimensions, full, normalize) =
            (resolved.dimensions, resolved.full, resolved.normalize);
        let opts = EmbedOptions {
            normalize: Some(normalize),
            truncate: resolved.truncate,
            prompt: resolved.prefix.clone(),
            priority,
        };
        let out = engine.embed(texts, opts, progress).await?;
        let mut vectors = out.vectors;
        if dimensions < full {
            for v in &mut vectors {
                v.truncate(dimensions);
                // A Matryoshka prefix of a unit vector is not unit: re-normalize.
                if normalize {
                    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-12);
                    v.iter_mut().for_each(|x| *x /= norm);
                }
            }
        }
        Ok(Embedded {
            vectors,
            token_counts: out.token_counts,
            dimensions,
        })
    }

    /// The `rerank` activity on an already-validated request and its chosen
    /// cross-encoder: results sorted by score, highest first, cut to `top_n`.
    async fn rerank_on(
        &self,
        engine: &Engine,
        req: RerankRequest,
        progress: &Progress,
        priority: i32,
    ) -> Result<RerankResponse, ActivityError> {
        let raw = req.raw_scores.unwrap_or(false);
        let with_docs = req.return_documents.unwrap_or(false);
        // Keep the texts only when the caller wants them back.
        let (documents, kept) = if with_docs {
            (req.documents.clone(), Some(req.documents))
        } else {
            (req.documents, None)
        };
        let scored = engine
            .score(req.query, documents, progress, priority)
            .await?;
        let mut results: Vec<RerankResult> = scored
            .logits
            .iter()
            .enumerate()
            .map(|(index, &logit)| RerankResult {
                index,
                score: if raw {
                    logit
                } else {
                    1.0 / (1.0 + (-logit).exp())
                },
                document: kept.as_ref().map(|d| d[index].clone()),
            })
            .collect();
        // Stable sort: equal scores keep input order.
        results.sort_by(|a, b| b.score.total_cmp(&a.score));
        if let Some(n) = req.top_n {
            results.truncate(n);
        }
        let id = engine.kind().identity();
        Ok(RerankResponse {
            results,
            model: engine.name().to_owned(),
            revision: id.revision.clone(),
            dtype: id.precision().to_owned(),
            family: id.family.as_str().to_owned(),
            device: self.inner.device.clone(),
            host_task_queue: self.inner.host_task_queue.clone(),
            usage: Usage {
                tokens: scored.token_counts.iter().map(|&c| c as u64).sum(),
            },
        })
    }
}
