//! The socket map domain: original destinations of proxied connections, the socket-to-socket
//! splicing hash, unconnected-UDP reverse translation, passive health counters and the runtime
//! settings the hooks read.
//!
//! Layout, as the kernel sees it:
//!
//! ```text
//! SETTINGS_V1    u32 (0)        -> Settings       (splice switch, proxy listener addresses)
//! SOCK_VIP_V2    socket         -> SockVip        (socket local storage, followed sockets only:
//!                                                   connect4/6 -> sockops, getpeername4/6)
//! SOCK_PEER_V1   cookie % 2^18  -> PeerSlot       (array: every other socket that dialled a
//!                                                   service, connect4/6 -> getpeername4/6)
//! SOCK_ORIG_V1   u64 (cookie)   -> ServiceKey     (proxy mode: connect4/6 -> sockops)
//! ORIG_DST_V1    SockTuple      -> ServiceKey     (proxy mode: sockops -> the daemon's accept())
//! SPLICE_V1      SockTuple      -> socket         (sockhash: sockops inserts, sk_msg redirects)
//! PAIR_SOCKS_V1  SockTuple      -> socket         (sockhash: the daemon arms a spliced proxy pair)
//! PAIR_PEER_V2   u64 (cookie)   -> peer socket    (sockhash: pair_verdict redirects to it)
//! PAIR_FLOW_V1   u64 (cookie)   -> PairFlow       (pair_verdict counts what it redirected/passed)
//! PAIR_GRANT_V1  u64 (cookie)   -> PairGrant      (the daemon's credit for pair_verdict)
//! UDP_REV_V1     UdpReverseKey  -> ServiceKey     (sendmsg4/6 and connect4/6 -> recvmsg4/6)
//! PASSIVE_V1     Backend        -> PassiveCounts  (per CPU: sockops -> the daemon's health)
//! ACTIVE_V1      Backend        -> u64            (sockops -> connect4/6: LEAST_REQUEST)
//! HOST_CX_V1     Backend        -> u64            (per CPU, LRU: kernel-path connects per host,
//!                                                   connect4/6 -> the daemon's `/clusters`)
//! ```
//!
//! Open connections per service for `max_connections` are in the `limit` domain.

use core::mem::size_of;

use crate::service::{Backend, ServiceKey};

/// `SockVip::flags` bit: the socket was redirected to the proxy listener (proxy mode), so its
/// original destination moves to `ORIG_DST_V1` when it is established and is removed from there
/// when it closes. Sockets of the kernel path skip both lookups.
pub const SOCK_VIP_F_PROXIED: u32 = 1 << 0;
/// `SockVip::flags` bit: the socket dialled a service with `SERVICE_F_PASSIVE`: sockops counts
/// its failed connect or reset for the backend, and an established connect ends the backend's
/// run of failures.
pub const SOCK_VIP_F_PASSIVE: u32 = 1 << 1;
/// `SockVip::flags` bit: the socket dialled a service with `SERVICE_F_LEAST_REQUEST`: sockops
/// counts it in its backend's `ACTIVE_V1` entry from its connect until it closes.
pub const SOCK_VIP_F_LEAST: u32 = 1 << 2;
/// `SockVip::flags` bit: sockops counted the socket in `ACTIVE_V1` (set at its connect, cleared
/// when the count is taken back at close), so a count is taken back exactly once.
pub const SOCK_VIP_F_COUNTED: u32 = 1 << 3;
/// `SockVip::flags` bit: the socket dialled a service with `SERVICE_F_CX_LIMIT`: sockops counts
/// it in the service's `CX_OPEN_V1` entry from its connect until it closes.
pub const SOCK_VIP_F_CX_LIMIT: u32 = 1 << 4;
/// `SockVip::flags` bit: sockops counted the socket in `CX_OPEN_V1` (set at its connect,
/// cleared when the count is taken back at close), so a count is taken back exactly once.
pub const SOCK_VIP_F_CX_COUNTED: u32 = 1 << 5;

/// Value of `SOCK_VIP_V2` (socket local storage): the service a socket dialled.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SockVip {
    /// The service address as the application dialled it (what getpeername shows).
    pub key: ServiceKey,
    /// `SOCK_VIP_F_*` bits, host byte order.
    pub flags: u32,
}
const _: () = assert!(size_of::<SockVip>() == 24);

