//! Locality-weighted load balancing inside one priority (Envoy's `locality_weighted_lb_config`):
//! each locality's effective weight, and the hosts' fractions of a class's load.

use std::{collections::BTreeMap, net::SocketAddr};

use crate::host::{Host, Locality};

/// Each host's fraction of its class's load (one class of one priority; the fractions sum
/// to 1): by host weight, or, when `all` (the priority's counted hosts) is given, first by
/// locality as Envoy's locality-weighted balancing does. A locality's effective weight is its
/// `load_balancing_weight` times `min(1, factor * eligible / hosts)` in that locality (no
/// weight: 0); hosts share their locality's part by weight. When no locality has an effective
/// weight Envoy picks from the whole class, so the fractions are by host weight again.
pub(super) fn class_shares(
    hosts: &[Host],
    all: Option<&[Host]>,
    factor: u32,
) -> Vec<(SocketAddr, f64)> {
    let weight = |h: &Host| f64::from(h.weight.max(1));
    let by_weight = |hosts: &[&Host]| -> Vec<(SocketAddr, f64)> {
        let total: f64 = hosts.iter().map(|h| weight(h)).sum();
        hosts.iter().map(|h| (h.addr, weight(h) / total)).collect()
    };
    let every: Vec<&Host> = hosts.iter().collect();
    let Some(shares) = all.and_then(|all| locality_shares(hosts, all, factor)) else {
        return if every.is_empty() {
            Vec::new()
        } else {
            by_weight(&every)
        };
    };
    let mut out = Vec::with_capacity(hosts.len());
    for (locality, share) in shares {
        let members: Vec<&Host> = every
            .iter()
            .copied()
            .filter(|h| h.locality() == locality)
            .collect();
        out.extend(
            by_weight(&members)
                .into_iter()
                .map(|(addr, f)| (addr, f * share)),
        );
    }
    out
}

