//! Publishing host sets into the kernel maps, never half-written.
//!
//! For one service: (1) backends that are new get ids and are inserted (one batched `bpf()`
//! call); (2) the slot table of a new generation is inserted; (3) the service entry is updated to
//! that generation with a single map update, which is the switch; (4) once [`RETIRE_GRACE`] has
//! passed (checked on the next publish), the old generation's table is deleted, then backends no
//! table references any more; a program that read the old generation just before the switch
//! still finds its table. A failure before (3) removes what (1)-(2) wrote and leaves the old
//! generation live; a connect sees the old or the new host set, never a mix.
//!
//! A service whose routable level has one host skips (1), (2) and (4): the host travels inside
//! the service entry ([`SERVICE_F_SINGLE`]), so (3) alone publishes it. Only the first priority
//! level that has a host is written: the kernel uses the first level with a table, and the
//! levels are routable hosts, so it would never read a lower one (the daemon republishes when the
//! first level empties).

mod counts;
mod drop;
mod limit;
mod stale;
mod write;

use std::{
    collections::{BTreeMap, HashMap as StdHashMap, HashSet, VecDeque},
    net::{IpAddr, SocketAddr},
    time::{Duration, Instant},
};

use aya::maps::{HashMap, MapData, MapError, PerCpuHashMap};
use proxy_common::{
    abi::maps,
    counters::ServiceCounts,
    service::{
        Backend, MAX_PRIORITIES, SERVICE_F_CX_LIMIT, SERVICE_F_DROP, SERVICE_F_LEAST_REQUEST,
        SERVICE_F_PASSIVE, SERVICE_F_PROXY, SERVICE_F_ROUND_ROBIN, SERVICE_F_SINGLE, Service,
        ServiceKey, SlotTable, SlotTableKey,
    },
};
use tracing::{debug, info};

pub use self::stale::PublishState;
use self::{drop::Drops, limit::Limits, stale::StaleSets};
use super::{DataplaneError, maps::ServiceMaps};

/// Service flags whose connections sockops follows.
const FOLLOWED: u32 =
    SERVICE_F_PROXY | SERVICE_F_PASSIVE | SERVICE_F_LEAST_REQUEST | SERVICE_F_CX_LIMIT;

/// `Live::tables` of a service adopted from a previous run: which priorities have a table is
/// unknown, so retiring it tries all of them.
const ALL_TABLES: u8 = (1 << MAX_PRIORITIES) - 1;

/// What a service should look like in the kernel: computed by `proxy_core::kernel`, written
/// here.
pub use proxy_core::kernel::ServiceSpec;

/// Whether a publish changed the kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PublishOutcome {
    /// A new generation is live.
    Published,
    /// The kernel already had exactly this; nothing was written.
    Unchanged,
}

/// How one generation of a service is laid out in the maps.
#[derive(Debug, PartialEq, Eq)]
enum Layout<'a> {
    /// No routable host: the service entry alone (connects are refused).
    Empty,
    /// One routable host, carried in the service entry ([`SERVICE_F_SINGLE`]).
    Single(SocketAddr),
    /// Two or more hosts: a slot table at `priority`.
    Table {
        priority: u32,
        hosts: &'a [(SocketAddr, u32)],
    },
}

/// The layout of `spec`: the first priority level with a host decides.
fn layout(spec: &ServiceSpec) -> Layout<'_> {
    let first = spec
        .priorities
        .iter()
        .enumerate()
        .find(|(_, hosts)| !hosts.is_empty());
    match first {
        None => Layout::Empty,
        Some((_, hosts)) if hosts.len() == 1 => Layout::Single(hosts[0].0),
        Some((priority, hosts)) => Layout::Table {
            priority: priority as u32,
            hosts,
        },
    }
}

struct Live {
    spec: Option<ServiceSpec>,
    service: Service,
    /// Backend ids the generation's table references (one reference each).
    backends: Vec<u32>,
    /// Bit `p` set: the generation has a slot table at priority `p`.
    tables: u8,
}

