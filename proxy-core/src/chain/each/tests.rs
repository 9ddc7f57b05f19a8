//! One chain at a time: an entry that cannot be used, or that both the file and Consul define,
//! leaves out only the chains that read it.

use std::path::Path;

use proxy_chain::ConfigEntry;
use serde_json::json;

use super::*;

const CONFIG: &str = "\
clusters:
  - name: web
  - name: api
  - name: backup
config_entries:
  - Kind: service-resolver
    Name: web
    Failover:
      '*': { Service: backup }
services:
  - { name: web, address: 127.77.0.1, port: 80, chain: web }
  - { name: api, address: 127.77.0.2, port: 80, chain: api }
";

fn config() -> Config {
    Config::parse(CONFIG, Path::new("test.yaml")).expect("valid config")
}

fn entry(value: serde_json::Value) -> ConfigEntry {
    serde_json::from_value(value).expect("decodes")
}

fn failures(out: &CompiledChains) -> Vec<(&str, &str)> {
    out.failures
        .iter()
        .map(|f| (f.service.as_str(), f.reason.as_str()))
        .collect()
}

#[test]
fn without_consul_entries_every_chain_compiles_as_at_load() {
    let config = config();
    let out = compile_each(&config, &config.config_entries, &[]);
    assert!(out.failures.is_empty(), "{:?}", out.failures);
    assert_eq!(out.chains, config.chains);
}

#[test]
fn an_entry_in_the_file_and_in_consul_is_refused_for_the_chains_that_read_it() {
    let config = config();
    let consul = [entry(json!({"Kind": "service-resolver", "Name": "web",
        "ConnectTimeout": "3s"}))];
    let out = compile_each(&config, &config.config_entries, &consul);
    let failures = failures(&out);
    assert_eq!(failures.len(), 1, "{failures:?}");
    assert_eq!(failures[0].0, "web");
    assert!(
        failures[0].1.contains("service-resolver \"web\"")
            && failures[0]
                .1
                .contains("both in the configuration file and in Consul"),
        "{failures:?}"
    );
    assert_eq!(out.chains.keys().collect::<Vec<_>>(), ["api"]);
}

#[test]
fn an_entry_consul_took_but_this_daemon_cannot_use_skips_only_its_chains() {
    let config = config();
    // Consul 1.8.7 takes a negative weight when the sum is 100; this daemon does not.
    let consul = [entry(json!({"Kind": "service-splitter", "Name": "api",
        "Splits": [{"Weight": 200}, {"Weight": -100, "Service": "backup"}]}))];
    let out = compile_each(&config, &config.config_entries, &consul);
    let failures = failures(&out);
    assert_eq!(failures.len(), 1, "{failures:?}");
    assert_eq!(failures[0].0, "api");
    assert!(failures[0].1.contains("negative Weight"), "{failures:?}");
    assert_eq!(out.chains.keys().collect::<Vec<_>>(), ["web"]);
    assert_eq!(out.chains["web"], config.chains["web"]);
}

#[test]
fn a_chain_that_does_not_compile_is_left_out_alone() {
    let config = config();
    // A valid entry, but Consul's compiler refuses a splitter on a tcp service.
    let consul = [entry(json!({"Kind": "service-splitter", "Name": "api",
        "Splits": [{"Weight": 50}, {"Weight": 50, "Service": "backup"}]}))];
    let out = compile_each(&config, &config.config_entries, &consul);
    let failures = failures(&out);
    assert_eq!(failures.len(), 1, "{failures:?}");
    assert!(failures[0].1.starts_with("chain \"api\": "), "{failures:?}");
    assert!(failures[0].1.contains("tcp"), "{failures:?}");
    assert_eq!(out.chains.keys().collect::<Vec<_>>(), ["web"]);
}

#[test]
fn a_target_without_a_cluster_is_left_out_alone() {
    let config = config();
    let consul = [entry(json!({"Kind": "service-resolver", "Name": "api",
        "Redirect": {"Service": "nowhere"}}))];
    let out = compile_each(&config, &config.config_entries, &consul);
    let failures = failures(&out);
    assert_eq!(failures.len(), 1, "{failures:?}");
    assert!(
        failures[0].1.contains("needs a cluster named \"nowhere\""),
        "{failures:?}"
    );
    assert_eq!(out.chains.keys().collect::<Vec<_>>(), ["web"]);
}

