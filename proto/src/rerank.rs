//! `rerank` payloads.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::{DeviceInfo, Usage};

/// Input of the `rerank` activity.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct RerankRequest {
    /// The query every document is scored against. Required.
    pub query: String,
    /// The documents to score, in order. Required, at least one.
    pub documents: Vec<String>,
    /// A cross-encoder served by the worker; absent means its first cross-encoder.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Return only the best `top_n` results; absent returns all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_n: Option<usize>,
    /// Include each document's text in its result (default false).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub return_documents: Option<bool>,
    /// Return the raw logit instead of its sigmoid (default false).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub raw_scores: Option<bool>,
}

/// One scored document.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct RerankResult {
    /// The document's position in the request.
    pub index: usize,
    /// Relevance: sigmoid of the logit in [0, 1], or the logit with `raw_scores`.
    pub score: f32,
    /// The document's text, with `return_documents`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub document: Option<String>,
}

/// Output of the `rerank` activity.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct RerankResponse {
    /// Results sorted by score, highest first.
    pub results: Vec<RerankResult>,
    /// The model name that served the call.
    pub model: String,
    /// Exactly which weights: the Hugging Face commit when the model came from the hub,
    /// else `sha256:` and the hash of its weight files. Stored results outlive
    /// deployments; this says what made them.
    pub revision: String,
    /// The dtype the model computed in (`f32`, `f16`, `bf16`, or `int8`: a CPU lane run with `--cpu-dtype int8`, dense layers quantized dynamically).
    pub dtype: String,
    /// The model family (`bert`, `xlm-roberta`, `distilbert`, `mpnet`, `modernbert`,
    /// `qwen3`).
    pub family: String,
    /// The device that served the call.
    pub device: DeviceInfo,
    /// The private queue of the card (or host CPU) that served the call.
    pub host_task_queue: String,
    /// Tokens processed (all pairs, after truncation).
    pub usage: Usage,
}
