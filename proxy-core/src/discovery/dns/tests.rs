//! Unit tests of the DNS cluster state machines, on paused tokio time and the fake resolver, and
//! of the real resolver against name servers the tests start on 127.0.0.1 (`sockets`).

mod config;
mod family;
mod logical;
mod sockets;
mod srv;
mod stale;
mod strict;

use std::{sync::Arc, time::Duration};

use tokio::{sync::watch, time::Instant};

use super::{DnsCluster, DnsEndpoint, DnsSettings, FakeResolver, QueryType};
use crate::discovery::SourceUpdate as Update;

/// Waits (in paused time, so instantly) for the next published update.
async fn next_update(updates: &mut watch::Receiver<Update>) -> Update {
    tokio::time::timeout(Duration::from_secs(3600), updates.changed())
        .await
        .expect("an update within an hour of paused time")
        .expect("the cluster is running");
    updates.borrow_and_update().clone()
}

/// Sleeps in paused time; the cluster's timers fire meanwhile.
async fn advance(duration: Duration) {
    tokio::time::sleep(duration).await;
}

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

fn addrs(hosts: &[crate::host::Host]) -> Vec<String> {
    hosts.iter().map(|h| h.addr.to_string()).collect()
}

fn v4_settings() -> DnsSettings {
    DnsSettings {
        dns_lookup_family: crate::config::sources::dns::DnsLookupFamily::V4Only,
        ..DnsSettings::default()
    }
}

fn strict(fake: &FakeResolver, settings: DnsSettings, names: &[&str]) -> DnsCluster {
    let endpoints = names.iter().map(|n| DnsEndpoint::new(*n, 80)).collect();
    super::spawn_strict_dns("web", settings, endpoints, Arc::new(fake.clone())).expect("valid")
}

/// Gaps between consecutive A queries of `name`.
/// `source` as the cluster of the config file `yaml` (its first cluster), through the health
/// matrix, its checks' outcomes scripted by `script`.
fn through_health(
    source: Box<dyn crate::discovery::DiscoverySource>,
    script: &Arc<crate::health::tests::support::Script>,
    yaml: &str,
) -> crate::upstream::Upstream {
    use crate::health::{ExtremeRandom, HealthCheckManager, tests::support::ScriptFactory};
    let factory = Arc::new(ScriptFactory(Arc::clone(script)));
    let manager = HealthCheckManager::new(factory, Arc::new(ExtremeRandom { max: false }));
    let cluster = crate::config::Config::parse(yaml, std::path::Path::new("t.yaml"))
        .expect("valid")
        .clusters
        .remove(0);
    crate::upstream::Upstream::with_source(
        &cluster,
        &manager,
        source,
        &crate::config::host_guard::HostGuard::default(),
    )
    .unwrap()
}

fn gaps(fake: &FakeResolver, name: &str) -> Vec<Duration> {
    let times: Vec<Instant> = fake.query_times(name, QueryType::A);
    times.windows(2).map(|w| w[1] - w[0]).collect()
}
