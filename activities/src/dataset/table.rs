//! What the dataset readers (`parquet`, `records`) share: the formats, the table a job
//! reads (every id, its own rows' texts), the bytes it holds against the limit (`Held`),
//! and the messages that name the column, the row or the URI of a problem: a missing
//! column, a null, a malformed file, a duplicate id.

use std::sync::Arc;

use arrow_array::ArrayRef;

use super::memory::Claim;
use crate::{
    input::{kind, quote, quote_uri},
    ActivityError,
};

/// A dataset's file format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Format {
    Parquet,
    JsonLines,
    Csv,
}

impl Format {
    /// The request's `format`, else the source's extension.
    pub(crate) fn of(given: Option<&str>, uri: &str) -> Result<Self, ActivityError> {
        let name = match given {
            Some(f) => f.to_owned(),
            None => uri
                .rsplit('/')
                .next()
                .and_then(|f| f.rsplit_once('.'))
                .map(|(_, ext)| ext.to_ascii_lowercase())
                .unwrap_or_default(),
        };
        match name.as_str() {
            "parquet" | "pq" => Ok(Format::Parquet),
            "jsonl" | "ndjson" => Ok(Format::JsonLines),
            "csv" => Ok(Format::Csv),
            other => Err(ActivityError::InvalidInput(format!(
                "field \"format\" is {} (given or from the extension of {}): use \"parquet\", \"jsonl\" or \"csv\"",
                quote(other),
                quote_uri(uri)
            ))),
        }
    }
}

/// The ids of a dataset: integers when every id is one, else strings.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Ids {
    Int(Vec<i64>),
    Str(Vec<String>),
}

impl Ids {
    /// Whether row `i`'s id is `v`, read from a text format (as [`Ids`] were made of
    /// such values: integers when all were, else strings and numbers as their text).
    pub(crate) fn holds(&self, i: usize, v: &serde_json::Value) -> bool {
        match (self, v) {
            (Ids::Int(ids), v) => ids.get(i).is_some_and(|&id| v.as_i64() == Some(id)),
            (Ids::Str(ids), serde_json::Value::String(s)) => ids.get(i) == Some(s),
            (Ids::Str(ids), v) => ids.get(i) == Some(&v.to_string()),
        }
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            Ids::Int(v) => v.len(),
            Ids::Str(v) => v.len(),
        }
    }

    /// Rows `[start, end)` as an Arrow array.
    pub(crate) fn slice(&self, start: usize, end: usize) -> ArrayRef {
        match self {
            Ids::Int(v) => Arc::new(arrow_array::Int64Array::from(v[start..end].to_vec())),
            Ids::Str(v) => Arc::new(arrow_array::StringArray::from(v[start..end].to_vec())),
        }
    }

    /// The first id that appears twice, with both rows.
    fn duplicate(&self) -> Option<(String, usize, usize)> {
        fn first_dup<T: Ord + ToString>(v: &[T]) -> Option<(String, usize, usize)> {
            // Sorted references tell whether any id repeats in [`UNIQUE_BYTES`] a row (a
            // map of every id took about three times that); only an id that does is
            // looked for again, in row order, to name the first repeat and its rows.
            let mut sorted: Vec<&T> = v.iter().collect();
            sorted.sort_unstable();
            let mut repeated: Vec<&T> = Vec::new();
            for w in sorted.windows(2) {
                if w[0] == w[1] && repeated.last() != Some(&w[0]) {
                    repeated.push(w[0]);
                }
            }
            drop(sorted);
            if repeated.is_empty() {
                return None;
            }
            // Where each repeated id was first seen, by its place in `repeated`.
            let mut first: Vec<Option<usize>> = vec![None; repeated.len()];
            for (row, id) in v.iter().enumerate() {
                if let Ok(k) = repeated.binary_search(&id) {
                    match first[k] {
                        Some(at) => return Some((id.to_string(), at, row)),
                        None => first[k] = Some(row),
                    }
                }
            }
            None
        }
        match self {
            Ids::Int(v) => first_dup(v),
            Ids::Str(v) => first_dup(v),
        }
    }
}

/// What looking for a repeated id holds a row while it looks (counted with the ids).
pub(super) const UNIQUE_BYTES: u64 = std::mem::size_of::<usize>() as u64;

