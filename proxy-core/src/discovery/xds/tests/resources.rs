//! CDS and LDS: decoding into the file's forms, the file's rules, warming, clashes, the state
//! of the world and delta paths to one overlay, and the RDS names asked as listeners change.

use envoy_types::pb::{
    envoy::{
        config::{
            cluster::v3::{
                Cluster, OutlierDetection,
                cluster::{
                    ClusterDiscoveryType, DiscoveryType, EdsClusterConfig, LbConfig, LbPolicy,
                    MaglevLbConfig, RingHashLbConfig,
                },
            },
            core::v3::{
                Address, AggregatedConfigSource, ConfigSource, SocketAddress, address,
                config_source::ConfigSourceSpecifier, socket_address::PortSpecifier,
            },
            listener::v3::{Filter, FilterChain, Listener, filter::ConfigType},
        },
        extensions::filters::network::tcp_proxy::v3::{
            TcpProxy,
            tcp_proxy::{ClusterSpecifier, WeightedCluster, weighted_cluster::ClusterWeight},
        },
        service::discovery::v3::{DeltaDiscoveryResponse, DiscoveryResponse, Resource},
    },
    google::protobuf::{Any, UInt64Value},
};
use prost::Message;
use tokio::sync::watch;

use super::{
    fixtures::cla,
    hcm::{http_listener, prefix, rds_hcm, rds_state, route_configuration, routes_sotw},
};
use crate::{
    config::{ClusterType, ServiceMode, sources::xds::XdsConfig},
    desired::Overlay,
    discovery::xds::{
        cds::CLUSTER_TYPE_URL,
        lds::{HCM_TYPE_URL, LISTENER_TYPE_URL, TCP_PROXY_TYPE_URL},
        resources::{FileNames, ResourceState, ResponseError},
    },
};

pub fn xds() -> XdsConfig {
    serde_norway::from_str(
        "node: {id: n1, cluster: edge}\nads_config: {api_type: GRPC, server_uri: '127.0.0.1:18000'}\ncds_config: {ads: {}}\nlds_config: {ads: {}}",
    )
    .expect("a valid xds block")
}

/// A state whose LDS has answered once (empty), so that CDS responses publish.
pub fn state(file: FileNames) -> (ResourceState, watch::Receiver<Overlay>) {
    let (tx, rx) = watch::channel(Overlay::default());
    let mut state = ResourceState::new(xds(), file, tx);
    state.apply_sotw(&listeners("0", &[])).expect("ACK");
    (state, rx)
}

pub fn static_cluster(name: &str, port: u32) -> Cluster {
    Cluster {
        name: name.into(),
        cluster_discovery_type: Some(ClusterDiscoveryType::Type(DiscoveryType::Static as i32)),
        lb_policy: LbPolicy::Random as i32,
        load_assignment: Some(cla(name, &[port])),
        ..Default::default()
    }
}

fn eds_cluster(name: &str) -> Cluster {
    let ads = ConfigSource {
        config_source_specifier: Some(ConfigSourceSpecifier::Ads(AggregatedConfigSource {})),
        ..Default::default()
    };
    Cluster {
        name: name.into(),
        cluster_discovery_type: Some(ClusterDiscoveryType::Type(DiscoveryType::Eds as i32)),
        eds_cluster_config: Some(EdsClusterConfig {
            eds_config: Some(ads),
            service_name: format!("{name}-svc"),
        }),
        ..Default::default()
    }
}

pub fn listener(name: &str, port: u32, target: ClusterSpecifier) -> Listener {
    listener_with(
        name,
        port,
        TCP_PROXY_TYPE_URL,
        TcpProxy {
            stat_prefix: name.into(),
            cluster_specifier: Some(target),
            ..Default::default()
        }
        .encode_to_vec(),
    )
}

pub fn listener_with(name: &str, port: u32, type_url: &str, value: Vec<u8>) -> Listener {
    let socket = SocketAddress {
        address: "127.77.0.1".into(),
        port_specifier: Some(PortSpecifier::PortValue(port)),
        ..Default::default()
    };
    let filter = Filter {
        name: "envoy.filters.network.tcp_proxy".into(),
        config_type: Some(ConfigType::TypedConfig(Any {
            type_url: type_url.into(),
            value,
        })),
    };
    Listener {
        name: name.into(),
        address: Some(Address {
            address: Some(address::Address::SocketAddress(socket)),
        }),
        filter_chains: vec![FilterChain {
            filters: vec![filter],
            ..Default::default()
        }],
        ..Default::default()
    }
}

