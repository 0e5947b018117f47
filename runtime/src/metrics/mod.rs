//! Every metric gpulane exports, declared once here on one `prometheus` registry, plus
//! sdk-core's own `temporal_*` worker metrics through [`CoreBridge`]; both are rendered
//! together at `/metrics`.
//!
//! Names and labels follow DCGM / Temporal style (`gpu_uuid`, `task_queue`,
//! `activity_type`); what runs on a device rather than on a card's budget is labelled
//! `device` (a card's UUID, or `cpu`) and `model`. Every label value comes from a set
//! this process owns: its lanes' queues, its cards, its models, the activity types it
//! serves (anything else is `other`), never a raw string from a task.

mod core;

use std::{
    sync::{Arc, OnceLock},
    time::Duration,
};

use gpulane_activities::{DatasetMemory, DatasetObserver, PartOutcome};
use gpulane_models::BatchObserver;
use gpulane_proto::activity;
use prometheus::{
    core::Collector, Encoder, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter,
    IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry, TextEncoder,
};

pub(crate) use self::core::CoreBridge;

/// The parts of one device's dataset jobs, into `gpulane_dataset_*`.
struct DatasetCounts {
    metrics: Arc<Metrics>,
    device: String,
}

impl DatasetObserver for DatasetCounts {
    fn part(&self, model: &str, outcome: PartOutcome, rows: usize) {
        let m = &self.metrics;
        m.dataset_parts
            .with_label_values(&[self.device.as_str(), model, outcome.as_str()])
            .inc();
        if outcome == PartOutcome::Written {
            m.dataset_rows
                .with_label_values(&[self.device.as_str(), model])
                .inc_by(rows as u64);
        }
    }

    fn memory_wait(&self, secs: f64) {
        self.metrics
            .dataset_memory_wait
            .with_label_values(&[self.device.as_str()])
            .inc_by(secs);
    }
}

/// Label keys.
const GPU_UUID: &str = "gpu_uuid";
const TASK_QUEUE: &str = "task_queue";
const ACTIVITY_TYPE: &str = "activity_type";
/// A card's UUID, or `cpu`, for what runs on a device rather than a card's budget.
const DEVICE: &str = "device";
const MODEL: &str = "model";
const OUTCOME: &str = "outcome";

/// The `activity_type` label of a task's type: one of the types gpulane serves, or
/// `other`, so a workflow cannot add series (or lines) by inventing types.
pub(crate) fn activity_label(activity_type: &str) -> &'static str {
    match activity_type {
        activity::EMBED => activity::EMBED,
        activity::RERANK => activity::RERANK,
        activity::EMBED_DATASET => activity::EMBED_DATASET,
        _ => "other",
    }
}

/// How an activity ended, for the duration histogram.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Outcome {
    Completed,
    Failed,
    Cancelled,
}

impl Outcome {
    fn label(self) -> &'static str {
        match self {
            Outcome::Completed => "completed",
            Outcome::Failed => "failed",
            Outcome::Cancelled => "cancelled",
        }
    }
}

/// The process's metrics.
pub(crate) struct Metrics {
    registry: Registry,
    core: Arc<CoreBridge>,
    gpu_total: GaugeVec,
    gpu_free: GaugeVec,
    gpu_reserved: GaugeVec,
    gpu_admitting: IntGaugeVec,
    host_total: prometheus::Gauge,
    host_available: prometheus::Gauge,
    host_reserved: prometheus::Gauge,
    host_admitting: IntGauge,
    host_memory_wait: prometheus::CounterVec,
    permits_issued: IntCounterVec,
    permits_used: IntCounterVec,
    memory_wait: prometheus::CounterVec,
    out_of_memory: IntCounterVec,
    batches: IntCounterVec,
    batch_rows: IntCounterVec,
    batch_tokens: IntCounterVec,
    batch_seconds: prometheus::CounterVec,
    batch_size: HistogramVec,
    engine_queued: HistogramVec,
    activity_seconds: HistogramVec,
    lane_polling: IntGaugeVec,
    model_not_served: IntCounterVec,
    dataset_parts: IntCounterVec,
    dataset_rows: IntCounterVec,
    dataset_memory_wait: prometheus::CounterVec,
    dataset_memory_limit: prometheus::Gauge,
    dataset_memory_held: prometheus::Gauge,
    /// The worker's dataset memory, read when the metrics are rendered.
    dataset_memory: OnceLock<DatasetMemory>,
    panics: IntCounterVec,
    ready: IntGauge,
}

