//! CDS: Envoy `Cluster` resources in the file's [`Cluster`] form, checked by the file's rules.
//!
//! A resource is mapped field by field into the JSON the configuration file would hold, then
//! parsed and validated by [`Config::parse`], so a CDS cluster passes exactly the checks a file
//! cluster passes. A field this daemon does not honour is refused by name rather than dropped
//! (the residual message, with every honoured field cleared, must encode to nothing).
//!
//! Honoured: `name`, `type` (STATIC, STRICT_DNS, LOGICAL_DNS, EDS, ORIGINAL_DST), `lb_policy`
//! (as the proto says: unset is ROUND_ROBIN, Envoy's default), `connect_timeout`,
//! `load_assignment` (socket addresses with `port_value`, weights, health, priorities,
//! localities and their weights, `policy.overprovisioning_factor` and
//! `policy.weighted_priority_health`), `common_lb_config` (`healthy_panic_threshold`,
//! `locality_weighted_lb_config`),
//! `eds_cluster_config` (`service_name`; `eds_config` must be `ads: {}`), `dns_refresh_rate`,
//! `respect_dns_ttl`, `dns_lookup_family`, `cleanup_interval`,
//! `ignore_health_on_host_removal`, `close_connections_on_host_health_failure`,
//! `ring_hash_lb_config` and `maglev_lb_config` (their bounds and texts are Envoy's),
//! `circuit_breakers` (checked by the file's rules, which refuse what is not honoured).

use std::path::Path;

use envoy_types::pb::{
    envoy::config::{
        cluster::v3::{
            CircuitBreakers as ProtoBreakers, Cluster as ProtoCluster,
            circuit_breakers::Thresholds as ProtoThresholds,
            cluster::{
                ClusterDiscoveryType, DiscoveryType, DnsLookupFamily, LbConfig as ProtoLbConfig,
                LbPolicy, ring_hash_lb_config::HashFunction as RingHashFunction,
            },
        },
        core::v3::{
            Address, HealthStatus, RoutingPriority, address, config_source::ConfigSourceSpecifier,
            socket_address::PortSpecifier,
        },
        endpoint::v3::{
            ClusterLoadAssignment, LbEndpoint, endpoint::HealthCheckConfig,
            lb_endpoint::HostIdentifier,
        },
    },
    google::protobuf::Duration as ProtoDuration,
};
use prost::Message;
use serde_json::{Map, Value, json};
use thiserror::Error;

use self::balance::{common_lb_form, policy_form};
use crate::config::{Cluster, Config, ConfigError, duration, sources::xds::XdsConfig};

mod balance;

/// The type URL of `envoy.config.cluster.v3.Cluster`.
pub const CLUSTER_TYPE_URL: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";

/// Why a CDS or LDS resource is refused; the message names the resource and the field.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ResourceError {
    /// A field this daemon does not honour is set.
    #[error(
        "{kind} {name:?}: field {field} is not supported by this daemon (it would be ignored); remove it or serve this resource to Envoy only"
    )]
    Unsupported {
        /// `cluster` or `listener`.
        kind: &'static str,
        /// The resource name.
        name: String,
        /// The field's path in the resource.
        field: String,
    },
    /// A field's value is refused.
    #[error("{kind} {name:?}: {field}: {reason}")]
    Invalid {
        /// `cluster` or `listener`.
        kind: &'static str,
        /// The resource name.
        name: String,
        /// The field's path in the resource.
        field: String,
        /// What is wrong.
        reason: String,
    },
}

/// `msg` with the honoured fields cleared by `clear` must encode to nothing; otherwise the
/// first field left is refused, named from `names` (field number, name) or by its number.
pub(crate) fn refuse_residual<M: Message + Clone>(
    msg: &M,
    clear: impl FnOnce(&mut M),
    names: &[(u64, &str)],
    unsupported: impl FnOnce(String) -> ResourceError,
) -> Result<(), ResourceError> {
    let mut rest = msg.clone();
    clear(&mut rest);
    let bytes = rest.encode_to_vec();
    if bytes.is_empty() {
        return Ok(());
    }
    let number = prost::encoding::decode_varint(&mut bytes.as_slice()).unwrap_or(0) >> 3;
    let field = names.iter().find(|(n, _)| *n == number).map_or_else(
        || format!("number {number}"),
        |(_, name)| (*name).to_owned(),
    );
    Err(unsupported(field))
}

