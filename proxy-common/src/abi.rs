//! The names of the kernel ABI: every map, program and pin of an instance, declared once.
//!
//! The daemon, the integration tests and any other userspace code name maps, programs and pins
//! only through these constants. The kernel side cannot: aya-ebpf's `#[map]` names a map after
//! its static's identifier, so `proxy-ebpf`'s `maps.rs` spells the same names as identifiers
//! (`SERVICES_V2`). The `proxy` crate's test `the_object_declares_exactly_the_abi` parses the
//! built object and fails when the two sides disagree (a map or program missing on either side).
//!
//! # Version policy
//!
//! A map's name carries the version of its layout (`_V1`, `_V2`, ...); userspace identifiers do
//! not (`maps::SERVICES` is `"SERVICES_V2"`), so a version bump changes the value here and the
//! static's identifier in `proxy-ebpf`, nothing else.
//!
//! - **When the suffix moves.** Any change a pinned map of the old layout would not survive:
//!   key or value type (size, field order, meaning or byte order of a field), map type, flags,
//!   max entries, or what a key stands for. The map gets the next suffix and the old name goes
//!   to [`RETIRED`]; a map that goes away entirely also leaves its name in [`RETIRED`]. A name is
//!   never reused for another layout. aya reuses a pinned map of the same name as it is, without
//!   comparing definitions, so a layout change under an old name would hand new programs old
//!   bytes.
//! - **Programs and their pins are not versioned.** A program's link is pinned as
//!   `link_<program>` and the sk_msg and stream verdict programs as `prog_<program>`: a new
//!   daemon attaches its program next to the old one and then replaces the pin, which is the
//!   hand-over without a gap. A program that is renamed or removed leaves its pin names in
//!   [`RETIRED`].
//! - **What a new daemon does with the pins under `<bpffs>/<instance>/`** ([`classify`]):
//!   [`PinKind::Current`] pins are adopted (maps reused with their entries; links and program
//!   pins replaced). [`PinKind::Retired`] pins are left in place while the new programs are
//!   attached and the first publish runs, so that a daemon that dies before that can be rolled
//!   back to the old version with its state intact; once every service was published they are
//!   unpinned (an old map whose pin was its last reference is freed then; old links are gone
//!   already, replaced by the new ones). [`PinKind::Unknown`] pins (a newer version's, or not
//!   ours) are never removed, only logged: a graceful stop removes current and retired pins and
//!   leaves the directory when anything else is in it.
//! - **Carrying state over.** Between the attach of new programs and the first publish, a new
//!   map starts empty. For the service maps the daemon closes that window: the previous
//!   layout's entries (`service::legacy`) are copied into the empty current maps before any
//!   program is attached (`proxy/src/dataplane/migrate.rs`). A future layout change of the
//!   service maps needs its own step there; counters and per-socket maps start empty.

/// Longest map or program name the kernel keeps (`BPF_OBJ_NAME_LEN` is 16 with the NUL); aya
/// truncates a longer one silently, and the pin would then not match the declared name.
pub const MAX_NAME_LEN: usize = 15;

