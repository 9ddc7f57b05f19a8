//! Drop overloads of kernel-path services (`SERVICE_F_DROP`): the share the publisher writes
//! into `DROP_V1` before a flagged service entry goes live and removes after the flag is gone,
//! and the drops the kernel counts in `DROPPED_V1`.

use aya::maps::{HashMap, MapData, MapError};
use proxy_common::service::ServiceKey;

/// The two maps of the drop overloads.
pub(super) struct Drops {
    /// The share of each dropping service, parts per million, written here only.
    pub(super) share: HashMap<MapData, ServiceKey, u32>,
    /// Connects dropped, written by the kernel only (but for the removal of a removed
    /// service's entry).
    pub(super) dropped: HashMap<MapData, ServiceKey, u64>,
}

impl Drops {
    /// Writes the share of the service at `key`, before its flagged entry is published: the
    /// kernel drops nothing for a flagged service without one.
    pub(super) fn write(&mut self, key: ServiceKey, share: u32) -> Result<(), MapError> {
        if self.share.get(&key, 0).ok() == Some(share) {
            return Ok(());
        }
        self.share.insert(key, share, 0)
    }

    /// Removes the share of the service at `key`, after its entry lost the flag or went away;
    /// with `removed`, its count goes too (a connect that drew a drop just before counts into
    /// a new entry, which the next removal of that address takes). Failures leave an entry
    /// nothing reads (a flagged entry of that address would drop by it).
    pub(super) fn clear(&mut self, key: &ServiceKey, removed: bool) {
        let _ = self.share.remove(key);
        if removed {
            let _ = self.dropped.remove(key);
        }
    }

    /// The connects the kernel dropped for the service at `key` (zero before its first).
    pub(super) fn count(&self, key: &ServiceKey) -> u64 {
        self.dropped.get(key, 0).unwrap_or_default()
    }
}
