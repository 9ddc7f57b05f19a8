//! Catalog entries to hosts: addresses, ports, metadata, checks to health, weights.

use std::collections::BTreeMap;

use super::*;
use crate::{
    discovery::consul::catalog::{ServiceEntry, Skipped, health_and_weight, to_hosts},
    host::EdsHealth,
};

fn entries(instances: &[Inst]) -> Vec<ServiceEntry> {
    serde_json::from_value(body(instances)).expect("valid entries")
}

fn health(instance: Inst, only_passing: bool) -> (EdsHealth, u32) {
    health_and_weight(&entries(&[instance])[0], only_passing)
}

#[test]
fn address_is_the_service_address_else_the_node_address() {
    let mut on_node = inst("b", "", 9090);
    on_node.node = "n2";
    on_node.node_addr = "127.0.0.9";
    let (hosts, skipped) = to_hosts(&entries(&[inst("a", "127.0.0.3", 8080), on_node]), false);
    assert!(skipped.is_empty());
    let addrs: Vec<String> = hosts.iter().map(|h| h.addr.to_string()).collect();
    assert_eq!(addrs, ["127.0.0.3:8080", "127.0.0.9:9090"]);
    assert!(
        hosts
            .iter()
            .all(|h| h.priority == 0 && h.hostname().is_none())
    );
}

#[test]
fn ipv6_addresses_work_and_names_are_skipped() {
    let (hosts, skipped) = to_hosts(
        &entries(&[inst("a", "::1", 80), inst("b", "web.example", 80)]),
        false,
    );
    assert_eq!(hosts.len(), 1);
    assert_eq!(hosts[0].addr.to_string(), "[::1]:80");
    assert_eq!(
        skipped,
        [Skipped {
            instance: "n1/b".to_owned(),
            reason: "address \"web.example\" is not an IP literal".to_owned(),
        }]
    );
}

#[test]
fn hosts_are_ordered_by_address_whatever_the_answer_order() {
    let list = [
        inst("c", "127.0.0.4", 80),
        inst("a", "127.0.0.2", 80),
        inst("b", "127.0.0.3", 80),
    ];
    let (hosts, _) = to_hosts(&entries(&list), false);
    let addrs: Vec<String> = hosts.iter().map(|h| h.addr.to_string()).collect();
    assert_eq!(addrs, ["127.0.0.2:80", "127.0.0.3:80", "127.0.0.4:80"]);
}

#[test]
fn service_meta_becomes_host_metadata() {
    let mut a = inst("a", "127.0.0.2", 80);
    a.meta = json!({"version": "v2", "zone": "z1"});
    let (hosts, _) = to_hosts(&entries(&[a]), false);
    let expected: BTreeMap<String, String> = [("version", "v2"), ("zone", "z1")]
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .into();
    assert_eq!(hosts[0].metadata(), &expected);
    let mut b = inst("b", "127.0.0.3", 80);
    b.meta = Value::Null;
    assert!(
        to_hosts(&entries(&[b]), false).0[0].metadata().is_empty(),
        "null Meta is empty"
    );
}

#[test]
fn checks_map_to_health_and_weights_as_consul_does_for_envoy() {
    let weighted = |status: &'static str| {
        let mut i = inst("a", "127.0.0.2", 80).check(status);
        i.weights = json!({"Passing": 10, "Warning": 3});
        i
    };
    assert_eq!(health(weighted("passing"), false), (EdsHealth::Healthy, 10));
    assert_eq!(health(weighted("warning"), false), (EdsHealth::Healthy, 3));
    assert_eq!(
        health(weighted("critical"), false),
        (EdsHealth::Unhealthy, 10)
    );
    assert_eq!(
        health(weighted("maintenance"), false),
        (EdsHealth::Unhealthy, 10)
    );
    // OnlyPassing: anything but passing is unhealthy (the warning weight still applies).
    assert_eq!(health(weighted("warning"), true), (EdsHealth::Unhealthy, 3));
    assert_eq!(health(weighted("passing"), true), (EdsHealth::Healthy, 10));
}

#[test]
fn node_checks_count_and_no_checks_means_healthy() {
    let mut node_down = inst("a", "127.0.0.2", 80);
    node_down.checks[0] = "critical";
    assert_eq!(health(node_down, false), (EdsHealth::Unhealthy, 1));
    let mut unchecked = inst("a", "127.0.0.2", 80);
    unchecked.checks.clear();
    assert_eq!(health(unchecked, false), (EdsHealth::Healthy, 1));
}

#[test]
fn weights_are_clamped_and_zero_means_unhealthy() {
    let with = |weights: Value, status: &'static str| {
        let mut i = inst("a", "127.0.0.2", 80).check(status);
        i.weights = weights;
        health(i, false)
    };
    assert_eq!(
        with(json!({"Passing": 1, "Warning": 0}), "warning"),
        (EdsHealth::Unhealthy, 1)
    );
    assert_eq!(
        with(json!({"Passing": 0, "Warning": 1}), "passing"),
        (EdsHealth::Unhealthy, 1)
    );
    assert_eq!(
        with(json!({"Passing": 500, "Warning": 1}), "passing"),
        (EdsHealth::Healthy, 128)
    );
    // Without Weights: weight 1, and a warning does not change it.
    assert_eq!(with(Value::Null, "warning"), (EdsHealth::Healthy, 1));
}

#[tokio::test(start_paused = true)]
async fn published_hosts_carry_weight_health_and_metadata() {
    let mut a = inst("a", "127.0.0.2", 8080).check("warning");
    a.weights = json!({"Passing": 5, "Warning": 2});
    a.meta = json!({"version": "v1"});
    let b = inst("b", "127.0.0.3", 8080).check("critical");
    let script = Script::new(vec![Reply::Ok(3, body(&[a, b]))]);
    let cluster = start(ConsulConfig::new("web"), &script);
    let update = wait_state(&cluster, |u| u.initialized).await;
    assert_eq!(addrs(&update), ["127.0.0.2:8080", "127.0.0.3:8080"]);
    let h = &update.hosts;
    assert_eq!((h[0].weight, h[0].eds_health), (2, EdsHealth::Healthy));
    assert_eq!(
        h[0].metadata().get("version").map(String::as_str),
        Some("v1")
    );
    assert_eq!((h[1].weight, h[1].eds_health), (1, EdsHealth::Unhealthy));
    assert_eq!(cluster.stats().values().source.membership_total, 2);
}

#[tokio::test(start_paused = true)]
async fn only_passing_is_applied_by_the_watch() {
    let script = Script::new(vec![Reply::Ok(
        3,
        body(&[inst("a", "127.0.0.2", 80).check("warning")]),
    )]);
    let mut config = ConsulConfig::new("web");
    config.only_passing = true;
    let cluster = start(config, &script);
    let update = wait_state(&cluster, |u| u.initialized).await;
    assert_eq!(update.hosts[0].eds_health, EdsHealth::Unhealthy);
}

#[tokio::test(start_paused = true)]
async fn skipped_instances_are_counted() {
    let script = Script::new(vec![Reply::Ok(3, body(&[inst("a", "web.example", 80)]))]);
    let cluster = start(ConsulConfig::new("web"), &script);
    let update = wait_state(&cluster, |u| u.initialized).await;
    assert!(update.hosts.is_empty());
    assert_eq!(cluster.stats().values().instances_skipped, 1);
}
