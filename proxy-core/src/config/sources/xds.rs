//! EDS configuration with Envoy v3 names (`eds_cluster_config`, `ConfigSource`,
//! `ApiConfigSource`, `ads_config`), and its reduction to control-plane connections.
//!
//! Deviations from Envoy, all additive:
//! * `ApiConfigSource.server_uri`: the control plane's address (`http://127.0.0.1:18000` or
//!   `127.0.0.1:18000`) instead of a `grpc_services` entry or REST `cluster_names`, for
//!   deployments without a static xDS cluster;
//! * `ApiConfigSource.retry_back_off`: bounds of the reconnect backoff (Envoy hardcodes
//!   500 ms / 30 s for xDS streams, which are our defaults);
//! * `envoy_grpc.cluster_name` and REST `cluster_names` are resolved to one address (and a
//!   `transport_socket`) by the caller ([`plan`]'s `resolve`), from a STATIC cluster;
//! * TLS: `server_uri: https://...` with a `tls` block ([`TlsSettings`], ours); Envoy's
//!   `google_grpc.channel_credentials.ssl_credentials` with `filename` data sources only
//!   (inline key material would show in `/config_dump`), `root_certs` required (no system
//!   trust store); for `envoy_grpc` and REST `cluster_names`, the named cluster's
//!   `transport_socket` (see `transport_socket`).

use std::{collections::BTreeMap, net::SocketAddr, path::PathBuf, time::Duration};

use serde::{Deserialize, Serialize};
use thiserror::Error;

use self::{target::server_uri, transport_socket::TransportSocket};
use crate::{config::duration, tls::TlsSettings};

pub mod clusters;
mod target;
pub mod transport_socket;

/// Envoy's xDS gRPC stream retry base (`RetryInitialDelayMs`).
pub const DEFAULT_BASE_INTERVAL: Duration = Duration::from_millis(500);
/// Envoy's xDS gRPC stream retry cap (`RetryMaxDelayMs`).
pub const DEFAULT_MAX_INTERVAL: Duration = Duration::from_secs(30);

/// The xDS section of the daemon's config: who we are, and the ADS server if any.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct XdsConfig {
    /// Identity sent in every request (bootstrap `node`).
    pub node: NodeConfig,
    /// The aggregated discovery server used by clusters whose `eds_config` is `ads: {}`
    /// (bootstrap `dynamic_resources.ads_config`); `api_type` GRPC or DELTA_GRPC.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ads_config: Option<ApiConfigSource>,
    /// Clusters from the ADS server (bootstrap `dynamic_resources.cds_config`): `{ads: {}}`,
    /// the only source taken. Absent: no CDS.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cds_config: Option<AdsOnly>,
    /// Listeners from the ADS server (bootstrap `dynamic_resources.lds_config`): `{ads: {}}`,
    /// the only source taken. Absent: no LDS.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lds_config: Option<AdsOnly>,
}

/// A `ConfigSource` that must be the ADS stream: `{ads: {}}` (with Envoy's optional
/// `resource_api_version`, V3).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct AdsOnly {
    /// Must be `{}`: the stream of `ads_config`.
    pub ads: AggregatedConfigSource,
    /// Must be V3.
    #[serde(default)]
    pub resource_api_version: ApiVersion,
}

impl XdsConfig {
    /// Whether CDS or LDS is enabled.
    pub fn resources_enabled(&self) -> bool {
        self.cds_config.is_some() || self.lds_config.is_some()
    }

    /// The ADS connection that carries CDS and LDS (the one ADS EDS clusters share, with
    /// Envoy's 15 s `initial_fetch_timeout`); refused without a gRPC `ads_config`.
    pub fn ads_source(&self, resolve: &Resolve<'_>) -> Result<XdsSource, XdsConfigError> {
        if self.ads_config.is_none() {
            return Err(XdsConfigError::Server {
                field: "xds.cds_config/lds_config".into(),
                reason: "clusters and listeners come over ADS: set ads_config (api_type GRPC or DELTA_GRPC)".into(),
            });
        }
        let ads = ConfigSource {
            api_config_source: None,
            ads: Some(AggregatedConfigSource {}),
            initial_fetch_timeout: default_initial_fetch_timeout(),
            resource_api_version: ApiVersion::default(),
        };
        cluster_source(self, "(cds_config/lds_config)", &ads, resolve)
    }
}