/// Entries of `HOST_CX_V1` (per CPU, 8 bytes per CPU each: 128 KiB per CPU): the hosts whose
/// kernel-path connects are counted at once; the least recently connected go first.
pub const HOST_CX_ENTRIES: u32 = 16_384;

/// Slots of `SOCK_PEER_V1`. A power of two: a socket's slot is the low bits of its cookie.
pub const PEER_SLOTS: u32 = 1 << 18;

/// Value of `SOCK_PEER_V1`: the service the socket of `cookie` dialled. The slot belongs to the
/// newest socket whose cookie maps to it; a reader whose cookie differs, or whose `check` does
/// not match what it read, finds nothing.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PeerSlot {
    /// Socket cookie of the owner (0: never written; the kernel's cookies start at 1).
    pub cookie: u64,
    /// The service address as the application dialled it.
    pub key: ServiceKey,
    /// [`PeerSlot::check_of`] the two fields above: a slot that two sockets wrote at once, or
    /// that was read while it was written, is torn, and its check tells.
    pub check: u32,
}
const _: () = assert!(size_of::<PeerSlot>() == 32);

impl PeerSlot {
    /// The slot of the socket of `cookie` that dialled `key`.
    #[inline(always)]
    pub fn new(cookie: u64, key: ServiceKey) -> Self {
        Self {
            cookie,
            key,
            check: Self::check_of(cookie, &key),
        }
    }

    /// FNV-1a over the 32-bit words of the cookie and the key (a torn slot matches with
    /// probability 2^-32).
    #[inline(always)]
    pub fn check_of(cookie: u64, key: &ServiceKey) -> u32 {
        let last = u32::from(key.port) | u32::from(key.proto) << 16 | u32::from(key.family) << 24;
        let words = [
            cookie as u32,
            (cookie >> 32) as u32,
            key.addr[0],
            key.addr[1],
            key.addr[2],
            key.addr[3],
            last,
        ];
        let mut h: u32 = 0x811c_9dc5;
        for w in words {
            h = (h ^ w).wrapping_mul(0x0100_0193);
        }
        h
    }
}

/// `Settings::flags` bit: splice established local socket pairs with sk_msg (opt-in until
/// benchmarks decide the default).
pub const SETTINGS_F_SPLICE: u32 = 1 << 0;

/// Key of the one entry of `SETTINGS_V1`.
pub const SETTINGS_KEY: u32 = 0;

/// Value of `SETTINGS_V1`: what the daemon can change at run time without reloading programs.
/// Kept in a hash map that is not preallocated, so an update replaces the whole value at once
/// (readers see the old or the new one, never a torn mix of address and port).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Settings {
    /// `SETTINGS_F_*` bits, host byte order.
    pub flags: u32,
    /// Explicit padding; always zero.
    pub _pad: u32,
    /// The proxy listener for IPv4 clients; `family == 0` when there is none.
    pub proxy_v4: Backend,
    /// The proxy listener for IPv6 clients; `family == 0` when there is none.
    pub proxy_v6: Backend,
}
const _: () = assert!(size_of::<Settings>() == 48);

/// A TCP connection as one of its ends sees it: key of `ORIG_DST_V1`, `SPLICE_V1` and
/// `PAIR_SOCKS_V1`.
///
/// The proxy listener looks a redirected connection up with (peer, local) of the accepted socket,
/// which is (local, remote) of the client's socket: the client's view is the key.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockTuple {
    /// This end's address, network byte order; IPv4 in `local[0]`, other words zero.
    pub local: [u32; 4],
    /// The other end's address, network byte order; IPv4 in `remote[0]`.
    pub remote: [u32; 4],
    /// This end's port, network byte order.
    pub local_port: u16,
    /// The other end's port, network byte order.
    pub remote_port: u16,
    /// `FAMILY_V4` or `FAMILY_V6` (IPv4-mapped IPv6 sockets are `FAMILY_V6`).
    pub family: u8,
    /// Explicit padding; always zero.
    pub _pad: [u8; 3],
}
const _: () = assert!(size_of::<SockTuple>() == 40);

