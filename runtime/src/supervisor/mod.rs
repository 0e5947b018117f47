//! `gpulane run`: the serving loop and its supervision.
//!
//! One task, the supervisor, owns every device and lane and changes them only in answer
//! to an [`Event`]: an admin request (status, drain, resume), a lane's worker ending, a
//! drain window closing, a stop signal, a card recovering, or something that must not die
//! dying (an engine thread, the memory refresh, the health checks, the admin thread).
//! Everything else reads its state through the shared [`Health`] or asks it by message,
//! so no lock is held across a lane's start or stop.
//!
//! Stopping (SIGTERM or SIGINT, or a failure) drains everything: readiness turns 503 at
//! once, the shared and model lanes stop polling, each card's private lane keeps serving
//! for `--drain-private-secs` so pinned follow-ups land, running activities get
//! `--graceful-shutdown-secs` (then core cancels them and they are failed back,
//! retryably), and an overall deadline ends the wait whatever happens. A second signal
//! exits at once. A failure (a lane's worker ending on its own, an engine thread or a
//! background task dying) stops the affected lanes at once, the rest as above, and makes
//! the process exit non-zero so its supervisor restarts it.

mod collision;
mod control;
mod lane;
mod status;

use std::{
    panic::AssertUnwindSafe,
    sync::{Arc, Mutex},
};

use futures::FutureExt;
use gpulane_proto::admin::{DrainResponse, ResumeResponse, StatusResponse};
use temporalio_client::Connection;
use temporalio_common::telemetry::TelemetryOptions;
use temporalio_sdk_core::{CoreRuntime, RuntimeOptions};
use tokio::{
    sync::{mpsc, oneshot},
    time::Instant,
};

use self::lane::{LaneRt, LaneState, WorkerDeps};
use crate::{
    admission::{refresh, MemoryBudget},
    config::RunArgs,
    devices::DeviceInventory,
    health::Health,
    lanes::{plan, LaneKind},
    metrics::Metrics,
    registry::ModelSpec,
    settings::Settings,
    startup::{
        check_cards, host, inventory, load_device, resolve_models, BrokenCard, DeviceSetup, Host,
    },
    temporal, RuntimeError,
};

/// What the supervisor answers to.
pub(crate) enum Event {
    Status(oneshot::Sender<StatusResponse>),
    Drain(String, oneshot::Sender<Result<DrainResponse, AdminError>>),
    Resume(String, oneshot::Sender<Result<ResumeResponse, AdminError>>),
    /// A lane's task loop ended and its worker shut down.
    LaneEnded {
        lane: usize,
        generation: u64,
        result: Result<(), String>,
    },
    /// A draining device's private-lane window is over.
    WindowOver {
        device: usize,
        generation: u64,
    },
    /// SIGTERM or SIGINT (the first one; a second exits at once).
    Signal(&'static str),
    /// An engine thread ended.
    EngineDied {
        device: usize,
        model: String,
    },
    /// Something that must run for the life of the process ended.
    Died(String),
    /// A card that could not be read at start is ready to serve.
    CardReady(Box<DeviceSetup>),
    /// A card that could not be read at start still cannot be.
    CardStillBroken {
        uuid: String,
        error: String,
    },
}

/// Why an admin request was refused; nothing changed.
#[derive(Debug)]
pub(crate) enum AdminError {
    /// No such device.
    NotFound(String),
    /// The device is not in a state where the request makes sense.
    Refused(String),
}

/// The supervisor's mailbox, for the admin API.
#[derive(Clone)]
pub(crate) struct SupervisorHandle(mpsc::UnboundedSender<Event>);

impl SupervisorHandle {
    async fn ask<T>(&self, make: impl FnOnce(oneshot::Sender<T>) -> Event) -> Option<T> {
        let (tx, rx) = oneshot::channel();
        self.0.send(make(tx)).ok()?;
        rx.await.ok()
    }

