//! Consul `TestCompile` corpus, routing and splitting cases, load-balancer cases and "all the
//! bells and whistles": each compiles Consul-shaped entries and compares the full chain JSON.

#![allow(
    clippy::needless_pass_by_value,
    reason = "the case builders take json! literals by value, for short call sites"
)]

mod support;

use serde_json::json;
use support::*;

fn main_router() -> serde_json::Value {
    json!({"Kind": "service-router", "Name": "main"})
}

fn noop_splitter() -> serde_json::Value {
    json!({"Kind": "service-splitter", "Name": "main", "Splits": [{"Weight": 100}]})
}

fn router_node(routes: Vec<serde_json::Value>) -> serde_json::Value {
    json!({"Type": "router", "Name": "main.default.default", "Routes": routes})
}

fn noop_split_node(next: &str) -> serde_json::Value {
    json!({
        "Type": "splitter", "Name": "main.default.default",
        "Splits": [{"Definition": {"Weight": 100}, "Weight": 100, "NextNode": next}]
    })
}

const MAIN: &str = "resolver:main.default.default.dc1";

#[test]
fn router_with_defaults() {
    assert_chain(
        json!([protocol("main", "http"), main_router()]),
        chain(
            "http",
            "router:main.default.default",
            vec![
                router_node(vec![
                    json!({"Definition": catch_all("main"), "NextNode": MAIN}),
                ]),
                resolver(&tid("main", "", "dc1"), true, "5s"),
            ],
            vec![target("main", "", "dc1")],
        ),
    );
}

#[test]
fn router_with_defaults_and_resolver() {
    let resolver_entry =
        json!({"Kind": "service-resolver", "Name": "main", "ConnectTimeout": "33s"});
    assert_chain(
        json!([protocol("main", "http"), main_router(), resolver_entry]),
        chain(
            "http",
            "router:main.default.default",
            vec![
                router_node(vec![
                    json!({"Definition": catch_all("main"), "NextNode": MAIN}),
                ]),
                resolver(&tid("main", "", "dc1"), false, "33s"),
            ],
            vec![with(
                target("main", "", "dc1"),
                json!({"ConnectTimeout": "33s"}),
            )],
        ),
    );
}

#[test]
fn router_with_defaults_and_noop_split() {
    assert_chain(
        json!([protocol("main", "http"), main_router(), noop_splitter()]),
        chain(
            "http",
            "router:main.default.default",
            vec![
                router_node(vec![
                    json!({"Definition": catch_all("main"), "NextNode": "splitter:main.default.default"}),
                ]),
                noop_split_node(MAIN),
                resolver(&tid("main", "", "dc1"), true, "5s"),
            ],
            vec![target("main", "", "dc1")],
        ),
    );
}

#[test]
fn router_with_defaults_and_noop_split_and_resolver() {
    let resolver_entry =
        json!({"Kind": "service-resolver", "Name": "main", "ConnectTimeout": "33s"});
    assert_chain(
        json!([
            protocol("main", "http"),
            main_router(),
            noop_splitter(),
            resolver_entry
        ]),
        chain(
            "http",
            "router:main.default.default",
            vec![
                router_node(vec![
                    json!({"Definition": catch_all("main"), "NextNode": "splitter:main.default.default"}),
                ]),
                noop_split_node(MAIN),
                resolver(&tid("main", "", "dc1"), false, "33s"),
            ],
            vec![with(
                target("main", "", "dc1"),
                json!({"ConnectTimeout": "33s"}),
            )],
        ),
    );
}

#[test]
fn router_with_no_destination() {
    let route = json!({"Match": {"HTTP": {"PathPrefix": "/"}}});
    let router = json!({"Kind": "service-router", "Name": "main", "Routes": [route]});
    assert_chain(
        json!([protocol("main", "http"), router]),
        chain(
            "http",
            "router:main.default.default",
            vec![
                router_node(vec![
                    json!({"Definition": route, "NextNode": MAIN}),
                    json!({"Definition": catch_all("main"), "NextNode": MAIN}),
                ]),
                resolver(&tid("main", "", "dc1"), true, "5s"),
            ],
            vec![target("main", "", "dc1")],
        ),
    );
}

