//! CDS and LDS against the real control plane, side by side with Envoy 1.40 subscribed to the
//! same server (SotW and delta ADS): per version pushed, the same ACK or NACK of each type, the
//! same clusters and listeners active and the same hosts of a STATIC cluster (port, weight,
//! priority), through a bad version, a listener whose cluster is not there yet, and removals;
//! and HTTP connection managers with an inline route table or one by RDS.

use std::{collections::BTreeSet, time::Duration};

use integration_tests::xds_server::{Envoy, WAIT, XdsServer};
use proxy_core::{
    config::sources::xds::{GrpcApi, Transport, XdsConfig},
    desired::Overlay,
    discovery::xds::{
        EdsClient,
        resources::{FileNames, ResourceState},
        spawn_ads,
    },
};
use serde_json::{Value, json};
use tokio::sync::watch;

const CLUSTER: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
const LISTENER: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
const ROUTE: &str = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration";

/// Envoy and our client, subscribed to CDS and LDS the same way.
pub(super) struct Side {
    flavour: &'static str,
    envoy_node: &'static str,
    pub(super) envoy: Envoy,
    ours_node: &'static str,
    _ours: EdsClient,
    pub(super) overlay: watch::Receiver<Overlay>,
}

impl Side {
    pub(super) fn start(server: &XdsServer, delta: bool) -> Self {
        let (flavour, envoy_node, ours_node, api_type) = if delta {
            ("delta", "envoy-cds-delta", "ours-cds-delta", "DELTA_GRPC")
        } else {
            ("sotw", "envoy-cds", "ours-cds", "GRPC")
        };
        let envoy =
            tokio::task::block_in_place(|| Envoy::start_dynamic(server, envoy_node, api_type));
        let xds: XdsConfig = serde_norway::from_str(&format!(
            "node: {{id: {ours_node}, cluster: edge}}\nads_config: {{api_type: {api_type}, server_uri: '{}'}}\ncds_config: {{ads: {{}}}}\nlds_config: {{ads: {{}}}}",
            server.grpc_uri()
        ))
        .expect("an xds block");
        let transport = Transport::Grpc {
            uri: server.grpc_uri(),
            api: GrpcApi::Aggregated,
            delta,
        };
        let (tx, overlay) = watch::channel(Overlay::default());
        let state = ResourceState::new(xds, FileNames::default(), tx);
        let ours = spawn_ads(super::source(transport, ours_node), Vec::new(), None, state)
            .expect("an ADS source");
        Self {
            flavour,
            envoy_node,
            envoy,
            ours_node,
            _ours: ours,
            overlay,
        }
    }

    /// Envoy's active `(clusters, listeners)` once they equal `want` (or the last after WAIT);
    /// its static `xds` cluster left out.
    pub(super) async fn envoy_active(&self, want: &Active) -> Active {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let seen = tokio::task::block_in_place(|| {
                let clusters = names(&self.envoy.clusters(), "cluster_statuses", "name");
                let listeners = names(&self.envoy.listeners(), "listener_statuses", "name");
                (
                    clusters.into_iter().filter(|c| c != "xds").collect(),
                    listeners,
                )
            });
            if seen == *want || tokio::time::Instant::now() >= deadline {
                return seen;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Our published `(clusters, services)` once they equal `want` (or the last after WAIT).
    pub(super) async fn our_active(&mut self, want: &Active) -> Active {
        let view = |o: &Overlay| -> Active {
            (
                o.clusters.iter().map(|c| c.name.clone()).collect(),
                o.services.iter().map(|s| s.name.clone()).collect(),
            )
        };
        let _ = tokio::time::timeout(WAIT, self.overlay.wait_for(|o| view(o) == *want)).await;
        view(&self.overlay.borrow())
    }
}

pub(super) type Active = (BTreeSet<String>, BTreeSet<String>);

/// `(port, weight, priority)` of a host.
type HostView = (u64, u64, u64);

impl Side {
    /// Envoy's hosts of `cluster`, as its admin shows them.
    fn envoy_hosts(&self, cluster: &str) -> BTreeSet<HostView> {
        let clusters = tokio::task::block_in_place(|| self.envoy.clusters());
        let all = super::envoy_hosts(&clusters, cluster).into_iter();
        all.map(|(port, weight, priority, _)| (port, weight, priority))
            .collect()
    }

    /// Our hosts of STATIC `cluster`, as published.
    fn our_hosts(&self, cluster: &str) -> BTreeSet<HostView> {
        let overlay = self.overlay.borrow();
        let Some(found) = overlay.clusters.iter().find(|c| c.name == cluster) else {
            return BTreeSet::new();
        };
        let hosts = found.static_hosts();
        hosts
            .iter()
            .map(|h| {
                (
                    u64::from(h.addr.port()),
                    u64::from(h.weight),
                    u64::from(h.priority),
                )
            })
            .collect()
    }
}

fn names(admin: &Value, list: &str, field: &str) -> BTreeSet<String> {
    let items = admin[list].as_array().cloned().unwrap_or_default();
    items
        .iter()
        .filter_map(|i| i[field].as_str().map(str::to_owned))
        .collect()
}

pub(super) fn active(clusters: &[&str], listeners: &[&str]) -> Active {
    (
        clusters.iter().map(|&c| c.to_owned()).collect(),
        listeners.iter().map(|&l| l.to_owned()).collect(),
    )
}

pub(super) fn static_cluster(name: &str, address: &str, port: u16) -> Value {
    json!({"name": name, "type": "STATIC", "connect_timeout": "1s", "lb_policy": "RANDOM",
           "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
               {"endpoint": {"address": {"socket_address": {"address": address, "port_value": port}}},
                "load_balancing_weight": 3}]}]}})
}

