//! Cross-activity batching. Concurrent calls on one engine each bring a few rows (a
//! tokenized text, or a tokenized query-document pair); running them one call at a time
//! wastes most of a forward pass on tiny batches. The batcher pools the rows of the calls
//! that arrive within a short wait, sorts them by length (less padding), cuts them into
//! batches under a row and token budget, and hands each call its own rows back, in order.
//!
//! Scheduling is in *rounds*: a round takes the calls already queued (waiting at most
//! `wait` after the oldest arrived, and stopping early once a full batch is pending), and
//! runs all their rows before the next round starts. A call that arrives during a round
//! waits for the next one, so a long text is never starved by a stream of short ones: it
//! finishes within its own round. A call whose caller went away (cancelled, timed out) has
//! its rows dropped before each batch.
//!
//! Calls carry a *priority* (Temporal's priority key: lower is more urgent). A round
//! takes the most urgent waiting calls first (arrival order among equals, so equal
//! priorities are never starved), and inside a round the more urgent calls' rows fill the
//! first batches: one lane can carry interactive calls beside a bulk job.
//!
//! This module knows nothing of candle: a model is anything that implements [`Forward`],
//! which is what lets the tests check order, budgets and cancellation with a fake.

use std::{
    sync::{
        atomic::{AtomicU64, AtomicUsize, Ordering},
        mpsc::{Receiver, RecvTimeoutError},
        Arc,
    },
    time::{Duration, Instant},
};

use tokio::sync::oneshot;

use crate::ModelError;

/// One tokenized input: token ids and token type (segment) ids of the same length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Row {
    pub(crate) ids: Vec<u32>,
    pub(crate) types: Vec<u32>,
    /// Leading tokens pooling leaves out (a prompt the model does not pool).
    pub(crate) skip: usize,
}

impl Row {
    /// A single-segment row (type ids all 0).
    pub(crate) fn single(ids: Vec<u32>) -> Self {
        let types = vec![0; ids.len()];
        Self {
            ids,
            types,
            skip: 0,
        }
    }

    /// The same row with its first `skip` tokens left out of pooling.
    pub(crate) fn skipping(mut self, skip: usize) -> Self {
        self.skip = skip;
        self
    }

    pub(crate) fn len(&self) -> usize {
        self.ids.len()
    }
}

/// Refuses a call with a row of no tokens ([`ModelError::NoTokens`]): a packed batch has
/// no token of its own to pool for it. Only a tokenizer that adds no special tokens, on an
/// empty text, gives one.
pub(crate) fn refuse_empty(
    rows: &[Row],
    field: &'static str,
    needs: &'static str,
) -> Result<(), ModelError> {
    match rows.iter().position(|r| r.ids.is_empty()) {
        Some(index) => Err(ModelError::NoTokens {
            field,
            index,
            needs,
        }),
        None => Ok(()),
    }
}

/// A model the batcher can drive: one output vector per row, in the order given. Rows
/// arrive sorted by length, shortest first.
pub(crate) trait Forward {
    fn forward(&self, rows: &[&Row]) -> Result<Vec<Vec<f32>>, ModelError>;
}

/// How big a batch may get and how long to wait for one.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BatchLimits {
    /// Most rows per forward pass.
    pub(crate) rows: usize,
    /// Most padded tokens (rows × longest row) per forward pass. A single row longer than
    /// this still runs, alone.
    pub(crate) tokens: usize,
    /// How long a round waits for more calls after its oldest one arrived. Zero runs every
    /// call in a round of its own (no cross-call batching).
    pub(crate) wait: Duration,
}

impl BatchLimits {
    fn fits(&self, rows: usize, width: usize) -> bool {
        rows <= self.rows && rows * width <= self.tokens
    }
}

/// How many of a call's rows have been computed, and what a long job wants its next
/// heartbeat to say; the runtime reads both to heartbeat progress. Clones share them.
#[derive(Debug, Clone, Default)]
pub struct Progress {
    done: Arc<AtomicUsize>,
    details: Arc<std::sync::Mutex<Option<serde_json::Value>>>,
    beat: Arc<tokio::sync::Notify>,
}