/// Envoy's bootstrap `node` (`core.v3.Node`): the identity control planes key and select on,
/// sent on every stream and every REST request (`node.rs` builds the wire forms).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct NodeConfig {
    /// `node.id`: unique per proxy instance; must not be empty.
    pub id: String,
    /// `node.cluster`: the service cluster this proxy belongs to.
    #[serde(default)]
    pub cluster: String,
    /// `node.metadata`: free-form values a control plane selects on (Istio, for example,
    /// reads its proxy's settings from here); sent as a `google.protobuf.Struct`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, serde_json::Value>,
    /// `node.locality`: where this proxy runs, for control planes that route by zone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub locality: Option<NodeLocality>,
}

/// Envoy's `core.v3.Locality` of the node.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct NodeLocality {
    /// The region.
    #[serde(default)]
    pub region: String,
    /// The zone within the region.
    #[serde(default)]
    pub zone: String,
    /// The sub-zone within the zone.
    #[serde(default)]
    pub sub_zone: String,
}

/// A cluster's `eds_cluster_config`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct EdsClusterConfig {
    /// The resource name to subscribe to; the cluster's name when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_name: Option<String>,
    /// Where the assignments come from.
    pub eds_config: ConfigSource,
}

/// Envoy's `core.v3.ConfigSource`: exactly one of `api_config_source` and `ads`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigSource {
    /// A dedicated EDS server (EndpointDiscoveryService or REST).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_config_source: Option<ApiConfigSource>,
    /// Use the ADS stream of [`XdsConfig::ads_config`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ads: Option<AggregatedConfigSource>,
    /// How long to wait for the first update before the cluster counts as initialized anyway
    /// (Envoy default 15 s; 0 waits forever).
    #[serde(default = "default_initial_fetch_timeout", with = "duration")]
    pub initial_fetch_timeout: Duration,
    /// Must be V3.
    #[serde(default)]
    pub resource_api_version: ApiVersion,
}

/// Envoy's `core.v3.AggregatedConfigSource` (no fields).
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct AggregatedConfigSource {}

/// Envoy's `core.v3.ApiConfigSource`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ApiConfigSource {
    /// GRPC (state of the world), DELTA_GRPC (incremental) or REST (JSON polling).
    pub api_type: ApiType,
    /// Must be V3.
    #[serde(default)]
    pub transport_api_version: ApiVersion,
    /// gRPC: exactly one entry (Envoy's rule), unless `server_uri` is set.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub grpc_services: Vec<GrpcService>,
    /// REST: exactly one cluster serving `POST /v3/discovery:endpoints`, unless `server_uri`
    /// is set.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cluster_names: Vec<String>,
    /// Our extension: the server's address, `http://127.0.0.1:18000` or `127.0.0.1:18000`,
    /// or `https://xds.example:18000` with `tls`; overrides `grpc_services` and
    /// `cluster_names`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_uri: Option<String>,
    /// Our extension: TLS to an `https://` `server_uri` (CA, client certificate and key
    /// files, server name override); files are read at every (re)connection.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<TlsSettings>,
    /// REST: the polling interval; required for REST, like in Envoy.
    #[serde(
        default,
        with = "duration::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub refresh_delay: Option<Duration>,
    /// REST: timeout of one poll (Envoy default 1 s).
    #[serde(default = "default_request_timeout", with = "duration")]
    pub request_timeout: Duration,
    /// Our extension: reconnect/poll-failure backoff (default 500 ms base, 30 s max).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_back_off: Option<BackoffConfig>,
}

/// `api_type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ApiType {
    /// State-of-the-world gRPC.
    Grpc,
    /// Incremental (delta) gRPC.
    DeltaGrpc,
    /// REST-JSON polling.
    Rest,
}

/// `transport_api_version` / `resource_api_version`: only V3 exists here.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Deserialize, Serialize)]
pub enum ApiVersion {
    /// xDS v3.
    #[default]
    V3,
}

/// Envoy's `core.v3.GrpcService`: exactly one of `envoy_grpc` and `google_grpc`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct GrpcService {
    /// A cluster of the daemon's config, resolved by the caller to one address.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub envoy_grpc: Option<EnvoyGrpc>,
    /// A direct target.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub google_grpc: Option<GoogleGrpc>,
}

/// `GrpcService.envoy_grpc`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct EnvoyGrpc {
    /// Name of the cluster serving xDS.
    pub cluster_name: String,
}