/// The rows a job covers of a dataset: `[start, end)`, and whether that is all of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Span {
    pub start: usize,
    pub end: usize,
    pub whole: bool,
}

/// What a job reads of a dataset: the ids of every row (checked unique across the file,
/// so that every shard agrees), and the texts of its span's rows, `texts[i]` being row
/// `span.start + i`.
#[derive(Debug)]
pub(crate) struct Table {
    pub ids: Ids,
    pub texts: Vec<String>,
    pub span: Span,
}

/// Which columns to read, and the file they come from (for messages).
pub(crate) struct Columns<'a> {
    pub id: &'a str,
    pub text: &'a str,
    pub uri: &'a str,
}

impl Columns<'_> {
    /// Where the id and text columns are among a file's column `names`.
    pub(super) fn positions(&self, names: &[String]) -> Result<(usize, usize), ActivityError> {
        let at = |which: &str, name: &str| {
            names
                .iter()
                .position(|n| n == name)
                .ok_or_else(|| self.missing(which, name, names))
        };
        Ok((at("id_column", self.id)?, at("text_column", self.text)?))
    }

    pub(super) fn missing(&self, which: &str, name: &str, have: &[String]) -> ActivityError {
        ActivityError::InvalidInput(format!(
            "field \"{which}\": {} is not a column of {}; its columns are {have:?}",
            quote(name),
            quote_uri(self.uri)
        ))
    }

    pub(super) fn malformed(&self, why: impl std::fmt::Display) -> ActivityError {
        ActivityError::InvalidInput(format!(
            "{} is not a valid file of its format: {why}",
            quote_uri(self.uri)
        ))
    }

    pub(super) fn null(&self, column: &str, row: usize) -> ActivityError {
        ActivityError::InvalidInput(format!(
            "row {row} of {} has no value in column {}: every row needs an id and a text",
            quote_uri(self.uri),
            quote(column)
        ))
    }

    /// A JSON Lines value that is null ([`Columns::null`]) or not of the type `want`.
    pub(super) fn json_value(
        &self,
        column: &str,
        row: usize,
        v: &serde_json::Value,
        want: &str,
    ) -> ActivityError {
        let found = match v {
            serde_json::Value::Null => return self.null(column, row),
            // A number is short whatever the file holds: show it.
            serde_json::Value::Number(n) => format!("the number {n}"),
            other => kind(other).to_owned(),
        };
        ActivityError::InvalidInput(format!(
            "row {row} of {} has {found} in column {}: it must be {want}",
            quote_uri(self.uri),
            quote(column)
        ))
    }
}

/// Refuses duplicate ids, naming the first one and both its rows; what looking takes is
/// claimed in `held` while it looks.
pub(super) fn unique(ids: &Ids, held: &mut Held) -> Result<(), ActivityError> {
    let looking = UNIQUE_BYTES.saturating_mul(ids.len() as u64);
    held.add(looking)?;
    let cols = held.cols;
    let found = ids.duplicate();
    held.give_back(looking);
    match found {
        Some((id, first, again)) => Err(ActivityError::InvalidInput(format!(
            "column {} of {} has duplicates: id {} is at rows {first} and {again}; ids must be unique, since each names one output row",
            quote(cols.id),
            quote_uri(cols.uri),
            quote(&id)
        ))),
        None => Ok(()),
    }
}

/// What a `String` costs beside its bytes: a text's or an id's row.
pub(super) const PER_ROW: u64 = std::mem::size_of::<String>() as u64;

/// The bytes a job holds of its source, against `--max-dataset-bytes`: counted as the
/// ids are read and before or as the texts are, so a file that understates what it holds
/// (a Parquet dictionary holds a repeated text once; a hostile footer, anything) is
/// refused before it takes the memory.
pub(super) struct Held<'a> {
    pub cols: &'a Columns<'a>,
    /// The job's rows and the file's count, once known.
    span: Option<(Span, usize)>,
    /// The job's share of the worker's dataset memory, whose limit binds one job too.
    claim: &'a mut Claim,
    bytes: u64,
    /// The most claimed ahead of counting ([`Held::reserve`]), kept when bytes are given back.
    reserved: u64,
}

