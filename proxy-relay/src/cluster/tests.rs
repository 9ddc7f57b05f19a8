//! The cluster handle: states, picks per policy, drains, and passive health reports.

use proxy_core::{
    health::{HostClass, Routing},
    host::Host,
};

use super::*;

fn routing(hosts: &[(&str, HostClass)]) -> Routing {
    let hosts: Vec<(Host, HostClass)> = hosts
        .iter()
        .map(|(a, c)| (Host::new(a.parse().unwrap()), *c))
        .collect();
    Routing::compute(&hosts, 50.0)
}

fn addr(s: &str) -> BackendAddr {
    BackendAddr(s.parse().unwrap())
}

const POLICY: DrainPolicy = DrainPolicy {
    drain_timeout: Duration::from_secs(10),
    close_on_health_failure: false,
};

#[test]
fn states() {
    let r = routing(&[
        ("127.0.0.1:1", HostClass::Healthy),
        ("127.0.0.2:1", HostClass::Healthy),
        ("127.0.0.3:1", HostClass::Unhealthy),
    ]);
    assert_eq!(
        host_state(&r, "127.0.0.1:1".parse().unwrap()),
        HostState::Routable
    );
    assert_eq!(
        host_state(&r, "127.0.0.3:1".parse().unwrap()),
        HostState::Unhealthy
    );
    assert_eq!(
        host_state(&r, "127.0.0.9:1".parse().unwrap()),
        HostState::Removed
    );
}

#[test]
fn pick_follows_weights_and_avoids_tried() {
    let hosts = [
        ("127.0.0.1:1".parse().unwrap(), 3),
        ("127.0.0.2:1".parse().unwrap(), 1),
    ];
    let n = 4000;
    let first = (0..n)
        .filter(|_| weighted_pick(&hosts) == Some(hosts[0].0))
        .count();
    // Expect 3000; 5 sigma of a binomial(4000, 0.75) is about 137.
    assert!((2860..3140).contains(&first), "{first}");
    let (_tx, rx) = watch::channel(routing(&[
        ("127.0.0.1:1", HostClass::Healthy),
        ("127.0.0.2:1", HostClass::Healthy),
    ]));
    let c = ClusterHandle::new("c", rx, true, Duration::from_secs(1));
    for _ in 0..50 {
        assert_eq!(c.pick(&[addr("127.0.0.1:1")]), Some(addr("127.0.0.2:1")));
    }
    // Every host tried: pick among all again.
    assert!(
        c.pick(&[addr("127.0.0.1:1"), addr("127.0.0.2:1")])
            .is_some()
    );
}

#[test]
fn round_robin_rotates_exactly_and_follows_the_hosts() {
    use proxy_core::config::LbPolicy;
    let (tx, rx) = watch::channel(routing(&[
        ("127.0.0.1:1", HostClass::Healthy),
        ("127.0.0.2:1", HostClass::Healthy),
        ("127.0.0.3:1", HostClass::Healthy),
    ]));
    let c = ClusterHandle::new("c", rx, true, Duration::from_secs(1))
        .with_policy(Some(Duration::from_millis(250)), LbPolicy::RoundRobin);
    assert_eq!(
        c.connect_timeout(Duration::from_secs(5)),
        Duration::from_millis(250)
    );
    // Clones share the rotation (the engine's threads each hold one).
    let d = c.clone();
    let picks: Vec<_> = (0..9)
        .map(|i| if i % 2 == 0 { &c } else { &d }.pick(&[]).unwrap())
        .collect();
    for host in ["127.0.0.1:1", "127.0.0.2:1", "127.0.0.3:1"] {
        assert_eq!(picks.iter().filter(|&&p| p == addr(host)).count(), 3);
    }
    // Three in a row are three different hosts.
    for w in picks.windows(3) {
        assert!(w[0] != w[1] && w[1] != w[2] && w[0] != w[2], "{picks:?}");
    }
    // A retry skips the host it tried, and the checks before a pick take no turn.
    assert!(c.has_routable());
    let next = c.pick(&[]).unwrap();
    assert_ne!(c.pick(&[next]), Some(next));
    // The rotation follows the hosts.
    tx.send_replace(routing(&[("127.0.0.9:1", HostClass::Healthy)]));
    assert_eq!(c.pick(&[]), Some(addr("127.0.0.9:1")));
    // Without its own timeout a cluster takes the proxy's; RANDOM does not rotate.
    let (_tx, rx) = watch::channel(routing(&[("127.0.0.1:1", HostClass::Healthy)]));
    let r = ClusterHandle::new("r", rx, true, Duration::from_secs(1))
        .with_policy(None, LbPolicy::Random);
    assert_eq!(
        r.connect_timeout(Duration::from_secs(5)),
        Duration::from_secs(5)
    );
    assert!(r.rotation.is_none());
}

