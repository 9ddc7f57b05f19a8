//! LDS: Envoy `Listener` resources as kernel-path services, checked by the file's rules.
//!
//! A listener with a concrete TCP `address.socket_address` and one filter chain holding one
//! `tcp_proxy` filter becomes a `mode: direct` service named like the listener, at the
//! listener's address and port: `cluster` as its cluster, or `weighted_clusters` as a chain
//! whose service-splitter (named like the listener) splits by the same weights, in hundredths
//! of a percent (largest remainders, so they sum to exactly 100), with `chain_options:
//! {tcp_splits: true}` (Envoy splits TCP connections; Consul alone would not). Anything else set on the
//! listener, its chain or the filter is refused by name. An HTTP connection manager instead
//! makes an HTTP service ([`hcm`]).

use std::path::Path;

use envoy_types::pb::{
    envoy::{
        config::{
            core::v3::{address::Address, socket_address::Protocol},
            listener::v3::{Listener, filter::ConfigType},
        },
        extensions::filters::network::tcp_proxy::v3::{
            TcpProxy,
            tcp_proxy::{ClusterSpecifier, WeightedCluster},
        },
    },
    google::protobuf::Any,
};
use prost::Message;
use serde_json::{Value, json};

use crate::{
    config::{ClusterType, Config, ConfigError, Service},
    discovery::xds::{
        cds::{ResourceError, located, refuse_residual, socket_address},
        hcm,
        listener::{ListenerForm, percentages},
    },
};

/// The type URL of `envoy.config.listener.v3.Listener`.
pub const LISTENER_TYPE_URL: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
/// The type URL of the `tcp_proxy` network filter's config.
pub const TCP_PROXY_TYPE_URL: &str =
    "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy";
/// The type URL of the HTTP connection manager's config.
pub const HCM_TYPE_URL: &str = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager";

/// Field numbers of `Listener` not honoured, for refusals.
const LISTENER_FIELDS: &[(u64, &str)] = &[
    (4, "use_original_dst"),
    (5, "per_connection_buffer_limit_bytes"),
    (6, "metadata"),
    (7, "deprecated_v1"),
    (8, "drain_type"),
    (9, "listener_filters"),
    (10, "transparent"),
    (11, "freebind"),
    (13, "socket_options"),
    (16, "traffic_direction"),
    (18, "udp_listener_config"),
    (19, "api_listener"),
    (22, "access_log"),
    (25, "default_filter_chain"),
    (26, "bind_to_port"),
    (27, "internal_listener"),
    (28, "stat_prefix"),
    (32, "filter_chain_matcher"),
    (33, "additional_addresses"),
];

/// Field numbers of `TcpProxy` not honoured.
const TCP_PROXY_FIELDS: &[(u64, &str)] = &[
    (3, "downstream_idle_timeout"),
    (4, "upstream_idle_timeout"),
    (5, "access_log"),
    (7, "max_connect_attempts"),
    (8, "idle_timeout"),
    (9, "metadata_match"),
    (11, "hash_policy"),
    (12, "tunneling_config"),
    (13, "max_downstream_connection_duration"),
    (14, "on_demand"),
];

