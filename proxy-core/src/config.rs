//! The daemon's configuration: one YAML (or JSON) file, strict, validated once.
//!
//! Clusters use Envoy v3 `Cluster` field names; services bind a VIP to a cluster. Every field is
//! documented here, defaults live in [`defaults`], and the types are `Serialize` so
//! `/config_dump` shows the effective configuration. A bad file yields a [`ConfigError`] that
//! names the file, line, column and field; the daemon exits with status 64 and changes nothing.

mod admin;
pub mod circuit_breakers;
mod cluster;
mod compose;
pub mod duration;
mod endpoint_health;
mod entries;
pub use self::compose::ComposeError;
pub mod envoy;
mod error;
pub(crate) mod fields;
mod file;
pub mod host_guard;
pub use self::file::{MAX_FILE, read_config_file};
pub mod kernel_maps;
pub mod locate;
pub mod proxy;
mod service;
pub mod sources;
mod unread;
mod validate;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

pub use self::{
    admin::{Admin, AdminAddress, AdminAddressError, MAX_UNIX_PATH},
    cluster::{
        Address, CONSUL_CLUSTER, Cluster, ClusterType, CustomClusterType, CustomConfig,
        DNS_SRV_CLUSTER, DnsSrvConfig, Endpoint, LbEndpoint, LbPolicy, LoadAssignment,
        LocalityLbEndpoints, Metadata, OriginalDstLbConfig, SocketAddress, SocketProtocol,
    },
    endpoint_health::EndpointHealthCheck,
    error::ConfigError,
    kernel_maps::MapSizes,
    proxy::{ProxyConfig, ProxyProtocolMode, SpliceMode},
    service::{HashKey, Protocol, Service, ServiceMode, UpgradeConfig, default_upgrade_configs},
};

/// The configuration used when `proxy run` is given no `--config`: the demo's STATIC cluster of
/// three weighted hosts on loopback behind a VIP in 127.77.0.0/16.
pub const EMBEDDED_DEFAULT: &str = include_str!("../../examples/demo.yaml");

/// Named default values, all in one place.
pub mod defaults {
    use std::net::SocketAddr;

    /// Instance name: names the pin directory under bpffs.
    pub fn instance() -> String {
        "proxy".to_owned()
    }
    /// The cgroup the programs attach to, relative to the cgroup v2 mount.
    pub fn cgroup() -> String {
        "proxy".to_owned()
    }
    /// Where bpffs is (mounted there when missing).
    pub fn bpffs() -> String {
        "/sys/fs/bpf".to_owned()
    }
    /// Admin HTTP listener: loopback only.
    pub fn admin_address() -> super::AdminAddress {
        super::AdminAddress::Tcp(SocketAddr::from(([127, 0, 0, 1], 15000)))
    }
    /// Load-balancing weight of an endpoint without one (Envoy: 1).
    pub fn weight() -> u32 {
        1
    }
    /// The seccomp filter after attaching: on.
    pub fn seccomp() -> bool {
        true
    }
    /// Datacenter discovery chains compile for.
    pub fn datacenter() -> String {
        "dc1".to_owned()
    }
    /// DNS refresh interval (Envoy: 5000 ms).
    pub fn dns_refresh_rate() -> std::time::Duration {
        std::time::Duration::from_millis(5000)
    }
}

