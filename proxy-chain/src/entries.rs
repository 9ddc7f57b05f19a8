//! Consul config entries in Consul's own JSON/YAML shape (`Kind` plus PascalCase fields) and the
//! [`Entries`] set a chain is compiled from.
//!
//! The three discovery-chain kinds reject unknown fields (a misspelt routing field must not be
//! silently dropped); `service-defaults` and `proxy-defaults` carry dozens of fields unrelated to
//! the chain, so only the ones the compiler reads are modelled and the rest are ignored.

mod resolver;
mod router;
mod splitter;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub(crate) use self::splitter::{scale_weight, serialize_weight};
pub use self::{
    resolver::{
        CookieConfig, FailoverPolicy, HashPolicy, LeastRequestConfig, LoadBalancer,
        PrioritizeByLocality, ResolverFailover, ResolverFailoverTarget, ResolverRedirect,
        ResolverSubset, RingHashConfig, ServiceResolver,
    },
    router::{
        HttpHeaderModifiers, ServiceRoute, ServiceRouteDestination, ServiceRouteHttpMatch,
        ServiceRouteMatch, ServiceRouteMatchHeader, ServiceRouteMatchQueryParam, ServiceRouter,
    },
    splitter::{ServiceSplit, ServiceSplitter, normalize_split_weight},
};
use crate::{error::ChainError, validate};

/// Name of the only proxy-defaults entry Consul accepts.
pub const PROXY_DEFAULTS_GLOBAL: &str = "global";

/// One config entry, tagged by Consul's `Kind` field.
#[expect(
    clippy::large_enum_variant,
    reason = "entries are parsed once and moved into `Entries`; boxing would only add noise to serde"
)]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "Kind")]
pub enum ConfigEntry {
    /// `service-defaults`.
    #[serde(rename = "service-defaults")]
    ServiceDefaults(ServiceDefaults),
    /// `proxy-defaults`.
    #[serde(rename = "proxy-defaults")]
    ProxyDefaults(ProxyDefaults),
    /// `service-router`.
    #[serde(rename = "service-router")]
    ServiceRouter(ServiceRouter),
    /// `service-splitter`.
    #[serde(rename = "service-splitter")]
    ServiceSplitter(ServiceSplitter),
    /// `service-resolver`.
    #[serde(rename = "service-resolver")]
    ServiceResolver(ServiceResolver),
}

/// The kinds of config entry this crate understands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum EntryKind {
    /// `service-defaults`.
    ServiceDefaults,
    /// `proxy-defaults`.
    ProxyDefaults,
    /// `service-router`.
    ServiceRouter,
    /// `service-splitter`.
    ServiceSplitter,
    /// `service-resolver`.
    ServiceResolver,
}

impl EntryKind {
    /// Consul's spelling of the kind.
    pub const fn as_str(self) -> &'static str {
        match self {
            EntryKind::ServiceDefaults => "service-defaults",
            EntryKind::ProxyDefaults => "proxy-defaults",
            EntryKind::ServiceRouter => "service-router",
            EntryKind::ServiceSplitter => "service-splitter",
            EntryKind::ServiceResolver => "service-resolver",
        }
    }
}

impl ConfigEntry {
    /// The entry's kind.
    pub fn kind(&self) -> EntryKind {
        match self {
            ConfigEntry::ServiceDefaults(_) => EntryKind::ServiceDefaults,
            ConfigEntry::ProxyDefaults(_) => EntryKind::ProxyDefaults,
            ConfigEntry::ServiceRouter(_) => EntryKind::ServiceRouter,
            ConfigEntry::ServiceSplitter(_) => EntryKind::ServiceSplitter,
            ConfigEntry::ServiceResolver(_) => EntryKind::ServiceResolver,
        }
    }

    /// The entry's `Name`.
    pub fn name(&self) -> &str {
        match self {
            ConfigEntry::ServiceDefaults(e) => &e.name,
            ConfigEntry::ProxyDefaults(e) => &e.name,
            ConfigEntry::ServiceRouter(e) => &e.name,
            ConfigEntry::ServiceSplitter(e) => &e.name,
            ConfigEntry::ServiceResolver(e) => &e.name,
        }
    }

    /// Consul's `Normalize()`: upper-cases router methods and rounds split weights to 0.01.
    pub fn normalize(&mut self) {
        match self {
            ConfigEntry::ServiceRouter(e) => e.normalize(),
            ConfigEntry::ServiceSplitter(e) => e.normalize(),
            _ => {}
        }
    }

    /// Consul's `Validate()` for the entry, with Consul CE's gating of Enterprise-only fields.
    pub fn validate(&self) -> Result<(), crate::error::ValidationError> {
        validate::validate_entry(self, validate::Edition::Community)
    }
}

