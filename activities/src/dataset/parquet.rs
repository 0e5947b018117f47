//! Reading the rows a job covers from a Parquet source without the rest of the file: the
//! footer first, then only the column chunks the job needs. Those are the id column of
//! every row group (duplicate ids are refused across the whole file, as in the other
//! formats, so every shard agrees on them) and the text column of the row groups that hold
//! the range. A shard of a large file so holds its own texts, not the file's, and the
//! memory it would take is checked against `--max-dataset-bytes` from the footer, before
//! any of it is fetched.
//!
//! The reading is synchronous (it runs on the blocking pool) and gets its bytes through a
//! caller's `fetch`, so the store behind it, and the count of bytes fetched, stay outside.

use std::{ops::Range, sync::Arc};

use arrow_array::RecordBatch;
use arrow_schema::DataType;
use bytes::Bytes;
use parquet::{
    arrow::{
        arrow_reader::{RowSelection, RowSelector},
        push_decoder::{ParquetPushDecoder, ParquetPushDecoderBuilder},
        ProjectionMask,
    },
    file::metadata::{ParquetMetaData, ParquetMetaDataPushDecoder},
    DecodeResult,
};

use super::table::{arrow_int64, strings, unique, Columns, Ids, Span, Table};
use crate::{input::quote_uri, ActivityError};

/// Rows decoded at a time.
const BATCH: usize = 8192;

/// Gets byte ranges of the source, in order.
pub(crate) type Fetch<'a> = dyn Fn(&[Range<u64>]) -> Result<Vec<Bytes>, ActivityError> + 'a;

/// Fetches through a caller's `fetch`, counting the bytes.
struct Fetcher<'a> {
    fetch: &'a Fetch<'a>,
    fetched: u64,
}

impl Fetcher<'_> {
    fn get(&mut self, ranges: &[Range<u64>]) -> Result<Vec<Bytes>, ActivityError> {
        let got = (self.fetch)(ranges)?;
        self.fetched += got.iter().map(|b| b.len() as u64).sum::<u64>();
        Ok(got)
    }
}

/// The rows a job covers, and how many bytes of the file were fetched for them.
#[derive(Debug)]
pub(crate) struct Read {
    pub table: Table,
    pub fetched: u64,
}

/// Reads the ids of the whole file and the texts of the rows `span_of(rows in the file)`
/// gives, from a Parquet file of `size` bytes.
pub(crate) fn read(
    fetch: &Fetch<'_>,
    size: u64,
    cols: &Columns,
    max_bytes: u64,
    span_of: impl FnOnce(usize) -> Result<Span, ActivityError>,
) -> Result<Read, ActivityError> {
    let mut f = Fetcher { fetch, fetched: 0 };
    let meta = Arc::new(metadata(&mut f, size, cols, max_bytes)?);
    let builder =
        ParquetPushDecoderBuilder::try_new_decoder(meta.clone()).map_err(|e| cols.malformed(e))?;
    let names: Vec<String> = builder
        .schema()
        .fields()
        .iter()
        .map(|f| f.name().clone())
        .collect();
    let index = |which: &str, name: &str| {
        names
            .iter()
            .position(|n| n == name)
            .ok_or_else(|| cols.missing(which, name, &names))
    };
    let (id_at, text_at) = (
        index("id_column", cols.id)?,
        index("text_column", cols.text)?,
    );
    let groups = meta.row_groups();
    let firsts: Vec<usize> = groups
        .iter()
        .scan(0usize, |at, g| {
            let first = *at;
            *at += usize::try_from(g.num_rows()).unwrap_or(0);
            Some(first)
        })
        .collect();
    let n = groups
        .iter()
        .map(|g| usize::try_from(g.num_rows()).unwrap_or(0))
        .sum();
    let span = span_of(n)?;
    // The row groups that hold [start, end).
    let holding: Vec<usize> = (0..groups.len())
        .filter(|&g| {
            let rows = usize::try_from(groups[g].num_rows()).unwrap_or(0);
            firsts[g] < span.end && firsts[g] + rows > span.start
        })
        .collect();

    // What the job would hold: each column chunk decoded, and a `String` per text and id.
    let leaves = builder.parquet_schema();
    let chunk_bytes = |group: usize, root: usize| -> u64 {
        (0..leaves.num_columns())
            .filter(|&leaf| leaves.get_column_root_idx(leaf) == root)
            .map(|leaf| u64::try_from(groups[group].column(leaf).uncompressed_size()).unwrap_or(0))
            .sum()
    };
    let per_row = std::mem::size_of::<String>() as u64;
    let need = (0..groups.len())
        .map(|g| chunk_bytes(g, id_at))
        .sum::<u64>()
        + holding
            .iter()
            .map(|&g| chunk_bytes(g, text_at))
            .sum::<u64>()
        + per_row * (n + span.end - span.start) as u64;
    if need > max_bytes {
        return Err(ActivityError::InvalidInput(format!(
            "field \"source\" is {}: rows {} to {} of its {n} take about {need} bytes once read (their texts, and the ids of every row), over the limit of {max_bytes} bytes for what one embed_dataset activity holds in memory (--max-dataset-bytes, 1/8 of the host's memory by default): run the job in more shards (each reads only its own rows' texts), or raise the limit on a host with the memory",
            quote_uri(cols.uri),
            span.start,
            span.end,
        )));
    }

    let ids = read_ids(&mut f, builder, id_at, cols)?;
    unique(&ids, cols)?;
    let mut texts = Vec::with_capacity(span.end - span.start);
    if let Some(&g0) = holding.first() {
        let in_groups: usize = holding
            .iter()
            .map(|&g| usize::try_from(groups[g].num_rows()).unwrap_or(0))
            .sum();
        let skip = span.start - firsts[g0];
        let take = span.end - span.start;
        let selection = RowSelection::from(vec![
            RowSelector::skip(skip),
            RowSelector::select(take),
            RowSelector::skip(in_groups - skip - take),
        ]);
        let dec = ParquetPushDecoderBuilder::try_new_decoder(meta.clone())
            .map_err(|e| cols.malformed(e))?;
        let mask = ProjectionMask::roots(dec.parquet_schema(), [text_at]);
        let dec = dec
            .with_projection(mask)
            .with_row_groups(holding)
            .with_row_selection(selection)
            .with_batch_size(BATCH)
            .build()
            .map_err(|e| cols.malformed(e))?;
        drain(dec, &mut f, cols, |batch| {
            let first = span.start + texts.len();
            strings(batch.column(0), cols.text, first, cols, &mut texts)
        })?;
    }
    if texts.len() != span.end - span.start {
        return Err(cols.malformed(format!(
            "rows {} to {} gave {} texts; the footer's row counts do not match the data",
            span.start,
            span.end,
            texts.len()
        )));
    }
    Ok(Read {
        table: Table { ids, texts, span },
        fetched: f.fetched,
    })
}