impl SockTuple {
    /// The same connection as the other end sees it.
    #[inline(always)]
    pub fn reversed(&self) -> Self {
        Self {
            local: self.remote,
            remote: self.local,
            local_port: self.remote_port,
            remote_port: self.local_port,
            family: self.family,
            _pad: [0; 3],
        }
    }
}

/// Key of `UDP_REV_V1`: a backend one UDP socket sent to on behalf of a service address.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct UdpReverseKey {
    /// Socket cookie (`SO_COOKIE`), host byte order.
    pub cookie: u64,
    /// The backend address as the socket's family writes it, network byte order: IPv4 sockets
    /// use `addr[0]`; IPv6 sockets the four words (IPv4-mapped for a dual-stack socket).
    pub addr: [u32; 4],
    /// The backend port, network byte order.
    pub port: u16,
    /// The socket's family: `FAMILY_V4` or `FAMILY_V6`.
    pub family: u8,
    /// Explicit padding; always zero.
    pub _pad: [u8; 5],
}
const _: () = assert!(size_of::<UdpReverseKey>() == 32);

/// Value of `PASSIVE_V1` (per CPU; the daemon sums): what sockets in the cgroup saw of one
/// backend, cumulative since the map was created.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PassiveCounts {
    /// Connects that never got established (SYN_SENT -> CLOSE: refused, unreachable, timed out).
    pub connect_failures: u64,
    /// Established connections that ended without the FIN handshake (ESTABLISHED or CLOSE_WAIT
    /// -> CLOSE: a reset received, or an abort).
    pub resets: u64,
}
const _: () = assert!(size_of::<PassiveCounts>() == 16);

/// Value of `PAIR_FLOW_V1`, by a spliced proxy socket's cookie: what `pair_verdict` did
/// with the bytes that socket received since it was spliced. Written only by the program (the
/// daemon inserts zeros before arming the pair, and reads).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PairFlow {
    /// Bytes redirected out of the peer socket (the kernel's splice).
    pub redirected: u64,
    /// Bytes passed to the socket's own receive queue, for the daemon to copy (the peer was
    /// behind by the whole credit, or bytes passed earlier were not copied yet).
    pub passed: u64,
}
const _: () = assert!(size_of::<PairFlow>() == 16);

/// Value of `PAIR_GRANT_V1`, by a spliced proxy socket's cookie: the credit the daemon
/// gives `pair_verdict`. Written only by the daemon, whole (one map update).
///
/// The program redirects a buffer only while `PairFlow::redirected` plus its length stays
/// within `granted` and every passed byte was copied (`PairFlow::passed == drained`);
/// otherwise it passes the buffer to the socket, where the daemon copies it in order. That
/// bounds what the kernel queues for a slow peer, and the socket's own receive buffer then
/// closes the TCP window: backpressure.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PairGrant {
    /// Total bytes (since splicing) the program may redirect.
    pub granted: u64,
    /// Passed bytes the daemon has copied to the peer.
    pub drained: u64,
}
const _: () = assert!(size_of::<PairGrant>() == 16);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service::{FAMILY_V4, PROTO_TCP};

    #[test]
    fn a_slot_check_changes_with_every_field() {
        let key = ServiceKey {
            addr: [u32::from_ne_bytes([127, 77, 0, 1]), 0, 0, 0],
            port: 80u16.to_be(),
            proto: PROTO_TCP,
            family: FAMILY_V4,
        };
        let cookie = 0x1_0000_0042;
        let base = PeerSlot::check_of(cookie, &key);
        assert_eq!(PeerSlot::new(cookie, key).check, base);
        let mut variants = [0u32; 10];
        variants[0] = PeerSlot::check_of(cookie + 1, &key);
        variants[1] = PeerSlot::check_of(cookie + (1 << 32), &key);
        variants[2] = PeerSlot::check_of(cookie + u64::from(PEER_SLOTS), &key);
        for change in 0..7 {
            let mut k = key;
            match change {
                0..=3 => k.addr[change] ^= 1,
                4 => k.port ^= 1,
                5 => k.proto ^= 1,
                _ => k.family ^= 1,
            }
            variants[3 + change] = PeerSlot::check_of(cookie, &k);
        }
        assert!(
            variants.iter().all(|&c| c != base),
            "{base:#x} in {variants:x?}"
        );
    }
}
