//! Cluster fields that the cluster's discovery type never reads: refused by name, so that
//! nothing in a cluster is ignored silently (Envoy accepts most of them and ignores them).

use super::{
    Cluster, ClusterType,
    error::Invalid,
    sources::dns::{DnsSettings, QueryLimits, dns_cluster_fields},
};

/// Refuses a field of cluster `i` that its type does not read. Runs after
/// [`super::envoy::normalize`], so `envoy.cluster.dns` clusters are STRICT_DNS or LOGICAL_DNS
/// here and a `typed_dns_resolver_config` has become `dns_resolvers` and its query limits.
pub(super) fn refuse_unread(i: usize, cluster: &Cluster) -> Result<(), Invalid> {
    let at = |field: &str| format!("clusters[{i}].{field}");
    let custom = cluster
        .custom_cluster_type
        .as_ref()
        .map(|c| c.name.as_str());
    let kind = custom.unwrap_or(match cluster.cluster_type {
        ClusterType::Static => "STATIC",
        ClusterType::StrictDns => "STRICT_DNS",
        ClusterType::LogicalDns => "LOGICAL_DNS",
        ClusterType::Eds => "EDS",
        ClusterType::OriginalDst => "ORIGINAL_DST",
    });
    let refuse = |field: &str, why: &str| {
        Err(Invalid::new(
            at(field),
            format!(
                "{} {kind} cluster does not read {field} ({why}); remove it",
                article(kind)
            ),
        ))
    };
    if custom.is_some() && cluster.cluster_type != ClusterType::Static {
        return refuse(
            "type",
            "its cluster_type names the discovery, as Envoy takes one of type and cluster_type",
        );
    }
    let eds = custom.is_none() && cluster.cluster_type == ClusterType::Eds;
    if cluster.eds_cluster_config.is_some() && !eds {
        return refuse("eds_cluster_config", "only EDS clusters subscribe to EDS");
    }
    if cluster.load_assignment.is_some() && (eds || custom.is_some()) {
        return refuse("load_assignment", "its hosts come from its discovery");
    }
    if custom.is_some() && cluster.cleanup_interval.is_some() {
        return refuse("cleanup_interval", "only ORIGINAL_DST clusters flush hosts");
    }
    if custom.is_some() && cluster.original_dst_lb_config.is_some() {
        return refuse(
            "original_dst_lb_config",
            "only ORIGINAL_DST clusters read original destinations",
        );
    }
    let resolves = match custom {
        Some(name) => name == super::DNS_SRV_CLUSTER,
        None => matches!(
            cluster.cluster_type,
            ClusterType::StrictDns | ClusterType::LogicalDns
        ),
    };
    // Not in `dns_field_set`: `envoy.cluster.dns`'s typed_config has no such field, so it stays
    // on the cluster beside it.
    let stale = cluster
        .dns_stale_bound
        .is_some()
        .then_some("dns_stale_bound");
    match dns_field_set(cluster).or(stale) {
        Some(field) if !resolves => refuse(field, "it resolves no names"),
        _ => Ok(()),
    }
}

/// "a" or "an" before `word`, as it is read.
fn article(word: &str) -> &'static str {
    if word.starts_with(['E', 'O']) {
        "an"
    } else {
        "a"
    }
}

