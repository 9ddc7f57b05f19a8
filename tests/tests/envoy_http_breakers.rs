//! HTTP circuit breakers side by side with a real Envoy 1.40 (root): the same three HTTP
//! clusters of one host each, in one fresh network namespace, with low limits, behind Envoy's
//! HTTP listeners and the daemon's `mode: proxy` services (reached through the kernel's
//! redirect). Each side has its own backends, which hold every request until the test releases
//! them, so the concurrency is exact: requests are sent one by one, each only once the
//! previous one is where it should be (held at the backend, or waiting as pending).
//!
//! Per case both sides must show the same answers (status, `x-envoy-overloaded`), the same
//! overflow counters and the same `circuit_breakers.default.*_open` gauges while the requests
//! are held, and the same counters once all are answered; and the same thresholds in
//! `/clusters?format=json`:
//! - `pend` (`max_connections: 2`, `max_pending_requests: 1`): two held on two connections,
//!   a third waits as pending (a connection over the limit counted), a fourth is refused;
//! - `req` (`max_requests: 2`): two held, a third refused once it has its connection;
//! - `retry` (`max_retries: 1`, one retry on 503): a retry held, a second one not made.
#![allow(
    unsafe_code,
    reason = "a socket pair handed to a forked client by its fd"
)]

use std::{
    io::{BufRead as _, BufReader, Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    os::unix::net::UnixStream,
    time::{Duration, Instant},
};

use integration_tests::{
    http_servers::HoldingBackend,
    kernel::{Daemon, InCgroup, Netns, TestCgroup, require_root, unique},
    xds_server::{Envoy, http},
};
use serde_json::{Value, json};

/// How long anything here may take: a held request, a wait for a state, an answer.
const BOUND: Duration = Duration::from_secs(20);

/// One case: its cluster (and service, listener) name, Envoy's listener port,
/// the daemon's VIP, the backends of each side, and its script.
struct Case {
    name: &'static str,
    envoy_port: u16,
    vip: &'static str,
    backends: [&'static str; 2],
    script: &'static [Step],
    /// What Envoy must show (lines of [`run`]'s record, or parts of one), so that the
    /// comparison is not between two sides that both stopped limiting.
    envoy_shows: &'static [&'static str],
}

/// What the test does next, on one side.
#[derive(Debug)]
enum Step {
    /// Opens client connection `i` and sends `GET <path>` on it.
    Send(usize, &'static str),
    /// Waits until the backend holds this many requests.
    Held(usize),
    /// Waits until the cluster's `circuit_breakers.default.<gauge>` is 1.
    Open(&'static str),
    /// Reads the answer on connection `i`: `<status> overloaded=<bool>`.
    Read(usize),
    /// Records the cluster's breaker stats.
    Snapshot,
    /// Lets the backend answer every request it holds, and the later ones at once.
    Release,
}

const CASES: [Case; 3] = [
    Case {
        name: "pend",
        envoy_port: 15011,
        vip: "127.77.10.1:80",
        backends: ["127.0.0.101:8101", "127.0.0.111:8111"],
        script: &[
            Step::Send(0, "/0"),
            Step::Held(1),
            Step::Send(1, "/1"),
            Step::Held(2),
            Step::Send(2, "/2"),
            Step::Open("rq_pending_open"),
            Step::Send(3, "/3"),
            Step::Read(3),
            Step::Snapshot,
            Step::Release,
            Step::Read(0),
            Step::Read(1),
            Step::Read(2),
        ],
        envoy_shows: &[
            "3: 503 overloaded=true",
            "2: 200 overloaded=false",
            "held [(\"upstream_cx_overflow\", 1), (\"upstream_rq_pending_overflow\", 1)",
            "(\"circuit_breakers.default.cx_open\", 1), (\"circuit_breakers.default.rq_pending_open\", 1)",
        ],
    },
    Case {
        name: "req",
        envoy_port: 15012,
        vip: "127.77.10.2:80",
        backends: ["127.0.0.102:8102", "127.0.0.112:8112"],
        script: &[
            Step::Send(0, "/0"),
            Step::Held(1),
            Step::Send(1, "/1"),
            Step::Held(2),
            Step::Send(2, "/2"),
            Step::Read(2),
            Step::Snapshot,
            Step::Release,
            Step::Read(0),
            Step::Read(1),
        ],
        envoy_shows: &[
            "2: 503 overloaded=true",
            "(\"upstream_rq_active_overflow\", 1)",
            "(\"circuit_breakers.default.rq_open\", 1)",
        ],
    },
    Case {
        name: "retry",
        envoy_port: 15013,
        vip: "127.77.10.3:80",
        backends: ["127.0.0.103:8103", "127.0.0.113:8113"],
        script: &[
            Step::Send(0, "/fail-once/0"),
            Step::Held(1),
            Step::Send(1, "/fail-once/1"),
            Step::Read(1),
            Step::Snapshot,
            Step::Release,
            Step::Read(0),
        ],
        envoy_shows: &[
            "1: 503 overloaded=false",
            "0: 200 overloaded=false",
            "(\"upstream_rq_retry_overflow\", 1)",
            "(\"circuit_breakers.default.rq_retry_open\", 1)",
        ],
    },
];

/// The thresholds of each case, by name.
fn thresholds(name: &str) -> Value {
    match name {
        "pend" => json!({"max_connections": 2, "max_pending_requests": 1}),
        "req" => json!({"max_requests": 2}),
        _ => json!({"max_retries": 1}),
    }
}

/// The case's cluster on one side (0 Envoy, 1 the daemon), as Envoy's JSON.
fn cluster(case: &Case, side: usize) -> Value {
    let b: SocketAddr = case.backends[side].parse().unwrap();
    let mut c = json!({
        "name": case.name, "type": "STATIC", "lb_policy": "ROUND_ROBIN", "connect_timeout": "10s",
        "circuit_breakers": {"thresholds": [thresholds(case.name)]},
        "load_assignment": {"endpoints": [{"lb_endpoints": [{"endpoint": {"address": {"socket_address": {"address": b.ip().to_string(), "port_value": b.port()}}}}]}]}
    });
    if side == 0 {
        // Envoy wants the name here too; the daemon derives it.
        c["load_assignment"]["cluster_name"] = json!(case.name);
    }
    c
}

/// Envoy's HTTP listener of `case`; the `retry` case's route retries a 503 once, as the
/// daemon's service-router does.
fn envoy_listener(case: &Case) -> Value {
    let mut route = json!({"cluster": case.name});
    if case.name == "retry" {
        route["retry_policy"] = json!({"retry_on": "retriable-status-codes", "retriable_status_codes": [503], "num_retries": 1});
    }
    json!({
        "name": case.name,
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": case.envoy_port}},
        "filter_chains": [{"filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                "stat_prefix": case.name,
                "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [{
                    "match": {"prefix": "/"}, "route": route
                }]}]},
                "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                }}]
            }
        }]}]
    })
}

