//! RING_HASH and MAGLEV on the proxy path side by side with a real Envoy 1.40 (root): four HTTP
//! backends in a fresh network namespace. Envoy routes one listener by a header's hash over a
//! RING_HASH cluster and another by a query parameter's over a MAGLEV cluster. The daemon
//! serves the same through two `mode: proxy` services reached by the kernel's redirect: the
//! ring through the cluster's `lb_policy` and the service's `hash_policy`, Maglev through a
//! Consul service-resolver `LoadBalancer` over a RANDOM cluster; a third listener and service
//! hash a cookie over the ring (generated when absent). Every key goes to the same backend on
//! both, every time, and the generated `Set-Cookie` has Envoy's form. After one backend is
//! removed (the daemon reloaded, Envoy restarted with the three left), again the same on both,
//! and the keys that moved are the removed backend's and, for the ring, the few that Envoy's
//! resized ring moves too.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    path::Path,
    time::{Duration, Instant},
};

use integration_tests::{
    http_servers::{Servers, http_server},
    kernel::{Daemon, InCgroup, Netns, TestCgroup, in_netns, require_root, unique},
    xds_server::{Envoy, http},
};
use serde_json::{Value, json};

const BACKENDS: [(&str, &str); 4] = [
    ("127.0.0.91:8091", "b1"),
    ("127.0.0.92:8092", "b2"),
    ("127.0.0.93:8093", "b3"),
    ("127.0.0.94:8094", "b4"),
];
const RING_VIP: &str = "127.77.9.1:80";
const MAGLEV_VIP: &str = "127.77.9.2:80";
const COOKIE_VIP: &str = "127.77.9.3:80";
/// Keys sent per side and policy.
const KEYS: usize = 60;

/// How a key goes into a request.
#[derive(Clone, Copy)]
enum Key {
    /// `x-user: <key>`.
    Header,
    /// `/?u=<key>`.
    Query,
    /// `cookie: s=<key>`.
    Cookie,
}

fn lb_endpoints(backends: &[(&str, &str)]) -> Vec<Value> {
    backends
        .iter()
        .map(|(b, _)| {
            let b: SocketAddr = b.parse().unwrap();
            json!({"endpoint": {"address": {"socket_address": {"address": b.ip().to_string(), "port_value": b.port()}}}})
        })
        .collect()
}

/// An HTTP listener named after its port, routing everything to `cluster` by `hash_policy`.
fn envoy_listener(port: u16, cluster: &str, hash_policy: &Value) -> Value {
    json!({
        "name": format!("l{port}"),
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
        "filter_chains": [{"filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                "stat_prefix": cluster,
                "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [{
                    "match": {"prefix": "/"},
                    "route": {"cluster": cluster, "hash_policy": [hash_policy]}
                }]}]},
                "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                }}]
            }
        }]}]
    })
}

/// Envoy with listeners on `ports` (ring by header, maglev, ring by cookie) over `backends`.
fn envoy_bootstrap(backends: &[(&str, &str)], ports: (u16, u16, u16)) -> String {
    let cluster = |name: &str, policy: &str| {
        json!({
            "name": name, "type": "STATIC", "lb_policy": policy, "connect_timeout": "1s",
            "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": lb_endpoints(backends)}]}
        })
    };
    json!({
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
        "static_resources": {
            "listeners": [
                envoy_listener(ports.0, "ring", &json!({"header": {"header_name": "x-user"}})),
                envoy_listener(ports.1, "maglev", &json!({"query_parameter": {"name": "u"}})),
                envoy_listener(ports.2, "ring", &json!({"cookie": {"name": "s", "ttl": "60s", "path": "/"}})),
            ],
            "clusters": [cluster("ring", "RING_HASH"), cluster("maglev", "MAGLEV")]
        }
    })
    .to_string()
}

