//! `embed_dataset` payloads (the claim-check pattern: texts and vectors stay in storage,
//! references and counts pass through Temporal). JSON field names are the contract.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Input of the `embed_dataset` activity.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct EmbedDatasetRequest {
    /// The dataset's URI (`file:///…` or `s3://bucket/…`), inside a `--data-root`.
    pub source: String,
    /// `parquet`, `jsonl` or `csv`; inferred from the extension when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<String>,
    /// The column of unique row ids (integers or strings).
    pub id_column: String,
    /// The column of texts.
    pub text_column: String,
    /// A URI prefix the parts and the manifest are written under, inside a `--data-root`.
    pub output: String,
    /// Shard `index` of `count`: rows `[index·N/count, (index+1)·N/count)` of N.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard: Option<Shard>,
    /// Rows `[start, end)` of the dataset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rows: Option<RowRange>,
    /// Rows per part file (default 1,000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub part_rows: Option<usize>,
    /// As in `embed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// As in `embed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub normalize: Option<bool>,
    /// As in `embed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub truncate: Option<bool>,
    /// As in `embed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dimensions: Option<usize>,
    /// As in `embed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt: Option<String>,
    /// As in `embed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_name: Option<String>,
}

/// One of `count` equal slices of a dataset.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Shard {
    /// From 0.
    pub index: usize,
    /// At least 1.
    pub count: usize,
}

/// Rows `[start, end)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RowRange {
    /// First row, from 0.
    pub start: usize,
    /// One past the last row.
    pub end: usize,
}

/// One written part file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct PartRef {
    /// Its URI.
    pub uri: String,
    /// Rows in it.
    pub rows: usize,
}

/// Output of `embed_dataset`, also written as the job's manifest file: small whatever the
/// dataset's size.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Manifest {
    /// The output prefix, ending in `/`.
    pub output: String,
    /// The manifest file's URI: `<output>_manifest.json` for a whole dataset,
    /// `<output>_manifest-<start>-<end>.json` for a slice.
    pub manifest: String,
    /// The dataset read.
    pub source: String,
    /// First row embedded.
    pub start: usize,
    /// One past the last row embedded.
    pub end: usize,
    /// Rows embedded (`end - start`).
    pub rows: usize,
    /// Width of each vector.
    pub dimensions: usize,
    /// The model's name.
    pub model: String,
    /// The model's revision (see `EmbedResponse::revision`).
    pub revision: String,
    /// The dtype it computed in (as `EmbedResponse.dtype`: `int8` too).
    pub dtype: String,
    /// Its family.
    pub family: String,
    /// Tokens embedded by this attempt and any earlier ones whose parts it kept are not
    /// recounted: tokens of the parts this attempt wrote.
    pub tokens: u64,
    /// The part files, in row order.
    pub parts: Vec<PartRef>,
    /// Parts an earlier attempt had written, found and kept.
    pub skipped_parts: usize,
}

/// What `embed_dataset` heartbeats: enough for a retried attempt to resume.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DatasetProgress {
    /// Texts done in the part being embedded.
    #[serde(default)]
    pub done: usize,
    /// File names (under the output prefix) of the parts written so far.
    #[serde(default)]
    pub parts_done: Vec<String>,
    /// Rows in those parts.
    #[serde(default)]
    pub rows_done: usize,
    /// Rows per second of this attempt so far.
    #[serde(default)]
    pub rows_per_s: f64,
}