/// `listener` as a service in the file's form, or the first field refused.
pub fn file_form(listener: &Listener) -> Result<ListenerForm, ResourceError> {
    let name = listener.name.clone();
    let unsupported = |field: &str| ResourceError::Unsupported {
        kind: "listener",
        name: name.clone(),
        field: field.to_owned(),
    };
    let invalid = |field: &str, reason: &str| ResourceError::Invalid {
        kind: "listener",
        name: name.clone(),
        field: field.to_owned(),
        reason: reason.to_owned(),
    };
    let clear = |l: &mut Listener| {
        l.name.clear();
        l.address = None;
        l.filter_chains.clear();
    };
    refuse_residual(listener, clear, LISTENER_FIELDS, |f| unsupported(&f))?;
    let (address, port) = tcp_address(listener).map_err(|(f, r)| invalid(f, r))?;
    let any = one_filter(listener, &unsupported, &invalid)?;
    if any.type_url == HCM_TYPE_URL {
        return hcm::file_form(&name, &address, port, any);
    }
    let proxy = decode_tcp_proxy(any, &unsupported, &invalid)?;
    let mut service = json!({"name": name, "address": address, "port": port});
    match proxy.cluster_specifier {
        Some(ClusterSpecifier::Cluster(cluster)) => {
            service["cluster"] = json!(cluster);
            Ok(ListenerForm {
                service,
                entries: Vec::new(),
                clusters: vec![cluster],
                validate_clusters: false,
                rds: None,
            })
        }
        Some(ClusterSpecifier::WeightedClusters(weighted)) => {
            if weighted.clusters.iter().any(|c| c.metadata_match.is_some()) {
                let field = "tcp_proxy.weighted_clusters.clusters[].metadata_match";
                return Err(unsupported(field));
            }
            split_form(&name, &weighted, service).map_err(|(f, r)| invalid(f, r))
        }
        None => Err(invalid(
            "tcp_proxy",
            "names no cluster (cluster or weighted_clusters)",
        )),
    }
}

/// The listener's TCP `socket_address` and port.
fn tcp_address(listener: &Listener) -> Result<(String, u32), (&'static str, &'static str)> {
    let (address, port) = socket_address(listener.address.as_ref())
        .ok_or(("address", "must be a socket_address with a port_value"))?;
    if let Some(Address::SocketAddress(sa)) =
        listener.address.as_ref().and_then(|a| a.address.as_ref())
        && sa.protocol != Protocol::Tcp as i32
    {
        return Err((
            "address.socket_address.protocol",
            "only TCP listeners become services",
        ));
    }
    Ok((address, port))
}

/// `weighted_clusters` as a chain named like the listener, split by a service-splitter.
fn split_form(
    name: &str,
    weighted: &WeightedCluster,
    mut service: Value,
) -> Result<ListenerForm, (&'static str, &'static str)> {
    let named: Vec<(String, u32)> = weighted
        .clusters
        .iter()
        .map(|c| (c.name.clone(), c.weight))
        .collect();
    let splits = percentages(&named).ok_or((
        "tcp_proxy.weighted_clusters",
        "needs at least one cluster and a total weight above 0",
    ))?;
    service["chain"] = json!(name);
    // Envoy splits TCP connections by weight; Consul's rules need the opt-in.
    service["chain_options"] = json!({"tcp_splits": true});
    let splitter = json!({"Kind": "service-splitter", "Name": name, "Splits": splits});
    Ok(ListenerForm {
        service,
        entries: vec![splitter],
        clusters: named.into_iter().map(|(n, _)| n).collect(),
        validate_clusters: false,
        rds: None,
    })
}

/// The typed config of the one filter of the listener's one filter chain.
fn one_filter<'l>(
    listener: &'l Listener,
    unsupported: &dyn Fn(&str) -> ResourceError,
    invalid: &dyn Fn(&str, &str) -> ResourceError,
) -> Result<&'l Any, ResourceError> {
    let [chain] = listener.filter_chains.as_slice() else {
        return Err(invalid(
            "filter_chains",
            "must hold exactly one filter chain",
        ));
    };
    let clear = |c: &mut envoy_types::pb::envoy::config::listener::v3::FilterChain| {
        c.filters.clear();
        c.name.clear();
    };
    let names = [
        (1, "filter_chain_match"),
        (5, "metadata"),
        (6, "transport_socket"),
    ];
    refuse_residual(chain, clear, &names, |f| {
        unsupported(&format!("filter_chains[0].{f}"))
    })?;
    let [filter] = chain.filters.as_slice() else {
        return Err(invalid(
            "filter_chains[0].filters",
            "must hold exactly one filter, tcp_proxy or http_connection_manager",
        ));
    };
    let Some(ConfigType::TypedConfig(any)) = &filter.config_type else {
        return Err(invalid(
            "filter_chains[0].filters[0]",
            "needs a typed_config",
        ));
    };
    Ok(any)
}

