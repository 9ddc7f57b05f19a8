//! The service map domain: which (VIP, port, protocol) tuples are services, and the slot tables
//! and backends that connect-time host selection reads.
//!
//! Layout, as the kernel sees it:
//!
//! ```text
//! SERVICES_V2   ServiceKey   -> Service        (one entry per VIP:port/proto; holds the live generation,
//!                                               and the host itself when there is only one)
//! SLOTS_V2      SlotTableKey -> SlotTable      (one per service with 2+ hosts, generation and priority)
//! BACKENDS_V2   u32 (id)     -> Backend        (addresses referenced from slot tables)
//! ```
//!
//! A service whose routable level has one host carries it in `Service::backend`
//! ([`SERVICE_F_SINGLE`]): publishing or moving it is one map update, and the kernel reads no
//! table. Otherwise publishing writes backends, then the slot table of a new generation, then
//! flips `Service::generation` with one map update, then deletes the old generation: a reader sees
//! either the old or the new host set, never a mix and never a half-written table.
//!
//! The three maps are versioned together (`_V2` since `Service` gained `backend`): slot table keys
//! and backend ids only mean something next to the `SERVICES` map of the same version.

use core::mem::size_of;

/// `Service::family` / `Backend::family` value for IPv4.
pub const FAMILY_V4: u8 = 4;
/// `Service::family` / `Backend::family` value for IPv6.
pub const FAMILY_V6: u8 = 6;

/// IANA protocol number for TCP.
pub const PROTO_TCP: u8 = 6;
/// IANA protocol number for UDP.
pub const PROTO_UDP: u8 = 17;

/// Slots per table that the daemon fills. Prime, so a Maglev permutation visits every slot; large
/// enough for a weight resolution of 0.1 % (the requirement is 1 %).
pub const SLOTS: usize = 1021;

/// Length of the slot array: the next power of two above [`SLOTS`], so the kernel can bound a
/// slot index for the verifier with a mask (`index & SLOT_MASK`) that the compiler cannot drop.
pub const SLOT_CAPACITY: usize = 1024;
/// `SLOT_CAPACITY - 1`.
pub const SLOT_MASK: usize = SLOT_CAPACITY - 1;
const _: () = assert!(SLOTS <= SLOT_CAPACITY && SLOT_CAPACITY.is_power_of_two());

/// Failover priorities the kernel looks at, highest (0) first.
pub const MAX_PRIORITIES: u32 = 4;

/// `Service::flags` bit: redirect TCP connections to the daemon's proxy listener (the address
/// in `SETTINGS_V1`) instead of connecting straight to a host, and record the original
/// destination for the proxy (see `socket`). UDP services ignore it.
pub const SERVICE_F_PROXY: u32 = 1 << 0;
/// `Service::flags` bit: choose the slot by hashing a key of the client (consistent hashing
/// over a Maglev table) instead of at random; [`SERVICE_HASH_KEY_MASK`] says which key.
pub const SERVICE_F_MAGLEV: u32 = 1 << 1;
/// `Service::flags` bit: the service has exactly one routable host, `Service::backend`; the kernel
/// reads no slot table (any slot table would name only that host, whatever the weights, and a
/// Maglev table of one host maps every client to it).
pub const SERVICE_F_SINGLE: u32 = 1 << 2;
/// `Service::flags` bit: the service's connections feed the passive health signal (a cluster
/// behind it has outlier detection). Without it sockops does not follow them: no state
/// callbacks, no counting. Proxy-mode connections never feed it (the proxy reports its own
/// upstream connects).
pub const SERVICE_F_PASSIVE: u32 = 1 << 3;

/// `Service::flags` bit: choose the slot in turn (ROUND_ROBIN): the table's `cursor` is
/// incremented atomically by every connect, across CPUs, and indexes the table, whose slots the
/// daemon lays out in smooth weighted order. Only the `_rr` program variants (kernels with BPF
/// atomic fetch-and-add, 5.12) read it; the daemon refuses such a service on older kernels.
pub const SERVICE_F_ROUND_ROBIN: u32 = 1 << 4;