/// The whole configuration file.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Name of this daemon instance. Its maps are pinned under `<bpffs>/<instance>/`, so two
    /// instances on one host need different names. Default `proxy`.
    #[serde(default = "defaults::instance")]
    pub instance: String,
    /// The cgroup v2 whose processes are served: an absolute path, or a path relative to the
    /// cgroup v2 mount (found in /proc/mounts). Created if missing (and then removed by `proxy
    /// uninstall`).
    /// Default `proxy`.
    #[serde(default = "defaults::cgroup")]
    pub cgroup: String,
    /// Mount point of the BPF filesystem; mounted if nothing is mounted there. Default
    /// `/sys/fs/bpf`.
    #[serde(default = "defaults::bpffs")]
    pub bpffs: String,
    /// The admin HTTP interface.
    #[serde(default)]
    pub admin: Admin,
    /// Upstream clusters, in Envoy v3 `Cluster` field names.
    #[serde(default)]
    pub clusters: Vec<Cluster>,
    /// Service addresses (VIP, port, protocol) and the cluster or discovery chain serving each.
    #[serde(default)]
    pub services: Vec<Service>,
    /// The xDS client for EDS clusters, in Envoy's bootstrap shape: `node {id, cluster}` and
    /// `ads_config` (an `api_config_source`: `api_type` GRPC, DELTA_GRPC or REST, `server_uri` or
    /// `grpc_services: [{envoy_grpc: {cluster_name}}]`). Required when a cluster is EDS.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub xds: Option<crate::config::sources::xds::XdsConfig>,
    /// The datacenter this daemon runs in; discovery chains are compiled for it. Default `dc1`.
    #[serde(default = "defaults::datacenter")]
    pub datacenter: String,
    /// Envoy's bootstrap `cluster_manager`: `local_cluster_name`, the cluster of this node's own
    /// service, whose hosts' localities zone-aware routing compares with each upstream's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster_manager: Option<ClusterManager>,
    /// Envoy's bootstrap `node`: its `locality`, where this node runs (zone-aware routing keeps
    /// traffic there). The xDS client's `xds.node.locality`, when also set, must be the same.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<Node>,
    /// Consul config entries, verbatim (`Kind` plus Consul's PascalCase fields):
    /// service-defaults, proxy-defaults, service-resolver, service-splitter, service-router.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub config_entries: Vec<proxy_chain::ConfigEntry>,
    /// Files with more config entries: a JSON array in Consul's API shape, or a YAML list.
    /// Relative paths are taken from the config file's directory.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub config_entry_files: Vec<String>,
    /// Consul's config entries, watched live from a Consul agent (the connection settings of a
    /// `proxy.clusters.consul` cluster: `address`, `token`/`token_file`, `datacenter`, `wait`,
    /// `tls`, `retry_backoff`). An entry named like one of `config_entries` or
    /// `config_entry_files` (same kind and name) is refused, never overridden. Off when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub consul_config_entries: Option<crate::config::sources::consul::entries::ConsulEntriesConfig>,
    /// The proxy path (services with `mode: proxy`): listeners, original destinations,
    /// draining, timeouts. Started only when a service uses it.
    #[serde(default)]
    pub proxy: ProxyConfig,
    /// Splice established local socket pairs of the cgroup (application <-> application, and
    /// application <-> the proxy listener) with sockops + sk_msg, so their bytes skip the TCP/IP
    /// stack. Default false until the benchmarks show it wins (see BENCHMARKS.md).
    #[serde(default)]
    pub splice: bool,
    /// Log records of the kernel programs, on their error paths only (a connect refused because
    /// its service has no routable host, published state the kernel cannot use, a failed map
    /// update), each with the service address and the reason: `off` (default), `error`, `warn`,
    /// `info` or `debug`. Fixed when the daemon loads the programs; at `off` the records' code
    /// is removed by the kernel's verifier and the daemon does not read the log buffer. Records
    /// appear in the daemon's log with the target `kernel`.
    #[serde(default)]
    pub kernel_log: KernelLogLevel,
    /// Entries of the kernel maps that hold services and host sets (`services`, `slot_tables`,
    /// `backends`): a cluster with more hosts than fit, or more services than fit, is refused
    /// (see SECURITY.md, "Limits"). Fixed at start; default the sizes the kernel object
    /// declares.
    #[serde(default)]
    pub kernel_maps: MapSizes,
    /// The user the daemon runs as once its data path is attached: a name (`nobody`),
    /// `name:group`, or `uid[:gid]`; names are looked up in /etc/passwd and /etc/group. It keeps
    /// only the capabilities it needs either way (SECURITY.md, "Privileges"). Unset: it stays
    /// root. `proxy run --user` overrides it. Fixed at start: a reload that changes it is
    /// refused (restart).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// Install a seccomp filter after the data path is attached, allowing only the system calls
    /// the daemon makes; any other call fails with `EPERM` (SECURITY.md, "Privileges"). Default
    /// true; `false` (or `proxy run --no-seccomp`) runs without it. Fixed at start, as `user`.
    #[serde(default = "defaults::seccomp")]
    pub seccomp: bool,
    /// Compiled discovery chains by service name, filled when the file is validated.
    #[serde(skip)]
    pub chains: std::collections::BTreeMap<String, proxy_chain::CompiledDiscoveryChain>,
    /// Chains that Consul's entries left uncompiled in a composition ([`Config::compose`]),
    /// each with its reason: the service runs its previous chain, or is left out. In a file
    /// with `consul_config_entries`, the chains that do not compile from the file's entries
    /// alone (the composition with Consul's compiles them again).
    #[serde(skip)]
    pub chain_failures: Vec<crate::chain::ChainFailure>,
    /// What the chains were compiled from, so that the next composition compiles only the
    /// chains whose entries changed ([`crate::chain::ChainMemo`]).
    #[serde(skip)]
    pub chain_memo: std::sync::Arc<crate::chain::ChainMemo>,
    /// Every config entry of the file (`config_entries` and the entries of
    /// `config_entry_files`), read when the file is validated, so that a composition with the
    /// dynamic sources ([`Config::compose`]) compiles chains without reading the files again.
    #[serde(skip)]
    file_entries: Vec<proxy_chain::ConfigEntry>,
    /// Where each cluster is in `clusters`, built on the first lookup by name.
    #[serde(skip)]
    cluster_index: ClusterIndex,
}

