//! What `/healthz` (liveness) and `/readyz` (readiness) answer, and the background checks
//! that keep them true.
//!
//! - **Live** (`/healthz`): every engine answers a tiny forward pass (checked every few
//!   seconds, the answer cached), and every served card's memory reading succeeds. A
//!   worker that fails this cannot do its job where it stands; restarting it is right.
//! - **Ready** (`/readyz`): connected to Temporal, every lane that should poll is polling,
//!   no lane, engine or background task has died, and the worker is not draining. A
//!   worker that fails this should not count as serving (a rollout waits for it).

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use gpulane_models::Engine;
use temporalio_client::Connection;

use crate::{admission::MemoryBudget, metrics::Metrics, temporal};

/// How often the engines and the connection are checked.
const CHECK_EVERY: Duration = Duration::from_secs(5);
/// How long a probe's forward pass may take before the engine counts as not answering
/// (unless it finished other batches meanwhile: then it is busy, not stuck).
const PROBE_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest one forward pass may run before the engine counts as stuck.
const LONGEST_BATCH: Duration = Duration::from_secs(300);
/// How long the connectivity check may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// One engine as the checks see it.
struct Watched {
    device: String,
    engine: Engine,
    /// The last check's verdict: `Ok`, or what failed.
    last: Result<(), String>,
    /// Forward passes done at the last check, to tell a busy engine from a stuck one.
    batches: u64,
}

struct State {
    /// Every lane has started polling once.
    started: bool,
    draining: bool,
    /// The last connectivity check: `Ok`, or why Temporal did not answer.
    connected: Result<(), String>,
    /// Fatal problems: a lane, engine or background task that died.
    failures: Vec<String>,
    /// Lanes that should poll and do not, with why.
    lanes_down: Vec<String>,
    engines: Vec<Watched>,
    budgets: Vec<Arc<MemoryBudget>>,
}

/// The worker's health, written by the supervisor and the checks, read by the probes
/// and `gpulane status`.
pub(crate) struct Health {
    state: Mutex<State>,
    metrics: Arc<Metrics>,
}

/// One engine's last check, for `status`.
pub(crate) struct EngineHealth {
    pub device: String,
    pub model: String,
    pub kind: &'static str,
    pub alive: bool,
    pub check: Result<(), String>,
    pub pending_rows: usize,
}

