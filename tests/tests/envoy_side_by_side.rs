//! The daemon and a real Envoy 1.40 side by side (root): the same STATIC cluster of three
//! loopback backends with the same active TCP health check, in one fresh network namespace. Both
//! admin interfaces are read in Envoy's JSON schemas (`/clusters?format=json`,
//! `/stats?format=json`) and compared: per host (address, port, failed_active_health_check,
//! eds_health_status, weight, priority) over time while backends die, the open-connection gauges
//! (`upstream_cx_active`, per host `cx_active`) while clients hold connections, and panic mode
//! (`lb_healthy_panic`, membership) when two of three hosts are down. Envoy's traffic goes
//! through its tcp_proxy; the daemon's through the kernel redirect to its proxy path. A second
//! case leaves `no_traffic_interval` at its default (60 s) and sends no traffic: both find a dead
//! host by two checks a minute apart, at the same time (about two minutes; runs in parallel);
//! beside it, the same default with traffic right after start: both find a dead host at the
//! 60 s check and the one `interval` after it.
//! A third runs a STRICT_DNS cluster on both against one unbound in the namespace: an address
//! two names return is two hosts, a stopped server leaves both with their hosts and counting
//! failures, and after its restart with a changed record both follow within a backoff and a
//! refresh of each other. A fourth subscribes both to one xDS server's EDS cluster and pushes
//! the same assignments: every EDS health status, weights, priorities, hosts leaving; both
//! `/clusters` and the membership stats must agree after each version. The absent cells of the
//! health matrix (hosts discovery stops sending) are compared in `removal`, locality-weighted
//! round robin (kernel and proxy path) in `locality`, zone-aware routing in `zone`, the
//! assignment policy's `drop_overloads` (HTTP and TCP on the proxy path) in `drop`, and its
//! `endpoint_stale_after` (the lease of an EDS assignment) in `lease`.

#[path = "envoy_side_by_side/drop.rs"]
mod drop;
#[path = "envoy_side_by_side/lease.rs"]
mod lease;
#[path = "envoy_side_by_side/locality.rs"]
mod locality;
#[path = "envoy_side_by_side/removal.rs"]
mod removal;
#[path = "envoy_side_by_side/zone.rs"]
mod zone;

use std::{
    net::{SocketAddr, TcpStream},
    path::PathBuf,
    time::{Duration, Instant},
};

use integration_tests::{
    kernel::{
        BannerServers, Daemon, InCgroup, Netns, Probe, TestCgroup, in_netns, require_root,
        skip_without_dataplane, unique,
    },
    unbound::Unbound,
    xds_server::{Envoy, XdsServer, http, python},
};
use serde_json::{Value, json};

const BACKENDS: [&str; 3] = ["127.0.0.91:8091", "127.0.0.92:8092", "127.0.0.93:8093"];
const VIP: &str = "127.77.9.1:80";

/// The daemon's side of an EDS comparison: cluster `c` over ADS from `server`, service `web` at
/// [`VIP`], its instance name from `prefix`.
fn eds_daemon_config(prefix: &str, cgroup: &TestCgroup, server: &XdsServer) -> String {
    let vip: SocketAddr = VIP.parse().unwrap();
    format!(
        "instance: {}\ncgroup: {}\nadmin:\n  address: \"{{admin}}\"\nxds:\n  node: {{ id: {}, cluster: edge }}\n  ads_config: {{ api_type: GRPC, server_uri: \"{}\" }}\nclusters:\n  - name: c\n    type: EDS\n    eds_cluster_config: {{ eds_config: {{ ads: {{}} }} }}\nservices:\n  - {{ name: web, address: \"{}\", port: {}, cluster: c }}\n",
        unique(prefix),
        cgroup.path().display(),
        unique("daemon"),
        server.grpc_addr(),
        vip.ip(),
        vip.port()
    )
}
/// Envoy's tcp_proxy listener (the daemon's proxy listener is 127.0.0.1:15001).
const ENVOY_LISTENER: &str = "127.0.0.1:15002";
/// Envoy's defaults but a short interval, and a short `no_traffic_interval` unless
/// `default_no_traffic` (then an idle cluster is checked every 60 s); the thresholds and timeout
/// have no default in Envoy.
fn health_check(default_no_traffic: bool) -> Value {
    let mut check = json!({"timeout": "1s", "interval": "0.5s", "no_traffic_interval": "0.5s",
           "unhealthy_threshold": 2, "healthy_threshold": 1, "tcp_health_check": {}});
    if default_no_traffic {
        check.as_object_mut().unwrap().remove("no_traffic_interval");
    }
    check
}

