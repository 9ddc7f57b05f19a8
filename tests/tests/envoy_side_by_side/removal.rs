//! The absent cells of Envoy's health matrix, side by side with Envoy 1.40: two EDS clusters
//! with the same active TCP health check, one at the default `ignore_health_on_host_removal`
//! (false) and one with it on, fed the same assignments by one xDS server. A host the server
//! stops sending while it passes its checks stays in the first (`pending_dynamic_removal`) until
//! it fails one, and leaves the second at once; a host that already fails its checks leaves both
//! at once. After each step both admins' `/clusters` must show the same hosts with the same
//! flags. A second case runs Envoy's per-endpoint `health_check_config` and `hostname` on both,
//! and which absent hosts each keeps (unchecked, EDS-unhealthy, draining).

use std::{
    fmt::Write as _,
    net::{SocketAddr, TcpListener},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use integration_tests::{
    kernel::{Daemon, TestCgroup, require_root, skip_without_dataplane, unique},
    xds_server::{Envoy, XdsServer},
};
use serde_json::{Value, json};

use super::{Sides, endpoint};

const HOSTS: [&str; 3] = ["127.0.0.101:8101", "127.0.0.102:8102", "127.0.0.103:8103"];

/// A host of one cluster: address, port, failed its active check, pending removal.
type Removal = (String, u64, bool, bool);

/// The cluster both run: EDS over ADS with a TCP check every 0.5 s (idle clusters too: the
/// default `no_traffic_interval` of 60 s would make each step a minute long; the matrix, not
/// the clock, is what this compares), two failures to mark a host failed.
fn cluster(name: &str, ignore_health_on_host_removal: bool) -> Value {
    json!({
        "name": name, "type": "EDS", "connect_timeout": "1s",
        "eds_cluster_config": {"eds_config": {"ads": {}, "resource_api_version": "V3"}},
        "ignore_health_on_host_removal": ignore_health_on_host_removal,
        "health_checks": [{"timeout": "1s", "interval": "0.5s", "no_traffic_interval": "0.5s",
                           "unhealthy_threshold": 2, "healthy_threshold": 1,
                           "tcp_health_check": {}}],
    })
}

fn view(clusters: &Value, name: &str) -> Vec<Removal> {
    let cluster = clusters["cluster_statuses"]
        .as_array()
        .expect("cluster_statuses")
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no cluster {name} in {clusters:#}"));
    let mut hosts: Vec<Removal> = cluster["host_statuses"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .map(|h| {
            let sa = &h["address"]["socket_address"];
            let health = &h["health_status"];
            let flag = |f: &str| health[f].as_bool().unwrap_or(false);
            (
                sa["address"].as_str().unwrap_or_default().to_owned(),
                sa["port_value"].as_u64().unwrap_or(0),
                flag("failed_active_health_check"),
                flag("pending_dynamic_removal"),
            )
        })
        .collect();
    hosts.sort();
    hosts
}

/// A host that passes TCP checks: it accepts and closes every connection, until dropped (then
/// the port refuses).
struct CheckedHost {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl CheckedHost {
    fn start(addr: &str) -> Self {
        let listener = TcpListener::bind(addr).expect("bind a test host");
        listener.set_nonblocking(true).expect("nonblocking");
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            while !flag.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((conn, _)) => drop(conn),
                    Err(_) => std::thread::sleep(Duration::from_millis(10)),
                }
            }
        });
        Self {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for CheckedHost {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            t.join().expect("host thread");
        }
    }
}

fn host(addr: &str, failed: bool, pending: bool) -> Removal {
    let addr: SocketAddr = addr.parse().unwrap();
    (
        addr.ip().to_string(),
        u64::from(addr.port()),
        failed,
        pending,
    )
}

/// Waits (at most 10 s) until both sides show `want` for both clusters.
fn until_both_show(sides: &Sides<'_>, step: &str, want_c: &[Removal], want_d: &[Removal]) {
    let mut sorted = [want_c.to_vec(), want_d.to_vec()];
    for w in &mut sorted {
        w.sort();
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (envoy, daemon) = sides.clusters();
        let seen = |json: &Value| [view(json, "c"), view(json, "d")];
        let (e, d) = (seen(&envoy), seen(&daemon));
        if e == sorted && d == sorted {
            println!("{step}: both show c {:?}, d {:?}", sorted[0], sorted[1]);
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{step}: want c {:?}, d {:?}\nenvoy:  {e:?}\ndaemon: {d:?}",
            sorted[0],
            sorted[1]
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

fn push_both(server: &XdsServer, version: &str, hosts: &[&str]) {
    let endpoints: Vec<Value> = hosts.iter().map(|h| endpoint(h, "HEALTHY", 1, 0)).collect();
    for cluster in ["c", "d"] {
        server.push(cluster, version, Value::Array(endpoints.clone()));
    }
}

#[test]
fn hosts_leaving_discovery_follow_envoys_absent_cells() {
    require_root();
    if skip_without_dataplane("hosts_leaving_discovery_follow_envoys_absent_cells") {
        return;
    }
    let mut listeners: Vec<Option<CheckedHost>> =
        HOSTS.iter().map(|h| Some(CheckedHost::start(h))).collect();
    let cgroup = TestCgroup::new();
    let server = XdsServer::start();
    push_both(&server, "1", &HOSTS);
    let envoy = Envoy::start_with_clusters(
        &server,
        &unique("envoy"),
        &[cluster("c", false), cluster("d", true)],
    );
    let daemon = eds_daemon(&cgroup, &server, &[("c", false), ("d", true)]);
    let sides = Sides {
        netns: None,
        envoy: envoy.admin(),
        daemon: &daemon,
    };
    let all: Vec<Removal> = HOSTS.iter().map(|h| host(h, false, false)).collect();
    until_both_show(&sides, "v1, three hosts passing", &all, &all);

    // Absent and passing: pending in c until it fails a check; gone from d at once.
    push_both(&server, "2", &HOSTS[..2]);
    let pending = [
        host(HOSTS[0], false, false),
        host(HOSTS[1], false, false),
        host(HOSTS[2], false, true),
    ];
    until_both_show(&sides, "v2 without the third", &pending, &all[..2]);
    // It stays while it passes: a second look, a few checks later, sees the same.
    std::thread::sleep(Duration::from_millis(1500));
    until_both_show(&sides, "v2, checks later", &pending, &all[..2]);
    listeners[2] = None;
    until_both_show(&sides, "the third fails its check", &all[..2], &all[..2]);

    // Failed, then absent: gone from both at once.
    listeners[1] = None;
    let failed = [host(HOSTS[0], false, false), host(HOSTS[1], true, false)];
    until_both_show(&sides, "the second fails its check", &failed, &failed);
    push_both(&server, "3", &HOSTS[..1]);
    until_both_show(&sides, "v3 without the failed second", &all[..1], &all[..1]);
    drop(listeners);
}

/// The hosts of `endpoint_health_check_config_matches_envoy`, a to f.
const HC_HOSTS: [&str; 6] = [
    "127.0.0.111:8111",
    "127.0.0.112:8112",
    "127.0.0.113:8113",
    "127.0.0.114:8114",
    "127.0.0.115:8115",
    "127.0.0.117:8117",
];

/// The daemon on `server`'s EDS clusters (`name`, `ignore_health_on_host_removal`), each behind
/// a service of its own.
fn eds_daemon(cgroup: &TestCgroup, server: &XdsServer, clusters: &[(&str, bool)]) -> Daemon {
    let mut yaml = String::from("clusters:\n");
    let mut services = String::from("services:\n");
    for (i, (name, ignore)) in clusters.iter().enumerate() {
        let mut c = cluster(name, *ignore);
        c["eds_cluster_config"]["eds_config"]
            .as_object_mut()
            .unwrap()
            .remove("resource_api_version");
        writeln!(yaml, "  - {c}").expect("writing to a String");
        writeln!(
            services,
            "  - {{ name: web-{name}, address: 127.77.9.{}, port: 80, cluster: {name} }}",
            21 + i
        )
        .expect("writing to a String");
    }
    Daemon::start(&format!(
        "instance: {}\ncgroup: {}\nadmin:\n  address: \"{{admin}}\"\nxds:\n  node: {{ id: {}, cluster: edge }}\n  ads_config: {{ api_type: GRPC, server_uri: \"{}\" }}\n{yaml}{services}",
        unique("sbseds"),
        cgroup.path().display(),
        unique("daemon"),
        server.grpc_addr(),
    ))
}

/// A host of cluster `c` with its name: address, port, failed its active check, pending
/// removal, hostname.
type Named = (String, u64, bool, bool, String);

fn named_view(clusters: &Value) -> Vec<Named> {
    let cluster = clusters["cluster_statuses"]
        .as_array()
        .expect("cluster_statuses")
        .iter()
        .find(|c| c["name"] == "c")
        .unwrap_or_else(|| panic!("no cluster c in {clusters:#}"));
    let hostnames: Vec<String> = cluster["host_statuses"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .map(|h| h["hostname"].as_str().unwrap_or_default().to_owned())
        .collect();
    let mut hosts: Vec<Named> = cluster["host_statuses"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .zip(hostnames)
        .map(|(h, name)| {
            let sa = &h["address"]["socket_address"];
            let health = &h["health_status"];
            let flag = |f: &str| health[f].as_bool().unwrap_or(false);
            (
                sa["address"].as_str().unwrap_or_default().to_owned(),
                sa["port_value"].as_u64().unwrap_or(0),
                flag("failed_active_health_check"),
                flag("pending_dynamic_removal"),
                name,
            )
        })
        .collect();
    hosts.sort();
    hosts
}

/// An EDS endpoint with `health_check_config` and `hostname`.
fn checked_endpoint(addr: &str, health: &str, hostname: &str, check: &Value) -> Value {
    let mut e = endpoint(addr, health, 1, 0);
    e["hostname"] = json!(hostname);
    e["health_check_config"] = check.clone();
    e
}

/// Waits (at most 10 s) until both show `want` for cluster `c`; returns Envoy's view.
fn until_both_named(sides: &Sides<'_>, step: &str, want: &[Named]) {
    let mut want = want.to_vec();
    want.sort();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (envoy, daemon) = sides.clusters();
        let (e, d) = (named_view(&envoy), named_view(&daemon));
        if e == want && d == want {
            println!("{step}: both show {want:?}");
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{step}: want {want:?}\nenvoy:  {e:?}\ndaemon: {d:?}"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

fn named(addr: &str, failed: bool, pending: bool, hostname: &str) -> Named {
    let (ip, port, ..) = host(addr, failed, pending);
    (ip, port, failed, pending, hostname.to_owned())
}

/// Envoy's per-endpoint `health_check_config` and `hostname`, side by side: checks that go to
/// another port (a dead one fails a live host; a live one passes a host whose own port is
/// dead), to another address, or nowhere (`disable_active_health_check`); the hostname shown in
/// `/clusters`. Then what leaves: a host whose checks pass stays pending; one whose checks are
/// disabled, and one EDS marked UNHEALTHY while its checks pass, go at once; a DRAINING one stays
/// pending.
#[test]
#[expect(
    clippy::many_single_char_names,
    reason = "hosts a to f, as the comments name them"
)]
fn endpoint_health_check_config_matches_envoy() {
    require_root();
    if skip_without_dataplane("endpoint_health_check_config_matches_envoy") {
        return;
    }
    let [a, b, c, d, e, f] = HC_HOSTS;
    // Live: a's traffic port, b's check port, the alternate address c is checked at, e, f.
    // Dead: a's check port, b's and c's and d's traffic ports.
    let _live: Vec<CheckedHost> = [a, "127.0.0.112:9112", "127.0.0.116:9116", e, f]
        .iter()
        .map(|h| CheckedHost::start(h))
        .collect();
    let v1 = json!([
        checked_endpoint(a, "HEALTHY", "web-a", &json!({"port_value": 9111})),
        checked_endpoint(b, "HEALTHY", "web-b", &json!({"port_value": 9112})),
        checked_endpoint(
            c,
            "HEALTHY",
            "",
            &json!({"address": {"socket_address": {"address": "127.0.0.116", "port_value": 9116}}})
        ),
        checked_endpoint(
            d,
            "HEALTHY",
            "",
            &json!({"disable_active_health_check": true})
        ),
        checked_endpoint(e, "HEALTHY", "web-e", &json!({})),
        checked_endpoint(f, "HEALTHY", "", &json!({})),
    ]);
    let cgroup = TestCgroup::new();
    let server = XdsServer::start();
    server.push("c", "1", v1);
    let envoy = Envoy::start_with_clusters(&server, &unique("envoy"), &[cluster("c", false)]);
    let daemon = eds_daemon(&cgroup, &server, &[("c", false)]);
    let sides = Sides {
        netns: None,
        envoy: envoy.admin(),
        daemon: &daemon,
    };
    until_both_named(
        &sides,
        "v1",
        &[
            named(a, true, false, "web-a"),
            named(b, false, false, "web-b"),
            named(c, false, false, ""),
            named(d, false, false, ""),
            named(e, false, false, "web-e"),
            named(f, false, false, ""),
        ],
    );

    // c leaves while its checks pass (pending); e becomes UNHEALTHY by EDS (its checks still
    // pass) and f DRAINING, then d, e and f leave: Envoy deletes d and e at once (not checked;
    // FAILED_EDS_HEALTH) and keeps f pending (draining is not a failure).
    let v2 = |version: &str, e_health: &str, with: bool| {
        let mut list = vec![
            checked_endpoint(a, "HEALTHY", "web-a", &json!({"port_value": 9111})),
            checked_endpoint(b, "HEALTHY", "web-b", &json!({"port_value": 9112})),
        ];
        if with {
            list.push(checked_endpoint(
                d,
                "HEALTHY",
                "",
                &json!({"disable_active_health_check": true}),
            ));
            list.push(checked_endpoint(e, e_health, "web-e", &json!({})));
            list.push(checked_endpoint(f, "DRAINING", "", &json!({})));
        }
        server.push("c", version, Value::Array(list));
    };
    v2("2", "UNHEALTHY", true);
    until_both_named(
        &sides,
        "v2, e unhealthy by EDS",
        &[
            named(a, true, false, "web-a"),
            named(b, false, false, "web-b"),
            named(c, false, true, ""),
            named(d, false, false, ""),
            named(e, false, false, "web-e"),
            named(f, false, false, ""),
        ],
    );
    v2("3", "UNHEALTHY", false);
    until_both_named(
        &sides,
        "v3 without d, e and f",
        &[
            named(a, true, false, "web-a"),
            named(b, false, false, "web-b"),
            named(c, false, true, ""),
            named(f, false, true, ""),
        ],
    );
}