    /// Something that must run for the life of the process ended.
    pub(crate) fn died(&self, why: String) {
        let _ = self.0.send(Event::Died(why));
    }

    /// The worker's status, without backlog.
    pub(crate) async fn status(&self) -> Option<StatusResponse> {
        self.ask(Event::Status).await
    }

    pub(crate) async fn drain(&self, device: String) -> Option<Result<DrainResponse, AdminError>> {
        self.ask(|tx| Event::Drain(device, tx)).await
    }

    pub(crate) async fn resume(
        &self,
        device: String,
    ) -> Option<Result<ResumeResponse, AdminError>> {
        self.ask(|tx| Event::Resume(device, tx)).await
    }
}

/// Where a device stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DeviceState {
    Serving,
    /// Shared and model lanes stopped; the private lane serves until its window ends.
    Draining,
    Drained,
    /// The worker stops.
    Stopping,
}

/// One served device.
struct Device {
    setup: DeviceSetup,
    state: DeviceState,
    /// Bumped whenever a drain window starts or is cancelled, so a stale window's end is
    /// ignored.
    window: u64,
    /// Why the device failed (an engine died), if it did.
    failed: Option<String>,
}

impl Device {
    fn id(&self) -> &str {
        self.setup.plan.label()
    }
}

/// The stop in progress.
struct Stop {
    deadline: Instant,
    /// The failure that caused it; `None` for a stop signal.
    failure: Option<String>,
}

struct Supervisor {
    settings: Arc<Settings>,
    core: CoreRuntime,
    connection: Connection,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    /// Every device's budget (the cards', the host's), read by the memory refresh.
    budgets: Arc<Mutex<Vec<Arc<MemoryBudget>>>>,
    devices: Vec<Device>,
    broken: Vec<BrokenCard>,
    lanes: Vec<LaneRt>,
    /// Lane task loops still running, of any generation.
    live: usize,
    events: mpsc::UnboundedSender<Event>,
    inbox: mpsc::UnboundedReceiver<Event>,
    stop: Option<Stop>,
}

