//! `embed` payloads. JSON field names are the contract; Rust names follow them.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Input of the `embed` activity. Parsing and limits are enforced by the activities
/// layer, which names the offending field in its failure message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct EmbedRequest {
    /// The texts to embed, in order. Required, at least one.
    pub texts: Vec<String>,
    /// A model name served by the worker; absent means the worker's default embedder.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// L2-normalize the vectors; absent follows the model's own pipeline.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub normalize: Option<bool>,
    /// Truncate texts longer than the model's limit (default true); false fails such a
    /// call with `TextTooLong`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub truncate: Option<bool>,
    /// Keep only the first `dimensions` values of each vector (Matryoshka models), then
    /// re-normalize when the output is normalized.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dimensions: Option<usize>,
    /// Text put before every input, e.g. e5's `"query: "`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt: Option<String>,
    /// A prompt by name from the model's config_sentence_transformers.json `prompts`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_name: Option<String>,
    /// `float` (default): arrays of numbers; `base64`: each vector as base64 of
    /// little-endian float32 bytes, about 3x smaller in JSON.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub encoding: Option<String>,
}

/// The vectors of an `embed` result, in the requested encoding.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum EmbeddingsOut {
    /// Arrays of numbers.
    Float(Vec<Vec<f32>>),
    /// Base64 of little-endian float32 bytes, one string per vector.
    Base64(Vec<String>),
}

/// Whether the device that served a call is a GPU or the CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    /// A CUDA card (or a simulated one).
    Gpu,
    /// The host CPU.
    Cpu,
}

/// The device that served a call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct DeviceInfo {
    /// GPU or CPU.
    pub kind: DeviceKind,
    /// The card's UUID as NVML reports it (GPU only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    /// The card's NVML index (GPU only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index: Option<u32>,
    /// The card's or CPU's name.
    pub name: String,
    /// True when the card is declared by `--simulate-gpus` and computes on the CPU.
    pub simulated: bool,
}

/// Token accounting for one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Usage {
    /// Tokens processed, after truncation, special tokens included.
    pub tokens: u64,
}

/// Output of the `embed` activity.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct EmbedResponse {
    /// One vector per input text, in input order.
    pub embeddings: EmbeddingsOut,
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
    /// Width of each vector.
    pub dimensions: usize,
    /// The device that served the call.
    pub device: DeviceInfo,
    /// The private queue of the card (or host CPU) that served the call: schedule the
    /// next activity there to stay on the same card.
    pub host_task_queue: String,
    /// Tokens processed.
    pub usage: Usage,
}
