//! Start-up, serving and shutdown of `gpulane run`, and the `gpulane devices` report.

use std::{sync::Arc, time::Duration};

use gpulane_activities::{DeviceActivities, Limits, ModelSet};
use gpulane_models::{DType, Engine, EngineDevice, EngineOptions, ModelKind};
use gpulane_proto::activity;
use temporalio_common::{telemetry::TelemetryOptions, worker::WorkerTaskTypes};
use temporalio_sdk_core::{
    init_worker, CoreRuntime, PollerBehavior, RuntimeOptions, SlotSupplierOptions,
    TunerHolderOptions, Worker, WorkerConfig, WorkerTuner, WorkerVersioningStrategy,
};

use crate::{
    admission::{refresh, BudgetOptions, CardBudget},
    config::{Cli, Command, DeviceArgs, ModelArgs, RunArgs},
    devices::{
        parse_simulate_spec, DeviceError, DeviceInventory, GpuDevice, NvmlInventory,
        SimulatedInventory,
    },
    lanes::{plan, DevicePlan},
    metrics::{self, Metrics},
    registry::{declarations, resolve, ModelSpec},
    worker::serve_lane,
    RuntimeError,
};

/// Runs a parsed command line to completion.
pub async fn run_cli(cli: Cli) -> Result<(), RuntimeError> {
    match cli.command {
        Command::Run(args) => run(*args).await,
        Command::Devices(args) => {
            print_devices(&args);
            Ok(())
        }
        Command::Models(args) => print_models(&args).await,
        Command::Bench(args) => crate::bench::run_bench(*args).await,
        Command::Admission(args) => print_admission(&args).await,
    }
}

pub(crate) async fn resolve_models(args: &ModelArgs) -> Result<Vec<ModelSpec>, RuntimeError> {
    resolve(declarations(args)?, &args.hub).await
}

/// Loads `m` on the CPU with default options, as the listings and estimates need it.
fn start_on_cpu(m: &ModelSpec) -> Result<Engine, RuntimeError> {
    Engine::start(
        &m.name,
        &m.path,
        &EngineDevice::Cpu,
        EngineOptions::default(),
    )
    .map_err(|source| RuntimeError::Model {
        name: m.name.clone(),
        device: "cpu".to_owned(),
        source: Box::new(source),
    })
}

/// `gpulane models`: loads each declared model on the CPU, as a worker would at start, and
/// lists it; a model that cannot load fails the command naming the file.
async fn print_models(args: &ModelArgs) -> Result<(), RuntimeError> {
    for m in resolve_models(args).await? {
        let engine = start_on_cpu(&m)?;
        let lanes = match (m.on_gpu, m.on_cpu) {
            (true, true) => "gpu,cpu",
            (true, false) => "gpu",
            _ => "cpu",
        };
        match engine.kind() {
            ModelKind::Embedder(i) => println!(
                "{name}  embedder  {arch}  pooling {pool}{norm}  max length {len}  dimensions {dim}  dtype {dtype:?}  lanes {lanes}  {path}",
                name = m.name,
                arch = i.architecture,
                pool = i.pooling.as_str(),
                norm = if i.normalize { "+normalize" } else { "" },
                len = i.max_seq_length,
                dim = i.dimensions,
                dtype = m.dtype,
                path = m.path.display(),
            ),
            ModelKind::CrossEncoder(i) => println!(
                "{name}  cross-encoder  {arch}  max length {len}  dtype {dtype:?}  lanes {lanes}  {path}",
                name = m.name,
                arch = i.architecture,
                len = i.max_length,
                dtype = m.dtype,
                path = m.path.display(),
            ),
        }
    }
    Ok(())
}

/// The machine's cards when NVML is missing: none, and the reason, for the log.
struct NoGpus;

impl DeviceInventory for NoGpus {
    fn source(&self) -> &'static str {
        "none"
    }
    fn devices(&self) -> &[GpuDevice] {
        &[]
    }
    fn free_memory(&self, uuid: &str) -> Result<u64, DeviceError> {
        Err(DeviceError::UnknownDevice(uuid.to_owned()))
    }
}

fn host_name(args: &DeviceArgs) -> String {
    args.host.clone().unwrap_or_else(|| {
        hostname::get()
            .map(|h| h.to_string_lossy().into_owned())
            .unwrap_or_else(|_| "unknown-host".to_owned())
    })
}