/// Runs `gpulane run` until it is stopped: `Ok` after a clean drain, an error after a
/// failure or a missed deadline (the process then exits non-zero).
pub(crate) async fn run(args: RunArgs) -> Result<(), RuntimeError> {
    let (events, inbox) = mpsc::unbounded_channel();
    // Signals first: one during start-up is handled once serving begins.
    spawn_signals(events.clone());
    let settings = Arc::new(Settings::from_args(&args)?);
    let models = Arc::new(resolve_models(&args.models, settings.model_queues).await?);
    let inv = inventory(&settings.devices)?;
    let host = host(&settings.devices, settings.max_dataset)?;
    let plans = plan(
        &settings.devices.host,
        inv.devices(),
        &settings.devices.gpus,
        settings.devices.cpu_lane,
    );
    if plans.is_empty() {
        return Err(RuntimeError::Config(
            "no lanes to serve: no GPU is selected and --cpu-lane is off".to_owned(),
        ));
    }
    let (plans, broken) = check_cards(plans, &*inv);
    let metrics = Arc::new(Metrics::default());
    metrics.watch_dataset_memory(host.datasets.clone());
    let health = Health::new(metrics.clone());
    // Bind before loading models: a taken port stops the worker at once, naming the flag.
    let http = bind("--metrics-address", settings.metrics_address)?;
    let admin = bind("--admin-address", settings.admin_address)?;
    if let Some(l) = &http {
        let bound = l.local_addr().map(|a| a.to_string()).unwrap_or_default();
        tracing::info!(address = %bound, "metrics and health on http://{bound}/metrics");
    }
    if let Some(l) = &admin {
        let bound = l.local_addr().map(|a| a.to_string()).unwrap_or_default();
        tracing::info!(address = %bound, "admin API on {bound} (gpulane status --admin-address {bound})");
    }

    // Load every model on every device before touching Temporal: a worker that cannot
    // serve what it declares must not take tasks.
    let setups = {
        let (settings, models, metrics) = (settings.clone(), models.clone(), metrics.clone());
        let (inv, host) = (inv.clone(), host.clone());
        tokio::task::spawn_blocking(move || {
            plans
                .into_iter()
                .map(|p| load_device(p, &models, &settings, &metrics, &*inv, &host))
                .collect::<Result<Vec<_>, _>>()
        })
        .await
        .expect("loading models panicked; this is a bug")?
    };

    tracing::debug!(address = %settings.temporal.address, "connecting");
    let connection = temporal::connect(&settings.temporal, &settings.identity).await?;
    // Core records its worker metrics through our meter (one /metrics). No core logger:
    // with one, core installs its own tracing subscriber on this thread and gpulane's own
    // log lines disappear; core's events reach our subscriber instead.
    let core = CoreRuntime::new_assume_tokio(
        RuntimeOptions::builder()
            .telemetry_options(
                TelemetryOptions::builder()
                    .metrics(metrics.core_meter() as Arc<_>)
                    .build(),
            )
            .build()
            .map_err(RuntimeError::Config)?,
    )
    .map_err(|e| RuntimeError::Config(format!("starting sdk-core: {e}")))?;

    let mut sup = Supervisor {
        settings: settings.clone(),
        core,
        connection: connection.clone(),
        metrics: metrics.clone(),
        health: health.clone(),
        budgets: Arc::default(),
        devices: Vec::new(),
        broken,
        lanes: Vec::new(),
        live: 0,
        events: events.clone(),
        inbox,
        stop: None,
    };
    for setup in setups {
        sup.add_device(setup);
    }
    crate::admin::spawn_thread(crate::admin::AdminThread {
        http,
        admin,
        metrics: metrics.clone(),
        health: health.clone(),
        supervisor: SupervisorHandle(events.clone()),
        connection: connection.clone(),
        namespace: settings.temporal.namespace.clone(),
    })?;
    sup.guard(
        "the memory refresh",
        true,
        refresh(
            sup.budgets.clone(),
            inv.clone(),
            host.memory.clone(),
            settings.memory_refresh,
        ),
    );
    sup.guard(
        "the health checks",
        true,
        health.clone().run_checks(connection),
    );
    if !sup.broken.is_empty() {
        sup.guard(
            "the broken-card retry",
            false,
            retry_cards(
                sup.broken.clone(),
                inv.clone(),
                host.clone(),
                models.clone(),
                settings.clone(),
                metrics.clone(),
                events.clone(),
            ),
        );
    }
    sup.check_private_queues().await?;
    for i in 0..sup.lanes.len() {
        if let Err(e) = sup.start_lane(i).await {
            // Lanes already polling may hold tasks: drain them before giving up.
            tracing::error!(error = %e, "a lane could not start; stopping the others");
            sup.fail(e.to_string());
            let _ = sup.serve().await;
            return Err(e);
        }
    }
    health.set_started();
    sup.update_health();
    let queues: Vec<&str> = sup.lanes.iter().map(|l| l.queue.as_str()).collect();
    tracing::info!(namespace = %settings.temporal.namespace, address = %settings.temporal.address,
        inventory = inv.source(), ?queues, identity = %settings.identity, "gpulane ready");
    sup.serve().await
}

fn bind(
    flag: &str,
    address: Option<std::net::SocketAddr>,
) -> Result<Option<std::net::TcpListener>, RuntimeError> {
    let Some(address) = address else {
        return Ok(None);
    };
    let listener = std::net::TcpListener::bind(address)
        .and_then(|l| l.set_nonblocking(true).map(|()| l))
        .map_err(|e| {
            RuntimeError::Config(format!(
                "{flag} {address}: {e}; pick a free port or pass `off`"
            ))
        })?;
    Ok(Some(listener))
}

