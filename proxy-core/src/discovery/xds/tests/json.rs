//! The proto3 JSON mapping of REST responses.

use serde_json::json;

use crate::{
    discovery::xds::{
        CLA_TYPE_URL, UpdateError, hosts_from_cla, json::discovery_response, state::decode_all,
    },
    host::EdsHealth,
};

#[test]
fn parses_camel_and_snake_case_strings_and_wrappers() {
    let body = json!({
        "version_info": "v9",
        "nonce": "x",
        "resources": [{
            "@type": CLA_TYPE_URL,
            "cluster_name": "web",
            "endpoints": [{
                "locality": {"region": "eu", "subZone": "r1"},
                "priority": "1",
                "loadBalancingWeight": 3,
                "lb_endpoints": [{
                    "endpoint": {"address": {"socket_address": {"address": "10.0.0.1", "port_value": "8080"}}, "hostname": "a"},
                    "health_status": 5,
                    "load_balancing_weight": 4,
                    "metadata": {"filterMetadata": {"envoy.lb": {"version": "v1", "nested": {"x": 1}}}}
                }, {
                    "endpoint": {"address": {"socketAddress": {"address": "10.0.0.2", "portValue": 8081}}},
                    "healthStatus": "DRAINING"
                }]
            }]
        }]
    });
    let response = discovery_response(body.to_string().as_bytes()).unwrap();
    assert_eq!(
        (response.version_info.as_str(), response.nonce.as_str()),
        ("v9", "x")
    );
    let clas = decode_all(&response.resources).unwrap();
    let hosts = hosts_from_cla(&clas[0]).unwrap();
    assert_eq!(hosts[0].addr, "10.0.0.1:8080".parse().unwrap());
    assert_eq!(
        (hosts[0].weight, hosts[0].priority, hosts[0].eds_health),
        (4, 1, EdsHealth::Degraded)
    );
    assert_eq!(hosts[0].hostname(), Some("a"));
    assert_eq!(
        hosts[0].metadata().get("version").map(String::as_str),
        Some("v1")
    );
    assert!(!hosts[0].metadata().contains_key("nested"));
    assert_eq!(
        hosts[0]
            .metadata()
            .get("locality.sub_zone")
            .map(String::as_str),
        Some("r1")
    );
    assert_eq!(
        (hosts[1].weight, hosts[1].eds_health),
        (1, EdsHealth::Draining)
    );
}

#[test]
fn wrong_type_and_garbage_are_errors() {
    let body = json!({"versionInfo": "1", "resources": [{"@type": "type.googleapis.com/envoy.config.cluster.v3.Cluster", "name": "web"}]});
    let response = discovery_response(body.to_string().as_bytes()).unwrap();
    assert!(matches!(
        decode_all(&response.resources),
        Err(UpdateError::TypeUrlMismatch { index: 0, .. })
    ));
    assert!(discovery_response(b"not json").is_err());
    let bad_port = json!({"resources": [{"@type": CLA_TYPE_URL, "clusterName": "web", "endpoints": [{"lbEndpoints": [
        {"endpoint": {"address": {"socketAddress": {"address": "10.0.0.1", "portValue": -1}}}}]}]}]});
    let error = discovery_response(bad_port.to_string().as_bytes()).unwrap_err();
    assert!(
        error.contains("resource 0 is not a ClusterLoadAssignment"),
        "{error}"
    );
    let bad_health = json!({"resources": [{"@type": CLA_TYPE_URL, "clusterName": "web", "endpoints": [{"lbEndpoints": [
        {"healthStatus": "SICK"}]}]}]});
    assert!(
        discovery_response(bad_health.to_string().as_bytes())
            .unwrap_err()
            .contains("SICK")
    );
}