/// The inventory the flags ask for. A machine without NVML (or without cards) is normal:
/// it logs why and returns an empty inventory.
pub(crate) fn inventory(args: &DeviceArgs) -> Result<Arc<dyn DeviceInventory>, RuntimeError> {
    let visible = args.cuda_visible_devices.as_deref();
    if let Some(spec) = &args.simulate_gpus {
        let (count, bytes) = parse_simulate_spec(spec)?;
        tracing::warn!(
            count,
            bytes,
            "simulated GPUs declared by --simulate-gpus: they compute on the CPU"
        );
        return Ok(Arc::new(
            SimulatedInventory::new(count, bytes)
                .with_visible(visible)
                .with_memory_file(args.simulated_memory.clone()),
        ));
    }
    match NvmlInventory::open(args.nvml_lib.as_deref().map(|p| p.as_os_str()), visible) {
        Ok(inv) => {
            if inv.devices().is_empty() {
                tracing::info!(cuda_visible_devices = ?visible, "NVML reports no visible GPU");
            }
            Ok(Arc::new(inv))
        }
        Err(DeviceError::NvmlUnavailable(why)) => {
            tracing::info!(%why, "no NVML on this machine, so no GPU lanes");
            Ok(Arc::new(NoGpus))
        }
        Err(e) => Err(e.into()),
    }
}

fn print_devices(args: &DeviceArgs) {
    let host = host_name(args);
    let inv = match inventory(args) {
        Ok(inv) => inv,
        Err(e) => {
            println!("error: {e}");
            return;
        }
    };
    println!("host: {host}");
    println!("inventory: {}", inv.source());
    if inv.devices().is_empty() {
        println!("gpus: none");
    }
    for d in inv.devices() {
        let free = inv
            .free_memory(&d.uuid)
            .map(|b| format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64))
            .unwrap_or_else(|e| format!("unknown ({e})"));
        println!(
            "gpu {index}: {uuid}  {name}  total {total:.1} GiB  free {free}  cuda ordinal {ord}{sim}",
            index = d.index,
            uuid = d.uuid,
            name = d.name,
            total = d.total_memory as f64 / (1u64 << 30) as f64,
            ord = d.cuda_ordinal,
            sim = if d.simulated { "  (simulated)" } else { "" },
        );
    }
    println!("task queues served:");
    for p in plan(&host, inv.devices(), &args.gpu_selection(), args.cpu_lane) {
        for q in &p.queues {
            println!("  {q}  ({})", p.label());
        }
    }
}

/// `gpulane admission`: each selected card's budget, built as `run` builds it, fed one
/// memory reading taken now, and how many activities of each type it would admit. The
/// models load on the CPU (only their sizes matter), so their weights are counted as
/// memory the card would still lose. One `key=value` line per card, for scripts.
async fn print_admission(args: &RunArgs) -> Result<(), RuntimeError> {
    let host = host_name(&args.devices);
    let specs = resolve_models(&args.models).await?;
    let inv = inventory(&args.devices)?;
    let cards: Vec<GpuDevice> = plan(
        &host,
        inv.devices(),
        &args.devices.gpu_selection(),
        crate::config::CpuLane::Off,
    )
    .into_iter()
    .filter_map(|p| p.gpu)
    .collect();
    if cards.is_empty() {
        println!("gpus: none (inventory: {})", inv.source());
        return Ok(());
    }
    let mut engines = Vec::new();
    for m in specs.iter().filter(|m| m.on_gpu) {
        engines.push(start_on_cpu(m)?);
    }
    if engines.is_empty() {
        return Err(RuntimeError::Config(
            "no declared model serves the gpu lanes".to_owned(),
        ));
    }
    let set = ModelSet::new(engines);
    for g in &cards {
        let budget = card_budget(args, g, &set, &specs, Arc::default(), false)?;
        let reading = inv.free_memory(&g.uuid);
        let free = reading
            .as_ref()
            .map_or_else(|e| format!("error ({e})"), u64::to_string);
        budget.set_reading(reading);
        let admits = |activity: &str| {
            budget
                .would_admit(activity)
                .map_or_else(|e| format!("none ({e})"), |n| n.to_string())
        };
        println!(
            "gpu {index} {uuid} total_bytes={total} free_bytes={free} headroom_bytes={headroom} \
             embed_cost_bytes={ec} admit_embed={ae} rerank_cost_bytes={rc} admit_rerank={ar}",
            index = g.index,
            uuid = g.uuid,
            total = g.total_memory,
            headroom = args
                .headroom_bytes(g.total_memory)
                .map_err(RuntimeError::Config)?,
            ec = budget.estimate(activity::EMBED),
            ae = admits(activity::EMBED),
            rc = budget.estimate(activity::RERANK),
            ar = admits(activity::RERANK),
        );
    }
    Ok(())
}

