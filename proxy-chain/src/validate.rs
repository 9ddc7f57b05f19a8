//! Consul's `Validate()` rules for config entries, checked in Consul's order so the first error
//! reported is the one Consul would report. Map-valued fields (subsets, failover sections) are
//! visited in sorted key order, where Consul's order is random.

mod resolver;

use std::collections::HashSet;

use crate::{
    entries::{ConfigEntry, PROXY_DEFAULTS_GLOBAL, ServiceRouter, ServiceSplitter, scale_weight},
    error::{EnterpriseFeature, ValidationError},
};

/// Which Consul build's gating applies to Enterprise-only fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Edition {
    /// Consul CE: namespaces, partitions, sameness groups, failover policies and
    /// prioritize-by-locality are rejected with Consul CE's messages.
    #[default]
    Community,
    /// Enterprise: those fields are accepted (the compiler still uses CE naming; see the crate
    /// docs).
    Enterprise,
}

const VALID_RETRY_CONDITIONS: [&str; 12] = [
    "5xx",
    "gateway-error",
    "reset",
    "connect-failure",
    "envoy-ratelimited",
    "retriable-4xx",
    "refused-stream",
    "cancelled",
    "deadline-exceeded",
    "internal",
    "resource-exhausted",
    "unavailable",
];

const VALID_METHODS: [&str; 9] = [
    "GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "CONNECT", "OPTIONS", "TRACE",
];

/// Validates one entry.
pub fn validate_entry(entry: &ConfigEntry, edition: Edition) -> Result<(), ValidationError> {
    let (namespace, partition) = match entry {
        ConfigEntry::ServiceDefaults(e) => (&e.namespace, &e.partition),
        ConfigEntry::ProxyDefaults(e) => (&e.namespace, &e.partition),
        ConfigEntry::ServiceRouter(e) => (&e.namespace, &e.partition),
        ConfigEntry::ServiceSplitter(e) => (&e.namespace, &e.partition),
        ConfigEntry::ServiceResolver(e) => (&e.namespace, &e.partition),
    };
    if edition == Edition::Community {
        if !is_default_tenancy(namespace) {
            return Err(ValidationError::Enterprise(EnterpriseFeature::Namespace));
        }
        if !is_default_tenancy(partition) {
            return Err(ValidationError::Enterprise(EnterpriseFeature::Partition));
        }
    }
    match entry {
        ConfigEntry::ServiceDefaults(e) if e.name.is_empty() => Err(ValidationError::NameRequired),
        ConfigEntry::ServiceDefaults(_) => Ok(()),
        ConfigEntry::ProxyDefaults(e) if e.name != PROXY_DEFAULTS_GLOBAL => {
            Err(ValidationError::ProxyDefaultsName(e.name.clone()))
        }
        ConfigEntry::ProxyDefaults(_) => Ok(()),
        ConfigEntry::ServiceRouter(e) => validate_router(e),
        ConfigEntry::ServiceSplitter(e) => validate_splitter(e),
        ConfigEntry::ServiceResolver(e) => resolver::validate_resolver(e, edition),
    }
}

fn is_default_tenancy(value: &str) -> bool {
    value.is_empty() || value == "default"
}

/// `service-router` rules.
pub fn validate_router(router: &ServiceRouter) -> Result<(), ValidationError> {
    if router.name.is_empty() {
        return Err(ValidationError::NameRequired);
    }
    for (index, route) in router.routes.iter().enumerate() {
        let mut prefix_rewrite_ok = false;
        if let Some(http) = route.match_.as_ref().and_then(|m| m.http.as_ref()) {
            prefix_rewrite_ok = !http.path_exact.is_empty() || !http.path_prefix.is_empty();
            validate_http_match(index, http)?;
        }
        let Some(dest) = &route.destination else {
            continue;
        };
        if !dest.prefix_rewrite.is_empty() && !prefix_rewrite_ok {
            return Err(ValidationError::RoutePrefixRewrite(index));
        }
        if let Some(bad) = dest
            .retry_on
            .iter()
            .find(|r| !VALID_RETRY_CONDITIONS.contains(&r.as_str()))
        {
            return Err(ValidationError::RouteRetryCondition {
                index,
                condition: bad.clone(),
            });
        }
    }
    Ok(())
}