/// The cluster both run, as Envoy's JSON (the daemon reads the same fields from its YAML).
fn cluster(default_no_traffic: bool) -> Value {
    let endpoints: Vec<Value> = BACKENDS
        .iter()
        .map(|b| {
            let b: SocketAddr = b.parse().unwrap();
            json!({"endpoint": {"address": {"socket_address": {"address": b.ip().to_string(), "port_value": b.port()}}}})
        })
        .collect();
    json!({
        "name": "c",
        "type": "STATIC",
        "connect_timeout": "1s",
        "common_lb_config": {"healthy_panic_threshold": {"value": 50}},
        "health_checks": [health_check(default_no_traffic)],
        "load_assignment": {"cluster_name": "c", "endpoints": [{"lb_endpoints": endpoints}]}
    })
}

fn envoy_bootstrap(default_no_traffic: bool) -> String {
    let listener: SocketAddr = ENVOY_LISTENER.parse().unwrap();
    json!({
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
        "static_resources": {
            "listeners": [{
                "name": "l",
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": listener.port()}},
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.tcp_proxy",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
                        "stat_prefix": "tp",
                        "cluster": "c"
                    }
                }]}]
            }],
            "clusters": [cluster(default_no_traffic)]
        }
    })
    .to_string()
}

fn daemon_config(cgroup: &TestCgroup, default_no_traffic: bool) -> String {
    let vip: SocketAddr = VIP.parse().unwrap();
    // JSON is YAML: the daemon gets the very cluster Envoy gets, less the fields it derives.
    let mut cluster = cluster(default_no_traffic);
    cluster["load_assignment"]
        .as_object_mut()
        .unwrap()
        .remove("cluster_name");
    format!(
        "instance: {}\ncgroup: {}\nadmin:\n  address: \"{{admin}}\"\nproxy:\n  listeners: [\"127.0.0.1:15001\"]\nclusters:\n  - {cluster}\nservices:\n  - {{ name: web, address: \"{}\", port: {}, cluster: c, mode: proxy }}\n",
        unique("sbs"),
        cgroup.path().display(),
        vip.ip(),
        vip.port()
    )
}

/// The two admin interfaces, read from inside the namespace (from the test's own when `None`).
struct Sides<'a> {
    netns: Option<&'a Netns>,
    envoy: SocketAddr,
    daemon: &'a Daemon,
}

impl Sides<'_> {
    fn envoy_get(&self, path: &str) -> Value {
        let (admin, path) = (self.envoy, path.to_owned());
        // Envoy answers chunked: `http` decodes that (and asserts 200).
        let (_, body) = match self.netns {
            Some(netns) => in_netns(netns, move || http(admin, "GET", &path, ""))
                .join()
                .expect("envoy admin answers"),
            None => http(admin, "GET", &path, ""),
        };
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("envoy JSON ({e}): {body}"))
    }

    fn daemon_get(&self, path: &str) -> Value {
        let (code, body) = self.daemon.get(path).expect("daemon admin answers");
        assert_eq!(code, 200, "{body}");
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("daemon JSON ({e}): {body}"))
    }

    /// (Envoy's, the daemon's) `/clusters?format=json`.
    fn clusters(&self) -> (Value, Value) {
        (
            self.envoy_get("/clusters?format=json"),
            self.daemon_get("/clusters?format=json"),
        )
    }

    /// (Envoy's, the daemon's) value of `name` in `/stats?format=json`.
    fn stat(&self, name: &str) -> (u64, u64) {
        (
            stat(&self.envoy_get("/stats?format=json"), name),
            stat(&self.daemon_get("/stats?format=json"), name),
        )
    }
}

/// A stat from `{"stats": [{"name", "value"}, ...]}`.
fn stat(stats: &Value, name: &str) -> u64 {
    stats["stats"]
        .as_array()
        .expect("a stats list")
        .iter()
        .find(|s| s["name"] == name)
        .and_then(|s| s["value"].as_u64())
        .unwrap_or_else(|| panic!("no {name} in {stats:#}"))
}

/// A host of cluster `c` reduced to what both must agree on.
type HostView = (String, u64, bool, String, u64, u64);