fn register<C: Collector + Clone + 'static>(registry: &Registry, c: C) -> C {
    registry
        .register(Box::new(c.clone()))
        .expect("each metric is declared once with valid names; this is a bug");
    c
}

fn opts(name: &str, help: &str) -> Opts {
    Opts::new(name, help)
}

fn histogram(name: &str, help: &str, buckets: &[f64]) -> HistogramOpts {
    HistogramOpts::new(name, help).buckets(buckets.to_vec())
}

/// Seconds, from a millisecond to ten minutes: an activity, or a wait in an engine.
const SECONDS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0, 600.0,
];
/// Rows per forward pass: powers of two up to the largest --batch-rows worth setting.
const ROWS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0];

impl Default for Metrics {
    fn default() -> Self {
        let r = Registry::new();
        let gauge = |name, help, labels: &[&str]| {
            register(
                &r,
                GaugeVec::new(opts(name, help), labels).expect("valid gauge"),
            )
        };
        let plain_gauge = |name, help| {
            register(
                &r,
                prometheus::Gauge::with_opts(opts(name, help)).expect("valid gauge"),
            )
        };
        let int_gauge = |name, help, labels: &[&str]| {
            register(
                &r,
                IntGaugeVec::new(opts(name, help), labels).expect("valid gauge"),
            )
        };
        let counter = |name, help, labels: &[&str]| {
            register(
                &r,
                IntCounterVec::new(opts(name, help), labels).expect("valid counter"),
            )
        };
        let float_counter = |name, help, labels: &[&str]| {
            register(
                &r,
                prometheus::CounterVec::new(opts(name, help), labels).expect("valid counter"),
            )
        };
        let histo = |name, help, buckets, labels: &[&str]| {
            register(
                &r,
                HistogramVec::new(histogram(name, help, buckets), labels).expect("valid histogram"),
            )
        };
        let engine = [DEVICE, MODEL];
        Self {
            gpu_total: gauge(
                "gpulane_gpu_memory_total_bytes",
                "Total memory of the card, bytes.",
                &[GPU_UUID],
            ),
            gpu_free: gauge(
                "gpulane_gpu_memory_free_bytes",
                "Free memory of the card at the last reading (NVML or the simulation file), bytes.",
                &[GPU_UUID],
            ),
            gpu_reserved: gauge(
                "gpulane_gpu_memory_reserved_bytes",
                "Memory promised to outstanding permits, bytes.",
                &[GPU_UUID],
            ),
            gpu_admitting: int_gauge(
                "gpulane_gpu_admitting",
                "1 while the card admits work, 0 while its memory reading fails.",
                &[GPU_UUID],
            ),
            host_total: plain_gauge(
                "gpulane_host_memory_total_bytes",
                "Memory the CPU lanes admit within: the host's, or its cgroup's limit when lower, bytes.",
            ),
            host_available: plain_gauge(
                "gpulane_host_memory_available_bytes",
                "Host memory available without swapping (MemAvailable, within the cgroup's limit) at the last reading, bytes.",
            ),
            host_reserved: plain_gauge(
                "gpulane_host_memory_reserved_bytes",
                "Host memory promised to the CPU lanes' running tasks (busy engines' working sets and waiting inputs), bytes.",
            ),
            host_admitting: register(
                &r,
                IntGauge::with_opts(opts(
                    "gpulane_host_admitting",
                    "1 while the CPU lanes admit work, 0 while the host's memory reading fails.",
                ))
                .expect("valid gauge"),
            ),
            host_memory_wait: float_counter(
                "gpulane_host_memory_wait_seconds_total",
                "Seconds CPU lanes spent waiting for host memory before polling.",
                &[TASK_QUEUE],
            ),
            permits_issued: counter(
                "gpulane_permits_issued_total",
                "Slot permits issued, per lane.",
                &[GPU_UUID, TASK_QUEUE],
            ),
            permits_used: counter(
                "gpulane_permits_used_total",
                "Slot permits that received a task, per lane and activity type.",
                &[GPU_UUID, TASK_QUEUE, ACTIVITY_TYPE],
            ),
            memory_wait: float_counter(
                "gpulane_memory_wait_seconds_total",
                "Seconds lanes spent waiting for card memory before polling.",
                &[GPU_UUID, TASK_QUEUE],
            ),
            out_of_memory: counter(
                "gpulane_gpu_out_of_memory_total",
                "Tasks that ran out of card memory, per activity type.",
                &[GPU_UUID, ACTIVITY_TYPE],
            ),
            batches: counter(
                "gpulane_batches_total",
                "Forward passes an engine ran, per device and model (rows_total / batches_total is the mean batch).",
                &engine,
            ),
            batch_rows: counter(
                "gpulane_batch_rows_total",
                "Texts or (query, document) pairs through forward passes, per device and model.",
                &engine,
            ),
            batch_tokens: counter(
                "gpulane_batch_tokens_total",
                "Tokens through forward passes (special tokens included, padding not), per device and model.",
                &engine,
            ),
            batch_seconds: float_counter(
                "gpulane_batch_seconds_total",
                "Seconds engines spent in forward passes, per device and model (its rate is the engine's busy fraction).",
                &engine,
            ),
            batch_size: histo(
                "gpulane_batch_rows",
                "Rows per forward pass, per device and model: what cross-activity batching achieves.",
                ROWS,
                &engine,
            ),
            engine_queued: histo(
                "gpulane_engine_queue_seconds",
                "Seconds a call waited in an engine's queue before its round of batches began, per device and model.",
                SECONDS,
                &engine,
            ),
            activity_seconds: histo(
                "gpulane_activity_seconds",
                "Seconds from a task's start on this worker to its completion, per lane, activity type, model and outcome.",
                SECONDS,
                &[TASK_QUEUE, ACTIVITY_TYPE, MODEL, OUTCOME],
            ),
            lane_polling: int_gauge(
                "gpulane_lane_polling",
                "1 while the lane polls its task queue, 0 while it is drained, stopping or failed.",
                &[TASK_QUEUE, DEVICE],
            ),
            dataset_parts: counter(
                "gpulane_dataset_parts_total",
                "embed_dataset part files, per device, model and outcome (written by this attempt, or skipped: found written by an earlier attempt its last heartbeat named).",
                &[DEVICE, MODEL, OUTCOME],
            ),
            dataset_rows: counter(
                "gpulane_dataset_rows_total",
                "embed_dataset rows written to part files, per device and model.",
                &engine,
            ),
            dataset_memory_wait: float_counter(
                "gpulane_dataset_memory_wait_seconds_total",
                "Seconds embed_dataset jobs waited, per device, for the memory other jobs held of the worker's dataset memory (--max-dataset-bytes).",
                &[DEVICE],
            ),
            dataset_memory_limit: plain_gauge(
                "gpulane_dataset_memory_limit_bytes",
                "What the worker's embed_dataset jobs may hold of their sources together (--max-dataset-bytes), bytes.",
            ),
            dataset_memory_held: plain_gauge(
                "gpulane_dataset_memory_held_bytes",
                "What the worker's embed_dataset jobs hold of their sources now (and waiting jobs have gathered), bytes.",
            ),
            dataset_memory: OnceLock::new(),
            model_not_served: counter(
                "gpulane_model_not_served_total",
                "Tasks on a shared queue naming a model this worker does not serve, handed back to Temporal for another worker.",
                &[TASK_QUEUE],
            ),
            panics: counter(
                "gpulane_activity_panics_total",
                "Activities that panicked (a bug); each was failed back retryably and the worker kept serving.",
                &[TASK_QUEUE],
            ),
            ready: register(
                &r,
                IntGauge::with_opts(opts(
                    "gpulane_ready",
                    "1 while /readyz answers 200: connected, every lane polling, not draining.",
                ))
                .expect("valid gauge"),
            ),
            core: Arc::new(CoreBridge::default()),
            registry: r,
        }
    }
}

