//! The proto3 JSON forms used by REST xDS: a `DiscoveryRequest` out, a `DiscoveryResponse` with
//! `ClusterLoadAssignment` resources in.
//!
//! Parsing follows the proto3 JSON mapping for the fields EDS uses: lowerCamelCase names (the
//! original snake_case names are accepted too, as proto3 parsers do), `uint32` as a number or a
//! decimal string, wrapper types (`load_balancing_weight`) as plain numbers, enums as their name
//! or number, `Any` as an object with `@type`. Unknown fields are ignored. A parsed assignment is
//! re-encoded as protobuf so REST takes the same validation path as gRPC.

use std::collections::HashMap;

use envoy_types::pb::{
    envoy::{
        config::{
            core::v3::{
                Address, EnvoyInternalAddress, HealthStatus, Locality, Metadata, Pipe,
                SocketAddress, address, socket_address::PortSpecifier,
            },
            endpoint::v3::{
                ClusterLoadAssignment, Endpoint, LbEndpoint, LedsClusterLocalityConfig,
                LocalityLbEndpoints, lb_endpoint::HostIdentifier, locality_lb_endpoints::LbConfig,
            },
        },
        service::discovery::v3::DiscoveryResponse,
    },
    google::protobuf::{Any, Struct, UInt32Value, Value, value::Kind},
};
use prost::Message;
use serde::{Deserialize, Deserializer, de};
use serde_json::json;

use crate::{
    config::sources::xds::NodeConfig,
    discovery::xds::{node, state::CLA_TYPE_URL},
};

/// A REST `DiscoveryRequest` as JSON; empty fields are omitted, as proto3 JSON does.
pub fn discovery_request(
    node: &NodeConfig,
    version_info: &str,
    resource_names: &[String],
    response_nonce: &str,
    error: Option<(i32, &str)>,
) -> serde_json::Value {
    let mut request = json!({
        "node": node::to_json(node),
        "resourceNames": resource_names,
        "typeUrl": CLA_TYPE_URL,
    });
    let object = request.as_object_mut().expect("a JSON object literal");
    if !version_info.is_empty() {
        object.insert("versionInfo".into(), version_info.into());
    }
    if !response_nonce.is_empty() {
        object.insert("responseNonce".into(), response_nonce.into());
    }
    if let Some((code, message)) = error {
        object.insert(
            "errorDetail".into(),
            json!({ "code": code, "message": message }),
        );
    }
    request
}