/// `Service::flags` bit: the published hosts were chosen in panic mode (too few healthy hosts,
/// so every host routes, as in Envoy); a connect to a host is also counted in the service's
/// `panic` counter (Envoy's `lb_healthy_panic`).
pub const SERVICE_F_PANIC: u32 = 1 << 5;

/// `Service::flags` bit: LEAST_REQUEST. The kernel draws two slots and takes the backend with
/// fewer open connections in `ACTIVE_V1` (the power of two choices); sockops keeps those counts
/// for the service's connections, so the service is followed.
pub const SERVICE_F_LEAST_REQUEST: u32 = 1 << 6;

/// `Service::flags` bit: the service's TCP connects are held to the `max_connections` in
/// `CX_MAX_V1` (its cluster's circuit breakers): connect4/6 refuse one while the service has
/// that many open connections in `CX_OPEN_V1`; sockops counts them, so the service is
/// followed. Without an entry in `CX_MAX_V1` nothing is limited (fail-open).
pub const SERVICE_F_CX_LIMIT: u32 = 1 << 7;

/// `Service::flags` bit: the service's TCP connects are refused at random at the share in
/// `DROP_V1` (its host set's `policy.drop_overloads`, see `crate::drop_overload`), counted in
/// `DROPPED_V1`. Without an entry in `DROP_V1` nothing is dropped (fail-open).
pub const SERVICE_F_DROP: u32 = 1 << 8;

/// `Service::flags` bit, with [`SERVICE_F_PROXY`]: while no proxy listener of the client's
/// family is there (the daemon stopped or was killed, and the next one does not listen yet),
/// connect straight to a host of the service's levels, as the kernel path does, instead of
/// refusing the connect. The daemon publishes a TCP proxy-mode service's hosts with it: the
/// proxy would only have copied bytes to one of them.
pub const SERVICE_F_NO_PROXY_HOSTS: u32 = 1 << 9;

/// `Service::flags` bit, with [`SERVICE_F_PROXY`]: while no proxy listener of the client's
/// family is there, let the connect go to the address dialled (an ORIGINAL_DST service, whose
/// proxy would have connected there too), instead of refusing it.
pub const SERVICE_F_NO_PROXY_DIALLED: u32 = 1 << 10;

/// `Service::flags` bit: a cluster behind the service ends its connections to a host that
/// leaves the routable set (`close_connections_on_host_health_failure`): connect4/6 record the
/// service and the chosen backend ([`SockHost`]) under the socket cookie in `SOCK_HOST_V2` (TCP
/// and connected UDP), which the daemon's socket iterators read to end that service's sockets
/// to that host with `bpf_sock_destroy` (Linux 6.5). Without it nothing is recorded.
pub const SERVICE_F_END: u32 = 1 << 11;

/// The bits of `Service::flags` that say what consistent hashing ([`SERVICE_F_MAGLEV`]) keys
/// on: one of the `HASH_KEY_*` values, shifted left by [`SERVICE_HASH_KEY_SHIFT`]. Zero is the
/// network namespace, what every service hashed on before the key was configurable, so an entry
/// a previous daemon published keeps its meaning. Kept far from the single-bit flags, which
/// grow upwards from bit 0.
pub const SERVICE_HASH_KEY_MASK: u32 = 0x7 << SERVICE_HASH_KEY_SHIFT;
/// Position of the hash-key field in `Service::flags`.
pub const SERVICE_HASH_KEY_SHIFT: u32 = 16;
/// Hash key: the client's network-namespace cookie (`bpf_get_netns_cookie`, Linux 5.7).
pub const HASH_KEY_NETNS: u32 = 0;
/// Hash key: the id of the client's cgroup v2 (`bpf_get_current_cgroup_id`; in cgroup
/// sock_addr programs since Linux 5.7, probed at load).
pub const HASH_KEY_CGROUP: u32 = 1;
/// Hash key: the client's process, its thread-group id in the initial pid namespace
/// (`bpf_get_current_pid_tgid`; in cgroup sock_addr programs by Linux 5.10, probed at load).
pub const HASH_KEY_PROCESS: u32 = 2;
/// Hash key: the client's user id in the initial user namespace (`bpf_get_current_uid_gid`,
/// Linux 4.17 in cgroup sock_addr programs).
pub const HASH_KEY_USER: u32 = 3;
/// Hash key: the client's socket cookie (`bpf_get_socket_cookie`): per connection for TCP, per
/// socket for UDP.
pub const HASH_KEY_SOCKET: u32 = 4;

