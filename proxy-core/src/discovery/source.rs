//! The one interface over every discovery source (STATIC, DNS, SRV, Consul, xDS): a watch of
//! host sets and Envoy-named stats, so the cluster's event loop consumes every source the same
//! way, and [`start`], which picks a cluster's source from its type.
//!
//! A source is a running object (it owns its tasks; dropping it stops them) that publishes
//! [`SourceUpdate`]s on a watch channel: the sender lives in the source's own task, and the event
//! loop reads the receiver, with no task copying one channel into another. Nobody waits on a
//! source on the connect path: consumers read the latest published hosts.

use tokio::sync::watch;

use super::{
    consul::spawn_consul,
    dns::{
        BuildResolverError, HickoryResolver, SrvService, spawn_dns_srv, spawn_logical_dns,
        spawn_strict_dns,
    },
    fixed::FixedSource,
    xds::XdsClients,
};
use crate::{
    config::{
        Cluster, ClusterType, CustomClusterType, CustomConfig,
        sources::dns::{DnsConfigError, DnsSettings, QueryLimits},
    },
    host::HostSet,
};

/// One published state of a source's hosts.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SourceUpdate {
    /// Increases with every publication; 0 is the initial state before any result.
    pub version: u64,
    /// The source's own version label: xDS's accepted `version_info` (SotW, REST) or resource
    /// `version` (delta); empty for sources without one and before the first assignment.
    pub version_info: String,
    /// True once the source finished its first fetch (success or failure; for xDS also the
    /// `initial_fetch_timeout`): Envoy's cluster initialization. Routing decisions are meaningful
    /// from then on.
    pub initialized: bool,
    /// All hosts the source reports, with their weight, priority, health and metadata.
    pub hosts: HostSet,
    /// Hosts whose address was not in the previous publication ([`super::diff_hosts`]).
    pub added: Vec<crate::host::Host>,
    /// Hosts of the previous publication whose address is gone: drain their connections when
    /// [`DiscoverySource::drain_on_change`] says so.
    pub removed: Vec<crate::host::Host>,
    /// The `ClusterLoadAssignment.policy` that came with the hosts (EDS); `None`: the
    /// cluster's own (`load_assignment.policy` of its config, else Envoy's defaults).
    pub policy: Option<crate::health::AssignmentPolicy>,
}

impl SourceUpdate {
    /// Replaces the hosts with `hosts` as the next version, filling `added` and `removed`, and
    /// marks the update initialized.
    pub fn advance(&mut self, hosts: HostSet) {
        let (added, removed) = super::diff_hosts(&self.hosts, &hosts);
        self.version += 1;
        self.initialized = true;
        self.hosts = hosts;
        self.added = added;
        self.removed = removed;
    }
}

/// A running discovery source of one cluster.
pub trait DiscoverySource: Send + Sync {
    /// The cluster this source discovers hosts for.
    fn cluster_name(&self) -> &str;

    /// A receiver of host-set updates; its current value is the latest state.
    fn updates(&self) -> watch::Receiver<SourceUpdate>;

    /// `(name, value)` pairs named as Envoy names them (`cluster.<name>.update_attempt`, ...).
    fn named_stats(&self) -> Vec<(String, u64)>;

    /// Whether connections to removed hosts are drained (Envoy: true for every type but
    /// LOGICAL_DNS).
    fn drain_on_change(&self) -> bool {
        true
    }
}

/// Why a cluster's source could not be started.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// Its DNS settings are invalid.
    #[error("cluster {cluster}: {source}")]
    Dns {
        /// The cluster.
        cluster: String,
        /// Why.
        #[source]
        source: DnsConfigError,
    },
    /// The resolver could not be built.
    #[error("cluster {cluster}: {source}")]
    Resolver {
        /// The cluster.
        cluster: String,
        /// Why.
        #[source]
        source: BuildResolverError,
    },
    /// A custom source's settings are invalid or it could not start.
    #[error("cluster {cluster}: {message}")]
    Custom {
        /// The cluster.
        cluster: String,
        /// What went wrong.
        message: String,
    },
    /// An EDS cluster that no running xDS client subscribed.
    #[error(
        "cluster {cluster}: no xDS client subscribes this EDS cluster; start them from the config (XdsClients::start)"
    )]
    NotSubscribed {
        /// The cluster.
        cluster: String,
    },
    /// The type is not served by this build.
    #[error("cluster {cluster}: type {kind:?} is not implemented yet in this build")]
    Unsupported {
        /// The cluster.
        cluster: String,
        /// Its type.
        kind: ClusterType,
    },
}