/// Field numbers of `envoy.config.cluster.v3.Cluster` not honoured here, for refusals.
const CLUSTER_FIELDS: &[(u64, &str)] = &[
    (5, "per_connection_buffer_limit_bytes"),
    (8, "health_checks"),
    (9, "max_requests_per_connection"),
    (13, "http_protocol_options"),
    (14, "http2_protocol_options"),
    (18, "dns_resolvers"),
    (19, "outlier_detection"),
    (21, "upstream_bind_config"),
    (22, "lb_subset_config"),
    (23, "ring_hash_lb_config"),
    (24, "transport_socket"),
    (25, "metadata"),
    (28, "alt_stat_name"),
    (29, "common_http_protocol_options"),
    (30, "upstream_connection_options"),
    (34, "original_dst_lb_config"),
    (36, "typed_extension_protocol_options"),
    (37, "least_request_lb_config"),
    (38, "cluster_type"),
    (40, "filters"),
    (41, "load_balancing_policy"),
    (42, "lrs_server"),
    (43, "transport_socket_matches"),
    (44, "dns_failure_refresh_rate"),
    (46, "upstream_http_protocol_options"),
    (52, "maglev_lb_config"),
    (54, "wait_for_warm_on_init"),
    (55, "typed_dns_resolver_config"),
    (58, "dns_jitter"),
];

/// `cluster` in the configuration file's JSON form, or the first field refused.
pub fn file_form(cluster: &ProtoCluster) -> Result<Value, ResourceError> {
    let name = cluster.name.clone();
    let unsupported = |field| ResourceError::Unsupported {
        kind: "cluster",
        name: name.clone(),
        field,
    };
    refuse_residual(cluster, clear_honoured, CLUSTER_FIELDS, unsupported)?;
    let invalid = |(field, reason): (String, String)| ResourceError::Invalid {
        kind: "cluster",
        name: name.clone(),
        field,
        reason,
    };
    let mut out = enums(cluster).map_err(invalid)?;
    scalars(cluster, &mut out).map_err(invalid)?;
    if let Some(cla) = &cluster.load_assignment {
        out.insert("load_assignment".into(), assignment(cla).map_err(invalid)?);
    }
    if let Some(eds) = &cluster.eds_cluster_config {
        out.insert("eds_cluster_config".into(), eds_form(eds).map_err(invalid)?);
    }
    if let Some((field, value)) = lb_config_form(cluster.lb_config.as_ref()) {
        out.insert(field.into(), value);
    }
    if let Some(common) = &cluster.common_lb_config {
        let form = common_lb_form(common).map_err(invalid)?;
        out.insert("common_lb_config".into(), form);
    }
    if let Some(breakers) = &cluster.circuit_breakers {
        let form = breakers_form(breakers).map_err(invalid)?;
        out.insert("circuit_breakers".into(), form);
    }
    Ok(Value::Object(out))
}

/// `ring_hash_lb_config` and `maglev_lb_config` in the file's form (their bounds are the file's
/// checks); the other `lb_config`s are refused by name with the residual.
fn lb_config_form(lb: Option<&ProtoLbConfig>) -> Option<(&'static str, Value)> {
    let mut form = Map::new();
    let mut size = |field: &str, value: Option<u64>| {
        if let Some(v) = value {
            form.insert(field.into(), json!(v));
        }
    };
    let field = match lb? {
        ProtoLbConfig::RingHashLbConfig(ring) => {
            size("minimum_ring_size", ring.minimum_ring_size.map(|v| v.value));
            size("maximum_ring_size", ring.maximum_ring_size.map(|v| v.value));
            let function = RingHashFunction::try_from(ring.hash_function).map_or_else(
                |_| ring.hash_function.to_string(),
                |f| f.as_str_name().into(),
            );
            form.insert("hash_function".into(), json!(function));
            "ring_hash_lb_config"
        }
        ProtoLbConfig::MaglevLbConfig(maglev) => {
            size("table_size", maglev.table_size.map(|v| v.value));
            "maglev_lb_config"
        }
        _ => return None,
    };
    Some((field, Value::Object(form)))
}

/// The name and the enumerations: `type`, `lb_policy` (unset is ROUND_ROBIN, as the proto
/// says) and `dns_lookup_family`.
fn enums(cluster: &ProtoCluster) -> Result<Map<String, Value>, (String, String)> {
    let invalid = |field: &str, reason: String| (field.to_owned(), reason);
    let kind = match cluster.cluster_discovery_type {
        None => DiscoveryType::Static,
        Some(ClusterDiscoveryType::Type(t)) => DiscoveryType::try_from(t)
            .map_err(|_| invalid("type", format!("unknown discovery type {t}")))?,
        Some(ClusterDiscoveryType::ClusterType(_)) => {
            let reason = "custom cluster types are not supported over CDS; use type".to_owned();
            return Err(invalid("cluster_type", reason));
        }
    };
    let lb = LbPolicy::try_from(cluster.lb_policy)
        .map_err(|_| invalid("lb_policy", format!("unknown policy {}", cluster.lb_policy)))?;
    let family = DnsLookupFamily::try_from(cluster.dns_lookup_family)
        .map_err(|_| invalid("dns_lookup_family", "unknown family".to_owned()))?;
    let mut out = Map::new();
    out.insert("name".into(), json!(cluster.name));
    out.insert("type".into(), json!(kind.as_str_name()));
    out.insert("lb_policy".into(), json!(lb.as_str_name()));
    out.insert("dns_lookup_family".into(), json!(family.as_str_name()));
    Ok(out)
}