impl Progress {
    /// Rows (texts or pairs) finished so far.
    pub fn done(&self) -> usize {
        self.done.load(Ordering::Relaxed)
    }

    /// Starts counting the rows of a new piece of work from zero.
    pub fn reset(&self) {
        self.done.store(0, Ordering::Relaxed);
    }

    fn add(&self, n: usize) {
        self.done.fetch_add(n, Ordering::Relaxed);
    }

    /// Sets what heartbeats carry besides the count (a job's parts done) and asks for a
    /// heartbeat now rather than at the next tick.
    pub fn set_details(&self, details: serde_json::Value) {
        *self.details.lock().expect("progress details poisoned") = Some(details);
        self.beat.notify_one();
    }

    /// The details last set, if any.
    pub fn details(&self) -> Option<serde_json::Value> {
        self.details
            .lock()
            .expect("progress details poisoned")
            .clone()
    }

    /// Resolves when [`Progress::set_details`] asks for a heartbeat.
    pub async fn beat_requested(&self) {
        self.beat.notified().await
    }
}

/// A call's outputs, one vector per row in input order, or why its batch failed.
pub(crate) type Outputs = Result<Vec<Vec<f32>>, ModelError>;

pub(crate) type Reply = oneshot::Sender<Outputs>;

/// One call waiting for the model.
pub(crate) struct Request {
    pub(crate) rows: Vec<Row>,
    pub(crate) reply: Reply,
    pub(crate) progress: Progress,
    pub(crate) span: tracing::Span,
    pub(crate) arrived: Instant,
    /// A health check's call: computed like any other, but not counted in metrics, so
    /// the probes do not show up as traffic.
    pub(crate) probe: bool,
    /// Lower runs first (Temporal's priority key, defaulted by the caller).
    pub(crate) priority: i32,
}

/// Told about each forward pass and each round's start, on the engine thread, so the
/// runtime can keep metrics (rows per batch, time queued) without this crate knowing how
/// they are exported. Implementations must be quick: they run between batches.
pub trait BatchObserver: Send + Sync {
    /// A forward pass begins.
    fn started(&self) {}
    /// The engine has had no call for [`IDLE_AFTER`] (told once per idle spell).
    fn idle(&self) {}
    /// A forward pass of `rows` rows and `tokens` real tokens took `took` (also for failed
    /// passes).
    fn batch(&self, rows: usize, tokens: usize, took: Duration);
    /// A call waited `waited` in the engine's queue before its round began.
    fn queued(&self, waited: Duration);
}

/// How long an engine waits without a call before it tells its observer it is idle.
pub const IDLE_AFTER: Duration = Duration::from_secs(5);

/// Running totals of an engine's forward passes, for metrics: written by the engine
/// thread after each batch, read from any thread at any time.
#[derive(Debug, Default)]
pub struct BatchCounters {
    batches: AtomicU64,
    rows: AtomicU64,
    tokens: AtomicU64,
    nanos: AtomicU64,
    /// When the forward pass in progress began, in nanoseconds since `epoch`; 0 between
    /// passes.
    busy_since: AtomicU64,
    epoch: std::sync::OnceLock<Instant>,
}

/// [`BatchCounters`] read at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct BatchTotals {
    /// Forward passes run, failed ones included.
    pub batches: u64,
    /// Texts or (query, document) pairs through them.
    pub rows: u64,
    /// Real tokens through them, special tokens included, padding not.
    pub tokens: u64,
    /// Seconds spent in them.
    pub seconds: f64,
}

impl BatchObserver for BatchCounters {
    fn started(&self) {
        let epoch = *self.epoch.get_or_init(Instant::now);
        // Never 0, which means idle.
        let since = (epoch.elapsed().as_nanos() as u64).max(1);
        self.busy_since.store(since, Ordering::Relaxed);
    }

    fn batch(&self, rows: usize, tokens: usize, took: Duration) {
        self.busy_since.store(0, Ordering::Relaxed);
        self.batches.fetch_add(1, Ordering::Relaxed);
        self.rows.fetch_add(rows as u64, Ordering::Relaxed);
        self.tokens.fetch_add(tokens as u64, Ordering::Relaxed);
        self.nanos
            .fetch_add(took.as_nanos() as u64, Ordering::Relaxed);
    }

