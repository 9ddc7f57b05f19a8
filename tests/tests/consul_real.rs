//! Consul catalog discovery against a real Consul 1.8.7 dev agent: services and TTL checks
//! registered and changed live through the agent's HTTP API, and the backend's host set,
//! health and weights following within bounded time.
//!
//! Consul missing is a failure with instructions (`cargo xtask setup` installs it), never a
//! skip.

use std::{collections::BTreeMap, time::Duration};

use integration_tests::consul::{Consul, service};
use proxy_core::discovery::{
    EdsHealth,
    consul::{ConsulCluster, ConsulConfig, spawn_consul},
    source::{DiscoverySource as _, SourceUpdate},
};
use serde_json::json;

/// Upper bound of every wait for the backend to follow a catalog change.
const FOLLOW: Duration = Duration::from_secs(15);

/// `addr -> (health, weight)` of the published hosts.
type View = BTreeMap<String, (EdsHealth, u32)>;

fn view(update: &SourceUpdate) -> View {
    update
        .hosts
        .iter()
        .map(|h| (h.addr.to_string(), (h.eds_health, h.weight)))
        .collect()
}

fn expect(hosts: &[(&str, EdsHealth, u32)]) -> View {
    hosts
        .iter()
        .map(|(addr, health, weight)| ((*addr).to_owned(), (*health, *weight)))
        .collect()
}

fn config(consul: &Consul, service: &str) -> ConsulConfig {
    let mut config = ConsulConfig::new(service);
    config.address = consul.http_addr().to_string();
    config.datacenter = Some(consul.datacenter().to_owned());
    config.wait = Duration::from_secs(5);
    config.retry_backoff.base_interval = Duration::from_millis(100);
    config.retry_backoff.max_interval = Duration::from_millis(500);
    config
}

/// Waits until the published hosts are exactly `wanted`.
async fn wait_view(cluster: &ConsulCluster, consul: &Consul, wanted: View, what: &str) {
    let mut updates = cluster.updates();
    let seen = tokio::time::timeout(
        FOLLOW,
        updates.wait_for(|u| u.initialized && view(u) == wanted),
    );
    assert!(
        matches!(seen.await, Ok(Ok(_))),
        "{what}: hosts never became {wanted:?} within {FOLLOW:?}\nlast: {:?}\nstats: {:?}\n\
         consul log: {}",
        view(&cluster.current()),
        cluster.named_stats(),
        consul.log()
    );
}

#[tokio::test]
async fn hosts_health_and_weights_follow_the_catalog() {
    use EdsHealth::{Healthy, Unhealthy};
    let consul = Consul::start("dc-proxy").await;
    let mut web1 = service("web-1", "web", "127.0.0.2", 8080);
    web1["Weights"] = json!({"Passing": 5, "Warning": 2});
    web1["Meta"] = json!({"version": "v1"});
    consul.register(web1.clone()).await;
    // No service address: the node's address (127.0.0.1) is used.
    consul.register(service("web-2", "web", "", 8081)).await;
    consul
        .register(service("api-1", "api", "127.0.0.9", 9000))
        .await;

    let cluster = spawn_consul("web", config(&consul, "web")).expect("valid config");
    let both = |h1, w1| expect(&[("127.0.0.1:8081", Healthy, 1), ("127.0.0.2:8080", h1, w1)]);
    wait_view(&cluster, &consul, both(Healthy, 5), "initial registration").await;
    let web1_host = cluster
        .current()
        .hosts
        .into_iter()
        .find(|h| h.addr.port() == 8080);
    let meta = web1_host.expect("web-1 published").metadata;
    assert_eq!(meta.get("version").map(String::as_str), Some("v1"));

    consul.set_check("web-1-ttl", "warn").await;
    wait_view(
        &cluster,
        &consul,
        both(Healthy, 2),
        "warning: the Warning weight",
    )
    .await;
    consul.set_check("web-1-ttl", "fail").await;
    // Critical: unhealthy; the weight is the Passing one again (only a warning selects Warning).
    wait_view(&cluster, &consul, both(Unhealthy, 5), "critical: unhealthy").await;
    consul.set_check("web-1-ttl", "pass").await;
    wait_view(&cluster, &consul, both(Healthy, 5), "passing again").await;

    // Re-registering an instance with a new address moves the host.
    web1["Address"] = json!("127.0.0.3");
    consul.register(web1).await;
    let moved = expect(&[
        ("127.0.0.1:8081", Healthy, 1),
        ("127.0.0.3:8080", Healthy, 5),
    ]);
    wait_view(
        &cluster,
        &consul,
        moved,
        "re-registration with a new address",
    )
    .await;

    consul.deregister("web-2").await;
    let one = expect(&[("127.0.0.3:8080", Healthy, 5)]);
    wait_view(&cluster, &consul, one, "deregistration").await;
    consul.deregister("web-1").await;
    wait_view(&cluster, &consul, View::new(), "last instance deregistered").await;

    let stats: BTreeMap<String, u64> = cluster.named_stats().into_iter().collect();
    assert!(stats["cluster.web.consul.index"] > 1, "{stats:?}");
    assert!(stats["cluster.web.update_success"] >= 7, "{stats:?}");
    assert_eq!(stats["cluster.web.update_failure"], 0, "{stats:?}");
    assert_eq!(stats["cluster.web.membership_total"], 0, "{stats:?}");
}

