//! LDS listeners with an HTTP connection manager and an inline route table: the generated
//! service and chain entries, Envoy's defaults, cluster validation, and each refusal by name;
//! and their RDS form: warming on the route configuration, its changes, removal and refusals.

use envoy_types::pb::{
    envoy::{
        config::{
            core::v3::{
                AggregatedConfigSource, ApiVersion, ConfigSource,
                config_source::ConfigSourceSpecifier,
            },
            route::v3::{
                HeaderMatcher, QueryParameterMatcher, RedirectAction, RetryPolicy, Route,
                RouteAction, RouteConfiguration, RouteMatch, VirtualHost, WeightedCluster,
                header_matcher::HeaderMatchSpecifier,
                query_parameter_matcher::QueryParameterMatchSpecifier, route::Action,
                route_action::ClusterSpecifier, route_match::PathSpecifier,
                weighted_cluster::ClusterWeight,
            },
        },
        extensions::filters::network::http_connection_manager::v3::{
            HttpConnectionManager, HttpFilter, Rds,
            http_connection_manager::{CodecType, RouteSpecifier},
            http_filter::ConfigType,
        },
        service::discovery::v3::{DeltaDiscoveryResponse, DiscoveryResponse},
        r#type::matcher::v3::{RegexMatcher, StringMatcher, string_matcher::MatchPattern},
    },
    google::protobuf::{BoolValue, Duration, UInt32Value},
};
use prost::Message;
use serde_json::{Value, json};

use super::resources::{any, clusters, listener_with, listeners, state, static_cluster};
use crate::{
    config::ServiceMode,
    discovery::xds::{
        hcm::{ROUTE_TYPE_URL, ROUTER_TYPE_URL},
        lds::HCM_TYPE_URL,
        resources::{FileNames, ResponseError},
    },
};

fn route(path: PathSpecifier, cluster: &str) -> Route {
    Route {
        r#match: Some(RouteMatch {
            path_specifier: Some(path),
            ..Default::default()
        }),
        action: Some(Action::Route(RouteAction {
            cluster_specifier: Some(ClusterSpecifier::Cluster(cluster.into())),
            ..Default::default()
        })),
        ..Default::default()
    }
}

pub(super) fn prefix(p: &str, cluster: &str) -> Route {
    route(PathSpecifier::Prefix(p.into()), cluster)
}

pub(super) fn hcm(routes: Vec<Route>) -> HttpConnectionManager {
    let router = HttpFilter {
        name: "envoy.filters.http.router".into(),
        config_type: Some(ConfigType::TypedConfig(
            envoy_types::pb::google::protobuf::Any {
                type_url: ROUTER_TYPE_URL.into(),
                value: Vec::new(),
            },
        )),
        ..Default::default()
    };
    let vhost = VirtualHost {
        name: "all".into(),
        domains: vec!["*".into()],
        routes,
        ..Default::default()
    };
    HttpConnectionManager {
        stat_prefix: "web".into(),
        http_filters: vec![router],
        route_specifier: Some(RouteSpecifier::RouteConfig(RouteConfiguration {
            name: "local".into(),
            virtual_hosts: vec![vhost],
            ..Default::default()
        })),
        ..Default::default()
    }
}

pub(super) fn http_listener(
    h: &HttpConnectionManager,
) -> envoy_types::pb::envoy::config::listener::v3::Listener {
    listener_with("web", 8080, HCM_TYPE_URL, h.encode_to_vec())
}

/// An HCM whose routes come by RDS over ADS as `name`.
pub(super) fn rds_hcm(name: &str) -> HttpConnectionManager {
    let mut h = hcm(Vec::new());
    h.route_specifier = Some(RouteSpecifier::Rds(Rds {
        config_source: Some(ConfigSource {
            config_source_specifier: Some(ConfigSourceSpecifier::Ads(AggregatedConfigSource {})),
            resource_api_version: ApiVersion::V3.into(),
            ..Default::default()
        }),
        route_config_name: name.into(),
    }));
    h
}

/// The RDS resource `name` with one virtual host of `routes`.
pub(super) fn route_configuration(name: &str, routes: Vec<Route>) -> RouteConfiguration {
    let Some(RouteSpecifier::RouteConfig(mut config)) = hcm(routes).route_specifier else {
        unreachable!("an inline route table")
    };
    config.name = name.into();
    config
}

/// A SotW RDS response of `list`.
pub(super) fn routes_sotw(version: &str, list: &[RouteConfiguration]) -> DiscoveryResponse {
    DiscoveryResponse {
        version_info: version.into(),
        resources: list.iter().map(|r| any(ROUTE_TYPE_URL, r)).collect(),
        type_url: ROUTE_TYPE_URL.into(),
        nonce: format!("r{version}"),
        ..Default::default()
    }
}