/// Map names, as the kernel objects and their pins are called. Layouts are in the modules of
/// this crate (`service`, `socket`, `counters`).
pub mod maps {
    /// Services by (VIP, port, protocol). `_V2`: `Service` gained `backend` (the three service
    /// maps are versioned together).
    pub const SERVICES: &str = "SERVICES_V2";
    /// Slot tables by (service, generation, priority).
    pub const SLOTS: &str = "SLOTS_V2";
    /// Backend addresses by id.
    pub const BACKENDS: &str = "BACKENDS_V2";
    /// The service a followed socket dialled, in socket local storage (a BTF map, pinned by the
    /// loader by path). `_V2`: socket storage instead of a hash by cookie.
    pub const SOCK_VIP: &str = "SOCK_VIP_V2";
    /// The service every other socket dialled, by the low bits of its cookie.
    pub const SOCK_PEER: &str = "SOCK_PEER_V1";
    /// Run-time settings (one entry).
    pub const SETTINGS: &str = "SETTINGS_V1";
    /// Proxy mode: the service a redirected socket dialled, by cookie, until sockops re-keys it.
    pub const SOCK_ORIG: &str = "SOCK_ORIG_V1";
    /// Proxy mode: the service a redirected connection dialled, by the client's 4-tuple.
    pub const ORIG_DST: &str = "ORIG_DST_V1";
    /// Sockhash of established local sockets, for sk_msg splicing.
    pub const SPLICE: &str = "SPLICE_V1";
    /// Unconnected UDP: the service a (socket, backend) pair stands for.
    pub const UDP_REV: &str = "UDP_REV_V1";
    /// Passive health: per-backend connect failures and resets (per CPU).
    pub const PASSIVE: &str = "PASSIVE_V1";
    /// Passive health: per backend, the current run of failures.
    pub const PASSIVE_RUN: &str = "PASSIVE_RUN_V1";
    /// Per-CPU counters, indexed by `crate::counters`. `_V2`: more counters.
    pub const COUNTERS: &str = "COUNTERS_V2";
    /// Per-CPU counters of each service, by `Service::id`.
    pub const SVC_COUNTERS: &str = "SVC_COUNTERS_V3";
    /// Open connections per backend of LEAST_REQUEST services (`socket`).
    pub const ACTIVE: &str = "ACTIVE_V1";
    /// `max_connections` of limited services, by service address (`limit`).
    pub const CX_MAX: &str = "CX_MAX_V1";
    /// Open connections and refused connects of limited services, by service address
    /// (`limit`).
    pub const CX_OPEN: &str = "CX_OPEN_V1";
    /// Drop-overload shares of services, by service address (`drop_overload`).
    pub const DROP: &str = "DROP_V1";
    /// Connects each service's drop overload refused, by service address (`drop_overload`).
    pub const DROPPED: &str = "DROPPED_V1";
    /// Proxy-pair splicing: the sockhash the stream verdict program is attached to.
    pub const PAIR_SOCKS: &str = "PAIR_SOCKS_V1";
    /// Proxy-pair splicing: the socket to send out of, by the receiving socket's cookie. `_V2`:
    /// keyed by cookie instead of 4-tuple.
    pub const PAIR_PEER: &str = "PAIR_PEER_V2";
    /// Proxy-pair splicing: what the program did with each spliced socket's bytes.
    pub const PAIR_FLOW: &str = "PAIR_FLOW_V1";
    /// Proxy-pair splicing: the daemon's credit for each spliced socket.
    pub const PAIR_GRANT: &str = "PAIR_GRANT_V1";
    /// Host ending: the service and backend a socket of a `SERVICE_F_END` service was connected
    /// to, by socket cookie (LRU). `_V2`: the service joined the backend.
    pub const SOCK_HOST: &str = "SOCK_HOST_V2";
    /// Kernel-path connects per chosen backend (per CPU, LRU), for `/clusters`' `cx_total`.
    pub const HOST_CX: &str = "HOST_CX_V1";

    /// aya-log's ring buffer of kernel log records (the name is aya-log-ebpf's). Not pinned and
    /// not in [`ALL`]: each daemon creates its own and reads it only when `kernel_log` is not
    /// `off`; records of a previous daemon's programs that nobody reads go with its buffer.
    pub const LOGS: &str = "AYA_LOGS";

    /// Every map of the object except [`LOGS`]; all of them are pinned under their name.
    pub const ALL: [&str; 25] = [
        ACTIVE,
        CX_MAX,
        CX_OPEN,
        DROP,
        DROPPED,
        SERVICES,
        SLOTS,
        BACKENDS,
        SOCK_VIP,
        SOCK_PEER,
        SETTINGS,
        SOCK_ORIG,
        ORIG_DST,
        SPLICE,
        UDP_REV,
        PASSIVE,
        PASSIVE_RUN,
        COUNTERS,
        SVC_COUNTERS,
        PAIR_SOCKS,
        PAIR_PEER,
        PAIR_FLOW,
        PAIR_GRANT,
        SOCK_HOST,
        HOST_CX,
    ];
}

/// Program names (the entry functions of `proxy-ebpf`).
pub mod programs {
    /// cgroup connect4: service address -> backend (or the proxy listener).
    pub const CONNECT4: &str = "connect4";
    /// cgroup connect6.
    pub const CONNECT6: &str = "connect6";
    /// cgroup getpeername4: backend -> service address.
    pub const GETPEERNAME4: &str = "getpeername4";
    /// cgroup getpeername6.
    pub const GETPEERNAME6: &str = "getpeername6";
    /// cgroup sendmsg4: unconnected UDP to a service.
    pub const SENDMSG4: &str = "sendmsg4";
    /// cgroup sendmsg6.
    pub const SENDMSG6: &str = "sendmsg6";
    /// cgroup recvmsg4: UDP replies shown as from the service.
    pub const RECVMSG4: &str = "recvmsg4";
    /// cgroup recvmsg6.
    pub const RECVMSG6: &str = "recvmsg6";
    /// cgroup sockops: follows proxied and watched connections, fills the splice sockhash.
    pub const SOCKOPS: &str = "proxy_sockops";
    /// sk_msg on [`super::maps::SPLICE`]: splices local socket pairs.
    pub const SPLICE: &str = "splice_msg";
    /// sk_skb stream verdict on [`super::maps::PAIR_SOCKS`]: splices proxied pairs.
    pub const PAIR: &str = "pair_verdict";

