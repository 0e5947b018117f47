//! Activity slot suppliers. Core asks a supplier for a slot before each poll, so a
//! supplier that withholds slots stops the worker from taking tasks; the tasks then wait
//! in Temporal, visible as backlog, for another card or host. One supplier is shared by
//! every lane of a device, so the card's shared and private queues draw from one budget.
//!
//! This supplier caps concurrent tasks per device. VRAM-aware admission plugs in here.

use std::sync::{
    atomic::{AtomicUsize, Ordering},
    Arc,
};

use temporalio_sdk_core::{
    ActivitySlotKind, SlotMarkUsedContext, SlotReleaseContext, SlotReservationContext,
    SlotSupplier, SlotSupplierPermit,
};
use tokio::sync::Semaphore;

/// A per-device cap on tasks in flight, over all the device's lanes.
#[derive(Debug)]
pub(crate) struct DeviceSlots {
    label: String,
    cap: usize,
    free: Semaphore,
    issued: AtomicUsize,
}

impl DeviceSlots {
    /// At most `cap` permits outstanding for the device `label` (a GPU UUID or `cpu`).
    pub(crate) fn new(label: &str, cap: usize) -> Arc<Self> {
        Arc::new(Self {
            label: label.to_owned(),
            cap,
            free: Semaphore::new(cap),
            issued: AtomicUsize::new(0),
        })
    }

    /// Permits outstanding now, used or not.
    pub(crate) fn issued(&self) -> usize {
        self.issued.load(Ordering::Relaxed)
    }

    fn grant(&self) -> SlotSupplierPermit {
        self.issued.fetch_add(1, Ordering::Relaxed);
        SlotSupplierPermit::default()
    }
}

#[async_trait::async_trait]
impl SlotSupplier for DeviceSlots {
    type SlotKind = ActivitySlotKind;

    async fn reserve_slot(&self, _ctx: &dyn SlotReservationContext) -> SlotSupplierPermit {
        // The permit's lifetime is tracked by core's reserve/release calls, not by a guard:
        // `release_slot` puts it back.
        self.free
            .acquire()
            .await
            .expect("the device semaphore is never closed; this is a bug")
            .forget();
        self.grant()
    }

    fn try_reserve_slot(&self, _ctx: &dyn SlotReservationContext) -> Option<SlotSupplierPermit> {
        let permit = self.free.try_acquire().ok()?;
        permit.forget();
        Some(self.grant())
    }

    fn mark_slot_used(&self, ctx: &dyn SlotMarkUsedContext<SlotKind = Self::SlotKind>) {
        tracing::trace!(
            device = %self.label,
            activity_type = %ctx.info().activity_type,
            issued = self.issued(),
            "slot used"
        );
    }

    fn release_slot(&self, _ctx: &dyn SlotReleaseContext<SlotKind = Self::SlotKind>) {
        self.issued.fetch_sub(1, Ordering::Relaxed);
        self.free.add_permits(1);
    }

    fn available_slots(&self) -> Option<usize> {
        Some(self.free.available_permits())
    }

    fn slot_supplier_kind(&self) -> String {
        format!("gpulane-device-cap({}, {})", self.label, self.cap)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use temporalio_common::worker::WorkerDeploymentVersion;

    struct Reserve(&'static str);
    impl SlotReservationContext for Reserve {
        fn task_queue(&self) -> &str {
            self.0
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

    struct Release(SlotSupplierPermit);
    impl SlotReleaseContext for Release {
        type SlotKind = ActivitySlotKind;
        fn permit(&self) -> &SlotSupplierPermit {
            &self.0
        }
        fn info(&self) -> Option<&temporalio_common::protos::coresdk::ActivitySlotInfo> {
            None
        }
    }

    /// The shared and private lanes of one card draw from one budget: together they never
    /// hold more permits than the cap, and a released permit (even one never used for a
    /// task) goes back to whichever lane asks next.
    #[tokio::test(start_paused = true)]
    async fn lanes_of_one_device_share_the_cap() {
        let slots = DeviceSlots::new("GPU-SIM-0", 2);
        let shared = Reserve("gpu-tools");
        let private = Reserve("gpu-tools.h.gpu-sim-0");
        let a = slots.try_reserve_slot(&shared).expect("first permit");
        let _b = slots.reserve_slot(&private).await;
        assert_eq!(slots.issued(), 2);
        assert!(slots.try_reserve_slot(&shared).is_none());
        assert!(slots.try_reserve_slot(&private).is_none());
        assert_eq!(slots.available_slots(), Some(0));

        // A blocked reservation completes once a permit is released.
        let waiter = {
            let slots = slots.clone();
            tokio::spawn(async move { slots.reserve_slot(&Reserve("gpu-tools")).await })
        };
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        slots.release_slot(&Release(a));
        tokio::time::timeout(std::time::Duration::from_secs(1), waiter)
            .await
            .expect("reservation proceeds after a release")
            .unwrap();
        assert_eq!(slots.issued(), 2);
    }
}
