use std::sync::Arc;

use base64::Engine as _;
use gpulane_models::{EmbedOptions, Engine, ModelKind, Progress};
use gpulane_proto::{
    activity, DeviceInfo, EmbedRequest, EmbedResponse, EmbeddingsOut, RerankRequest,
    RerankResponse, RerankResult, Usage,
};

use crate::{embed::parse_embed, rerank::parse_rerank, ActivityError, Limits};

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

    /// The engine for `name`, or the first of the needed kind when `name` is absent.
    fn get(&self, name: Option<&str>, need: Need) -> Result<&Engine, ActivityError> {
        let of_kind = || -> Vec<String> {
            self.engines
                .iter()
                .filter(|e| need.fits(e.kind()))
                .map(|e| e.name().to_owned())
                .collect()
        };
        match name {
            None => self
                .engines
                .iter()
                .find(|e| need.fits(e.kind()))
                .ok_or_else(|| ActivityError::UnknownModel {
                    name: format!("<default {}>", need.label()),
                    known: self.names(),
                }),
            Some(n) => match self.engines.iter().find(|e| e.name() == n) {
                Some(e) if need.fits(e.kind()) => Ok(e),
                Some(e) => Err(ActivityError::InvalidInput(format!(
                    "field \"model\": {n:?} is a {}, this activity needs a {}: pass one of {:?}",
                    e.kind().label(),
                    need.label(),
                    of_kind()
                ))),
                None => Err(ActivityError::UnknownModel {
                    name: n.to_owned(),
                    known: self.names(),
                }),
            },
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
            }),
        }
    }

    /// The activity types served.
    pub fn activity_types() -> Vec<&'static str> {
        vec![activity::EMBED, activity::RERANK]
    }

    /// The models served.
    pub fn models(&self) -> &ModelSet {
        &self.inner.models
    }

    /// The device results are attributed to.
    pub fn device(&self) -> &DeviceInfo {
        &self.inner.device
    }

    /// Runs `activity_type` on a JSON `input` and returns the JSON output. `progress`
    /// counts the texts (or documents) done, for heartbeats.
    pub async fn run(
        &self,
        activity_type: &str,
        input: &[u8],
        progress: &Progress,
    ) -> Result<Vec<u8>, ActivityError> {
        match activity_type {
            activity::EMBED => {
                let req = parse_embed(input, &self.inner.limits)?;
                let out = self.embed(req, progress).await?;
                let json =
                    serde_json::to_vec(&out).expect("embed response serializes; this is a bug");
                self.check_size(json, "send fewer texts per call, ask for \"encoding\": \"base64\" (about 3x smaller), or fewer \"dimensions\"")
            }
            activity::RERANK => {
                let req = parse_rerank(input, &self.inner.limits)?;
                let out = self.rerank(req, progress).await?;
                let json =
                    serde_json::to_vec(&out).expect("rerank response serializes; this is a bug");
                self.check_size(json, "send fewer documents per call, set \"top_n\", or leave \"return_documents\" off")
            }
            other => Err(ActivityError::UnknownActivity {
                name: other.to_owned(),
                known: Self::activity_types(),
            }),
        }
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

    /// The `embed` activity on an already-validated request.
    pub async fn embed(
        &self,
        req: EmbedRequest,
        progress: &Progress,
    ) -> Result<EmbedResponse, ActivityError> {
        let engine = self
            .inner
            .models
            .get(req.model.as_deref(), Need::Embedder)?;
        let ModelKind::Embedder(info) = engine.kind() else {
            unreachable!("get() returned a non-embedder for Need::Embedder; this is a bug")
        };
        let full = info.dimensions;
        let dimensions = match req.dimensions {
            Some(d) if d > full => {
                return Err(ActivityError::InvalidInput(format!(
                    "field \"dimensions\" is {d}, over the model's {full}: pass at most {full} or omit it"
                )))
            }
            Some(d) => d,
            None => full,
        };
        let prefix = match (&req.prompt, &req.prompt_name) {
            (Some(p), _) => Some(p.clone()),
            (None, Some(name)) => Some(info.prompts.get(name).cloned().ok_or_else(|| {
                ActivityError::InvalidInput(format!(
                    "field \"prompt_name\" is {name:?}; this model's prompts are {:?} (config_sentence_transformers.json); or pass \"prompt\" text",
                    info.prompts.keys().collect::<Vec<_>>()
                ))
            })?),
            (None, None) => None,
        };
        let texts = match prefix {
            Some(p) => req.texts.into_iter().map(|t| format!("{p}{t}")).collect(),
            None => req.texts,
        };
        let normalize = req.normalize.unwrap_or(info.normalize);
        let opts = EmbedOptions {
            normalize: Some(normalize),
            truncate: req.truncate.unwrap_or(true),
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
            device: self.inner.device.clone(),
            host_task_queue: self.inner.host_task_queue.clone(),
            usage: Usage {
                tokens: out.token_counts.iter().map(|&c| c as u64).sum(),
            },
        })
    }

    /// The `rerank` activity on an already-validated request: results sorted by score,
    /// highest first, cut to `top_n`.
    pub async fn rerank(
        &self,
        req: RerankRequest,
        progress: &Progress,
    ) -> Result<RerankResponse, ActivityError> {
        let engine = self
            .inner
            .models
            .get(req.model.as_deref(), Need::CrossEncoder)?;
        let raw = req.raw_scores.unwrap_or(false);
        let with_docs = req.return_documents.unwrap_or(false);
        // Keep the texts only when the caller wants them back.
        let (documents, kept) = if with_docs {
            (req.documents.clone(), Some(req.documents))
        } else {
            (req.documents, None)
        };
        let scored = engine.score(req.query, documents, progress).await?;
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
        Ok(RerankResponse {
            results,
            model: engine.name().to_owned(),
            device: self.inner.device.clone(),
            host_task_queue: self.inner.host_task_queue.clone(),
            usage: Usage {
                tokens: scored.token_counts.iter().map(|&c| c as u64).sum(),
            },
        })
    }
}
