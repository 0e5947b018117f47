//! A stored object's body as a `Read`, for the JSON Lines and CSV first pass on the
//! blocking pool. A stream that breaks is opened again where it broke, pinned to the
//! version first read: a connection can drop, and an HTTP client's request timeout also
//! covers reading the body, which stops while the reader waits in its turn for dataset
//! memory (`memory`) or reads a long file.

use std::io::Read;

use bytes::{Buf, Bytes};
use futures::{stream::BoxStream, StreamExt};

use super::storage::storage_error;
use crate::{input::quote_uri, ActivityError};

/// Most times in a row a broken stream is opened again without a byte read in between.
const REOPENS: u32 = 3;

/// A body's chunks.
pub(super) type Chunks = BoxStream<'static, object_store::Result<Bytes>>;

/// Opens the object's body again from a byte offset, to its end.
pub(super) type Reopen<'a> = &'a dyn Fn(u64) -> object_store::Result<Chunks>;

/// A stored object's body.
pub(super) enum Body<'a> {
    File(std::io::Take<std::fs::File>),
    /// Chunks awaited on the runtime (from the blocking pool).
    Stream {
        rt: &'a tokio::runtime::Handle,
        stream: Chunks,
        chunk: Bytes,
        /// None where the store names no version to pin a reopen to.
        reopen: Option<Reopen<'a>>,
        /// Bytes of the body handed out so far: where a reopened stream starts.
        at: u64,
        /// The body's size: a stream that ends short of it broke.
        size: u64,
        /// Reopens since the last chunk.
        tries: u32,
    },
}

impl<'a> Body<'a> {
    pub(super) fn stream(
        rt: &'a tokio::runtime::Handle,
        stream: Chunks,
        size: u64,
        reopen: Option<Reopen<'a>>,
    ) -> Self {
        Body::Stream {
            rt,
            stream,
            chunk: Bytes::new(),
            reopen,
            at: 0,
            size,
            tries: 0,
        }
    }
}

/// A stored object's body as a `Read`. A storage error is kept, so that the reader's
/// caller can tell it from a file that does not parse.
pub(super) struct Whole<'a> {
    pub from: Body<'a>,
    pub uri: &'a str,
    pub failed: Option<ActivityError>,
}

impl Read for Whole<'_> {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        let Whole { from, uri, failed } = self;
        match from {
            Body::File(file) => file.read(out).inspect_err(|e| {
                // The reader retries an interrupted read.
                if e.kind() != std::io::ErrorKind::Interrupted {
                    *failed = Some(ActivityError::StorageUnavailable(format!(
                        "{}: {e}",
                        quote_uri(uri)
                    )));
                }
            }),
            Body::Stream {
                rt,
                stream,
                chunk,
                reopen,
                at,
                size,
                tries,
            } => {
                while chunk.is_empty() {
                    match (rt.block_on(stream.next()), &reopen) {
                        (Some(Ok(b)), _) => {
                            if !b.is_empty() {
                                *tries = 0;
                            }
                            *chunk = b;
                        }
                        (Some(Err(e)), Some(reopen)) if *tries < REOPENS => {
                            *tries += 1;
                            tracing::info!(
                                source = %uri,
                                at = *at,
                                error = %e,
                                "the source's stream broke; opening it again where it broke"
                            );
                            match reopen(*at) {
                                Ok(again) => *stream = again,
                                Err(e) => return Err(kept(failed, storage_error(uri, e))),
                            }
                        }
                        (Some(Err(e)), _) => return Err(kept(failed, storage_error(uri, e))),
                        (None, _) if *at < *size => {
                            let e = ActivityError::StorageUnavailable(format!(
                                "{}: its body ended at byte {at} of {size}",
                                quote_uri(uri)
                            ));
                            return Err(kept(failed, e));
                        }
                        (None, _) => return Ok(0),
                    }
                }
                let n = out.len().min(chunk.len());
                out[..n].copy_from_slice(&chunk[..n]);
                chunk.advance(n);
                *at += n as u64;
                Ok(n)
            }
        }
    }
}

/// Keeps `e` as the read's failure, and gives the reader an I/O error that says it.
fn kept(failed: &mut Option<ActivityError>, e: ActivityError) -> std::io::Error {
    let shown = e.to_string();
    *failed = Some(e);
    std::io::Error::other(shown)
}

#[cfg(test)]
mod tests {
    use std::{cell::RefCell, ops::Range};

    use super::*;
    use crate::dataset::{
        memory::{Claim, DatasetMemory},
        records,
        table::{Columns, Format, Span},
    };

    const FILE: &[u8] = b"id,text\n1,a\n2,b\n3,c\n";

    fn reset() -> object_store::Error {
        object_store::Error::Generic {
            store: "test",
            source: "connection reset".into(),
        }
    }

