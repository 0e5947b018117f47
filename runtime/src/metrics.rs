//! Every metric gpulane exports, declared once here, rendered in Prometheus text format,
//! and served with health endpoints. Names and labels follow DCGM / Temporal style
//! (`gpu_uuid`, `task_queue`, `activity_type`); what runs on a device rather than on a
//! card's budget is labelled `device` (a card's UUID, or `cpu`) and `model`.

use std::{
    collections::BTreeMap,
    fmt::Write,
    sync::{atomic::AtomicBool, atomic::Ordering, Arc, Mutex},
};

use gpulane_models::{BatchCounters, Engine};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpListener,
};

/// Label keys.
const GPU_UUID: &str = "gpu_uuid";
const TASK_QUEUE: &str = "task_queue";
const ACTIVITY_TYPE: &str = "activity_type";
/// A card's UUID, or `cpu`, for what runs on a device rather than a card's budget.
const DEVICE: &str = "device";
const MODEL: &str = "model";

/// (name, type, help) of every family.
const FAMILIES: &[(&str, &str, &str)] = &[
    (
        "gpulane_gpu_memory_total_bytes",
        "gauge",
        "Total memory of the card, bytes.",
    ),
    (
        "gpulane_gpu_memory_free_bytes",
        "gauge",
        "Free memory of the card at the last reading (NVML or the simulation file), bytes.",
    ),
    (
        "gpulane_gpu_memory_reserved_bytes",
        "gauge",
        "Memory promised to outstanding permits, bytes.",
    ),
    (
        "gpulane_gpu_admitting",
        "gauge",
        "1 while the card admits work, 0 while its memory reading fails.",
    ),
    (
        "gpulane_permits_issued_total",
        "counter",
        "Slot permits issued, per lane.",
    ),
    (
        "gpulane_permits_used_total",
        "counter",
        "Slot permits that received a task, per lane and activity type.",
    ),
    (
        "gpulane_memory_wait_seconds_total",
        "counter",
        "Seconds lanes spent waiting for card memory before polling.",
    ),
    (
        "gpulane_gpu_out_of_memory_total",
        "counter",
        "Tasks that ran out of card memory, per activity type.",
    ),
    (
        "gpulane_batches_total",
        "counter",
        "Forward passes an engine ran, per device and model (rows_total / batches_total is the mean batch).",
    ),
    (
        "gpulane_batch_rows_total",
        "counter",
        "Texts or (query, document) pairs through forward passes, per device and model.",
    ),
    (
        "gpulane_batch_tokens_total",
        "counter",
        "Tokens through forward passes (special tokens included, padding not), per device and model.",
    ),
    (
        "gpulane_batch_seconds_total",
        "counter",
        "Seconds engines spent in forward passes, per device and model (its rate is the engine's busy fraction).",
    ),
];