/// Forwards SIGTERM and SIGINT; a second one exits at once.
fn spawn_signals(events: mpsc::UnboundedSender<Event>) {
    #[cfg(unix)]
    tokio::spawn(async move {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate())
            .expect("installing a SIGTERM handler cannot fail on Unix; this is a bug");
        let mut int = signal(SignalKind::interrupt())
            .expect("installing a SIGINT handler cannot fail on Unix; this is a bug");
        let mut seen = 0;
        loop {
            let name = tokio::select! {
                _ = term.recv() => "SIGTERM",
                _ = int.recv() => "SIGINT",
            };
            seen += 1;
            if seen > 1 {
                tracing::warn!(
                    signal = name,
                    "second stop signal: exiting now; running \
                    activities are abandoned and Temporal retries them after their timeouts"
                );
                std::process::exit(1);
            }
            let _ = events.send(Event::Signal(name));
        }
    });
    #[cfg(not(unix))]
    tokio::spawn(async move {
        let _ = tokio::signal::ctrl_c().await;
        let _ = events.send(Event::Signal("Ctrl-C"));
    });
}

/// Tries the cards that could not be read, every `--card-retry-secs`, and loads a card's
/// models once it reads again.
async fn retry_cards(
    mut broken: Vec<BrokenCard>,
    inv: Arc<dyn DeviceInventory>,
    host: Host,
    models: Arc<Vec<ModelSpec>>,
    settings: Arc<Settings>,
    metrics: Arc<Metrics>,
    events: mpsc::UnboundedSender<Event>,
) {
    let mut tick = tokio::time::interval(settings.card_retry);
    tick.tick().await;
    while !broken.is_empty() {
        tick.tick().await;
        let mut left = Vec::new();
        for mut card in broken {
            let gpu = card
                .plan
                .gpu
                .clone()
                .expect("only cards are set aside; this is a bug");
            let probe_inv = inv.clone();
            let probed = tokio::task::spawn_blocking(move || {
                let g = probe_inv.probe(&gpu)?;
                probe_inv.free_memory(&g.uuid).map(|_| g)
            })
            .await
            .expect("reading a card panicked; this is a bug");
            let loaded = match probed {
                Err(e) => Err(e.to_string()),
                Ok(g) => {
                    card.plan.gpu = Some(g);
                    let (plan, models, settings, metrics, inv, host) = (
                        card.plan.clone(),
                        models.clone(),
                        settings.clone(),
                        metrics.clone(),
                        inv.clone(),
                        host.clone(),
                    );
                    tokio::task::spawn_blocking(move || {
                        load_device(plan, &models, &settings, &metrics, &*inv, &host)
                    })
                    .await
                    .expect("loading models panicked; this is a bug")
                    .map_err(|e| e.to_string())
                }
            };
            match loaded {
                Ok(setup) => {
                    let _ = events.send(Event::CardReady(Box::new(setup)));
                }
                Err(error) => {
                    let _ = events.send(Event::CardStillBroken {
                        uuid: card.plan.label().to_owned(),
                        error: error.clone(),
                    });
                    card.error = error;
                    left.push(card);
                }
            }
        }
        broken = left;
    }
}

impl Supervisor {
    /// Spawns a background task whose panic is a failure, and whose end is one too when
    /// it must run for the life of the process (`forever`).
    fn guard(
        &self,
        what: &'static str,
        forever: bool,
        task: impl std::future::Future<Output = ()> + Send + 'static,
    ) {
        let events = self.events.clone();
        tokio::spawn(async move {
            let why = match AssertUnwindSafe(task).catch_unwind().await {
                Ok(()) if !forever => return,
                Ok(()) => format!("{what} ended"),
                Err(panic) => format!("{what} panicked: {}", crate::worker::panic_message(&*panic)),
            };
            let _ = events.send(Event::Died(why));
        });
    }

