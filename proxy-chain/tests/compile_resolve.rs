//! Consul `TestCompile` corpus: redirect, failover, defaults, service meta, error, override and
//! circular-reference cases, each asserting the full chain JSON or the exact error text.

#![allow(
    clippy::needless_pass_by_value,
    reason = "the case builders take json! literals by value, for short call sites"
)]

mod support;

use proxy_chain::{GoDuration, MeshGatewayMode, compile};
use serde_json::{Value, json};
use support::*;

const MAIN: &str = "resolver:main.default.default.dc1";

fn redirect(name: &str, redirect: Value) -> Value {
    json!({"Kind": "service-resolver", "Name": name, "Redirect": redirect})
}

fn failover(name: &str, section: Value) -> Value {
    json!({"Kind": "service-resolver", "Name": name, "Failover": {"*": section}})
}

fn remote_gateways() -> Value {
    json!({"Kind": "proxy-defaults", "Name": "global", "MeshGateway": {"Mode": "remote"}})
}

fn remote(t: Value) -> Value {
    with(t, json!({"MeshGateway": {"Mode": "remote"}}))
}

fn with_failover(node: Value, targets: &[&str]) -> Value {
    let mut node = node;
    node["Resolver"]["Failover"] = json!({"Targets": targets});
    node
}

fn single(protocol: &str, node: Value, target_list: Vec<Value>) -> Value {
    let start = format!("resolver:{}", node["Name"].as_str().unwrap());
    chain(protocol, &start, vec![node], target_list)
}

fn default_chain(mut value: Value) -> Value {
    value["Default"] = json!(true);
    value
}

#[test]
fn service_redirect() {
    assert_chain(
        json!([redirect("main", json!({"Service": "other"}))]),
        single(
            "tcp",
            resolver(&tid("other", "", "dc1"), true, "5s"),
            vec![target("other", "", "dc1")],
        ),
    );
}

#[test]
fn service_and_subset_redirect() {
    let f2 = "Service.Meta.version == 2";
    assert_chain(
        json!([
            redirect("main", json!({"Service": "other", "ServiceSubset": "v2"})),
            {"Kind": "service-resolver", "Name": "other", "Subsets": {
                "v1": {"Filter": "Service.Meta.version == 1"}, "v2": {"Filter": f2}}},
        ]),
        single(
            "tcp",
            resolver(&tid("other", "v2", "dc1"), false, "5s"),
            vec![with(
                target("other", "v2", "dc1"),
                json!({"Subset": {"Filter": f2}}),
            )],
        ),
    );
}

#[test]
fn datacenter_redirect() {
    assert_chain(
        json!([redirect("main", json!({"Datacenter": "dc9"}))]),
        single(
            "tcp",
            resolver(&tid("main", "", "dc9"), false, "5s"),
            vec![target("main", "", "dc9")],
        ),
    );
}

#[test]
fn datacenter_redirect_with_mesh_gateways() {
    assert_chain(
        json!([
            remote_gateways(),
            redirect("main", json!({"Datacenter": "dc9"}))
        ]),
        single(
            "tcp",
            resolver(&tid("main", "", "dc9"), false, "5s"),
            vec![remote(target("main", "", "dc9"))],
        ),
    );
}

#[test]
fn service_failover() {
    assert_chain(
        json!([failover("main", json!({"Service": "backup"}))]),
        single(
            "tcp",
            with_failover(
                resolver(&tid("main", "", "dc1"), false, "5s"),
                &["backup.default.default.dc1"],
            ),
            vec![target("main", "", "dc1"), target("backup", "", "dc1")],
        ),
    );
}

#[test]
fn service_failover_through_redirect() {
    assert_chain(
        json!([
            redirect("backup", json!({"Service": "actual"})),
            failover("main", json!({"Service": "backup"}))
        ]),
        single(
            "tcp",
            with_failover(
                resolver(&tid("main", "", "dc1"), false, "5s"),
                &["actual.default.default.dc1"],
            ),
            vec![target("main", "", "dc1"), target("actual", "", "dc1")],
        ),
    );
}

#[test]
fn circular_resolver_failover() {
    assert_chain(
        json!([
            failover("backup", json!({"Service": "main"})),
            failover("main", json!({"Service": "backup"}))
        ]),
        single(
            "tcp",
            with_failover(
                resolver(&tid("main", "", "dc1"), false, "5s"),
                &["backup.default.default.dc1"],
            ),
            vec![target("main", "", "dc1"), target("backup", "", "dc1")],
        ),
    );
}

