//! sdk-core's worker metrics (`temporal_activity_schedule_to_start_latency`, slots
//! available and used, poll results, request latencies, ...) recorded through a
//! [`CoreMeter`] of ours onto `prometheus` collectors, so they are scraped from
//! gpulane's own `/metrics` beside its `gpulane_*` series, with core's names and
//! `task_queue` labels.
//!
//! Why not core's built-in Prometheus exporter: it serves its own HTTP port from a
//! registry we cannot reach, and it labels activity metrics with the task's raw activity
//! type, which a workflow chooses. Here every `activity_type` value is mapped onto the
//! bounded set gpulane serves (see [`super::activity_label`]).
//!
//! Core asks for an instrument by name and learns its labels only when it records, and
//! one name can be recorded with different label sets; so each (name, label keys) pair
//! gets its own collector, and [`CoreBridge::gather`] merges them by name.

use std::{
    collections::{BTreeMap, HashMap},
    error::Error,
    sync::{Arc, Mutex},
    time::Duration,
};

use prometheus::{
    core::Collector, proto::MetricFamily, Gauge, GaugeVec, Histogram, HistogramOpts, HistogramVec,
    IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
};
use temporalio_common::telemetry::metrics::{
    default_buckets_for, CoreMeter, Counter, CounterBase, Gauge as CoreGauge, GaugeBase, GaugeF64,
    GaugeF64Base, Histogram as CoreHistogram, HistogramBase, HistogramDuration,
    HistogramDurationBase, HistogramF64, HistogramF64Base, MetricAttributable, MetricAttributes,
    MetricParameters, NewAttributes, OrderedPromLabelSet, UpDownCounter, UpDownCounterBase,
};

/// Longest label value kept from core; its values are queue names and status words.
const MAX_LABEL_CHARS: usize = 200;

/// What kind of instrument core asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Counter,
    Gauge,
    FloatGauge,
    UpDown,
    Histogram,
    FloatHistogram,
    Duration,
}

#[derive(Clone)]
enum Family {
    Counter(IntCounterVec),
    Gauge(IntGaugeVec),
    FloatGauge(GaugeVec),
    Histogram(HistogramVec),
}

impl Family {
    fn collect(&self) -> Vec<MetricFamily> {
        match self {
            Family::Counter(v) => v.collect(),
            Family::Gauge(v) => v.collect(),
            Family::FloatGauge(v) => v.collect(),
            Family::Histogram(v) => v.collect(),
        }
    }
}

type Families = Arc<Mutex<HashMap<(String, Vec<String>), Family>>>;

/// The meter handed to sdk-core; its collectors are rendered with gpulane's metrics.
#[derive(Default)]
pub(crate) struct CoreBridge {
    families: Families,
}

impl std::fmt::Debug for CoreBridge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CoreBridge")
    }
}

impl CoreBridge {
    fn instrument(&self, params: &MetricParameters, kind: Kind) -> Arc<Instrument> {
        Arc::new(Instrument {
            families: self.families.clone(),
            name: params.name.to_string(),
            help: if params.description.is_empty() {
                format!("sdk-core's {}", params.name)
            } else {
                params.description.to_string()
            },
            kind,
        })
    }

    /// Every core series, one family per name.
    pub(crate) fn gather(&self) -> Vec<MetricFamily> {
        let families: Vec<Family> = self
            .families
            .lock()
            .expect("core metrics lock poisoned; this is a bug")
            .values()
            .cloned()
            .collect();
        let mut by_name: BTreeMap<String, MetricFamily> = BTreeMap::new();
        for mut mf in families.iter().flat_map(Family::collect) {
            if mf.get_metric().is_empty() {
                continue;
            }
            match by_name.get_mut(mf.name()) {
                Some(existing) => existing.mut_metric().extend(mf.take_metric()),
                None => {
                    by_name.insert(mf.name().to_owned(), mf);
                }
            }
        }
        by_name.into_values().collect()
    }
}

/// Labels core sets from what a workflow chose, with no bounded mapping: dropped. An
/// activity worker's metrics need no workflow type, and core sets the Nexus ones only for
/// Nexus workers.
const DROPPED_LABELS: &[&str] = &["workflow_type", "nexus_service", "nexus_operation"];