fn eds_cluster(name: &str) -> Value {
    json!({"name": name, "type": "EDS", "connect_timeout": "1s", "lb_policy": "RANDOM",
           "eds_cluster_config": {"eds_config": {"ads": {}, "resource_api_version": "V3"}}})
}

fn tcp_listener(name: &str, port: u16, cluster: &str) -> Value {
    json!({"name": name,
           "address": {"socket_address": {"address": "127.77.240.1", "port_value": port}},
           "filter_chains": [{"filters": [{"name": "envoy.filters.network.tcp_proxy", "typed_config": {
               "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
               "stat_prefix": name, "cluster": cluster}}]}]})
}

/// ACK (`None`) or NACK (`Some(error_detail)`): `node`'s answer of `type_url` after the first
/// `skip` requests.
fn verdict(server: &XdsServer, node: &str, type_url: &str, skip: usize) -> Option<String> {
    let answer = tokio::task::block_in_place(|| {
        server.wait_request(&format!("{node}'s ACK or NACK of {type_url}"), skip, |r| {
            r["node"] == node
                && r["type_url"] == type_url
                && !r["response_nonce"].as_str().unwrap_or("").is_empty()
        })
    });
    answer["error_detail"].as_str().map(str::to_owned)
}

/// Pushes `resources` of `kind` at `version`; on each side (SotW, delta) Envoy and we must both
/// ACK (`nack`: `None`) or both NACK with `nack`'s words in both details, and then show `want` (Envoy's, ours) active.
async fn step(
    server: &XdsServer,
    sides: &mut [Side],
    version: &str,
    push: (&str, Value),
    nack: (Option<&str>, Option<&str>),
    want: (&Active, &Active),
) {
    let before = tokio::task::block_in_place(|| server.requests().len());
    let (kind, resources) = push;
    let type_url = match kind {
        "cluster" => CLUSTER,
        "route" => ROUTE,
        _ => LISTENER,
    };
    tokio::task::block_in_place(|| server.push_resources(kind, version, resources));
    for side in sides.iter_mut() {
        let nack = if side.flavour == "sotw" {
            nack.0
        } else {
            nack.1
        };
        let theirs = verdict(server, side.envoy_node, type_url, before);
        let ours = verdict(server, side.ours_node, type_url, before);
        let what = format!("{kind} v{version} ({})", side.flavour);
        assert_eq!(
            (theirs.is_some(), ours.is_some()),
            (nack.is_some(), nack.is_some()),
            "{what}: ACK/NACK of Envoy (left) and ours (right): {theirs:?} / {ours:?}"
        );
        for detail in [&theirs, &ours].into_iter().flatten() {
            let words = nack.unwrap_or_default();
            assert!(
                detail.contains(words),
                "{what}: NACK {detail:?} lacks {words:?}"
            );
        }
        let (envoy, our) = (
            side.envoy_active(want.0).await,
            side.our_active(want.1).await,
        );
        assert_eq!(
            (&envoy, &our),
            want,
            "{what}: active clusters and listeners of Envoy (left) and ours (right)"
        );
    }
}

