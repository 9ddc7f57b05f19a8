//! Publishing host sets into the kernel maps, never half-written.
//!
//! For one service: (1) backends that are new get ids and are inserted; (2) the slot tables of
//! a new generation are inserted; (3) the service entry is updated to that generation with a
//! single map update, which is the switch; (4) once [`RETIRE_GRACE`] has passed (checked on the
//! next publish), the old generation's tables are deleted, then backends no table references
//! any more; a program that read the old generation just before the switch still finds its
//! tables. A failure before (3) removes what (1)-(2) wrote and
//! leaves the old generation live; a connect sees the old or the new host set, never a mix.

use std::{
    collections::{BTreeMap, HashMap as StdHashMap, VecDeque},
    net::{IpAddr, SocketAddr},
    time::{Duration, Instant},
};

use aya::maps::{HashMap, MapData, MapError};
use proxy_common::service::{
    Backend, FAMILY_V4, FAMILY_V6, MAX_PRIORITIES, SERVICE_F_MAGLEV, SLOTS, Service, ServiceKey,
    SlotTable, SlotTableKey,
};
use proxy_core::lb::{self, SlotHost};
use tracing::{debug, info};

use super::DataplaneError;

/// What a service should look like in the kernel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceSpec {
    /// Name, for errors and logs.
    pub name: String,
    /// The service address.
    pub key: ServiceKey,
    /// `SERVICE_F_*` flags.
    pub flags: u32,
    /// Routable hosts with weights, by failover priority (index 0 = highest).
    pub priorities: Vec<Vec<(SocketAddr, u32)>>,
}

/// Whether a publish changed the kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PublishOutcome {
    /// A new generation is live.
    Published,
    /// The kernel already had exactly this; nothing was written.
    Unchanged,
}

struct Live {
    spec: Option<ServiceSpec>,
    service: Service,
    backends: Vec<u32>,
}