/// `GrpcService.google_grpc`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct GoogleGrpc {
    /// `host:port` of the server: plaintext, or TLS with `channel_credentials`.
    pub target_uri: String,
    /// Envoy's stat prefix; accepted and unused.
    #[serde(default)]
    pub stat_prefix: String,
    /// TLS to the target: only `ssl_credentials`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub channel_credentials: Option<ChannelCredentials>,
}

/// `GoogleGrpc.channel_credentials`; `local_credentials` and `google_default` are refused.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ChannelCredentials {
    /// TLS, with files.
    pub ssl_credentials: SslCredentials,
}

/// Envoy's `GrpcService.GoogleGrpc.SslCredentials`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SslCredentials {
    /// PEM CA certificates the server's certificate must chain to; required here (no system
    /// trust store is used).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub root_certs: Option<DataSource>,
    /// PEM client private key for mutual TLS; needs `cert_chain`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub private_key: Option<DataSource>,
    /// PEM client certificate chain for mutual TLS; needs `private_key`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cert_chain: Option<DataSource>,
}

/// Envoy's `core.v3.DataSource`, `filename` only: `inline_string` and `inline_bytes` are
/// refused, as key material inline would show in `/config_dump`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DataSource {
    /// The file, read at every (re)connection.
    pub filename: PathBuf,
}

/// Envoy's `core.v3.BackoffStrategy`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct BackoffConfig {
    /// First delay bound; more than 0.
    #[serde(with = "duration")]
    pub base_interval: Duration,
    /// Largest delay bound; default 10 × `base_interval`; at least `base_interval`.
    #[serde(
        default,
        with = "duration::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub max_interval: Option<Duration>,
}

fn default_initial_fetch_timeout() -> Duration {
    Duration::from_secs(15)
}

fn default_request_timeout() -> Duration {
    Duration::from_secs(1)
}

/// A configuration error, naming the field.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum XdsConfigError {
    /// `node.id` is empty.
    #[error("node.id must not be empty: control planes key their snapshots on it")]
    EmptyNodeId,
    /// Not exactly one of `api_config_source` and `ads`.
    #[error("cluster {cluster}: eds_config must set exactly one of api_config_source and ads")]
    SourceChoice {
        /// The cluster.
        cluster: String,
    },
    /// `ads: {}` without `ads_config`.
    #[error("cluster {cluster}: eds_config.ads is set but there is no ads_config")]
    NoAdsConfig {
        /// The cluster.
        cluster: String,
    },
    /// `ads_config` with `api_type: REST`.
    #[error("ads_config.api_type must be GRPC or DELTA_GRPC, not REST")]
    RestAds,
    /// No way to find the server.
    #[error("{field}: {reason}")]
    Server {
        /// The config path.
        field: String,
        /// What is missing or wrong.
        reason: String,
    },
    /// REST without `refresh_delay`, or a zero one.
    #[error("{field}.refresh_delay must be set and above 0 for REST")]
    RefreshDelay {
        /// The config path.
        field: String,
    },
    /// `max_interval` below `base_interval`, or a zero base.
    #[error(
        "{field}.retry_back_off: base_interval must be above 0 and max_interval at least base_interval"
    )]
    Backoff {
        /// The config path.
        field: String,
    },
}

/// Finds a STATIC cluster named by `envoy_grpc` or REST `cluster_names`: its address, and its
/// `transport_socket` if any.
pub type Resolve<'a> = dyn Fn(&str) -> Option<(SocketAddr, Option<TransportSocket>)> + 'a;

/// Which gRPC service carries the subscription.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GrpcApi {
    /// AggregatedDiscoveryService (ADS).
    Aggregated,
    /// EndpointDiscoveryService.
    Endpoint,
}

/// How one control-plane connection is made.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Transport {
    /// A gRPC stream.
    Grpc {
        /// `http://host:port`.
        uri: String,
        /// ADS or EDS.
        api: GrpcApi,
        /// Delta (incremental) instead of state of the world.
        delta: bool,
    },
    /// REST-JSON polling.
    Rest {
        /// `http://host:port`.
        uri: String,
        /// Interval between polls.
        refresh_delay: Duration,
        /// Timeout of one poll.
        request_timeout: Duration,
    },
}

