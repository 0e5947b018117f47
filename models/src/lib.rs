//! Text models for gpulane: sentence-transformers directories (BERT, XLM-RoBERTa,
//! DistilBERT, MPNet, ModernBERT and Qwen3 families) loaded into candle, their tokenizers,
//! pooling and Dense heads, and the per-device [`Engine`] thread that owns a loaded model.
//!
//! This crate knows nothing of Temporal: the activities layer above turns payloads into
//! engine calls, and the runtime decides which device an engine lives on.
#![warn(missing_docs)]

mod attention;
mod batcher;
mod checkpoint;
mod config;
mod cross_encoder;
#[cfg(feature = "cuda")]
mod cuda;
mod dense;
mod embedder;
mod encoder;
mod engine;
mod error;
mod feed_forward;
mod int8;
mod isa;
mod kernel_check;
mod kernels;
mod model_dir;
mod pooling;
#[cfg(test)]
mod simt_tests;
mod st_dir;
mod tokenizing;
mod varlen;

pub use crate::{
    batcher::{BatchCounters, BatchObserver, BatchTotals, Progress},
    config::Family,
    cross_encoder::{CrossEncoder, CrossEncoderInfo, Scores},
    embedder::{EmbedOptions, Embedder, Embeddings},
    encoder::Attention,
    engine::{
        DeviceMemory, Engine, EngineDevice, EngineLife, EngineLoad, EngineOptions, ModelKind,
    },
    error::ModelError,
    isa::{cap_cpu_isa, cpu_isa, CpuIsa},
    kernel_check::{check_kernels, KernelCheck},
    model_dir::{self_name, ModelIdentity},
    pooling::Pooling,
    st_dir::{ModelInfo, SentenceTransformerDir},
    tokenizing::{Tokenizing, TOKENIZING_BYTES_PER_CHAR},
};

/// Re-exported so callers can name a device and dtype without depending on candle.
pub use candle_core::{DType, Device};
