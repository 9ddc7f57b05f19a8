//! DNS knobs of a DNS-based cluster (Envoy `Cluster` / `DnsCluster` field names) and validation;
//! `crate::discovery::dns` resolves with them.
//!
//! Durations are Envoy JSON strings: `"5s"`, `"0.5s"`; `"500ms"` is accepted too (see
//! [`crate::config::duration`]). Every field has Envoy's default, so `{}` is a valid [`DnsSettings`].

use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr},
    time::Duration,
};

use serde::{Deserialize, Serialize, Serializer};

use crate::{config::duration, host::EdsHealth};

/// Smallest refresh or backoff interval Envoy accepts is anything strictly above this.
const MIN_INTERVAL: Duration = Duration::from_millis(1);

/// Port used for a `dns_resolvers` entry that names no port.
const DEFAULT_DNS_PORT: u16 = 53;

/// The DNS fields of a STRICT_DNS, LOGICAL_DNS or DNS SRV cluster that Envoy's `DnsCluster`
/// (the `envoy.cluster.dns` extension's typed_config) has too, declared once for
/// [`DnsSettings`], the file's `Cluster` and `config::envoy`'s `DnsCluster` (see
/// `config::fields`).
macro_rules! dns_cluster_fields {
    ($($args:tt)*) => {
        $crate::config::fields::group! { $crate::config::sources::dns::DnsSettings [$($args)*]
            /// DNS clusters: interval between resolutions of a name after a successful one.
            /// Default 5000 ms; must be > 1 ms.
            #[serde(
                default = "crate::config::defaults::dns_refresh_rate",
                with = "crate::config::duration"
            )]
            dns_refresh_rate: ::std::time::Duration,
            /// DNS clusters: refresh after the answer's TTL instead of `dns_refresh_rate` when a
            /// non-empty successful answer's TTL is not 0 (strict and SRV: minimum of all records;
            /// logical: the first record's). Default false.
            #[serde(default)]
            respect_dns_ttl: bool,
            /// DNS clusters: jittered exponential backoff after failed resolutions
            /// (`base_interval`, `max_interval` default 10x base). Unset: retry after
            /// `dns_refresh_rate`.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            dns_failure_refresh_rate: Option<$crate::config::sources::dns::RefreshRate>,
            /// DNS clusters: a random delay in [0, dns_jitter) added to each refresh after a
            /// success. Unset: none.
            #[serde(
                default,
                with = "crate::config::duration::option",
                skip_serializing_if = "Option::is_none"
            )]
            dns_jitter: Option<::std::time::Duration>,
            /// DNS clusters: AUTO (default: IPv6, falling back to IPv4), V4_ONLY, V6_ONLY,
            /// V4_PREFERRED or ALL.
            #[serde(default)]
            dns_lookup_family: $crate::config::sources::dns::DnsLookupFamily,
        }
    };
}
pub(crate) use dns_cluster_fields;

/// The DNS fields of a cluster that Envoy's `DnsCluster` does not have (it names its resolvers
/// in `typed_dns_resolver_config`; the stale bound is this daemon's), declared once for
/// [`DnsSettings`] and the file's `Cluster` (see `config::fields`).
macro_rules! dns_file_fields {
    ($($args:tt)*) => {
        $crate::config::fields::group! { $crate::config::sources::dns::DnsSettings [$($args)*]
            /// DNS clusters: name servers to query over UDP, each Envoy's `{socket_address:
            /// {address, port_value}}` or `"IP:PORT"` / `"IP"` (port 53). Empty: the system's
            /// (`/etc/resolv.conf`).
            #[serde(default, skip_serializing_if = "Vec::is_empty")]
            dns_resolvers: Vec<$crate::config::sources::dns::DnsResolverAddress>,
            /// STRICT_DNS, LOGICAL_DNS and DNS SRV clusters: how long a name's last hosts are kept
            /// once its lookups fail (from the first failed lookup after its last success; for
            /// LOGICAL_DNS an empty answer is a failure); then they are dropped as an empty answer
            /// drops them, until a lookup succeeds again. Must be > 0. Unset: kept until a lookup
            /// succeeds (Envoy's behaviour). Not an Envoy field, so CDS cannot set it.
            #[serde(
                default,
                with = "crate::config::duration::option",
                skip_serializing_if = "Option::is_none"
            )]
            dns_stale_bound: Option<::std::time::Duration>,
        }
    };
}
pub(crate) use dns_file_fields;

