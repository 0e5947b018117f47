//! The host memory every `embed_dataset` activity of the worker holds of its sources,
//! together, against `--max-dataset-bytes`. Each device's activities read into the same
//! host memory, so the bound is one for the worker, not one per activity: several shards
//! sent to one host at once would otherwise each take the limit.
//!
//! A reader claims what it holds as it reads it (`Held::add`), a JSON Lines or CSV job's
//! ids in its first pass included. A job alone over the limit is refused (`Held`).
//! Otherwise a claim the memory cannot give at once goes one of two ways:
//! - **Out of turn** (a job's first read), the claim fails at once: the job gives back
//!   all it holds, waits for its turn, and reads its source again. Two readers that
//!   waited while each held part of its source could wait on each other for ever.
//! - **In its turn** (one job of the worker at a time), the claim waits for the memory.
//!   That cannot deadlock: the others that hold memory either have read (they end, and
//!   give it back) or read out of turn (they never wait while holding).
//!
//! So a job reads its source at most twice. A job that finds another waiting (in line for
//! the turn, or short of memory in it) gets in line behind it before it reads, so the
//! memory a short job gives back goes to it first; once through the line, it reads out of
//! turn like any other, so jobs that queued together read together. What a reader holds
//! beside its counted values (a Parquet footer, fetched compressed chunks, stream
//! buffers) is not claimed; what it holds for a moment (the duplicate check) is claimed
//! and given back.

use std::{
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use tokio::{
    runtime::Handle,
    sync::{watch, Mutex, OwnedMutexGuard, OwnedSemaphorePermit, Semaphore},
};

/// The worker's memory for datasets, shared by every device's activities.
#[derive(Clone)]
pub struct DatasetMemory {
    bytes: u64,
    /// `bytes` in KiB, as the semaphore was made with.
    permits: usize,
    /// One permit a KiB: tokio counts permits in `u32` per claim and `usize` in all.
    kib: Arc<Semaphore>,
    /// The turn to read with claims that wait: one job at a time (tokio's mutex is fair).
    turn: Arc<Mutex<()>>,
    /// Jobs waiting now: for the turn, or in it for memory.
    waiting: Arc<AtomicUsize>,
}

impl std::fmt::Debug for DatasetMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DatasetMemory")
            .field("bytes", &self.bytes)
            .field("held", &self.held())
            .finish()
    }
}

/// KiB covering `bytes`, as one claim takes them (a claim over 4 TiB is taken as 4 TiB;
/// no limit here is near it).
fn kib(bytes: u64) -> u32 {
    u32::try_from(bytes.div_ceil(1024)).unwrap_or(u32::MAX)
}