#[test]
fn an_unusable_proxy_defaults_is_read_by_every_chain() {
    let config = config();
    let consul = [entry(
        json!({"Kind": "proxy-defaults", "Name": "not-global"}),
    )];
    let out = compile_each(&config, &config.config_entries, &consul);
    assert_eq!(
        failures(&out).iter().map(|f| f.0).collect::<Vec<_>>(),
        ["web", "api"]
    );
    assert!(out.chains.is_empty());
}

#[test]
fn hash_policies_from_consul_leave_a_kernel_path_chain_out_with_the_reason() {
    let config = config();
    let consul = [entry(json!({"Kind": "service-resolver", "Name": "api",
        "LoadBalancer": {"Policy": "maglev", "HashPolicies": [{"SourceIP": true}]}}))];
    let out = compile_each(&config, &config.config_entries, &consul);
    let failures = failures(&out);
    assert_eq!(failures.len(), 1, "{failures:?}");
    assert_eq!(failures[0].0, "api");
    assert!(
        failures[0].1.contains("LoadBalancer.HashPolicies") && failures[0].1.contains("hash_key"),
        "{failures:?}"
    );
    assert_eq!(out.chains.keys().collect::<Vec<_>>(), ["web"]);
}

/// A configuration of two direct chain services over `api` (whose resolver is `resolver`) and
/// a tcp split of `mixed` between `api` and `backup` (whose resolver is `backup`).
fn policy_config(resolver: &str, backup: &str, hash_key: &str) -> Result<Config, String> {
    let yaml = format!(
        "clusters:\n  - name: api\n  - name: backup\nconfig_entries:\n  - {{Kind: service-resolver, Name: api{resolver}}}\n  - {{Kind: service-resolver, Name: backup{backup}}}\n  - {{Kind: service-splitter, Name: mixed, Splits: [{{Weight: 50, Service: api}}, {{Weight: 50, Service: backup}}]}}\nservices:\n  - {{ name: api, address: 127.77.0.1, port: 80, chain: api{hash_key} }}\n  - {{ name: mixed, address: 127.77.0.2, port: 80, chain: mixed, chain_options: {{ tcp_splits: true }} }}\n"
    );
    Config::parse(&yaml, Path::new("t.yaml")).map_err(|e| e.to_string())
}

#[test]
fn a_resolver_policy_the_kernel_cannot_serve_is_refused_naming_the_field() {
    let maglev = ", LoadBalancer: {Policy: maglev}";
    let rotate = ", LoadBalancer: {Policy: round_robin}";
    let ok = policy_config(maglev, maglev, ", hash_key: user").expect("one policy, hashed");
    assert_eq!(ok.chains.len(), 2);
    let ring = ", LoadBalancer: {Policy: ring_hash}";
    let both = policy_config(maglev, ring, "").expect("maglev and ring_hash: one Maglev table");
    assert_eq!(both.chains.len(), 2);
    for (resolver, backup, hash_key, why) in [
        (
            ", LoadBalancer: {Policy: ring_hash, HashPolicies: [{Field: header, FieldValue: x-user}]}",
            "",
            "",
            "LoadBalancer.HashPolicies",
        ),
        (maglev, rotate, "", "set different LoadBalancer policies"),
        (
            rotate,
            "",
            ", hash_key: process",
            "sets hash_key, but its chain's load-balancing policy is RoundRobin",
        ),
        (
            "",
            "",
            ", hash_key: process",
            "sets hash_key, but its chain's load-balancing policy is Random",
        ),
        (
            ", LoadBalancer: {Policy: least_request, LeastRequestConfig: {ChoiceCount: 3}}",
            "",
            "",
            "ChoiceCount 3",
        ),
    ] {
        let err = policy_config(resolver, backup, hash_key).expect_err(why);
        assert!(err.contains(why), "{why}: {err}");
    }
}
