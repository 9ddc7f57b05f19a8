//! `ClusterLoadAssignment` → `HostSet`: every field, every health status, every rejection.

use std::collections::HashMap;

use envoy_types::pb::{
    envoy::config::{
        core::v3::{Address, Metadata, Pipe, address, socket_address::PortSpecifier},
        endpoint::v3::{
            ClusterLoadAssignment, LbEndpoint, LedsClusterLocalityConfig,
            lb_endpoint::HostIdentifier, locality_lb_endpoints::LbConfig,
        },
    },
    google::protobuf::{ListValue, Struct, UInt32Value, Value, value::Kind},
};

use super::fixtures::{cla, endpoint, locality};
use crate::discovery::{
    EdsHealth,
    xds::cla::{ClaError, LOCALITY_REGION, LOCALITY_SUB_ZONE, LOCALITY_ZONE, hosts_from_cla},
};

fn one(lb: LbEndpoint) -> ClusterLoadAssignment {
    ClusterLoadAssignment {
        cluster_name: "web".into(),
        endpoints: vec![locality(0, vec![lb])],
        ..Default::default()
    }
}

fn socket_mut(lb: &mut LbEndpoint) -> &mut envoy_types::pb::envoy::config::core::v3::SocketAddress {
    let Some(HostIdentifier::Endpoint(endpoint)) = &mut lb.host_identifier else {
        unreachable!()
    };
    let Some(address::Address::SocketAddress(socket)) =
        &mut endpoint.address.as_mut().unwrap().address
    else {
        unreachable!()
    };
    socket
}

fn error_of(lb: LbEndpoint) -> ClaError {
    hosts_from_cla(&one(lb)).expect_err("must be rejected")
}

#[test]
fn every_health_status_maps() {
    let expected = [
        (0, EdsHealth::Unknown),
        (1, EdsHealth::Healthy),
        (2, EdsHealth::Unhealthy),
        (3, EdsHealth::Draining),
        (4, EdsHealth::Timeout),
        (5, EdsHealth::Degraded),
    ];
    for (value, health) in expected {
        let mut lb = endpoint("10.0.0.1", 80);
        lb.health_status = value;
        let hosts = hosts_from_cla(&one(lb)).unwrap();
        assert_eq!(hosts[0].eds_health, health, "health_status {value}");
    }
    let mut lb = endpoint("10.0.0.1", 80);
    lb.health_status = 42;
    assert!(matches!(
        error_of(lb),
        ClaError::UnknownHealth { value: 42, .. }
    ));
}

#[test]
fn fields_map_to_host() {
    let mut lb = endpoint("2001:db8::1", 8443);
    lb.load_balancing_weight = Some(UInt32Value { value: 7 });
    let Some(HostIdentifier::Endpoint(e)) = &mut lb.host_identifier else {
        unreachable!()
    };
    e.hostname = "web-1.example".into();
    let fields = HashMap::from([
        (
            "version".to_owned(),
            Value {
                kind: Some(Kind::StringValue("v2".into())),
            },
        ),
        (
            "canary".to_owned(),
            Value {
                kind: Some(Kind::BoolValue(true)),
            },
        ),
        (
            "shard".to_owned(),
            Value {
                kind: Some(Kind::NumberValue(3.0)),
            },
        ),
        (
            "list".to_owned(),
            Value {
                kind: Some(Kind::ListValue(ListValue::default())),
            },
        ),
    ]);
    let mut metadata = Metadata::default();
    metadata
        .filter_metadata
        .insert("envoy.lb".into(), Struct { fields });
    metadata
        .filter_metadata
        .insert("other".into(), Struct::default());
    lb.metadata = Some(metadata);
    let mut loc = locality(2, vec![lb]);
    loc.locality.as_mut().unwrap().sub_zone = "rack-4".into();
    let assignment = ClusterLoadAssignment {
        cluster_name: "web".into(),
        endpoints: vec![loc],
        ..Default::default()
    };
    let host = hosts_from_cla(&assignment).unwrap().remove(0);
    assert_eq!(host.addr, "[2001:db8::1]:8443".parse().unwrap());
    assert_eq!((host.weight, host.priority), (7, 2));
    assert_eq!(host.hostname.as_deref(), Some("web-1.example"));
    let meta: Vec<_> = host
        .metadata
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    assert_eq!(
        meta,
        [
            ("canary", "true"),
            (LOCALITY_REGION, "eu"),
            (LOCALITY_SUB_ZONE, "rack-4"),
            (LOCALITY_ZONE, "eu-1a"),
            ("shard", "3"),
            ("version", "v2"),
        ]
    );
}

