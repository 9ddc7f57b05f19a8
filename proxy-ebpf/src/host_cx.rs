//! Per-host connect counts of the kernel path: one per connect4/6 that rewrote a service
//! address to a chosen host (TCP, and connected UDP), in `HOST_CX_V1` (per CPU, by backend).
//! Unconnected UDP datagrams (sendmsg4/6) and connects redirected to the proxy are not counted
//! here: the proxy counts its own upstream connects.
//!
//! Called from connect4/6 only; never changes a connect's fate. Writes `HOST_CX_V1` and, when a
//! host's entry cannot be created, `COUNTERS_V2`.

use proxy_common::{counters, service::Backend};

use crate::maps::{HOST_CX_V1, count};

/// One more kernel-path connect to `backend` on this CPU: an add to this CPU's value, or, for a
/// host this map does not have, an insert of 1.
///
/// The insert is `BPF_ANY`, not `BPF_NOEXIST`: on a per-CPU map an update from a program
/// writes this CPU's value only, so when another CPU created the entry meanwhile the insert
/// sets this CPU's value (0 until now) to 1, which is right, where `BPF_NOEXIST` would fail.
/// It fails only when the kernel has no element to give (counted as `host_cx_record_failed`).
#[inline(always)]
pub fn connected(backend: &Backend) {
    if let Some(n) = HOST_CX_V1.get_ptr_mut(backend) {
        // SAFETY: this CPU's value of the entry, valid while the program runs; per-CPU values
        // are not shared, and a preempting program at worst loses one increment.
        unsafe { *n += 1 };
        return;
    }
    if HOST_CX_V1.insert(backend, &1, 0).is_err() {
        count(counters::HOST_CX_RECORD_FAILED);
    }
}
