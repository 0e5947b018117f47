use std::sync::Arc;

use gpulane_models::{EmbedOptions, Engine};
use gpulane_proto::{activity, DeviceInfo, EmbedRequest, EmbedResponse, Usage};

use crate::{embed::parse_embed, ActivityError, Limits};

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

    fn get(&self, name: Option<&str>) -> Result<&Engine, ActivityError> {
        let found = match name {
            None => self.engines.first(),
            Some(n) => self.engines.iter().find(|e| e.name() == n),
        };
        found.ok_or_else(|| ActivityError::UnknownModel {
            name: name.unwrap_or("<default>").to_owned(),
            known: self.names(),
        })
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
        vec![activity::EMBED]
    }

    /// The models served.
    pub fn models(&self) -> &ModelSet {
        &self.inner.models
    }

    /// The device results are attributed to.
    pub fn device(&self) -> &DeviceInfo {
        &self.inner.device
    }

    /// Runs `activity_type` on a JSON `input` and returns the JSON output.
    pub async fn run(&self, activity_type: &str, input: &[u8]) -> Result<Vec<u8>, ActivityError> {
        match activity_type {
            activity::EMBED => {
                let req = parse_embed(input, &self.inner.limits)?;
                let out = self.embed(req).await?;
                Ok(serde_json::to_vec(&out).expect("embed response serializes; this is a bug"))
            }
            other => Err(ActivityError::UnknownActivity {
                name: other.to_owned(),
                known: Self::activity_types(),
            }),
        }
    }

    /// The `embed` activity on an already-validated request.
    pub async fn embed(&self, req: EmbedRequest) -> Result<EmbedResponse, ActivityError> {
        let engine = self.inner.models.get(req.model.as_deref())?;
        let opts = EmbedOptions {
            normalize: req.normalize,
            truncate: req.truncate.unwrap_or(true),
        };
        let out = engine.embed(req.texts, opts).await?;
        Ok(EmbedResponse {
            dimensions: engine.info().dimensions,
            embeddings: out.vectors,
            model: engine.name().to_owned(),
            device: self.inner.device.clone(),
            host_task_queue: self.inner.host_task_queue.clone(),
            usage: Usage {
                tokens: out.token_counts.iter().map(|&c| c as u64).sum(),
            },
        })
    }
}
