//! JSON Lines and CSV sources. They have no index to read part of, so the job reads them
//! in two passes: the first streams the whole file for its ids (checked unique, as in
//! every format) and where each row starts; the second fetches only the bytes of the job's
//! rows and keeps their texts. A shard so holds every id and its own texts, not the file's,
//! though each shard still streams the whole file once.

use std::{
    cell::Cell,
    io::{BufRead, BufReader, Read},
    ops::Range,
};

use bytes::Bytes;
use serde_json::{Map, Value};

use super::{
    memory::Claim,
    storage::changed,
    table::{unique, Columns, Format, Held, Ids, Span, Table, PER_ROW},
};
use crate::{input::quote_uri, ActivityError};

/// One row of a JSON Lines or CSV file.
struct Record {
    /// Where the row starts in the bytes parsed.
    offset: u64,
    id: Value,
    text: String,
}

/// Reads the ids of the file `whole` streams (`size` bytes) and the texts of the rows
/// `span_of(rows in the file)` gives, fetched through `fetch_range`.
pub(crate) fn read(
    whole: &mut dyn Read,
    fetch_range: &dyn Fn(Range<u64>) -> Result<Bytes, ActivityError>,
    size: u64,
    format: Format,
    cols: &Columns,
    claim: &mut Claim,
    span_of: impl FnOnce(usize) -> Result<Span, ActivityError>,
) -> Result<Table, ActivityError> {
    let max_bytes = claim.limit();
    let mut held = Held::new(cols, claim);
    let (mut ids, mut offsets) = (IdsRead::Int(Vec::new()), Vec::<u64>::new());
    // A row's bytes count twice once its range is fetched (below): a row over half the
    // limit could never be held, so it is refused as the first pass reads it.
    let header = records(whole, format, cols, None, 0, max_bytes / 2, |r| {
        // The id as held and the row's offset, the vectors counted as they grow.
        let room = offsets.capacity();
        let bytes = ids.push(r.id);
        offsets.push(r.offset);
        held.add(bytes + grown(&offsets, room))
    })?;
    let ids = ids.done();
    let n = ids.len();
    unique(&ids, &mut held)?;
    let span = span_of(n)?;
    held.span(span, n);
    let mut texts = Vec::with_capacity(span.end - span.start);
    // The second read must give the rows the first one found: storage is asked for the
    // version the first read saw, and each row's id is compared. A file replaced between
    // the two is storage's doing, so the job fails as retryable and reads it anew.
    let replaced = |why: String| changed(cols.uri, &why);
    if span.start < span.end {
        let bytes = offsets[span.start]..offsets.get(span.end).copied().unwrap_or(size);
        // The rows' bytes are what their texts take at most (escapes and quotes only
        // shrink); both are held at once, so they count twice before they are fetched.
        let rows = (span.end - span.start) as u64;
        held.add(
            (bytes.end - bytes.start)
                .saturating_mul(2)
                .saturating_add(rows * PER_ROW),
        )?;
        let part = fetch_range(bytes)?;
        let mut row = span.start;
        records(
            &mut part.as_ref(),
            format,
            cols,
            header,
            span.start,
            u64::MAX,
            |r| {
                if row >= span.end || !ids.holds(row, &r.id) {
                    return Err(replaced(format!("row {row} is not where it was")));
                }
                row += 1;
                texts.push(r.text);
                Ok(())
            },
        )
        // The first pass parsed these bytes: if they do not parse now, they are others.
        .map_err(|e| match e {
            ActivityError::StorageUnavailable(_) => e,
            other => replaced(other.to_string()),
        })?;
    }
    if texts.len() != span.end - span.start {
        return Err(replaced(format!(
            "rows {} to {} gave {} rows",
            span.start,
            span.end,
            texts.len()
        )));
    }
    Ok(Table { ids, texts, span })
}

