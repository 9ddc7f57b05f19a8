//! `service-resolver` rules: subsets, redirect, failover, timeouts and load balancer.

use std::sync::LazyLock;

use regex::Regex;

use super::{Edition, is_default_tenancy};
use crate::{
    entries::{LoadBalancer, ResolverFailover, ResolverRedirect, ServiceResolver},
    error::{EnterpriseFeature, SubsetNameError, ValidationError},
    filter::Filter,
};

static SUBSET_NAME: LazyLock<Regex> =
    LazyLock::new(|| Regex::new("^[a-z0-9]([a-z0-9-]*[a-z0-9])?$").expect("static regex"));

const SUBSET_NAME_MAX: usize = 63;

const VALID_LB_POLICIES: [&str; 6] = [
    "",
    "random",
    "round_robin",
    "least_request",
    "ring_hash",
    "maglev",
];

const VALID_HASH_FIELDS: [&str; 3] = ["header", "cookie", "query_parameter"];

/// Checks a subset name is a DNS label (it ends up in SNI names).
pub fn validate_subset_name(name: &str) -> Result<(), SubsetNameError> {
    if name.is_empty() || name.len() > SUBSET_NAME_MAX {
        return Err(SubsetNameError::Length);
    }
    if !SUBSET_NAME.is_match(name) {
        return Err(SubsetNameError::Charset);
    }
    Ok(())
}

/// `service-resolver` rules, in Consul's order.
pub(super) fn validate_resolver(
    r: &ServiceResolver,
    edition: Edition,
) -> Result<(), ValidationError> {
    let ce = edition == Edition::Community;
    if r.name.is_empty() {
        return Err(ValidationError::NameRequired);
    }
    for (name, subset) in &r.subsets {
        if name.is_empty() {
            return Err(ValidationError::SubsetEmptyName);
        }
        validate_subset_name(name).map_err(|reason| ValidationError::SubsetName {
            name: name.clone(),
            reason,
        })?;
        if !subset.filter.is_empty() {
            Filter::parse(&subset.filter).map_err(|source| ValidationError::SubsetFilter {
                name: name.clone(),
                source,
            })?;
        }
    }
    if ce
        && r.prioritize_by_locality
            .as_ref()
            .is_some_and(|p| !p.mode.is_empty())
    {
        return Err(ValidationError::PrioritizeByLocality);
    }
    if !r.default_subset.is_empty() && !r.subsets.contains_key(&r.default_subset) {
        return Err(ValidationError::DefaultSubset(r.default_subset.clone()));
    }
    if let Some(redirect) = &r.redirect {
        validate_redirect(r, redirect, ce)?;
    }
    for (subset, failover) in &r.failover {
        validate_failover(r, subset, failover, ce)?;
    }
    if r.connect_timeout.as_nanos() < 0 {
        return Err(ValidationError::ConnectTimeout(r.connect_timeout));
    }
    if r.request_timeout.as_nanos() < 0 {
        return Err(ValidationError::RequestTimeout(r.request_timeout));
    }
    match &r.load_balancer {
        Some(lb) => validate_load_balancer(lb),
        None => Ok(()),
    }
}

fn redirect_enterprise(redirect: &ResolverRedirect) -> Option<EnterpriseFeature> {
    if !redirect.partition.is_empty() {
        Some(EnterpriseFeature::Partition)
    } else if !redirect.namespace.is_empty() {
        Some(EnterpriseFeature::Namespace)
    } else if !redirect.sameness_group.is_empty() {
        Some(EnterpriseFeature::SamenessGroup)
    } else {
        None
    }
}

