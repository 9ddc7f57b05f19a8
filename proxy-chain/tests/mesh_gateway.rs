//! Mesh gateway modes of compiled targets, as Consul 1.8.7 sets them: only targets in another
//! datacenter than the one the chain is used from get a mode, from service-defaults, else
//! proxy-defaults, then the request's override; local and external targets get none.
//! Every mode from every source, on a local target, a remote target reached by redirect and a
//! remote target reached by failover.

mod support;

use std::collections::BTreeMap;

use proxy_chain::{CompileRequest, MeshGatewayMode, compile};
use serde_json::{Value, json};
use support::{TRUST_DOMAIN, entries, request};

/// `target ID -> mode` of the compiled chain, and whether an override customized it.
fn modes(list: Value, setup: impl Fn(&mut CompileRequest)) -> (BTreeMap<String, String>, bool) {
    let mut req = request();
    setup(&mut req);
    let chain = compile(&req, &entries(list)).expect("compiles");
    let customized = !chain.customization_hash.is_empty();
    let json = serde_json::to_value(&chain).unwrap();
    let modes = json["Targets"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(id, t)| {
            let mode = t["MeshGateway"]["Mode"].as_str().unwrap_or("").to_owned();
            (id.clone(), mode)
        })
        .collect();
    (modes, customized)
}

fn expect(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(id, mode)| ((*id).to_owned(), (*mode).to_owned()))
        .collect()
}

const LOCAL: &str = "main.default.default.dc1";
const REMOTE: &str = "main.default.default.dc2";

/// The three kinds of target: the chain's own (local), a redirect to dc2, a failover to dc2.
fn kinds() -> [(&'static str, Vec<Value>, Vec<&'static str>); 3] {
    [
        ("local", vec![], vec![LOCAL]),
        (
            "redirect",
            vec![
                json!({"Kind": "service-resolver", "Name": "main", "Redirect": {"Datacenter": "dc2"}}),
            ],
            vec![REMOTE],
        ),
        (
            "failover",
            vec![
                json!({"Kind": "service-resolver", "Name": "main", "Failover": {"*": {"Datacenters": ["dc2"]}}}),
            ],
            vec![LOCAL, REMOTE],
        ),
    ]
}

/// The mode each target should have when the remote ones get `mode`.
fn wanted(ids: &[&str], mode: &str) -> BTreeMap<String, String> {
    ids.iter()
        .map(|id| {
            let m = if *id == LOCAL { "" } else { mode };
            ((*id).to_owned(), m.to_owned())
        })
        .collect()
}

#[test]
fn every_mode_from_proxy_defaults_reaches_remote_targets_only() {
    for mode in ["", "none", "local", "remote"] {
        for (kind, resolvers, ids) in kinds() {
            let mut list = resolvers;
            list.push(
                json!({"Kind": "proxy-defaults", "Name": "global", "MeshGateway": {"Mode": mode}}),
            );
            let (got, customized) = modes(Value::Array(list), |_| {});
            assert_eq!(got, wanted(&ids, mode), "proxy-defaults {mode:?}, {kind}");
            assert!(!customized, "{kind}");
        }
    }
}

#[test]
fn every_mode_from_service_defaults_reaches_remote_targets_only() {
    for mode in ["", "none", "local", "remote"] {
        for (kind, resolvers, ids) in kinds() {
            let mut list = resolvers;
            list.push(
                json!({"Kind": "service-defaults", "Name": "main", "MeshGateway": {"Mode": mode}}),
            );
            let (got, customized) = modes(Value::Array(list), |_| {});
            assert_eq!(got, wanted(&ids, mode), "service-defaults {mode:?}, {kind}");
            assert!(!customized, "{kind}");
        }
    }
}

#[test]
fn every_override_reaches_remote_targets_only_and_customizes_only_there() {
    for mode in ["", "none", "local", "remote"] {
        let override_mode: MeshGatewayMode = mode.parse().unwrap();
        for (kind, resolvers, ids) in kinds() {
            let (got, customized) = modes(Value::Array(resolvers), |r| {
                r.override_mesh_gateway = override_mode;
            });
            assert_eq!(got, wanted(&ids, mode), "override {mode:?}, {kind}");
            let remote = ids.contains(&REMOTE);
            assert_eq!(
                customized,
                remote && !mode.is_empty(),
                "override {mode:?}, {kind}"
            );
        }
    }
}

#[test]
fn service_defaults_win_over_proxy_defaults_and_the_override_over_both() {
    let redirect =
        json!({"Kind": "service-resolver", "Name": "main", "Redirect": {"Datacenter": "dc2"}});
    let global =
        json!({"Kind": "proxy-defaults", "Name": "global", "MeshGateway": {"Mode": "remote"}});
    let service = |mode: &str| json!({"Kind": "service-defaults", "Name": "main", "MeshGateway": {"Mode": mode}});
    let list = json!([redirect, global, service("local")]);
    assert_eq!(
        modes(list.clone(), |_| {}),
        (expect(&[(REMOTE, "local")]), false)
    );
    // A service-defaults without a mode leaves it to proxy-defaults.
    let unset = json!([redirect, global, service("")]);
    assert_eq!(modes(unset, |_| {}), (expect(&[(REMOTE, "remote")]), false));
    let none = |r: &mut CompileRequest| r.override_mesh_gateway = MeshGatewayMode::None;
    assert_eq!(
        modes(list.clone(), none),
        (expect(&[(REMOTE, "none")]), true)
    );
    // An override equal to the configured mode changes nothing, so customizes nothing.
    let same = |r: &mut CompileRequest| r.override_mesh_gateway = MeshGatewayMode::Local;
    assert_eq!(modes(list, same), (expect(&[(REMOTE, "local")]), false));
}

#[test]
fn the_redirected_services_defaults_decide() {
    let list = json!([
        {"Kind": "service-resolver", "Name": "main", "Redirect": {"Service": "other", "Datacenter": "dc2"}},
        {"Kind": "service-defaults", "Name": "main", "MeshGateway": {"Mode": "none"}},
        {"Kind": "service-defaults", "Name": "other", "MeshGateway": {"Mode": "local"}},
    ]);
    let (got, _) = modes(list, |_| {});
    assert_eq!(got, expect(&[("other.default.default.dc2", "local")]));
}

#[test]
fn local_means_the_datacenter_the_chain_is_used_from() {
    // Consul's `compile-dc=dc2` on a dc1 agent: evaluated in dc2, used from dc1.
    let global =
        json!({"Kind": "proxy-defaults", "Name": "global", "MeshGateway": {"Mode": "local"}});
    let elsewhere = |r: &mut CompileRequest| r.evaluate_in_datacenter = "dc2".into();
    assert_eq!(
        modes(json!([global]), elsewhere),
        (expect(&[(REMOTE, "local")]), false)
    );
    let back_home = json!([global,
        {"Kind": "service-resolver", "Name": "main", "Redirect": {"Datacenter": "dc1"}}]);
    assert_eq!(modes(back_home, elsewhere), (expect(&[(LOCAL, "")]), false));
    let request = CompileRequest::new("main", "dc1", TRUST_DOMAIN);
    assert_eq!(request.use_in_datacenter, "dc1");
}

#[test]
fn a_resolver_has_no_mesh_gateway_in_consul_1_8() {
    let error = proxy_chain::Entries::from_json(
        &json!([{"Kind": "service-resolver", "Name": "main", "MeshGateway": {"Mode": "local"}}])
            .to_string(),
    )
    .unwrap_err();
    assert!(error.to_string().contains("MeshGateway"), "{error}");
}
