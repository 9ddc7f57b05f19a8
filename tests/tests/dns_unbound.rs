//! DNS discovery against a real unbound: live record changes, TTL-driven refresh, LOGICAL_DNS
//! first address, SRV priorities and weights, empty and failed answers.

use std::{net::SocketAddr, sync::Arc, time::Duration};

use integration_tests::unbound::Unbound;
use proxy_core::{
    config::sources::dns::{DnsEndpoint, DnsLookupFamily, DnsResolverAddress, DnsSettings},
    discovery::{
        SourceUpdate as Update,
        dns::{
            DnsCluster, HickoryResolver, SrvService, spawn_dns_srv, spawn_logical_dns,
            spawn_strict_dns,
        },
    },
};
use tokio::sync::watch;

/// Upper bound of every wait for a host-set change.
const WAIT: Duration = Duration::from_secs(10);

fn settings(server: &Unbound, refresh: Duration) -> DnsSettings {
    DnsSettings {
        dns_refresh_rate: refresh,
        dns_lookup_family: DnsLookupFamily::V4Only,
        dns_resolvers: vec![DnsResolverAddress(server.addr())],
        ..DnsSettings::default()
    }
}

fn resolver(settings: &DnsSettings) -> Arc<HickoryResolver> {
    Arc::new(HickoryResolver::new(settings).expect("resolver for 127.0.0.1"))
}

fn strict(server: &Unbound, name: &str, settings: DnsSettings) -> DnsCluster {
    let resolver = resolver(&settings);
    spawn_strict_dns(
        "web",
        settings,
        vec![DnsEndpoint::new(name, 8080)],
        resolver,
    )
    .unwrap_or_else(|e| panic!("strict cluster on {}: {e}", server.addr()))
}

fn addrs(update: &Update) -> Vec<String> {
    let mut addrs: Vec<String> = update.hosts.iter().map(|h| h.addr.to_string()).collect();
    addrs.sort();
    addrs
}

/// Waits (at most [`WAIT`]) until the published hosts are exactly `expected` (any order).
async fn wait_hosts(updates: &mut watch::Receiver<Update>, expected: &[&str]) -> Update {
    let wanted = |update: &Update| update.initialized && addrs(update) == expected;
    let found = match tokio::time::timeout(WAIT, updates.wait_for(wanted)).await {
        Ok(Ok(update)) => Some(update.clone()),
        _ => None,
    };
    found.unwrap_or_else(|| {
        panic!(
            "hosts never became {expected:?}; last: {:?}",
            addrs(&updates.borrow())
        )
    })
}

#[tokio::test]
async fn strict_dns_follows_records_added_and_removed_live() {
    let server = Unbound::start(&["web.svc.test. 5 IN A 127.0.0.2"]);
    let cluster = strict(
        &server,
        "web.svc.test",
        settings(&server, Duration::from_millis(200)),
    );
    let mut updates = cluster.updates();
    wait_hosts(&mut updates, &["127.0.0.2:8080"]).await;

    server.add("web.svc.test. 5 IN A 127.0.0.3");
    let update = wait_hosts(&mut updates, &["127.0.0.2:8080", "127.0.0.3:8080"]).await;
    assert!(
        update
            .added
            .iter()
            .any(|h| h.addr.to_string() == "127.0.0.3:8080")
    );

    server.replace("web.svc.test.", &["web.svc.test. 5 IN A 127.0.0.3"]);
    wait_hosts(&mut updates, &["127.0.0.3:8080"]).await;

    server.remove("web.svc.test.");
    let update = wait_hosts(&mut updates, &[]).await;
    assert!(!update.removed.is_empty() && cluster.drain_on_change());
    tokio::time::sleep(Duration::from_millis(500)).await; // unchanged NXDOMAIN answers
    let stats = cluster.stats().values();
    assert!(
        stats.source.update_success >= 4 && stats.source.update_no_rebuild >= 1,
        "{stats:?}"
    );
}

