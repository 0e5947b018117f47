//! `embed_dataset`: a whole dataset from storage to Parquet, claim-check style. Texts and
//! vectors stay in storage; Temporal carries the request and the manifest. The work goes
//! in parts of a fixed row count, each written whole under a name given by its rows, and
//! after each part the heartbeat lists the parts done, so a retried attempt (another
//! worker, after a crash) skips them and redoes at most the part it was in.
//!
//! The job feeds the device's engine in small calls, like any other activity, so an
//! interactive `embed` arriving meanwhile waits for at most one small call of the job, and
//! a call with a more urgent Temporal priority goes ahead of the job's rows.

mod memory;
mod parquet;
mod parts;
mod records;
mod source;
mod storage;
mod stream;
mod table;

use std::{sync::Arc, time::Instant};

use gpulane_models::{Engine, ModelKind};
use gpulane_proto::{DatasetProgress, EmbedDatasetRequest, Manifest, PartRef, RowRange, Shard};
use object_store::PutPayload;
use serde_json::{Map, Value};

pub use self::{memory::DatasetMemory, storage::DataRoots};
use self::{
    parts::{encode, manifest_name, part_name, PartMeta},
    source::{load, Source},
    storage::{storage_error, Access},
    table::{Format, Span},
};
use crate::{
    input::{invalid, kind, object, opt_bool, opt_positive, opt_string, quote, quote_uri, shown},
    service::{Call, EmbedSpec},
    ActivityError, DeviceActivities,
};

/// Most texts per engine call: small, so that other calls on the engine wait for little.
const CHUNK: usize = 64;
/// Rows per part when the request names none.
const DEFAULT_PART_ROWS: usize = 1000;
/// Most rows per part: a part is built in memory.
const MAX_PART_ROWS: usize = 100_000;

const FIELDS: &[&str] = &[
    "source",
    "format",
    "id_column",
    "text_column",
    "output",
    "shard",
    "rows",
    "part_rows",
    "model",
    "normalize",
    "truncate",
    "dimensions",
    "prompt",
    "prompt_name",
];
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
    /// A job waited `secs` for the memory other jobs held of the worker's dataset memory:
    /// for its turn, and in it for the memory.
    fn memory_wait(&self, secs: f64);
}

/// Parses and checks an `embed_dataset` input. Checks a `serde_json::Value` by hand, as
/// `embed` does, rather than deriving: serde's messages name neither the field of a wrong
/// type nor a limit, and repeat an unknown field's name however long.
pub(crate) fn parse(input: &[u8]) -> Result<EmbedDatasetRequest, ActivityError> {
    let obj = object(input, FIELDS, SHAPE)?;
    let required = |field: &str| {
        opt_string(&obj, field)?
            .ok_or_else(|| invalid(format!("field \"{field}\" is required: pass {SHAPE}")))
    };
    let part_rows_hint =
        format!("use 1 to {MAX_PART_ROWS} or omit it for {DEFAULT_PART_ROWS} rows a part");
    let req = EmbedDatasetRequest {
        source: required("source")?,
        format: opt_string(&obj, "format")?,
        id_column: required("id_column")?,
        text_column: required("text_column")?,
        output: required("output")?,
        shard: pair(&obj, "shard", ["index", "count"])?
            .map(|[index, count]| Shard { index, count }),
        rows: pair(&obj, "rows", ["start", "end"])?.map(|[start, end]| RowRange { start, end }),
        part_rows: opt_positive(&obj, "part_rows", &part_rows_hint)?,
        model: opt_string(&obj, "model")?,
        normalize: opt_bool(&obj, "normalize")?,
        truncate: opt_bool(&obj, "truncate")?,
        dimensions: opt_positive(&obj, "dimensions", "omit it for the model's full width")?,
        prompt: opt_string(&obj, "prompt")?,
        prompt_name: opt_string(&obj, "prompt_name")?,
    };
    let bad = |m: String| Err(ActivityError::InvalidInput(m));
    if let Some(p) = req.part_rows {
        if p > MAX_PART_ROWS {
            return bad(format!("field \"part_rows\" is {p}: {part_rows_hint}"));
        }
    }
    if req.prompt.is_some() && req.prompt_name.is_some() {
        return bad(
            "fields \"prompt\" and \"prompt_name\" exclude each other: pass one".to_owned(),
        );
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

/// An optional object of two non-negative integers named `keys`, such as `"shard":
/// {"index": 0, "count": 4}`.
fn pair(
    obj: &Map<String, Value>,
    field: &str,
    keys: [&str; 2],
) -> Result<Option<[usize; 2]>, ActivityError> {
    let shape = format!("{{\"{}\": int, \"{}\": int}}", keys[0], keys[1]);
    let m = match obj.get(field) {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(m)) => m,
        Some(other) => {
            return Err(invalid(format!(
                "field \"{field}\" must be an object {shape}, got {}",
                kind(other)
            )))
        }
    };
    if let Some(k) = m.keys().find(|k| !keys.contains(&k.as_str())) {
        return Err(invalid(format!(
            "field \"{field}\" has an unknown key {}: pass {shape}",
            quote(k)
        )));
    }
    let mut out = [0; 2];
    for (o, key) in out.iter_mut().zip(keys) {
        *o = match m.get(key).map(|v| (v, v.as_u64().map(usize::try_from))) {
            Some((_, Some(Ok(n)))) => n,
            found => {
                return Err(invalid(format!(
                    "field \"{field}.{key}\" must be a non-negative integer, got {}: pass {shape}",
                    found.map_or("nothing".to_owned(), |(v, _)| shown(v))
                )));
            }
        };
    }
    Ok(Some(out))
}

/// The engine calls that embed texts of `lens` characters, as ranges of them: at most
/// [`CHUNK`] texts, and at most `max_chars` characters with the `prompt` characters before
/// each, which is what the host's tokenizing reserve was sized for (`--max-total-chars`);
/// a text alone over that still goes, alone.
fn calls(lens: &[usize], prompt: usize, max_chars: usize) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut chars) = (0, 0);
    for (i, &len) in lens.iter().enumerate() {
        let n = prompt + len;
        if i > start && (i - start == CHUNK || chars + n > max_chars) {
            out.push(start..i);
            (start, chars) = (i, 0);
        }
        chars += n;
    }
    if start < lens.len() {
        out.push(start..lens.len());
    }
    out
}