impl<'a> Held<'a> {
    pub(super) fn new(cols: &'a Columns<'a>, claim: &'a mut Claim) -> Self {
        Self {
            cols,
            span: None,
            claim,
            bytes: 0,
            reserved: 0,
        }
    }

    /// The job's rows, of the file's `n`, for the message.
    pub(super) fn span(&mut self, span: Span, n: usize) {
        self.span = Some((span, n));
    }

    /// Refused: the job would hold `how` bytes.
    pub(super) fn over(&self, how: &str) -> ActivityError {
        let what = match self.span {
            Some((span, n)) => format!(
                "rows {} to {} of its {n} take {how} bytes once read (their texts, and the ids of every row)",
                span.start, span.end
            ),
            None => format!("its ids take {how} bytes once read"),
        };
        ActivityError::InvalidInput(format!(
            "field \"source\" is {}: {what}, over the limit of {} bytes for what one embed_dataset activity holds in memory (--max-dataset-bytes, 1/8 of the host's memory by default): run the job in more shards (each reads only its own rows' texts), or raise the limit on a host with the memory",
            quote_uri(self.cols.uri),
            self.claim.limit(),
        ))
    }

    /// Counts `bytes` more and claims them: refused when the job alone would pass the
    /// limit, stopped when the claim fails (see [`Held::cover`]).
    pub(super) fn add(&mut self, bytes: u64) -> Result<(), ActivityError> {
        self.bytes = self.bytes.saturating_add(bytes);
        if self.bytes > self.claim.limit() {
            return Err(self.over(&format!("at least {}", self.bytes)));
        }
        self.cover(self.bytes)
    }

    /// Stops counting `bytes` that are no longer held, and gives back their claim (not
    /// what was reserved ahead).
    pub(super) fn give_back(&mut self, bytes: u64) {
        self.bytes = self.bytes.saturating_sub(bytes);
        self.claim.shrink(self.bytes.max(self.reserved));
    }

    /// Claims `bytes` in all ahead of counting them (a Parquet footer's estimate, within
    /// the limit: the caller checked), so that a job short of memory stops before it
    /// fetches.
    pub(super) fn reserve(&mut self, bytes: u64) -> Result<(), ActivityError> {
        self.reserved = self.reserved.max(bytes);
        self.cover(bytes)
    }

    /// Claims `bytes` in all of the worker's dataset memory. Out of its turn a job's claim
    /// fails when the memory is taken, and so does this read; in its turn the claim waits
    /// (see `memory`). Either way it fails once the job's activity has ended.
    fn cover(&mut self, bytes: u64) -> Result<(), ActivityError> {
        if self.claim.cover(bytes) {
            return Ok(());
        }
        // `load` sees the claim short, waits for the job's turn and reads again; or the
        // job's activity has ended, and no one is left to read it. This error only stops
        // the read.
        Err(ActivityError::Internal(
            "the worker's other embed_dataset jobs hold its dataset memory".to_owned(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The repeat named is the first in row order, whatever sorts first, with the row
    /// its id first appeared at.
    #[test]
    fn the_first_repeated_id_is_named_with_both_rows() {
        assert_eq!(
            Ids::Int(vec![9, 5, 3, 7, 3, 5, 5]).duplicate(),
            Some(("3".to_owned(), 2, 4))
        );
        let strs = |v: &[&str]| Ids::Str(v.iter().map(|s| s.to_string()).collect());
        assert_eq!(
            strs(&["b", "a", "c", "a", "b"]).duplicate(),
            Some(("a".to_owned(), 1, 3))
        );
        assert_eq!(Ids::Int((0..1000).rev().collect()).duplicate(), None);
        assert_eq!(strs(&[]).duplicate(), None);
    }

    #[test]
    fn formats_come_from_the_request_or_the_extension() {
        assert_eq!(
            Format::of(None, "s3://b/a.parquet").unwrap(),
            Format::Parquet
        );
        assert_eq!(
            Format::of(None, "file:///a/b.JSONL").unwrap(),
            Format::JsonLines
        );
        assert_eq!(
            Format::of(Some("csv"), "file:///a/b.txt").unwrap(),
            Format::Csv
        );
        assert!(Format::of(None, "file:///a/b.txt").is_err());
    }
}
