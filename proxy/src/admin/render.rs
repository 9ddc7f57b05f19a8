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

/// Prometheus text exposition, with Envoy's naming: `cluster.<name>.<stat>` becomes
/// `envoy_cluster_<stat>{envoy_cluster_name="<name>"}`; kernel counters become `proxy_bpf_<name>`.
pub(super) fn prometheus(state: &State) -> String {
    let mut families: BTreeMap<String, Vec<(String, u64)>> = BTreeMap::new();
    for (name, value) in all_stats(state) {
        let (family, labels) = match name.strip_prefix("cluster.") {
            Some(rest) => {
                // The longest cluster name that the stat name starts with (a name may hold
                // dots): one lookup per dot, not a scan of every cluster per stat.
                let cluster = rest
                    .rmatch_indices('.')
                    .map(|(dot, _)| &rest[..dot])
                    .find(|c| state.upstreams.contains_key(*c));
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
                {"name": "server.chain_failures", "value": 0},
                {"name": "server.clusters", "value": 0},
                {"name": "server.services", "value": 0}
            ]})
        );
    }

    /// A cluster's circuit-breaker stats under Envoy's names: the overflow counters, the
    /// `circuit_breakers.default.*` gauges, and with `track_remaining` what remains of
    /// Envoy's defaults (1024 connections, pending requests and requests, 3 retries) when the
    /// thresholds set no limit.
    #[tokio::test]
    async fn circuit_breaker_stats_are_envoys_with_its_defaults() {
        let config = Config::parse(
            "clusters:\n  - name: c\n    circuit_breakers: { thresholds: [ { track_remaining: true } ] }\n    load_assignment: { endpoints: [ { lb_endpoints: [ { endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: 81 } } } } ] } ] }\n",
            std::path::Path::new("t.yaml"),
        )
        .expect("config");
        let manager = proxy_core::health::HealthCheckManager::default();
        let up =
            proxy_core::upstream::Upstream::spawn(&config.clusters[0], &manager).expect("spawn");
        let upstreams = BTreeMap::from([("c".to_owned(), Arc::new(up))]);
        let state = State::new(
            config,
            Arc::new(Mutex::new(None)),
            upstreams,
            watch::channel(std::collections::BTreeSet::default()).1,
        );
        let stats = all_stats(&state);
        let breakers: BTreeMap<&str, u64> = stats
            .iter()
            .filter(|(name, _)| name.contains("overflow") || name.contains("circuit_breakers"))
            .map(|(name, value)| (name.as_str(), *value))
            .collect();
        let d = "cluster.c.circuit_breakers.default";
        let want = BTreeMap::from([
            (format!("{d}.cx_open"), 0),
            (format!("{d}.cx_pool_open"), 0),
            (format!("{d}.remaining_cx"), 1024),
            (format!("{d}.remaining_cx_pools"), u64::MAX),
            (format!("{d}.remaining_pending"), 1024),
            (format!("{d}.remaining_retries"), 3),
            (format!("{d}.remaining_rq"), 1024),
            (format!("{d}.rq_open"), 0),
            (format!("{d}.rq_pending_open"), 0),
            (format!("{d}.rq_retry_open"), 0),
            ("cluster.c.upstream_cx_overflow".to_owned(), 0),
            ("cluster.c.upstream_rq_pending_overflow".to_owned(), 0),
            ("cluster.c.upstream_rq_active_overflow".to_owned(), 0),
            ("cluster.c.upstream_rq_retry_overflow".to_owned(), 0),
        ]);
        let want: BTreeMap<&str, u64> = want.iter().map(|(k, v)| (k.as_str(), *v)).collect();
        assert_eq!(breakers, want);
        assert!(is_gauge(&format!("{d}.remaining_cx")) && is_gauge(&format!("{d}.rq_open")));
        assert!(!is_gauge("cluster.c.upstream_cx_overflow"));
    }

    /// One parsed sample line: family, labels (unescaped), value.
    type Sample = (String, Vec<(String, String)>, u64);

    /// A strict reader of the text exposition format the page claims: every family has exactly
    /// one `# TYPE` line (counter or gauge) before its samples, which are contiguous; names are
    /// valid metric names; label values are quoted with `\\`, `\"` and `\n` escapes.
    fn parse_exposition(text: &str) -> Result<Vec<Sample>, String> {
        let valid_name = |n: &str| {
            !n.is_empty()
                && !n.starts_with(|c: char| c.is_ascii_digit())
                && n.chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
        };
        let mut typed: BTreeMap<String, String> = BTreeMap::new();
        let mut current: Option<String> = None;
        let mut samples = Vec::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (family, kind) = rest.split_once(' ').ok_or(format!("bad TYPE: {line}"))?;
                if !valid_name(family) || !matches!(kind, "counter" | "gauge") {
                    return Err(format!("bad TYPE: {line}"));
                }
                if typed.insert(family.to_owned(), kind.to_owned()).is_some() {
                    return Err(format!("second TYPE for {family}"));
                }
                current = Some(family.to_owned());
                continue;
            }
            let (series, value) = line.rsplit_once(' ').ok_or(format!("bad line: {line}"))?;
            let value: u64 = value.parse().map_err(|_| format!("bad value: {line}"))?;
            let (family, labels) = match series.split_once('{') {
                None => (series, Vec::new()),
                Some((family, rest)) => {
                    let body = rest
                        .strip_suffix('}')
                        .ok_or(format!("bad labels: {line}"))?;
                    let mut labels = Vec::new();
                    let mut chars = body.chars().peekable();
                    while chars.peek().is_some() {
                        let name: String = chars.by_ref().take_while(|c| *c != '=').collect();
                        if !valid_name(&name) || chars.next() != Some('"') {
                            return Err(format!("bad label: {line}"));
                        }
                        let mut value = String::new();
                        loop {
                            match chars.next().ok_or(format!("unterminated: {line}"))? {
                                '"' => break,
                                '\\' => match chars.next() {
                                    Some('\\') => value.push('\\'),
                                    Some('"') => value.push('"'),
                                    Some('n') => value.push('\n'),
                                    _ => return Err(format!("bad escape: {line}")),
                                },
                                c => value.push(c),
                            }
                        }
                        labels.push((name, value));
                        match chars.next() {
                            None => break,
                            Some(',') => {}
                            Some(_) => return Err(format!("bad separator: {line}")),
                        }
                    }
                    (family, labels)
                }
            };
            if current.as_deref() != Some(family) {
                return Err(format!("sample of {family} outside its TYPE block: {line}"));
            }
            samples.push((family.to_owned(), labels, value));
        }
        Ok(samples)
    }

    #[test]
    fn levels_are_gauges_and_events_counters() {
        for gauge in [
            "cluster.c.hosts_refused",
            "cluster.c.membership_healthy",
            "service.s.hosts_stale",
            "cluster.c.upstream_cx_active",
        ] {
            assert!(is_gauge(gauge), "{gauge}");
        }
        for counter in ["cluster.c.update_rejected", "cluster.c.upstream_cx_total"] {
            assert!(!is_gauge(counter), "{counter}");
        }
    }

    #[test]
    fn the_exposition_parser_refuses_what_prometheus_refuses() {
        for bad in [
            "# TYPE a counter\n# TYPE a gauge\na 1\n",
            "a 1\n",
            "# TYPE a counter\na{x=\"1} 1\n",
            "# TYPE a counter\na{x=\"\\q\"} 1\n",
            "# TYPE a summary\na 1\n",
            "# TYPE a counter\n# TYPE b counter\na 1\n",
        ] {
            assert!(parse_exposition(bad).is_err(), "{bad:?}");
        }
    }

    /// `/stats/prometheus` parses as the text exposition format, with every cluster, service and
    /// kernel stat present under its label, and label values escaped (a service name may hold
    /// any character the configuration allows; the escaping is checked with the worst ones).
    #[tokio::test]
    async fn prometheus_parses_with_one_type_per_family_and_escaped_labels() {
        let config = Config::parse(
            "clusters:\n  - name: c.x\n    load_assignment: { endpoints: [ { lb_endpoints: [ { endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: 81 } } } } ] } ] }\n  - name: c\n    load_assignment: { endpoints: [ { lb_endpoints: [ { endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: 82 } } } } ] } ] }\nservices:\n  - { name: web, address: 127.77.0.1, port: 80, cluster: c }\n",
            std::path::Path::new("t.yaml"),
        )
        .expect("config");
        let manager = proxy_core::health::HealthCheckManager::default();
        let mut upstreams = BTreeMap::new();
        for cluster in &config.clusters {
            let up = proxy_core::upstream::Upstream::spawn(cluster, &manager).expect("spawn");
            up.initialized().wait_for(|i| *i).await.unwrap();
            upstreams.insert(cluster.name.clone(), Arc::new(up));
        }
        let state = State::new(
            config,
            Arc::new(Mutex::new(None)),
            upstreams,
            watch::channel(std::collections::BTreeSet::default()).1,
        );
        let text = prometheus(&state);
        let samples = parse_exposition(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        let of = |family: &str, cluster: &str| {
            samples.iter().find(|(f, labels, _)| {
                f == family && labels == &[("envoy_cluster_name".to_owned(), cluster.to_owned())]
            })
        };
        // `c` and `c.x`: a stat of `c.x` must not be read as a stat `x.…` of `c`.
        for cluster in ["c", "c.x"] {
            let found = of("envoy_cluster_membership_total", cluster);
            assert_eq!(found.map(|s| s.2), Some(1), "{cluster}\n{text}");
        }
        assert!(
            of("envoy_cluster_x_membership_total", "c").is_none(),
            "{text}"
        );
        assert!(
            samples
                .iter()
                .any(|(f, l, v)| f == "envoy_server_services" && l.is_empty() && *v == 1),
            "{text}"
        );
        assert_eq!(label_value("a\\b\"c\nd"), "a\\\\b\\\"c\\nd");
        let line = format!(
            "# TYPE t counter\nt{{service=\"{}\"}} 3\n",
            label_value("a\\b\"c\nd")
        );
        assert_eq!(
            parse_exposition(&line).unwrap(),
            [(
                "t".to_owned(),
                vec![("service".to_owned(), "a\\b\"c\nd".to_owned())],
                3
            )]
        );
    }
}