/// Parses `r` record by record, the first being row `first`. `header` is the CSV header's
/// (id, text) positions when `r` starts past it (the second pass); what it returns is
/// them, read from the header. A row over `max_row` bytes is refused as it is read, so one
/// huge line cannot take the memory the limit is there to keep.
fn records(
    r: &mut dyn Read,
    format: Format,
    cols: &Columns,
    header: Option<(usize, usize)>,
    first: usize,
    max_row: u64,
    each: impl FnMut(Record) -> Result<(), ActivityError>,
) -> Result<Option<(usize, usize)>, ActivityError> {
    let too_long = |row: usize| {
        ActivityError::InvalidInput(format!(
            "row {row} of {} takes over {max_row} bytes on its own, over what one embed_dataset activity can hold of a row within its limit (half of --max-dataset-bytes: a row's bytes and its text are held at once): shorten it, or raise the limit",
            quote_uri(cols.uri)
        ))
    };
    match format {
        Format::JsonLines => jsonl(r, cols, first, max_row, too_long, each).map(|()| None),
        Format::Csv => csv(r, cols, header, first, max_row, too_long, each).map(Some),
        Format::Parquet => unreachable!("Parquet is read by its row groups; this is a bug"),
    }
}

fn jsonl(
    r: &mut dyn Read,
    cols: &Columns,
    first: usize,
    max_row: u64,
    too_long: impl Fn(usize) -> ActivityError,
    mut each: impl FnMut(Record) -> Result<(), ActivityError>,
) -> Result<(), ActivityError> {
    let mut r = BufReader::with_capacity(1 << 16, r);
    let (mut line, mut offset, mut line_no, mut row) = (Vec::new(), 0u64, 0usize, first);
    loop {
        line.clear();
        let got = (&mut r)
            .take(max_row.saturating_add(1))
            .read_until(b'\n', &mut line)
            .map_err(|e| cols.malformed(e))?;
        if got == 0 {
            return Ok(());
        }
        if got as u64 > max_row {
            return Err(too_long(row));
        }
        let start = offset;
        offset += got as u64;
        line_no += 1;
        // As `str::trim` has it: a line of Unicode spaces is blank too.
        if std::str::from_utf8(&line).is_ok_and(|l| l.trim().is_empty()) {
            continue;
        }
        let obj: Map<String, Value> = serde_json::from_slice(&line)
            .map_err(|e| cols.malformed(format!("line {line_no}: {e}")))?;
        let get = |obj: &Map<String, Value>, which: &str, name: &str| {
            obj.get(name).cloned().ok_or_else(|| {
                let have: Vec<String> = obj.keys().cloned().collect();
                let e = cols.missing(which, name, &have);
                ActivityError::InvalidInput(format!("{e} (row {row}, line {line_no})"))
            })
        };
        let id = get(&obj, "id_column", cols.id)?;
        if !(id.is_i64() || id.is_string()) {
            let want = "a signed 64-bit integer or a string";
            return Err(cols.json_value(cols.id, row, &id, want));
        }
        let text = match get(&obj, "text_column", cols.text)? {
            Value::String(s) => s,
            other => return Err(cols.json_value(cols.text, row, &other, "a string")),
        };
        each(Record {
            offset: start,
            id,
            text,
        })?;
        row += 1;
    }
}