fn validate_redirect(
    r: &ServiceResolver,
    redirect: &ResolverRedirect,
    ce: bool,
) -> Result<(), ValidationError> {
    let entry_partition = if r.partition.is_empty() {
        "default"
    } else {
        r.partition.as_str()
    };
    let redirect_partition = if redirect.partition.is_empty() {
        "default"
    } else {
        redirect.partition.as_str()
    };
    if !is_default_tenancy(&r.partition) && !redirect.datacenter.is_empty() {
        return Err(ValidationError::RedirectCrossDcPartition);
    }
    if redirect_partition != entry_partition && !redirect.datacenter.is_empty() {
        return Err(ValidationError::RedirectCrossDcAndPartition);
    }
    if let Some(feature) = redirect_enterprise(redirect).filter(|_| ce) {
        return Err(ValidationError::RedirectEnterprise(feature));
    }
    if !r.failover.is_empty() {
        return Err(ValidationError::RedirectAndFailover);
    }
    if redirect.is_empty() {
        return Err(ValidationError::RedirectEmpty);
    }
    let peer = !redirect.peer.is_empty();
    if peer && !redirect.service_subset.is_empty() {
        return Err(ValidationError::RedirectPeerWithSubset);
    }
    if peer && !redirect.partition.is_empty() {
        return Err(ValidationError::RedirectPartitionWithPeer);
    }
    if peer && !redirect.datacenter.is_empty() {
        return Err(ValidationError::RedirectPeerWithDatacenter);
    }
    if redirect.service.is_empty() {
        let without_service = [
            ("ServiceSubset", &redirect.service_subset),
            ("Namespace", &redirect.namespace),
            ("Partition", &redirect.partition),
            ("Peer", &redirect.peer),
        ];
        if let Some((field, _)) = without_service.iter().find(|(_, v)| !v.is_empty()) {
            return Err(ValidationError::RedirectWithoutService(field));
        }
    } else if !redirect.service_subset.is_empty()
        && redirect.service == r.name
        && !r.subsets.contains_key(&redirect.service_subset)
    {
        return Err(ValidationError::RedirectSubset {
            subset: redirect.service_subset.clone(),
            service: r.name.clone(),
        });
    }
    Ok(())
}

fn failover_enterprise(f: &ResolverFailover) -> Option<EnterpriseFeature> {
    if !f.namespace.is_empty() {
        Some(EnterpriseFeature::Namespace)
    } else if !f.sameness_group.is_empty() {
        Some(EnterpriseFeature::SamenessGroup)
    } else {
        None
    }
}

fn validate_failover(
    r: &ServiceResolver,
    subset: &str,
    f: &ResolverFailover,
    ce: bool,
) -> Result<(), ValidationError> {
    let key = || subset.to_owned();
    if !is_default_tenancy(&r.partition) && !f.datacenters.is_empty() {
        return Err(ValidationError::FailoverCrossDcPartition);
    }
    if let Some(feature) = failover_enterprise(f).filter(|_| ce) {
        return Err(ValidationError::FailoverEnterprise {
            subset: key(),
            feature,
        });
    }
    if subset != "*" && !r.subsets.contains_key(subset) {
        return Err(ValidationError::FailoverNotSubset(key()));
    }
    if f.is_empty() {
        return Err(ValidationError::FailoverEmpty(key()));
    }
    let mode = f.policy.as_ref().map_or("", |p| p.mode.as_str());
    if ce && !mode.is_empty() {
        let feature = EnterpriseFeature::FailoverPolicy;
        return Err(ValidationError::FailoverEnterprise {
            subset: key(),
            feature,
        });
    }
    if !matches!(mode, "" | "default" | "order-by-locality") {
        return Err(ValidationError::FailoverPolicy(key()));
    }
    let own_service = f.service.is_empty() || f.service == r.name;
    if !f.service_subset.is_empty() && own_service && !r.subsets.contains_key(&f.service_subset) {
        return Err(ValidationError::FailoverSubset {
            subset: key(),
            service_subset: f.service_subset.clone(),
            service: f.service.clone(),
        });
    }
    if !f.targets.is_empty() {
        let conflicts = [
            ("Datacenters", !f.datacenters.is_empty()),
            ("ServiceSubset", !f.service_subset.is_empty()),
            ("Service", !f.service.is_empty()),
        ];
        if let Some((field, _)) = conflicts.iter().find(|(_, set)| *set) {
            return Err(ValidationError::FailoverTargetsWith {
                subset: key(),
                field,
            });
        }
    }
    validate_failover_targets(r, subset, f, ce)?;
    if f.datacenters.iter().any(String::is_empty) {
        return Err(ValidationError::FailoverEmptyDatacenter(key()));
    }
    Ok(())
}

