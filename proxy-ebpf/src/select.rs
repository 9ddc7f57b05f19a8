//! Host selection: from a service to one backend, O(1) in the number of hosts.
//!
//! A service with one host carries it in its own map value (`SERVICE_F_SINGLE`): no further
//! lookup. Otherwise the daemon expands weights into a slot table per failover priority. The kernel walks the
//! priorities of the live generation, highest first, and uses the first table with a routable
//! host; inside it, the slot is random, or, for consistent hashing, derived from the client's
//! network-namespace cookie (the table is then a Maglev permutation table).

use proxy_common::service::{
    Backend, MAX_PRIORITIES, SERVICE_F_MAGLEV, SERVICE_F_SINGLE, SLOT_MASK, Service, SlotTableKey,
};

use crate::maps::{BACKENDS_V2, SLOTS_V2};

/// Why no backend could be chosen.
pub enum NoBackend {
    /// No priority of the live generation has a routable host.
    NoHost,
    /// A slot names a backend id that is not in `BACKENDS_V2`.
    Missing,
}

/// Chooses a backend for `svc`. `netns_cookie` keys consistent hashing.
#[inline(always)]
pub fn choose(svc: &Service, netns_cookie: u64) -> Result<&Backend, NoBackend> {
    if svc.flags & SERVICE_F_SINGLE != 0 {
        return Ok(&svc.backend);
    }
    let hash = if svc.flags & SERVICE_F_MAGLEV != 0 {
        mix(netns_cookie)
    } else {
        // SAFETY: a helper without arguments or side effects.
        unsafe { aya_ebpf::helpers::bpf_get_prandom_u32() }
    };
    let mut priority = 0;
    while priority < MAX_PRIORITIES {
        let key = SlotTableKey {
            service_id: svc.id,
            generation: svc.generation,
            priority,
        };
        // SAFETY: the reference is only read before this program returns; the map is not
        // preallocated, so the element is not reused while we hold it.
        if let Some(table) = unsafe { SLOTS_V2.get(&key) } {
            let len = table.len;
            if len > 0 {
                // The daemon keeps len <= SLOTS; the mask is what proves the bound to the
                // verifier (a modulo result is not tracked), and a corrupt len can at worst pick
                // a stale slot inside the array.
                let index = ((hash % len) as usize) & SLOT_MASK;
                let id = *table.slots.get(index).ok_or(NoBackend::Missing)?;
                // SAFETY: as above.
                return unsafe { BACKENDS_V2.get(&id) }.ok_or(NoBackend::Missing);
            }
        }
        priority += 1;
    }
    Err(NoBackend::NoHost)
}

/// Folds a 64-bit cookie into a well-mixed 32-bit hash (the finaliser of MurmurHash3), so that
/// sequential cookies spread over the whole table.
#[inline(always)]
fn mix(cookie: u64) -> u32 {
    let mut h = cookie;
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^= h >> 33;
    h as u32
}
