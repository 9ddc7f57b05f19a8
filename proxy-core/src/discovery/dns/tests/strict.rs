//! STRICT_DNS: hosts, diffs, stats, refresh timing, backoff, and one address from two names
//! through health and load assignment.

use std::{collections::BTreeMap, net::SocketAddr, sync::Arc, time::Duration};

use tokio::time::Instant;

use super::{addrs, advance, gaps, next_update, secs, strict, through_health, v4_settings};
use crate::{
    config::sources::dns::{DnsEndpoint, DnsSettings, RefreshRate},
    discovery::dns::{FakeResolver, QueryType, StatValues, spawn_strict_dns},
    health::tests::support::Script,
    host::EdsHealth,
    lb,
};

#[tokio::test(start_paused = true)]
async fn every_distinct_address_is_a_host_carrying_endpoint_attributes() {
    let fake = FakeResolver::new();
    fake.set(
        "web.test",
        &[("10.0.0.1", 30), ("10.0.0.2", 30), ("10.0.0.1", 30)],
    );
    let endpoint = DnsEndpoint {
        hostname: Some("web".into()),
        weight: 7,
        priority: 2,
        metadata: BTreeMap::from([("zone".into(), "a".into())]),
        health: EdsHealth::Degraded,
        locality: crate::host::Locality {
            zone: "z1".into(),
            ..Default::default()
        },
        locality_weight: Some(3),
        ..DnsEndpoint::new("web.test", 8080)
    };
    let cluster =
        spawn_strict_dns("web", v4_settings(), vec![endpoint], Arc::new(fake.clone())).unwrap();
    let update = next_update(&mut cluster.updates()).await;
    assert!(update.initialized);
    assert_eq!(addrs(&update.hosts), ["10.0.0.1:8080", "10.0.0.2:8080"]);
    assert_eq!(addrs(&update.added), ["10.0.0.1:8080", "10.0.0.2:8080"]);
    assert!(update.removed.is_empty() && cluster.drain_on_change());
    for host in &update.hosts {
        assert_eq!(
            (host.weight, host.priority, host.eds_health),
            (7, 2, EdsHealth::Degraded)
        );
        assert_eq!(host.metadata()["zone"], "a");
        assert_eq!(host.hostname(), Some("web"));
        assert_eq!(
            (host.locality().zone.as_str(), host.locality_weight),
            ("z1", Some(3))
        );
    }
    let stats = cluster.stats().values();
    assert_eq!(
        (
            stats.source.update_attempt,
            stats.source.update_success,
            stats.source.membership_total
        ),
        (1, 1, 2)
    );
}

#[tokio::test(start_paused = true)]
async fn weight_zero_becomes_one_and_hostname_defaults_to_the_address() {
    let fake = FakeResolver::new();
    fake.set("web.test", &[("10.0.0.1", 30)]);
    let endpoint = DnsEndpoint {
        weight: 0,
        ..DnsEndpoint::new("web.test", 80)
    };
    let cluster =
        spawn_strict_dns("web", v4_settings(), vec![endpoint], Arc::new(fake.clone())).unwrap();
    let host = next_update(&mut cluster.updates()).await.hosts[0].clone();
    assert_eq!((host.weight, host.hostname()), (1, Some("web.test")));
}

#[tokio::test(start_paused = true)]
async fn successful_empty_answer_means_zero_hosts_and_drains_them() {
    let fake = FakeResolver::new();
    fake.set("web.test", &[("10.0.0.1", 30), ("10.0.0.2", 30)]);
    let cluster = strict(&fake, v4_settings(), &["web.test"]);
    let mut updates = cluster.updates();
    next_update(&mut updates).await;
    fake.set("web.test", &[]);
    let update = next_update(&mut updates).await;
    assert!(update.hosts.is_empty());
    assert_eq!(addrs(&update.removed), ["10.0.0.1:80", "10.0.0.2:80"]);
    assert!(cluster.drain_on_change());
    let stats = cluster.stats().values();
    assert_eq!(
        (
            stats.source.update_success,
            stats.source.update_failure,
            stats.source.update_empty
        ),
        (2, 0, 0)
    );
    assert_eq!(stats.source.membership_total, 0);
}

