//! The xDS side of the file's clusters: which are EDS, how a config source reaches the STATIC
//! cluster it names, where a `transport_socket` is accepted, and the file's check of them all.

use std::net::SocketAddr;

use super::{ApiConfigSource, EdsClusterConfig, plan, transport_socket::TransportSocket};
use crate::config::{ClusterType, Config, error::Invalid};

/// Every EDS cluster of `config` with its `eds_cluster_config` (validation made it present).
pub fn eds_clusters(config: &Config) -> Vec<(String, EdsClusterConfig)> {
    config
        .clusters
        .iter()
        .filter(|c| c.cluster_type == ClusterType::Eds && c.custom_cluster_type.is_none())
        .filter_map(|c| Some((c.name.clone(), c.eds_cluster_config.clone()?)))
        .collect()
}

/// How `envoy_grpc: {cluster_name}` and REST `cluster_names` reach their server: the address of
/// the named STATIC cluster's first host, and the cluster's `transport_socket`.
pub fn static_resolver(
    config: &Config,
) -> impl Fn(&str) -> Option<(SocketAddr, Option<TransportSocket>)> + '_ {
    |name| {
        let cluster = config.cluster(name)?;
        let addr = cluster.static_hosts().first()?.addr;
        Some((addr, cluster.transport_socket.clone()))
    }
}

/// Refuses a `transport_socket` on a cluster that no xDS config source names through
/// `envoy_grpc` or REST `cluster_names` (without `server_uri`), or on a cluster that is not
/// STATIC: the data path does not speak TLS, so it would be accepted without effect.
pub fn check_transport_sockets(config: &Config) -> Result<(), String> {
    let eds = eds_clusters(config);
    let mut sources: Vec<&ApiConfigSource> = eds
        .iter()
        .filter_map(|(_, eds)| eds.eds_config.api_config_source.as_ref())
        .collect();
    sources.extend(config.xds.as_ref().and_then(|x| x.ads_config.as_ref()));
    let named: Vec<&str> = sources
        .iter()
        .filter(|s| s.server_uri.is_none())
        .flat_map(|s| {
            let grpc = s.grpc_services.iter().filter_map(|g| g.envoy_grpc.as_ref());
            let grpc = grpc.map(|e| e.cluster_name.as_str());
            grpc.chain(s.cluster_names.iter().map(String::as_str))
        })
        .collect();
    for (i, cluster) in config.clusters.iter().enumerate() {
        let used = named.contains(&cluster.name.as_str());
        if cluster.transport_socket.is_some()
            && (!used || cluster.cluster_type != ClusterType::Static)
        {
            return Err(format!(
                "clusters[{i}] ({}): transport_socket is only accepted on a STATIC cluster that an xDS config source names (envoy_grpc or REST cluster_names): the data path does not speak TLS",
                cluster.name
            ));
        }
    }
    Ok(())
}

/// The xDS parts: an `xds` section when a cluster is EDS, the ADS source when CDS or LDS is
/// on, every EDS cluster's source reachable ([`plan`]), and no `xds` section that nothing
/// subscribes through. Runs last, as `proxy check` always ran it.
pub(in crate::config) fn validate_xds(config: &Config) -> Result<(), Invalid> {
    check_transport_sockets(config).map_err(|e| Invalid::new("clusters", e))?;
    let clusters = eds_clusters(config);
    let Some(xds) = &config.xds else {
        if clusters.is_empty() {
            return Ok(());
        }
        return Err(Invalid::new(
            "xds",
            "EDS clusters need an `xds` section with the node identity",
        ));
    };
    if xds.resources_enabled() {
        xds.ads_source(&static_resolver(config))
            .map_err(|e| Invalid::new("xds", e.to_string()))?;
    } else if clusters.is_empty() {
        return Err(Invalid::new(
            "xds",
            "nothing subscribes through this section (no EDS cluster, cds_config or lds_config): \
             remove it, or add what it is for",
        ));
    }
    plan(xds, &clusters, &static_resolver(config))
        .map(|_| ())
        .map_err(|e| Invalid::new("xds", e.to_string()))
}
