//! Starting and stopping one lane's sdk-core worker. A lane keeps its queue, device and
//! route for the life of the process; its worker is replaced when a drained lane resumes
//! (core cannot restart a worker that has shut down).

use std::{
    panic::AssertUnwindSafe,
    sync::{atomic::AtomicUsize, Arc, Weak},
    time::Duration,
};

use futures::FutureExt;
use gpulane_activities::Route;
use temporalio_client::Connection;
use temporalio_common::worker::WorkerTaskTypes;
use temporalio_sdk_core::{
    init_worker, ActivitySlotKind, CoreRuntime, SlotSupplier, SlotSupplierOptions,
    TunerHolderOptions, Worker, WorkerConfig, WorkerTuner,
};
use tokio::sync::mpsc::UnboundedSender;
use tracing::Instrument;

use super::Event;
use crate::{
    admission::{MemoryBudget, PollGate},
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
    /// The current worker's key in its card's turn-taking, while it polls.
    pub supplier: Option<u64>,
    /// The current worker's poll gate, while it polls.
    pub gate: Option<Arc<PollGate>>,
}

/// What a new worker for a lane needs besides the lane.
pub(super) struct WorkerDeps<'a> {
    pub core: &'a CoreRuntime,
    pub connection: &'a Connection,
    pub settings: &'a Settings,
    pub metrics: &'a Arc<Metrics>,
    pub activities: &'a gpulane_activities::DeviceActivities,
    pub budget: &'a Arc<MemoryBudget>,
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
        // A lane's supplier joins its device's turn-taking (a card's, or the host's for
        // every CPU lane) as it is made; if the worker then fails to start, it leaves
        // again. A model lane's tasks can only use its model's engine.
        let model = match &self.route {
            gpulane_activities::Route::Model { model, .. } => Some(model.as_str()),
            _ => None,
        };
        let lane_slots = d.budget.lane(
            &self.queue,
            &gpulane_activities::DeviceActivities::activity_types(),
            model,
        );
        let supplier = Some(lane_slots.id());
        let gate = lane_slots.gate();
        let slots: Arc<dyn SlotSupplier<SlotKind = ActivitySlotKind> + Send + Sync> =
            Arc::new(lane_slots);
        let tuner: Arc<dyn WorkerTuner + Send + Sync> = Arc::new(
            TunerHolderOptions::builder()
                .activity_slot_options(SlotSupplierOptions::Custom(slots))
                .build_tuner_holder()
                .map_err(|e| worker_error(e.into()))?,
        );
        let worker = match self.new_worker(&d, tuner).await {
            Ok(w) => Arc::new(w),
            Err(e) => {
                if let Some(id) = supplier {
                    d.budget.supplier_stopped(id);
                }
                return Err(worker_error(e));
            }
        };
        self.supplier = supplier;
        self.gate = Some(gate);
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
            budget: d.budget.clone(),
            metrics: d.metrics.clone(),
            running: self.running.clone(),
        };
        let mut ended = Ended {
            events: d.events.clone(),
            lane: index,
            generation: self.generation,
            result: Some(Err("its task ended abnormally".to_owned())),
        };
        let queue = self.queue.clone();
        tokio::spawn(async move {
            let served = AssertUnwindSafe(serve_lane(lane)).catch_unwind().await;
            match served {
                Ok(Ok(())) => {
                    // Core has handed out its last task; wait (bounded) for it to
                    // release everything, then free the worker (if no finished activity
                    // still holds a handle).
                    if tokio::time::timeout(WORKER_SHUTDOWN, worker.shutdown())
                        .await
                        .is_err()
                    {
                        tracing::warn!(task_queue = %queue, "the lane's worker did not finish shutting down in time");
                    } else if let Ok(worker) = Arc::try_unwrap(worker) {
                        worker.finalize_shutdown().await;
                    }
                    ended.set(Ok(()));
                }
                // A failed poll loop: report it now. Core's shutdown would wait for a
                // poll that nobody makes any more; the worker is stopped and dropped.
                Ok(Err(e)) => {
                    worker.initiate_shutdown();
                    ended.set(Err(e.to_string()));
                }
                Err(panic) => {
                    worker.initiate_shutdown();
                    ended.set(Err(format!(
                        "its task loop panicked: {}",
                        crate::worker::panic_message(&*panic)
                    )));
                }
            }
            tracing::debug!(task_queue = %queue, "lane worker finished");
            // `ended` reports on drop, also if anything above panicked.
        });
        tracing::info!(task_queue = %self.queue, kind = self.kind.label(),
            identity = %self.identity, "lane polling");
        Ok(())
    }

    /// Builds and validates an sdk-core worker for the lane. Validation is a call to the
    /// server; it gets [`VALIDATE_TIMEOUT`] so a slow server cannot hold the supervisor.
    async fn new_worker(
        &self,
        d: &WorkerDeps<'_>,
        tuner: Arc<dyn WorkerTuner + Send + Sync>,
    ) -> Result<Worker, Box<dyn std::error::Error + Send + Sync>> {
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
            .build()?;
        let worker = init_worker(d.core, config, d.connection.clone())?;
        match tokio::time::timeout(VALIDATE_TIMEOUT, worker.validate()).await {
            Ok(Ok(_namespace)) => Ok(worker),
            Ok(Err(e)) => Err(Box::new(e)),
            Err(_) => Err(format!(
                "the server did not confirm the namespace within {} s",
                VALIDATE_TIMEOUT.as_secs()
            )
            .into()),
        }
    }

    /// Stops polling; running activities finish (core cancels what is left after the
    /// graceful shutdown period, and the lane fails those back retryably).
    ///
    /// The worker is not shut down at once: sdk-core 0.10.1 throws away a long poll still
    /// open at shutdown, even one the server has just answered with a task, which is then
    /// lost until its timeout. So the lane's gate closes first (no new polls), its open
    /// polls come back (a task arriving on one runs), and only then, or once no task has
    /// arrived for [`POLL_QUIET`] (an idle queue's polls would hold for a minute), does the
    /// worker shut down.
    pub(super) fn stop(&mut self, metrics: &Metrics, device: &str, budget: &MemoryBudget) {
        if self.state != LaneState::Polling {
            return;
        }
        let gate = self.gate.take();
        if let Some(g) = &gate {
            g.close();
        }
        if let Some(w) = self.worker.upgrade() {
            // Owned by the lane's worker: it ends with the shutdown it starts, which the
            // lane's task loop then sees (and reports) as the lane's end.
            let span = tracing::info_span!("lane-stop", task_queue = %self.queue);
            tokio::spawn(
                async move {
                    if let Some(g) = gate {
                        let open = g.settle(POLL_QUIET, POLL_SETTLE_LIMIT).await;
                        tracing::debug!(
                            open_polls = open,
                            "polls settled; shutting the lane's worker down"
                        );
                    }
                    w.initiate_shutdown();
                }
                .instrument(span),
            );
        }
        self.leave_turns(budget);
        self.state = LaneState::Stopping;
        metrics.lane_polling(&self.queue, device, false);
        tracing::info!(task_queue = %self.queue, "lane stops polling; running activities finish");
    }

    /// The lane no longer takes turns for its card's permits.
    pub(super) fn leave_turns(&mut self, budget: &MemoryBudget) {
        if let Some(id) = self.supplier.take() {
            budget.supplier_stopped(id);
        }
    }
}

/// How long a stopped lane's worker may take to release everything once its last task is
/// done.
const WORKER_SHUTDOWN: Duration = Duration::from_secs(30);
/// A stopping lane's open polls are interrupted once no task has arrived on them for this
/// long (see [`LaneRt::stop`]).
const POLL_QUIET: Duration = Duration::from_secs(1);
/// And at the latest after this long.
const POLL_SETTLE_LIMIT: Duration = Duration::from_secs(10);
/// How long the server may take to confirm a new worker's namespace.
const VALIDATE_TIMEOUT: Duration = Duration::from_secs(20);

/// Reports a lane task's end to the supervisor when dropped, whatever ended it.
struct Ended {
    events: UnboundedSender<Event>,
    lane: usize,
    generation: u64,
    result: Option<Result<(), String>>,
}

impl Ended {
    fn set(&mut self, result: Result<(), String>) {
        self.result = Some(result);
    }
}

impl Drop for Ended {
    fn drop(&mut self) {
        let _ = self.events.send(Event::LaneEnded {
            lane: self.lane,
            generation: self.generation,
            result: self
                .result
                .take()
                .unwrap_or_else(|| Err("its task ended abnormally".to_owned())),
        });
    }
}
