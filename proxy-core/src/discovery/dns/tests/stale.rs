//! `dns_stale_bound`: a failing name's hosts are kept for at most the bound after its first
//! failure, per name, then dropped as an empty answer drops them; unset keeps them (Envoy).

use std::{sync::Arc, time::Duration};

use tokio::time::Instant;

use super::{addrs, advance, next_update, secs, strict, through_health, v4_settings};
use crate::{
    config::sources::dns::{DnsEndpoint, DnsSettings},
    discovery::dns::{
        FakeResolver, SrvRecord, SrvService, StatValues, spawn_dns_srv, spawn_logical_dns,
    },
    health::{
        state::{CheckOutcome, FailureKind},
        tests::support::Script,
    },
    upstream::Upstream,
};

fn bounded(bound: Duration) -> DnsSettings {
    DnsSettings {
        dns_stale_bound: Some(bound),
        ..v4_settings()
    }
}

/// `(dns_stale_names, dns_stale_served_ms, dns_stale_expired, membership_total)`.
fn stale(values: StatValues) -> (u64, u64, u64, u64) {
    (
        values.dns_stale_names,
        values.dns_stale_served_ms,
        values.dns_stale_expired,
        values.source.membership_total,
    )
}

#[tokio::test(start_paused = true)]
async fn strict_hosts_are_dropped_at_the_bound_and_back_after_a_success() {
    let fake = FakeResolver::new();
    fake.set("web.test", &[("10.0.0.1", 30), ("10.0.0.2", 30)]);
    let cluster = strict(&fake, bounded(secs(2)), &["web.test"]);
    let mut updates = cluster.updates();
    next_update(&mut updates).await;
    let start = Instant::now();
    fake.fail_all("web.test");
    // The lookup at 5 s fails: stale from then on; the bound passes at 7 s, between lookups.
    let update = next_update(&mut updates).await;
    assert_eq!(start.elapsed(), secs(7));
    assert!(update.hosts.is_empty());
    assert_eq!(addrs(&update.removed), ["10.0.0.1:80", "10.0.0.2:80"]);
    assert!(
        cluster.drain_on_change(),
        "dropped as an empty answer: drained"
    );
    assert_eq!(stale(cluster.stats().values()), (0, 2000, 1, 0));
    advance(secs(20)).await;
    assert!(
        !updates.has_changed().unwrap(),
        "later failures drop nothing more"
    );
    assert_eq!(stale(cluster.stats().values()), (0, 2000, 1, 0));
    fake.set("web.test", &[("10.0.0.1", 30)]);
    let update = next_update(&mut updates).await;
    assert_eq!(start.elapsed(), secs(30));
    assert_eq!(addrs(&update.hosts), ["10.0.0.1:80"]);
    assert_eq!(addrs(&update.added), ["10.0.0.1:80"]);
}

#[tokio::test(start_paused = true)]
async fn a_success_before_the_bound_keeps_the_hosts_and_restarts_the_clock() {
    let fake = FakeResolver::new();
    fake.set("web.test", &[("10.0.0.1", 30)]);
    let cluster = strict(&fake, bounded(secs(12)), &["web.test"]);
    let mut updates = cluster.updates();
    let first = next_update(&mut updates).await;
    let start = Instant::now();
    fake.fail_all("web.test");
    advance(secs(11)).await;
    assert_eq!(stale(cluster.stats().values()), (1, 6000, 0, 1));
    fake.set("web.test", &[("10.0.0.1", 30)]);
    advance(secs(5)).await;
    assert!(
        !updates.has_changed().unwrap(),
        "the success at 15 s came before 17 s"
    );
    assert_eq!(cluster.current(), first);
    assert_eq!(stale(cluster.stats().values()), (0, 10_000, 0, 1));
    // Failing again from 20 s: a new period, dropped 12 s after its own first failure.
    fake.fail_all("web.test");
    let update = next_update(&mut updates).await;
    assert_eq!(start.elapsed(), secs(32));
    assert!(update.hosts.is_empty());
    assert_eq!(stale(cluster.stats().values()), (0, 22_000, 1, 0));
}

