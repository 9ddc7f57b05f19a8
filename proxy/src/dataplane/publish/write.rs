//! The writes of one publish: a layout's backends and slot table before the switch, undone on
//! failure; the old generation's table and unreferenced backends after the grace period.

use std::{collections::HashSet, net::SocketAddr};

use aya::maps::MapError;
use proxy_common::{
    abi::maps,
    service::{
        Backend, MAX_PRIORITIES, SERVICE_F_MAGLEV, SERVICE_F_ROUND_ROBIN, SERVICE_F_SINGLE, SLOTS,
        Service, SlotTable, SlotTableKey,
    },
};
use proxy_core::lb::{self, SlotHost};

use super::{
    DataplaneError, Layout, Live, Publisher, ServiceSpec, Written, backend_of, layout, publish_err,
};
use crate::sys::map_batch;

impl Publisher {
    /// Writes what `spec`'s layout needs before the switch: nothing for no host, the host into
    /// `service` for one, backends and a slot table for more. A failure undoes what it wrote.
    pub(super) fn write_layout(
        &mut self,
        spec: &ServiceSpec,
        service: &mut Service,
    ) -> Result<Written, DataplaneError> {
        let mut written = Written::default();
        match layout(spec) {
            Layout::Empty => {}
            Layout::Single(addr) => {
                service.flags |= SERVICE_F_SINGLE;
                service.backend = backend_of(addr);
            }
            Layout::Table { priority, hosts } => {
                let result =
                    self.write_table(spec, service, priority, hosts, &mut written.new_backends);
                match result {
                    Ok(ids) => (written.tables, written.referenced) = (1 << priority, ids),
                    Err(err) => {
                        self.undo(service, 1 << priority, &written.new_backends);
                        return Err(err);
                    }
                }
            }
        }
        Ok(written)
    }

    /// Writes the backends and the slot table of `service.generation` at `priority`. Returns the
    /// backend ids the table references (one reference each, counted); `new_backends` collects
    /// ids allocated by this call.
    pub(super) fn write_table(
        &mut self,
        spec: &ServiceSpec,
        service: &Service,
        priority: u32,
        hosts: &[(SocketAddr, u32)],
        new_backends: &mut Vec<u32>,
    ) -> Result<Vec<u32>, DataplaneError> {
        let slot_hosts: Vec<SlotHost> = hosts
            .iter()
            .map(|&(addr, weight)| SlotHost {
                id: self.backend_id(addr, new_backends),
                addr,
                weight: weight.max(1),
            })
            .collect();
        self.insert_backends(new_backends)
            .map_err(|e| publish_err(spec, maps::BACKENDS, e))?;
        let slots = if spec.flags & SERVICE_F_MAGLEV != 0 {
            lb::maglev_table(&slot_hosts, SLOTS)
        } else if spec.flags & SERVICE_F_ROUND_ROBIN != 0 {
            lb::round_robin_table(&slot_hosts, SLOTS)
        } else {
            lb::random_table(&slot_hosts, SLOTS)
        };
        let mut table = SlotTable {
            len: slots.len() as u32,
            ..SlotTable::default()
        };
        table.slots[..slots.len()].copy_from_slice(&slots);
        let key = SlotTableKey {
            service_id: service.id,
            generation: service.generation,
            priority,
        };
        self.slots
            .insert(key, table, 0)
            .map_err(|e| publish_err(spec, maps::SLOTS, e))?;
        // Count references only once everything is written, so `undo` has nothing to uncount.
        let referenced: Vec<u32> = slot_hosts.iter().map(|h| h.id).collect();
        for id in &referenced {
            if let Some((_, refs)) = self.backend_refs.get_mut(id) {
                *refs += 1;
            }
        }
        Ok(referenced)
    }

    /// The id of the backend at `addr`; a new one is allocated (and pushed to `new_backends`)
    /// but not written: [`Publisher::insert_backends`] does that.
    pub(super) fn backend_id(&mut self, addr: SocketAddr, new_backends: &mut Vec<u32>) -> u32 {
        let backend = backend_of(addr);
        if let Some(id) = self.backend_ids.get(&backend) {
            return *id;
        }
        let id = self.next_backend_id;
        self.next_backend_id = self.next_backend_id.wrapping_add(1).max(1);
        self.backend_ids.insert(backend, id);
        self.backend_refs.insert(id, (backend, 0));
        new_backends.push(id);
        id
    }