fn csv(
    r: &mut dyn Read,
    cols: &Columns,
    header: Option<(usize, usize)>,
    first: usize,
    max_row: u64,
    too_long: impl Fn(usize) -> ActivityError,
    mut each: impl FnMut(Record) -> Result<(), ActivityError>,
) -> Result<(usize, usize), ActivityError> {
    // Where the record being read began: the reader below stops once it has read more
    // than a row may take past it (and the csv reader's buffer).
    let mark = Cell::new(0u64);
    let mut capped = Capped {
        inner: r,
        read: 0,
        mark: &mark,
        cap: max_row.saturating_add(1 << 16),
        over: false,
    };
    let mut r = csv::ReaderBuilder::new()
        .has_headers(header.is_none())
        .from_reader(&mut capped);
    let (id_at, text_at) = match header {
        Some(at) => at,
        None => {
            let headers: Vec<String> = r
                .headers()
                .map_err(|e| cols.malformed(e))?
                .iter()
                .map(str::to_owned)
                .collect();
            cols.positions(&headers)?
        }
    };
    mark.set(r.position().byte());
    let mut rec = csv::StringRecord::new();
    for row in first.. {
        match r.read_record(&mut rec) {
            Ok(true) => {}
            Ok(false) => break,
            Err(_) if r.get_ref().over => return Err(too_long(row)),
            Err(e) => return Err(cols.malformed(format!("row {row}: {e}"))),
        }
        let end = r.position().byte();
        if end.saturating_sub(rec.position().map_or(end, |p| p.byte())) > max_row {
            return Err(too_long(row));
        }
        mark.set(end);
        let id = rec.get(id_at).ok_or_else(|| cols.null(cols.id, row))?;
        let text = rec.get(text_at).ok_or_else(|| cols.null(cols.text, row))?;
        each(Record {
            offset: rec.position().map_or(0, |p| p.byte()),
            id: match id.parse::<i64>() {
                Ok(n) => Value::from(n),
                Err(_) => Value::from(id),
            },
            text: text.to_owned(),
        })?;
    }
    Ok((id_at, text_at))
}

/// A reader that fails once it has read `cap` bytes past `mark`: a bound on what one
/// record can take while it is read (a run of blank lines that long is refused too).
struct Capped<'a, 'm> {
    inner: &'a mut dyn Read,
    read: u64,
    mark: &'m Cell<u64>,
    cap: u64,
    over: bool,
}

impl Read for Capped<'_, '_> {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        if self.read.saturating_sub(self.mark.get()) > self.cap {
            self.over = true;
            return Err(std::io::Error::other("a row over the limit"));
        }
        let n = self.inner.read(out)?;
        self.read += n as u64;
        Ok(n)
    }
}

/// Ids as a text format's first pass reads them: integers while every one is one, strings
/// from the first that is not (the integers before it as their text, as JSON prints them,
/// so that [`Ids::holds`] finds them again).
enum IdsRead {
    Int(Vec<i64>),
    Str(Vec<String>),
}

impl IdsRead {
    /// Keeps `id`; gives the bytes it holds more: the id's own, and what its vector grew.
    fn push(&mut self, id: Value) -> u64 {
        match (&mut *self, id) {
            (IdsRead::Int(v), Value::Number(n)) if n.is_i64() => {
                let room = v.capacity();
                v.push(n.as_i64().unwrap_or_default());
                grown(v, room)
            }
            (IdsRead::Int(v), id) => {
                let strings: Vec<String> = v.iter().map(i64::to_string).collect();
                // The integers' text, beside the integers until they are dropped here.
                let texts: u64 = strings.iter().map(|s| s.len() as u64).sum();
                let bytes = texts + grown(&strings, 0);
                *self = IdsRead::Str(strings);
                bytes + self.push(id)
            }
            (IdsRead::Str(v), id) => {
                let id = match id {
                    Value::String(s) => s,
                    other => other.to_string(),
                };
                let (room, len) = (v.capacity(), id.len() as u64);
                v.push(id);
                len + grown(v, room)
            }
        }
    }

    fn done(self) -> Ids {
        match self {
            IdsRead::Int(v) => Ids::Int(v),
            IdsRead::Str(v) => Ids::Str(v),
        }
    }
}