/// The `HASH_KEY_*` value of `flags`.
pub const fn hash_key_of(flags: u32) -> u32 {
    (flags & SERVICE_HASH_KEY_MASK) >> SERVICE_HASH_KEY_SHIFT
}

/// Key of `SERVICES_V2`: a service address as the application dials it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceKey {
    /// Address, network byte order, as in `bpf_sock_addr.user_ip4`/`user_ip6`. IPv4 uses
    /// `addr[0]` and leaves the other words zero.
    pub addr: [u32; 4],
    /// Port, network byte order (the `__be16` of `bpf_sock_addr.user_port`).
    pub port: u16,
    /// `PROTO_TCP` or `PROTO_UDP`.
    pub proto: u8,
    /// `FAMILY_V4` or `FAMILY_V6`.
    pub family: u8,
}
const _: () = assert!(size_of::<ServiceKey>() == 20);

impl ServiceKey {
    /// The key of `ip:port` over `proto` (`PROTO_TCP` or `PROTO_UDP`). An IPv4-mapped IPv6
    /// address is keyed as its IPv4 address, as connect6 and sendmsg6 key a dual-stack socket's
    /// destination: one service answers both spellings.
    pub fn new(ip: core::net::IpAddr, port: u16, proto: u8) -> Self {
        let ip = match ip {
            core::net::IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, core::net::IpAddr::V4),
            core::net::IpAddr::V4(_) => ip,
        };
        let (addr, family) = ip_words(ip);
        Self {
            addr,
            port: port.to_be(),
            proto,
            family,
        }
    }
}

/// An address as the maps store it: each word holds 4 bytes in network order, IPv4 in the
/// first; with its `FAMILY_V4` or `FAMILY_V6`.
pub fn ip_words(ip: core::net::IpAddr) -> ([u32; 4], u8) {
    match ip {
        core::net::IpAddr::V4(v4) => ([u32::from_ne_bytes(v4.octets()), 0, 0, 0], FAMILY_V4),
        core::net::IpAddr::V6(v6) => {
            let o = v6.octets();
            let word = |i: usize| u32::from_ne_bytes([o[i], o[i + 1], o[i + 2], o[i + 3]]);
            ([word(0), word(4), word(8), word(12)], FAMILY_V6)
        }
    }
}

/// Value of `SERVICES_V2`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Service {
    /// Stable identifier of the service, host byte order; part of every `SlotTableKey`.
    pub id: u32,
    /// The live generation, host byte order. Only slot tables of this generation are read.
    pub generation: u32,
    /// `SERVICE_F_*` bits, host byte order.
    pub flags: u32,
    /// The one host when `flags` has [`SERVICE_F_SINGLE`]; all zero otherwise.
    pub backend: Backend,
}
const _: () = assert!(size_of::<Service>() == 32);

/// Key of `SLOTS_V2`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SlotTableKey {
    /// `Service::id`, host byte order.
    pub service_id: u32,
    /// Generation the table belongs to, host byte order.
    pub generation: u32,
    /// Failover priority, 0 = highest, host byte order; less than `MAX_PRIORITIES`.
    pub priority: u32,
}
const _: () = assert!(size_of::<SlotTableKey>() == 12);

