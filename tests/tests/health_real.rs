//! Health checkers against real servers on 127.0.0.1: TCP, HTTP/1.1, gRPC (tonic-health) and UDP
//! (a socat echo server, and unbound for DNS queries).
//!
//! No root needed. Each test starts its servers on random loopback ports, runs the checker,
//! stops and restarts the server, and asserts the host goes unhealthy and then healthy again.
//! Every wait is bounded.

use std::{net::SocketAddr, sync::Arc, time::Duration};

use integration_tests::{
    health_servers::{GrpcHealthServer, HttpServer, PingServer},
    udp_echo::UdpEcho,
    unbound::Unbound,
};
use proxy_core::{
    health::{
        CheckOutcome, Checker, ClusterHealth, ClusterHealthConfig, FailureKind, HealthCheckManager,
        HealthEvent, ProtocolChecker, SeededRandom,
    },
    host::Host,
};
use tokio::sync::broadcast;

/// Longest any test waits for a state it expects.
const WAIT: Duration = Duration::from_secs(10);

fn config(checker: &str) -> ClusterHealthConfig {
    let yaml = format!(
        "health_checks: [{{timeout: 0.5s, interval: 0.1s, unhealthy_threshold: 2, \
         healthy_threshold: 2, {checker}}}]\ncommon_lb_config: {{healthy_panic_threshold: {{value: 0}}}}"
    );
    serde_norway::from_str(&yaml).unwrap_or_else(|e| panic!("config {yaml}: {e}"))
}

async fn one_check(checker: &str, addr: SocketAddr) -> CheckOutcome {
    let spec = config(checker)
        .validate("svc")
        .expect("valid")
        .expect("one check");
    ProtocolChecker::new(Arc::new(spec)).check(addr).await
}

/// A cluster's health with its subscription to the manager's events, as its event loop holds
/// them.
struct Watched {
    cluster: ClusterHealth,
    events: broadcast::Receiver<HealthEvent>,
}

impl Watched {
    /// Subscribes, then builds the cluster, so no transition of its probes is missed.
    fn new(name: &str, checker: &str, manager: &HealthCheckManager, seed: u64) -> Self {
        let events = manager.subscribe();
        let random = Arc::new(SeededRandom::with_seed(seed));
        let cluster =
            ClusterHealth::new(name, &config(checker), manager, random).expect("valid config");
        Self { cluster, events }
    }
}

