//! `/v1/health/service/<name>` entries and how one becomes a [`Host`].
//!
//! Health and weight follow Consul's own Envoy integration (`calculateEndpointHealthAndWeight`
//! in hashicorp/consul `agent/xds/endpoints.go`), over all checks of the entry, node checks
//! (`serfHealth`, node maintenance) included:
//! * healthy, weight `Service.Weights.Passing` (1 when the entry has no `Weights`);
//! * any `critical` check (maintenance mode registers a critical check): unhealthy;
//! * with `only_passing`, any check that is not `passing`: unhealthy;
//! * any `warning` check: weight `Service.Weights.Warning` (still healthy without `only_passing`);
//! * a weight below 1 (a `Weights` of 0) makes the instance unhealthy with weight 1; weights are
//!   capped at 128, as Consul caps them for Envoy.
//!
//! The address is `Service.Address`, or `Node.Address` when that is empty (Consul's
//! `BestAddress` for the local datacenter); the port is `Service.Port`; `Service.Meta` becomes
//! the host metadata. Instances whose address is not an IP literal are skipped (the kernel path
//! connects to addresses, it does not resolve names).

use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr},
};

use serde::Deserialize;

use crate::host::{EdsHealth, Host, HostSet};

/// Largest weight Consul hands to Envoy.
const MAX_WEIGHT: i64 = 128;

/// One element of the `/v1/health/service/<name>` array. Unknown fields are ignored: this is
/// Consul's API, not our configuration.
#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct ServiceEntry {
    /// The node the instance runs on.
    pub node: Node,
    /// The service instance.
    pub service: Service,
    /// Node and service checks.
    #[serde(default, deserialize_with = "null_as_default")]
    pub checks: Vec<Check>,
}

/// The node part of an entry.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "PascalCase", default)]
pub struct Node {
    /// Node name.
    pub node: String,
    /// Node address; the instance's address when `Service.Address` is empty.
    pub address: String,
    /// The node's datacenter.
    pub datacenter: String,
}

/// The service part of an entry.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "PascalCase", default)]
pub struct Service {
    /// Instance ID, unique per node.
    #[serde(rename = "ID")]
    pub id: String,
    /// Service name.
    pub service: String,
    /// Instance address; empty means the node's address.
    pub address: String,
    /// Instance port.
    pub port: u16,
    /// User metadata.
    #[serde(deserialize_with = "null_as_default")]
    pub meta: BTreeMap<String, String>,
    /// Weights by health; Consul fills in 1/1 when registered without them.
    pub weights: Option<Weights>,
}

/// `Service.Weights`.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "PascalCase", default)]
pub struct Weights {
    /// Weight while every check passes.
    pub passing: i64,
    /// Weight while some check warns.
    pub warning: i64,
}

/// One check of an entry.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "PascalCase", default)]
pub struct Check {
    /// Check ID.
    #[serde(rename = "CheckID")]
    pub check_id: String,
    /// `passing`, `warning`, `critical` (or `maintenance`).
    pub status: String,
}

fn null_as_default<'de, D, T>(deserializer: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(deserializer)?.unwrap_or_default())
}

/// An instance that could not become a host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Skipped {
    /// `node/service-id` (`#<n>` for an entry too broken to name).
    pub instance: String,
    /// Why: an address that is not an IP literal, or what is wrong with the entry.
    pub reason: String,
}

/// Decodes a `/v1/health/service/<name>` answer entry by entry: one entry Consul accepted but
/// this daemon cannot use (a port of -1 or 70000, a field of the wrong type) is skipped with
/// its reason, and never makes the rest of the answer, and with it every later change of the
/// service, unreadable. An answer that is not a JSON array (or `null`) is an error.
pub fn decode_entries(body: &[u8]) -> Result<(Vec<ServiceEntry>, Vec<Skipped>), serde_json::Error> {
    let values: Option<Vec<serde_json::Value>> = serde_json::from_slice(body)?;
    let mut entries = Vec::new();
    let mut skipped = Vec::new();
    for (i, value) in values.unwrap_or_default().into_iter().enumerate() {
        let name = |field: &str, key: &str| {
            value
                .get(field)
                .and_then(|v| v.get(key))
                .and_then(serde_json::Value::as_str)
                .map(str::to_owned)
        };
        let instance = match (name("Node", "Node"), name("Service", "ID")) {
            (Some(node), Some(id)) => format!("{node}/{id}"),
            _ => format!("#{i}"),
        };
        match serde_json::from_value::<ServiceEntry>(value) {
            Ok(entry) => entries.push(entry),
            Err(err) => skipped.push(Skipped {
                instance,
                reason: format!("not a usable entry: {err}"),
            }),
        }
    }
    Ok((entries, skipped))
}

/// Health and weight of one entry, as Consul computes them for Envoy.
pub fn health_and_weight(entry: &ServiceEntry, only_passing: bool) -> (EdsHealth, u32) {
    let mut health = EdsHealth::Healthy;
    let mut weight = entry.service.weights.map_or(1, |w| w.passing);
    for check in &entry.checks {
        let status = check.status.as_str();
        if status == "critical" || status == "maintenance" {
            health = EdsHealth::Unhealthy;
        }
        if only_passing && status != "passing" {
            health = EdsHealth::Unhealthy;
        }
        if status == "warning"
            && let Some(weights) = entry.service.weights
        {
            weight = weights.warning;
        }
    }
    if weight < 1 {
        health = EdsHealth::Unhealthy;
        weight = 1;
    }
    (health, weight.min(MAX_WEIGHT) as u32)
}

/// The hosts of a response, ordered by address (then node and instance ID) so that an
/// unchanged catalog gives an identical host set; and the instances that were skipped.
pub fn to_hosts(entries: &[ServiceEntry], only_passing: bool) -> (HostSet, Vec<Skipped>) {
    let mut keyed = Vec::with_capacity(entries.len());
    let mut skipped = Vec::new();
    for entry in entries {
        let address = if entry.service.address.is_empty() {
            &entry.node.address
        } else {
            &entry.service.address
        };
        let Ok(ip) = address.parse::<IpAddr>() else {
            skipped.push(Skipped {
                instance: format!("{}/{}", entry.node.node, entry.service.id),
                reason: format!("address {address:?} is not an IP literal"),
            });
            continue;
        };
        let (eds_health, weight) = health_and_weight(entry, only_passing);
        let host = Host {
            weight,
            eds_health,
            ..Host::new(SocketAddr::new(ip, entry.service.port))
        }
        .with_metadata(entry.service.meta.clone());
        keyed.push(((entry.node.node.clone(), entry.service.id.clone()), host));
    }
    keyed.sort_by(|(ka, a), (kb, b)| a.addr.cmp(&b.addr).then_with(|| ka.cmp(kb)));
    (keyed.into_iter().map(|(_, host)| host).collect(), skipped)
}
