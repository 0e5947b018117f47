//! Getting a job's rows out of storage, on the blocking pool: a Parquet source by its row
//! groups (`parquet`), JSON Lines and CSV by their rows in two passes (`records`). Either
//! way a job holds every id and its own rows' texts, counted against
//! `--max-dataset-bytes` before or as they are read, in the memory every job of the
//! worker shares (`memory`).

use std::{io::Read, ops::Range};

use bytes::Bytes;
use futures::StreamExt;
use object_store::{
    coalesce_ranges, path::Path, GetOptions, GetResultPayload, ObjectMeta, ObjectStore,
    OBJECT_STORE_COALESCE_DEFAULT,
};

use super::{
    memory::{Claim, DatasetMemory},
    parquet, records,
    storage::{storage_error, Location},
    stream::{Body, Whole},
    table::{Columns, Format, Span, Table},
    DatasetObserver,
};
use crate::ActivityError;

/// What to read, and the worker's memory it is read into.
pub(crate) struct Source<'a> {
    pub at: &'a Location,
    pub uri: &'a str,
    pub format: Format,
    pub id_column: &'a str,
    pub text_column: &'a str,
    pub memory: &'a DatasetMemory,
    /// Hears how long the job waited for memory.
    pub observer: Option<&'a dyn DatasetObserver>,
}

/// Reads the ids of `source` and the texts of the span `span_of(rows in the file)` gives,
/// off the async runtime. The table comes with the job's claim on the worker's dataset
/// memory, which the job keeps as long as it keeps the table. A job that finds the memory
/// taken by other jobs gives back what it held, waits for its turn, and reads again in
/// it; one that finds another job waiting gets in line behind it first (`memory`).
pub(crate) async fn load(
    source: Source<'_>,
    span_of: impl FnOnce(usize) -> Result<Span, ActivityError> + Clone + Send + 'static,
) -> Result<(Table, Claim), ActivityError> {
    let mut claim = Claim::new(source.memory);
    // Dropped with this future when the activity ends early (cancelled, timed out), which
    // stops the read at its next claim (it runs on the blocking pool, which the drop does
    // not stop) and tells a read waiting in its turn to stop waiting and pass the turn on.
    let (_alive, gone) = tokio::sync::watch::channel(());
    claim.watch(gone);
    // How long the job waited (in line, for its turn), once it has.
    let mut waiting = None;
    if claim.others_waiting() {
        let since = std::time::Instant::now();
        log_wait(&source, None);
        claim.wait_in_line().await;
        waiting = Some(since.elapsed());
    }
    loop {
        let (read, back) = read_once(&source, span_of.clone(), claim).await;
        claim = back;
        match claim.short() {
            Some(bytes) if read.is_err() && !claim.in_turn() => {
                let since = std::time::Instant::now();
                log_wait(&source, Some(bytes));
                claim.take_turn().await;
                waiting = Some(waiting.unwrap_or_default() + since.elapsed());
            }
            _ => {
                let in_turn = claim.end_read();
                if let Some(before) = waiting {
                    // The waits before reading, and the turn's claims' waits for memory.
                    let waited = before + in_turn;
                    if let Some(o) = source.observer {
                        o.memory_wait(waited.as_secs_f64());
                    }
                    tracing::info!(
                        source = %source.uri,
                        secs = waited.as_secs_f64(),
                        read = read.is_ok(),
                        "read the source after waiting for dataset memory"
                    );
                }
                return read.map(|t| (t, claim));
            }
        }
    }
}

/// Says a job waits for memory other jobs hold: `short_at` the bytes its read had reached,
/// or none where it gets in line behind jobs that wait.
fn log_wait(source: &Source<'_>, short_at: Option<u64>) {
    let memory = source.memory;
    tracing::info!(
        source = %source.uri,
        short_at,
        held = memory.held(),
        limit = memory.bytes(),
        "waiting for memory other embed_dataset jobs hold (--max-dataset-bytes)"
    );
}

