//! The CPU lanes' slots: one fixed pool of `--max-concurrent-cpu` tasks shared by the
//! host's CPU lanes (a CPU inference worker keeps the CPU busy by design, so core's
//! resource-based tuner starved the engine of the concurrent activities it batches), and
//! a poll gate per lane for its stop.

use std::sync::{
    atomic::{AtomicBool, Ordering},
    Arc, Mutex,
};

use temporalio_sdk_core::{
    ActivitySlotKind, SlotMarkUsedContext, SlotReleaseContext, SlotReservationContext,
    SlotSupplier, SlotSupplierPermit,
};
use tokio::sync::Notify;

use super::slots::PollGate;

/// The host's CPU task pool.
pub(crate) struct CpuPool {
    cap: usize,
    taken: Mutex<usize>,
    changed: Notify,
}

impl CpuPool {
    pub(crate) fn new(cap: usize) -> Arc<Self> {
        Arc::new(Self {
            cap,
            taken: Mutex::new(0),
            changed: Notify::new(),
        })
    }

    fn try_take(&self) -> bool {
        let mut t = self
            .taken
            .lock()
            .expect("cpu pool lock poisoned; this is a bug");
        if *t < self.cap {
            *t += 1;
            true
        } else {
            false
        }
    }

    fn give(&self) {
        let mut t = self
            .taken
            .lock()
            .expect("cpu pool lock poisoned; this is a bug");
        *t = t.saturating_sub(1);
        drop(t);
        self.changed.notify_waiters();
    }

    /// A supplier for one CPU lane.
    pub(crate) fn lane(self: &Arc<Self>) -> CpuSlots {
        CpuSlots {
            pool: self.clone(),
            gate: Arc::default(),
        }
    }
}

/// Whether a permit is still an open poll.
struct Open(AtomicBool);

/// One CPU lane's slot supplier.
pub(crate) struct CpuSlots {
    pool: Arc<CpuPool>,
    gate: Arc<PollGate>,
}

impl CpuSlots {
    /// The lane's poll gate, for its stop.
    pub(crate) fn gate(&self) -> Arc<PollGate> {
        self.gate.clone()
    }

    fn try_open(&self) -> Option<SlotSupplierPermit> {
        if !self.gate.try_open() {
            return None;
        }
        if !self.pool.try_take() {
            self.gate.ended(false);
            return None;
        }
        Some(SlotSupplierPermit::with_user_data(Open(AtomicBool::new(
            true,
        ))))
    }
}

#[async_trait::async_trait]
impl SlotSupplier for CpuSlots {
    type SlotKind = ActivitySlotKind;

    async fn reserve_slot(&self, _ctx: &dyn SlotReservationContext) -> SlotSupplierPermit {
        loop {
            self.gate.wait_open().await;
            let notified = self.pool.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(p) = self.try_open() {
                return p;
            }
            notified.await;
        }
    }

    fn try_reserve_slot(&self, _ctx: &dyn SlotReservationContext) -> Option<SlotSupplierPermit> {
        self.try_open()
    }

    fn mark_slot_used(&self, ctx: &dyn SlotMarkUsedContext<SlotKind = Self::SlotKind>) {
        if let Some(open) = ctx.permit().user_data::<Open>() {
            if open.0.swap(false, Ordering::AcqRel) {
                self.gate.ended(true);
            }
        }
    }

    fn release_slot(&self, ctx: &dyn SlotReleaseContext<SlotKind = Self::SlotKind>) {
        if let Some(open) = ctx.permit().user_data::<Open>() {
            if open.0.swap(false, Ordering::AcqRel) {
                self.gate.ended(false);
            }
        }
        self.pool.give();
    }

    fn available_slots(&self) -> Option<usize> {
        let taken = *self
            .pool
            .taken
            .lock()
            .expect("cpu pool lock poisoned; this is a bug");
        Some(self.pool.cap.saturating_sub(taken))
    }

    fn slot_supplier_kind(&self) -> String {
        "gpulane-cpu-pool".to_owned()
    }
}
