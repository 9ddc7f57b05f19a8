//! The kernel side, seen from the daemon: load the programs, attach them to the cgroup, pin maps
//! and links under `<bpffs>/<instance>/`, publish host sets, read counters, clean up.
//!
//! Pinning makes the data path outlive the daemon: after a crash or `kill -9`, connections to
//! services keep working on the last published state, and the next daemon adopts the pins
//! (maps are reused as they are; links are replaced without a gap). A graceful stop removes
//! everything this daemon created.

mod error;
mod loader;
mod mounts;
mod pair;
mod publish;
mod runtime;

pub use self::{
    error::DataplaneError,
    loader::{Dataplane, DataplaneOptions, PAIR_PROGRAM, PROGRAMS, SPLICE_PROGRAM},
    mounts::{cgroup2_mount, resolve_cgroup},
    pair::{PAIR_CREDIT, PairError, PairGuard, PairSide, PairSplicer},
    publish::{PublishOutcome, Publisher, ServiceSpec, backend_of, service_key as publish_key},
    runtime::{OriginalDestinations, PassiveReport, RuntimeMaps},
};

/// The kernel programs, built by `build.rs` from the `proxy-ebpf` crate.
pub static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/proxy"));