/// Label pairs of an attribute set, sorted by key, with bounded values.
fn labels(attributes: &MetricAttributes) -> Vec<(String, String)> {
    let pairs: Vec<(String, String)> = match attributes {
        MetricAttributes::Prometheus { labels } => labels
            .as_prom_labels()
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v))
            .collect(),
        MetricAttributes::NoOp(map) => map.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
        _ => Vec::new(),
    };
    let mut pairs: Vec<(String, String)> = pairs
        .into_iter()
        .filter(|(k, _)| !DROPPED_LABELS.contains(&k.as_str()))
        .map(|(k, v)| {
            let v = if k == "activity_type" {
                super::activity_label(&v).to_owned()
            } else {
                v.chars().take(MAX_LABEL_CHARS).collect()
            };
            (k, v)
        })
        .collect();
    pairs.sort();
    pairs
}

/// One instrument core created: a name and kind, bound to a label set per recording.
struct Instrument {
    families: Families,
    name: String,
    help: String,
    kind: Kind,
}

/// A series of one instrument, bound to its label values.
enum Bound {
    Counter(IntCounter),
    Gauge(IntGauge),
    FloatGauge(Gauge),
    Histogram(Histogram),
}

impl Instrument {
    fn bind(&self, attributes: &MetricAttributes) -> Result<Bound, Box<dyn Error>> {
        let pairs = labels(attributes);
        let keys: Vec<String> = pairs.iter().map(|(k, _)| k.clone()).collect();
        let values: Vec<&str> = pairs.iter().map(|(_, v)| v.as_str()).collect();
        let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let mut families = self
            .families
            .lock()
            .expect("core metrics lock poisoned; this is a bug");
        let family = match families.get(&(self.name.clone(), keys.clone())) {
            Some(f) => f.clone(),
            None => {
                let opts = Opts::new(self.name.clone(), self.help.clone());
                let base = self.name.strip_prefix("temporal_").unwrap_or(&self.name);
                let buckets = |seconds| {
                    HistogramOpts::new(self.name.clone(), self.help.clone())
                        .buckets(default_buckets_for(base, seconds).to_vec())
                };
                let f = match self.kind {
                    Kind::Counter => Family::Counter(IntCounterVec::new(opts, &key_refs)?),
                    Kind::Gauge | Kind::UpDown => Family::Gauge(IntGaugeVec::new(opts, &key_refs)?),
                    Kind::FloatGauge => Family::FloatGauge(GaugeVec::new(opts, &key_refs)?),
                    Kind::Histogram => {
                        Family::Histogram(HistogramVec::new(buckets(false), &key_refs)?)
                    }
                    Kind::FloatHistogram | Kind::Duration => {
                        Family::Histogram(HistogramVec::new(buckets(true), &key_refs)?)
                    }
                };
                families.insert((self.name.clone(), keys), f.clone());
                f
            }
        };
        Ok(match family {
            Family::Counter(v) => Bound::Counter(v.get_metric_with_label_values(&values)?),
            Family::Gauge(v) => Bound::Gauge(v.get_metric_with_label_values(&values)?),
            Family::FloatGauge(v) => Bound::FloatGauge(v.get_metric_with_label_values(&values)?),
            Family::Histogram(v) => Bound::Histogram(v.get_metric_with_label_values(&values)?),
        })
    }
}

impl CounterBase for Bound {
    fn adds(&self, value: u64) {
        if let Bound::Counter(c) = self {
            c.inc_by(value);
        }
    }
}

impl GaugeBase for Bound {
    fn records(&self, value: u64) {
        if let Bound::Gauge(g) = self {
            g.set(i64::try_from(value).unwrap_or(i64::MAX));
        }
    }
}

impl GaugeF64Base for Bound {
    fn records(&self, value: f64) {
        if let Bound::FloatGauge(g) = self {
            g.set(value);
        }
    }
}

impl UpDownCounterBase for Bound {
    fn adds(&self, value: i64) {
        if let Bound::Gauge(g) = self {
            g.add(value);
        }
    }
}

impl HistogramBase for Bound {
    fn records(&self, value: u64) {
        if let Bound::Histogram(h) = self {
            h.observe(value as f64);
        }
    }
}

impl HistogramF64Base for Bound {
    fn records(&self, value: f64) {
        if let Bound::Histogram(h) = self {
            h.observe(value);
        }
    }
}

impl HistogramDurationBase for Bound {
    /// Durations in seconds, the Prometheus convention.
    fn records(&self, value: Duration) {
        if let Bound::Histogram(h) = self {
            h.observe(value.as_secs_f64());
        }
    }
}

/// `MetricAttributable` for each base trait core asks for: bind, then box.
macro_rules! attributable {
    ($($base:ident),*) => {$(
        impl MetricAttributable<Box<dyn $base>> for Instrument {
            fn with_attributes(
                &self,
                attributes: &MetricAttributes,
            ) -> Result<Box<dyn $base>, Box<dyn Error>> {
                Ok(Box::new(self.bind(attributes)?))
            }
        }
    )*};
}

