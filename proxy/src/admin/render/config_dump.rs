//! `/config_dump` in Envoy's shape, `envoy.admin.v3.ConfigDump` as proto3 JSON: the clusters
//! (`ClustersConfigDump`, from the configuration in force), their endpoints as discovery and
//! health checking have them now (`EndpointsConfigDump`: EDS clusters' under
//! `dynamic_endpoint_configs`, the others' under `static_endpoint_configs`, as Envoy with
//! `include_eds`), and the listeners (`ListenersConfigDump`: each service's address with a
//! `tcp_proxy` to its cluster, and the proxy path's sockets, see `listeners`). Clusters and
//! listeners come from the file, so they are `static_*` (a CDS or LDS resource becomes the
//! daemon's own configuration).
//!
//! Only what the daemon has and means is printed: a cluster's name, type, load balancing
//! policy, connect timeout, static load assignment and EDS source (its API type and clusters:
//! the daemon's own `server_uri` and `tls` are not Envoy's fields). A custom cluster type is
//! named without its `typed_config` (which may hold a token, and whose type Envoy does not
//! know). The daemon's own effective configuration stays at `/config_dump?format=proxy`.

use std::{collections::BTreeMap, time::Duration};

use proxy_core::{
    config::{Cluster, ClusterType, sources::xds::ConfigSource},
    health::HostStatus,
    host::EdsHealth,
};
use serde_json::{Value, json};

use super::listeners::{Listening, address, listening};
use crate::admin::State;

const TYPE_URL: &str = "type.googleapis.com/";

/// `envoy.admin.v3.ConfigDump`.
pub(crate) fn config_dump(state: &State) -> Value {
    let clusters: Vec<Value> = state
        .config
        .clusters
        .iter()
        .map(|c| json!({ "cluster": cluster(c, state.config.proxy.connect_timeout) }))
        .collect();
    let (mut dynamic, mut fixed) = (Vec::new(), Vec::new());
    for c in &state.config.clusters {
        let Some(upstream) = state.upstreams.get(&c.name) else {
            continue;
        };
        let assignment =
            json!({ "endpoint_config": assignment(&c.name, &upstream.host_statuses()) });
        if c.cluster_type == ClusterType::Eds {
            dynamic.push(assignment);
        } else {
            fixed.push(assignment);
        }
    }
    let listeners: Vec<Value> = listening(state)
        .iter()
        .map(|l| json!({ "listener": listener(l) }))
        .collect();
    json!({ "configs": [
        {
            "@type": format!("{TYPE_URL}envoy.admin.v3.ClustersConfigDump"),
            "static_clusters": clusters,
        },
        {
            "@type": format!("{TYPE_URL}envoy.admin.v3.EndpointsConfigDump"),
            "static_endpoint_configs": fixed,
            "dynamic_endpoint_configs": dynamic,
        },
        {
            "@type": format!("{TYPE_URL}envoy.admin.v3.ListenersConfigDump"),
            "static_listeners": listeners,
        },
    ]})
}

/// A protobuf `Duration` in JSON: seconds with a fraction when there is one (`"0.250s"`).
fn duration(d: Duration) -> String {
    match d.subsec_nanos() {
        0 => format!("{}s", d.as_secs()),
        n => {
            let fraction = format!("{n:09}");
            format!("{}.{}s", d.as_secs(), fraction.trim_end_matches('0'))
        }
    }
}

/// `envoy.config.cluster.v3.Cluster`.
fn cluster(c: &Cluster, default_timeout: Duration) -> Value {
    let mut out = json!({
        "@type": format!("{TYPE_URL}envoy.config.cluster.v3.Cluster"),
        "name": c.name,
        "connect_timeout": duration(c.connect_timeout.unwrap_or(default_timeout)),
        "lb_policy": serde_json::to_value(c.lb_policy).unwrap_or(Value::Null),
    });
    match &c.custom_cluster_type {
        Some(custom) => out["cluster_type"] = json!({ "name": custom.name }),
        None => out["type"] = serde_json::to_value(c.cluster_type).unwrap_or(Value::Null),
    }
    if let Some(la) = &c.load_assignment {
        let endpoints: Vec<Value> = la
            .endpoints
            .iter()
            .map(|group| {
                let lb_endpoints: Vec<Value> = group
                    .lb_endpoints
                    .iter()
                    .map(|e| {
                        json!({
                            "endpoint": { "address": { "socket_address": {
                                "address": e.endpoint.address.socket_address.address,
                                "port_value": e.endpoint.address.socket_address.port_value,
                            }}},
                            "load_balancing_weight": e.load_balancing_weight,
                        })
                    })
                    .collect();
                json!({ "lb_endpoints": lb_endpoints, "priority": group.priority })
            })
            .collect();
        out["load_assignment"] = json!({ "cluster_name": c.name, "endpoints": endpoints });
    }
    if let Some(eds) = &c.eds_cluster_config {
        let mut config = json!({ "eds_config": eds_source(&eds.eds_config) });
        if let Some(name) = &eds.service_name {
            config["service_name"] = json!(name);
        }
        out["eds_cluster_config"] = config;
    }
    out
}