fn hosts_of(clusters: &Value) -> Vec<HostView> {
    let cluster = clusters["cluster_statuses"]
        .as_array()
        .expect("cluster_statuses")
        .iter()
        .find(|c| c["name"] == "c")
        .unwrap_or_else(|| panic!("no cluster c in {clusters:#}"));
    // proto3 JSON leaves an empty list out: a cluster without hosts has no `host_statuses`.
    let statuses = match &cluster["host_statuses"] {
        Value::Null => &Vec::new(),
        list => list.as_array().expect("host_statuses is a list"),
    };
    let mut hosts: Vec<HostView> = statuses
        .iter()
        .map(|h| {
            let sa = &h["address"]["socket_address"];
            let health = &h["health_status"];
            (
                sa["address"].as_str().unwrap_or_default().to_owned(),
                sa["port_value"].as_u64().unwrap_or(0),
                health["failed_active_health_check"]
                    .as_bool()
                    .unwrap_or(false),
                health["eds_health_status"]
                    .as_str()
                    .unwrap_or("UNKNOWN")
                    .to_owned(),
                h["weight"].as_u64().unwrap_or(0),
                h["priority"].as_u64().unwrap_or(0),
            )
        })
        .collect();
    hosts.sort();
    hosts
}

/// A host's `cx_active` in `host_statuses[].stats` (a gauge printed without `value` when 0).
fn host_cx_active(clusters: &Value) -> u64 {
    clusters["cluster_statuses"][0]["host_statuses"]
        .as_array()
        .expect("host_statuses")
        .iter()
        .flat_map(|h| h["stats"].as_array().cloned().unwrap_or_default())
        .filter(|s| s["name"] == "cx_active")
        .map(|s| {
            assert_eq!(s["type"], "GAUGE", "{s}");
            s["value"].as_str().map_or(0, |v| v.parse().unwrap())
        })
        .sum()
}

fn failed(view: &[HostView], backend: &str) -> bool {
    let addr: SocketAddr = backend.parse().unwrap();
    view.iter()
        .find(|h| h.0 == addr.ip().to_string() && h.1 == u64::from(addr.port()))
        .unwrap_or_else(|| panic!("no {backend} in {view:?}"))
        .2
}