fn vhost_mut(h: &mut HttpConnectionManager) -> &mut VirtualHost {
    let Some(RouteSpecifier::RouteConfig(c)) = &mut h.route_specifier else {
        unreachable!("an inline route table")
    };
    &mut c.virtual_hosts[0]
}

/// The NACK text of `h` served with clusters a and b known.
fn nack(h: &HttpConnectionManager) -> String {
    let (mut state, _rx) = state(FileNames::default());
    let known = [static_cluster("a", 9001), static_cluster("b", 9002)];
    state.apply_sotw(&clusters("1", &known)).expect("ACK");
    state
        .apply_sotw(&listeners("1", &[http_listener(h)]))
        .expect_err("NACK")
        .to_string()
}

fn entry(overlay: &crate::desired::Overlay, kind: &str, name: &str) -> Value {
    let all: Vec<Value> = overlay
        .config_entries
        .iter()
        .map(|e| serde_json::to_value(e).expect("serialisable"))
        .collect();
    all.into_iter()
        .find(|e| e["Kind"] == kind && e["Name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

#[test]
fn routes_become_a_router_in_envoys_order_with_envoys_defaults() {
    let mut header = prefix("/h", "b");
    header.r#match.as_mut().expect("match").headers = vec![HeaderMatcher {
        name: "x-v".into(),
        header_match_specifier: Some(HeaderMatchSpecifier::StringMatch(StringMatcher {
            match_pattern: Some(MatchPattern::Exact("2".into())),
            ..Default::default()
        })),
        ..Default::default()
    }];
    let mut query = prefix("/q", "b");
    query.r#match.as_mut().expect("match").query_parameters = vec![QueryParameterMatcher {
        name: "debug".into(),
        query_parameter_match_specifier: Some(QueryParameterMatchSpecifier::PresentMatch(true)),
    }];
    let regex = RegexMatcher {
        regex: "/r/[0-9]+".into(),
        ..Default::default()
    };
    let mut timed = route(PathSpecifier::Path("/exact".into()), "b");
    if let Some(Action::Route(a)) = &mut timed.action {
        a.timeout = Some(Duration {
            seconds: 2,
            nanos: 500_000_000,
        });
        a.idle_timeout = Some(Duration::default());
        a.prefix_rewrite = "/new".into();
    }
    let routes = vec![
        timed,
        header,
        query,
        route(PathSpecifier::SafeRegex(regex), "b"),
        prefix("/", "a"),
    ];
    let (mut state, rx) = state(FileNames::default());
    let known = [static_cluster("a", 9001), static_cluster("b", 9002)];
    state.apply_sotw(&clusters("1", &known)).expect("ACK");
    state
        .apply_sotw(&listeners("1", &[http_listener(&hcm(routes))]))
        .expect("ACK");
    let overlay = rx.borrow().clone();
    let [service] = overlay.services.as_slice() else {
        panic!("one service")
    };
    assert_eq!(
        (service.mode, service.chain.as_deref()),
        (ServiceMode::Proxy, Some("web"))
    );
    assert!(
        service.upgrade_configs.is_empty(),
        "Envoy allows no upgrade unless configured"
    );
    let router = entry(&overlay, "service-router", "web");
    let dest = |d: Value| {
        let mut d = d;
        d["IdleTimeout"] = json!("5m0s");
        d
    };
    let expected = json!([
        {"Match": {"HTTP": {"PathExact": "/exact"}}, "Destination": {"Service": "b", "RequestTimeout": "2.5s", "PrefixRewrite": "/new"}},
        {"Match": {"HTTP": {"PathPrefix": "/h", "Header": [{"Name": "x-v", "Exact": "2"}]}}, "Destination": dest(json!({"Service": "b", "RequestTimeout": "15s"}))},
        {"Match": {"HTTP": {"PathPrefix": "/q", "QueryParam": [{"Name": "debug", "Present": true}]}}, "Destination": dest(json!({"Service": "b", "RequestTimeout": "15s"}))},
        {"Match": {"HTTP": {"PathRegex": "/r/[0-9]+"}}, "Destination": dest(json!({"Service": "b", "RequestTimeout": "15s"}))},
        {"Match": {"HTTP": {"PathPrefix": "/"}}, "Destination": dest(json!({"Service": "a", "RequestTimeout": "15s"}))},
    ]);
    assert_eq!(router["Routes"], expected);
    for name in ["web", "a", "b"] {
        assert_eq!(
            entry(&overlay, "service-defaults", name)["Protocol"],
            "http"
        );
    }
}

