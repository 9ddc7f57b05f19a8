//! Rendering of stats and clusters in Envoy's formats.

mod clusters;

use std::{collections::BTreeMap, fmt::Write as _};

use serde::Serialize;

pub(super) use self::clusters::{clusters_json, clusters_text, routing};
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
        ] {
            stats.insert(format!("service.{service}.{stat}"), value);
        }
    }
    for upstream in state.upstreams.values() {
        stats.extend(upstream.stats());
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
    stats
}

/// `/stats?format=json` in Envoy's form: `{"stats": [{"name": ..., "value": ...}, ...]}`,
/// sorted by name, values as JSON numbers. Envoy ends the list with a `histograms` entry; the
/// daemon keeps no histograms, so there is none.
#[derive(Serialize)]
pub(super) struct StatsJson {
    stats: Vec<StatJson>,
}

/// One stat of [`StatsJson`].
#[derive(Serialize)]
struct StatJson {
    name: String,
    value: u64,
}

pub(super) fn stats_map(state: &State) -> StatsJson {
    StatsJson {
        stats: all_stats(state)
            .into_iter()
            .map(|(name, value)| StatJson { name, value })
            .collect(),
    }
}

/// `name: value` lines, Envoy's `/stats` text format.
pub(super) fn stats_text(state: &State) -> String {
    let mut out = String::new();
    for (name, value) in all_stats(state) {
        let _ = writeln!(out, "{name}: {value}");
    }
    out
}

/// A Prometheus label value: backslash, double quote and line feed escaped.
fn label_value(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Stats that are levels, not running totals.
fn is_gauge(name: &str) -> bool {
    let leaf = name.rsplit('.').next().unwrap_or(name);
    leaf.starts_with("membership_")
        || leaf == "healthy"
        || leaf.ends_with("_active")
        || leaf == "original_dst_hosts"
        || name.starts_with("server.")
}

/// Prometheus text exposition, with Envoy's naming: `cluster.<name>.<stat>` becomes
/// `envoy_cluster_<stat>{envoy_cluster_name="<name>"}`; kernel counters become `proxy_bpf_<name>`.
pub(super) fn prometheus(state: &State) -> String {
    let mut families: BTreeMap<String, Vec<(String, u64)>> = BTreeMap::new();
    for (name, value) in all_stats(state) {
        let (family, labels) = match name.strip_prefix("cluster.") {
            Some(rest) => {
                let cluster = state
                    .upstreams
                    .keys()
                    .filter(|c| rest.starts_with(&format!("{c}.")))
                    .max_by_key(|c| c.len());
                match cluster {
                    Some(c) => (
                        format!("envoy_cluster_{}", sanitize(&rest[c.len() + 1..])),
                        format!("{{envoy_cluster_name=\"{}\"}}", label_value(c)),
                    ),
                    None => (format!("envoy_cluster_{}", sanitize(rest)), String::new()),
                }
            }
            None if name.starts_with("bpf.") => {
                (format!("proxy_{}", sanitize(&name)), String::new())
            }
            // `service.<name>.<stat>`: the stat is the last part (a service name may hold dots).
            None if name.starts_with("service.") => match name["service.".len()..].rsplit_once('.')
            {
                Some((service, stat)) => (
                    format!("proxy_service_{}", sanitize(stat)),
                    format!("{{service=\"{}\"}}", label_value(service)),
                ),
                None => (format!("proxy_{}", sanitize(&name)), String::new()),
            },
            None => (format!("envoy_{}", sanitize(&name)), String::new()),
        };
        let kind = if is_gauge(&name) { "gauge" } else { "counter" };
        families
            .entry(format!("{family} {kind}"))
            .or_default()
            .push((labels, value));
    }
    let mut out = String::new();
    for (head, samples) in families {
        let (family, kind) = head.split_once(' ').unwrap_or((&head, "counter"));
        let _ = writeln!(out, "# TYPE {family} {kind}");
        for (labels, value) in samples {
            let _ = writeln!(out, "{family}{labels} {value}");
        }
    }
    out
}

fn sanitize(name: &str) -> String {
    name.chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use proxy_core::config::Config;
    use tokio::sync::watch;

    use super::*;

    /// Envoy's `/stats?format=json` form: one list under `stats`, sorted by name.
    #[test]
    fn stats_json_is_envoys_form() {
        let config = Config::parse("{}", std::path::Path::new("t.yaml")).expect("empty config");
        let state = State::new(
            config,
            Arc::new(Mutex::new(None)),
            BTreeMap::new(),
            watch::channel(std::collections::BTreeSet::default()).1,
        );
        assert_eq!(
            serde_json::to_value(stats_map(&state)).unwrap(),
            serde_json::json!({"stats": [
                {"name": "server.clusters", "value": 0},
                {"name": "server.services", "value": 0}
            ]})
        );
    }
}