crate::config::fields::splice! {
    {
        /// DNS settings of one STRICT_DNS, LOGICAL_DNS or DNS SRV cluster. Every field has
        /// Envoy's default, so `{}` is valid.
        #[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
        #[serde(deny_unknown_fields)]
        pub struct DnsSettings {}
    }
    [dns_cluster_fields, dns_file_fields]
}

impl Default for DnsSettings {
    fn default() -> Self {
        Self {
            dns_refresh_rate: crate::config::defaults::dns_refresh_rate(),
            respect_dns_ttl: false,
            dns_failure_refresh_rate: None,
            dns_jitter: None,
            dns_lookup_family: DnsLookupFamily::default(),
            dns_resolvers: Vec::new(),
            dns_stale_bound: None,
        }
    }
}

impl DnsSettings {
    /// Checks the constraints Envoy enforces on these fields.
    pub fn validate(&self) -> Result<(), DnsConfigError> {
        check_interval("dns_refresh_rate", self.dns_refresh_rate)?;
        if let Some(rate) = &self.dns_failure_refresh_rate {
            check_interval("dns_failure_refresh_rate.base_interval", rate.base_interval)?;
            if let Some(max) = rate.max_interval {
                check_interval("dns_failure_refresh_rate.max_interval", max)?;
            }
            if rate.effective_max_interval() < rate.base_interval {
                return Err(DnsConfigError::MaxBelowBase {
                    base_interval: rate.base_interval,
                    max_interval: rate.effective_max_interval(),
                });
            }
        }
        if self.dns_stale_bound.is_some_and(|bound| bound.is_zero()) {
            return Err(DnsConfigError::StaleBoundZero);
        }
        Ok(())
    }
}

fn check_interval(field: &'static str, value: Duration) -> Result<(), DnsConfigError> {
    if value <= MIN_INTERVAL {
        return Err(DnsConfigError::IntervalTooSmall { field, value });
    }
    Ok(())
}

/// Envoy's `Cluster.RefreshRate`: bounds of the failure backoff.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RefreshRate {
    /// First backoff bound, required, > 1 ms.
    #[serde(with = "duration")]
    pub base_interval: Duration,
    /// Cap of the backoff bound; defaults to 10 x `base_interval`; must be >= `base_interval`.
    #[serde(
        default,
        with = "duration::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub max_interval: Option<Duration>,
}

impl RefreshRate {
    /// `max_interval`, or its default of ten times `base_interval`.
    pub fn effective_max_interval(&self) -> Duration {
        self.max_interval
            .unwrap_or_else(|| self.base_interval.saturating_mul(10))
    }
}

/// Envoy's `dns_lookup_family`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum DnsLookupFamily {
    /// AAAA first; A when the AAAA lookup yields no address. `UNSPECIFIED` (the
    /// `common.dns.v3` zero value) means the same.
    #[default]
    #[serde(alias = "UNSPECIFIED")]
    Auto,
    /// A only.
    V4Only,
    /// AAAA only.
    V6Only,
    /// A first; AAAA when the A lookup yields no address.
    V4Preferred,
    /// A and AAAA; every address of both.
    All,
}

/// One name server in `dns_resolvers`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Deserialize)]
#[serde(try_from = "RawResolver")]
pub struct DnsResolverAddress(pub SocketAddr);

#[derive(Deserialize)]
#[serde(untagged)]
enum RawResolver {
    Envoy { socket_address: RawSocketAddress },
    Plain(String),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSocketAddress {
    address: String,
    #[serde(default)]
    port_value: Option<u16>,
    #[serde(default)]
    protocol: Option<String>,
}

impl TryFrom<RawResolver> for DnsResolverAddress {
    type Error = DnsConfigError;

    fn try_from(raw: RawResolver) -> Result<Self, Self::Error> {
        let bad = |value: &str| DnsConfigError::BadResolver {
            value: value.to_owned(),
        };
        match raw {
            RawResolver::Envoy { socket_address } => {
                if socket_address
                    .protocol
                    .as_deref()
                    .is_some_and(|p| p != "UDP")
                {
                    return Err(bad(&socket_address.address));
                }
                let ip: IpAddr = socket_address
                    .address
                    .parse()
                    .map_err(|_| bad(&socket_address.address))?;
                let port = socket_address.port_value.unwrap_or(DEFAULT_DNS_PORT);
                Ok(Self(SocketAddr::new(ip, port)))
            }
            RawResolver::Plain(text) => text
                .parse::<SocketAddr>()
                .or_else(|_| {
                    text.parse::<IpAddr>()
                        .map(|ip| SocketAddr::new(ip, DEFAULT_DNS_PORT))
                })
                .map(Self)
                .map_err(|_| bad(&text)),
        }
    }
}

impl Serialize for DnsResolverAddress {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Inner {
            address: String,
            port_value: u16,
        }
        #[derive(Serialize)]
        struct Outer {
            socket_address: Inner,
        }
        Outer {
            socket_address: Inner {
                address: self.0.ip().to_string(),
                port_value: self.0.port(),
            },
        }
        .serialize(serializer)
    }
}