/// Value of `SLOTS_V2`: the hosts of one priority level with weights expanded into slots.
/// Aligned to 8 (its size is a multiple of 8, so the layout is the same) because the kernel
/// updates `len` and `cursor` as one 64-bit word (ROUND_ROBIN).
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotTable {
    /// Number of valid slots, host byte order; 0 means the priority has no routable host.
    pub len: u32,
    /// ROUND_ROBIN's rotation ([`SERVICE_F_ROUND_ROBIN`]): the kernel's connects increment it
    /// atomically (as the high half of the 64-bit word it shares with `len`) and take slot
    /// `cursor % len`. The daemon writes 0 with each new table (a new
    /// generation starts its rotation afresh); other tables never touch it.
    pub cursor: u32,
    /// Backend ids (keys of `BACKENDS_V2`), host byte order. Only `slots[..len]` is read;
    /// `len` is at most [`SLOTS`].
    pub slots: [u32; SLOT_CAPACITY],
}
const _: () = assert!(size_of::<SlotTable>() == 8 + 4 * SLOT_CAPACITY);

impl Default for SlotTable {
    fn default() -> Self {
        Self {
            len: 0,
            cursor: 0,
            slots: [0; SLOT_CAPACITY],
        }
    }
}

/// Value of `BACKENDS_V2`: where a chosen host is.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Backend {
    /// Address, network byte order; IPv4 in `addr[0]`.
    pub addr: [u32; 4],
    /// Port, network byte order.
    pub port: u16,
    /// `FAMILY_V4` or `FAMILY_V6`.
    pub family: u8,
    /// Explicit padding; always zero.
    pub _pad: u8,
}
const _: () = assert!(size_of::<Backend>() == 20);

/// Value of `SOCK_HOST_V2`, and key of the daemon's map of what to end: which service a socket
/// dialled and the host it was sent to. Keyed by the service too because a host that fails in
/// one service's cluster may be healthy in another's (checked on another port, say): ending
/// one service's connections must leave the other's alone, as each Envoy cluster closes only
/// its own.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockHost {
    /// The service dialled, as its `SERVICES_V2` key.
    pub service: ServiceKey,
    /// The chosen host.
    pub backend: Backend,
}
const _: () = assert!(size_of::<SockHost>() == 40);

/// Layouts of earlier versions that a new daemon still reads, to carry their state over
/// (`abi::RETIRED` names their maps).
pub mod legacy {
    use core::mem::size_of;

    /// Value of `SERVICES_V1` (before `Service` gained `backend`); `SLOTS_V1` and `BACKENDS_V1`
    /// hold [`super::SlotTable`] and [`super::Backend`] as `_V2` does, under the same keys.
    /// Its flags are [`super::SERVICE_F_PROXY`] and [`super::SERVICE_F_MAGLEV`].
    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
    pub struct ServiceV1 {
        /// Stable identifier of the service, host byte order.
        pub id: u32,
        /// The live generation, host byte order.
        pub generation: u32,
        /// `SERVICE_F_*` bits, host byte order.
        pub flags: u32,
        /// Explicit padding; always zero.
        pub _pad: u32,
    }
    const _: () = assert!(size_of::<ServiceV1>() == 16);

    /// The `_V1` names of the three service maps.
    pub const SERVICES_V1: &str = "SERVICES_V1";
    pub const SLOTS_V1: &str = "SLOTS_V1";
    pub const BACKENDS_V1: &str = "BACKENDS_V1";
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A VIP written as IPv4-mapped IPv6 is the IPv4 service, the key connect4 builds for an
    /// IPv4 socket and connect6 for a dual-stack one; before, it was an IPv6 key no hook built.
    #[test]
    fn an_ipv4_mapped_address_is_keyed_as_ipv4() {
        let four = ServiceKey::new("127.77.0.3".parse().unwrap(), 80, PROTO_TCP);
        let mapped = ServiceKey::new("::ffff:127.77.0.3".parse().unwrap(), 80, PROTO_TCP);
        assert_eq!(mapped, four);
        assert_eq!(mapped.family, FAMILY_V4);
        assert_eq!(mapped.addr, [u32::from_ne_bytes([127, 77, 0, 3]), 0, 0, 0]);
        let six = ServiceKey::new("fd77::3".parse().unwrap(), 80, PROTO_TCP);
        assert_eq!(six.family, FAMILY_V6);
    }
}
