//! Task queue, activity and failure names. These are the strings a workflow author types;
//! they live here, once, and README.md lists them.

/// The shared GPU lane: every GPU worker on every host polls it.
pub const GPU_TOOLS: &str = "gpu-tools";
/// The shared CPU lane, the fallback when no GPU poller is there.
pub const CPU_TOOLS: &str = "cpu-tools";
/// Separates the parts of a private (host- or card-specific) queue name.
pub const QUEUE_PREFIX_SEPARATOR: char = '.';
/// Separates a shared lane from a model in a model queue: `gpu-tools@e5-small`.
pub const MODEL_QUEUE_SEPARATOR: char = '@';
/// The longest model name, in characters.
pub const MODEL_NAME_MAX: usize = 64;

/// Activity type names, as registered with Temporal.
pub mod activity {
    /// Text embedding: [`crate::EmbedRequest`] in, [`crate::EmbedResponse`] out.
    pub const EMBED: &str = "embed";
    /// Cross-encoder reranking: [`crate::RerankRequest`] in, [`crate::RerankResponse`] out.
    pub const RERANK: &str = "rerank";
    /// A whole dataset from storage to Parquet parts: [`crate::EmbedDatasetRequest`] in,
    /// [`crate::Manifest`] out.
    pub const EMBED_DATASET: &str = "embed_dataset";
}

/// Application failure type names a workflow can match on (`ApplicationError.type` in
/// Python, `ApplicationError.Type()` in Go).
pub mod failure {
    /// The input is malformed or over a limit. Never retried.
    pub const INVALID_INPUT: &str = "InvalidInput";
    /// The requested model is not served by this worker. Never retried.
    pub const UNKNOWN_MODEL: &str = "UnknownModel";
    /// A text is longer than the model allows and `truncate` is false. Never retried.
    pub const TEXT_TOO_LONG: &str = "TextTooLong";
    /// The result would exceed Temporal's payload limit. Never retried: the same call
    /// produces the same size; the message says how to make it smaller.
    pub const RESULT_TOO_LARGE: &str = "ResultTooLarge";
    /// The model's output for an input holds NaN or an infinity (half precision
    /// overflowed, or the weights hold such values). Never retried: the same input gives
    /// it again; the message names the input and the fix.
    pub const NON_FINITE_OUTPUT: &str = "NonFiniteOutput";
    /// An activity type this worker does not serve. Never retried.
    pub const UNKNOWN_ACTIVITY: &str = "UnknownActivity";
    /// The card ran out of memory during the task. Retried by Temporal's policy; the
    /// worker has raised its estimate for the activity, so it admits less at once.
    pub const GPU_OUT_OF_MEMORY: &str = "GpuOutOfMemory";
    /// The model failed on the device. Retried by Temporal's policy.
    pub const MODEL_FAILURE: &str = "ModelFailure";
    /// A task on a shared queue (`gpu-tools`, `cpu-tools`) names a well-formed model this
    /// worker does not serve. Retried, with a growing delay, so that another worker on the
    /// same queue can serve it: the shared queues may be polled by workers with different
    /// models. Route by model queue (`gpu-tools@<model>`) to reach only workers that serve
    /// the model.
    pub const MODEL_NOT_SERVED: &str = "ModelNotServed";
    /// The worker stopped (drain deadline) before the activity finished. Retried, so
    /// another worker takes it at once.
    pub const WORKER_SHUTDOWN: &str = "WorkerShutdown";
    /// A bug in gpulane (a panic) ended the activity. Retried; the worker keeps serving.
    pub const INTERNAL_ERROR: &str = "InternalError";
    /// Storage was unreachable, throttled or failed a request. Retried; `embed_dataset`
    /// resumes from its last written part.
    pub const STORAGE_UNAVAILABLE: &str = "StorageUnavailable";

