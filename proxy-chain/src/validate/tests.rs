//! One test per Consul validation message, asserting the exact text.

#![allow(
    clippy::needless_pass_by_value,
    reason = "the entry builders take json! literals by value, for short call sites"
)]

use serde_json::{Value, json};

use super::{Edition, validate_entry};
use crate::entries::ConfigEntry;

fn check(edition: Edition, entry: Value) -> Result<(), String> {
    let mut entry: ConfigEntry = serde_json::from_value(entry).expect("entry parses");
    entry.normalize();
    validate_entry(&entry, edition).map_err(|e| e.to_string())
}

fn err(entry: Value) -> String {
    check(Edition::Community, entry).expect_err("must be invalid")
}

fn ent_err(entry: Value) -> String {
    check(Edition::Enterprise, entry).expect_err("must be invalid")
}

fn router(routes: Value) -> Value {
    json!({"Kind": "service-router", "Name": "web", "Routes": routes})
}

fn http_route(http: Value) -> Value {
    router(json!([{"Match": {"HTTP": http}}]))
}

#[test]
fn names_are_required() {
    for kind in ["service-router", "service-resolver", "service-defaults"] {
        assert_eq!(err(json!({"Kind": kind})), "Name is required", "{kind}");
    }
    assert_eq!(
        err(json!({"Kind": "service-splitter", "Splits": [{"Weight": 100}]})),
        "Name is required"
    );
    assert_eq!(
        err(json!({"Kind": "proxy-defaults", "Name": "web"})),
        "invalid name (\"web\"), only \"global\" is supported"
    );
}

#[test]
fn router_paths() {
    assert_eq!(
        err(http_route(json!({"PathExact": "x"}))),
        "Route[0] PathExact doesn't start with '/': \"x\""
    );
    assert_eq!(
        err(http_route(json!({"PathPrefix": "x"}))),
        "Route[0] PathPrefix doesn't start with '/': \"x\""
    );
    assert_eq!(
        err(http_route(json!({"PathExact": "/a", "PathRegex": "/b.*"}))),
        "Route[0] should only contain at most one of PathExact, PathPrefix, or PathRegex"
    );
}

#[test]
fn router_headers_and_query_params() {
    assert_eq!(
        err(http_route(json!({"Header": [{"Exact": "x"}]}))),
        "Route[0] Header[0] missing required Name field"
    );
    assert_eq!(
        err(http_route(
            json!({"Header": [{"Name": "a", "Present": true}, {"Name": "b", "Exact": "x", "Prefix": "y"}]})
        )),
        "Route[0] Header[1] should only contain one of Present, Exact, Prefix, Suffix, or Regex"
    );
    assert_eq!(
        err(http_route(json!({"QueryParam": [{"Exact": "x"}]}))),
        "Route[0] QueryParam[0] missing required Name field"
    );
    assert_eq!(
        err(http_route(json!({"QueryParam": [{"Name": "q"}]}))),
        "Route[0] QueryParam[0] should only contain one of Present, Exact, or Regex"
    );
}

#[test]
fn router_methods_are_normalized_then_checked() {
    assert_eq!(
        check(
            Edition::Community,
            http_route(json!({"Methods": ["get", "Post"]}))
        ),
        Ok(())
    );
    assert_eq!(
        err(http_route(json!({"Methods": ["GET", "FETCH"]}))),
        "Route[0] Methods contains an invalid method \"FETCH\""
    );
    assert_eq!(
        err(http_route(json!({"Methods": ["GET", "get"]}))),
        "Route[0] Methods contains \"GET\" more than once"
    );
}

#[test]
fn router_destination_rules() {
    assert_eq!(
        err(router(
            json!([{"Match": {"HTTP": {"PathRegex": "/a.*"}}, "Destination": {"PrefixRewrite": "/b"}}])
        )),
        "Route[0] cannot make use of PrefixRewrite without configuring either PathExact or PathPrefix"
    );
    assert_eq!(
        check(
            Edition::Community,
            router(json!([{"Match": {"HTTP": {"PathPrefix": "/a"}},
            "Destination": {"PrefixRewrite": "/b", "RetryOn": ["5xx", "unavailable"], "RequestTimeout": "3s"}}]))
        ),
        Ok(())
    );
    assert_eq!(
        err(router(
            json!([{}, {"Destination": {"RetryOn": ["reset", "sometimes"]}}])
        )),
        "Route[1] contains an invalid retry condition: \"sometimes\""
    );
}

fn splitter(splits: Value) -> Value {
    json!({"Kind": "service-splitter", "Name": "web", "Splits": splits})
}