/// The durations and flags, into `out`.
#[expect(
    deprecated,
    reason = "Envoy 1.40 still honours the DNS fields on Cluster (deprecated for DnsCluster)"
)]
fn scalars(cluster: &ProtoCluster, out: &mut Map<String, Value>) -> Result<(), (String, String)> {
    let durations = [
        ("connect_timeout", cluster.connect_timeout.as_ref()),
        ("dns_refresh_rate", cluster.dns_refresh_rate.as_ref()),
        ("cleanup_interval", cluster.cleanup_interval.as_ref()),
    ];
    for (field, value) in durations {
        if let Some(d) = value {
            let text = text_duration(d).ok_or_else(|| {
                (
                    field.to_owned(),
                    "must be a non-negative duration".to_owned(),
                )
            })?;
            out.insert(field.into(), json!(text));
        }
    }
    let flags = [
        ("respect_dns_ttl", cluster.respect_dns_ttl),
        (
            "ignore_health_on_host_removal",
            cluster.ignore_health_on_host_removal,
        ),
        (
            "close_connections_on_host_health_failure",
            cluster.close_connections_on_host_health_failure,
        ),
    ];
    for (field, set) in flags {
        if set {
            out.insert(field.into(), json!(true));
        }
    }
    Ok(())
}

#[expect(deprecated, reason = "the DNS fields file_form honours")]
fn clear_honoured(c: &mut ProtoCluster) {
    c.name.clear();
    c.cluster_discovery_type = None;
    c.lb_policy = 0;
    c.connect_timeout = None;
    c.load_assignment = None;
    c.eds_cluster_config = None;
    c.dns_refresh_rate = None;
    c.respect_dns_ttl = false;
    c.dns_lookup_family = 0;
    c.cleanup_interval = None;
    c.ignore_health_on_host_removal = false;
    c.close_connections_on_host_health_failure = false;
    if matches!(
        c.lb_config,
        Some(ProtoLbConfig::RingHashLbConfig(_) | ProtoLbConfig::MaglevLbConfig(_))
    ) {
        c.lb_config = None;
    }
    c.circuit_breakers = None;
    c.common_lb_config = None;
}

/// `circuit_breakers` in the file's form. Fields not honoured (`retry_budget`,
/// `max_connection_pools`, `per_host_thresholds`) are carried over for the file's rules to
/// refuse by name.
fn breakers_form(breakers: &ProtoBreakers) -> Result<Value, (String, String)> {
    let form = |i: usize, t: &ProtoThresholds| -> Result<Value, (String, String)> {
        let priority = RoutingPriority::try_from(t.priority).map_err(|_| {
            (
                format!("circuit_breakers.thresholds[{i}].priority"),
                format!("unknown priority {}", t.priority),
            )
        })?;
        let mut out = json!({"priority": priority.as_str_name()});
        for (field, value) in [
            ("max_connections", t.max_connections),
            ("max_pending_requests", t.max_pending_requests),
            ("max_requests", t.max_requests),
            ("max_retries", t.max_retries),
            ("max_connection_pools", t.max_connection_pools),
        ] {
            if let Some(v) = value {
                out[field] = json!(v.value);
            }
        }
        if t.track_remaining {
            out["track_remaining"] = json!(true);
        }
        if t.retry_budget.is_some() {
            out["retry_budget"] = json!({});
        }
        Ok(out)
    };
    let thresholds = breakers.thresholds.iter().enumerate();
    let mut out =
        json!({"thresholds": thresholds.map(|(i, t)| form(i, t)).collect::<Result<Vec<_>, _>>()?});
    if !breakers.per_host_thresholds.is_empty() {
        out["per_host_thresholds"] = json!([]);
    }
    Ok(out)
}

/// Envoy's JSON duration text of `d`; `None` when negative or out of range.
fn text_duration(d: &ProtoDuration) -> Option<String> {
    let secs = u64::try_from(d.seconds).ok()?;
    let nanos = u32::try_from(d.nanos).ok().filter(|n| *n < 1_000_000_000)?;
    Some(duration::format(std::time::Duration::new(secs, nanos)))
}

