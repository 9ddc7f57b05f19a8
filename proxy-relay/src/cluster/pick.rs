//! The proxy path's picks that keep state per cluster handle: ROUND_ROBIN's rotation,
//! LEAST_REQUEST's open counts, RING_HASH's ring and MAGLEV's table (rebuilt when the hosts or
//! weights change, not per pick), and the weighted random choice the others draw from.

use std::{
    cell::Cell,
    hash::{BuildHasher, RandomState},
    net::SocketAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
};

use proxy_core::lb::{self, Balancer, maglev::Maglev, ring_hash::Ring};

use crate::addr::BackendAddr;

/// Open connections (or requests) per host, for LEAST_REQUEST.
#[derive(Default)]
pub(super) struct ActiveCounts(Mutex<std::collections::HashMap<SocketAddr, u64>>);

impl ActiveCounts {
    pub(super) fn of(&self, host: SocketAddr) -> u64 {
        self.lock().get(&host).copied().unwrap_or(0)
    }

    pub(super) fn lock(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::HashMap<SocketAddr, u64>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// A connection's (or request's) place in its host's open count (LEAST_REQUEST), given back
/// when dropped.
pub struct ActiveLease {
    pub(super) counts: Arc<ActiveCounts>,
    pub(super) host: SocketAddr,
}

impl Drop for ActiveLease {
    fn drop(&mut self) {
        let mut counts = self.counts.lock();
        if let Some(n) = counts.get_mut(&self.host) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                counts.remove(&self.host);
            }
        }
    }
}

/// ROUND_ROBIN on the proxy path: the kernel's rotation (the same smooth weighted table,
/// [`lb::round_robin_table`]) with one turn counter per cluster handle.
#[derive(Default)]
pub(super) struct Rotation {
    turn: AtomicU64,
    table: Mutex<RotationTable>,
}

/// A rotation's table and the level (hosts and weights) it was built from.
#[derive(Default)]
struct RotationTable {
    level: Vec<(SocketAddr, u32)>,
    hosts: Vec<SocketAddr>,
}

impl Rotation {
    /// The next host of `level` in turn, skipping `tried` while a fresh one is left.
    pub(super) fn next(
        &self,
        level: &[(SocketAddr, u32)],
        tried: &[BackendAddr],
    ) -> Option<SocketAddr> {
        let mut cached = self
            .table
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if cached.level != level {
            let hosts: Vec<lb::SlotHost> = level
                .iter()
                .enumerate()
                .map(|(i, &(addr, weight))| lb::SlotHost {
                    id: i as u32,
                    addr,
                    weight: weight.max(1),
                })
                .collect();
            let table = lb::round_robin_table(&hosts, proxy_common::service::SLOTS)
                .into_iter()
                .map(|id| level[id as usize].0)
                .collect();
            *cached = RotationTable {
                level: level.to_vec(),
                hosts: table,
            };
        }
        let table = &cached.hosts;
        let len = table.len() as u64;
        if len == 0 {
            return None;
        }
        let mut turn = self.turn.fetch_add(1, Ordering::Relaxed);
        for _ in 0..len {
            let host = table[(turn % len) as usize];
            if !tried.contains(&BackendAddr(host)) {
                return Some(host);
            }
            turn = self.turn.fetch_add(1, Ordering::Relaxed);
        }
        Some(table[(turn % len) as usize])
    }
}

/// A weighted random choice.
pub fn weighted_pick(hosts: &[(SocketAddr, u32)]) -> Option<SocketAddr> {
    let total: u64 = hosts.iter().map(|(_, w)| u64::from((*w).max(1))).sum();
    if total == 0 {
        return None;
    }
    let mut r = random_u64() % total;
    for (addr, w) in hosts {
        let w = u64::from((*w).max(1));
        if r < w {
            return Some(*addr);
        }
        r -= w;
    }
    hosts.last().map(|(a, _)| *a)
}

/// A fast per-thread pseudo-random number (xorshift64*), seeded from the std hasher's keys.
pub fn random_u64() -> u64 {
    thread_local! {
        static STATE: Cell<u64> = Cell::new(RandomState::new().hash_one(0x5eed_u64) | 1);
    }
    STATE.with(|s| {
        let mut x = s.get();
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        s.set(x);
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    })
}

/// LEAST_REQUEST: of `choices` hosts drawn by weight (with replacement, as Envoy's), the one
/// with the fewest open leases; the earliest drawn on a tie.
pub(super) fn least_of(
    candidates: &[(SocketAddr, u32)],
    counts: &ActiveCounts,
    choices: u32,
) -> Option<SocketAddr> {
    let mut best = weighted_pick(candidates)?;
    for _ in 1..choices.max(2) {
        let other = weighted_pick(candidates)?;
        if counts.of(other) < counts.of(best) {
            best = other;
        }
    }
    Some(best)
}

/// RING_HASH or MAGLEV for one cluster handle: the ring or table of the level it was last
/// built from.
pub(super) struct Consistent {
    balancer: Balancer,
    built: Mutex<Built>,
}

/// A level (hosts and weights) and what was built from it.
#[derive(Default)]
struct Built {
    level: Vec<(SocketAddr, u32)>,
    table: Table,
}

#[derive(Default)]
enum Table {
    #[default]
    None,
    Ring(Ring),
    Maglev(Maglev),
}

impl Table {
    fn pick(&self, hash: u64, attempt: u32) -> Option<usize> {
        match self {
            Table::None => None,
            Table::Ring(ring) => ring.pick(hash, attempt),
            Table::Maglev(maglev) => maglev.pick(hash, attempt),
        }
    }
}

/// Most tries for a host not tried yet (each a retry attempt in Envoy's sense).
const MAX_HASH_ATTEMPTS: usize = 64;

impl Consistent {
    /// The picker of a hash-based `balancer` (`None` for the others).
    pub(super) fn new(balancer: Balancer) -> Option<Self> {
        balancer.is_hash_based().then(|| Self {
            balancer,
            built: Mutex::default(),
        })
    }

    /// The host `hash` falls on in `level`, rebuilding the ring or table if the level changed;
    /// a host in `tried` is passed over (Envoy's retry attempts) while a try is left.
    pub(super) fn pick(
        &self,
        level: &[(SocketAddr, u32)],
        hash: u64,
        tried: &[BackendAddr],
    ) -> Option<SocketAddr> {
        let mut built = self
            .built
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if built.level != level || matches!(built.table, Table::None) {
            let table = match self.balancer {
                Balancer::RingHash {
                    min_ring_size,
                    max_ring_size,
                } => Table::Ring(Ring::build(level, min_ring_size, max_ring_size)),
                Balancer::Maglev { table_size } => Table::Maglev(Maglev::build(level, table_size)),
                _ => Table::None,
            };
            *built = Built {
                level: level.to_vec(),
                table,
            };
        }
        let tries = (level.len() * 4).clamp(1, MAX_HASH_ATTEMPTS) as u32;
        let first = built.table.pick(hash, 0)?;
        for attempt in 0..tries {
            let host = level[built.table.pick(hash, attempt)?].0;
            if !tried.contains(&BackendAddr(host)) {
                return Some(host);
            }
        }
        Some(level[first].0)
    }
}
