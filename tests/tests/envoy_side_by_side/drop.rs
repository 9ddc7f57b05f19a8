//! Drop overload side by side with Envoy 1.40, in one fresh network namespace: three STATIC
//! clusters of one HTTP backend whose `load_assignment.policy.drop_overloads` (the same
//! `ClusterLoadAssignment` JSON on both sides) drops `half` (5,000 / `TEN_THOUSAND`), `all`
//! (100 / `HUNDRED`) and `none` (0) of the requests. Envoy serves them on HTTP listeners; the
//! daemon on `mode: proxy` HTTP services reached through the kernel's redirect from the test
//! cgroup. Each side gets the same requests; the answers must be the same kinds (status, body,
//! `x-envoy-drop-overload`, `x-envoy-unconditional-drop-overload`) on both, `all` must drop
//! every request and `none` none (exact), and the daemon's `upstream_rq_drop_overload` must
//! count exactly its drops. TCP: Envoy's `tcp_proxy` and the daemon's TCP service over `all`
//! both connect every connection to the backend (Envoy 1.40 does not drop TCP).
//!
//! The bound for `half`: each side's drops X of N = 400 requests, each dropped independently
//! with probability 1/2. Hoeffding's inequality gives P(|X - 200| >= 60) <= 2 exp(-2 x 60^2 /
//! 400) = 2 e^-18 < 3.1e-8 per side, so a correct pair of sides fails this test less than once
//! in 10^7 runs (below 1e-6); a side that never drops, or always does, is outside by 140.

use std::{
    collections::BTreeMap,
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    time::Duration,
};

use integration_tests::{
    http_servers::{Servers, http_server},
    kernel::{InCgroup, Netns, TestCgroup, require_root, unique},
    xds_server::Envoy,
};
use serde_json::{Value, json};

use super::locality::until_envoy_listens_n;

/// The one HTTP backend every cluster has.
const BACKEND: &str = "127.0.0.95:8095";
/// Requests per side to `half`.
const HALF_REQUESTS: u32 = 400;
/// Off the expected 200 drops of `half` by at most this (Hoeffding, module doc).
const HALF_SLACK: u32 = 60;
/// Requests (and TCP connections) per side to `all` and `none`.
const EXACT_REQUESTS: u32 = 50;

/// (cluster, numerator, denominator, Envoy's HTTP port, the daemon's VIP).
const CASES: [(&str, u32, &str, u16, &str); 3] = [
    ("half", 5_000, "TEN_THOUSAND", 15021, "127.77.11.1:80"),
    ("all", 100, "HUNDRED", 15022, "127.77.11.2:80"),
    ("none", 0, "HUNDRED", 15023, "127.77.11.3:80"),
];
/// Envoy's tcp_proxy port and the daemon's TCP VIP, both over `all`.
const TCP: (u16, &str) = (15024, "127.77.11.4:80");

/// The cluster as Envoy's JSON; the daemon gets the same less `cluster_name`.
fn cluster(name: &str, numerator: u32, denominator: &str) -> Value {
    let backend: SocketAddr = BACKEND.parse().unwrap();
    let endpoint = json!({"endpoint": {"address": {"socket_address": {
        "address": backend.ip().to_string(), "port_value": backend.port()}}}});
    let drop = json!({"category": "throttle",
        "drop_percentage": {"numerator": numerator, "denominator": denominator}});
    json!({
        "name": name, "type": "STATIC", "connect_timeout": "1s",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [endpoint]}],
            "policy": {"drop_overloads": [drop]}}
    })
}

fn http_listener(name: &str, port: u16) -> Value {
    json!({
        "name": name,
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
        "filter_chains": [{"filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                "stat_prefix": name,
                "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [{
                    "match": {"prefix": "/"}, "route": {"cluster": name}
                }]}]},
                "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                }}]
            }
        }]}]
    })
}

