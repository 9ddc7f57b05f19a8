//! Rendering of stats and clusters in Envoy's formats.
//!
//! Stats are gathered fresh for each request (`all_stats`), the counters shown less what they
//! were at the last `/reset_counters` (`Shown`), then kept or left out by the request's
//! `filter` and `usedonly` (`query`) and printed as Envoy's text, Envoy's JSON or Prometheus'
//! text exposition (`prometheus`).

mod clusters;
mod config_dump;
mod help;
mod listeners;
mod prometheus;
mod query;
#[cfg(test)]
mod tests;

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    sync::{Arc, Mutex, PoisonError, Weak},
};

use proxy_core::upstream::HistogramSnapshot;
use serde::Serialize;

pub(super) use self::{
    clusters::{clusters_json, clusters_text, routing},
    config_dump::config_dump,
    listeners::{listeners_json, listeners_text},
    prometheus::prometheus,
    query::{Format, StatsQuery},
};
use super::State;

/// Every stat: kernel counters (`bpf.*`), each service's kernel counters (`service.<name>.*`),
/// cluster stats (`cluster.<name>.*`), the proxy path's (`proxy.*`, Envoy's listener and
/// tcp_proxy names), server gauges.
fn all_stats(state: &State) -> BTreeMap<String, u64> {
    let mut stats = BTreeMap::new();
    for (name, value) in state.kernel_counters() {
        stats.insert(format!("bpf.{name}"), value);
    }
    let services = state.service_counters();
    for (service, counts) in &services {
        for (stat, value) in [
            ("cx_to_host", counts.to_host),
            ("cx_to_proxy", counts.to_proxy),
            ("cx_no_host", counts.no_host),
            ("cx_panic", counts.panic),
            ("cx_passive_failure", counts.passive_failures),
        ] {
            stats.insert(format!("service.{service}.{stat}"), value);
        }
    }
    // The kernel serves an older host set than the service's newest (its publish failed).
    for (service, publish) in state.publish_states() {
        let stale = u64::from(publish.stale);
        stats.insert(format!("service.{service}.hosts_stale"), stale);
        stats.insert(
            format!("service.{service}.publish_failed"),
            publish.failures,
        );
    }
    for upstream in state.upstreams.values() {
        stats.extend(upstream.stats());
    }
    kernel_limits(state, &mut stats);
    if let Some(entries) = &state.consul_entries {
        stats.extend(entries.named());
    }
    // The kernel path's connections under Envoy's per-cluster names, added to the proxy path's
    // (`UpstreamTraffic`): for a direct-mode service with one cluster, its connects are that
    // cluster's. A chain's are counted per service only (the kernel does not know which of its
    // targets a host came from).
    for (service, counts) in &services {
        let Some(cluster) = state.kernel_cluster(service) else {
            continue;
        };
        for (stat, value) in [
            ("upstream_cx_total", counts.to_host),
            ("upstream_cx_none_healthy", counts.no_host),
            ("lb_healthy_panic", counts.panic),
        ] {
            *stats
                .entry(format!("cluster.{cluster}.{stat}"))
                .or_default() += value;
        }
    }
    if let Some(proxy) = &state.proxy {
        for (name, value) in proxy.stats() {
            stats.insert(format!("proxy.{name}"), value);
        }
    }
    stats.insert(
        "server.services".to_owned(),
        state.config.services.len() as u64,
    );
    stats.insert(
        "server.clusters".to_owned(),
        state.config.clusters.len() as u64,
    );
    // Chains that Consul's entries left uncompiled: each service runs its previous chain, or is
    // left out (the log says which, and why).
    stats.insert(
        "server.chain_failures".to_owned(),
        state.config.chain_failures.len() as u64,
    );
    stats
}