/// Mesh gateway mode (`MeshGateway.Mode`); the empty string is Consul's "default".
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum MeshGatewayMode {
    /// No opinion: a later layer decides.
    #[default]
    #[serde(rename = "")]
    Default,
    /// Do not use a mesh gateway.
    #[serde(rename = "none")]
    None,
    /// Use the local datacenter's gateway.
    #[serde(rename = "local")]
    Local,
    /// Use the remote datacenter's gateway.
    #[serde(rename = "remote")]
    Remote,
}

impl MeshGatewayMode {
    /// Consul's spelling (`""`, `none`, `local`, `remote`).
    pub const fn as_str(self) -> &'static str {
        match self {
            MeshGatewayMode::Default => "",
            MeshGatewayMode::None => "none",
            MeshGatewayMode::Local => "local",
            MeshGatewayMode::Remote => "remote",
        }
    }

    /// True for the "no opinion" mode.
    pub fn is_default(&self) -> bool {
        *self == MeshGatewayMode::Default
    }
}

impl std::str::FromStr for MeshGatewayMode {
    type Err = ChainError;

    fn from_str(s: &str) -> Result<Self, ChainError> {
        match s {
            "" | "default" => Ok(MeshGatewayMode::Default),
            "none" => Ok(MeshGatewayMode::None),
            "local" => Ok(MeshGatewayMode::Local),
            "remote" => Ok(MeshGatewayMode::Remote),
            other => Err(ChainError::InvalidMeshGatewayMode(other.to_owned())),
        }
    }
}

/// `MeshGateway` block of service-defaults, proxy-defaults and compiled targets.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", default)]
pub struct MeshGatewayConfig {
    /// The gateway mode.
    #[serde(skip_serializing_if = "MeshGatewayMode::is_default")]
    pub mode: MeshGatewayMode,
}

/// `TransparentProxy` block of service-defaults, proxy-defaults and compiled targets.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", default)]
pub struct TransparentProxyConfig {
    /// Port of the outbound listener traffic is redirected to.
    #[serde(skip_serializing_if = "is_zero_i32", alias = "outbound_listener_port")]
    pub outbound_listener_port: i32,
    /// Whether transparent proxies may dial instances directly.
    #[serde(skip_serializing_if = "is_false", alias = "dialed_directly")]
    pub dialed_directly: bool,
}

/// `service-defaults`: only the fields the discovery chain reads; others are ignored.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", default)]
pub struct ServiceDefaults {
    /// Service name.
    pub name: String,
    /// Protocol (`tcp`, `http`, `http2`, `grpc`); empty means tcp.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub protocol: String,
    /// Default mesh gateway mode for the service.
    pub mesh_gateway: MeshGatewayConfig,
    /// Transparent proxy settings.
    pub transparent_proxy: TransparentProxyConfig,
    /// SNI of an external (non-mesh) service; makes its targets external.
    #[serde(
        rename = "ExternalSNI",
        alias = "external_sni",
        skip_serializing_if = "String::is_empty"
    )]
    pub external_sni: String,
    /// Free-form metadata, projected into the compiled chain as `ServiceMeta`.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub meta: BTreeMap<String, String>,
    /// Envoy extensions, passed through verbatim.
    #[serde(alias = "envoy_extensions", skip_serializing_if = "Vec::is_empty")]
    pub envoy_extensions: Vec<serde_json::Value>,
    /// Namespace (Enterprise only; must be empty or `default`).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub namespace: String,
    /// Admin partition (Enterprise only; must be empty or `default`).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub partition: String,
}

/// `proxy-defaults` (always named `global`): only the fields the chain reads.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", default)]
pub struct ProxyDefaults {
    /// Must be `global`.
    pub name: String,
    /// Opaque proxy config; `protocol` is read.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub config: BTreeMap<String, serde_json::Value>,
    /// Mesh gateway mode for every service without its own.
    pub mesh_gateway: MeshGatewayConfig,
    /// Transparent proxy settings.
    pub transparent_proxy: TransparentProxyConfig,
    /// Failover policy used when a resolver's failover section names none.
    #[serde(alias = "failover_policy", skip_serializing_if = "Option::is_none")]
    pub failover_policy: Option<FailoverPolicy>,
    /// Envoy extensions, passed through verbatim.
    #[serde(alias = "envoy_extensions", skip_serializing_if = "Vec::is_empty")]
    pub envoy_extensions: Vec<serde_json::Value>,
    /// Free-form metadata.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub meta: BTreeMap<String, String>,
    /// Namespace (Enterprise only).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub namespace: String,
    /// Admin partition (Enterprise only).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub partition: String,
}

impl ProxyDefaults {
    /// `Config["protocol"]` as Consul's weak decoding reads it (strings, numbers and booleans).
    pub fn protocol(&self) -> Option<String> {
        match self.config.get("protocol")? {
            serde_json::Value::String(s) => Some(s.clone()),
            serde_json::Value::Number(n) => Some(n.to_string()),
            serde_json::Value::Bool(b) => Some(if *b { "1" } else { "0" }.to_owned()),
            _ => None,
        }
    }
}

