//! RING_HASH as Envoy builds it (`ring_hash_lb.cc`): every host puts `scale x normalized
//! weight` points on a ring, each point the XXH64 of `"<address>_<i>"`; a request hash takes
//! the first point at or after it, wrapping around. Removing one of N hosts moves only the keys
//! that host's points held (about 1/N of them).

use std::net::SocketAddr;

use super::xxhash::xxhash64;

/// Envoy's default `minimum_ring_size`.
pub const DEFAULT_MIN_RING_SIZE: u64 = 1024;
/// Envoy's default `maximum_ring_size`, and the largest either bound may be.
pub const MAX_RING_SIZE: u64 = 8 * 1024 * 1024;

/// A built ring: (point, index of the host in the list it was built from), sorted by point.
#[derive(Debug, PartialEq, Clone, Default)]
pub struct Ring {
    points: Vec<(u64, u32)>,
}

impl Ring {
    /// The ring of `hosts` (address, weight; a weight of 0 counts as 1) with Envoy's sizing:
    /// the lightest host gets a whole number of points once the ring has `min_size` points,
    /// and the ring never grows past `max_size`.
    pub fn build(hosts: &[(SocketAddr, u32)], min_size: u64, max_size: u64) -> Self {
        let sum: u64 = hosts.iter().map(|(_, w)| u64::from((*w).max(1))).sum();
        if sum == 0 {
            return Self::default();
        }
        let normalized: Vec<f64> = hosts
            .iter()
            .map(|(_, w)| f64::from((*w).max(1)) / sum as f64)
            .collect();
        let min_weight = normalized.iter().copied().fold(1.0_f64, f64::min);
        let scale = ((min_weight * min_size as f64).ceil() / min_weight).min(max_size as f64);
        let mut points = Vec::with_capacity(scale.ceil() as usize);
        let (mut current, mut target) = (0.0_f64, 0.0_f64);
        for (index, ((addr, _), weight)) in hosts.iter().zip(&normalized).enumerate() {
            let key = addr.to_string();
            target += scale * weight;
            let mut i = 0_u64;
            while current < target {
                let point = xxhash64(format!("{key}_{i}").as_bytes(), 0);
                points.push((point, index as u32));
                i += 1;
                current += 1.0;
            }
        }
        points.sort_by_key(|&(point, _)| point);
        Self { points }
    }

    /// The host (its index in the list the ring was built from) for `hash`; a retry's
    /// `attempt` > 0 takes the point that many places further on, as Envoy's does.
    pub fn pick(&self, hash: u64, attempt: u32) -> Option<usize> {
        if self.points.is_empty() {
            return None;
        }
        let first = self.points.partition_point(|&(point, _)| point < hash);
        let at = (first + attempt as usize) % self.points.len();
        Some(self.points[at].1 as usize)
    }

    /// The number of points on the ring.
    pub fn len(&self) -> usize {
        self.points.len()
    }

    /// Whether the ring has no point (no host).
    pub fn is_empty(&self) -> bool {
        self.points.is_empty()
    }

    /// The points host `index` holds.
    pub fn points_of(&self, index: usize) -> usize {
        self.points.iter().filter(|p| p.1 as usize == index).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(n: u8) -> Vec<(SocketAddr, u32)> {
        (1..=n)
            .map(|i| (SocketAddr::from(([127, 0, 0, i], 8080)), 1))
            .collect()
    }

    #[test]
    fn sizes_follow_envoys_rules_and_weights() {
        // Equal weights: the lightest host gets ceil(1024 / 3) = 342 points, so does every host.
        let ring = Ring::build(&hosts(3), DEFAULT_MIN_RING_SIZE, MAX_RING_SIZE);
        assert_eq!(ring.len(), 1026);
        assert!((0..3).all(|i| ring.points_of(i) == 342));
        // Weights 1:3: a quarter and three quarters of 1024.
        let mut weighted = hosts(2);
        weighted[1].1 = 3;
        let ring = Ring::build(&weighted, DEFAULT_MIN_RING_SIZE, MAX_RING_SIZE);
        assert_eq!((ring.points_of(0), ring.points_of(1)), (256, 768));
        // The maximum caps the ring.
        let ring = Ring::build(&hosts(3), DEFAULT_MIN_RING_SIZE, 600);
        assert_eq!(ring.len(), 600);
        assert!(Ring::build(&[], 1024, 2048).pick(7, 0).is_none());
    }

    #[test]
    fn a_point_is_the_hash_of_the_address_and_its_number() {
        // One host, one point: "127.0.0.1:80_0" (XXH64 0x4bb2f57cda42c065).
        let ring = Ring::build(&[(SocketAddr::from(([127, 0, 0, 1], 80)), 1)], 1, 1);
        assert_eq!(ring.points, vec![(0x4bb2_f57c_da42_c065, 0)]);
        // Any hash lands on it, a hash above it wraps around to it.
        assert_eq!(ring.pick(u64::MAX, 0), Some(0));
    }

    /// Removing one of five hosts moves the keys it held and some others: Envoy sizes the ring
    /// by its lightest host, so each of the four left grows from 205 to 256 points, and the new
    /// points take keys. (Hosts' first 205 points stay where they were.) Over 20 000 keys.
    #[test]
    fn removing_one_of_n_hosts_moves_its_keys_and_a_few_more() {
        let all = hosts(5);
        let before = Ring::build(&all, DEFAULT_MIN_RING_SIZE, MAX_RING_SIZE);
        let after = Ring::build(&all[..4], DEFAULT_MIN_RING_SIZE, MAX_RING_SIZE);
        assert_eq!((before.points_of(0), after.points_of(0)), (205, 256));
        let keys = 20_000;
        let (mut on_removed, mut others_moved) = (0, 0);
        for k in 0..keys {
            let hash = xxhash64(format!("key-{k}").as_bytes(), 0);
            let was = before.pick(hash, 0).unwrap();
            if was == 4 {
                on_removed += 1;
            } else if after.pick(hash, 0) != Some(was) {
                others_moved += 1;
            }
        }
        // A fifth of the keys were on the removed host (3867), and a tenth of the others'
        // moved to the new points (2040): fewer than the removed host's own.
        assert!((3_600..4_400).contains(&on_removed), "{on_removed}");
        assert!(others_moved < 2_100, "{others_moved}");
    }

    #[test]
    fn a_retry_takes_the_next_point() {
        let ring = Ring::build(&hosts(2), 4, 4);
        // Hash 0 lands on the first point, a retry on the second, and so on around.
        for attempt in 0..6 {
            let point = ring.points[attempt as usize % 4];
            assert_eq!(ring.pick(0, attempt), Some(point.1 as usize));
        }
    }
}