#[test]
fn splitter_rules() {
    assert_eq!(err(splitter(json!([]))), "no splits configured");
    assert_eq!(
        err(splitter(
            json!([{"Weight": 50}, {"Weight": 50, "Service": "web"}])
        )),
        "split destination occurs more than once: service=\"web\", subset=\"\", namespace=\"\", partition=\"\""
    );
    assert_eq!(
        err(splitter(
            json!([{"Weight": 50.5, "ServiceSubset": "a"}, {"Weight": 49.49, "ServiceSubset": "b"}])
        )),
        "the sum of all split weights must be 100, not 99.989998"
    );
    // A weight far past i64 (as 0.01 units) is reported, not an overflow.
    assert!(
        err(splitter(
            json!([{"Weight": 1e30, "ServiceSubset": "a"}, {"Weight": 1e30, "ServiceSubset": "b"}])
        ))
        .starts_with("the sum of all split weights must be 100, not "),
    );
    // Consul 1.8.7 accepts [200, -100] (the sum is 100); no proxy can send a negative share.
    assert_eq!(
        err(splitter(
            json!([{"Weight": 200, "ServiceSubset": "a"}, {"Weight": -100, "ServiceSubset": "b"}])
        )),
        "Splits[1] has a negative Weight (-100): a weight is the split's share of the traffic, from 0 to 100"
    );
    // NaN (YAML's `.nan`; JSON has none) is refused in Consul's words, never read as 0.
    for weights in [[f32::NAN, 100.0], [100.0, f32::NAN]] {
        let mut entry: crate::entries::ServiceSplitter = serde_json::from_value(json!({
            "Name": "web",
            "Splits": [{"Weight": 1, "ServiceSubset": "a"}, {"Weight": 1, "ServiceSubset": "b"}]
        }))
        .unwrap();
        for (split, weight) in entry.splits.iter_mut().zip(weights) {
            split.weight = weight;
        }
        assert_eq!(
            super::validate_splitter(&entry).unwrap_err().to_string(),
            "the sum of all split weights must be 100, not NaN",
            "{weights:?}"
        );
    }
    // 0.01 is the resolution: 33.333 rounds to 33.33.
    assert_eq!(
        check(
            Edition::Community,
            splitter(json!([{"Weight": 33.333, "ServiceSubset": "a"},
            {"Weight": 33.333, "ServiceSubset": "b"}, {"Weight": 33.34, "ServiceSubset": "c"}]))
        ),
        Ok(())
    );
}

fn resolver(fields: Value) -> Value {
    let mut entry = json!({"Kind": "service-resolver", "Name": "web"});
    for (k, v) in fields.as_object().unwrap() {
        entry[k] = v.clone();
    }
    entry
}

#[test]
fn resolver_subsets() {
    assert_eq!(
        err(resolver(json!({"Subsets": {"": {}}}))),
        "Subset defined with empty name"
    );
    assert_eq!(
        err(resolver(json!({"Subsets": {"V1": {}}}))),
        "Subset \"V1\" is invalid: must be 63 characters or fewer, begin or end with lower case alphanumeric \
         characters, and contain lower case alphanumeric characters or '-' in between"
    );
    let long = "a".repeat(64);
    let mut subsets = serde_json::Map::new();
    subsets.insert(long.clone(), json!({}));
    assert_eq!(
        err(resolver(json!({"Subsets": subsets}))),
        format!("Subset \"{long}\" is invalid: must be non-empty and 63 characters or fewer")
    );
    assert!(
        err(resolver(
            json!({"Subsets": {"v1": {"Filter": "Service.Meta.version =="}}})
        ))
        .starts_with("Filter for subset \"v1\" is not a valid expression: ")
    );
    assert_eq!(
        err(resolver(json!({"DefaultSubset": "v9"}))),
        "DefaultSubset \"v9\" is not a valid subset"
    );
}