fn engine_device(plan: &DevicePlan) -> Result<EngineDevice, RuntimeError> {
    match &plan.gpu {
        None => Ok(EngineDevice::Cpu),
        Some(g) if g.simulated => Ok(EngineDevice::Cpu),
        Some(g) if cfg!(feature = "cuda") => {
            // The ordinal comes from NVML's order filtered by CUDA_VISIBLE_DEVICES; the
            // driver confirms it opens this very card (devices/cuda.rs says why).
            if crate::devices::check_cuda_ordinal(g)? {
                tracing::info!(gpu_uuid = %g.uuid, cuda_ordinal = g.cuda_ordinal,
                    "CUDA ordinal verified against the card's UUID");
            }
            Ok(EngineDevice::Cuda(g.cuda_ordinal))
        }
        Some(g) => Err(RuntimeError::Config(format!(
            "found GPU {} but this gpulane was built without the `cuda` feature: rebuild with \
             `--features cuda` (scripts/cuda-build.sh), or pass --gpus none to serve the CPU lane",
            g.uuid
        ))),
    }
}

/// The admission budget of one card: per-task estimates from each model's cost formula
/// (or its --vram-cost override), the headroom, the cap, and for simulated cards the
/// weights NVML would have shown as used.
fn card_budget(
    args: &RunArgs,
    gpu: &GpuDevice,
    models: &ModelSet,
    specs: &[ModelSpec],
    metrics: Arc<Metrics>,
    weights_on_card: bool,
) -> Result<Arc<CardBudget>, RuntimeError> {
    let spec = |name: &str| {
        specs
            .iter()
            .find(|s| s.name == name)
            .expect("every engine comes from a spec; this is a bug")
    };
    // Simulated cards compute on the CPU in f32; real cards in the model's dtype.
    let dtype_bytes = |e: &Engine| {
        if gpu.simulated {
            4
        } else {
            spec(e.name()).dtype.size_in_bytes() as u64
        }
    };
    let mut overrides = args.vram_costs().map_err(RuntimeError::Config)?;
    overrides.extend(
        specs
            .iter()
            .filter_map(|s| s.vram_cost.map(|c| (s.name.clone(), c))),
    );
    for (name, _) in &overrides {
        if !models.names().contains(name) {
            return Err(RuntimeError::Config(format!(
                "--vram-cost names {name:?}, which is not a served model ({:?})",
                models.names()
            )));
        }
    }
    let cost = |e: &Engine| {
        overrides
            .iter()
            .find(|(n, _)| n == e.name())
            .map_or_else(|| e.kind().working_bytes(dtype_bytes(e)), |(_, b)| *b)
    };
    // Each activity costs what its costliest model of the right kind costs; the model a
    // task will use is only known once its input is read.
    let max_cost = |want: fn(&ModelKind) -> bool| {
        models
            .engines()
            .iter()
            .filter(|e| want(e.kind()))
            .map(cost)
            .max()
            .unwrap_or(0)
    };
    let embed_cost = max_cost(|k| matches!(k, ModelKind::Embedder(_)));
    let rerank_cost = max_cost(|k| matches!(k, ModelKind::CrossEncoder(_)));
    let resident: u64 = models
        .engines()
        .iter()
        .map(|e| e.kind().weight_bytes(dtype_bytes(e)))
        .sum();
    let headroom = args
        .headroom_bytes(gpu.total_memory)
        .map_err(RuntimeError::Config)?;
    tracing::info!(gpu_uuid = %gpu.uuid, embed_bytes = embed_cost, rerank_bytes = rerank_cost,
        resident_bytes = resident, headroom_bytes = headroom, cap = args.max_concurrent_per_card,
        "card admission budget");
    let estimates = [
        (activity::EMBED.to_owned(), embed_cost),
        (activity::RERANK.to_owned(), rerank_cost),
    ]
    .into_iter()
    .collect();
    Ok(CardBudget::new(
        &gpu.uuid,
        gpu.total_memory,
        BudgetOptions {
            headroom,
            cap: args.max_concurrent_per_card,
            // NVML sees weights once they are loaded on a real card; simulated cards
            // and `gpulane admission` (which loads nothing on the card) must count them.
            unseen_resident: if gpu.simulated || !weights_on_card {
                resident
            } else {
                0
            },
            estimates,
        },
        metrics,
    ))
}

struct Lane {
    queue: String,
    worker: Arc<Worker>,
}

