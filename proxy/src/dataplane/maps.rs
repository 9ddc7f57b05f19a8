//! The one typed handle to the kernel maps the daemon uses: [`KernelMaps`], taken from a loaded
//! object or opened from the pins of an instance whose daemon is gone. This module is the only
//! code that turns a map name (`proxy_common::abi::maps`) into a typed aya map; the publisher,
//! the run-time maps and the pair splicer get theirs from the handle.
//!
//! The maps come in groups, one per consumer, each declared once below with its field, type and
//! name: the declaration generates the struct, its list of names and both constructors, so the
//! list the tests compare with the ABI is the list the constructors take.

use std::path::Path;

use aya::{
    Ebpf,
    maps::{
        HashMap, Map, MapData, MapError, PerCpuArray, PerCpuHashMap, SockHash, sock::SockMapFd,
    },
};
use proxy_common::{
    abi::maps,
    counters::ServiceCounts,
    limit::CxOpen,
    service::{Backend, Service, ServiceKey, SlotTable, SlotTableKey},
    socket::{PairFlow, PairGrant, PassiveCounts, Settings, SockTuple},
};

use super::DataplaneError;

/// Declares a group of maps: a struct with one public field per map, `NAMES`, and the two
/// constructors (take from an [`Ebpf`], open from a pin directory), in declaration order.
/// Maps after `@newer` are ones an earlier version did not pin: an `Option`, always there in a
/// loaded object, and `None` among the pins of an instance that version ran.
macro_rules! map_group {
    (
        $(#[$meta:meta])*
        pub struct $group:ident {
            $( $(#[$field_meta:meta])* $field:ident: $ty:ty = $name:ident, )+
            $( @newer $( $(#[$new_meta:meta])* $new:ident: $new_ty:ty = $new_name:ident, )+ )?
        }
    ) => {
        $(#[$meta])*
        pub struct $group {
            $( $(#[$field_meta])* pub $field: $ty, )+
            $( $( $(#[$new_meta])* pub $new: Option<$new_ty>, )+ )?
        }

        impl $group {
            /// The names of the group's maps, in the order the constructors take them.
            pub const NAMES: &'static [&'static str] = &[$(maps::$name,)+ $($(maps::$new_name,)+)?];

            fn take(ebpf: &mut Ebpf) -> Result<Self, DataplaneError> {
                Ok(Self {
                    $( $field: take(ebpf, maps::$name)?, )+
                    $( $( $new: Some(take(ebpf, maps::$new_name)?), )+ )?
                })
            }

            fn open_pinned(pin_dir: &Path) -> Result<Self, DataplaneError> {
                Ok(Self {
                    $( $field: open_pinned(pin_dir, maps::$name)?, )+
                    $( $( $new: open_newer(pin_dir, maps::$new_name)?, )+ )?
                })
            }
        }
    };
}

map_group! {
    /// What the publisher writes host sets into.
    pub struct ServiceMaps {
        /// Services by (VIP, port, protocol).
        services: HashMap<MapData, ServiceKey, Service> = SERVICES,
        /// Slot tables by (service, generation, priority).
        slots: HashMap<MapData, SlotTableKey, SlotTable> = SLOTS,
        /// Backend addresses by id.
        backends: HashMap<MapData, u32, Backend> = BACKENDS,
        /// Per-CPU counters of each service, by service id.
        svc_counters: PerCpuHashMap<MapData, u32, ServiceCounts> = SVC_COUNTERS,
        /// `max_connections` of limited services, by address.
        cx_max: HashMap<MapData, ServiceKey, u64> = CX_MAX,
        /// Open connections and refused connects of limited services, by address.
        cx_open: HashMap<MapData, ServiceKey, CxOpen> = CX_OPEN,
        /// Drop-overload shares of services, by address.
        drop_share: HashMap<MapData, ServiceKey, u32> = DROP,
        /// Connects each service's drop overload refused, by address.
        dropped: HashMap<MapData, ServiceKey, u64> = DROPPED,
    }
}

map_group! {
    /// What the daemon reads and writes while it runs (`super::RuntimeMaps`).
    pub struct RuntimeMapSet {
        /// The run-time settings (one entry).
        settings: HashMap<MapData, u32, Settings> = SETTINGS,
        /// Per-CPU counters.
        counters: PerCpuArray<MapData, u64> = COUNTERS,
        /// Original destinations of connections redirected to the proxy listener.
        orig_dst: HashMap<MapData, SockTuple, ServiceKey> = ORIG_DST,
        /// Passive health: failures and resets per backend.
        passive: PerCpuHashMap<MapData, Backend, PassiveCounts> = PASSIVE,
        /// Passive health: the current run of failures per backend.
        passive_run: HashMap<MapData, Backend, u64> = PASSIVE_RUN,
        @newer
        /// Kernel-path connects per host (summed over CPUs by the reader).
        host_cx: PerCpuHashMap<MapData, Backend, u64> = HOST_CX,
    }
}

map_group! {
    /// Proxy-pair splicing (`super::PairSplicer`).
    pub struct PairMaps {
        /// The sockhash the stream verdict program is attached to.
        pair_socks: SockHash<MapData, SockTuple> = PAIR_SOCKS,
        /// The socket to send out of, by the receiving socket's cookie.
        pair_peer: SockHash<MapData, u64> = PAIR_PEER,
        /// What the program did with each spliced socket's bytes.
        pair_flow: HashMap<MapData, u64, PairFlow> = PAIR_FLOW,
        /// The daemon's credit for each spliced socket.
        pair_grant: HashMap<MapData, u64, PairGrant> = PAIR_GRANT,
    }
}

/// Maps only the programs read and write; the daemon takes no handle to them. The loader
/// borrows the fd of [`maps::SPLICE`] to attach sk_msg to it ([`sockhash_fd`]).
pub const KERNEL_ONLY: [&str; 7] = [
    // LEAST_REQUEST's open connections: sockops keeps them, connect4/6 read them.
    maps::ACTIVE,
    maps::SOCK_VIP,
    maps::SOCK_PEER,
    maps::SOCK_ORIG,
    maps::SPLICE,
    maps::UDP_REV,
    // Host ending: connect4/6 write it; the reaper's iterator programs read it by their own fd.
    maps::SOCK_HOST,
];

/// Every map the daemon uses, typed.
pub struct KernelMaps {
    /// The publisher's maps.
    pub service: ServiceMaps,
    /// The run-time maps.
    pub runtime: RuntimeMapSet,
    /// The proxy-pair maps, or why they could not be taken or opened: they are optional, as
    /// proxy-pair splicing is (the loader fails only when their program was attached).
    pub pair: Result<PairMaps, DataplaneError>,
}

impl KernelMaps {
    /// Takes the maps out of a loaded object. Call it once every program is loaded: a program
    /// loaded later refers to its maps by the fds the object holds.
    pub(super) fn take(ebpf: &mut Ebpf) -> Result<Self, DataplaneError> {
        Ok(Self {
            service: ServiceMaps::take(ebpf)?,
            runtime: RuntimeMapSet::take(ebpf)?,
            pair: PairMaps::take(ebpf),
        })
    }

    /// Opens the pinned maps of the instance at `pin_dir` (`<bpffs>/<instance>/`), without
    /// loading any program: for tools that look at an instance whose daemon is gone.
    pub fn open_pinned(pin_dir: &Path) -> Result<Self, DataplaneError> {
        Ok(Self {
            service: ServiceMaps::open_pinned(pin_dir)?,
            runtime: RuntimeMapSet::open_pinned(pin_dir)?,
            pair: PairMaps::open_pinned(pin_dir),
        })
    }

    /// The names of the maps the handle holds.
    pub fn names() -> impl Iterator<Item = &'static str> {
        [ServiceMaps::NAMES, RuntimeMapSet::NAMES, PairMaps::NAMES]
            .into_iter()
            .flatten()
            .copied()
    }
}

/// A duplicate of the fd of the sockhash `name` of a loaded object, which stays in the object
/// (programs loaded after this are relocated against the object's fd): what sk_msg and stream
/// verdict programs are attached to.
pub(super) fn sockhash_fd(
    ebpf: &Ebpf,
    name: &'static str,
    pin_dir: &Path,
) -> Result<SockMapFd, DataplaneError> {
    let map = ebpf.map(name).ok_or_else(|| missing(name))?;
    let map = SockHash::<_, SockTuple>::try_from(map)
        .map_err(|source| DataplaneError::Map { name, source })?;
    map.fd().try_clone().map_err(|source| DataplaneError::Io {
        what: "duplicating the sockhash fd of",
        path: pin_dir.join(name),
        source,
    })
}

fn take<T>(ebpf: &mut Ebpf, name: &'static str) -> Result<T, DataplaneError>
where
    T: TryFrom<Map, Error = MapError>,
{
    let map = ebpf.take_map(name).ok_or_else(|| missing(name))?;
    T::try_from(map).map_err(|source| DataplaneError::Map { name, source })
}

fn open_pinned<T>(pin_dir: &Path, name: &'static str) -> Result<T, DataplaneError>
where
    T: TryFrom<Map, Error = MapError>,
{
    let map = MapData::from_pin(pin_dir.join(name))
        .and_then(Map::from_map_data)
        .map_err(|source| DataplaneError::Map { name, source })?;
    T::try_from(map).map_err(|source| DataplaneError::Map { name, source })
}

/// [`open_pinned`] for a map an earlier version did not pin: `None` when `pin_dir` has no pin
/// of it (that version's instance, opened by a tool; a daemon's load creates the map).
fn open_newer<T>(pin_dir: &Path, name: &'static str) -> Result<Option<T>, DataplaneError>
where
    T: TryFrom<Map, Error = MapError>,
{
    if pin_dir.join(name).exists() {
        open_pinned(pin_dir, name).map(Some)
    } else {
        Ok(None)
    }
}

/// The error for a map the object does not have.
fn missing(name: &'static str) -> DataplaneError {
    DataplaneError::Map {
        name,
        source: MapError::InvalidName {
            name: name.to_owned(),
        },
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use proxy_common::abi;

    use super::*;

    /// Every map of the ABI is either in the handle or declared kernel-only, never both and
    /// never twice: a map added to the ABI needs a decision here.
    #[test]
    fn the_handle_and_the_kernel_only_maps_are_the_abi() {
        let held: Vec<&str> = KernelMaps::names().collect();
        let held_set: BTreeSet<&str> = held.iter().copied().collect();
        assert_eq!(
            held.len(),
            held_set.len(),
            "a map twice in the handle: {held:?}"
        );
        let kernel_only = BTreeSet::from(KERNEL_ONLY);
        assert!(
            held_set.is_disjoint(&kernel_only),
            "held and kernel-only: {:?}",
            held_set.intersection(&kernel_only).collect::<Vec<_>>()
        );
        let all: BTreeSet<&str> = held_set.union(&kernel_only).copied().collect();
        assert_eq!(all, BTreeSet::from(abi::maps::ALL));
    }
}
