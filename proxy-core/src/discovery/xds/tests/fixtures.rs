//! Builders of xDS messages for the tests.

use std::time::Duration;

use envoy_types::pb::{
    envoy::{
        config::{
            core::v3::{Address, Locality, SocketAddress, address, socket_address::PortSpecifier},
            endpoint::v3::{
                ClusterLoadAssignment, Endpoint, LbEndpoint, LocalityLbEndpoints,
                lb_endpoint::HostIdentifier,
            },
        },
        service::discovery::v3::{DeltaDiscoveryResponse, DiscoveryResponse, Resource},
    },
    google::protobuf::Any,
};
use prost::Message;
use tokio::sync::watch;

use crate::discovery::{SourceUpdate as EdsUpdate, xds::CLA_TYPE_URL};

/// Upper bound of every wait in the tests.
pub const WAIT: Duration = Duration::from_secs(5);

/// An endpoint at `ip:port` with defaults everywhere else.
pub fn endpoint(ip: &str, port: u32) -> LbEndpoint {
    let socket = SocketAddress {
        address: ip.to_owned(),
        port_specifier: Some(PortSpecifier::PortValue(port)),
        ..Default::default()
    };
    LbEndpoint {
        host_identifier: Some(HostIdentifier::Endpoint(Endpoint {
            address: Some(Address {
                address: Some(address::Address::SocketAddress(socket)),
            }),
            ..Default::default()
        })),
        ..Default::default()
    }
}

/// A locality at `priority` holding `endpoints`.
pub fn locality(priority: u32, endpoints: Vec<LbEndpoint>) -> LocalityLbEndpoints {
    LocalityLbEndpoints {
        lb_endpoints: endpoints,
        priority,
        locality: Some(Locality {
            region: "eu".into(),
            zone: "eu-1a".into(),
            sub_zone: String::new(),
        }),
        ..Default::default()
    }
}

/// An assignment of `name` with one priority-0 locality of `127.0.0.1:<port>` endpoints.
pub fn cla(name: &str, ports: &[u32]) -> ClusterLoadAssignment {
    let endpoints = ports.iter().map(|&p| endpoint("127.0.0.1", p)).collect();
    ClusterLoadAssignment {
        cluster_name: name.into(),
        endpoints: vec![locality(0, endpoints)],
        ..Default::default()
    }
}

/// `cla` packed in an `Any`.
pub fn any(cla: &ClusterLoadAssignment) -> Any {
    Any {
        type_url: CLA_TYPE_URL.into(),
        value: cla.encode_to_vec(),
    }
}

/// A SotW response.
pub fn sotw(version: &str, nonce: &str, clas: &[ClusterLoadAssignment]) -> DiscoveryResponse {
    DiscoveryResponse {
        version_info: version.into(),
        resources: clas.iter().map(any).collect(),
        type_url: CLA_TYPE_URL.into(),
        nonce: nonce.into(),
        ..Default::default()
    }
}

/// A delta response adding `(version, assignment)` pairs and removing `removed`.
pub fn delta(
    nonce: &str,
    added: &[(&str, ClusterLoadAssignment)],
    removed: &[&str],
) -> DeltaDiscoveryResponse {
    DeltaDiscoveryResponse {
        system_version_info: nonce.into(),
        resources: added
            .iter()
            .map(|(version, cla)| Resource {
                name: cla.cluster_name.clone(),
                version: (*version).into(),
                resource: Some(any(cla)),
                ..Default::default()
            })
            .collect(),
        type_url: CLA_TYPE_URL.into(),
        removed_resources: removed.iter().map(|r| (*r).to_owned()).collect(),
        nonce: nonce.into(),
        ..Default::default()
    }
}

/// Ports of the hosts of an update.
pub fn ports(update: &EdsUpdate) -> Vec<u16> {
    update.hosts.iter().map(|h| h.addr.port()).collect()
}

/// Waits (bounded) until the published state satisfies `f`.
pub async fn wait_for(
    rx: &mut watch::Receiver<EdsUpdate>,
    what: &str,
    f: impl Fn(&EdsUpdate) -> bool,
) -> EdsUpdate {
    let result = tokio::time::timeout(WAIT, rx.wait_for(|u| f(u)))
        .await
        .map(|r| r.map(|update| update.clone()));
    match result {
        Ok(Ok(update)) => update,
        Ok(Err(_closed)) => panic!("update channel closed while waiting for {what}"),
        Err(elapsed) => panic!(
            "waiting for {what}: {elapsed}; last state: {:?}",
            *rx.borrow()
        ),
    }
}