/// `eds_cluster_config` in the file's form: only `eds_config: {ads: {}}` is taken, since a
/// CDS cluster's endpoints come on the ADS stream that delivered it.
fn eds_form(
    eds: &envoy_types::pb::envoy::config::cluster::v3::cluster::EdsClusterConfig,
) -> Result<Value, (String, String)> {
    let source = eds.eds_config.as_ref();
    if !matches!(
        source.and_then(|s| s.config_source_specifier.as_ref()),
        Some(ConfigSourceSpecifier::Ads(_))
    ) {
        return Err((
            "eds_cluster_config.eds_config".into(),
            "only `ads: {}` is supported: a CDS cluster's endpoints come over the ADS stream that delivered it".into(),
        ));
    }
    let mut config = json!({"ads": {}});
    if let Some(timeout) = source.and_then(|s| s.initial_fetch_timeout.as_ref()) {
        let text = text_duration(timeout).ok_or_else(|| {
            (
                "eds_cluster_config.eds_config.initial_fetch_timeout".to_owned(),
                "must be a non-negative duration".to_owned(),
            )
        })?;
        config["initial_fetch_timeout"] = json!(text);
    }
    let mut out = json!({ "eds_config": config });
    if !eds.service_name.is_empty() {
        out["service_name"] = json!(eds.service_name);
    }
    Ok(out)
}

/// Field numbers of `LbEndpoint` not honoured.
const LB_ENDPOINT_FIELDS: &[(u64, &str)] = &[(3, "metadata"), (5, "endpoint_name")];

/// An inline `load_assignment` in the file's form: socket addresses with a port value,
/// weights, health, priorities, localities with their weights, and the `policy`.
fn assignment(cla: &ClusterLoadAssignment) -> Result<Value, (String, String)> {
    if !cla.named_endpoints.is_empty() {
        return Err((
            "load_assignment.named_endpoints".into(),
            "is not supported".into(),
        ));
    }
    let mut groups = Vec::new();
    for (i, group) in cla.endpoints.iter().enumerate() {
        let mut lbs = Vec::new();
        for (j, lb) in group.lb_endpoints.iter().enumerate() {
            let at = format!("load_assignment.endpoints[{i}].lb_endpoints[{j}]");
            lbs.push(lb_endpoint(lb).map_err(|(f, r)| (format!("{at}.{f}"), r))?);
        }
        if group.lb_config.is_some() {
            return Err((
                format!("load_assignment.endpoints[{i}]"),
                "LEDS (leds_cluster_locality_config) is not supported".into(),
            ));
        }
        let mut form = json!({"lb_endpoints": lbs, "priority": group.priority});
        if let Some(l) = &group.locality {
            form["locality"] = json!({"region": l.region, "zone": l.zone, "sub_zone": l.sub_zone});
        }
        if let Some(w) = group.load_balancing_weight {
            form["load_balancing_weight"] = json!(w.value);
        }
        groups.push(form);
    }
    let mut out = json!({"cluster_name": cla.cluster_name, "endpoints": groups});
    if let Some(policy) = &cla.policy {
        out["policy"] = policy_form(policy)?;
    }
    Ok(out)
}

/// Refuses an `LbEndpoint` field not honoured (`metadata`, `endpoint_name`, ...).
fn endpoint_residual(lb: &LbEndpoint) -> Result<(), (String, String)> {
    let clear = |l: &mut LbEndpoint| {
        l.host_identifier = None;
        l.health_status = 0;
        l.load_balancing_weight = None;
    };
    let unsupported = |field| ResourceError::Unsupported {
        kind: "cluster",
        name: String::new(),
        field,
    };
    refuse_residual(lb, clear, LB_ENDPOINT_FIELDS, unsupported).map_err(|e| match e {
        ResourceError::Unsupported { field, .. } | ResourceError::Invalid { field, .. } => {
            (field, "is not supported".to_owned())
        }
    })
}

