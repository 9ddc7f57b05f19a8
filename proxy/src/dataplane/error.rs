//! Errors of the kernel side, each naming the object and the likely cause.

use std::path::PathBuf;

/// What went wrong while loading, attaching, publishing or cleaning up.
#[derive(Debug, thiserror::Error)]
pub enum DataplaneError {
    /// Host ending failed or is unavailable (`reaper`).
    #[error("ending sockets of hosts that left: {why}")]
    NoHostEnding { why: String },
    /// No cgroup v2 hierarchy is mounted.
    #[error(
        "no cgroup v2 filesystem in /proc/mounts; mount one (mount -t cgroup2 none /sys/fs/cgroup) or give an absolute cgroup path"
    )]
    NoCgroup2,
    /// An absolute cgroup path outside every cgroup v2 mount.
    #[error(
        "cgroup {} is not in a cgroup v2 hierarchy (cgroup2 is mounted at: {mounts}); give a path under it, or a relative one",
        path.display()
    )]
    NotCgroup2 {
        /// The configured path.
        path: PathBuf,
        /// The cgroup v2 mount points.
        mounts: String,
    },
    /// Another daemon holds the instance.
    #[error(
        "instance {instance:?} is in use by another running daemon (it holds the lock on {}); stop it, or give this one another `instance`",
        path.display()
    )]
    InstanceBusy {
        /// The instance name.
        instance: String,
        /// Its pin directory.
        path: PathBuf,
    },
    /// The configured cgroup is a cgroup v2 root: every process of the host is in it.
    #[error(
        "cgroup {} is the root of a cgroup v2 hierarchy, which holds every process of the host; give a cgroup below it",
        path.display()
    )]
    CgroupRoot {
        /// The configured path.
        path: PathBuf,
    },
    /// The configured bpffs path is an ordinary directory with something in it: mounting bpffs
    /// there would hide what it holds.
    #[error(
        "bpffs {} is a directory with files in it, not a BPF filesystem; give an empty directory or a bpffs mount (for example /sys/fs/bpf)",
        path.display()
    )]
    NotBpffs {
        /// The configured path.
        path: PathBuf,
    },
    /// A filesystem operation on a cgroup, a pin or bpffs failed.
    #[error("{what} {}: {source}", path.display())]
    Io {
        /// What was being done, e.g. "creating the cgroup".
        what: &'static str,
        /// On which path.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The object could not be loaded (maps created, or pinned maps reused).
    #[error("loading the eBPF object failed (is this root, with a kernel that has BPF and BTF?)")]
    Load(#[source] aya::EbpfError),
    /// The reader of the programs' log records could not be set up (`kernel_log` is not off).
    #[error(
        "reading the kernel's log records (kernel_log) failed: {0}; set kernel_log: off to run without them"
    )]
    KernelLog(#[source] aya_log::Error),
    /// A program is missing from the object, or could not be loaded or attached.
    #[error("program {name}: {source}")]
    Program {
        /// The program.
        name: &'static str,
        /// Why.
        #[source]
        source: aya::programs::ProgramError,
    },
    /// The kernel attached the program without a bpf_link (before 5.7), which cannot be pinned.
    #[error(
        "program {name}: the kernel has no bpf_link for cgroup programs (needs 5.7); the data path could not survive a restart, so it is not attached"
    )]
    NoBpfLink {
        /// The program.
        name: &'static str,
    },
    /// A link could not be pinned (bpf_link needs kernel 5.7; pinning needs bpffs).
    #[error("pinning the link of {name} at {}: {source}", path.display())]
    PinLink {
        /// The program.
        name: &'static str,
        /// Where.
        path: PathBuf,
        /// Why.
        #[source]
        source: aya::pin::PinError,
    },
    /// A program could not be pinned (the sk_msg program is pinned next to its sockhash).
    #[error("pinning program {name} at {}: {source}", path.display())]
    PinProgram {
        /// The program.
        name: &'static str,
        /// Where.
        path: PathBuf,
        /// Why.
        #[source]
        source: aya::pin::PinError,
    },
    /// A map is missing or has an unexpected type.
    #[error("map {name}: {source}")]
    Map {
        /// The map.
        name: &'static str,
        /// Why.
        #[source]
        source: aya::maps::MapError,
    },
    /// A service's hosts could not be published; the previous generation is still live.
    #[error("publishing service {service}: map {map}: {source} (the previous host set stays live)")]
    Publish {
        /// The service.
        service: String,
        /// The map being written.
        map: &'static str,
        /// Why.
        #[source]
        source: aya::maps::MapError,
    },
    /// Too many failover priorities or hosts for the kernel's tables.
    #[error("service {service}: {message}")]
    Capacity {
        /// The service.
        service: String,
        /// What does not fit.
        message: String,
    },
    /// A map pinned by a previous run has another size than `kernel_maps` asks for.
    #[error(
        "map {name} pinned at {} holds {pinned} entries, the configuration asks for {wanted} (kernel_maps.{field}); sizes are fixed when the maps are created: set kernel_maps.{field} to {pinned}, or stop the daemon, remove the instance with `proxy uninstall` (the data path stops serving) and start again",
        path.display()
    )]
    PinnedSize {
        /// The map.
        name: &'static str,
        /// Its pin.
        path: PathBuf,
        /// Its size.
        pinned: u32,
        /// The configured size.
        wanted: u32,
        /// The `kernel_maps` field that sets it.
        field: &'static str,
    },
    /// The proxy-pair splicing program could not be attached (the rest of the data path works;
    /// `splice: kernel` cannot).
    #[error(
        "proxy-pair splicing is not available: {why} (needs kernel 5.10+ with CONFIG_BPF_STREAM_PARSER; use `splice: copy`)"
    )]
    PairUnavailable {
        /// What failed when the daemon attached it.
        why: String,
    },
    /// Something that needs sockops was asked of a data path opened without it
    /// (`DataplaneOptions::follow_sockets`); nothing was changed.
    #[error("{what} needs the sockops program, which this data path was opened without")]
    NoSockops {
        /// What was asked: a service (proxy mode or passive health), or splicing.
        what: String,
    },
    /// A ROUND_ROBIN service on a kernel whose verifier refused the `_rr` programs (BPF atomic
    /// fetch-and-add needs Linux 5.12); nothing was changed.
    #[error(
        "service {service}: lb_policy ROUND_ROBIN needs BPF atomic fetch-and-add (Linux 5.12), which this kernel refused; use RANDOM or MAGLEV"
    )]
    NoRoundRobin {
        /// The service.
        service: String,
    },
    /// A service whose consistent hashing keys on what this kernel's programs cannot read
    /// (the loader's probe found no such helper); nothing was changed.
    #[error(
        "service {service}: hash_key {key} needs {helper} in cgroup sock_addr programs, which this kernel lacks (Linux {kernel} and later have it); choose hash_key netns, user or socket"
    )]
    NoHashKey {
        /// The service.
        service: String,
        /// The key, as configured.
        key: &'static str,
        /// The helper the programs would call.
        helper: &'static str,
        /// A Linux version from which on every kernel offers it there.
        kernel: &'static str,
    },
}
