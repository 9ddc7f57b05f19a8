//! Config parsing (the example file), planning into connections, and config errors.

use std::{collections::BTreeMap, net::SocketAddr, time::Duration};

use serde::Deserialize;

use crate::config::sources::xds::{
    ApiType, EdsClusterConfig, EdsWatch, GrpcApi, Transport, XdsConfig, XdsConfigError, plan,
    transport_socket::TransportSocket,
};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Example {
    xds: XdsConfig,
    clusters: BTreeMap<String, EdsClusterConfig>,
}

fn resolve(name: &str) -> Option<(SocketAddr, Option<TransportSocket>)> {
    (name == "xds_cluster").then(|| ("127.0.0.1:18000".parse().unwrap(), None))
}

fn example() -> Example {
    serde_norway::from_str(include_str!("eds.example.yaml")).expect("example parses")
}

fn clusters(example: &Example) -> Vec<(String, EdsClusterConfig)> {
    example
        .clusters
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

#[test]
fn example_plans_three_connections() {
    let example = example();
    let groups = plan(&example.xds, &clusters(&example), &resolve).unwrap();
    assert_eq!(
        groups.len(),
        4,
        "ADS web and api differ only in initial_fetch_timeout"
    );
    let ads: Vec<_> = groups
        .iter()
        .filter(|(s, _)| {
            matches!(
                s.transport,
                Transport::Grpc {
                    api: GrpcApi::Aggregated,
                    ..
                }
            )
        })
        .collect();
    assert_eq!(ads.len(), 2);
    for (source, _) in &ads {
        assert_eq!(
            source.transport,
            Transport::Grpc {
                uri: "http://127.0.0.1:18000".into(),
                api: GrpcApi::Aggregated,
                delta: true
            }
        );
        assert_eq!(
            source.backoff,
            (Duration::from_millis(250), Duration::from_secs(10))
        );
    }
    let web = groups.iter().find(|(_, w)| w[0].cluster == "web").unwrap();
    assert_eq!(
        web.1,
        [EdsWatch {
            cluster: "web".into(),
            resource: "web-v1".into()
        }]
    );
    assert_eq!(web.0.initial_fetch_timeout, Duration::from_secs(5));
    let rest = groups
        .iter()
        .find(|(_, w)| w[0].cluster == "legacy")
        .unwrap();
    assert_eq!(
        rest.0.transport,
        Transport::Rest {
            uri: "http://127.0.0.1:18080".into(),
            refresh_delay: Duration::from_secs(2),
            request_timeout: Duration::from_millis(500)
        }
    );
    let billing = groups
        .iter()
        .find(|(_, w)| w[0].cluster == "billing")
        .unwrap();
    assert!(
        matches!(&billing.0.transport, Transport::Grpc { uri, api: GrpcApi::Endpoint, delta: false } if uri == "http://127.0.0.1:18001")
    );
    assert_eq!(
        billing.0.initial_fetch_timeout,
        Duration::from_secs(15),
        "Envoy's default"
    );
}

#[test]
fn config_serializes_back_and_reparses() {
    let example = example();
    let yaml = serde_norway::to_string(&example.xds).unwrap();
    assert_eq!(
        serde_norway::from_str::<XdsConfig>(&yaml).unwrap(),
        example.xds
    );
    assert!(yaml.contains("api_type: DELTA_GRPC"), "{yaml}");
}

fn plan_one(xds: &str, cluster: &str) -> Result<(), XdsConfigError> {
    let xds: XdsConfig = serde_norway::from_str(xds).unwrap();
    let cluster: EdsClusterConfig = serde_norway::from_str(cluster).unwrap();
    plan(&xds, &[("web".into(), cluster)], &resolve).map(|_| ())
}

#[test]
fn config_errors_name_the_problem() {
    let node = "node: {id: n}";
    let cases = [
        (
            "node: {id: ''}",
            "eds_config: {ads: {}}",
            "node.id must not be empty",
        ),
        (node, "eds_config: {ads: {}}", "there is no ads_config"),
        (
            node,
            "eds_config: {}",
            "exactly one of api_config_source and ads",
        ),
        (
            node,
            "eds_config: {api_config_source: {api_type: REST, server_uri: '127.0.0.1:1'}}",
            "refresh_delay must be set",
        ),
        (
            node,
            "eds_config: {api_config_source: {api_type: GRPC}}",
            "exactly one grpc_services entry",
        ),
        (
            node,
            "eds_config: {api_config_source: {api_type: GRPC, grpc_services: [{envoy_grpc: {cluster_name: nope}}]}}",
            "\"nope\" is not a known static cluster",
        ),
        (
            node,
            "eds_config: {api_config_source: {api_type: GRPC, server_uri: 'https://127.0.0.1:1'}}",
            "is https:// but no TLS is configured",
        ),
        (
            node,
            "eds_config: {api_config_source: {api_type: GRPC, server_uri: '127.0.0.1'}}",
            "host:port",
        ),
        (
            "{node: {id: n}, ads_config: {api_type: REST, server_uri: '127.0.0.1:1'}}",
            "eds_config: {ads: {}}",
            "GRPC or DELTA_GRPC",
        ),
        (
            node,
            "eds_config: {api_config_source: {api_type: GRPC, server_uri: '127.0.0.1:1', retry_back_off: {base_interval: 2s, max_interval: 1s}}}",
            "retry_back_off",
        ),
    ];
    for (xds, cluster, expected) in cases {
        let error = plan_one(xds, cluster).expect_err(cluster).to_string();
        assert!(
            error.contains(expected),
            "{error:?} should contain {expected:?}"
        );
    }
    assert!(
        plan_one(
            node,
            "eds_config: {api_config_source: {api_type: GRPC, server_uri: '127.0.0.1:1'}}"
        )
        .is_ok()
    );
}

#[test]
fn unknown_fields_and_versions_are_rejected() {
    let unknown = serde_norway::from_str::<EdsClusterConfig>("eds_config: {ads: {}, bogus: 1}");
    assert!(
        unknown
            .unwrap_err()
            .to_string()
            .contains("unknown field `bogus`")
    );
    let v2 = serde_norway::from_str::<EdsClusterConfig>(
        "eds_config: {ads: {}, resource_api_version: V2}",
    );
    assert!(v2.is_err());
    let rest: EdsClusterConfig = serde_norway::from_str("eds_config: {api_config_source: {api_type: REST, server_uri: '127.0.0.1:1', refresh_delay: 1s}}").unwrap();
    assert_eq!(
        rest.eds_config.api_config_source.unwrap().api_type,
        ApiType::Rest
    );
}

/// `refresh_delay` on a gRPC source, or `server_uri` beside `grpc_services`, was accepted and
/// never read: each field the source's `api_type` does not read is refused by name.
#[test]
fn a_field_the_api_type_does_not_read_is_refused() {
    let node = "node: {id: n}";
    let grpc = "api_type: GRPC, server_uri: '127.0.0.1:1'";
    let rest = "api_type: REST, refresh_delay: 1s";
    for (source, expected) in [
        (
            format!("{grpc}, grpc_services: [{{envoy_grpc: {{cluster_name: x}}}}]"),
            "server_uri replaces grpc_services and cluster_names",
        ),
        (
            format!("{grpc}, cluster_names: [x]"),
            "server_uri replaces grpc_services and cluster_names",
        ),
        (
            format!("{rest}, cluster_names: [x], grpc_services: [{{envoy_grpc: {{cluster_name: x}}}}]"),
            "grpc_services is for GRPC and DELTA_GRPC",
        ),
        (
            "api_type: DELTA_GRPC, cluster_names: [x], grpc_services: [{envoy_grpc: {cluster_name: x}}]".to_owned(),
            "cluster_names is for REST",
        ),
        (format!("{grpc}, refresh_delay: 1s"), "refresh_delay is REST's polling interval"),
        (format!("{grpc}, request_timeout: 2s"), "request_timeout bounds one REST poll"),
    ] {
        let cluster = format!("eds_config: {{api_config_source: {{{source}}}}}");
        let error = plan_one(node, &cluster).expect_err(&cluster).to_string();
        assert!(error.contains(expected), "{error:?} should contain {expected:?}");
        assert!(error.contains("api_config_source"), "{error:?} names the source");
    }
    let polled = format!(
        "eds_config: {{api_config_source: {{{rest}, server_uri: '127.0.0.1:1', request_timeout: 2s}}}}"
    );
    assert!(plan_one(node, &polled).is_ok(), "REST reads both");
}

/// An `xds` section with CDS or LDS but a bad `ads_config` passed `proxy check` (the start found
/// it), and one that nothing subscribes through was accepted and did nothing: both are refused.
#[test]
fn an_xds_section_is_checked_whatever_subscribes_and_refused_when_nothing_does() {
    let parse = |text: &str| crate::config::Config::parse(text, std::path::Path::new("t.yaml"));
    let node = "xds:\n  node: { id: n }\n";
    let bad = format!("{node}  ads_config: {{ api_type: GRPC, server_uri: 'not an address' }}\n");
    let err = parse(&format!("{bad}  cds_config: {{ ads: {{}} }}\n")).expect_err("bad uri");
    assert_eq!(err.field(), Some("xds"), "{err}");
    let err = parse(&format!("{node}  lds_config: {{ ads: {{}} }}\n")).expect_err("no ads");
    assert!(err.to_string().contains("set ads_config"), "{err}");
    let err = parse(&bad).expect_err("nothing subscribes");
    assert_eq!(err.field(), Some("xds"), "{err}");
    assert!(err.to_string().contains("nothing subscribes"), "{err}");
    let good = format!("{node}  ads_config: {{ api_type: GRPC, server_uri: '127.0.0.1:18000' }}\n");
    parse(&format!("{good}  cds_config: {{ ads: {{}} }}\n")).expect("CDS over a good ADS");
}
