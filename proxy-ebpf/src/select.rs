//! Host selection: from a service to one backend, O(1) in the number of hosts.
//!
//! A service with one host carries it in its own map value (`SERVICE_F_SINGLE`): no further
//! lookup. Otherwise the daemon expands weights into a slot table per failover priority. The kernel walks the
//! priorities of the live generation, highest first, and uses the first table with a routable
//! host; inside it, the slot is random, or, for consistent hashing, derived from a key of the
//! client (its network namespace, cgroup, process, user or socket, as the service's flags say;
//! the table is then a Maglev permutation table), or, for
//! ROUND_ROBIN, the next turn of the table's atomic cursor (the table is then in smooth
//! weighted order), or, for LEAST_REQUEST, the less loaded of two random slots' backends.

use proxy_common::service::{
    Backend, MAX_PRIORITIES, SERVICE_F_LEAST_REQUEST, SERVICE_F_MAGLEV, SERVICE_F_ROUND_ROBIN,
    SERVICE_F_SINGLE, SLOT_MASK, Service, SlotTable, SlotTableKey,
};

use crate::{
    active::active_of,
    maps::{BACKENDS_V2, SLOTS_V2},
};

/// Why no backend could be chosen.
pub enum NoBackend {
    /// No priority of the live generation has a routable host.
    NoHost,
    /// A slot names a backend id that is not in `BACKENDS_V2`.
    Missing,
}

/// Chooses a backend for `svc`. `client` (the key [`crate::translate`] read) keys consistent
/// hashing. `ROTATE`: this is a
/// `_rr` program variant, which may use atomic fetch-and-add for ROUND_ROBIN services; in the
/// base programs a ROUND_ROBIN service (which the daemon never publishes for them) picks at
/// random.
#[inline(always)]
pub fn choose<const ROTATE: bool>(svc: &Service, client: u64) -> Result<&Backend, NoBackend> {
    if svc.flags & SERVICE_F_SINGLE != 0 {
        return Ok(&svc.backend);
    }
    let rotate = ROTATE && svc.flags & SERVICE_F_ROUND_ROBIN != 0;
    let hash = if svc.flags & SERVICE_F_MAGLEV != 0 {
        mix(client)
    } else if rotate {
        0
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
        // The element is only used before this program returns; the map is not preallocated,
        // so it is not reused while we hold it. Only `cursor` is ever written through it.
        if let Some(table) = SLOTS_V2.get_ptr_mut(&key) {
            // SAFETY: as above.
            if let Some(chosen) = unsafe { from_table(table, svc.flags, rotate, hash) } {
                return chosen;
            }
        }
        priority += 1;
    }
    Err(NoBackend::NoHost)
}

/// The choice from one priority's table (`None`: the table is empty, try the next priority).
///
/// # Safety
/// `table` is a live element of `SLOTS_V2`, used before the program returns (the map is not
/// preallocated, so it is not reused meanwhile); `len` and `slots` are written only by the
/// daemon, which replaces a table rather than changing it in place; only `cursor` is written
/// through it.
#[inline(always)]
unsafe fn from_table(
    table: *mut SlotTable,
    flags: u32,
    rotate: bool,
    hash: u32,
) -> Option<Result<&'static Backend, NoBackend>> {
    // SAFETY: the caller's contract.
    let len = unsafe { (*table).len };
    if len == 0 {
        return None;
    }
    let turn = if rotate {
        // SAFETY: the element is live and 8-byte aligned (`SlotTable` is `align(8)`, and the
        // kernel aligns map values to 8), and every write of `cursor` is this atomic add.
        unsafe { next_turn(table.cast::<u64>()) }
    } else {
        hash
    };
    // SAFETY: the caller's contract.
    let first = match unsafe { slot(table, len, turn) } {
        Ok(first) => first,
        Err(missing) => return Some(Err(missing)),
    };
    if flags & SERVICE_F_LEAST_REQUEST == 0 {
        return Some(Ok(first));
    }
    // LEAST_REQUEST: a second draw, and the one with fewer open connections (the first on a
    // tie). Draws are with replacement, as Envoy's.
    // SAFETY: a helper without arguments or side effects.
    let again = unsafe { aya_ebpf::helpers::bpf_get_prandom_u32() };
    // SAFETY: the caller's contract.
    Some(unsafe { slot(table, len, again) }.map(|second| {
        if active_of(second) < active_of(first) {
            second
        } else {
            first
        }
    }))
}

/// The backend in the slot `turn` picks of a table of `len` slots.
///
/// # Safety
/// `table` is a live element of `SLOTS_V2`, used before the program returns (the map is not
/// preallocated, so it is not reused meanwhile); its `slots` are written only by the daemon,
/// which replaces a table rather than changing it in place.
#[inline(always)]
unsafe fn slot(
    table: *const SlotTable,
    len: u32,
    turn: u32,
) -> Result<&'static Backend, NoBackend> {
    // The daemon keeps len <= SLOTS; the mask is what proves the bound to the verifier (a
    // modulo result is not tracked), and a corrupt len can at worst pick a stale slot inside
    // the array.
    let index = ((turn % len) as usize) & SLOT_MASK;
    // SAFETY: the caller's contract.
    let id = *unsafe { (*table).slots.get(index) }.ok_or(NoBackend::Missing)?;
    // SAFETY: read-only use before the program returns; the map is not preallocated.
    unsafe { BACKENDS_V2.get(&id) }.ok_or(NoBackend::Missing)
}

/// The next turn of a ROUND_ROBIN table: its `cursor`, incremented atomically across CPUs.
///
/// The table's first 8 bytes are `len` (low half, little-endian) and `cursor` (high half): one
/// 64-bit atomic fetch-and-add of 1 << 32 advances the cursor and never carries into `len` (the
/// carry out of bit 63 is dropped when the cursor wraps). Written as the instruction itself:
/// LLVM selects fetch-and-add only for cpu v3, and the object is built for v1, which every
/// supported kernel runs; the instruction needs 5.12, which is why only the `_rr` programs have
/// it (an older verifier refuses it even in code it would never reach).
///
/// # Safety
///
/// `head` points to the first 8 bytes of a live `SlotTable`, 8-byte aligned.
#[inline(always)]
unsafe fn next_turn(head: *mut u64) -> u32 {
    let mut previous: u64 = 1 << 32;
    // SAFETY: the caller's contract; the instruction reads and writes only `*head`.
    unsafe {
        core::arch::asm!(
            "{previous} = atomic_fetch_add((u64 *)({head} + 0), {previous})",
            head = in(reg) head,
            previous = inout(reg) previous,
            options(nostack),
        );
    }
    (previous >> 32) as u32
}

/// Folds a 64-bit client key into a well-mixed 32-bit hash (the finaliser of MurmurHash3), so
/// that sequential keys (cookies, process ids, user ids) spread over the whole table.
#[inline(always)]
fn mix(key: u64) -> u32 {
    let mut h = key;
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^= h >> 33;
    h as u32
}
