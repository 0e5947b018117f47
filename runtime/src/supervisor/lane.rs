//! Starting and stopping one lane's sdk-core worker. A lane keeps its queue, device and
//! route for the life of the process; its worker is replaced when a drained lane resumes
//! (core cannot restart a worker that has shut down).

use std::{
    panic::AssertUnwindSafe,
    sync::{atomic::AtomicUsize, Arc, Weak},
};

use futures::FutureExt;
use gpulane_activities::Route;
use temporalio_client::Connection;
use temporalio_common::worker::WorkerTaskTypes;
use temporalio_sdk_core::{
    init_worker, CoreRuntime, SlotSupplierOptions, TunerHolderOptions, Worker, WorkerConfig,
    WorkerTuner,
};
use tokio::sync::mpsc::UnboundedSender;

use super::Event;
use crate::{
    admission::CardBudget,
    lanes::LaneKind,
    metrics::Metrics,
    settings::Settings,
    worker::{serve_lane, Lane},
    RuntimeError,
};

/// Where a lane stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum LaneState {
    /// Its worker polls.
    Polling,
    /// Its worker no longer polls; running activities finish.
    Stopping,
    /// No worker.
    Stopped,
    /// Its worker ended on its own, or its device failed.
    Failed(String),
}

impl LaneState {
    pub(super) fn label(&self) -> &'static str {
        match self {
            LaneState::Polling => "polling",
            LaneState::Stopping => "stopping",
            LaneState::Stopped => "stopped",
            LaneState::Failed(_) => "failed",
        }
    }
}

/// One lane of one device.
pub(super) struct LaneRt {
    pub queue: String,
    /// Index of its device in the supervisor's list.
    pub device: usize,
    pub kind: LaneKind,
    pub route: Route,
    pub identity: String,
    pub state: LaneState,
    /// The current worker; weak, so that the lane's task can take it back whole and
    /// finalize it once it has shut down.
    pub worker: Weak<Worker>,
    /// Bumped at each start, so the end of a replaced worker is told from the current
    /// one's.
    pub generation: u64,
    /// Activities running on any of the lane's workers.
    pub running: Arc<AtomicUsize>,
}

/// What a new worker for a lane needs besides the lane.
pub(super) struct WorkerDeps<'a> {
    pub core: &'a CoreRuntime,
    pub connection: &'a Connection,
    pub settings: &'a Settings,
    pub metrics: &'a Arc<Metrics>,
    pub activities: &'a gpulane_activities::DeviceActivities,
    pub budget: Option<&'a Arc<CardBudget>>,
    pub cpu_tuner: &'a Arc<dyn WorkerTuner + Send + Sync>,
    pub events: &'a UnboundedSender<Event>,
}

impl LaneRt {
    /// Creates and validates a worker for the lane, and spawns its task loop; the loop's
    /// end (and the worker's final shutdown) is reported as [`Event::LaneEnded`].
    pub(super) async fn start(
        &mut self,
        index: usize,
        d: WorkerDeps<'_>,
    ) -> Result<(), RuntimeError> {
        let queue = self.queue.clone();
        let worker_error =
            |source: Box<dyn std::error::Error + Send + Sync>| RuntimeError::Worker {
                queue: queue.clone(),
                source,
            };
        let tuner: Arc<dyn WorkerTuner + Send + Sync> = match d.budget {
            Some(b) => Arc::new(
                TunerHolderOptions::builder()
                    .activity_slot_options(SlotSupplierOptions::Custom(Arc::new(b.lane(
                        &self.queue,
                        &gpulane_activities::DeviceActivities::activity_types(),
                    ))))
                    .build_tuner_holder()
                    .map_err(|e| worker_error(e.into()))?,
            ),
            // Both CPU lanes (and the model ones) share one fixed pool of
            // --max-concurrent-cpu slots; see runtime/src/supervisor/mod.rs.
            None => d.cpu_tuner.clone(),
        };
        let s = d.settings;
        let config = WorkerConfig::builder()
            .namespace(s.temporal.namespace.clone())
            .task_queue(self.queue.clone())
            .task_types(WorkerTaskTypes::activity_only())
            .versioning_strategy(s.versioning.clone())
            .client_identity_override(self.identity.clone())
            .tuner(tuner)
            .activity_task_poller_behavior(s.pollers)
            .maybe_max_worker_activities_per_second(s.max_activities_per_second)
            .maybe_max_task_queue_activities_per_second(s.max_task_queue_activities_per_second)
            .graceful_shutdown_period(s.graceful_shutdown)
            // Several cards of this host poll the shared queues through one connection,
            // and a resumed lane's new worker polls beside its old one while that one
            // finishes; core refuses both unless told they are intended.
            .skip_client_worker_set_check(true)
            .build()
            .map_err(|e| worker_error(e.into()))?;
        let worker = init_worker(d.core, config, d.connection.clone())
            .map_err(|e| worker_error(e.into()))?;
        worker
            .validate()
            .await
            .map_err(|e| worker_error(Box::new(e)))?;
        let worker = Arc::new(worker);
        self.generation += 1;
        self.worker = Arc::downgrade(&worker);
        self.state = LaneState::Polling;
        d.metrics.lane_polling(
            &self.queue,
            d.activities.device().uuid.as_deref().unwrap_or("cpu"),
            true,
        );
        let lane = Lane {
            worker: worker.clone(),
            activities: d.activities.clone(),
            queue: self.queue.clone(),
            route: self.route.clone(),
            budget: d.budget.cloned(),
            metrics: d.metrics.clone(),
            running: self.running.clone(),
        };
        let generation = self.generation;
        let events = d.events.clone();
        let queue = self.queue.clone();
        tokio::spawn(async move {
            let served = AssertUnwindSafe(serve_lane(lane)).catch_unwind().await;
            let result = match served {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => Err(e.to_string()),
                Err(panic) => Err(format!(
                    "its task loop panicked: {}",
                    crate::worker::panic_message(&*panic)
                )),
            };
            // Core has handed out its last task; wait for it to release everything,
            // then free the worker (if no finished activity still holds a handle).
            worker.shutdown().await;
            if let Ok(worker) = Arc::try_unwrap(worker) {
                worker.finalize_shutdown().await;
            }
            tracing::debug!(task_queue = %queue, generation, "lane worker finished");
            let _ = events.send(Event::LaneEnded {
                lane: index,
                generation,
                result,
            });
        });
        tracing::info!(task_queue = %self.queue, kind = self.kind.label(),
            identity = %self.identity, "lane polling");
        Ok(())
    }

    /// Stops polling; running activities finish (core cancels what is left after the
    /// graceful shutdown period, and the lane fails those back retryably).
    pub(super) fn stop(&mut self, metrics: &Metrics, device: &str) {
        if self.state != LaneState::Polling {
            return;
        }
        if let Some(w) = self.worker.upgrade() {
            w.initiate_shutdown();
        }
        self.state = LaneState::Stopping;
        metrics.lane_polling(&self.queue, device, false);
        tracing::info!(task_queue = %self.queue, "lane stops polling; running activities finish");
    }
}
