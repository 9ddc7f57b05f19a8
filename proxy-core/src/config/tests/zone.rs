//! Zone-aware routing's settings: what the file must name for it, and how it reaches the
//! cluster's settings.

use std::path::Path;

use crate::config::Config;

const CLUSTERS: &str = "clusters:
  - name: local
    load_assignment: {endpoints: [{locality: {zone: a}, lb_endpoints: [{endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: 80}}}}]}]}
  - name: web
    common_lb_config: {zone_aware_lb_config: {routing_enabled: {value: 40}, min_cluster_size: 3}}
    load_assignment: {endpoints: [{locality: {zone: a}, lb_endpoints: [{endpoint: {address: {socket_address: {address: 127.0.0.2, port_value: 80}}}}]}]}
";

fn error(text: &str) -> String {
    Config::parse(text, Path::new("t.yaml"))
        .expect_err("refused")
        .to_string()
}

#[test]
fn zone_aware_routing_needs_a_local_cluster_and_a_node_locality() {
    let whole = format!(
        "{CLUSTERS}cluster_manager: {{local_cluster_name: local}}\nnode: {{locality: {{zone: a}}}}\n"
    );
    let config = Config::parse(&whole, Path::new("t.yaml")).expect("valid");
    let web = config.cluster("web").expect("web");
    let zone = web
        .common_lb_config
        .zone_aware_lb_config
        .expect("zone-aware");
    let node = config.node.as_ref().expect("node").locality.clone();
    let settings = zone.settings(node.clone());
    assert_eq!(
        (
            settings.routing_enabled,
            settings.min_cluster_size,
            settings.fail_traffic_on_panic
        ),
        (40.0, 3, false)
    );
    assert_eq!(settings.node.zone, "a");

    let no_manager = error(&format!("{CLUSTERS}node: {{locality: {{zone: a}}}}\n"));
    assert!(no_manager.contains("zone_aware_lb_config"), "{no_manager}");
    assert!(
        no_manager.contains("cluster_manager.local_cluster_name"),
        "{no_manager}"
    );
    let no_node = error(&format!(
        "{CLUSTERS}cluster_manager: {{local_cluster_name: local}}\n"
    ));
    assert!(no_node.contains("node.locality"), "{no_node}");
    let unknown = error(&format!(
        "{CLUSTERS}cluster_manager: {{local_cluster_name: nope}}\nnode: {{locality: {{zone: a}}}}\n"
    ));
    assert!(
        unknown.contains("local cluster 'nope' must be defined"),
        "{unknown}"
    );
    let both = error(&whole.replace(
        "{zone_aware_lb_config:",
        "{locality_weighted_lb_config: {}, zone_aware_lb_config:",
    ));
    assert!(both.contains("sets both"), "{both}");
    let percent = error(&whole.replace("value: 40", "value: 140"));
    assert!(percent.contains("routing_enabled"), "{percent}");
}

#[test]
fn the_node_has_one_locality() {
    let text = format!(
        "{CLUSTERS}cluster_manager: {{local_cluster_name: local}}\nnode: {{locality: {{zone: a}}}}\nxds:\n  node: {{id: n1, locality: {{zone: b}}}}\n  ads_config: {{api_type: GRPC, grpc_services: [{{envoy_grpc: {{cluster_name: local}}}}]}}\n"
    );
    let err = error(&text);
    assert!(err.contains("differs from xds.node.locality"), "{err}");
}
