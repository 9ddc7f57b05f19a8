//! Envoy's newer spellings of fields the daemon already has, turned into those fields when a file
//! is validated, so every later stage sees one form:
//!
//! - `cluster_type: {name: envoy.cluster.dns, typed_config: DnsCluster}` (Envoy 1.40's
//!   non-deprecated form of DNS clusters) becomes `type: STRICT_DNS`, or `LOGICAL_DNS` with
//!   `all_addresses_in_single_endpoint: true`, with the DNS fields of the `typed_config`. As in
//!   Envoy, the cluster's top-level DNS fields are then not read.
//! - `typed_dns_resolver_config` (the c-ares or getaddrinfo resolver extension) becomes
//!   `dns_resolvers`, and c-ares' `query_timeout_seconds` and `query_tries` the cluster's
//!   `dns_query_limits`.
//!
//! A field of these messages that the daemon would not honour is an error naming it, never
//! silently dropped.

use std::time::Duration;

use serde::Deserialize;

use super::{Cluster, ClusterType, error::Invalid};
use crate::config::{
    fields::splice,
    sources::dns::{DnsResolverAddress, QueryLimits, dns_cluster_fields},
};

/// `cluster_type.name` of Envoy's DNS cluster extension.
pub const DNS_CLUSTER: &str = "envoy.cluster.dns";
const DNS_CLUSTER_TYPE: &str = "type.googleapis.com/envoy.extensions.clusters.dns.v3.DnsCluster";
const CARES: &str = "envoy.network.dns_resolver.cares";
const CARES_TYPE: &str =
    "type.googleapis.com/envoy.extensions.network.dns_resolver.cares.v3.CaresDnsResolverConfig";
const GETADDRINFO: &str = "envoy.network.dns_resolver.getaddrinfo";
const GETADDRINFO_TYPE: &str = "type.googleapis.com/envoy.extensions.network.dns_resolver.getaddrinfo.v3.GetAddrInfoDnsResolverConfig";

/// Envoy's `TypedExtensionConfig` as `typed_dns_resolver_config` holds it.
#[derive(Clone, Debug, PartialEq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct TypedDnsResolverConfig {
    /// `envoy.network.dns_resolver.cares` or `envoy.network.dns_resolver.getaddrinfo`.
    pub name: String,
    /// The resolver's settings (`CaresDnsResolverConfig` or `GetAddrInfoDnsResolverConfig`).
    #[serde(default)]
    pub typed_config: serde_json::Value,
}

splice! {
    {
        /// `envoy.extensions.clusters.dns.v3.DnsCluster`: its own fields, then the DNS fields
        /// it shares with the file's `Cluster` (`dns_cluster_fields`). `dns_lookup_family:
        /// UNSPECIFIED` (the proto's zero) means AUTO, as in Envoy.
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct DnsCluster {
            #[serde(rename = "@type", default)]
            type_url: Option<String>,
            #[serde(default)]
            typed_dns_resolver_config: Option<TypedDnsResolverConfig>,
            #[serde(default)]
            all_addresses_in_single_endpoint: bool,
        }
    }
    [dns_cluster_fields]
}

/// `envoy.extensions.network.dns_resolver.cares.v3.CaresDnsResolverConfig`, the fields the
/// daemon honours (an unknown or unhonoured one is an error).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Cares {
    #[serde(rename = "@type", default)]
    type_url: Option<String>,
    #[serde(default)]
    resolvers: Vec<DnsResolverAddress>,
    #[serde(default)]
    use_resolvers_as_fallback: bool,
    #[serde(default)]
    dns_resolver_options: Option<ResolverOptions>,
    /// How long one try waits, in seconds (Envoy's default 5).
    #[serde(default)]
    query_timeout_seconds: Option<u64>,
    /// Tries per query (Envoy's default 4).
    #[serde(default)]
    query_tries: Option<u32>,
}

/// The most tries per query accepted (Envoy takes any count from 1).
const MAX_QUERY_TRIES: u32 = 255;
/// The longest try accepted, in seconds (Envoy takes any from 1).
const MAX_QUERY_TIMEOUT_SECONDS: u64 = 3600;

