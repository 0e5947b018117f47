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
    /// The request names a model this worker does not serve, on a queue only this worker
    /// polls (its private queue), so no other worker could serve it. Not retryable.
    #[error("unknown model {name}: this worker serves {known:?}; pass one of those as \"model\" or omit it for the default")]
    UnknownModel {
        /// The requested name, quoted and cut to a short prefix.
        name: String,
        /// The names this worker serves.
        known: Vec<String>,
    },
    /// The request, on a shared queue (`gpu-tools`, `cpu-tools`), names a well-formed
    /// model this worker does not serve. Retryable: another worker polling the same queue
    /// may serve it, and the retry may reach that worker. [`ActivityError::retry_delay`]
    /// spaces the attempts out.
    #[error("model {name} is not served by this worker (it serves {known:?}), but another worker on {queue} may serve it, so Temporal retries the task; to reach only workers that serve it, schedule it on {model_queue:?}")]
    ModelNotServed {
        /// The requested name, quoted and cut to a short prefix.
        name: String,
        /// The names this worker serves.
        known: Vec<String>,
        /// The shared queue the task came on.
        queue: String,
        /// The model queue that reaches only workers serving the model.
        model_queue: String,
    },
    /// The activity panicked: a bug in gpulane. Retryable; the worker keeps serving.
    #[error("internal error (a bug in gpulane, please report it): {0}")]
    Internal(String),
    /// The worker stopped before the activity finished (the drain deadline passed).
    /// Retryable: another worker takes the task at once.
    #[error("the worker stopped before this activity finished ({0}); Temporal retries it on another worker")]
    WorkerShutdown(String),
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
    #[error("unknown activity type {name}: gpulane serves {known:?}")]
    UnknownActivity {
        /// The requested type, quoted and cut to a short prefix.
        name: String,
        /// The types gpulane serves.
        known: Vec<&'static str>,
    },
    /// Storage was unreachable, throttled or failed a request (`embed_dataset`).
    /// Retryable: the next attempt resumes from the last part written.
    #[error("storage: {0}; Temporal retries, and the job resumes from its last written part")]
    StorageUnavailable(String),
    /// The model layer failed; retryable as [`ModelError::is_retryable`] says.
    #[error("{}", model_message(.0))]
    Model(#[from] ModelError),
}

fn model_message(e: &ModelError) -> String {
    match e {
        ModelError::TextTooLong { .. } => {
            format!("{e}: set \"truncate\" to true (the default) to cut it, or shorten the text")
        }
        ModelError::NoTokens { .. } => format!("{e}; send a text that is not empty"),
        ModelError::NonFiniteOutput { precision: "f16", .. } => format!(
            "{e}; serve this model in f32 (dtype = \"f32\" in the models file) or send the call to cpu-tools"
        ),
        ModelError::NonFiniteOutput { .. } => {
            format!("{e}; check the checkpoint, or try the model in f32 on cpu-tools")
        }
        _ => e.to_string(),
    }
}

impl ActivityError {
    /// Whether Temporal should retry the activity.
    pub fn is_retryable(&self) -> bool {
        match self {
            ActivityError::Model(e) => e.is_retryable(),
            ActivityError::ModelNotServed { .. }
            | ActivityError::Internal(_)
            | ActivityError::WorkerShutdown(_)
            | ActivityError::StorageUnavailable(_) => true,
            ActivityError::InvalidInput(_)
            | ActivityError::UnknownModel { .. }
            | ActivityError::ResultTooLarge { .. }
            | ActivityError::UnknownActivity { .. } => false,
        }
    }

    /// How long Temporal should wait before the next attempt, where the error asks for a
    /// delay of its own: a model not served here waits longer with each attempt (about
    /// 1 s per attempt, at most about a minute), so a task on a shared queue whose model
    /// no worker serves (a typo) does not spin. The delay is jittered by ±50%: with fixed
    /// delays, two workers that each hold the other's model bounced two tasks in lockstep,
    /// each always reaching the wrong worker (seen 15 times in a row).
    /// `None` leaves the workflow's retry policy in charge.
    pub fn retry_delay(&self, attempt: u32) -> Option<std::time::Duration> {
        match self {
            ActivityError::ModelNotServed { .. } => {
                use std::hash::BuildHasher;
                // A random factor in [0.5, 1.5) from the process's random hash keys; no
                // need for a generator crate for one number per bounced task.
                let bits = std::collections::hash_map::RandomState::new().hash_one(attempt);
                let factor = 0.5 + (bits >> 11) as f64 / (1u64 << 53) as f64;
                let base = f64::from(attempt.clamp(1, 60));
                Some(std::time::Duration::from_secs_f64(base * factor))
            }
            _ => None,
        }
    }

