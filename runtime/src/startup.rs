//! Start-up: the models a worker declares, the device inventory, and each device made
//! ready to serve: its engines loaded (paired with the declaration they came from), its
//! activities, and its admission budget (a card's memory, or the host's for the CPU lane). Used by `gpulane run`, by the
//! reports (`models`, `admission`, `bench`), and again when a card that could not be read
//! at start recovers.

use std::sync::Arc;

use gpulane_activities::{DatasetMemory, DeviceActivities, ModelSet};
use gpulane_models::{DType, Engine, EngineDevice, EngineOptions, ModelKind, Tokenizing};
use gpulane_proto::activity;

use crate::{
    admission::{BudgetOf, BudgetOptions, EngineCost, MemoryBudget},
    config::ModelArgs,
    devices::{
        DeviceError, DeviceInventory, GpuDevice, HostMemory, NvmlInventory, SimulatedHost,
        SimulatedInventory, SysinfoHost,
    },
    lanes::{DevicePlan, LanePlan},
    metrics::Metrics,
    registry::{declarations, resolve, ModelSpec},
    settings::{DeviceSettings, Headroom, Settings},
    RuntimeError,
};

/// The declared models, resolved to directories; `model_queues` is the default of each
/// one's `model_queue`.
pub(crate) async fn resolve_models(
    args: &ModelArgs,
    model_queues: bool,
) -> Result<Vec<ModelSpec>, RuntimeError> {
    resolve(declarations(args)?, &args.hub, model_queues).await
}

/// Loads `m` on the CPU with default options (in int8 where its CPU lanes run it so), as
/// the listings and estimates need it.
pub(crate) fn start_on_cpu(m: &ModelSpec) -> Result<Engine, RuntimeError> {
    Engine::start(
        &m.name,
        &m.path,
        &EngineDevice::Cpu,
        EngineOptions {
            int8: m.on_cpu && m.cpu_int8,
            ..EngineOptions::default()
        },
    )
    .map_err(|source| RuntimeError::Model {
        name: m.name.clone(),
        device: "cpu".to_owned(),
        source: Box::new(source),
    })
}

/// The machine's cards when NVML is missing: none.
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
    fn probe(&self, card: &GpuDevice) -> Result<GpuDevice, DeviceError> {
        Err(DeviceError::UnknownDevice(card.uuid.clone()))
    }
}