/// Everything one control-plane connection needs.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct XdsSource {
    /// Connection kind and address.
    pub transport: Transport,
    /// Our identity.
    pub node: NodeConfig,
    /// See [`ConfigSource::initial_fetch_timeout`].
    pub initial_fetch_timeout: Duration,
    /// Reconnect backoff `(base, max)`.
    pub backoff: (Duration, Duration),
    /// TLS to the server (the transport's `uri` is then `https://`); plaintext when `None`.
    pub tls: Option<TlsSettings>,
}

/// One EDS cluster on a connection: its name (for stats and outputs) and resource name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EdsWatch {
    /// The cluster's name.
    pub cluster: String,
    /// The subscribed resource: `service_name`, or the cluster's name.
    pub resource: String,
}

/// Groups `clusters` by control-plane connection: all ADS clusters share one stream, other
/// clusters share a connection when their sources are equal. `resolve` maps an `envoy_grpc`
/// or REST cluster name to its address.
pub fn plan(
    xds: &XdsConfig,
    clusters: &[(String, EdsClusterConfig)],
    resolve: &Resolve<'_>,
) -> Result<Vec<(XdsSource, Vec<EdsWatch>)>, XdsConfigError> {
    if xds.node.id.is_empty() {
        return Err(XdsConfigError::EmptyNodeId);
    }
    let mut groups: BTreeMap<String, (XdsSource, Vec<EdsWatch>)> = BTreeMap::new();
    for (cluster, eds) in clusters {
        let source = cluster_source(xds, cluster, &eds.eds_config, resolve)?;
        let watch = EdsWatch {
            cluster: cluster.clone(),
            resource: eds.service_name.clone().unwrap_or_else(|| cluster.clone()),
        };
        let key = format!("{source:?}");
        groups
            .entry(key)
            .or_insert_with(|| (source, Vec::new()))
            .1
            .push(watch);
    }
    Ok(groups.into_values().collect())
}

fn cluster_source(
    xds: &XdsConfig,
    cluster: &str,
    config: &ConfigSource,
    resolve: &Resolve<'_>,
) -> Result<XdsSource, XdsConfigError> {
    let (api, api_source, field) = match (&config.api_config_source, &config.ads) {
        (Some(source), None) => (GrpcApi::Endpoint, source, "eds_config.api_config_source"),
        (None, Some(_)) => {
            let cluster = cluster.to_owned();
            let source = xds
                .ads_config
                .as_ref()
                .ok_or(XdsConfigError::NoAdsConfig { cluster })?;
            if source.api_type == ApiType::Rest {
                return Err(XdsConfigError::RestAds);
            }
            (GrpcApi::Aggregated, source, "ads_config")
        }
        _ => {
            let cluster = cluster.to_owned();
            return Err(XdsConfigError::SourceChoice { cluster });
        }
    };
    let field = if api == GrpcApi::Aggregated {
        field.to_owned()
    } else {
        format!("clusters.{cluster}.{field}")
    };
    let (transport, tls) = transport(api_source, api, &field, resolve)?;
    Ok(XdsSource {
        transport,
        node: xds.node.clone(),
        initial_fetch_timeout: config.initial_fetch_timeout,
        backoff: backoff(api_source, &field)?,
        tls,
    })
}

fn transport(
    source: &ApiConfigSource,
    api: GrpcApi,
    field: &str,
    resolve: &Resolve<'_>,
) -> Result<(Transport, Option<TlsSettings>), XdsConfigError> {
    let (uri, tls) = server_uri(source, field, resolve)?;
    let transport = match source.api_type {
        ApiType::Grpc | ApiType::DeltaGrpc => Transport::Grpc {
            uri,
            api,
            delta: source.api_type == ApiType::DeltaGrpc,
        },
        ApiType::Rest => Transport::Rest {
            uri,
            refresh_delay: source
                .refresh_delay
                .filter(|d| !d.is_zero())
                .ok_or_else(|| XdsConfigError::RefreshDelay {
                    field: field.to_owned(),
                })?,
            request_timeout: source.request_timeout,
        },
    };
    Ok((transport, tls))
}

fn backoff(source: &ApiConfigSource, field: &str) -> Result<(Duration, Duration), XdsConfigError> {
    let Some(config) = source.retry_back_off else {
        return Ok((DEFAULT_BASE_INTERVAL, DEFAULT_MAX_INTERVAL));
    };
    let max = config
        .max_interval
        .unwrap_or(config.base_interval.saturating_mul(10));
    if config.base_interval.is_zero() || max < config.base_interval {
        return Err(XdsConfigError::Backoff {
            field: field.to_owned(),
        });
    }
    Ok((config.base_interval, max))
}
