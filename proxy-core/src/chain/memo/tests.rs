//! A composition compiles only the chains whose entries changed, and its chains are those a
//! composition from scratch gives.

use std::path::Path;

use proxy_chain::ConfigEntry;
use serde_json::json;

use crate::{
    config::Config,
    desired::{Overlay, Source},
};

/// Three split services over two legs, watching Consul's entries.
const FILE: &str = "\
clusters:
  - name: leg-a
  - name: leg-b
services:
  - { name: split-0, address: 127.77.0.1, port: 80, chain: split-0 }
  - { name: split-1, address: 127.77.0.2, port: 80, chain: split-1 }
  - { name: split-2, address: 127.77.0.3, port: 80, chain: split-2 }
consul_config_entries: { address: \"127.0.0.1:8500\" }
";

fn entry(value: serde_json::Value) -> ConfigEntry {
    serde_json::from_value(value).expect("decodes")
}

/// Consul's entries: the legs and each split service HTTP, split `m` all to `legs[m]`, plus
/// `extra`.
fn consul(legs: [&str; 3], extra: &[serde_json::Value]) -> Overlay {
    let mut entries: Vec<ConfigEntry> = ["leg-a", "leg-b"]
        .into_iter()
        .map(|leg| entry(json!({"Kind": "service-defaults", "Name": leg, "Protocol": "http"})))
        .collect();
    for (m, leg) in legs.iter().enumerate() {
        entries.push(entry(
            json!({"Kind": "service-defaults", "Name": format!("split-{m}"),
            "Protocol": "http"}),
        ));
        entries.push(entry(
            json!({"Kind": "service-splitter", "Name": format!("split-{m}"),
            "Splits": [{"Weight": 100, "Service": leg}]}),
        ));
    }
    entries.extend(extra.iter().cloned().map(entry));
    Overlay {
        config_entries: entries,
        ..Overlay::default()
    }
}

fn file() -> Config {
    Config::parse(FILE, Path::new("test.yaml")).expect("valid")
}

/// `file` composed with `overlay` after `previous`; also checks that the chains are the ones
/// compiling every chain again gives (the same `previous` without its memo).
fn compose(file: &Config, overlay: &Overlay, previous: Option<&Config>) -> Config {
    let composed = file
        .compose([(Source::ConsulEntries, overlay)], previous)
        .expect("composes");
    let forgotten = previous.map(|p| {
        let mut forgotten = p.clone();
        forgotten.chain_memo = std::sync::Arc::default();
        forgotten
    });
    let scratch = file
        .compose([(Source::ConsulEntries, overlay)], forgotten.as_ref())
        .expect("composes");
    assert_eq!(composed.chains, scratch.chains);
    assert_eq!(composed.chain_failures, scratch.chain_failures);
    composed
}

fn target_services(config: &Config, service: &str) -> Vec<String> {
    config.chains[service]
        .targets
        .values()
        .map(|t| t.service.clone())
        .collect()
}

#[test]
fn a_moved_splitter_recompiles_its_chain_alone() {
    let file = file();
    let first = compose(&file, &consul(["leg-a"; 3], &[]), None);
    assert_eq!(first.chain_memo.compiled(), 3);
    let moved = compose(
        &file,
        &consul(["leg-a", "leg-b", "leg-a"], &[]),
        Some(&first),
    );
    assert_eq!(moved.chain_memo.compiled(), 1);
    assert_eq!(target_services(&moved, "split-1"), ["leg-b"]);
    assert_eq!(moved.chains["split-0"], first.chains["split-0"]);
    let again = compose(
        &file,
        &consul(["leg-a", "leg-b", "leg-a"], &[]),
        Some(&moved),
    );
    assert_eq!(again.chain_memo.compiled(), 0, "nothing changed");
}

#[test]
fn an_entry_a_chain_looked_up_and_did_not_find_is_a_change_when_it_comes() {
    let file = file();
    let first = compose(&file, &consul(["leg-a", "leg-b", "leg-b"], &[]), None);
    // leg-b's resolver: read (absent) by the chains that reach leg-b, by no other.
    let redirect = json!({"Kind": "service-resolver", "Name": "leg-b",
        "ConnectTimeout": "3s"});
    let next = compose(
        &file,
        &consul(["leg-a", "leg-b", "leg-b"], &[redirect]),
        Some(&first),
    );
    assert_eq!(next.chain_memo.compiled(), 2);
    assert_ne!(next.chains["split-1"], first.chains["split-1"]);
    assert_eq!(next.chains["split-0"], first.chains["split-0"]);
}

#[test]
fn proxy_defaults_and_the_request_are_read_by_every_chain() {
    let file = file();
    let first = compose(&file, &consul(["leg-a"; 3], &[]), None);
    let global = json!({"Kind": "proxy-defaults", "Name": "global",
        "MeshGateway": {"Mode": "local"}});
    let next = compose(&file, &consul(["leg-a"; 3], &[global]), Some(&first));
    assert_eq!(next.chain_memo.compiled(), 3);
    // Another datacenter is another request: every chain compiles again.
    let other_dc =
        Config::parse(&format!("{FILE}datacenter: dc2\n"), Path::new("t.yaml")).expect("valid");
    let moved = compose(&other_dc, &consul(["leg-a"; 3], &[]), Some(&first));
    assert_eq!(moved.chain_memo.compiled(), 3);
}

#[test]
fn an_unusable_entry_leaves_out_the_chains_that_read_it_whether_kept_or_compiled() {
    let file = file();
    let first = compose(&file, &consul(["leg-a", "leg-b", "leg-a"], &[]), None);
    // Consul takes a negative weight when the sum is 100; this daemon does not. The splitter
    // is unusable: split-1, which read it, keeps its chain in force and is reported.
    let mut overlay = consul(["leg-a", "leg-b", "leg-a"], &[]);
    overlay.config_entries[5] = entry(json!({"Kind": "service-splitter", "Name": "split-1",
        "Splits": [{"Weight": 200, "Service": "leg-a"}, {"Weight": -100, "Service": "leg-b"}]}));
    let next = compose(&file, &overlay, Some(&first));
    assert_eq!(
        next.chain_failures
            .iter()
            .map(|f| f.service.as_str())
            .collect::<Vec<_>>(),
        ["split-1"]
    );
    assert_eq!(
        next.chains["split-1"], first.chains["split-1"],
        "kept in force"
    );
    assert_eq!(next.chains["split-0"], first.chains["split-0"]);
}