/// The file's footer. It is fetched too, so it counts against the limit: a file of a few
/// bytes of data can still declare a footer of any size.
fn metadata(
    f: &mut Fetcher,
    size: u64,
    cols: &Columns,
    max_bytes: u64,
) -> Result<ParquetMetaData, ActivityError> {
    let mut dec = ParquetMetaDataPushDecoder::try_new(size).map_err(|e| cols.malformed(e))?;
    loop {
        match dec.try_decode().map_err(|e| cols.malformed(e))? {
            DecodeResult::NeedsData(ranges) => {
                let more: u64 = ranges.iter().map(|r| r.end - r.start).sum();
                if f.fetched + more > max_bytes {
                    return Err(ActivityError::InvalidInput(format!(
                        "field \"source\" is {}: its Parquet footer takes {} bytes, over the limit of {max_bytes} bytes for what one embed_dataset activity holds in memory (--max-dataset-bytes): write it with fewer row groups or columns, or raise the limit",
                        quote_uri(cols.uri),
                        f.fetched + more
                    )));
                }
                let data = f.get(&ranges)?;
                dec.push_ranges(ranges, data)
                    .map_err(|e| cols.malformed(e))?;
            }
            DecodeResult::Data(meta) => return Ok(meta),
            DecodeResult::Finished => {
                return Err(cols.malformed("the footer ended before its metadata"))
            }
        }
    }
}

/// The id column of every row group: integers when its type is one, else strings.
fn read_ids(
    f: &mut Fetcher,
    builder: ParquetPushDecoderBuilder,
    id_at: usize,
    cols: &Columns,
) -> Result<Ids, ActivityError> {
    let mask = ProjectionMask::roots(builder.parquet_schema(), [id_at]);
    let dec = builder
        .with_projection(mask)
        .with_batch_size(BATCH)
        .build()
        .map_err(|e| cols.malformed(e))?;
    let (mut ints, mut strs) = (Vec::new(), Vec::new());
    drain(dec, f, cols, |batch| {
        let id = batch.column(0);
        let first = ints.len() + strs.len();
        match id.data_type() {
            DataType::Int8
            | DataType::Int16
            | DataType::Int32
            | DataType::Int64
            | DataType::UInt8
            | DataType::UInt16
            | DataType::UInt32
            | DataType::UInt64 => {
                for (i, v) in arrow_int64(id)?.into_iter().enumerate() {
                    ints.push(v.ok_or_else(|| cols.null(cols.id, first + i))?);
                }
                Ok(())
            }
            _ => strings(id, cols.id, first, cols, &mut strs),
        }
    })?;
    Ok(if strs.is_empty() {
        Ids::Int(ints)
    } else {
        Ids::Str(strs)
    })
}