/// `envoy.config.core.v3.DnsResolverOptions`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ResolverOptions {
    #[serde(default)]
    use_tcp_for_dns_lookups: bool,
    #[serde(default)]
    no_default_search_domain: bool,
}

/// `GetAddrInfoDnsResolverConfig`: the system's resolver, which is what an empty
/// `dns_resolvers` means here. Its thread and retry knobs have no counterpart.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct GetAddrInfo {
    #[serde(rename = "@type", default)]
    type_url: Option<String>,
}

/// Rewrites cluster `i`'s Envoy forms into the daemon's own fields. Idempotent: the forms are
/// taken out of the cluster once rewritten.
pub(super) fn normalize(i: usize, cluster: &mut Cluster) -> Result<(), Invalid> {
    let at = |field: &str| format!("clusters[{i}].{field}");
    if cluster
        .custom_cluster_type
        .as_ref()
        .is_some_and(|c| c.name == DNS_CLUSTER)
    {
        refuse_top_level_dns(cluster).map_err(|(field, why)| Invalid::new(at(field), why))?;
        let custom = cluster.custom_cluster_type.take().expect("checked above");
        let field = |inner: &str| at(&format!("cluster_type.typed_config{inner}"));
        let dns: DnsCluster = serde_path_to_error::deserialize(&custom.typed_config)
            .map_err(|e| Invalid::new(field(&path_suffix(e.path())), e.into_inner().to_string()))?;
        check_type_url(dns.type_url.as_deref(), DNS_CLUSTER_TYPE, || {
            field(".@type")
        })?;
        cluster.cluster_type = if dns.all_addresses_in_single_endpoint {
            ClusterType::LogicalDns
        } else {
            ClusterType::StrictDns
        };
        dns_cluster_fields!(@assign cluster, dns);
        (cluster.dns_resolvers, cluster.dns_query_limits) = match dns.typed_dns_resolver_config {
            Some(resolver) => resolvers(&resolver, &field(".typed_dns_resolver_config"))?,
            None => (Vec::new(), QueryLimits::default()),
        };
    }
    if let Some(resolver) = cluster.typed_dns_resolver_config.take() {
        if !cluster.dns_resolvers.is_empty() {
            return Err(Invalid::new(
                at("typed_dns_resolver_config"),
                "set either dns_resolvers or typed_dns_resolver_config, not both",
            ));
        }
        (cluster.dns_resolvers, cluster.dns_query_limits) =
            resolvers(&resolver, &at("typed_dns_resolver_config"))?;
    }
    Ok(())
}

/// A DNS field set on a cluster whose `envoy.cluster.dns` typed_config holds its DNS settings
/// (Envoy reads only those): it would be overwritten, so it is refused, naming it.
fn refuse_top_level_dns(cluster: &Cluster) -> Result<(), (&'static str, String)> {
    let field = super::unread::dns_field_set(cluster).or_else(|| {
        let resolver = cluster.typed_dns_resolver_config.is_some();
        resolver.then_some("typed_dns_resolver_config")
    });
    if let Some(field) = field {
        return Err((
            field,
            format!(
                "with cluster_type {DNS_CLUSTER}, {field} is read from its typed_config only (as in \
                 Envoy); move it there"
            ),
        ));
    }
    if cluster.cluster_type != ClusterType::Static {
        let why = format!(
            "with cluster_type {DNS_CLUSTER}, all_addresses_in_single_endpoint decides between \
             STRICT_DNS and LOGICAL_DNS (Envoy takes one of type and cluster_type); remove type"
        );
        return Err(("type", why));
    }
    Ok(())
}

