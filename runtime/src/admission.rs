//! VRAM admission: a card takes a task only when it has the memory for it.
//!
//! sdk-core asks a lane's slot supplier for a permit before every poll. Each card has one
//! [`CardBudget`], shared by all its lanes (the shared `gpu-tools` queue and the card's
//! private queue), and each lane a [`LaneSlots`] supplier drawing on it. A permit is
//! granted only while
//!
//! ```text
//! free (live, NVML or simulation file) - unseen resident weights
//!     - bytes promised to outstanding permits - headroom  >=  cost of one task
//! ```
//!
//! and fewer than `cap` permits are out. Without a permit the lane does not poll, so the
//! task waits in Temporal (visible as backlog) where another card or host can take it.
//! The activity type is unknown when core reserves, so a lane reserves its costliest
//! activity; `mark_slot_used` corrects to the actual activity's cost and `release_slot`
//! returns it, including permits whose poll came back empty. A CUDA out-of-memory raises
//! the activity's estimate; a failed memory reading stops admission until one succeeds.

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use temporalio_sdk_core::{
    ActivitySlotKind, SlotMarkUsedContext, SlotReleaseContext, SlotReservationContext,
    SlotSupplier, SlotSupplierPermit,
};
use tokio::sync::Notify;

use crate::{
    devices::{DeviceError, DeviceInventory},
    metrics::Metrics,
};

/// How a card's budget is set.
#[derive(Debug, Clone)]
pub(crate) struct BudgetOptions {
    /// Bytes never promised to tasks, left for other tenants and allocator slack.
    pub headroom: u64,
    /// Most permits out at once over the card's lanes.
    pub cap: usize,
    /// Memory the inventory cannot see: the resident weights of models on a simulated
    /// card (a real card's NVML reading already includes them once they are loaded).
    pub unseen_resident: u64,
    /// Per-task working memory by activity type.
    pub estimates: HashMap<String, u64>,
}

#[derive(Debug)]
struct State {
    /// The last memory reading: free bytes, or why it failed (then nothing is admitted).
    free: Result<u64, String>,
    reserved: u64,
    outstanding: usize,
    estimates: HashMap<String, u64>,
    /// Per active lane supplier (one per lane worker), the permits it holds for polls
    /// still waiting for a task. A stopped lane's supplier is removed, so it is not waited
    /// for, and its late releases do not touch its successor's count.
    idle: HashMap<u64, usize>,
    /// Lanes announced but whose supplier does not exist yet (start-up): they count as
    /// lanes without a poll, so the first lane to start does not take every permit.
    expected: std::collections::HashSet<String>,
    next_supplier: u64,
}

/// A card's budget at one moment.
#[derive(Debug, Clone)]
pub(crate) struct BudgetSnapshot {
    pub total: u64,
    pub free: Result<u64, String>,
    pub reserved: u64,
    pub headroom: u64,
    pub unseen_resident: u64,
    pub permits_out: usize,
    pub cap: usize,
    pub estimates: std::collections::BTreeMap<String, u64>,
}

/// Why a reservation could not be granted now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Blocked {
    Memory,
    Cap,
    NoReading,
}

/// One card's admission budget, shared by the card's lanes.
pub(crate) struct CardBudget {
    uuid: String,
    total: u64,
    opts: BudgetOptions,
    state: Mutex<State>,
    changed: Notify,
    metrics: Arc<Metrics>,
}

