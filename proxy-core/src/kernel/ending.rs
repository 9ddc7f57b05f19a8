//! Host ending on the kernel path: which hosts' connections a service's publish ends, for a
//! service whose clusters enable `close_connections_on_host_health_failure`
//! (`SERVICE_F_END`). A host that leaves the service's routable set while a cluster that
//! enables it still has the host (it failed active health checking, or outlier detection
//! ejected it) is ended at once, as Envoy resets its connections; one that discovery removed is
//! ended after `proxy.drain_timeout`, as the proxy path closes its connections to a removed
//! host, unless it is routable again by then.

use std::{collections::BTreeSet, net::SocketAddr};

use super::{ServiceSpec, ServiceTemplate};
use crate::health::Routing;

/// The hosts a publish ends.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Leavers {
    /// Failed or ejected, still discovered: ended now.
    pub now: Vec<SocketAddr>,
    /// Removed by discovery: ended after the drain deadline if not routable again.
    pub later: Vec<SocketAddr>,
}

/// Every host a spec routes to.
pub fn routable(spec: &ServiceSpec) -> BTreeSet<SocketAddr> {
    spec.priorities
        .iter()
        .flatten()
        .map(|(addr, _)| *addr)
        .collect()
}

impl ServiceTemplate {
    /// Whether the service ends its hosts' connections (`SERVICE_F_END`).
    pub fn ends_hosts(&self) -> bool {
        !self.end_clusters.is_empty()
    }

    /// The hosts `before` routed to that `after` does not, split by why they left (see the
    /// module); only hosts that a cluster enabling the option had in `before_clusters`, and
    /// never the address the kernel refuses. `after_clusters` is the routing `after` was made
    /// from.
    pub fn leavers(
        &self,
        before: &ServiceSpec,
        after: &ServiceSpec,
        before_clusters: &[(&str, &Routing)],
        after_clusters: &[(&str, &Routing)],
    ) -> Leavers {
        let had = |clusters: &[(&str, &Routing)], addr: &SocketAddr| {
            clusters
                .iter()
                .filter(|(name, _)| self.end_clusters.iter().any(|c| c == name))
                .flat_map(|(_, routing)| &routing.priorities)
                .flat_map(|p| &p.all)
                .any(|host| host.addr == *addr)
        };
        let still = routable(after);
        let mut out = Leavers::default();
        for addr in routable(before) {
            if still.contains(&addr) || addr == self.refuse || !had(before_clusters, &addr) {
                continue;
            }
            if had(after_clusters, &addr) {
                out.now.push(addr);
            } else {
                out.later.push(addr);
            }
        }
        out
    }
}
