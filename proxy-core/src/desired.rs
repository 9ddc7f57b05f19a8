//! The desired state: what the daemon should run, from every source at once.
//!
//! The configuration file is one source. Dynamic sources (an xDS server's listeners, routes and
//! clusters over ADS; Consul's config entries) each publish an [`Overlay`]: the clusters,
//! services and config entries they hold now, as a whole (state of the world, never a delta).
//! The daemon composes the file and the latest overlay of every source into one [`Config`]
//! and applies it through the same plan-and-apply path a reload takes.
//!
//! A source publishes on its [`Feed`] only what it has checked (a bad resource is refused at the
//! source, and its last good state stays in the overlay). Composition refuses a name that two
//! sources both define: nothing overrides silently.

use std::sync::Arc;

use crate::config::{Cluster, Service};

/// What one dynamic source contributes: every resource it holds now.
#[derive(Clone, Debug, Default)]
pub struct Overlay {
    /// Clusters, in the file's form (Envoy v3 `Cluster` field names). Shared: the source, its
    /// feed and the daemon hold one copy.
    pub clusters: Arc<Vec<Cluster>>,
    /// Services: a VIP and port served by a cluster or a chain. Shared as the clusters are.
    pub services: Arc<Vec<Service>>,
    /// Consul config entries (service-router, -splitter, -resolver, service-defaults,
    /// proxy-defaults) that chains compile from.
    pub config_entries: Vec<proxy_chain::ConfigEntry>,
}

impl Overlay {
    /// Whether the source contributes nothing.
    pub fn is_empty(&self) -> bool {
        self.clusters.is_empty() && self.services.is_empty() && self.config_entries.is_empty()
    }
}

/// Where a source publishes its overlay. The daemon holds the receiving end and recomposes on
/// every change.
///
/// A source publishes its first overlay once every kind of resource it subscribes to has
/// answered once (Envoy's initialization: clusters, then listeners), never a partial first
/// state: a start waits for the first overlay of each source in [`expected`] (bounded by
/// [`INITIAL_FETCH_TIMEOUT`]) before it removes what the previous run published and reports
/// ready, so a restart keeps serving the services a source holds.
pub type Feed = tokio::sync::watch::Sender<Overlay>;

/// How long a start waits for a source's first overlay: Envoy's default
/// `initial_fetch_timeout`. After it, the daemon runs on what it has and applies the overlay
/// when it comes.
pub const INITIAL_FETCH_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(15);

/// The dynamic sources `config` turns on, whose first overlay a start waits for. Each source
/// that publishes overlays names the setting that turns it on here.
pub fn expected(config: &crate::config::Config) -> Vec<Source> {
    let mut sources = Vec::new();
    // `xds.cds_config` or `xds.lds_config`.
    if config
        .xds
        .as_ref()
        .is_some_and(crate::config::sources::xds::XdsConfig::resources_enabled)
    {
        sources.push(Source::Xds);
    }
    if config.consul_config_entries.is_some() {
        sources.push(Source::ConsulEntries);
    }
    sources
}

/// A source of the desired state, named in errors and in `/config_dump`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Source {
    /// The configuration file (and `--config` reloads of it).
    File,
    /// The xDS server's LDS, RDS and CDS resources.
    Xds,
    /// Consul's config entries, watched live.
    ConsulEntries,
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::File => "the configuration file",
            Self::Xds => "xDS",
            Self::ConsulEntries => "Consul config entries",
        })
    }
}