#[tokio::test(start_paused = true)]
async fn each_name_goes_stale_on_its_own() {
    let fake = FakeResolver::new();
    fake.set("a.test", &[("10.0.0.1", 30)]);
    fake.set("b.test", &[("10.0.0.2", 30)]);
    let cluster = strict(&fake, bounded(secs(2)), &["a.test", "b.test"]);
    let mut updates = cluster.updates();
    advance(secs(1)).await;
    assert_eq!(updates.borrow_and_update().hosts.len(), 2);
    let start = Instant::now();
    fake.fail_all("b.test");
    let update = next_update(&mut updates).await;
    assert_eq!(start.elapsed(), secs(6), "b failed at 5 s, dropped at 7 s");
    assert_eq!(addrs(&update.hosts), ["10.0.0.1:80"]);
    assert_eq!(addrs(&update.removed), ["10.0.0.2:80"]);
    fake.fail_all("a.test");
    let update = next_update(&mut updates).await;
    assert_eq!(
        start.elapsed(),
        secs(11),
        "a failed at 10 s, dropped at 12 s"
    );
    assert!(update.hosts.is_empty());
    assert_eq!(stale(cluster.stats().values()), (0, 4000, 2, 0));
}

#[tokio::test(start_paused = true)]
async fn logical_empty_answers_count_toward_the_bound_and_nothing_is_drained() {
    let fake = FakeResolver::new();
    fake.set("web.test", &[("10.0.0.1", 30)]);
    let endpoints = vec![DnsEndpoint::new("web.test", 443)];
    let cluster =
        spawn_logical_dns("web", bounded(secs(2)), endpoints, Arc::new(fake.clone())).unwrap();
    let mut updates = cluster.updates();
    next_update(&mut updates).await;
    let start = Instant::now();
    fake.set("web.test", &[]);
    let update = next_update(&mut updates).await;
    assert_eq!(start.elapsed(), secs(7));
    assert!(update.hosts.is_empty());
    assert_eq!(addrs(&update.removed), ["10.0.0.1:443"]);
    assert!(!cluster.drain_on_change(), "LOGICAL_DNS never drains");
    assert_eq!(stale(cluster.stats().values()), (0, 2000, 1, 0));
    fake.set("web.test", &[("10.0.0.2", 30), ("10.0.0.1", 30)]);
    let update = next_update(&mut updates).await;
    assert_eq!(start.elapsed(), secs(10));
    assert_eq!(addrs(&update.hosts), ["10.0.0.2:443"]);
}

#[tokio::test(start_paused = true)]
async fn the_bound_holds_while_a_slow_lookup_is_in_flight() {
    let fake = FakeResolver::new();
    fake.set("web.test", &[("10.0.0.1", 30)]);
    let cluster = strict(&fake, bounded(secs(7)), &["web.test"]);
    let mut updates = cluster.updates();
    next_update(&mut updates).await;
    let start = Instant::now();
    fake.fail_all("web.test");
    fake.set_latency(secs(10));
    // Lookups 5-15 s (fails: stale from 15 s) and 20-30 s: the bound passes at 22 s inside it.
    let update = next_update(&mut updates).await;
    assert_eq!(start.elapsed(), secs(22));
    assert!(update.hosts.is_empty());
    assert_eq!(stale(cluster.stats().values()), (0, 7000, 1, 0));
}

#[tokio::test(start_paused = true)]
async fn by_default_a_failing_name_keeps_its_hosts_and_counts_the_time_stale() {
    let fake = FakeResolver::new();
    fake.set("web.test", &[("10.0.0.1", 30)]);
    let cluster = strict(&fake, v4_settings(), &["web.test"]);
    let mut updates = cluster.updates();
    let first = next_update(&mut updates).await;
    fake.fail_all("web.test");
    advance(secs(3600)).await;
    assert!(!updates.has_changed().unwrap());
    assert_eq!(cluster.current(), first);
    assert_eq!(stale(cluster.stats().values()), (1, 3_595_000, 0, 1));
}