    /// [`CONNECT4`] with ROUND_ROBIN's atomic cursor (BPF atomic fetch-and-add, Linux 5.12).
    pub const CONNECT4_RR: &str = "connect4_rr";
    /// [`CONNECT6`] with ROUND_ROBIN's atomic cursor.
    pub const CONNECT6_RR: &str = "connect6_rr";
    /// [`SENDMSG4`] with ROUND_ROBIN's atomic cursor.
    pub const SENDMSG4_RR: &str = "sendmsg4_rr";
    /// [`SENDMSG6`] with ROUND_ROBIN's atomic cursor.
    pub const SENDMSG6_RR: &str = "sendmsg6_rr";

    /// Programs that choose a host, each with its variant for kernels that have BPF atomic
    /// fetch-and-add (which an older verifier refuses even in code it would never run). The
    /// loader attaches the variant where the kernel loads it, and the base program elsewhere;
    /// either is pinned under the base program's link name.
    pub const ROUND_ROBIN_VARIANTS: [(&str, &str); 4] = [
        (CONNECT4, CONNECT4_RR),
        (CONNECT6, CONNECT6_RR),
        (SENDMSG4, SENDMSG4_RR),
        (SENDMSG6, SENDMSG6_RR),
    ];

    /// The variant of `program` for kernels with atomic fetch-and-add, if it has one.
    pub fn round_robin_variant(program: &str) -> Option<&'static str> {
        ROUND_ROBIN_VARIANTS
            .iter()
            .find(|(base, _)| *base == program)
            .map(|(_, variant)| *variant)
    }

    /// The cgroup programs, attached through bpf_link in this order (and detached in reverse).
    pub const CGROUP: [&str; 9] = [
        CONNECT4,
        CONNECT6,
        GETPEERNAME4,
        GETPEERNAME6,
        SENDMSG4,
        SENDMSG6,
        RECVMSG4,
        RECVMSG6,
        SOCKOPS,
    ];

    /// Every program of the object.
    pub const ALL: [&str; 15] = [
        CONNECT4,
        CONNECT6,
        CONNECT4_RR,
        CONNECT6_RR,
        GETPEERNAME4,
        GETPEERNAME6,
        SENDMSG4,
        SENDMSG6,
        SENDMSG4_RR,
        SENDMSG6_RR,
        RECVMSG4,
        RECVMSG6,
        SOCKOPS,
        SPLICE,
        PAIR,
    ];
}

/// What the loader tells the programs about the kernel they run on: a read-only global of the
/// object, set before load. A kernel that lacks a feature then sees the code using it as dead,
/// and its verifier never checks it (an unknown helper in a branch the verifier walks would
/// fail the load).
pub mod features {
    /// The global's symbol in the object: a `u32` of the bits below.
    pub const GLOBAL: &str = "KERNEL_FEATURES";
    /// `bpf_set_retval` in cgroup sock_addr programs (Linux 5.18): a refused connect fails
    /// with `ECONNREFUSED` instead of `EPERM`.
    pub const SET_RETVAL: u32 = 1 << 0;
    /// `bpf_get_current_pid_tgid` in cgroup sock_addr programs (by Linux 5.10): consistent hashing
    /// can key on the client's process (`service::HASH_KEY_PROCESS`).
    pub const CURRENT_PID_TGID: u32 = 1 << 1;
    /// `bpf_get_current_cgroup_id` in cgroup sock_addr programs (Linux 5.7): consistent hashing
    /// can key on the client's cgroup (`service::HASH_KEY_CGROUP`).
    pub const CURRENT_CGROUP_ID: u32 = 1 << 2;
}