/// The name servers a resolver extension names (none: the system's resolv.conf) and how its
/// queries are tried.
fn resolvers(
    resolver: &TypedDnsResolverConfig,
    at: &str,
) -> Result<(Vec<DnsResolverAddress>, QueryLimits), Invalid> {
    let typed = |inner: &str| format!("{at}.typed_config{inner}");
    match resolver.name.as_str() {
        CARES => {
            let cares: Cares =
                serde_path_to_error::deserialize(&resolver.typed_config).map_err(|e| {
                    Invalid::new(typed(&path_suffix(e.path())), e.into_inner().to_string())
                })?;
            check_type_url(cares.type_url.as_deref(), CARES_TYPE, || typed(".@type"))?;
            if cares.use_resolvers_as_fallback {
                return Err(Invalid::new(
                    typed(".use_resolvers_as_fallback"),
                    "is not supported: the listed resolvers replace resolv.conf's (the default, false)",
                ));
            }
            if let Some(options) = cares.dns_resolver_options {
                if options.use_tcp_for_dns_lookups {
                    return Err(Invalid::new(
                        typed(".dns_resolver_options.use_tcp_for_dns_lookups"),
                        "is not supported: queries go over UDP, and over TCP when an answer is truncated",
                    ));
                }
                // Listed resolvers are asked for names as written, never expanded by
                // resolv.conf's search list: that is `true`, and docs/differences.md lists `false` with
                // listed resolvers as a difference. Without listed resolvers the system's
                // search list applies, which `true` would forbid.
                if options.no_default_search_domain && cares.resolvers.is_empty() {
                    return Err(Invalid::new(
                        typed(".dns_resolver_options.no_default_search_domain"),
                        "is only supported with listed resolvers (the system resolver applies resolv.conf's search list)",
                    ));
                }
            }
            let mut limits = QueryLimits::default();
            if let Some(seconds) = cares.query_timeout_seconds {
                if !(1..=MAX_QUERY_TIMEOUT_SECONDS).contains(&seconds) {
                    return Err(Invalid::new(
                        typed(".query_timeout_seconds"),
                        format!("is {seconds}; must be 1 to {MAX_QUERY_TIMEOUT_SECONDS}"),
                    ));
                }
                limits.timeout = Duration::from_secs(seconds);
            }
            if let Some(tries) = cares.query_tries {
                limits.tries = u8::try_from(tries)
                    .ok()
                    .filter(|t| *t >= 1)
                    .ok_or_else(|| {
                        Invalid::new(
                            typed(".query_tries"),
                            format!("is {tries}; must be 1 to {MAX_QUERY_TRIES}"),
                        )
                    })?;
            }
            Ok((cares.resolvers, limits))
        }
        GETADDRINFO => {
            let gai: GetAddrInfo = serde_path_to_error::deserialize(&resolver.typed_config)
                .map_err(|e| {
                    Invalid::new(typed(&path_suffix(e.path())), e.into_inner().to_string())
                })?;
            check_type_url(gai.type_url.as_deref(), GETADDRINFO_TYPE, || {
                typed(".@type")
            })?;
            Ok((Vec::new(), QueryLimits::default()))
        }
        other => Err(Invalid::new(
            format!("{at}.name"),
            format!("unknown DNS resolver {other:?}; this build has {CARES} and {GETADDRINFO}"),
        )),
    }
}

/// An `@type`, when given, must be the message the extension takes.
fn check_type_url(
    given: Option<&str>,
    expected: &str,
    at: impl Fn() -> String,
) -> Result<(), Invalid> {
    match given {
        Some(url) if url != expected => Err(Invalid::new(
            at(),
            format!("is {url:?}; this extension takes {expected:?}"),
        )),
        _ => Ok(()),
    }
}

/// serde_path_to_error's path as a suffix of a field path (`.` alone is the value itself).
fn path_suffix(path: &serde_path_to_error::Path) -> String {
    let path = path.to_string();
    if path == "." {
        String::new()
    } else {
        format!(".{path}")
    }
}

/// The paths of the `typed_config`s read here, under `custom` (a cluster's `cluster_type`),
/// for the table of accepted fields in docs/fields.md and the configuration reference
/// (`field_table`).
#[cfg(test)]
pub(crate) fn typed_trace(custom: &str) -> crate::field_table::tracer::Trace {
    use crate::field_table::tracer::trace;
    let resolver = "typed_dns_resolver_config";
    let mut paths = trace::<DnsCluster>(&format!("{custom}({DNS_CLUSTER}).typed_config"));
    for at in [
        "clusters[]",
        &format!("{custom}({DNS_CLUSTER}).typed_config"),
    ] {
        paths.extend(trace::<Cares>(&format!(
            "{at}.{resolver}({CARES}).typed_config"
        )));
        let gai = format!("{at}.{resolver}({GETADDRINFO}).typed_config");
        paths.extend(trace::<GetAddrInfo>(&gai));
    }
    paths
}
