//! The passive health signal, as sockops records it for sockets whose service has
//! `SERVICE_F_PASSIVE` (a cluster with outlier detection): per backend, cumulative connect
//! failures and resets in `PASSIVE_V1` (per CPU) and the current run of failures in
//! `PASSIVE_RUN_V1`, which an established connect ends.
//!
//! Called from `sockops` only; never changes a connection's fate. Writes `PASSIVE_V1`,
//! `PASSIVE_RUN_V1`, `COUNTERS_V2` and the service's `SVC_COUNTERS_V3` entry (read from
//! `SERVICES_V2`).

use aya_ebpf::bindings::{BPF_NOEXIST, BPF_TCP_CLOSE_WAIT, BPF_TCP_ESTABLISHED, BPF_TCP_SYN_SENT};
use proxy_common::{
    counters,
    service::{Backend, ServiceKey},
    socket::PassiveCounts,
};

use crate::maps::{PASSIVE_RUN_V1, PASSIVE_V1, SERVICES_V2, ServiceOutcome, count, count_service};

/// The backend's counters could not be created (the map is full, or lost an insert race twice).
pub struct NotRecorded;

/// A followed socket to `backend` reached CLOSE from `old`: from SYN_SENT a failed connect,
/// from ESTABLISHED or CLOSE_WAIT a reset (an orderly close passes through FIN_WAIT or LAST_ACK
/// instead). Either extends the backend's run.
#[inline(always)]
pub fn closed(backend: &Backend, old: u32) -> Result<(), NotRecorded> {
    let (counter, delta) = match old {
        BPF_TCP_SYN_SENT => (
            counters::PASSIVE_CONNECT_FAILED,
            PassiveCounts {
                connect_failures: 1,
                resets: 0,
            },
        ),
        BPF_TCP_ESTABLISHED | BPF_TCP_CLOSE_WAIT => (
            counters::PASSIVE_RESET,
            PassiveCounts {
                connect_failures: 0,
                resets: 1,
            },
        ),
        _ => return Ok(()),
    };
    count(counter);
    extend_run(backend);
    add(backend, delta)
}

/// One more failure in `backend`'s current run. The increment is not atomic: two CPUs failing
/// at the same instant may count one (the run only decides when outlier detection ejects).
#[inline(always)]
fn extend_run(backend: &Backend) {
    if let Some(run) = PASSIVE_RUN_V1.get_ptr_mut(backend) {
        // SAFETY: a value of the map, valid while the program runs.
        unsafe { *run += 1 };
        return;
    }
    if PASSIVE_RUN_V1
        .insert(backend, &1, u64::from(BPF_NOEXIST))
        .is_err()
    {
        count(counters::PASSIVE_RECORD_FAILED);
    }
}

/// Whether a followed socket that reached CLOSE from `old` failed (see [`closed`]).
#[inline(always)]
pub fn is_failure(old: u32) -> bool {
    matches!(
        old,
        BPF_TCP_SYN_SENT | BPF_TCP_ESTABLISHED | BPF_TCP_CLOSE_WAIT
    )
}

/// A failure of a connect to the service at `key`, in its `passive_failures`.
#[inline(always)]
pub fn service_failed(key: &ServiceKey) {
    // SAFETY: read-only use before the program returns; the map is not preallocated.
    if let Some(svc) = unsafe { SERVICES_V2.get(key) } {
        count_service(svc.id, ServiceOutcome::PassiveFailure);
    }
}

/// A connect to `backend` got established: its run of failures ends (no entry: nothing to do).
#[inline(always)]
pub fn end_run(backend: &Backend) {
    if let Some(run) = PASSIVE_RUN_V1.get_ptr_mut(backend) {
        // SAFETY: a value of the map, valid while the program runs.
        unsafe {
            if *run != 0 {
                *run = 0;
            }
        }
    }
}

/// Adds `delta` to this CPU's counters of `backend`.
#[inline(always)]
fn add(backend: &Backend, delta: PassiveCounts) -> Result<(), NotRecorded> {
    for _ in 0..2 {
        if let Some(c) = PASSIVE_V1.get_ptr_mut(backend) {
            // SAFETY: a per-CPU value of this CPU, valid while the program runs.
            unsafe {
                (*c).connect_failures += delta.connect_failures;
                (*c).resets += delta.resets;
            }
            return Ok(());
        }
        // A concurrent insert on another CPU may win; then the second lookup finds it.
        if PASSIVE_V1
            .insert(backend, &delta, u64::from(BPF_NOEXIST))
            .is_ok()
        {
            return Ok(());
        }
    }
    Err(NotRecorded)
}
