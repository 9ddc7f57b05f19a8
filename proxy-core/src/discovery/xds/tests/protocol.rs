//! An endpoint's `socket_address.protocol` in the three sources (file, CDS inline, EDS):
//! Envoy's `TCP` and `UDP` are accepted and change nothing, as in Envoy 1.40, whose tcp_proxy
//! connects TCP to a `UDP` endpoint (seen on a real Envoy): a host serves its service's
//! protocol. Another value does not parse in the file; on the wire it is an enum number, and
//! Envoy accepts any.

use std::path::Path;

use envoy_types::pb::envoy::config::{
    cluster::v3::Cluster as XdsCluster,
    core::v3::{address, socket_address::Protocol},
    endpoint::v3::{ClusterLoadAssignment, lb_endpoint::HostIdentifier},
};

use super::{
    fixtures::cla,
    resources::{clusters, state, static_cluster},
};
use crate::{
    config::{Config, SocketProtocol},
    discovery::xds::{cla::hosts_from_cla, resources::FileNames},
};

/// `cla` with every endpoint's `protocol` set to `protocol`.
fn with_protocol(mut cla: ClusterLoadAssignment, protocol: i32) -> ClusterLoadAssignment {
    for lb in cla.endpoints.iter_mut().flat_map(|l| &mut l.lb_endpoints) {
        let Some(HostIdentifier::Endpoint(endpoint)) = &mut lb.host_identifier else {
            unreachable!("fixtures make endpoints")
        };
        let Some(address::Address::SocketAddress(socket)) =
            &mut endpoint.address.as_mut().expect("an address").address
        else {
            unreachable!("fixtures make socket addresses")
        };
        socket.protocol = protocol;
    }
    cla
}

fn file(protocol: &str) -> Result<Config, crate::config::ConfigError> {
    let text = format!(
        "clusters:\n  - name: a\n    load_assignment: {{ endpoints: [ {{ lb_endpoints: [ {{ endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: 9001{protocol} }} }} }} }} ] }} ] }}\n"
    );
    Config::parse(&text, Path::new("t.yaml"))
}

#[test]
fn the_file_takes_tcp_and_udp_with_the_same_host_and_dumps_them() {
    let plain = file("").expect("no protocol");
    for (given, want) in [("TCP", SocketProtocol::Tcp), ("UDP", SocketProtocol::Udp)] {
        let config = file(&format!(", protocol: {given}")).expect(given);
        let c = &config.clusters[0];
        assert_eq!(
            c.static_hosts(),
            plain.clusters[0].static_hosts(),
            "{given}"
        );
        let sa = &c.load_assignment.as_ref().unwrap().endpoints[0].lb_endpoints[0]
            .endpoint
            .address
            .socket_address;
        assert_eq!(sa.protocol, Some(want));
        let dumped = serde_json::to_value(sa).unwrap();
        assert_eq!(dumped["protocol"], given, "/config_dump shows it as given");
    }
    let err = file(", protocol: SCTP").expect_err("SCTP").to_string();
    assert!(err.contains("protocol") && err.contains("SCTP"), "{err}");
}

#[test]
fn eds_takes_udp_endpoints_with_the_same_hosts() {
    let plain = hosts_from_cla(&cla("web", &[9001, 9002])).expect("plain");
    for protocol in [Protocol::Tcp as i32, Protocol::Udp as i32, 7] {
        let hosts = hosts_from_cla(&with_protocol(cla("web", &[9001, 9002]), protocol))
            .unwrap_or_else(|e| panic!("protocol {protocol}: {e}"));
        assert_eq!(hosts, plain, "protocol {protocol}");
    }
}

#[test]
fn cds_takes_an_inline_udp_endpoint_with_the_same_host() {
    let (mut state, rx) = state(FileNames::default());
    let udp = XdsCluster {
        load_assignment: Some(with_protocol(cla("a", &[9001]), Protocol::Udp as i32)),
        ..static_cluster("a", 9001)
    };
    state.apply_sotw(&clusters("1", &[udp])).expect("ACK");
    let overlay = rx.borrow().clone();
    let hosts = overlay.clusters[0].static_hosts();
    assert_eq!(hosts.len(), 1);
    assert_eq!(hosts[0].addr.to_string(), "127.0.0.1:9001");
}

/// A CDS inline endpoint naming a custom `resolver_name` is NACKed naming the field, as EDS
/// refuses it: this daemon has no custom resolvers, so the name would be ignored.
#[test]
fn cds_refuses_an_inline_endpoints_resolver_name() {
    let (mut state, _rx) = state(FileNames::default());
    let mut assignment = cla("a", &[9001]);
    for lb in assignment
        .endpoints
        .iter_mut()
        .flat_map(|l| &mut l.lb_endpoints)
    {
        let Some(HostIdentifier::Endpoint(endpoint)) = &mut lb.host_identifier else {
            unreachable!("fixtures make endpoints")
        };
        let Some(address::Address::SocketAddress(socket)) =
            &mut endpoint.address.as_mut().expect("an address").address
        else {
            unreachable!("fixtures make socket addresses")
        };
        socket.resolver_name = "envoy.resolvers.custom".into();
    }
    let custom = XdsCluster {
        load_assignment: Some(assignment),
        ..static_cluster("a", 9001)
    };
    let err = state
        .apply_sotw(&clusters("1", &[custom]))
        .expect_err("NACK")
        .to_string();
    assert!(err.contains("resolver_name"), "{err}");
}
