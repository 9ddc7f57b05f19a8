//! Helpers shared by the compile corpus tests: entries from Consul-shaped JSON, and builders for
//! the expected JSON that mirror the helpers of Consul's `compile_test.go` (`newTarget`, ...).

#![allow(dead_code)]
#![allow(
    clippy::needless_pass_by_value,
    reason = "the builders take json! literals by value, for short call sites"
)]

use proxy_chain::{CompileRequest, Entries, compile};
use serde_json::{Value, json};

pub const TRUST_DOMAIN: &str = "trustdomain.consul";

/// Entries from a JSON array in Consul's API shape. Every set is also checked to be in
/// [`ENTRY_SETS`], the corpus `tests/consul_real.rs` compiles in a real Consul to compare.
pub fn entries(value: Value) -> Entries {
    let set = value.to_string();
    record(&set);
    Entries::from_json(&set).expect("valid entries")
}

/// Every entry set these tests compile, one JSON array a line, sorted.
pub const ENTRY_SETS: &str = include_str!("../entry_sets.jsonl");

/// Set to a file to append the sets there instead of checking them (then `sort -u` it into
/// `tests/entry_sets.jsonl`).
const WRITE_SETS: &str = "PROXY_CHAIN_WRITE_ENTRY_SETS";

/// Checks that `set` is in [`ENTRY_SETS`], or appends it to the file `WRITE_SETS` names.
fn record(set: &str) {
    use std::io::Write as _;
    if let Some(path) = std::env::var_os(WRITE_SETS) {
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .expect("open the entry set file");
        // One write per line, so that parallel tests never interleave within a line.
        file.write_all(format!("{set}\n").as_bytes())
            .expect("append an entry set");
        return;
    }
    assert!(
        ENTRY_SETS.lines().any(|line| line == set),
        "this entry set is not in proxy-chain/tests/entry_sets.jsonl, which consul_real \
         cross-checks against a real Consul; regenerate it: {WRITE_SETS}=/tmp/sets cargo test \
         -p proxy-chain --tests && sort -u /tmp/sets > proxy-chain/tests/entry_sets.jsonl\n{set}"
    );
}

/// `service-defaults` with just a protocol (Consul's `setServiceProtocol`).
pub fn protocol(name: &str, protocol: &str) -> Value {
    json!({"Kind": "service-defaults", "Name": name, "Protocol": protocol})
}

/// Global proxy-defaults with `Config.protocol` (Consul's `setGlobalProxyProtocol`).
pub fn global_protocol(protocol: &str) -> Value {
    json!({"Kind": "proxy-defaults", "Name": "global", "Config": {"protocol": protocol}})
}

/// Consul's `newSimpleRoute`: `PathPrefix: "/<name>"` to service `<name>`.
pub fn simple_route(name: &str) -> Value {
    json!({"Match": {"HTTP": {"PathPrefix": format!("/{name}")}}, "Destination": {"Service": name}})
}

/// The catch-all route the compiler appends.
pub fn catch_all(service: &str) -> Value {
    json!({
        "Match": {"HTTP": {"PathPrefix": "/"}},
        "Destination": {"Service": service, "Namespace": "default", "Partition": "default"}
    })
}

/// Target ID in the default namespace and partition.
pub fn tid(service: &str, subset: &str, dc: &str) -> String {
    if subset.is_empty() {
        format!("{service}.default.default.{dc}")
    } else {
        format!("{subset}.{service}.default.default.{dc}")
    }
}

/// Consul's `newTarget`: a target with default SNI, name and a 5 s connect timeout.
pub fn target(service: &str, subset: &str, dc: &str) -> Value {
    let sni = if subset.is_empty() {
        format!("{service}.default.{dc}.internal.{TRUST_DOMAIN}")
    } else {
        format!("{subset}.{service}.default.{dc}.internal.{TRUST_DOMAIN}")
    };
    let mut t = json!({
        "ConnectTimeout": "5s",
        "ID": tid(service, subset, dc),
        "Service": service,
        "Namespace": "default",
        "Partition": "default",
        "Datacenter": dc,
        "MeshGateway": {},
        "Subset": {},
        "TransparentProxy": {},
        "SNI": sni,
        "Name": sni,
    });
    if !subset.is_empty() {
        t["ServiceSubset"] = json!(subset);
    }
    t
}

/// `value` with the fields of `changes` replaced.
pub fn with(mut value: Value, changes: Value) -> Value {
    for (k, v) in changes.as_object().expect("object").clone() {
        value[k] = v;
    }
    value
}

/// A resolver node for `target_id`.
pub fn resolver(target_id: &str, default: bool, connect_timeout: &str) -> Value {
    let mut r = json!({"ConnectTimeout": connect_timeout, "Target": target_id});
    if default {
        r["Default"] = json!(true);
    }
    json!({"Type": "resolver", "Name": target_id, "Resolver": r})
}

/// A node map entry keyed by `<type>:<name>`.
pub fn keyed(nodes: Vec<Value>) -> Value {
    let mut map = serde_json::Map::new();
    for node in nodes {
        let key = format!(
            "{}:{}",
            node["Type"].as_str().unwrap(),
            node["Name"].as_str().unwrap()
        );
        map.insert(key, node);
    }
    Value::Object(map)
}

/// A targets map keyed by ID.
pub fn targets(list: Vec<Value>) -> Value {
    let mut map = serde_json::Map::new();
    for t in list {
        map.insert(t["ID"].as_str().unwrap().to_owned(), t);
    }
    Value::Object(map)
}

/// The whole expected chain for service `main` in dc1.
pub fn chain(protocol: &str, start: &str, nodes: Vec<Value>, target_list: Vec<Value>) -> Value {
    json!({
        "ServiceName": "main",
        "Namespace": "default",
        "Partition": "default",
        "Datacenter": "dc1",
        "Protocol": protocol,
        "StartNode": start,
        "Nodes": keyed(nodes),
        "Targets": targets(target_list),
    })
}

/// The request every corpus case uses (Consul's test: main, default/default, dc1).
pub fn request() -> CompileRequest {
    CompileRequest::new("main", "dc1", TRUST_DOMAIN)
}

/// Compiles `entries` and returns the chain as JSON.
pub fn compiled(entries: &Entries, req: &CompileRequest) -> Value {
    let chain = compile(req, entries).expect("compiles");
    serde_json::to_value(&chain).expect("serializes")
}

/// Compiles with the default request and compares the full JSON.
pub fn assert_chain(entries_json: Value, expect: Value) {
    let actual = compiled(&entries(entries_json), &request());
    assert_eq!(
        actual,
        expect,
        "\nactual:\n{}",
        serde_json::to_string_pretty(&actual).unwrap()
    );
}

/// Compiles with the default request and compares the exact error text.
pub fn assert_error(entries_json: Value, expect: &str) {
    let err = compile(&request(), &entries(entries_json)).expect_err("compile must fail");
    assert_eq!(err.to_string(), expect);
}
