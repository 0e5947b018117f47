//! The wire contract of gpulane: task queue names, activity type names, failure type
//! names and the JSON payloads of each activity. Workflows in any language call gpulane
//! with these; `proto/gpulane.proto` describes the same shapes for code generators.
//!
//! Everything here is plain data; nothing depends on Temporal or on the models.
#![warn(missing_docs)]

mod embed;
mod names;
mod rerank;

pub use crate::{
    embed::{DeviceInfo, DeviceKind, EmbedRequest, EmbedResponse, EmbeddingsOut, Usage},
    names::{
        activity, cpu_host_queue, failure, gpu_card_queue, sanitize_host, CPU_TOOLS, GPU_TOOLS,
        QUEUE_PREFIX_SEPARATOR,
    },
    rerank::{RerankRequest, RerankResponse, RerankResult},
};