#[tokio::test(start_paused = true)]
async fn a_name_that_never_resolved_is_not_stale() {
    let fake = FakeResolver::new();
    fake.fail_all("web.test");
    let cluster = strict(&fake, bounded(secs(2)), &["web.test"]);
    advance(secs(30)).await;
    assert!(cluster.current().initialized && cluster.current().hosts.is_empty());
    assert_eq!(stale(cluster.stats().values()), (0, 0, 0, 0));
}

#[tokio::test(start_paused = true)]
async fn an_srv_name_whose_target_fails_goes_stale_as_a_whole() {
    let fake = FakeResolver::new();
    let record = SrvRecord {
        priority: 0,
        weight: 1,
        port: 8001,
        target: "a.test.".into(),
        ttl: secs(60),
    };
    fake.set_srv("_web._tcp.test", vec![record]);
    fake.set("a.test", &[("10.0.0.1", 60)]);
    let service = vec![SrvService::new("_web._tcp.test")];
    let cluster = spawn_dns_srv("web", bounded(secs(2)), service, Arc::new(fake.clone())).unwrap();
    let mut updates = cluster.updates();
    next_update(&mut updates).await;
    let start = Instant::now();
    fake.fail_all("a.test");
    let update = next_update(&mut updates).await;
    assert_eq!(start.elapsed(), secs(7));
    assert_eq!(addrs(&update.removed), ["10.0.0.1:8001"]);
    assert_eq!(stale(cluster.stats().values()), (0, 2000, 1, 0));
}

/// A STRICT_DNS cluster of `web.test` -> 127.0.0.1 with a bound of 2 s and a TCP check every
/// 1 s, through the health matrix; `extra` is added to the cluster.
fn checked(fake: &FakeResolver, script: &Arc<Script>, extra: &str) -> Upstream {
    let source = Box::new(strict(fake, bounded(secs(2)), &["web.test"]));
    let yaml = format!(
        "clusters:\n  - name: web\n{extra}    health_checks: [{{timeout: 1s, interval: 1s, \
         unhealthy_threshold: 1, healthy_threshold: 1, tcp_health_check: {{}}}}]\n"
    );
    through_health(source, script, &yaml)
}

/// Waits (paused time) until `routable` hosts of `up` are `want`; returns when.
async fn routable(up: &Upstream, want: usize) -> Instant {
    let mut routing = up.routing();
    let reached = routing.wait_for(|r| r.routable().len() == want);
    tokio::time::timeout(secs(60), reached)
        .await
        .expect("reached within a minute of paused time")
        .expect("the cluster runs");
    Instant::now()
}

#[tokio::test(start_paused = true)]
async fn dropped_stale_hosts_follow_the_health_matrix_absent_rules() {
    let fake = FakeResolver::new();
    fake.set("web.test", &[("127.0.0.1", 30)]);
    let script = Arc::new(Script::default());
    let up = checked(&fake, &script, "");
    routable(&up, 1).await;
    let start = Instant::now();
    fake.fail_all("web.test");
    advance(secs(8)).await;
    let stats: std::collections::BTreeMap<String, u64> = up.stats().into_iter().collect();
    assert_eq!(stats["cluster.web.dns_stale_expired"], 1, "dropped at 7 s");
    assert_eq!(
        up.routing().borrow().routable().len(),
        1,
        "absent but passing its checks: still routed"
    );
    script.set(
        "127.0.0.1:80".parse().unwrap(),
        CheckOutcome::Failed(FailureKind::Immediate),
    );
    let gone = routable(&up, 0).await;
    assert!(gone - start > secs(8), "gone at its first failed check");

    let fake = FakeResolver::new();
    fake.set("web.test", &[("127.0.0.1", 30)]);
    let script = Arc::new(Script::default());
    let up = checked(&fake, &script, "    ignore_health_on_host_removal: true\n");
    routable(&up, 1).await;
    let start = Instant::now();
    fake.fail_all("web.test");
    let gone = routable(&up, 0).await;
    assert_eq!(
        gone - start,
        secs(7),
        "deleted when dropped, checks ignored"
    );
}
