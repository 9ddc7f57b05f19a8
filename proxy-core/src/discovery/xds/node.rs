//! The node identity on the wire: [`NodeConfig`] as the `core.v3.Node` of every gRPC request,
//! and as proto3 JSON in every REST request. Both forms come from here, so a stream and a poll
//! always say the same thing.

use envoy_types::pb::{
    envoy::config::core::v3::{Locality, Node, node::UserAgentVersionType},
    google::protobuf::{ListValue, Struct, Value, value::Kind},
};
use serde_json::json;

use crate::config::sources::xds::NodeConfig;

/// What we call ourselves in `user_agent_name` (Envoy sends "envoy"); control planes log it and
/// some match on it.
pub const USER_AGENT_NAME: &str = "proxy";

/// The daemon's version, sent as `user_agent_version`.
pub const USER_AGENT_VERSION: &str = env!("CARGO_PKG_VERSION");

/// The node as sent on a gRPC stream.
pub fn to_proto(node: &NodeConfig) -> Node {
    Node {
        id: node.id.clone(),
        cluster: node.cluster.clone(),
        metadata: (!node.metadata.is_empty()).then(|| Struct {
            fields: node
                .metadata
                .iter()
                .map(|(k, v)| (k.clone(), value(v)))
                .collect(),
        }),
        locality: node.locality.as_ref().map(|l| Locality {
            region: l.region.clone(),
            zone: l.zone.clone(),
            sub_zone: l.sub_zone.clone(),
        }),
        user_agent_name: USER_AGENT_NAME.to_owned(),
        user_agent_version_type: Some(UserAgentVersionType::UserAgentVersion(
            USER_AGENT_VERSION.to_owned(),
        )),
        ..Default::default()
    }
}

/// The node as proto3 JSON (a REST request's `node`): a `Struct` is a plain JSON object there,
/// and empty fields are left out.
pub fn to_json(node: &NodeConfig) -> serde_json::Value {
    let mut out = json!({
        "id": node.id,
        "userAgentName": USER_AGENT_NAME,
        "userAgentVersion": USER_AGENT_VERSION,
    });
    let object = out.as_object_mut().expect("a JSON object literal");
    if !node.cluster.is_empty() {
        object.insert("cluster".into(), node.cluster.clone().into());
    }
    if !node.metadata.is_empty() {
        object.insert("metadata".into(), json!(node.metadata));
    }
    if let Some(l) = &node.locality {
        let mut locality = serde_json::Map::new();
        for (key, v) in [
            ("region", &l.region),
            ("zone", &l.zone),
            ("subZone", &l.sub_zone),
        ] {
            if !v.is_empty() {
                locality.insert(key.into(), v.clone().into());
            }
        }
        object.insert("locality".into(), locality.into());
    }
    out
}

/// A JSON value as a `google.protobuf.Value` (numbers become doubles, as in proto3 JSON).
fn value(v: &serde_json::Value) -> Value {
    let kind = match v {
        serde_json::Value::Null => Kind::NullValue(0),
        serde_json::Value::Bool(b) => Kind::BoolValue(*b),
        serde_json::Value::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or(f64::NAN)),
        serde_json::Value::String(s) => Kind::StringValue(s.clone()),
        serde_json::Value::Array(items) => Kind::ListValue(ListValue {
            values: items.iter().map(value).collect(),
        }),
        serde_json::Value::Object(fields) => Kind::StructValue(Struct {
            fields: fields.iter().map(|(k, v)| (k.clone(), value(v))).collect(),
        }),
    };
    Value { kind: Some(kind) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::sources::xds::NodeLocality;

    fn node() -> NodeConfig {
        serde_norway::from_str(
            "id: n1\ncluster: edge\nmetadata: {team: payments, shard: 3, canary: true, \
             tags: [a, b], nested: {k: v}}\nlocality: {region: eu, zone: eu-1a}\n",
        )
        .unwrap()
    }

    #[test]
    fn the_grpc_node_carries_metadata_locality_and_the_user_agent() {
        let n = to_proto(&node());
        assert_eq!((n.id.as_str(), n.cluster.as_str()), ("n1", "edge"));
        let fields = n.metadata.unwrap().fields;
        let kind = |k: &str| fields[k].kind.clone().unwrap();
        assert_eq!(kind("team"), Kind::StringValue("payments".into()));
        assert_eq!(kind("shard"), Kind::NumberValue(3.0));
        assert_eq!(kind("canary"), Kind::BoolValue(true));
        let Kind::ListValue(tags) = kind("tags") else {
            panic!("tags is a list")
        };
        assert_eq!(tags.values.len(), 2);
        let Kind::StructValue(nested) = kind("nested") else {
            panic!("nested is a struct")
        };
        assert_eq!(nested.fields["k"].kind, Some(Kind::StringValue("v".into())));
        assert_eq!(
            n.locality,
            Some(Locality {
                region: "eu".into(),
                zone: "eu-1a".into(),
                sub_zone: String::new()
            })
        );
        assert_eq!(n.user_agent_name, "proxy");
        assert!(matches!(
            n.user_agent_version_type,
            Some(UserAgentVersionType::UserAgentVersion(v)) if v == USER_AGENT_VERSION
        ));
    }

    #[test]
    fn a_bare_node_sends_no_metadata_or_locality() {
        let n = to_proto(&NodeConfig {
            id: "n1".into(),
            ..NodeConfig::default()
        });
        assert_eq!((n.metadata, n.locality), (None, None));
        assert_eq!(
            to_json(&NodeConfig {
                id: "n1".into(),
                ..NodeConfig::default()
            }),
            json!({"id": "n1", "userAgentName": "proxy", "userAgentVersion": USER_AGENT_VERSION})
        );
    }

    #[test]
    fn the_rest_node_is_proto3_json() {
        let mut n = node();
        n.locality = Some(NodeLocality {
            sub_zone: "rack-7".into(),
            ..NodeLocality::default()
        });
        let j = to_json(&n);
        assert_eq!(j["cluster"], "edge");
        assert_eq!(j["metadata"]["shard"], 3);
        assert_eq!(j["metadata"]["nested"]["k"], "v");
        assert_eq!(j["locality"], json!({"subZone": "rack-7"}));
    }

    #[test]
    fn unknown_node_fields_are_refused() {
        let err = serde_norway::from_str::<NodeConfig>("id: n1\nzone: a\n").unwrap_err();
        assert!(err.to_string().contains("unknown field `zone`"), "{err}");
    }
}