attributable!(
    CounterBase,
    GaugeBase,
    GaugeF64Base,
    UpDownCounterBase,
    HistogramBase,
    HistogramF64Base,
    HistogramDurationBase
);

impl CoreMeter for CoreBridge {
    fn new_attributes(&self, attribs: NewAttributes) -> MetricAttributes {
        MetricAttributes::Prometheus {
            labels: Arc::new(attribs.into()),
        }
    }

    fn extend_attributes(
        &self,
        existing: MetricAttributes,
        attribs: NewAttributes,
    ) -> MetricAttributes {
        let mut all = match existing {
            MetricAttributes::Prometheus { labels } => Arc::unwrap_or_clone(labels),
            _ => OrderedPromLabelSet::new(),
        };
        for kv in attribs.attributes {
            all.add_kv(kv);
        }
        MetricAttributes::Prometheus {
            labels: Arc::new(all),
        }
    }

    fn counter(&self, params: MetricParameters) -> Counter {
        Counter::new(self.instrument(&params, Kind::Counter))
    }

    fn histogram(&self, params: MetricParameters) -> CoreHistogram {
        CoreHistogram::new(self.instrument(&params, Kind::Histogram))
    }

    fn histogram_f64(&self, params: MetricParameters) -> HistogramF64 {
        HistogramF64::new(self.instrument(&params, Kind::FloatHistogram))
    }

    fn histogram_duration(&self, mut params: MetricParameters) -> HistogramDuration {
        params.unit = "seconds".into();
        HistogramDuration::new(self.instrument(&params, Kind::Duration))
    }

    fn gauge(&self, params: MetricParameters) -> CoreGauge {
        CoreGauge::new(self.instrument(&params, Kind::Gauge))
    }

    fn gauge_f64(&self, params: MetricParameters) -> GaugeF64 {
        GaugeF64::new(self.instrument(&params, Kind::FloatGauge))
    }

    fn up_down_counter(&self, params: MetricParameters) -> UpDownCounter {
        UpDownCounter::new(self.instrument(&params, Kind::UpDown))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use temporalio_common::telemetry::metrics::MetricKeyValue;

    fn attrs(bridge: &CoreBridge, kvs: &[(&'static str, &str)]) -> MetricAttributes {
        bridge.new_attributes(NewAttributes::new(
            kvs.iter()
                .map(|(k, v)| MetricKeyValue::new(*k, v.to_string()))
                .collect(),
        ))
    }

    fn render(bridge: &CoreBridge) -> String {
        use prometheus::Encoder;
        let mut out = Vec::new();
        prometheus::TextEncoder::new()
            .encode(&bridge.gather(), &mut out)
            .unwrap();
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn core_histograms_and_counters_render_with_their_labels_in_seconds() {
        let b = CoreBridge::default();
        let h = b.histogram_duration("temporal_activity_schedule_to_start_latency".into());
        let a = attrs(
            &b,
            &[("task_queue", "gpu-tools"), ("activity_type", "embed")],
        );
        h.record(Duration::from_millis(250), &a);
        let c = b.counter("temporal_activity_poll_no_task".into());
        c.add(2, &attrs(&b, &[("task_queue", "gpu-tools")]));
        // The same name with another label set joins the same family.
        c.add(1, &attrs(&b, &[("task_queue", "cpu-tools"), ("x", "y")]));
        let text = render(&b);
        assert!(text.contains(
            "temporal_activity_schedule_to_start_latency_sum{activity_type=\"embed\",task_queue=\"gpu-tools\"} 0.25"
        ), "{text}");
        assert!(
            text.contains("temporal_activity_poll_no_task{task_queue=\"gpu-tools\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("temporal_activity_poll_no_task{task_queue=\"cpu-tools\",x=\"y\"} 1"),
            "{text}"
        );
        assert_eq!(
            text.matches("# TYPE temporal_activity_poll_no_task ")
                .count(),
            1,
            "{text}"
        );
    }

    #[test]
    fn made_up_activity_and_workflow_types_add_no_series() {
        let b = CoreBridge::default();
        let c = b.counter("temporal_activity_execution_failed".into());
        for i in 0..300 {
            let t = format!("bad\n{i}\"");
            c.add(
                1,
                &attrs(
                    &b,
                    &[("activity_type", t.as_str()), ("workflow_type", t.as_str())],
                ),
            );
        }
        let text = render(&b);
        assert!(
            text.contains("temporal_activity_execution_failed{activity_type=\"other\"} 300"),
            "{text}"
        );
        assert_eq!(text.lines().filter(|l| !l.starts_with('#')).count(), 1);
    }
}
