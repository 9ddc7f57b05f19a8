//! Consul catalog discovery against a real Consul 1.8.7 dev agent: services and TTL checks
//! registered and changed live through the agent's HTTP API, and the backend's host set,
//! health and weights following within bounded time. And the discovery chain compiler against
//! Consul's own: the mesh gateway modes of compiled targets, from every source, on local and
//! remote targets.
//!
//! And Consul's config entries watched live (`entries`).
//!
//! Consul missing is a failure with instructions (`cargo xtask setup` installs it), never a
//! skip.

#[path = "consul_real/cross_check.rs"]
mod cross_check;
#[path = "consul_real/entries.rs"]
mod entries;

use std::{collections::BTreeMap, time::Duration};

use integration_tests::consul::{Consul, service};
use proxy_chain::{CompileRequest, Entries, compile};
use proxy_core::{
    config::sources::consul::ConsulConfig,
    discovery::{
        consul::{ConsulCluster, spawn_consul},
        source::{DiscoverySource as _, SourceUpdate},
    },
    host::EdsHealth,
};
use serde_json::{Value, json};

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
    config.address = Some(consul.http_addr().to_string());
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
    let web1_host = web1_host.expect("web-1 published");
    assert_eq!(
        web1_host.metadata().get("version").map(String::as_str),
        Some("v1")
    );

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
        lost.stats().values().source.update_failure >= 1,
        "{:?}",
        lost.named_stats()
    );
    assert_eq!(lost.stats().values().source.update_success, 0);

    consul.kill();
    let failures_before = cluster.stats().values().source.update_failure;
    let deadline = tokio::time::Instant::now() + FOLLOW;
    while cluster.stats().values().source.update_failure < failures_before + 2 {
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

/// `"<subset>.<service>.<dc>" -> MeshGateway.Mode` of a compiled chain in Consul's JSON, ours or
/// Consul's (target IDs differ: 1.8.7 has no partition in them).
fn target_modes(chain: &Value) -> BTreeMap<String, String> {
    let targets = chain["Targets"].as_object().cloned().unwrap_or_default();
    targets
        .values()
        .map(|t| {
            let text = |field: &str| t[field].as_str().unwrap_or("").to_owned();
            let key = format!(
                "{}.{}.{}",
                text("ServiceSubset"),
                text("Service"),
                text("Datacenter")
            );
            let mode = t["MeshGateway"]["Mode"].as_str().unwrap_or("").to_owned();
            (key, mode)
        })
        .collect()
}

/// Whether the chain was customized by an override (a non-empty `CustomizationHash`).
fn customized(chain: &Value) -> bool {
    chain["CustomizationHash"]
        .as_str()
        .is_some_and(|h| !h.is_empty())
}

/// Compiles `main` from `entries` (already written to `consul`) in Consul and here, evaluated in
/// `compile_dc` (Consul's `compile-dc`; the agent's dc1 when `None`) and used from dc1, and
/// checks that both give every target the same mesh gateway mode and agree on customization.
/// Returns the modes.
async fn agree(
    consul: &Consul,
    entries: &[Value],
    compile_dc: Option<&str>,
    override_mode: &str,
    what: &str,
) -> BTreeMap<String, String> {
    let theirs = consul
        .compiled_chain("main", compile_dc, override_mode)
        .await;
    let set = Entries::from_json(&Value::Array(entries.to_vec()).to_string()).expect("entries");
    let mut request = CompileRequest::new("main", compile_dc.unwrap_or("dc1"), "consul");
    request.use_in_datacenter = "dc1".to_owned();
    request.override_mesh_gateway = override_mode.parse().expect("a mode");
    let ours = serde_json::to_value(compile(&request, &set).expect("compiles")).unwrap();
    let modes = target_modes(&theirs);
    assert!(
        !modes.is_empty(),
        "{what}: Consul's chain has no targets: {theirs}"
    );
    assert_eq!(
        (target_modes(&ours), customized(&ours)),
        (modes.clone(), customized(&theirs)),
        "{what}: ours (left), Consul's (right)\nConsul: {theirs}"
    );
    modes
}

/// Writes `entry` to Consul and expects it accepted.
async fn write(consul: &Consul, entry: &Value) {
    let (status, body) = consul.write_config(entry).await;
    assert_eq!(status, 200, "PUT {entry}: {body}");
}

/// Config entries that make `main`'s target local, redirected to dc2, or failing over to dc2.
fn target_kinds() -> [(&'static str, Option<Value>); 3] {
    [
        ("local target", None),
        (
            "redirect to dc2",
            Some(
                json!({"Kind": "service-resolver", "Name": "main", "Redirect": {"Datacenter": "dc2"}}),
            ),
        ),
        (
            "failover to dc2",
            Some(json!({"Kind": "service-resolver", "Name": "main",
                "Failover": {"*": {"Datacenters": ["dc2"]}}})),
        ),
    ]
}

/// Every mesh gateway mode from proxy-defaults, service-defaults and the request's override, on
/// a local target, a redirect and a failover to another datacenter: Consul 1.8.7's compiled
/// chain and ours agree. One agent suffices: a chain names other datacenters without
/// contacting them, and `compile-dc` moves the evaluation datacenter while the agent's stays
/// the datacenter the chain is used from.
#[tokio::test]
async fn compiled_chains_agree_with_consul_on_mesh_gateway_modes() {
    let consul = Consul::start("dc1").await;
    for (kind, resolver) in target_kinds() {
        match &resolver {
            Some(entry) => write(&consul, entry).await,
            None => consul.delete_config("service-resolver", "main").await,
        }
        for source in ["proxy-defaults", "service-defaults", "override"] {
            for mode in ["", "none", "local", "remote"] {
                consul.delete_config("proxy-defaults", "global").await;
                consul.delete_config("service-defaults", "main").await;
                let mut entries: Vec<Value> = resolver.iter().cloned().collect();
                let gateway = json!({"Mode": mode});
                let override_mode = match source {
                    "proxy-defaults" => {
                        entries.push(json!({"Kind": "proxy-defaults", "Name": "global", "MeshGateway": gateway}));
                        ""
                    }
                    "service-defaults" => {
                        entries.push(json!({"Kind": "service-defaults", "Name": "main", "MeshGateway": gateway}));
                        ""
                    }
                    _ => mode,
                };
                if let Some(entry) = entries.last().filter(|e| e["Kind"] != "service-resolver") {
                    write(&consul, entry).await;
                }
                let what = format!("{kind}, {source} {mode:?}");
                let modes = agree(&consul, &entries, None, override_mode, &what).await;
                // The remote target has the mode, a local one none (Consul 1.8.7).
                for (target, got) in &modes {
                    let want = if target.rsplit('.').next() == Some("dc1") {
                        ""
                    } else {
                        mode
                    };
                    assert_eq!(got, want, "{what}: {target}");
                }
            }
        }
    }
    precedence_and_compile_dc(&consul).await;
}

/// service-defaults over proxy-defaults, the override over both; `compile-dc=dc2`; and no
/// mode on a service-resolver in 1.8.7.
async fn precedence_and_compile_dc(consul: &Consul) {
    let redirect =
        json!({"Kind": "service-resolver", "Name": "main", "Redirect": {"Datacenter": "dc2"}});
    let global =
        json!({"Kind": "proxy-defaults", "Name": "global", "MeshGateway": {"Mode": "remote"}});
    let service =
        json!({"Kind": "service-defaults", "Name": "main", "MeshGateway": {"Mode": "local"}});
    for entry in [&redirect, &global, &service] {
        write(consul, entry).await;
    }
    let all = [redirect.clone(), global.clone(), service.clone()];
    for (override_mode, want) in [("", "local"), ("local", "local"), ("none", "none")] {
        let what = format!(
            "service-defaults local over proxy-defaults remote, override {override_mode:?}"
        );
        let modes = agree(consul, &all, None, override_mode, &what).await;
        assert_eq!(modes.values().collect::<Vec<_>>(), [want], "{what}");
    }

    // Evaluated in dc2 from a dc1 agent: main.dc2 is remote, a redirect back to dc1 is local.
    consul.delete_config("service-resolver", "main").await;
    let both = [global.clone(), service.clone()];
    let modes = agree(consul, &both, Some("dc2"), "", "compile-dc dc2").await;
    assert_eq!(
        modes,
        BTreeMap::from([(".main.dc2".to_owned(), "local".to_owned())])
    );
    let home =
        json!({"Kind": "service-resolver", "Name": "main", "Redirect": {"Datacenter": "dc1"}});
    write(consul, &home).await;
    let modes = agree(
        consul,
        &[home, global, service],
        Some("dc2"),
        "remote",
        "compile-dc dc2, redirect home",
    )
    .await;
    assert_eq!(
        modes,
        BTreeMap::from([(".main.dc1".to_owned(), String::new())])
    );

    // A service-resolver has no MeshGateway in 1.8.7: both refuse it.
    let resolver_mode =
        json!({"Kind": "service-resolver", "Name": "main", "MeshGateway": {"Mode": "local"}});
    let (status, body) = consul.write_config(&resolver_mode).await;
    assert_ne!(status, 200, "Consul accepted {resolver_mode}: {body}");
    let ours = Entries::from_json(&json!([resolver_mode]).to_string());
    assert!(ours.is_err(), "we accepted {resolver_mode}");
}