/// The inventory the settings ask for. A machine without NVML (or without cards) is
/// normal: it logs why and returns an empty inventory.
pub(crate) fn inventory(d: &DeviceSettings) -> Result<Arc<dyn DeviceInventory>, RuntimeError> {
    let visible = d.cuda_visible_devices.as_deref();
    if let Some((count, bytes)) = d.simulate {
        tracing::warn!(
            count,
            bytes,
            "simulated GPUs declared by --simulate-gpus: they compute on the CPU"
        );
        return Ok(Arc::new(
            SimulatedInventory::new(count, bytes, d.simulated_id.as_deref())
                .with_visible(visible)
                .with_memory_file(d.simulated_memory.clone()),
        ));
    }
    match NvmlInventory::open(d.nvml_lib.as_deref().map(|p| p.as_os_str()), visible) {
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

/// The host as every device's engines share it: its memory, the tokenizing slots
/// (tokenization runs on the host, whichever device runs the model), and the memory
/// dataset jobs read their sources into (likewise the host's, whichever device embeds).
#[derive(Clone)]
pub(crate) struct Host {
    pub memory: Arc<dyn HostMemory>,
    pub tokenizing: Arc<Tokenizing>,
    pub datasets: DatasetMemory,
}

/// Most calls tokenizing at once. Each call's `encode_batch` already spreads over the
/// cores, so more slots than cores buy nothing, and each slot is memory the host keeps.
const MOST_TOKENIZING: usize = 4;

/// The host the settings ask for: `--simulated-host-memory`, else the machine's memory
/// through `sysinfo`, with `max_dataset` of it for dataset jobs.
pub(crate) fn host(d: &DeviceSettings, max_dataset: Headroom) -> Result<Host, RuntimeError> {
    let memory: Arc<dyn HostMemory> = match d.simulated_host {
        Some(bytes) => {
            tracing::warn!(
                bytes,
                "simulated host memory declared by --simulated-host-memory"
            );
            Arc::new(SimulatedHost::new(bytes, d.simulated_memory.clone()))
        }
        None => Arc::new(SysinfoHost::new()?),
    };
    let slots = std::thread::available_parallelism()
        .map_or(1, usize::from)
        .min(MOST_TOKENIZING);
    let datasets = DatasetMemory::new(max_dataset.bytes(memory.total()));
    tracing::info!(
        source = memory.source(),
        total_bytes = memory.total(),
        tokenizing_slots = slots,
        dataset_bytes = datasets.bytes(),
        "host memory"
    );
    Ok(Host {
        tokenizing: Tokenizing::new(slots, memory.engine_memory()),
        memory,
        datasets,
    })
}

/// Where a device's engines run: the CPU for the CPU lane and simulated cards, the card
/// (by its verified CUDA ordinal) with the `cuda` build, else a refusal that says why.
pub(crate) fn engine_device(plan: &DevicePlan) -> Result<EngineDevice, RuntimeError> {
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

/// A card that could not be read at start (or since), with why: not served, shown in
/// `gpulane status`, and retried in the background.
#[derive(Debug, Clone)]
pub(crate) struct BrokenCard {
    pub plan: DevicePlan,
    pub error: String,
}

/// Splits the planned cards into those readable now and those that are not: a card whose
/// first memory reading fails is set aside instead of stopping the whole worker.
pub(crate) fn check_cards(
    plans: Vec<DevicePlan>,
    inventory: &dyn DeviceInventory,
) -> (Vec<DevicePlan>, Vec<BrokenCard>) {
    let mut ok = Vec::new();
    let mut broken = Vec::new();
    for p in plans {
        let error = match &p.gpu {
            None => None,
            Some(g) if g.total_memory == 0 => {
                Some("its total memory could not be read at start".to_owned())
            }
            Some(g) => inventory.free_memory(&g.uuid).err().map(|e| e.to_string()),
        };
        match error {
            None => ok.push(p),
            Some(error) => {
                tracing::error!(gpu_uuid = p.label(), %error,
                    "cannot read this card: serving the others; retrying it in the background");
                broken.push(BrokenCard { plan: p, error });
            }
        }
    }
    (ok, broken)
}

/// One device made ready to serve.
pub(crate) struct DeviceSetup {
    pub plan: DevicePlan,
    /// Each engine with the declaration it was loaded from.
    pub engines: Vec<(ModelSpec, Engine)>,
    pub activities: DeviceActivities,
    pub budget: Arc<MemoryBudget>,
    pub lanes: Vec<LanePlan>,
}

/// Loads every model this device serves and builds its activities, budget and lanes.
/// Blocking (model loading): run it off the async runtime.
pub(crate) fn load_device(
    plan: DevicePlan,
    models: &[ModelSpec],
    settings: &Settings,
    metrics: &Arc<Metrics>,
    inventory: &dyn DeviceInventory,
    host: &Host,
) -> Result<DeviceSetup, RuntimeError> {
    let device = engine_device(&plan)?;
    let on_cpu = matches!(device, EngineDevice::Cpu);
    // A simulated card (or host) accounts what its engines hold (see
    // devices/simulated.rs); if a later model fails to load, the weights held so far go
    // back with the engines.
    let memory = match &plan.gpu {
        Some(g) => inventory.engine_memory(&g.uuid),
        None => host.memory.engine_memory(),
    };
    let mut held = HeldWeights(memory.clone(), 0);
    let mut engines = Vec::new();
    for m in models.iter().filter(|m| {
        if plan.gpu.is_some() {
            m.on_gpu
        } else {
            m.on_cpu
        }
    }) {
        let opts = EngineOptions {
            // The CPU (and simulated cards) always compute in f32.
            dtype: if on_cpu { DType::F32 } else { m.dtype },
            // Simulated cards run on the CPU too, but stand for cards: f32, never int8.
            int8: on_cpu && plan.gpu.is_none() && m.cpu_int8,
            attention: settings.gpu_attention,
            batch_tokens: m.batch_tokens,
            batch_rows: Some(settings.batch_rows),
            batch_wait: settings.batch_wait,
            observer: Some(metrics.engine(plan.label(), &m.name)),
            fault_hooks: settings.test_faults,
            memory: memory.clone(),
            tokenizing: Some(host.tokenizing.clone()),
        };
        let engine = Engine::start(&m.name, &m.path, &device, opts).map_err(|source| {
            RuntimeError::Model {
                name: m.name.clone(),
                device: plan.label().to_owned(),
                source: Box::new(source),
            }
        })?;
        if let Some(mem) = &memory {
            let bytes = engine.kind().weight_bytes(4);
            mem.hold(bytes);
            held.1 += bytes;
        }
        match engine.kind() {
            ModelKind::Embedder(info) => tracing::info!(model = %m.name,
                path = %m.path.display(), device = plan.label(), kind = "embedder",
                architecture = %info.identity.architecture,
                family = info.identity.family.as_str(), revision = %info.identity.revision,
                pooling = info.pooling.as_str(),
                max_seq_length = info.max_seq_length, dimensions = info.dimensions,
                "model loaded"),
            ModelKind::CrossEncoder(info) => tracing::info!(model = %m.name,
                path = %m.path.display(), device = plan.label(), kind = "cross-encoder",
                architecture = %info.identity.architecture,
                family = info.identity.family.as_str(), revision = %info.identity.revision,
                max_length = info.max_length,
                "model loaded"),
        }
        engines.push((m.clone(), engine));
    }
    if engines.is_empty() {
        return Err(RuntimeError::Config(format!(
            "no declared model serves the {} lane ({}): add it to a model's lanes or turn the lane off",
            if plan.gpu.is_some() { "gpu" } else { "cpu" },
            plan.label()
        )));
    }
    let budget = match &plan.gpu {
        Some(g) => card_budget(settings, g, &engines, metrics.clone(), true)?,
        None => host_budget(settings, host, &engines, metrics.clone()),
    };
    let model_queues: Vec<&str> = engines
        .iter()
        .filter(|(m, _)| m.model_queue)
        .map(|(m, _)| m.name.as_str())
        .collect();
    let lanes = plan.lanes(&model_queues);
    let activities = DeviceActivities::new(
        ModelSet::new(engines.iter().map(|(_, e)| e.clone()).collect()),
        plan.device_info(),
        plan.host_queue.clone(),
        settings.limits,
    )
    .with_fault_hooks(settings.test_faults)
    .with_datasets(
        settings.data_roots.clone(),
        host.datasets.clone(),
        Some(metrics.datasets(plan.label())),
    );
    // Loaded whole: the weights stay held as long as the engines.
    held.1 = 0;
    Ok(DeviceSetup {
        plan,
        engines,
        activities,
        budget,
        lanes,
    })
}

/// Weights held on a simulated card by a device still loading: given back unless the
/// device loads whole (its count is then set to 0, and they stay for the engines' life).
struct HeldWeights(Option<Arc<dyn gpulane_models::DeviceMemory>>, u64);

impl Drop for HeldWeights {
    fn drop(&mut self) {
        if let Some(mem) = &self.0 {
            mem.give_back(self.1);
        }
    }
}

/// The admission budget of one card: each engine's working set from its model's cost
/// formula (or its override), the weights, each task's waiting rows, the headroom and the
/// cap. `weights_in_reading`: whether the card's memory reading holds the weights (false
/// in `gpulane admission`, which loads nothing on the card).
pub(crate) fn card_budget(
    settings: &Settings,
    gpu: &GpuDevice,
    engines: &[(ModelSpec, Engine)],
    metrics: Arc<Metrics>,
    weights_in_reading: bool,
) -> Result<Arc<MemoryBudget>, RuntimeError> {
    for (name, _) in &settings.vram_costs {
        if !engines.iter().any(|(s, _)| &s.name == name) {
            return Err(RuntimeError::Config(format!(
                "--vram-cost names {name:?}, which is not a served model ({:?})",
                engines.iter().map(|(s, _)| &s.name).collect::<Vec<_>>()
            )));
        }
    }
    let costs = engine_costs(engines, |spec, engine| {
        settings
            .vram_costs
            .iter()
            .find(|(n, _)| *n == spec.name)
            .map(|(_, b)| *b)
            .or(spec.vram_cost)
            .unwrap_or_else(|| engine.kind().working_bytes(card_dtype_bytes(gpu, spec)))
    });
    let weights: u64 = engines
        .iter()
        .map(|(s, e)| e.kind().weight_bytes(card_dtype_bytes(gpu, s)))
        .sum();
    let opts = BudgetOptions {
        headroom: settings.headroom.bytes(gpu.total_memory),
        cap: settings.max_concurrent_per_card,
        weights,
        reserve: 0,
        weights_in_reading,
        engines: costs,
        waiting_rows: waiting_rows(settings, engines, 0),
    };
    Ok(budget(
        BudgetOf::Card(gpu.uuid.clone()),
        gpu.total_memory,
        opts,
        metrics,
    ))
}

/// The CPU lanes' budget of the host's memory: as a card's (the engines compute in f32),
/// plus the tokenizing slots' peak kept once, and each task's input text, which the host
/// holds (as received and as decoded strings, at most 4 bytes a character each) while the
/// task runs.
pub(crate) fn host_budget(
    settings: &Settings,
    host: &Host,
    engines: &[(ModelSpec, Engine)],
    metrics: Arc<Metrics>,
) -> Arc<MemoryBudget> {
    let total = host.memory.total();
    let costs = engine_costs(engines, |_, engine| engine.kind().working_bytes(4));
    let max_chars = settings.limits.max_total_chars;
    let opts = BudgetOptions {
        headroom: settings.host_headroom.bytes(total),
        cap: settings.max_concurrent_cpu,
        weights: engines.iter().map(|(_, e)| e.kind().weight_bytes(4)).sum(),
        reserve: host.tokenizing.reserve(max_chars),
        weights_in_reading: true,
        engines: costs,
        waiting_rows: waiting_rows(settings, engines, 2 * 4 * max_chars as u64),
    };
    budget(BudgetOf::Host, total, opts, metrics)
}

/// Each engine as admission counts it, its working set from `working`.
fn engine_costs(
    engines: &[(ModelSpec, Engine)],
    working: impl Fn(&ModelSpec, &Engine) -> u64,
) -> Vec<EngineCost> {
    engines
        .iter()
        .map(|(spec, engine)| EngineCost {
            model: spec.name.clone(),
            serves: match engine.kind() {
                ModelKind::Embedder(_) => vec![
                    activity::EMBED.to_owned(),
                    activity::EMBED_DATASET.to_owned(),
                ],
                ModelKind::CrossEncoder(_) => vec![activity::RERANK.to_owned()],
            },
            working: working(spec, engine),
            load: engine.load(),
        })
        .collect()
}

/// Per task, by activity type: its rows waiting in an engine's queue as token ids and
/// masks (4 bytes each), at most --max-texts rows of the longest sequence a model of its
/// kind takes, plus `input` bytes more.
fn waiting_rows(
    settings: &Settings,
    engines: &[(ModelSpec, Engine)],
    input: u64,
) -> std::collections::HashMap<String, u64> {
    let waiting = |want: fn(&ModelKind) -> bool| {
        let longest = engines
            .iter()
            .filter(|(_, e)| want(e.kind()))
            .map(|(_, e)| match e.kind() {
                ModelKind::Embedder(i) => i.max_seq_length,
                ModelKind::CrossEncoder(i) => i.max_length,
            })
            .max()
            .unwrap_or(0) as u64;
        settings.limits.max_texts as u64 * longest * 8 + input
    };
    let embed_rows = waiting(|k| matches!(k, ModelKind::Embedder(_)));
    [
        (activity::EMBED.to_owned(), embed_rows),
        (activity::EMBED_DATASET.to_owned(), embed_rows),
        (
            activity::RERANK.to_owned(),
            waiting(|k| matches!(k, ModelKind::CrossEncoder(_))),
        ),
    ]
    .into_iter()
    .collect()
}

/// A budget for `of`, logged as it is set.
fn budget(
    of: BudgetOf,
    total: u64,
    opts: BudgetOptions,
    metrics: Arc<Metrics>,
) -> Arc<MemoryBudget> {
    for c in &opts.engines {
        tracing::info!(budget = %of, model = %c.model, working_bytes = c.working,
            "admission: working set per forward pass");
    }
    tracing::info!(budget = %of, total_bytes = total, weights_bytes = opts.weights,
        reserve_bytes = opts.reserve, headroom_bytes = opts.headroom,
        embed_waiting_rows_bytes = opts.waiting_rows.get(activity::EMBED).copied().unwrap_or(0),
        cap = opts.cap, "admission budget");
    MemoryBudget::new(of, total, opts, metrics)
}

/// Bytes per value of `spec` on `gpu`: simulated cards compute on the CPU in f32, real
/// cards in the model's dtype.
fn card_dtype_bytes(gpu: &GpuDevice, spec: &ModelSpec) -> u64 {
    if gpu.simulated {
        4
    } else {
        spec.dtype.size_in_bytes() as u64
    }
}
