//! A lane's slot supplier: opens polls on its device's [`MemoryBudget`] (a card's, or the
//! host's for the CPU lanes) and charges the task that arrives; and the gate that lets a stopping lane's open polls finish.

use std::{
    sync::{
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use temporalio_sdk_core::{
    ActivitySlotKind, SlotMarkUsedContext, SlotReleaseContext, SlotReservationContext,
    SlotSupplier, SlotSupplierPermit,
};
use tokio::sync::Notify;

use super::{BudgetOf, MemoryBudget};

/// Counts a lane's open polls (permits core took and has neither used nor released) and
/// can close the lane to new polls. sdk-core 0.10.1 throws away a long poll that is still
/// open when the worker shuts down, even one the server has just answered with a task,
/// which is then lost until its timeout (see below). A stopping lane
/// closes its gate, lets its open polls come back (a task arriving on one runs), and only
/// then shuts its worker down (ARCHITECTURE.md, "The shutdown sequence").
#[derive(Default)]
pub(crate) struct PollGate {
    closed: AtomicBool,
    open: AtomicUsize,
    /// When the last open poll received a task, in ms since `epoch`.
    last_task_ms: AtomicU64,
    /// Tokio's clock, so that tests with paused time see the gate's waits.
    epoch: std::sync::OnceLock<tokio::time::Instant>,
    changed: Notify,
}

impl PollGate {
    fn now_ms(&self) -> u64 {
        self.epoch
            .get_or_init(tokio::time::Instant::now)
            .elapsed()
            .as_millis() as u64
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    /// No new polls from here on.
    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.changed.notify_waiters();
    }

    /// Counts a poll about to open, unless the gate is closed. Counted first and the gate
    /// checked after (both sequentially consistent, as `close` and `settle` are): a stop
    /// that closes the gate in between then sees this poll open and waits for it, rather
    /// than shutting the worker down under it.
    pub(crate) fn try_open(&self) -> bool {
        self.open.fetch_add(1, Ordering::SeqCst);
        if self.is_closed() {
            self.ended(false);
            return false;
        }
        true
    }

    /// An open poll came back, with a task or empty.
    pub(crate) fn ended(&self, with_task: bool) {
        if with_task {
            self.last_task_ms.store(self.now_ms(), Ordering::Relaxed);
        }
        let _ = self
            .open
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
        self.changed.notify_waiters();
    }

    /// Open polls now.
    pub(crate) fn open_polls(&self) -> usize {
        self.open.load(Ordering::SeqCst)
    }

    /// Waits until no poll is open, or until no task has arrived on one for `quiet` (an
    /// idle queue's long polls would otherwise hold the stop for a minute), or `limit`.
    /// Returns the polls still open.
    pub(crate) async fn settle(&self, quiet: Duration, limit: Duration) -> usize {
        let began = self.now_ms();
        let limit_ms = began + limit.as_millis() as u64;
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let open = self.open_polls();
            let now = self.now_ms();
            let last = self.last_task_ms.load(Ordering::Relaxed).max(began);
            if open == 0 || now >= limit_ms || now >= last + quiet.as_millis() as u64 {
                return open;
            }
            let wake = (last + quiet.as_millis() as u64).min(limit_ms) - now;
            let _ = tokio::time::timeout(Duration::from_millis(wake.max(1)), notified).await;
        }
    }

    /// Resolves never once closed; otherwise at once. Core cancels a pending reservation
    /// when the worker shuts down.
    pub(crate) async fn wait_open(&self) {
        if self.is_closed() {
            std::future::pending::<()>().await;
        }
    }
}

/// What a permit holds, so release returns exactly that: whether it is still an open poll
/// (no task yet), and its task's type and waiting-rows cost.
struct Held {
    bytes: AtomicU64,
    idle: AtomicBool,
    activity: std::sync::OnceLock<String>,
}

/// One lane's slot supplier, drawing on its device's [`MemoryBudget`].
pub(crate) struct LaneSlots {
    budget: Arc<MemoryBudget>,
    /// This supplier's key in the budget's turn-taking.
    id: u64,
    queue: String,
    activity_types: Vec<String>,
    /// A model lane's model: only its engine counts for the lane's room.
    model: Option<String>,
    gate: Arc<PollGate>,
}

impl LaneSlots {
    pub(super) fn new(
        budget: Arc<MemoryBudget>,
        id: u64,
        queue: &str,
        activity_types: Vec<String>,
        model: Option<String>,
    ) -> Self {
        Self {
            budget,
            id,
            queue: queue.to_owned(),
            activity_types,
            model,
            gate: Arc::default(),
        }
    }

    /// This supplier's key, for [`MemoryBudget::supplier_stopped`].
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// The lane's poll gate, for its stop.
    pub(crate) fn gate(&self) -> Arc<PollGate> {
        self.gate.clone()
    }

    fn try_open(&self) -> Result<SlotSupplierPermit, super::Blocked> {
        if !self.gate.try_open() {
            return Err(super::Blocked::Cap);
        }
        if let Err(b) = self
            .budget
            .try_poll(self.id, &self.activity_types, self.model.as_deref())
        {
            self.gate.ended(false);
            return Err(b);
        }
        if let BudgetOf::Card(uuid) = &self.budget.of {
            self.budget.metrics.permit_issued(uuid, &self.queue);
        }
        Ok(SlotSupplierPermit::with_user_data(Held {
            bytes: AtomicU64::new(0),
            idle: AtomicBool::new(true),
            activity: std::sync::OnceLock::new(),
        }))
    }
}

#[async_trait::async_trait]
impl SlotSupplier for LaneSlots {
    type SlotKind = ActivitySlotKind;

    async fn reserve_slot(&self, _ctx: &dyn SlotReservationContext) -> SlotSupplierPermit {
        let mut waiting_since: Option<Instant> = None;
        loop {
            self.gate.wait_open().await;
            // Register for wake-ups before checking, so a release between the check and
            // the wait is not missed.
            let notified = self.budget.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            match self.try_open() {
                Ok(permit) => {
                    if let Some(t) = waiting_since {
                        let secs = t.elapsed().as_secs_f64();
                        match &self.budget.of {
                            BudgetOf::Card(uuid) => {
                                self.budget.metrics.memory_wait(uuid, &self.queue, secs);
                            }
                            BudgetOf::Host => {
                                self.budget.metrics.host_memory_wait(&self.queue, secs);
                            }
                        }
                    }
                    return permit;
                }
                Err(super::Blocked::Memory) if waiting_since.is_none() => {
                    tracing::debug!(budget = %self.budget.of, task_queue = %self.queue,
                        "waiting for memory before polling");
                    waiting_since = Some(Instant::now());
                }
                Err(_) => {}
            }
            // Engines finishing their work free working sets without a release; the
            // memory refresh wakes waiters too, this bounds the wait between them.
            let _ = tokio::time::timeout(Duration::from_millis(250), notified).await;
        }
    }

    fn try_reserve_slot(&self, _ctx: &dyn SlotReservationContext) -> Option<SlotSupplierPermit> {
        self.try_open().ok()
    }

    fn mark_slot_used(&self, ctx: &dyn SlotMarkUsedContext<SlotKind = Self::SlotKind>) {
        let activity = &ctx.info().activity_type;
        if let BudgetOf::Card(uuid) = &self.budget.of {
            self.budget.metrics.permit_used(uuid, &self.queue, activity);
        }
        if let Some(held) = ctx.permit().user_data::<Held>() {
            if held.idle.swap(false, Ordering::AcqRel) {
                let bytes = self.budget.waiting_cost(std::slice::from_ref(activity));
                held.bytes.store(bytes, Ordering::Relaxed);
                let _ = held.activity.set(activity.clone());
                self.budget.poll_ended(self.id, Some((activity, bytes)));
                self.gate.ended(true);
            }
        }
    }

    fn release_slot(&self, ctx: &dyn SlotReleaseContext<SlotKind = Self::SlotKind>) {
        let Some(held) = ctx.permit().user_data::<Held>() else {
            return;
        };
        if held.idle.swap(false, Ordering::AcqRel) {
            // The poll came back empty.
            self.budget.poll_ended(self.id, None);
            self.gate.ended(false);
        } else {
            self.budget.task_ended(
                held.activity.get().map_or("", String::as_str),
                held.bytes.load(Ordering::Relaxed),
            );
        }
    }

    fn slot_supplier_kind(&self) -> String {
        match &self.budget.of {
            BudgetOf::Card(uuid) => format!("gpulane-vram({uuid})"),
            BudgetOf::Host => "gpulane-host-memory".to_owned(),
        }
    }
}
