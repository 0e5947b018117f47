//! Getting a job's rows out of storage. A Parquet source is read by its row groups (see
//! `parquet`): the footer, every id, and the texts of the job's rows only. JSON Lines and
//! CSV have no index to read a part by, so the file is read whole, refused first from its
//! stored size when that is over `--max-dataset-bytes`.

use std::ops::Range;

use super::{
    parquet,
    storage::{storage_error, Location},
    table::{self, Columns, Format, Span, Table},
};
use crate::{input::quote_uri, ActivityError};

/// What to read, and the most bytes one activity may hold of it.
pub(crate) struct Source<'a> {
    pub at: &'a Location,
    pub uri: &'a str,
    pub format: Format,
    pub id_column: &'a str,
    pub text_column: &'a str,
    pub max_bytes: u64,
}

/// Reads the ids of `source` and the texts of the span `span_of(rows in the file)` gives,
/// off the async runtime.
pub(crate) async fn load(
    source: Source<'_>,
    span_of: impl FnOnce(usize) -> Result<Span, ActivityError> + Send + 'static,
) -> Result<Table, ActivityError> {
    let (store, path) = (source.at.store.clone(), source.at.path.clone());
    let (uri, id, text) = (
        source.uri.to_owned(),
        source.id_column.to_owned(),
        source.text_column.to_owned(),
    );
    let (format, max) = (source.format, source.max_bytes);
    let joined =
        |e: tokio::task::JoinError| ActivityError::Internal(format!("reading the dataset: {e}"));
    if format == Format::Parquet {
        let size = store
            .head(&path)
            .await
            .map_err(|e| storage_error(&uri, e))?
            .size;
        let rt = tokio::runtime::Handle::current();
        return tokio::task::spawn_blocking(move || {
            let cols = Columns {
                id: &id,
                text: &text,
                uri: &uri,
            };
            // On the blocking pool, so waiting here for the store holds no runtime thread.
            let fetch = |ranges: &[Range<u64>]| {
                rt.block_on(store.get_ranges(&path, ranges))
                    .map_err(|e| storage_error(&uri, e))
            };
            let read = parquet::read(&fetch, size, &cols, max, span_of)?;
            tracing::debug!(
                source = %uri,
                size,
                fetched = read.fetched,
                rows = read.table.texts.len(),
                "read the job's rows of a Parquet source"
            );
            Ok(read.table)
        })
        .await
        .map_err(joined)?;
    }
    let got = store.get(&path).await.map_err(|e| storage_error(&uri, e))?;
    // Refused before its body is read: the whole file, and the table made of it, would
    // be held in the host's memory.
    if got.meta.size > max {
        return Err(ActivityError::InvalidInput(format!(
            "field \"source\" is {}: {} bytes, over the limit of {max} bytes for a JSON Lines or CSV file, which embed_dataset reads whole into memory (--max-dataset-bytes, 1/8 of the host's memory by default): split it into smaller files, convert it to Parquet (of which each shard reads only its own rows), or raise the limit on a host with the memory",
            quote_uri(&uri),
            got.meta.size
        )));
    }
    let bytes = got.bytes().await.map_err(|e| storage_error(&uri, e))?;
    tokio::task::spawn_blocking(move || {
        let cols = Columns {
            id: &id,
            text: &text,
            uri: &uri,
        };
        table::read(&bytes, format, &cols, span_of)
    })
    .await
    .map_err(joined)?
}
