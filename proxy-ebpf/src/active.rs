//! Open-connection counts the kernel keeps with atomic adds: per backend for LEAST_REQUEST
//! (`ACTIVE_V1`), and the add itself, which `crate::limit` shares for `max_connections`.

use aya_ebpf::bindings::BPF_NOEXIST;
use proxy_common::service::Backend;

use crate::maps::ACTIVE_V1;

/// Adds `delta` (wrapping: `u64::MAX` takes one back) to `backend`'s open connections;
/// false when the map is full (the connection is then not counted).
#[inline(always)]
pub fn active_add(backend: &Backend, delta: u64) -> bool {
    for _ in 0..2 {
        if let Some(count) = ACTIVE_V1.get_ptr_mut(backend) {
            // SAFETY: the value is live (not preallocated: never reused while referenced) and
            // 8-byte aligned; every write of it is an atomic add.
            unsafe { atomic_add(count, delta) };
            return true;
        }
        // Another CPU may create it at the same moment: then the lookup again finds it.
        if ACTIVE_V1
            .insert(backend, &delta, u64::from(BPF_NOEXIST))
            .is_ok()
        {
            return true;
        }
    }
    false
}

/// `backend`'s open connections (0 when it has no entry).
#[inline(always)]
pub fn active_of(backend: &Backend) -> u64 {
    // SAFETY: a plain 8-byte load of a live value; a concurrent atomic add is seen or not.
    ACTIVE_V1
        .get_ptr(backend)
        .map_or(0, |count| unsafe { core::ptr::read_volatile(count) })
}

/// `*target += delta` as one atomic instruction without a fetch (every supported kernel has it;
/// the target has no atomic read-modify-write methods).
///
/// # Safety
///
/// `target` points to a live, 8-byte aligned u64 in a map value.
#[inline(always)]
pub unsafe fn atomic_add(target: *mut u64, delta: u64) {
    // SAFETY: the caller's contract; the instruction writes only `*target`.
    unsafe {
        core::arch::asm!(
            "lock *(u64 *)({target} + 0) += {delta}",
            target = in(reg) target,
            delta = in(reg) delta,
            options(nostack),
        );
    }
}