#[test]
fn weighted_clusters_become_a_splitter_of_the_route() {
    let mut split = prefix("/", "a");
    let weight = |name: &str, w: u32| ClusterWeight {
        name: name.into(),
        weight: Some(UInt32Value { value: w }),
        ..Default::default()
    };
    if let Some(Action::Route(a)) = &mut split.action {
        a.cluster_specifier = Some(ClusterSpecifier::WeightedClusters(WeightedCluster {
            clusters: vec![weight("a", 1), weight("b", 2)],
            ..Default::default()
        }));
    }
    let (mut state, rx) = state(FileNames::default());
    let known = [static_cluster("a", 9001), static_cluster("b", 9002)];
    state.apply_sotw(&clusters("1", &known)).expect("ACK");
    state
        .apply_sotw(&listeners("1", &[http_listener(&hcm(vec![split]))]))
        .expect("ACK");
    let overlay = rx.borrow().clone();
    let router = entry(&overlay, "service-router", "web");
    assert_eq!(router["Routes"][0]["Destination"]["Service"], "web/route/0");
    let splitter = entry(&overlay, "service-splitter", "web/route/0");
    let splits: Vec<(String, f32)> =
        serde_json::from_value::<Vec<Value>>(splitter["Splits"].clone())
            .expect("a list")
            .iter()
            .map(|s| {
                (
                    s["Service"].as_str().expect("a name").to_owned(),
                    s["Weight"].as_f64().expect("a weight") as f32,
                )
            })
            .collect();
    assert_eq!(splits, [("a".to_owned(), 33.33), ("b".to_owned(), 66.67)]);
}

#[test]
fn an_unknown_cluster_is_refused_as_envoy_does_unless_validate_clusters_is_false() {
    let h = hcm(vec![prefix("/", "missing")]);
    assert!(
        nack(&h).ends_with("route_config: route: unknown cluster 'missing'"),
        "{}",
        nack(&h)
    );
    let mut lenient = h.clone();
    if let Some(RouteSpecifier::RouteConfig(c)) = &mut lenient.route_specifier {
        c.validate_clusters = Some(BoolValue { value: false });
    }
    let (mut state, rx) = state(FileNames::default());
    state
        .apply_sotw(&listeners("1", &[http_listener(&lenient)]))
        .expect("ACK: held");
    assert!(
        rx.borrow().services.is_empty(),
        "warming until the cluster arrives"
    );
    state
        .apply_sotw(&clusters("1", &[static_cluster("missing", 9003)]))
        .expect("ACK");
    assert_eq!(rx.borrow().services.len(), 1);
}

#[test]
fn a_generated_entry_the_file_defines_is_refused_naming_both_sources() {
    let mut file = FileNames::default();
    file.entries.insert(("service-router", "web".into()));
    let (mut state, rx) = state(file);
    state
        .apply_sotw(&clusters("1", &[static_cluster("a", 9001)]))
        .expect("ACK");
    let error = state
        .apply_sotw(&listeners(
            "1",
            &[http_listener(&hcm(vec![prefix("/", "a")]))],
        ))
        .expect_err("NACK");
    assert!(matches!(error, ResponseError::Clash { .. }));
    assert_eq!(
        error.to_string(),
        "service-router \"web\" is defined both in the configuration file (config_entries) and by xDS; a name may come from one source only, rename one of them"
    );
    assert!(rx.borrow().services.is_empty());
}

type Mutation = fn(&mut HttpConnectionManager);

