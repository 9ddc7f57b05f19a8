//! `service-router`: L7 routes, the top of a discovery chain.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{is_false, is_zero_u32};
use crate::duration::GoDuration;

/// A `service-router` entry.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", default, deny_unknown_fields)]
pub struct ServiceRouter {
    /// Service the router applies to.
    pub name: String,
    /// Routes, first match wins; a catch-all to `Name` is appended when compiled.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub routes: Vec<ServiceRoute>,
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

impl ServiceRouter {
    /// Consul's `Normalize()`: HTTP methods are upper-cased.
    pub fn normalize(&mut self) {
        for route in &mut self.routes {
            if let Some(http) = route.match_.as_mut().and_then(|m| m.http.as_mut()) {
                for method in &mut http.methods {
                    *method = method.to_uppercase();
                }
            }
        }
    }
}

/// One route: a match and where matching requests go.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", default, deny_unknown_fields)]
pub struct ServiceRoute {
    /// Match criteria; absent matches everything.
    #[serde(rename = "Match", skip_serializing_if = "Option::is_none")]
    pub match_: Option<ServiceRouteMatch>,
    /// Destination; absent means the chain's own service.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub destination: Option<ServiceRouteDestination>,
}

impl ServiceRoute {
    /// The catch-all route the compiler appends: `PathPrefix: "/"` to `service`.
    pub fn catch_all(service: &str, namespace: &str, partition: &str) -> Self {
        ServiceRoute {
            match_: Some(ServiceRouteMatch {
                http: Some(ServiceRouteHttpMatch {
                    path_prefix: "/".to_owned(),
                    ..Default::default()
                }),
            }),
            destination: Some(ServiceRouteDestination {
                service: service.to_owned(),
                namespace: namespace.to_owned(),
                partition: partition.to_owned(),
                ..Default::default()
            }),
        }
    }
}

/// Match criteria of a route.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", default, deny_unknown_fields)]
pub struct ServiceRouteMatch {
    /// HTTP criteria.
    #[serde(
        rename = "HTTP",
        alias = "http",
        skip_serializing_if = "Option::is_none"
    )]
    pub http: Option<ServiceRouteHttpMatch>,
}

/// HTTP match criteria; all given criteria must match.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", default, deny_unknown_fields)]
pub struct ServiceRouteHttpMatch {
    /// Exact path.
    #[serde(alias = "path_exact", skip_serializing_if = "String::is_empty")]
    pub path_exact: String,
    /// Path prefix.
    #[serde(alias = "path_prefix", skip_serializing_if = "String::is_empty")]
    pub path_prefix: String,
    /// Path regular expression (Envoy RE2 syntax).
    #[serde(alias = "path_regex", skip_serializing_if = "String::is_empty")]
    pub path_regex: String,
    /// Header criteria.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub header: Vec<ServiceRouteMatchHeader>,
    /// Query parameter criteria.
    #[serde(alias = "query_param", skip_serializing_if = "Vec::is_empty")]
    pub query_param: Vec<ServiceRouteMatchQueryParam>,
    /// Allowed methods (upper-cased by normalization).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub methods: Vec<String>,
}

/// One header criterion: exactly one of the matchers must be set.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", default, deny_unknown_fields)]
pub struct ServiceRouteMatchHeader {
    /// Header name.
    pub name: String,
    /// Header is present.
    #[serde(skip_serializing_if = "is_false")]
    pub present: bool,
    /// Exact value.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub exact: String,
    /// Value prefix.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub prefix: String,
    /// Value suffix.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub suffix: String,
    /// Value regular expression.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub regex: String,
    /// Invert the match.
    #[serde(skip_serializing_if = "is_false")]
    pub invert: bool,
}

/// One query parameter criterion: exactly one of the matchers must be set.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", default, deny_unknown_fields)]
pub struct ServiceRouteMatchQueryParam {
    /// Parameter name.
    pub name: String,
    /// Parameter is present.
    #[serde(skip_serializing_if = "is_false")]
    pub present: bool,
    /// Exact value.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub exact: String,
    /// Value regular expression.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub regex: String,
}

/// Where a route sends traffic. Field order follows Consul's JSON (timeouts first).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", default, deny_unknown_fields)]
pub struct ServiceRouteDestination {
    /// Whole-request timeout.
    #[serde(alias = "request_timeout", skip_serializing_if = "GoDuration::is_zero")]
    pub request_timeout: GoDuration,
    /// Stream idle timeout.
    #[serde(alias = "idle_timeout", skip_serializing_if = "GoDuration::is_zero")]
    pub idle_timeout: GoDuration,
    /// Service; empty means the chain's service.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub service: String,
    /// Subset; set means the route bypasses splitters.
    #[serde(alias = "service_subset", skip_serializing_if = "String::is_empty")]
    pub service_subset: String,
    /// Namespace.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub namespace: String,
    /// Admin partition.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub partition: String,
    /// Replacement for the matched path prefix.
    #[serde(alias = "prefix_rewrite", skip_serializing_if = "String::is_empty")]
    pub prefix_rewrite: String,
    /// Retry count.
    #[serde(alias = "num_retries", skip_serializing_if = "is_zero_u32")]
    pub num_retries: u32,
    /// Retry on connect failure.
    #[serde(alias = "retry_on_connect_failure", skip_serializing_if = "is_false")]
    pub retry_on_connect_failure: bool,
    /// Envoy retry conditions.
    #[serde(alias = "retry_on", skip_serializing_if = "Vec::is_empty")]
    pub retry_on: Vec<String>,
    /// Status codes that trigger a retry.
    #[serde(alias = "retry_on_status_codes", skip_serializing_if = "Vec::is_empty")]
    pub retry_on_status_codes: Vec<u32>,
    /// Request header changes.
    #[serde(alias = "request_headers", skip_serializing_if = "Option::is_none")]
    pub request_headers: Option<HttpHeaderModifiers>,
    /// Response header changes.
    #[serde(alias = "response_headers", skip_serializing_if = "Option::is_none")]
    pub response_headers: Option<HttpHeaderModifiers>,
}

/// Header additions, replacements and removals.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", default, deny_unknown_fields)]
pub struct HttpHeaderModifiers {
    /// Headers appended.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub add: BTreeMap<String, String>,
    /// Headers replaced.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub set: BTreeMap<String, String>,
    /// Headers removed.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub remove: Vec<String>,
}

impl HttpHeaderModifiers {
    /// True when nothing is added, set or removed (Consul's `IsZero`).
    pub fn is_zero(&self) -> bool {
        self.add.is_empty() && self.set.is_empty() && self.remove.is_empty()
    }

    /// Consul's `MergeHTTPHeaderModifiers`: `overrides` wins on collisions; removals are
    /// de-duplicated.
    pub fn merge(base: Option<&Self>, overrides: Option<&Self>) -> Option<Self> {
        let Some(base) = base.filter(|b| !b.is_zero()) else {
            return overrides.cloned();
        };
        let mut merged = base.clone();
        let Some(overrides) = overrides.filter(|o| !o.is_zero()) else {
            return Some(merged);
        };
        merged
            .add
            .extend(overrides.add.iter().map(|(k, v)| (k.clone(), v.clone())));
        merged
            .set
            .extend(overrides.set.iter().map(|(k, v)| (k.clone(), v.clone())));
        for key in &overrides.remove {
            if !base.remove.contains(key) {
                merged.remove.push(key.clone());
            }
        }
        Some(merged)
    }
}
