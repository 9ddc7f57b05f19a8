//! Zone-aware routing (Envoy's `zone_aware_lb_config`): how much of priority 0's traffic stays
//! in this node's own locality, and how the rest spills over the other localities, from the
//! share of healthy hosts each locality has in the upstream cluster and in the local cluster
//! (the cluster this node's own service belongs to, `cluster_manager.local_cluster_name`).
//!
//! Envoy's rules, in its order:
//! * no zone routing when priority 0's healthy hosts are in fewer than two localities, when the
//!   local cluster's hosts are in fewer than two, or when none of them is in this node's
//!   locality (`lb_local_cluster_not_ok`), or when priority 0 has fewer healthy hosts than
//!   `min_cluster_size` (default 6, `lb_zone_cluster_too_small`), or when the local cluster is
//!   in panic (its healthy share below the panic threshold);
//! * with `local%` this locality's share of the local cluster's healthy hosts and `upstream%`
//!   its share of priority 0's healthy hosts (both in hundredths of a percent, truncated):
//!   `upstream% >= local%` (and above 0) sends everything to this locality (direct);
//! * otherwise `upstream% / local%` of the traffic stays local and the rest goes to the other
//!   localities in proportion to their residual capacity, `upstream% - local%` where positive
//!   (with no residual capacity anywhere, to every locality alike);
//! * `routing_enabled` (default 100 %) is the share of picks that route by zone at all; the
//!   others pick host by host.
//!
//! Envoy decides per pick; the kernel picks from one table, so the result here is each
//! locality's expected share of priority 0's healthy load ([`ZoneShares`]), which
//! [`crate::lb::kernel_levels`] turns into host weights for both paths.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::{
    health::{PriorityRouting, Routing},
    host::{Host, Locality},
};

/// Envoy's default `min_cluster_size`.
pub const DEFAULT_MIN_CLUSTER_SIZE: u64 = 6;

/// A cluster's zone-aware settings with this node's place.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ZoneSettings {
    /// This node's locality (`node.locality`).
    pub node: Locality,
    /// Percent of picks routed by zone (`routing_enabled`, default 100).
    pub routing_enabled: f64,
    /// Fewer healthy priority-0 hosts than this: no zone routing (default 6).
    pub min_cluster_size: u64,
    /// A priority in panic fails its traffic instead of routing to every host.
    pub fail_traffic_on_panic: bool,
}

/// Why zone routing is off, or how it routes (the recomputation's outcome, for the stats).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ZoneState {
    /// Fewer than two localities upstream or in the local cluster.
    NoLocalities,
    /// The local cluster has no host in this node's locality, or is in panic.
    LocalClusterNotOk,
    /// Fewer healthy priority-0 hosts than `min_cluster_size`.
    TooSmall,
    /// Everything stays in this node's locality.
    Direct,
    /// Part stays, the rest spills by residual capacity.
    Residual,
}

/// Each locality's share of priority 0's healthy load under zone routing.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ZoneShares {
    /// How the shares came about.
    pub state: ZoneState,
    /// Locality -> fraction of the zone-routed picks (sums to 1 when routing by zone; empty
    /// when not).
    pub localities: Vec<(Locality, f64)>,
    /// The fraction of picks routed by zone (`routing_enabled` / 100).
    pub enabled: f64,
    /// `fail_traffic_on_panic`.
    pub fail_traffic_on_panic: bool,
}

/// The zone shares of `upstream` for a node in `settings.node`, given the local cluster's
/// routing `local`.
pub fn zone_shares(upstream: &Routing, local: &Routing, settings: &ZoneSettings) -> ZoneShares {
    let (state, localities) = decide(upstream, local, settings);
    ZoneShares {
        state,
        localities,
        enabled: (settings.routing_enabled / 100.0).clamp(0.0, 1.0),
        fail_traffic_on_panic: settings.fail_traffic_on_panic,
    }
}