pub fn any<M: Message>(type_url: &str, message: &M) -> Any {
    Any {
        type_url: type_url.into(),
        value: message.encode_to_vec(),
    }
}

fn sotw(type_url: &str, version: &str, resources: Vec<Any>) -> DiscoveryResponse {
    DiscoveryResponse {
        version_info: version.into(),
        resources,
        type_url: type_url.into(),
        nonce: format!("n{version}"),
        ..Default::default()
    }
}

pub fn clusters(version: &str, list: &[Cluster]) -> DiscoveryResponse {
    let resources = list.iter().map(|c| any(CLUSTER_TYPE_URL, c)).collect();
    sotw(CLUSTER_TYPE_URL, version, resources)
}

pub fn listeners(version: &str, list: &[Listener]) -> DiscoveryResponse {
    let resources = list.iter().map(|l| any(LISTENER_TYPE_URL, l)).collect();
    sotw(LISTENER_TYPE_URL, version, resources)
}

fn names(overlay: &Overlay) -> (Vec<String>, Vec<String>) {
    (
        overlay.clusters.iter().map(|c| c.name.clone()).collect(),
        overlay.services.iter().map(|s| s.name.clone()).collect(),
    )
}

#[test]
fn cds_clusters_become_file_clusters() {
    let (mut state, rx) = state(FileNames::default());
    state
        .apply_sotw(&clusters(
            "1",
            &[static_cluster("a", 9001), eds_cluster("b")],
        ))
        .expect("ACK");
    let overlay = rx.borrow().clone();
    let a = &overlay.clusters[0];
    assert_eq!(
        (a.name.as_str(), a.cluster_type),
        ("a", ClusterType::Static)
    );
    assert_eq!(a.static_hosts()[0].addr.to_string(), "127.0.0.1:9001");
    let b = &overlay.clusters[1];
    assert_eq!(b.cluster_type, ClusterType::Eds);
    let eds = b.eds_cluster_config.as_ref().expect("eds_cluster_config");
    assert!(eds.eds_config.ads.is_some());
    assert_eq!(eds.service_name.as_deref(), Some("b-svc"));
    assert_eq!(state.version_info(CLUSTER_TYPE_URL), "1");
}

#[test]
fn unsupported_field_is_nacked_by_name_and_the_last_good_state_kept() {
    let (mut state, rx) = state(FileNames::default());
    state
        .apply_sotw(&clusters("1", &[static_cluster("a", 9001)]))
        .expect("ACK");
    let mut bad = static_cluster("a", 9002);
    bad.outlier_detection = Some(OutlierDetection::default());
    let error = state.apply_sotw(&clusters("2", &[bad])).expect_err("NACK");
    assert_eq!(
        error.to_string(),
        "cluster \"a\": field outlier_detection is not supported by this daemon (it would be ignored); remove it or serve this resource to Envoy only"
    );
    assert_eq!(state.version_info(CLUSTER_TYPE_URL), "1");
    assert_eq!(rx.borrow().clusters[0].static_hosts()[0].addr.port(), 9001);
}

#[test]
fn the_file_rules_refuse_a_cluster_naming_the_field() {
    let (mut state, _rx) = state(FileNames::default());
    let mut maglev = static_cluster("a", 9001);
    maglev.lb_policy = LbPolicy::Maglev as i32;
    maglev.lb_config = Some(LbConfig::MaglevLbConfig(MaglevLbConfig {
        table_size: Some(UInt64Value { value: 65_536 }),
    }));
    let error = state
        .apply_sotw(&clusters("1", &[maglev]))
        .expect_err("NACK");
    let text = error.to_string();
    assert!(
        text.starts_with(
            "cluster \"a\": maglev_lb_config: The table size of maglev must be prime number"
        ),
        "{text}"
    );
}

