//! `embed_dataset`: a whole dataset from storage to Parquet, claim-check style. Texts and
//! vectors stay in storage; Temporal carries the request and the manifest. The work goes
//! in parts of a fixed row count, each written whole under a name given by its rows, and
//! after each part the heartbeat lists the parts done, so a retried attempt (another
//! worker, after a crash) skips them and redoes at most the part it was in.
//!
//! The job feeds the device's engine in small calls, like any other activity, so an
//! interactive `embed` arriving meanwhile waits for at most one small call of the job, and
//! a call with a more urgent Temporal priority goes ahead of the job's rows.

mod parts;
mod storage;
mod table;

use std::{sync::Arc, time::Instant};

use gpulane_models::{Engine, ModelKind};
use gpulane_proto::{DatasetProgress, EmbedDatasetRequest, Manifest, PartRef};
use object_store::PutPayload;

pub use self::storage::DataRoots;
use self::{
    parts::{encode, manifest_name, part_name, PartMeta},
    storage::{storage_error, Access},
    table::{Columns, Format},
};
use crate::{
    input::{quote, quote_uri},
    service::{Call, EmbedSpec},
    ActivityError, DeviceActivities,
};

/// Texts per engine call: small, so that other calls on the engine wait for little.
const CHUNK: usize = 64;
/// Rows per part when the request names none.
const DEFAULT_PART_ROWS: usize = 1000;
/// Most rows per part: a part is built in memory.
const MAX_PART_ROWS: usize = 100_000;

const SHAPE: &str = r#"{"source": URI, "format"?: "parquet"|"jsonl"|"csv", "id_column": string, "text_column": string, "output": URI prefix, "shard"?: {"index", "count"}, "rows"?: {"start", "end"}, "part_rows"?: int, "model"?, "normalize"?, "truncate"?, "dimensions"?, "prompt"?, "prompt_name"?}"#;

/// What happened to one part, for metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PartOutcome {
    /// Embedded and written by this attempt.
    Written,
    /// Found written by an earlier attempt (per its last heartbeat) and kept.
    Skipped,
}

impl PartOutcome {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            PartOutcome::Written => "written",
            PartOutcome::Skipped => "skipped",
        }
    }
}

/// Told about each part of a dataset job, so the runtime can count parts and rows
/// without this crate knowing how metrics are exported.
pub trait DatasetObserver: Send + Sync {
    /// A part of `rows` rows of `model`'s job ended as `outcome`.
    fn part(&self, model: &str, outcome: PartOutcome, rows: usize);
}

/// Parses and checks an `embed_dataset` input.
pub(crate) fn parse(input: &[u8]) -> Result<EmbedDatasetRequest, ActivityError> {
    let req: EmbedDatasetRequest = serde_json::from_slice(input).map_err(|e| {
        ActivityError::InvalidInput(format!("embed_dataset input: {e}; expected {SHAPE}"))
    })?;
    let bad = |m: String| Err(ActivityError::InvalidInput(m));
    if let Some(p) = req.part_rows {
        if !(1..=MAX_PART_ROWS).contains(&p) {
            return bad(format!(
                "field \"part_rows\" is {p}: use 1 to {MAX_PART_ROWS} (default {DEFAULT_PART_ROWS})"
            ));
        }
    }
    if let Some(s) = req.shard {
        if s.count == 0 || s.index >= s.count {
            return bad(format!(
                "field \"shard\" is index {} of count {}: count must be at least 1 and index below it",
                s.index, s.count
            ));
        }
    }
    if let Some(r) = req.rows {
        if r.start > r.end {
            return bad(format!(
                "field \"rows\" starts at {} after its end {}",
                r.start, r.end
            ));
        }
    }
    if req.shard.is_some() && req.rows.is_some() {
        return bad("fields \"shard\" and \"rows\" exclude each other: pass one".to_owned());
    }
    for (field, v) in [
        ("id_column", &req.id_column),
        ("text_column", &req.text_column),
    ] {
        if v.is_empty() {
            return bad(format!("field \"{field}\" is empty: name a column"));
        }
    }
    Ok(req)
}

/// The rows a request covers of a dataset of `n` rows, and whether that is all of them.
fn row_range(req: &EmbedDatasetRequest, n: usize) -> Result<(usize, usize, bool), ActivityError> {
    let (start, end) = match (req.shard, req.rows) {
        (Some(s), _) => (s.index * n / s.count, (s.index + 1) * n / s.count),
        (_, Some(r)) => {
            if r.end > n {
                return Err(ActivityError::InvalidInput(format!(
                    "field \"rows\" ends at {}, past the {n} rows of {}",
                    r.end,
                    quote_uri(&req.source)
                )));
            }
            (r.start, r.end)
        }
        (None, None) => (0, n),
    };
    Ok((start, end, start == 0 && end == n))
}