    /// `FILE` from `from`, in one chunk, then `then` (an error, or the end).
    fn chunks(from: u64, then: Option<object_store::Error>) -> Chunks {
        let mut v = vec![Ok(Bytes::from_static(&FILE[from as usize..]))];
        v.extend(then.map(Err));
        futures::stream::iter(v).boxed()
    }

    /// Runs `f` on a blocking thread of a runtime, as the readers run.
    fn on_the_pool<T: Send + 'static>(
        f: impl FnOnce(&tokio::runtime::Handle) -> T + Send + 'static,
    ) -> T {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let handle = rt.handle().clone();
        rt.block_on(rt.spawn_blocking(move || f(&handle))).unwrap()
    }

    /// A stream that breaks midway is opened again at the byte it broke at, and the body
    /// reads whole.
    #[test]
    fn a_stream_that_breaks_is_opened_again_where_it_broke() {
        let (read, asked) = on_the_pool(|rt| {
            let asked = RefCell::new(Vec::new());
            let reopen = |from: u64| {
                asked.borrow_mut().push(from);
                Ok(chunks(from, None))
            };
            let first: Vec<object_store::Result<Bytes>> =
                vec![Ok(Bytes::from_static(&FILE[..14])), Err(reset())];
            let mut whole = Whole {
                from: Body::stream(
                    rt,
                    futures::stream::iter(first).boxed(),
                    FILE.len() as u64,
                    Some(&reopen),
                ),
                uri: "s3://b/d.csv",
                failed: None,
            };
            let mut read = Vec::new();
            whole.read_to_end(&mut read).unwrap();
            assert!(whole.failed.is_none());
            (read, asked.into_inner())
        });
        assert_eq!(read, FILE);
        assert_eq!(asked, vec![14]);
    }

    /// A stream that breaks again each time it is opened fails as storage's (retryable),
    /// not as a malformed file, after a few tries.
    #[test]
    fn a_stream_that_keeps_breaking_is_storages_failure() {
        let (failed, tries) = on_the_pool(|rt| {
            let tries = RefCell::new(0);
            let reopen = |_: u64| {
                *tries.borrow_mut() += 1;
                Ok(futures::stream::iter(vec![Err(reset())]).boxed())
            };
            let first: Vec<object_store::Result<Bytes>> =
                vec![Ok(Bytes::from_static(b"id,text\n1,a\n2,")), Err(reset())];
            let mut whole = Whole {
                from: Body::stream(rt, futures::stream::iter(first).boxed(), 100, Some(&reopen)),
                uri: "s3://b/d.csv",
                failed: None,
            };
            let cols = Columns {
                id: "id",
                text: "text",
                uri: "s3://b/d.csv",
            };
            let all = |n| {
                Ok(Span {
                    start: 0,
                    end: n,
                    whole: true,
                })
            };
            let fetch = |_: Range<u64>| unreachable!("the first pass fails");
            let mut claim = Claim::new(&DatasetMemory::new(u64::MAX));
            let read = records::read(&mut whole, &fetch, 100, Format::Csv, &cols, &mut claim, all);
            assert!(read.is_err());
            (whole.failed.take(), tries.into_inner())
        });
        let e = failed.expect("the storage error is kept");
        assert!(
            matches!(&e, ActivityError::StorageUnavailable(m) if m.contains("connection reset")),
            "{e:?}"
        );
        assert_eq!(tries, REOPENS);
    }

    /// A body that ends short of its size broke (retryable), and a stream the store names
    /// no version for is not reopened: a reopen could read another version's bytes.
    #[test]
    fn a_short_body_or_an_unpinned_break_is_storages_failure() {
        let failed = on_the_pool(|rt| {
            let short: Vec<object_store::Result<Bytes>> = vec![Ok(Bytes::from_static(&FILE[..14]))];
            let broken: Vec<object_store::Result<Bytes>> =
                vec![Ok(Bytes::from_static(&FILE[..14])), Err(reset())];
            [(short, true), (broken, false)].map(|(chunks, pinned)| {
                let reopen = |_: u64| -> object_store::Result<Chunks> {
                    unreachable!("neither stream is opened again")
                };
                let mut whole = Whole {
                    from: Body::stream(
                        rt,
                        futures::stream::iter(chunks).boxed(),
                        FILE.len() as u64,
                        pinned.then_some(&reopen as Reopen),
                    ),
                    uri: "s3://b/d.csv",
                    failed: None,
                };
                assert!(whole.read_to_end(&mut Vec::new()).is_err());
                whole.failed.take()
            })
        });
        let [short, broken] = failed.map(|f| f.expect("the storage error is kept"));
        assert!(
            matches!(&short, ActivityError::StorageUnavailable(m) if m.contains("ended at byte 14 of")),
            "{short:?}"
        );
        assert!(
            matches!(&broken, ActivityError::StorageUnavailable(m) if m.contains("connection reset")),
            "{broken:?}"
        );
    }
}