impl Health {
    pub(crate) fn new(metrics: Arc<Metrics>) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(State {
                started: false,
                draining: false,
                connected: Ok(()),
                failures: Vec::new(),
                lanes_down: Vec::new(),
                engines: Vec::new(),
                budgets: Vec::new(),
            }),
            metrics,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .expect("health lock poisoned; this is a bug")
    }

    /// Keeps the readiness gauge in step; called after every change.
    fn publish(&self, s: &State) {
        self.metrics.set_ready(readiness(s).is_empty());
    }

    /// Watches `engine` on `device` (a card's UUID or `cpu`).
    pub(crate) fn watch_engine(&self, device: &str, engine: Engine) {
        let mut s = self.lock();
        s.engines.push(Watched {
            device: device.to_owned(),
            engine,
            last: Ok(()),
            batches: 0,
        });
    }

    /// Watches a served device's memory reading (a card's, or the host's).
    pub(crate) fn watch_budget(&self, budget: Arc<MemoryBudget>) {
        self.lock().budgets.push(budget);
    }

    /// Every lane polls: start-up is over.
    pub(crate) fn set_started(&self) {
        let mut s = self.lock();
        s.started = true;
        self.publish(&s);
    }

    /// The worker drains (SIGTERM, `Drain(all)`) or no longer does (`Resume(all)`).
    pub(crate) fn set_draining(&self, draining: bool) {
        let mut s = self.lock();
        s.draining = draining;
        self.publish(&s);
    }

    /// Something that must not die did.
    pub(crate) fn fail(&self, what: String) {
        let mut s = self.lock();
        s.failures.push(what);
        self.publish(&s);
    }

    /// The lanes that should poll and do not.
    pub(crate) fn set_lanes_down(&self, down: Vec<String>) {
        let mut s = self.lock();
        s.lanes_down = down;
        self.publish(&s);
    }

    /// Why the worker is not ready; empty when it is.
    pub(crate) fn readiness(&self) -> Vec<String> {
        readiness(&self.lock())
    }

    /// Why the worker is not live; empty when it is.
    pub(crate) fn liveness(&self) -> Vec<String> {
        let s = self.lock();
        let mut problems: Vec<String> = s
            .engines
            .iter()
            .filter_map(|w| {
                w.last
                    .as_ref()
                    .err()
                    .map(|e| format!("engine {} on {}: {e}", w.engine.name(), w.device))
            })
            .collect();
        problems.extend(
            s.budgets
                .iter()
                .filter_map(|b| b.reading_error().map(|e| format!("{}: {e}", b.of()))),
        );
        problems
    }

    /// Every watched engine's state.
    pub(crate) fn engines(&self) -> Vec<EngineHealth> {
        self.lock()
            .engines
            .iter()
            .map(|w| EngineHealth {
                device: w.device.clone(),
                model: w.engine.name().to_owned(),
                kind: w.engine.kind().label(),
                alive: w.engine.life().is_alive(),
                check: w.last.clone(),
                pending_rows: w.engine.pending_rows(),
            })
            .collect()
    }

    /// Whether the worker drains.
    pub(crate) fn draining(&self) -> bool {
        self.lock().draining
    }

    /// Runs the checks until the process ends: every engine's probe, and a cheap call to
    /// Temporal. The first round runs at once.
    pub(crate) async fn run_checks(self: Arc<Self>, connection: Connection) {
        let mut tick = tokio::time::interval(CHECK_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let engines: Vec<(usize, Engine, u64)> = self
                .lock()
                .engines
                .iter()
                .enumerate()
                .map(|(i, w)| (i, w.engine.clone(), w.batches))
                .collect();
            let probes = engines.into_iter().map(|(i, engine, before)| async move {
                let verdict = if !engine.life().is_alive() {
                    Err("its thread has ended".to_owned())
                } else {
                    match tokio::time::timeout(PROBE_TIMEOUT, engine.probe()).await {
                        Ok(Ok(())) => Ok(()),
                        // The engine answered; another tenant holds the card. Admission
                        // already stops polling it; restarting the worker would not help.
                        Ok(Err(gpulane_models::ModelError::OutOfMemory(_))) => Ok(()),
                        // The engine answered, with NaN: the model (or its dtype) is at
                        // fault, and a restart would load the same model and kill the
                        // process's other lanes, the cpu-tools one the failure's message
                        // sends callers to among them. Each call says so itself.
                        Ok(Err(gpulane_models::ModelError::NonFiniteOutput { .. })) => Ok(()),
                        Ok(Err(e)) => Err(format!("the probe failed: {e}")),
                        // Still finishing other batches, or in one long one: busy, not
                        // stuck.
                        Err(_) if engine.counters().totals().batches > before => Ok(()),
                        Err(_)
                            if engine
                                .counters()
                                .busy_for()
                                .is_some_and(|d| d < LONGEST_BATCH) =>
                        {
                            Ok(())
                        }
                        Err(_) => Err(format!(
                            "no answer to a one-text probe in {} s, no forward pass finished since the last check, and none has been running for less than {} s",
                            PROBE_TIMEOUT.as_secs(),
                            LONGEST_BATCH.as_secs()
                        )),
                    }
                };
                (i, verdict, engine.counters().totals().batches)
            });
            let checked = futures::future::join_all(probes).await;
            let connected =
                match tokio::time::timeout(CONNECT_TIMEOUT, temporal::reachable(&connection)).await
                {
                    Ok(Ok(())) => Ok(()),
                    Ok(Err(e)) => Err(format!("Temporal does not answer: {}", e.message())),
                    Err(_) => Err(format!(
                        "Temporal does not answer within {} s",
                        CONNECT_TIMEOUT.as_secs()
                    )),
                };
            let mut s = self.lock();
            for (i, verdict, batches) in checked {
                if let Some(w) = s.engines.get_mut(i) {
                    if let Err(e) = &verdict {
                        if w.last.is_ok() {
                            tracing::error!(model = w.engine.name(), device = %w.device, error = %e,
                                "engine health check failed");
                        }
                    }
                    w.last = verdict;
                    w.batches = batches;
                }
            }
            if let (Ok(()), Err(e)) = (&s.connected, &connected) {
                tracing::warn!(error = %e, "not ready: lost Temporal");
            } else if let (Err(_), Ok(())) = (&s.connected, &connected) {
                tracing::info!("Temporal answers again");
            }
            s.connected = connected;
            self.publish(&s);
        }
    }
}

fn readiness(s: &State) -> Vec<String> {
    let mut why = Vec::new();
    if !s.started {
        why.push("starting: the lanes do not poll yet".to_owned());
    }
    if let Err(e) = &s.connected {
        why.push(e.clone());
    }
    if s.draining {
        why.push("draining".to_owned());
    }
    why.extend(s.failures.iter().cloned());
    why.extend(s.lanes_down.iter().cloned());
    why
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readiness_names_every_reason() {
        let h = Health::new(Arc::default());
        assert_eq!(h.readiness().len(), 1, "starting");
        h.set_started();
        assert!(h.readiness().is_empty());
        h.set_draining(true);
        h.set_lanes_down(vec!["lane gpu-tools: stopped".into()]);
        h.fail("engine minilm on cpu died".into());
        let why = h.readiness();
        assert_eq!(why.len(), 3, "{why:?}");
        assert!(why.iter().any(|w| w == "draining"));
        h.set_draining(false);
        h.set_lanes_down(Vec::new());
        assert_eq!(h.readiness(), vec!["engine minilm on cpu died".to_owned()]);
        assert!(h.liveness().is_empty(), "no engine or card watched");
    }
}