impl DatasetMemory {
    /// `bytes` for every `embed_dataset` activity of the worker together.
    pub fn new(bytes: u64) -> Self {
        let permits = (kib(bytes) as usize).min(Semaphore::MAX_PERMITS);
        Self {
            bytes,
            permits,
            kib: Arc::new(Semaphore::new(permits)),
            turn: Arc::new(Mutex::new(())),
            waiting: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// The limit, in bytes.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// What the worker's jobs hold now, in bytes (to the KiB).
    pub fn held(&self) -> u64 {
        self.permits.saturating_sub(self.kib.available_permits()) as u64 * 1024
    }
}

/// What one job holds of [`DatasetMemory`], given back when it is dropped (when the job
/// ends, since it keeps its texts to the end).
pub(crate) struct Claim {
    memory: DatasetMemory,
    /// What it holds, a permit a KiB.
    permit: Option<OwnedSemaphorePermit>,
    /// Bytes the job had reached when the memory was taken, if it was.
    short: Option<u64>,
    /// The job's turn, while it reads in it: then a claim waits for the memory.
    turn: Option<Turn>,
    /// Closes (its sender drops) once the job's activity has ended (cancelled, timed out)
    /// while it reads. Its claims then fail: a read out of turn stops at its next count
    /// instead of reading on to its end on the blocking pool, and one in its turn stops
    /// waiting and passes the turn on.
    gone: Option<watch::Receiver<()>>,
    /// How long claims waited for the memory in this turn.
    waited: Duration,
}

impl Claim {
    pub(crate) fn new(memory: &DatasetMemory) -> Self {
        Self {
            memory: memory.clone(),
            permit: None,
            short: None,
            turn: None,
            gone: None,
            waited: Duration::ZERO,
        }
    }

    /// Watches the job's activity while it reads: once `gone` closes, every claim fails.
    pub(crate) fn watch(&mut self, gone: watch::Receiver<()>) {
        self.gone = Some(gone);
    }

    /// Whether the activity it watches has ended.
    fn ended(&self) -> bool {
        self.gone.as_ref().is_some_and(|g| g.has_changed().is_err())
    }

    /// The most one job may hold: all of the worker's dataset memory.
    pub(super) fn limit(&self) -> u64 {
        self.memory.bytes
    }

    /// KiB held.
    fn kib(&self) -> u32 {
        self.permit.as_ref().map_or(0, |p| p.num_permits() as u32)
    }

    /// Holds enough for `bytes` in all. Out of turn it never waits: false when other jobs
    /// hold too much, and the caller stops reading. In its turn it waits for the memory,
    /// blocking the thread (readers run on the blocking pool), and `bytes` must be within
    /// the limit, or it would wait for ever. Either way it is false once the job's
    /// activity has ended (cancelled, timed out; [`Claim::watch`]), even within what it
    /// holds, so that the read stops and a turn passes on now.
    pub(super) fn cover(&mut self, bytes: u64) -> bool {
        if self.ended() {
            return false;
        }
        let (want, held) = (kib(bytes), self.kib());
        if want <= held {
            return true;
        }
        let Some(more) = self.more(want - held) else {
            self.short = Some(bytes);
            return false;
        };
        match &mut self.permit {
            Some(p) => p.merge(more),
            None => self.permit = Some(more),
        }
        true
    }

    /// `n` KiB more: at once, or in the job's turn once they are free; none if other jobs
    /// hold them (out of turn) or the job ends while it waits.
    fn more(&mut self, n: u32) -> Option<OwnedSemaphorePermit> {
        let semaphore = self.memory.kib.clone();
        let (Some(turn), Some(gone)) = (&self.turn, &mut self.gone) else {
            return semaphore.try_acquire_many_owned(n).ok();
        };
        if let Ok(more) = semaphore.clone().try_acquire_many_owned(n) {
            return Some(more);
        }
        let since = Instant::now();
        let got = turn.rt.block_on(async {
            tokio::select! {
                more = semaphore.acquire_many_owned(n) => {
                    Some(more.expect("the dataset memory's semaphore is never closed"))
                }
                // The job ended while it waits: not when the memory frees.
                _ = gone.changed() => None,
            }
        });
        self.waited += since.elapsed();
        got
    }

    /// Holds only enough for `bytes` in all, giving the rest back (what a reader held for
    /// a moment).
    pub(super) fn shrink(&mut self, bytes: u64) {
        let (keep, held) = (kib(bytes), self.kib());
        if keep < held {
            if let Some(p) = &mut self.permit {
                drop(p.split((held - keep) as usize));
            }
        }
    }

    /// The bytes a read stopped at for want of memory, if it did.
    pub(crate) fn short(&mut self) -> Option<u64> {
        self.short.take()
    }

    /// Whether another job waits for memory now: in line for the turn, or short of memory
    /// in it (from when it took its turn to when its read ends). A job that finds one gets
    /// in line behind it (`wait_in_line`), first come, first served.
    pub(crate) fn others_waiting(&self) -> bool {
        self.memory.waiting.load(Ordering::SeqCst) > 0
    }

    /// Waits in line behind the jobs waiting for memory, then passes the turn on at once:
    /// the job has not found memory short itself, so it reads out of turn like any other,
    /// and jobs that queued together read together again (not one at a time).
    pub(crate) async fn wait_in_line(&self) {
        let _waiting = Waiting::count(&self.memory.waiting);
        drop(self.memory.turn.clone().lock_owned().await);
    }

    /// Whether this job reads in its turn.
    pub(crate) fn in_turn(&self) -> bool {
        self.turn.is_some()
    }

    /// Gives back all it holds, then waits for the job's turn, counted as waiting until
    /// the turn ends: newcomers get in line rather than take the memory it gave back. The
    /// claim must watch the job's activity ([`Claim::watch`]): the turn's claims stop
    /// waiting once that ends, and without a watch they could wait for ever.
    pub(crate) async fn take_turn(&mut self) {
        assert!(
            self.gone.is_some(),
            "a turn taken without a watch on its job; this is a bug"
        );
        self.permit = None;
        self.short = None;
        let waiting = Waiting::count(&self.memory.waiting);
        let guard = self.memory.turn.clone().lock_owned().await;
        self.turn = Some(Turn {
            _waiting: waiting,
            _guard: guard,
            rt: Handle::current(),
        });
    }

    /// Ends the job's read: its turn, if it had one, and its watch on the activity (so a
    /// claim that outlives the read only holds); keeps what it holds. Gives how long its
    /// claims waited in the turn.
    pub(crate) fn end_read(&mut self) -> Duration {
        self.turn = None;
        self.gone = None;
        std::mem::take(&mut self.waited)
    }
}

/// One job counted as waiting while this lives (dropped with a wait that is abandoned).
struct Waiting(Arc<AtomicUsize>);

impl Waiting {
    fn count(waiting: &Arc<AtomicUsize>) -> Self {
        waiting.fetch_add(1, Ordering::SeqCst);
        Self(waiting.clone())
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A job's turn to read with claims that wait.
struct Turn {
    // Fields drop in order: the job stops counting as waiting before the turn passes on,
    // so the next job in its turn never sees it still waiting.
    _waiting: Waiting,
    _guard: OwnedMutexGuard<()>,
    /// The runtime the claims wait on, from the blocking pool.
    rt: Handle,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claims_share_the_limit_and_give_it_back_when_dropped() {
        let memory = DatasetMemory::new(10 * 1024);
        let mut a = Claim::new(&memory);
        assert!(a.cover(6 * 1024));
        // Counting within what is held takes nothing more.
        assert!(a.cover(6 * 1024 - 1));
        assert_eq!(memory.held(), 6 * 1024);
        let mut b = Claim::new(&memory);
        assert!(!b.cover(5 * 1024));
        assert_eq!(b.short(), Some(5 * 1024));
        assert_eq!(b.short(), None);
        assert!(b.cover(4 * 1024));
        assert_eq!(memory.held(), 10 * 1024);
        drop(a);
        assert_eq!(memory.held(), 4 * 1024);
        assert!(b.cover(9 * 1024));
        b.shrink(3 * 1024);
        assert_eq!(memory.held(), 3 * 1024);
        assert!(b.cover(4 * 1024));
        assert_eq!(memory.held(), 4 * 1024);
        drop(b);
        assert_eq!(memory.held(), 0);
    }

    /// In its turn a claim waits for what another job holds, then holds it; out of turn
    /// the same claim fails at once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn in_its_turn_a_claim_waits_for_the_memory() {
        let memory = DatasetMemory::new(10 * 1024);
        let mut a = Claim::new(&memory);
        assert!(a.cover(6 * 1024));
        let mut b = Claim::new(&memory);
        assert!(!b.cover(8 * 1024), "out of turn, a claim never waits");
        assert!(!b.others_waiting());
        let (_alive, gone) = watch::channel(());
        b.watch(gone);
        b.take_turn().await;
        assert!(b.in_turn());
        let b = tokio::task::spawn_blocking(move || {
            assert!(b.cover(8 * 1024));
            b
        });
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!b.is_finished(), "the claim did not wait for the memory");
        drop(a);
        let mut b = b.await.unwrap();
        assert_eq!(memory.held(), 8 * 1024);
        assert!(b.end_read() >= Duration::from_millis(150));
        assert!(!b.in_turn());
        drop(b);
        assert_eq!(memory.held(), 0);
    }

    /// One job reads in turn at a time, and taking a turn gives back what a job held, so
    /// a job waiting for the turn holds nothing another waits for. A job in its turn makes
    /// newcomers get in line, so they do not take the memory it gave back.
    #[tokio::test]
    async fn turns_come_one_at_a_time_and_waiting_for_one_holds_nothing() {
        let memory = DatasetMemory::new(10 * 1024);
        let (_alive, gone) = watch::channel(());
        let mut a = Claim::new(&memory);
        a.watch(gone.clone());
        a.take_turn().await;
        let mut b = Claim::new(&memory);
        b.watch(gone);
        assert!(b.cover(4 * 1024));
        assert!(
            b.others_waiting(),
            "a newcomer could take what the turn gave back"
        );
        let b = tokio::spawn(async move {
            b.take_turn().await;
            b
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!b.is_finished(), "two jobs had the turn at once");
        assert!(Claim::new(&memory).others_waiting());
        assert_eq!(
            memory.held(),
            0,
            "the job waiting for its turn still held memory"
        );
        assert!(a.cover(10 * 1024), "the turn's claim got all the memory");
        a.end_read();
        let mut b = b.await.unwrap();
        assert!(b.in_turn());
        b.end_read();
        drop(a);
        assert_eq!(memory.held(), 0);
    }

    /// A job whose activity ends while its turn's claim waits stops waiting: the claim
    /// fails, and once the job's read gives up its claim the turn passes on, without
    /// waiting for the memory to free.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_job_that_ends_while_it_waits_passes_the_turn_on() {
        let memory = DatasetMemory::new(10 * 1024);
        let mut a = Claim::new(&memory);
        assert!(a.cover(6 * 1024));
        let (alive, gone) = watch::channel(());
        let mut b = Claim::new(&memory);
        b.watch(gone);
        b.take_turn().await;
        let b = tokio::task::spawn_blocking(move || {
            let covered = b.cover(8 * 1024);
            (covered, b.short())
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!b.is_finished());
        drop(alive);
        assert_eq!(b.await.unwrap(), (false, Some(8 * 1024)));
        let mut c = Claim::new(&memory);
        assert!(!c.others_waiting());
        let (_alive, gone) = watch::channel(());
        c.watch(gone);
        tokio::time::timeout(Duration::from_secs(1), c.take_turn())
            .await
            .expect("the ended job kept the turn");
        assert_eq!(memory.held(), 6 * 1024);
        drop(a);
        assert!(c.cover(10 * 1024));
    }

    /// A job that ended while it reads stops at its next claim, in its turn or out of it,
    /// even where the memory is there or the claim is within what it holds: the turn
    /// passes on, and a read out of turn stops, before the job would have read its whole
    /// source. It is not short of memory, so it does not wait for a turn. Once its read
    /// has ended, the claim holds what it held.
    #[tokio::test]
    async fn a_job_that_ends_while_it_reads_stops_at_its_next_claim() {
        for in_turn in [false, true] {
            let memory = DatasetMemory::new(10 * 1024);
            let (alive, gone) = watch::channel(());
            let mut a = Claim::new(&memory);
            a.watch(gone);
            if in_turn {
                a.take_turn().await;
            }
            assert!(a.cover(2 * 1024));
            drop(alive);
            assert!(
                !a.cover(2 * 1024),
                "in turn {in_turn}: within what it holds"
            );
            assert!(!a.cover(3 * 1024), "in turn {in_turn}");
            assert_eq!(a.short(), None, "in turn {in_turn}");
            assert_eq!(memory.held(), 2 * 1024);
            a.end_read();
            assert!(a.cover(2 * 1024), "in turn {in_turn}: after its read");
            drop(a);
            assert_eq!(memory.held(), 0);
        }
    }

    /// A job that got in line behind a waiting one passes the turn on as soon as it gets
    /// it: it reads out of turn, beside the others that were in line.
    #[tokio::test]
    async fn a_job_through_the_line_passes_the_turn_on() {
        let memory = DatasetMemory::new(10 * 1024);
        let (_alive, gone) = watch::channel(());
        let mut a = Claim::new(&memory);
        a.watch(gone.clone());
        a.take_turn().await;
        let line = |memory: &DatasetMemory| {
            let b = Claim::new(memory);
            tokio::spawn(async move { b.wait_in_line().await })
        };
        let (b, c) = (line(&memory), line(&memory));
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(
            !b.is_finished() && !c.is_finished(),
            "the line did not wait for the turn"
        );
        a.end_read();
        tokio::time::timeout(Duration::from_secs(1), async {
            b.await.unwrap();
            c.await.unwrap();
        })
        .await
        .expect("the line did not move on");
        let mut d = Claim::new(&memory);
        assert!(!d.others_waiting());
        d.watch(gone);
        tokio::time::timeout(Duration::from_secs(1), d.take_turn())
            .await
            .expect("a job through the line kept the turn");
    }
}