#[test]
fn resolver_redirects() {
    assert_eq!(
        err(resolver(
            json!({"Redirect": {"Service": "a"}, "Failover": {"*": {"Service": "b"}}})
        )),
        "Redirect and Failover cannot both be set"
    );
    assert_eq!(err(resolver(json!({"Redirect": {}}))), "Redirect is empty");
    assert_eq!(
        err(resolver(
            json!({"Redirect": {"Service": "a", "Peer": "p", "ServiceSubset": "s"}})
        )),
        "Redirect.Peer cannot be set with Redirect.ServiceSubset"
    );
    assert_eq!(
        ent_err(resolver(
            json!({"Redirect": {"Service": "a", "Peer": "p", "Partition": "x"}})
        )),
        "Redirect.Partition cannot be set with Redirect.Peer"
    );
    assert_eq!(
        err(resolver(
            json!({"Redirect": {"Service": "a", "Peer": "p", "Datacenter": "dc2"}})
        )),
        "Redirect.Peer cannot be set with Redirect.Datacenter"
    );
    assert_eq!(
        err(resolver(json!({"Redirect": {"ServiceSubset": "v1"}}))),
        "Redirect.ServiceSubset defined without Redirect.Service"
    );
    assert_eq!(
        ent_err(resolver(json!({"Redirect": {"Namespace": "n"}}))),
        "Redirect.Namespace defined without Redirect.Service"
    );
    assert_eq!(
        err(resolver(json!({"Redirect": {"Peer": "p"}}))),
        "Redirect.Peer defined without Redirect.Service"
    );
    assert_eq!(
        err(resolver(
            json!({"Redirect": {"Service": "web", "ServiceSubset": "v1"}})
        )),
        "Redirect.ServiceSubset \"v1\" is not a valid subset of \"web\""
    );
    assert_eq!(
        ent_err(resolver(
            json!({"Redirect": {"Service": "a", "Partition": "p2", "Datacenter": "dc2"}})
        )),
        "Cross-datacenter and cross-partition redirect is not supported"
    );
    assert_eq!(
        ent_err(resolver(
            json!({"Partition": "p2", "Redirect": {"Datacenter": "dc2"}})
        )),
        "Cross-datacenter redirect is only supported in the default partition"
    );
}

#[test]
fn community_edition_gating() {
    assert_eq!(
        err(resolver(
            json!({"Redirect": {"Service": "a", "Namespace": "n"}})
        )),
        "Redirect: Setting Namespace requires Consul Enterprise"
    );
    assert_eq!(
        err(resolver(
            json!({"Redirect": {"Service": "a", "Partition": "p"}})
        )),
        "Redirect: Setting Partition requires Consul Enterprise"
    );
    assert_eq!(
        err(resolver(json!({"Redirect": {"SamenessGroup": "g"}}))),
        "Redirect: Setting SamenessGroup requires Consul Enterprise"
    );
    assert_eq!(
        err(resolver(
            json!({"Failover": {"*": {"Service": "a", "Policy": {"Mode": "default"}}}})
        )),
        "Bad Failover[\"*\"]: Setting failover policies requires Consul Enterprise"
    );
    assert_eq!(
        err(resolver(json!({"Failover": {"*": {"Namespace": "n"}}}))),
        "Bad Failover[\"*\"]: Setting Namespace requires Consul Enterprise"
    );
    assert_eq!(
        err(resolver(
            json!({"Failover": {"*": {"Targets": [{"Partition": "p"}]}}})
        )),
        "Bad Failover[\"*\"].Targets[0]: Setting Partition requires Consul Enterprise"
    );
    assert_eq!(
        err(resolver(
            json!({"PrioritizeByLocality": {"Mode": "failover"}})
        )),
        "Prioritize-by-locality requires Consul Enterprise "
    );
    assert_eq!(
        err(json!({"Kind": "service-defaults", "Name": "web", "Namespace": "team"})),
        "Setting Namespace requires Consul Enterprise"
    );
}

#[test]
fn resolver_failover() {
    let failover = |section: Value| resolver(json!({"Subsets": {"v1": {}}, "Failover": section}));
    assert_eq!(
        err(failover(json!({"v9": {"Service": "a"}}))),
        "Bad Failover[\"v9\"]: not a valid subset subset"
    );
    assert_eq!(
        err(failover(json!({"*": {}}))),
        "Bad Failover[\"*\"]: one of Service, ServiceSubset, Namespace, Targets, or Datacenters is required"
    );
    assert_eq!(
        ent_err(failover(
            json!({"*": {"Service": "a", "Policy": {"Mode": "nearest"}}})
        )),
        "Bad Failover[\"*\"]: Policy must be one of '', 'default', or 'order-by-locality'"
    );
    assert_eq!(
        err(failover(json!({"*": {"ServiceSubset": "v9"}}))),
        "Bad Failover[\"*\"]: ServiceSubset \"v9\" is not a valid subset of \"\""
    );
    for (conflict, field) in [
        (json!({"Datacenters": ["dc2"]}), "Datacenters"),
        (json!({"ServiceSubset": "v1"}), "ServiceSubset"),
        (json!({"Service": "a"}), "Service"),
    ] {
        let mut section = conflict;
        section["Targets"] = json!([{"Service": "b"}]);
        assert_eq!(
            err(failover(json!({"*": section}))),
            format!("Bad Failover[\"*\"]: Targets cannot be set with {field}")
        );
    }
    assert_eq!(
        err(failover(json!({"*": {"Datacenters": ["dc2", ""]}}))),
        "Bad Failover[\"*\"].Datacenters: found empty datacenter"
    );
}