#[test]
fn what_the_proxy_path_cannot_do_as_envoy_is_refused_by_name() {
    let cases: &[(&str, Mutation)] = &[
        ("http_connection_manager.codec_type", |h| {
            h.codec_type = CodecType::Http1 as i32;
        }),
        ("http_connection_manager.stream_idle_timeout", |h| {
            h.stream_idle_timeout = Some(Duration {
                seconds: 1,
                nanos: 0,
            });
        }),
        (
            "http_connection_manager.http_filters: must hold exactly one filter",
            |h| {
                h.http_filters.push(h.http_filters[0].clone());
            },
        ),
        (
            "http_connection_manager.rds.config_source: config_source must be ads",
            |h| {
                h.route_specifier = Some(RouteSpecifier::Rds(Rds::default()));
            },
        ),
        (
            "route_config.virtual_hosts[0].domains: only domains [\"*\"]",
            |h| {
                vhost_mut(h).domains = vec!["example.com".into()];
            },
        ),
        ("route_config.virtual_hosts[0].retry_policy", |h| {
            vhost_mut(h).retry_policy = Some(RetryPolicy::default());
        }),
        ("route_config.virtual_hosts[0].routes[0].redirect", |h| {
            vhost_mut(h).routes[0].action = Some(Action::Redirect(RedirectAction::default()));
        }),
        (
            "route_config.virtual_hosts[0].routes[0].route.retry_policy",
            |h| {
                if let Some(Action::Route(a)) = &mut vhost_mut(h).routes[0].action {
                    a.retry_policy = Some(RetryPolicy::default());
                }
            },
        ),
        (
            "route_config.virtual_hosts[0].routes[0].match.case_sensitive",
            |h| {
                let m = vhost_mut(h).routes[0].r#match.as_mut().expect("match");
                m.case_sensitive = Some(BoolValue { value: false });
            },
        ),
        (
            "routes[0].match.headers[0].invert_match (only with present_match)",
            |h| {
                let m = vhost_mut(h).routes[0].r#match.as_mut().expect("match");
                m.headers = vec![HeaderMatcher {
                    name: "x".into(),
                    invert_match: true,
                    header_match_specifier: Some(HeaderMatchSpecifier::StringMatch(
                        StringMatcher {
                            match_pattern: Some(MatchPattern::Exact("1".into())),
                            ..Default::default()
                        },
                    )),
                    ..Default::default()
                }];
            },
        ),
        ("routes[0].match.headers[0].string_match.ignore_case", |h| {
            let m = vhost_mut(h).routes[0].r#match.as_mut().expect("match");
            m.headers = vec![HeaderMatcher {
                name: "x".into(),
                header_match_specifier: Some(HeaderMatchSpecifier::StringMatch(StringMatcher {
                    ignore_case: true,
                    match_pattern: Some(MatchPattern::Exact("1".into())),
                })),
                ..Default::default()
            }];
        }),
        (
            "route_config.virtual_hosts[0].routes: the last route must match every request",
            |h| {
                vhost_mut(h).routes[1] = prefix("/only", "a");
            },
        ),
    ];
    for (expected, mutate) in cases {
        let mut h = hcm(vec![prefix("/b", "b"), prefix("/", "a")]);
        mutate(&mut h);
        let text = nack(&h);
        assert!(
            text.starts_with("listener \"web\": ") && text.contains(expected),
            "{expected}: {text}"
        );
    }
}

#[test]
fn a_generated_entry_consul_refuses_is_nacked_naming_the_listener() {
    let text = nack(&hcm(vec![prefix("b", "b"), prefix("/", "a")]));
    assert_eq!(
        text,
        "listener \"web\": generated \"service-router\" \"web\": Route[0] PathPrefix doesn't start with '/': \"b\""
    );
}

/// The router's routes of listener `web`, as (path prefix, service) pairs.
fn web_routes(overlay: &crate::desired::Overlay) -> Vec<(String, String)> {
    let router = entry(overlay, "service-router", "web");
    let routes = router["Routes"].as_array().cloned().unwrap_or_default();
    routes
        .iter()
        .map(|r| {
            let at = r["Match"]["HTTP"]["PathPrefix"].as_str().unwrap_or("?");
            let to = r["Destination"]["Service"].as_str().unwrap_or("?");
            (at.to_owned(), to.to_owned())
        })
        .collect()
}

/// A state with clusters a and b and the RDS listener `web` naming `r1`: held, nothing out.
pub(super) fn rds_state() -> (
    crate::discovery::xds::resources::ResourceState,
    tokio::sync::watch::Receiver<crate::desired::Overlay>,
) {
    let (mut state, rx) = state(FileNames::default());
    let known = [static_cluster("a", 9001), static_cluster("b", 9002)];
    state.apply_sotw(&clusters("1", &known)).expect("ACK");
    let web = http_listener(&rds_hcm("r1"));
    state
        .apply_sotw(&listeners("1", &[web]))
        .expect("ACK: held");
    assert!(rx.borrow().services.is_empty(), "warming until r1 arrives");
    assert_eq!(state.route_names().into_iter().collect::<Vec<_>>(), ["r1"]);
    (state, rx)
}