#[test]
fn defaults_weight_one_no_hostname() {
    let host = hosts_from_cla(&cla("web", &[80])).unwrap().remove(0);
    assert_eq!(
        (host.weight, host.priority, host.eds_health),
        (1, 0, EdsHealth::Unknown)
    );
    assert_eq!(host.hostname, None);
}

#[test]
fn priority_gaps_are_accepted_like_envoy() {
    let assignment = ClusterLoadAssignment {
        cluster_name: "web".into(),
        endpoints: vec![
            locality(0, vec![endpoint("10.0.0.1", 80)]),
            locality(2, vec![endpoint("10.0.0.2", 80)]),
        ],
        ..Default::default()
    };
    let priorities: Vec<_> = hosts_from_cla(&assignment)
        .unwrap()
        .iter()
        .map(|h| h.priority)
        .collect();
    assert_eq!(priorities, [0, 2]);
}

#[test]
fn duplicate_address_keeps_first_and_empty_assignment_is_no_hosts() {
    let mut second = endpoint("127.0.0.1", 80);
    second.load_balancing_weight = Some(UInt32Value { value: 9 });
    let assignment = ClusterLoadAssignment {
        cluster_name: "web".into(),
        endpoints: vec![
            locality(0, vec![endpoint("127.0.0.1", 80)]),
            locality(1, vec![second]),
        ],
        ..Default::default()
    };
    let hosts = hosts_from_cla(&assignment).unwrap();
    assert_eq!(hosts.len(), 1);
    assert_eq!((hosts[0].weight, hosts[0].priority), (1, 0));
    assert!(hosts_from_cla(&cla("web", &[])).unwrap().is_empty());
}

#[test]
fn invalid_endpoints_are_rejected() {
    let cases: Vec<(LbEndpoint, &str)> = vec![
        (LbEndpoint::default(), "has no endpoint"),
        (
            endpoint("web.local", 80),
            "malformed IP address \"web.local\"",
        ),
        (endpoint("10.0.0.1", 0), "port 0 is out of range"),
        (endpoint("10.0.0.1", 70000), "port 70000 is out of range"),
        (weighted(0), "load_balancing_weight must be at least 1"),
        (
            with_socket(|s| s.port_specifier = Some(PortSpecifier::NamedPort("http".into()))),
            "named port",
        ),
        (
            with_socket(|s| s.port_specifier = None),
            "has no port_value",
        ),
        (
            with_socket(|s| s.resolver_name = "dns".into()),
            "custom resolver",
        ),
        (with_address(None), "endpoint has no address"),
        (
            with_address(Some(address::Address::Pipe(Pipe::default()))),
            "not a pipe address",
        ),
    ];
    for (lb, expected) in cases {
        let message = error_of(lb).to_string();
        assert!(
            message.contains(expected),
            "{message:?} should contain {expected:?}"
        );
        assert!(
            message.starts_with("endpoints[0].lb_endpoints[0]"),
            "{message}"
        );
    }
}

fn weighted(weight: u32) -> LbEndpoint {
    let mut lb = endpoint("10.0.0.1", 80);
    lb.load_balancing_weight = Some(UInt32Value { value: weight });
    lb
}

fn with_socket(
    f: impl FnOnce(&mut envoy_types::pb::envoy::config::core::v3::SocketAddress),
) -> LbEndpoint {
    let mut lb = endpoint("10.0.0.1", 80);
    f(socket_mut(&mut lb));
    lb
}

fn with_address(address: Option<address::Address>) -> LbEndpoint {
    let mut lb = endpoint("10.0.0.1", 80);
    let Some(HostIdentifier::Endpoint(e)) = &mut lb.host_identifier else {
        unreachable!()
    };
    e.address = address.map(|address| Address {
        address: Some(address),
    });
    lb
}

#[test]
fn invalid_localities_and_names_are_rejected() {
    let mut assignment = cla("web", &[80]);
    assignment.endpoints[0].load_balancing_weight = Some(UInt32Value { value: 0 });
    assert_eq!(
        hosts_from_cla(&assignment).unwrap_err(),
        ClaError::ZeroWeight {
            at: "endpoints[0].load_balancing_weight".into()
        }
    );
    let mut assignment = cla("web", &[80]);
    assignment.endpoints[0].lb_config = Some(LbConfig::LedsClusterLocalityConfig(
        LedsClusterLocalityConfig::default(),
    ));
    assert!(matches!(
        hosts_from_cla(&assignment),
        Err(ClaError::Leds { .. })
    ));
    assert_eq!(
        hosts_from_cla(&cla("", &[80])),
        Err(ClaError::EmptyClusterName)
    );
}