/// Starts the source of a validated `cluster`: the one place that maps a cluster type to a
/// source. EDS clusters take their subscription from `xds`, whose connections several clusters
/// share. Must run inside a tokio runtime.
pub fn start(cluster: &Cluster, xds: &XdsClients) -> Result<Box<dyn DiscoverySource>, SourceError> {
    let name = &cluster.name;
    if let Some(custom) = &cluster.custom_cluster_type {
        return start_custom(cluster, custom);
    }
    match cluster.cluster_type {
        ClusterType::Static => Ok(Box::new(FixedSource::new(name, cluster.static_hosts()))),
        ClusterType::StrictDns | ClusterType::LogicalDns => {
            let settings = cluster.dns_settings();
            let resolver = resolver(name, &settings, cluster.dns_query_limits)?;
            let endpoints = cluster.dns_endpoints();
            let spawn = if cluster.cluster_type == ClusterType::StrictDns {
                spawn_strict_dns
            } else {
                spawn_logical_dns
            };
            let dns =
                spawn(name, settings, endpoints, resolver).map_err(|source| SourceError::Dns {
                    cluster: name.clone(),
                    source,
                })?;
            Ok(Box::new(dns))
        }
        ClusterType::Eds => match xds.source(name) {
            Some(eds) => Ok(Box::new(eds)),
            None => Err(SourceError::NotSubscribed {
                cluster: name.clone(),
            }),
        },
        // ORIGINAL_DST hosts are the proxied connections' destinations, kept by the proxy path.
        kind @ ClusterType::OriginalDst => Err(SourceError::Unsupported {
            cluster: name.clone(),
            kind,
        }),
    }
}

fn resolver(
    cluster: &str,
    settings: &DnsSettings,
    limits: QueryLimits,
) -> Result<std::sync::Arc<HickoryResolver>, SourceError> {
    HickoryResolver::with_limits(settings, limits)
        .map(std::sync::Arc::new)
        .map_err(|source| SourceError::Resolver {
            cluster: cluster.to_owned(),
            source,
        })
}

/// Starts a custom source (`cluster_type: {name, typed_config}`) from the settings that
/// validation typed.
fn start_custom(
    cluster: &Cluster,
    custom: &CustomClusterType,
) -> Result<Box<dyn DiscoverySource>, SourceError> {
    let name = &cluster.name;
    let bad = |message: String| SourceError::Custom {
        cluster: name.clone(),
        message,
    };
    match &custom.typed {
        Some(CustomConfig::Consul(cfg)) => {
            let consul = spawn_consul(name.clone(), cfg.clone()).map_err(|e| bad(e.to_string()))?;
            Ok(Box::new(consul))
        }
        Some(CustomConfig::DnsSrv(cfg)) => {
            let settings = cluster.dns_settings();
            let resolver = resolver(name, &settings, cluster.dns_query_limits)?;
            let services = cfg
                .service_names
                .iter()
                .map(|n| SrvService::new(n.clone()))
                .collect();
            let dns = spawn_dns_srv(name, settings, services, resolver).map_err(|source| {
                SourceError::Dns {
                    cluster: name.clone(),
                    source,
                }
            })?;
            Ok(Box::new(dns))
        }
        None => Err(bad(format!(
            "custom cluster type {:?} was not validated (Config::parse types it)",
            custom.name
        ))),
    }
}

#[cfg(test)]
mod tests {
    use std::{path::Path, sync::Arc, time::Duration};

    use super::*;
    use crate::{
        config::{Config, sources::dns::DnsEndpoint},
        discovery::dns::FakeResolver,
    };

