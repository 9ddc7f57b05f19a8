//! `max_connections` of kernel-path services (`SERVICE_F_CX_LIMIT`): the limit the publisher
//! writes into `CX_MAX_V1` before a flagged service entry goes live and removes after the flag
//! is gone, and the counts the kernel keeps in `CX_OPEN_V1`.

use aya::maps::{HashMap, MapData, MapError};
use proxy_common::{limit::CxOpen, service::ServiceKey};

/// The two maps of the connection limits.
pub(super) struct Limits {
    /// The limit of each limited service, written here only.
    pub(super) max: HashMap<MapData, ServiceKey, u64>,
    /// Open connections and refusals, written by the kernel only (but for the removal of a
    /// removed service's entry).
    pub(super) open: HashMap<MapData, ServiceKey, CxOpen>,
}

impl Limits {
    /// Writes the limit of the service at `key`, before its flagged entry is published: the
    /// kernel does not limit a flagged service without one.
    pub(super) fn write(&mut self, key: ServiceKey, max: u32) -> Result<(), MapError> {
        if self.max.get(&key, 0).ok() == Some(u64::from(max)) {
            return Ok(());
        }
        self.max.insert(key, u64::from(max), 0)
    }

    /// Removes the limit of the service at `key`, after its entry lost the flag or went away.
    /// With `removed`, its counts go too when no connection counts in them: a connection
    /// counted later (its connect passed just before the removal) creates a new entry, and a
    /// close that finds none takes nothing back, so a count never goes below zero. Failures
    /// leave an entry nothing reads (a flagged entry of that address would be limited by it).
    pub(super) fn clear(&mut self, key: &ServiceKey, removed: bool) {
        let _ = self.max.remove(key);
        if removed && self.open.get(key, 0).is_ok_and(|c| c.open == 0) {
            let _ = self.open.remove(key);
        }
    }

    /// What the kernel counted for the service at `key` (zero before its first connection).
    pub(super) fn counts(&self, key: &ServiceKey) -> CxOpen {
        self.open.get(key, 0).unwrap_or_default()
    }
}
