//! `policy.drop_overloads` on the kernel path, for TCP services published with
//! `SERVICE_F_DROP`: connect4/6 refuse a connect with the probability the daemon put in
//! `DROP_V1` (parts per million), one `bpf_get_prandom_u32` draw per connect, as Envoy's router
//! draws per request. A refusal is counted for the service in `DROPPED_V1` and in
//! `CONNECT_DROP_OVERLOAD`.
//!
//! Fail-open: without a `DROP_V1` entry nothing is dropped; a count that finds `DROPPED_V1` full
//! is lost, the refusal stands.

use aya_ebpf::bindings::BPF_NOEXIST;
use proxy_common::{counters, drop_overload::PER_MILLION, service::ServiceKey};

use crate::{
    active::atomic_add,
    log,
    maps::{DROP_V1, DROPPED_V1, count},
};

/// Whether a connect to the service at `key` may proceed (no drop drawn).
#[inline(always)]
pub fn admit(key: &ServiceKey) -> bool {
    // SAFETY: the value is copied out before the program returns.
    let Some(share) = (unsafe { DROP_V1.get(key) }).copied() else {
        return true;
    };
    // SAFETY: a helper without arguments.
    let draw = unsafe { aya_ebpf::helpers::bpf_get_prandom_u32() };
    let scaled = (u64::from(draw) * u64::from(PER_MILLION)) >> 32;
    if share < PER_MILLION && scaled >= u64::from(share) {
        return true;
    }
    dropped(key);
    count(counters::CONNECT_DROP_OVERLOAD);
    log::service!(warn, WARN, key, "connect refused: drop_overloads");
    false
}

/// Counts one drop for the service at `key`.
#[inline(always)]
fn dropped(key: &ServiceKey) {
    for _ in 0..2 {
        if let Some(entry) = DROPPED_V1.get_ptr_mut(key) {
            // SAFETY: a live 8-byte aligned value (not preallocated: never reused while
            // referenced); every write of it is an atomic add.
            unsafe { atomic_add(entry, 1) };
            return;
        }
        // Another CPU may create it at the same moment: then the lookup again finds it.
        if DROPPED_V1.insert(key, &1, u64::from(BPF_NOEXIST)).is_ok() {
            return;
        }
    }
}
