//! Every map of the kernel programs. Names carry a layout version (`_V1`, `_V2`) so that a newer
//! layout's maps can be pinned beside the old ones during an upgrade. The daemon's loader pins
//! them by name under `<bpffs>/<instance>/` (the sockhash too: the sk_msg program is attached to
//! it, and the attachment lives exactly as long as the map).
//!
//! `#[map]` names a map after its static; userspace takes the names (and the version policy)
//! from `proxy_common::abi::maps`, and the `proxy` test `the_object_declares_exactly_the_abi`
//! fails when the lists differ (a retired name goes in `abi::RETIRED`).

use aya_ebpf::{
    bindings::{BPF_F_NO_PREALLOC, BPF_NOEXIST},
    btf_maps::SkStorage,
    macros::{btf_map, map},
    maps::{Array, HashMap, LruHashMap, LruPerCpuHashMap, PerCpuArray, PerCpuHashMap, SockHash},
};
use proxy_common::{
    counters::{self, ServiceCounts},
    limit::CxOpen,
    service::{Backend, Service, ServiceKey, SlotTable, SlotTableKey, SockHost},
    socket::{
        HOST_CX_ENTRIES, PEER_SLOTS, PairFlow, PairGrant, PassiveCounts, PeerSlot, Settings,
        SockTuple, SockVip, UdpReverseKey,
    },
};

/// Services by (VIP, port, protocol); a one-host service carries its host here. Not
/// preallocated: an update allocates a new element and frees the old one after an RCU grace
/// period, so a concurrent reader never sees it reused. `_V2`: `Service` gained `backend` (the
/// three service maps are versioned together).
#[map]
pub static SERVICES_V2: HashMap<ServiceKey, Service> = HashMap::pinned(65_536, BPF_F_NO_PREALLOC);

/// Slot tables by (service, generation, priority), only for services of two or more hosts. Two
/// generations of one service coexist only while it is republished.
#[map]
pub static SLOTS_V2: HashMap<SlotTableKey, SlotTable> = HashMap::pinned(262_144, BPF_F_NO_PREALLOC);

/// Backend addresses by id; ids are allocated by the daemon and referenced from slot tables.
#[map]
pub static BACKENDS_V2: HashMap<u32, Backend> = HashMap::pinned(262_144, BPF_F_NO_PREALLOC);

/// The service address a *followed* socket dialled (proxy mode, or a cluster with outlier
/// detection: `SockVip::flags` is not 0), kept in the socket itself (socket local storage), so
/// sockops can tell which sockets to watch and getpeername can show it. Every other socket has
/// no entry, and sockops' lookup is a NULL check: no hashing, no cookie, no cache-missing bucket
/// of a big table, for every socket of the cgroup. The kernel frees an entry with its socket.
/// A BTF map (the kernel needs BTF for the value): the aya-ebpf definition has no pinning
/// field, so the daemon's loader pins it by path.
///
/// Only followed sockets get one: creating an entry (two memcg-charged allocations, and an
/// RCU-deferred free when the socket goes) cost 1,000 of connect4's 1,300 ns on 6.18.
#[btf_map]
pub static SOCK_VIP_V2: SkStorage<SockVip> = SkStorage::new();

/// The service address every other socket dialled (the plain kernel path, and UDP), for
/// getpeername: a direct-mapped cache indexed by the low bits of the socket cookie, each slot
/// tagged with the cookie of its owner and a check of cookie and service (`PeerSlot`). A
/// connect costs the cookie and one store into a preallocated slot: no hashing, no lock, no
/// allocation, and nothing to free when the socket closes. Cookies are never reused and come
/// in per-CPU runs, so a slot changes owner only after `PEER_SLOTS` (262,144) newer cookies; a
/// socket that lost its slot is fail-open (getpeername shows the backend). 8 MiB.
#[map]
pub static SOCK_PEER_V1: Array<PeerSlot> = Array::pinned(PEER_SLOTS, 0);

/// Run-time settings (one entry, `SETTINGS_KEY`): the splice switch and the proxy listener
/// addresses. Not preallocated, so an update swaps the whole value.
#[map]
pub static SETTINGS_V1: HashMap<u32, Settings> = HashMap::pinned(1, BPF_F_NO_PREALLOC);

