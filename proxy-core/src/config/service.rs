//! Services: the addresses applications dial, and what serves them.

use std::net::IpAddr;

use serde::{Deserialize, Serialize};

/// A service address (VIP, port, protocol) served by a cluster.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Service {
    /// Unique name, used in stats and `/clusters`.
    pub name: String,
    /// The VIP applications dial. On a host, keep it in 127.0.0.0/8 (e.g. 127.77.0.0/16) so
    /// that a connect which is not rewritten still stays on the machine.
    pub address: IpAddr,
    /// The port applications dial.
    pub port: u16,
    /// `TCP` (default) or `UDP`.
    #[serde(default)]
    pub protocol: Protocol,
    /// Name of the cluster whose hosts serve this service. Exactly one of `cluster` and `chain`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub cluster: String,
    /// Name of the Consul service whose discovery chain (from `config_entries`) serves this
    /// service: splits become weights, failover targets lower priorities, redirects and subsets
    /// choose hosts. Each target maps to the cluster named like its service (`<service>.<dc>`
    /// for another datacenter).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chain: Option<String>,
    /// Opt-in behaviour beyond Consul's for this service's chain (all off by default).
    #[serde(default)]
    pub chain_options: crate::chain::ChainOptions,
    /// `direct` (default): the kernel connects the application straight to a chosen host.
    /// `proxy`: the connection goes through the daemon's proxy listener.
    #[serde(default)]
    pub mode: ServiceMode,
}

/// Transport protocol of a service.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Protocol {
    /// TCP.
    #[default]
    Tcp,
    /// UDP (connected sockets through connect4/6).
    Udp,
}

/// Which path serves a service.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ServiceMode {
    /// Kernel path: connect4/6 rewrite the destination to a chosen host.
    #[default]
    Direct,
    /// Proxy path: connect4/6 redirect to the daemon's listener.
    Proxy,
}
