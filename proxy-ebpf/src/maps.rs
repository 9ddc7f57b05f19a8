//! Every map of the kernel programs. Names carry a layout version (`_V1`) so that a daemon of a
//! newer layout can pin its maps beside the old ones during an upgrade. Maps are pinned by name
//! under `<bpffs>/<instance>/` by the daemon's loader.

use aya_ebpf::{
    bindings::BPF_F_NO_PREALLOC,
    macros::map,
    maps::{HashMap, LruHashMap, PerCpuArray},
};
use proxy_common::{
    counters,
    service::{Backend, Service, ServiceKey, SlotTable, SlotTableKey},
};

/// Services by (VIP, port, protocol). Not preallocated: an update allocates a new element and
/// frees the old one after an RCU grace period, so a concurrent reader never sees it reused.
#[map]
pub static SERVICES_V1: HashMap<ServiceKey, Service> =
    HashMap::pinned(65_536, BPF_F_NO_PREALLOC);

/// Slot tables by (service, generation, priority). Two generations of one service coexist only
/// while it is republished.
#[map]
pub static SLOTS_V1: HashMap<SlotTableKey, SlotTable> =
    HashMap::pinned(262_144, BPF_F_NO_PREALLOC);

/// Backend addresses by id; ids are allocated by the daemon and referenced from slot tables.
#[map]
pub static BACKENDS_V1: HashMap<u32, Backend> = HashMap::pinned(262_144, BPF_F_NO_PREALLOC);

/// The service address a socket dialled, by socket cookie, so getpeername can show it. LRU so it
/// can never fill up with entries of closed sockets.
#[map]
pub static SOCK_VIP_V1: LruHashMap<u64, ServiceKey> = LruHashMap::pinned(262_144, 0);

/// Per-CPU outcome and error counters, indexed by `proxy_common::counters`.
#[map]
pub static COUNTERS_V1: PerCpuArray<u64> = PerCpuArray::pinned(counters::COUNT, 0);

/// Adds one to a counter of this CPU.
#[inline(always)]
pub fn count(index: u32) {
    if let Some(slot) = COUNTERS_V1.get_ptr_mut(index) {
        // SAFETY: the pointer comes from the map and is valid for this CPU; per-CPU values are
        // not shared with other CPUs, and a preempting program at worst loses one increment.
        unsafe { *slot += 1 };
    }
}