impl CardBudget {
    /// A budget for card `uuid` of `total` bytes. Nothing is admitted until the first
    /// memory reading ([`CardBudget::set_reading`]).
    pub(crate) fn new(
        uuid: &str,
        total: u64,
        opts: BudgetOptions,
        metrics: Arc<Metrics>,
    ) -> Arc<Self> {
        let estimates = opts.estimates.clone();
        Arc::new(Self {
            uuid: uuid.to_owned(),
            total,
            opts,
            state: Mutex::new(State {
                free: Err("no memory reading yet".to_owned()),
                reserved: 0,
                outstanding: 0,
                estimates,
                idle: HashMap::new(),
                expected: Default::default(),
                next_supplier: 0,
            }),
            changed: Notify::new(),
            metrics,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .expect("card budget lock poisoned; this is a bug")
    }

    fn publish(&self, s: &State) {
        self.metrics.gpu_memory(
            &self.uuid,
            self.total,
            s.free.as_ref().ok().copied(),
            s.reserved,
        );
    }

    /// Records a memory reading. A failure stops admission (and says so once); the next
    /// good reading resumes it.
    pub(crate) fn set_reading(&self, reading: Result<u64, DeviceError>) {
        let mut s = self.lock();
        match (&s.free, &reading) {
            (Ok(_), Err(e)) => tracing::warn!(gpu_uuid = %self.uuid, error = %e,
                "cannot read card memory: admitting nothing on this card until a reading succeeds"),
            (Err(was), Ok(free)) => tracing::info!(gpu_uuid = %self.uuid, free, previous = %was,
                "card memory readable: admission resumes"),
            _ => {}
        }
        s.free = reading.map_err(|e| e.to_string());
        self.publish(&s);
        drop(s);
        self.changed.notify_waiters();
    }

    /// The current per-task estimate of `activity_type` (0 for types with none).
    pub(crate) fn estimate(&self, activity_type: &str) -> u64 {
        self.lock()
            .estimates
            .get(activity_type)
            .copied()
            .unwrap_or(0)
    }

    /// A task of `activity_type` ran out of memory: raise its estimate by half (at most to
    /// what the card can give), so fewer run at once from now on.
    pub(crate) fn record_oom(&self, activity_type: &str) {
        let mut s = self.lock();
        let ceiling = self.total.saturating_sub(self.opts.headroom).max(1);
        let est = s.estimates.entry(activity_type.to_owned()).or_insert(0);
        let raised = (*est + *est / 2).max(*est + (64 << 20)).min(ceiling);
        tracing::warn!(gpu_uuid = %self.uuid, activity_type, from = *est, to = raised,
            "out of memory on the card: raising the per-task estimate");
        *est = raised;
        drop(s);
        self.metrics.out_of_memory(&self.uuid, activity_type);
    }

    /// Bytes a new permit may still take, from a reading of `free` bytes.
    fn available(&self, s: &State, free: u64) -> u64 {
        free.saturating_sub(self.opts.unseen_resident)
            .saturating_sub(s.reserved)
            .saturating_sub(self.opts.headroom)
    }

    /// How many more tasks of `activity_type` the card would admit now, one after the
    /// other, from the last reading: what `gpulane admission` prints. Reserves nothing.
    pub(crate) fn would_admit(&self, activity_type: &str) -> Result<usize, String> {
        let s = self.lock();
        let free = *s.free.as_ref().map_err(Clone::clone)?;
        let slots = self.opts.cap.saturating_sub(s.outstanding);
        let cost = s.estimates.get(activity_type).copied().unwrap_or(0);
        let by_memory = match self.available(&s, free).checked_div(cost) {
            Some(n) => usize::try_from(n).unwrap_or(usize::MAX),
            None => usize::MAX,
        };
        Ok(slots.min(by_memory))
    }

    /// Announces a lane that is about to start: until it polls, no other lane of the
    /// card takes a second idle permit (see [`CardBudget::try_admit`]).
    pub(crate) fn expect_lane(&self, queue: &str) {
        self.lock().expected.insert(queue.to_owned());
    }

    /// A lane's supplier stopped (its lane drains, or its worker did not start): its
    /// lane is no longer waited for.
    pub(crate) fn supplier_stopped(&self, supplier: u64) {
        let mut s = self.lock();
        s.idle.remove(&supplier);
        drop(s);
        self.changed.notify_waiters();
    }

    /// Grants a permit of `cost` bytes to `lane`'s next poll. Besides memory and the cap,
    /// lanes take turns: a lane that already has a poll waiting gets another only if
    /// room remains for one poll of every other active lane that has none. Otherwise
    /// one lane's idle polls could hold every permit of a card that can take only a few
    /// tasks, and the other lane (a pinned follow-up's private queue, or the shared one)
    /// would wait a whole long poll, a minute, with the card idle.
    fn try_admit(&self, supplier: u64, cost: u64) -> Result<(), Blocked> {
        let mut s = self.lock();
        let free = *s.free.as_ref().map_err(|_| Blocked::NoReading)?;
        let mine = s.idle.get(&supplier).copied().unwrap_or(0);
        let starving = if mine == 0 {
            0
        } else {
            s.expected.len()
                + s.idle
                    .iter()
                    .filter(|(id, n)| **id != supplier && **n == 0)
                    .count()
        };
        if s.outstanding + 1 + starving > self.opts.cap {
            return Err(Blocked::Cap);
        }
        let available = self.available(&s, free);
        if available < cost.saturating_mul(1 + starving as u64) {
            return Err(Blocked::Memory);
        }
        s.reserved += cost;
        s.outstanding += 1;
        if let Some(n) = s.idle.get_mut(&supplier) {
            *n += 1;
        }
        self.publish(&s);
        Ok(())
    }

    /// An idle permit of `supplier` received a task, or ended without one. Wakes the
    /// waiting lanes: the turn rule may now let one of them poll.
    fn poll_ended(&self, supplier: u64) {
        let mut s = self.lock();
        if let Some(n) = s.idle.get_mut(&supplier) {
            *n = n.saturating_sub(1);
        }
        drop(s);
        self.changed.notify_waiters();
    }

    fn adjust(&self, from: u64, to: u64) {
        let mut s = self.lock();
        s.reserved = s.reserved.saturating_sub(from) + to;
        self.publish(&s);
        drop(s);
        if to < from {
            self.changed.notify_waiters();
        }
    }

    fn release(&self, bytes: u64) {
        let mut s = self.lock();
        s.reserved = s.reserved.saturating_sub(bytes);
        s.outstanding = s.outstanding.saturating_sub(1);
        self.publish(&s);
        drop(s);
        self.changed.notify_waiters();
    }

    /// Bytes promised to outstanding permits.
    #[cfg(test)]
    pub(crate) fn reserved(&self) -> u64 {
        self.lock().reserved
    }

    /// Permits out.
    #[cfg(test)]
    pub(crate) fn outstanding(&self) -> usize {
        self.lock().outstanding
    }

    /// Idle polls of a supplier.
    #[cfg(test)]
    pub(crate) fn idle(&self, supplier: u64) -> usize {
        self.lock().idle.get(&supplier).copied().unwrap_or(0)
    }

    /// The card's UUID.
    pub(crate) fn uuid(&self) -> &str {
        &self.uuid
    }

    /// Why the last memory reading failed, if it did.
    pub(crate) fn reading_error(&self) -> Option<String> {
        self.lock().free.as_ref().err().cloned()
    }

    /// The budget as it stands, for `gpulane status`.
    pub(crate) fn snapshot(&self) -> BudgetSnapshot {
        let s = self.lock();
        BudgetSnapshot {
            total: self.total,
            free: s.free.clone(),
            reserved: s.reserved,
            headroom: self.opts.headroom,
            unseen_resident: self.opts.unseen_resident,
            permits_out: s.outstanding,
            cap: self.opts.cap,
            estimates: s.estimates.iter().map(|(k, v)| (k.clone(), *v)).collect(),
        }
    }

    /// A slot supplier for one lane of this card, serving `activity_types`.
    /// A lane's supplier is active from here until [`CardBudget::supplier_stopped`].
    pub(crate) fn lane(self: &Arc<Self>, queue: &str, activity_types: &[&str]) -> LaneSlots {
        let mut s = self.lock();
        let id = s.next_supplier;
        s.next_supplier += 1;
        s.idle.insert(id, 0);
        s.expected.remove(queue);
        drop(s);
        LaneSlots {
            budget: self.clone(),
            id,
            queue: queue.to_owned(),
            activity_types: activity_types.iter().map(|s| (*s).to_owned()).collect(),
        }
    }
}

/// Keeps every card's memory reading fresh: reads the inventory every `every` and feeds
/// the budgets, which wakes lanes waiting for memory. Never returns; a panic in a reading
/// ends it, which the supervisor sees.
pub(crate) async fn refresh(
    budgets: Arc<Mutex<Vec<Arc<CardBudget>>>>,
    inventory: Arc<dyn DeviceInventory>,
    every: Duration,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        // Cards that recover after start join the list; read the list each round.
        let now: Vec<Arc<CardBudget>> = budgets
            .lock()
            .expect("card list lock poisoned; this is a bug")
            .clone();
        for b in &now {
            // NVML calls are quick but blocking; a simulation file read is too.
            let inv = inventory.clone();
            let uuid = b.uuid.clone();
            let reading = tokio::task::spawn_blocking(move || inv.free_memory(&uuid))
                .await
                .expect("memory reading task panicked; this is a bug");
            b.set_reading(reading);
        }
    }
}

/// What a permit holds, kept in the permit so release returns exactly that: its bytes,
/// and whether it is still an idle poll's (no task yet).
struct Held {
    bytes: AtomicU64,
    idle: std::sync::atomic::AtomicBool,
}

/// One lane's slot supplier, drawing on its card's [`CardBudget`].
pub(crate) struct LaneSlots {
    budget: Arc<CardBudget>,
    /// This supplier's key in the budget's turn-taking.
    id: u64,
    queue: String,
    activity_types: Vec<String>,
}

impl LaneSlots {
    /// This supplier's key, for [`CardBudget::supplier_stopped`].
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// What one reservation costs now: the lane's costliest activity.
    fn reservation_cost(&self) -> u64 {
        self.activity_types
            .iter()
            .map(|a| self.budget.estimate(a))
            .max()
            .unwrap_or(0)
    }

