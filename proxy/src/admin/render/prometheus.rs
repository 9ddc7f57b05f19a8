//! `/stats/prometheus`: Prometheus' text exposition (format 0.0.4), encoded by the
//! `prometheus-client` library, with Envoy's family names and labels so that a dashboard made
//! for Envoy reads the daemon: `cluster.<name>.<stat>` becomes
//! `envoy_cluster_<stat>{envoy_cluster_name="<name>"}`, `cluster.<name>.upstream_rq_<n>xx`
//! becomes `envoy_cluster_upstream_rq_xx{envoy_response_code_class="<n>",...}`,
//! `upstream_rq_<code>` `envoy_cluster_upstream_rq{envoy_response_code="<code>",...}`, the
//! histograms have Envoy's buckets (`_bucket{le=...}`, `_sum`, `_count`, in milliseconds), from
//! their first sample on (Envoy prints them empty; here most clusters are the kernel's, which
//! has no histograms);
//! kernel counters become `proxy_bpf_<name>`, per-service ones
//! `proxy_service_<stat>{service="<name>"}`, the rest `envoy_<name>`.
//!
//! Every family has a `# HELP` line (`help`). The library gives a counter's family the
//! `_total` suffix, which most of Envoy's counter names (`upstream_rq_xx`,
//! `upstream_cx_connect_fail`) do not have: those keep Envoy's exact name, typed `untyped`
//! (queries by name, `rate()` included, read them as they read Envoy's); a counter whose name
//! ends in `_total` is typed `counter`.

use std::{collections::BTreeMap, fmt::Write as _};

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, MetricEncoder, NoLabelSet},
    metrics::MetricType,
    registry::Registry,
};
use proxy_core::upstream::HistogramSnapshot;

use super::{Shown, StatsQuery, help::help};
use crate::admin::State;

/// A sample's labels, in order.
type Labels = Vec<(&'static str, String)>;

/// One sample's value.
#[derive(Debug)]
enum Value {
    Plain(u64),
    Histogram(HistogramSnapshot),
}

/// One family: its name (for a counter, without the `_total` the library adds), HELP, type,
/// samples.
#[derive(Debug)]
struct Family {
    /// The name the library is given: a counter's without the `_total` it adds.
    stem: String,
    help: String,
    kind: Kind,
    samples: Vec<(Labels, Value)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Counter,
    Gauge,
    Untyped,
    Histogram,
}

impl Kind {
    fn metric_type(self) -> MetricType {
        match self {
            Kind::Counter => MetricType::Counter,
            Kind::Gauge => MetricType::Gauge,
            Kind::Untyped => MetricType::Unknown,
            Kind::Histogram => MetricType::Histogram,
        }
    }
}

/// The page's families, by name: what the registry encodes on the one scrape.
#[derive(Debug, Default)]
struct Exposition(BTreeMap<String, Family>);

impl Exposition {
    /// Adds a sample of the stat `name` (dotted, as `/stats` names it).
    fn add(&mut self, state: &State, name: &str, kind: Kind, value: Value) {
        let (family, labels) = family_of(state, name);
        let (stem, kind) = match (kind, family.strip_suffix("_total")) {
            (Kind::Counter, Some(stem)) => (stem.to_owned(), Kind::Counter),
            (Kind::Counter, None) => (family.clone(), Kind::Untyped),
            (other, _) => (family.clone(), other),
        };
        // Keyed by the name shown: `upstream_rq_total` and `upstream_rq{code}` are two.
        let entry = self.0.entry(family).or_insert_with_key(|shown| Family {
            help: help(name, shown, proxy_relay::ProxyStatsHandle::help),
            stem,
            kind,
            samples: Vec::new(),
        });
        entry.samples.push((labels, value));
    }
}

impl Collector for Exposition {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        for family in self.0.values() {
            let mut metric = encoder.encode_descriptor(
                &family.stem,
                &family.help,
                None,
                family.kind.metric_type(),
            )?;
            for (labels, value) in &family.samples {
                let sample = metric.encode_family(labels)?;
                encode_value(sample, family.kind, value)?;
            }
        }
        Ok(())
    }
}