fn decide(
    upstream: &Routing,
    local: &Routing,
    settings: &ZoneSettings,
) -> (ZoneState, Vec<(Locality, f64)>) {
    let none = |state| (state, Vec::new());
    let p0 = priority_zero(upstream);
    let upstream_healthy = p0.map_or(&[][..], |p| &p.healthy[..]);
    let upstream_counts = per_locality(upstream_healthy);
    // Envoy counts localities over all hosts (its per-locality lists of healthy hosts keep an
    // entry, maybe empty, for each).
    let upstream_all = per_locality(p0.map_or(&[][..], |p| &p.all[..]));
    let local_p0 = priority_zero(local);
    let local_all = per_locality(local_p0.map_or(&[][..], |p| &p.all[..]));
    if upstream_all.len() < 2 || local_all.len() < 2 {
        return none(ZoneState::NoLocalities);
    }
    if local_all.get(&settings.node).copied().unwrap_or(0) == 0 {
        return none(ZoneState::LocalClusterNotOk);
    }
    if (upstream_healthy.len() as u64) < settings.min_cluster_size {
        return none(ZoneState::TooSmall);
    }
    if local_p0.is_none_or(|p| p.panic) {
        return none(ZoneState::LocalClusterNotOk);
    }
    let local_healthy = per_locality(local_p0.map_or(&[][..], |p| &p.healthy[..]));
    let pct = |counts: &BTreeMap<Locality, u64>, l: &Locality| -> u64 {
        let total: u64 = counts.values().sum();
        (10_000 * counts.get(l).copied().unwrap_or(0))
            .checked_div(total)
            .unwrap_or(0)
    };
    let node = &settings.node;
    let (up_here, local_here) = (pct(&upstream_counts, node), pct(&local_healthy, node));
    if upstream_counts.contains_key(node) && up_here > 0 && up_here >= local_here {
        return (ZoneState::Direct, vec![(node.clone(), 1.0)]);
    }
    let stay = if upstream_counts.contains_key(node) && local_here > 0 {
        (up_here * 10_000 / local_here) as f64 / 10_000.0
    } else {
        0.0
    };
    let residual: Vec<(Locality, u64)> = upstream_counts
        .keys()
        .filter(|l| *l != node)
        .map(|l| {
            let spare = pct(&upstream_counts, l).saturating_sub(pct(&local_healthy, l));
            (l.clone(), spare)
        })
        .collect();
    let capacity: u64 = residual.iter().map(|(_, r)| r).sum();
    let mut shares = Vec::new();
    if stay > 0.0 {
        shares.push((node.clone(), stay));
    }
    let spill = 1.0 - stay;
    if capacity == 0 {
        // Envoy: "extremely unlikely", a random locality (here: of those with healthy hosts).
        let n = upstream_counts.len().max(1) as f64;
        for l in upstream_counts.keys() {
            add(&mut shares, l, spill / n);
        }
    } else {
        for (l, r) in residual {
            if r > 0 {
                add(&mut shares, &l, spill * r as f64 / capacity as f64);
            }
        }
    }
    (ZoneState::Residual, shares)
}

/// Priority 0's healthy hosts' fractions under `zone`: `plain` (each host's fraction without
/// zone routing) for the picks not routed by zone, and for the others each locality's share
/// spread over its hosts by weight. Unchanged when zone routing is off.
pub(crate) fn host_shares(
    hosts: &[Host],
    plain: &[(std::net::SocketAddr, f64)],
    zone: &ZoneShares,
) -> Vec<(std::net::SocketAddr, f64)> {
    if zone.localities.is_empty() {
        return plain.to_vec();
    }
    let weight_in = |l: &Locality| -> f64 {
        hosts
            .iter()
            .filter(|h| h.locality() == l)
            .map(|h| f64::from(h.weight.max(1)))
            .sum()
    };
    plain
        .iter()
        .map(|&(addr, f)| {
            let routed = hosts.iter().find(|h| h.addr == addr).map_or(0.0, |h| {
                let share = zone
                    .localities
                    .iter()
                    .find(|(l, _)| l == h.locality())
                    .map_or(0.0, |(_, s)| *s);
                share * f64::from(h.weight.max(1)) / weight_in(h.locality())
            });
            (addr, zone.enabled * routed + (1.0 - zone.enabled) * f)
        })
        .filter(|(_, f)| *f > 0.0)
        .collect()
}

fn add(shares: &mut Vec<(Locality, f64)>, l: &Locality, f: f64) {
    match shares.iter_mut().find(|(k, _)| k == l) {
        Some((_, v)) => *v += f,
        None => shares.push((l.clone(), f)),
    }
}

/// Priority 0 (Envoy routes by zone there only), when the routing has it.
fn priority_zero(routing: &Routing) -> Option<&PriorityRouting> {
    routing.priorities.first().filter(|p| p.priority == 0)
}

fn per_locality(hosts: &[Host]) -> BTreeMap<Locality, u64> {
    let mut counts = BTreeMap::new();
    for h in hosts {
        *counts.entry(h.locality().clone()).or_insert(0) += 1;
    }
    counts
}

#[cfg(test)]
mod tests;