fn daemon_config(cgroup: &TestCgroup, instance: &str, backends: &[(&str, &str)]) -> String {
    let endpoints = serde_json::to_string(&lb_endpoints(backends)).unwrap();
    let cluster = |name: &str, policy: &str| {
        format!(
            "  - {{ name: {name}, lb_policy: {policy}, load_assignment: {{ endpoints: [{{ lb_endpoints: {endpoints} }}] }} }}\n"
        )
    };
    format!(
        "instance: {instance}\ncgroup: {}\nadmin:\n  address: \"{{admin}}\"\nproxy:\n  listeners: [\"127.0.0.1:15001\"]\nclusters:\n{}{}config_entries:\n  - {{ Kind: service-defaults, Name: ring, Protocol: http }}\n  - {{ Kind: service-defaults, Name: maglev, Protocol: http }}\n  - Kind: service-resolver\n    Name: maglev\n    LoadBalancer: {{ Policy: maglev, HashPolicies: [{{ Field: query_parameter, FieldValue: u }}] }}\nservices:\n  - {{ name: ring, address: 127.77.9.1, port: 80, chain: ring, mode: proxy, hash_policy: [{{ header: {{ header_name: x-user }} }}] }}\n  - {{ name: maglev, address: 127.77.9.2, port: 80, chain: maglev, mode: proxy }}\n  - {{ name: cookie, address: 127.77.9.3, port: 80, chain: ring, mode: proxy, hash_policy: [{{ cookie: {{ name: s, ttl: 60s, path: / }} }}] }}\n",
        cgroup.path().display(),
        cluster("ring", "RING_HASH"),
        cluster("maglev", "RANDOM"),
    )
}

/// The backend each key reached through `to` (from inside the cgroup when given), in key order.
fn backends_of(netns: &Netns, cgroup: Option<&Path>, to: &str, key: Key) -> Vec<String> {
    let to: SocketAddr = to.parse().unwrap();
    let child = InCgroup::spawn(cgroup, netns, move || {
        let mut names = Vec::new();
        for k in 0..KEYS {
            let request = match key {
                Key::Header => format!(
                    "GET / HTTP/1.1\r\nhost: web\r\nx-user: user-{k}\r\nconnection: close\r\n\r\n"
                ),
                Key::Query => {
                    format!("GET /?u=user-{k} HTTP/1.1\r\nhost: web\r\nconnection: close\r\n\r\n")
                }
                Key::Cookie => format!(
                    "GET / HTTP/1.1\r\nhost: web\r\ncookie: s=user-{k}\r\nconnection: close\r\n\r\n"
                ),
            };
            let text = exchange(to, &request).unwrap_or_else(|e| format!("error:{e}"));
            let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
            names.push(body.split_whitespace().next().unwrap_or("none").to_owned());
        }
        names.join("\n")
    });
    child
        .wait(Duration::from_secs(60))
        .lines()
        .map(str::to_owned)
        .collect()
}

