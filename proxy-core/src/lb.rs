//! Load assignment: host weights to the fixed-size slot tables the kernel reads.
//!
//! A table has `m` slots (a prime, [`proxy_common::service::SLOTS`] in the kernel). Each host gets
//! a quota of slots proportional to its weight (largest-remainder rounding; every host gets at
//! least one slot while there are at least as many slots as hosts), so a weight resolution of
//! 1/m. For `RANDOM`, the kernel picks a uniformly random slot. For `MAGLEV`, the slots are filled
//! in Maglev order (each host walks its own permutation of the table), so that removing one of N
//! hosts changes only about 1/N of the slots and clients keyed to the others stay where they are.
//!
//! The proxy path's RING_HASH and MAGLEV are Envoy's own constructions instead ([`ring_hash`],
//! [`maglev`], over [`xxhash`]), keyed by a request's [`hash_policy`]; [`Balancer`] is the policy
//! a cluster (or a Consul resolver's `LoadBalancer`) picks with there.

mod balancer;
pub mod hash_policy;
mod locality;
pub mod maglev;
pub mod ring_hash;
pub mod xxhash;
pub mod zone;

use std::net::SocketAddr;

pub use self::balancer::{Balancer, MaglevLbConfig, RingHashFunction, RingHashLbConfig};
use self::locality::class_shares;
use crate::{health::Routing, host::Host};

/// Total weight a table's hosts are scaled to when priority loads are merged: a resolution of
/// one millionth, far below the table's 1/1021.
const LOAD_SCALE: f64 = 1_000_000.0;

/// Kernel failover levels from a cluster's routing, each a list of (host, weight).
///
/// Envoy spreads traffic over priorities by load (overprovisioning factor 1.4: a priority that is
/// 80 % healthy still takes all traffic; at 50 % it takes 70 % and the next priority the rest),
/// and inside a priority over healthy and then degraded hosts. The kernel picks from one table,
/// so every priority that carries load goes into level 0 with each host's weight scaled by its
/// priority's (and class's) load share, and under locality-weighted balancing by its
/// locality's share ([`class_shares`]). Priorities without load follow as levels 1, 2, ...:
/// the kernel falls back to them only if level 0 has no host.
pub fn kernel_levels(routing: &Routing) -> Vec<Vec<(SocketAddr, u32)>> {
    let mut merged = Vec::new();
    let mut standby = Vec::new();
    for p in &routing.priorities {
        if p.healthy_load + p.degraded_load == 0 {
            if !p.healthy.is_empty() {
                standby.push(
                    p.healthy
                        .iter()
                        .map(|h| (h.addr, h.weight.max(1)))
                        .collect(),
                );
            }
            continue;
        }
        // Zone-aware `fail_traffic_on_panic`: a priority in panic serves nothing.
        if p.panic
            && routing
                .zone
                .as_ref()
                .is_some_and(|z| z.fail_traffic_on_panic)
        {
            continue;
        }
        let classes: [(&[Host], u32); 2] = if p.panic {
            [(&p.all, p.healthy_load + p.degraded_load), (&[], 0)]
        } else {
            [(&p.healthy, p.healthy_load), (&p.degraded, p.degraded_load)]
        };
        // Envoy ignores localities in panic: the whole priority's hosts, by host weight.
        let localities = routing.locality_weighted && !p.panic;
        for (class, (hosts, load)) in classes.into_iter().enumerate() {
            let all = if localities { Some(&p.all[..]) } else { None };
            let mut shares = class_shares(hosts, all, routing.overprovisioning_factor);
            // Zone routing: priority 0's healthy hosts only (Envoy's rule), not in panic.
            if let (Some(zone), 0, 0, false) = (&routing.zone, p.priority, class, p.panic) {
                shares = zone::host_shares(hosts, &shares, zone);
            }
            for (addr, share) in shares {
                let scaled = f64::from(load) / 100.0 * share * LOAD_SCALE;
                merged.push((addr, (scaled.round() as u32).max(1)));
            }
        }
    }
    let mut levels = Vec::with_capacity(1 + standby.len());
    if !merged.is_empty() {
        levels.push(merged);
    }
    levels.extend(standby);
    levels
}

/// A host as the slot tables see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotHost {
    /// Backend id the slot holds (the kernel's key into its backend map).
    pub id: u32,
    /// Address; seeds the host's Maglev permutation, so it is stable across republishing.
    pub addr: SocketAddr,
    /// Relative weight, at least 1.
    pub weight: u32,
}

