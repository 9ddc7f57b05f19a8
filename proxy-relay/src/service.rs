//! What the proxy does with each original destination: the [`Service`] by the address clients
//! dial, in a [`ServiceTable`] with an optional fallback.

use std::{collections::HashMap, net::SocketAddr, sync::Arc};

use crate::{addr::canonical, cluster::ClusterHandle, route::RouteTable};

/// What the proxy does with connections to one original destination.
#[derive(Clone)]
pub enum Service {
    /// ORIGINAL_DST: connect to the destination itself. With `http`, requests are proxied one
    /// by one over pooled connections (and `x-envoy-original-dst-host` applies when enabled).
    OriginalDst {
        /// Treat the traffic as HTTP/1.1 or HTTP/2 cleartext.
        http: bool,
    },
    /// TCP to a host of the cluster, drained when the host is removed.
    Tcp(ClusterHandle),
    /// HTTP routed by a compiled service-router chain.
    Http(Arc<RouteTable>),
}

/// Services by the address clients dial (VIP:port), and what to do with other destinations.
#[derive(Clone, Default)]
pub struct ServiceTable {
    pub(crate) by_addr: HashMap<SocketAddr, Service>,
    pub(crate) fallback: Option<Service>,
}

impl ServiceTable {
    /// No services; connections to unknown destinations are refused.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) the service at `addr`.
    pub fn insert(&mut self, addr: SocketAddr, service: Service) -> &mut Self {
        self.by_addr.insert(canonical(addr), service);
        self
    }

    /// What destinations without a service get (typically `OriginalDst` for iptables users);
    /// without one they are refused and counted `downstream_cx_no_route`.
    pub fn set_fallback(&mut self, service: Service) -> &mut Self {
        self.fallback = Some(service);
        self
    }

    /// Every cluster the services use (for pool sweeps).
    pub(crate) fn clusters(&self) -> Vec<ClusterHandle> {
        let services = self.by_addr.values().chain(self.fallback.as_ref());
        services
            .flat_map(|s| match s {
                Service::Tcp(c) => vec![c.clone()],
                Service::Http(t) => t.clusters(),
                Service::OriginalDst { .. } => vec![],
            })
            .collect()
    }
}