/// The level of the kernel's log records (aya-log), a read-only global of the object set by the
/// loader before load, like [`features`]. The programs emit a record only if the level is at
/// least the record's; at [`kernel_log::OFF`] (the object's own value) every record's code is a
/// dead branch the verifier removes before the program runs.
pub mod kernel_log {
    /// The global's symbol in the object: a `u8`, one of the levels below.
    pub const GLOBAL: &str = "KERNEL_LOG_LEVEL";
    /// No records (the default).
    pub const OFF: u8 = 0;
    /// Records of errors: state the daemon published that the kernel cannot use.
    pub const ERROR: u8 = 1;
    /// Also refusals an operator can act on (a service with no host) and failed map updates.
    pub const WARN: u8 = 2;
    /// Also informational records (none yet).
    pub const INFO: u8 = 3;
    /// Everything.
    pub const DEBUG: u8 = 4;
}

/// Pin names under `<bpffs>/<instance>/` besides the maps (which are pinned under their own
/// name, [`maps::ALL`]).
pub mod pins {
    use super::programs;

    /// The bpf_link of each cgroup program, pinned as `link_<program>`, in attach order.
    pub const LINKS: [(&str, &str); 9] = [
        (programs::CONNECT4, "link_connect4"),
        (programs::CONNECT6, "link_connect6"),
        (programs::GETPEERNAME4, "link_getpeername4"),
        (programs::GETPEERNAME6, "link_getpeername6"),
        (programs::SENDMSG4, "link_sendmsg4"),
        (programs::SENDMSG6, "link_sendmsg6"),
        (programs::RECVMSG4, "link_recvmsg4"),
        (programs::RECVMSG6, "link_recvmsg6"),
        (programs::SOCKOPS, "link_proxy_sockops"),
    ];
    /// The link of connect4 (the first program attached, the last detached).
    pub const LINK_CONNECT4: &str = LINKS[0].1;
    /// The link of sockops (present only when the data path follows sockets).
    pub const LINK_SOCKOPS: &str = LINKS[8].1;
    /// The sk_msg program (prog-attached to its sockhash; pinned so it can be inspected and is
    /// removed with the instance).
    pub const PROG_SPLICE: &str = "prog_splice_msg";
    /// The stream verdict program of proxy-pair splicing.
    pub const PROG_PAIR: &str = "prog_pair_verdict";
    /// Not a pin: a symbolic link to the cgroup a run of this instance created, so that the run
    /// that stops cleanly removes it even when the one that created it was killed.
    pub const OWNED_CGROUP: &str = "owned_cgroup";
    /// Not a pin: a symbolic link to the bpffs mount point a run of this instance mounted (it
    /// found none there), so that `proxy uninstall` unmounts it once nothing else is pinned in it.
    pub const OWNED_BPFFS: &str = "owned_bpffs";
}

/// Pin names of earlier versions: maps whose layout moved to a new suffix, and pins of programs
/// that were renamed or removed. A daemon removes them from its instance directory once its own
/// programs are attached and every service was published once (see the version policy above).
pub const RETIRED: [&str; 9] = [
    // `Service` gained `backend`: the three service maps moved to `_V2` together.
    "SERVICES_V1",
    "SLOTS_V1",
    "BACKENDS_V1",
    // More counters.
    "COUNTERS_V1",
    // An LRU hash by socket cookie, replaced by socket local storage.
    "SOCK_VIP_V1",
    // Keyed by 4-tuple, replaced by a sockhash keyed by cookie.
    "PAIR_PEER_V1",
    // `ServiceCounts` gained `panic`, then `passive_failures`.
    "SVC_COUNTERS_V1",
    "SVC_COUNTERS_V2",
    // The backend alone, so one service's failed host ended every service's sockets to it.
    "SOCK_HOST_V1",
];

/// What a file under `<bpffs>/<instance>/` is to this version of the daemon.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PinKind {
    /// A map, link or program pin of this version: adopted (or replaced) at start.
    Current,
    /// A pin of an earlier version ([`RETIRED`]): removed once this version serves.
    Retired,
    /// Not a name this version knows (a newer version's, or not ours): never removed.
    Unknown,
}

/// Classifies one file name found under `<bpffs>/<instance>/`.
pub fn classify(pin: &str) -> PinKind {
    let current = maps::ALL.contains(&pin)
        || pins::LINKS.iter().any(|(_, link)| *link == pin)
        || pin == pins::PROG_SPLICE
        || pin == pins::PROG_PAIR
        || pin == pins::OWNED_CGROUP
        || pin == pins::OWNED_BPFFS;
    if current {
        PinKind::Current
    } else if RETIRED.contains(&pin) {
        PinKind::Retired
    } else {
        PinKind::Unknown
    }
}

