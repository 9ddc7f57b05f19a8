//! `max_connections` on the kernel path (Envoy's circuit breaker on a cluster's open
//! connections), for TCP services published with `SERVICE_F_CX_LIMIT`.
//!
//! connect4/6 refuse a connect while the service's open connections in `CX_OPEN_V1` are at its
//! limit in `CX_MAX_V1` ([`admit`]); sockops adds the connection at `TCP_CONNECT_CB`
//! ([`opened`]), when the close callback that takes it back is sure to come, and takes it back
//! at CLOSE ([`closed`]), whether the connection was established or failed. A connect that
//! fails before `TCP_CONNECT_CB` (no route, no local port) was never added, so nothing leaks.
//!
//! The check and the add are two steps, not one atomic fetch-and-add: an add at connect4 would
//! leak for a connect that fails before sockops sees it (no callback follows), and the atomic
//! fetch needs 5.12. Both run inside the same `connect()` call with the socket locked and no
//! sleep between them, so an overshoot is bounded by the connects of the cgroup to that service
//! that are between the two points at the same moment (on a kernel without preemption, at most
//! the number of CPUs minus one); sequential connects are exact.
//!
//! Fail-open: without a `CX_MAX_V1` entry, or when `CX_OPEN_V1` is full, nothing is limited.

use proxy_common::{counters, limit::CxOpen, service::ServiceKey};

use crate::{
    active::atomic_add,
    log,
    maps::{CX_MAX_V1, CX_OPEN_V1, count},
};

/// Whether a connect to the limited service at `key` may proceed. A refusal is counted for the
/// service (`CxOpen::overflow`) and in `CONNECT_CX_OVERFLOW`.
#[inline(always)]
pub fn admit(key: &ServiceKey) -> bool {
    // SAFETY: the value is copied out before the program returns.
    let Some(max) = (unsafe { CX_MAX_V1.get(key) }).copied() else {
        return true;
    };
    let Some(entry) = CX_OPEN_V1.get_ptr_mut(key) else {
        // Nothing counted yet: no connection is open.
        return true;
    };
    // SAFETY: a plain 8-byte load of a live value (not preallocated: never reused while
    // referenced); a concurrent atomic add is seen or not.
    let open = unsafe { core::ptr::read_volatile(&raw const (*entry).open) };
    // A count below zero (a wrap, which the exactly-once take-back rules out) never refuses.
    if open < max || open > i64::MAX as u64 {
        return true;
    }
    // SAFETY: as above; the field is 8-byte aligned and every write of it is an atomic add.
    unsafe { atomic_add(&raw mut (*entry).overflow, 1) };
    count(counters::CONNECT_CX_OVERFLOW);
    log::service!(warn, WARN, key, "connect refused: max_connections reached");
    false
}

/// Adds a connection to the service at `key`; false when the map is full (the connection is
/// then not counted, and its close takes nothing back).
#[inline(always)]
pub fn opened(key: &ServiceKey) -> bool {
    for _ in 0..2 {
        if let Some(entry) = CX_OPEN_V1.get_ptr_mut(key) {
            // SAFETY: as in `admit`.
            unsafe { atomic_add(&raw mut (*entry).open, 1) };
            return true;
        }
        let first = CxOpen {
            open: 1,
            overflow: 0,
        };
        // Another CPU may create it at the same moment: then the lookup again finds it.
        if CX_OPEN_V1
            .insert(key, &first, u64::from(aya_ebpf::bindings::BPF_NOEXIST))
            .is_ok()
        {
            return true;
        }
    }
    false
}

/// Takes back a connection [`opened`] counted. Never creates an entry: the daemon removes a
/// removed service's entry only when nothing counts in it, and a close that finds none has
/// nothing to take back.
#[inline(always)]
pub fn closed(key: &ServiceKey) {
    if let Some(entry) = CX_OPEN_V1.get_ptr_mut(key) {
        // SAFETY: as in `admit`; adding u64::MAX is taking one back.
        unsafe { atomic_add(&raw mut (*entry).open, u64::MAX) };
    }
}
