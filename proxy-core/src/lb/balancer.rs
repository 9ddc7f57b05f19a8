//! How the proxy path picks a cluster's host: the cluster's `lb_policy` with its
//! `ring_hash_lb_config` / `maglev_lb_config` (Envoy's fields, bounds and error texts), or a
//! Consul service-resolver's `LoadBalancer`, which replaces it for the resolver's targets as
//! Consul's xDS makes it the cluster's policy.

use serde::{Deserialize, Serialize};

use super::{maglev, ring_hash};
use crate::config::LbPolicy;

/// Envoy's `Cluster.RingHashLbConfig`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RingHashLbConfig {
    /// Fewest points on the ring (more points: a more even spread). Default 1024; at most
    /// 8388608.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub minimum_ring_size: Option<u64>,
    /// Most points on the ring. Default 8388608, also the largest value accepted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub maximum_ring_size: Option<u64>,
    /// `XX_HASH` (the default and the only one available; `MURMUR_HASH_2` is refused).
    #[serde(default)]
    pub hash_function: RingHashFunction,
}

/// Envoy's `RingHashLbConfig.HashFunction`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum RingHashFunction {
    /// XXH64 with seed 0 (Envoy's default).
    #[default]
    XxHash,
    /// Not available.
    #[serde(rename = "MURMUR_HASH_2")]
    MurmurHash2,
}

/// Envoy's `Cluster.MaglevLbConfig`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct MaglevLbConfig {
    /// Entries in the proxy path's Maglev table: a prime, at most 5000011. Default 65537. (The
    /// kernel path's table has its own fixed size.)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub table_size: Option<u64>,
}

impl RingHashLbConfig {
    /// Envoy's checks, with its texts.
    pub fn validate(&self) -> Result<(), String> {
        if self.hash_function == RingHashFunction::MurmurHash2 {
            return Err("hash_function MURMUR_HASH_2 is not available; use XX_HASH".into());
        }
        for (name, value) in [
            ("minimum_ring_size", self.minimum_ring_size),
            ("maximum_ring_size", self.maximum_ring_size),
        ] {
            if value.is_some_and(|v| v > ring_hash::MAX_RING_SIZE) {
                return Err(format!(
                    "{name}: value must be less than or equal to {}",
                    ring_hash::MAX_RING_SIZE
                ));
            }
        }
        let (min, max) = self.sizes();
        if min > max {
            return Err(format!(
                "ring hash: minimum_ring_size ({min}) > maximum_ring_size ({max})"
            ));
        }
        Ok(())
    }

    /// The minimum and maximum ring sizes, defaults filled in.
    pub fn sizes(&self) -> (u64, u64) {
        (
            self.minimum_ring_size
                .unwrap_or(ring_hash::DEFAULT_MIN_RING_SIZE),
            self.maximum_ring_size.unwrap_or(ring_hash::MAX_RING_SIZE),
        )
    }
}

impl MaglevLbConfig {
    /// Envoy's checks, with its texts.
    pub fn validate(&self) -> Result<(), String> {
        let size = self.size();
        if size > maglev::MAX_TABLE_SIZE {
            return Err(format!(
                "table_size: value must be less than or equal to {}",
                maglev::MAX_TABLE_SIZE
            ));
        }
        if !maglev::is_prime(size) {
            return Err("The table size of maglev must be prime number".into());
        }
        Ok(())
    }

    /// The table size, the default filled in.
    pub fn size(&self) -> u64 {
        self.table_size.unwrap_or(maglev::DEFAULT_TABLE_SIZE)
    }
}

/// A host-picking policy with its parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Balancer {
    /// Weighted random.
    Random,
    /// A smooth weighted rotation.
    RoundRobin,
    /// The fewest open requests of `choice_count` hosts drawn by weight.
    LeastRequest {
        /// Hosts drawn per pick (2: the power of two choices).
        choice_count: u32,
    },
    /// Envoy's ring ([`ring_hash::Ring`]).
    RingHash {
        /// Fewest points.
        min_ring_size: u64,
        /// Most points.
        max_ring_size: u64,
    },
    /// Envoy's Maglev table ([`maglev::Maglev`]).
    Maglev {
        /// Entries (a prime).
        table_size: u64,
    },
}

/// Envoy's (and Consul's) default `choice_count`.
const DEFAULT_CHOICE_COUNT: u32 = 2;