/// The first DNS field of `cluster` that differs from its default, of those an
/// `envoy.cluster.dns` typed_config would hold (`dns_resolvers` as its resolver's).
pub(super) fn dns_field_set(cluster: &Cluster) -> Option<&'static str> {
    let defaults = DnsSettings::default();
    dns_cluster_fields!(@changed cluster, defaults)
        .into_iter()
        .chain([
            (!cluster.dns_resolvers.is_empty(), "dns_resolvers"),
            (
                cluster.dns_query_limits != QueryLimits::default(),
                "typed_dns_resolver_config",
            ),
        ])
        .find_map(|(on, field)| on.then_some(field))
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use crate::config::Config;

    const HOST: &str = "load_assignment: { endpoints: [ { lb_endpoints: [ { endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: 8080 } } } } ] } ] }";

    fn refusal(cluster: &str) -> (String, String) {
        let text = format!("clusters:\n  - {cluster}\n");
        let err = Config::parse(&text, Path::new("t.yaml")).expect_err(cluster);
        let crate::config::ConfigError::Invalid { field, at, .. } = &err else {
            panic!("{cluster}: {err}");
        };
        assert_eq!(at.line, 2, "{err}");
        (field.clone(), err.to_string())
    }

    #[test]
    fn a_field_the_cluster_type_does_not_read_is_refused_by_name() {
        let consul =
            "cluster_type: { name: proxy.clusters.consul, typed_config: { service: web } }";
        let eds = "type: EDS, eds_cluster_config: { eds_config: { ads: {} } }";
        for (cluster, field, why) in [
            (
                format!(
                    "{{ name: a, {HOST}, eds_cluster_config: {{ eds_config: {{ ads: {{}} }} }} }}"
                ),
                "eds_cluster_config",
                "a STATIC cluster does not read eds_cluster_config",
            ),
            (
                format!("{{ name: a, {eds}, {HOST} }}"),
                "load_assignment",
                "an EDS cluster",
            ),
            (
                format!("{{ name: a, {consul}, {HOST} }}"),
                "load_assignment",
                "a proxy.clusters.consul cluster does not read load_assignment",
            ),
            (
                format!("{{ name: a, {consul}, type: STRICT_DNS }}"),
                "type",
                "one of type and cluster_type",
            ),
            (
                format!("{{ name: a, {consul}, cleanup_interval: 1s }}"),
                "cleanup_interval",
                "only ORIGINAL_DST",
            ),
            (
                format!(
                    "{{ name: a, {consul}, original_dst_lb_config: {{ use_http_header: true }} }}"
                ),
                "original_dst_lb_config",
                "original destinations",
            ),
            (
                format!("{{ name: a, {consul}, dns_lookup_family: V4_ONLY }}"),
                "dns_lookup_family",
                "resolves no names",
            ),
            (
                format!("{{ name: a, {HOST}, dns_refresh_rate: 1s }}"),
                "dns_refresh_rate",
                "resolves no names",
            ),
            (
                format!("{{ name: a, {HOST}, respect_dns_ttl: true }}"),
                "respect_dns_ttl",
                "resolves no names",
            ),
            (
                format!("{{ name: a, {HOST}, dns_stale_bound: 30s }}"),
                "dns_stale_bound",
                "a STATIC cluster does not read dns_stale_bound (it resolves no names)",
            ),
            (
                format!("{{ name: a, {consul}, dns_stale_bound: 30s }}"),
                "dns_stale_bound",
                "resolves no names",
            ),
            (
                format!("{{ name: a, {eds}, dns_resolvers: [\"127.0.0.1:53\"] }}"),
                "dns_resolvers",
                "resolves no names",
            ),
            (
                format!(
                    "{{ name: a, {HOST}, typed_dns_resolver_config: {{ name: envoy.network.dns_resolver.cares, typed_config: {{ query_tries: 2 }} }} }}"
                ),
                "typed_dns_resolver_config",
                "resolves no names",
            ),
        ] {
            let (at, text) = refusal(&cluster);
            assert_eq!(at, format!("clusters[0].{field}"), "{cluster}: {text}");
            assert!(text.contains(why), "{cluster}: {text}");
        }
    }

    #[test]
    fn the_fields_a_type_reads_pass() {
        for cluster in [
            format!("{{ name: a, type: STRICT_DNS, {HOST}, dns_refresh_rate: 1s, dns_lookup_family: V4_ONLY }}"),
            "{ name: a, type: EDS, eds_cluster_config: { eds_config: { ads: {} } } }".to_owned(),
            "{ name: a, cluster_type: { name: proxy.clusters.dns_srv, typed_config: { service_names: [_web._tcp.test] } }, dns_refresh_rate: 1s }".to_owned(),
            format!("{{ name: a, {HOST}, dns_refresh_rate: 5s }}"),
            format!("{{ name: a, type: STRICT_DNS, {HOST}, dns_stale_bound: 30s }}"),
            format!("{{ name: a, type: LOGICAL_DNS, {HOST}, dns_stale_bound: 0.5s }}"),
            "{ name: a, cluster_type: { name: proxy.clusters.dns_srv, typed_config: { service_names: [_web._tcp.test] } }, dns_stale_bound: 30s }".to_owned(),
            format!("{{ name: a, cluster_type: {{ name: envoy.cluster.dns, typed_config: {{ dns_refresh_rate: 1s }} }}, {HOST}, dns_stale_bound: 30s }}"),
        ] {
            let xds = "xds: { node: { id: n }, ads_config: { api_type: GRPC, server_uri: \"127.0.0.1:18000\" } }\n";
            let xds = if cluster.contains("EDS") { xds } else { "" };
            let text = format!("{xds}clusters:\n  - {cluster}\n");
            Config::parse(&text, Path::new("t.yaml")).expect(&cluster);
        }
    }

    /// With `envoy.cluster.dns`, the cluster's own DNS fields were overwritten by the
    /// typed_config's (or, for a resolver, overrode them): each is refused, naming it.
    #[test]
    fn a_dns_field_beside_an_envoy_dns_cluster_is_refused() {
        let dns =
            "cluster_type: { name: envoy.cluster.dns, typed_config: { dns_refresh_rate: 1s } }";
        for (field, value) in [
            ("dns_refresh_rate", "2s"),
            ("dns_lookup_family", "V4_ONLY"),
            ("respect_dns_ttl", "true"),
            (
                "typed_dns_resolver_config",
                "{ name: envoy.network.dns_resolver.getaddrinfo }",
            ),
            ("type", "LOGICAL_DNS"),
        ] {
            let cluster = format!("{{ name: a, {dns}, {field}: {value} }}");
            let (at, text) = refusal(&cluster);
            assert_eq!(at, format!("clusters[0].{field}"), "{text}");
            assert!(
                text.contains("with cluster_type envoy.cluster.dns"),
                "{text}"
            );
        }
    }
}
