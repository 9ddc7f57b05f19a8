//! The load-balancing policy a chain's resolvers give its kernel-path service: Consul's
//! service-resolver `LoadBalancer`, mapped to the kernel's policies, or refused where the
//! kernel cannot honour it.
//!
//! The kernel chooses per connect, without the request: `HashPolicies` (headers, cookies, query
//! parameters, the source address, which is the same for every local client) cannot be keyed
//! there; the service's `hash_key` says what consistent hashing keys on instead. One service has
//! one policy in the kernel, so resolvers of the chain's legs that set different policies are
//! refused rather than one of them silently winning (Consul would give each target's cluster its
//! own policy, which one kernel entry cannot); `maglev` and `ring_hash` count as one, the Maglev
//! table. Failover targets are served with the policy of the leg they belong to.

use proxy_chain::{Leg, entries::LoadBalancer};

use crate::config::LbPolicy;

/// Why a chain's resolvers give its service no kernel policy.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    /// A resolver sets `LoadBalancer.HashPolicies`.
    #[error(
        "the service-resolver of target {target} sets LoadBalancer.HashPolicies, which the \
         kernel path cannot key on (it sees no request, and every local client has the same \
         source address); remove HashPolicies and choose the key with the service's hash_key, \
         or use mode: proxy"
    )]
    HashPolicies {
        /// The target whose resolver sets them.
        target: String,
    },
    /// Resolvers of two legs set different policies.
    #[error(
        "the service-resolvers of targets {first} ({first_policy}) and {second} \
         ({second_policy}) set different LoadBalancer policies, and the kernel path gives one \
         service one policy; set the same Policy in both"
    )]
    Conflict {
        /// The first target with a policy.
        first: String,
        /// Its policy.
        first_policy: String,
        /// A target with another one.
        second: String,
        /// That policy.
        second_policy: String,
    },
    /// `LeastRequestConfig.ChoiceCount` other than two.
    #[error(
        "the service-resolver of target {target} sets LeastRequestConfig.ChoiceCount {count}; \
         the kernel path compares two hosts (the power of two choices): remove it or set 2"
    )]
    ChoiceCount {
        /// The target whose resolver sets it.
        target: String,
        /// The count it asks for.
        count: u32,
    },
}

/// The policy the resolvers of `legs` set (`None`: none sets one, the clusters' `lb_policy`
/// applies). `ring_hash` is served like `maglev`, by the kernel's Maglev table.
pub fn resolver_policy(legs: &[Leg]) -> Result<Option<LbPolicy>, PolicyError> {
    let mut chosen: Option<(&str, &str, LbPolicy)> = None;
    for leg in legs {
        let Some(lb) = &leg.load_balancer else {
            continue;
        };
        let Some(policy) = kernel_policy(&leg.target.id, lb)? else {
            continue;
        };
        match chosen {
            None => chosen = Some((&leg.target.id, &lb.policy, policy)),
            // maglev and ring_hash are one policy here: both are served by the Maglev table.
            Some((_, _, same)) if same == policy || (same.hashes() && policy.hashes()) => {}
            Some((first, first_policy, _)) => {
                return Err(PolicyError::Conflict {
                    first: first.to_owned(),
                    first_policy: first_policy.to_owned(),
                    second: leg.target.id.clone(),
                    second_policy: lb.policy.clone(),
                });
            }
        }
    }
    Ok(chosen.map(|(_, _, policy)| policy))
}

/// The kernel policy of one resolver's `lb` (`None` for an empty `Policy`, which leaves the
/// cluster's). Consul validated the policy names; any other is treated as unset.
fn kernel_policy(target: &str, lb: &LoadBalancer) -> Result<Option<LbPolicy>, PolicyError> {
    if !lb.hash_policies.is_empty() {
        return Err(PolicyError::HashPolicies {
            target: target.to_owned(),
        });
    }
    if let Some(count) = lb
        .least_request_config
        .as_ref()
        .map(|c| c.choice_count)
        .filter(|c| *c != 0 && *c != 2)
    {
        return Err(PolicyError::ChoiceCount {
            target: target.to_owned(),
            count,
        });
    }
    Ok(match lb.policy.as_str() {
        "random" => Some(LbPolicy::Random),
        "round_robin" => Some(LbPolicy::RoundRobin),
        "least_request" => Some(LbPolicy::LeastRequest),
        "maglev" => Some(LbPolicy::Maglev),
        "ring_hash" => Some(LbPolicy::RingHash),
        _ => None,
    })
}