fn decode_tcp_proxy(
    any: &Any,
    unsupported: &dyn Fn(&str) -> ResourceError,
    invalid: &dyn Fn(&str, &str) -> ResourceError,
) -> Result<TcpProxy, ResourceError> {
    let at = "filter_chains[0].filters[0].typed_config";
    if any.type_url != TCP_PROXY_TYPE_URL {
        let reason = format!(
            "{} is not supported; only tcp_proxy and http_connection_manager are",
            any.type_url
        );
        return Err(invalid(at, &reason));
    }
    let proxy = TcpProxy::decode(any.value.as_slice()).map_err(|e| {
        invalid(
            "filter_chains[0].filters[0].typed_config",
            &format!("does not decode as TcpProxy: {e}"),
        )
    })?;
    let clear = |p: &mut TcpProxy| {
        p.stat_prefix.clear();
        p.cluster_specifier = None;
    };
    refuse_residual(&proxy, clear, TCP_PROXY_FIELDS, |f| {
        unsupported(&format!("tcp_proxy.{f}"))
    })?;
    Ok(proxy)
}

/// Checks listener services with the file's rules against the clusters they may name
/// (`known`: name and type), with their splitters; returns them typed, or the first refusal
/// naming its listener.
pub fn validate(
    forms: &[(String, ListenerForm)],
    known: &[(String, ClusterType)],
) -> Result<(Vec<Service>, Vec<proxy_chain::ConfigEntry>), ResourceError> {
    let stubs: Vec<Value> = known
        .iter()
        .map(|(name, kind)| {
            let kind = if *kind == ClusterType::OriginalDst {
                "ORIGINAL_DST"
            } else {
                "STATIC"
            };
            json!({"name": name, "type": kind})
        })
        .collect();
    let services: Vec<&Value> = forms.iter().map(|(_, f)| &f.service).collect();
    // Each entry once (two HTTP listeners may both declare one cluster's protocol), with the
    // listener that brought it first, to name it in a refusal.
    let mut entries: Vec<&Value> = Vec::new();
    let mut owners: Vec<(String, Value)> = Vec::new();
    for (name, form) in forms {
        for entry in &form.entries {
            if entries.contains(&entry) {
                continue;
            }
            entries.push(entry);
            let what = format!("generated {} {}", entry["Kind"], entry["Name"]);
            owners.push((name.clone(), Value::String(what)));
        }
    }
    let text =
        json!({"clusters": stubs, "services": services, "config_entries": entries}).to_string();
    let named: Vec<(String, Value)> = forms
        .iter()
        .map(|(n, _)| (n.clone(), Value::Null))
        .collect();
    match Config::parse_json(&text, Path::new("LDS")) {
        Ok(config) => Ok((config.services, config.config_entries)),
        Err(error) => {
            let in_entries = matches!(&error, ConfigError::Invalid { field, .. } if field.starts_with("config_entries"));
            if in_entries {
                Err(entry_refused(&error, &owners))
            } else {
                Err(located(&error, &named, "services", "listener"))
            }
        }
    }
}

/// A refusal of a generated config entry, named by its listener and the entry (kind and name).
fn entry_refused(error: &ConfigError, owners: &[(String, Value)]) -> ResourceError {
    let mut refused = located(error, owners, "config_entries", "listener");
    let index = match error {
        ConfigError::Invalid { field, .. } => field
            .strip_prefix("config_entries[")
            .and_then(|rest| rest.split_once(']'))
            .and_then(|(i, _)| i.parse::<usize>().ok()),
        ConfigError::Read { .. } => None,
    };
    if let ResourceError::Invalid { field, .. } = &mut refused
        && let Some((_, Value::String(what))) = index.and_then(|i| owners.get(i))
    {
        *field = if field.is_empty() {
            what.clone()
        } else {
            format!("{what}: {field}")
        };
    }
    refused
}