/// One request to `to`; the whole answer.
fn exchange(to: SocketAddr, request: &str) -> std::io::Result<String> {
    let mut s = TcpStream::connect_timeout(&to, Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    s.write_all(request.as_bytes())?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    Ok(text)
}

/// The `Set-Cookie` a request without the cookie gets through `to`, its value masked (Envoy
/// hashes its own listener's address into it, the daemon the service's).
fn generated_cookie(netns: &Netns, cgroup: Option<&Path>, to: &str) -> String {
    let to: SocketAddr = to.parse().unwrap();
    let child = InCgroup::spawn(cgroup, netns, move || {
        let request = "GET / HTTP/1.1\r\nhost: web\r\nconnection: close\r\n\r\n";
        let text = exchange(to, request).unwrap_or_else(|e| format!("error:{e}"));
        let line = text.lines().find_map(|l| {
            let (name, value) = l.split_once(':')?;
            name.eq_ignore_ascii_case("set-cookie")
                .then(|| value.trim().to_owned())
        });
        line.unwrap_or_else(|| format!("no set-cookie in {text:?}"))
    });
    let line = child.wait(Duration::from_secs(30));
    let value = line.split('"').nth(1).unwrap_or_default().to_owned();
    assert!(
        value.len() == 16 && value.bytes().all(|b| b.is_ascii_hexdigit()),
        "{line}"
    );
    line.trim().replace(&value, "<16 hex>")
}

/// Waits until Envoy is live with its three listeners bound.
fn until_envoy_serves(netns: &Netns, envoy: &Envoy) {
    let admin = envoy.admin();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (_, body) = in_netns(netns, move || http(admin, "GET", "/stats?format=json", ""))
            .join()
            .expect("envoy admin answers");
        let stats: Value = serde_json::from_str(&body).unwrap_or_default();
        let stat = |name: &str| {
            stats["stats"].as_array().and_then(|all| {
                all.iter()
                    .find(|s| s["name"] == name)
                    .and_then(|s| s["value"].as_u64())
            })
        };
        if stat("server.state") == Some(0)
            && stat("listener_manager.total_listeners_active") == Some(3)
        {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "envoy not live with its listeners"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Both sides' backends per key, in pairs (Envoy's, the daemon's): the ring by header,
/// Maglev by query parameter, the ring by cookie. The daemon is asked twice: a key's backend
/// must not change between the rounds.
fn both_sides(netns: &Netns, cgroup: &TestCgroup, ports: (u16, u16, u16)) -> [Vec<String>; 6] {
    let envoy = |port: u16, key| backends_of(netns, None, &format!("127.0.0.1:{port}"), key);
    let daemon = |vip: &str, key| {
        let first = backends_of(netns, Some(cgroup.path()), vip, key);
        let again = backends_of(netns, Some(cgroup.path()), vip, key);
        assert_eq!(first, again, "{vip}: a key changed backends");
        first
    };
    [
        envoy(ports.0, Key::Header),
        daemon(RING_VIP, Key::Header),
        envoy(ports.1, Key::Query),
        daemon(MAGLEV_VIP, Key::Query),
        envoy(ports.2, Key::Cookie),
        daemon(COOKIE_VIP, Key::Cookie),
    ]
}

/// Each pair of [`both_sides`] is equal.
fn assert_same(sides: &[Vec<String>; 6], when: &str) {
    for (pair, what) in sides
        .chunks(2)
        .zip(["ring by header", "maglev", "ring by cookie"])
    {
        assert_eq!(
            pair[1], pair[0],
            "{what} {when}: the daemon's backends are Envoy's"
        );
    }
}

/// Keys that were not on `removed` and moved.
fn others_moved(before: &[String], after: &[String], removed: &str) -> usize {
    before
        .iter()
        .zip(after)
        .filter(|(b, a)| *b != removed && b != a)
        .count()
}

#[test]
fn ring_hash_and_maglev_pick_the_backends_envoy_picks() {
    require_root();
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let servers: Vec<(SocketAddr, &str)> = BACKENDS
        .iter()
        .map(|(a, n)| (a.parse().unwrap(), *n))
        .collect();
    let _servers = Servers::start(&netns, &servers, http_server);
    let instance = unique("hash");
    let daemon = Daemon::start_in(&netns, &daemon_config(&cgroup, &instance, &BACKENDS));
    let envoy = Envoy::with_bootstrap(
        &envoy_bootstrap(&BACKENDS, (15002, 15003, 15004)),
        Some(&netns.path()),
    );
    until_envoy_serves(&netns, &envoy);
    let before = both_sides(&netns, &cgroup, (15002, 15003, 15004));
    println!("before: {before:?}");
    for (i, side) in before.iter().enumerate() {
        let used: std::collections::BTreeSet<_> = side.iter().collect();
        assert!(
            used.len() >= 3 && used.iter().all(|n| n.starts_with('b')),
            "side {i}: {side:?}"
        );
    }
    assert_same(&before, "with four backends");
    // A request without the cookie gets one generated, in Envoy's form.
    assert_eq!(
        generated_cookie(&netns, Some(cgroup.path()), COOKIE_VIP),
        generated_cookie(&netns, None, "127.0.0.1:15004"),
    );
    drop(envoy);

    // b4 leaves: the daemon reloads, Envoy starts again with the three left.
    let left = &BACKENDS[..3];
    std::fs::write(
        &daemon.config,
        daemon_config(&cgroup, &instance, left).replace("{admin}", &daemon.admin.to_string()),
    )
    .unwrap();
    daemon.signal(libc::SIGHUP);
    let deadline = Instant::now() + Duration::from_secs(20);
    while backends_of(&netns, Some(cgroup.path()), RING_VIP, Key::Header).contains(&"b4".to_owned())
        || backends_of(&netns, Some(cgroup.path()), MAGLEV_VIP, Key::Query)
            .contains(&"b4".to_owned())
    {
        assert!(Instant::now() < deadline, "the reload never took b4 out");
    }
    let ports = (15005, 15006, 15007);
    let envoy = Envoy::with_bootstrap(&envoy_bootstrap(left, ports), Some(&netns.path()));
    until_envoy_serves(&netns, &envoy);
    let after = both_sides(&netns, &cgroup, ports);
    println!("after: {after:?}");
    assert_same(&after, "after b4 left");
    let (ring_moved, maglev_moved) = (
        others_moved(&before[1], &after[1], "b4"),
        others_moved(&before[3], &after[3], "b4"),
    );
    println!("keys not on b4 that moved: ring {ring_moved}, maglev {maglev_moved} of {KEYS}");
    // About a quarter of the keys were on b4; Maglev moves almost no other, the resized ring
    // (342 points per host instead of 256) a few more.
    assert!(maglev_moved <= KEYS / 20, "maglev moved {maglev_moved}");
    assert!(ring_moved <= KEYS / 5, "ring moved {ring_moved}");
}