/// `envoy.config.core.v3.ConfigSource` of an EDS cluster: ADS, or the API type and clusters of
/// its own server (the daemon's extensions, `server_uri` and `tls`, are not Envoy's: left out).
fn eds_source(source: &ConfigSource) -> Value {
    match &source.api_config_source {
        None => json!({ "ads": {}, "resource_api_version": "V3" }),
        Some(api) => json!({
            "api_config_source": {
                "api_type": serde_json::to_value(api.api_type).unwrap_or(Value::Null),
                "transport_api_version": "V3",
                "cluster_names": api.cluster_names,
            },
            "resource_api_version": "V3",
        }),
    }
}

/// `envoy.config.endpoint.v3.ClusterLoadAssignment` of the hosts the cluster has now, one
/// locality group per priority.
fn assignment(cluster: &str, hosts: &[HostStatus]) -> Value {
    let mut priorities: BTreeMap<u32, Vec<Value>> = BTreeMap::new();
    for status in hosts {
        let host = &status.host;
        let health = match host.eds_health {
            _ if status.flags.failed_active_hc || status.flags.failed_outlier_check => "UNHEALTHY",
            EdsHealth::Unknown | EdsHealth::Healthy => "HEALTHY",
            EdsHealth::Unhealthy => "UNHEALTHY",
            EdsHealth::Timeout => "TIMEOUT",
            EdsHealth::Draining => "DRAINING",
            EdsHealth::Degraded => "DEGRADED",
        };
        let mut endpoint = json!({ "address": address(host.addr, false) });
        if let Some(name) = host.hostname() {
            endpoint["hostname"] = json!(name);
        }
        priorities.entry(host.priority).or_default().push(json!({
            "endpoint": endpoint,
            "health_status": health,
            "load_balancing_weight": host.weight,
        }));
    }
    let endpoints: Vec<Value> = priorities
        .into_iter()
        .map(|(priority, lb_endpoints)| json!({ "lb_endpoints": lb_endpoints, "priority": priority }))
        .collect();
    json!({
        "@type": format!("{TYPE_URL}envoy.config.endpoint.v3.ClusterLoadAssignment"),
        "cluster_name": cluster,
        "endpoints": endpoints,
    })
}

/// `envoy.config.listener.v3.Listener`: a TCP service of one cluster with a `tcp_proxy` to it
/// (a chain's or a UDP service's address alone), the proxy's sockets as Envoy's outbound
/// listener (`use_original_dst`).
fn listener(l: &Listening<'_>) -> Value {
    let mut out = json!({
        "@type": format!("{TYPE_URL}envoy.config.listener.v3.Listener"),
        "name": l.name,
        "address": address(l.addr, l.udp),
    });
    match l.service {
        None => out["use_original_dst"] = json!(true),
        Some(svc) if svc.chain.is_none() && !l.udp => {
            out["filter_chains"] = json!([{ "filters": [{
                "name": "envoy.filters.network.tcp_proxy",
                "typed_config": {
                    "@type": format!(
                        "{TYPE_URL}envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy"
                    ),
                    "stat_prefix": svc.name,
                    "cluster": svc.cluster,
                },
            }]}]);
        }
        Some(_) => {}
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_are_protobuf_json() {
        assert_eq!(duration(Duration::from_secs(5)), "5s");
        assert_eq!(duration(Duration::from_millis(250)), "0.25s");
        assert_eq!(
            duration(Duration::from_nanos(1_000_000_001)),
            "1.000000001s"
        );
    }
}