fn lb_endpoint(lb: &LbEndpoint) -> Result<Value, (String, String)> {
    endpoint_residual(lb)?;
    let Some(HostIdentifier::Endpoint(endpoint)) = &lb.host_identifier else {
        return Err((
            "endpoint".into(),
            "must be an endpoint (not a named one)".into(),
        ));
    };
    if !endpoint.additional_addresses.is_empty() {
        let reason = "additional_addresses are not supported";
        return Err(("endpoint".into(), reason.into()));
    }
    if let Some(address::Address::SocketAddress(sa)) =
        endpoint.address.as_ref().and_then(|a| a.address.as_ref())
        && !sa.resolver_name.is_empty()
    {
        return Err((
            "endpoint.address.socket_address.resolver_name".to_owned(),
            format!(
                "is not supported ({:?}: this daemon has no custom address resolvers)",
                sa.resolver_name
            ),
        ));
    }
    let (address, port) = socket_address(endpoint.address.as_ref()).ok_or_else(|| {
        (
            "endpoint.address".to_owned(),
            "must be a socket_address with a port_value".to_owned(),
        )
    })?;
    let health = HealthStatus::try_from(lb.health_status)
        .map_err(|_| ("health_status".to_owned(), "unknown status".to_owned()))?;
    let mut out = json!({
        "endpoint": {"address": {"socket_address": {"address": address, "port_value": port}}},
        "health_status": health.as_str_name(),
    });
    if let Some(w) = lb.load_balancing_weight {
        out["load_balancing_weight"] = json!(w.value);
    }
    if !endpoint.hostname.is_empty() {
        out["endpoint"]["hostname"] = json!(endpoint.hostname);
    }
    if let Some(check) = &endpoint.health_check_config {
        out["endpoint"]["health_check_config"] = endpoint_check(check)?;
    }
    Ok(out)
}

/// `Endpoint.health_check_config` in the file's form (`config::EndpointHealthCheck`), which
/// the file's rules then check.
fn endpoint_check(check: &HealthCheckConfig) -> Result<Value, (String, String)> {
    let mut out = json!({
        "port_value": check.port_value,
        "hostname": check.hostname,
        "disable_active_health_check": check.disable_active_health_check,
    });
    if let Some(address) = &check.address {
        let (ip, port) = socket_address(Some(address)).ok_or_else(|| {
            (
                "endpoint.health_check_config.address".to_owned(),
                "must be a socket_address with a port_value".to_owned(),
            )
        })?;
        out["address"] = json!({"socket_address": {"address": ip, "port_value": port}});
    }
    Ok(out)
}

/// The address and port of a `socket_address` with a `port_value`.
pub(crate) fn socket_address(address: Option<&Address>) -> Option<(String, u32)> {
    let Some(address::Address::SocketAddress(sa)) = address?.address.as_ref() else {
        return None;
    };
    match sa.port_specifier {
        Some(PortSpecifier::PortValue(port)) => Some((sa.address.clone(), port)),
        _ => None,
    }
}

/// Checks the file forms of clusters (`(name, form)`, each form as JSON text) with the file's
/// rules, with the running `xds` block (EDS clusters need its ADS server); returns them typed,
/// or the first refusal naming its cluster.
pub fn validate<T: AsRef<str>>(
    forms: &[(String, T)],
    xds: &XdsConfig,
) -> Result<Vec<Cluster>, ResourceError> {
    // `{"xds": ...}` with the clusters' texts put in front of it, as they are.
    let tail = json!({ "xds": xds }).to_string();
    let total = forms
        .iter()
        .map(|(_, f)| f.as_ref().len() + 1)
        .sum::<usize>();
    let mut text = String::with_capacity(total + tail.len() + 16);
    text.push_str("{\"clusters\":[");
    for (i, (_, form)) in forms.iter().enumerate() {
        if i > 0 {
            text.push(',');
        }
        text.push_str(form.as_ref());
    }
    text.push_str("],");
    text.push_str(tail.strip_prefix('{').unwrap_or(&tail));
    match Config::parse_json(&text, Path::new("CDS")) {
        Ok(config) => Ok(config.clusters),
        Err(error) => Err(located(&error, forms, "clusters", "cluster")),
    }
}

/// A [`ConfigError`] about `<list>[i].field` as a refusal of the `i`th resource of `names`.
pub(crate) fn located<T>(
    error: &ConfigError,
    names: &[(String, T)],
    list: &str,
    kind: &'static str,
) -> ResourceError {
    let (field, reason) = match error {
        ConfigError::Invalid { field, message, .. } => (field.clone(), message.clone()),
        ConfigError::Read { .. } => (String::new(), error.to_string()),
    };
    let indexed = field.strip_prefix(list).and_then(|rest| {
        let rest = rest.strip_prefix('[')?;
        let (index, tail) = rest.split_once(']')?;
        let name = &names.get(index.parse::<usize>().ok()?)?.0;
        Some((name.clone(), tail.trim_start_matches('.').to_owned()))
    });
    let (name, field) = indexed.unwrap_or_else(|| (String::new(), field));
    ResourceError::Invalid {
        kind,
        name,
        field,
        reason,
    }
}