/// The kernel path's `max_connections`: per service its open connections and refusals, and
/// the refusals under Envoy's per-cluster name, added to the proxy path's, for a direct-mode
/// service of one cluster (the only kind the kernel limits).
fn kernel_limits(state: &State, stats: &mut BTreeMap<String, u64>) {
    for (service, counts) in state.cx_counts() {
        stats.insert(format!("service.{service}.cx_open"), counts.open);
        stats.insert(format!("service.{service}.cx_overflow"), counts.overflow);
        if let Some(cluster) = state.kernel_cluster(service) {
            *stats
                .entry(format!("cluster.{cluster}.upstream_cx_overflow"))
                .or_default() += counts.overflow;
        }
    }
    // Envoy's name for a request its router dropped; here the kernel refused a connect.
    for (service, dropped) in state.drop_counts() {
        stats.insert(format!("service.{service}.cx_drop_overload"), dropped);
        if let Some(cluster) = state.kernel_cluster(service) {
            *stats
                .entry(format!("cluster.{cluster}.upstream_rq_drop_overload"))
                .or_default() += dropped;
        }
    }
}

/// The counters' values at the last `/reset_counters`, by name: what is shown is the value
/// less this (Envoy resets its counters to zero; the daemon's live in the kernel, the proxy
/// path and discovery, so the admin keeps the baseline instead). Gauges and histograms are not
/// reset, as in Envoy.
#[derive(Debug, Default)]
pub(crate) struct CounterBaseline(Mutex<Baseline>);

/// What [`CounterBaseline`] holds: the values, and the clusters they were read from.
#[derive(Debug, Default, Clone)]
struct Baseline {
    values: BTreeMap<String, u64>,
    /// The running cluster each `cluster.<name>.*` value came from: a cluster a reload
    /// replaced since counts afresh, so its baseline no longer applies.
    clusters: BTreeMap<String, Weak<proxy_core::upstream::Upstream>>,
}

impl Baseline {
    /// `value` of counter `name` as shown, and whether it was ever non-zero (Envoy's `used`).
    /// A counter of a cluster replaced since, or below its baseline (its source restarted), is
    /// shown as it is.
    fn apply(&self, state: &State, name: &str, value: u64) -> (u64, bool) {
        let Some(&base) = self.values.get(name) else {
            return (value, value > 0);
        };
        let replaced = cluster_of(state, name).is_some_and(|c| {
            self.clusters
                .get(c)
                .is_none_or(|was| !Weak::ptr_eq(was, &Arc::downgrade(&state.upstreams[c])))
        });
        if replaced || value < base {
            (value, value > 0)
        } else {
            (value - base, value > 0)
        }
    }
}

/// The cluster of a `cluster.<name>.<stat>` stat: the longest running cluster's name the stat
/// starts with (a name may hold dots), found with one lookup per dot.
fn cluster_of<'n>(state: &State, name: &'n str) -> Option<&'n str> {
    let rest = name.strip_prefix("cluster.")?;
    rest.rmatch_indices('.')
        .map(|(dot, _)| &rest[..dot])
        .find(|c| state.upstreams.contains_key(*c))
}

/// `POST /reset_counters`: every counter shows zero from now on (gauges and histograms go on).
/// Returns how many counters were reset.
pub(super) fn reset_counters(state: &State) -> usize {
    let values: BTreeMap<String, u64> = all_stats(state)
        .into_iter()
        .filter(|(name, _)| !is_gauge(name))
        .collect();
    let n = values.len();
    let clusters = state
        .upstreams
        .iter()
        .map(|(name, up)| (name.clone(), Arc::downgrade(up)))
        .collect();
    *state
        .counter_baseline
        .0
        .lock()
        .unwrap_or_else(PoisonError::into_inner) = Baseline { values, clusters };
    n
}

/// One stat as shown.
struct ShownStat {
    name: String,
    value: u64,
    gauge: bool,
}

/// The stats a request shows: counters and gauges sorted by name, then the histograms, each
/// kept by the query's `filter` and `usedonly`.
struct Shown {
    stats: Vec<ShownStat>,
    histograms: Vec<(String, HistogramSnapshot)>,
}

impl Shown {
    fn gather(state: &State, query: &StatsQuery) -> Self {
        let baseline = state
            .counter_baseline
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let stats = all_stats(state)
            .into_iter()
            .filter_map(|(name, raw)| {
                let gauge = is_gauge(&name);
                let (value, used) = if gauge {
                    (raw, raw > 0)
                } else {
                    baseline.apply(state, &name, raw)
                };
                query
                    .keeps(&name, used)
                    .then_some(ShownStat { name, value, gauge })
            })
            .collect();
        let mut histograms: Vec<_> = state
            .upstreams
            .values()
            .flat_map(|up| up.histograms())
            .filter(|(name, h)| query.keeps(name, h.count > 0))
            .collect();
        histograms.sort_by(|a, b| a.0.cmp(&b.0));
        Self { stats, histograms }
    }
}