#[test]
fn resolver_failover_targets() {
    let target = |t: Value| {
        resolver(
            json!({"Subsets": {"v1": {}}, "Failover": {"*": {"Targets": [{"Service": "a"}, t]}}}),
        )
    };
    let cases = [
        (
            json!({"Peer": "p", "ServiceSubset": "v1"}),
            "Peer cannot be set with ServiceSubset",
        ),
        (
            json!({"Peer": "p", "Partition": "x"}),
            "Partition cannot be set with Peer",
        ),
        (
            json!({"Peer": "p", "Datacenter": "dc2"}),
            "Peer cannot be set with Datacenter",
        ),
        (
            json!({"Partition": "x", "Datacenter": "dc2"}),
            "Partition cannot be set with Datacenter",
        ),
        (
            json!({"ServiceSubset": "v9"}),
            "ServiceSubset \"v9\" is not a valid subset of \"web\"",
        ),
    ];
    for (t, message) in cases {
        assert_eq!(
            ent_err(target(t)),
            format!("Bad Failover[\"*\"].Targets[1]: {message}")
        );
    }
    assert_eq!(
        ent_err(resolver(
            json!({"Partition": "p2", "Failover": {"*": {"Datacenters": ["dc2"]}}})
        )),
        "Cross-datacenter failover is only supported in the default partition"
    );
}

#[test]
fn resolver_timeouts() {
    assert_eq!(
        err(resolver(json!({"ConnectTimeout": "-1s"}))),
        "Bad ConnectTimeout '-1s', must be >= 0"
    );
    assert_eq!(
        err(resolver(json!({"RequestTimeout": "-1m30s"}))),
        "Bad RequestTimeout '-1m30s', must be >= 0"
    );
}

fn lb(value: Value) -> Value {
    resolver(json!({"LoadBalancer": value}))
}

#[test]
fn load_balancer_policies() {
    assert_eq!(
        err(lb(json!({"Policy": "fastest"}))),
        "Bad LoadBalancer policy: \"fastest\" is not supported"
    );
    assert_eq!(
        err(lb(
            json!({"Policy": "maglev", "RingHashConfig": {"MinimumRingSize": 1024}})
        )),
        "Bad LoadBalancer configuration. RingHashConfig specified for incompatible load balancing policy \"maglev\""
    );
    assert_eq!(
        err(lb(
            json!({"Policy": "random", "LeastRequestConfig": {"ChoiceCount": 2}})
        )),
        "Bad LoadBalancer configuration. LeastRequestConfig specified for incompatible load balancing policy \"random\""
    );
    assert_eq!(
        err(lb(
            json!({"Policy": "round_robin", "HashPolicies": [{"SourceIP": true}]})
        )),
        "Bad LoadBalancer configuration: HashPolicies specified for non-hash-based Policy: \"round_robin\""
    );
}

#[test]
fn load_balancer_hash_policies() {
    let hp = |p: Value| lb(json!({"Policy": "ring_hash", "HashPolicies": [{"SourceIP": true}, p]}));
    let cases = [
        (
            json!({"Field": "path", "FieldValue": "x"}),
            "\"path\" is not a supported field",
        ),
        (
            json!({"Field": "header", "SourceIP": true}),
            "A single hash policy cannot hash both a source address and a \"header\"",
        ),
        (
            json!({"FieldValue": "x", "SourceIP": true}),
            "A FieldValue cannot be specified when hashing SourceIP",
        ),
        (
            json!({"Field": "header"}),
            "Field \"header\" was specified without a FieldValue",
        ),
        (
            json!({"FieldValue": "x"}),
            "FieldValue requires a Field to apply to",
        ),
        (
            json!({"Field": "header", "FieldValue": "x", "CookieConfig": {}}),
            "cookie_config provided for \"header\"",
        ),
        (
            json!({"Field": "cookie", "FieldValue": "x", "CookieConfig": {"Session": true, "TTL": "10s"}}),
            "a session cookie cannot have an associated TTL",
        ),
    ];
    for (policy, message) in cases {
        assert_eq!(
            err(hp(policy)),
            format!("Bad LoadBalancer HashPolicy[1]: {message}")
        );
    }
    let ok =
        json!({"Field": "cookie", "FieldValue": "x", "CookieConfig": {"TTL": "10s", "Path": "/"}});
    assert_eq!(check(Edition::Community, hp(ok)), Ok(()));
}

#[test]
fn unknown_fields_are_rejected_on_chain_kinds_only() {
    let bad: Result<ConfigEntry, _> = serde_json::from_value(
        json!({"Kind": "service-resolver", "Name": "web", "ConectTimeout": "5s"}),
    );
    assert!(bad.unwrap_err().to_string().contains("ConectTimeout"));
    let ok: ConfigEntry = serde_json::from_value(json!({"Kind": "service-defaults", "Name": "web",
        "Protocol": "http", "MaxInboundConnections": 10, "UpstreamConfig": {}}))
    .expect("unmodelled service-defaults fields are ignored");
    assert_eq!(ok.name(), "web");
}
