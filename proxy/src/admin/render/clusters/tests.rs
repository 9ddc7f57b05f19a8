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

/// A host's kernel-path connects add to its `cx_total` in both forms, and only there:
/// `cx_connect_fail` and `cx_active` stay the proxy path's; a host with kernel-path connects
/// only shows them alone.
#[tokio::test]
async fn kernel_connects_add_to_cx_total_only() {
    let (state, traffic) = state().await;
    let (v4, v6): (SocketAddr, SocketAddr) =
        ("127.0.0.1:81".parse().unwrap(), "[::1]:82".parse().unwrap());
    traffic.connect_result(v4, true);
    traffic.connect_result(v4, false);
    let _open = traffic.open(v4);
    // Another address with the same IP, and a host of no cluster: counted for nobody here.
    let kernel = HashMap::from([
        (v4, 5),
        (v6, 7),
        ("127.0.0.1:82".parse().unwrap(), 100),
        ("127.0.0.9:81".parse().unwrap(), 100),
    ]);
    let json = serde_json::to_value(json_with(&state, &kernel)).unwrap();
    let hosts = &json["cluster_statuses"][0]["host_statuses"];
    assert_eq!(
        hosts[0]["stats"],
        json!([
            {"name": "cx_connect_fail", "value": "1"},
            {"name": "cx_total", "value": "7"},
            {"type": "GAUGE", "name": "cx_active", "value": "1"}
        ])
    );
    assert_eq!(
        hosts[1]["stats"],
        json!([
            {"name": "cx_connect_fail"},
            {"name": "cx_total", "value": "7"},
            {"type": "GAUGE", "name": "cx_active"}
        ])
    );
    let text = text_with(&state, &kernel);
    for line in [
        "c::127.0.0.1:81::cx_active::1\nc::127.0.0.1:81::cx_connect_fail::1\nc::127.0.0.1:81::cx_total::7\nc::127.0.0.1:81::health_flags::healthy\n",
        "c::[::1]:82::cx_active::0\nc::[::1]:82::cx_connect_fail::0\nc::[::1]:82::cx_total::7\n",
    ] {
        assert!(text.contains(line), "{line} in {text}");
    }
    // Without kernel counts, the proxy path's alone.
    let text = text_with(&state, &HashMap::new());
    assert!(text.contains("c::127.0.0.1:81::cx_total::2\n"), "{text}");
    assert!(text.contains("c::[::1]:82::cx_total::0\n"), "{text}");
}

/// `/routing` keeps what `proxy status` shows; the text `/clusters` has Envoy's host stats
/// first, then the daemon's lines as before.
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
        text.starts_with(
            "c::127.0.0.1:81::cx_active::0\nc::127.0.0.1:81::cx_connect_fail::0\n\
             c::127.0.0.1:81::cx_total::0\nc::127.0.0.1:81::health_flags::healthy\n\
             c::127.0.0.1:81::weight::3\n"
        ),
        "{text}"
    );
}
