//! The host memory every `embed_dataset` activity of the worker holds of its sources,
//! together, against `--max-dataset-bytes`. Each device's activities read into the same
//! host memory, so the bound is one for the worker, not one per activity: several shards
//! sent to one host at once would otherwise each take the limit.
//!
//! A reader counts what it holds as it reads, against the limit alone, and claims it
//! from this memory where it knows the sum (`Held::reserve`), without waiting: a reader
//! on the blocking pool that waited while holding part of its source could deadlock with
//! another doing the same. When the memory is taken, the job gives back all it holds,
//! waits (first come, first served: the first waiter gathers what is given back) until
//! the sum it asked for is free, and reads again holding that much from the start, so a
//! job reads its source again once per wait, not once per claim (a second wait comes only
//! where a Parquet footer understated what the values take, claimed at the end). Only jobs that have finished
//! reading hold memory without waiting for more, and they end, so every waiter gets its
//! turn. A job alone over the limit is refused (`Held`). What a reader holds before it
//! claims (a JSON Lines or CSV job's ids in its first pass, a Parquet footer) is bounded
//! by the limit alone.

use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The worker's memory for datasets, shared by every device's activities.
#[derive(Clone)]
pub struct DatasetMemory {
    bytes: u64,
    /// `bytes` in KiB, as the semaphore was made with.
    permits: usize,
    /// One permit a KiB: tokio counts permits in `u32` per claim and `usize` in all.
    kib: Arc<Semaphore>,
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
    permit: Option<OwnedSemaphorePermit>,
    /// KiB held.
    kib: u32,
    /// Bytes the job had reached when the memory was taken, if it was.
    short: Option<u64>,
}

impl Claim {
    pub(crate) fn new(memory: &DatasetMemory) -> Self {
        Self {
            memory: memory.clone(),
            permit: None,
            kib: 0,
            short: None,
        }
    }

    /// The most one job may hold: all of the worker's dataset memory.
    pub(super) fn limit(&self) -> u64 {
        self.memory.bytes
    }

    /// Holds enough for `bytes` in all, without waiting. False when other jobs hold too
    /// much: the caller stops reading, and [`Claim::wait`] waits for `bytes`.
    pub(super) fn cover(&mut self, bytes: u64) -> bool {
        let want = kib(bytes);
        if want <= self.kib {
            return true;
        }
        match self
            .memory
            .kib
            .clone()
            .try_acquire_many_owned(want - self.kib)
        {
            Ok(more) => {
                match &mut self.permit {
                    Some(p) => p.merge(more),
                    None => self.permit = Some(more),
                }
                self.kib = want;
                true
            }
            Err(_) => {
                self.short = Some(bytes);
                false
            }
        }
    }

    /// The bytes a read stopped at for want of memory, if it did.
    pub(crate) fn short(&mut self) -> Option<u64> {
        self.short.take()
    }

    /// Gives back all it holds, then waits in turn until `bytes` are free and holds them.
    pub(crate) async fn wait(&mut self, bytes: u64) {
        self.permit = None;
        self.kib = 0;
        let want = kib(bytes);
        let permit = self
            .memory
            .kib
            .clone()
            .acquire_many_owned(want)
            .await
            .expect("the dataset memory's semaphore is never closed");
        self.permit = Some(permit);
        self.kib = want;
    }
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
        drop(b);
        assert_eq!(memory.held(), 0);
    }

    /// A waiting job gives back what it held before it waits, so two jobs each short of
    /// memory never wait on each other: one gets what the other gave back.
    #[tokio::test]
    async fn two_short_jobs_do_not_wait_on_each_other() {
        let memory = DatasetMemory::new(10 * 1024);
        let (mut a, mut b) = (Claim::new(&memory), Claim::new(&memory));
        assert!(a.cover(5 * 1024));
        assert!(b.cover(5 * 1024));
        assert!(!a.cover(8 * 1024));
        assert!(!b.cover(8 * 1024));
        let wait = |mut c: Claim| {
            tokio::spawn(async move {
                c.wait(8 * 1024).await;
                c
            })
        };
        let (first, second) = (wait(a), wait(b));
        let (done, other) = match futures::future::select(first, second).await {
            futures::future::Either::Left((done, other))
            | futures::future::Either::Right((done, other)) => (done.unwrap(), other),
        };
        assert_eq!(done.kib, 8);
        assert!(!other.is_finished());
        drop(done);
        let other = other.await.unwrap();
        assert_eq!(other.kib, 8);
        drop(other);
        assert_eq!(memory.held(), 0);
    }
}