/// The bytes `v` took more since its capacity was `room`: a vector holds its capacity, up
/// to twice what it has in it.
fn grown<T>(v: &Vec<T>, room: usize) -> u64 {
    (v.capacity().saturating_sub(room) * std::mem::size_of::<T>()) as u64
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;
    use crate::dataset::memory::DatasetMemory;

    fn cols() -> Columns<'static> {
        Columns {
            id: "id",
            text: "text",
            uri: "file:///d/x",
        }
    }

    /// Reads `b` with the span `span_of` gives, under `max` bytes; also the bytes the
    /// second pass fetched.
    fn read_span(
        b: &[u8],
        format: Format,
        max: u64,
        span_of: impl FnOnce(usize) -> Result<Span, ActivityError>,
    ) -> Result<(Table, u64), ActivityError> {
        let fetched = Cell::new(0);
        let fetch = |r: Range<u64>| {
            fetched.set(fetched.get() + r.end - r.start);
            Ok(Bytes::copy_from_slice(&b[r.start as usize..r.end as usize]))
        };
        let t = super::read(
            &mut &b[..],
            &fetch,
            b.len() as u64,
            format,
            &cols(),
            &mut Claim::new(&DatasetMemory::new(max)),
            span_of,
        )?;
        Ok((t, fetched.get()))
    }

    /// The whole file.
    fn read(b: Bytes, format: Format, _: &Columns) -> Result<Table, ActivityError> {
        let all = |n| {
            Ok(Span {
                start: 0,
                end: n,
                whole: true,
            })
        };
        read_span(&b, format, u64::MAX, all).map(|(t, _)| t)
    }

    fn span_of(start: usize, end: usize) -> Span {
        Span {
            start,
            end,
            whole: false,
        }
    }

    fn span(start: usize, end: usize) -> impl FnOnce(usize) -> Result<Span, ActivityError> {
        move |n| {
            Ok(Span {
                start,
                end,
                whole: start == 0 && end == n,
            })
        }
    }

    #[test]
    fn a_span_fetches_its_own_rows_bytes_and_keeps_every_id() {
        // Quoted newlines and commas inside CSV fields; blank lines and CRLF in JSON Lines.
        let csv = b"id,text\n7,\"a,\nb\"\n8,\"c\"\"d\"\n9,e\n10,f\n";
        let (t, fetched) = read_span(csv, Format::Csv, u64::MAX, span(1, 3)).unwrap();
        assert_eq!(t.ids, Ids::Int(vec![7, 8, 9, 10]));
        assert_eq!(t.texts, vec!["c\"d".to_owned(), "e".to_owned()]);
        assert_eq!(fetched, "8,\"c\"\"d\"\n9,e\n".len() as u64);
        let (t, _) = read_span(csv, Format::Csv, u64::MAX, span(0, 4)).unwrap();
        assert_eq!(t.texts[0], "a,\nb");
        assert_eq!(t.texts[3], "f");
        let jsonl = b"{\"id\": \"x\", \"text\": \"a\"}\r\n\n  \n{\"id\": \"y\", \"text\": \"b\\nc\"}\n{\"id\": \"z\", \"text\": \"d\"}";
        let (t, _) = read_span(jsonl, Format::JsonLines, u64::MAX, span(1, 3)).unwrap();
        assert_eq!(
            t.ids,
            Ids::Str(vec!["x".to_owned(), "y".to_owned(), "z".to_owned()])
        );
        assert_eq!(t.texts, vec!["b\nc".to_owned(), "d".to_owned()]);
        // An empty span fetches nothing.
        let (t, fetched) = read_span(jsonl, Format::JsonLines, u64::MAX, span(3, 3)).unwrap();
        assert!(t.texts.is_empty() && fetched == 0);
    }

    /// Integer ids turn to strings from the first id that is not one, the integers before
    /// it as their text, and the second pass still finds each row's id.
    #[test]
    fn ids_are_integers_until_one_is_not() {
        let jsonl = b"{\"id\": 1, \"text\": \"a\"}\n{\"id\": \"x\", \"text\": \"b\"}\n{\"id\": 30, \"text\": \"c\"}\n";
        let (t, _) = read_span(jsonl, Format::JsonLines, u64::MAX, span(0, 3)).unwrap();
        assert_eq!(t.ids, Ids::Str(["1", "x", "30"].map(String::from).to_vec()));
        assert_eq!(t.texts, ["a", "b", "c"].map(String::from).to_vec());
        let csv = b"id,text\n-4,a\n5,b\n";
        let (t, _) = read_span(csv, Format::Csv, u64::MAX, span(0, 2)).unwrap();
        assert_eq!(t.ids, Ids::Int(vec![-4, 5]));
    }

    #[test]
    fn a_row_over_the_limit_on_its_own_is_refused_as_it_is_read() {
        let long = "w".repeat(300_000);
        let jsonl =
            format!("{{\"id\": 1, \"text\": \"a\"}}\n{{\"id\": 2, \"text\": \"{long}\"}}\n");
        let csv = format!("id,text\n1,a\n2,{long}\n");
        for (b, format) in [(jsonl, Format::JsonLines), (csv, Format::Csv)] {
            let m = read_span(b.as_bytes(), format, 100_000, span(0, 0))
                .unwrap_err()
                .to_string();
            assert!(
                m.contains("row 1 of") && m.contains("takes over 50000 bytes on its own"),
                "{format:?}: {m}"
            );
        }
    }

    /// The error of a read whose first pass sees `first` and whose second is served from
    /// `replaced`.
    fn replaced_read(first: &[u8], replaced: &[u8], format: Format, rows: Span) -> ActivityError {
        let fetch = |r: Range<u64>| {
            Ok(Bytes::copy_from_slice(
                &replaced[r.start as usize..r.end as usize],
            ))
        };
        super::read(
            &mut &first[..],
            &fetch,
            first.len() as u64,
            format,
            &cols(),
            &mut Claim::new(&DatasetMemory::new(u64::MAX)),
            |_| Ok(rows),
        )
        .unwrap_err()
    }

    #[test]
    fn a_second_read_of_other_rows_is_refused_as_retryable() {
        let cases: [(&[u8], &[u8], Format, Span); 2] = [
            (
                b"id,text\n1,aaaa\n2,bbbb\n3,cccc\n",
                b"id,text\n3,cccc\n1,aaaa\n2,bbbb\n",
                Format::Csv,
                span_of(0, 3),
            ),
            // Replaced by rows of other lengths, the range starts mid-row and does not
            // parse: that is the change too, not a malformed file.
            (
                b"{\"id\": 1, \"text\": \"a\"}\n{\"id\": 2, \"text\": \"b\"}\n",
                b"{\"id\": 1, \"text\": \"longer\"}\n{\"id\": 2, \"text\": \"b\"}\n",
                Format::JsonLines,
                span_of(1, 2),
            ),
        ];
        for (first, replaced, format, rows) in cases {
            let e = replaced_read(first, replaced, format, rows);
            assert!(
                matches!(&e, ActivityError::StorageUnavailable(m) if m.contains("changed while it was read")),
                "{format:?}: {e:?}"
            );
        }
    }

    #[test]
    fn lines_of_unicode_spaces_are_blank() {
        let jsonl = "{\"id\": 1, \"text\": \"a\"}\n\u{a0}\u{2003}\n{\"id\": 2, \"text\": \"b\"}\n";
        let (t, _) = read_span(jsonl.as_bytes(), Format::JsonLines, u64::MAX, span(0, 2)).unwrap();
        assert_eq!(t.texts, vec!["a".to_owned(), "b".to_owned()]);
    }

    #[test]
    fn the_limit_counts_every_id_and_the_spans_rows() {
        let mut csv = b"id,text\n".to_vec();
        for i in 0..1000 {
            csv.extend(format!("{i},{}\n", "w".repeat(1000)).as_bytes());
        }
        // About 1 MB of texts and 40 kB of ids; a range's bytes count twice (they are held
        // with the texts made of them): a twentieth of the rows fits 200 kB.
        let m = read_span(&csv, Format::Csv, 200_000, span(0, 1000))
            .unwrap_err()
            .to_string();
        assert!(
            m.contains("rows 0 to 1000 of its 1000")
                && m.contains("over the limit of 200000 bytes"),
            "{m}"
        );
        let (t, _) = read_span(&csv, Format::Csv, 200_000, span(500, 550)).unwrap();
        assert_eq!(t.texts.len(), 50);
        let m = read_span(&csv, Format::Csv, 10_000, span(0, 0))
            .unwrap_err()
            .to_string();
        assert!(m.contains("its ids take at least"), "{m}");
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
        let span = |n: usize| {
            assert_eq!(n, 3);
            Ok(Span {
                start: 1,
                end: 2,
                whole: false,
            })
        };
        let (t, _) = read_span(b"id,text\n7,a\n8,b\n9,c\n", Format::Csv, u64::MAX, span).unwrap();
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