/// Proxy mode: the service a redirected socket dialled, by socket cookie, from connect until
/// sockops re-keys it by 4-tuple (then it is removed). LRU for sockets that never establish.
#[map]
pub static SOCK_ORIG_V1: LruHashMap<u64, ServiceKey> = LruHashMap::pinned(65_536, 0);

/// Host ending (`SERVICE_F_END`): the service and backend a socket connected to, by socket
/// cookie, for the daemon's socket iterators. Nothing removes an entry when its socket closes:
/// LRU, so a socket evicted under churn is simply not ended.
#[map]
pub static SOCK_HOST_V2: LruHashMap<u64, SockHost> = LruHashMap::pinned(262_144, 0);

/// Kernel-path connects per chosen backend (`crate::host_cx`), which the daemon adds to each
/// host's `cx_total` in `/clusters`. Per CPU, so a connect adds without atomics; LRU, so hosts
/// that come and go never fill it (a cold host's count is evicted first). Never removed by the
/// daemon: a count belongs to an address, whatever cluster lists it.
#[map]
pub static HOST_CX_V1: LruPerCpuHashMap<Backend, u64> =
    LruPerCpuHashMap::pinned(HOST_CX_ENTRIES, 0);

/// Proxy mode: the service a redirected connection dialled, by the client's 4-tuple, for the
/// proxy's accept(). Removed by sockops when the client socket closes; LRU as a backstop.
#[map]
pub static ORIG_DST_V1: LruHashMap<SockTuple, ServiceKey> = LruHashMap::pinned(262_144, 0);

/// Established local sockets by 4-tuple (their own view), for sk_msg splicing. The kernel
/// removes a socket when it closes.
#[map]
pub static SPLICE_V1: SockHash<SockTuple> = SockHash::pinned(65_536, 0);

/// Unconnected UDP: which service address a (socket, backend) pair stands for, so recvmsg can
/// show replies as coming from the service. LRU: UDP sockets have no close callback here.
#[map]
pub static UDP_REV_V1: LruHashMap<UdpReverseKey, ServiceKey> = LruHashMap::pinned(262_144, 0);

/// LEAST_REQUEST: open connections per backend, of the sockets of LEAST_REQUEST services (sockops
/// adds one at a socket's connect and takes it back when it closes; connect4/6 read two). A
/// plain hash, not LRU: an evicted entry would lose counts that are taken back later.
#[map]
pub static ACTIVE_V1: HashMap<Backend, u64> = HashMap::pinned(65_536, BPF_F_NO_PREALLOC);

/// `max_connections` of each limited service (`SERVICE_F_CX_LIMIT`), by its address; written
/// by the daemon before the flag is published, removed after it is gone.
#[map]
pub static CX_MAX_V1: HashMap<ServiceKey, u64> = HashMap::pinned(65_536, BPF_F_NO_PREALLOC);

/// The drop-overload share (parts per million) of each service with `SERVICE_F_DROP`, by its
/// address; written by the daemon before the flag is published, removed after it is gone.
#[map]
pub static DROP_V1: HashMap<ServiceKey, u32> = HashMap::pinned(65_536, BPF_F_NO_PREALLOC);

/// Connects each such service's drop overload refused, by its address. Only the programs write
/// it (atomic adds; connect4/6 create an entry at a first drop); the daemon deletes a removed
/// service's entry.
#[map]
pub static DROPPED_V1: HashMap<ServiceKey, u64> = HashMap::pinned(65_536, BPF_F_NO_PREALLOC);

/// Open connections and refused connects of each limited service, by its address. Only the
/// programs write it (atomic adds; sockops creates an entry at a first connect), so, as
/// `ACTIVE_V1`, a plain hash: an evicted count could not be taken back.
#[map]
pub static CX_OPEN_V1: HashMap<ServiceKey, CxOpen> = HashMap::pinned(65_536, BPF_F_NO_PREALLOC);

/// Passive health: per-backend connect failures and resets seen by sockets in the cgroup.
#[map]
pub static PASSIVE_V1: LruPerCpuHashMap<Backend, PassiveCounts> =
    LruPerCpuHashMap::pinned(16_384, 0);

/// Passive health: per backend, the current run of failures (failed connects and resets) since
/// the last connect to it that got established. Only backends that failed get an entry.
#[map]
pub static PASSIVE_RUN_V1: LruHashMap<Backend, u64> = LruHashMap::pinned(16_384, 0);

/// Per-CPU outcome and error counters, indexed by `proxy_common::counters`.
#[map]
pub static COUNTERS_V2: PerCpuArray<u64> = PerCpuArray::pinned(counters::COUNT, 0);