/// RING_HASH and MAGLEV with their configs arrive as the file's fields.
#[test]
fn ring_hash_and_maglev_configs_are_honoured() {
    let (mut state, rx) = state(FileNames::default());
    let mut ring = static_cluster("a", 9001);
    ring.lb_policy = LbPolicy::RingHash as i32;
    ring.lb_config = Some(LbConfig::RingHashLbConfig(RingHashLbConfig {
        minimum_ring_size: Some(UInt64Value { value: 2048 }),
        ..RingHashLbConfig::default()
    }));
    let mut maglev = static_cluster("b", 9002);
    maglev.lb_policy = LbPolicy::Maglev as i32;
    maglev.lb_config = Some(LbConfig::MaglevLbConfig(MaglevLbConfig {
        table_size: Some(UInt64Value { value: 13 }),
    }));
    state
        .apply_sotw(&clusters("1", &[ring, maglev]))
        .expect("ACK");
    let overlay = rx.borrow();
    let sizes = overlay.clusters[0]
        .ring_hash_lb_config
        .as_ref()
        .unwrap()
        .sizes();
    assert_eq!(sizes, (2048, 8_388_608));
    let table = overlay.clusters[1]
        .maglev_lb_config
        .as_ref()
        .unwrap()
        .size();
    assert_eq!(table, 13);
}

#[test]
fn a_listener_waits_for_its_cluster_then_serves_it() {
    let (mut state, rx) = state(FileNames::default());
    let web = listener("web", 8080, ClusterSpecifier::Cluster("a".into()));
    state
        .apply_sotw(&listeners("1", &[web]))
        .expect("ACK: held, not refused");
    assert_eq!(names(&rx.borrow()), (vec![], vec![]));
    state
        .apply_sotw(&clusters("1", &[static_cluster("a", 9001)]))
        .expect("ACK");
    let overlay = rx.borrow().clone();
    assert_eq!(names(&overlay), (vec!["a".into()], vec!["web".into()]));
    let web = &overlay.services[0];
    assert_eq!(
        (web.address.to_string(), web.port),
        ("127.77.0.1".into(), 8080)
    );
    assert_eq!((web.cluster.as_str(), web.mode), ("a", ServiceMode::Direct));
}

#[test]
fn a_listener_may_name_a_file_cluster() {
    let mut file = FileNames::default();
    file.clusters.insert("f".into(), ClusterType::Static);
    let (mut state, rx) = state(file);
    let web = listener("web", 8080, ClusterSpecifier::Cluster("f".into()));
    state.apply_sotw(&listeners("1", &[web])).expect("ACK");
    // No CDS cluster at all: its first answer is empty.
    state.apply_sotw(&clusters("1", &[])).expect("ACK");
    assert_eq!(names(&rx.borrow()), (vec![], vec!["web".into()]));
}

#[test]
fn weighted_clusters_become_a_split_summing_to_100() {
    let (mut state, rx) = state(FileNames::default());
    let weight = |name: &str| ClusterWeight {
        name: name.into(),
        weight: 1,
        ..Default::default()
    };
    let split = WeightedCluster {
        clusters: vec![weight("a"), weight("b"), weight("c")],
    };
    let web = listener("web", 8080, ClusterSpecifier::WeightedClusters(split));
    let list = [
        static_cluster("a", 1),
        static_cluster("b", 2),
        static_cluster("c", 3),
    ];
    state.apply_sotw(&clusters("1", &list)).expect("ACK");
    state.apply_sotw(&listeners("1", &[web])).expect("ACK");
    let overlay = rx.borrow().clone();
    assert_eq!(overlay.services[0].chain.as_deref(), Some("web"));
    let json = serde_json::to_value(&overlay.config_entries).expect("entries serialize");
    // Consul's weights are f32 percentages: compare in hundredths.
    #[expect(clippy::cast_possible_truncation, reason = "percentages in hundredths")]
    let hundredths: Vec<i64> = json[0]["Splits"]
        .as_array()
        .expect("splits")
        .iter()
        .map(|s| (s["Weight"].as_f64().expect("a weight") * 100.0).round() as i64)
        .collect();
    assert_eq!(hundredths, [3334, 3333, 3333]);
}

#[test]
fn a_name_the_file_defines_is_refused_naming_both_sources() {
    let mut file = FileNames::default();
    file.clusters.insert("a".into(), ClusterType::Static);
    let (mut state, rx) = state(file);
    let error = state
        .apply_sotw(&clusters("1", &[static_cluster("a", 9001)]))
        .expect_err("NACK");
    assert!(matches!(error, ResponseError::Clash { .. }));
    assert_eq!(
        error.to_string(),
        "cluster \"a\" is defined both in the configuration file (clusters) and by xDS; a name may come from one source only, rename one of them"
    );
    assert!(rx.borrow().is_empty());
}