/// One read of `source`, counting what it holds in `claim`, which comes back with it.
async fn read_once(
    source: &Source<'_>,
    span_of: impl FnOnce(usize) -> Result<Span, ActivityError> + Send + 'static,
    mut claim: Claim,
) -> (Result<Table, ActivityError>, Claim) {
    let (store, path) = (source.at.store.clone(), source.at.path.clone());
    let (uri, id, text) = (
        source.uri.to_owned(),
        source.id_column.to_owned(),
        source.text_column.to_owned(),
    );
    let format = source.format;
    // A read that panicked gives back its claim as it unwinds.
    let joined = |e: tokio::task::JoinError| {
        (
            Err(ActivityError::Internal(format!("reading the dataset: {e}"))),
            Claim::new(source.memory),
        )
    };
    if format == Format::Parquet {
        let meta = match store.head(&path).await {
            Ok(meta) => meta,
            Err(e) => return (Err(storage_error(&uri, e)), claim),
        };
        let size = meta.size;
        let rt = tokio::runtime::Handle::current();
        return tokio::task::spawn_blocking(move || {
            let cols = Columns {
                id: &id,
                text: &text,
                uri: &uri,
            };
            // The footer, the ids and the texts are fetched apart: each fetch is pinned to
            // the version `head` saw, so a file replaced in between fails as retryable
            // instead of decoding one file's offsets against another's bytes. Near ranges
            // are merged into one request, as `get_ranges` would.
            let fetch = |ranges: &[Range<u64>]| {
                let one = |r| get_pinned(&*store, &path, &meta, r);
                // On the blocking pool, so waiting here for the store holds no runtime
                // thread.
                rt.block_on(coalesce_ranges(ranges, one, OBJECT_STORE_COALESCE_DEFAULT))
                    .map_err(|e| storage_error(&uri, e))
            };
            let read = parquet::read(&fetch, size, &cols, &mut claim, span_of).map(|read| {
                tracing::debug!(
                    source = %uri,
                    size,
                    fetched = read.fetched,
                    rows = read.table.texts.len(),
                    "read the job's rows of a Parquet source"
                );
                read.table
            });
            (read, claim)
        })
        .await
        .unwrap_or_else(joined);
    }
    let got = match store.get(&path).await {
        Ok(got) => got,
        Err(e) => return (Err(storage_error(&uri, e)), claim),
    };
    let meta = got.meta.clone();
    let size = meta.size;
    let rt = tokio::runtime::Handle::current();
    tokio::task::spawn_blocking(move || {
        let cols = Columns {
            id: &id,
            text: &text,
            uri: &uri,
        };
        // The rest of the version first read, should its stream break.
        let reopen = |from: u64| {
            if from >= size {
                // Broke after its last byte: nothing is left to get.
                return Ok(futures::stream::empty().boxed());
            }
            rt.block_on(async {
                let options = pinned(&meta, from..size);
                Ok(store.get_opts(&path, options).await?.into_stream())
            })
        };
        let from = match got.payload {
            // A local file is read as one, not in the store's 8 KiB chunks.
            GetResultPayload::File(file, _) => Body::File(file.take(size)),
            // A reopen is pinned by the e_tag or the version; with neither, it could
            // splice two versions, so the stream is not reopened.
            GetResultPayload::Stream(stream) => {
                let pinned = meta.e_tag.is_some() || meta.version.is_some();
                Body::stream(&rt, stream, size, pinned.then_some(&reopen as _))
            }
        };
        let mut whole = Whole {
            from,
            uri: &uri,
            failed: None,
        };
        // The rows' bytes of the version the first pass read (a replaced file fails the
        // precondition, which is retryable).
        let fetch_range = |r: Range<u64>| {
            rt.block_on(get_pinned(&*store, &path, &meta, r))
                .map_err(|e| storage_error(&uri, e))
        };
        let read = records::read(
            &mut whole,
            &fetch_range,
            size,
            format,
            &cols,
            &mut claim,
            span_of,
        );
        // A parse error that came from storage failing mid-stream is storage's.
        let read = match whole.failed.take() {
            Some(e) => Err(e),
            None => read,
        };
        (read, claim)
    })
    .await
    .unwrap_or_else(joined)
}

/// Gets `range` of the object `meta` describes, and only of that version: another fails
/// with a precondition error.
async fn get_pinned(
    store: &dyn ObjectStore,
    path: &Path,
    meta: &ObjectMeta,
    range: Range<u64>,
) -> object_store::Result<Bytes> {
    store
        .get_opts(path, pinned(meta, range))
        .await?
        .bytes()
        .await
}

