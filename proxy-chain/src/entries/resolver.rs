//! `service-resolver`: subsets, redirects, failover, timeouts and load balancing for a service.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{is_false, is_zero_u32, is_zero_u64};
use crate::duration::{GoDuration, serialize_nanos};

/// A `service-resolver` entry.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", default, deny_unknown_fields)]
pub struct ServiceResolver {
    /// Service the resolver applies to.
    pub name: String,
    /// Subset used when none is requested.
    #[serde(alias = "default_subset", skip_serializing_if = "String::is_empty")]
    pub default_subset: String,
    /// Named subsets of the service's instances.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub subsets: BTreeMap<String, ResolverSubset>,
    /// Resolve something else instead.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub redirect: Option<ResolverRedirect>,
    /// Failover sections keyed by subset name, `*` for any.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub failover: BTreeMap<String, ResolverFailover>,
    /// Connect timeout; zero means 5 s when compiled.
    #[serde(alias = "connect_timeout", skip_serializing_if = "GoDuration::is_zero")]
    pub connect_timeout: GoDuration,
    /// HTTP request timeout.
    #[serde(alias = "request_timeout", skip_serializing_if = "GoDuration::is_zero")]
    pub request_timeout: GoDuration,
    /// Locality-aware routing (Enterprise only).
    #[serde(
        alias = "prioritize_by_locality",
        skip_serializing_if = "Option::is_none"
    )]
    pub prioritize_by_locality: Option<PrioritizeByLocality>,
    /// Load-balancing policy.
    #[serde(alias = "load_balancer", skip_serializing_if = "Option::is_none")]
    pub load_balancer: Option<LoadBalancer>,
    /// Free-form metadata.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub meta: BTreeMap<String, String>,
    /// Namespace (Enterprise only; must be empty or `default`).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub namespace: String,
    /// Admin partition (Enterprise only; must be empty or `default`).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub partition: String,
    /// Raft index from Consul's API, ignored.
    #[serde(skip_serializing)]
    pub create_index: u64,
    /// Raft index from Consul's API, ignored.
    #[serde(skip_serializing)]
    pub modify_index: u64,
    /// Content hash from Consul's API, ignored.
    #[serde(skip_serializing)]
    pub hash: u64,
}

impl ServiceResolver {
    /// The resolver Consul synthesizes for a service without one.
    pub fn default_for(name: &str) -> Self {
        ServiceResolver {
            name: name.to_owned(),
            ..Default::default()
        }
    }

    /// Consul's `IsDefault()`: nothing beyond the name is configured.
    pub fn is_default(&self) -> bool {
        self.default_subset.is_empty()
            && self.subsets.is_empty()
            && self.redirect.is_none()
            && self.failover.is_empty()
            && self.connect_timeout.is_zero()
            && self.request_timeout.is_zero()
            && self.load_balancer.is_none()
    }

    /// Consul's `SubsetExists`: the empty subset always exists.
    pub fn subset_exists(&self, name: &str) -> bool {
        name.is_empty() || self.subsets.contains_key(name)
    }
}

/// A named subset: a filter over instances and a health strictness.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", default, deny_unknown_fields)]
pub struct ResolverSubset {
    /// go-bexpr filter expression (see [`crate::filter`]).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub filter: String,
    /// Only instances whose checks all pass (warning excluded).
    #[serde(alias = "only_passing", skip_serializing_if = "is_false")]
    pub only_passing: bool,
}

/// A redirect: resolve another service, subset, datacenter or peer instead.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", default, deny_unknown_fields)]
pub struct ResolverRedirect {
    /// Service.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub service: String,
    /// Subset.
    #[serde(alias = "service_subset", skip_serializing_if = "String::is_empty")]
    pub service_subset: String,
    /// Namespace (Enterprise only).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub namespace: String,
    /// Admin partition (Enterprise only).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub partition: String,
    /// Sameness group (Enterprise only).
    #[serde(alias = "sameness_group", skip_serializing_if = "String::is_empty")]
    pub sameness_group: String,
    /// Datacenter.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub datacenter: String,
    /// Cluster peer.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub peer: String,
}

impl ResolverRedirect {
    /// True when no field is set.
    pub fn is_empty(&self) -> bool {
        self.service.is_empty()
            && self.service_subset.is_empty()
            && self.namespace.is_empty()
            && self.partition.is_empty()
            && self.datacenter.is_empty()
            && self.peer.is_empty()
            && self.sameness_group.is_empty()
    }
}