/// Writes service host sets into [`maps::SERVICES`], [`maps::SLOTS`] and [`maps::BACKENDS`].
pub struct Publisher {
    services: HashMap<MapData, ServiceKey, Service>,
    slots: HashMap<MapData, SlotTableKey, SlotTable>,
    backends: HashMap<MapData, u32, Backend>,
    /// Per-service counters the hooks keep, by service id; an entry goes with its service.
    svc_counters: PerCpuHashMap<MapData, u32, ServiceCounts>,
    /// `max_connections` of limited services, and the kernel's counts.
    limits: Limits,
    /// The drop overloads' two maps.
    drops: Drops,
    live: BTreeMap<ServiceKey, Live>,
    /// Backend address -> id, and id -> (address, number of live tables referencing it).
    backend_ids: StdHashMap<Backend, u32>,
    backend_refs: StdHashMap<u32, (Backend, usize)>,
    next_service_id: u32,
    /// Ids of live services, so allocating one is O(1) with thousands of services.
    service_ids: HashSet<u32>,
    next_backend_id: u32,
    adopted: usize,
    /// sockops is attached: services it must follow (proxy mode, passive health) can be
    /// published.
    follow_sockets: bool,
    /// The `_rr` program variants are attached: ROUND_ROBIN services can be published.
    round_robin: bool,
    /// What the loader found the kernel offers (`abi::features`): which hash keys the programs
    /// can read. None until the loader says so.
    kernel_features: u32,
    /// Generations switched away from, freed once they are older than [`RETIRE_GRACE`].
    retiring: VecDeque<Retiring>,
    /// Services whose newest host set failed to publish.
    stale: StaleSets,
    /// The maps may hold slot tables or backends that `live` and `backend_refs` do not know:
    /// what a previous run left (adopted generations have no record of their backends), or a
    /// delete that failed. [`Publisher::sweep`] walks the maps for them only while this is set,
    /// so a sweep after a change of this run costs what it removes, not the maps' size.
    unaccounted: bool,
}

/// What [`Publisher::write_layout`] wrote for a new generation.
#[derive(Default)]
struct Written {
    /// Bit `p` set: a slot table at priority `p`.
    tables: u8,
    /// Backend ids the table references (counted).
    referenced: Vec<u32>,
    /// Backend ids allocated and inserted for it.
    new_backends: Vec<u32>,
}

/// A generation waiting to be freed.
struct Retiring {
    since: Instant,
    live: Live,
    /// The service was removed: its id may be reused once its tables are gone.
    free_id: bool,
}

/// How long a generation's tables outlive the switch away from them. A program that read the
/// old `Service` just before the switch may still look its tables up; the kernel also re-reads
/// the service when a generation's tables are gone, so this only has to outlast one program run.
pub const RETIRE_GRACE: Duration = Duration::from_millis(50);

impl Publisher {
    /// Wraps the maps; services already in them (pinned by a previous run) are adopted: they stay
    /// live until they are republished or removed by [`Publisher::sweep`].
    pub(super) fn new(
        maps: ServiceMaps,
        follow_sockets: bool,
        round_robin: bool,
    ) -> Result<Self, DataplaneError> {
        let ServiceMaps {
            services,
            slots,
            backends,
            svc_counters,
            cx_max,
            cx_open,
            drop_share,
            dropped,
        } = maps;
        let mut live = BTreeMap::new();
        let mut next_service_id = 1;
        for entry in &services {
            let (key, service) = entry.map_err(|source| DataplaneError::Map {
                name: maps::SERVICES,
                source,
            })?;
            next_service_id = next_service_id.max(service.id.wrapping_add(1));
            let tables = if service.flags & SERVICE_F_SINGLE != 0 {
                0
            } else {
                ALL_TABLES
            };
            live.insert(
                key,
                Live {
                    spec: None,
                    service,
                    backends: Vec::new(),
                    tables,
                },
            );
        }
        let mut next_backend_id = 1;
        let mut found_backends = false;
        for id in backends.keys() {
            // A key that cannot be read is something found all the same.
            found_backends = true;
            if let Ok(id) = id {
                next_backend_id = next_backend_id.max(id.wrapping_add(1));
            }
        }
        let adopted = live.len();
        // Maps that start empty hold only what this run writes and records.
        let unaccounted = adopted > 0 || found_backends || slots.keys().next().is_some();
        let service_ids = live.values().map(|l: &Live| l.service.id).collect();
        Ok(Self {
            services,
            slots,
            backends,
            svc_counters,
            limits: Limits {
                max: cx_max,
                open: cx_open,
            },
            drops: Drops {
                share: drop_share,
                dropped,
            },
            live,
            backend_ids: StdHashMap::new(),
            backend_refs: StdHashMap::new(),
            next_service_id,
            service_ids,
            next_backend_id,
            adopted,
            follow_sockets,
            round_robin,
            kernel_features: 0,
            retiring: VecDeque::new(),
            stale: StaleSets::default(),
            unaccounted,
        })
    }