#[tokio::test]
async fn tag_filter_and_only_passing() {
    use EdsHealth::{Healthy, Unhealthy};
    let consul = Consul::start("dc-tags").await;
    let mut blue = service("web-blue", "web", "127.0.0.2", 80);
    blue["Tags"] = json!(["blue"]);
    let mut green = service("web-green", "web", "127.0.0.3", 80);
    green["Tags"] = json!(["green"]);
    consul.register(blue).await;
    consul.register(green).await;

    let mut tagged = config(&consul, "web");
    tagged.tag = Some("blue".to_owned());
    let blue_only = spawn_consul("web-blue", tagged).expect("valid config");
    let mut strict = config(&consul, "web");
    strict.only_passing = true;
    let only_passing = spawn_consul("web-strict", strict).expect("valid config");

    wait_view(
        &blue_only,
        &consul,
        expect(&[("127.0.0.2:80", Healthy, 1)]),
        "tag blue",
    )
    .await;
    let all = |green| expect(&[("127.0.0.2:80", Healthy, 1), ("127.0.0.3:80", green, 1)]);
    wait_view(
        &only_passing,
        &consul,
        all(Healthy),
        "only_passing, all passing",
    )
    .await;
    consul.set_check("web-green-ttl", "warn").await;
    wait_view(
        &only_passing,
        &consul,
        all(Unhealthy),
        "only_passing: warning is unhealthy",
    )
    .await;
}

#[tokio::test]
async fn unknown_datacenter_and_a_dead_agent_are_failures_that_keep_hosts() {
    let mut consul = Consul::start("dc-fail").await;
    consul
        .register(service("web-1", "web", "127.0.0.2", 80))
        .await;

    let mut elsewhere = config(&consul, "web");
    elsewhere.datacenter = Some("dc-nowhere".to_owned());
    let lost = spawn_consul("web-lost", elsewhere).expect("valid config");
    let cluster = spawn_consul("web", config(&consul, "web")).expect("valid config");
    let one = expect(&[("127.0.0.2:80", EdsHealth::Healthy, 1)]);
    wait_view(&cluster, &consul, one.clone(), "registration").await;
    wait_view(
        &lost,
        &consul,
        View::new(),
        "unknown datacenter: initialized, no hosts",
    )
    .await;
    assert!(
        lost.stats().values().update_failure >= 1,
        "{:?}",
        lost.named_stats()
    );
    assert_eq!(lost.stats().values().update_success, 0);

    consul.kill();
    let failures_before = cluster.stats().values().update_failure;
    let deadline = tokio::time::Instant::now() + FOLLOW;
    while cluster.stats().values().update_failure < failures_before + 2 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no failed queries after the agent died: {:?}",
            cluster.named_stats()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        view(&cluster.current()),
        one,
        "hosts are kept while consul is down"
    );
}
