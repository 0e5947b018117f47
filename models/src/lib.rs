//! Text models for gpulane: sentence-transformers directories loaded into candle, their
//! tokenizers, pooling, and the per-device [`Engine`] thread that owns a loaded model.
//!
//! This crate knows nothing of Temporal: the activities layer above turns payloads into
//! engine calls, and the runtime decides which device an engine lives on.
#![warn(missing_docs)]

mod backbone;
mod batcher;
mod cross_encoder;
mod embedder;
mod encoder;
mod engine;
mod error;
mod kernels;
mod modernbert;
mod pooling;
mod st_dir;

pub use crate::{
    batcher::{BatchCounters, BatchObserver, BatchTotals, Progress},
    cross_encoder::{CrossEncoder, CrossEncoderInfo, Scores},
    embedder::{EmbedOptions, Embedder, Embeddings},
    engine::{Engine, EngineDevice, EngineLife, EngineOptions, ModelKind},
    error::ModelError,
    pooling::Pooling,
    st_dir::{ModelInfo, SentenceTransformerDir},
};

/// Re-exported so callers can name a device and dtype without depending on candle.
pub use candle_core::{DType, Device};