    /// The same failure with the input it names counted from `first`, not from the start
    /// of one engine call: `embed_dataset` feeds the engine the source in chunks, and its
    /// caller knows the source's rows, not a chunk's positions.
    pub(crate) fn counted_from(mut self, first: usize) -> Self {
        if let ActivityError::Model(
            ModelError::TextTooLong { field, index, .. }
            | ModelError::NoTokens { field, index, .. }
            | ModelError::NonFiniteOutput { field, index, .. },
        ) = &mut self
        {
            *field = "source rows";
            *index += first;
        }
        self
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
            ActivityError::ModelNotServed { .. } => failure::MODEL_NOT_SERVED,
            ActivityError::Internal(_) => failure::INTERNAL_ERROR,
            ActivityError::WorkerShutdown(_) => failure::WORKER_SHUTDOWN,
            ActivityError::StorageUnavailable(_) => failure::STORAGE_UNAVAILABLE,
            ActivityError::UnknownActivity { .. } => failure::UNKNOWN_ACTIVITY,
            ActivityError::ResultTooLarge { .. } => failure::RESULT_TOO_LARGE,
            ActivityError::Model(ModelError::TextTooLong { .. }) => failure::TEXT_TOO_LONG,
            ActivityError::Model(ModelError::OutOfMemory(_)) => failure::GPU_OUT_OF_MEMORY,
            ActivityError::Model(ModelError::NonFiniteOutput { .. }) => failure::NON_FINITE_OUTPUT,
            // The tokenizer fails the same way on the same text: it is the input that
            // this model cannot take, not a failure a retry can mend (`ModelFailure` is
            // retried).
            ActivityError::Model(ModelError::Tokenizer(_) | ModelError::NoTokens { .. }) => {
                failure::INVALID_INPUT
            }
            ActivityError::Model(_) => failure::MODEL_FAILURE,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The published table (`failure::ALL`: the schema, the client packages) says what the
    /// worker does with each failure type it can raise during a task.
    #[test]
    fn published_retry_table_matches_the_errors() {
        let samples = [
            ActivityError::InvalidInput("x".into()),
            ActivityError::UnknownModel {
                name: "m".into(),
                known: vec![],
            },
            ActivityError::ModelNotServed {
                name: "m".into(),
                known: vec![],
                queue: "gpu-tools".into(),
                model_queue: "gpu-tools@m".into(),
            },
            ActivityError::Internal("x".into()),
            ActivityError::WorkerShutdown("x".into()),
            ActivityError::StorageUnavailable("x".into()),
            ActivityError::UnknownActivity {
                name: "x".into(),
                known: vec![],
            },
            ActivityError::ResultTooLarge {
                size: 2,
                limit: 1,
                fix: "x",
            },
            ActivityError::Model(ModelError::TextTooLong {
                field: "texts",
                index: 0,
                tokens: 2,
                limit: 1,
            }),
            ActivityError::Model(ModelError::OutOfMemory("x".into())),
            ActivityError::Model(ModelError::NonFiniteOutput {
                field: "texts",
                index: 0,
                precision: "f16",
                cause: "x",
            }),
            ActivityError::Model(ModelError::EngineStopped),
        ];
        for e in &samples {
            let (_, retried) = failure::ALL
                .iter()
                .find(|(name, _)| *name == e.failure_type())
                .unwrap_or_else(|| panic!("{} is not published", e.failure_type()));
            assert_eq!(*retried, e.is_retryable(), "{}", e.failure_type());
        }
        for (name, _) in failure::ALL {
            assert!(
                samples.iter().any(|e| e.failure_type() == name),
                "{name} is published but never raised here"
            );
        }
    }

    fn non_finite(precision: &'static str) -> ActivityError {
        ActivityError::Model(ModelError::NonFiniteOutput {
            field: "texts",
            index: 2,
            precision,
            cause: "a cause",
        })
    }

    /// A non-finite output's message ends with the remedy for its precision: f32 or the
    /// CPU lane for f16, the checkpoint otherwise.
    #[test]
    fn a_non_finite_output_says_what_to_do_for_its_precision() {
        let f16 = non_finite("f16").to_string();
        assert!(
            f16.contains("texts[2]")
                && f16.contains("dtype = \"f32\"")
                && f16.contains("cpu-tools"),
            "{f16}"
        );
        let f32 = non_finite("f32").to_string();
        assert!(
            f32.contains("check the checkpoint") && !f32.contains("dtype ="),
            "{f32}"
        );
    }

    /// `embed_dataset`'s chunks name the source's rows: a chunk's positions are shifted by
    /// where the chunk starts, and both failures name `source rows` (a dataset has no
    /// `texts` field).
    #[test]
    fn dataset_failures_count_from_the_chunk_start() {
        let too_long = ActivityError::Model(ModelError::TextTooLong {
            field: "texts",
            index: 3,
            tokens: 300,
            limit: 256,
        })
        .counted_from(128);
        assert!(
            too_long.to_string().contains("source rows[131]"),
            "{too_long}"
        );
        let nan = non_finite("f32").counted_from(128).to_string();
        assert!(nan.contains("source rows[130]"), "{nan}");
        let empty = ActivityError::Model(ModelError::NoTokens {
            field: "texts",
            index: 1,
            needs: "the model's pooling",
        })
        .counted_from(128);
        assert!(!empty.is_retryable());
        assert_eq!(empty.failure_type(), failure::INVALID_INPUT);
        let empty = empty.to_string();
        assert!(
            empty.contains("source rows[129]") && empty.contains("not empty"),
            "{empty}"
        );
        let other = ActivityError::Internal("x".into()).counted_from(128);
        assert!(matches!(other, ActivityError::Internal(_)));
    }
}