/// Per-CPU counters of each service, by `Service::id`; entries are created by the hooks on a
/// service's first use and deleted by the daemon with the service.
#[map]
pub static SVC_COUNTERS_V3: PerCpuHashMap<u32, ServiceCounts> =
    PerCpuHashMap::pinned(65_536, BPF_F_NO_PREALLOC);

/// Which of a service's counters [`count_service`] adds to.
#[derive(Clone, Copy)]
pub enum ServiceOutcome {
    ToHost,
    /// To a host, chosen in panic mode (`to_host` and `panic`).
    ToHostInPanic,
    ToProxy,
    NoHost,
    /// A followed connect failed or was reset (sockops, passive health).
    PassiveFailure,
}

/// Adds one to a counter of service `id` on this CPU (creating its entry on first use).
#[inline(always)]
pub fn count_service(id: u32, outcome: ServiceOutcome) {
    let add = |counts: &mut ServiceCounts| match outcome {
        ServiceOutcome::ToHost => counts.to_host += 1,
        ServiceOutcome::ToHostInPanic => {
            counts.to_host += 1;
            counts.panic += 1;
        }
        ServiceOutcome::ToProxy => counts.to_proxy += 1,
        ServiceOutcome::NoHost => counts.no_host += 1,
        ServiceOutcome::PassiveFailure => counts.passive_failures += 1,
    };
    if let Some(counts) = SVC_COUNTERS_V3.get_ptr_mut(&id) {
        // SAFETY: the pointer comes from the map and is valid for this CPU; per-CPU values are
        // not shared with other CPUs, and a preempting program at worst loses one increment.
        add(unsafe { &mut *counts });
        return;
    }
    let mut first = ServiceCounts::default();
    add(&mut first);
    // Another CPU may create it at the same moment (BPF_NOEXIST then fails): that CPU's entry
    // is the service's, and this one increment is lost. A full map also loses it; the global
    // counters still have it.
    let _ = SVC_COUNTERS_V3.insert(&id, &first, u64::from(BPF_NOEXIST));
}

/// Adds one to a counter of this CPU.
#[inline(always)]
pub fn count(index: u32) {
    if let Some(slot) = COUNTERS_V2.get_ptr_mut(index) {
        // SAFETY: the pointer comes from the map and is valid for this CPU; per-CPU values are
        // not shared with other CPUs, and a preempting program at worst loses one increment.
        unsafe { *slot += 1 };
    }
}

/// The current settings (all off when the daemon never wrote any).
#[inline(always)]
pub fn settings() -> Settings {
    // SAFETY: the value is copied out before the program returns.
    unsafe { SETTINGS_V1.get(&proxy_common::socket::SETTINGS_KEY) }
        .copied()
        .unwrap_or_default()
}

/// Proxy-pair splicing: the daemon's client and upstream sockets of a spliced connection, by
/// their own 4-tuple. The stream verdict program `pair_verdict` is attached here: a socket runs
/// it from the moment it is inserted. The kernel removes a socket when it closes.
#[map]
pub static PAIR_SOCKS_V1: SockHash<SockTuple> = SockHash::pinned(65_536, 0);

/// Proxy-pair splicing: the socket that bytes received by a spliced socket go out of, by the
/// receiving socket's cookie (no program attached: the daemon fills it before it arms the pair
/// in `PAIR_SOCKS_V1`). `_V2`: keyed by cookie instead of 4-tuple, which a closing socket loses
/// (its local port reads 0 once released) while bytes may still wait for the program.
#[map]
pub static PAIR_PEER_V2: SockHash<u64> = SockHash::pinned(65_536, 0);

/// Proxy-pair splicing: what `pair_verdict` did with each spliced socket's bytes (redirected,
/// passed), by the receiving socket's cookie. The daemon inserts zeros before it arms the pair
/// and removes the entry when it takes the pair apart; only the program writes it between.
#[map]
pub static PAIR_FLOW_V1: HashMap<u64, PairFlow> = HashMap::pinned(65_536, 0);

/// Proxy-pair splicing: the daemon's credit for each spliced socket (see `PairGrant`), by the
/// receiving socket's cookie. Only the daemon writes it.
#[map]
pub static PAIR_GRANT_V1: HashMap<u64, PairGrant> = HashMap::pinned(65_536, 0);
