//! The wire contract of gpulane: task queue names, activity type names, failure type
//! names and the JSON payloads of each activity, and the admin API of a running worker.
//! Workflows in any language call gpulane with these; `proto/gpulane.proto` describes the
//! same payload shapes for code generators, and `proto/admin.proto` defines the admin API
//! (generated here with tonic, under [`admin`]).
//!
//! Everything here is plain data; nothing depends on Temporal or on the models.
#![warn(missing_docs)]

mod dataset;
mod embed;
mod names;
mod rerank;
mod schema;

pub use crate::{
    dataset::{DatasetProgress, EmbedDatasetRequest, Manifest, PartRef, RowRange, Shard},
    embed::{DeviceInfo, DeviceKind, EmbedRequest, EmbedResponse, EmbeddingsOut, Usage},
    names::{
        activity, cpu_host_queue, failure, gpu_card_queue, model_queue, sanitize_host,
        valid_model_name, CPU_TOOLS, GPU_TOOLS, MODEL_NAME_MAX, MODEL_QUEUE_SEPARATOR,
        QUEUE_PREFIX_SEPARATOR,
    },
    rerank::{RerankRequest, RerankResponse, RerankResult},
    schema::{contract_schema, contract_schema_text},
};

/// The admin API (`proto/admin.proto`, package `gpulane.admin.v1`): messages, the tonic
/// client (`admin_client::AdminClient`) and server (`admin_server::Admin`).
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod admin {
    tonic::include_proto!("gpulane.admin.v1");
}
