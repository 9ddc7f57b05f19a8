//! The stats pages' forms: Envoy's JSON and text, the circuit breakers' names, `filter`,
//! `usedonly` and `/reset_counters`; the exposition format in `exposition`.

mod exposition;

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use proxy_core::config::Config;
use tokio::sync::watch;

use super::*;

/// A state over `yaml`'s clusters, each running and past its first discovery.
async fn running(yaml: &str) -> State {
    let config = Config::parse(yaml, std::path::Path::new("t.yaml")).expect("config");
    let manager = proxy_core::health::HealthCheckManager::default();
    let mut upstreams = BTreeMap::new();
    for cluster in &config.clusters {
        let up = proxy_core::upstream::Upstream::spawn(cluster, &manager).expect("spawn");
        up.initialized().wait_for(|i| *i).await.unwrap();
        upstreams.insert(cluster.name.clone(), Arc::new(up));
    }
    State::new(
        config,
        Arc::new(Mutex::new(None)),
        upstreams,
        watch::channel(std::collections::BTreeSet::default()).1,
    )
}

/// A STATIC cluster `name` of one host at 127.0.0.1:`port`, as YAML list item.
fn static_cluster(name: &str, port: u16) -> String {
    format!(
        "  - name: {name}\n    load_assignment: {{ endpoints: [ {{ lb_endpoints: [ {{ endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {port} }} }} }} }} ] }} ] }}\n"
    )
}

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
        serde_json::to_value(stats_map(&state, &StatsQuery::all())).unwrap(),
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
    let up = proxy_core::upstream::Upstream::spawn(&config.clusters[0], &manager).expect("spawn");
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

/// Envoy's `/stats` forms of a histogram: `No recorded values`, then quantiles
/// (`P50(nan,17.5)`: no flush interval here), and in JSON the last entry of `stats`.
#[tokio::test]
async fn histograms_print_as_envoys_quantiles() {
    let state = running(&format!("clusters:\n{}", static_cluster("c", 81))).await;
    let q = StatsQuery::parse("filter=upstream_(rq_time|cx_connect_ms)").unwrap();
    assert_eq!(
        stats_text(&state, &q),
        "cluster.c.upstream_cx_connect_ms: No recorded values\n\
         cluster.c.upstream_rq_time: No recorded values\n"
    );
    let traffic = state.upstreams["c"].traffic();
    for _ in 0..4 {
        traffic.responses.time.record(Duration::from_millis(20));
    }
    let text = stats_text(&state, &StatsQuery::parse("filter=rq_time").unwrap());
    assert!(
        text.starts_with("cluster.c.upstream_rq_time: P0(nan,10) P25(nan,13.75) P50(nan,17.5)"),
        "{text}"
    );
    assert!(text.ends_with(" P100(nan,25)\n"), "{text}");
    let json = serde_json::to_value(stats_map(&state, &q)).unwrap();
    let last = &json["stats"][0]["histograms"];
    assert_eq!(last["supported_quantiles"][9], 100.0);
    let computed = &last["computed_quantiles"];
    assert_eq!(computed[0]["name"], "cluster.c.upstream_cx_connect_ms");
    assert_eq!(
        computed[0]["values"][2],
        serde_json::json!({"interval": null, "cumulative": null})
    );
    assert_eq!(computed[1]["values"][2]["cumulative"], 17.5);
}

/// `/reset_counters` zeroes the counters shown, not the gauges; a reset counter still counts
/// as used (`usedonly` shows it, as Envoy's), one never used does not; counting goes on.
#[tokio::test]
async fn reset_counters_zeroes_counters_and_usedonly_keeps_the_used() {
    let state = running(&format!("clusters:\n{}", static_cluster("c", 81))).await;
    let traffic = state.upstreams["c"].traffic();
    let host = "127.0.0.1:81".parse().unwrap();
    traffic.connect_result(host, true);
    traffic.connect_result(host, false);
    let _open = traffic.open(host);
    let shown = |query: &str| stats_text(&state, &StatsQuery::parse(query).unwrap());
    let q = "filter=cluster%5C.c%5C.upstream_cx_(total|connect_fail|active|none_healthy)$";
    assert_eq!(
        shown(q),
        "cluster.c.upstream_cx_active: 1\ncluster.c.upstream_cx_connect_fail: 1\n\
         cluster.c.upstream_cx_none_healthy: 0\ncluster.c.upstream_cx_total: 2\n"
    );
    assert!(reset_counters(&state) > 0);
    assert_eq!(
        shown(&format!("{q}&usedonly")),
        "cluster.c.upstream_cx_active: 1\ncluster.c.upstream_cx_connect_fail: 0\n\
         cluster.c.upstream_cx_total: 0\n"
    );
    traffic.connect_result(host, true);
    assert!(shown(q).contains("cluster.c.upstream_cx_total: 1\n"));
}

/// A cluster that a reload replaced after `/reset_counters` counts afresh: the baseline taken
/// from the cluster it replaced does not apply to it.
#[tokio::test]
async fn a_cluster_replaced_after_a_reset_counts_afresh() {
    let yaml = format!("clusters:\n{}", static_cluster("c", 81));
    let mut state = running(&yaml).await;
    let host = "127.0.0.1:81".parse().unwrap();
    for _ in 0..3 {
        state.upstreams["c"].traffic().connect_result(host, true);
    }
    reset_counters(&state);
    state.upstreams = running(&yaml).await.upstreams;
    for _ in 0..5 {
        state.upstreams["c"].traffic().connect_result(host, true);
    }
    let q = StatsQuery::parse("filter=c%5C.upstream_cx_total$").unwrap();
    assert_eq!(stats_text(&state, &q), "cluster.c.upstream_cx_total: 5\n");
}