    /// Adds a loaded device, its lanes (not started) and its watchers.
    fn add_device(&mut self, setup: DeviceSetup) {
        let index = self.devices.len();
        let id = setup.plan.label().to_owned();
        for (_, engine) in &setup.engines {
            self.health.watch_engine(&id, engine.clone());
            let life = engine.life();
            let events = self.events.clone();
            let model = engine.name().to_owned();
            tokio::spawn(async move {
                life.ended().await;
                let _ = events.send(Event::EngineDied {
                    device: index,
                    model,
                });
            });
        }
        // Every lane of the device counts before the first one polls, so the first lane
        // to start does not take every permit.
        let b = &setup.budget;
        for l in &setup.lanes {
            b.expect_lane(&l.queue);
        }
        self.health.watch_budget(b.clone());
        self.budgets
            .lock()
            .expect("budget list lock poisoned; this is a bug")
            .push(b.clone());
        for l in &setup.lanes {
            self.lanes.push(LaneRt {
                identity: format!("{}/{id}/{}", self.settings.identity, l.queue),
                queue: l.queue.clone(),
                device: index,
                kind: l.kind,
                route: l.route.clone(),
                state: LaneState::Stopped,
                worker: std::sync::Weak::new(),
                generation: 0,
                running: Arc::default(),
                supplier: None,
                gate: None,
            });
        }
        self.devices.push(Device {
            setup,
            state: DeviceState::Serving,
            window: 0,
            failed: None,
        });
    }

    async fn start_lane(&mut self, i: usize) -> Result<(), RuntimeError> {
        let device = &self.devices[self.lanes[i].device];
        let deps = WorkerDeps {
            core: &self.core,
            connection: &self.connection,
            settings: &self.settings,
            metrics: &self.metrics,
            activities: &device.setup.activities,
            budget: &device.setup.budget,
            events: &self.events,
        };
        self.lanes[i].start(i, deps).await?;
        self.live += 1;
        Ok(())
    }

    fn stop_lane(&mut self, i: usize) {
        let device = &self.devices[self.lanes[i].device];
        self.lanes[i].stop(&self.metrics, device.id(), &device.setup.budget);
    }

    /// The lanes of `device`, optionally without its private one.
    fn lanes_of(&self, device: usize, private_too: bool) -> Vec<usize> {
        (0..self.lanes.len())
            .filter(|&i| {
                self.lanes[i].device == device
                    && (private_too || self.lanes[i].kind != LaneKind::Private)
            })
            .collect()
    }

    /// Readiness follows the devices and lanes: draining when no device serves, and a
    /// lane of a serving device that does not poll is named.
    fn update_health(&self) {
        let draining =
            self.stop.is_some() || self.devices.iter().all(|d| d.state != DeviceState::Serving);
        self.health.set_draining(draining);
        let down = self
            .lanes
            .iter()
            .filter(|l| {
                self.devices[l.device].state == DeviceState::Serving
                    && l.state != LaneState::Polling
            })
            .map(|l| format!("lane {} does not poll ({})", l.queue, l.state.label()))
            .collect();
        self.health.set_lanes_down(down);
    }

    /// The loop: answer events until a stop has finished or its deadline passed.
    async fn serve(mut self) -> Result<(), RuntimeError> {
        loop {
            if let Some(stop) = &self.stop {
                if self.live == 0 {
                    break;
                }
                let deadline = stop.deadline;
                let event = tokio::select! {
                    e = self.inbox.recv() => e,
                    () = tokio::time::sleep_until(deadline) => {
                        let running: usize = self.lanes.iter()
                            .map(|l| l.running.load(std::sync::atomic::Ordering::Relaxed)).sum();
                        let waiting: Vec<&str> = self.lanes.iter()
                            .filter(|l| matches!(l.state, LaneState::Stopping))
                            .map(|l| l.queue.as_str()).collect();
                        tracing::error!(?waiting, running, "the stop's deadline passed; exiting \
                            without waiting further (Temporal retries what was running after its timeouts)");
                        return Err(RuntimeError::Stopped(format!(
                            "the stop's deadline ({} s) passed with {running} activities still running on {waiting:?}",
                            self.settings.shutdown_deadline().as_secs()
                        )));
                    }
                };
                let Some(event) = event else { break };
                self.handle(event).await;
            } else {
                let event = self
                    .inbox
                    .recv()
                    .await
                    .expect("the supervisor holds a sender of its own inbox; this is a bug");
                self.handle(event).await;
            }
        }
        tracing::info!("gpulane stopped");
        match self.stop.and_then(|s| s.failure) {
            Some(failure) => Err(RuntimeError::Stopped(failure)),
            None => Ok(()),
        }
    }