/// Polls the cluster until `addr` is (or is not) routable, failing after [`WAIT`].
async fn wait_routable(watched: &mut Watched, addr: SocketAddr, want: bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    let Watched { cluster, events } = watched;
    loop {
        cluster.pump_events(events);
        let routable = cluster.routing().routable().iter().any(|h| h.addr == addr);
        if routable == want {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{addr} still routable={routable} after {WAIT:?}; flags: {:?}",
            cluster
                .host_statuses()
                .iter()
                .map(|s| s.flags.render())
                .collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn cluster(checker: &str, manager: &HealthCheckManager, addr: SocketAddr) -> Watched {
    let mut c = Watched::new("svc", checker, manager, 9);
    c.cluster.note_traffic();
    c.cluster.update_hosts(vec![Host::new(addr)]);
    c
}

const TCP: &str =
    "tcp_health_check: {send: {text: 50494E47}, receive: [{text: 504F}, {text: 4E47}]}";
const HTTP: &str =
    "http_health_check: {path: /healthz, retriable_statuses: [{start: 502, end: 503}]}";
const GRPC: &str = "grpc_health_check: {service_name: orders}";

#[tokio::test]
async fn tcp_checker_against_a_real_listener() {
    let mut server = PingServer::start().await;
    let addr = server.addr();
    assert_eq!(one_check(TCP, addr).await, CheckOutcome::Healthy);
    assert_eq!(
        one_check("tcp_health_check: {}", addr).await,
        CheckOutcome::Healthy
    );
    // Expecting bytes the server never sends: it closes after its reply, a network failure.
    let wrong = "tcp_health_check: {send: {text: 50494E47}, receive: [{text: 5858}]}";
    assert_eq!(
        one_check(wrong, addr).await,
        CheckOutcome::Failed(FailureKind::Network)
    );
    // A peer that accepts but never answers: the timeout decides.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let silent_addr = silent.local_addr().expect("addr");
    assert_eq!(
        one_check(TCP, silent_addr).await,
        CheckOutcome::Failed(FailureKind::Timeout)
    );
    drop(silent);

    let manager = HealthCheckManager::default();
    let mut c = cluster(TCP, &manager, addr);
    wait_routable(&mut c, addr, true).await;
    server.stop().await;
    assert_eq!(
        one_check(TCP, addr).await,
        CheckOutcome::Failed(FailureKind::Network)
    );
    wait_routable(&mut c, addr, false).await;
    server.restart().await;
    wait_routable(&mut c, addr, true).await;
}

#[tokio::test]
async fn http_checker_against_a_real_server() {
    let mut server = HttpServer::start().await;
    let addr = server.addr();
    assert_eq!(one_check(HTTP, addr).await, CheckOutcome::Healthy);
    server.set_status(502);
    assert_eq!(
        one_check(HTTP, addr).await,
        CheckOutcome::Failed(FailureKind::Retriable)
    );
    server.set_status(500);
    assert_eq!(
        one_check(HTTP, addr).await,
        CheckOutcome::Failed(FailureKind::Immediate)
    );
    server.set_status(299);
    assert_eq!(one_check(HTTP, addr).await, CheckOutcome::Degraded);
    server.set_status(298);
    assert_eq!(
        one_check(HTTP, addr).await,
        CheckOutcome::Failed(FailureKind::Immediate)
    );
    server.set_status(200);

    let manager = HealthCheckManager::default();
    let mut c = cluster(HTTP, &manager, addr);
    wait_routable(&mut c, addr, true).await;
    server.stop().await;
    wait_routable(&mut c, addr, false).await;
    server.restart().await;
    wait_routable(&mut c, addr, true).await;
    // A non-retriable status fails the host without waiting for the threshold.
    server.set_status(404);
    wait_routable(&mut c, addr, false).await;
    server.set_status(200);
    wait_routable(&mut c, addr, true).await;
    let stats = c.cluster.stats();
    let get = |name: &str| stats.iter().find(|(n, _)| n == name).map_or(0, |(_, v)| *v);
    assert!(get("cluster.svc.health_check.attempt") >= 4, "{stats:?}");
    assert!(
        get("cluster.svc.health_check.network_failure") >= 2,
        "{stats:?}"
    );
    assert!(get("cluster.svc.health_check.failure") >= 3, "{stats:?}");
}

#[tokio::test]
async fn grpc_checker_against_tonic_health() {
    let mut server = GrpcHealthServer::start("orders").await;
    let addr = server.addr();
    assert_eq!(one_check(GRPC, addr).await, CheckOutcome::Healthy);
    let unknown = "grpc_health_check: {service_name: nope}";
    assert_eq!(
        one_check(unknown, addr).await,
        CheckOutcome::Failed(FailureKind::Immediate)
    );
    server.set_serving("orders", false).await;
    assert_eq!(
        one_check(GRPC, addr).await,
        CheckOutcome::Failed(FailureKind::Immediate)
    );
    server.set_serving("orders", true).await;

    let manager = HealthCheckManager::default();
    let mut c = cluster(GRPC, &manager, addr);
    wait_routable(&mut c, addr, true).await;
    server.stop().await;
    wait_routable(&mut c, addr, false).await;
    server.restart().await;
    wait_routable(&mut c, addr, true).await;
    server.set_serving("orders", false).await;
    wait_routable(&mut c, addr, false).await;
}

#[tokio::test]
async fn two_clusters_share_one_real_probe() {
    let server = PingServer::start().await;
    let addr = server.addr();
    let manager = HealthCheckManager::default();
    let mut a = cluster(TCP, &manager, addr);
    let mut b = Watched::new("other", TCP, &manager, 3);
    b.cluster.update_hosts(vec![Host::new(addr)]);
    assert_eq!(manager.probe_count(), 1);
    wait_routable(&mut a, addr, true).await;
    wait_routable(&mut b, addr, true).await;
    drop(a);
    drop(b);
    assert_eq!(manager.probe_count(), 0);
}

/// `PING` out, `PING` back (socat echoes it).
const UDP_ECHO: &str =
    "udp_health_check: {send: {text: 50494E47}, receive: [{text: 5049}, {text: 4E47}]}";
const UDP_DNS: &str = "udp_health_check: {dns: {name: health.svc.test.}}";

#[tokio::test]
async fn udp_checker_against_a_real_echo_server() {
    let mut server = UdpEcho::start();
    let addr = server.addr();
    assert_eq!(one_check(UDP_ECHO, addr).await, CheckOutcome::Healthy);
    let any_reply = "udp_health_check: {send: {text: 00}}";
    assert_eq!(one_check(any_reply, addr).await, CheckOutcome::Healthy);
    // A reply that never holds the blocks: the timeout decides.
    let wrong = "udp_health_check: {send: {text: 50494E47}, receive: [{text: 5858}]}";
    assert_eq!(
        one_check(wrong, addr).await,
        CheckOutcome::Failed(FailureKind::Timeout)
    );

    let manager = HealthCheckManager::default();
    let mut c = cluster(UDP_ECHO, &manager, addr);
    wait_routable(&mut c, addr, true).await;
    server.stop();
    // Nothing listens: the ICMP port unreachable fails the check at once, a network failure
    // rather than a timeout.
    assert_eq!(
        one_check(UDP_ECHO, addr).await,
        CheckOutcome::Failed(FailureKind::Network)
    );
    wait_routable(&mut c, addr, false).await;
    server.restart();
    wait_routable(&mut c, addr, true).await;
    let stats = c.cluster.stats();
    let get = |name: &str| stats.iter().find(|(n, _)| n == name).map_or(0, |(_, v)| *v);
    assert!(
        get("cluster.svc.health_check.network_failure") >= 2,
        "{stats:?}"
    );
}

#[tokio::test]
async fn udp_dns_checker_against_unbound() {
    let mut server = Unbound::start(&["health.svc.test. 5 IN A 127.0.0.9"]);
    let addr = server.addr();
    assert_eq!(one_check(UDP_DNS, addr).await, CheckOutcome::Healthy);
    let aaaa = "udp_health_check: {dns: {name: health.svc.test, query_type: AAAA}}";
    assert_eq!(one_check(aaaa, addr).await, CheckOutcome::Healthy);
    // A name the zone does not hold: NXDOMAIN, a failure counted towards the threshold unless
    // NXDOMAIN is what the check expects.
    let missing = "udp_health_check: {dns: {name: gone.svc.test}}";
    assert_eq!(
        one_check(missing, addr).await,
        CheckOutcome::Failed(FailureKind::Retriable)
    );
    let expect_nx = "udp_health_check: {dns: {name: gone.svc.test, expected_rcode: NXDOMAIN}}";
    assert_eq!(one_check(expect_nx, addr).await, CheckOutcome::Healthy);

    let manager = HealthCheckManager::default();
    let mut c = cluster(UDP_DNS, &manager, addr);
    // Two clusters with the same check on the same address share one probe.
    let mut other = Watched::new("other", UDP_DNS, &manager, 3);
    other.cluster.update_hosts(vec![Host::new(addr)]);
    assert_eq!(manager.probe_count(), 1);
    wait_routable(&mut c, addr, true).await;
    wait_routable(&mut other, addr, true).await;
    server.stop();
    assert_eq!(
        one_check(UDP_DNS, addr).await,
        CheckOutcome::Failed(FailureKind::Network)
    );
    wait_routable(&mut c, addr, false).await;
    server.restart();
    wait_routable(&mut c, addr, true).await;
    // The name deleted at the server: answered NXDOMAIN, the host fails after the threshold.
    server.remove("health.svc.test.");
    wait_routable(&mut c, addr, false).await;
    server.add("health.svc.test. 5 IN A 127.0.0.9");
    wait_routable(&mut c, addr, true).await;
    let stats = c.cluster.stats();
    let get = |name: &str| stats.iter().find(|(n, _)| n == name).map_or(0, |(_, v)| *v);
    assert!(get("cluster.svc.health_check.failure") >= 4, "{stats:?}");
}