    /// Whether ROUND_ROBIN services can be published (the `_rr` programs are attached).
    pub fn round_robin(&self) -> bool {
        self.round_robin
    }

    /// Records what the loader found the kernel offers (`abi::features` bits).
    pub(super) fn set_kernel_features(&mut self, bits: u32) {
        self.kernel_features = bits;
    }

    /// Whether the programs can read the hash key of a service `name` with `flags`
    /// ([`super::features::check_hash_key`]).
    pub fn check_hash_key(&self, name: &str, flags: u32) -> Result<(), DataplaneError> {
        super::features::check_hash_key(name, flags, self.kernel_features)
    }

    /// How many services were found in pinned maps at start.
    pub fn adopted(&self) -> usize {
        self.adopted
    }

    /// Makes the kernel serve `spec`, switching generations atomically. A failure leaves the
    /// service on its previous host set, recorded in [`Publisher::publish_state`].
    pub fn publish(&mut self, spec: &ServiceSpec) -> Result<PublishOutcome, DataplaneError> {
        let result = self.switch_to(spec);
        self.stale.record(spec.key, result.is_ok());
        result
    }

    /// Whether the service at `key` runs on an older host set than its last publish asked for,
    /// and how many of its publishes failed.
    pub fn publish_state(&self, key: &ServiceKey) -> PublishState {
        self.stale.of(key)
    }

    fn switch_to(&mut self, spec: &ServiceSpec) -> Result<PublishOutcome, DataplaneError> {
        self.reap(false);
        if spec.flags & FOLLOWED != 0 && !self.follow_sockets {
            return Err(DataplaneError::NoSockops {
                what: format!(
                    "service {} (proxy mode, passive health, LEAST_REQUEST or max_connections)",
                    spec.name
                ),
            });
        }
        if spec.flags & SERVICE_F_ROUND_ROBIN != 0 && !self.round_robin {
            return Err(DataplaneError::NoRoundRobin {
                service: spec.name.clone(),
            });
        }
        self.check_hash_key(&spec.name, spec.flags)?;
        if spec.priorities.len() > MAX_PRIORITIES as usize {
            return Err(DataplaneError::Capacity {
                service: spec.name.clone(),
                message: format!(
                    "{} priorities; the kernel reads {MAX_PRIORITIES}",
                    spec.priorities.len()
                ),
            });
        }
        if self.live.get(&spec.key).and_then(|l| l.spec.as_ref()) == Some(spec) {
            return Ok(PublishOutcome::Unchanged);
        }
        let (id, old_generation) = match self.live.get(&spec.key) {
            Some(live) => (live.service.id, Some(live.service.generation)),
            None => (self.allocate_service_id(), None),
        };
        let generation = old_generation.map_or(1, |g| g.wrapping_add(1).max(1));
        let mut service = Service {
            id,
            generation,
            flags: spec.flags & !SERVICE_F_SINGLE,
            backend: Backend::default(),
        };
        // Before the switch; a later failure leaves the new limit beside the old generation.
        if let Some(max) = spec.max_connections {
            (self.limits.write(spec.key, max)).map_err(|e| publish_err(spec, maps::CX_MAX, e))?;
        }
        if spec.drop_overload > 0 {
            let share = spec.drop_overload;
            (self.drops.write(spec.key, share)).map_err(|e| publish_err(spec, maps::DROP, e))?;
        }
        let Written {
            tables,
            referenced,
            new_backends,
        } = self.write_layout(spec, &mut service)?;
        if let Err(source) = self.services.insert(spec.key, service, 0) {
            self.uncount(&referenced);
            self.undo(&service, tables, &new_backends);
            return Err(publish_err(spec, maps::SERVICES, source));
        }
        // The switch happened; everything below only frees what nobody reads any more.
        let now_live = Live {
            spec: Some(spec.clone()),
            service,
            backends: referenced,
            tables,
        };
        if let Some(old) = self.live.insert(spec.key, now_live) {
            if old.service.flags & SERVICE_F_CX_LIMIT != 0 && spec.max_connections.is_none() {
                self.limits.clear(&spec.key, false);
            }
            if old.service.flags & SERVICE_F_DROP != 0 && spec.drop_overload == 0 {
                self.drops.clear(&spec.key, false);
            }
            self.retiring.push_back(Retiring {
                since: Instant::now(),
                live: old,
                free_id: false,
            });
        }
        debug!(service = %spec.name, generation, "published");
        Ok(PublishOutcome::Published)
    }