    fn queued(&self, _waited: Duration) {}
}

impl BatchCounters {
    /// How long the forward pass in progress has run, or `None` between passes: a health
    /// check tells a busy engine (one long batch) from a stuck one with it.
    pub fn busy_for(&self) -> Option<Duration> {
        let since = self.busy_since.load(Ordering::Relaxed);
        let epoch = self.epoch.get()?;
        (since != 0).then(|| epoch.elapsed().saturating_sub(Duration::from_nanos(since)))
    }

    /// The totals so far.
    pub fn totals(&self) -> BatchTotals {
        BatchTotals {
            batches: self.batches.load(Ordering::Relaxed),
            rows: self.rows.load(Ordering::Relaxed),
            tokens: self.tokens.load(Ordering::Relaxed),
            seconds: self.nanos.load(Ordering::Relaxed) as f64 * 1e-9,
        }
    }
}

/// Serves `queue` until every sender is gone, telling `observer` about every batch.
/// Blocking: runs on the engine's own thread.
pub(crate) fn serve(
    model: &dyn Forward,
    limits: BatchLimits,
    queue: Receiver<Request>,
    observer: &dyn BatchObserver,
) {
    let mut waiting: Vec<Request> = Vec::new();
    // Idle means no call but health probes for IDLE_AFTER (probes come every few seconds
    // and would otherwise keep an idle engine from ever being idle); told once per spell.
    let mut last_work = Instant::now();
    let mut told_idle = false;
    loop {
        if waiting.is_empty() {
            let first = if told_idle {
                queue.recv().map_err(|_| ())
            } else {
                match queue.recv_timeout(IDLE_AFTER.saturating_sub(last_work.elapsed())) {
                    Ok(first) => Ok(first),
                    Err(RecvTimeoutError::Timeout) => {
                        observer.idle();
                        told_idle = true;
                        continue;
                    }
                    Err(RecvTimeoutError::Disconnected) => Err(()),
                }
            };
            match first {
                Ok(first) => waiting.push(first),
                Err(()) => return,
            }
        }
        let round = gather(&mut waiting, &queue, &limits);
        let work = round.iter().any(|r| !r.probe);
        run_round(model, &limits, round, observer);
        if work {
            last_work = Instant::now();
            told_idle = false;
        }
    }
}

/// Moves every call already in `queue` to `waiting`.
fn drain(waiting: &mut Vec<Request>, queue: &Receiver<Request>) {
    while let Ok(r) = queue.try_recv() {
        waiting.push(r);
    }
}

