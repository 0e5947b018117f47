//! One lane's task loop: poll activity tasks from sdk-core, run each on the device's
//! activities in its own tokio task, heartbeat while it runs so cancellation reaches it,
//! and complete it. Polling itself (long polls, slot reservation, retries) is core's.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::Duration,
};

use gpulane_activities::DeviceActivities;
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
    admission::CardBudget,
    temporal::{failure, input_json, json_payload},
    RuntimeError,
};

/// How often a running activity heartbeats when its workflow set no heartbeat timeout.
/// Heartbeats are how cancellation requests reach a worker; core throttles them anyway.
const DEFAULT_HEARTBEAT: Duration = Duration::from_secs(5);

type Running = Arc<Mutex<HashMap<Vec<u8>, oneshot::Sender<ActivityCancelReason>>>>;

/// Serves one lane until core reports shutdown (after `initiate_shutdown` and once every
/// running activity has completed).
pub(crate) async fn serve_lane(
    worker: Arc<Worker>,
    activities: DeviceActivities,
    queue: String,
    budget: Option<Arc<CardBudget>>,
) -> Result<(), RuntimeError> {
    let running: Running = Arc::default();
    loop {
        let task = match worker.poll_activity_task().await {
            Ok(task) => task,
            Err(PollError::ShutDown) => return Ok(()),
            Err(e) => {
                return Err(RuntimeError::Poll {
                    queue,
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
                    task_queue = %queue,
                    activity_type = %start.activity_type,
                    activity_id = %start.activity_id,
                    workflow_id = start.workflow_execution.as_ref().map(|w| w.workflow_id.as_str()).unwrap_or(""),
                    attempt = start.attempt,
                    device = %activities.device().uuid.as_deref().unwrap_or("cpu"),
                );
                tokio::spawn(
                    execute(
                        worker.clone(),
                        activities.clone(),
                        start,
                        token,
                        cancel_rx,
                        running.clone(),
                        budget.clone(),
                    )
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

async fn execute(
    worker: Arc<Worker>,
    activities: DeviceActivities,
    start: Start,
    token: Vec<u8>,
    cancelled: oneshot::Receiver<ActivityCancelReason>,
    running: Running,
    budget: Option<Arc<CardBudget>>,
) {
    let heartbeat_every = start
        .heartbeat_timeout
        .and_then(|d| Duration::try_from(d).ok())
        .filter(|d| !d.is_zero())
        .map_or(DEFAULT_HEARTBEAT, |d| d / 2);
    let progress = Progress::default();
    let heartbeats = {
        let worker = worker.clone();
        let token = token.clone();
        let progress = progress.clone();
        async move {
            let mut tick = tokio::time::interval(heartbeat_every);
            tick.tick().await;
            loop {
                tick.tick().await;
                // Details show in the UI and `describe`; a long call's count shows it moves.
                let details = serde_json::json!({ "done": progress.done() });
                worker.record_activity_heartbeat(ActivityHeartbeat {
                    task_token: token.clone(),
                    details: vec![json_payload(details.to_string().into_bytes())],
                });
            }
        }
    };
    let work = async {
        let input = input_json(&start.input)?;
        activities.run(&start.activity_type, input, &progress).await
    };
    let result = tokio::select! {
        out = work => match out {
            Ok(json) => ActivityExecutionResult::ok(json_payload(json)),
            Err(e) => {
                if e.is_out_of_memory() {
                    if let Some(b) = &budget {
                        b.record_oom(&start.activity_type);
                    }
                }
                if e.is_retryable() {
                    tracing::warn!(failure_type = e.failure_type(), error = %e, "activity failed, retryable");
                } else {
                    tracing::info!(failure_type = e.failure_type(), error = %e, "activity refused");
                }
                ActivityExecutionResult::fail(failure(&e))
            }
        },
        Ok(reason) = cancelled => {
            // Dropping `work` abandons the engine call; the engine skips jobs nobody
            // waits for, so a cancelled activity frees the device.
            tracing::info!(?reason, "activity cancelled");
            ActivityExecutionResult::cancel_from_details(None)
        }
        _ = heartbeats => unreachable!("the heartbeat loop never ends"),
    };
    running
        .lock()
        .expect("running-task map poisoned; this is a bug")
        .remove(&token);
    if let Err(e) = worker
        .complete_activity_task(ActivityTaskCompletion {
            task_token: token,
            result: Some(result),
        })
        .await
    {
        tracing::error!(error = %e, "could not complete the activity task");
    }
}
