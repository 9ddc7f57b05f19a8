//! DNS SRV backend: priority ranks, weights, ports, TTLs, failures.

use std::{collections::BTreeMap, sync::Arc, time::Duration};

use super::{addrs, advance, next_update, secs, v4_settings};
use crate::{
    config::sources::dns::DnsSettings,
    discovery::dns::{DnsCluster, FakeResolver, QueryType, SrvRecord, SrvService, spawn_dns_srv},
};

const NAME: &str = "_http._tcp.web.test";

fn srv(priority: u16, weight: u16, port: u16, target: &str, ttl: u64) -> SrvRecord {
    SrvRecord {
        priority,
        weight,
        port,
        target: target.into(),
        ttl: Duration::from_secs(ttl),
    }
}

fn cluster(fake: &FakeResolver, settings: DnsSettings) -> DnsCluster {
    let service = SrvService {
        name: NAME.into(),
        metadata: BTreeMap::from([("via".into(), "srv".into())]),
    };
    spawn_dns_srv("web", settings, vec![service], Arc::new(fake.clone())).expect("valid")
}

#[tokio::test(start_paused = true)]
async fn srv_priority_weight_and_port_map_to_hosts() {
    let fake = FakeResolver::new();
    fake.set_srv(
        NAME,
        vec![
            srv(20, 0, 8002, "b.test.", 60),
            srv(10, 5, 8001, "a.test.", 60),
            srv(10, 1, 8003, "c.test.", 60),
            srv(30, 9, 8004, "d.test.", 60),
        ],
    );
    fake.set("a.test", &[("10.0.0.1", 60)]);
    fake.set("b.test", &[("10.0.0.2", 60)]);
    fake.set("c.test", &[("10.0.0.3", 60), ("10.0.0.4", 60)]);
    fake.set("d.test", &[("10.0.0.5", 60)]);
    let cluster = cluster(&fake, v4_settings());
    let update = next_update(&mut cluster.updates()).await;
    let summary: Vec<(String, u32, u32)> = update
        .hosts
        .iter()
        .map(|h| (h.addr.to_string(), h.priority, h.weight))
        .collect();
    let expected = [
        ("10.0.0.1:8001", 0, 5),
        ("10.0.0.3:8003", 0, 1),
        ("10.0.0.4:8003", 0, 1),
        ("10.0.0.2:8002", 1, 1), // SRV weight 0 becomes 1
        ("10.0.0.5:8004", 2, 9),
    ];
    let expected: Vec<(String, u32, u32)> = expected
        .iter()
        .map(|(a, p, w)| (a.to_string(), *p, *w))
        .collect();
    assert_eq!(summary, expected);
    assert_eq!(update.hosts[0].hostname(), Some("a.test"));
    assert_eq!(update.hosts[0].metadata()["via"], "srv");
    assert!(cluster.drain_on_change());
}

#[tokio::test(start_paused = true)]
async fn dot_target_is_skipped_and_empty_srv_means_no_hosts() {
    let fake = FakeResolver::new();
    fake.set_srv(
        NAME,
        vec![srv(0, 1, 80, ".", 60), srv(0, 1, 81, "a.test", 60)],
    );
    fake.set("a.test", &[("10.0.0.1", 60)]);
    let cluster = cluster(&fake, v4_settings());
    let mut updates = cluster.updates();
    assert_eq!(
        addrs(&next_update(&mut updates).await.hosts),
        ["10.0.0.1:81"]
    );
    fake.set_srv(NAME, vec![]);
    let update = next_update(&mut updates).await;
    assert!(update.hosts.is_empty());
    assert_eq!(addrs(&update.removed), ["10.0.0.1:81"]);
}

#[tokio::test(start_paused = true)]
async fn a_failed_target_lookup_fails_the_resolution_and_keeps_hosts() {
    let fake = FakeResolver::new();
    fake.set_srv(
        NAME,
        vec![srv(0, 1, 80, "a.test", 60), srv(0, 1, 80, "b.test", 60)],
    );
    fake.set("a.test", &[("10.0.0.1", 60)]);
    fake.set("b.test", &[("10.0.0.2", 60)]);
    let cluster = cluster(&fake, v4_settings());
    let mut updates = cluster.updates();
    let first = next_update(&mut updates).await;
    fake.fail("b.test", QueryType::A);
    advance(secs(6)).await;
    assert_eq!(cluster.current(), first);
    assert_eq!(cluster.stats().values().source.update_failure, 1);
}

#[tokio::test(start_paused = true)]
async fn respect_dns_ttl_takes_the_minimum_of_srv_and_address_ttls() {
    let fake = FakeResolver::new();
    fake.set_srv(
        NAME,
        vec![srv(0, 1, 80, "a.test", 40), srv(1, 1, 80, "b.test", 30)],
    );
    fake.set("a.test", &[("10.0.0.1", 20)]);
    fake.set("b.test", &[("10.0.0.2", 50)]);
    let cluster = cluster(
        &fake,
        DnsSettings {
            respect_dns_ttl: true,
            ..v4_settings()
        },
    );
    advance(secs(50)).await;
    drop(cluster);
    let times = fake.query_times(NAME, QueryType::Srv);
    assert_eq!(times[1] - times[0], secs(20));
}

#[tokio::test(start_paused = true)]
async fn a_priority_change_republishes_without_removing() {
    let fake = FakeResolver::new();
    fake.set_srv(
        NAME,
        vec![srv(0, 1, 80, "a.test", 60), srv(5, 1, 80, "b.test", 60)],
    );
    fake.set("a.test", &[("10.0.0.1", 60)]);
    fake.set("b.test", &[("10.0.0.2", 60)]);
    let cluster = cluster(&fake, v4_settings());
    let mut updates = cluster.updates();
    next_update(&mut updates).await;
    fake.set_srv(
        NAME,
        vec![srv(9, 1, 80, "a.test", 60), srv(5, 1, 80, "b.test", 60)],
    );
    let update = next_update(&mut updates).await;
    let priorities: Vec<(String, u32)> = update
        .hosts
        .iter()
        .map(|h| (h.addr.to_string(), h.priority))
        .collect();
    assert_eq!(
        priorities,
        [
            ("10.0.0.2:80".to_string(), 0),
            ("10.0.0.1:80".to_string(), 1)
        ]
    );
    assert!(update.added.is_empty() && update.removed.is_empty());
}
