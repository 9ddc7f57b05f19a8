//! `/clusters` in Envoy's JSON and text forms, and `/routing`.

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
};

use proxy_core::{config::Config, health::HealthCheckManager, upstream::Upstream};
use serde_json::json;
use tokio::sync::watch;

use super::*;

const CONFIG: &str = "clusters:
  - name: c
    circuit_breakers:
      thresholds: [{ max_connections: 2, max_retries: 1 }, { priority: HIGH, max_requests: 7 }]
    load_assignment:
      endpoints:
        - lb_endpoints:
            - endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: 81 } } }
              load_balancing_weight: 3
        - priority: 1
          lb_endpoints:
            - endpoint: { address: { socket_address: { address: \"::1\", port_value: 82 } } }
services:
  - { name: web, address: 127.77.0.1, port: 80, cluster: c }
";

async fn state() -> (State, Arc<proxy_core::upstream::UpstreamTraffic>) {
    let config = Config::parse(CONFIG, std::path::Path::new("t.yaml")).expect("config");
    let upstream =
        Upstream::spawn(&config.clusters[0], &HealthCheckManager::default()).expect("spawn");
    upstream.initialized().wait_for(|i| *i).await.unwrap();
    let traffic = upstream.traffic();
    let upstreams = BTreeMap::from([("c".to_owned(), Arc::new(upstream))]);
    let state = State::new(
        config,
        Arc::new(Mutex::new(None)),
        upstreams,
        watch::channel(std::collections::BTreeSet::default()).1,
    );
    (state, traffic)
}

/// The JSON is Envoy's: defaults left out, stat values as strings, gauges typed, the
/// daemon's own fields nowhere.
#[tokio::test]
async fn clusters_json_is_envoys_schema() {
    let (state, traffic) = state().await;
    let host = "127.0.0.1:81".parse().unwrap();
    traffic.connect_result(host, true);
    traffic.connect_result(host, false);
    let _open = traffic.open(host);
    let json = serde_json::to_value(clusters_json(&state)).unwrap();
    let stats = |fail: Option<&str>, total: Option<&str>, active: Option<&str>| {
        let mut v = vec![
            json!({"name": "cx_connect_fail"}),
            json!({"name": "cx_total"}),
            json!({"type": "GAUGE", "name": "cx_active"}),
        ];
        for (i, value) in [fail, total, active].into_iter().enumerate() {
            if let Some(value) = value {
                v[i]["value"] = json!(value);
            }
        }
        v
    };
    // As a real Envoy 1.40 prints the same thresholds: every maximum, defaults filled in.
    let thresholds = json!([
        {"max_connections": 2, "max_pending_requests": 1024, "max_requests": 1024, "max_retries": 1},
        {"priority": "HIGH", "max_connections": 1024, "max_pending_requests": 1024, "max_requests": 7, "max_retries": 3}
    ]);
    let expected = json!({"cluster_statuses": [{
        "name": "c",
        "circuit_breakers": {"thresholds": thresholds},
        "observability_name": "c",
        "host_statuses": [
            {
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": 81}},
                "stats": stats(Some("1"), Some("2"), Some("1")),
                "health_status": {"eds_health_status": "HEALTHY"},
                "weight": 3,
                "locality": {}
            },
            {
                "address": {"socket_address": {"address": "::1", "port_value": 82}},
                "stats": stats(None, None, None),
                "health_status": {"eds_health_status": "HEALTHY"},
                "weight": 1,
                "priority": 1,
                "locality": {}
            }
        ]
    }]});
    assert_eq!(json, expected, "{json:#}");
}

#[test]
fn health_flags_map_to_envoys_and_false_ones_are_left_out() {
    let flags = HostFlags {
        failed_active_hc: true,
        pending_active_hc: true,
        eds_status_draining: true,
        ..HostFlags::default()
    };
    assert_eq!(
        serde_json::to_value(HostHealthStatus::new(&flags, EdsHealth::Draining)).unwrap(),
        json!({"failed_active_health_check": true, "pending_active_hc": true, "eds_health_status": "DRAINING"})
    );
    let flags = HostFlags {
        failed_eds_health: true,
        failed_outlier_check: true,
        ..HostFlags::default()
    };
    assert_eq!(
        serde_json::to_value(HostHealthStatus::new(&flags, EdsHealth::Timeout)).unwrap(),
        json!({"failed_outlier_check": true, "eds_health_status": "UNHEALTHY"})
    );
    assert_eq!(
        serde_json::to_value(HostHealthStatus::new(
            &HostFlags::default(),
            EdsHealth::Unknown
        ))
        .unwrap(),
        json!({"eds_health_status": "HEALTHY"})
    );
}

/// `/routing` keeps what `proxy status` shows, and the text `/clusters` is unchanged.
#[tokio::test]
async fn routing_and_text_keep_the_daemons_view() {
    let (state, _traffic) = state().await;
    let json = serde_json::to_value(routing(&state)).unwrap();
    assert_eq!(json[0]["services"], json!(["web 127.77.0.1:80"]));
    assert_eq!(
        json[0]["hosts"][0],
        json!({"address": "127.0.0.1:81", "health_flags": "healthy", "weight": 3, "priority": 0, "routable": true})
    );
    // Priority 1 is not needed while priority 0 is healthy.
    assert_eq!(json[0]["hosts"][1]["routable"], json!(false));
    let text = clusters_text(&state);
    assert!(
        text.starts_with("c::127.0.0.1:81::health_flags::healthy\nc::127.0.0.1:81::weight::3\n"),
        "{text}"
    );
}