/// The first state: the same clusters and listeners active, the same hosts of `a`, LDS ACKed.
async fn first_state_agrees(server: &XdsServer, sides: &mut [Side], both: &Active) {
    for side in sides {
        let (envoy, our) = (side.envoy_active(both).await, side.our_active(both).await);
        assert_eq!((&envoy, &our), (both, both), "v1 ({})", side.flavour);
        let hosts = (side.envoy_hosts("a"), side.our_hosts("a"));
        let want: BTreeSet<HostView> = [(9001, 3, 0)].into();
        assert_eq!(
            (&hosts.0, &hosts.1),
            (&want, &want),
            "v1 ({}): hosts of a",
            side.flavour
        );
        for (node, type_url) in [(side.envoy_node, LISTENER), (side.ours_node, LISTENER)] {
            assert_eq!(
                verdict(server, node, type_url, 0),
                None,
                "{node}: LDS v1 ACKed"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_and_we_agree_on_cds_and_lds() {
    let server = tokio::task::block_in_place(XdsServer::start);
    let port = std::net::TcpListener::bind("127.77.240.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port on 127.77.240.1")
        .port();
    // EDS cluster b gets its endpoints at once: Envoy warms it on them.
    server.push("b", "1", super::endpoints(&[9101]));
    let a = static_cluster("a", "127.0.0.1", 9001);
    server.push_resources("cluster", "1", json!([a, eds_cluster("b")]));
    server.push_resources("listener", "1", json!([tcp_listener("web", port, "a")]));
    let mut sides = [Side::start(&server, false), Side::start(&server, true)];
    let both = active(&["a", "b"], &["web"]);
    first_state_agrees(&server, &mut sides, &both).await;
    // A STATIC host that is not an IP: both NACK, both keep v1.
    let bad = static_cluster("a", "not-an-ip", 9001);
    step(
        &server,
        &mut sides,
        "2",
        ("cluster", json!([bad, eds_cluster("b")])),
        (Some("not-an-ip"), Some("not-an-ip")),
        (&both, &both),
    )
    .await;
    // One name twice: over SotW both NACK ("duplicate cluster a found"; Envoy has applied the
    // first of the two by then, we keep v1 whole: docs/xds.md). The server's delta sends a name once,
    // so there both ACK the first.
    let twice = json!([
        static_cluster("a", "127.0.0.1", 9002),
        static_cluster("a", "127.0.0.1", 9001),
        eds_cluster("b")
    ]);
    step(
        &server,
        &mut sides,
        "2d",
        ("cluster", twice),
        (Some("duplicate"), None),
        (&both, &both),
    )
    .await;
    // A listener naming a cluster that does not exist: both ACK; Envoy serves it (its
    // tcp_proxy looks the cluster up per connection), we hold it until the cluster arrives.
    let waiting = json!([
        tcp_listener("web", port, "a"),
        tcp_listener("late", port + 1, "c")
    ]);
    let envoy_view = active(&["a", "b"], &["late", "web"]);
    step(
        &server,
        &mut sides,
        "2",
        ("listener", waiting),
        (None, None),
        (&envoy_view, &both),
    )
    .await;
    let with_c = json!([
        static_cluster("a", "127.0.0.1", 9001),
        eds_cluster("b"),
        static_cluster("c", "127.0.0.1", 9003)
    ]);
    let all = active(&["a", "b", "c"], &["late", "web"]);
    step(
        &server,
        &mut sides,
        "3",
        ("cluster", with_c),
        (None, None),
        (&all, &all),
    )
    .await;
    // Removals: listeners, then clusters.
    let gone = active(&["a", "b", "c"], &[]);
    step(
        &server,
        &mut sides,
        "3",
        ("listener", json!([])),
        (None, None),
        (&gone, &gone),
    )
    .await;
    let only_a = active(&["a"], &[]);
    let a = static_cluster("a", "127.0.0.1", 9001);
    step(
        &server,
        &mut sides,
        "4",
        ("cluster", json!([a])),
        (None, None),
        (&only_a, &only_a),
    )
    .await;
}

pub(super) fn http_listener(name: &str, port: u16, routes: &Value) -> Value {
    json!({"name": name,
           "address": {"socket_address": {"address": "127.77.240.1", "port_value": port}},
           "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": {
               "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
               "stat_prefix": name,
               "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
                   "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
               "route_config": {"name": "local", "virtual_hosts": [
                   {"name": "all", "domains": ["*"], "routes": routes}]}}}]}]})
}

/// HTTP connection managers with an inline route table: both ACK a good one and show it
/// active, both NACK a route naming a cluster that is not there (Envoy validates inline
/// tables) and keep the last good one, both take a weighted split, and both withdraw it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_and_we_agree_on_inline_http_listeners() {
    let server = tokio::task::block_in_place(XdsServer::start);
    let port = std::net::TcpListener::bind("127.77.240.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port on 127.77.240.1")
        .port();
    let (a, b) = (
        static_cluster("a", "127.0.0.1", 9001),
        static_cluster("b", "127.0.0.1", 9002),
    );
    server.push_resources("cluster", "1", json!([a, b]));
    let routes = json!([
        {"match": {"prefix": "/b", "headers": [{"name": "x-v", "string_match": {"exact": "2"}}]},
         "route": {"cluster": "b"}},
        {"match": {"path": "/only-b"}, "route": {"cluster": "b", "timeout": "3s"}},
        {"match": {"prefix": "/"}, "route": {"cluster": "a"}}
    ]);
    server.push_resources(
        "listener",
        "1",
        json!([http_listener("web", port, &routes)]),
    );
    let mut sides = [Side::start(&server, false), Side::start(&server, true)];
    let both = active(&["a", "b"], &["web"]);
    first_state_agrees(&server, &mut sides, &both).await;
    let unknown = json!([{"match": {"prefix": "/"}, "route": {"cluster": "zz"}}]);
    let words = Some("route: unknown cluster 'zz'");
    step(
        &server,
        &mut sides,
        "2",
        ("listener", json!([http_listener("web", port, &unknown)])),
        (words, words),
        (&both, &both),
    )
    .await;
    let split = json!([{"match": {"prefix": "/"}, "route": {"weighted_clusters": {"clusters": [
        {"name": "a", "weight": 1}, {"name": "b", "weight": 3}]}}}]);
    step(
        &server,
        &mut sides,
        "3",
        ("listener", json!([http_listener("web", port, &split)])),
        (None, None),
        (&both, &both),
    )
    .await;
    let gone = active(&["a", "b"], &[]);
    step(
        &server,
        &mut sides,
        "4",
        ("listener", json!([])),
        (None, None),
        (&gone, &gone),
    )
    .await;
}

