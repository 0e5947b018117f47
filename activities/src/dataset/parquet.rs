//! Reading the rows a job covers from a Parquet source without the rest of the file: the
//! footer first, then only the column chunks the job needs. Those are the id column of
//! every row group (duplicate ids are refused across the whole file, as in the other
//! formats, so every shard agrees on them) and the text column of the row groups that hold
//! the range. A shard of a large file so holds its own texts, not the file's. The memory
//! that takes is checked against `--max-dataset-bytes` from the footer before any of it is
//! fetched, and counted again as rows are decoded, since a footer can understate it.
//!
//! The reading is synchronous (it runs on the blocking pool) and gets its bytes through a
//! caller's `fetch`, so the store behind it, and the count of bytes fetched, stay outside.

use std::{ops::Range, sync::Arc};

use arrow_array::{cast::AsArray, types, Array, ArrayRef, RecordBatch};
use arrow_schema::{DataType, Field, Schema};
use bytes::Bytes;
use parquet::{
    arrow::{
        arrow_reader::{ArrowReaderMetadata, ArrowReaderOptions, RowSelection, RowSelector},
        push_decoder::{ParquetPushDecoder, ParquetPushDecoderBuilder},
        ProjectionMask,
    },
    file::metadata::{ParquetMetaData, ParquetMetaDataPushDecoder},
    DecodeResult,
};

use super::{
    memory::Claim,
    table::{unique, Columns, Held, Ids, Span, Table, PER_ROW},
};
use crate::{
    input::{quote, quote_uri},
    ActivityError,
};

/// Ids decoded at a time.
const ID_BATCH: usize = 8192;
/// Texts decoded at a time: few, so a batch's views and buffers stay small.
const TEXT_BATCH: usize = 256;

/// Gets byte ranges of the source, in order.
pub(crate) type Fetch<'a> = dyn Fn(&[Range<u64>]) -> Result<Vec<Bytes>, ActivityError> + 'a;

/// Fetches through a caller's `fetch`, counting the bytes, and refusing ranges the file
/// does not have (a footer that points past the end is the file's fault, not storage's)
/// and a single fetch over the limit (what the footer says a column chunk takes is not
/// trusted until it is decoded).
struct Fetcher<'a> {
    fetch: &'a Fetch<'a>,
    size: u64,
    max_bytes: u64,
    fetched: u64,
}