impl Metrics {
    /// The meter sdk-core records its `temporal_*` metrics through.
    pub(crate) fn core_meter(&self) -> Arc<CoreBridge> {
        self.core.clone()
    }

    /// A card's memory picture: total, last free reading, reserved for permits.
    pub(crate) fn gpu_memory(&self, uuid: &str, total: u64, free: Option<u64>, reserved: u64) {
        let l = [uuid];
        self.gpu_total.with_label_values(&l).set(total as f64);
        if let Some(free) = free {
            self.gpu_free.with_label_values(&l).set(free as f64);
        }
        self.gpu_reserved.with_label_values(&l).set(reserved as f64);
        self.gpu_admitting
            .with_label_values(&l)
            .set(i64::from(free.is_some()));
    }

    /// The host's memory picture, as the CPU lanes' budget sees it.
    pub(crate) fn host_memory(&self, total: u64, available: Option<u64>, reserved: u64) {
        self.host_total.set(total as f64);
        if let Some(a) = available {
            self.host_available.set(a as f64);
        }
        self.host_reserved.set(reserved as f64);
        self.host_admitting.set(i64::from(available.is_some()));
    }

    /// A CPU lane waited `secs` for host memory.
    pub(crate) fn host_memory_wait(&self, queue: &str, secs: f64) {
        self.host_memory_wait
            .with_label_values(&[queue])
            .inc_by(secs);
    }

