//! The discovery plane: where a cluster's hosts come from.
//!
//! Every source sits side by side here and implements [`DiscoverySource`]: [`fixed`] (STATIC),
//! [`dns`] (STRICT_DNS, LOGICAL_DNS and the DNS SRV custom type), [`consul`] (the Consul catalog
//! custom type) and [`xds`] (EDS over xDS v3). Each publishes [`SourceUpdate`]s itself on the
//! watch channel that the cluster's event loop (`crate::upstream`) reads; [`start`] is the one
//! place that maps a cluster's type to its source. Every source reduces to a [`HostSet`](crate::host::HostSet), and
//! [`diff_hosts`] is the one host diff they publish with.

pub mod consul;
pub mod dns;
pub mod fixed;
pub mod source;
pub mod source_stats;
pub mod xds;

use std::{collections::BTreeSet, net::SocketAddr};

pub use self::{
    source::{DiscoverySource, SourceError, SourceUpdate, start},
    source_stats::{SourceStatValues, SourceStats},
};
use crate::host::Host;

/// Hosts of `new` whose address is not in `old`, and hosts of `old` whose address is not in
/// `new`: every source fills [`SourceUpdate::added`] and [`SourceUpdate::removed`] with it. A
/// consumer that may have skipped versions (watch channels keep only the latest) diffs its
/// last-seen hosts against the current ones with this instead.
pub fn diff_hosts(old: &[Host], new: &[Host]) -> (Vec<Host>, Vec<Host>) {
    let old_addrs: BTreeSet<SocketAddr> = old.iter().map(|h| h.addr).collect();
    let new_addrs: BTreeSet<SocketAddr> = new.iter().map(|h| h.addr).collect();
    // Kept as long as the update is: no spare capacity.
    let missing = |hosts: &[Host], from: &BTreeSet<SocketAddr>| -> Vec<Host> {
        let mut out: Vec<Host> = hosts
            .iter()
            .filter(|h| !from.contains(&h.addr))
            .cloned()
            .collect();
        out.shrink_to_fit();
        out
    };
    (missing(new, &old_addrs), missing(old, &new_addrs))
}
