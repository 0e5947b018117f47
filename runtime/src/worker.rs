//! One lane's task loop: poll activity tasks from sdk-core, run each on the device's
//! activities in its own tokio task, heartbeat while it runs so cancellation reaches it,
//! and complete it, always: a panic inside an activity becomes a retryable failure, so
//! the task's slot (and the card memory it holds) is released at once rather than at a
//! server timeout. Polling itself (long polls, slot reservation, retries) is core's.

use std::{
    any::Any,
    collections::HashMap,
    panic::AssertUnwindSafe,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use futures::FutureExt;
use gpulane_activities::{ActivityError, Call, DeviceActivities, Ran, Route};
use gpulane_models::Progress;
use temporalio_common::protos::coresdk::{
    activity_result::ActivityExecutionResult,
    activity_task::{activity_task::Variant, ActivityCancelReason, Start},
    ActivityHeartbeat, ActivityTaskCompletion,
};
use temporalio_sdk_core::{PollError, Worker};
use tokio::sync::oneshot;
use tracing::Instrument;

use crate::{
    admission::MemoryBudget,
    metrics::{Metrics, Outcome},
    temporal::{failure, input_json, json_payload},
    RuntimeError,
};

/// How often a running activity heartbeats when its workflow set no heartbeat timeout.
/// Heartbeats are how cancellation requests reach a worker; core throttles them anyway.
const DEFAULT_HEARTBEAT: Duration = Duration::from_secs(5);
/// The fastest a running activity heartbeats, whatever its timeout says.
const MIN_HEARTBEAT: Duration = Duration::from_millis(100);

type Running = Arc<Mutex<HashMap<Vec<u8>, oneshot::Sender<ActivityCancelReason>>>>;

/// Everything one lane's loop needs.
pub(crate) struct Lane {
    pub worker: Arc<Worker>,
    pub activities: DeviceActivities,
    pub queue: String,
    pub route: Route,
    pub budget: Arc<MemoryBudget>,
    pub metrics: Arc<Metrics>,
    /// Activities running now on this lane, for `status`.
    pub running: Arc<AtomicUsize>,
}

/// Serves one lane until core reports shutdown (after `initiate_shutdown` and once every
/// running activity has completed).
pub(crate) async fn serve_lane(lane: Lane) -> Result<(), RuntimeError> {
    let lane = Arc::new(lane);
    let running: Running = Arc::default();
    loop {
        let task = match lane.worker.poll_activity_task().await {
            Ok(task) => task,
            Err(PollError::ShutDown) => return Ok(()),
            Err(e) => {
                return Err(RuntimeError::Poll {
                    queue: lane.queue.clone(),
                    source: Box::new(e),
                })
            }
        };
        let token = task.task_token;
        match task.variant {
            Some(Variant::Start(start)) => {
                let (cancel_tx, cancel_rx) = oneshot::channel();
                running
                    .lock()
                    .expect("running-task map poisoned; this is a bug")
                    .insert(token.clone(), cancel_tx);
                let span = tracing::info_span!(
                    "activity",
                    task_queue = %lane.queue,
                    activity_type = %start.activity_type.chars().take(64).collect::<String>(),
                    activity_id = %start.activity_id,
                    workflow_id = start.workflow_execution.as_ref().map(|w| w.workflow_id.as_str()).unwrap_or(""),
                    attempt = start.attempt,
                    device = %lane.activities.device().uuid.as_deref().unwrap_or("cpu"),
                );
                tokio::spawn(
                    execute(lane.clone(), start, token, cancel_rx, running.clone())
                        .instrument(span),
                );
            }
            Some(Variant::Cancel(cancel)) => {
                let reason = cancel.reason();
                let waiting = running
                    .lock()
                    .expect("running-task map poisoned; this is a bug")
                    .remove(&token);
                if let Some(tx) = waiting {
                    let _ = tx.send(reason);
                }
            }
            None => {}
        }
    }
}

/// Heartbeat every half heartbeat timeout, or [`DEFAULT_HEARTBEAT`] without one, but never
/// faster than [`MIN_HEARTBEAT`]: a heartbeat timeout of 1 ns would otherwise make the
/// period zero, and a zero period panics `tokio::time::interval`.
fn heartbeat_interval(timeout: Option<Duration>) -> Duration {
    timeout
        .filter(|d| !d.is_zero())
        .map_or(DEFAULT_HEARTBEAT, |d| d / 2)
        .max(MIN_HEARTBEAT)
}

/// A panic's message, for the failure it becomes.
pub(crate) fn panic_message(panic: &(dyn Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_owned())
}

/// Takes the activity off the lane's running count however `execute` ends.
struct Counted(Arc<AtomicUsize>);

impl Counted {
    fn new(n: &Arc<AtomicUsize>) -> Self {
        n.fetch_add(1, Ordering::Relaxed);
        Self(n.clone())
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Runs the activity to its result, turning a panic into a retryable failure.
async fn outcome(lane: &Lane, start: &Start, progress: &Progress) -> (Ran, Option<String>) {
    let work = async {
        match input_json(&start.input) {
            Ok(input) => {
                let call = Call {
                    route: &lane.route,
                    progress,
                    last_heartbeat: start.heartbeat_details.last().map(|p| p.data.as_slice()),
                    priority_key: start.priority.as_ref().map_or(0, |p| p.priority_key),
                };
                lane.activities
                    .run(&start.activity_type, input, &call)
                    .await
            }
            Err(e) => Ran {
                model: None,
                result: Err(e),
            },
        }
    };
    match AssertUnwindSafe(work).catch_unwind().await {
        Ok(ran) => (ran, None),
        Err(panic) => {
            let message = panic_message(&*panic);
            (
                Ran {
                    model: None,
                    result: Err(ActivityError::Internal(message.clone())),
                },
                Some(message),
            )
        }
    }
}

async fn execute(
    lane: Arc<Lane>,
    start: Start,
    token: Vec<u8>,
    cancelled: oneshot::Receiver<ActivityCancelReason>,
    running: Running,
) {
    let _counted = Counted::new(&lane.running);
    let began = Instant::now();
    let every = heartbeat_interval(
        start
            .heartbeat_timeout
            .and_then(|d| Duration::try_from(d).ok()),
    );
    let progress = Progress::default();
    let heartbeats = {
        let worker = lane.worker.clone();
        let token = token.clone();
        let progress = progress.clone();
        async move {
            let beat = async move {
                let mut tick = tokio::time::interval(every);
                tick.tick().await;
                loop {
                    // On the tick, or at once when a job has just finished a part (its
                    // details are what a retried attempt resumes from).
                    tokio::select! {
                        _ = tick.tick() => {}
                        _ = progress.beat_requested() => {}
                    }
                    // Details show in the UI and `describe`; a long call's count shows
                    // it moves.
                    let details = match progress.details() {
                        Some(mut d) => {
                            d["done"] = progress.done().into();
                            d
                        }
                        None => serde_json::json!({ "done": progress.done() }),
                    };
                    worker.record_activity_heartbeat(ActivityHeartbeat {
                        task_token: token.clone(),
                        details: vec![json_payload(details.to_string().into_bytes())],
                    });
                }
            };
            // Heartbeats are best effort: if they ever panic, the activity still ends.
            let _ = AssertUnwindSafe(beat).catch_unwind().await;
            std::future::pending::<()>().await;
        }
    };
    let queue = lane.queue.as_str();
    let (result, ended, model) = tokio::select! {
        (ran, panicked) = outcome(&lane, &start, &progress) => match ran.result {
            Ok(json) => {
                if let Some(m) = &ran.model {
                    lane.budget.record_success(m);
                }
                (ActivityExecutionResult::ok(json_payload(json)), Outcome::Completed, ran.model)
            }
            Err(e) => {
                if let Some(message) = panicked {
                    lane.metrics.activity_panicked(queue);
                    tracing::error!(panic = %message, "activity panicked (a bug); failed back retryably, the lane keeps serving");
                } else if e.is_out_of_memory() {
                    lane.budget.record_oom(&start.activity_type, ran.model.as_deref());
                }
                if matches!(e, ActivityError::ModelNotServed { .. }) {
                    lane.metrics.model_not_served(queue);
                }
                if e.is_retryable() {
                    tracing::warn!(failure_type = e.failure_type(), error = %e, "activity failed, retryable");
                } else {
                    tracing::info!(failure_type = e.failure_type(), error = %e, "activity refused");
                }
                (ActivityExecutionResult::fail(failure(&e, start.attempt)), Outcome::Failed, ran.model)
            }
        },
        Ok(reason) = cancelled => {
            // Dropping the work abandons the engine call; the engine skips jobs nobody
            // waits for, so a cancelled activity frees the device.
            if reason == ActivityCancelReason::WorkerShutdown {
                // The drain's grace is over: hand the task back for another worker now,
                // rather than report a cancellation nobody asked for.
                let e = ActivityError::WorkerShutdown(format!(
                    "its lane {queue} stopped and the graceful shutdown period passed"
                ));
                tracing::warn!(error = %e, "activity failed back at shutdown");
                (ActivityExecutionResult::fail(failure(&e, start.attempt)), Outcome::Failed, None)
            } else {
                tracing::info!(?reason, "activity cancelled");
                (ActivityExecutionResult::cancel_from_details(None), Outcome::Cancelled, None)
            }
        }
        _ = heartbeats => unreachable!("the heartbeat loop never ends"),
    };
    lane.metrics.activity(
        queue,
        &start.activity_type,
        model.as_deref(),
        ended,
        began.elapsed(),
    );
    running
        .lock()
        .expect("running-task map poisoned; this is a bug")
        .remove(&token);
    if let Err(e) = lane
        .worker
        .complete_activity_task(ActivityTaskCompletion {
            task_token: token,
            result: Some(result),
        })
        .await
    {
        tracing::error!(error = %e, "could not complete the activity task");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heartbeats_are_never_faster_than_the_floor() {
        assert_eq!(heartbeat_interval(None), DEFAULT_HEARTBEAT);
        assert_eq!(
            heartbeat_interval(Some(Duration::from_secs(4))),
            Duration::from_secs(2)
        );
        // 1 ns halves to zero, which tokio's interval panics on.
        assert_eq!(
            heartbeat_interval(Some(Duration::from_nanos(1))),
            MIN_HEARTBEAT
        );
        assert_eq!(heartbeat_interval(Some(Duration::ZERO)), DEFAULT_HEARTBEAT);
    }

    #[test]
    fn panic_messages_are_kept() {
        let p = std::panic::catch_unwind(|| panic!("boom {}", 7)).unwrap_err();
        assert_eq!(panic_message(&*p), "boom 7");
        let p = std::panic::catch_unwind(|| panic!("static")).unwrap_err();
        assert_eq!(panic_message(&*p), "static");
    }
}