    /// A permit was issued to a lane.
    pub(crate) fn permit_issued(&self, uuid: &str, queue: &str) {
        self.permits_issued.with_label_values(&[uuid, queue]).inc();
    }

    /// A lane's permit received a task.
    pub(crate) fn permit_used(&self, uuid: &str, queue: &str, activity_type: &str) {
        self.permits_used
            .with_label_values(&[uuid, queue, activity_label(activity_type)])
            .inc();
    }

    /// A lane waited `secs` for card memory.
    pub(crate) fn memory_wait(&self, uuid: &str, queue: &str, secs: f64) {
        self.memory_wait
            .with_label_values(&[uuid, queue])
            .inc_by(secs);
    }

    /// A task ran out of card memory.
    pub(crate) fn out_of_memory(&self, uuid: &str, activity_type: &str) {
        self.out_of_memory
            .with_label_values(&[uuid, activity_label(activity_type)])
            .inc();
    }

    /// The observer an engine of `model` on `device` (a card's UUID or `cpu`) reports its
    /// batches to.
    pub(crate) fn engine(&self, device: &str, model: &str) -> Arc<dyn BatchObserver> {
        let l = [device, model];
        Arc::new(EngineMetrics {
            batches: self.batches.with_label_values(&l),
            rows: self.batch_rows.with_label_values(&l),
            tokens: self.batch_tokens.with_label_values(&l),
            seconds: self.batch_seconds.with_label_values(&l),
            size: self.batch_size.with_label_values(&l),
            queued: self.engine_queued.with_label_values(&l),
        })
    }

    /// An activity ran on `queue` for `took`. `model` must be a served model's name.
    pub(crate) fn activity(
        &self,
        queue: &str,
        activity_type: &str,
        model: Option<&str>,
        outcome: Outcome,
        took: Duration,
    ) {
        self.activity_seconds
            .with_label_values(&[
                queue,
                activity_label(activity_type),
                model.unwrap_or("none"),
                outcome.label(),
            ])
            .observe(took.as_secs_f64());
    }

    /// Whether a lane polls now.
    pub(crate) fn lane_polling(&self, queue: &str, device: &str, polling: bool) {
        self.lane_polling
            .with_label_values(&[queue, device])
            .set(i64::from(polling));
    }

    /// A task on a shared queue named a model this worker lacks and was handed back.
    /// Counts the parts of `embed_dataset` jobs on `device`.
    pub(crate) fn datasets(self: &Arc<Self>, device: &str) -> Arc<dyn DatasetObserver> {
        Arc::new(DatasetCounts {
            metrics: self.clone(),
            device: device.to_owned(),
        })
    }

    pub(crate) fn model_not_served(&self, queue: &str) {
        self.model_not_served.with_label_values(&[queue]).inc();
    }

    /// An activity panicked.
    pub(crate) fn activity_panicked(&self, queue: &str) {
        self.panics.with_label_values(&[queue]).inc();
    }