    fn grant(&self, cost: u64) -> SlotSupplierPermit {
        self.budget
            .metrics
            .permit_issued(&self.budget.uuid, &self.queue);
        SlotSupplierPermit::with_user_data(Held {
            bytes: AtomicU64::new(cost),
            idle: std::sync::atomic::AtomicBool::new(true),
        })
    }
}

#[async_trait::async_trait]
impl SlotSupplier for LaneSlots {
    type SlotKind = ActivitySlotKind;

    async fn reserve_slot(&self, _ctx: &dyn SlotReservationContext) -> SlotSupplierPermit {
        let mut waiting_since: Option<Instant> = None;
        loop {
            // Register for wake-ups before checking, so a release between the check and
            // the wait is not missed.
            let notified = self.budget.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let cost = self.reservation_cost();
            match self.budget.try_admit(self.id, cost) {
                Ok(()) => {
                    if let Some(t) = waiting_since {
                        self.budget.metrics.memory_wait(
                            &self.budget.uuid,
                            &self.queue,
                            t.elapsed().as_secs_f64(),
                        );
                    }
                    return self.grant(cost);
                }
                Err(Blocked::Memory) if waiting_since.is_none() => {
                    tracing::debug!(gpu_uuid = %self.budget.uuid, task_queue = %self.queue, cost,
                        "waiting for card memory before polling");
                    waiting_since = Some(Instant::now());
                }
                Err(_) => {}
            }
            notified.await;
        }
    }