fn envoy_bootstrap() -> String {
    json!({
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
        "static_resources": {
            "listeners": CASES.iter().map(envoy_listener).collect::<Vec<_>>(),
            "clusters": CASES.iter().map(|c| cluster(c, 0)).collect::<Vec<_>>()
        }
    })
    .to_string()
}

/// The daemon's configuration: the same clusters, one service each (all HTTP), the `retry`
/// one with a service-router that retries a 503 once.
fn daemon_config(cgroup: &TestCgroup) -> String {
    use std::fmt::Write as _;
    let mut text = format!(
        "instance: {}\ncgroup: {}\nadmin:\n  address: \"{{admin}}\"\nproxy:\n  listeners: [\"127.0.0.1:15001\"]\nclusters:\n",
        unique("cb"),
        cgroup.path().display()
    );
    for case in &CASES {
        writeln!(text, "  - {}", cluster(case, 1)).unwrap();
    }
    text += "config_entries:\n  - { Kind: proxy-defaults, Name: global, Config: { protocol: http } }\n  - Kind: service-router\n    Name: retry\n    Routes: [{ Match: { HTTP: { PathPrefix: / } }, Destination: { NumRetries: 1, RetryOnStatusCodes: [503] } }]\nservices:\n";
    for case in &CASES {
        let vip: SocketAddr = case.vip.parse().unwrap();
        writeln!(
            text,
            "  - {{ name: {0}, address: {1}, port: {2}, chain: {0}, mode: proxy }}",
            case.name,
            vip.ip(),
            vip.port()
        )
        .unwrap();
    }
    text
}

/// A client in a child process (in `cgroup` when given) that does what it is told over a
/// socket pair, one command a line: `send <i> <target> <path>` and `read <i>`.
struct Client {
    _child: InCgroup,
    control: UnixStream,
    reader: BufReader<UnixStream>,
}

impl Client {
    fn start(netns: &Netns, cgroup: Option<&std::path::Path>) -> Self {
        use std::os::fd::{FromRawFd as _, IntoRawFd as _};
        let (control, theirs) = UnixStream::pair().expect("socket pair");
        let fd = theirs.into_raw_fd();
        let child = InCgroup::spawn_keeping(cgroup, netns, fd, move || {
            // SAFETY: the descriptor was handed to this child, which owns it from here.
            client_main(unsafe { UnixStream::from_raw_fd(fd) })
        });
        // SAFETY: `fd` was ours (into_raw_fd above) and is not used again here.
        unsafe { libc::close(fd) };
        control.set_read_timeout(Some(BOUND * 2)).unwrap();
        let reader = BufReader::new(control.try_clone().expect("cloning"));
        Self {
            _child: child,
            control,
            reader,
        }
    }