fn validate_http_match(
    index: usize,
    http: &crate::entries::ServiceRouteHttpMatch,
) -> Result<(), ValidationError> {
    for (field, value) in [
        ("PathExact", &http.path_exact),
        ("PathPrefix", &http.path_prefix),
    ] {
        if !value.is_empty() && !value.starts_with('/') {
            return Err(ValidationError::RoutePathNoSlash {
                index,
                field,
                value: value.clone(),
            });
        }
    }
    let paths = [&http.path_exact, &http.path_prefix, &http.path_regex];
    if paths.iter().filter(|p| !p.is_empty()).count() > 1 {
        return Err(ValidationError::RouteMultiplePaths(index));
    }
    for (header, h) in http.header.iter().enumerate() {
        if h.name.is_empty() {
            return Err(ValidationError::RouteHeaderName {
                route: index,
                header,
            });
        }
        let set = [
            !h.exact.is_empty(),
            !h.regex.is_empty(),
            !h.prefix.is_empty(),
            !h.suffix.is_empty(),
        ];
        if set.iter().filter(|s| **s).count() + usize::from(h.present) != 1 {
            return Err(ValidationError::RouteHeaderMatchers {
                route: index,
                header,
            });
        }
    }
    for (param, q) in http.query_param.iter().enumerate() {
        if q.name.is_empty() {
            return Err(ValidationError::RouteQueryParamName {
                route: index,
                param,
            });
        }
        let set = usize::from(q.present)
            + usize::from(!q.exact.is_empty())
            + usize::from(!q.regex.is_empty());
        if set != 1 {
            return Err(ValidationError::RouteQueryParamMatchers {
                route: index,
                param,
            });
        }
    }
    let mut seen = HashSet::new();
    for method in &http.methods {
        if !VALID_METHODS.contains(&method.as_str()) {
            return Err(ValidationError::RouteInvalidMethod {
                index,
                method: method.clone(),
            });
        }
        if !seen.insert(method.as_str()) {
            return Err(ValidationError::RouteDuplicateMethod {
                index,
                method: method.clone(),
            });
        }
    }
    Ok(())
}

/// `service-splitter` rules.
pub fn validate_splitter(splitter: &ServiceSplitter) -> Result<(), ValidationError> {
    if splitter.name.is_empty() {
        return Err(ValidationError::NameRequired);
    }
    if splitter.splits.is_empty() {
        return Err(ValidationError::NoSplits);
    }
    let mut seen = HashSet::new();
    for split in &splitter.splits {
        // Consul keys on the whole split struct; header modifiers are pointers there, so a split
        // carrying them never equals another.
        if split.request_headers.is_some() || split.response_headers.is_some() {
            continue;
        }
        let service = if split.service.is_empty() {
            &splitter.name
        } else {
            &split.service
        };
        let key = (
            service.clone(),
            split.service_subset.clone(),
            split.namespace.clone(),
            split.partition.clone(),
        );
        if !seen.insert(key.clone()) {
            let (service, subset, namespace, partition) = key;
            return Err(ValidationError::DuplicateSplit {
                service,
                subset,
                namespace,
                partition,
            });
        }
    }
    for (index, split) in splitter.splits.iter().enumerate() {
        // Consul's words: its float-to-int conversion turns NaN into a sum that is not 100
        // (Rust's would turn it into 0, and `[NaN, 100]` would pass).
        if split.weight.is_nan() {
            return Err(ValidationError::SplitWeightSum(f32::NAN));
        }
        if split.weight < 0.0 {
            let weight = split.weight;
            return Err(ValidationError::NegativeSplitWeight { index, weight });
        }
    }
    // Saturating: a weight of 1e30 is a typo to report, not an overflow.
    let sum = splitter
        .splits
        .iter()
        .fold(0i64, |sum, s| sum.saturating_add(scale_weight(s.weight)));
    if sum != 100 * 100 {
        return Err(ValidationError::SplitWeightSum(sum as f32 / 100.0));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
