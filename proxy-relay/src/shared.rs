//! The state every connection shares ([`Shared`]: config, stats, services, the original
//! destination source and the splicer), built once by `serve`.

use std::{net::SocketAddr, sync::Arc, time::Duration};

use proxy_core::config::proxy::ProxyConfig;

use crate::{
    addr::canonical,
    cluster::{ClusterHandle, DrainPolicy},
    conn::Actions,
    orig_dst::{OriginalDst, OriginalDstCluster},
    service::ServiceTable,
    splice::Splicer,
    stats::ProxyStats,
};

/// State every connection task shares.
pub(crate) struct Shared {
    pub(crate) config: ProxyConfig,
    pub(crate) stats: Arc<ProxyStats>,
    pub(crate) original_dst: Arc<dyn OriginalDst>,
    pub(crate) services: ServiceTable,
    /// The services as the tokio path looks them up.
    pub(crate) actions: Actions<ClusterHandle>,
    pub(crate) splicer: Option<Arc<dyn Splicer>>,
    pub(crate) orig_dst_cluster: Arc<OriginalDstCluster>,
    /// The bound listener addresses: a destination equal to one of them would loop.
    pub(crate) listeners: Vec<SocketAddr>,
}

impl Shared {
    pub(crate) fn drain_policy(&self) -> DrainPolicy {
        DrainPolicy {
            drain_timeout: self.config.drain_timeout,
            close_on_health_failure: self.config.close_connections_on_host_health_failure,
        }
    }

    /// How long a connect to a host of `cluster` may take (ORIGINAL_DST: `None`): the cluster's
    /// own `connect_timeout`, else the proxy's.
    pub(crate) fn connect_timeout(&self, cluster: Option<&ClusterHandle>) -> Duration {
        match cluster {
            Some(c) => c.connect_timeout(self.config.connect_timeout),
            None => self
                .config
                .original_dst_connect_timeout
                .unwrap_or(self.config.connect_timeout),
        }
    }

    /// Whether `dst` is the proxy itself (a connection to it would loop).
    pub(crate) fn is_self(&self, dst: SocketAddr) -> bool {
        let dst = canonical(dst);
        self.listeners
            .iter()
            .any(|l| l.port() == dst.port() && (l.ip() == dst.ip() || l.ip().is_unspecified()))
    }
}