/// One `lb_endpoint` of a STRICT_DNS or LOGICAL_DNS cluster: a name to resolve and what every
/// host resolved from it carries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DnsEndpoint {
    /// Name to resolve (`socket_address.address`); an IP literal resolves to itself.
    pub address: String,
    /// Port of every resolved host (`socket_address.port_value`).
    pub port: u16,
    /// `endpoint.hostname`; when `None` the hosts carry `address` as their hostname.
    pub hostname: Option<String>,
    /// `load_balancing_weight`; 0 (unset) becomes 1.
    pub weight: u32,
    /// Priority of the enclosing `LocalityLbEndpoints`.
    pub priority: u32,
    /// `lb_endpoint.metadata`, flattened.
    pub metadata: BTreeMap<String, String>,
    /// `lb_endpoint.health_status`.
    pub health: EdsHealth,
    /// `endpoint.health_check_config`, for every resolved host.
    pub health_check: crate::host::HealthCheckTarget,
    /// The enclosing group's `locality`.
    pub locality: crate::host::Locality,
    /// The enclosing group's `load_balancing_weight`.
    pub locality_weight: Option<u32>,
}

impl DnsEndpoint {
    /// An endpoint with weight 1, priority 0, no metadata and unknown health.
    pub fn new(address: impl Into<String>, port: u16) -> Self {
        Self {
            address: address.into(),
            port,
            hostname: None,
            weight: 1,
            priority: 0,
            metadata: BTreeMap::new(),
            health: EdsHealth::Unknown,
            health_check: crate::host::HealthCheckTarget::default(),
            locality: crate::host::Locality::default(),
            locality_weight: None,
        }
    }
}

/// How long one try waits and how many tries one query makes: the defaults of Envoy's c-ares
/// resolver (`CaresDnsResolverConfig.query_timeout_seconds` 5 and `query_tries` 4, which Envoy
/// sets over c-ares' own 2 s and 3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueryLimits {
    /// How long one try waits for its answer.
    pub timeout: Duration,
    /// Tries per query, at least 1.
    pub tries: u8,
}

impl Default for QueryLimits {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(5),
            tries: 4,
        }
    }
}

/// Errors in DNS cluster configuration; each names the offending field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DnsConfigError {
    /// An interval is at most 1 ms.
    #[error("{field} must be greater than 1ms, got {value:?}")]
    IntervalTooSmall {
        /// Field path, e.g. `dns_failure_refresh_rate.base_interval`.
        field: &'static str,
        /// The configured value.
        value: Duration,
    },
    /// `max_interval` < `base_interval` (Envoy's message, verbatim).
    #[error(
        "dns_failure_refresh_rate must have max_interval greater than or equal to the base_interval"
    )]
    MaxBelowBase {
        /// Configured base interval.
        base_interval: Duration,
        /// Configured (or defaulted) max interval.
        max_interval: Duration,
    },
    /// `dns_stale_bound` is zero: stale hosts would be dropped at the first failure.
    #[error(
        "dns_stale_bound must be greater than 0; unset it to keep a failing name's hosts until \
         a lookup succeeds"
    )]
    StaleBoundZero,
    /// A `dns_resolvers` entry is not an IP address (with optional port) over UDP.
    #[error("dns_resolvers entry {value:?} is not an IP address with an optional port over UDP")]
    BadResolver {
        /// The rejected entry.
        value: String,
    },
    /// LOGICAL_DNS needs exactly one endpoint (Envoy's message).
    #[error(
        "LOGICAL_DNS clusters must have a single locality_lb_endpoint and a single lb_endpoint"
    )]
    LogicalNotSingleHost {
        /// How many endpoints were given.
        count: usize,
    },
    /// An endpoint or SRV name is empty.
    #[error("{field} must not be empty")]
    EmptyName {
        /// Field path, e.g. `load_assignment.endpoints[0].address`.
        field: String,
    },
}