#[test]
fn least_request_prefers_the_host_with_fewer_open_leases() {
    use proxy_core::config::LbPolicy;
    let (_tx, rx) = watch::channel(routing(&[
        ("127.0.0.1:1", HostClass::Healthy),
        ("127.0.0.2:1", HostClass::Healthy),
    ]));
    let c = ClusterHandle::new("c", rx, true, Duration::from_secs(1))
        .with_policy(None, LbPolicy::LeastRequest);
    // A hundred leases held on host 1 (taken until one lands there).
    let mut held = Vec::new();
    while held.len() < 100 {
        let (host, lease) = c.pick_leased(&[]).unwrap();
        if host == addr("127.0.0.1:1") {
            held.push(lease.expect("LEAST_REQUEST leases"));
        }
    }
    // Host 1 is chosen only when both draws fall on it: about a quarter.
    let n = 4000;
    let on_loaded = (0..n)
        .filter(|_| c.pick_leased(&[]).unwrap().0 == addr("127.0.0.1:1"))
        .count();
    // Expect 1000; 5 sigma of binomial(4000, 1/4) is about 137.
    assert!((860..1140).contains(&on_loaded), "{on_loaded}");
    // Given back: the counts are even again, and host 1 gets about half.
    drop(held);
    let on_first = (0..n)
        .filter(|_| c.pick(&[]).unwrap() == addr("127.0.0.1:1"))
        .count();
    assert!((1840..2160).contains(&on_first), "{on_first}");
    // Other policies hand out no lease.
    let (_tx, rx) = watch::channel(routing(&[("127.0.0.1:1", HostClass::Healthy)]));
    let r = ClusterHandle::new("r", rx, true, Duration::from_secs(1));
    assert!(r.pick_leased(&[]).unwrap().1.is_none());
}

#[tokio::test(start_paused = true)]
async fn removed_host_drains_until_the_deadline() {
    let (tx, rx) = watch::channel(routing(&[("127.0.0.1:1", HostClass::Healthy)]));
    let c = ClusterHandle::new("c", rx, true, Duration::from_secs(1));
    let start = tokio::time::Instant::now();
    let closed = tokio::spawn({
        let c = c.clone();
        async move { c.host_closed(addr("127.0.0.1:1"), POLICY).await }
    });
    tokio::time::sleep(Duration::from_secs(3)).await;
    tx.send_replace(routing(&[("127.0.0.2:1", HostClass::Healthy)]));
    assert_eq!(closed.await.unwrap(), HostClose::Drained);
    assert_eq!(start.elapsed(), Duration::from_secs(13));
    // New picks go elsewhere at once.
    assert_eq!(c.pick(&[]), Some(addr("127.0.0.2:1")));
}

#[tokio::test(start_paused = true)]
async fn host_back_before_the_deadline_cancels_the_drain() {
    let (tx, rx) = watch::channel(routing(&[("127.0.0.1:1", HostClass::Healthy)]));
    let c = ClusterHandle::new("c", rx, true, Duration::from_secs(1));
    let closed = tokio::spawn({
        let c = c.clone();
        async move { c.host_closed(addr("127.0.0.1:1"), POLICY).await }
    });
    tx.send_replace(routing(&[]));
    tokio::time::sleep(Duration::from_secs(5)).await;
    tx.send_replace(routing(&[("127.0.0.1:1", HostClass::Healthy)]));
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert!(!closed.is_finished());
    closed.abort();
}

#[tokio::test(start_paused = true)]
async fn logical_dns_never_drains_and_health_failure_closes_when_configured() {
    let (tx, rx) = watch::channel(routing(&[("127.0.0.1:1", HostClass::Healthy)]));
    let logical = ClusterHandle::new("l", rx.clone(), false, Duration::from_secs(1));
    let never = tokio::spawn(async move { logical.host_closed(addr("127.0.0.1:1"), POLICY).await });
    let strict = ClusterHandle::new("s", rx, true, Duration::from_secs(1));
    let policy = DrainPolicy {
        close_on_health_failure: true,
        ..POLICY
    };
    let health = tokio::spawn(async move { strict.host_closed(addr("127.0.0.1:1"), policy).await });
    tokio::time::sleep(Duration::from_millis(1)).await;
    tx.send_replace(routing(&[
        ("127.0.0.1:1", HostClass::Unhealthy),
        ("127.0.0.2:1", HostClass::Healthy),
        ("127.0.0.3:1", HostClass::Healthy),
    ]));
    assert_eq!(health.await.unwrap(), HostClose::HealthFailure);
    tx.send_replace(routing(&[]));
    tokio::time::sleep(Duration::from_secs(3600)).await;
    assert!(!never.is_finished());
    never.abort();
}