    fn try_reserve_slot(&self, _ctx: &dyn SlotReservationContext) -> Option<SlotSupplierPermit> {
        let cost = self.reservation_cost();
        self.budget
            .try_admit(self.id, cost)
            .ok()
            .map(|()| self.grant(cost))
    }

    fn mark_slot_used(&self, ctx: &dyn SlotMarkUsedContext<SlotKind = Self::SlotKind>) {
        let activity = &ctx.info().activity_type;
        self.budget
            .metrics
            .permit_used(&self.budget.uuid, &self.queue, activity);
        if let Some(held) = ctx.permit().user_data::<Held>() {
            if held.idle.swap(false, Ordering::Relaxed) {
                self.budget.poll_ended(self.id);
            }
            let actual = self.budget.estimate(activity);
            let before = held.bytes.swap(actual, Ordering::Relaxed);
            self.budget.adjust(before, actual);
        }
    }

    fn release_slot(&self, ctx: &dyn SlotReleaseContext<SlotKind = Self::SlotKind>) {
        let held = ctx.permit().user_data::<Held>();
        if held.is_some_and(|h| h.idle.swap(false, Ordering::Relaxed)) {
            self.budget.poll_ended(self.id);
        }
        self.budget
            .release(held.map_or(0, |h| h.bytes.load(Ordering::Relaxed)));
    }