fn envoy_bootstrap() -> String {
    let mut listeners: Vec<Value> = CASES
        .iter()
        .map(|&(name, _, _, port, _)| http_listener(name, port))
        .collect();
    listeners.push(json!({
        "name": "tcp",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": TCP.0}},
        "filter_chains": [{"filters": [{
            "name": "envoy.filters.network.tcp_proxy",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
                "stat_prefix": "tcp", "cluster": "all"
            }
        }]}]
    }));
    let clusters: Vec<Value> = CASES
        .iter()
        .map(|&(name, n, d, _, _)| cluster(name, n, d))
        .collect();
    json!({
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
        "static_resources": {"listeners": listeners, "clusters": clusters}
    })
    .to_string()
}

fn daemon_config(cgroup: &TestCgroup) -> String {
    use std::fmt::Write as _;
    let mut text = format!(
        "instance: {}\ncgroup: {}\nadmin:\n  address: \"{{admin}}\"\nproxy:\n  listeners: [\"127.0.0.1:15001\"]\nclusters:\n",
        unique("drop"),
        cgroup.path().display()
    );
    for &(name, n, d, _, _) in &CASES {
        let mut c = cluster(name, n, d);
        c["load_assignment"]
            .as_object_mut()
            .unwrap()
            .remove("cluster_name");
        writeln!(text, "  - {c}").unwrap();
    }
    text += "config_entries:\n  - { Kind: proxy-defaults, Name: global, Config: { protocol: http } }\nservices:\n";
    for &(name, _, _, _, vip) in &CASES {
        let vip: SocketAddr = vip.parse().unwrap();
        writeln!(
            text,
            "  - {{ name: {name}, address: {}, port: {}, chain: {name}, mode: proxy }}",
            vip.ip(),
            vip.port()
        )
        .unwrap();
    }
    let tcp: SocketAddr = TCP.1.parse().unwrap();
    writeln!(
        text,
        "  - {{ name: alltcp, address: {}, port: {}, cluster: all, mode: proxy }}",
        tcp.ip(),
        tcp.port()
    )
    .unwrap();
    text
}

/// One answer's kind: status, body, and the two drop headers' values (`-` when absent).
fn kind(answer: &str) -> String {
    let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((answer, ""));
    let status = head.split_whitespace().nth(1).unwrap_or("none");
    let header = |name: &str| {
        head.lines()
            .filter_map(|l| l.split_once(':'))
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map_or("-".to_owned(), |(_, v)| v.trim().to_owned())
    };
    // The backend names the path: the same on both sides.
    format!(
        "{status} {body:?} drop={} unconditional={}",
        header("x-envoy-drop-overload"),
        header("x-envoy-unconditional-drop-overload")
    )
}

/// `n` GETs (one connection each) to `target` from `cgroup` (the test's own when `None`):
/// how many answers of each kind.
fn answers(
    netns: &Netns,
    cgroup: Option<&TestCgroup>,
    target: &str,
    n: u32,
) -> BTreeMap<String, u32> {
    let target: SocketAddr = target.parse().unwrap();
    let child = InCgroup::spawn(cgroup.map(TestCgroup::path), netns, move || {
        let mut kinds = Vec::new();
        for _ in 0..n {
            let answer = (|| -> std::io::Result<String> {
                let mut s = TcpStream::connect_timeout(&target, Duration::from_secs(2))?;
                s.set_read_timeout(Some(Duration::from_secs(5)))?;
                write!(
                    s,
                    "GET /d HTTP/1.1\r\nhost: web\r\nconnection: close\r\n\r\n"
                )?;
                read_response(&mut s)
            })();
            kinds.push(answer.map_or_else(|e| format!("error: {e}"), |a| kind(&a)));
        }
        kinds.join("\n")
    });
    let mut counts = BTreeMap::new();
    for line in child.wait(Duration::from_secs(60)).lines() {
        *counts.entry(line.to_owned()).or_insert(0) += 1;
    }
    counts
}

