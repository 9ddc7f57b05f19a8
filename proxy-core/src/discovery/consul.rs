//! Consul catalog discovery: a custom cluster type whose hosts are the instances of one Consul
//! service, with Consul's health and weights, kept current with blocking queries.
//!
//! Wiring: deserialize and validate a [`ConsulConfig`], then call [`spawn_consul`] inside a
//! tokio runtime. The returned [`ConsulCluster`] owns one watch task (aborted when it is
//! dropped) and is a [`DiscoverySource`]: it publishes [`SourceUpdate`]s on a watch channel and
//! exposes Envoy-named stats. Queries never happen on the connect path.
//!
//! ```no_run
//! # async fn wire() -> Result<(), Box<dyn std::error::Error>> {
//! use proxy_core::{
//!     config::sources::consul::ConsulConfig,
//!     discovery::{consul::spawn_consul, source::DiscoverySource as _},
//! };
//!
//! let config: ConsulConfig = serde_norway::from_str("service: web\ndatacenter: dc1")?;
//! let cluster = spawn_consul("web", config)?;
//! let mut updates = cluster.updates();
//! while updates.changed().await.is_ok() {
//!     let update = updates.borrow_and_update().clone();
//!     // Feed update.hosts (weights, eds_health, metadata) to the cluster's health state.
//! }
//! # Ok(())
//! # }
//! ```
//!
//! Behaviour:
//! * every query counts `update_attempt`, then `update_success` or `update_failure`; a success
//!   whose host set is unchanged counts `update_no_rebuild` and publishes nothing;
//! * instances are not filtered by health (`passing` is never sent): each becomes a host whose
//!   [`EdsHealth`](crate::host::EdsHealth) and weight come from its checks and `Weights`
//!   exactly as Consul computes them for Envoy (see [`catalog`]);
//! * a failure (connection, timeout, non-200, bad body) keeps the hosts and retries after a
//!   jittered exponential backoff (`retry_backoff`), reset by the next success; when another
//!   watch on the same agent succeeds after failing (the agent is back), a watch still waiting
//!   retries within `base_interval` instead (see [`recovery`]);
//! * the blocking-query index rules are Consul's documented ones (see [`next_index`]);
//! * the agent's address and ACL token come from the config, else the `CONSUL_HTTP_*`
//!   variables, as Consul's CLI reads them (see [`access`]); the token is sent as
//!   `X-Consul-Token` and never shown;
//! * an empty answer is checked against Consul's ACLs before it applies, so a missing or wrong
//!   token keeps the hosts and counts `consul.acl_denied` (see [`acl`]);
//! * initialized after the first query finished, success or failure (a Consul agent that is
//!   down at start gives an initialized, empty cluster, as a failed first DNS resolution does).

pub mod acl;
pub mod catalog;
pub mod entries;
pub mod http;
mod recovery;
mod stats;
#[cfg(test)]
mod tests;
mod watch;

use std::sync::Arc;

use tokio::{sync::watch as channel, task::AbortHandle};

use self::watch::{CatalogFetch, HttpFetch, Watch};
pub use self::{
    acl::AclDenial,
    stats::{ConsulStatValues, ConsulStats},
    watch::{QueryError, next_index, query_target},
};
use super::source::{DiscoverySource, SourceUpdate};
use crate::config::sources::consul::{
    ConsulConfig, ConsulConfigError,
    access::{self, Access},
};

/// A running Consul cluster. Dropping it stops its watch.
pub struct ConsulCluster {
    name: String,
    config: ConsulConfig,
    updates: channel::Receiver<SourceUpdate>,
    stats: Arc<ConsulStats>,
    task: AbortHandle,
}

impl ConsulCluster {
    /// The configuration it runs with.
    pub fn config(&self) -> &ConsulConfig {
        &self.config
    }

    /// The latest published state.
    pub fn current(&self) -> SourceUpdate {
        self.updates.borrow().clone()
    }

    /// Waits until the first query has finished.
    pub async fn initialized(&self) {
        let mut updates = self.updates.clone();
        // The sender lives in the watch task; it is only dropped when the task is aborted.
        let _ = updates.wait_for(|update| update.initialized).await;
    }

    /// Counters and gauges.
    pub fn stats(&self) -> &Arc<ConsulStats> {
        &self.stats
    }
}

impl DiscoverySource for ConsulCluster {
    fn cluster_name(&self) -> &str {
        &self.name
    }

    fn updates(&self) -> channel::Receiver<SourceUpdate> {
        self.updates.clone()
    }

    fn named_stats(&self) -> Vec<(String, u64)> {
        self.stats.named(&self.name)
    }
}

impl Drop for ConsulCluster {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Validates `config`, resolves it against this process's `CONSUL_HTTP_*` variables, and
/// starts watching the catalog for cluster `name`. Must be called within a tokio runtime.
pub fn spawn_consul(
    name: impl Into<String>,
    config: ConsulConfig,
) -> Result<ConsulCluster, ConsulConfigError> {
    config.validate_fields()?;
    let access = access::resolve(&config, &|name| std::env::var(name).ok())?;
    let fetch = Arc::new(HttpFetch::new(access.authority.clone(), access.tls.clone()));
    spawn_with(name.into(), config, access, fetch, fastrand::Rng::new())
}

fn spawn_with(
    name: String,
    config: ConsulConfig,
    access: Access,
    fetch: Arc<dyn CatalogFetch>,
    rng: fastrand::Rng,
) -> Result<ConsulCluster, ConsulConfigError> {
    config.validate_fields()?;
    let (tx, updates) = channel::channel(SourceUpdate::default());
    let stats = Arc::new(ConsulStats::default());
    let watch = Watch {
        name: name.clone(),
        config: config.clone(),
        fetch,
        token: access.token,
        updates: tx,
        stats: stats.clone(),
        rng,
        denied: None,
    };
    let task = tokio::spawn(watch.run()).abort_handle();
    Ok(ConsulCluster {
        name,
        config,
        updates,
        stats,
        task,
    })
}
