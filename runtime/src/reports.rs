//! The report commands, which connect to nothing: `gpulane devices` (inventory and queue
//! names), `gpulane models` (what would load) and `gpulane admission` (what a card would
//! admit now).

use std::sync::Arc;

use gpulane_models::ModelKind;
use gpulane_proto::activity;

use crate::{
    admission::MemoryBudget,
    config::{CpuLane, DeviceArgs, ModelArgs, RunArgs},
    lanes::plan,
    registry::ModelSpec,
    settings::{DeviceSettings, Settings},
    startup::{card_budget, host, host_budget, inventory, resolve_models, start_on_cpu},
    RuntimeError,
};

/// `gpulane models`: loads each declared model on the CPU, as a worker would at start, and
/// lists it; a model that cannot load fails the command naming the file.
pub(crate) async fn print_models(args: &ModelArgs) -> Result<(), RuntimeError> {
    for m in resolve_models(args, false).await? {
        let engine = start_on_cpu(&m)?;
        let lanes = match (m.on_gpu, m.on_cpu) {
            (true, true) => "gpu,cpu",
            (true, false) => "gpu",
            _ => "cpu",
        };
        let id = engine.kind().identity();
        // The CPU computes in f32 or int8 (`cpu_dtype`); cards in the declared dtype.
        let cpu = if m.cpu_int8 { "int8" } else { "f32" };
        let dtype = match (m.on_gpu, m.on_cpu) {
            (true, true) => format!("gpu {} cpu {cpu}", m.dtype.as_str()),
            (true, false) => m.dtype.as_str().to_owned(),
            _ => cpu.to_owned(),
        };
        let common = format!(
            "{arch}  family {family}  dtype {dtype}  revision {rev}",
            arch = id.architecture,
            family = id.family.as_str(),
            rev = id.revision,
        );
        match engine.kind() {
            ModelKind::Embedder(i) => println!(
                "{name}  embedder  {common}  pooling {pool}{dense}{norm}  max length {len}  dimensions {dim}  lanes {lanes}  {path}",
                name = m.name,
                pool = i.pooling.as_str(),
                dense = i
                    .dense
                    .iter()
                    .map(|d| format!("+dense({d})"))
                    .collect::<String>(),
                norm = if i.normalize { "+normalize" } else { "" },
                len = i.max_seq_length,
                dim = i.dimensions,
                path = m.path.display(),
            ),
            ModelKind::CrossEncoder(i) => println!(
                "{name}  cross-encoder  {common}  max length {len}  lanes {lanes}  {path}",
                name = m.name,
                len = i.max_length,
                path = m.path.display(),
            ),
        }
    }
    Ok(())
}

/// `gpulane devices`.
pub(crate) fn print_devices(args: &DeviceArgs) {
    let report = || -> Result<(), RuntimeError> {
        let d = DeviceSettings::from_args(args)?;
        let inv = inventory(&d)?;
        println!("host: {}", d.host);
        println!("inventory: {}", inv.source());
        if inv.devices().is_empty() {
            println!("gpus: none");
        }
        for g in inv.devices() {
            let free = inv
                .free_memory(&g.uuid)
                .map(|b| format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64))
                .unwrap_or_else(|e| format!("unknown ({e})"));
            println!(
                "gpu {index}: {uuid}  {name}  total {total:.1} GiB  free {free}  cuda ordinal {ord}{sim}",
                index = g.index,
                uuid = g.uuid,
                name = g.name,
                total = g.total_memory as f64 / (1u64 << 30) as f64,
                ord = g.cuda_ordinal,
                sim = if g.simulated { "  (simulated)" } else { "" },
            );
        }
        println!("task queues served (plus gpu-tools@<model> / cpu-tools@<model> for models with a model queue):");
        for p in plan(&d.host, inv.devices(), &d.gpus, d.cpu_lane) {
            for l in p.lanes(&[]) {
                println!("  {}  ({})", l.queue, p.label());
            }
        }
        Ok(())
    };
    if let Err(e) = report() {
        println!("error: {e}");
    }
}

/// `gpulane admission`: each selected card's budget, built as `run` builds it, fed one
/// memory reading taken now, and how many activities of each type it would admit; then
/// the host's, for the CPU lanes. The models load on the CPU (only their sizes matter), so
/// their weights are counted as memory a card would still lose. One `key=value` line per
/// device, for scripts.
pub(crate) async fn print_admission(args: &RunArgs) -> Result<(), RuntimeError> {
    let settings = Settings::from_args(args)?;
    let specs = resolve_models(&args.models, false).await?;
    let inv = inventory(&settings.devices)?;
    let d = &settings.devices;
    let cards: Vec<_> = plan(&d.host, inv.devices(), &d.gpus, CpuLane::Off)
        .into_iter()
        .filter_map(|p| p.gpu)
        .collect();
    let load = |on: fn(&ModelSpec) -> bool| {
        specs
            .iter()
            .filter(|m| on(m))
            .map(|m| Ok((m.clone(), start_on_cpu(m)?)))
            .collect::<Result<Vec<(ModelSpec, _)>, RuntimeError>>()
    };
    if cards.is_empty() {
        println!("gpus: none (inventory: {})", inv.source());
    } else {
        let engines = load(|m| m.on_gpu)?;
        if engines.is_empty() {
            return Err(RuntimeError::Config(
                "no declared model serves the gpu lanes".to_owned(),
            ));
        }
        for g in &cards {
            let budget = card_budget(&settings, g, &engines, Arc::default(), false)?;
            let reading = inv.free_memory(&g.uuid);
            budget.set_reading(reading, inv.own_usage(&g.uuid));
            print_budget(&format!("gpu {} {}", g.index, g.uuid), &budget);
        }
    }
    let engines = load(|m| m.on_cpu)?;
    if !engines.is_empty() {
        let host = host(d, settings.max_dataset)?;
        let budget = host_budget(&settings, &host, &engines, Arc::default());
        budget.set_reading(host.memory.available(), host.memory.own_usage());
        print_budget(&format!("host {}", host.memory.source()), &budget);
        // Read into host memory whichever device embeds them, by every lane together.
        println!("  datasets max_bytes={}", host.datasets.bytes());
    }
    Ok(())
}

/// One device's budget as `gpulane admission` prints it.
fn print_budget(head: &str, budget: &MemoryBudget) {
    let snap = budget.snapshot();
    // An activity no model on the device serves is admitted by nothing.
    let admits = |activity: &str| {
        if !snap.by_activity.contains_key(activity) {
            return "none (no model serves it)".to_owned();
        }
        budget
            .would_admit(activity)
            .map_or_else(|e| format!("none ({e})"), |n| n.to_string())
    };
    println!(
        "{head} total_bytes={total} free_bytes={free} others_bytes={others} \
         headroom_bytes={headroom} weights_bytes={weights} reserve_bytes={reserve} \
         admit_embed={ae} admit_rerank={ar}",
        total = snap.total,
        free = snap
            .free
            .as_ref()
            .map_or_else(|e| format!("error ({e})"), u64::to_string),
        others = snap
            .others
            .map_or_else(|| "?".to_owned(), |b| b.to_string()),
        headroom = snap.headroom,
        weights = snap.weights,
        reserve = snap.reserve,
        ae = admits(activity::EMBED),
        ar = admits(activity::RERANK),
    );
    for (model, bytes) in &snap.estimates {
        println!("  model {model} working_set_bytes={bytes}");
    }
    for (activity, bytes) in &snap.waiting_rows {
        println!("  activity {activity} waiting_rows_bytes={bytes}");
    }
}