impl Balancer {
    /// A cluster's own policy (CLUSTER_PROVIDED, for ORIGINAL_DST, picks nothing: random).
    pub fn of_cluster(
        policy: LbPolicy,
        ring: Option<&RingHashLbConfig>,
        maglev: Option<&MaglevLbConfig>,
    ) -> Self {
        match policy {
            LbPolicy::Random | LbPolicy::ClusterProvided => Self::Random,
            LbPolicy::RoundRobin => Self::RoundRobin,
            LbPolicy::LeastRequest => Self::LeastRequest {
                choice_count: DEFAULT_CHOICE_COUNT,
            },
            LbPolicy::RingHash => {
                let (min_ring_size, max_ring_size) = ring.cloned().unwrap_or_default().sizes();
                Self::RingHash {
                    min_ring_size,
                    max_ring_size,
                }
            }
            LbPolicy::Maglev => Self::Maglev {
                table_size: maglev.cloned().unwrap_or_default().size(),
            },
        }
    }

    /// A Consul resolver's `LoadBalancer` (validated by proxy-chain), as Consul's xDS turns it
    /// into the cluster's policy; `None` when it sets no policy (the cluster's applies). Sizes
    /// of 0 are Envoy's defaults.
    pub fn of_resolver(lb: &proxy_chain::entries::LoadBalancer) -> Option<Self> {
        let nonzero = |v: u64, default: u64| if v == 0 { default } else { v };
        Some(match lb.policy.as_str() {
            "random" => Self::Random,
            "round_robin" => Self::RoundRobin,
            "least_request" => Self::LeastRequest {
                choice_count: lb
                    .least_request_config
                    .as_ref()
                    .map_or(DEFAULT_CHOICE_COUNT, |c| c.choice_count)
                    .max(DEFAULT_CHOICE_COUNT),
            },
            "ring_hash" => {
                let c = lb.ring_hash_config.clone().unwrap_or_default();
                Self::RingHash {
                    min_ring_size: nonzero(c.minimum_ring_size, ring_hash::DEFAULT_MIN_RING_SIZE),
                    max_ring_size: nonzero(c.maximum_ring_size, ring_hash::MAX_RING_SIZE),
                }
            }
            "maglev" => Self::Maglev {
                table_size: maglev::DEFAULT_TABLE_SIZE,
            },
            _ => return None,
        })
    }

    /// RING_HASH and MAGLEV: the hosts are picked by a hash of the request.
    pub fn is_hash_based(self) -> bool {
        matches!(self, Self::RingHash { .. } | Self::Maglev { .. })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envoys_bounds_and_texts() {
        let ring = |yaml: &str| serde_norway::from_str::<RingHashLbConfig>(yaml).unwrap();
        assert_eq!(ring("{}").sizes(), (1024, 8_388_608));
        assert!(ring("{}").validate().is_ok());
        assert_eq!(
            ring("{minimum_ring_size: 8388609}").validate().unwrap_err(),
            "minimum_ring_size: value must be less than or equal to 8388608"
        );
        assert_eq!(
            ring("{minimum_ring_size: 100, maximum_ring_size: 10}")
                .validate()
                .unwrap_err(),
            "ring hash: minimum_ring_size (100) > maximum_ring_size (10)"
        );
        assert!(ring("{hash_function: MURMUR_HASH_2}").validate().is_err());
        let maglev = |yaml: &str| serde_norway::from_str::<MaglevLbConfig>(yaml).unwrap();
        assert_eq!(maglev("{}").size(), 65_537);
        assert_eq!(
            maglev("{table_size: 65536}").validate().unwrap_err(),
            "The table size of maglev must be prime number"
        );
        assert!(
            maglev("{table_size: 5000017}")
                .validate()
                .unwrap_err()
                .contains("5000011")
        );
        assert!(maglev("{table_size: 13}").validate().is_ok());
    }

    #[test]
    fn resolver_policies() {
        let of = |json: &str| {
            let lb: proxy_chain::entries::LoadBalancer = serde_json::from_str(json).unwrap();
            Balancer::of_resolver(&lb)
        };
        assert_eq!(of("{}"), None);
        assert_eq!(of(r#"{"Policy": "random"}"#), Some(Balancer::Random));
        assert_eq!(
            of(r#"{"Policy": "least_request", "LeastRequestConfig": {"ChoiceCount": 5}}"#),
            Some(Balancer::LeastRequest { choice_count: 5 })
        );
        assert_eq!(
            of(r#"{"Policy": "ring_hash", "RingHashConfig": {"MinimumRingSize": 16}}"#),
            Some(Balancer::RingHash {
                min_ring_size: 16,
                max_ring_size: 8_388_608
            })
        );
        assert_eq!(
            of(r#"{"Policy": "maglev"}"#),
            Some(Balancer::Maglev { table_size: 65_537 })
        );
        // The cluster's own: defaults filled in.
        assert_eq!(
            Balancer::of_cluster(LbPolicy::RingHash, None, None),
            Balancer::RingHash {
                min_ring_size: 1024,
                max_ring_size: 8_388_608
            }
        );
    }
}