/// Writes service host sets into `SERVICES_V1`, `SLOTS_V1` and `BACKENDS_V1`.
pub struct Publisher {
    services: HashMap<MapData, ServiceKey, Service>,
    slots: HashMap<MapData, SlotTableKey, SlotTable>,
    backends: HashMap<MapData, u32, Backend>,
    live: BTreeMap<ServiceKey, Live>,
    /// Backend address -> id, and id -> (address, number of live tables referencing it).
    backend_ids: StdHashMap<Backend, u32>,
    backend_refs: StdHashMap<u32, (Backend, usize)>,
    next_service_id: u32,
    /// Ids of live services, so allocating one is O(1) with thousands of services.
    service_ids: std::collections::HashSet<u32>,
    next_backend_id: u32,
    adopted: usize,
    /// Generations switched away from, freed once they are older than [`RETIRE_GRACE`].
    retiring: VecDeque<Retiring>,
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
        services: HashMap<MapData, ServiceKey, Service>,
        slots: HashMap<MapData, SlotTableKey, SlotTable>,
        backends: HashMap<MapData, u32, Backend>,
    ) -> Result<Self, DataplaneError> {
        let mut live = BTreeMap::new();
        let mut next_service_id = 1;
        for entry in services.iter() {
            let (key, service) = entry.map_err(|source| DataplaneError::Map {
                name: "SERVICES_V1",
                source,
            })?;
            next_service_id = next_service_id.max(service.id.wrapping_add(1));
            live.insert(key, Live { spec: None, service, backends: Vec::new() });
        }
        let mut next_backend_id = 1;
        for id in backends.keys().flatten() {
            next_backend_id = next_backend_id.max(id.wrapping_add(1));
        }
        let adopted = live.len();
        let service_ids = live.values().map(|l: &Live| l.service.id).collect();
        Ok(Self {
            services,
            slots,
            backends,
            live,
            backend_ids: StdHashMap::new(),
            backend_refs: StdHashMap::new(),
            next_service_id,
            service_ids,
            next_backend_id,
            adopted,
            retiring: VecDeque::new(),
        })
    }

    /// How many services were found in pinned maps at start.
    pub fn adopted(&self) -> usize {
        self.adopted
    }

    /// Makes the kernel serve `spec`, switching generations atomically.
    pub fn publish(&mut self, spec: &ServiceSpec) -> Result<PublishOutcome, DataplaneError> {
        self.reap(false);
        if spec.priorities.len() > MAX_PRIORITIES as usize {
            return Err(DataplaneError::Capacity {
                service: spec.name.clone(),
                message: format!("{} priorities; the kernel reads {MAX_PRIORITIES}", spec.priorities.len()),
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
        let service = Service { id, generation, flags: spec.flags, _pad: 0 };
        let mut new_backends = Vec::new();
        let written = self.write_generation(spec, &service, &mut new_backends);
        let tables = match written {
            Ok(tables) => tables,
            Err(err) => {
                self.undo(&service, &new_backends);
                return Err(err);
            }
        };
        if let Err(source) = self.services.insert(spec.key, service, 0) {
            self.undo(&service, &new_backends);
            return Err(publish_err(spec, "SERVICES_V1", source));
        }
        // The switch happened; everything below only frees what nobody reads any more.
        let old = self.live.insert(
            spec.key,
            Live { spec: Some(spec.clone()), service, backends: tables },
        );
        if let Some(old) = old {
            self.retiring.push_back(Retiring { since: Instant::now(), live: old, free_id: false });
        }
        debug!(service = %spec.name, generation, "published");
        Ok(PublishOutcome::Published)
    }

    /// Removes a service: connects to its address proceed untouched from now on.
    pub fn remove(&mut self, key: &ServiceKey) -> Result<(), DataplaneError> {
        let Some(live) = self.live.remove(key) else { return Ok(()) };
        self.services.remove(key).map_err(|source| DataplaneError::Map {
            name: "SERVICES_V1",
            source,
        })?;
        self.retiring.push_back(Retiring { since: Instant::now(), live, free_id: true });
        Ok(())
    }

    /// Frees generations switched away from more than [`RETIRE_GRACE`] ago (all of them with
    /// `all`). Publishing calls this; a daemon that stops publishing for a while may call it to
    /// free memory sooner.
    pub fn reap(&mut self, all: bool) {
        while let Some(first) = self.retiring.front() {
            if !all && first.since.elapsed() < RETIRE_GRACE {
                break;
            }
            if let Some(old) = self.retiring.pop_front() {
                self.retire(&old.live);
                if old.free_id {
                    self.service_ids.remove(&old.live.service.id);
                }
            }
        }
    }

    /// After a start that adopted pinned maps: removes services that are not in `keep`, then
    /// slot tables of dead generations and backends nothing references.
    pub fn sweep(&mut self, keep: &[ServiceKey]) -> Result<(), DataplaneError> {
        let stale: Vec<ServiceKey> =
            self.live.keys().filter(|k| !keep.contains(k)).copied().collect();
        for key in &stale {
            self.remove(key)?;
        }
        self.reap(true);
        let live: std::collections::HashSet<(u32, u32)> =
            self.live.values().map(|l| (l.service.id, l.service.generation)).collect();
        let dead: Vec<SlotTableKey> = self
            .slots
            .keys()
            .flatten()
            .filter(|k| !live.contains(&(k.service_id, k.generation)))
            .collect();
        for key in &dead {
            let _ = self.slots.remove(key);
        }
        let orphans: Vec<u32> = self
            .backends
            .keys()
            .flatten()
            .filter(|id| !self.backend_refs.contains_key(id))
            .collect();
        for id in &orphans {
            let _ = self.backends.remove(id);
        }
        if !stale.is_empty() || !dead.is_empty() || !orphans.is_empty() {
            info!(services = stale.len(), tables = dead.len(), backends = orphans.len(), "swept state left by a previous run");
        }
        Ok(())
    }

    /// Writes backends and the slot tables of `service.generation`. Returns the backend ids the
    /// tables reference (one reference each); `new_backends` collects ids inserted by this call.
    fn write_generation(
        &mut self,
        spec: &ServiceSpec,
        service: &Service,
        new_backends: &mut Vec<u32>,
    ) -> Result<Vec<u32>, DataplaneError> {
        let mut referenced = Vec::new();
        for (priority, hosts) in spec.priorities.iter().enumerate() {
            if hosts.is_empty() {
                continue;
            }
            let mut slot_hosts = Vec::with_capacity(hosts.len());
            for &(addr, weight) in hosts {
                let id = self.backend_id(spec, addr, new_backends)?;
                referenced.push(id);
                slot_hosts.push(SlotHost { id, addr, weight: weight.max(1) });
            }
            let slots = if spec.flags & SERVICE_F_MAGLEV != 0 {
                lb::maglev_table(&slot_hosts, SLOTS)
            } else {
                lb::random_table(&slot_hosts, SLOTS)
            };
            let mut table = SlotTable { len: slots.len() as u32, ..SlotTable::default() };
            table.slots[..slots.len()].copy_from_slice(&slots);
            let key = SlotTableKey {
                service_id: service.id,
                generation: service.generation,
                priority: priority as u32,
            };
            self.slots.insert(key, table, 0).map_err(|e| publish_err(spec, "SLOTS_V1", e))?;
        }
        // Count references only once everything is written, so `undo` has nothing to uncount.
        for id in &referenced {
            if let Some((_, refs)) = self.backend_refs.get_mut(id) {
                *refs += 1;
            }
        }
        Ok(referenced)
    }

    /// The id of the backend at `addr`, inserting it into the map if it is new.
    fn backend_id(
        &mut self,
        spec: &ServiceSpec,
        addr: SocketAddr,
        new_backends: &mut Vec<u32>,
    ) -> Result<u32, DataplaneError> {
        let backend = backend_of(addr);
        if let Some(id) = self.backend_ids.get(&backend) {
            return Ok(*id);
        }
        let id = self.next_backend_id;
        self.next_backend_id = self.next_backend_id.wrapping_add(1).max(1);
        self.backends.insert(id, backend, 0).map_err(|e| publish_err(spec, "BACKENDS_V1", e))?;
        self.backend_ids.insert(backend, id);
        self.backend_refs.insert(id, (backend, 0));
        new_backends.push(id);
        Ok(id)
    }

    /// Removes what a failed publish wrote; the old generation was never switched away from.
    fn undo(&mut self, service: &Service, new_backends: &[u32]) {
        // A new service's id goes back to the pool (rare path: a linear scan is fine).
        if !self.live.values().any(|l| l.service.id == service.id) {
            self.service_ids.remove(&service.id);
        }
        for priority in 0..MAX_PRIORITIES {
            let _ = self.slots.remove(&SlotTableKey {
                service_id: service.id,
                generation: service.generation,
                priority,
            });
        }
        for id in new_backends {
            let _ = self.backends.remove(id);
            if let Some((backend, _)) = self.backend_refs.remove(id) {
                self.backend_ids.remove(&backend);
            }
        }
    }

    /// Frees a generation nobody reads any more: its tables, then unreferenced backends.
    fn retire(&mut self, old: &Live) {
        for priority in 0..MAX_PRIORITIES {
            let _ = self.slots.remove(&SlotTableKey {
                service_id: old.service.id,
                generation: old.service.generation,
                priority,
            });
        }
        for id in &old.backends {
            let Some((backend, refs)) = self.backend_refs.get_mut(id) else { continue };
            *refs = refs.saturating_sub(1);
            if *refs == 0 {
                let backend = *backend;
                self.backend_refs.remove(id);
                self.backend_ids.remove(&backend);
                let _ = self.backends.remove(id);
            }
        }
    }

    fn allocate_service_id(&mut self) -> u32 {
        loop {
            let id = self.next_service_id;
            self.next_service_id = self.next_service_id.wrapping_add(1).max(1);
            if self.service_ids.insert(id) {
                return id;
            }
        }
    }
}

fn publish_err(spec: &ServiceSpec, map: &'static str, source: MapError) -> DataplaneError {
    DataplaneError::Publish { service: spec.name.clone(), map, source }
}

/// The kernel's view of a socket address: network byte order, IPv4 in the first word.
pub fn backend_of(addr: SocketAddr) -> Backend {
    let (addr_words, family) = ip_words(addr.ip());
    Backend { addr: addr_words, port: addr.port().to_be(), family, _pad: 0 }
}

/// A service key for `ip:port` over `proto`.
pub fn service_key(ip: IpAddr, port: u16, proto: u8) -> ServiceKey {
    let (addr, family) = ip_words(ip);
    ServiceKey { addr, port: port.to_be(), proto, family }
}

/// Address words as the kernel stores them: each u32 holds 4 bytes in network order.
fn ip_words(ip: IpAddr) -> ([u32; 4], u8) {
    match ip {
        IpAddr::V4(v4) => ([u32::from_ne_bytes(v4.octets()), 0, 0, 0], FAMILY_V4),
        IpAddr::V6(v6) => {
            let o = v6.octets();
            let word = |i: usize| u32::from_ne_bytes([o[i], o[i + 1], o[i + 2], o[i + 3]]);
            ([word(0), word(4), word(8), word(12)], FAMILY_V6)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_in_network_order() {
        let key = service_key("127.77.0.1".parse().unwrap(), 80, 6);
        assert_eq!(key.addr[0].to_ne_bytes(), [127, 77, 0, 1]);
        assert_eq!(key.port.to_ne_bytes(), [0, 80]);
        assert_eq!(key.family, FAMILY_V4);
        let b = backend_of("[::1]:8080".parse().unwrap());
        assert_eq!(b.addr[3].to_ne_bytes(), [0, 0, 0, 1]);
        assert_eq!(b.family, FAMILY_V6);
    }
}