#[test]
fn an_rds_listener_waits_for_its_routes_follows_them_and_is_withdrawn_without_them() {
    let (mut state, rx) = rds_state();
    let r1 = route_configuration("r1", vec![prefix("/", "a")]);
    state.apply_sotw(&routes_sotw("1", &[r1])).expect("ACK");
    let [service] = rx
        .borrow()
        .services
        .to_vec()
        .try_into()
        .expect("one service");
    assert_eq!(
        (service.mode, service.chain.as_deref()),
        (ServiceMode::Proxy, Some("web"))
    );
    assert_eq!(web_routes(&rx.borrow()), [("/".into(), "a".into())]);
    let moved = route_configuration("r1", vec![prefix("/b", "b"), prefix("/", "a")]);
    state.apply_sotw(&routes_sotw("2", &[moved])).expect("ACK");
    let want = [("/b".to_owned(), "b".to_owned()), ("/".into(), "a".into())];
    assert_eq!(web_routes(&rx.borrow()), want);
    assert_eq!(state.version_info(ROUTE_TYPE_URL), "2");
    // State of the world: r1 absent from the answer withdraws the listener's service.
    state.apply_sotw(&routes_sotw("3", &[])).expect("ACK");
    assert!(rx.borrow().services.is_empty(), "withdrawn without routes");
    assert!(rx.borrow().config_entries.is_empty(), "its chain too");
}

#[test]
fn a_delta_removal_of_the_route_configuration_withdraws_the_service() {
    let (mut state, rx) = rds_state();
    let r1 = route_configuration("r1", vec![prefix("/", "a")]);
    let added = DeltaDiscoveryResponse {
        type_url: ROUTE_TYPE_URL.into(),
        resources: vec![envoy_types::pb::envoy::service::discovery::v3::Resource {
            name: "r1".into(),
            version: "v1".into(),
            resource: Some(any(ROUTE_TYPE_URL, &r1)),
            ..Default::default()
        }],
        ..Default::default()
    };
    state.apply_delta(&added).expect("ACK");
    assert_eq!(rx.borrow().services.len(), 1);
    let held = state.delta_versions(ROUTE_TYPE_URL);
    assert_eq!(held.get("r1").map(String::as_str), Some("v1"));
    let removed = DeltaDiscoveryResponse {
        type_url: ROUTE_TYPE_URL.into(),
        removed_resources: vec!["r1".into()],
        ..Default::default()
    };
    state.apply_delta(&removed).expect("ACK");
    assert!(rx.borrow().services.is_empty(), "withdrawn without routes");
}

#[test]
fn a_bad_route_configuration_is_nacked_by_name_and_field_keeping_the_last_good() {
    let (mut state, rx) = rds_state();
    let good = route_configuration("r1", vec![prefix("/", "a")]);
    state.apply_sotw(&routes_sotw("1", &[good])).expect("ACK");
    let mut bad = route_configuration("r1", vec![prefix("/", "b")]);
    bad.virtual_hosts[0].domains = vec!["example.com".into()];
    let error = state
        .apply_sotw(&routes_sotw("2", &[bad]))
        .expect_err("NACK");
    assert!(
        error
            .to_string()
            .starts_with("route configuration \"r1\": virtual_hosts[0].domains: only domains"),
        "{error}"
    );
    let kept = [("/".to_owned(), "a".to_owned())];
    assert_eq!(
        web_routes(&rx.borrow()),
        kept,
        "the last good state is kept"
    );
    assert_eq!(state.version_info(ROUTE_TYPE_URL), "1");
    let mut strict = route_configuration("r1", vec![prefix("/", "missing")]);
    strict.validate_clusters = Some(BoolValue { value: true });
    let error = state
        .apply_sotw(&routes_sotw("3", &[strict]))
        .expect_err("NACK");
    let want = "route configuration \"r1\": virtual_hosts[0]: route: unknown cluster 'missing'";
    assert_eq!(error.to_string(), want);
}

#[test]
fn a_route_configuration_no_listener_names_is_ignored_as_envoy_does() {
    let (mut state, rx) = rds_state();
    let mut stray = route_configuration("other", vec![prefix("/", "a")]);
    stray.virtual_hosts[0].domains = vec!["example.com".into()];
    let r1 = route_configuration("r1", vec![prefix("/", "a")]);
    state
        .apply_sotw(&routes_sotw("1", &[stray, r1]))
        .expect("ACK: the stray one is not looked at");
    assert_eq!(web_routes(&rx.borrow()), [("/".into(), "a".into())]);
}

#[test]
fn an_rds_route_table_waits_for_an_unknown_cluster_by_default() {
    let (mut state, rx) = rds_state();
    let lenient = route_configuration("r1", vec![prefix("/", "c")]);
    state
        .apply_sotw(&routes_sotw("1", &[lenient]))
        .expect("ACK: held");
    assert!(rx.borrow().services.is_empty(), "warming until c arrives");
    let known = [
        static_cluster("a", 9001),
        static_cluster("b", 9002),
        static_cluster("c", 9003),
    ];
    state.apply_sotw(&clusters("2", &known)).expect("ACK");
    assert_eq!(web_routes(&rx.borrow()), [("/".into(), "c".into())]);
}
