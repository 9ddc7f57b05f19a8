//! Indices of the per-CPU counter array `COUNTERS_V1`. Every outcome of a hook and every error it
//! can meet has one; the daemon sums them over CPUs and exports them under `/stats`.

/// connect4/6: a service address was rewritten to a chosen host.
pub const CONNECT_REWRITTEN: u32 = 0;
/// connect4/6: the destination is not a service; the connect proceeds untouched.
pub const CONNECT_NOT_SERVICE: u32 = 1;
/// connect4/6: the service has no routable host in any priority; the connect is refused.
pub const CONNECT_NO_HOST: u32 = 2;
/// connect4/6: a slot points at a backend id that is not in the backend map (a publishing bug);
/// the connect proceeds untouched (fail-open).
pub const CONNECT_BACKEND_MISSING: u32 = 3;
/// connect4/6: the family of the chosen backend differs from the socket's; proceeds untouched.
pub const CONNECT_FAMILY_MISMATCH: u32 = 4;

/// Number of counters; the size of `COUNTERS_V1`.
pub const COUNT: u32 = 16;

/// Names used by the daemon when it exports the counters, indexed like the constants above.
pub const NAMES: [&str; 5] = [
    "connect_rewritten",
    "connect_not_service",
    "connect_no_host",
    "connect_backend_missing",
    "connect_family_mismatch",
];