/// A failover section: where to go when the primary target has no healthy instances.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", default, deny_unknown_fields)]
pub struct ResolverFailover {
    /// Service.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub service: String,
    /// Subset.
    #[serde(alias = "service_subset", skip_serializing_if = "String::is_empty")]
    pub service_subset: String,
    /// Namespace (Enterprise only).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub namespace: String,
    /// Sameness group (Enterprise only).
    #[serde(alias = "sameness_group", skip_serializing_if = "String::is_empty")]
    pub sameness_group: String,
    /// Datacenters tried in order.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub datacenters: Vec<String>,
    /// Explicit targets tried in order.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub targets: Vec<ResolverFailoverTarget>,
    /// Failover policy.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub policy: Option<FailoverPolicy>,
}

impl ResolverFailover {
    /// True when no destination is given (Consul's `isEmpty`).
    pub fn is_empty(&self) -> bool {
        self.service.is_empty()
            && self.service_subset.is_empty()
            && self.namespace.is_empty()
            && self.datacenters.is_empty()
            && self.targets.is_empty()
            && self.sameness_group.is_empty()
    }
}

/// One explicit failover target.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", default, deny_unknown_fields)]
pub struct ResolverFailoverTarget {
    /// Service.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub service: String,
    /// Subset.
    #[serde(alias = "service_subset", skip_serializing_if = "String::is_empty")]
    pub service_subset: String,
    /// Admin partition (Enterprise only).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub partition: String,
    /// Namespace (Enterprise only).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub namespace: String,
    /// Datacenter.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub datacenter: String,
    /// Cluster peer.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub peer: String,
}

/// Failover policy (`Mode`: `""`, `default` or `order-by-locality`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", default, deny_unknown_fields)]
pub struct FailoverPolicy {
    /// Policy mode.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub mode: String,
    /// Region order for `order-by-locality`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub regions: Vec<String>,
}

/// `PrioritizeByLocality` (Enterprise only).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", default, deny_unknown_fields)]
pub struct PrioritizeByLocality {
    /// Mode (`""`, `none`, `failover`).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub mode: String,
}

/// Load-balancing policy and its parameters.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", default, deny_unknown_fields)]
pub struct LoadBalancer {
    /// `""`, `random`, `round_robin`, `least_request`, `ring_hash` or `maglev`.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub policy: String,
    /// `ring_hash` parameters.
    #[serde(alias = "ring_hash_config", skip_serializing_if = "Option::is_none")]
    pub ring_hash_config: Option<RingHashConfig>,
    /// `least_request` parameters.
    #[serde(
        alias = "least_request_config",
        skip_serializing_if = "Option::is_none"
    )]
    pub least_request_config: Option<LeastRequestConfig>,
    /// What hash-based policies hash.
    #[serde(alias = "hash_policies", skip_serializing_if = "Vec::is_empty")]
    pub hash_policies: Vec<HashPolicy>,
}

impl LoadBalancer {
    /// True for `ring_hash` and `maglev`.
    pub fn is_hash_based(&self) -> bool {
        matches!(self.policy.as_str(), "ring_hash" | "maglev")
    }
}

/// `ring_hash` parameters.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", default, deny_unknown_fields)]
pub struct RingHashConfig {
    /// Minimum ring entries.
    #[serde(alias = "minimum_ring_size", skip_serializing_if = "is_zero_u64")]
    pub minimum_ring_size: u64,
    /// Maximum ring entries.
    #[serde(alias = "maximum_ring_size", skip_serializing_if = "is_zero_u64")]
    pub maximum_ring_size: u64,
}

/// `least_request` parameters.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", default, deny_unknown_fields)]
pub struct LeastRequestConfig {
    /// Random hosts compared per pick.
    #[serde(alias = "choice_count", skip_serializing_if = "is_zero_u32")]
    pub choice_count: u32,
}

/// One input to a hash-based policy.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", default, deny_unknown_fields)]
pub struct HashPolicy {
    /// `header`, `cookie` or `query_parameter`.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub field: String,
    /// Header, cookie or parameter name.
    #[serde(alias = "field_value", skip_serializing_if = "String::is_empty")]
    pub field_value: String,
    /// Generated-cookie settings.
    #[serde(alias = "cookie_config", skip_serializing_if = "Option::is_none")]
    pub cookie_config: Option<CookieConfig>,
    /// Hash the source IP.
    #[serde(
        rename = "SourceIP",
        alias = "source_ip",
        skip_serializing_if = "is_false"
    )]
    pub source_ip: bool,
    /// Stop at this policy when it produced a hash.
    #[serde(skip_serializing_if = "is_false")]
    pub terminal: bool,
}

/// Generated-cookie settings. `TTL` is written as integer nanoseconds, as Go does.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", default, deny_unknown_fields)]
pub struct CookieConfig {
    /// Session cookie (no expiry).
    #[serde(skip_serializing_if = "is_false")]
    pub session: bool,
    /// Cookie lifetime.
    #[serde(
        rename = "TTL",
        alias = "ttl",
        serialize_with = "serialize_nanos",
        skip_serializing_if = "GoDuration::is_zero"
    )]
    pub ttl: GoDuration,
    /// Cookie path.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub path: String,
}
