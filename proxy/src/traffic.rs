//! Tells the health checker which clusters carried traffic. Envoy checks a cluster's hosts at
//! `no_traffic_interval` (60 s by default) until the cluster has had a connection, and at
//! `interval` from then on; without this feed every cluster would stay at the slow rate and a
//! dead host of a busy service would be found a minute or two late.
//!
//! The source is the kernel's per-service counters (`SVC_COUNTERS_V3`): a connect or datagram
//! sent to a host, or a connect redirected to the proxy listener, is traffic for every cluster the
//! service reads (for a chain, each of its targets: the counters are per service, not per
//! target). Like Envoy's `upstream_cx_total`, once a cluster had traffic it keeps the fast rate.

use std::time::Duration;

use proxy_common::service::ServiceKey;
use proxy_core::{config::Config, health::HealthCheckManager};
use tracing::debug;

use crate::daemon::state::{SharedDataplane, service_key};

/// How often the counters are read, at most one period behind the first connection.
pub const PERIOD: Duration = Duration::from_secs(1);

/// One service whose clusters have not carried traffic yet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Watched {
    pub service: String,
    pub key: ServiceKey,
    pub clusters: Vec<String>,
}

/// Every service of `config` that reads at least one cluster.
pub fn watched(config: &Config) -> Vec<Watched> {
    config
        .services
        .iter()
        .map(|svc| Watched {
            service: svc.name.clone(),
            key: service_key(svc),
            clusters: config.service_clusters(svc),
        })
        .filter(|w| !w.clusters.is_empty())
        .collect()
}

/// Reads the counters every [`PERIOD`] and notes traffic for the clusters of each service that
/// was used; ends once every service was (or the data path is gone).
pub async fn run(dp: SharedDataplane, manager: HealthCheckManager, mut waiting: Vec<Watched>) {
    let mut ticks = tokio::time::interval(PERIOD);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while !waiting.is_empty() {
        ticks.tick().await;
        let Some(used) = used(&dp, &waiting) else {
            return;
        };
        // Highest index first, so that the indices left stay valid.
        for i in used.into_iter().rev() {
            let served = waiting.swap_remove(i);
            debug!(service = %served.service, clusters = ?served.clusters, "first traffic: health checks leave no_traffic_interval");
            for cluster in &served.clusters {
                manager.note_traffic(cluster);
            }
        }
    }
}

/// The indices (ascending) of the services in `waiting` that carried traffic; `None` once the
/// data path is gone.
fn used(dp: &SharedDataplane, waiting: &[Watched]) -> Option<Vec<usize>> {
    let keys: Vec<ServiceKey> = waiting.iter().map(|w| w.key).collect();
    let guard = dp.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let used = guard.as_ref()?.used_services(&keys);
    Some(
        used.into_iter()
            .enumerate()
            .filter_map(|(i, used)| used.then_some(i))
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    #[test]
    fn every_service_with_clusters_is_watched() {
        let endpoint = "    load_assignment: { endpoints: [ { lb_endpoints: [ { endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: 1 } } } } ] } ] }\n";
        let yaml = format!(
            "clusters:\n  - name: a\n{endpoint}  - name: b\n{endpoint}services:\n  - {{ name: one, address: 127.77.0.1, port: 80, cluster: a }}\n  - {{ name: two, address: 127.77.0.2, port: 53, protocol: UDP, cluster: b }}\n"
        );
        let config = Config::parse(&yaml, Path::new("t.yaml")).expect("valid config");
        let watched = watched(&config);
        let names: Vec<(&str, &[String])> = watched
            .iter()
            .map(|w| (w.service.as_str(), w.clusters.as_slice()))
            .collect();
        assert_eq!(
            names,
            [
                ("one", &["a".to_owned()][..]),
                ("two", &["b".to_owned()][..])
            ]
        );
        assert_eq!(watched[1].key, service_key(&config.services[1]));
        assert_ne!(watched[0].key, watched[1].key);
    }
}