/// Runs `dec` to the end, fetching what it asks for and handing each batch to `each`.
fn drain(
    mut dec: ParquetPushDecoder,
    f: &mut Fetcher,
    cols: &Columns,
    mut each: impl FnMut(RecordBatch) -> Result<(), ActivityError>,
) -> Result<(), ActivityError> {
    loop {
        match dec.try_decode().map_err(|e| cols.malformed(e))? {
            DecodeResult::NeedsData(ranges) => {
                let data = f.get(&ranges)?;
                dec.push_ranges(ranges, data)
                    .map_err(|e| cols.malformed(e))?;
            }
            DecodeResult::Data(batch) => each(batch)?,
            DecodeResult::Finished => return Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use arrow_array::{Int64Array, StringArray};
    use arrow_schema::{Field, Schema};
    use parquet::{arrow::ArrowWriter, file::properties::WriterProperties};

    use super::*;

    const COLS: Columns<'static> = Columns {
        id: "id",
        text: "text",
        uri: "file:///d/x.parquet",
    };

    /// A file of `n` rows in row groups of `group` rows; row i's text is 500 bytes.
    fn file(n: usize, group: usize, nulls_at: Option<usize>) -> Bytes {
        let schema = Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("text", DataType::Utf8, true),
        ]));
        let props = WriterProperties::builder()
            .set_max_row_group_row_count(Some(group))
            .build();
        let mut buf = Vec::new();
        let mut w = ArrowWriter::try_new(&mut buf, schema.clone(), Some(props)).unwrap();
        let texts: Vec<Option<String>> = (0..n)
            .map(|i| (Some(i) != nulls_at).then(|| format!("{i:05}{}", "x".repeat(495))))
            .collect();
        let batch = RecordBatch::try_new(
            schema,
            vec![
                Arc::new(Int64Array::from_iter_values((0..n as i64).map(|i| i * 10))),
                Arc::new(StringArray::from(texts)),
            ],
        )
        .unwrap();
        w.write(&batch).unwrap();
        w.close().unwrap();
        Bytes::from(buf)
    }

    fn span(start: usize, end: usize) -> impl FnOnce(usize) -> Result<Span, ActivityError> {
        move |n| {
            Ok(Span {
                start,
                end: end.min(n),
                whole: start == 0 && end >= n,
            })
        }
    }

    fn read_from(
        data: &Bytes,
        max: u64,
        s: impl FnOnce(usize) -> Result<Span, ActivityError>,
    ) -> Result<Read, ActivityError> {
        let fetch = |ranges: &[Range<u64>]| {
            Ok(ranges
                .iter()
                .map(|r| data.slice(r.start as usize..r.end as usize))
                .collect())
        };
        read(&fetch, data.len() as u64, &COLS, max, s)
    }

    #[test]
    fn a_range_reads_its_own_texts_and_every_id() {
        let data = file(4000, 1000, None);
        let whole = read_from(&data, u64::MAX, span(0, usize::MAX)).unwrap();
        assert_eq!(whole.table.texts.len(), 4000);
        // Rows 1500..2700 straddle three row groups' edges.
        let r = read_from(&data, u64::MAX, span(1500, 2700)).unwrap();
        assert_eq!(
            r.table.ids,
            Ids::Int((0..4000).map(|i| i * 10).collect()),
            "every id, for the duplicate check"
        );
        assert_eq!(r.table.texts.len(), 1200);
        assert!(
            r.table.texts[0].starts_with("01500"),
            "{}",
            &r.table.texts[0][..5]
        );
        assert!(r.table.texts[1199].starts_with("02699"));
        assert_eq!(
            r.table.texts[..],
            whole.table.texts[1500..2700],
            "the same texts as read whole"
        );
        // Two of four row groups' texts, not the file's.
        assert!(
            r.fetched < whole.fetched * 3 / 5,
            "fetched {} of a whole read's {}",
            r.fetched,
            whole.fetched
        );
        let empty = read_from(&data, u64::MAX, span(4000, 4000)).unwrap();
        assert!(empty.table.texts.is_empty());
        assert!(empty.fetched < whole.fetched / 5, "{}", empty.fetched);
    }

    #[test]
    fn the_limit_counts_the_range_not_the_file() {
        let data = file(4000, 1000, None);
        // About 500 bytes of text a row: a quarter of the file fits 1 MB, all of it not.
        let m = read_from(&data, 1_000_000, span(0, 4000))
            .unwrap_err()
            .to_string();
        assert!(
            m.contains("over the limit of 1000000 bytes") && m.contains("--max-dataset-bytes"),
            "{m}"
        );
        assert!(m.contains("rows 0 to 4000 of its 4000"), "{m}");
        let r = read_from(&data, 1_000_000, span(1000, 2000)).unwrap();
        assert_eq!(r.table.texts.len(), 1000);
        // A footer alone over the limit is refused before the data is looked at.
        let m = read_from(&data, 100, span(0, 0)).unwrap_err().to_string();
        assert!(m.contains("footer"), "{m}");
    }

    #[test]
    fn problems_name_the_row_or_file() {
        let data = file(3000, 1000, Some(2100));
        let m = read_from(&data, u64::MAX, span(2000, 3000))
            .unwrap_err()
            .to_string();
        assert!(
            m.contains("row 2100 of") && m.contains("\"text\""),
            "the row is the file's, not the range's: {m}"
        );
        // Outside the range, a null text is not read.
        assert!(read_from(&data, u64::MAX, span(0, 1000)).is_ok());
        let m = read_from(&Bytes::from("not parquet"), u64::MAX, span(0, 0))
            .unwrap_err()
            .to_string();
        assert!(m.contains("x.parquet") && m.contains("not a valid"), "{m}");
    }
}