async fn run(args: RunArgs) -> Result<(), RuntimeError> {
    let host = host_name(&args.devices);
    let models = resolve_models(&args.models).await?;
    let inv = inventory(&args.devices)?;
    let plans = plan(
        &host,
        inv.devices(),
        &args.devices.gpu_selection(),
        args.devices.cpu_lane,
    );
    if plans.is_empty() {
        return Err(RuntimeError::Config(
            "no lanes to serve: no GPU is selected and --cpu-lane is off".to_owned(),
        ));
    }
    let limits = Limits {
        max_texts: args.max_texts,
        max_text_chars: args.max_text_chars,
        max_total_chars: args.max_total_chars,
        max_result_bytes: args.max_result_bytes,
    };

    let metrics = Arc::new(Metrics::default());
    if args.metrics_address != "off" {
        let listener = tokio::net::TcpListener::bind(&args.metrics_address)
            .await
            .map_err(|e| {
                RuntimeError::Config(format!(
                    "--metrics-address {}: {e}; pick a free port or pass `off`",
                    args.metrics_address
                ))
            })?;
        let bound = listener
            .local_addr()
            .map(|a| a.to_string())
            .unwrap_or_default();
        tracing::info!(address = %bound, "metrics and health on http://{bound}/metrics");
        tokio::spawn(metrics::serve(listener, metrics.clone()));
    }

    // Load every model on every device before touching Temporal: a worker that cannot
    // serve what it declares must not take tasks.
    let mut devices = Vec::new();
    for p in &plans {
        let device = engine_device(p)?;
        let on_cpu = matches!(device, EngineDevice::Cpu);
        let mut engines = Vec::new();
        for m in models
            .iter()
            .filter(|m| if p.gpu.is_some() { m.on_gpu } else { m.on_cpu })
        {
            let opts = EngineOptions {
                // The CPU (and simulated cards) always compute in f32.
                dtype: if on_cpu { DType::F32 } else { m.dtype },
                batch_tokens: m.batch_tokens,
                batch_rows: Some(args.batch_rows),
                batch_wait: Duration::from_millis(args.batch_wait_ms),
            };
            let engine = Engine::start(&m.name, &m.path, &device, opts).map_err(|source| {
                RuntimeError::Model {
                    name: m.name.clone(),
                    device: p.label().to_owned(),
                    source: Box::new(source),
                }
            })?;
            match engine.kind() {
                ModelKind::Embedder(info) => tracing::info!(model = %m.name,
                    path = %m.path.display(), device = p.label(), kind = "embedder",
                    architecture = %info.architecture, pooling = info.pooling.as_str(),
                    max_seq_length = info.max_seq_length, dimensions = info.dimensions,
                    "model loaded"),
                ModelKind::CrossEncoder(info) => tracing::info!(model = %m.name,
                    path = %m.path.display(), device = p.label(), kind = "cross-encoder",
                    architecture = %info.architecture, max_length = info.max_length,
                    "model loaded"),
            }
            metrics.watch_engine(p.label(), &engine);
            engines.push(engine);
        }
        if engines.is_empty() {
            return Err(RuntimeError::Config(format!(
                "no declared model serves the {} lane ({}): add it to a model's lanes or turn the lane off",
                if p.gpu.is_some() { "gpu" } else { "cpu" },
                p.label()
            )));
        }
        let acts = DeviceActivities::new(
            ModelSet::new(engines),
            p.device_info(),
            p.host_queue.clone(),
            limits,
        );
        let budget = match &p.gpu {
            Some(g) => Some(card_budget(
                &args,
                g,
                acts.models(),
                &models,
                metrics.clone(),
                true,
            )?),
            None => None,
        };
        devices.push((p, acts, budget));
    }
    let budgets: Vec<Arc<CardBudget>> = devices.iter().filter_map(|d| d.2.clone()).collect();
    if !budgets.is_empty() {
        tokio::spawn(refresh(
            budgets,
            inv.clone(),
            Duration::from_millis(args.memory_refresh_ms.max(10)),
        ));
    }

    let identity_base = args
        .identity
        .clone()
        .unwrap_or_else(|| format!("gpulane@{host}:{}", std::process::id()));
    tracing::debug!(address = %args.address, "connecting");
    let connection = crate::temporal::connect(&args, &identity_base).await?;
    tracing::debug!("connected");
    // No core logger: with one, core installs its own tracing subscriber on this thread
    // and gpulane's own log lines disappear. Core's events reach our subscriber instead.
    let core = CoreRuntime::new_assume_tokio(
        RuntimeOptions::builder()
            .telemetry_options(TelemetryOptions::builder().build())
            .build()
            .map_err(RuntimeError::Config)?,
    )
    .map_err(|e| RuntimeError::Config(format!("starting sdk-core: {e}")))?;

    // Both CPU lanes share one fixed pool of --max-concurrent-cpu slots. Not core's
    // resource-based tuner: it stops issuing slots while CPU use is over its target, and
    // a CPU inference worker keeps the CPU busy by design, so it starved the engine of
    // the concurrent activities it batches (and ramped up at one slot per 50 ms).
    // Waiting activities cost little memory: they hold token ids, not activations.
    let cpu_tuner: Arc<dyn WorkerTuner + Send + Sync> = Arc::new(
        TunerHolderOptions::builder()
            .activity_slot_options(SlotSupplierOptions::FixedSize {
                slots: args.max_concurrent_cpu,
            })
            .build_tuner_holder()
            .map_err(|e| RuntimeError::Config(format!("CPU lane slots: {e}")))?,
    );
    let activity_types = DeviceActivities::activity_types();
    let mut lanes = Vec::new();
    let mut tasks = tokio::task::JoinSet::new();
    for (p, acts, budget) in &devices {
        for queue in &p.queues {
            let tuner: Arc<dyn WorkerTuner + Send + Sync> = match budget {
                Some(b) => Arc::new(
                    TunerHolderOptions::builder()
                        .activity_slot_options(SlotSupplierOptions::Custom(Arc::new(
                            b.lane(queue, &activity_types),
                        )))
                        .build_tuner_holder()
                        .map_err(|e| RuntimeError::Worker {
                            queue: queue.clone(),
                            source: e.into(),
                        })?,
                ),
                None => cpu_tuner.clone(),
            };
            let config = WorkerConfig::builder()
                .namespace(args.namespace.clone())
                .task_queue(queue.clone())
                .task_types(WorkerTaskTypes::activity_only())
                .versioning_strategy(WorkerVersioningStrategy::None {
                    build_id: format!("gpulane-{}", env!("CARGO_PKG_VERSION")),
                })
                .client_identity_override(format!("{identity_base}/{queue}"))
                .tuner(tuner)
                .activity_task_poller_behavior(PollerBehavior::SimpleMaximum(2))
                .graceful_shutdown_period(Duration::from_secs(args.graceful_shutdown_secs))
                // Several cards of this host poll the shared gpu-tools queue through one
                // connection; core refuses that unless told it is intended.
                .skip_client_worker_set_check(true)
                .build()
                .map_err(|e| RuntimeError::Worker {
                    queue: queue.clone(),
                    source: e.into(),
                })?;
            let worker = init_worker(&core, config, connection.clone()).map_err(|e| {
                RuntimeError::Worker {
                    queue: queue.clone(),
                    source: e.into(),
                }
            })?;
            tracing::debug!(task_queue = %queue, "validating worker");
            worker.validate().await.map_err(|e| RuntimeError::Worker {
                queue: queue.clone(),
                source: Box::new(e),
            })?;
            let worker = Arc::new(worker);
            tasks.spawn(serve_lane(
                worker.clone(),
                acts.clone(),
                queue.clone(),
                budget.clone(),
            ));
            tracing::info!(task_queue = %queue, device = p.label(),
                simulated = p.gpu.as_ref().is_some_and(|g| g.simulated), "lane polling");
            lanes.push(Lane {
                queue: queue.clone(),
                worker,
            });
        }
    }
    let queues: Vec<&str> = lanes.iter().map(|l| l.queue.as_str()).collect();
    metrics.set_ready();
    tracing::info!(namespace = %args.namespace, address = %args.address, inventory = inv.source(),
        ?queues, "gpulane ready");

    let failed = tokio::select! {
        _ = stop_signal() => { tracing::info!("stop requested; finishing running activities"); None }
        Some(res) = tasks.join_next() => Some(res),
    };
    for lane in &lanes {
        lane.worker.initiate_shutdown();
    }
    while let Some(res) = tasks.join_next().await {
        if let Ok(Err(e)) = res {
            tracing::error!(error = %e, "lane stopped with an error");
        }
    }
    for lane in lanes {
        lane.worker.shutdown().await;
        if let Ok(worker) = Arc::try_unwrap(lane.worker) {
            worker.finalize_shutdown().await;
        }
    }
    tracing::info!("gpulane stopped");
    match failed {
        Some(Ok(Err(e))) => Err(e),
        _ => Ok(()),
    }
}

async fn stop_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("installing a SIGTERM handler cannot fail on Unix; this is a bug");
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}