/// The calls of one round, taken from `waiting` most urgent first (then oldest): the
/// calls queued, plus whatever arrives before the most urgent call has waited
/// `limits.wait`, until a full batch is pending. The rest stay waiting.
fn gather(
    waiting: &mut Vec<Request>,
    queue: &Receiver<Request>,
    limits: &BatchLimits,
) -> Vec<Request> {
    drain(waiting, queue);
    // Stable: equal priorities keep arrival order.
    waiting.sort_by_key(|r| r.priority);
    if limits.wait.is_zero() {
        return vec![waiting.remove(0)];
    }
    let deadline = waiting[0].arrived + limits.wait;
    loop {
        let (mut rows, mut tokens) = (0, 0);
        let mut full = None;
        for (i, r) in waiting.iter().enumerate() {
            rows += r.rows.len();
            tokens += r.rows.iter().map(Row::len).sum::<usize>();
            if rows >= limits.rows || tokens >= limits.tokens {
                full = Some(i + 1);
                break;
            }
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if let Some(n) = full {
            return waiting.drain(..n).collect();
        }
        if left.is_zero() {
            return std::mem::take(waiting);
        }
        match queue.recv_timeout(left) {
            Ok(r) => {
                waiting.push(r);
                drain(waiting, queue);
                waiting.sort_by_key(|r| r.priority);
            }
            Err(RecvTimeoutError::Timeout) | Err(RecvTimeoutError::Disconnected) => {
                return std::mem::take(waiting)
            }
        }
    }
}

struct Open {
    out: Vec<Vec<f32>>,
    left: usize,
    reply: Option<Reply>,
    progress: Progress,
    span: tracing::Span,
    probe: bool,
}

impl Open {
    /// Still wanted: not answered yet, and the caller still waits.
    fn wanted(&self) -> bool {
        self.reply.as_ref().is_some_and(|r| !r.is_closed())
    }
}

fn run_round(
    model: &dyn Forward,
    limits: &BatchLimits,
    round: Vec<Request>,
    observer: &dyn BatchObserver,
) {
    let mut rows = Vec::new();
    let mut open = Vec::with_capacity(round.len());
    let began = Instant::now();
    let round_priorities: Vec<i32> = round.iter().map(|r| r.priority).collect();
    for (call, req) in round.into_iter().enumerate() {
        if !req.probe {
            observer.queued(began.saturating_duration_since(req.arrived));
        }
        let n = req.rows.len();
        rows.extend(
            req.rows
                .into_iter()
                .enumerate()
                .map(|(index, row)| (call, index, row)),
        );
        let mut o = Open {
            out: vec![Vec::new(); n],
            left: n,
            reply: Some(req.reply),
            progress: req.progress,
            span: req.span,
            probe: req.probe,
        };
        if n == 0 {
            if let Some(reply) = o.reply.take() {
                let _ = reply.send(Ok(Vec::new()));
            }
        }
        open.push(o);
    }
    // More urgent calls' rows first, then by length; stable, so equal keys keep arrival
    // order and batches are deterministic.
    let priority: Vec<i32> = round_priorities;
    rows.sort_by_key(|(call, _, row)| (priority[*call], row.len()));
    let mut start = 0;
    while start < rows.len() {
        // Rows of calls nobody waits for any more leave the queue here.
        if !open[rows[start].0].wanted() {
            let o = &mut open[rows[start].0];
            if let Some(reply) = o.reply.take() {
                tracing::debug!(parent: &o.span, rows_left = o.left, "call abandoned; its rows leave the queue");
                drop(reply);
            }
            start += 1;
            continue;
        }
        let mut batch = vec![start];
        let mut end = start + 1;
        while end < rows.len() {
            if open[rows[end].0].wanted() {
                if !limits.fits(batch.len() + 1, rows[end].2.len()) {
                    break;
                }
                batch.push(end);
            }
            end += 1;
        }
        let inputs: Vec<&Row> = batch.iter().map(|&i| &rows[i].2).collect();
        let began = Instant::now();
        observer.started();
        let result = model.forward(&inputs).map_err(ModelError::classify);
        let took = began.elapsed();
        let counted: Vec<usize> = batch
            .iter()
            .filter(|&&i| !open[rows[i].0].probe)
            .map(|&i| rows[i].2.len())
            .collect();
        if !counted.is_empty() {
            observer.batch(counted.len(), counted.iter().sum(), took);
        }
        if tracing::enabled!(tracing::Level::DEBUG) {
            // Distinct calls in the batch: counted only for the log.
            let mut calls: Vec<usize> = batch.iter().map(|&i| rows[i].0).collect();
            calls.sort_unstable();
            calls.dedup();
            tracing::debug!(
                rows = batch.len(),
                calls = calls.len(),
                width = inputs.last().map_or(0, |r| r.len()),
                ms = took.as_secs_f64() * 1e3,
                "batch"
            );
        }
        match result {
            Ok(outs) => {
                assert_eq!(
                    outs.len(),
                    batch.len(),
                    "a forward pass returned the wrong number of rows; this is a bug"
                );
                for (&i, out) in batch.iter().zip(outs) {
                    let (call, index, _) = rows[i];
                    let o = &mut open[call];
                    o.out[index] = out;
                    o.left -= 1;
                    o.progress.add(1);
                    if o.left == 0 {
                        if let Some(reply) = o.reply.take() {
                            let _ = reply.send(Ok(std::mem::take(&mut o.out)));
                        }
                    }
                }
            }
            Err(e) => {
                // Every call with a row in the failed batch fails; the others go on.
                for &i in &batch {
                    let o = &mut open[rows[i].0];
                    if let Some(reply) = o.reply.take() {
                        tracing::warn!(parent: &o.span, error = %e, "batch failed");
                        let _ = reply.send(Err(e.duplicate()));
                    }
                }
            }
        }
        start = end;
    }
}

/// Runs `rows` through `model` in length-sorted batches on the calling thread, outputs in
/// input order: the batcher for one call, without a queue (direct model use and tests).
pub(crate) fn run_now(
    model: &dyn Forward,
    limits: &BatchLimits,
    rows: Vec<Row>,
) -> Result<Vec<Vec<f32>>, ModelError> {
    let (reply, mut rx) = oneshot::channel();
    let req = Request {
        rows,
        reply,
        progress: Progress::default(),
        span: tracing::Span::current(),
        arrived: Instant::now(),
        probe: false,
        priority: 0,
    };
    run_round(model, limits, vec![req], &BatchCounters::default());
    rx.try_recv()
        .expect("a round answers every call it was given; this is a bug")
}

#[cfg(test)]
mod tests {
    use std::sync::{mpsc, Mutex};

    use tokio::sync::oneshot::Receiver;

    use super::*;

    #[test]
    fn counters_tell_a_forward_pass_in_progress() {
        let c = BatchCounters::default();
        assert_eq!(c.busy_for(), None);
        c.started();
        std::thread::sleep(Duration::from_millis(5));
        assert!(c.busy_for().is_some_and(|d| d >= Duration::from_millis(5)));
        c.batch(2, 9, Duration::from_millis(5));
        assert_eq!(c.busy_for(), None);
        assert_eq!(c.totals().rows, 2);
    }

    /// A model whose output for a row is `[first id, row length]`, which records the
    /// batches it saw (as lists of first ids), can drop a caller's reply receiver during
    /// its first batch, and can fail batches holding one id.
    #[derive(Default)]
    struct Fake {
        batches: Mutex<Vec<Vec<u32>>>,
        drop_during_first: Mutex<Option<Receiver<Outputs>>>,
        fail_on: Option<u32>,
    }

    impl Forward for Fake {
        fn forward(&self, rows: &[&Row]) -> Result<Vec<Vec<f32>>, ModelError> {
            drop(self.drop_during_first.lock().unwrap().take());
            self.batches
                .lock()
                .unwrap()
                .push(rows.iter().map(|r| r.ids[0]).collect());
            if rows.iter().any(|r| Some(r.ids[0]) == self.fail_on) {
                return Err(ModelError::OutOfMemory("fake".into()));
            }
            Ok(rows
                .iter()
                .map(|r| vec![r.ids[0] as f32, r.len() as f32])
                .collect())
        }
    }

    /// A row of `len` tokens whose first id is `tag`.
    fn row(tag: u32, len: usize) -> Row {
        let mut ids = vec![tag];
        ids.resize(len, 0);
        Row::single(ids)
    }

    fn limits(rows: usize, tokens: usize, wait_ms: u64) -> BatchLimits {
        BatchLimits {
            rows,
            tokens,
            wait: Duration::from_millis(wait_ms),
        }
    }

    fn request(rows: Vec<Row>) -> (Request, Receiver<Outputs>) {
        let (reply, rx) = oneshot::channel();
        let req = Request {
            rows,
            reply,
            progress: Progress::default(),
            span: tracing::Span::none(),
            arrived: Instant::now(),
            probe: false,
            priority: 0,
        };
        (req, rx)
    }

    #[test]
    fn each_call_gets_its_rows_back_in_input_order() {
        let model = Fake::default();
        let (a, mut ra) = request(vec![row(1, 9), row(2, 3), row(3, 6)]);
        let (b, mut rb) = request(vec![row(4, 2), row(5, 8)]);
        run_round(
            &model,
            &limits(2, 1000, 5),
            vec![a, b],
            &BatchCounters::default(),
        );
        let a = ra.try_recv().unwrap().unwrap();
        let b = rb.try_recv().unwrap().unwrap();
        assert_eq!(a, vec![vec![1., 9.], vec![2., 3.], vec![3., 6.]]);
        assert_eq!(b, vec![vec![4., 2.], vec![5., 8.]]);
        // Rows of both calls were pooled and length-sorted: 2,3 | 6,8 | 9.
        assert_eq!(
            *model.batches.lock().unwrap(),
            vec![vec![4, 2], vec![3, 5], vec![1]]
        );
    }

    /// Inside a round, an urgent call's rows fill the first batch even though they are
    /// longer; among equal priorities rows stay length-sorted.
    #[test]
    fn urgent_rows_go_into_the_first_batches() {
        let model = Fake::default();
        let (mut bulk, _rb) = request(vec![row(1, 2), row(2, 3)]);
        bulk.priority = 3;
        let (mut urgent, mut ru) = request(vec![row(9, 8)]);
        urgent.priority = 1;
        run_round(
            &model,
            &limits(1, 1000, 5),
            vec![bulk, urgent],
            &BatchCounters::default(),
        );
        assert_eq!(ru.try_recv().unwrap().unwrap(), vec![vec![9., 8.]]);
        assert_eq!(
            *model.batches.lock().unwrap(),
            vec![vec![9], vec![1], vec![2]]
        );
    }

    /// The next round takes the most urgent waiting call first, and the oldest among
    /// equals, whatever order they were queued in.
    #[test]
    fn a_round_takes_the_most_urgent_then_the_oldest_calls() {
        let (tx, queue) = mpsc::channel();
        let mut waiting = Vec::new();
        for (tag, priority) in [(1u32, 3), (2, 3), (3, 1), (4, 3)] {
            let (mut r, rx) = request(vec![row(tag, 2)]);
            r.priority = priority;
            std::mem::forget(rx);
            tx.send(r).unwrap();
        }
        let first = |w: &mut Vec<Request>| {
            let round = gather(w, &queue, &limits(1, 1000, 5));
            round.iter().map(|r| r.rows[0].ids[0]).collect::<Vec<_>>()
        };
        assert_eq!(first(&mut waiting), vec![3]);
        assert_eq!(first(&mut waiting), vec![1]);
        assert_eq!(first(&mut waiting), vec![2]);
        assert_eq!(first(&mut waiting), vec![4]);
    }

    #[test]
    fn batches_respect_the_row_and_token_budgets() {
        let model = Fake::default();
        let lens = [3usize, 7, 7, 2, 10, 5, 5, 5, 1, 9, 4, 8];
        let rows: Vec<Row> = lens
            .iter()
            .enumerate()
            .map(|(i, &l)| row(i as u32 + 1, l))
            .collect();
        let lim = limits(4, 20, 0);
        let out = run_now(&model, &lim, rows).unwrap();
        assert_eq!(out.len(), lens.len());
        let batches = model.batches.lock().unwrap();
        for b in batches.iter() {
            let width = b.iter().map(|&t| lens[t as usize - 1]).max().unwrap();
            assert!(b.len() <= 4, "{b:?} has more than 4 rows");
            assert!(
                b.len() * width <= 20,
                "{b:?} pads to {} tokens",
                b.len() * width
            );
        }
        // Greedy: every batch but the last is as full as the budget allows.
        assert_eq!(batches.iter().map(Vec::len).sum::<usize>(), lens.len());
        assert_eq!(batches.len(), 5, "{batches:?}");
    }

    #[test]
    fn a_row_over_the_token_budget_runs_alone() {
        let model = Fake::default();
        let out = run_now(&model, &limits(8, 10, 0), vec![row(1, 2), row(2, 50)]).unwrap();
        assert_eq!(out, vec![vec![1., 2.], vec![2., 50.]]);
        assert_eq!(*model.batches.lock().unwrap(), vec![vec![1], vec![2]]);
    }

    #[test]
    fn a_cancelled_call_leaves_the_queue() {
        let model = Fake::default();
        let (a, ra) = request(vec![row(1, 4), row(2, 4)]);
        let (b, mut rb) = request(vec![row(3, 4)]);
        drop(ra); // the caller of `a` gave up before the round ran
        let progress = b.progress.clone();
        run_round(
            &model,
            &limits(1, 1000, 0),
            vec![a, b],
            &BatchCounters::default(),
        );
        assert_eq!(*model.batches.lock().unwrap(), vec![vec![3]]);
        assert_eq!(rb.try_recv().unwrap().unwrap(), vec![vec![3., 4.]]);
        assert_eq!(progress.done(), 1);
    }

    #[test]
    fn a_call_cancelled_mid_round_stops_after_the_current_batch() {
        let (a, ra) = request(vec![row(1, 4), row(2, 4), row(3, 4)]);
        let progress = a.progress.clone();
        // The caller gives up while the first batch is running.
        let model = Fake {
            drop_during_first: Mutex::new(Some(ra)),
            ..Fake::default()
        };
        run_round(
            &model,
            &limits(1, 1000, 0),
            vec![a],
            &BatchCounters::default(),
        );
        assert_eq!(*model.batches.lock().unwrap(), vec![vec![1]]);
        assert_eq!(progress.done(), 1);
    }

    #[test]
    fn a_long_text_is_not_starved_by_a_stream_of_short_ones() {
        let model = Fake::default();
        let (tx, rx) = mpsc::channel();
        let (long, mut rlong) = request(vec![row(100, 50)]);
        tx.send(long).unwrap();
        // Far more short calls than one batch holds, all queued behind the long one.
        let mut shorts = Vec::new();
        for i in 0..40 {
            let (r, rr) = request(vec![row(i + 1, 2)]);
            tx.send(r).unwrap();
            shorts.push(rr);
        }
        drop(tx);
        serve(&model, limits(8, 1000, 1), rx, &BatchCounters::default());
        assert_eq!(rlong.try_recv().unwrap().unwrap(), vec![vec![100., 50.]]);
        for mut r in shorts {
            assert!(r.try_recv().unwrap().is_ok());
        }
        // The long text ran in the first round, before most short calls were even taken.
        let batches = model.batches.lock().unwrap();
        let long_at = batches.iter().position(|b| b.contains(&100)).unwrap();
        assert!(
            long_at <= 1,
            "long text ran in batch {long_at}: {batches:?}"
        );
    }

    #[test]
    fn concurrent_calls_are_batched_together_within_the_wait() {
        let model = Fake::default();
        let (tx, rx) = mpsc::channel();
        let mut replies = Vec::new();
        for i in 0..16 {
            let (r, rr) = request(vec![row(i + 1, 3)]);
            tx.send(r).unwrap();
            replies.push(rr);
        }
        drop(tx);
        let counters = BatchCounters::default();
        serve(&model, limits(32, 1000, 50), rx, &counters);
        assert_eq!(model.batches.lock().unwrap().len(), 1);
        // The counters saw the one batch: 16 rows of 3 tokens.
        let t = counters.totals();
        assert_eq!((t.batches, t.rows, t.tokens), (1, 16, 48));
        for (i, mut r) in replies.into_iter().enumerate() {
            assert_eq!(
                r.try_recv().unwrap().unwrap(),
                vec![vec![i as f32 + 1., 3.]]
            );
        }
    }

    #[test]
    fn zero_wait_runs_each_call_alone() {
        let model = Fake::default();
        let (tx, rx) = mpsc::channel();
        let mut replies = Vec::new();
        for i in 0..4 {
            let (r, rr) = request(vec![row(i + 1, 3)]);
            tx.send(r).unwrap();
            replies.push(rr);
        }
        drop(tx);
        let counters = BatchCounters::default();
        serve(&model, limits(32, 1000, 0), rx, &counters);
        assert_eq!(model.batches.lock().unwrap().len(), 4);
        let t = counters.totals();
        assert_eq!((t.batches, t.rows, t.tokens), (4, 4, 12));
        assert!(replies.iter_mut().all(|r| r.try_recv().unwrap().is_ok()));
    }

    #[test]
    fn a_failed_batch_fails_its_calls_and_the_others_go_on() {
        let model = Fake {
            fail_on: Some(2),
            ..Fake::default()
        };
        let (a, mut ra) = request(vec![row(1, 2), row(2, 9)]);
        let (b, mut rb) = request(vec![row(3, 3)]);
        run_round(
            &model,
            &limits(1, 1000, 0),
            vec![a, b],
            &BatchCounters::default(),
        );
        assert!(matches!(
            ra.try_recv().unwrap(),
            Err(ModelError::OutOfMemory(_))
        ));
        assert_eq!(rb.try_recv().unwrap().unwrap(), vec![vec![3., 3.]]);
    }
}