/// A get of `range` of the version `meta` describes.
fn pinned(meta: &ObjectMeta, range: Range<u64>) -> GetOptions {
    GetOptions {
        range: Some(range.into()),
        if_match: meta.e_tag.clone(),
        // The e_tag pins the content; a version is asked for only without one, since
        // reading a version takes a permission (s3:GetObjectVersion) that a read-only role
        // may not have.
        version: meta.version.clone().filter(|_| meta.e_tag.is_none()),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `bytes` as `name` in a local store at `dir`.
    fn local(dir: &std::path::Path, name: &str, bytes: &[u8]) -> Location {
        std::fs::write(dir.join(name), bytes).unwrap();
        Location {
            store: std::sync::Arc::new(
                object_store::local::LocalFileSystem::new_with_prefix(dir).unwrap(),
            ),
            path: name.into(),
        }
    }

    fn all(n: usize) -> Result<Span, ActivityError> {
        Ok(Span {
            start: 0,
            end: n,
            whole: true,
        })
    }

    async fn read_in(
        at: &Location,
        format: Format,
        memory: &DatasetMemory,
        observer: Option<&dyn DatasetObserver>,
        span_of: impl FnOnce(usize) -> Result<Span, ActivityError> + Clone + Send + 'static,
    ) -> Result<(Table, Claim), ActivityError> {
        let source = Source {
            at,
            uri: "file:///d/x",
            format,
            id_column: "id",
            text_column: "text",
            memory,
            observer,
        };
        load(source, span_of).await
    }

    /// A JSON Lines file and a Parquet file (row groups of 5,000) of `n` rows each, named
    /// for their formats.
    fn both_formats(n: usize) -> [(&'static str, Format, Vec<u8>); 2] {
        [
            ("d.jsonl", Format::JsonLines, lines(n, "a")),
            (
                "d.parquet",
                Format::Parquet,
                parquet::tests::file(n, 5000, None).to_vec(),
            ),
        ]
    }

    /// JSON Lines of `n` rows.
    fn lines(n: usize, tag: &str) -> Vec<u8> {
        (0..n)
            .map(|i| format!("{{\"id\":{i},\"text\":\"{tag} {i}\"}}\n"))
            .collect::<String>()
            .into_bytes()
    }

    /// Reads `name` from a local store, replacing it with `after` once its ids are read
    /// (`span_of` runs between the ids and the texts), when `after` is given.
    async fn read_replaced(
        name: &str,
        format: Format,
        before: &[u8],
        after: Option<Vec<u8>>,
    ) -> Result<Table, ActivityError> {
        let dir = tempfile::tempdir().unwrap();
        let at = local(dir.path(), name, before);
        let file = dir.path().join(name);
        let span_of = move |n| {
            if let Some(bytes) = after {
                // As a writer would: a new file renamed over the old one.
                let fresh = file.with_extension("new");
                std::fs::write(&fresh, bytes).unwrap();
                std::fs::rename(&fresh, &file).unwrap();
            }
            all(n)
        };
        let memory = DatasetMemory::new(u64::MAX);
        read_in(&at, format, &memory, None, span_of)
            .await
            .map(|(t, _)| t)
    }

    /// Jobs share the worker's dataset memory: one that finds it taken waits, and reads
    /// once the other job ends.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_job_waits_for_the_memory_another_holds_then_reads() {
        let cases = [
            (
                "d.parquet",
                Format::Parquet,
                parquet::tests::file(400, 100, None).to_vec(),
            ),
            ("d.jsonl", Format::JsonLines, lines(400, "a")),
        ];
        for (name, format, bytes) in cases {
            let dir = tempfile::tempdir().unwrap();
            let at = std::sync::Arc::new(local(dir.path(), name, &bytes));
            // What one job holds, and room for one job but not two.
            let unbounded = DatasetMemory::new(u64::MAX);
            let (_, alone) = read_in(&at, format, &unbounded, None, all).await.unwrap();
            let one = unbounded.held();
            drop(alone);
            let memory = DatasetMemory::new(one * 3 / 2);
            let (first, held) = read_in(&at, format, &memory, None, all).await.unwrap();
            assert_eq!(memory.held(), one, "{name}");
            let second = {
                let (at, memory) = (at.clone(), memory.clone());
                tokio::spawn(async move { read_in(&at, format, &memory, None, all).await })
            };
            tokio::time::sleep(std::time::Duration::from_millis(300)).await;
            assert!(!second.is_finished(), "{name}: the second job did not wait");
            drop(held);
            let (table, claim) = second.await.unwrap().unwrap();
            assert_eq!(table.texts, first.texts, "{name}");
            assert_eq!(memory.held(), one, "{name}");
            drop(claim);
            assert_eq!(memory.held(), 0, "{name}");
        }
    }

    /// A job whose activity ends while it waits in its turn (the worker drops its future:
    /// cancelled, timed out) passes the turn on at once, not when the memory frees.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_job_dropped_while_it_waits_passes_its_turn_on() {
        let dir = tempfile::tempdir().unwrap();
        let at = std::sync::Arc::new(local(dir.path(), "d.jsonl", &lines(4000, "a")));
        let memory = DatasetMemory::new(200 * 1024);
        let mut other = Claim::new(&memory);
        assert!(other.cover(150 * 1024));
        let job = {
            let (at, memory) = (at.clone(), memory.clone());
            tokio::spawn(async move { read_in(&at, Format::JsonLines, &memory, None, all).await })
        };
        // The job waits in its turn once its first read has found the memory short.
        let probe = Claim::new(&memory);
        let in_turn = async {
            while !probe.others_waiting() {
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
        };
        tokio::time::timeout(std::time::Duration::from_secs(10), in_turn)
            .await
            .expect("the job never waited in its turn");
        job.abort();
        let (_alive, gone) = tokio::sync::watch::channel(());
        let mut probe = probe;
        probe.watch(gone);
        tokio::time::timeout(std::time::Duration::from_secs(10), probe.take_turn())
            .await
            .expect("the dropped job kept its turn");
        probe.end_read();
        assert!(!probe.others_waiting());
        assert_eq!(memory.held(), 150 * 1024);
        drop(other);
    }

    /// A job whose activity ends while it reads out of turn (the worker drops its future;
    /// the read itself goes on on the blocking pool) stops at its next claim, and gives
    /// back what it held: it claims none of its texts. It used to read them all to the
    /// end, holding its claim.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_job_dropped_while_it_reads_stops_at_its_next_claim() {
        use std::sync::{mpsc, Arc, Mutex};
        use std::time::Duration;
        for (name, format, bytes) in both_formats(100_000) {
            let dir = tempfile::tempdir().unwrap();
            let at = Arc::new(local(dir.path(), name, &bytes));
            let memory = DatasetMemory::new(u64::MAX);
            // `span_of` runs between the ids and the texts, on the blocking pool: it
            // holds the read there until the test has dropped the job.
            let (reached, at_span) = mpsc::channel();
            let (go, wait) = mpsc::channel::<()>();
            let wait = Arc::new(Mutex::new(wait));
            let span_of = move |n| {
                let _ = reached.send(());
                let _ = wait.lock().unwrap().recv();
                all(n)
            };
            let job = {
                let (at, memory) = (at.clone(), memory.clone());
                tokio::spawn(async move { read_in(&at, format, &memory, None, span_of).await })
            };
            tokio::task::spawn_blocking(move || at_span.recv_timeout(Duration::from_secs(10)))
                .await
                .unwrap()
                .unwrap_or_else(|_| panic!("{name}: the read never reached its span"));
            let before = memory.held();
            job.abort();
            assert!(
                matches!(job.await, Err(e) if e.is_cancelled()),
                "{name}: the job ended before it was dropped"
            );
            // The most the memory holds from here until the read has ended: the read holds
            // a clone of the store's handle (this test's `at` holds the other) until then.
            let peak = {
                let (memory, at) = (memory.clone(), at.clone());
                std::thread::spawn(move || {
                    let (mut peak, since) = (0, std::time::Instant::now());
                    while since.elapsed() < Duration::from_secs(10) {
                        let reading = Arc::strong_count(&at.store) > 1;
                        peak = peak.max(memory.held());
                        if !reading {
                            return Some(peak);
                        }
                    }
                    None
                })
            };
            go.send(()).unwrap();
            let peak = tokio::task::spawn_blocking(move || peak.join().unwrap())
                .await
                .unwrap()
                .unwrap_or_else(|| panic!("{name}: the dropped read went on for 10 s"));
            // The claim goes back just after the read's end.
            tokio::time::timeout(Duration::from_secs(10), async {
                while memory.held() > 0 {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            })
            .await
            .unwrap_or_else(|_| panic!("{name}: the dropped read kept its claim"));
            assert!(
                peak <= before,
                "{name}: the dropped read claimed on, to {peak} bytes from {before}"
            );
        }
    }

    /// A JSON Lines job's ids are claimed as its first pass reads them, not after it: jobs
    /// in their first passes at once hold no more than the worker's memory together.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_jobs_ids_are_claimed_as_its_first_pass_reads_them() {
        let dir = tempfile::tempdir().unwrap();
        let at = local(dir.path(), "d.jsonl", &lines(20_000, "a"));
        let memory = DatasetMemory::new(u64::MAX);
        let seen = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        // Runs between the first pass and the texts; the job takes no rows.
        let span_of = {
            let (memory, seen) = (memory.clone(), seen.clone());
            move |_| {
                seen.store(memory.held(), std::sync::atomic::Ordering::SeqCst);
                Ok(Span {
                    start: 0,
                    end: 0,
                    whole: false,
                })
            }
        };
        let (table, claim) = read_in(&at, Format::JsonLines, &memory, None, span_of)
            .await
            .unwrap();
        assert_eq!(table.ids.len(), 20_000);
        let seen = seen.load(std::sync::atomic::Ordering::SeqCst);
        // An integer id and its row's offset: 16 bytes, and their vectors' spare room.
        assert!(
            seen >= 20_000 * 16,
            "{seen} bytes claimed after the first pass"
        );
        assert_eq!(memory.held(), seen);
        drop(claim);
    }

    /// Counts the jobs that waited for memory, each of which read again at most once.
    #[derive(Default)]
    struct Waits(std::sync::atomic::AtomicUsize);

    impl DatasetObserver for Waits {
        fn part(&self, _: &str, _: super::super::PartOutcome, _: usize) {}
        fn memory_wait(&self, _: f64) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }

    /// Two jobs that cannot hold their sources at once, started together: one waits for
    /// the other, and each reads its source again at most once (claims that could fail
    /// while the other waited once made them take turns re-reading, a KiB further each
    /// time).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn jobs_short_of_memory_read_their_source_again_once() {
        for (name, format, bytes) in both_formats(40_000) {
            let dir = tempfile::tempdir().unwrap();
            let at = std::sync::Arc::new(local(dir.path(), name, &bytes));
            let unbounded = DatasetMemory::new(u64::MAX);
            // A few rows of a long file: the ids are most of what a job holds, and both
            // jobs count theirs at once in the first pass.
            let few = |n: usize| {
                Ok(Span {
                    start: 0,
                    end: n.min(10),
                    whole: false,
                })
            };
            let (_, alone) = read_in(&at, format, &unbounded, None, few).await.unwrap();
            let one = unbounded.held();
            drop(alone);
            // Room for one job as it reads (the duplicate check holds half as much again
            // as the ids for a moment) but not for two.
            let memory = DatasetMemory::new(one * 7 / 4);
            let waits = std::sync::Arc::new(Waits::default());
            let job = || {
                let (at, memory, waits) = (at.clone(), memory.clone(), waits.clone());
                tokio::spawn(async move {
                    // The job ends, and gives back its memory, as soon as it has read.
                    read_in(&at, format, &memory, Some(&*waits), few)
                        .await
                        .map(|(t, _)| t.texts.len())
                })
            };
            let (a, b) = (job(), job());
            assert_eq!(a.await.unwrap().unwrap(), 10, "{name}");
            assert_eq!(b.await.unwrap().unwrap(), 10, "{name}");
            let waits = waits.0.load(std::sync::atomic::Ordering::SeqCst);
            assert!(waits <= 2, "{name}: {waits} reads again for two jobs");
            assert_eq!(memory.held(), 0, "{name}");
        }
    }

    /// A file replaced between the ids and the texts fails as retryable, in both readers:
    /// each fetch after the first is pinned to the version first seen.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_source_replaced_while_it_is_read_is_read_anew_by_a_retry() {
        let cases = [
            (
                "d.parquet",
                Format::Parquet,
                parquet::tests::file(4000, 1000, None).to_vec(),
                parquet::tests::file(3000, 700, None).to_vec(),
            ),
            ("d.jsonl", Format::JsonLines, lines(50, "a"), lines(50, "b")),
        ];
        for (name, format, before, after) in cases {
            let whole = read_replaced(name, format, &before, None).await.unwrap();
            assert_eq!(whole.texts.len(), whole.ids.len(), "{name}");
            match read_replaced(name, format, &before, Some(after)).await {
                Err(ActivityError::StorageUnavailable(m)) => {
                    assert!(m.contains("changed while it was read"), "{name}: {m}")
                }
                Err(e) => panic!("{name}: {e:?}"),
                Ok(t) => panic!("{name}: read {} rows of a replaced file", t.texts.len()),
            }
        }
    }
}
