use gpulane_models::ModelError;
use gpulane_proto::failure;

/// Why an activity failed. Each variant says whether Temporal should retry it; the
/// runtime sets the failure's `non_retryable` flag and type name from
/// [`ActivityError::is_retryable`] and [`ActivityError::failure_type`].
#[derive(Debug, thiserror::Error)]
pub enum ActivityError {
    /// The input is malformed or over a limit. Not retryable. The message names the field,
    /// the limit and the fix.
    #[error("{0}")]
    InvalidInput(String),
    /// The request names a model this worker does not serve. Not retryable.
    #[error("unknown model {name:?}: this worker serves {known:?}; pass one of those as \"model\" or omit it for the default")]
    UnknownModel {
        /// The requested name.
        name: String,
        /// The names this worker serves.
        known: Vec<String>,
    },
    /// The result would be over Temporal's payload limit. Not retryable: the same call
    /// gives the same size.
    #[error("the result is {size} bytes of JSON, over the limit of {limit} (Temporal refuses larger payloads): {fix}")]
    ResultTooLarge {
        /// The result's size in bytes.
        size: usize,
        /// The limit in bytes.
        limit: usize,
        /// How to make it smaller.
        fix: &'static str,
    },
    /// The activity type is not one gpulane serves. Not retryable.
    #[error("unknown activity type {name:?}: gpulane serves {known:?}")]
    UnknownActivity {
        /// The requested type.
        name: String,
        /// The types gpulane serves.
        known: Vec<&'static str>,
    },
    /// The model layer failed; retryable as [`ModelError::is_retryable`] says.
    #[error("{}", model_message(.0))]
    Model(#[from] ModelError),
}

fn model_message(e: &ModelError) -> String {
    match e {
        ModelError::TextTooLong { .. } => {
            format!("{e}: set \"truncate\" to true (the default) to cut it, or shorten the text")
        }
        _ => e.to_string(),
    }
}

impl ActivityError {
    /// Whether Temporal should retry the activity.
    pub fn is_retryable(&self) -> bool {
        match self {
            ActivityError::Model(e) => e.is_retryable(),
            _ => false,
        }
    }

    /// Whether the device ran out of memory, which the runtime learns from.
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, ActivityError::Model(ModelError::OutOfMemory(_)))
    }

    /// The application failure type a workflow matches on.
    pub fn failure_type(&self) -> &'static str {
        match self {
            ActivityError::InvalidInput(_) => failure::INVALID_INPUT,
            ActivityError::UnknownModel { .. } => failure::UNKNOWN_MODEL,
            ActivityError::UnknownActivity { .. } => failure::UNKNOWN_ACTIVITY,
            ActivityError::ResultTooLarge { .. } => failure::RESULT_TOO_LARGE,
            ActivityError::Model(ModelError::TextTooLong { .. }) => failure::TEXT_TOO_LONG,
            ActivityError::Model(ModelError::OutOfMemory(_)) => failure::GPU_OUT_OF_MEMORY,
            ActivityError::Model(_) => failure::MODEL_FAILURE,
        }
    }
}