    /// Removes a service: connects to its address proceed untouched from now on.
    pub fn remove(&mut self, key: &ServiceKey) -> Result<(), DataplaneError> {
        self.stale.forget(key);
        let Some(live) = self.live.remove(key) else {
            return Ok(());
        };
        self.services
            .remove(key)
            .map_err(|source| DataplaneError::Map {
                name: maps::SERVICES,
                source,
            })?;
        if live.service.flags & SERVICE_F_CX_LIMIT != 0 {
            self.limits.clear(key, true);
        }
        if live.service.flags & SERVICE_F_DROP != 0 {
            self.drops.clear(key, true);
        }
        self.retiring.push_back(Retiring {
            since: Instant::now(),
            live,
            free_id: true,
        });
        Ok(())
    }

    /// Frees generations switched away from more than [`RETIRE_GRACE`] ago (all of them with
    /// `all`). Publishing calls this; a daemon that stops publishing for a while may call it to
    /// free memory sooner.
    pub fn reap(&mut self, all: bool) {
        let mut dead_backends = Vec::new();
        while let Some(first) = self.retiring.front() {
            if !all && first.since.elapsed() < RETIRE_GRACE {
                break;
            }
            if let Some(old) = self.retiring.pop_front() {
                self.retire(&old.live, &mut dead_backends);
                if old.free_id {
                    self.service_ids.remove(&old.live.service.id);
                    let _ = self.svc_counters.remove(&old.live.service.id);
                }
            }
        }
        // After every retired table is gone: nothing references these any more.
        self.delete_backends(&dead_backends);
    }

    /// After a start that adopted pinned maps: removes services that are not in `keep`, then
    /// slot tables of dead generations and backends nothing references (walking the maps only
    /// while they may hold what this run has no record of: [`Publisher::unaccounted`]).
    pub fn sweep(&mut self, keep: &[ServiceKey]) -> Result<(), DataplaneError> {
        let keep: HashSet<&ServiceKey> = keep.iter().collect();
        let stale: Vec<ServiceKey> = self
            .live
            .keys()
            .filter(|k| !keep.contains(k))
            .copied()
            .collect();
        for key in &stale {
            self.remove(key)?;
        }
        self.reap(true);
        let (dead, orphans) = if self.unaccounted {
            self.walk_unaccounted()
        } else {
            (0, 0)
        };
        if !stale.is_empty() || dead > 0 || orphans > 0 {
            info!(
                services = stale.len(),
                tables = dead,
                backends = orphans,
                "swept state left by a previous run"
            );
        }
        Ok(())
    }

    fn allocate_service_id(&mut self) -> u32 {
        loop {
            let id = self.next_service_id;
            self.next_service_id = self.next_service_id.wrapping_add(1).max(1);
            if self.service_ids.insert(id) {
                // Counters a previous holder of the id left (a service removed while no daemon
                // ran) must not count for this one. The id is in no service entry yet.
                let _ = self.svc_counters.remove(&id);
                return id;
            }
        }
    }
}

fn publish_err(spec: &ServiceSpec, map: &'static str, source: MapError) -> DataplaneError {
    DataplaneError::Publish {
        service: spec.name.clone(),
        map,
        source,
    }
}

/// The kernel's view of a socket address: network byte order, IPv4 in the first word.
pub fn backend_of(addr: SocketAddr) -> Backend {
    let (addr_words, family) = proxy_common::service::ip_words(addr.ip());
    Backend {
        addr: addr_words,
        port: addr.port().to_be(),
        family,
        _pad: 0,
    }
}

/// A service key for `ip:port` over `proto`.
pub fn service_key(ip: IpAddr, port: u16, proto: u8) -> ServiceKey {
    ServiceKey::new(ip, port, proto)
}

#[cfg(test)]
mod tests;