    /// Whether /readyz answers 200.
    pub(crate) fn set_ready(&self, ready: bool) {
        self.ready.set(i64::from(ready));
    }

    /// Reports the worker's dataset memory from now on.
    pub(crate) fn watch_dataset_memory(&self, memory: DatasetMemory) {
        self.dataset_memory_limit.set(memory.bytes() as f64);
        // Set once at start; a second call would be a bug, and the first memory stays.
        let _ = self.dataset_memory.set(memory);
    }

    /// The Prometheus text exposition of gpulane's and sdk-core's metrics.
    pub(crate) fn render(&self) -> String {
        if let Some(m) = self.dataset_memory.get() {
            self.dataset_memory_held.set(m.held() as f64);
        }
        let mut families = self.registry.gather();
        families.extend(self.core.gather());
        let mut out = Vec::new();
        TextEncoder::new()
            .encode(&families, &mut out)
            .expect("the registry's families encode; this is a bug");
        String::from_utf8(out).expect("the text format is UTF-8; this is a bug")
    }
}

/// One engine's batch metrics, bound to its labels once.
struct EngineMetrics {
    batches: IntCounter,
    rows: IntCounter,
    tokens: IntCounter,
    seconds: prometheus::Counter,
    size: Histogram,
    queued: Histogram,
}

impl BatchObserver for EngineMetrics {
    fn idle(&self) {
        // Not a metric, but this is the runtime's hook on the engine thread.
        crate::heap::trim();
    }

    fn batch(&self, rows: usize, tokens: usize, took: Duration) {
        self.batches.inc();
        self.rows.inc_by(rows as u64);
        self.tokens.inc_by(tokens as u64);
        self.seconds.inc_by(took.as_secs_f64());
        self.size.observe(rows as f64);
    }

    fn queued(&self, waited: Duration) {
        self.queued.observe(waited.as_secs_f64());
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

    /// A workflow that names made-up activity types, with newlines and quotes, neither
    /// adds lines to the exposition nor grows it by a series per type.
    #[test]
    fn activity_type_labels_are_bounded_and_cannot_inject_lines() {
        let m = Metrics::default();
        let evil = "embed\n gpulane_injected_total{evil=\"1\"} 42";
        m.permit_used("GPU-1", "gpu-tools", evil);
        m.activity(
            "gpu-tools",
            evil,
            None,
            Outcome::Failed,
            Duration::from_millis(3),
        );
        for i in 0..300 {
            m.permit_used("GPU-1", "gpu-tools", &format!("made-up-{i}"));
        }
        let text = m.render();
        assert!(!text.contains("gpulane_injected_total"), "{text}");
        assert!(!text.contains("made-up"), "{text}");
        let used: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("gpulane_permits_used_total{"))
            .collect();
        assert_eq!(
            used,
            vec![
                "gpulane_permits_used_total{activity_type=\"other\",gpu_uuid=\"GPU-1\",task_queue=\"gpu-tools\"} 301"
            ]
        );
    }

    /// An engine's batches appear at each scrape, with the batch-size and queue-time
    /// histograms.
    #[test]
    fn engine_observers_count_batches_rows_and_waits() {
        let m = Metrics::default();
        let o = m.engine("cpu", "tiny");
        o.batch(3, 17, Duration::from_millis(5));
        o.batch(1, 4, Duration::from_millis(1));
        o.queued(Duration::from_millis(2));
        let text = m.render();
        for want in [
            "gpulane_batches_total{device=\"cpu\",model=\"tiny\"} 2",
            "gpulane_batch_rows_total{device=\"cpu\",model=\"tiny\"} 4",
            "gpulane_batch_tokens_total{device=\"cpu\",model=\"tiny\"} 21",
            "gpulane_batch_rows_bucket{device=\"cpu\",model=\"tiny\",le=\"2\"} 1",
            "gpulane_batch_rows_count{device=\"cpu\",model=\"tiny\"} 2",
            "gpulane_engine_queue_seconds_count{device=\"cpu\",model=\"tiny\"} 1",
        ] {
            assert!(text.contains(want), "missing {want}:\n{text}");
        }
    }
}
