//! The kernel ABI shared by the kernel programs (`proxy-ebpf`) and the daemon (`proxy`): map keys
//! and values, and the names of maps, programs and pins ([`abi`], with the version policy).
//!
//! Every type is `#[repr(C)]`, made of fixed-width integers and arrays only, with explicit padding
//! and a compile-time size assertion, so the kernel and userspace layouts cannot drift. Byte order
//! is stated on every field. With the `user` feature the types implement `aya::Pod` (the only
//! `unsafe` in this crate, allowed in one module).
#![no_std]

pub mod abi;
pub mod counters;
pub mod drop_overload;
pub mod limit;
pub mod service;
pub mod socket;

/// Implements `aya::Pod` for map types when built for userspace.
///
/// `aya::Pod` is an `unsafe trait`; the impls live in the `pod` module below, which is the only
/// place in this crate that is allowed to use `unsafe`.
#[cfg(feature = "user")]
#[allow(unsafe_code)]
mod pod {
    use crate::{
        counters::ServiceCounts,
        limit::CxOpen,
        service::{
            Backend, Service, ServiceKey, SlotTable, SlotTableKey, SockHost, legacy::ServiceV1,
        },
        socket::{
            PairFlow, PairGrant, PassiveCounts, PeerSlot, Settings, SockTuple, UdpReverseKey,
        },
    };

    // SAFETY: each type is repr(C), made only of integers and integer arrays with explicit
    // padding fields, so every bit pattern is valid and there are no implicit padding bytes.
    unsafe impl aya::Pod for ServiceKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for Service {}
    // SAFETY: as above.
    unsafe impl aya::Pod for SlotTableKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for SlotTable {}
    // SAFETY: as above.
    unsafe impl aya::Pod for Backend {}
    // SAFETY: as above (two such types, 20 bytes each, so no padding between them).
    unsafe impl aya::Pod for SockHost {}
    // SAFETY: as above.
    unsafe impl aya::Pod for Settings {}
    // SAFETY: as above.
    unsafe impl aya::Pod for SockTuple {}
    // SAFETY: as above.
    unsafe impl aya::Pod for UdpReverseKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for PassiveCounts {}
    // SAFETY: as above.
    unsafe impl aya::Pod for PairFlow {}
    // SAFETY: as above.
    unsafe impl aya::Pod for PairGrant {}
    // SAFETY: as above.
    unsafe impl aya::Pod for PeerSlot {}
    // SAFETY: as above.
    unsafe impl aya::Pod for ServiceCounts {}
    // SAFETY: as above.
    unsafe impl aya::Pod for ServiceV1 {}
    // SAFETY: as above.
    unsafe impl aya::Pod for CxOpen {}
}
