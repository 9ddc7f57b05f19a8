//! LOGICAL_DNS: first address only, empty answers keep the host, nothing is drained.

use std::sync::Arc;

use super::{addrs, advance, gaps, next_update, secs, v4_settings};
use crate::{
    config::sources::dns::{DnsConfigError, DnsEndpoint, DnsSettings},
    discovery::dns::{DnsCluster, FakeResolver, spawn_logical_dns},
};

fn logical(fake: &FakeResolver, settings: DnsSettings) -> DnsCluster {
    let endpoint = DnsEndpoint {
        priority: 3,
        ..DnsEndpoint::new("web.test", 443)
    };
    spawn_logical_dns("web", settings, vec![endpoint], Arc::new(fake.clone())).expect("valid")
}

#[tokio::test(start_paused = true)]
async fn only_the_first_address_is_the_host_and_priority_is_zero() {
    let fake = FakeResolver::new();
    fake.set("web.test", &[("10.0.0.1", 30), ("10.0.0.2", 30)]);
    let cluster = logical(&fake, v4_settings());
    let update = next_update(&mut cluster.updates()).await;
    assert_eq!(addrs(&update.hosts), ["10.0.0.1:443"]);
    assert_eq!(update.hosts[0].priority, 0);
    assert!(!cluster.drain_on_change());
}

#[tokio::test(start_paused = true)]
async fn a_new_first_address_replaces_the_host_without_draining() {
    let fake = FakeResolver::new();
    fake.set("web.test", &[("10.0.0.1", 30), ("10.0.0.2", 30)]);
    let cluster = logical(&fake, v4_settings());
    let mut updates = cluster.updates();
    next_update(&mut updates).await;
    fake.set("web.test", &[("10.0.0.2", 30), ("10.0.0.1", 30)]);
    let update = next_update(&mut updates).await;
    assert_eq!(addrs(&update.hosts), ["10.0.0.2:443"]);
    assert_eq!(addrs(&update.removed), ["10.0.0.1:443"]);
    assert!(!cluster.drain_on_change(), "removed, but not drained");
}

#[tokio::test(start_paused = true)]
async fn empty_answer_keeps_the_host_and_counts_a_failure() {
    let fake = FakeResolver::new();
    fake.set("web.test", &[("10.0.0.1", 30)]);
    let cluster = logical(&fake, v4_settings());
    let mut updates = cluster.updates();
    let first = next_update(&mut updates).await;
    fake.set("web.test", &[]);
    advance(secs(11)).await;
    assert!(!updates.has_changed().unwrap());
    assert_eq!(cluster.current(), first);
    let stats = cluster.stats().values();
    assert_eq!(
        (
            stats.source.update_success,
            stats.source.update_failure,
            stats.source.membership_total
        ),
        (1, 2, 1)
    );
}

#[tokio::test(start_paused = true)]
async fn same_answer_is_no_rebuild_but_a_changed_tail_republishes() {
    let fake = FakeResolver::new();
    fake.set("web.test", &[("10.0.0.1", 30), ("10.0.0.2", 30)]);
    let cluster = logical(&fake, v4_settings());
    let mut updates = cluster.updates();
    next_update(&mut updates).await;
    advance(secs(6)).await;
    assert_eq!(cluster.stats().values().source.update_no_rebuild, 1);
    fake.set("web.test", &[("10.0.0.1", 30), ("10.0.0.3", 30)]);
    let update = next_update(&mut updates).await;
    assert_eq!(addrs(&update.hosts), ["10.0.0.1:443"]);
    assert!(update.added.is_empty() && update.removed.is_empty());
    assert_eq!(cluster.stats().values().source.update_no_rebuild, 1);
}

#[tokio::test(start_paused = true)]
async fn respect_dns_ttl_uses_the_first_records_ttl() {
    let fake = FakeResolver::new();
    fake.set("web.test", &[("10.0.0.1", 30), ("10.0.0.2", 10)]);
    let cluster = logical(
        &fake,
        DnsSettings {
            respect_dns_ttl: true,
            ..v4_settings()
        },
    );
    advance(secs(100)).await;
    drop(cluster);
    assert_eq!(gaps(&fake, "web.test")[..3], [secs(30); 3]);
}

#[tokio::test(start_paused = true)]
async fn first_ttl_zero_falls_back_to_the_refresh_rate() {
    let fake = FakeResolver::new();
    fake.set("web.test", &[("10.0.0.1", 0), ("10.0.0.2", 10)]);
    let cluster = logical(
        &fake,
        DnsSettings {
            respect_dns_ttl: true,
            ..v4_settings()
        },
    );
    advance(secs(12)).await;
    drop(cluster);
    assert_eq!(gaps(&fake, "web.test"), [secs(5), secs(5)]);
}

#[test]
fn logical_needs_exactly_one_endpoint() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let _guard = runtime.enter();
    let fake = Arc::new(FakeResolver::new());
    let two = vec![
        DnsEndpoint::new("a.test", 80),
        DnsEndpoint::new("b.test", 80),
    ];
    let err = spawn_logical_dns("web", DnsSettings::default(), two, fake.clone())
        .err()
        .unwrap();
    assert_eq!(err, DnsConfigError::LogicalNotSingleHost { count: 2 });
    assert_eq!(
        err.to_string(),
        "LOGICAL_DNS clusters must have a single locality_lb_endpoint and a single lb_endpoint"
    );
    assert!(spawn_logical_dns("web", DnsSettings::default(), vec![], fake).is_err());
}
