//! Kernel log records (aya-log) on the error paths an operator can act on: a connect or
//! datagram refused because its service has nowhere to go, state the daemon published that the
//! kernel cannot use, a failed map update that costs one connection a feature. Never on a path
//! that succeeds, and each record names the service address and the reason.
//!
//! Every record is behind [`enabled`], a read of the load-time global `KERNEL_LOG_LEVEL`
//! (`proxy_common::abi::kernel_log`). The loader sets it and aya freezes the object's read-only
//! data, so the verifier knows the value: at `off` (the object's own value, and the daemon's
//! default) a record's code is a dead branch, removed before the program is JIT-compiled. The
//! root test `kernel_log` checks that connect4 then holds no instruction that touches the log
//! buffer.
//!
//! Records go to aya-log's ring buffer `AYA_LOGS` (ring buffers: 5.8); the daemon reads it only
//! when the level is not off. A full buffer drops records; the counters still count.

use proxy_common::service::ServiceKey;

/// The level (`proxy_common::abi::kernel_log`). Off in the object. `#[used]`, like
/// `KERNEL_FEATURES`: it keeps LLVM from handing other read-only constants of the same value
/// this global's address.
#[unsafe(no_mangle)]
#[used]
static KERNEL_LOG_LEVEL: u8 = 0;

/// Whether records of `level` are wanted.
#[inline(always)]
pub fn enabled(level: u8) -> bool {
    // SAFETY: a read of a static; volatile, so the compiler does not fold the object's zero in.
    let current = unsafe { core::ptr::read_volatile(&raw const KERNEL_LOG_LEVEL) };
    current >= level
}

/// The IPv6 address of a service key, as the bytes aya-log formats (the key's words are in
/// network byte order). A plain array: an `IpAddr` would carry its V4 variant's uninitialised
/// bytes, which the compiler may then copy from any register, and the verifier refuses reads
/// of registers that were never written.
#[inline(always)]
pub fn ip6(key: &ServiceKey) -> [u8; 16] {
    let [a, b, c, d] = key.addr.map(u32::to_ne_bytes);
    [
        a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3], c[0], c[1], c[2], c[3], d[0], d[1], d[2],
        d[3],
    ]
}

/// A record about the service at `key`: `service!(warn, WARN, key, "reason")` writes
/// `<vip> port <port>: <reason>` at aya-log's `warn` when the level is at least `WARN`.
macro_rules! service {
    ($record:ident, $level:ident, $key:expr, $reason:literal) => {
        if $crate::log::enabled(proxy_common::abi::kernel_log::$level) {
            let key: &proxy_common::service::ServiceKey = $key;
            let port = u16::from_be(key.port);
            if key.family == proxy_common::service::FAMILY_V4 {
                let ip4 = key.addr[0].to_ne_bytes();
                aya_log_ebpf::$record!(&(), target: "kernel", "{:i} port {}: {}", ip4, port, $reason);
            } else {
                let ip6 = $crate::log::ip6(key);
                aya_log_ebpf::$record!(&(), target: "kernel", "{:i} port {}: {}", ip6, port, $reason);
            }
        }
    };
}
pub(crate) use service;