/// Whether every name fits the kernel's object name length.
const fn all_fit(names: &[&str]) -> bool {
    let mut i = 0;
    while i < names.len() {
        if names[i].len() > MAX_NAME_LEN {
            return false;
        }
        i += 1;
    }
    true
}

const _: () = assert!(all_fit(&maps::ALL), "a map name is longer than 15 bytes");
const _: () = assert!(
    all_fit(&programs::ALL),
    "a program name is longer than 15 bytes"
);

#[cfg(test)]
mod tests {
    extern crate std;

    use std::{collections::BTreeSet, format, vec::Vec};

    use super::*;

    #[test]
    fn names_are_unique() {
        let maps: BTreeSet<_> = maps::ALL.iter().collect();
        assert_eq!(maps.len(), maps::ALL.len());
        let programs: BTreeSet<_> = programs::ALL.iter().collect();
        assert_eq!(programs.len(), programs::ALL.len());
        let retired: BTreeSet<_> = RETIRED.iter().collect();
        assert_eq!(retired.len(), RETIRED.len());
    }

    #[test]
    fn every_map_name_carries_a_version() {
        for name in maps::ALL.iter().chain(&RETIRED) {
            let version = version_of(name).unwrap_or_else(|| panic!("{name} has no _V<n>"));
            assert!(version >= 1, "{name}");
        }
    }

    /// The policy's bookkeeping: a map at `_V<n>` left `_V1` .. `_V<n-1>` in `RETIRED`, so a
    /// version bump that forgets to retire the old name fails here.
    #[test]
    fn older_versions_of_current_maps_are_retired() {
        for name in maps::ALL {
            let version = version_of(name).expect("versioned");
            let base = &name[..name.rfind("_V").expect("versioned")];
            for older in 1..version {
                let old = format!("{base}_V{older}");
                assert!(RETIRED.contains(&old.as_str()), "{old} is not in RETIRED");
            }
        }
    }

    #[test]
    fn cgroup_programs_are_linked_under_their_name() {
        assert_eq!(
            pins::LINKS.iter().map(|(p, _)| *p).collect::<Vec<_>>(),
            programs::CGROUP
        );
        for (program, link) in pins::LINKS {
            assert_eq!(link, format!("link_{program}"));
        }
        assert_eq!(pins::PROG_SPLICE, format!("prog_{}", programs::SPLICE));
        assert_eq!(pins::PROG_PAIR, format!("prog_{}", programs::PAIR));
    }

    #[test]
    fn pins_are_current_retired_or_unknown() {
        assert_eq!(classify("SERVICES_V2"), PinKind::Current);
        assert_eq!(classify("SOCK_VIP_V2"), PinKind::Current);
        assert_eq!(classify("link_connect4"), PinKind::Current);
        assert_eq!(classify("link_proxy_sockops"), PinKind::Current);
        assert_eq!(classify("prog_splice_msg"), PinKind::Current);
        assert_eq!(classify("prog_pair_verdict"), PinKind::Current);
        for old in [
            "SERVICES_V1",
            "SLOTS_V1",
            "BACKENDS_V1",
            "COUNTERS_V1",
            "SOCK_VIP_V1",
            "PAIR_PEER_V1",
        ] {
            assert_eq!(classify(old), PinKind::Retired, "{old}");
        }
        // A newer version's map, another tool's pin, near misses of our names: left alone.
        for other in [
            "SERVICES_V3",
            "SERVICES",
            "services_v1",
            "link_connect4.bak",
            "prog_other",
            "cilium_lb4_services_v2",
            "",
        ] {
            assert_eq!(classify(other), PinKind::Unknown, "{other:?}");
        }
    }

    #[test]
    fn no_current_pin_is_retired() {
        for name in maps::ALL {
            assert_eq!(classify(name), PinKind::Current, "{name}");
        }
        for name in RETIRED {
            assert!(!maps::ALL.contains(&name), "{name} is current and retired");
        }
    }

    #[test]
    fn the_length_check_rejects_a_long_name() {
        assert!(all_fit(&["SERVICES_V2", "PASSIVE_RUN_V1"]));
        assert!(!all_fit(&["A_NAME_OF_16_BYT"]));
    }

    /// `n` of a `NAME_V<n>`.
    fn version_of(name: &str) -> Option<u32> {
        name.rsplit_once("_V")?.1.parse().ok()
    }
}