/// Parses a JSON `DiscoveryResponse`. Resources keep their `@type`, so a wrong type is caught
/// by the same check as for gRPC; a resource that does not parse as an assignment is an error.
pub fn discovery_response(body: &[u8]) -> Result<DiscoveryResponse, String> {
    let raw: RawResponse = serde_json::from_slice(body).map_err(|e| e.to_string())?;
    let mut resources = Vec::with_capacity(raw.resources.len());
    for (index, resource) in raw.resources.into_iter().enumerate() {
        let type_url = resource
            .get("@type")
            .and_then(|t| t.as_str())
            .unwrap_or_default()
            .to_owned();
        let value = if type_url == CLA_TYPE_URL {
            let cla: JsonCla = serde_json::from_value(resource)
                .map_err(|e| format!("resource {index} is not a ClusterLoadAssignment: {e}"))?;
            ClusterLoadAssignment::from(cla).encode_to_vec()
        } else {
            Vec::new()
        };
        resources.push(Any { type_url, value });
    }
    Ok(DiscoveryResponse {
        version_info: raw.version_info,
        resources,
        type_url: raw.type_url,
        nonce: raw.nonce,
        ..Default::default()
    })
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawResponse {
    #[serde(default, alias = "version_info")]
    version_info: String,
    #[serde(default)]
    resources: Vec<serde_json::Value>,
    #[serde(default, alias = "type_url")]
    type_url: String,
    #[serde(default)]
    nonce: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct JsonCla {
    #[serde(default, alias = "cluster_name")]
    cluster_name: String,
    #[serde(default)]
    endpoints: Vec<JsonLocalityLbEndpoints>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct JsonLocalityLbEndpoints {
    #[serde(default)]
    locality: Option<JsonLocality>,
    #[serde(default, alias = "lb_endpoints")]
    lb_endpoints: Vec<JsonLbEndpoint>,
    #[serde(default, alias = "load_balancing_weight", deserialize_with = "opt_u32")]
    load_balancing_weight: Option<u32>,
    #[serde(default, deserialize_with = "opt_u32")]
    priority: Option<u32>,
    #[serde(default, alias = "leds_cluster_locality_config")]
    leds_cluster_locality_config: Option<serde_json::Value>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct JsonLocality {
    #[serde(default)]
    region: String,
    #[serde(default)]
    zone: String,
    #[serde(default, alias = "sub_zone")]
    sub_zone: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct JsonLbEndpoint {
    #[serde(default)]
    endpoint: Option<JsonEndpoint>,
    #[serde(default, alias = "health_status", deserialize_with = "health_status")]
    health_status: i32,
    #[serde(default)]
    metadata: Option<JsonMetadata>,
    #[serde(default, alias = "load_balancing_weight", deserialize_with = "opt_u32")]
    load_balancing_weight: Option<u32>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct JsonEndpoint {
    #[serde(default)]
    address: Option<JsonAddress>,
    #[serde(default)]
    hostname: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct JsonAddress {
    #[serde(default, alias = "socket_address")]
    socket_address: Option<JsonSocketAddress>,
    #[serde(default)]
    pipe: Option<serde_json::Value>,
    #[serde(default, alias = "envoy_internal_address")]
    envoy_internal_address: Option<serde_json::Value>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct JsonSocketAddress {
    #[serde(default)]
    address: String,
    #[serde(default, alias = "port_value", deserialize_with = "opt_u32")]
    port_value: Option<u32>,
    #[serde(default, alias = "named_port")]
    named_port: Option<String>,
    #[serde(default, alias = "resolver_name")]
    resolver_name: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct JsonMetadata {
    #[serde(default, alias = "filter_metadata")]
    filter_metadata: HashMap<String, serde_json::Map<String, serde_json::Value>>,
}

/// A proto3 JSON `uint32`: a number or a decimal string.
fn opt_u32<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<u32>, D::Error> {
    let value = Option::<serde_json::Value>::deserialize(deserializer)?;
    let number = match &value {
        None | Some(serde_json::Value::Null) => return Ok(None),
        Some(serde_json::Value::Number(n)) => n.as_u64(),
        Some(serde_json::Value::String(s)) => s.parse::<u64>().ok(),
        Some(_) => None,
    };
    number
        .and_then(|n| u32::try_from(n).ok())
        .map(Some)
        .ok_or_else(|| de::Error::custom(format!("{} is not a uint32", value.unwrap_or_default())))
}

/// A proto3 JSON enum `HealthStatus`: its name or number.
fn health_status<'de, D: Deserializer<'de>>(deserializer: D) -> Result<i32, D::Error> {
    match serde_json::Value::deserialize(deserializer)? {
        serde_json::Value::Number(n) => n
            .as_i64()
            .and_then(|n| i32::try_from(n).ok())
            .ok_or_else(|| de::Error::custom(format!("health_status {n} is not an int32"))),
        serde_json::Value::String(name) => HealthStatus::from_str_name(&name)
            .map(|s| s as i32)
            .ok_or_else(|| de::Error::custom(format!("unknown health_status {name:?}"))),
        serde_json::Value::Null => Ok(0),
        other => Err(de::Error::custom(format!(
            "health_status {other} is neither a name nor a number"
        ))),
    }
}

impl From<JsonCla> for ClusterLoadAssignment {
    fn from(cla: JsonCla) -> Self {
        ClusterLoadAssignment {
            cluster_name: cla.cluster_name,
            endpoints: cla
                .endpoints
                .into_iter()
                .map(LocalityLbEndpoints::from)
                .collect(),
            ..Default::default()
        }
    }
}

impl From<JsonLocalityLbEndpoints> for LocalityLbEndpoints {
    fn from(json: JsonLocalityLbEndpoints) -> Self {
        LocalityLbEndpoints {
            locality: json.locality.map(|l| Locality {
                region: l.region,
                zone: l.zone,
                sub_zone: l.sub_zone,
            }),
            lb_endpoints: json
                .lb_endpoints
                .into_iter()
                .map(LbEndpoint::from)
                .collect(),
            load_balancing_weight: json
                .load_balancing_weight
                .map(|value| UInt32Value { value }),
            priority: json.priority.unwrap_or(0),
            lb_config: json
                .leds_cluster_locality_config
                .map(|_| LbConfig::LedsClusterLocalityConfig(LedsClusterLocalityConfig::default())),
            ..Default::default()
        }
    }
}

impl From<JsonLbEndpoint> for LbEndpoint {
    fn from(json: JsonLbEndpoint) -> Self {
        LbEndpoint {
            host_identifier: json.endpoint.map(|e| {
                HostIdentifier::Endpoint(Endpoint {
                    address: e.address.map(Address::from),
                    hostname: e.hostname,
                    ..Default::default()
                })
            }),
            health_status: json.health_status,
            metadata: json.metadata.map(Metadata::from),
            load_balancing_weight: json
                .load_balancing_weight
                .map(|value| UInt32Value { value }),
        }
    }
}

impl From<JsonAddress> for Address {
    fn from(json: JsonAddress) -> Self {
        let address = if let Some(socket) = json.socket_address {
            let port_specifier = match (socket.port_value, socket.named_port) {
                (Some(port), _) => Some(PortSpecifier::PortValue(port)),
                (None, Some(name)) => Some(PortSpecifier::NamedPort(name)),
                (None, None) => None,
            };
            Some(address::Address::SocketAddress(SocketAddress {
                address: socket.address,
                resolver_name: socket.resolver_name,
                port_specifier,
                ..Default::default()
            }))
        } else if json.pipe.is_some() {
            Some(address::Address::Pipe(Pipe::default()))
        } else {
            json.envoy_internal_address
                .map(|_| address::Address::EnvoyInternalAddress(EnvoyInternalAddress::default()))
        };
        Address { address }
    }
}

impl From<JsonMetadata> for Metadata {
    fn from(json: JsonMetadata) -> Self {
        let filter_metadata = json
            .filter_metadata
            .into_iter()
            .map(|(namespace, fields)| {
                let fields = fields.into_iter().map(|(k, v)| (k, scalar(v))).collect();
                (namespace, Struct { fields })
            })
            .collect();
        Metadata {
            filter_metadata,
            ..Default::default()
        }
    }
}

/// A JSON scalar as a `google.protobuf.Value`; lists and objects become kind-less values,
/// which the host mapping skips like it skips protobuf lists and structs.
fn scalar(value: serde_json::Value) -> Value {
    let kind = match value {
        serde_json::Value::String(s) => Some(Kind::StringValue(s)),
        serde_json::Value::Bool(b) => Some(Kind::BoolValue(b)),
        serde_json::Value::Number(n) => n.as_f64().map(Kind::NumberValue),
        serde_json::Value::Null => Some(Kind::NullValue(0)),
        serde_json::Value::Array(_) | serde_json::Value::Object(_) => None,
    };
    Value { kind }
}