fn validate_failover_targets(
    r: &ServiceResolver,
    subset: &str,
    f: &ResolverFailover,
    ce: bool,
) -> Result<(), ValidationError> {
    for (index, t) in f.targets.iter().enumerate() {
        let subset = subset.to_owned();
        let feature = if !t.partition.is_empty() {
            Some(EnterpriseFeature::Partition)
        } else if !t.namespace.is_empty() {
            Some(EnterpriseFeature::Namespace)
        } else {
            None
        };
        if let Some(feature) = feature.filter(|_| ce) {
            return Err(ValidationError::FailoverTargetEnterprise {
                subset,
                index,
                feature,
            });
        }
        let (peer, partition, dc) = (
            !t.peer.is_empty(),
            !t.partition.is_empty(),
            !t.datacenter.is_empty(),
        );
        let conflict = if peer && !t.service_subset.is_empty() {
            Some("Peer cannot be set with ServiceSubset")
        } else if peer && partition {
            Some("Partition cannot be set with Peer")
        } else if peer && dc {
            Some("Peer cannot be set with Datacenter")
        } else if partition && dc {
            Some("Partition cannot be set with Datacenter")
        } else {
            None
        };
        if let Some(conflict) = conflict {
            return Err(ValidationError::FailoverTargetConflict {
                subset,
                index,
                conflict,
            });
        }
        let own_service = t.service.is_empty() || t.service == r.name;
        if !t.service_subset.is_empty() && own_service && !r.subsets.contains_key(&t.service_subset)
        {
            return Err(ValidationError::FailoverTargetSubset {
                subset,
                index,
                service_subset: t.service_subset.clone(),
                service: r.name.clone(),
            });
        }
    }
    Ok(())
}

fn validate_load_balancer(lb: &LoadBalancer) -> Result<(), ValidationError> {
    let policy = || lb.policy.clone();
    if !VALID_LB_POLICIES.contains(&lb.policy.as_str()) {
        return Err(ValidationError::LbPolicy(policy()));
    }
    if lb.policy != "ring_hash" && lb.ring_hash_config.is_some() {
        return Err(ValidationError::LbRingHashConfig(policy()));
    }
    if lb.policy != "least_request" && lb.least_request_config.is_some() {
        return Err(ValidationError::LbLeastRequestConfig(policy()));
    }
    if !lb.is_hash_based() && !lb.hash_policies.is_empty() {
        return Err(ValidationError::LbHashPoliciesNotHashBased(policy()));
    }
    for (index, hp) in lb.hash_policies.iter().enumerate() {
        let field = || hp.field.clone();
        if !hp.field.is_empty() && !VALID_HASH_FIELDS.contains(&hp.field.as_str()) {
            return Err(ValidationError::HashPolicyField {
                index,
                field: field(),
            });
        }
        if hp.source_ip && !hp.field.is_empty() {
            return Err(ValidationError::HashPolicySourceIpAndField {
                index,
                field: field(),
            });
        }
        if hp.source_ip && !hp.field_value.is_empty() {
            return Err(ValidationError::HashPolicySourceIpValue(index));
        }
        if !hp.field.is_empty() && hp.field_value.is_empty() {
            return Err(ValidationError::HashPolicyFieldWithoutValue {
                index,
                field: field(),
            });
        }
        if !hp.field_value.is_empty() && hp.field.is_empty() {
            return Err(ValidationError::HashPolicyValueWithoutField(index));
        }
        if let Some(cookie) = &hp.cookie_config {
            if hp.field != "cookie" {
                return Err(ValidationError::HashPolicyCookieConfig {
                    index,
                    field: field(),
                });
            }
            if cookie.session && !cookie.ttl.is_zero() {
                return Err(ValidationError::HashPolicySessionTtl(index));
            }
        }
    }
    Ok(())
}