/// An HTTP listener whose routes come by RDS over ADS as `route`.
fn rds_listener(name: &str, port: u16, route: &str) -> Value {
    let mut listener = http_listener(name, port, &json!([]));
    let hcm = &mut listener["filter_chains"][0]["filters"][0]["typed_config"];
    let Some(fields) = hcm.as_object_mut() else {
        unreachable!("an HttpConnectionManager object")
    };
    fields.remove("route_config");
    fields.insert(
        "rds".into(),
        json!({"config_source": {"ads": {}, "resource_api_version": "V3"}, "route_config_name": route}),
    );
    listener
}

fn route_configuration(name: &str, routes: &Value) -> Value {
    json!({"name": name, "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": routes}]})
}

/// HTTP connection managers with routes by RDS: both ask for the route configuration by name
/// (we hold the listener until it arrives), ACK a good one, both NACK a table naming a cluster that is not there
/// with `validate_clusters: true`, both take a weighted split; a route configuration removed
/// is ACKed by both, Envoy keeps the listener active where we withdraw it (docs/xds.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_and_we_agree_on_rds_http_listeners() {
    let server = tokio::task::block_in_place(XdsServer::start);
    let port = std::net::TcpListener::bind("127.77.240.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port on 127.77.240.1")
        .port();
    let (a, b) = (
        static_cluster("a", "127.0.0.1", 9001),
        static_cluster("b", "127.0.0.1", 9002),
    );
    server.push_resources("cluster", "1", json!([a, b]));
    server.push_resources("listener", "1", json!([rds_listener("web", port, "r1")]));
    let mut sides = [Side::start(&server, false), Side::start(&server, true)];
    // Both ask for r1 by name; we hold the listener until it arrives (Envoy's admin lists its
    // warming listener already).
    let held = active(&["a", "b"], &[]);
    for side in &mut sides {
        for node in [side.envoy_node, side.ours_node] {
            tokio::task::block_in_place(|| {
                server.wait_request(&format!("{node}'s RDS request of r1"), 0, |r| {
                    let names = if side.flavour == "sotw" {
                        &r["resource_names"]
                    } else {
                        &r["subscribe"]
                    };
                    r["node"] == node && r["type_url"] == ROUTE && *names == json!(["r1"])
                })
            });
        }
        assert_eq!(
            side.our_active(&held).await,
            held,
            "warming ({})",
            side.flavour
        );
    }
    let routes = json!([
        {"match": {"prefix": "/b"}, "route": {"cluster": "b"}},
        {"match": {"prefix": "/"}, "route": {"cluster": "a"}}
    ]);
    let both = active(&["a", "b"], &["web"]);
    let r1 = |routes: &Value| json!([route_configuration("r1", routes)]);
    step(
        &server,
        &mut sides,
        "1",
        ("route", r1(&routes)),
        (None, None),
        (&both, &both),
    )
    .await;
    let mut unknown = route_configuration(
        "r1",
        &json!([{"match": {"prefix": "/"}, "route": {"cluster": "zz"}}]),
    );
    unknown["validate_clusters"] = json!(true);
    let words = Some("route: unknown cluster 'zz'");
    step(
        &server,
        &mut sides,
        "2",
        ("route", json!([unknown])),
        (words, words),
        (&both, &both),
    )
    .await;
    let split = json!([{"match": {"prefix": "/"}, "route": {"weighted_clusters": {"clusters": [
        {"name": "a", "weight": 1}, {"name": "b", "weight": 3}]}}}]);
    step(
        &server,
        &mut sides,
        "3",
        ("route", r1(&split)),
        (None, None),
        (&both, &both),
    )
    .await;
    step(
        &server,
        &mut sides,
        "4",
        ("route", json!([])),
        (None, None),
        (&both, &held),
    )
    .await;
}