/// A cluster's own `close_connections_on_host_health_failure` wins over the proxy's, both
/// ways; unset, the proxy's applies.
#[test]
fn the_clusters_close_on_health_failure_wins_over_the_proxys() {
    let (_tx, rx) = watch::channel(routing(&[]));
    let c = |own| {
        ClusterHandle::new("c", rx.clone(), true, Duration::from_secs(1))
            .with_close_on_health_failure(own)
    };
    let proxy = |close| DrainPolicy {
        close_on_health_failure: close,
        ..POLICY
    };
    let verdict = |own, close| c(own).verdict(HostState::Unhealthy, proxy(close));
    assert_eq!(verdict(None, false), HostVerdict::Keep);
    assert_eq!(verdict(None, true), HostVerdict::Close);
    assert_eq!(verdict(Some(true), false), HostVerdict::Close);
    assert_eq!(verdict(Some(false), true), HostVerdict::Keep);
    // A healthy host is kept whatever the setting.
    assert_eq!(
        c(Some(true)).verdict(HostState::Routable, proxy(true)),
        HostVerdict::Keep
    );
}

fn upstream(outlier_detection: &str) -> proxy_core::upstream::Upstream {
    let yaml = format!(
        "clusters:\n  - name: c\n{outlier_detection}    load_assignment:\n      endpoints:\n        - lb_endpoints:\n            - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: 1 }} }} }}\n            - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.2, port_value: 1 }} }} }}\n"
    );
    let config = proxy_core::config::Config::parse(&yaml, std::path::Path::new("t.yaml"))
        .expect("valid config");
    let manager = proxy_core::health::HealthCheckManager::default();
    proxy_core::upstream::Upstream::spawn(&config.clusters[0], &manager).expect("spawns")
}

#[tokio::test]
async fn connect_failures_eject_through_outlier_detection() {
    // Two hosts: ejecting one is 50 % of the cluster, which the cap must allow.
    let up = upstream(
        "    outlier_detection: { consecutive_5xx: 2, interval: 0.1s, max_ejection_percent: 50 }\n",
    );
    up.initialized().wait_for(|i| *i).await.unwrap();
    let c = ClusterHandle::from_upstream(&up, Duration::from_secs(60));
    let bad = addr("127.0.0.2:1");
    c.report_connect(bad, false);
    c.report_connect(bad, false);
    let mut routing = up.routing();
    tokio::time::timeout(
        Duration::from_secs(5),
        routing.wait_for(|r| r.routable().iter().all(|h| h.addr != bad.0)),
    )
    .await
    .expect("the failing host is ejected")
    .unwrap();
    for _ in 0..20 {
        assert_eq!(c.pick(&[]), Some(addr("127.0.0.1:1")));
    }
}

/// HTTP exchanges are judged by their status: two 5xx in a row eject even with a successful
/// connect between them (a connect of an HTTP exchange reports only its failure).
#[tokio::test]
async fn http_5xx_responses_eject_and_connect_successes_do_not_reset_the_run() {
    let up = upstream(
        "    outlier_detection: { consecutive_5xx: 2, interval: 0.1s, max_ejection_percent: 50 }\n",
    );
    up.initialized().wait_for(|i| *i).await.unwrap();
    let c = ClusterHandle::from_upstream(&up, Duration::from_secs(60));
    let bad = addr("127.0.0.2:1");
    c.report_response(bad, 500);
    c.report_http_connect(bad, true);
    c.report_response(bad, 502);
    // The connect is counted like any other, for the cluster and the host.
    let counted = up.traffic().host(bad.0);
    assert_eq!((counted.cx_total, counted.cx_connect_fail), (1, 0));
    let mut routing = up.routing();
    tokio::time::timeout(
        Duration::from_secs(5),
        routing.wait_for(|r| r.routable().iter().all(|h| h.addr != bad.0)),
    )
    .await
    .expect("the host answering 5xx is ejected")
    .unwrap();
    // A 2xx between two 5xx ends the run: the other host stays.
    let good = addr("127.0.0.1:1");
    c.report_response(good, 500);
    c.report_response(good, 200);
    c.report_response(good, 500);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        up.routing()
            .borrow()
            .routable()
            .iter()
            .any(|h| h.addr == good.0)
    );
}

