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
use crate::{
    discovery::xds::cla::{
        ClaError, LOCALITY_REGION, LOCALITY_SUB_ZONE, LOCALITY_ZONE, Rule, hosts_from_cla,
    },
    host::EdsHealth,
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
    // Outside the enum: Envoy has no `defined_only` rule there and routes such a host.
    let mut lb = endpoint("10.0.0.1", 80);
    lb.health_status = 42;
    let hosts = hosts_from_cla(&one(lb)).unwrap();
    assert_eq!(hosts[0].eds_health, EdsHealth::Unknown);
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
    loc.load_balancing_weight = Some(UInt32Value { value: 3 });
    let assignment = ClusterLoadAssignment {
        cluster_name: "web".into(),
        endpoints: vec![loc],
        ..Default::default()
    };
    let host = hosts_from_cla(&assignment).unwrap().remove(0);
    assert_eq!(host.addr, "[2001:db8::1]:8443".parse().unwrap());
    assert_eq!((host.weight, host.priority), (7, 2));
    assert_eq!(host.hostname(), Some("web-1.example"));
    let zone = ("eu", "eu-1a", "rack-4");
    let l = &host.locality();
    assert_eq!(
        (l.region.as_str(), l.zone.as_str(), l.sub_zone.as_str()),
        zone
    );
    assert_eq!(host.locality_weight, Some(3));
    let meta: Vec<_> = host
        .metadata()
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
    assert_eq!(host.hostname(), None);
    assert_eq!(host.locality_weight, None);
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

/// Envoy's chain from the assignment down to one endpoint's socket address.
const SOCKET: &str = "ClusterLoadAssignmentValidationError.Endpoints[0]: embedded message failed validation | caused by LocalityLbEndpointsValidationError.LbEndpoints[0]: embedded message failed validation | caused by LbEndpointValidationError.Endpoint: embedded message failed validation | caused by EndpointValidationError.Address: embedded message failed validation | caused by ";

#[test]
fn proto_rules_are_reported_in_envoys_words() {
    let socket = format!(
        "{SOCKET}AddressValidationError.SocketAddress: embedded message failed validation | caused by "
    );
    let cases: Vec<(LbEndpoint, String)> = vec![
        (
            endpoint("10.0.0.1", 70000),
            format!("{socket}SocketAddressValidationError.PortValue: value must be less than or equal to 65535"),
        ),
        (
            with_socket(|s| s.port_specifier = None),
            format!("{socket}field: \"port_specifier\", reason: is required"),
        ),
        (
            endpoint("", 80),
            format!("{socket}SocketAddressValidationError.Address: value length must be at least 1 characters"),
        ),
        (
            with_address(Some(Address::default())),
            format!("{SOCKET}field: \"address\", reason: is required"),
        ),
        (
            weighted(0),
            "ClusterLoadAssignmentValidationError.Endpoints[0]: embedded message failed validation | caused by LocalityLbEndpointsValidationError.LbEndpoints[0]: embedded message failed validation | caused by LbEndpointValidationError.LoadBalancingWeight: value must be greater than or equal to 1".to_owned(),
        ),
    ];
    for (lb, chain) in cases {
        let error = error_of(lb);
        assert!(matches!(error, ClaError::Constraint { .. }), "{error:?}");
        assert_eq!(
            error.to_string(),
            format!("Proto constraint validation failed ({chain})")
        );
    }
}

#[test]
fn proto_rules_come_in_field_order() {
    // The endpoint (field 2 of the locality) is checked before the locality's own weight
    // (field 3) and priority (field 5); the name (field 1 of the assignment) before all.
    let mut assignment = one(weighted(0));
    assignment.endpoints[0].load_balancing_weight = Some(UInt32Value { value: 0 });
    let chain = |e: ClaError| match e {
        ClaError::Constraint { violation } => violation.rule,
        other => panic!("{other:?}"),
    };
    assert_eq!(
        chain(hosts_from_cla(&assignment).unwrap_err()),
        Rule::EndpointWeight
    );
    assignment.endpoints[0].lb_endpoints.clear();
    assignment.endpoints[0].priority = 129;
    assert_eq!(
        chain(hosts_from_cla(&assignment).unwrap_err()),
        Rule::LocalityWeight
    );
    assignment.endpoints[0].load_balancing_weight = None;
    assert_eq!(
        hosts_from_cla(&assignment).unwrap_err().to_string(),
        "Proto constraint validation failed (ClusterLoadAssignmentValidationError.Endpoints[0]: embedded message failed validation | caused by LocalityLbEndpointsValidationError.Priority: value must be less than or equal to 128)"
    );
    assignment.endpoints[0].priority = 128;
    assert!(hosts_from_cla(&assignment).unwrap().is_empty());
    assignment.cluster_name.clear();
    assignment.endpoints[0].priority = 129;
    assert_eq!(
        hosts_from_cla(&assignment).unwrap_err().to_string(),
        "Proto constraint validation failed (ClusterLoadAssignmentValidationError.ClusterName: value length must be at least 1 characters)"
    );
}

#[test]
fn unusable_endpoints_are_rejected_with_envoys_words() {
    let cases: Vec<(LbEndpoint, &str)> = vec![
        (
            LbEndpoint::default(),
            "Address must be set: endpoints[0].lb_endpoints[0] has no endpoint",
        ),
        (
            with_address(None),
            "Address must be set: endpoints[0].lb_endpoints[0].endpoint.address has no address",
        ),
        (
            endpoint("web.local", 80),
            "malformed IP address: web.local. EDS endpoints must be IP literals (endpoints[0].lb_endpoints[0].endpoint.address)",
        ),
        (
            with_socket(|s| s.port_specifier = Some(PortSpecifier::NamedPort("http".into()))),
            "IP resolver can't handle port specifier type 4: endpoints[0].lb_endpoints[0].endpoint.address has named_port \"http\", use port_value",
        ),
        (
            with_socket(|s| s.resolver_name = "dns".into()),
            "Unknown address resolver: dns.",
        ),
        (
            with_address(Some(Address {
                address: Some(address::Address::Pipe(Pipe::default())),
            })),
            "endpoints[0].lb_endpoints[0].endpoint.address: only socket addresses are supported, not a pipe address",
        ),
    ];
    for (lb, expected) in cases {
        let message = error_of(lb).to_string();
        assert!(
            message.starts_with(expected),
            "{message:?} should start with {expected:?}"
        );
    }
}

#[test]
fn port_zero_and_never_routable_addresses_are_hosts_of_the_assignment() {
    // Envoy keeps them (every connect fails); the cluster's loop refuses them (`guard`).
    let assignment = ClusterLoadAssignment {
        cluster_name: "web".into(),
        endpoints: vec![locality(
            0,
            vec![
                endpoint("10.0.0.1", 0),
                endpoint("0.0.0.0", 80),
                endpoint("224.0.0.1", 80),
                endpoint("10.0.0.2", 80),
            ],
        )],
        ..Default::default()
    };
    let hosts = hosts_from_cla(&assignment).unwrap();
    let addrs: Vec<String> = hosts.iter().map(|h| h.addr.to_string()).collect();
    assert_eq!(
        addrs,
        ["10.0.0.1:0", "0.0.0.0:80", "224.0.0.1:80", "10.0.0.2:80"]
    );
    let guard = crate::config::host_guard::HostGuard::default();
    let (kept, refused) = guard.filter(hosts);
    assert_eq!(kept.len(), 1);
    assert_eq!(refused[0].1, "port 0");
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

/// An endpoint whose `Address` is `address` (`None`: no `Address` at all).
fn with_address(address: Option<Address>) -> LbEndpoint {
    let mut lb = endpoint("10.0.0.1", 80);
    let Some(HostIdentifier::Endpoint(e)) = &mut lb.host_identifier else {
        unreachable!()
    };
    e.address = address;
    lb
}

#[test]
fn leds_localities_are_rejected() {
    let mut assignment = cla("web", &[80]);
    assignment.endpoints[0].lb_config = Some(LbConfig::LedsClusterLocalityConfig(
        LedsClusterLocalityConfig {
            leds_collection_name: "xdstp://leds/web".into(),
            ..Default::default()
        },
    ));
    assert_eq!(
        hosts_from_cla(&assignment).unwrap_err().to_string(),
        "A ClusterLoadAssignment for cluster web cannot include both LEDS (resource: xdstp://leds/web) and a list of endpoints."
    );
    assignment.endpoints[0].lb_endpoints.clear();
    assert!(matches!(
        hosts_from_cla(&assignment),
        Err(ClaError::Leds { .. })
    ));
}

/// `health_check_config` becomes the host's check target; its address must be an IP literal
/// like the endpoint's, and a port above 65535 breaks the proto rule with Envoy's words.
#[test]
fn health_check_config_maps_to_the_check_target() {
    use envoy_types::pb::envoy::config::endpoint::v3::endpoint::HealthCheckConfig;
    let with = |check: HealthCheckConfig| {
        let mut lb = endpoint("10.0.0.1", 80);
        let Some(HostIdentifier::Endpoint(e)) = &mut lb.host_identifier else {
            unreachable!()
        };
        e.health_check_config = Some(check);
        lb
    };
    let alternate = |ip: &str| {
        let Some(HostIdentifier::Endpoint(e)) = endpoint(ip, 81).host_identifier else {
            unreachable!()
        };
        e.address
    };
    let hosts = hosts_from_cla(&one(with(HealthCheckConfig {
        port_value: 9000,
        hostname: "health.web".into(),
        address: alternate("10.0.0.9"),
        disable_active_health_check: true,
    })))
    .unwrap();
    let check = &hosts[0].health_check();
    assert_eq!(check.addr(hosts[0].addr).to_string(), "10.0.0.9:9000");
    assert_eq!(check.hostname.as_deref(), Some("health.web"));
    assert!(check.disabled);

    let err = error_of(with(HealthCheckConfig {
        address: alternate("health.test"),
        ..HealthCheckConfig::default()
    }));
    assert!(
        err.to_string()
            .contains("malformed IP address: health.test"),
        "{err}"
    );
    let err = error_of(with(HealthCheckConfig {
        port_value: 70_000,
        ..HealthCheckConfig::default()
    }));
    assert!(
        err.to_string().contains(
            "HealthCheckConfigValidationError.PortValue: value must be less than or equal to 65535"
        ),
        "{err}"
    );
}

/// A policy's staleness was ACKed and ignored: it is refused by name (Envoy acts on it). The
/// overprovisioning factor and weighted priority health are honoured: they come with the
/// hosts; a factor of 0 breaks Envoy's proto rule. (`drop_overloads`:
/// `drop_overloads_are_honoured_or_refused_as_envoy_refuses_them`.) (An endpoint's `health_check_config` is
/// honoured: `health_check_config_maps_to_the_check_target`.)
#[test]
fn the_policy_is_honoured_or_refused_by_name() {
    use envoy_types::pb::envoy::config::endpoint::v3::cluster_load_assignment::Policy;

    use crate::{discovery::xds::cla::assignment_policy, health::AssignmentPolicy};
    let policy = |policy: Policy| ClusterLoadAssignment {
        policy: Some(policy),
        ..cla("web", &[80])
    };
    let factor = |value| Policy {
        overprovisioning_factor: Some(UInt32Value { value }),
        ..Default::default()
    };
    assert_eq!(
        assignment_policy(&cla("web", &[80])),
        Ok(AssignmentPolicy::default())
    );
    let weighted = policy(Policy {
        weighted_priority_health: true,
        ..factor(200)
    });
    assert!(hosts_from_cla(&weighted).is_ok());
    let want = AssignmentPolicy {
        overprovisioning_factor: 200,
        weighted_priority_health: true,
        ..AssignmentPolicy::default()
    };
    assert_eq!(assignment_policy(&weighted), Ok(want));
    let zero = hosts_from_cla(&policy(factor(0))).expect_err("factor 0");
    assert!(
        zero.to_string().contains(
            "ClusterLoadAssignmentValidationError.Policy: embedded message failed validation | caused by PolicyValidationError.OverprovisioningFactor: value must be greater than 0"
        ),
        "{zero}"
    );
    // The lease: above 0 (Envoy's proto rule and text), read as a duration.
    let lease = |seconds, nanos| {
        policy(Policy {
            endpoint_stale_after: Some(envoy_types::pb::google::protobuf::Duration {
                seconds,
                nanos,
            }),
            ..Default::default()
        })
    };
    for (seconds, nanos) in [(0, 0), (-1, 0), (0, -5)] {
        let error = hosts_from_cla(&lease(seconds, nanos))
            .expect_err("not above 0")
            .to_string();
        assert!(
            error.contains(
                "ClusterLoadAssignmentValidationError.Policy: embedded message failed validation | caused by PolicyValidationError.EndpointStaleAfter: value must be greater than 0s"
            ),
            "{seconds}s {nanos}ns: {error}"
        );
    }
    let leased = lease(2, 500_000_000);
    assert!(hosts_from_cla(&leased).is_ok());
    assert_eq!(
        crate::discovery::xds::cla::stale_after(&leased),
        Some(std::time::Duration::from_millis(2500))
    );
    assert_eq!(
        crate::discovery::xds::cla::stale_after(&policy(factor(200))),
        None
    );
}

/// `drop_overloads` travels with the hosts in parts per million; Envoy's proto rules (a
/// category, a defined denominator) and its own checks (one category, at most 1) refuse the
/// assignment with Envoy's texts.
#[test]
fn drop_overloads_are_honoured_or_refused_as_envoy_refuses_them() {
    use envoy_types::pb::envoy::{
        config::endpoint::v3::cluster_load_assignment::{Policy, policy::DropOverload},
        r#type::v3::FractionalPercent,
    };

    use crate::discovery::xds::cla::assignment_policy;
    let drop = |category: &str, numerator, denominator| DropOverload {
        category: category.into(),
        drop_percentage: Some(FractionalPercent {
            numerator,
            denominator,
        }),
    };
    let with = |drops: Vec<DropOverload>| ClusterLoadAssignment {
        policy: Some(Policy {
            drop_overloads: drops,
            ..Policy::default()
        }),
        ..cla("web", &[80])
    };
    // TEN_THOUSAND is 1: 25 / 10,000 is 2,500 per million.
    let quarter = with(vec![drop("throttle", 25, 1)]);
    assert_eq!(hosts_from_cla(&quarter).map(|h| h.len()), Ok(1));
    let share = assignment_policy(&quarter).unwrap().drop_overload;
    assert_eq!(share.per_million(), 2_500);
    let error = |drops| hosts_from_cla(&with(drops)).unwrap_err().to_string();
    assert_eq!(
        error(vec![drop("a", 1, 0), drop("b", 1, 0)]),
        "Cluster drop_overloads config has 2 categories. Envoy only support one."
    );
    assert_eq!(
        error(vec![drop("a", 101, 0)]),
        "Cluster drop_overloads config is invalid. drop_ratio=1.01(Numerator 101 / Denominator 100). The valid range is 0~1."
    );
    let policy = "Proto constraint validation failed (ClusterLoadAssignmentValidationError.Policy: embedded message failed validation | caused by PolicyValidationError.DropOverloads[0]: embedded message failed validation | caused by DropOverloadValidationError.";
    assert_eq!(
        error(vec![drop("", 1, 0)]),
        format!("{policy}Category: value length must be at least 1 characters)")
    );
    assert_eq!(
        error(vec![drop("a", 1, 7)]),
        format!(
            "{policy}DropPercentage: embedded message failed validation | caused by FractionalPercentValidationError.Denominator: value must be one of the defined enum values)"
        )
    );
}