#[test]
fn service_and_subset_failover() {
    let filter = "Service.Meta.version == backup";
    assert_chain(
        json!([{"Kind": "service-resolver", "Name": "main",
            "Subsets": {"backup": {"Filter": filter}}, "Failover": {"*": {"ServiceSubset": "backup"}}}]),
        single(
            "tcp",
            with_failover(
                resolver(&tid("main", "", "dc1"), false, "5s"),
                &["backup.main.default.default.dc1"],
            ),
            vec![
                target("main", "", "dc1"),
                with(
                    target("main", "backup", "dc1"),
                    json!({"Subset": {"Filter": filter}}),
                ),
            ],
        ),
    );
}

#[test]
fn datacenter_failover() {
    assert_chain(
        json!([failover("main", json!({"Datacenters": ["dc2", "dc4"]}))]),
        single(
            "tcp",
            with_failover(
                resolver(&tid("main", "", "dc1"), false, "5s"),
                &["main.default.default.dc2", "main.default.default.dc4"],
            ),
            vec![
                target("main", "", "dc1"),
                target("main", "", "dc2"),
                target("main", "", "dc4"),
            ],
        ),
    );
}

#[test]
fn datacenter_failover_with_mesh_gateways() {
    assert_chain(
        json!([
            remote_gateways(),
            failover("main", json!({"Datacenters": ["dc2", "dc4"]}))
        ]),
        single(
            "tcp",
            with_failover(
                resolver(&tid("main", "", "dc1"), false, "5s"),
                &["main.default.default.dc2", "main.default.default.dc4"],
            ),
            vec![
                target("main", "", "dc1"),
                remote(target("main", "", "dc2")),
                remote(target("main", "", "dc4")),
            ],
        ),
    );
}

fn v1_v2_default_v2() -> Value {
    json!({"Kind": "service-resolver", "Name": "main", "DefaultSubset": "v2", "Subsets": {
        "v1": {"Filter": "Service.Meta.version == 1"}, "v2": {"Filter": "Service.Meta.version == 2"}}})
}

#[test]
fn noop_split_to_resolver_with_default_subset() {
    let v2 = "resolver:v2.main.default.default.dc1";
    assert_chain(
        json!([protocol("main", "http"), {"Kind": "service-splitter", "Name": "main", "Splits": [{"Weight": 100}]},
            v1_v2_default_v2()]),
        chain(
            "http",
            "splitter:main.default.default",
            vec![
                json!({"Type": "splitter", "Name": "main.default.default",
                    "Splits": [{"Definition": {"Weight": 100}, "Weight": 100, "NextNode": v2}]}),
                resolver(&tid("main", "v2", "dc1"), false, "5s"),
            ],
            vec![with(
                target("main", "v2", "dc1"),
                json!({"Subset": {"Filter": "Service.Meta.version == 2"}}),
            )],
        ),
    );
}

#[test]
fn resolver_with_default_subset() {
    assert_chain(
        json!([v1_v2_default_v2()]),
        single(
            "tcp",
            resolver(&tid("main", "v2", "dc1"), false, "5s"),
            vec![with(
                target("main", "v2", "dc1"),
                json!({"Subset": {"Filter": "Service.Meta.version == 2"}}),
            )],
        ),
    );
}

#[test]
fn default_resolver_with_external_sni() {
    let sni = "main.some.other.service.mesh";
    assert_chain(
        json!([{"Kind": "service-defaults", "Name": "main", "ExternalSNI": sni}]),
        default_chain(single(
            "tcp",
            resolver(&tid("main", "", "dc1"), true, "5s"),
            vec![with(
                target("main", "", "dc1"),
                json!({"SNI": sni, "External": true}),
            )],
        )),
    );
}

#[test]
fn resolver_with_no_entries_and_inferring_defaults() {
    assert_chain(
        json!([]),
        default_chain(single(
            "tcp",
            resolver(&tid("main", "", "dc1"), true, "5s"),
            vec![target("main", "", "dc1")],
        )),
    );
}

#[test]
fn default_resolver_with_proxy_defaults() {
    assert_chain(
        json!([{"Kind": "proxy-defaults", "Name": "global", "Config": {"protocol": "grpc"},
            "MeshGateway": {"Mode": "remote"}}]),
        default_chain(single(
            "grpc",
            resolver(&tid("main", "", "dc1"), true, "5s"),
            vec![target("main", "", "dc1")],
        )),
    );
}

#[test]
fn service_redirect_to_service_with_default_resolver_is_not_a_default_chain() {
    let actual = compiled(
        &entries(json!([redirect("main", json!({"Service": "other"}))])),
        &request(),
    );
    assert_eq!(actual.get("Default"), None);
    assert_eq!(
        actual["Nodes"]["resolver:other.default.default.dc1"]["Resolver"]["Default"],
        json!(true)
    );
    assert_eq!(
        actual,
        single(
            "tcp",
            resolver(&tid("other", "", "dc1"), true, "5s"),
            vec![target("other", "", "dc1")]
        )
    );
}