/// One response, read by its `content-length` (every answer here has one): Envoy closes a
/// connection a second after its local reply, so reading to the close would wait for that.
fn read_response(s: &mut TcpStream) -> std::io::Result<String> {
    let mut text = Vec::new();
    let mut byte = [0u8; 1];
    while !text.ends_with(b"\r\n\r\n") && text.len() < 8192 {
        if s.read(&mut byte)? == 0 {
            break;
        }
        text.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&text).into_owned();
    let length = head
        .lines()
        .filter_map(|l| l.split_once(':'))
        .find(|(n, _)| n.eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.trim().parse::<usize>().ok())
        .unwrap_or(0);
    let mut body = vec![0u8; length.min(8192)];
    s.read_exact(&mut body)?;
    Ok(head + &String::from_utf8_lossy(&body))
}

/// `n` TCP connections to `target` from `cgroup`, each sending a GET: how many reached the
/// backend (its answer names it).
fn tcp_reached(netns: &Netns, cgroup: Option<&TestCgroup>, target: &str, n: u32) -> u32 {
    let counts = answers(netns, cgroup, target, n);
    counts
        .iter()
        .filter(|(k, _)| k.starts_with("200 \"b /d\""))
        .map(|(_, c)| c)
        .sum()
}

const DROPPED: &str = "503 \"drop overload\" drop=true unconditional=-";
const UNCONDITIONAL: &str = "503 \"unconditional drop overload\" drop=- unconditional=true";
const PASSED: &str = "200 \"b /d\" drop=- unconditional=-";

#[test]
fn drop_overloads_drop_the_same_share_as_envoy() {
    require_root();
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let _backend = Servers::start(&netns, &[(BACKEND.parse().unwrap(), "b")], http_server);
    let daemon = integration_tests::kernel::Daemon::start_in(&netns, &daemon_config(&cgroup));
    let envoy = Envoy::with_bootstrap(&envoy_bootstrap(), Some(&netns.path()));
    until_envoy_listens_n(&netns, &envoy, 4);
    let envoy_at = |port: u16| format!("127.0.0.1:{port}");
    let daemon_stat =
        |name: &str| daemon.stat(&format!("cluster.{name}.upstream_rq_drop_overload"));

    let (_, _, _, port, vip) = CASES[0];
    let envoy_half = answers(&netns, None, &envoy_at(port), HALF_REQUESTS);
    let daemon_half = answers(&netns, Some(&cgroup), vip, HALF_REQUESTS);
    println!("half: envoy {envoy_half:?}\ndaemon {daemon_half:?}");
    for (side, got) in [("envoy", &envoy_half), ("daemon", &daemon_half)] {
        let kinds: Vec<&str> = got.keys().map(String::as_str).collect();
        assert_eq!(kinds, [PASSED, DROPPED], "{side}: {got:?}");
        let dropped = got[DROPPED];
        assert!(
            dropped.abs_diff(HALF_REQUESTS / 2) < HALF_SLACK,
            "{side}: {dropped} of {HALF_REQUESTS} dropped at 1/2"
        );
    }
    assert_eq!(daemon_stat("half"), u64::from(daemon_half[DROPPED]));

    for (index, only) in [(1, UNCONDITIONAL), (2, PASSED)] {
        let (name, _, _, port, vip) = CASES[index];
        let want = BTreeMap::from([(only.to_owned(), EXACT_REQUESTS)]);
        assert_eq!(
            answers(&netns, None, &envoy_at(port), EXACT_REQUESTS),
            want,
            "envoy {name}"
        );
        assert_eq!(
            answers(&netns, Some(&cgroup), vip, EXACT_REQUESTS),
            want,
            "daemon {name}"
        );
    }
    assert_eq!(daemon_stat("all"), u64::from(EXACT_REQUESTS));
    assert_eq!(daemon_stat("none"), 0);

    // TCP over `all`: Envoy's tcp_proxy and the daemon's TCP service drop nothing.
    let envoy_tcp = tcp_reached(&netns, None, &envoy_at(TCP.0), EXACT_REQUESTS);
    let daemon_tcp = tcp_reached(&netns, Some(&cgroup), TCP.1, EXACT_REQUESTS);
    assert_eq!((envoy_tcp, daemon_tcp), (EXACT_REQUESTS, EXACT_REQUESTS));
    assert_eq!(daemon_stat("all"), u64::from(EXACT_REQUESTS));
}