/// Runs one `embed_dataset` request on `engine` (see the module doc).
pub(crate) async fn run(
    svc: &DeviceActivities,
    engine: &Engine,
    req: EmbedDatasetRequest,
    call: &Call<'_>,
) -> Result<Manifest, ActivityError> {
    let roots = svc.data_roots();
    let src = roots.resolve("source", &req.source, Access::Read)?;
    let mut output = req.output.clone();
    if !output.ends_with('/') {
        output.push('/');
    }
    let out = roots.resolve("output", &output, Access::Write)?;
    let format = Format::of(req.format.as_deref(), &req.source)?;
    let bytes = src
        .store
        .get(&src.path)
        .await
        .map_err(|e| storage_error(&req.source, e))?
        .bytes()
        .await
        .map_err(|e| storage_error(&req.source, e))?;
    let (id_col, text_col, uri) = (
        req.id_column.clone(),
        req.text_column.clone(),
        req.source.clone(),
    );
    let table = tokio::task::spawn_blocking(move || {
        let cols = Columns {
            id: &id_col,
            text: &text_col,
            uri: &uri,
        };
        table::read(bytes, format, &cols)
    })
    .await
    .map_err(|e| ActivityError::Internal(format!("reading the dataset: {e}")))??;
    let table = Arc::new(table);
    let n = table.texts.len();
    let (start, end, whole) = row_range(&req, n)?;
    let limit = svc.limits().max_text_chars;
    if let Some((row, t)) = table.texts[start..end]
        .iter()
        .enumerate()
        .find(|(_, t)| t.chars().count() > limit)
    {
        return Err(ActivityError::InvalidInput(format!(
            "row {} of {} has {} characters in column {}, over the limit of {limit} (--max-text-chars): shorten it or raise the limit",
            start + row,
            quote_uri(&req.source),
            t.chars().count(),
            quote(&req.text_column)
        )));
    }

    let ModelKind::Embedder(info) = engine.kind() else {
        unreachable!("embed_dataset gets embedders only; this is a bug")
    };
    let id = &info.identity;
    let part_rows = req.part_rows.unwrap_or(DEFAULT_PART_ROWS);
    let plan: Vec<(usize, usize)> = (start..end)
        .step_by(part_rows)
        .map(|a| (a, (a + part_rows).min(end)))
        .collect();

    // Resume: the parts the last attempt's heartbeat says it wrote, if they are there.
    let previous: DatasetProgress = call
        .last_heartbeat
        .and_then(|b| serde_json::from_slice(b).ok())
        .unwrap_or_default();
    let mut kept = std::collections::HashSet::new();
    for &(a, b) in &plan {
        let name = part_name(a, b);
        if previous.parts_done.contains(&name)
            && out.store.head(&out.path.child(name.as_str())).await.is_ok()
        {
            kept.insert(name);
        }
    }
    let observer = svc.dataset_observer();
    if !kept.is_empty() {
        tracing::info!(
            skipped = kept.len(),
            parts = plan.len(),
            output = %output,
            "resuming embed_dataset: {} of {} parts were written by an earlier attempt (its last heartbeat) and are skipped",
            kept.len(),
            plan.len()
        );
        if let Some(o) = &observer {
            for &(a, b) in &plan {
                if kept.contains(&part_name(a, b)) {
                    o.part(engine.name(), PartOutcome::Skipped, b - a);
                }
            }
        }
    }

    let spec = EmbedSpec {
        normalize: req.normalize,
        truncate: req.truncate,
        dimensions: req.dimensions,
        prompt: req.prompt.clone(),
        prompt_name: req.prompt_name.clone(),
    };
    let mut dims = req.dimensions.unwrap_or(info.dimensions);
    let mut progress = DatasetProgress {
        parts_done: kept.iter().cloned().collect(),
        rows_done: plan
            .iter()
            .filter(|(a, b)| kept.contains(&part_name(*a, *b)))
            .map(|(a, b)| b - a)
            .sum(),
        ..Default::default()
    };
    progress.parts_done.sort();
    let began = Instant::now();
    let (mut rows_now, mut tokens) = (0usize, 0u64);
    let mut parts = Vec::with_capacity(plan.len());
    for &(a, b) in &plan {
        let name = part_name(a, b);
        parts.push(PartRef {
            uri: format!("{output}{name}"),
            rows: b - a,
        });
        if kept.contains(&name) {
            continue;
        }
        call.progress.reset();
        let (mut vectors, mut counts) = (Vec::with_capacity(b - a), Vec::with_capacity(b - a));
        for (c, chunk) in table.texts[a..b].chunks(CHUNK).enumerate() {
            let e = svc
                .embed_texts(
                    engine,
                    &spec,
                    chunk.to_vec(),
                    call.progress,
                    call.priority(),
                )
                .await
                .map_err(|e| e.counted_from(a + c * CHUNK))?;
            dims = e.dimensions;
            vectors.extend(e.vectors);
            counts.extend(e.token_counts);
        }
        tokens += counts.iter().map(|&c| c as u64).sum::<u64>();
        let (t, source) = (table.clone(), req.source.clone());
        let (model, revision, dtype, family) = (
            engine.name().to_owned(),
            id.revision.clone(),
            id.precision().to_owned(),
            id.family.as_str().to_owned(),
        );
        let bytes = tokio::task::spawn_blocking(move || {
            let meta = PartMeta {
                model: &model,
                revision: &revision,
                dtype: &dtype,
                family: &family,
                source: &source,
            };
            encode(&t.ids, a, b, &vectors, &counts, dims, &meta)
        })
        .await
        .map_err(|e| ActivityError::Internal(format!("encoding a part: {e}")))??;
        // One put: on a filesystem object_store writes a temporary file and renames it; on
        // S3 a single PUT is atomic. Either way a part is whole or absent.
        let uri = format!("{output}{name}");
        out.store
            .put(&out.path.child(name.as_str()), PutPayload::from(bytes))
            .await
            .map_err(|e| storage_error(&uri, e))?;
        if let Some(o) = &observer {
            o.part(engine.name(), PartOutcome::Written, b - a);
        }
        rows_now += b - a;
        progress.parts_done.push(name);
        progress.rows_done += b - a;
        progress.rows_per_s = rows_now as f64 / began.elapsed().as_secs_f64().max(1e-9);
        progress.done = 0;
        call.progress.set_details(
            serde_json::to_value(&progress).expect("progress serializes; this is a bug"),
        );
    }

    let manifest_file = manifest_name(start, end, whole);
    let manifest = Manifest {
        manifest: format!("{output}{manifest_file}"),
        output: output.clone(),
        source: req.source.clone(),
        start,
        end,
        rows: end - start,
        dimensions: dims,
        model: engine.name().to_owned(),
        revision: id.revision.clone(),
        dtype: id.precision().to_owned(),
        family: id.family.as_str().to_owned(),
        tokens,
        parts,
        skipped_parts: kept.len(),
    };
    let json = serde_json::to_vec_pretty(&manifest).expect("a manifest serializes; this is a bug");
    out.store
        .put(
            &out.path.child(manifest_file.as_str()),
            PutPayload::from(json),
        )
        .await
        .map_err(|e| storage_error(&manifest.manifest, e))?;
    tracing::info!(
        rows = manifest.rows,
        parts = manifest.parts.len(),
        skipped = manifest.skipped_parts,
        rows_per_s = rows_now as f64 / began.elapsed().as_secs_f64().max(1e-9),
        manifest = %manifest.manifest,
        "embed_dataset done"
    );
    Ok(manifest)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(extra: &str) -> Result<EmbedDatasetRequest, ActivityError> {
        parse(
            format!(
                r#"{{"source": "s3://b/d.parquet", "id_column": "id", "text_column": "text", "output": "s3://b/o/"{extra}}}"#
            )
            .as_bytes(),
        )
    }

    #[test]
    fn shards_cover_every_row_once() {
        let n = 20_003;
        let mut covered = 0;
        let mut next = 0;
        for index in 0..4 {
            let r = req(&format!(r#", "shard": {{"index": {index}, "count": 4}}"#)).unwrap();
            let (a, b, whole) = row_range(&r, n).unwrap();
            assert_eq!(a, next);
            assert!(!whole);
            covered += b - a;
            next = b;
        }
        assert_eq!((covered, next), (n, n));
        assert!(row_range(&req("").unwrap(), n).unwrap().2);
    }

    #[test]
    fn bad_requests_name_the_field() {
        for (extra, field) in [
            (r#", "part_rows": 0"#, "part_rows"),
            (r#", "shard": {"index": 4, "count": 4}"#, "shard"),
            (r#", "rows": {"start": 5, "end": 1}"#, "rows"),
            (r#", "surprise": 1"#, "surprise"),
        ] {
            let m = req(extra).unwrap_err().to_string();
            assert!(m.contains(field), "{extra}: {m}");
        }
        let r = req(r#", "rows": {"start": 0, "end": 50}"#).unwrap();
        assert!(row_range(&r, 10)
            .unwrap_err()
            .to_string()
            .contains("past the 10 rows"));
    }
}
