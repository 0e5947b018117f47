//! Part files: one Parquet file per fixed slice of rows, named by the rows it holds, so
//! that a redone part replaces itself and shards never collide; and the job's manifest.

use std::sync::Arc;

use arrow_array::{ArrayRef, FixedSizeListArray, Float32Array, Int32Array, RecordBatch};
use arrow_schema::{DataType, Field, Schema};
use parquet::{arrow::ArrowWriter, file::metadata::KeyValue, file::properties::WriterProperties};

use super::table::Ids;
use crate::ActivityError;

/// The file name of the part holding rows `[start, end)` of the source.
pub(crate) fn part_name(start: usize, end: usize) -> String {
    format!("part-{start:09}-{end:09}.parquet")
}

/// The manifest's file name: `_manifest.json` for a whole dataset, else named by the rows.
pub(crate) fn manifest_name(start: usize, end: usize, whole: bool) -> String {
    if whole {
        "_manifest.json".to_owned()
    } else {
        format!("_manifest-{start:09}-{end:09}.json")
    }
}

/// What every part's file metadata says about its vectors.
pub(crate) struct PartMeta<'a> {
    pub model: &'a str,
    pub revision: &'a str,
    pub dtype: &'a str,
    pub family: &'a str,
    pub source: &'a str,
}

/// One part as Parquet bytes: `id` (int64 or string), `embedding` (fixed-size list of
/// float32), `tokens` (int32), with the model's name and revision in the file metadata.
pub(crate) fn encode(
    ids: &Ids,
    start: usize,
    end: usize,
    vectors: &[Vec<f32>],
    tokens: &[usize],
    dims: usize,
    meta: &PartMeta,
) -> Result<Vec<u8>, ActivityError> {
    let bug =
        |e: &dyn std::fmt::Display| ActivityError::Internal(format!("building a part file: {e}"));
    let id = ids.slice(start, end);
    let item = Arc::new(Field::new("item", DataType::Float32, false));
    let pairs = [
        ("model", meta.model.to_owned()),
        ("revision", meta.revision.to_owned()),
        ("dtype", meta.dtype.to_owned()),
        ("family", meta.family.to_owned()),
        ("source", meta.source.to_owned()),
        ("rows", format!("{start}-{end}")),
    ];
    // In the Arrow schema too, so `pyarrow.parquet.read_table(f).schema.metadata` (and
    // pandas, polars) see them, not only the Parquet footer's key-value list.
    let schema_meta: std::collections::HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| (format!("gpulane.{k}"), v.clone()))
        .collect();
    let schema = Arc::new(
        Schema::new(vec![
            Field::new("id", id.data_type().clone(), false),
            Field::new(
                "embedding",
                DataType::FixedSizeList(item.clone(), dims as i32),
                false,
            ),
            Field::new("tokens", DataType::Int32, false),
        ])
        .with_metadata(schema_meta),
    );
    let flat: Vec<f32> = vectors.iter().flatten().copied().collect();
    let embedding =
        FixedSizeListArray::try_new(item, dims as i32, Arc::new(Float32Array::from(flat)), None)
            .map_err(|e| bug(&e))?;
    let tokens = Int32Array::from(tokens.iter().map(|&t| t as i32).collect::<Vec<_>>());
    let columns: Vec<ArrayRef> = vec![id, Arc::new(embedding), Arc::new(tokens)];
    let batch = RecordBatch::try_new(schema.clone(), columns).map_err(|e| bug(&e))?;
    let props = WriterProperties::builder()
        .set_key_value_metadata(Some(
            pairs
                .iter()
                .map(|(k, v)| KeyValue::new(format!("gpulane.{k}"), v.clone()))
                .collect(),
        ))
        .build();
    let mut buf = Vec::new();
    let mut w = ArrowWriter::try_new(&mut buf, schema, Some(props)).map_err(|e| bug(&e))?;
    w.write(&batch).map_err(|e| bug(&e))?;
    w.close().map_err(|e| bug(&e))?;
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

    use super::*;

    #[test]
    fn a_part_reads_back_with_its_columns_and_metadata() {
        let meta = PartMeta {
            model: "m",
            revision: "sha256:ab",
            dtype: "f32",
            family: "bert",
            source: "file:///d/x.jsonl",
        };
        let ids = Ids::Int(vec![10, 11, 12]);
        let bytes = encode(&ids, 1, 3, &[vec![1., 2.], vec![3., 4.]], &[5, 6], 2, &meta).unwrap();
        let b = ParquetRecordBatchReaderBuilder::try_new(Bytes::from(bytes)).unwrap();
        let kv = b.metadata().file_metadata().key_value_metadata().unwrap();
        assert!(kv
            .iter()
            .any(|k| k.key == "gpulane.revision" && k.value.as_deref() == Some("sha256:ab")));
        assert_eq!(
            b.schema()
                .metadata()
                .get("gpulane.model")
                .map(String::as_str),
            Some("m")
        );
        let batch = b.build().unwrap().next().unwrap().unwrap();
        assert_eq!(batch.num_rows(), 2);
        assert_eq!(
            batch.schema().field(1).data_type(),
            &DataType::FixedSizeList(Arc::new(Field::new("item", DataType::Float32, false)), 2)
        );
        assert_eq!(part_name(0, 1000), "part-000000000-000001000.parquet");
    }
}