#[test]
fn route_bypasses_splitter() {
    let route = json!({"Match": {"HTTP": {"PathPrefix": "/other"}}, "Destination": {"Service": "other", "ServiceSubset": "bypass"}});
    let filter = "Service.Meta.version == bypass";
    assert_chain(
        json!([
            protocol("main", "http"),
            protocol("other", "http"),
            {"Kind": "service-router", "Name": "main", "Routes": [route]},
            {"Kind": "service-splitter", "Name": "other", "Splits": [{"Weight": 100, "Service": "ignored"}]},
            {"Kind": "service-resolver", "Name": "other", "Subsets": {"bypass": {"Filter": filter}}},
        ]),
        chain(
            "http",
            "router:main.default.default",
            vec![
                router_node(vec![
                    json!({"Definition": route, "NextNode": "resolver:bypass.other.default.default.dc1"}),
                    json!({"Definition": catch_all("main"), "NextNode": MAIN}),
                ]),
                resolver(&tid("main", "", "dc1"), true, "5s"),
                resolver(&tid("other", "bypass", "dc1"), false, "5s"),
            ],
            vec![
                target("main", "", "dc1"),
                with(
                    target("other", "bypass", "dc1"),
                    json!({"Subset": {"Filter": filter}}),
                ),
            ],
        ),
    );
}

#[test]
fn noop_split() {
    assert_chain(
        json!([protocol("main", "http"), noop_splitter()]),
        chain(
            "http",
            "splitter:main.default.default",
            vec![
                noop_split_node(MAIN),
                resolver(&tid("main", "", "dc1"), true, "5s"),
            ],
            vec![target("main", "", "dc1")],
        ),
    );
}

#[test]
fn noop_split_with_protocol_from_proxy_defaults() {
    assert_chain(
        json!([global_protocol("http"), main_router(), noop_splitter()]),
        chain(
            "http",
            "router:main.default.default",
            vec![
                router_node(vec![
                    json!({"Definition": catch_all("main"), "NextNode": "splitter:main.default.default"}),
                ]),
                noop_split_node(MAIN),
                resolver(&tid("main", "", "dc1"), true, "5s"),
            ],
            vec![target("main", "", "dc1")],
        ),
    );
}

#[test]
fn noop_split_with_resolver() {
    let resolver_entry =
        json!({"Kind": "service-resolver", "Name": "main", "ConnectTimeout": "33s"});
    assert_chain(
        json!([protocol("main", "http"), noop_splitter(), resolver_entry]),
        chain(
            "http",
            "splitter:main.default.default",
            vec![
                noop_split_node(MAIN),
                resolver(&tid("main", "", "dc1"), false, "33s"),
            ],
            vec![with(
                target("main", "", "dc1"),
                json!({"ConnectTimeout": "33s"}),
            )],
        ),
    );
}

#[test]
fn subset_split() {
    let (f1, f2) = ("Service.Meta.version == 1", "Service.Meta.version == 2");
    assert_chain(
        json!([
            protocol("main", "http"),
            {"Kind": "service-splitter", "Name": "main", "Splits": [
                {"Weight": 60, "ServiceSubset": "v2"}, {"Weight": 40, "ServiceSubset": "v1"}]},
            {"Kind": "service-resolver", "Name": "main", "Subsets": {"v1": {"Filter": f1}, "v2": {"Filter": f2}}},
        ]),
        chain(
            "http",
            "splitter:main.default.default",
            vec![
                json!({"Type": "splitter", "Name": "main.default.default", "Splits": [
                    {"Definition": {"Weight": 60, "ServiceSubset": "v2"}, "Weight": 60,
                     "NextNode": "resolver:v2.main.default.default.dc1"},
                    {"Definition": {"Weight": 40, "ServiceSubset": "v1"}, "Weight": 40,
                     "NextNode": "resolver:v1.main.default.default.dc1"}]}),
                resolver(&tid("main", "v2", "dc1"), false, "5s"),
                resolver(&tid("main", "v1", "dc1"), false, "5s"),
            ],
            vec![
                with(
                    target("main", "v2", "dc1"),
                    json!({"Subset": {"Filter": f2}}),
                ),
                with(
                    target("main", "v1", "dc1"),
                    json!({"Subset": {"Filter": f1}}),
                ),
            ],
        ),
    );
}

