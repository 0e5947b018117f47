//! The start-up check that this worker's private queues are its own: another live
//! process with the same `--host` serving the same card would take part of the calls
//! pinned to it, and pinning would silently break.

use std::{
    collections::HashMap,
    time::{Duration, SystemTime},
};

use super::Supervisor;
use crate::{lanes::LaneKind, RuntimeError};

impl Supervisor {
    /// Refuses to start when another live process already polls one of this worker's
    /// private queues: two workers with the same `--host` would each serve part of the
    /// calls pinned to a card. A poller known to run (a default identity of this host whose
    /// PID runs) refuses at once; one whose liveness cannot be told (a pod's name, a custom
    /// `--identity`) refuses once it is seen polling again, and is let through once it has
    /// not polled for [`crate::temporal::OTHER_RECENT`] (a replaced pod, a crashed worker).
    /// A queue that cannot be described is let through with a warning (the server may
    /// refuse DescribeTaskQueue to this worker's credentials).
    pub(super) async fn check_private_queues(&self) -> Result<(), RuntimeError> {
        const DESCRIBE_TIMEOUT: Duration = Duration::from_secs(10);
        const RECHECK: Duration = Duration::from_secs(5);
        for lane in self.lanes.iter().filter(|l| l.kind == LaneKind::Private) {
            let mut first_seen: HashMap<String, SystemTime> = HashMap::new();
            loop {
                let others = match tokio::time::timeout(
                    DESCRIBE_TIMEOUT,
                    crate::temporal::other_pollers(
                        &self.connection,
                        &self.settings.temporal.namespace,
                        &lane.queue,
                        &self.settings.identity,
                    ),
                )
                .await
                {
                    Ok(Ok(others)) => others,
                    Ok(Err(e)) => {
                        tracing::warn!(task_queue = %lane.queue, error = %e.message(),
                            "cannot check whether another process polls this private queue");
                        break;
                    }
                    Err(_) => {
                        tracing::warn!(task_queue = %lane.queue,
                            "cannot check whether another process polls this private queue: DescribeTaskQueue took over 10 s");
                        break;
                    }
                };
                let taken = others.iter().find(|p| {
                    p.alive == Some(true)
                        || first_seen
                            .get(&p.identity)
                            .is_some_and(|seen| p.last_access > *seen)
                });
                if let Some(p) = taken {
                    return Err(RuntimeError::QueueTaken {
                        queue: lane.queue.clone(),
                        other: p.identity.clone(),
                        seconds_ago: SystemTime::now()
                            .duration_since(p.last_access)
                            .unwrap_or_default()
                            .as_secs_f64(),
                    });
                }
                if others.is_empty() {
                    break;
                }
                for p in others {
                    first_seen.entry(p.identity.clone()).or_insert_with(|| {
                        tracing::warn!(task_queue = %lane.queue, other = %p.identity,
                            "this private queue was polled recently by another identity; waiting to see whether it still polls (refused if so, served once it has not for 90 s)");
                        p.last_access
                    });
                }
                tokio::time::sleep(RECHECK).await;
            }
        }
        Ok(())
    }
}