    #[tokio::test(start_paused = true)]
    async fn dns_cluster_publishes_source_updates_itself() {
        let resolver = Arc::new(FakeResolver::new());
        resolver.set("web.svc.test", &[("127.0.0.2", 5)]);
        let settings = DnsSettings {
            dns_refresh_rate: Duration::from_secs(1),
            ..DnsSettings::default()
        };
        let endpoints = vec![DnsEndpoint::new("web.svc.test", 8080)];
        let cluster = spawn_strict_dns("web", settings, endpoints, resolver).expect("valid");
        let source: &dyn DiscoverySource = &cluster;
        let mut updates = source.updates();
        let wait = updates.wait_for(|u| u.initialized);
        let update = tokio::time::timeout(Duration::from_secs(5), wait)
            .await
            .expect("initialized in time")
            .expect("source alive")
            .clone();
        assert!(update.version >= 1);
        let addrs: Vec<String> = update.hosts.iter().map(|h| h.addr.to_string()).collect();
        assert_eq!(addrs, ["127.0.0.2:8080"]);
        assert_eq!(update.added, update.hosts, "the first hosts are all added");
        assert_eq!(source.cluster_name(), "web");
        assert!(source.drain_on_change());
        assert!(
            source
                .named_stats()
                .iter()
                .any(|(n, _)| n == "cluster.web.update_attempt")
        );
    }

    fn cluster(yaml: &str) -> Cluster {
        Config::parse(yaml, Path::new("t.yaml"))
            .expect("valid")
            .clusters
            .remove(0)
    }

    /// `query_tries` and `query_timeout_seconds` of an Envoy c-ares resolver config reach the
    /// cluster's resolver: a name server that never answers gets exactly that many datagrams,
    /// and the lookup fails once their time is spent.
    #[tokio::test]
    async fn c_ares_query_limits_reach_the_resolver() {
        let server = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = server.local_addr().unwrap();
        let queries = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = queries.clone();
        let silent = tokio::spawn(async move {
            let mut buf = [0; 512];
            while server.recv_from(&mut buf).await.is_ok() {
                counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
        });
        let dns = cluster(&format!(
            "clusters:\n  - name: q\n    type: STRICT_DNS\n    dns_lookup_family: V4_ONLY\n    typed_dns_resolver_config:\n      name: envoy.network.dns_resolver.cares\n      typed_config: {{ resolvers: [{{ socket_address: {{ address: 127.0.0.1, port_value: {} }} }}], query_tries: 2, query_timeout_seconds: 1 }}\n    load_assignment: {{ endpoints: [ {{ lb_endpoints: [ {{ endpoint: {{ address: {{ socket_address: {{ address: web.svc.test, port_value: 80 }} }} }} }} ] }} ] }}\n",
            addr.port()
        ));
        let started = std::time::Instant::now();
        let source = start(&dns, &XdsClients::default()).expect("strict dns starts");
        let failures = || {
            source
                .named_stats()
                .into_iter()
                .find_map(|(n, v)| (n == "cluster.q.update_failure").then_some(v))
                .unwrap_or(0)
        };
        let deadline = started + Duration::from_secs(10);
        while failures() == 0 {
            assert!(std::time::Instant::now() < deadline, "no update_failure");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let took = started.elapsed();
        silent.abort();
        assert_eq!(queries.load(std::sync::atomic::Ordering::SeqCst), 2);
        assert!(
            took >= Duration::from_secs(2) && took < Duration::from_secs(4),
            "two tries of 1 s took {took:?}"
        );
    }

    #[tokio::test]
    async fn start_picks_the_source_by_type() {
        let none = XdsClients::default();
        let fixed = cluster(
            "clusters:\n  - name: s\n    load_assignment: { endpoints: [ { lb_endpoints: [ { endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: 1 } } } } ] } ] }\n",
        );
        let source = start(&fixed, &none).expect("static starts");
        let update = source.updates().borrow().clone();
        assert!(update.initialized, "static hosts are known at once");
        assert_eq!(update.hosts.len(), 1);
        let logical = cluster(
            "clusters:\n  - name: l\n    type: LOGICAL_DNS\n    load_assignment: { endpoints: [ { lb_endpoints: [ { endpoint: { address: { socket_address: { address: localhost, port_value: 1 } } } } ] } ] }\n",
        );
        let source = start(&logical, &none).expect("logical dns starts");
        assert!(!source.drain_on_change(), "LOGICAL_DNS never drains");
        let mut original = cluster("clusters:\n  - name: o\n");
        original.cluster_type = ClusterType::OriginalDst;
        let err = start(&original, &none).err().expect("unsupported");
        assert!(err.to_string().contains("not implemented yet"), "{err}");
    }
}