#[test]
fn service_split() {
    assert_chain(
        json!([
            protocol("main", "http"), protocol("foo", "http"), protocol("bar", "http"),
            {"Kind": "service-splitter", "Name": "main", "Splits": [
                {"Weight": 60, "Service": "foo"}, {"Weight": 40, "Service": "bar"}]},
        ]),
        chain(
            "http",
            "splitter:main.default.default",
            vec![
                json!({"Type": "splitter", "Name": "main.default.default", "Splits": [
                    {"Definition": {"Weight": 60, "Service": "foo"}, "Weight": 60,
                     "NextNode": "resolver:foo.default.default.dc1"},
                    {"Definition": {"Weight": 40, "Service": "bar"}, "Weight": 40,
                     "NextNode": "resolver:bar.default.default.dc1"}]}),
                resolver(&tid("foo", "", "dc1"), true, "5s"),
                resolver(&tid("bar", "", "dc1"), true, "5s"),
            ],
            vec![target("foo", "", "dc1"), target("bar", "", "dc1")],
        ),
    );
}

#[test]
fn split_bypasses_next_splitter() {
    let bypass = "Service.Meta.version == bypass";
    assert_chain(
        json!([
            protocol("main", "http"), protocol("next", "http"),
            {"Kind": "service-splitter", "Name": "main", "Splits": [
                {"Weight": 100, "Service": "next", "ServiceSubset": "bypassed"}]},
            {"Kind": "service-splitter", "Name": "next", "Splits": [
                {"Weight": 100, "ServiceSubset": "not-bypassed"}]},
            {"Kind": "service-resolver", "Name": "next", "Subsets": {
                "bypassed": {"Filter": bypass},
                "not-bypassed": {"Filter": "Service.Meta.version != bypass"}}},
        ]),
        chain(
            "http",
            "splitter:main.default.default",
            vec![
                json!({"Type": "splitter", "Name": "main.default.default", "Splits": [
                    {"Definition": {"Weight": 100, "Service": "next", "ServiceSubset": "bypassed"},
                     "Weight": 100, "NextNode": "resolver:bypassed.next.default.default.dc1"}]}),
                resolver(&tid("next", "bypassed", "dc1"), false, "5s"),
            ],
            vec![with(
                target("next", "bypassed", "dc1"),
                json!({"Subset": {"Filter": bypass}}),
            )],
        ),
    );
}

fn ring_hash(max: u64) -> serde_json::Value {
    json!({"Policy": "ring_hash", "RingHashConfig": {"MaximumRingSize": max}, "HashPolicies": [{"SourceIP": true}]})
}

#[test]
fn loadbalancer_splitter_and_resolver() {
    let least = json!({"Policy": "least_request", "LeastRequestConfig": {"ChoiceCount": 3}});
    let maglev_in = json!({"Policy": "maglev", "HashPolicies": [{"Field": "cookie", "FieldValue": "chocolate-chip",
        "CookieConfig": {"TTL": "2m", "Path": "/bowl"}, "Terminal": true}]});
    let maglev_out = json!({"Policy": "maglev", "HashPolicies": [{"Field": "cookie", "FieldValue": "chocolate-chip",
        "CookieConfig": {"TTL": 120_000_000_000_i64, "Path": "/bowl"}, "Terminal": true}]});
    let lb_node = |service: &str, lb: &serde_json::Value| {
        with(
            resolver(&tid(service, "", "dc1"), false, "5s"),
            json!({"LoadBalancer": lb}),
        )
    };
    assert_chain(
        json!([
            protocol("foo", "http"), protocol("bar", "http"), protocol("baz", "http"),
            {"Kind": "service-splitter", "Name": "main", "Splits": [
                {"Weight": 60, "Service": "foo"}, {"Weight": 20, "Service": "bar"}, {"Weight": 20, "Service": "baz"}]},
            {"Kind": "service-resolver", "Name": "foo", "LoadBalancer": least},
            {"Kind": "service-resolver", "Name": "bar", "LoadBalancer": ring_hash(101)},
            {"Kind": "service-resolver", "Name": "baz", "LoadBalancer": maglev_in},
        ]),
        chain(
            "http",
            "splitter:main.default.default",
            vec![
                json!({"Type": "splitter", "Name": "main.default.default", "Splits": [
                    {"Definition": {"Weight": 60, "Service": "foo"}, "Weight": 60, "NextNode": "resolver:foo.default.default.dc1"},
                    {"Definition": {"Weight": 20, "Service": "bar"}, "Weight": 20, "NextNode": "resolver:bar.default.default.dc1"},
                    {"Definition": {"Weight": 20, "Service": "baz"}, "Weight": 20, "NextNode": "resolver:baz.default.default.dc1"}],
                    "LoadBalancer": ring_hash(101)}),
                lb_node("foo", &least),
                lb_node("bar", &ring_hash(101)),
                lb_node("baz", &maglev_out),
            ],
            vec![
                target("foo", "", "dc1"),
                target("bar", "", "dc1"),
                target("baz", "", "dc1"),
            ],
        ),
    );
}