#[test]
fn sotw_removal_withdraws_and_delta_takes_the_same_path() {
    let (mut state, rx) = state(FileNames::default());
    let web = listener("web", 8080, ClusterSpecifier::Cluster("a".into()));
    state
        .apply_sotw(&clusters("1", &[static_cluster("a", 9001)]))
        .expect("ACK");
    state
        .apply_sotw(&listeners("1", std::slice::from_ref(&web)))
        .expect("ACK");
    state.apply_sotw(&listeners("2", &[])).expect("ACK");
    assert_eq!(names(&rx.borrow()), (vec!["a".into()], vec![]));
    let added = DeltaDiscoveryResponse {
        type_url: LISTENER_TYPE_URL.into(),
        resources: vec![Resource {
            name: "web".into(),
            version: "v1".into(),
            resource: Some(any(LISTENER_TYPE_URL, &web)),
            ..Default::default()
        }],
        nonce: "d1".into(),
        ..Default::default()
    };
    state.apply_delta(&added).expect("ACK");
    assert_eq!(names(&rx.borrow()).1, ["web"]);
    assert_eq!(state.delta_versions(LISTENER_TYPE_URL)["web"], "v1");
    let removed = DeltaDiscoveryResponse {
        type_url: LISTENER_TYPE_URL.into(),
        removed_resources: vec!["web".into()],
        nonce: "d2".into(),
        ..Default::default()
    };
    state.apply_delta(&removed).expect("ACK");
    assert!(rx.borrow().services.is_empty());
}

#[test]
fn a_duplicate_name_in_one_response_is_refused() {
    let (mut state, _rx) = state(FileNames::default());
    let list = [static_cluster("a", 1), static_cluster("a", 2)];
    let error = state.apply_sotw(&clusters("1", &list)).expect_err("NACK");
    assert_eq!(error.to_string(), "duplicate cluster a found");
}

#[test]
fn the_first_overlay_waits_for_every_type_to_answer_once() {
    let (tx, mut rx) = watch::channel(Overlay::default());
    let mut state = ResourceState::new(xds(), FileNames::default(), tx);
    state
        .apply_sotw(&clusters("1", &[static_cluster("a", 9001)]))
        .expect("ACK");
    assert!(!rx.has_changed().expect("open"), "no partial first state");
    // A NACK is an answer too (Envoy's initialization goes on after a rejected first update).
    let http = listener_with("web", 8080, HCM_TYPE_URL, Vec::new());
    state
        .apply_sotw(&listeners("1", &[http]))
        .expect_err("NACK");
    assert!(rx.has_changed().expect("open"));
    assert_eq!(names(&rx.borrow_and_update()), (vec!["a".into()], vec![]));
}

#[test]
fn a_reloaded_file_that_takes_an_xds_name_is_refused_and_changes_nothing() {
    let (mut state, rx) = state(FileNames::default());
    state
        .apply_sotw(&clusters("1", &[static_cluster("a", 9001)]))
        .expect("ACK");
    let mut file = FileNames::default();
    file.clusters.insert("a".into(), ClusterType::Static);
    let error = state.set_file(file).expect_err("a clash");
    assert!(matches!(error, ResponseError::Clash { .. }), "{error}");
    // The old names stay: the same cluster is still accepted.
    state
        .apply_sotw(&clusters("2", &[static_cluster("a", 9002)]))
        .expect("ACK");
    assert_eq!(rx.borrow().clusters[0].static_hosts()[0].addr.port(), 9002);
}

#[test]
fn weighted_clusters_without_weight_are_refused() {
    let (mut state, _rx) = state(FileNames::default());
    let zero = ClusterWeight {
        name: "a".into(),
        weight: 0,
        ..Default::default()
    };
    let split = WeightedCluster {
        clusters: vec![zero],
    };
    let web = listener("web", 8080, ClusterSpecifier::WeightedClusters(split));
    let text = state
        .apply_sotw(&listeners("1", &[web]))
        .expect_err("NACK")
        .to_string();
    assert_eq!(
        text,
        "listener \"web\": tcp_proxy.weighted_clusters: needs at least one cluster and a total weight above 0"
    );
}