    /// Every failure type with whether Temporal retries it (the failure's
    /// `non_retryable` is the opposite), for the published schema and client packages.
    pub const ALL: [(&str, bool); 12] = [
        (INVALID_INPUT, false),
        (UNKNOWN_MODEL, false),
        (TEXT_TOO_LONG, false),
        (RESULT_TOO_LARGE, false),
        (NON_FINITE_OUTPUT, false),
        (UNKNOWN_ACTIVITY, false),
        (GPU_OUT_OF_MEMORY, true),
        (MODEL_FAILURE, true),
        (MODEL_NOT_SERVED, true),
        (WORKER_SHUTDOWN, true),
        (INTERNAL_ERROR, true),
        (STORAGE_UNAVAILABLE, true),
    ];
}

/// Makes a host name safe and stable inside a queue name: lower case, and anything but
/// `[a-z0-9-]` becomes `-`, so that dots in FQDNs do not look like separators.
pub fn sanitize_host(host: &str) -> String {
    let s: String = host
        .trim()
        .to_ascii_lowercase()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '-'
            }
        })
        .collect();
    if s.is_empty() {
        "unknown-host".to_owned()
    } else {
        s
    }
}

/// The private queue of one card: `gpu-tools.<host>.<gpu-uuid>`. Stable across restarts
/// (the UUID is burned into the card), unique across hosts, and greppable.
pub fn gpu_card_queue(host: &str, gpu_uuid: &str) -> String {
    format!(
        "{GPU_TOOLS}{QUEUE_PREFIX_SEPARATOR}{}{QUEUE_PREFIX_SEPARATOR}{}",
        sanitize_host(host),
        gpu_uuid.trim().to_ascii_lowercase()
    )
}

/// Whether `name` may name a model: 1 to [`MODEL_NAME_MAX`] characters of ASCII letters,
/// digits, `-`, `_` and `.`, so that it can stand in a queue name and a metric label.
pub fn valid_model_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MODEL_NAME_MAX
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// The queue only workers serving `model` poll, on a shared lane: `gpu-tools@<model>` or
/// `cpu-tools@<model>`. The queue name is the capability: a task there always finds a
/// worker that has the model.
pub fn model_queue(shared: &str, model: &str) -> String {
    format!("{shared}{MODEL_QUEUE_SEPARATOR}{model}")
}

/// The private CPU queue of one host: `cpu-tools.<host>`.
pub fn cpu_host_queue(host: &str) -> String {
    format!("{CPU_TOOLS}{QUEUE_PREFIX_SEPARATOR}{}", sanitize_host(host))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn card_queue_names_host_and_uuid() {
        assert_eq!(
            gpu_card_queue("box-1", "GPU-8f3a2c1e-0000-1111-2222-333344445555"),
            "gpu-tools.box-1.gpu-8f3a2c1e-0000-1111-2222-333344445555"
        );
    }

    #[test]
    fn host_dots_and_case_do_not_leak_into_queue_names() {
        assert_eq!(sanitize_host("GPU-Box.example.com"), "gpu-box-example-com");
        assert_eq!(cpu_host_queue("a.b"), "cpu-tools.a-b");
        assert_eq!(sanitize_host("  "), "unknown-host");
    }

    #[test]
    fn model_queues_name_the_lane_and_the_model() {
        assert_eq!(model_queue(GPU_TOOLS, "e5-small"), "gpu-tools@e5-small");
        assert_eq!(model_queue(CPU_TOOLS, "bge.v1"), "cpu-tools@bge.v1");
    }

    #[test]
    fn model_names_fit_queue_names_and_labels() {
        for ok in ["all-MiniLM-L6-v2", "e5_small", "bge.v1.5", "m"] {
            assert!(valid_model_name(ok), "{ok}");
        }
        let long = "m".repeat(MODEL_NAME_MAX + 1);
        for bad in [
            "",
            "a b",
            "org/name",
            "x\n",
            "q\"uote",
            "a@b",
            long.as_str(),
        ] {
            assert!(!valid_model_name(bad), "{bad:?}");
        }
    }

    #[test]
    fn two_cards_of_one_host_get_distinct_queues() {
        let a = gpu_card_queue("h", "GPU-aaaa");
        let b = gpu_card_queue("h", "GPU-bbbb");
        assert_ne!(a, b);
        assert!(a.starts_with("gpu-tools.h."));
    }
}