    fn ask(&mut self, command: &str) -> String {
        writeln!(self.control, "{command}").expect("telling the client");
        let mut line = String::new();
        self.reader
            .read_line(&mut line)
            .unwrap_or_else(|e| panic!("the client's answer to {command}: {e}"));
        line.trim().to_owned()
    }
}

/// The child's loop: bounded by its command count.
fn client_main(control: UnixStream) -> String {
    let mut out = control.try_clone().expect("cloning");
    let mut conns: Vec<Option<TcpStream>> = (0..8).map(|_| None).collect();
    for line in BufReader::new(control).lines().take(64) {
        let Ok(line) = line else { break };
        let words: Vec<&str> = line.split_whitespace().collect();
        let reply = match words[..] {
            ["send", i, target, path] => {
                send(&mut conns[i.parse::<usize>().unwrap()], target, path)
            }
            ["read", i] => conns[i.parse::<usize>().unwrap()]
                .take()
                .map_or_else(|| "no connection".to_owned(), read_answer),
            _ => format!("unknown command {line}"),
        };
        if writeln!(out, "{reply}").is_err() {
            break;
        }
    }
    String::new()
}

fn send(slot: &mut Option<TcpStream>, target: &str, path: &str) -> String {
    let target: SocketAddr = target.parse().unwrap();
    let sent = TcpStream::connect_timeout(&target, Duration::from_secs(2)).and_then(|mut s| {
        s.set_read_timeout(Some(BOUND))?;
        write!(
            s,
            "GET {path} HTTP/1.1\r\nhost: web\r\nconnection: close\r\n\r\n"
        )?;
        Ok(s)
    });
    match sent {
        Ok(s) => {
            *slot = Some(s);
            "sent".to_owned()
        }
        Err(e) => format!("send failed: {e}"),
    }
}

/// `<status> overloaded=<bool>` of the answer (read to the close).
fn read_answer(mut s: TcpStream) -> String {
    let mut text = String::new();
    if let Err(e) = s.read_to_string(&mut text) {
        return format!("read failed: {e}");
    }
    let status = text.split_whitespace().nth(1).unwrap_or("none").to_owned();
    let head = text.split("\r\n\r\n").next().unwrap_or_default();
    let overloaded = head.lines().any(|l| {
        l.split_once(':').is_some_and(|(n, v)| {
            n.eq_ignore_ascii_case("x-envoy-overloaded") && v.trim() == "true"
        })
    });
    format!("{status} overloaded={overloaded}")
}

/// One side's view: its client, where it sends, its backend, its stats.
struct Side<'a> {
    client: Client,
    target: String,
    backend: &'a HoldingBackend,
    stats: &'a dyn Fn() -> Value,
}

/// The breaker stats of `cluster` in a `/stats?format=json` answer.
fn breaker_stats(stats: &Value, cluster: &str) -> Vec<(String, u64)> {
    let names = [
        "upstream_cx_overflow",
        "upstream_rq_pending_overflow",
        "upstream_rq_active_overflow",
        "upstream_rq_retry_overflow",
        "circuit_breakers.default.cx_open",
        "circuit_breakers.default.rq_pending_open",
        "circuit_breakers.default.rq_open",
        "circuit_breakers.default.rq_retry_open",
    ];
    names
        .iter()
        .map(|n| {
            let name = format!("cluster.{cluster}.{n}");
            let value = stats["stats"]
                .as_array()
                .and_then(|all| all.iter().find(|s| s["name"] == name.as_str()))
                .and_then(|s| s["value"].as_u64())
                .unwrap_or_else(|| panic!("no stat {name}"));
            ((*n).to_owned(), value)
        })
        .collect()
}

/// Runs `case`'s script on one side: every answer and snapshot, then the final counters.
fn run(case: &Case, side: &mut Side<'_>) -> Vec<String> {
    let mut seen = Vec::new();
    for step in case.script {
        match *step {
            Step::Send(i, path) => {
                let reply = side.client.ask(&format!("send {i} {} {path}", side.target));
                assert_eq!(reply, "sent", "{}: {step:?}", case.name);
            }
            Step::Held(n) => side.backend.until_held(n),
            Step::Open(gauge) => until_open(case.name, gauge, side.stats),
            Step::Read(i) => seen.push(format!("{i}: {}", side.client.ask(&format!("read {i}")))),
            Step::Snapshot => seen.push(format!(
                "held {:?}",
                breaker_stats(&(side.stats)(), case.name)
            )),
            Step::Release => side.backend.release(),
        }
    }
    let counters: Vec<_> = breaker_stats(&(side.stats)(), case.name)
        .into_iter()
        .filter(|(n, _)| n.ends_with("overflow"))
        .collect();
    seen.push(format!("after {counters:?}"));
    seen
}