    async fn handle(&mut self, event: Event) {
        match event {
            Event::Status(reply) => {
                let _ = reply.send(self.status());
            }
            Event::Drain(target, reply) => {
                let _ = reply.send(self.drain(&target));
            }
            Event::Resume(target, reply) => {
                let r = self.resume(&target).await;
                let _ = reply.send(r);
            }
            Event::LaneEnded {
                lane,
                generation,
                result,
            } => self.lane_ended(lane, generation, result),
            Event::WindowOver { device, generation } => self.window_over(device, generation),
            Event::Signal(name) => {
                tracing::info!(
                    signal = name,
                    "stop requested: draining (a second signal exits at once)"
                );
                self.begin_stop(None);
            }
            Event::EngineDied { device, model } => {
                if self.devices[device].failed.is_none() {
                    let why = format!(
                        "the engine of model {model} on {} died",
                        self.devices[device].id()
                    );
                    tracing::error!(reason = %why, "failure: stopping this device's lanes now and the worker after its drain");
                    self.devices[device].failed = Some(why.clone());
                    for i in self.lanes_of(device, true) {
                        self.stop_lane(i);
                    }
                    self.fail(why);
                }
            }
            Event::Died(why) => {
                tracing::error!(reason = %why, "failure: the worker drains and exits non-zero");
                self.fail(why);
            }
            Event::CardReady(setup) => self.card_ready(*setup).await,
            Event::CardStillBroken { uuid, error } => {
                tracing::warn!(gpu_uuid = %uuid, %error, "card still cannot be read; retrying later");
                if let Some(b) = self.broken.iter_mut().find(|b| b.plan.label() == uuid) {
                    b.error = error;
                }
            }
        }
        self.update_health();
    }

    fn lane_ended(&mut self, lane: usize, generation: u64, result: Result<(), String>) {
        self.live -= 1;
        let device = &self.devices[self.lanes[lane].device];
        let (id, budget) = (device.id().to_owned(), device.setup.budget.clone());
        let l = &mut self.lanes[lane];
        if generation != l.generation {
            // A replaced worker (the lane resumed meanwhile) finished its last tasks.
            if let Err(e) = result {
                tracing::warn!(task_queue = %l.queue, error = %e, "a lane's replaced worker ended with an error");
            }
            return;
        }
        let expected = matches!(l.state, LaneState::Stopping | LaneState::Failed(_));
        let why = match (expected, result) {
            (true, Ok(())) => {
                if l.state == LaneState::Stopping {
                    l.state = LaneState::Stopped;
                }
                return;
            }
            (_, Err(e)) => {
                let why = format!("lane {} stopped with an error: {e}", l.queue);
                l.state = LaneState::Failed(e);
                why
            }
            (false, Ok(())) => {
                l.state = LaneState::Failed("it ended on its own".to_owned());
                format!("lane {} stopped polling on its own", l.queue)
            }
        };
        l.leave_turns(&budget);
        self.metrics.lane_polling(&l.queue, &id, false);
        self.fail(why);
    }

    /// A failure: readiness down for good, the worker drains and exits non-zero.
    fn fail(&mut self, why: String) {
        self.health.fail(why.clone());
        if let Some(stop) = &mut self.stop {
            stop.failure.get_or_insert(why);
        } else {
            self.begin_stop(Some(why));
        }
    }
}
