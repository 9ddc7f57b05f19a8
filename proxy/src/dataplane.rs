//! The kernel side, seen from the daemon: load the programs, attach them to the cgroup, pin maps
//! and links under `<bpffs>/<instance>/`, publish host sets, read counters, clean up.
//!
//! Pinning makes the data path outlive the daemon: after a crash or `kill -9`, connections to
//! services keep working on the last published state, and the next daemon adopts the pins
//! (maps are reused as they are; links are replaced without a gap). A graceful stop removes
//! everything this daemon created. Names and the version policy for pins of an earlier version:
//! `proxy_common::abi`.

mod attach;
mod btf;
mod error;
mod features;
mod loader;
mod maps;
mod migrate;
mod mounts;
mod pair;
mod pins;
mod publish;
mod reaper;
mod runtime;
mod sizes;
mod uninstall;

pub use self::{
    error::DataplaneError,
    loader::{Dataplane, DataplaneOptions},
    maps::{KERNEL_ONLY, KernelMaps, PairMaps, RuntimeMapSet, ServiceMaps},
    migrate::upgrade as upgrade_v1,
    mounts::{cgroup2_mount, resolve_cgroup},
    pair::{PAIR_CREDIT, PairError, PairGuard, PairSide, PairSplicer},
    pins::RetiredPins,
    publish::{
        PublishOutcome, PublishState, Publisher, ServiceSpec, backend_of,
        service_key as publish_key,
    },
    runtime::{OriginalDestinations, PassiveReport, RuntimeMaps, socket_addr as kernel_addr},
    uninstall::{Uninstalled, uninstall},
};

/// The kernel programs, built by `build.rs` from the `proxy-ebpf` crate.
pub static EBPF_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/proxy-programs"));

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use aya_obj::{Object, maps::PinningType};
    use proxy_common::abi;

    /// The embedded object, parsed without loading anything (no privileges needed).
    fn object() -> Object {
        Object::parse(super::EBPF_OBJECT).expect("parsing the embedded eBPF object")
    }

    /// Every map and program `proxy_common::abi` declares is in the built object, and the object
    /// has nothing it does not declare: the kernel statics and the userspace names agree.
    #[test]
    fn the_object_declares_exactly_the_abi() {
        let obj = object();
        // Data sections (`.rodata`, `.bss`) are maps to aya too, named after their section.
        let maps: BTreeSet<&str> = obj
            .maps
            .keys()
            .map(String::as_str)
            .filter(|name| !name.starts_with('.'))
            .collect();
        let mut declared = BTreeSet::from(abi::maps::ALL);
        declared.insert(abi::maps::LOGS);
        assert_eq!(
            maps, declared,
            "maps of the object vs abi::maps::ALL and LOGS"
        );
        let programs: BTreeSet<&str> = obj.programs.keys().map(String::as_str).collect();
        assert_eq!(
            programs,
            BTreeSet::from(abi::programs::ALL),
            "programs of the object vs abi::programs::ALL"
        );
    }

    /// Every map is pinned under its name, so a restarted daemon adopts it: the legacy maps ask
    /// for it in their definition, the one BTF map (socket storage, which cannot) is pinned by
    /// the loader by path.
    #[test]
    fn every_map_is_pinned_by_name_or_by_the_loader() {
        let obj = object();
        for name in abi::maps::ALL {
            let map = obj
                .maps
                .get(name)
                .unwrap_or_else(|| panic!("no map {name}"));
            match map {
                aya_obj::Map::Legacy(_) => {
                    assert_eq!(
                        map.pinning(),
                        PinningType::ByName,
                        "{name} is not pinned by name"
                    );
                }
                aya_obj::Map::Btf(_) => assert_eq!(name, abi::maps::SOCK_VIP, "{name}"),
            }
        }
    }

    /// The sized maps declare the sizes `kernel_maps` defaults to, which the docs give.
    #[test]
    fn the_sized_maps_declare_the_kernel_maps_defaults() {
        let obj = object();
        let sizes = proxy_core::config::MapSizes::default();
        for (name, entries) in [
            (abi::maps::SERVICES, sizes.services),
            (abi::maps::SVC_COUNTERS, sizes.services),
            (abi::maps::SLOTS, sizes.slot_tables),
            (abi::maps::BACKENDS, sizes.backends),
        ] {
            assert_eq!(obj.maps[name].max_entries(), entries, "{name}");
        }
    }

    /// The reader of `HOST_CX_V1` bounds its pass by the size the kernel programs declare, and
    /// the map is per CPU and LRU (the reader sums CPUs; hosts that come and go never fill it).
    #[test]
    fn the_host_connects_map_is_a_bounded_lru_per_cpu_hash() {
        let map = &object().maps[abi::maps::HOST_CX];
        assert_eq!(map.max_entries(), proxy_common::socket::HOST_CX_ENTRIES);
        let lru_per_cpu = aya_obj::generated::bpf_map_type::BPF_MAP_TYPE_LRU_PERCPU_HASH as u32;
        assert_eq!(map.map_type(), lru_per_cpu);
    }

    /// aya-log's ring buffer is not pinned: each daemon reads only its own programs' records,
    /// and a stopped daemon's buffer goes with its programs.
    #[test]
    fn the_log_buffer_is_an_unpinned_ring_buffer() {
        let obj = object();
        let map = &obj.maps[abi::maps::LOGS];
        let ringbuf = aya_obj::generated::bpf_map_type::BPF_MAP_TYPE_RINGBUF as u32;
        assert_eq!(map.map_type(), ringbuf);
        assert_eq!(map.pinning(), PinningType::None);
    }

    /// The sk_msg and stream verdict programs go on sockhashes, the maps the loader attaches
    /// them to and the pair splicer fills.
    #[test]
    fn the_sockhashes_are_sockhashes() {
        let sockhash = aya_obj::generated::bpf_map_type::BPF_MAP_TYPE_SOCKHASH as u32;
        let obj = object();
        for name in [
            abi::maps::SPLICE,
            abi::maps::PAIR_SOCKS,
            abi::maps::PAIR_PEER,
        ] {
            assert_eq!(obj.maps[name].map_type(), sockhash, "{name}");
        }
    }
}