/// Slots per host, proportional to weight, summing to `m`. Hosts beyond `m` (sorted by weight,
/// heaviest first) get none: a table cannot hold more hosts than slots.
pub fn quotas(weights: &[u32], m: usize) -> Vec<usize> {
    let n = weights.len();
    let mut quota = vec![0usize; n];
    if n == 0 || m == 0 {
        return quota;
    }
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(weights[i]));
    // Everyone that fits gets one slot first, so no configured host is starved by rounding.
    let guaranteed = n.min(m);
    for &i in &order[..guaranteed] {
        quota[i] = 1;
    }
    let rest = m - guaranteed;
    let total: u128 = order[..guaranteed]
        .iter()
        .map(|&i| u128::from(weights[i]))
        .sum();
    if rest == 0 || total == 0 {
        return quota;
    }
    // Largest remainder over the slots left after the guaranteed ones.
    let mut remainders = Vec::with_capacity(guaranteed);
    let mut given = 0usize;
    for &i in &order[..guaranteed] {
        let exact = u128::from(weights[i]) * rest as u128;
        let whole = (exact / total) as usize;
        quota[i] += whole;
        given += whole;
        remainders.push((exact % total, i));
    }
    remainders.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    for &(_, i) in remainders.iter().take(rest - given) {
        quota[i] += 1;
    }
    quota
}

/// A table for random selection: each host's quota of slots, interleaved.
pub fn random_table(hosts: &[SlotHost], m: usize) -> Vec<u32> {
    let weights: Vec<u32> = hosts.iter().map(|h| h.weight).collect();
    let quota = quotas(&weights, m);
    let mut table = Vec::with_capacity(m);
    let mut left = quota.clone();
    // Round-robin placement keeps a host's slots spread out; order does not matter to a random
    // pick, but it makes tables easy to read in dumps.
    while table.len() < m && left.iter().any(|&q| q > 0) {
        for (i, host) in hosts.iter().enumerate() {
            if left[i] > 0 {
                table.push(host.id);
                left[i] -= 1;
            }
        }
    }
    table
}

/// A Maglev lookup table of size `m` (prime), with each host filling exactly its quota.
pub fn maglev_table(hosts: &[SlotHost], m: usize) -> Vec<u32> {
    let weights: Vec<u32> = hosts.iter().map(|h| h.weight).collect();
    let quota = quotas(&weights, m);
    if hosts.is_empty() || m == 0 {
        return Vec::new();
    }
    let perms: Vec<(usize, usize)> = hosts
        .iter()
        .map(|h| {
            let seed = hash_addr(&h.addr);
            let offset = (seed % m as u64) as usize;
            let skip = if m > 1 {
                ((seed >> 32) % (m as u64 - 1)) as usize + 1
            } else {
                1
            };
            (offset, skip)
        })
        .collect();
    let mut next = vec![0usize; hosts.len()];
    let mut filled = vec![0usize; hosts.len()];
    let mut table: Vec<Option<u32>> = vec![None; m];
    let mut placed = 0;
    while placed < m {
        for (i, host) in hosts.iter().enumerate() {
            if filled[i] >= quota[i] {
                continue;
            }
            let (offset, skip) = perms[i];
            // Walk this host's permutation to its next free slot. With m prime and
            // 1 <= skip < m the permutation visits every slot, so this ends.
            let slot = loop {
                let candidate = (offset + next[i] * skip) % m;
                next[i] += 1;
                if table[candidate].is_none() {
                    break candidate;
                }
            };
            table[slot] = Some(host.id);
            filled[i] += 1;
            placed += 1;
            if placed == m {
                break;
            }
        }
    }
    table
        .into_iter()
        .map(std::option::Option::unwrap_or_default)
        .collect()
}

