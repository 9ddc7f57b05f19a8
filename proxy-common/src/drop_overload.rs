//! The drop-overload map domain: a kernel-path TCP service whose host set's
//! `policy.drop_overloads` sets a share refuses that share of the cgroup's connects to it, each
//! connect drawn at random (Envoy's router drops HTTP requests; the kernel path has connects).
//!
//! Layout, as the kernel sees it:
//!
//! ```text
//! DROP_V1     ServiceKey -> u32  (the daemon: the share in parts per million, 1 to PER_MILLION)
//! DROPPED_V1  ServiceKey -> u64  (connect4/6: connects refused, atomic adds)
//! ```
//!
//! Keyed by the service address, as `CX_MAX_V1` is. Both values are host byte order.

/// A share of everything, in parts per million: a connect is refused when a uniform draw
/// `d` of 32 bits has `d * PER_MILLION >> 32` below the share (always at `PER_MILLION`).
pub const PER_MILLION: u32 = 1_000_000;
