//! The connection-limit map domain: a kernel-path TCP service whose cluster sets
//! `circuit_breakers` with a `max_connections` refuses connects once that many of the cgroup's
//! connections to it are open (Envoy's overflow).
//!
//! Layout, as the kernel sees it:
//!
//! ```text
//! CX_MAX_V1   ServiceKey -> u64     (the daemon: the service's max_connections)
//! CX_OPEN_V1  ServiceKey -> CxOpen  (sockops counts open connections; connect4/6 read them
//!                                    and count refusals)
//! ```
//!
//! Keyed by the service address, as the socket's `SockVip` records it, so that the close of a
//! connection takes back exactly what its connect added even when the service was republished
//! (or removed and added again) in between.

use core::mem::size_of;

/// Value of `CX_OPEN_V1`: one service's open connections from the cgroup and its refused
/// connects. Written by the kernel only, with atomic adds; the daemon reads it and deletes the
/// entry of a removed service once no connection counts in it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CxOpen {
    /// Connections counted at their connect (sockops, `TCP_CONNECT_CB`) and not yet closed,
    /// host byte order. `u64::MAX` adds take one back.
    pub open: u64,
    /// Connects refused because `open` had reached the limit (Envoy's `upstream_cx_overflow`),
    /// host byte order.
    pub overflow: u64,
}
const _: () = assert!(size_of::<CxOpen>() == 16);