#[tokio::test(start_paused = true)]
async fn failure_keeps_hosts_and_publishes_nothing() {
    let fake = FakeResolver::new();
    fake.set("web.test", &[("10.0.0.1", 30)]);
    let cluster = strict(&fake, v4_settings(), &["web.test"]);
    let mut updates = cluster.updates();
    let first = next_update(&mut updates).await;
    fake.fail_all("web.test");
    advance(secs(21)).await; // refreshes at 5, 10, 15, 20 s all fail
    assert!(
        !updates.has_changed().unwrap(),
        "a failure must not publish"
    );
    assert_eq!(cluster.current(), first);
    let stats = cluster.stats().values();
    assert_eq!(
        (stats.source.update_attempt, stats.source.update_failure),
        (5, 4)
    );
    assert_eq!(stats.source.membership_total, 1);
}

#[tokio::test(start_paused = true)]
async fn unchanged_answer_counts_no_rebuild_even_reordered() {
    let fake = FakeResolver::new();
    fake.set("web.test", &[("10.0.0.1", 30), ("10.0.0.2", 30)]);
    let cluster = strict(&fake, v4_settings(), &["web.test"]);
    let mut updates = cluster.updates();
    next_update(&mut updates).await;
    fake.set("web.test", &[("10.0.0.2", 30), ("10.0.0.1", 30)]);
    advance(secs(11)).await;
    assert!(!updates.has_changed().unwrap());
    let stats = cluster.stats().values();
    assert_eq!(
        (
            stats.source.update_success,
            stats.source.update_no_rebuild,
            stats.source.membership_change
        ),
        (3, 2, 1)
    );
}

#[tokio::test(start_paused = true)]
async fn added_and_removed_are_relative_to_the_previous_version() {
    let fake = FakeResolver::new();
    fake.set("web.test", &[("10.0.0.1", 30), ("10.0.0.2", 30)]);
    let cluster = strict(&fake, v4_settings(), &["web.test"]);
    let mut updates = cluster.updates();
    assert_eq!(next_update(&mut updates).await.version, 1);
    fake.set("web.test", &[("10.0.0.2", 30), ("10.0.0.3", 30)]);
    let update = next_update(&mut updates).await;
    assert_eq!(update.version, 2);
    assert_eq!(addrs(&update.added), ["10.0.0.3:80"]);
    assert_eq!(addrs(&update.removed), ["10.0.0.1:80"]);
    assert_eq!(addrs(&update.hosts), ["10.0.0.2:80", "10.0.0.3:80"]);
}

#[tokio::test(start_paused = true)]
async fn names_are_separate_targets_and_same_ip_gives_two_hosts() {
    let fake = FakeResolver::new();
    fake.set("a.test", &[("10.0.0.1", 30)]);
    fake.set("b.test", &[("10.0.0.1", 30), ("10.0.0.2", 30)]);
    let cluster = strict(&fake, v4_settings(), &["a.test", "b.test"]);
    let mut updates = cluster.updates();
    let mut update = next_update(&mut updates).await;
    while update.hosts.len() < 3 {
        update = next_update(&mut updates).await;
    }
    assert_eq!(
        addrs(&update.hosts),
        ["10.0.0.1:80", "10.0.0.1:80", "10.0.0.2:80"]
    );
    // a.test drops the shared address: b.test still has it, so nothing is removed.
    fake.set("a.test", &[]);
    let update = next_update(&mut updates).await;
    assert_eq!(addrs(&update.hosts), ["10.0.0.1:80", "10.0.0.2:80"]);
    assert!(update.removed.is_empty() && update.added.is_empty());
}

#[tokio::test(start_paused = true)]
async fn initialized_after_first_resolution_even_a_failure() {
    let fake = FakeResolver::new();
    fake.fail_all("web.test");
    let cluster = strict(&fake, v4_settings(), &["web.test"]);
    let update = next_update(&mut cluster.updates()).await;
    assert!(update.initialized && update.hosts.is_empty());
    assert_eq!(cluster.stats().values().source.update_failure, 1);
}

#[tokio::test(start_paused = true)]
async fn no_targets_is_initialized_at_once_with_no_hosts() {
    let fake = FakeResolver::new();
    let cluster = strict(&fake, v4_settings(), &[]);
    let update = cluster.current();
    assert!(update.initialized && update.hosts.is_empty());
    cluster.initialized().await;
    assert_eq!(cluster.stats().values(), StatValues::default());
}

fn ttl_settings(respect: bool) -> DnsSettings {
    DnsSettings {
        respect_dns_ttl: respect,
        ..v4_settings()
    }
}