/// A table for ROUND_ROBIN: the kernel takes slot `turn % len` with a turn that every connect
/// increments, so the table *is* the rotation. Its length is the sum of the weights divided by
/// their greatest common divisor when that fits in `m` (so equal weights give one slot per host,
/// and weights 3:1 give four slots), and `m` slots by [`quotas`] otherwise; the slots are laid
/// out in smooth weighted order (each step the host with the largest credit, credits grown by
/// weight), so a host's turns are spread through the rotation instead of bunched.
pub fn round_robin_table(hosts: &[SlotHost], m: usize) -> Vec<u32> {
    if hosts.is_empty() || m == 0 {
        return Vec::new();
    }
    let weights: Vec<u64> = hosts.iter().map(|h| u64::from(h.weight.max(1))).collect();
    let divisor = weights.iter().copied().fold(0, gcd);
    let exact: u64 = weights.iter().map(|w| w / divisor).sum();
    let quota: Vec<u64> = if exact <= m as u64 {
        weights.iter().map(|w| w / divisor).collect()
    } else {
        let raw: Vec<u32> = hosts.iter().map(|h| h.weight.max(1)).collect();
        quotas(&raw, m).into_iter().map(|q| q as u64).collect()
    };
    let len: u64 = quota.iter().sum();
    let mut credit = vec![0i64; hosts.len()];
    let mut table = Vec::with_capacity(len as usize);
    for _ in 0..len {
        let mut best = None;
        for (i, q) in quota.iter().enumerate() {
            if *q == 0 {
                continue;
            }
            credit[i] += *q as i64;
            if best.is_none_or(|b: usize| credit[i] > credit[b]) {
                best = Some(i);
            }
        }
        let Some(b) = best else { break };
        credit[b] -= len as i64;
        table.push(hosts[b].id);
    }
    table
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// A stable 64-bit hash of an address (FNV-1a over its text, then a finaliser), so that a host
/// keeps its permutation across restarts and releases.
fn hash_addr(addr: &SocketAddr) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in addr.to_string().bytes() {
        h ^= u64::from(byte);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^ (h >> 33)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        health::{HostClass, Routing},
        host::Host,
    };

    fn host(last: u8, priority: u32) -> Host {
        Host {
            priority,
            ..Host::new(SocketAddr::from(([127, 0, 0, last], 80)))
        }
    }

    #[test]
    fn healthy_first_priority_takes_everything_and_the_next_stands_by() {
        let hosts = [
            (host(1, 0), HostClass::Healthy),
            (host(2, 0), HostClass::Healthy),
            (host(3, 1), HostClass::Healthy),
        ];
        let levels = kernel_levels(&Routing::compute(&hosts, 50.0));
        assert_eq!(levels.len(), 2);
        assert_eq!(levels[0].len(), 2);
        assert_eq!(levels[1][0].0, host(3, 1).addr);
    }

    #[test]
    fn partially_healthy_priority_spills_by_load() {
        // 1 of 2 healthy: availability 140 * 1/2 = 70 %, so 70 % to P0 and 30 % to P1.
        let hosts = [
            (host(1, 0), HostClass::Healthy),
            (host(2, 0), HostClass::Unhealthy),
            (host(3, 1), HostClass::Healthy),
        ];
        let levels = kernel_levels(&Routing::compute(&hosts, 0.0));
        assert_eq!(levels.len(), 1);
        let weight = |last| {
            levels[0]
                .iter()
                .find(|(a, _)| *a == host(last, 0).addr)
                .map(|x| x.1)
        };
        assert_eq!(weight(1), Some(700_000));
        assert_eq!(weight(3), Some(300_000));
        assert_eq!(weight(2), None);
    }

    #[test]
    fn nothing_routable_gives_no_levels() {
        let hosts = [(host(1, 0), HostClass::Unhealthy)];
        assert!(kernel_levels(&Routing::compute(&hosts, 0.0)).is_empty());
    }

    #[test]
    fn panic_routes_to_all_hosts_of_the_priority() {
        let hosts = [
            (host(1, 0), HostClass::Healthy),
            (host(2, 0), HostClass::Unhealthy),
            (host(3, 0), HostClass::Unhealthy),
            (host(4, 0), HostClass::Unhealthy),
        ];
        let levels = kernel_levels(&Routing::compute(&hosts, 50.0));
        assert_eq!(levels[0].len(), 4, "{levels:?}");
    }

    const M: usize = 1021;

    fn hosts(weights: &[u32]) -> Vec<SlotHost> {
        weights
            .iter()
            .enumerate()
            .map(|(i, &weight)| SlotHost {
                id: i as u32 + 1,
                addr: SocketAddr::from(([127, 0, 0, 10 + i as u8], 8080)),
                weight,
            })
            .collect()
    }

    #[test]
    fn quotas_are_proportional_and_sum_to_m() {
        let q = quotas(&[5, 3, 2], M);
        assert_eq!(q.iter().sum::<usize>(), M);
        for (got, w) in q.iter().zip([5.0, 3.0, 2.0]) {
            let want = M as f64 * w / 10.0;
            assert!((*got as f64 - want).abs() <= 1.0, "{got} vs {want}");
        }
    }

    #[test]
    fn one_percent_weights_are_resolved() {
        // 99:1 must not round the small host away, nor give it more than ~1 %.
        let q = quotas(&[99, 1], M);
        assert!((9..=12).contains(&q[1]), "{q:?}");
    }

    #[test]
    fn every_host_gets_a_slot_when_it_fits() {
        let q = quotas(&[1_000_000, 1, 1], M);
        assert!(q[1] >= 1 && q[2] >= 1, "{q:?}");
        assert_eq!(q.iter().sum::<usize>(), M);
    }

    #[test]
    fn more_hosts_than_slots_keeps_the_heaviest() {
        let mut weights = vec![1u32; 10];
        weights[7] = 5;
        let q = quotas(&weights, 4);
        assert_eq!(q.iter().sum::<usize>(), 4);
        assert_eq!(q[7], 1);
    }

    #[test]
    fn empty_inputs() {
        assert!(random_table(&[], M).is_empty());
        assert!(maglev_table(&[], M).is_empty());
        assert_eq!(quotas(&[], M), Vec::<usize>::new());
    }

    #[test]
    fn random_table_matches_quotas() {
        let h = hosts(&[5, 3, 2]);
        let table = random_table(&h, M);
        assert_eq!(table.len(), M);
        let q = quotas(&[5, 3, 2], M);
        for (i, host) in h.iter().enumerate() {
            assert_eq!(table.iter().filter(|&&id| id == host.id).count(), q[i]);
        }
    }

    #[test]
    fn round_robin_tables_are_the_exact_rotation() {
        // Equal weights: one slot each, so connect n goes to host n % 3.
        assert_eq!(round_robin_table(&hosts(&[1, 1, 1]), 1021), [1, 2, 3]);
        // Envoy-scaled equal weights reduce the same way.
        assert_eq!(
            round_robin_table(&hosts(&[333_333, 333_333, 333_333]), 1021),
            [1, 2, 3]
        );
        // 3:1 is four turns, spread: the light host is not next to itself.
        let t = round_robin_table(&hosts(&[3, 1]), 1021);
        assert_eq!(t.len(), 4);
        assert_eq!(t.iter().filter(|&&id| id == 1).count(), 3);
        // 5:3:2 in ten turns, each host's turns spread out (no host twice in a row here).
        let t = round_robin_table(&hosts(&[5, 3, 2]), 1021);
        assert_eq!(t.len(), 10);
        for (id, want) in [(1, 5), (2, 3), (3, 2)] {
            assert_eq!(t.iter().filter(|&&x| x == id).count(), want);
        }
        for pair in t.windows(2) {
            assert!(!(pair[0] == pair[1] && pair[0] != 1), "{t:?}");
        }
        // Weights without a small common divisor: the table quotas over m slots.
        let t = round_robin_table(&hosts(&[1_000_003, 999_983]), 1021);
        assert_eq!(t.len(), 1021);
        assert!(round_robin_table(&[], 1021).is_empty());
    }

    #[test]
    fn maglev_table_is_full_and_weighted() {
        let h = hosts(&[1, 1, 2]);
        let table = maglev_table(&h, M);
        assert_eq!(table.len(), M);
        let q = quotas(&[1, 1, 2], M);
        for (i, host) in h.iter().enumerate() {
            assert_eq!(table.iter().filter(|&&id| id == host.id).count(), q[i]);
        }
    }

    #[test]
    fn maglev_removing_one_of_n_moves_about_one_nth() {
        let n = 10;
        let all = hosts(&vec![1; n]);
        let before = maglev_table(&all, M);
        let fewer: Vec<SlotHost> = all.iter().copied().filter(|h| h.id != 4).collect();
        let after = maglev_table(&fewer, M);
        // Slots that did not belong to the removed host and changed owner anyway.
        let moved = before
            .iter()
            .zip(&after)
            .filter(|(b, a)| **b != 4 && b != a)
            .count();
        // Maglev is not perfectly minimal; allow a few percent of collateral movement.
        assert!(
            moved as f64 / M as f64 <= 0.05,
            "collateral movement {moved}/{M}"
        );
    }

    #[test]
    fn maglev_is_stable_across_calls_and_orders() {
        let h = hosts(&[1, 2, 3]);
        let mut reversed = h.clone();
        reversed.reverse();
        assert_eq!(maglev_table(&h, M), maglev_table(&h, M));
        // Order of hosts in the input may shift a few slots but the quotas stay exact.
        let t = maglev_table(&reversed, M);
        assert_eq!(
            t.iter().filter(|&&id| id == 3).count(),
            quotas(&[1, 2, 3], M)[2]
        );
    }

    /// Generated cases: a seeded xorshift, so a failure names its case and replays.
    mod properties {
        use super::*;

        struct Rng(u64);

        impl Rng {
            fn next(&mut self) -> u64 {
                self.0 ^= self.0 << 13;
                self.0 ^= self.0 >> 7;
                self.0 ^= self.0 << 17;
                self.0
            }

            /// Uniform in `lo..=hi`.
            fn range(&mut self, lo: u64, hi: u64) -> u64 {
                lo + self.next() % (hi - lo + 1)
            }

            /// Weights of one of three shapes: equal, uniform, or one heavy host among light ones.
            fn weights(&mut self, n: usize) -> Vec<u32> {
                let shape = self.range(0, 2);
                (0..n)
                    .map(|i| match shape {
                        0 => 7,
                        1 => self.range(1, 1000) as u32,
                        _ if i == 0 => self.range(1_000, 1_000_000) as u32,
                        _ => self.range(1, 10) as u32,
                    })
                    .collect()
            }
        }

        const CASES: u64 = 300;

        /// The rule of `quotas`: one slot per host, then the rest of the table in proportion to
        /// weight by largest remainder. Each quota is within one slot of that, the table is
        /// full, and a heavier host never has fewer slots.
        #[test]
        fn quotas_follow_their_rule_for_any_weights() {
            for case in 0..CASES {
                let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (case + 1));
                let n = rng.range(1, 200) as usize;
                let weights = rng.weights(n);
                let q = quotas(&weights, M);
                assert_eq!(q.iter().sum::<usize>(), M, "case {case}: {weights:?}");
                let total: f64 = weights.iter().map(|w| f64::from(*w)).sum();
                let rest = (M - n) as f64;
                for (i, (&got, &w)) in q.iter().zip(&weights).enumerate() {
                    let want = 1.0 + rest * f64::from(w) / total;
                    assert!(
                        (got as f64 - want).abs() < 1.0,
                        "case {case}, host {i}: {got} slots, rule says {want:.2} ({weights:?})"
                    );
                    for (j, &other) in weights.iter().enumerate() {
                        assert!(
                            w <= other || got >= q[j],
                            "case {case}: host {i} (weight {w}) has fewer slots than {j} ({other})"
                        );
                    }
                }
                // With equal weights the rule is exact proportion.
                if weights.iter().all(|w| *w == weights[0]) {
                    let (lo, hi) = (M / n, M.div_ceil(n));
                    assert!(
                        q.iter().all(|s| (lo..=hi).contains(s)),
                        "case {case}: {q:?}"
                    );
                }
            }
        }

        /// Both tables hold exactly each host's quota.
        #[test]
        fn tables_hold_exactly_the_quotas() {
            for case in 0..CASES / 3 {
                let mut rng = Rng(0x2545_f491_4f6c_dd1d ^ (case + 1));
                let n = rng.range(1, 60) as usize;
                let weights = rng.weights(n);
                let h = hosts(&weights);
                let q = quotas(&weights, M);
                for table in [random_table(&h, M), maglev_table(&h, M)] {
                    assert_eq!(table.len(), M, "case {case}");
                    for (i, host) in h.iter().enumerate() {
                        let held = table.iter().filter(|&&id| id == host.id).count();
                        assert_eq!(held, q[i], "case {case}, host {i}: {weights:?}");
                    }
                }
            }
        }

        /// Consistent hashing: when one of N hosts goes, the clients that move are about its
        /// share (1/N of them with equal weights), and few others move besides.
        #[test]
        fn maglev_moves_about_the_removed_hosts_share() {
            let mut worst: f64 = 0.0;
            for case in 0..CASES / 3 {
                let mut rng = Rng(0xd1b5_4a32_d192_ed03 ^ (case + 1));
                let n = rng.range(3, 50) as usize;
                let weights = if rng.range(0, 1) == 0 {
                    vec![1; n]
                } else {
                    (0..n).map(|_| rng.range(1, 4) as u32).collect()
                };
                let all = hosts(&weights);
                let gone = all[rng.range(0, n as u64 - 1) as usize].id;
                let before = maglev_table(&all, M);
                let rest: Vec<SlotHost> = all.iter().copied().filter(|h| h.id != gone).collect();
                let after = maglev_table(&rest, M);
                let share = before.iter().filter(|&&id| id == gone).count() as f64 / M as f64;
                let moved =
                    before.iter().zip(&after).filter(|(b, a)| b != a).count() as f64 / M as f64;
                let collateral = moved - share;
                worst = worst.max(collateral);
                assert!(
                    collateral <= 0.10,
                    "case {case}: {n} hosts {weights:?}, removing {gone} moved {moved:.3} of the table, its share was {share:.3}"
                );
            }
            println!("worst collateral movement: {worst:.3} of the table");
        }
    }
}