/// Envoy's bootstrap `cluster_manager`, the part used here.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterManager {
    /// The cluster this node's own service belongs to (a cluster of the file).
    pub local_cluster_name: String,
}

/// Envoy's bootstrap `node`, the part used here.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Node {
    /// Where this node runs.
    #[serde(default)]
    pub locality: crate::host::Locality,
}

/// Cluster positions by name for [`Config::cluster`], which every service's set-up asks for
/// its clusters: a scan of `clusters` each time is quadratic in services at 10,000 of them.
/// `clusters` is public, so a position is checked against the name before it is trusted, and a
/// name not found (or found elsewhere) falls back to the scan: a stale index is only slower.
#[derive(Clone, Default)]
struct ClusterIndex(std::sync::OnceLock<std::collections::HashMap<String, usize>>);

impl std::fmt::Debug for ClusterIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterIndex")
    }
}

/// How much the kernel programs log (`kernel_log`), from none to everything.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KernelLogLevel {
    /// No records; the records' code is not even in the programs the kernel runs.
    #[default]
    Off,
    /// Published state the kernel cannot use (a slot naming a missing host).
    Error,
    /// Also refused connects and datagrams, and failed map updates.
    Warn,
    /// Also informational records.
    Info,
    /// Everything.
    Debug,
}

impl KernelLogLevel {
    /// The value of the programs' load-time global (`proxy_common::abi::kernel_log`).
    pub fn abi(self) -> u8 {
        use proxy_common::abi::kernel_log;
        match self {
            Self::Off => kernel_log::OFF,
            Self::Error => kernel_log::ERROR,
            Self::Warn => kernel_log::WARN,
            Self::Info => kernel_log::INFO,
            Self::Debug => kernel_log::DEBUG,
        }
    }
}