#[test]
fn the_route_names_asked_follow_the_listeners_sotw_and_delta() {
    let node = envoy_types::pb::envoy::config::core::v3::Node::default();
    let (mut state, _rx) = rds_state();
    state.stream_started();
    let first = state.route_request_sotw(&node).expect("r1 asked");
    assert_eq!(first.resource_names, ["r1"]);
    assert!(state.route_request_sotw(&node).is_none(), "asked once");
    let r1 = route_configuration("r1", vec![prefix("/", "a")]);
    state.apply_sotw(&routes_sotw("1", &[r1])).expect("ACK");
    let two = [
        http_listener(&rds_hcm("r2")),
        listener_with("api", 8081, HCM_TYPE_URL, rds_hcm("r2").encode_to_vec()),
    ];
    state.apply_sotw(&listeners("2", &two)).expect("ACK");
    let next = state.route_request_sotw(&node).expect("the names changed");
    let seen = (
        next.resource_names.as_slice(),
        next.version_info.as_str(),
        next.response_nonce.as_str(),
    );
    assert_eq!(seen, (["r2".to_owned()].as_slice(), "1", "r1"));
    state
        .apply_sotw(&listeners("3", &[http_listener(&rds_hcm("r3"))]))
        .expect("ACK");
    let delta = state
        .route_request_delta(&node, false)
        .expect("the names changed");
    assert_eq!(
        (
            delta.resource_names_subscribe,
            delta.resource_names_unsubscribe
        ),
        (vec!["r3".to_owned()], vec!["r2".to_owned()])
    );
    state.apply_sotw(&listeners("4", &[])).expect("ACK");
    let none = state.route_request_sotw(&node).expect("the names changed");
    assert!(none.resource_names.is_empty(), "nothing left to ask for");
}

/// The held forms are JSON texts put side by side into one document: each is checked as the
/// file's cluster at its place, and a refusal names the cluster whose text it is.
#[test]
fn cluster_texts_are_checked_in_place_and_a_refusal_names_its_cluster() {
    use crate::discovery::xds::cds::{ResourceError, validate};
    let form = |name: &str, lb: &str| {
        serde_json::json!({"name": name, "type": "STATIC", "lb_policy": lb,
            "load_assignment": {"endpoints": [{"lb_endpoints": [{"endpoint": {"address":
                {"socket_address": {"address": "127.0.0.1", "port_value": 80}}}}]}]}})
        .to_string()
    };
    let good = [
        ("a".to_owned(), form("a", "RANDOM")),
        ("b".to_owned(), form("b", "MAGLEV")),
    ];
    let typed = validate(&good, &xds()).expect("both are valid clusters");
    let names: Vec<&str> = typed.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, ["a", "b"]);
    let bad = [
        ("a".to_owned(), form("a", "RANDOM")),
        ("b".to_owned(), form("b", "NOPE")),
    ];
    match validate(&bad, &xds()) {
        Err(ResourceError::Invalid { name, field, .. }) => {
            assert_eq!((name.as_str(), field.as_str()), ("b", "lb_policy"));
        }
        other => panic!("expected b's lb_policy refused, got {other:?}"),
    }
}

#[test]
fn a_response_that_leaves_the_clusters_keeps_their_checked_form() {
    let (mut state, rx) = state(FileNames::default());
    state
        .apply_sotw(&clusters("1", &[static_cluster("a", 9001)]))
        .expect("ACK");
    let before = rx.borrow().clusters.clone();
    let web = listener("web", 8080, ClusterSpecifier::Cluster("a".into()));
    state.apply_sotw(&listeners("1", &[web])).expect("ACK");
    let after = rx.borrow().clone();
    assert_eq!(names(&after), (vec!["a".into()], vec!["web".into()]));
    assert!(
        std::sync::Arc::ptr_eq(&before, &after.clusters),
        "a listener change does not check the clusters again"
    );
    // A changed cluster is checked again, and its new form published.
    state
        .apply_sotw(&clusters("2", &[static_cluster("a", 9002)]))
        .expect("ACK");
    let changed = rx.borrow().clusters.clone();
    assert!(!std::sync::Arc::ptr_eq(&before, &changed));
    assert_eq!(changed[0].static_hosts()[0].addr.port(), 9002);
}