fn main_meta() -> Value {
    json!({"Kind": "service-defaults", "Name": "main", "Meta": {"foo": "bar", "abc": "123"}})
}

#[test]
fn service_meta_projection() {
    let mut expect = default_chain(single(
        "tcp",
        resolver(&tid("main", "", "dc1"), true, "5s"),
        vec![target("main", "", "dc1")],
    ));
    expect["ServiceMeta"] = json!({"foo": "bar", "abc": "123"});
    assert_chain(json!([main_meta()]), expect);
}

#[test]
fn service_meta_projection_with_redirect() {
    let other_meta = json!({"Kind": "service-defaults", "Name": "other", "Meta": {"zim": "gir", "abc": "456", "xyz": "999"}});
    let mut expect = single(
        "tcp",
        resolver(&tid("other", "", "dc1"), true, "5s"),
        vec![target("other", "", "dc1")],
    );
    // Note this is main's meta, not other's.
    expect["ServiceMeta"] = json!({"foo": "bar", "abc": "123"});
    assert_chain(
        json!([
            main_meta(),
            other_meta,
            redirect("main", json!({"Service": "other"}))
        ]),
        expect,
    );
}

const NO_ADVANCED: &str = "discovery chain \"main\" uses a protocol \"tcp\" that does not permit advanced routing or splitting behavior";

#[test]
fn splitter_requires_valid_protocol() {
    assert_error(
        json!([protocol("main", "tcp"), {"Kind": "service-splitter", "Name": "main", "Splits": [
            {"Weight": 90, "Namespace": "v1"}, {"Weight": 10, "Namespace": "v2"}]}]),
        NO_ADVANCED,
    );
}

#[test]
fn router_requires_valid_protocol() {
    assert_error(
        json!([protocol("main", "tcp"), {"Kind": "service-router", "Name": "main", "Routes": [
            {"Match": {"HTTP": {"PathExact": "/other"}}, "Destination": {"Namespace": "other"}}]}]),
        NO_ADVANCED,
    );
}

#[test]
fn split_to_unsplittable_protocol() {
    assert_error(
        json!([protocol("main", "tcp"), protocol("other", "tcp"), {"Kind": "service-splitter", "Name": "main",
            "Splits": [{"Weight": 90}, {"Weight": 10, "Service": "other"}]}]),
        NO_ADVANCED,
    );
}

#[test]
fn route_to_unroutable_protocol() {
    assert_error(
        json!([protocol("main", "tcp"), protocol("other", "tcp"), {"Kind": "service-router", "Name": "main", "Routes": [
            {"Match": {"HTTP": {"PathExact": "/other"}}, "Destination": {"Service": "other"}}]}]),
        NO_ADVANCED,
    );
}

const CROSSES: &str = "discovery chain \"main\" uses inconsistent protocols; service \"other\" has \"tcp\" which is not \"grpc\"";

#[test]
fn failover_crosses_protocols() {
    assert_error(
        json!([
            protocol("main", "grpc"),
            protocol("other", "tcp"),
            failover("main", json!({"Service": "other"}))
        ]),
        CROSSES,
    );
}

#[test]
fn redirect_crosses_protocols() {
    assert_error(
        json!([
            protocol("main", "grpc"),
            protocol("other", "tcp"),
            redirect("main", json!({"Service": "other"}))
        ]),
        CROSSES,
    );
}

#[test]
fn redirect_to_missing_subset() {
    assert_error(
        json!([{"Kind": "service-resolver", "Name": "other", "ConnectTimeout": "33s"},
            redirect("main", json!({"Service": "other", "ServiceSubset": "v1"}))]),
        "service \"other\" does not have a subset named \"v1\"",
    );
}

fn external_main() -> Value {
    json!({"Kind": "service-defaults", "Name": "main", "ExternalSNI": "main.some.other.service.mesh"})
}

#[test]
fn resolver_with_failover_and_external_sni() {
    assert_error(
        json!([external_main(), {"Kind": "service-resolver", "Name": "main", "ConnectTimeout": "33s",
            "Failover": {"*": {"Service": "backup"}}}]),
        "service \"main\" has an external SNI set; cannot define failover for external services",
    );
}

#[test]
fn resolver_with_subsets_and_external_sni() {
    assert_error(
        json!([external_main(), {"Kind": "service-resolver", "Name": "main", "ConnectTimeout": "33s",
            "Subsets": {"canary": {"Filter": "Service.Meta.version == canary"}}}]),
        "service \"main\" has an external SNI set; cannot define subsets for external services",
    );
}

#[test]
fn resolver_with_redirect_and_external_sni() {
    assert_error(
        json!([external_main(), {"Kind": "service-resolver", "Name": "main", "ConnectTimeout": "33s",
            "Redirect": {"Datacenter": "dc2"}}]),
        "service \"main\" has an external SNI set; cannot define redirects for external services",
    );
}

