//! EDS clusters: checking their xDS configuration (so `proxy check` catches it, with
//! file:line:column) and starting the xDS clients that feed their hosts.
//!
//! The configuration keeps the `xds` section and each cluster's `eds_cluster_config` in Envoy's
//! shapes; they are parsed here into `proxy_core::discovery::xds` types.

use std::{collections::BTreeMap, net::SocketAddr, path::Path, sync::Arc};

use proxy_core::{
    config::{ClusterType, Config, ConfigError, locate::Locator},
    discovery::xds::{EdsClient, EdsClusterConfig, XdsConfig},
    upstream::{FeedStats, FeedUpdate},
};
use serde::de::DeserializeOwned;
use tokio::sync::watch;

/// Parses `value` as `T`, reporting the failing field at its place in the file.
fn parse<T: DeserializeOwned>(
    value: &serde_json::Value,
    at: &str,
    file: &Path,
    text: &str,
) -> Result<T, ConfigError> {
    serde_path_to_error::deserialize(value).map_err(|err| {
        let inner = err.path().to_string();
        let field = if inner == "." {
            at.to_owned()
        } else {
            format!("{at}.{inner}")
        };
        invalid(file, text, field, err.into_inner().to_string())
    })
}

fn invalid(file: &Path, text: &str, field: String, message: String) -> ConfigError {
    ConfigError::Invalid {
        file: file.to_owned(),
        at: Locator::new(text).find(&field).unwrap_or_default(),
        field,
        message,
    }
}

/// The xDS settings and every EDS cluster's config, parsed.
struct Parsed {
    xds: Option<XdsConfig>,
    clusters: Vec<(String, EdsClusterConfig)>,
}

fn parse_all(config: &Config, file: &Path, text: &str) -> Result<Parsed, ConfigError> {
    let xds = match &config.xds {
        Some(v) => Some(parse::<XdsConfig>(v, "xds", file, text)?),
        None => None,
    };
    let mut clusters = Vec::new();
    for (i, c) in config.clusters.iter().enumerate() {
        if c.cluster_type != ClusterType::Eds {
            continue;
        }
        let value = c
            .eds_cluster_config
            .as_ref()
            .unwrap_or(&serde_json::Value::Null);
        let at = format!("clusters[{i}].eds_cluster_config");
        clusters.push((
            c.name.clone(),
            parse::<EdsClusterConfig>(value, &at, file, text)?,
        ));
    }
    Ok(Parsed { xds, clusters })
}

/// The address of a STATIC cluster's first host: how `envoy_grpc: {cluster_name}` and REST
/// cluster names reach their server.
fn resolver(config: &Config) -> impl Fn(&str) -> Option<SocketAddr> + '_ {
    |name| {
        config
            .cluster(name)
            .and_then(|c| c.static_hosts().first().map(|h| h.addr))
    }
}

/// Checks the xDS parts of a parsed config: types, and that every EDS cluster has a source.
pub fn validate(config: &Config, file: &Path, text: &str) -> Result<(), ConfigError> {
    let parsed = parse_all(config, file, text)?;
    if parsed.clusters.is_empty() {
        return Ok(());
    }
    let Some(xds) = &parsed.xds else {
        return Err(invalid(
            file,
            text,
            "xds".to_owned(),
            "EDS clusters need an `xds` section with the node identity".to_owned(),
        ));
    };
    proxy_core::discovery::xds::plan(xds, &parsed.clusters, &resolver(config))
        .map(|_| ())
        .map_err(|e| invalid(file, text, "xds".to_owned(), e.to_string()))
}

/// Running xDS clients and one host feed per EDS cluster.
pub struct EdsFeeds {
    /// The clients (dropping one stops its stream).
    clients: Vec<Arc<EdsClient>>,
    /// Hosts per cluster, with the stats of its client.
    pub feeds: BTreeMap<String, (watch::Receiver<FeedUpdate>, FeedStats)>,
}

impl EdsFeeds {
    /// How many xDS connections run.
    pub fn connections(&self) -> usize {
        self.clients.len()
    }
}

/// Starts the xDS clients of a validated config. Must run inside a tokio runtime.
pub fn start(config: &Config) -> anyhow::Result<EdsFeeds> {
    let parsed = parse_all(config, Path::new("<config>"), "")?;
    let mut out = EdsFeeds {
        clients: Vec::new(),
        feeds: BTreeMap::new(),
    };
    let Some(xds) = parsed.xds else {
        return Ok(out);
    };
    if parsed.clusters.is_empty() {
        return Ok(out);
    }
    for (source, watches) in
        proxy_core::discovery::xds::plan(&xds, &parsed.clusters, &resolver(config))?
    {
        let names: Vec<String> = watches.iter().map(|w| w.cluster.clone()).collect();
        let client = Arc::new(proxy_core::discovery::xds::spawn_eds(source, watches)?);
        for name in names {
            let Some(mut updates) = client.updates(&name) else {
                continue;
            };
            let first = updates.borrow_and_update().clone();
            let feed = |u: proxy_core::discovery::xds::EdsUpdate| FeedUpdate {
                version: u.version,
                initialized: u.initialized,
                hosts: u.hosts,
            };
            let (tx, rx) = watch::channel(feed(first));
            tokio::spawn(async move {
                while updates.changed().await.is_ok() {
                    tx.send_replace(feed(updates.borrow_and_update().clone()));
                }
            });
            let (stats_client, prefix) = (client.clone(), format!("cluster.{name}."));
            let stats: FeedStats = Arc::new(move || {
                stats_client
                    .named_stats()
                    .into_iter()
                    .filter(|(k, _)| k.starts_with(&prefix))
                    .collect()
            });
            out.feeds.insert(name, (rx, stats));
        }
        out.clients.push(client);
    }
    Ok(out)
}