/// Waits until `circuit_breakers.default.<gauge>` of `cluster` is 1.
fn until_open(cluster: &str, gauge: &str, stats: &dyn Fn() -> Value) {
    let name = format!("circuit_breakers.default.{gauge}");
    let deadline = Instant::now() + BOUND;
    loop {
        let now = breaker_stats(&stats(), cluster);
        if now.iter().any(|(n, v)| *n == name && *v == 1) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{cluster}: {name} never opened: {now:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Waits until Envoy is live with its listeners bound.
fn until_envoy_serves(envoy_stats: &dyn Fn() -> Value) {
    let deadline = Instant::now() + BOUND;
    loop {
        let stats = envoy_stats();
        let stat = |name: &str| {
            stats["stats"].as_array().and_then(|all| {
                all.iter()
                    .find(|s| s["name"] == name)
                    .and_then(|s| s["value"].as_u64())
            })
        };
        if stat("server.state") == Some(0)
            && stat("listener_manager.total_listeners_active") == Some(CASES.len() as u64)
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

/// Each case's cluster's `circuit_breakers` in a `/clusters?format=json` answer.
fn thresholds_of(body: &str) -> Vec<Value> {
    let clusters: Value = serde_json::from_str(body).expect("clusters JSON");
    let all = clusters["cluster_statuses"]
        .as_array()
        .expect("cluster_statuses");
    CASES
        .iter()
        .map(|case| {
            let c = all.iter().find(|c| c["name"] == case.name);
            c.map_or(Value::Null, |c| c["circuit_breakers"].clone())
        })
        .collect()
}

/// Runs `case` through Envoy, checks what Envoy must show, then through the daemon: the
/// daemon's record must be Envoy's.
fn compare(case: &Case, mut envoy: Side<'_>, mut daemon: Side<'_>) {
    let through_envoy = run(case, &mut envoy);
    for shown in case.envoy_shows {
        assert!(
            through_envoy.iter().any(|line| line.contains(shown)),
            "{}: envoy does not show {shown}: {through_envoy:#?}",
            case.name
        );
    }
    let through_daemon = run(case, &mut daemon);
    println!(
        "{}: envoy {through_envoy:#?}\ndaemon {through_daemon:#?}",
        case.name
    );
    assert_eq!(through_daemon, through_envoy, "{}", case.name);
}

#[test]
fn http_circuit_breakers_answer_and_count_as_envoys() {
    require_root();
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let backends: Vec<[HoldingBackend; 2]> = CASES
        .iter()
        .map(|c| {
            c.backends
                .map(|b| HoldingBackend::start(&netns, b.parse().unwrap()))
        })
        .collect();
    let daemon = Daemon::start_in(&netns, &daemon_config(&cgroup));
    let envoy = Envoy::with_bootstrap(&envoy_bootstrap(), Some(&netns.path()));
    let admin = envoy.admin();
    let ns = netns.path();
    let envoy_stats = move || -> Value {
        let (_, body) = integration_tests::kernel::in_netns_at(ns.clone(), move || {
            http(admin, "GET", "/stats?format=json", "")
        })
        .join()
        .expect("envoy admin answers");
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("envoy stats JSON ({e}): {body}"))
    };
    let daemon_stats = || -> Value {
        let (code, body) = daemon
            .get("/stats?format=json")
            .expect("daemon admin answers");
        assert_eq!(code, 200, "{body}");
        serde_json::from_str(&body).expect("daemon stats JSON")
    };
    until_envoy_serves(&envoy_stats);
    for (case, backends) in CASES.iter().zip(&backends) {
        let envoy_side = Side {
            client: Client::start(&netns, None),
            target: format!("127.0.0.1:{}", case.envoy_port),
            backend: &backends[0],
            stats: &envoy_stats,
        };
        let daemon_side = Side {
            client: Client::start(&netns, Some(cgroup.path())),
            target: case.vip.to_owned(),
            backend: &backends[1],
            stats: &daemon_stats,
        };
        compare(case, envoy_side, daemon_side);
    }
    let (code, daemon_clusters) = daemon
        .get("/clusters?format=json")
        .expect("daemon admin answers");
    assert_eq!(code, 200, "{daemon_clusters}");
    let ns = netns.path();
    let (_, envoy_clusters) = integration_tests::kernel::in_netns_at(ns, move || {
        http(admin, "GET", "/clusters?format=json", "")
    })
    .join()
    .expect("envoy admin answers");
    assert_eq!(
        thresholds_of(&daemon_clusters),
        thresholds_of(&envoy_clusters),
        "/clusters circuit_breakers"
    );
}