    /// Writes the backends `ids` (allocated by [`Publisher::backend_id`]): one batched update,
    /// or one update each if the batch fails (which also names the error precisely).
    pub(super) fn insert_backends(&mut self, ids: &[u32]) -> Result<(), MapError> {
        let (keys, values): (Vec<u32>, Vec<Backend>) = ids
            .iter()
            .filter_map(|id| {
                self.backend_refs
                    .get(id)
                    .map(|(backend, _)| (*id, *backend))
            })
            .unzip();
        if keys.len() > 1 && map_batch::update(&mut self.backends, &keys, &values).is_ok() {
            return Ok(());
        }
        for (id, backend) in keys.iter().zip(&values) {
            self.backends.insert(id, backend, 0)?;
        }
        Ok(())
    }

    /// Deletes backends known to be in the map: one batched delete, or one delete each if the
    /// batch fails.
    pub(super) fn delete_backends(&mut self, ids: &[u32]) {
        if ids.len() > 1 && map_batch::delete(&mut self.backends, ids).is_ok() {
            return;
        }
        for id in ids {
            self.unaccounted |= self.backends.remove(id).is_err();
        }
    }

    /// Drops the references `write_table` counted, for a publish that failed after it.
    pub(super) fn uncount(&mut self, referenced: &[u32]) {
        for id in referenced {
            if let Some((_, refs)) = self.backend_refs.get_mut(id) {
                *refs = refs.saturating_sub(1);
            }
        }
    }

    /// Removes what a failed publish wrote (tables at the priorities in `tables`, backends
    /// `new_backends`); the old generation was never switched away from.
    pub(super) fn undo(&mut self, service: &Service, tables: u8, new_backends: &[u32]) {
        // A new service's id goes back to the pool (rare path: a linear scan is fine).
        if !self.live.values().any(|l| l.service.id == service.id) {
            self.service_ids.remove(&service.id);
        }
        self.delete_tables(service, tables);
        for id in new_backends {
            self.unaccounted |= self.backends.remove(id).is_err();
            if let Some((backend, _)) = self.backend_refs.remove(id) {
                self.backend_ids.remove(&backend);
            }
        }
    }

    /// Frees a generation nobody reads any more: its tables now; backends no table references
    /// any more go to `dead_backends`, to be deleted once every retired table is gone.
    pub(super) fn retire(&mut self, old: &Live, dead_backends: &mut Vec<u32>) {
        // An adopted generation's backends are not recorded: the next sweep finds them.
        self.unaccounted |= old.spec.is_none();
        self.delete_tables(&old.service, old.tables);
        for id in &old.backends {
            let Some((backend, refs)) = self.backend_refs.get_mut(id) else {
                continue;
            };
            *refs = refs.saturating_sub(1);
            if *refs == 0 {
                let backend = *backend;
                self.backend_refs.remove(id);
                self.backend_ids.remove(&backend);
                dead_backends.push(*id);
            }
        }
    }

    /// Deletes the slot tables of `service`'s generation at the priorities set in `tables`.
    pub(super) fn delete_tables(&mut self, service: &Service, tables: u8) {
        for priority in (0..MAX_PRIORITIES).filter(|p| tables & (1 << p) != 0) {
            let removed = self.slots.remove(&SlotTableKey {
                service_id: service.id,
                generation: service.generation,
                priority,
            });
            self.unaccounted |= removed.is_err();
        }
    }

    /// Deletes the slot tables of no live generation and the backends no table references,
    /// walking both maps; returns how many of each. Clears [`Publisher::unaccounted`] unless a
    /// delete fails (the next sweep walks again).
    pub(super) fn walk_unaccounted(&mut self) -> (usize, usize) {
        // A key that cannot be read leaves the maps unaccounted for.
        let mut unread = false;
        let live: HashSet<(u32, u32)> = self
            .live
            .values()
            .map(|l| (l.service.id, l.service.generation))
            .collect();
        let dead: Vec<SlotTableKey> = self
            .slots
            .keys()
            .filter_map(|key| readable(key, &mut unread))
            .filter(|k| !live.contains(&(k.service_id, k.generation)))
            .collect();
        let orphans: Vec<u32> = self
            .backends
            .keys()
            .filter_map(|key| readable(key, &mut unread))
            .filter(|id| !self.backend_refs.contains_key(id))
            .collect();
        self.unaccounted = unread;
        for key in &dead {
            self.unaccounted |= self.slots.remove(key).is_err();
        }
        for id in &orphans {
            self.unaccounted |= self.backends.remove(id).is_err();
        }
        (dead.len(), orphans.len())
    }
}

/// The key, or `None` with `unread` set when it could not be read.
fn readable<K>(key: Result<K, MapError>, unread: &mut bool) -> Option<K> {
    *unread |= key.is_err();
    key.ok()
}