impl Fetcher<'_> {
    fn get(&mut self, ranges: &[Range<u64>], cols: &Columns) -> Result<Vec<Bytes>, ActivityError> {
        if let Some(r) = ranges.iter().find(|r| r.end > self.size || r.start > r.end) {
            return Err(cols.malformed(format!(
                "its footer points at bytes {} to {}, outside its {} bytes",
                r.start, r.end, self.size
            )));
        }
        let more = ranges
            .iter()
            .fold(0u64, |sum, r| sum.saturating_add(r.end - r.start));
        if more > self.max_bytes {
            return Err(ActivityError::InvalidInput(format!(
                "field \"source\" is {}: one of its column chunks takes {more} bytes, over the limit of {} bytes for what one embed_dataset activity holds in memory (--max-dataset-bytes): write it with smaller row groups, or raise the limit",
                quote_uri(cols.uri),
                self.max_bytes
            )));
        }
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

/// Rows of a row group as the footer gives them (a negative count is refused by the
/// decoder; here it counts as none).
fn rows_of(meta: &ParquetMetaData, group: usize) -> usize {
    usize::try_from(meta.row_group(group).num_rows()).unwrap_or(0)
}

/// Reads the ids of the whole file and the texts of the rows `span_of(rows in the file)`
/// gives, from a Parquet file of `size` bytes.
pub(crate) fn read(
    fetch: &Fetch<'_>,
    size: u64,
    cols: &Columns,
    claim: &mut Claim,
    span_of: impl FnOnce(usize) -> Result<Span, ActivityError>,
) -> Result<Read, ActivityError> {
    let max_bytes = claim.limit();
    let mut f = Fetcher {
        fetch,
        size,
        max_bytes,
        fetched: 0,
    };
    let meta = Arc::new(metadata(&mut f, cols)?);
    // The file's Arrow schema, with texts as views, derived once for both decoders.
    let arrow = views(&meta, cols)?;
    let decoder = || ParquetPushDecoderBuilder::new_with_metadata(arrow.clone());
    let builder = decoder();
    let names: Vec<String> = builder
        .schema()
        .fields()
        .iter()
        .map(|f| f.name().clone())
        .collect();
    let (id_at, text_at) = cols.positions(&names)?;
    let groups = meta.num_row_groups();
    let mut firsts = Vec::with_capacity(groups);
    let mut n = 0usize;
    for g in 0..groups {
        firsts.push(n);
        n = n.checked_add(rows_of(&meta, g)).ok_or_else(|| {
            cols.malformed("its footer's row counts add up past the largest integer")
        })?;
    }
    let span = span_of(n)?;
    // The row groups that hold some of [start, end): none for an empty span, nor a group
    // of no rows (the decoder gives it no reader).
    let holding: Vec<usize> = (0..groups)
        .filter(|&g| {
            span.start < span.end
                && rows_of(&meta, g) > 0
                && firsts[g] < span.end
                && firsts[g] + rows_of(&meta, g) > span.start
        })
        .collect();

    // What the job would hold, by the footer: each column chunk decoded (the largest of
    // its sizes, since a dictionary's encoded size is far under its values'), and a
    // `String` a text and an id.
    let leaves = builder.parquet_schema();
    let chunk_bytes = |group: usize, root: usize| -> u64 {
        (0..leaves.num_columns())
            .filter(|&leaf| leaves.get_column_root_idx(leaf) == root)
            .map(|leaf| {
                let c = meta.row_group(group).column(leaf);
                [
                    c.uncompressed_size(),
                    c.compressed_size(),
                    c.unencoded_byte_array_data_bytes().unwrap_or(0),
                ]
                .into_iter()
                .map(|b| u64::try_from(b).unwrap_or(0))
                .max()
                .unwrap_or(0)
            })
            .fold(0u64, u64::saturating_add)
    };
    let mut held = Held::new(cols, claim);
    held.span(span, n);
    let need = (0..groups)
        .map(|g| chunk_bytes(g, id_at))
        .chain(holding.iter().map(|&g| chunk_bytes(g, text_at)))
        .fold(0u64, u64::saturating_add)
        .saturating_add(PER_ROW.saturating_mul((n + span.end - span.start) as u64));
    if need > max_bytes {
        return Err(held.over(&format!("about {need}")));
    }
    // The footer's estimate is claimed before any data is fetched; values past it (a
    // footer can understate them) are claimed as they are counted.
    held.reserve(need)?;

    let ids = read_ids(&mut f, &mut held, builder, &meta, id_at)?;
    if ids.len() != n {
        return Err(cols.malformed(format!(
            "it holds {} ids where its footer says {n} rows",
            ids.len()
        )));
    }
    unique(&ids, &mut held)?;
    let mut texts = Vec::with_capacity(span.end - span.start);
    if let Some(&g0) = holding.first() {
        let in_groups: usize = holding.iter().map(|&g| rows_of(&meta, g)).sum();
        let skip = span.start - firsts[g0];
        let take = span.end - span.start;
        let selection = RowSelection::from(vec![
            RowSelector::skip(skip),
            RowSelector::select(take),
            RowSelector::skip(in_groups - skip - take),
        ]);
        let dec = decoder();
        let mask = ProjectionMask::roots(dec.parquet_schema(), [text_at]);
        let dec = dec
            .with_projection(mask)
            .with_row_groups(holding.clone())
            .with_row_selection(selection)
            .with_batch_size(TEXT_BATCH)
            .build()
            .map_err(|e| cols.malformed(e))?;
        // Each row group must give the rows of the span it holds: a text chunk with more
        // or fewer rows than its footer says would pair texts with other rows' ids.
        let mut next = holding.iter();
        drain(
            dec,
            &mut f,
            cols,
            |batch| {
                let first = span.start + texts.len();
                strings(batch.column(0), cols.text, first, &mut held, &mut texts)
            },
            |rows| {
                let g = *next.next().ok_or_else(|| {
                    cols.malformed("it gave more row groups of texts than asked for")
                })?;
                let (a, b) = (firsts[g], firsts[g] + rows_of(&meta, g));
                let want = b.min(span.end) - a.max(span.start);
                if rows != want {
                    return Err(cols.malformed(format!(
                        "row group {g} gave {rows} texts of rows {} to {} where its footer makes them {want}",
                        a.max(span.start),
                        b.min(span.end)
                    )));
                }
                Ok(())
            },
        )?;
    }
    if texts.len() != span.end - span.start {
        return Err(cols.malformed(format!(
            "rows {} to {} gave {} texts; its footer's row counts do not match its data",
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
fn metadata(f: &mut Fetcher, cols: &Columns) -> Result<ParquetMetaData, ActivityError> {
    let mut dec = ParquetMetaDataPushDecoder::try_new(f.size).map_err(|e| cols.malformed(e))?;
    loop {
        match dec.try_decode().map_err(|e| cols.malformed(e))? {
            DecodeResult::NeedsData(ranges) => {
                let more = ranges.iter().fold(0u64, |sum, r| {
                    sum.saturating_add(r.end.saturating_sub(r.start))
                });
                if f.fetched.saturating_add(more) > f.max_bytes {
                    return Err(ActivityError::InvalidInput(format!(
                        "field \"source\" is {}: its Parquet footer takes {} bytes, over the limit of {} bytes for what one embed_dataset activity holds in memory (--max-dataset-bytes): write it with fewer row groups or columns, or raise the limit",
                        quote_uri(cols.uri),
                        f.fetched.saturating_add(more),
                        f.max_bytes
                    )));
                }
                let data = f.get(&ranges, cols)?;
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

/// The id column of every row group: integers when its type is one, else strings. Each
/// row group must hold the rows its footer says, since the texts are found by those counts
/// and a text paired with another row's id would be written under it.
fn read_ids(
    f: &mut Fetcher,
    held: &mut Held,
    builder: ParquetPushDecoderBuilder,
    meta: &ParquetMetaData,
    id_at: usize,
) -> Result<Ids, ActivityError> {
    let cols = held.cols;
    let mask = ProjectionMask::roots(builder.parquet_schema(), [id_at]);
    let dec = builder
        .with_projection(mask)
        .with_batch_size(ID_BATCH)
        .build()
        .map_err(|e| cols.malformed(e))?;
    let (mut ints, mut strs): (Vec<i64>, Vec<String>) = (Vec::new(), Vec::new());
    let mut group = 0;
    drain(
        dec,
        f,
        cols,
        |batch| {
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
                    held.add(8 * id.len() as u64)
                }
                _ => strings(id, cols.id, first, held, &mut strs),
            }
        },
        |rows| {
            // A row group of no rows gives no reader.
            while group < meta.num_row_groups() && rows_of(meta, group) == 0 {
                group += 1;
            }
            let want = match group < meta.num_row_groups() {
                true => rows_of(meta, group),
                false => 0,
            };
            group += 1;
            if rows != want {
                return Err(cols.malformed(format!(
                    "row group {} holds {rows} ids where its footer says {want} rows",
                    group - 1
                )));
            }
            Ok(())
        },
    )?;
    Ok(if strs.is_empty() {
        Ids::Int(ints)
    } else {
        Ids::Str(strs)
    })
}

/// An integer column as i64 (unsigned values past i64's range are refused).
fn arrow_int64(a: &ArrayRef) -> Result<Vec<Option<i64>>, ActivityError> {
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

/// Appends a string column's values to `out`, refusing nulls and non-string types, and
/// counting each value against the limit before it is copied.
fn strings(
    a: &ArrayRef,
    column: &str,
    first: usize,
    held: &mut Held,
    out: &mut Vec<String>,
) -> Result<(), ActivityError> {
    let cols = held.cols;
    let mut push =
        |out: &mut Vec<String>, i: usize, v: Option<&str>| -> Result<(), ActivityError> {
            let v = v.ok_or_else(|| cols.null(column, first + i))?;
            held.add(v.len() as u64 + PER_ROW)?;
            out.push(v.to_owned());
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

/// The file's reader metadata, with every text column read as string views: a dictionary-encoded
/// column then points into its dictionary instead of copying a value per row, so a batch
/// of a text repeated many times takes its dictionary's memory, not rows × the text.
fn views(
    meta: &Arc<ParquetMetaData>,
    cols: &Columns,
) -> Result<ArrowReaderMetadata, ActivityError> {
    let file = ArrowReaderMetadata::try_new(meta.clone(), ArrowReaderOptions::new())
        .map_err(|e| cols.malformed(e))?;
    let fields: Vec<Field> = file
        .schema()
        .fields()
        .iter()
        .map(|f| match f.data_type() {
            DataType::Utf8 | DataType::LargeUtf8 => {
                f.as_ref().clone().with_data_type(DataType::Utf8View)
            }
            _ => f.as_ref().clone(),
        })
        .collect();
    let schema = Schema::new_with_metadata(fields, file.schema().metadata().clone());
    ArrowReaderMetadata::try_new(
        meta.clone(),
        ArrowReaderOptions::new().with_schema(Arc::new(schema)),
    )
    .map_err(|e| cols.malformed(e))
}

/// Runs `dec` to the end a row group at a time, fetching what it asks for: hands each
/// batch to `each`, and the rows each row group gave to `group_done`.
fn drain(
    mut dec: ParquetPushDecoder,
    f: &mut Fetcher,
    cols: &Columns,
    mut each: impl FnMut(RecordBatch) -> Result<(), ActivityError>,
    mut group_done: impl FnMut(usize) -> Result<(), ActivityError>,
) -> Result<(), ActivityError> {
    loop {
        match dec.try_next_reader().map_err(|e| cols.malformed(e))? {
            DecodeResult::NeedsData(ranges) => {
                let data = f.get(&ranges, cols)?;
                dec.push_ranges(ranges, data)
                    .map_err(|e| cols.malformed(e))?;
            }
            DecodeResult::Data(reader) => {
                let mut rows = 0;
                for batch in reader {
                    let batch = batch.map_err(|e| cols.malformed(e))?;
                    rows += batch.num_rows();
                    each(batch)?;
                }
                group_done(rows)?;
            }
            DecodeResult::Finished => return Ok(()),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use arrow_array::{Int64Array, StringArray};
    use arrow_schema::{Field, Schema};
    use parquet::{
        arrow::ArrowWriter,
        file::properties::{EnabledStatistics, WriterProperties},
    };

    use super::*;
    use crate::dataset::memory::DatasetMemory;

    const COLS: Columns<'static> = Columns {
        id: "id",
        text: "text",
        uri: "file:///d/x.parquet",
    };

    /// A file of `n` rows in row groups of `group` rows; row i's text is 500 bytes.
    pub(crate) fn file(n: usize, group: usize, nulls_at: Option<usize>) -> Bytes {
        let texts = (0..n)
            .map(|i| (Some(i) != nulls_at).then(|| format!("{i:05}{}", "x".repeat(495))))
            .collect();
        file_of(texts, group)
    }

    fn file_of(texts: Vec<Option<String>>, group: usize) -> Bytes {
        file_with(texts, group, EnabledStatistics::Page)
    }

    fn file_with(texts: Vec<Option<String>>, group: usize, stats: EnabledStatistics) -> Bytes {
        let n = texts.len();
        let schema = Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("text", DataType::Utf8, true),
        ]));
        let props = WriterProperties::builder()
            .set_max_row_group_row_count(Some(group))
            .set_statistics_enabled(stats)
            .build();
        let mut buf = Vec::new();
        let mut w = ArrowWriter::try_new(&mut buf, schema.clone(), Some(props)).unwrap();
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
        let mut claim = Claim::new(&DatasetMemory::new(max));
        read(&fetch, data.len() as u64, &COLS, &mut claim, s)
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
        // More shards than rows: an empty span inside a row group holds nothing.
        let r = read_from(&data, 200_000, span(1500, 1500)).unwrap();
        assert!(r.table.texts.is_empty());
        // A footer alone over the limit is refused before the data is looked at.
        let m = read_from(&data, 100, span(0, 0)).unwrap_err().to_string();
        assert!(m.contains("footer"), "{m}");
    }

    /// A dictionary holds a repeated text once: the file and its encoded sizes are small,
    /// and what its rows take once read is not.
    #[test]
    fn repeated_texts_count_as_read_not_as_stored() {
        let texts = vec![Some("y".repeat(20_000)); 400];
        // By the footer's count of the values' bytes.
        let data = file_of(texts.clone(), 400);
        assert!(data.len() < 100_000, "{}", data.len());
        let m = read_from(&data, 1_000_000, span(0, 400))
            .unwrap_err()
            .to_string();
        assert!(
            m.contains("about") && m.contains("over the limit of 1000000 bytes"),
            "{m}"
        );
        assert!(read_from(&data, 10_000_000, span(0, 400)).is_ok());
        // Without it, as the rows are read.
        let data = file_with(texts, 400, EnabledStatistics::None);
        let m = read_from(&data, 1_000_000, span(0, 400))
            .unwrap_err()
            .to_string();
        assert!(
            m.contains("at least") && m.contains("over the limit of 1000000 bytes"),
            "{m}"
        );
    }

    /// A file with row groups of `sizes` rows, some of them empty (ArrowWriter writes
    /// none such; other writers do). Ids 0.., texts "t<id>".
    fn groups(sizes: &[usize]) -> Bytes {
        use parquet::{
            basic::{LogicalType, Repetition, Type as Physical},
            column::writer::ColumnWriter,
            data_type::ByteArray,
            file::writer::SerializedFileWriter,
            schema::types::Type,
        };
        let column = |name: &str, t: Physical, logical: Option<LogicalType>| {
            Arc::new(
                Type::primitive_type_builder(name, t)
                    .with_repetition(Repetition::REQUIRED)
                    .with_logical_type(logical)
                    .build()
                    .unwrap(),
            )
        };
        let schema = Type::group_type_builder("schema")
            .with_fields(vec![
                column("id", Physical::INT64, None),
                column("text", Physical::BYTE_ARRAY, Some(LogicalType::String)),
            ])
            .build()
            .unwrap();
        let mut buf = Vec::new();
        let props = Arc::new(WriterProperties::builder().build());
        let mut w = SerializedFileWriter::new(&mut buf, Arc::new(schema), props).unwrap();
        let mut at = 0i64;
        for &n in sizes {
            let ids: Vec<i64> = (at..at + n as i64).collect();
            let texts: Vec<ByteArray> = ids
                .iter()
                .map(|i| format!("t{i}").as_str().into())
                .collect();
            let mut g = w.next_row_group().unwrap();
            let mut c = g.next_column().unwrap().unwrap();
            if let ColumnWriter::Int64ColumnWriter(c) = c.untyped() {
                c.write_batch(&ids, None, None).unwrap();
            }
            c.close().unwrap();
            let mut c = g.next_column().unwrap().unwrap();
            if let ColumnWriter::ByteArrayColumnWriter(c) = c.untyped() {
                c.write_batch(&texts, None, None).unwrap();
            }
            c.close().unwrap();
            g.close().unwrap();
            at += n as i64;
        }
        w.close().unwrap();
        Bytes::from(buf)
    }

    #[test]
    fn empty_row_groups_are_passed_over() {
        for sizes in [&[5usize, 0, 5][..], &[0, 5, 5], &[5, 5, 0]] {
            let data = groups(sizes);
            let r = read_from(&data, u64::MAX, span(3, 8)).unwrap();
            assert_eq!(r.table.ids, Ids::Int((0..10).collect()), "{sizes:?}");
            assert_eq!(
                r.table.texts,
                ["t3", "t4", "t5", "t6", "t7"].map(String::from),
                "{sizes:?}"
            );
        }
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