#[test]
fn loadbalancer_resolver() {
    assert_chain(
        json!([
            protocol("main", "http"),
            {"Kind": "service-resolver", "Name": "main", "LoadBalancer": ring_hash(101)},
        ]),
        chain(
            "http",
            MAIN,
            vec![with(
                resolver(&tid("main", "", "dc1"), false, "5s"),
                json!({"LoadBalancer": ring_hash(101)}),
            )],
            vec![target("main", "", "dc1")],
        ),
    );
}

#[test]
fn all_the_bells_and_whistles() {
    let services = [
        "main",
        "svc-redirect",
        "svc-redirect-again",
        "svc-split",
        "svc-split-again",
        "svc-split-one-more-time",
        "redirected",
    ];
    let mut list: Vec<serde_json::Value> = services.iter().map(|s| protocol(s, "http")).collect();
    let parent_req = json!({"Set": {"parent": "1", "shared": "from-parent"}});
    let parent_resp = json!({"Set": {"parent": "2", "shared": "from-parent"}});
    list.extend([
        json!({"Kind": "service-router", "Name": "main", "Routes": [simple_route("svc-redirect"), simple_route("svc-split")]}),
        json!({"Kind": "service-splitter", "Name": "svc-split", "Splits": [
            {"Weight": 60, "Service": "svc-redirect"}, {"Weight": 40, "Service": "svc-split-again"}]}),
        json!({"Kind": "service-splitter", "Name": "svc-split-again", "Splits": [
            {"Weight": 75, "Service": "main", "ServiceSubset": "v1"},
            {"Weight": 25, "Service": "svc-split-one-more-time", "RequestHeaders": parent_req, "ResponseHeaders": parent_resp}]}),
        json!({"Kind": "service-splitter", "Name": "svc-split-one-more-time", "Splits": [
            {"Weight": 80, "Service": "main", "ServiceSubset": "v2"},
            {"Weight": 20, "Service": "main", "ServiceSubset": "v3",
             "RequestHeaders": {"Set": {"child": "3", "shared": "from-child"}},
             "ResponseHeaders": {"Set": {"child": "4", "shared": "from-parent"}}}]}),
        json!({"Kind": "service-resolver", "Name": "svc-redirect", "Redirect": {"Service": "svc-redirect-again"}}),
        json!({"Kind": "service-resolver", "Name": "svc-redirect-again", "Redirect": {"Service": "redirected"}}),
        json!({"Kind": "service-resolver", "Name": "redirected", "DefaultSubset": "prod",
            "Subsets": {"prod": {"Filter": "ServiceMeta.env == prod"}, "qa": {"Filter": "ServiceMeta.env == qa"}},
            "LoadBalancer": ring_hash(100)}),
        json!({"Kind": "service-resolver", "Name": "main", "DefaultSubset": "default-subset", "Subsets": {
            "v1": {"Filter": "Service.Meta.version == 1"}, "v2": {"Filter": "Service.Meta.version == 2"},
            "v3": {"Filter": "Service.Meta.version == 3"}, "default-subset": {"OnlyPassing": true}}}),
    ]);
    let prod = "resolver:prod.redirected.default.default.dc1";
    let subset_target = |subset: &str, n: u8| {
        with(
            target("main", subset, "dc1"),
            json!({"Subset": {"Filter": format!("Service.Meta.version == {n}")}}),
        )
    };
    assert_chain(
        serde_json::Value::Array(list),
        chain(
            "http",
            "router:main.default.default",
            vec![
                router_node(vec![
                    json!({"Definition": simple_route("svc-redirect"), "NextNode": prod}),
                    json!({"Definition": simple_route("svc-split"), "NextNode": "splitter:svc-split.default.default"}),
                    json!({"Definition": catch_all("main"), "NextNode": "resolver:default-subset.main.default.default.dc1"}),
                ]),
                json!({"Type": "splitter", "Name": "svc-split.default.default", "Splits": [
                    {"Definition": {"Weight": 60, "Service": "svc-redirect"}, "Weight": 60, "NextNode": prod},
                    {"Definition": {"Weight": 75, "Service": "main", "ServiceSubset": "v1"}, "Weight": 30,
                     "NextNode": "resolver:v1.main.default.default.dc1"},
                    {"Definition": {"Weight": 80, "Service": "main", "ServiceSubset": "v2",
                        "RequestHeaders": {"Set": {"parent": "1", "shared": "from-parent"}},
                        "ResponseHeaders": {"Set": {"parent": "2", "shared": "from-parent"}}},
                     "Weight": 8, "NextNode": "resolver:v2.main.default.default.dc1"},
                    {"Definition": {"Weight": 20, "Service": "main", "ServiceSubset": "v3",
                        "RequestHeaders": {"Set": {"parent": "1", "child": "3", "shared": "from-child"}},
                        "ResponseHeaders": {"Set": {"parent": "2", "child": "4", "shared": "from-parent"}}},
                     "Weight": 2, "NextNode": "resolver:v3.main.default.default.dc1"}],
                    "LoadBalancer": ring_hash(100)}),
                with(
                    resolver(&tid("redirected", "prod", "dc1"), false, "5s"),
                    json!({"LoadBalancer": ring_hash(100)}),
                ),
                resolver(&tid("main", "v1", "dc1"), false, "5s"),
                resolver(&tid("main", "v2", "dc1"), false, "5s"),
                resolver(&tid("main", "v3", "dc1"), false, "5s"),
                resolver(&tid("main", "default-subset", "dc1"), false, "5s"),
            ],
            vec![
                with(
                    target("redirected", "prod", "dc1"),
                    json!({"Subset": {"Filter": "ServiceMeta.env == prod"}}),
                ),
                subset_target("v1", 1),
                subset_target("v2", 2),
                subset_target("v3", 3),
                with(
                    target("main", "default-subset", "dc1"),
                    json!({"Subset": {"OnlyPassing": true}}),
                ),
            ],
        ),
    );
}