/// Each locality's fraction of a class (Envoy's `effectiveLocalityWeight`, normalised), for
/// localities with eligible hosts and a positive effective weight; `None` when there are none.
fn locality_shares<'h>(
    eligible: &'h [Host],
    all: &'h [Host],
    factor: u32,
) -> Option<Vec<(&'h Locality, f64)>> {
    let mut counts: BTreeMap<&Locality, (u32, usize, usize)> = BTreeMap::new();
    for h in all {
        let entry = counts
            .entry(h.locality())
            .or_insert((h.locality_weight.unwrap_or(0), 0, 0));
        entry.2 += 1;
    }
    for h in eligible {
        if let Some(entry) = counts.get_mut(h.locality()) {
            entry.1 += 1;
        }
    }
    let effective: Vec<(&Locality, f64)> = counts
        .into_iter()
        .filter(|(_, (_, eligible, _))| *eligible > 0)
        .map(|(locality, (weight, eligible, total))| {
            let ratio = f64::from(factor) / 100.0 * eligible as f64 / total as f64;
            (locality, f64::from(weight) * ratio.min(1.0))
        })
        .filter(|(_, w)| *w > 0.0)
        .collect();
    let sum: f64 = effective.iter().map(|(_, w)| w).sum();
    (sum > 0.0).then(|| effective.into_iter().map(|(l, w)| (l, w / sum)).collect())
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use crate::{
        health::{Balance, HostClass, Routing},
        host::{Host, Locality},
        lb::kernel_levels,
    };

    /// A priority-0 host `127.0.0.<last>` in zone `zone`, whose locality has `weight`.
    fn host(last: u8, zone: &str, weight: Option<u32>) -> Host {
        Host {
            locality_weight: weight,
            ..Host::new(SocketAddr::from(([127, 0, 0, last], 80)))
        }
        .with_locality(Locality {
            zone: zone.into(),
            ..Locality::default()
        })
    }

    fn localities() -> Balance {
        Balance {
            locality_weighted: true,
            ..Balance::new(50.0)
        }
    }

    /// Level 0's weight of each host `127.0.0.<last>`, in millionths (`None`: no traffic).
    fn weights(hosts: &[(Host, HostClass)], balance: &Balance, lasts: &[u8]) -> Vec<Option<u32>> {
        let levels = kernel_levels(&Routing::compute_with(hosts, balance));
        let level = levels.first().cloned().unwrap_or_default();
        lasts
            .iter()
            .map(|last| {
                let addr = SocketAddr::from(([127, 0, 0, *last], 80));
                level.iter().find(|(a, _)| *a == addr).map(|(_, w)| *w)
            })
            .collect()
    }

    #[test]
    fn localities_share_by_weight_times_capped_availability() {
        // X (weight 1): one of two hosts healthy, 1.4 * 1/2 = 0.7. Y (weight 2): whole, 2.
        let hosts = [
            (host(1, "x", Some(1)), HostClass::Healthy),
            (host(2, "x", Some(1)), HostClass::Unhealthy),
            (host(3, "y", Some(2)), HostClass::Healthy),
            (host(4, "y", Some(2)), HostClass::Healthy),
        ];
        let got = weights(&hosts, &localities(), &[1, 2, 3, 4]);
        assert_eq!(got, [Some(259_259), None, Some(370_370), Some(370_370)]);
        // Without locality weighting: host by host.
        let plain = weights(&hosts, &Balance::new(50.0), &[1, 3, 4]);
        assert_eq!(plain, [Some(333_333); 3]);
        // Availability above 1 / 1.4 does not lower a locality's weight (Envoy's table: X at
        // 70 % healthy still takes a third).
        let mut most: Vec<(Host, HostClass)> = (1..=10)
            .map(|i| (host(i, "x", Some(1)), HostClass::Healthy))
            .collect();
        for entry in &mut most[..3] {
            entry.1 = HostClass::Unhealthy;
        }
        most.push((host(20, "y", Some(2)), HostClass::Healthy));
        let got = weights(&most, &localities(), &[4, 20]);
        assert_eq!(got, [Some(46_980), Some(671_141)]);
    }

    #[test]
    fn a_locality_without_weight_gets_nothing_unless_none_has_one() {
        let hosts = [
            (host(1, "x", Some(1)), HostClass::Healthy),
            (host(2, "z", None), HostClass::Healthy),
        ];
        assert_eq!(
            weights(&hosts, &localities(), &[1, 2]),
            [Some(1_000_000), None]
        );
        // No locality with an effective weight: Envoy picks from the whole priority.
        let hosts = [
            (host(1, "x", None), HostClass::Healthy),
            (host(2, "z", None), HostClass::Healthy),
        ];
        let got = weights(&hosts, &localities(), &[1, 2]);
        assert_eq!(got, [Some(500_000), Some(500_000)]);
    }

    #[test]
    fn hosts_share_their_locality_by_weight_and_one_locality_takes_all() {
        let mut heavy = host(2, "x", Some(7));
        heavy.weight = 3;
        let hosts = [
            (host(1, "x", Some(7)), HostClass::Healthy),
            (heavy, HostClass::Healthy),
        ];
        let got = weights(&hosts, &localities(), &[1, 2]);
        assert_eq!(got, [Some(250_000), Some(750_000)]);
    }

    #[test]
    fn degraded_hosts_share_by_their_own_locality_availability() {
        // Healthy 1.4 * 1/4 = 35 %, degraded the other 65 %. Healthy: only X has one. Degraded:
        // X 1 of 2 (0.7), Y 2 of 2 (1).
        let hosts = [
            (host(1, "x", Some(1)), HostClass::Healthy),
            (host(2, "x", Some(1)), HostClass::Degraded),
            (host(3, "y", Some(1)), HostClass::Degraded),
            (host(4, "y", Some(1)), HostClass::Degraded),
        ];
        let got = weights(&hosts, &localities(), &[1, 2, 3, 4]);
        assert_eq!(
            got,
            [Some(350_000), Some(267_647), Some(191_176), Some(191_176)]
        );
    }

    #[test]
    fn panic_ignores_localities() {
        let hosts = [
            (host(1, "x", Some(1)), HostClass::Healthy),
            (host(2, "x", Some(1)), HostClass::Unhealthy),
            (host(3, "x", Some(1)), HostClass::Unhealthy),
            (host(4, "y", Some(9)), HostClass::Unhealthy),
        ];
        let got = weights(&hosts, &localities(), &[1, 2, 3, 4]);
        assert_eq!(got, [Some(250_000); 4]);
    }

    #[test]
    fn the_factor_sets_priority_health_and_locality_availability() {
        let mut backup = host(9, "x", Some(1));
        backup.priority = 1;
        let hosts = [
            (host(1, "x", Some(1)), HostClass::Healthy),
            (host(2, "x", Some(1)), HostClass::Unhealthy),
            (host(3, "y", Some(1)), HostClass::Healthy),
            (host(4, "y", Some(1)), HostClass::Healthy),
            (backup, HostClass::Healthy),
        ];
        // Factor 100: P0 is 75 % available; X's effective weight 0.5 against Y's 1.
        let exact = Balance {
            overprovisioning_factor: 100,
            ..localities()
        };
        let got = weights(&hosts, &exact, &[1, 3, 4, 9]);
        assert_eq!(
            got,
            [Some(250_000), Some(250_000), Some(250_000), Some(250_000)]
        );
        // Factor 200: P0 whole, X's availability capped at 1.
        let generous = Balance {
            overprovisioning_factor: 200,
            ..localities()
        };
        let got = weights(&hosts, &generous, &[1, 3, 4, 9]);
        assert_eq!(got, [Some(500_000), Some(250_000), Some(250_000), None]);
    }

    #[test]
    fn weighted_priority_health_counts_host_weights() {
        let mut heavy = host(1, "", None);
        heavy.weight = 3;
        let mut backup = host(9, "", None);
        backup.priority = 1;
        let hosts = [
            (heavy, HostClass::Healthy),
            (host(2, "", None), HostClass::Unhealthy),
            (backup, HostClass::Healthy),
        ];
        // By count 1.4 * 1/2 = 70 % stays in P0; by weight 1.4 * 3/4 caps at 100 %.
        let counted = weights(&hosts, &Balance::new(0.0), &[1, 9]);
        assert_eq!(counted, [Some(700_000), Some(300_000)]);
        let weighted = Balance {
            weighted_priority_health: true,
            ..Balance::new(0.0)
        };
        assert_eq!(weights(&hosts, &weighted, &[1, 9]), [Some(1_000_000), None]);
    }
}