async fn first_gap(fake: &FakeResolver, settings: DnsSettings) -> Duration {
    let cluster = strict(fake, settings, &["web.test"]);
    advance(secs(120)).await;
    drop(cluster);
    gaps(fake, "web.test")[0]
}

#[tokio::test(start_paused = true)]
async fn respect_dns_ttl_refreshes_after_the_minimum_ttl() {
    let fake = FakeResolver::new();
    fake.set(
        "web.test",
        &[("10.0.0.1", 30), ("10.0.0.2", 10), ("10.0.0.3", 20)],
    );
    assert_eq!(first_gap(&fake, ttl_settings(true)).await, secs(10));
}

#[tokio::test(start_paused = true)]
async fn ttl_is_ignored_without_respect_dns_ttl() {
    let fake = FakeResolver::new();
    fake.set("web.test", &[("10.0.0.1", 30)]);
    assert_eq!(first_gap(&fake, ttl_settings(false)).await, secs(5));
}

#[tokio::test(start_paused = true)]
async fn ttl_zero_falls_back_to_the_refresh_rate() {
    let fake = FakeResolver::new();
    fake.set("web.test", &[("10.0.0.1", 30), ("10.0.0.2", 0)]);
    assert_eq!(first_gap(&fake, ttl_settings(true)).await, secs(5));
}

#[tokio::test(start_paused = true)]
async fn empty_answer_uses_the_refresh_rate_even_with_respect_dns_ttl() {
    let fake = FakeResolver::new();
    fake.set("web.test", &[]);
    let settings = DnsSettings {
        dns_refresh_rate: secs(7),
        ..ttl_settings(true)
    };
    assert_eq!(first_gap(&fake, settings).await, secs(7));
}

#[tokio::test(start_paused = true)]
async fn failures_use_the_refresh_rate_when_no_failure_rate_is_set() {
    let fake = FakeResolver::new();
    fake.fail_all("web.test");
    let settings = DnsSettings {
        dns_refresh_rate: secs(3),
        ..v4_settings()
    };
    let cluster = strict(&fake, settings, &["web.test"]);
    advance(secs(16)).await;
    drop(cluster);
    assert_eq!(gaps(&fake, "web.test"), [secs(3); 5]);
}

#[tokio::test(start_paused = true)]
async fn failure_backoff_grows_caps_and_resets_on_success() {
    let fake = FakeResolver::new();
    fake.fail_all("web.test");
    let rate = RefreshRate {
        base_interval: secs(1),
        max_interval: Some(secs(4)),
    };
    let settings = DnsSettings {
        dns_failure_refresh_rate: Some(rate),
        ..v4_settings()
    };
    let cluster = strict(&fake, settings, &["web.test"]);
    while fake.query_times("web.test", QueryType::A).len() < 7 {
        advance(Duration::from_millis(100)).await;
    }
    let bounds = [secs(1), secs(2), secs(4), secs(4), secs(4), secs(4)];
    for (gap, bound) in gaps(&fake, "web.test").iter().zip(bounds) {
        assert!(*gap < bound, "failure gap {gap:?} must be below {bound:?}");
    }
    // Success: back to the refresh rate; the next failure starts again from base_interval.
    fake.set("web.test", &[("10.0.0.1", 30)]);
    let mut updates = cluster.updates();
    while next_update(&mut updates).await.hosts.is_empty() {}
    let success_at = Instant::now();
    fake.fail_all("web.test");
    advance(secs(5) + Duration::from_millis(1100)).await;
    let times = fake.query_times("web.test", QueryType::A);
    let after: Vec<_> = times.iter().filter(|t| **t > success_at).collect();
    assert_eq!(*after[0] - success_at, secs(5));
    assert!(
        after.len() >= 2 && *after[1] - *after[0] < secs(1),
        "backoff was not reset"
    );
}

#[tokio::test(start_paused = true)]
async fn jitter_adds_up_to_dns_jitter_after_success() {
    let fake = FakeResolver::new();
    fake.set("web.test", &[("10.0.0.1", 30)]);
    let settings = DnsSettings {
        dns_jitter: Some(secs(1)),
        ..v4_settings()
    };
    let cluster = strict(&fake, settings, &["web.test"]);
    advance(secs(300)).await;
    drop(cluster);
    let gaps = gaps(&fake, "web.test");
    assert!(gaps.len() > 40);
    assert!(
        gaps.iter().all(|g| *g >= secs(5) && *g < secs(6)),
        "{gaps:?}"
    );
    assert!(gaps.iter().any(|g| *g != gaps[0]), "jitter varies");
}