#[test]
fn multi_dc_canary() {
    let dc_target = |dc: &str| with(target("main", "", dc), json!({"ConnectTimeout": "33s"}));
    assert_chain(
        json!([
            protocol("main", "http"), protocol("main-dc2", "http"), protocol("main-dc3", "http"),
            {"Kind": "service-splitter", "Name": "main", "Splits": [
                {"Weight": 60, "Service": "main-dc2"}, {"Weight": 40, "Service": "main-dc3"}]},
            {"Kind": "service-resolver", "Name": "main-dc2", "Redirect": {"Service": "main", "Datacenter": "dc2"}},
            {"Kind": "service-resolver", "Name": "main-dc3", "Redirect": {"Service": "main", "Datacenter": "dc3"}},
            {"Kind": "service-resolver", "Name": "main", "ConnectTimeout": "33s"},
        ]),
        chain(
            "http",
            "splitter:main.default.default",
            vec![
                json!({"Type": "splitter", "Name": "main.default.default", "Splits": [
                    {"Definition": {"Weight": 60, "Service": "main-dc2"}, "Weight": 60,
                     "NextNode": "resolver:main.default.default.dc2"},
                    {"Definition": {"Weight": 40, "Service": "main-dc3"}, "Weight": 40,
                     "NextNode": "resolver:main.default.default.dc3"}]}),
                resolver(&tid("main", "", "dc2"), false, "33s"),
                resolver(&tid("main", "", "dc3"), false, "33s"),
            ],
            vec![dc_target("dc2"), dc_target("dc3")],
        ),
    );
}

/// Splitters leading one into the next, thousands deep (config entries can say so): refused
/// with a clear error instead of overflowing the stack; a chain within the bound compiles.
#[test]
fn splitter_chains_are_bounded() {
    let chain_of = |n: usize| {
        let mut list = vec![global_protocol("http")];
        for i in 0..n {
            let name = if i == 0 {
                "main".to_owned()
            } else {
                format!("s{i}")
            };
            list.push(json!({"Kind": "service-splitter", "Name": name,
                "Splits": [{"Weight": 100, "Service": format!("s{}", i + 1)}]}));
        }
        serde_json::Value::Array(list)
    };
    // Run on a small stack, as a thread of the daemon would: the bound must hold there too.
    let handle = std::thread::Builder::new()
        .stack_size(1024 * 1024)
        .spawn(move || {
            assert_error(
                chain_of(2000),
                "discovery chain \"main\" has more than 64 service-splitters leading one into the next; this compiler stops there",
            );
            compiled(&entries(chain_of(60)), &request())
        })
        .unwrap();
    let chain = handle.join().expect("no stack overflow");
    assert_eq!(chain["StartNode"], "splitter:main.default.default");
}