type Labels = Vec<(&'static str, String)>;

/// The process's metrics registry.
#[derive(Default)]
pub(crate) struct Metrics {
    values: Mutex<BTreeMap<(&'static str, Labels), f64>>,
    ready: AtomicBool,
    /// Engines' batch counters, read at each scrape, with their device and model labels;
    /// the counters only, so metrics never keep an engine alive.
    engines: Mutex<Vec<(Labels, Arc<BatchCounters>)>>,
}

impl Metrics {
    fn set(&self, name: &'static str, labels: Labels, v: f64) {
        debug_assert!(
            FAMILIES.iter().any(|f| f.0 == name),
            "undeclared metric {name}"
        );
        self.values
            .lock()
            .expect("metrics lock poisoned; this is a bug")
            .insert((name, labels), v);
    }

    fn add(&self, name: &'static str, labels: Labels, v: f64) {
        debug_assert!(
            FAMILIES.iter().any(|f| f.0 == name),
            "undeclared metric {name}"
        );
        *self
            .values
            .lock()
            .expect("metrics lock poisoned; this is a bug")
            .entry((name, labels))
            .or_default() += v;
    }

    /// A card's memory picture: total, last free reading, reserved for permits.
    pub(crate) fn gpu_memory(&self, uuid: &str, total: u64, free: Option<u64>, reserved: u64) {
        let l = || vec![(GPU_UUID, uuid.to_owned())];
        self.set("gpulane_gpu_memory_total_bytes", l(), total as f64);
        if let Some(free) = free {
            self.set("gpulane_gpu_memory_free_bytes", l(), free as f64);
        }
        self.set("gpulane_gpu_memory_reserved_bytes", l(), reserved as f64);
        self.set(
            "gpulane_gpu_admitting",
            l(),
            if free.is_some() { 1.0 } else { 0.0 },
        );
    }

    /// A permit was issued to a lane.
    pub(crate) fn permit_issued(&self, uuid: &str, queue: &str) {
        let l = vec![(GPU_UUID, uuid.to_owned()), (TASK_QUEUE, queue.to_owned())];
        self.add("gpulane_permits_issued_total", l, 1.0);
    }

    /// A lane's permit received a task.
    pub(crate) fn permit_used(&self, uuid: &str, queue: &str, activity_type: &str) {
        let l = vec![
            (GPU_UUID, uuid.to_owned()),
            (TASK_QUEUE, queue.to_owned()),
            (ACTIVITY_TYPE, activity_type.to_owned()),
        ];
        self.add("gpulane_permits_used_total", l, 1.0);
    }

    /// A lane waited `secs` for card memory.
    pub(crate) fn memory_wait(&self, uuid: &str, queue: &str, secs: f64) {
        let l = vec![(GPU_UUID, uuid.to_owned()), (TASK_QUEUE, queue.to_owned())];
        self.add("gpulane_memory_wait_seconds_total", l, secs);
    }

    /// A task ran out of card memory.
    pub(crate) fn out_of_memory(&self, uuid: &str, activity_type: &str) {
        let l = vec![
            (GPU_UUID, uuid.to_owned()),
            (ACTIVITY_TYPE, activity_type.to_owned()),
        ];
        self.add("gpulane_gpu_out_of_memory_total", l, 1.0);
    }

    /// Exports `engine`'s batch counters, labelled with `device` (a card's UUID or `cpu`)
    /// and its model's name; they are read at each scrape.
    pub(crate) fn watch_engine(&self, device: &str, engine: &Engine) {
        let labels = vec![
            (DEVICE, device.to_owned()),
            (MODEL, engine.name().to_owned()),
        ];
        self.engines
            .lock()
            .expect("metrics lock poisoned; this is a bug")
            .push((labels, engine.counters()));
    }

    /// Copies every watched engine's batch totals into the registry.
    fn read_engines(&self) {
        let engines = self
            .engines
            .lock()
            .expect("metrics lock poisoned; this is a bug");
        for (labels, counters) in engines.iter() {
            let t = counters.totals();
            let l = || labels.clone();
            self.set("gpulane_batches_total", l(), t.batches as f64);
            self.set("gpulane_batch_rows_total", l(), t.rows as f64);
            self.set("gpulane_batch_tokens_total", l(), t.tokens as f64);
            self.set("gpulane_batch_seconds_total", l(), t.seconds);
        }
    }

    /// Marks the worker ready (every lane polling) for `/readyz`.
    pub(crate) fn set_ready(&self) {
        self.ready.store(true, Ordering::Relaxed);
    }

    /// The Prometheus text exposition of every value.
    pub(crate) fn render(&self) -> String {
        self.read_engines();
        let values = self
            .values
            .lock()
            .expect("metrics lock poisoned; this is a bug");
        let mut out = String::new();
        for (name, kind, help) in FAMILIES {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for ((n, labels), v) in values.iter() {
                if n != name {
                    continue;
                }
                let labels: Vec<String> = labels
                    .iter()
                    .map(|(k, v)| {
                        format!("{k}=\"{}\"", v.replace('\\', "\\\\").replace('"', "\\\""))
                    })
                    .collect();
                let _ = writeln!(out, "{name}{{{}}} {v}", labels.join(","));
            }
        }
        out
    }
}

/// Serves `/metrics`, `/healthz` (the process is up) and `/readyz` (every lane polls) on
/// `listener` until the process ends. A deliberately small HTTP/1.0 responder: one request
/// per connection, no keep-alive, which is all Prometheus and probes need.
pub(crate) async fn serve(listener: TcpListener, metrics: Arc<Metrics>) {
    loop {
        let Ok((mut sock, _)) = listener.accept().await else {
            continue;
        };
        let metrics = metrics.clone();
        tokio::spawn(async move {
            let mut buf = [0u8; 2048];
            let n = sock.read(&mut buf).await.unwrap_or(0);
            let request = String::from_utf8_lossy(&buf[..n]);
            let path = request.split_whitespace().nth(1).unwrap_or("/");
            let (status, body) = match path {
                "/metrics" => ("200 OK", metrics.render()),
                "/healthz" => ("200 OK", "ok\n".to_owned()),
                "/readyz" if metrics.ready.load(Ordering::Relaxed) => {
                    ("200 OK", "ready\n".to_owned())
                }
                "/readyz" => ("503 Service Unavailable", "starting\n".to_owned()),
                _ => (
                    "404 Not Found",
                    "try /metrics, /healthz or /readyz\n".to_owned(),
                ),
            };
            let head = format!(
                "HTTP/1.0 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\n\r\n",
                body.len()
            );
            let _ = sock.write_all(head.as_bytes()).await;
            let _ = sock.write_all(body.as_bytes()).await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_declared_families_with_labels() {
        let m = Metrics::default();
        m.gpu_memory("GPU-1", 100, Some(40), 10);
        m.permit_issued("GPU-1", "gpu-tools");
        m.permit_issued("GPU-1", "gpu-tools");
        m.memory_wait("GPU-1", "gpu-tools", 0.5);
        let text = m.render();
        assert!(text.contains("# TYPE gpulane_gpu_memory_free_bytes gauge"));
        assert!(text.contains("gpulane_gpu_memory_free_bytes{gpu_uuid=\"GPU-1\"} 40"));
        assert!(text.contains(
            "gpulane_permits_issued_total{gpu_uuid=\"GPU-1\",task_queue=\"gpu-tools\"} 2"
        ));
        assert!(text.contains("gpulane_gpu_admitting{gpu_uuid=\"GPU-1\"} 1"));
        m.gpu_memory("GPU-1", 100, None, 10);
        assert!(m
            .render()
            .contains("gpulane_gpu_admitting{gpu_uuid=\"GPU-1\"} 0"));
    }

    /// An engine's batch counters appear at each scrape, as they stand then.
    #[test]
    fn watched_engines_export_their_batch_counters() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../shared/fixtures/tiny-bert-cls");
        let engine = Engine::start(
            "tiny",
            &dir,
            &gpulane_models::EngineDevice::Cpu,
            Default::default(),
        )
        .unwrap();
        let m = Metrics::default();
        m.watch_engine("cpu", &engine);
        assert!(m
            .render()
            .contains("gpulane_batches_total{device=\"cpu\",model=\"tiny\"} 0"));
        let texts = vec!["one".to_owned(), "two words".to_owned()];
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(engine.embed(texts, Default::default(), &Default::default()))
            .unwrap();
        let text = m.render();
        assert!(
            text.contains("gpulane_batch_rows_total{device=\"cpu\",model=\"tiny\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("gpulane_batches_total{device=\"cpu\",model=\"tiny\"} 1"),
            "{text}"
        );
    }
}