/// The rows a request covers of a dataset of `n` rows.
fn row_range(req: &EmbedDatasetRequest, n: usize) -> Result<Span, ActivityError> {
    // In u128: `(index + 1) · n` overflows usize for an index near usize::MAX, and `parse`
    // only bounds the index by the count. Each bound is at most n, so it fits back.
    let slice = |s: Shard, i: usize| (i as u128 * n as u128 / s.count as u128) as usize;
    let (start, end) = match (req.shard, req.rows) {
        (Some(s), _) => (slice(s, s.index), slice(s, s.index + 1)),
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
    Ok(Span {
        start,
        end,
        whole: start == 0 && end == n,
    })
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
    // The options are checked against the model before the source is read, so a bad one
    // fails at once, even where the range turns out to hold no rows.
    let spec = EmbedSpec {
        normalize: req.normalize,
        truncate: req.truncate,
        dimensions: req.dimensions,
        prompt: req.prompt.clone(),
        prompt_name: req.prompt_name.clone(),
    };
    let resolved = spec.resolve(engine)?;
    let observer = svc.dataset_observer();
    let source = Source {
        at: &src,
        uri: &req.source,
        format,
        id_column: &req.id_column,
        text_column: &req.text_column,
        memory: svc.dataset_memory(),
        observer: observer.as_deref(),
    };
    let span_req = req.clone();
    // The claim holds the job's share of the worker's dataset memory until the job ends,
    // as the table does the memory.
    let (table, _claim) = load(source, move |n| row_range(&span_req, n)).await?;
    let table = Arc::new(table);
    let Span { start, end, whole } = table.span;
    // Every row of the range, with the prompt that goes before it, against the per-text
    // limit, before any part is written. `embed`'s per-call total does not apply: the job
    // sizes its own calls.
    let limit = svc.limits().max_text_chars;
    let prompt = resolved.prompt_in_effect().map_or(0, |p| p.chars().count());
    // Counted once: the parts' calls are cut by the same counts.
    let lens: Vec<usize> = table.texts.iter().map(|t| t.chars().count()).collect();
    if let Some((row, &chars)) = lens
        .iter()
        .enumerate()
        .find(|&(_, &chars)| prompt + chars > limit)
    {
        let with = match prompt {
            0 => String::new(),
            p => format!(" and {p} more of prompt before it"),
        };
        return Err(ActivityError::InvalidInput(format!(
            "row {} of {} has {chars} characters in column {}{with}, over the limit of {limit} (--max-text-chars): shorten it{}, or raise the limit",
            start + row,
            quote_uri(&req.source),
            quote(&req.text_column),
            if prompt > 0 { " or the prompt" } else { "" },
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

    let mut dims = resolved.dimensions;
    let max_chars = svc.limits().max_total_chars;
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
        for r in calls(&lens[a - start..b - start], prompt, max_chars) {
            let e = svc
                .embed_resolved(
                    engine,
                    &resolved,
                    table.texts[a - start + r.start..a - start + r.end].to_vec(),
                    call.progress,
                    call.priority(),
                )
                .await
                .map_err(|e| e.counted_from(a + r.start))?;
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
            let Span {
                start: a,
                end: b,
                whole,
            } = row_range(&r, n).unwrap();
            assert_eq!(a, next);
            assert!(!whole);
            covered += b - a;
            next = b;
        }
        assert_eq!((covered, next), (n, n));
        assert!(row_range(&req("").unwrap(), n).unwrap().whole);
    }

    fn span(start: usize, end: usize) -> Span {
        Span {
            start,
            end,
            whole: false,
        }
    }

    /// `(index + 1) · n` overflowed for an index near usize::MAX: a panic the worker
    /// caught and reported as a retryable internal error, on every retry.
    #[test]
    fn a_shard_index_near_the_largest_integer_gives_its_slice() {
        let (index, count) = (usize::MAX - 1, usize::MAX);
        let r = req(&format!(
            r#", "shard": {{"index": {index}, "count": {count}}}"#
        ))
        .unwrap();
        assert_eq!(row_range(&r, 10).unwrap(), span(9, 10));
        let r = req(&format!(r#", "shard": {{"index": 0, "count": {count}}}"#)).unwrap();
        assert_eq!(row_range(&r, 10).unwrap(), span(0, 0));
    }

    #[test]
    fn calls_hold_at_most_64_texts_and_the_characters_of_one_embed_call() {
        assert_eq!(calls(&[1; 130], 0, 1000), [0..64, 64..128, 128..130]);
        // 4 + 4 fit in 10 characters, a third does not; with a prompt of 2, 5 + 5 do.
        assert_eq!(calls(&[4, 4, 4, 4], 0, 10), [0..2, 2..4]);
        assert_eq!(calls(&[3, 3, 3], 2, 10), [0..2, 2..3]);
        // A text over the bound alone goes alone.
        assert_eq!(calls(&[2, 20, 2], 0, 10), [0..1, 1..2, 2..3]);
        assert!(calls(&[], 0, 10).is_empty());
    }

    #[test]
    fn bad_requests_name_the_field() {
        for (extra, field) in [
            (r#", "part_rows": 0"#, "part_rows"),
            (r#", "shard": {"index": 4, "count": 4}"#, "shard"),
            (r#", "rows": {"start": 5, "end": 1}"#, "rows"),
            (r#", "surprise": 1"#, "surprise"),
            (
                r#", "part_rows": "10""#,
                "field \"part_rows\" must be a positive integer, got a string;",
            ),
            (r#", "part_rows": 100001"#, "use 1 to 100000"),
            (r#", "format": 5"#, "field \"format\" must be a string"),
            (r#", "source": "s3://b/e.parquet""#, "key \"source\" twice"),
            (r#", "shard": 3"#, "field \"shard\" must be an object"),
            (
                r#", "shard": {"index": -1, "count": 2}"#,
                "field \"shard.index\" must be a non-negative integer, got -1",
            ),
            (
                r#", "rows": {"start": 0}"#,
                "field \"rows.end\" must be a non-negative integer, got nothing",
            ),
            (
                r#", "rows": {"start": 0, "end": 1, "step": 2}"#,
                "unknown key \"step\"",
            ),
            (
                r#", "prompt": "q: ", "prompt_name": "query""#,
                "exclude each other",
            ),
        ] {
            let m = req(extra).unwrap_err().to_string();
            assert!(m.contains(field), "{extra}: {m}");
        }
        let m = parse(br#"{"id_column": "id", "text_column": "text", "output": "s3://b/o/"}"#)
            .unwrap_err()
            .to_string();
        assert!(m.contains("field \"source\" is required"), "{m}");
        let r = req(r#", "rows": {"start": 0, "end": 50}"#).unwrap();
        assert!(row_range(&r, 10)
            .unwrap_err()
            .to_string()
            .contains("past the 10 rows"));
    }
}
