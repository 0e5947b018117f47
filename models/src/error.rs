use std::path::PathBuf;

/// What can go wrong loading or running a model. Each variant's doc says whether a retry
/// can help; the activities layer maps that onto Temporal's non-retryable flag.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A file the model directory must contain is missing or unreadable. Not retryable:
    /// the worker's configuration is wrong.
    #[error("model file {path}: {source}")]
    File {
        /// The file that could not be read.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A JSON file of the model directory does not parse. Not retryable.
    #[error("model file {path} is not valid: {source}")]
    Json {
        /// The file that failed to parse.
        path: PathBuf,
        /// Why.
        #[source]
        source: serde_json::Error,
    },
    /// The model directory declares something gpulane cannot run. Not retryable.
    #[error("unsupported model in {path}: {reason}")]
    Unsupported {
        /// The model directory.
        path: PathBuf,
        /// What is unsupported and what is.
        reason: String,
    },
    /// The tokenizer failed to load or to encode. Not retryable.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// A text is longer than the model's maximum sequence length and truncation was
    /// turned off by the caller. Not retryable: the same input fails again.
    #[error("{field}[{index}] has {tokens} tokens, more than the model's limit of {limit}")]
    TextTooLong {
        /// Where the text came from (`texts`; `source rows` for a dataset).
        field: &'static str,
        /// Its position there.
        index: usize,
        /// Its token count, special tokens included.
        tokens: usize,
        /// The model's maximum sequence length.
        limit: usize,
    },
    /// A text tokenized to no tokens at all: the model's tokenizer adds no special tokens,
    /// and the text (or the pair) is empty. Not retryable: no pooling has a token to read
    /// (CLS and last-token pooling would take a neighbour's token, mean a zero vector).
    #[error("{field}[{index}] has no tokens: this model's tokenizer adds no special tokens, so an empty text leaves {needs} nothing to read")]
    NoTokens {
        /// Where the text came from (`texts`, `documents`; `source rows` for a dataset).
        field: &'static str,
        /// Its position there.
        index: usize,
        /// What needed a token (`the model's pooling`, `the reranker's classifier`).
        needs: &'static str,
    },
    /// The tensor library failed (shape bug, device error, out of memory). Retryable: device
    /// errors are often transient, and a shape bug shows up in tests, not in production.
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
    /// The operating system refused to start the engine thread. Not retryable here: the
    /// worker stops at start.
    #[error("could not start the engine thread: {0}")]
    Spawn(#[source] std::io::Error),
    /// The device ran out of memory during the call. Retryable: the runtime raises its
    /// estimate for the activity and admits less at once, so a retry usually fits.
    #[error("the device ran out of memory: {0}")]
    OutOfMemory(String),
    /// The call asked a model for what its kind cannot do. Not retryable; the activities
    /// layer checks kinds first, so this is a bug if it surfaces.
    #[error("wrong model kind: {0}")]
    WrongKind(&'static str),
    /// The model's output for one input holds NaN or an infinity, which JSON cannot carry
    /// (it would reach the caller as nulls) and no index should store. Not retryable: the
    /// same input through the same model and dtype gives it again.
    #[error("the model's output for {field}[{index}] is not finite (NaN or infinity) in {precision}: {cause}")]
    NonFiniteOutput {
        /// The request field the input came from (`texts`, `documents`).
        field: &'static str,
        /// Its position there.
        index: usize,
        /// What the model computed in (`f16`, `f32`, `int8`, ...).
        precision: &'static str,
        /// The likely cause, for that precision.
        cause: &'static str,
    },
    /// The engine thread is gone (the worker is shutting down). Retryable: another worker
    /// or a restarted one can serve the task.
    #[error("the model engine has stopped")]
    EngineStopped,
}

impl ModelError {
    /// Whether running the same input again may succeed.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            ModelError::Candle(_) | ModelError::OutOfMemory(_) | ModelError::EngineStopped
        )
    }

    /// The same failure for another call of a failed batch: the same variant where it
    /// matters to the caller (out of memory, stopped), otherwise a retryable tensor error
    /// with the same text.
    pub(crate) fn duplicate(&self) -> Self {
        match self {
            ModelError::OutOfMemory(m) => ModelError::OutOfMemory(m.clone()),
            ModelError::EngineStopped => ModelError::EngineStopped,
            other => ModelError::Candle(candle_core::Error::Msg(other.to_string())),
        }
    }

    /// Recognises a device out-of-memory inside a tensor-library error, so that it is
    /// reported as [`ModelError::OutOfMemory`] (CUDA says `CUDA_ERROR_OUT_OF_MEMORY`).
    pub fn classify(self) -> Self {
        match self {
            ModelError::Candle(e) => {
                let text = e.to_string();
                // The driver says CUDA_ERROR_OUT_OF_MEMORY; cuBLAS and cuRAND report their
                // own allocation failures (CUBLAS_STATUS_ALLOC_FAILED,
                // CURAND_STATUS_ALLOCATION_FAILED).
                if text.contains("OUT_OF_MEMORY")
                    || text.contains("ALLOC_FAILED")
                    || text.contains("ALLOCATION_FAILED")
                    || text.to_ascii_lowercase().contains("out of memory")
                {
                    ModelError::OutOfMemory(text)
                } else {
                    ModelError::Candle(e)
                }
            }
            other => other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_oom_is_classified_and_retryable() {
        let e = ModelError::Candle(candle_core::Error::Msg(
            "DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")".into(),
        ))
        .classify();
        assert!(matches!(e, ModelError::OutOfMemory(_)), "{e}");
        assert!(e.is_retryable());
        let cublas = ModelError::Candle(candle_core::Error::Msg(
            "cublas error: CUBLAS_STATUS_ALLOC_FAILED".into(),
        ))
        .classify();
        assert!(matches!(cublas, ModelError::OutOfMemory(_)), "{cublas}");
        let other = ModelError::Candle(candle_core::Error::Msg("shape mismatch".into())).classify();
        assert!(matches!(other, ModelError::Candle(_)));
    }
}
