//! Reading a dataset's id and text columns from Parquet, JSON Lines or CSV bytes. Every
//! problem names the column, the row or the URI: a missing column, a null, a malformed
//! file, a duplicate id.

use std::{collections::HashMap, sync::Arc};

use arrow_array::{cast::AsArray, types, Array, ArrayRef};
use arrow_schema::DataType;

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
    /// Rows `[start, end)` as an Arrow array.
    pub(crate) fn slice(&self, start: usize, end: usize) -> ArrayRef {
        match self {
            Ids::Int(v) => Arc::new(arrow_array::Int64Array::from(v[start..end].to_vec())),
            Ids::Str(v) => Arc::new(arrow_array::StringArray::from(v[start..end].to_vec())),
        }
    }

    /// The first id that appears twice, with both rows.
    fn duplicate(&self) -> Option<(String, usize, usize)> {
        fn first_dup<T: std::hash::Hash + Eq + ToString>(
            v: &[T],
        ) -> Option<(String, usize, usize)> {
            let mut seen: HashMap<&T, usize> = HashMap::with_capacity(v.len());
            for (row, id) in v.iter().enumerate() {
                if let Some(&first) = seen.get(id) {
                    return Some((id.to_string(), first, row));
                }
                seen.insert(id, row);
            }
            None
        }
        match self {
            Ids::Int(v) => first_dup(v),
            Ids::Str(v) => first_dup(v),
        }
    }
}

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

    fn missing(&self, which: &str, name: &str, have: &[String]) -> ActivityError {
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
    fn json_value(
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

/// Reads the id and text columns of `bytes`, a JSON Lines or CSV file (there is no
/// reading part of one), and keeps the texts of the span `span_of(rows in the file)` gives.
pub(crate) fn read(
    bytes: &[u8],
    format: Format,
    cols: &Columns,
    span_of: impl FnOnce(usize) -> Result<Span, ActivityError>,
) -> Result<Table, ActivityError> {
    let (ids, mut texts) = match format {
        Format::JsonLines => read_jsonl(bytes, cols)?,
        Format::Csv => read_csv(bytes, cols)?,
        Format::Parquet => unreachable!("Parquet is read by its row groups; this is a bug"),
    };
    unique(&ids, cols)?;
    let span = span_of(texts.len())?;
    texts.truncate(span.end);
    texts.drain(..span.start);
    Ok(Table { ids, texts, span })
}

/// Refuses duplicate ids, naming the first one and both its rows.
pub(super) fn unique(ids: &Ids, cols: &Columns) -> Result<(), ActivityError> {
    match ids.duplicate() {
        Some((id, first, again)) => Err(ActivityError::InvalidInput(format!(
            "column {} of {} has duplicates: id {} is at rows {first} and {again}; ids must be unique, since each names one output row",
            quote(cols.id),
            quote_uri(cols.uri),
            quote(&id)
        ))),
        None => Ok(()),
    }
}

/// An integer column as i64 (unsigned values past i64's range are refused).
pub(super) fn arrow_int64(a: &ArrayRef) -> Result<Vec<Option<i64>>, ActivityError> {
    macro_rules! widen {
        ($t:ty) => {
            a.as_primitive::<$t>()
                .iter()
                .map(|v| v.map(i64::from))
                .collect()
        };
    }
    Ok(match a.data_type() {
        DataType::Int8 => widen!(types::Int8Type),
        DataType::Int16 => widen!(types::Int16Type),
        DataType::Int32 => widen!(types::Int32Type),
        DataType::Int64 => a.as_primitive::<types::Int64Type>().iter().collect(),
        DataType::UInt8 => widen!(types::UInt8Type),
        DataType::UInt16 => widen!(types::UInt16Type),
        DataType::UInt32 => widen!(types::UInt32Type),
        DataType::UInt64 => {
            let mut out = Vec::with_capacity(a.len());
            for v in a.as_primitive::<types::UInt64Type>().iter() {
                out.push(match v {
                    Some(v) => Some(i64::try_from(v).map_err(|_| {
                        ActivityError::InvalidInput(format!(
                            "id {v} does not fit a signed 64-bit integer"
                        ))
                    })?),
                    None => None,
                });
            }
            out
        }
        other => unreachable!("called for integer columns only, not {other}"),
    })
}

/// Appends a string column's values to `out`, refusing nulls and non-string types.
pub(super) fn strings(
    a: &ArrayRef,
    column: &str,
    first: usize,
    cols: &Columns,
    out: &mut Vec<String>,
) -> Result<(), ActivityError> {
    let push = |out: &mut Vec<String>, i: usize, v: Option<&str>| -> Result<(), ActivityError> {
        out.push(v.ok_or_else(|| cols.null(column, first + i))?.to_owned());
        Ok(())
    };
    match a.data_type() {
        DataType::Utf8 => {
            for (i, v) in a.as_string::<i32>().iter().enumerate() {
                push(out, i, v)?;
            }
        }
        DataType::LargeUtf8 => {
            for (i, v) in a.as_string::<i64>().iter().enumerate() {
                push(out, i, v)?;
            }
        }
        DataType::Utf8View => {
            for (i, v) in a.as_string_view().iter().enumerate() {
                push(out, i, v)?;
            }
        }
        other => {
            return Err(ActivityError::InvalidInput(format!(
                "column {} of {} is {other}; it must be text (or, for ids, integers)",
                quote(column),
                quote_uri(cols.uri)
            )))
        }
    }
    Ok(())
}

/// Ids read from text formats: integers when all are, else strings.
fn ids_from(raw: Vec<serde_json::Value>) -> Ids {
    if raw.iter().all(|v| v.as_i64().is_some()) {
        Ids::Int(raw.iter().filter_map(serde_json::Value::as_i64).collect())
    } else {
        Ids::Str(
            raw.into_iter()
                .map(|v| match v {
                    serde_json::Value::String(s) => s,
                    other => other.to_string(),
                })
                .collect(),
        )
    }
}

fn read_jsonl(bytes: &[u8], cols: &Columns) -> Result<(Ids, Vec<String>), ActivityError> {
    let text = std::str::from_utf8(bytes).map_err(|e| cols.malformed(e))?;
    let (mut ids, mut texts) = (Vec::new(), Vec::new());
    for (line_no, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let row = texts.len();
        let obj: serde_json::Map<String, serde_json::Value> = serde_json::from_str(line)
            .map_err(|e| cols.malformed(format!("line {}: {e}", line_no + 1)))?;
        let get = |which: &str, name: &str| {
            obj.get(name).cloned().ok_or_else(|| {
                let have: Vec<String> = obj.keys().cloned().collect();
                let e = cols.missing(which, name, &have);
                ActivityError::InvalidInput(format!("{e} (row {row}, line {})", line_no + 1))
            })
        };
        let id = get("id_column", cols.id)?;
        if !(id.is_i64() || id.is_string()) {
            let want = "a signed 64-bit integer or a string";
            return Err(cols.json_value(cols.id, row, &id, want));
        }
        match get("text_column", cols.text)? {
            serde_json::Value::String(s) => texts.push(s),
            other => return Err(cols.json_value(cols.text, row, &other, "a string")),
        }
        ids.push(id);
    }
    Ok((ids_from(ids), texts))
}

fn read_csv(bytes: &[u8], cols: &Columns) -> Result<(Ids, Vec<String>), ActivityError> {
    let mut r = csv::ReaderBuilder::new()
        .has_headers(true)
        .from_reader(bytes);
    let headers: Vec<String> = r
        .headers()
        .map_err(|e| cols.malformed(e))?
        .iter()
        .map(str::to_owned)
        .collect();
    let (id_at, text_at) = cols.positions(&headers)?;
    let (mut ids, mut texts) = (Vec::new(), Vec::new());
    for (row, rec) in r.records().enumerate() {
        let rec = rec.map_err(|e| cols.malformed(format!("row {row}: {e}")))?;
        let id = rec.get(id_at).ok_or_else(|| cols.null(cols.id, row))?;
        let text = rec.get(text_at).ok_or_else(|| cols.null(cols.text, row))?;
        ids.push(match id.parse::<i64>() {
            Ok(n) => serde_json::Value::from(n),
            Err(_) => serde_json::Value::from(id),
        });
        texts.push(text.to_owned());
    }
    Ok((ids_from(ids), texts))
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;

    /// The whole file, as bytes.
    fn read(b: Bytes, format: Format, cols: &Columns) -> Result<Table, ActivityError> {
        let all = |n| {
            Ok(Span {
                start: 0,
                end: n,
                whole: true,
            })
        };
        super::read(&b, format, cols, all)
    }

    fn cols() -> Columns<'static> {
        Columns {
            id: "id",
            text: "text",
            uri: "file:///d/x",
        }
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

    #[test]
    fn jsonl_and_csv_read_ids_and_texts() {
        let t = read(
            Bytes::from("{\"id\": 1, \"text\": \"a\"}\n{\"id\": 2, \"text\": \"b\"}\n"),
            Format::JsonLines,
            &cols(),
        )
        .unwrap();
        assert_eq!(
            (t.ids, t.texts),
            (Ids::Int(vec![1, 2]), vec!["a".to_owned(), "b".to_owned()])
        );
        let t = read(
            Bytes::from("id,text\nx,\"a, b\"\ny,c\n"),
            Format::Csv,
            &cols(),
        )
        .unwrap();
        assert_eq!(t.ids, Ids::Str(vec!["x".to_owned(), "y".to_owned()]));
        assert_eq!(t.texts[0], "a, b");
    }

    #[test]
    fn a_span_keeps_its_texts_and_every_id() {
        let cols = cols();
        let span = |n: usize| {
            assert_eq!(n, 3);
            Ok(Span {
                start: 1,
                end: 2,
                whole: false,
            })
        };
        let t = super::read(b"id,text\n7,a\n8,b\n9,c\n", Format::Csv, &cols, span).unwrap();
        assert_eq!(t.ids, Ids::Int(vec![7, 8, 9]));
        assert_eq!(t.texts, vec!["b".to_owned()]);
    }

    #[test]
    fn problems_name_the_column_row_or_id() {
        let m = read(Bytes::from("id,body\n1,a\n"), Format::Csv, &cols())
            .unwrap_err()
            .to_string();
        assert!(m.contains("\"text\"") && m.contains("body"), "{m}");
        let m = read(
            Bytes::from("id,text\n7,a\n8,b\n7,c\n"),
            Format::Csv,
            &cols(),
        )
        .unwrap_err()
        .to_string();
        assert!(m.contains("\"7\"") && m.contains("rows 0 and 2"), "{m}");
        let m = read(Bytes::from("{\"id\": 1}\n"), Format::JsonLines, &cols())
            .unwrap_err()
            .to_string();
        assert!(m.contains("\"text\"") && m.contains("row 0"), "{m}");
        // A value of the wrong type is named as what it is, not as missing.
        for (line, found) in [
            (
                r#"{"id": 1.5, "text": "a"}"#,
                "has the number 1.5 in column \"id\"",
            ),
            (
                r#"{"id": true, "text": "a"}"#,
                "has a boolean in column \"id\"",
            ),
            (
                r#"{"id": 1, "text": 7}"#,
                "has the number 7 in column \"text\"",
            ),
            (
                r#"{"id": 1, "text": null}"#,
                "has no value in column \"text\"",
            ),
        ] {
            let m = read(Bytes::from(line), Format::JsonLines, &cols())
                .unwrap_err()
                .to_string();
            assert!(m.contains(found), "{line}: {m}");
        }
    }
}
