/// Per-call input limits. They bound tokenizer work and memory per activity, and keep
/// results under Temporal's payload limit for typical models; README.md documents them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Most texts in one `embed` call.
    pub max_texts: usize,
    /// Most characters (Unicode scalar values) in one text.
    pub max_text_chars: usize,
    /// Most characters over all texts of one call.
    pub max_total_chars: usize,
    /// Largest result in bytes of JSON. Temporal refuses payloads over 2 MB by default
    /// (and retries such a completion forever), so gpulane checks before returning.
    pub max_result_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_texts: 1024,
            max_text_chars: 100_000,
            max_total_chars: 1_000_000,
            max_result_bytes: 2_000_000,
        }
    }
}
