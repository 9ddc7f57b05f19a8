//! Carrying an earlier version's service maps over to this version's layout, so that an upgrade
//! across a layout change has no window in which the kernel serves nothing.
//!
//! A new daemon's programs read this version's maps from the moment they are attached; after a
//! layout change those maps are new and empty until the first publish, which waits for
//! discovery (up to the first-publish wait). When the instance still holds the previous layout's
//! service maps (`SERVICES_V1`, `SLOTS_V1`, `BACKENDS_V1`) and this version's are empty, their
//! entries are copied over before any program is attached: the new programs start with the host
//! sets the old ones served, and the publisher adopts them as it adopts a same-version restart's.
//!
//! Backends and slot tables go first, each service entry last (one update each), so the kernel
//! never reads a service whose tables are missing. An entry that cannot be read or written is
//! skipped with a warning: that service is served from the first publish on, as without the
//! migration, and the others are not held back.

use std::path::Path;

use aya::{
    Ebpf,
    maps::{HashMap, Map, MapData},
};
use proxy_common::{
    abi::maps,
    service::{
        Backend, SERVICE_F_MAGLEV, SERVICE_F_PROXY, Service, ServiceKey, SlotTable, SlotTableKey,
        legacy::{BACKENDS_V1, SERVICES_V1, SLOTS_V1, ServiceV1},
    },
};
use tracing::{info, warn};

/// What was carried over.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Migrated {
    pub services: usize,
    pub tables: usize,
    pub backends: usize,
}

/// Copies the `_V1` service maps pinned under `pin_dir` into the loaded object's empty current
/// ones. `None` when there is nothing to carry (no `_V1` maps, or the current ones already hold
/// services: a restart of this version).
pub fn service_maps_v1(ebpf: &mut Ebpf, pin_dir: &Path) -> Option<Migrated> {
    if !pin_dir.join(SERVICES_V1).exists() {
        return None;
    }
    match carry(ebpf, pin_dir) {
        Ok(Some(done)) => {
            info!(
                services = done.services,
                tables = done.tables,
                backends = done.backends,
                "carried the previous layout's services (SERVICES_V1) over; they are served until the first publish"
            );
            Some(done)
        }
        Ok(None) => None,
        Err(err) => {
            warn!(%err, "the previous layout's services (SERVICES_V1) could not be read; they are served again from the first publish");
            None
        }
    }
}

fn carry(ebpf: &mut Ebpf, pin_dir: &Path) -> Result<Option<Migrated>, String> {
    let old_services: HashMap<MapData, ServiceKey, ServiceV1> = pinned(pin_dir, SERVICES_V1)?;
    let old_tables: HashMap<MapData, SlotTableKey, SlotTable> = pinned(pin_dir, SLOTS_V1)?;
    let old_backends: HashMap<MapData, u32, Backend> = pinned(pin_dir, BACKENDS_V1)?;
    let mut done = Migrated::default();
    {
        let services: HashMap<&mut MapData, ServiceKey, Service> = current(ebpf, maps::SERVICES)?;
        if services.keys().next().is_some() {
            return Ok(None);
        }
    }
    {
        let mut backends: HashMap<&mut MapData, u32, Backend> = current(ebpf, maps::BACKENDS)?;
        for entry in &old_backends {
            match entry.map_err(|e| e.to_string()).and_then(|(id, b)| {
                backends
                    .insert(id, b, 0)
                    .map_err(|e| format!("backend {id}: {e}"))
            }) {
                Ok(()) => done.backends += 1,
                Err(err) => warn!(%err, "skipped a backend of the previous layout"),
            }
        }
    }
    {
        let mut tables: HashMap<&mut MapData, SlotTableKey, SlotTable> =
            current(ebpf, maps::SLOTS)?;
        for entry in &old_tables {
            match entry.map_err(|e| e.to_string()).and_then(|(key, table)| {
                tables
                    .insert(key, table, 0)
                    .map_err(|e| format!("slot table of service {}: {e}", key.service_id))
            }) {
                Ok(()) => done.tables += 1,
                Err(err) => warn!(%err, "skipped a slot table of the previous layout"),
            }
        }
    }
    let mut services: HashMap<&mut MapData, ServiceKey, Service> = current(ebpf, maps::SERVICES)?;
    for entry in &old_services {
        match entry.map_err(|e| e.to_string()).and_then(|(key, old)| {
            services
                .insert(key, upgrade(old), 0)
                .map_err(|e| e.to_string())
        }) {
            Ok(()) => done.services += 1,
            Err(err) => warn!(%err, "skipped a service of the previous layout"),
        }
    }
    Ok(Some(done))
}

/// A `_V1` service entry in this version's layout: the same id, generation and tables; only the
/// flags `_V1` knew.
pub fn upgrade(old: ServiceV1) -> Service {
    Service {
        id: old.id,
        generation: old.generation,
        flags: old.flags & (SERVICE_F_PROXY | SERVICE_F_MAGLEV),
        backend: Backend::default(),
    }
}

/// A `_V1` map from its pin (its key and value sizes are checked by aya).
fn pinned<K: aya::Pod, V: aya::Pod>(
    pin_dir: &Path,
    name: &str,
) -> Result<HashMap<MapData, K, V>, String> {
    let data = MapData::from_pin(pin_dir.join(name)).map_err(|e| format!("{name}: {e}"))?;
    HashMap::try_from(Map::HashMap(data)).map_err(|e| format!("{name}: {e}"))
}

/// One of this version's maps in the loaded object.
fn current<'a, K: aya::Pod, V: aya::Pod>(
    ebpf: &'a mut Ebpf,
    name: &str,
) -> Result<HashMap<&'a mut MapData, K, V>, String> {
    let map = ebpf
        .map_mut(name)
        .ok_or_else(|| format!("{name} is not in the object"))?;
    HashMap::try_from(map).map_err(|e| format!("{name}: {e}"))
}

#[cfg(test)]
mod tests {
    use proxy_common::service::SERVICE_F_SINGLE;

    use super::*;

    #[test]
    fn a_v1_service_keeps_its_id_generation_and_tables() {
        let old = ServiceV1 {
            id: 7,
            generation: 3,
            flags: SERVICE_F_MAGLEV | SERVICE_F_SINGLE,
            _pad: 0,
        };
        let new = upgrade(old);
        assert_eq!((new.id, new.generation), (7, 3));
        assert_eq!(new.flags, SERVICE_F_MAGLEV, "only the flags V1 knew");
        assert_eq!(new.backend, Backend::default(), "read from its slot tables");
    }
}