/// The quantiles `/stats` prints for a histogram, as Envoy's defaults (percent).
const QUANTILES: [f64; 10] = [0.0, 25.0, 50.0, 75.0, 90.0, 95.0, 99.0, 99.5, 99.9, 100.0];

/// `/stats?format=json` in Envoy's form: `{"stats": [{"name": ..., "value": ...}, ...]}`,
/// sorted by name, values as JSON numbers, and when there are histograms a last entry
/// `{"histograms": {"supported_quantiles": [...], "computed_quantiles": [...]}}` (the daemon
/// keeps no flush intervals: `interval` is null, `cumulative` is since the start).
#[derive(Serialize)]
pub(super) struct StatsJson {
    stats: Vec<StatJson>,
}

/// One entry of [`StatsJson`].
#[derive(Serialize)]
#[serde(untagged)]
enum StatJson {
    Stat { name: String, value: u64 },
    Histograms { histograms: HistogramsJson },
}

#[derive(Serialize)]
struct HistogramsJson {
    supported_quantiles: [f64; 10],
    computed_quantiles: Vec<ComputedJson>,
}

#[derive(Serialize)]
struct ComputedJson {
    name: String,
    values: Vec<QuantileJson>,
}

#[derive(Serialize)]
struct QuantileJson {
    interval: Option<f64>,
    cumulative: Option<f64>,
}

pub(super) fn stats_map(state: &State, query: &StatsQuery) -> StatsJson {
    let shown = Shown::gather(state, query);
    let mut stats: Vec<StatJson> = shown
        .stats
        .into_iter()
        .map(|s| StatJson::Stat {
            name: s.name,
            value: s.value,
        })
        .collect();
    if !shown.histograms.is_empty() {
        let computed_quantiles = shown
            .histograms
            .into_iter()
            .map(|(name, h)| ComputedJson {
                name,
                values: QUANTILES
                    .iter()
                    .map(|q| QuantileJson {
                        interval: None,
                        cumulative: h.quantile(q / 100.0),
                    })
                    .collect(),
            })
            .collect();
        stats.push(StatJson::Histograms {
            histograms: HistogramsJson {
                supported_quantiles: QUANTILES,
                computed_quantiles,
            },
        });
    }
    StatsJson { stats }
}

/// `name: value` lines, Envoy's `/stats` text format; histograms last, as Envoy prints them
/// (`P50(interval,cumulative)`; the daemon keeps no flush intervals, so `interval` is `nan`).
pub(super) fn stats_text(state: &State, query: &StatsQuery) -> String {
    let shown = Shown::gather(state, query);
    let mut out = String::new();
    for s in shown.stats {
        let _ = writeln!(out, "{}: {}", s.name, s.value);
    }
    for (name, h) in shown.histograms {
        if h.count == 0 {
            let _ = writeln!(out, "{name}: No recorded values");
            continue;
        }
        let _ = write!(out, "{name}:");
        for q in QUANTILES {
            let value = h.quantile(q / 100.0).unwrap_or(f64::NAN);
            let _ = write!(out, " P{q}(nan,{value})");
        }
        out.push('\n');
    }
    out
}

/// Stats that are levels, not running totals.
fn is_gauge(name: &str) -> bool {
    let leaf = name.rsplit('.').next().unwrap_or(name);
    leaf.starts_with("membership_")
        || leaf == "healthy"
        || leaf.ends_with("_active")
        // Circuit breakers: `cx_open`, `rq_pending_open`, ... and `remaining_*`.
        || leaf.ends_with("_open")
        || leaf.starts_with("remaining_")
        || leaf == "original_dst_hosts"
        || leaf == "hosts_stale"
        || leaf == "hosts_refused"
        || leaf == "entries_total"
        || leaf == "entries_skipped"
        || name.starts_with("server.")
}