/// Samples both views every 250 ms until `done` holds for both (at most `within`); returns
/// when each first did, after the start.
fn until_both(
    sides: &Sides<'_>,
    within: Duration,
    what: &str,
    done: impl Fn(&[HostView]) -> bool,
) -> (Duration, Duration) {
    let start = Instant::now();
    let (mut envoy_at, mut daemon_at) = (None, None);
    loop {
        let (envoy, daemon) = sides.clusters();
        let (envoy, daemon) = (hosts_of(&envoy), hosts_of(&daemon));
        let now = start.elapsed();
        if envoy_at.is_none() && done(&envoy) {
            envoy_at = Some(now);
        }
        if daemon_at.is_none() && done(&daemon) {
            daemon_at = Some(now);
        }
        if let (Some(e), Some(d)) = (envoy_at, daemon_at) {
            println!("{what}: envoy after {e:?}, daemon after {d:?}");
            return (e, d);
        }
        assert!(
            now < within,
            "{what}: not both within {within:?} (envoy {envoy_at:?}, daemon {daemon_at:?})\nenvoy:  {envoy:?}\ndaemon: {daemon:?}"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// The daemon's JSON parses as `envoy.admin.v3.Clusters` with protobuf's strict JSON parser
/// (unknown fields refused), when the test's Python has the xDS protos.
fn assert_parses_as_envoy_clusters(clusters: &Value) {
    let script = "import sys\nfrom google.protobuf import json_format\nfrom envoy.admin.v3 import clusters_pb2\njson_format.Parse(sys.stdin.read(), clusters_pb2.Clusters())\n";
    let python: PathBuf = python();
    let mut child = match std::process::Command::new(&python)
        .args(["-c", script])
        .stdin(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
    {
        Ok(child) => child,
        Err(err) => {
            println!(
                "skipping the strict proto parse: {} ({err})",
                python.display()
            );
            return;
        }
    };
    {
        use std::io::Write as _;
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(clusters.to_string().as_bytes()).unwrap();
    }
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    if err.contains("ModuleNotFoundError") {
        println!(
            "skipping the strict proto parse: no xds-protos in {}",
            python.display()
        );
        return;
    }
    assert!(
        out.status.success(),
        "not an envoy.admin.v3.Clusters: {err}"
    );
}

/// Holds `n` connections to `target` from inside the namespace (in `cgroup` when given, so the
/// kernel redirects them) for `time`; its answer is how many connected.
fn hold(
    netns: &Netns,
    cgroup: Option<&TestCgroup>,
    target: &str,
    n: usize,
    time: Duration,
) -> InCgroup {
    let target: SocketAddr = target.parse().unwrap();
    InCgroup::spawn(cgroup.map(TestCgroup::path), netns, move || {
        let conns: Vec<TcpStream> = (0..n)
            .filter_map(|_| TcpStream::connect_timeout(&target, Duration::from_secs(1)).ok())
            .collect();
        std::thread::sleep(time);
        conns.len().to_string()
    })
}

/// Polls until (Envoy's, the daemon's) `upstream_cx_active` and the sums of their hosts'
/// `cx_active` are all `want` (at most 4 s).
fn until_active(sides: &Sides<'_>, want: u64) {
    let deadline = Instant::now() + Duration::from_secs(4);
    loop {
        let cluster = sides.stat("cluster.c.upstream_cx_active");
        let (envoy, daemon) = sides.clusters();
        let hosts = (host_cx_active(&envoy), host_cx_active(&daemon));
        if cluster == (want, want) && hosts == (want, want) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "upstream_cx_active (envoy, daemon) {cluster:?}, hosts' cx_active {hosts:?}, want {want}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn health_active_connections_and_panic_match_envoy() {
    require_root();
    if skip_without_dataplane("health_active_connections_and_panic_match_envoy") {
        return;
    }
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let addr = |i: usize| -> SocketAddr { BACKENDS[i].parse().unwrap() };
    let backend_a = BannerServers::start_holding(&netns, &[(addr(0), "a", false)]);
    let mut backend_b = Some(BannerServers::start_holding(
        &netns,
        &[(addr(1), "b", false)],
    ));
    let mut backend_c = Some(BannerServers::start_holding(
        &netns,
        &[(addr(2), "c", false)],
    ));
    let daemon = Daemon::start_in(&netns, &daemon_config(&cgroup, false));
    let envoy = Envoy::with_bootstrap(&envoy_bootstrap(false), Some(&netns.path()));
    let sides = Sides {
        netns: Some(&netns),
        envoy: envoy.admin(),
        daemon: &daemon,
    };

    // Every host checked and healthy on both, and the same hosts.
    until_both(&sides, Duration::from_secs(10), "all healthy", |v| {
        v.len() == 3 && v.iter().all(|h| !h.2)
    });
    let (envoy_json, daemon_json) = sides.clusters();
    assert_eq!(hosts_of(&envoy_json), hosts_of(&daemon_json));
    assert_parses_as_envoy_clusters(&daemon_json);

    // Open connections: the cluster gauge and the hosts' gauges agree, and fall back to 0.
    let held = 4;
    let envoy_clients = hold(&netns, None, ENVOY_LISTENER, held, Duration::from_secs(2));
    let daemon_clients = hold(&netns, Some(&cgroup), VIP, held, Duration::from_secs(2));
    until_active(&sides, held as u64);
    assert_eq!(
        envoy_clients.wait(Duration::from_secs(10)),
        held.to_string()
    );
    assert_eq!(
        daemon_clients.wait(Duration::from_secs(10)),
        held.to_string()
    );
    until_active(&sides, 0);

    // One backend dies: both mark it failed within a few intervals of each other, and then
    // show the same hosts again.
    drop(backend_c.take());
    let (envoy_at, daemon_at) = until_both(&sides, Duration::from_secs(10), "one host down", |v| {
        failed(v, BACKENDS[2])
    });
    assert!(
        envoy_at.abs_diff(daemon_at) <= Duration::from_secs(2),
        "envoy {envoy_at:?}, daemon {daemon_at:?}"
    );
    let (envoy_json, daemon_json) = sides.clusters();
    assert_eq!(hosts_of(&envoy_json), hosts_of(&daemon_json));
    // Two of three healthy is above the 50 % threshold: no panic on either.
    let n = 12;
    Probe::run(&netns, None, ENVOY_LISTENER.parse().unwrap(), n, false);
    Probe::run(&netns, Some(cgroup.path()), VIP.parse().unwrap(), n, false);
    assert_eq!(sides.stat("cluster.c.lb_healthy_panic"), (0, 0));

    // A second dies: one of three healthy is under 50 %, both are in panic and pick among all
    // three, counting each pick.
    drop(backend_b.take());
    until_both(&sides, Duration::from_secs(10), "two hosts down", |v| {
        failed(v, BACKENDS[1]) && failed(v, BACKENDS[2])
    });
    let (envoy_json, daemon_json) = sides.clusters();
    assert_eq!(hosts_of(&envoy_json), hosts_of(&daemon_json));
    assert_eq!(sides.stat("cluster.c.membership_healthy"), (1, 1));
    assert_eq!(sides.stat("cluster.c.membership_total"), (3, 3));
    let envoy_probe = Probe::run(&netns, None, ENVOY_LISTENER.parse().unwrap(), n, false);
    let daemon_probe = Probe::run(&netns, Some(cgroup.path()), VIP.parse().unwrap(), n, false);
    println!("panic: envoy {envoy_probe:?}\n       daemon {daemon_probe:?}");
    assert_eq!(
        sides.stat("cluster.c.lb_healthy_panic"),
        (u64::from(n), u64::from(n)),
        "one count per connection in panic mode"
    );
    assert_eq!(sides.stat("cluster.c.upstream_cx_none_healthy"), (0, 0));
    drop(backend_a);
}

/// With `no_traffic_interval` at its default (60 s) and no traffic, a dead host is found by two
/// checks a minute apart on both, at about the same time (both started their checks within a
/// second or two of each other).
#[test]
fn idle_cluster_finds_a_dead_host_at_no_traffic_interval_as_envoy() {
    require_root();
    if skip_without_dataplane("idle_cluster_finds_a_dead_host_at_no_traffic_interval_as_envoy") {
        return;
    }
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let servers: Vec<_> = BACKENDS
        .iter()
        .map(|b| BannerServers::start_holding(&netns, &[(b.parse().unwrap(), "x", false)]))
        .collect();
    let daemon = Daemon::start_in(&netns, &daemon_config(&cgroup, true));
    let envoy = Envoy::with_bootstrap(&envoy_bootstrap(true), Some(&netns.path()));
    let sides = Sides {
        netns: Some(&netns),
        envoy: envoy.admin(),
        daemon: &daemon,
    };
    until_both(&sides, Duration::from_secs(10), "all healthy", |v| {
        v.len() == 3 && v.iter().all(|h| !h.2)
    });
    let mut servers = servers.into_iter();
    drop(servers.next_back());
    let (envoy_at, daemon_at) =
        until_both(&sides, Duration::from_secs(150), "idle host down", |v| {
            failed(v, BACKENDS[2])
        });
    for at in [envoy_at, daemon_at] {
        assert!(
            at > Duration::from_secs(55),
            "found after {at:?}: checks ran faster than no_traffic_interval"
        );
    }
    assert!(
        envoy_at.abs_diff(daemon_at) <= Duration::from_secs(5),
        "envoy {envoy_at:?}, daemon {daemon_at:?}"
    );
    let (envoy_json, daemon_json) = sides.clusters();
    assert_eq!(hosts_of(&envoy_json), hosts_of(&daemon_json));
    assert_eq!(sides.stat("cluster.c.upstream_cx_total"), (0, 0));
}

/// With `no_traffic_interval` at its default (60 s) and traffic through both right after start,
/// a host that dies is found at the check already scheduled 60 s after start and the one
/// `interval` after it (traffic moved both off the slow rate): on both at the same time, about a
/// minute before the idle case above finds its host. Runs beside it, so the suite waits once.
#[test]
fn busy_cluster_leaves_no_traffic_interval_as_envoy() {
    require_root();
    if skip_without_dataplane("busy_cluster_leaves_no_traffic_interval_as_envoy") {
        return;
    }
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let servers: Vec<_> = BACKENDS
        .iter()
        .map(|b| BannerServers::start_holding(&netns, &[(b.parse().unwrap(), "x", false)]))
        .collect();
    let daemon = Daemon::start_in(&netns, &daemon_config(&cgroup, true));
    let envoy = Envoy::with_bootstrap(&envoy_bootstrap(true), Some(&netns.path()));
    let start = Instant::now();
    let sides = Sides {
        netns: Some(&netns),
        envoy: envoy.admin(),
        daemon: &daemon,
    };
    until_both(&sides, Duration::from_secs(10), "all healthy", |v| {
        v.len() == 3 && v.iter().all(|h| !h.2)
    });
    let envoy_clients = hold(&netns, None, ENVOY_LISTENER, 3, Duration::from_millis(500));
    let daemon_clients = hold(&netns, Some(&cgroup), VIP, 3, Duration::from_millis(500));
    assert_eq!(envoy_clients.wait(Duration::from_secs(10)), "3");
    assert_eq!(daemon_clients.wait(Duration::from_secs(10)), "3");
    let (envoy_cx, daemon_cx) = sides.stat("cluster.c.upstream_cx_total");
    assert!(
        envoy_cx >= 3 && daemon_cx >= 3,
        "traffic: envoy {envoy_cx}, daemon {daemon_cx}"
    );
    let mut servers = servers.into_iter();
    drop(servers.next_back());
    let (envoy_at, daemon_at) =
        until_both(&sides, Duration::from_secs(90), "busy host down", |v| {
            failed(v, BACKENDS[2])
        });
    let since_start = start.elapsed();
    println!(
        "busy host down {since_start:?} after both started (no_traffic_interval 60 s, interval 0.5 s, threshold 2)"
    );
    for at in [envoy_at, daemon_at] {
        assert!(
            at > Duration::from_secs(50),
            "found after {at:?}: the check at no_traffic_interval was not waited for"
        );
    }
    assert!(
        since_start < Duration::from_secs(80),
        "found {since_start:?} after start: the second check waited no_traffic_interval again"
    );
    assert!(
        envoy_at.abs_diff(daemon_at) <= Duration::from_secs(5),
        "envoy {envoy_at:?}, daemon {daemon_at:?}"
    );
    let (envoy_json, daemon_json) = sides.clusters();
    assert_eq!(hosts_of(&envoy_json), hosts_of(&daemon_json));
}

/// The STRICT_DNS cluster both run against the same unbound: two names, one address returned by
/// both (two hosts in Envoy), a 1 s refresh and a 1-2 s failure backoff.
fn dns_cluster(name: &str, resolver: SocketAddr, failure_refresh: Option<Value>) -> Value {
    let endpoint = |name: &str| json!({"endpoint": {"address": {"socket_address": {"address": name, "port_value": 8091}}}});
    let mut cluster = json!({
        "name": name,
        "type": "STRICT_DNS",
        "connect_timeout": "1s",
        "dns_refresh_rate": "1s",
        "dns_lookup_family": "V4_ONLY",
        "typed_dns_resolver_config": {
            "name": "envoy.network.dns_resolver.cares",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.network.dns_resolver.cares.v3.CaresDnsResolverConfig",
                "resolvers": [{"socket_address": {"address": resolver.ip().to_string(), "port_value": resolver.port()}}],
                "dns_resolver_options": {"no_default_search_domain": true}
            }
        },
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [endpoint("a.svc.test"), endpoint("b.svc.test")]}]}
    });
    if let Some(rate) = failure_refresh {
        cluster["dns_failure_refresh_rate"] = rate;
    }
    cluster
}

/// Envoy's cluster as the daemon's file takes it (no `load_assignment.cluster_name`).
fn as_ours(mut cluster: Value) -> Value {
    cluster["load_assignment"]
        .as_object_mut()
        .unwrap()
        .remove("cluster_name");
    cluster
}

/// Hosts as (address, port) in order, from a view.
fn addresses(view: &[HostView]) -> Vec<String> {
    view.iter().map(|h| format!("{}:{}", h.0, h.1)).collect()
}

/// Holds both sides' `update_failure` counts since `before_*`, over the outage that began at
/// `start`, to the bounds of each cluster's failure strategy (see the test below).
fn assert_failure_pace(
    sides: &Sides<'_>,
    start: Instant,
    before_c: (u64, u64),
    before_j: (u64, u64),
) {
    let failures = |cluster: &str| sides.stat(&format!("cluster.{cluster}.update_failure"));
    let window_from = start.elapsed().as_secs_f64();
    let (c, j) = (failures("c"), failures("j"));
    let window_to = start.elapsed().as_secs_f64();
    let delta = |now: (u64, u64), before: (u64, u64)| (now.0 - before.0, now.1 - before.1);
    let ((envoy_c, daemon_c), (envoy_j, daemon_j)) = (delta(c, before_c), delta(j, before_j));
    println!(
        "update_failure in {window_from:.2}-{window_to:.2} s down: fixed envoy {envoy_c} daemon \
         {daemon_c}, jittered envoy {envoy_j} daemon {daemon_j}"
    );
    // Two names per cluster. Whole seconds of the window, rounded down.
    let (low, high) = (window_from.floor() as u64, window_to.floor() as u64);
    let fixed_bounds = 2 * (low - 1)..=2 * (high + 1);
    for (side, count) in [("envoy", envoy_c), ("daemon", daemon_c)] {
        assert!(
            fixed_bounds.contains(&count),
            "{side}: {count} failures of the fixed strategy, not in {fixed_bounds:?}"
        );
    }
    // First jittered lookup within the last 1 s refresh, then waits under 2 s each.
    let jittered_low = 2 * (((window_from - 1.0) / 2.0).floor() as u64 + 1);
    for (side, count) in [("envoy", envoy_j), ("daemon", daemon_j)] {
        assert!(
            (jittered_low..=32).contains(&count),
            "{side}: {count} failures of the jittered strategy, not in {jittered_low}..=32"
        );
    }
}

/// STRICT_DNS side by side, one unbound for both: an address two names return is two hosts on
/// both; with the server stopped both keep their hosts and count failures at the pace of their
/// failure refresh strategy; restarted with a changed record, both show the new hosts within a
/// refresh of each other.
///
/// Cluster `c` has the default failure strategy: a failed lookup is retried at
/// `dns_refresh_rate` (1 s), so in a window of W seconds each name fails floor(W) - 1 to
/// floor(W) + 1 times (the phase of its last refresh, a lookup's latency) on either side.
/// Cluster `j` backs off with full jitter (bound 1 s, then 2 s). Two independent jittered
/// processes cannot be held to each other count for count (over 4 s their difference spreads
/// with a standard deviation of about two failures), so each side is held to what the strategy
/// guarantees: no wait reaches 2 s, and no hot loop (more than 16 failures of a name in under
/// 5 s needs 15 uniform waits of mean 1 s to sum under 4 s: odds below 1e-7). The strategy's
/// distribution is `discovery::dns::backoff`'s unit tests.
#[test]
fn strict_dns_through_an_outage_matches_envoy() {
    require_root();
    if skip_without_dataplane("strict_dns_through_an_outage_matches_envoy") {
        return;
    }
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let mut unbound = Unbound::start_in(
        &netns.path(),
        &[
            "a.svc.test. 5 IN A 127.0.0.91",
            "b.svc.test. 5 IN A 127.0.0.91",
            "b.svc.test. 5 IN A 127.0.0.92",
        ],
    );
    let fixed = dns_cluster("c", unbound.addr(), None);
    let jittered = dns_cluster(
        "j",
        unbound.addr(),
        Some(json!({"base_interval": "1s", "max_interval": "2s"})),
    );
    let envoy_bootstrap = json!({
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
        "static_resources": {"clusters": [fixed.clone(), jittered.clone()]}
    })
    .to_string();
    let vip: SocketAddr = VIP.parse().unwrap();
    let config = format!(
        "instance: {}\ncgroup: {}\nadmin:\n  address: \"{{admin}}\"\nclusters:\n  - {}\n  - {}\nservices:\n  - {{ name: web, address: \"{}\", port: {}, cluster: c }}\n",
        unique("sbsdns"),
        cgroup.path().display(),
        as_ours(fixed),
        as_ours(jittered),
        vip.ip(),
        vip.port()
    );
    let daemon = Daemon::start_in(&netns, &config);
    let envoy = Envoy::with_bootstrap(&envoy_bootstrap, Some(&netns.path()));
    let sides = Sides {
        netns: Some(&netns),
        envoy: envoy.admin(),
        daemon: &daemon,
    };
    let first = [
        "127.0.0.91:8091".to_owned(),
        "127.0.0.91:8091".to_owned(),
        "127.0.0.92:8091".to_owned(),
    ];
    until_both(&sides, Duration::from_secs(10), "resolved", |v| {
        addresses(v) == first
    });
    let (envoy_json, daemon_json) = sides.clusters();
    assert_eq!(hosts_of(&envoy_json), hosts_of(&daemon_json));
    let failures = |cluster: &str| sides.stat(&format!("cluster.{cluster}.update_failure"));
    let (before_c, before_j) = (failures("c"), failures("j"));

    // The server goes away: every lookup fails at once (its port is closed); both keep the
    // hosts they had and count the failures.
    unbound.stop();
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(4) {
        let (envoy_json, daemon_json) = sides.clusters();
        assert_eq!(
            addresses(&hosts_of(&envoy_json)),
            first,
            "Envoy kept its hosts"
        );
        assert_eq!(
            addresses(&hosts_of(&daemon_json)),
            first,
            "the daemon kept its hosts"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    assert_failure_pace(&sides, start, before_c, before_j);

    // Back, with b.svc.test moved: both follow within a refresh of each other.
    unbound.restart();
    unbound.replace("b.svc.test.", &["b.svc.test. 5 IN A 127.0.0.93"]);
    let moved = ["127.0.0.91:8091".to_owned(), "127.0.0.93:8091".to_owned()];
    let (envoy_at, daemon_at) =
        until_both(&sides, Duration::from_secs(15), "after the restart", |v| {
            addresses(v) == moved
        });
    assert!(
        envoy_at.abs_diff(daemon_at) <= Duration::from_secs(3),
        "envoy {envoy_at:?}, daemon {daemon_at:?}"
    );
    let (envoy_json, daemon_json) = sides.clusters();
    assert_eq!(hosts_of(&envoy_json), hosts_of(&daemon_json));
}

/// The membership stats both must agree on.
const MEMBERSHIP: [&str; 3] = [
    "cluster.c.membership_total",
    "cluster.c.membership_healthy",
    "cluster.c.membership_degraded",
];

/// One EDS endpoint for the server (`tests/xds/xds_server.py`).
fn endpoint(addr: &str, health: &str, weight: u32, priority: u32) -> Value {
    let addr: SocketAddr = addr.parse().unwrap();
    json!({"address": addr.ip().to_string(), "port": addr.port(), "health": health,
           "weight": weight, "priority": priority})
}

#[test]
fn eds_health_matrix_matches_envoy() {
    require_root();
    if skip_without_dataplane("eds_health_matrix_matches_envoy") {
        return;
    }
    let cgroup = TestCgroup::new();
    let server = XdsServer::start();
    let statuses = [
        "HEALTHY",
        "UNHEALTHY",
        "DEGRADED",
        "DRAINING",
        "TIMEOUT",
        "UNKNOWN",
    ];
    let first: Vec<Value> = statuses
        .iter()
        .enumerate()
        .map(|(i, h)| {
            let i = u32::try_from(i).unwrap();
            endpoint(&format!("127.0.0.{}:80{}", 41 + i, 41 + i), h, 1 + i, i % 2)
        })
        .collect();
    server.push("c", "1", Value::Array(first));
    let envoy = Envoy::start(&server, &unique("envoy"), &["c"]);
    let daemon = Daemon::start(&eds_daemon_config("sbseds", &cgroup, &server));
    let sides = Sides {
        netns: None,
        envoy: envoy.admin(),
        daemon: &daemon,
    };
    // Each version: both show it, then their hosts and membership agree.
    let agree = |version: &str, hosts: usize| {
        until_both(
            &sides,
            Duration::from_secs(10),
            &format!("version {version}"),
            |v| v.len() == hosts,
        );
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let (envoy_json, daemon_json) = sides.clusters();
            let (e, d) = (hosts_of(&envoy_json), hosts_of(&daemon_json));
            let stats: Vec<(u64, u64)> = MEMBERSHIP.iter().map(|m| sides.stat(m)).collect();
            if e == d && stats.iter().all(|(a, b)| a == b) {
                println!(
                    "version {version}: {} hosts agree; membership (envoy, daemon) {stats:?}",
                    e.len()
                );
                return e;
            }
            assert!(
                Instant::now() < deadline,
                "version {version}:\nenvoy:  {e:?}\ndaemon: {d:?}\nmembership (envoy, daemon) {stats:?}"
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    };
    // Envoy's admin prints TIMEOUT as UNHEALTHY and UNKNOWN as HEALTHY; both must do so.
    let v1 = agree("1", 6);
    let eds: Vec<&str> = v1.iter().map(|h| h.3.as_str()).collect();
    for status in ["HEALTHY", "UNHEALTHY", "DEGRADED", "DRAINING"] {
        assert!(eds.contains(&status), "{status} missing from {eds:?}");
    }
    // Every host changes its status, two leave, one joins at a new priority.
    server.push(
        "c",
        "2",
        json!([
            endpoint("127.0.0.41:8041", "DRAINING", 2, 0),
            endpoint("127.0.0.42:8042", "HEALTHY", 2, 0),
            endpoint("127.0.0.43:8043", "UNHEALTHY", 5, 1),
            endpoint("127.0.0.44:8044", "DEGRADED", 1, 0),
            endpoint("127.0.0.47:8047", "HEALTHY", 1, 2),
        ]),
    );
    agree("2", 5);
    // Nothing healthy is left.
    server.push(
        "c",
        "3",
        json!([
            endpoint("127.0.0.41:8041", "UNHEALTHY", 1, 0),
            endpoint("127.0.0.42:8042", "TIMEOUT", 1, 0),
        ]),
    );
    agree("3", 2);
    assert_eq!(sides.stat("cluster.c.membership_healthy"), (0, 0));
}