impl Config {
    /// Parses and validates a configuration file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = read_config_file(path).map_err(|source| ConfigError::Read {
            file: path.to_owned(),
            source,
        })?;
        Self::parse(&text, path)
    }

    /// Parses and validates configuration text; `file` is only used in error messages.
    pub fn parse(text: &str, file: &Path) -> Result<Self, ConfigError> {
        let deserializer = serde_norway::Deserializer::from_str(text);
        let config: Config = serde_path_to_error::deserialize(deserializer)
            .map_err(|err| ConfigError::from_serde(file, text, err))?;
        Self::checked(config, text, file)
    }

    /// [`Config::parse`] of JSON text, with the same types and rules: what the xDS decoders
    /// build from CDS and LDS resources. JSON is YAML, so `parse` takes it too, but the YAML
    /// parser spent most of a 10,000-cluster CDS response's time.
    pub fn parse_json(text: &str, file: &Path) -> Result<Self, ConfigError> {
        let mut deserializer = serde_json::Deserializer::from_str(text);
        let config: Config = serde_path_to_error::deserialize(&mut deserializer)
            .map_err(|err| ConfigError::from_serde_json(file, text, err))?;
        deserializer.end().map_err(|err| {
            ConfigError::from_parts(file, text, ".".to_owned(), None, &err.to_string())
        })?;
        Self::checked(config, text, file)
    }

    /// The rules a parsed file is held to, its entries gathered and its chains compiled.
    fn checked(mut config: Config, text: &str, file: &Path) -> Result<Self, ConfigError> {
        validate::validate(&mut config).map_err(|invalid| invalid.locate(file, text))?;
        let base = file.parent().unwrap_or(Path::new("."));
        config.file_entries =
            entries::gather_entries(&config, base).map_err(|e| e.locate(file, text))?;
        if config.consul_config_entries.is_some() {
            // Chains read Consul's entries too (a service-defaults that makes one HTTP, say):
            // one that does not compile from the file's alone is not the file's fault. It is
            // listed in `chain_failures`, and the composition with Consul's entries compiles it
            // (until then, the daemon leaves its service out).
            let compiled = crate::chain::compile_each(&config, &config.file_entries, &[]);
            config.chains = compiled.chains;
            config.chain_failures = compiled.failures;
            config.chain_memo = std::sync::Arc::new(compiled.memo);
        } else {
            config.chains = entries::compile_chains(&config, &config.file_entries)
                .map_err(|e| e.locate(file, text))?;
        }
        sources::xds::clusters::validate_xds(&config)
            .map_err(|invalid| invalid.locate(file, text))?;
        Ok(config)
    }

    /// The embedded default configuration (see [`EMBEDDED_DEFAULT`]).
    pub fn embedded_default() -> Self {
        Self::parse(EMBEDDED_DEFAULT, &PathBuf::from("<embedded default>"))
            .expect("the embedded default configuration is valid (unit-tested)")
    }

    /// The cluster named `name`.
    pub fn cluster(&self, name: &str) -> Option<&Cluster> {
        let index = self.cluster_index.0.get_or_init(|| {
            let mut index = std::collections::HashMap::with_capacity(self.clusters.len());
            for (i, c) in self.clusters.iter().enumerate() {
                // The first of a name, as the scan finds it.
                index.entry(c.name.clone()).or_insert(i);
            }
            index
        });
        let indexed = index
            .get(name)
            .and_then(|&i| self.clusters.get(i))
            .filter(|c| c.name == name);
        indexed.or_else(|| self.clusters.iter().find(|c| c.name == name))
    }

    /// The kernel execution plan of a chain service (`None` for a service with a plain cluster, and
    /// for the proxy path, which routes the chain per request).
    pub fn chain_plan(&self, svc: &Service) -> Option<crate::chain::ChainPlan> {
        if svc.mode == ServiceMode::Proxy {
            return None;
        }
        let chain = self.chains.get(&svc.name)?;
        crate::chain::ChainPlan::new(chain, &self.datacenter, svc.chain_options.clone(), |c| {
            self.cluster(c).is_some()
        })
        .ok()
    }

    /// Every cluster a service reads: its cluster, or the clusters of its chain's targets.
    pub fn service_clusters(&self, svc: &Service) -> Vec<String> {
        if let Some(chain) = self.chains.get(&svc.name)
            && svc.mode == ServiceMode::Proxy
        {
            let has = |c: &str| self.cluster(c).is_some();
            return crate::chain::route_clusters(chain, &self.datacenter, &has)
                .map(|c| c.into_iter().collect())
                .unwrap_or_default();
        }
        match self.chain_plan(svc) {
            Some(plan) => plan.clusters().into_iter().collect(),
            None => vec![svc.cluster.clone()],
        }
    }

    /// Whether the cluster named `name` is an ORIGINAL_DST cluster.
    pub fn is_original_dst(&self, name: &str) -> bool {
        self.cluster(name).is_some_and(|c| {
            c.cluster_type == ClusterType::OriginalDst && c.custom_cluster_type.is_none()
        })
    }

    /// Whether the proxy path runs: a service uses it or it has a fallback cluster.
    pub fn uses_proxy(&self) -> bool {
        self.services.iter().any(|s| s.mode == ServiceMode::Proxy)
            || self.proxy.fallback_cluster.is_some()
    }

    /// Whether a daemon of this file runs the proxy path from its start, with an empty table
    /// while nothing uses it yet: a proxy-mode service or `fallback_cluster` of its own (one
    /// may wait for Consul's entries), or LDS (whose HTTP listeners become proxy-mode services).
    /// Starting the proxy path later would need a restart.
    pub fn declares_proxy(&self) -> bool {
        self.uses_proxy() || self.xds.as_ref().is_some_and(|x| x.lds_config.is_some())
    }

    /// The proxy path's settings, with the ORIGINAL_DST ones taken from the ORIGINAL_DST
    /// clusters (validation made them agree).
    pub fn effective_proxy(&self) -> ProxyConfig {
        let mut proxy = self.proxy.clone();
        if let Some(c) = self.clusters.iter().find(|c| self.is_original_dst(&c.name)) {
            proxy.cleanup_interval = c
                .cleanup_interval
                .unwrap_or(proxy::defaults::cleanup_interval());
            proxy.use_http_header = c
                .original_dst_lb_config
                .as_ref()
                .is_some_and(|o| o.use_http_header);
            proxy.original_dst_connect_timeout = c.connect_timeout;
        }
        proxy
    }
}

#[cfg(test)]
mod tests;