#[tokio::test]
async fn respect_dns_ttl_follows_ttl_changes() {
    let server = Unbound::start(&["ttl.svc.test. 1 IN A 127.0.0.2"]);
    let settings = DnsSettings {
        respect_dns_ttl: true,
        ..settings(&server, Duration::from_secs(60))
    };
    let cluster = strict(&server, "ttl.svc.test", settings);
    cluster.initialized().await;
    let attempts = || cluster.stats().values().source.update_attempt;

    // TTL 1 s: about one resolution per second, although dns_refresh_rate is 60 s.
    let before = attempts();
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let fast = attempts() - before;
    assert!(
        (2..=5).contains(&fast),
        "{fast} resolutions in 3.5 s with TTL 1 s"
    );

    // TTL 30 s: once the new TTL has been read (within a second), resolutions stop. The swap
    // (remove, then add) happens right after a resolution, so none can see the name missing.
    let seen = attempts();
    let next_resolution = async {
        while attempts() == seen {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::time::timeout(WAIT, next_resolution)
        .await
        .expect("TTL 1 s keeps resolving");
    server.replace("ttl.svc.test.", &["ttl.svc.test. 30 IN A 127.0.0.2"]);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let before = attempts();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        attempts() - before,
        0,
        "TTL 30 s must stop the 1 s refreshes"
    );
}

#[tokio::test]
async fn logical_dns_uses_only_the_first_address() {
    let server = Unbound::start(&[
        "one.svc.test. 5 IN A 127.0.0.2",
        "one.svc.test. 5 IN A 127.0.0.3",
        "one.svc.test. 5 IN A 127.0.0.4",
    ]);
    let settings = settings(&server, Duration::from_millis(200));
    let resolver = resolver(&settings);
    let endpoint = DnsEndpoint::new("one.svc.test", 9000);
    let cluster = spawn_logical_dns("one", settings, vec![endpoint], resolver).expect("valid");
    let mut updates = cluster.updates();
    wait_hosts(&mut updates, &["127.0.0.2:9000"]).await;
    assert!(!cluster.drain_on_change());

    // An empty answer keeps the host and counts as a failure.
    server.remove("one.svc.test.");
    let failures = cluster.stats().values().source.update_failure;
    tokio::time::timeout(WAIT, async {
        while cluster.stats().values().source.update_failure == failures {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("an empty answer counts as a LOGICAL_DNS failure");
    assert_eq!(addrs(&cluster.current()), ["127.0.0.2:9000"]);
}

#[tokio::test]
async fn srv_records_map_priority_weight_and_port() {
    let server = Unbound::start(&[
        "_http._tcp.web.svc.test. 30 IN SRV 10 5 8001 a.svc.test.",
        "_http._tcp.web.svc.test. 30 IN SRV 20 0 8002 b.svc.test.",
        "a.svc.test. 30 IN A 127.0.0.2",
        "b.svc.test. 30 IN A 127.0.0.3",
    ]);
    let settings = settings(&server, Duration::from_millis(200));
    let resolver = resolver(&settings);
    let service = SrvService::new("_http._tcp.web.svc.test");
    let cluster = spawn_dns_srv("srv", settings, vec![service], resolver).expect("valid");
    let mut updates = cluster.updates();
    let update = wait_hosts(&mut updates, &["127.0.0.2:8001", "127.0.0.3:8002"]).await;
    let host = |addr: &str| {
        let addr: SocketAddr = addr.parse().unwrap();
        update
            .hosts
            .iter()
            .find(|h| h.addr == addr)
            .cloned()
            .unwrap()
    };
    assert_eq!(
        (
            host("127.0.0.2:8001").priority,
            host("127.0.0.2:8001").weight
        ),
        (0, 5)
    );
    assert_eq!(
        (
            host("127.0.0.3:8002").priority,
            host("127.0.0.3:8002").weight
        ),
        (1, 1)
    );

    server.add("_http._tcp.web.svc.test. 30 IN SRV 5 7 8003 b.svc.test.");
    let update = wait_hosts(
        &mut updates,
        &["127.0.0.2:8001", "127.0.0.3:8002", "127.0.0.3:8003"],
    )
    .await;
    let priority_of = |port: u16| {
        update
            .hosts
            .iter()
            .find(|h| h.addr.port() == port)
            .unwrap()
            .priority
    };
    assert_eq!(
        (priority_of(8003), priority_of(8001), priority_of(8002)),
        (0, 1, 2)
    );
}

#[tokio::test]
async fn nxdomain_is_zero_hosts_and_no_server_is_a_failure() {
    let server = Unbound::start(&["web.svc.test. 5 IN A 127.0.0.2"]);
    let cluster = strict(
        &server,
        "missing.svc.test",
        settings(&server, Duration::from_millis(200)),
    );
    cluster.initialized().await;
    let stats = cluster.stats().values();
    assert!(cluster.current().hosts.is_empty());
    assert_eq!(
        (stats.source.update_success, stats.source.update_failure),
        (1, 0)
    );

    // A closed port on 127.0.0.1: ICMP port unreachable fails the resolution at once (as c-ares
    // reports it, not after the try timeouts) and the cluster still initializes.
    let dead = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let dead_addr = dead.local_addr().unwrap();
    drop(dead);
    let settings = DnsSettings {
        dns_resolvers: vec![DnsResolverAddress(dead_addr)],
        ..settings(&server, Duration::from_millis(200))
    };
    let resolver = resolver(&settings);
    let endpoint = DnsEndpoint::new("web.svc.test", 80);
    let started = std::time::Instant::now();
    let cluster = spawn_strict_dns("dead", settings, vec![endpoint], resolver).unwrap();
    tokio::time::timeout(Duration::from_secs(1), cluster.initialized())
        .await
        .expect("a refused resolution fails at once and still initializes the cluster");
    assert!(
        started.elapsed() < Duration::from_millis(500),
        "{:?}",
        started.elapsed()
    );
    assert!(cluster.stats().values().source.update_failure >= 1);
    assert!(cluster.current().hosts.is_empty());
}

/// A name with more records than a UDP answer holds: unbound answers with the truncation bit,
/// and the resolver asks again over TCP (as c-ares does) instead of never resolving.
#[tokio::test]
async fn a_truncated_answer_is_asked_again_over_tcp() {
    let records: Vec<String> = (0..1000u32)
        .map(|i| format!("big.svc.test. 30 IN A 127.1.{}.{}", i / 250, i % 250 + 1))
        .collect();
    let refs: Vec<&str> = records.iter().map(String::as_str).collect();
    let server = Unbound::start(&refs);
    let cluster = strict(
        &server,
        "big.svc.test",
        settings(&server, Duration::from_millis(200)),
    );
    let mut updates = cluster.updates();
    let all = |update: &Update| update.initialized && update.hosts.len() == 1000;
    let resolved = tokio::time::timeout(WAIT, updates.wait_for(all))
        .await
        .is_ok_and(|r| r.is_ok());
    assert!(
        resolved,
        "not all 1000 records arrived; last: {} hosts",
        updates.borrow().hosts.len()
    );
}