#[tokio::test]
async fn without_outlier_detection_nothing_is_reported() {
    let up = upstream("");
    up.initialized().wait_for(|i| *i).await.unwrap();
    let c = ClusterHandle::from_upstream(&up, Duration::from_secs(60));
    assert!(
        c.passive.is_none(),
        "no channel: connect results change nothing"
    );
    // Reporting is then a no-op, and both hosts stay routable.
    c.report_connect(addr("127.0.0.2:1"), false);
    c.report_connect(addr("127.0.0.2:1"), false);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(up.routing().borrow().routable().len(), 2);
}

/// RING_HASH and MAGLEV through a handle: one hash, one host (for clones too); a retry passes
/// over the host it tried; the ring or table follows the hosts.
#[test]
fn hashed_picks_are_stable_skip_tried_hosts_and_follow_the_hosts() {
    let three = [
        ("127.0.0.1:1", HostClass::Healthy),
        ("127.0.0.2:1", HostClass::Healthy),
        ("127.0.0.3:1", HostClass::Healthy),
    ];
    for balancer in [
        Balancer::RingHash {
            min_ring_size: 1024,
            max_ring_size: 8_388_608,
        },
        Balancer::Maglev { table_size: 65_537 },
    ] {
        let (tx, rx) = watch::channel(routing(&three));
        let c = ClusterHandle::new("c", rx, true, Duration::from_secs(1)).with_balancer(balancer);
        let d = c.clone();
        let mut seen = std::collections::BTreeSet::new();
        for k in 0..300_u64 {
            let hash = Some(k.wrapping_mul(0x9e37_79b9_7f4a_7c15));
            let host = c.pick_hashed(&[], hash).unwrap();
            assert_eq!(d.pick_hashed(&[], hash), Some(host), "{balancer:?}");
            assert_ne!(c.pick_hashed(&[host], hash), Some(host), "{balancer:?}");
            seen.insert(host);
        }
        assert_eq!(seen.len(), 3, "{balancer:?}: every host takes hashes");
        tx.send_replace(routing(&[("127.0.0.9:1", HostClass::Healthy)]));
        assert_eq!(c.pick_hashed(&[], Some(7)), Some(addr("127.0.0.9:1")));
        // Without a hash, a random one: still a routable host.
        assert_eq!(c.pick(&[]), Some(addr("127.0.0.9:1")));
    }
}

/// LEAST_REQUEST's `choice_count`: with ten draws, a loaded host is chosen only when all ten
/// land on it (1 in 1024).
#[test]
fn least_request_draws_choice_count_hosts() {
    let (_tx, rx) = watch::channel(routing(&[
        ("127.0.0.1:1", HostClass::Healthy),
        ("127.0.0.2:1", HostClass::Healthy),
    ]));
    let c = ClusterHandle::new("c", rx, true, Duration::from_secs(1))
        .with_balancer(Balancer::LeastRequest { choice_count: 10 });
    let mut held = Vec::new();
    while held.len() < 10 {
        let (host, lease) = c.pick_leased(&[]).unwrap();
        if host == addr("127.0.0.1:1") {
            held.push(lease.expect("LEAST_REQUEST leases"));
        }
    }
    let on_loaded = (0..2000)
        .filter(|_| c.pick(&[]).unwrap() == addr("127.0.0.1:1"))
        .count();
    // Expect about 2; 20 is more than 12 sigma of a Poisson(2) away.
    assert!(on_loaded < 20, "{on_loaded}");
}

/// A TCP service hashing the source IP: every connection from one address lands on one host,
/// the host its address's XXH64 picks.
#[test]
fn source_ip_hash_keys_tcp_connections_on_the_client_address() {
    let (_tx, rx) = watch::channel(routing(&[
        ("127.0.0.1:1", HostClass::Healthy),
        ("127.0.0.2:1", HostClass::Healthy),
        ("127.0.0.3:1", HostClass::Healthy),
    ]));
    let c = ClusterHandle::new("c", rx, true, Duration::from_secs(1))
        .with_balancer(Balancer::Maglev { table_size: 65_537 })
        .with_source_ip_hash(true);
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let want = c.pick_hashed(&[], Some(lb::xxhash::xxhash64(b"127.0.0.5", 0)));
    for _ in 0..5 {
        let client =
            socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        client
            .bind(&SocketAddr::from(([127, 0, 0, 5], 0)).into())
            .unwrap();
        client
            .connect(&listener.local_addr().unwrap().into())
            .unwrap();
        let (accepted, _) = listener.accept().unwrap();
        assert_eq!(c.pick_leased_for(&[], &accepted).unwrap().0, want.unwrap());
    }
}