fn encode_value(mut sample: MetricEncoder, kind: Kind, value: &Value) -> std::fmt::Result {
    match value {
        Value::Plain(v) if kind == Kind::Counter => {
            sample.encode_counter::<NoLabelSet, u64, u64>(v, None)
        }
        Value::Plain(v) => sample.encode_gauge(v),
        Value::Histogram(h) => {
            // The library sums the buckets itself: it takes each bucket's own samples.
            let mut below = 0;
            let own: Vec<(f64, u64)> = h
                .buckets
                .iter()
                .map(|&(bound, cumulative)| {
                    let n = cumulative.saturating_sub(below);
                    below = cumulative;
                    (bound, n)
                })
                .collect();
            sample.encode_histogram::<NoLabelSet>(h.sum_ms, h.count, &own, None)
        }
    }
}

/// The family and labels of the stat `name`.
fn family_of(state: &State, name: &str) -> (String, Labels) {
    if let Some(rest) = name.strip_prefix("cluster.") {
        let Some(cluster) = super::cluster_of(state, name) else {
            return (format!("envoy_cluster_{}", sanitize(rest)), Vec::new());
        };
        let stat = &rest[cluster.len() + 1..];
        let mut labels = vec![("envoy_cluster_name", cluster.to_owned())];
        // Envoy's tag: the response class of `upstream_rq_<n>xx`.
        if let Some(class) = stat
            .strip_prefix("upstream_rq_")
            .and_then(|s| s.strip_suffix("xx"))
            .filter(|c| matches!(*c, "1" | "2" | "3" | "4" | "5"))
        {
            labels.insert(0, ("envoy_response_code_class", class.to_owned()));
            return ("envoy_cluster_upstream_rq_xx".to_owned(), labels);
        }
        // And of `upstream_rq_<code>`: the code.
        if let Some(code) = stat
            .strip_prefix("upstream_rq_")
            .filter(|c| c.len() == 3 && c.bytes().all(|b| b.is_ascii_digit()))
        {
            labels.insert(0, ("envoy_response_code", code.to_owned()));
            return ("envoy_cluster_upstream_rq".to_owned(), labels);
        }
        return (format!("envoy_cluster_{}", sanitize(stat)), labels);
    }
    if name.starts_with("bpf.") {
        return (format!("proxy_{}", sanitize(name)), Vec::new());
    }
    // `service.<name>.<stat>`: the stat is the last part (a service name may hold dots).
    if let Some((service, stat)) = name
        .strip_prefix("service.")
        .and_then(|rest| rest.rsplit_once('.'))
    {
        return (
            format!("proxy_service_{}", sanitize(stat)),
            vec![("service", service.to_owned())],
        );
    }
    (format!("envoy_{}", sanitize(name)), Vec::new())
}

fn sanitize(name: &str) -> String {
    name.chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect()
}

/// The page: the stats the query keeps, in Prometheus' text exposition.
pub(crate) fn prometheus(state: &State, query: &StatsQuery) -> String {
    let shown = Shown::gather(state, query);
    let mut exposition = Exposition::default();
    for stat in shown.stats {
        let kind = if stat.gauge {
            Kind::Gauge
        } else {
            Kind::Counter
        };
        exposition.add(state, &stat.name, kind, Value::Plain(stat.value));
    }
    // A histogram shows from its first sample on: a cluster the proxy path never carried
    // (every kernel-path cluster) would print 22 empty lines per histogram.
    for (name, h) in shown.histograms.into_iter().filter(|(_, h)| h.count > 0) {
        exposition.add(state, &name, Kind::Histogram, Value::Histogram(h));
    }
    encode(exposition)
}

/// The exposition's text.
fn encode(exposition: Exposition) -> String {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(exposition));
    let mut out = String::new();
    // Writing to a String cannot fail; an encoder error would be a bug: shown, not hidden.
    if let Err(err) = prometheus_client::encoding::prometheus_text::encode(&mut out, &registry) {
        let _ = writeln!(out, "# encoding failed: {err}");
    }
    out
}

/// One gauge `t` of service `service`, as the page prints it (the tests read the library's
/// escaping back).
#[cfg(test)]
pub(super) fn one_service_gauge(service: &str) -> String {
    let mut exposition = Exposition::default();
    exposition.0.insert(
        "t".to_owned(),
        Family {
            stem: "t".to_owned(),
            help: "h".to_owned(),
            kind: Kind::Gauge,
            samples: vec![(vec![("service", service.to_owned())], Value::Plain(3))],
        },
    );
    encode(exposition)
}