#[tokio::test(start_paused = true)]
async fn dropping_the_cluster_stops_resolution() {
    let fake = FakeResolver::new();
    fake.set("web.test", &[("10.0.0.1", 30)]);
    let cluster = strict(&fake, v4_settings(), &["web.test"]);
    advance(secs(1)).await;
    drop(cluster);
    advance(secs(60)).await;
    assert_eq!(fake.query_times("web.test", QueryType::A).len(), 1);
}

#[tokio::test(start_paused = true)]
async fn stats_are_named_like_envoy() {
    let fake = FakeResolver::new();
    fake.set("web.test", &[("10.0.0.1", 30)]);
    let cluster = strict(&fake, v4_settings(), &["web.test"]);
    cluster.initialized().await;
    let named = cluster.named_stats();
    let get = |n: &str| named.iter().find(|(name, _)| name == n).map(|(_, v)| *v);
    assert_eq!(get("cluster.web.update_attempt"), Some(1));
    assert_eq!(get("cluster.web.update_success"), Some(1));
    assert_eq!(get("cluster.web.update_failure"), Some(0));
    assert_eq!(get("cluster.web.update_empty"), Some(0));
    assert_eq!(get("cluster.web.update_no_rebuild"), Some(0));
    assert_eq!(get("cluster.web.membership_total"), Some(1));
}

/// Envoy keeps one address returned by two names as two hosts (each name's `ResolveTarget` has
/// its own), so downstream of discovery the address counts twice: two `/clusters` entries, twice
/// the weight in the kernel's table, `membership_total` 3; and it is probed once (one probe per
/// address and check, node-wide), both hosts taking that probe's health.
#[tokio::test(start_paused = true)]
async fn same_ip_from_two_names_is_two_hosts_downstream() {
    let fake = FakeResolver::new();
    fake.set("a.test", &[("127.0.0.1", 30)]);
    fake.set("b.test", &[("127.0.0.1", 30), ("127.0.0.2", 30)]);
    let source = Box::new(strict(&fake, v4_settings(), &["a.test", "b.test"]));
    let script = Arc::new(Script::default());
    let yaml = "clusters:\n  - name: web\n    health_checks: [{timeout: 1s, interval: 5s, \
                unhealthy_threshold: 1, healthy_threshold: 1, tcp_health_check: {}}]\n";
    let up = through_health(source, &script, yaml);
    let mut routing = up.routing();
    let three = routing.wait_for(|r| r.routable().len() == 3);
    tokio::time::timeout(secs(60), three)
        .await
        .expect("three routable hosts within a minute of paused time")
        .expect("the cluster runs");

    let statuses: Vec<(String, Option<String>, String)> = up
        .host_statuses()
        .into_iter()
        .map(|s| {
            let name = s.host.hostname().map(str::to_owned);
            (s.host.addr.to_string(), name, s.flags.render())
        })
        .collect();
    let entry = |addr: &str, name: &str| (addr.to_owned(), Some(name.to_owned()), "healthy".into());
    assert_eq!(
        statuses,
        [
            entry("127.0.0.1:80", "a.test"),
            entry("127.0.0.1:80", "b.test"),
            entry("127.0.0.2:80", "b.test"),
        ]
    );
    let shared: SocketAddr = "127.0.0.1:80".parse().unwrap();
    let other: SocketAddr = "127.0.0.2:80".parse().unwrap();
    assert_eq!(
        script.calls(shared).len(),
        script.calls(other).len(),
        "one probe"
    );
    let stats: BTreeMap<String, u64> = up.stats().into_iter().collect();
    assert_eq!(stats["cluster.web.membership_total"], 3);
    assert_eq!(stats["cluster.web.health_check.healthy"], 3);

    let levels = lb::kernel_levels(&routing.borrow());
    let weight = |addr: SocketAddr| -> u64 {
        levels[0]
            .iter()
            .filter(|(a, _)| *a == addr)
            .map(|(_, w)| u64::from(*w))
            .sum()
    };
    assert_eq!(weight(shared), 2 * weight(other), "{levels:?}");
}
