//! Getting a job's rows out of storage, on the blocking pool: a Parquet source by its row
//! groups (`parquet`), JSON Lines and CSV by their rows in two passes (`records`). Either
//! way a job holds every id and its own rows' texts, counted against
//! `--max-dataset-bytes` before or as they are read.

use std::{io::Read, ops::Range};

use bytes::{Buf, Bytes};
use futures::{stream::BoxStream, StreamExt};

use super::{
    parquet, records,
    storage::{storage_error, Location},
    table::{Columns, Format, Span, Table},
};
use crate::ActivityError;

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
    let size = got.meta.size;
    let rt = tokio::runtime::Handle::current();
    tokio::task::spawn_blocking(move || {
        let cols = Columns {
            id: &id,
            text: &text,
            uri: &uri,
        };
        let mut whole = Streamed {
            rt: &rt,
            stream: got.into_stream(),
            chunk: Bytes::new(),
            failed: None,
        };
        let fetch_range = |r: Range<u64>| {
            rt.block_on(store.get_range(&path, r))
                .map_err(|e| storage_error(&uri, e))
        };
        let read = records::read(&mut whole, &fetch_range, size, format, &cols, max, span_of);
        // A parse error that came from storage failing mid-stream is storage's.
        match whole.failed.take() {
            Some(e) => Err(storage_error(&uri, e)),
            None => read,
        }
    })
    .await
    .map_err(joined)?
}

/// A stored object's body as a `Read`, for the blocking pool: each chunk is awaited on the
/// runtime. A storage error is kept, so that the reader's caller can tell it from a file
/// that does not parse.
struct Streamed<'a> {
    rt: &'a tokio::runtime::Handle,
    stream: BoxStream<'static, object_store::Result<Bytes>>,
    chunk: Bytes,
    failed: Option<object_store::Error>,
}

impl Read for Streamed<'_> {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        while self.chunk.is_empty() {
            match self.rt.block_on(self.stream.next()) {
                Some(Ok(b)) => self.chunk = b,
                Some(Err(e)) => {
                    let shown = e.to_string();
                    self.failed = Some(e);
                    return Err(std::io::Error::other(shown));
                }
                None => return Ok(0),
            }
        }
        let n = out.len().min(self.chunk.len());
        out[..n].copy_from_slice(&self.chunk[..n]);
        self.chunk.advance(n);
        Ok(n)
    }
}