/// Compiles with an override and checks that a customization hash (8 hex digits) is present
/// exactly when `custom`; returns the JSON without it.
fn compiled_with(
    entries_json: Value,
    custom: bool,
    setup: impl Fn(&mut proxy_chain::CompileRequest),
) -> Value {
    let mut req = request();
    setup(&mut req);
    let mut actual = compiled(&entries(entries_json), &req);
    let hash = actual.as_object_mut().unwrap().remove("CustomizationHash");
    match hash {
        Some(Value::String(h)) if custom => assert!(
            h.len() == 8 && h.chars().all(|c| c.is_ascii_hexdigit()),
            "{h}"
        ),
        None if !custom => {}
        other => panic!("unexpected CustomizationHash {other:?}"),
    }
    actual
}

#[test]
fn resolver_with_protocol_from_override() {
    let actual = compiled_with(json!([protocol("main", "grpc")]), true, |r| {
        r.override_protocol = "http2".into();
    });
    let expect = default_chain(single(
        "http2",
        resolver(&tid("main", "", "dc1"), true, "5s"),
        vec![target("main", "", "dc1")],
    ));
    assert_eq!(actual, expect);
}

#[test]
fn resolver_with_protocol_from_override_ignored() {
    let actual = compiled_with(json!([protocol("main", "http2")]), false, |r| {
        r.override_protocol = "http2".into();
    });
    let expect = default_chain(single(
        "http2",
        resolver(&tid("main", "", "dc1"), true, "5s"),
        vec![target("main", "", "dc1")],
    ));
    assert_eq!(actual, expect);
}

#[test]
fn router_ignored_due_to_protocol_override() {
    let actual = compiled_with(
        json!([protocol("main", "grpc"), {"Kind": "service-router", "Name": "main"}]),
        true,
        |r| r.override_protocol = "tcp".into(),
    );
    let expect = default_chain(single(
        "tcp",
        resolver(&tid("main", "", "dc1"), true, "5s"),
        vec![target("main", "", "dc1")],
    ));
    assert_eq!(actual, expect);
}

#[test]
fn connect_timeout_and_mesh_gateway_overrides() {
    // The mesh gateway override does not reach a target in the datacenter the chain is used
    // from (Consul 1.8.7), so only the timeout customizes this chain.
    let actual = compiled_with(json!([]), true, |r| {
        r.override_connect_timeout = GoDuration::from_secs(60);
        r.override_mesh_gateway = MeshGatewayMode::Local;
    });
    let node = resolver(&tid("main", "", "dc1"), true, "1m0s");
    let t = with(target("main", "", "dc1"), json!({"ConnectTimeout": "1m0s"}));
    assert_eq!(actual, default_chain(single("tcp", node, vec![t])));
    let remote = compiled_with(
        json!([redirect("main", json!({"Datacenter": "dc2"}))]),
        true,
        |r| {
            r.override_mesh_gateway = MeshGatewayMode::Local;
        },
    );
    let node = resolver(&tid("main", "", "dc2"), false, "5s");
    let t = with(
        target("main", "", "dc2"),
        json!({"MeshGateway": {"Mode": "local"}}),
    );
    assert_eq!(remote, single("tcp", node, vec![t]));
}

#[test]
fn customization_hash_is_deterministic_and_override_specific() {
    let hash = |protocol: &str| {
        let mut req = request();
        req.override_protocol = protocol.into();
        compile(&req, &entries(json!([])))
            .unwrap()
            .customization_hash
    };
    assert_eq!(hash("http"), hash("http"));
    assert_ne!(hash("http"), hash("grpc"));
    assert_eq!(
        hash("tcp"),
        "",
        "an override equal to the protocol is not a customization"
    );
}

#[test]
fn circular_resolver_redirect() {
    assert_error(
        json!([
            redirect("main", json!({"Service": "other"})),
            redirect("other", json!({"Service": "main"}))
        ]),
        "detected circular resolver redirect: [main.default.default.dc1 -> other.default.default.dc1 -> main.default.default.dc1]",
    );
}

#[test]
fn circular_split() {
    assert_error(
        json!([global_protocol("http"),
            {"Kind": "service-splitter", "Name": "main", "Splits": [{"Weight": 100, "Service": "other"}]},
            {"Kind": "service-splitter", "Name": "other", "Splits": [{"Weight": 100, "Service": "main"}]}]),
        "detected circular reference: [splitter:main.default.default -> splitter:other.default.default -> splitter:main.default.default]",
    );
}

#[test]
fn default_chain_start_node() {
    let actual = compiled(&entries(json!([])), &request());
    assert_eq!(actual["StartNode"], json!(MAIN));
}