/// A borrowed entry of any kind, as returned by [`Entries::get`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum EntryRef<'a> {
    /// `service-defaults`.
    ServiceDefaults(&'a ServiceDefaults),
    /// `proxy-defaults`.
    ProxyDefaults(&'a ProxyDefaults),
    /// `service-router`.
    ServiceRouter(&'a ServiceRouter),
    /// `service-splitter`.
    ServiceSplitter(&'a ServiceSplitter),
    /// `service-resolver`.
    ServiceResolver(&'a ServiceResolver),
}

/// The set of config entries a chain is compiled from, keyed by kind and name (Consul CE: every
/// entry lives in the `default` namespace and partition).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Entries {
    routers: BTreeMap<String, ServiceRouter>,
    splitters: BTreeMap<String, ServiceSplitter>,
    resolvers: BTreeMap<String, ServiceResolver>,
    services: BTreeMap<String, ServiceDefaults>,
    proxy_defaults: Option<ProxyDefaults>,
}

impl Entries {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Normalizes, validates and indexes `entries`; a second entry with the same kind and name
    /// is an error.
    pub fn from_entries(
        entries: impl IntoIterator<Item = ConfigEntry>,
    ) -> Result<Self, ChainError> {
        let mut set = Entries::new();
        for entry in entries {
            set.insert(entry)?;
        }
        Ok(set)
    }

    /// Parses a JSON array of entries in Consul's API shape, then as [`Entries::from_entries`].
    pub fn from_json(text: &str) -> Result<Self, ChainError> {
        let entries: Vec<ConfigEntry> = serde_json::from_str(text).map_err(ChainError::Parse)?;
        Self::from_entries(entries)
    }

    /// Normalizes, validates and adds one entry.
    pub fn insert(&mut self, mut entry: ConfigEntry) -> Result<(), ChainError> {
        entry.normalize();
        let (kind, name) = (entry.kind(), entry.name().to_owned());
        entry
            .validate()
            .map_err(|source| ChainError::InvalidEntry {
                kind: kind.as_str(),
                name: name.clone(),
                source: Box::new(source),
            })?;
        if self.get(kind, &name).is_some() {
            return Err(ChainError::DuplicateEntry {
                kind: kind.as_str(),
                name,
            });
        }
        match entry {
            ConfigEntry::ServiceDefaults(e) => drop(self.services.insert(name, e)),
            ConfigEntry::ProxyDefaults(e) => self.proxy_defaults = Some(e),
            ConfigEntry::ServiceRouter(e) => drop(self.routers.insert(name, e)),
            ConfigEntry::ServiceSplitter(e) => drop(self.splitters.insert(name, e)),
            ConfigEntry::ServiceResolver(e) => drop(self.resolvers.insert(name, e)),
        }
        Ok(())
    }

    /// Looks an entry up by kind and name.
    pub fn get(&self, kind: EntryKind, name: &str) -> Option<EntryRef<'_>> {
        match kind {
            EntryKind::ServiceDefaults => {
                self.service_defaults(name).map(EntryRef::ServiceDefaults)
            }
            EntryKind::ProxyDefaults => self
                .proxy_defaults
                .as_ref()
                .filter(|e| e.name == name)
                .map(EntryRef::ProxyDefaults),
            EntryKind::ServiceRouter => self.router(name).map(EntryRef::ServiceRouter),
            EntryKind::ServiceSplitter => self.splitter(name).map(EntryRef::ServiceSplitter),
            EntryKind::ServiceResolver => self.resolver(name).map(EntryRef::ServiceResolver),
        }
    }

    /// The service-router named `name`.
    pub fn router(&self, name: &str) -> Option<&ServiceRouter> {
        self.routers.get(name)
    }

    /// The service-splitter named `name`.
    pub fn splitter(&self, name: &str) -> Option<&ServiceSplitter> {
        self.splitters.get(name)
    }

    /// The service-resolver named `name`.
    pub fn resolver(&self, name: &str) -> Option<&ServiceResolver> {
        self.resolvers.get(name)
    }

    /// The service-defaults named `name`.
    pub fn service_defaults(&self, name: &str) -> Option<&ServiceDefaults> {
        self.services.get(name)
    }

    /// The global proxy-defaults.
    pub fn proxy_defaults(&self) -> Option<&ProxyDefaults> {
        self.proxy_defaults.as_ref()
    }

    /// True when there are no routers, splitters or resolvers (Consul's `IsChainEmpty`).
    pub fn is_chain_empty(&self) -> bool {
        self.routers.is_empty() && self.splitters.is_empty() && self.resolvers.is_empty()
    }
}

pub(crate) fn is_false(b: &bool) -> bool {
    !*b
}

pub(crate) fn is_zero_i32(v: &i32) -> bool {
    *v == 0
}

pub(crate) fn is_zero_u32(v: &u32) -> bool {
    *v == 0
}

pub(crate) fn is_zero_u64(v: &u64) -> bool {
    *v == 0
}
