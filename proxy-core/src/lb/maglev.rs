//! MAGLEV as Envoy builds it (`maglev_lb.cc`) for the proxy path: hosts sorted by address,
//! each walking its own permutation of a prime-sized table (offset: XXH64 of the address with
//! seed 0, skip: with seed 1), a host of weight w taking a turn in w / max-weight of the rounds.
//! A request hash picks entry `hash % size`. (The kernel's slot tables are
//! [`super::maglev_table`]: a smaller table, filled by quota.)

use std::net::SocketAddr;

use super::xxhash::xxhash64;

/// Envoy's default `table_size`.
pub const DEFAULT_TABLE_SIZE: u64 = 65_537;
/// The largest `table_size` Envoy accepts.
pub const MAX_TABLE_SIZE: u64 = 5_000_011;

/// A built table: each entry the index of a host in the list it was built from.
#[derive(Debug, PartialEq, Clone, Default)]
pub struct Maglev {
    table: Vec<u32>,
}

/// One host's walk through the table.
struct Walk {
    index: u32,
    offset: u64,
    skip: u64,
    next: u64,
    weight: f64,
    target: f64,
}

impl Maglev {
    /// The table of `hosts` (address, weight; 0 counts as 1). `size` must be a prime
    /// ([`is_prime`]; validation refuses others): then every walk visits every entry.
    pub fn build(hosts: &[(SocketAddr, u32)], size: u64) -> Self {
        let sum: u64 = hosts.iter().map(|(_, w)| u64::from((*w).max(1))).sum();
        if sum == 0 || size < 2 || !is_prime(size) {
            return Self::default();
        }
        let mut keyed: Vec<(String, u32, f64)> = hosts
            .iter()
            .enumerate()
            .map(|(i, (addr, w))| {
                let weight = f64::from((*w).max(1)) / sum as f64;
                (addr.to_string(), i as u32, weight)
            })
            .collect();
        keyed.sort_by(|a, b| a.0.cmp(&b.0));
        let max_weight = keyed.iter().map(|k| k.2).fold(0.0_f64, f64::max);
        let mut walks: Vec<Walk> = keyed
            .iter()
            .map(|(key, index, weight)| Walk {
                index: *index,
                offset: xxhash64(key.as_bytes(), 0) % size,
                skip: xxhash64(key.as_bytes(), 1) % (size - 1) + 1,
                next: 0,
                weight: *weight,
                target: 0.0,
            })
            .collect();
        Self {
            table: fill(&mut walks, size, max_weight),
        }
    }

    /// The host (its index in the list the table was built from) for `hash`; a retry's
    /// `attempt` > 0 changes the hash as Envoy's does.
    pub fn pick(&self, hash: u64, attempt: u32) -> Option<usize> {
        if self.table.is_empty() {
            return None;
        }
        let hash = if attempt > 0 {
            hash ^ (!0_u64).wrapping_sub(u64::from(attempt)).wrapping_add(1)
        } else {
            hash
        };
        Some(self.table[(hash % self.table.len() as u64) as usize] as usize)
    }

    /// The entries host `index` holds.
    pub fn entries_of(&self, index: usize) -> usize {
        self.table.iter().filter(|&&h| h as usize == index).count()
    }
}

/// Rounds over the walks until every entry has a host: a walk takes its next free entry when
/// its weight has earned a turn this round.
fn fill(walks: &mut [Walk], size: u64, max_weight: f64) -> Vec<u32> {
    const FREE: u32 = u32::MAX;
    let mut table = vec![FREE; size as usize];
    let mut filled = 0_u64;
    let mut round = 1_u32;
    while filled < size {
        for walk in walks.iter_mut() {
            if filled == size {
                break;
            }
            if f64::from(round) * walk.weight < walk.target {
                continue;
            }
            walk.target += max_weight;
            let mut at = (walk.offset + walk.skip * walk.next) % size;
            while table[at as usize] != FREE {
                walk.next += 1;
                at = (walk.offset + walk.skip * walk.next) % size;
            }
            table[at as usize] = walk.index;
            walk.next += 1;
            filled += 1;
        }
        round += 1;
    }
    table
}

/// Whether `n` is prime (trial division: table sizes are at most [`MAX_TABLE_SIZE`]).
pub fn is_prime(n: u64) -> bool {
    if n < 2 {
        return false;
    }
    let mut d = 2;
    while d * d <= n {
        if n.is_multiple_of(d) {
            return false;
        }
        d += 1;
    }
    true
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
    fn entries_follow_the_weights() {
        let table = Maglev::build(&hosts(3), DEFAULT_TABLE_SIZE);
        // Equal weights: every host takes a turn each round, so the counts differ by at most 1.
        let counts: Vec<_> = (0..3).map(|i| table.entries_of(i)).collect();
        assert_eq!(counts.iter().sum::<usize>(), 65_537);
        assert!(
            counts.iter().all(|&c| (21_845..=21_846).contains(&c)),
            "{counts:?}"
        );
        // The host order given does not matter (hosts are sorted by address).
        let reversed: Vec<_> = hosts(3).into_iter().rev().collect();
        let other = Maglev::build(&reversed, DEFAULT_TABLE_SIZE);
        assert!((0..1000_u64).all(|h| table.pick(h, 0).map(|i| 2 - i) == other.pick(h, 0)));
        // Weights 3:1: the light host takes a turn in a third of the rounds, a quarter of the
        // entries.
        let mut weighted = hosts(2);
        weighted[0].1 = 3;
        let table = Maglev::build(&weighted, DEFAULT_TABLE_SIZE);
        let light = table.entries_of(1);
        assert!((16_300..16_500).contains(&light), "{light}");
    }

    /// Removing one of five hosts moves its keys and only a few others (the Maglev paper's
    /// near-minimal disruption): measured over 20 000 keys.
    #[test]
    fn removing_one_of_n_hosts_moves_about_one_nth() {
        let all = hosts(5);
        let before = Maglev::build(&all, DEFAULT_TABLE_SIZE);
        let after = Maglev::build(&all[..4], DEFAULT_TABLE_SIZE);
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
        assert!((3_600..4_400).contains(&on_removed), "{on_removed}");
        // Of the 16 000 keys on the remaining hosts, under 2 % move.
        assert!(others_moved < 320, "{others_moved}");
    }

    #[test]
    fn primes_and_retries() {
        assert!(is_prime(65_537) && is_prime(5_000_011) && is_prime(13));
        assert!(!is_prime(65_536) && !is_prime(1) && !is_prime(0) && !is_prime(9));
        assert!(Maglev::build(&hosts(2), 10).pick(1, 0).is_none());
        let table = Maglev::build(&hosts(2), 13);
        // Attempt 1 flips every bit: hash 0 becomes u64::MAX.
        assert_eq!(table.pick(0, 1), table.pick(u64::MAX, 0));
    }
}