    fn slot_supplier_kind(&self) -> String {
        format!("gpulane-vram({})", self.budget.uuid)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use temporalio_common::{protos::coresdk::ActivitySlotInfo, worker::WorkerDeploymentVersion};

    const GIB: u64 = 1 << 30;

    struct Reserve;
    impl SlotReservationContext for Reserve {
        fn task_queue(&self) -> &str {
            "q"
        }
        fn worker_identity(&self) -> &str {
            "test"
        }
        fn worker_deployment_version(&self) -> &Option<WorkerDeploymentVersion> {
            &None
        }
        fn num_issued_slots(&self) -> usize {
            0
        }
        fn is_sticky(&self) -> bool {
            false
        }
    }

    struct Used(SlotSupplierPermit, ActivitySlotInfo);
    impl SlotMarkUsedContext for Used {
        type SlotKind = ActivitySlotKind;
        fn permit(&self) -> &SlotSupplierPermit {
            &self.0
        }
        fn info(&self) -> &ActivitySlotInfo {
            &self.1
        }
    }

    struct Release(SlotSupplierPermit, Option<ActivitySlotInfo>);
    impl SlotReleaseContext for Release {
        type SlotKind = ActivitySlotKind;
        fn permit(&self) -> &SlotSupplierPermit {
            &self.0
        }
        fn info(&self) -> Option<&ActivitySlotInfo> {
            self.1.as_ref()
        }
    }

    fn budget(cap: usize, headroom: u64) -> Arc<CardBudget> {
        let estimates =
            HashMap::from([("embed".to_owned(), 2 * GIB), ("cheap".to_owned(), GIB / 2)]);
        CardBudget::new(
            "GPU-T",
            8 * GIB,
            BudgetOptions {
                headroom,
                cap,
                unseen_resident: 0,
                estimates,
            },
            Arc::default(),
        )
    }

    async fn reserve_within(lane: &LaneSlots, d: Duration) -> Option<SlotSupplierPermit> {
        tokio::time::timeout(d, lane.reserve_slot(&Reserve))
            .await
            .ok()
    }

    #[tokio::test(start_paused = true)]
    async fn no_permit_below_one_task_then_permits_flow_when_memory_frees() {
        let b = budget(8, 0);
        let lane = b.lane("gpu-tools", &["embed"]);
        b.set_reading(Ok(GIB)); // one task needs 2 GiB
        assert!(lane.try_reserve_slot(&Reserve).is_none());
        assert!(reserve_within(&lane, Duration::from_secs(60))
            .await
            .is_none());

        let waiter = {
            let b = b.clone();
            tokio::spawn(
                async move { b.lane("gpu-tools", &["embed"]).reserve_slot(&Reserve).await },
            )
        };
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        b.set_reading(Ok(5 * GIB)); // room for two
        let _p1 = tokio::time::timeout(Duration::from_secs(1), waiter)
            .await
            .expect("the waiting lane is woken by the new reading")
            .unwrap();
        let _p2 = lane.try_reserve_slot(&Reserve).expect("second task fits");
        assert!(
            lane.try_reserve_slot(&Reserve).is_none(),
            "a third would over-commit"
        );
        assert_eq!(b.reserved(), 4 * GIB);
    }

    #[test]
    fn would_admit_counts_what_reservations_would_grant() {
        let b = budget(100, GIB);
        assert!(b.would_admit("embed").is_err(), "no reading yet");
        b.set_reading(Ok(7 * GIB)); // 6 GiB usable: three 2 GiB tasks
        assert_eq!(b.would_admit("embed"), Ok(3));
        let lane = b.lane("gpu-tools", &["embed"]);
        let _p = lane.try_reserve_slot(&Reserve).unwrap();
        assert_eq!(b.would_admit("embed"), Ok(2));
        b.set_reading(Ok(GIB)); // another tenant took the card
        assert_eq!(b.would_admit("embed"), Ok(0));
        assert_eq!(
            budget(2, 0).would_admit("cheap"),
            Err("no memory reading yet".into())
        );
        let capped = budget(2, 0);
        capped.set_reading(Ok(8 * GIB));
        assert_eq!(capped.would_admit("cheap"), Ok(2), "the cap binds first");
    }

    #[tokio::test(start_paused = true)]
    async fn two_lanes_of_one_card_never_over_commit_together() {
        let b = budget(100, GIB);
        b.set_reading(Ok(7 * GIB)); // 6 GiB usable after headroom: three 2 GiB tasks
        let shared = b.lane("gpu-tools", &["embed"]);
        let private = b.lane("gpu-tools.h.gpu-t", &["embed"]);
        let mut held = Vec::new();
        for i in 0..10 {
            let lane = if i % 2 == 0 { &shared } else { &private };
            if let Some(p) = lane.try_reserve_slot(&Reserve) {
                held.push(p);
            }
        }
        assert_eq!(held.len(), 3);
        assert!(reserve_within(&private, Duration::from_secs(5))
            .await
            .is_none());
        assert!(b.reserved() <= 6 * GIB);
    }

    #[tokio::test(start_paused = true)]
    async fn release_without_a_task_frees_the_reservation() {
        let b = budget(8, 0);
        b.set_reading(Ok(2 * GIB));
        let lane = b.lane("gpu-tools", &["embed"]);
        let p = lane.try_reserve_slot(&Reserve).unwrap();
        assert!(lane.try_reserve_slot(&Reserve).is_none());
        lane.release_slot(&Release(p, None)); // the poll came back empty
        assert_eq!(b.reserved(), 0);
        assert!(lane.try_reserve_slot(&Reserve).is_some());
    }

    #[tokio::test(start_paused = true)]
    async fn mark_used_corrects_to_the_actual_activity() {
        let b = budget(8, 0);
        b.set_reading(Ok(3 * GIB));
        let lane = b.lane("gpu-tools", &["embed", "cheap"]);
        let p = lane.try_reserve_slot(&Reserve).unwrap();
        assert_eq!(b.reserved(), 2 * GIB, "reserves the costliest activity");
        let info = ActivitySlotInfo {
            activity_type: "cheap".to_owned(),
        };
        let used = Used(p, info.clone());
        lane.mark_slot_used(&used);
        assert_eq!(b.reserved(), GIB / 2);
        lane.release_slot(&Release(used.0, Some(info)));
        assert_eq!(b.reserved(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn out_of_memory_raises_the_estimate() {
        let b = budget(8, 0);
        b.set_reading(Ok(5 * GIB));
        let lane = b.lane("gpu-tools", &["embed"]);
        b.record_oom("embed");
        assert_eq!(b.estimate("embed"), 3 * GIB);
        let _a = lane.try_reserve_slot(&Reserve).unwrap();
        assert!(
            lane.try_reserve_slot(&Reserve).is_none(),
            "two 3 GiB tasks do not fit in 5 GiB"
        );
        for _ in 0..10 {
            b.record_oom("embed");
        }
        assert_eq!(b.estimate("embed"), 8 * GIB, "never above the card");
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_reading_stops_admission_until_one_succeeds() {
        let b = budget(8, 0);
        let lane = b.lane("gpu-tools", &["embed"]);
        b.set_reading(Ok(8 * GIB));
        assert!(lane.try_reserve_slot(&Reserve).is_some());
        b.set_reading(Err(DeviceError::UnknownDevice("GPU-T".into())));
        assert!(lane.try_reserve_slot(&Reserve).is_none());
        assert!(reserve_within(&lane, Duration::from_secs(30))
            .await
            .is_none());
        b.set_reading(Ok(8 * GIB));
        assert!(lane.try_reserve_slot(&Reserve).is_some());
    }

    fn used(lane: &LaneSlots, p: SlotSupplierPermit) -> Used {
        let u = Used(
            p,
            ActivitySlotInfo {
                activity_type: "embed".to_owned(),
            },
        );
        lane.mark_slot_used(&u);
        u
    }

    /// Regression: one lane's idle polls held every permit of a card with a small cap,
    /// so the other lane (a pinned call's private queue) waited a whole long poll.
    #[tokio::test(start_paused = true)]
    async fn idle_polls_of_one_lane_never_starve_the_other_lane_of_the_card() {
        let b = budget(2, 0);
        b.set_reading(Ok(8 * GIB));
        b.expect_lane("gpu-tools");
        b.expect_lane("private");
        let shared = b.lane("gpu-tools", &["cheap"]);
        // The shared lane starts first; its second poller must leave room for the
        // private lane's first, though that lane's worker does not exist yet.
        let s1 = shared.try_reserve_slot(&Reserve).expect("first poll");
        assert!(
            shared.try_reserve_slot(&Reserve).is_none(),
            "would starve the private lane"
        );
        let private = b.lane("private", &["cheap"]);
        assert!(
            shared.try_reserve_slot(&Reserve).is_none(),
            "would starve the private lane"
        );
        let p1 = private
            .try_reserve_slot(&Reserve)
            .expect("the private lane polls");
        assert!(
            private.try_reserve_slot(&Reserve).is_none(),
            "the cap binds"
        );
        // A task arrives on the shared lane and ends: its permit goes back to a shared
        // poll, not to the private lane's second poller.
        let task = used(&shared, s1);
        shared.release_slot(&Release(task.0, Some(task.1)));
        assert!(
            private.try_reserve_slot(&Reserve).is_none(),
            "the shared lane has no poll"
        );
        let s2 = shared
            .try_reserve_slot(&Reserve)
            .expect("the shared lane polls again");
        // An empty poll's permit returns too.
        private.release_slot(&Release(p1, None));
        let p2 = private
            .try_reserve_slot(&Reserve)
            .expect("the private lane polls again");
        assert_eq!(b.outstanding(), 2);
        // A drained lane is not waited for: once its poll ends, the shared lane may take
        // both permits.
        b.supplier_stopped(private.id());
        private.release_slot(&Release(p2, None));
        let s3 = shared
            .try_reserve_slot(&Reserve)
            .expect("no active lane is left without a poll");
        assert!(shared.try_reserve_slot(&Reserve).is_none(), "the cap binds");
        // Regression: a resumed lane's new supplier keeps its own count; the old one's
        // late releases do not change it.
        let old = b.lane("private", &["cheap"]);
        shared.release_slot(&Release(s3, None));
        let late = old
            .try_reserve_slot(&Reserve)
            .expect("the old worker's poll");
        b.supplier_stopped(old.id());
        let resumed = b.lane("private", &["cheap"]);
        shared.release_slot(&Release(s2, None));
        let r1 = resumed
            .try_reserve_slot(&Reserve)
            .expect("the resumed lane polls");
        assert_eq!(b.idle(resumed.id()), 1);
        old.release_slot(&Release(late, None));
        assert_eq!(
            b.idle(resumed.id()),
            1,
            "the old poll's end is not the new one's"
        );
        resumed.release_slot(&Release(r1, None));
        assert_eq!(b.idle(resumed.id()), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn the_cap_bounds_tasks_even_with_memory_to_spare() {
        let b = budget(2, 0);
        b.set_reading(Ok(80 * GIB));
        let lane = b.lane("gpu-tools", &["cheap"]);
        let _a = lane.try_reserve_slot(&Reserve).unwrap();
        let _b = lane.try_reserve_slot(&Reserve).unwrap();
        assert!(lane.try_reserve_slot(&Reserve).is_none());
    }
}
