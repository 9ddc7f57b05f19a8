//! Configuration parsing and validation: the examples parse, errors point at file:line:column
//! and name the field.

use std::{net::SocketAddr, path::Path, time::Duration};

use super::*;

mod zone;
use crate::config::sources::dns::{DnsLookupFamily, QueryLimits};

fn parse(text: &str) -> Result<Config, ConfigError> {
    Config::parse(text, Path::new("test.yaml"))
}

fn invalid(text: &str) -> (String, usize, usize, String) {
    match parse(text) {
        Err(err @ ConfigError::Invalid { .. }) => {
            let at = err.position().unwrap();
            (
                err.field().unwrap().to_owned(),
                at.line,
                at.column,
                err.to_string(),
            )
        }
        other => panic!("expected an Invalid error, got {other:?}"),
    }
}

#[test]
fn examples_parse() {
    // Every file in examples/, so a new one cannot go unchecked.
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    names.sort();
    for want in [
        "chain.yaml",
        "consul.yaml",
        "demo.yaml",
        "eds.yaml",
        "health.yaml",
        "original_dst.yaml",
        "proxy.yaml",
        "static.yaml",
        "strict_dns.yaml",
    ] {
        assert!(
            names.iter().any(|n| n == want),
            "examples/{want} is missing"
        );
    }
    for name in &names {
        let path = dir.join(name);
        let config = Config::load(&path).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(!config.services.is_empty(), "{name} has services");
    }
}

/// The README's "One example": its YAML block, as written there, passes what `proxy check`
/// passes.
#[test]
fn the_readme_example_parses() {
    let readme = include_str!("../../../README.md");
    let section = readme
        .split("\n## One example\n")
        .nth(1)
        .expect("README.md has a section \"One example\"");
    let block = section
        .split("```yaml\n")
        .nth(1)
        .and_then(|rest| rest.split("\n```").next())
        .expect("the section has a yaml block");
    let config = parse(block).unwrap_or_else(|e| panic!("README.md, \"One example\": {e}"));
    assert_eq!(config.services.len(), 1);
    assert_eq!(config.cluster("api").unwrap().static_hosts().len(), 3);
}

#[test]
fn embedded_default_is_the_demo() {
    let config = Config::embedded_default();
    assert_eq!(config.instance, "proxy-demo");
    let hosts = config.cluster("web").unwrap().static_hosts();
    let weights: Vec<u32> = hosts.iter().map(|h| h.weight).collect();
    assert_eq!(weights, [5, 3, 2]);
    assert!(
        config.services[0]
            .address
            .to_string()
            .starts_with("127.77.")
    );
}

#[test]
fn defaults_apply() {
    let config = parse("clusters: []\n").unwrap();
    assert_eq!(config.instance, "proxy");
    assert_eq!(config.bpffs, "/sys/fs/bpf");
    assert_eq!(config.admin.address, defaults::admin_address());
}

#[test]
fn unknown_field_names_line_column_and_field() {
    let text = "instance: x\nclusters:\n  - name: a\n    typo: 1\n";
    let (field, line, column, msg) = invalid(text);
    assert_eq!(field, "clusters[0].typo");
    assert_eq!((line, column), (4, 5));
    assert!(
        msg.starts_with("test.yaml:4:5: clusters[0].typo: unknown field `typo`"),
        "{msg}"
    );
}

#[test]
fn wrong_type_is_located() {
    let text =
        "services:\n  - name: s\n    address: 127.77.0.1\n    port: eighty\n    cluster: c\n";
    let (field, line, _, msg) = invalid(text);
    assert_eq!(field, "services[0].port");
    assert_eq!(line, 4);
    assert!(msg.contains("invalid type"), "{msg}");
}

#[test]
fn missing_cluster_reference_is_located() {
    let text = "clusters:\n  - name: a\nservices:\n  - name: s\n    address: 127.77.0.1\n    port: 80\n    cluster: nope\n";
    let (field, line, column, msg) = invalid(text);
    assert_eq!(field, "services[0].cluster");
    assert_eq!((line, column), (7, 5));
    assert!(msg.ends_with("no cluster named \"nope\""), "{msg}");
}

#[test]
fn semantic_errors_name_the_field() {
    let cases = [
        (
            "clusters:\n  - name: a\n  - name: a\n",
            "clusters[1].name",
            "duplicate",
        ),
        (
            "clusters:\n  - name: a\n    lb_policy: RING_HASH\n    maglev_lb_config: {}\n",
            "clusters[0].maglev_lb_config",
            "applies to lb_policy Maglev only",
        ),
        (
            "clusters:\n  - name: a\n    type: ORIGINAL_DST\n    load_assignment: {}\n",
            "clusters[0].load_assignment",
            "original destinations",
        ),
        (
            "clusters:\n  - name: a\n    type: ORIGINAL_DST\n    lb_policy: MAGLEV\n",
            "clusters[0].lb_policy",
            "CLUSTER_PROVIDED",
        ),
        (
            "clusters:\n  - name: a\n    cleanup_interval: 1s\n",
            "clusters[0].cleanup_interval",
            "only ORIGINAL_DST",
        ),
        (
            "clusters:\n  - name: a\n    type: ORIGINAL_DST\n    cleanup_interval: 0.000000001s\n",
            "clusters[0].cleanup_interval",
            "at least 1ms",
        ),
        (
            "clusters:\n  - name: a\n    type: ORIGINAL_DST\n  - name: b\n    type: ORIGINAL_DST\n    cleanup_interval: 1s\n",
            "clusters[1].cleanup_interval",
            "share one host pool",
        ),
        (
            "clusters:\n  - name: o\n    type: ORIGINAL_DST\nservices:\n  - {name: s, address: 127.77.0.1, port: 80, cluster: o}\n",
            "services[0].mode",
            "set mode: proxy",
        ),
        (
            "clusters:\n  - name: a\nservices:\n  - {name: s, address: 127.77.0.1, port: 53, protocol: UDP, cluster: a, mode: proxy}\n",
            "services[0].mode",
            "UDP",
        ),
        (
            "proxy:\n  fallback_cluster: nope\n",
            "proxy.fallback_cluster",
            "no cluster named",
        ),
        (
            "clusters:\n  - name: a\nservices:\n  - {name: s, address: 127.77.0.1, port: 80, cluster: a, mode: proxy}\nproxy:\n  listeners: []\n",
            "proxy.listeners",
            "listener",
        ),
        (
            "proxy:\n  cleanup_interval: 1s\n",
            "proxy.cleanup_interval",
            "unknown field",
        ),
        (
            "clusters:\n  - name: a\n    type: EDS\n",
            "clusters[0].eds_cluster_config",
            "need eds_cluster_config",
        ),
        (
            "clusters:\n  - name: a\n    type: STRICT_DNS\n    dns_failure_refresh_rate: { base_interval: 2s, max_interval: 1s }\n",
            "clusters[0].dns_failure_refresh_rate",
            "max_interval greater than or equal to the base_interval",
        ),
        (
            "clusters:\n  - name: a\n    type: LOGICAL_DNS\n",
            "clusters[0].load_assignment",
            "single lb_endpoint",
        ),
        (
            "clusters:\n  - name: a\n    health_checks:\n      - interval: 1s\n        tcp_health_check: {}\n",
            "clusters[0].health_checks[0]",
            "timeout",
        ),
        ("instance: a/b\n", "instance", "bpffs"),
        (
            "clusters:\n  - name: a\n    load_assignment:\n      endpoints:\n        - lb_endpoints:\n            - endpoint: { address: { socket_address: { address: web.local, port_value: 80 } } }\n",
            "clusters[0].load_assignment.endpoints[0].lb_endpoints[0].endpoint.address.socket_address.address",
            "not an IP",
        ),
        (
            "clusters:\n  - name: a\n    load_assignment:\n      endpoints:\n        - priority: 4\n",
            "clusters[0].load_assignment.endpoints[0].priority",
            "less than 4",
        ),
    ];
    for (text, want_field, want_msg) in cases {
        let (field, line, _, msg) = invalid(text);
        assert_eq!(field, want_field, "{text}");
        assert!(line > 0, "{msg}");
        assert!(msg.contains(want_msg), "{msg}");
    }
}

/// A STATIC host the data path would refuse at run time (never a host, or the daemon's own VIP)
/// is refused by `proxy check`, at its line.
#[test]
fn static_hosts_that_are_never_hosts_are_refused() {
    let cases = [
        (
            "clusters:\n  - name: a\n    load_assignment: { endpoints: [ { lb_endpoints: [ { endpoint: { address: { socket_address: { address: \"0.0.0.0\", port_value: 80 } } } } ] } ] }\n",
            "clusters[0].load_assignment.endpoints[0].lb_endpoints[0].endpoint.address.socket_address",
            "unspecified",
        ),
        (
            "clusters:\n  - name: a\n    load_assignment: { endpoints: [ { lb_endpoints: [ { endpoint: { address: { socket_address: { address: \"255.255.255.255\", port_value: 80 } } } } ] } ] }\n",
            "clusters[0].load_assignment.endpoints[0].lb_endpoints[0].endpoint.address.socket_address",
            "broadcast",
        ),
        (
            "clusters:\n  - name: a\n    load_assignment: { endpoints: [ { lb_endpoints: [ { endpoint: { address: { socket_address: { address: \"224.0.0.1\", port_value: 80 } } } } ] } ] }\n",
            "clusters[0].load_assignment.endpoints[0].lb_endpoints[0].endpoint.address.socket_address",
            "multicast",
        ),
        (
            "clusters:\n  - name: a\n    load_assignment: { endpoints: [ { lb_endpoints: [ { endpoint: { address: { socket_address: { address: \"169.254.169.254\", port_value: 80 } } } } ] } ] }\n",
            "clusters[0].load_assignment.endpoints[0].lb_endpoints[0].endpoint.address.socket_address",
            "link-local",
        ),
        (
            "clusters:\n  - name: a\n    load_assignment: { endpoints: [ { lb_endpoints: [ { endpoint: { address: { socket_address: { address: \"fe80::1\", port_value: 80 } } } } ] } ] }\n",
            "clusters[0].load_assignment.endpoints[0].lb_endpoints[0].endpoint.address.socket_address",
            "link-local",
        ),
        (
            "clusters:\n  - name: a\n    load_assignment: { endpoints: [ { lb_endpoints: [ { endpoint: { address: { socket_address: { address: \"127.77.0.1\", port_value: 80 } } } } ] } ] }\nservices:\n  - {name: s, address: 127.77.0.1, port: 80, cluster: a}\n",
            "clusters[0].load_assignment.endpoints[0].lb_endpoints[0].endpoint.address.socket_address",
            "VIP",
        ),
    ];
    for (text, want_field, want_msg) in cases {
        let (field, line, _, msg) = invalid(text);
        assert_eq!(field, want_field, "{text}");
        assert!(line > 0, "{msg}");
        assert!(msg.contains(want_msg), "{msg}");
    }
}

#[test]
fn duplicate_service_address_rejected() {
    let text = "clusters:\n  - name: a\nservices:\n  - {name: s, address: 127.77.0.1, port: 80, cluster: a}\n  - {name: t, address: 127.77.0.1, port: 80, cluster: a}\n";
    let (field, line, _, msg) = invalid(text);
    assert_eq!(field, "services[1].address");
    assert_eq!(line, 5);
    assert!(msg.contains("already a service"), "{msg}");
}

#[test]
fn yaml_syntax_error_is_located() {
    let (_, line, _, msg) = invalid("clusters:\n  - name: [unclosed\n");
    assert!(line >= 2, "{msg}");
}

#[test]
fn dns_cluster_with_health_checks_parses() {
    let text = "\
clusters:
  - name: web
    type: STRICT_DNS
    dns_refresh_rate: 1s
    respect_dns_ttl: true
    dns_lookup_family: V4_ONLY
    dns_resolvers: [\"127.0.0.1:5353\"]
    health_checks:
      - timeout: 1s
        interval: 2s
        unhealthy_threshold: 2
        healthy_threshold: 1
        http_health_check: { path: /healthz }
    outlier_detection: { consecutive_5xx: 3 }
    common_lb_config: { healthy_panic_threshold: { value: 0 } }
    load_assignment:
      endpoints:
        - lb_endpoints:
            - endpoint: { address: { socket_address: { address: web.svc.test, port_value: 80 } } }
              health_status: DEGRADED
";
    let config = parse(text).unwrap();
    let cluster = &config.clusters[0];
    let endpoints = cluster.dns_endpoints();
    assert_eq!(endpoints[0].address, "web.svc.test");
    assert_eq!(endpoints[0].health, crate::host::EdsHealth::Degraded);
    assert_eq!(
        cluster.dns_settings().dns_refresh_rate,
        std::time::Duration::from_secs(1)
    );
    assert!(cluster.health_config().validate("web").unwrap().is_some());
}

const CHAIN_CONFIG: &str = "\
clusters:
  - name: web
  - name: backup
config_entries:
  - Kind: service-resolver
    Name: web
    Failover:
      '*': { Service: backup }
services:
  - name: web
    address: 127.77.0.1
    port: 80
    chain: web
";

#[test]
fn chain_service_compiles_at_load() {
    let config = parse(CHAIN_CONFIG).unwrap();
    let chain = &config.chains["web"];
    assert_eq!(chain.start_node, "resolver:web.default.default.dc1");
    let plan = config.chain_plan(&config.services[0]).unwrap();
    assert_eq!(
        plan.clusters().into_iter().collect::<Vec<_>>(),
        ["backup", "web"]
    );
}

#[test]
fn chain_errors_are_located() {
    let missing = CHAIN_CONFIG.replace("  - name: backup\n", "");
    let (field, line, _, msg) = invalid(&missing);
    assert_eq!((field.as_str(), line), ("services[0].chain", 12));
    assert!(msg.contains("needs a cluster named \"backup\""), "{msg}");

    let bad_entry =
        CHAIN_CONFIG.replace("Failover:\n      '*': { Service: backup }", "Redirect: {}");
    let (field, line, _, msg) = invalid(&bad_entry);
    assert_eq!((field.as_str(), line), ("config_entries[0]", 5));
    assert!(msg.contains("Redirect is empty"), "{msg}");

    let both = CHAIN_CONFIG.replace("    chain: web\n", "    chain: web\n    cluster: web\n");
    let (field, _, _, msg) = invalid(&both);
    assert_eq!(field, "services[0].cluster");
    assert!(msg.contains("exactly one"), "{msg}");
}

#[test]
fn entries_from_a_json_file_in_consuls_api_shape() {
    let dir = std::env::temp_dir().join(format!("proxy-cfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("entries.json"),
        r#"[{"Kind":"service-resolver","Name":"web","Redirect":{"Service":"backup"}}]"#,
    )
    .unwrap();
    let text = CHAIN_CONFIG.replace(
        "config_entries:\n  - Kind: service-resolver\n    Name: web\n    Failover:\n      '*': { Service: backup }\n",
        "config_entry_files: [entries.json]\n",
    );
    let config = Config::parse(&text, &dir.join("proxy.yaml")).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    let plan = config.chain_plan(&config.services[0]).unwrap();
    assert_eq!(plan.clusters().into_iter().collect::<Vec<_>>(), ["backup"]);
}

#[test]
fn proxy_mode_and_original_dst_are_accepted() {
    let text = "\
clusters:
  - name: web
    load_assignment:
      endpoints:
        - lb_endpoints:
            - endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: 8080 } } }
  - name: passthrough
    type: ORIGINAL_DST
    lb_policy: CLUSTER_PROVIDED
    cleanup_interval: 250ms
    original_dst_lb_config: { use_http_header: true }
services:
  - { name: web, address: 127.77.0.1, port: 80, cluster: web, mode: proxy }
  - { name: pass, address: 127.77.0.2, port: 80, cluster: passthrough, mode: proxy }
proxy:
  listeners: [127.0.0.1:15901]
  drain_timeout: 2s
  fallback_cluster: passthrough
splice: true
";
    let config = Config::parse(text, Path::new("test.yaml")).expect("valid");
    assert!(config.uses_proxy());
    assert!(config.splice);
    assert!(config.is_original_dst("passthrough"));
    assert!(!config.is_original_dst("web"));
    let proxy = config.effective_proxy();
    assert_eq!(proxy.listeners, vec!["127.0.0.1:15901".parse().unwrap()]);
    assert_eq!(proxy.drain_timeout, std::time::Duration::from_secs(2));
    assert_eq!(
        proxy.cleanup_interval,
        std::time::Duration::from_millis(250)
    );
    assert!(proxy.use_http_header);
    assert_eq!(proxy.fallback_cluster.as_deref(), Some("passthrough"));
    // Without a proxy section: Envoy's ORIGINAL_DST default and the default listeners.
    let plain = Config::parse(
        "clusters:\n  - name: o\n    type: ORIGINAL_DST\n",
        Path::new("t.yaml"),
    )
    .unwrap();
    assert!(!plain.uses_proxy());
    assert_eq!(
        plain.effective_proxy().cleanup_interval,
        std::time::Duration::from_millis(5000)
    );
    assert_eq!(plain.effective_proxy().listeners.len(), 2);
}

#[test]
fn router_chains_need_the_proxy_path_and_the_proxy_path_needs_http() {
    let router = "\
clusters:
  - name: web
  - name: api
config_entries:
  - { Kind: service-defaults, Name: web, Protocol: http }
  - { Kind: service-defaults, Name: api, Protocol: http }
  - Kind: service-router
    Name: web
    Routes:
      - Match: { HTTP: { PathPrefix: /api } }
        Destination: { Service: api }
services:
  - { name: web, address: 127.77.0.1, port: 80, chain: web, mode: MODE }
";
    let (field, _, _, msg) = invalid(&router.replace("MODE", "direct"));
    assert_eq!(field, "services[0].chain");
    assert!(msg.contains("need the proxy path (mode: proxy)"), "{msg}");
    let config =
        Config::parse(&router.replace("MODE", "proxy"), Path::new("t.yaml")).expect("valid");
    assert_eq!(config.service_clusters(&config.services[0]), ["api", "web"]);
    assert!(config.chain_plan(&config.services[0]).is_none());

    let tcp = "\
clusters:
  - name: web
  - name: backup
config_entries:
  - { Kind: service-resolver, Name: web, Redirect: { Service: backup } }
services:
  - { name: web, address: 127.77.0.1, port: 80, chain: web, mode: proxy }
";
    let (field, _, _, msg) = invalid(tcp);
    assert_eq!(field, "services[0].chain");
    assert!(msg.contains("its protocol is \"tcp\""), "{msg}");
}

/// `Config::parse` checks the xDS section and every EDS cluster's `eds_cluster_config` itself:
/// type errors at the offending value, planning errors at the `xds` section.
#[test]
fn xds_errors_are_located() {
    let eds = "clusters:\n  - name: web\n    type: EDS\n    eds_cluster_config: { eds_config: { ads: {} } }\n";
    let cases = [
        (
            format!("xds:\n  node: {{ id: n }}\n  bogus: 1\n{eds}"),
            ("xds.bogus", 3, 3),
            "unknown field `bogus`, expected one of `node`, `ads_config`, `cds_config`, `lds_config`",
        ),
        (
            format!(
                "xds:\n  node: {{ id: n }}\n  ads_config: {{ api_type: FOO, server_uri: '127.0.0.1:1' }}\n{eds}"
            ),
            ("xds.ads_config.api_type", 3, 27),
            "unknown variant `FOO`",
        ),
        (
            "xds:\n  node: { id: n }\nclusters:\n  - name: web\n    type: EDS\n    eds_cluster_config: { eds_config: { ads: {}, resource_api_version: V2 } }\n".to_owned(),
            ("clusters[0].eds_cluster_config.eds_config.resource_api_version", 6, 72),
            "expected `V3`",
        ),
        (
            eds.to_owned(),
            ("xds", 1, 1),
            "EDS clusters need an `xds` section with the node identity",
        ),
        (
            format!("xds:\n  node: {{ id: n }}\n{eds}"),
            ("xds", 1, 1),
            "cluster web: eds_config.ads is set but there is no ads_config",
        ),
        (
            format!(
                "xds:\n  node: {{ id: '' }}\n  ads_config: {{ api_type: GRPC, server_uri: '127.0.0.1:1' }}\n{eds}"
            ),
            ("xds", 1, 1),
            "node.id must not be empty",
        ),
    ];
    for (text, (field, line, column), message) in cases {
        let (got_field, got_line, got_column, msg) = invalid(&text);
        assert_eq!(
            (got_field.as_str(), got_line, got_column),
            (field, line, column),
            "{msg}"
        );
        assert!(msg.contains(message), "{msg:?} should contain {message:?}");
    }
}

#[test]
fn xds_config_is_typed_and_dumped() {
    let text = "xds:\n  node: { id: n, cluster: edge }\n  ads_config: { api_type: DELTA_GRPC, server_uri: '127.0.0.1:18000' }\nclusters:\n  - name: web\n    type: EDS\n    eds_cluster_config: { service_name: web-v1, eds_config: { ads: {} } }\n";
    let config = parse(text).expect("valid");
    let xds = config.xds.as_ref().expect("xds section");
    assert_eq!(
        (xds.node.id.as_str(), xds.node.cluster.as_str()),
        ("n", "edge")
    );
    let eds = config.clusters[0].eds_cluster_config.as_ref().expect("eds");
    assert_eq!(eds.service_name.as_deref(), Some("web-v1"));
    let dump = serde_json::to_value(&config).unwrap();
    assert_eq!(dump["xds"]["ads_config"]["api_type"], "DELTA_GRPC");
    assert_eq!(
        dump["clusters"][0]["eds_cluster_config"]["eds_config"]["initial_fetch_timeout"], "15s",
        "the default shows in /config_dump"
    );
}

#[test]
fn custom_cluster_settings_are_typed_once_by_validation() {
    let text = "clusters:\n  - name: c\n    cluster_type: { name: proxy.clusters.consul, typed_config: { address: '127.0.0.1:8500', service: web } }\n  - name: s\n    cluster_type: { name: proxy.clusters.dns_srv, typed_config: { service_names: [_web._tcp.test] } }\n";
    let config = parse(text).expect("valid");
    let typed = |i: usize| {
        config.clusters[i]
            .custom_cluster_type
            .as_ref()
            .and_then(|c| c.typed.clone())
    };
    match typed(0) {
        Some(CustomConfig::Consul(consul)) => {
            assert_eq!(
                (consul.address.as_deref(), consul.service.as_str()),
                (Some("127.0.0.1:8500"), "web")
            );
        }
        other => panic!("expected Consul settings, got {other:?}"),
    }
    assert_eq!(
        typed(1),
        Some(CustomConfig::DnsSrv(DnsSrvConfig {
            service_names: vec!["_web._tcp.test".to_owned()]
        }))
    );
}

/// Values that would make the daemon touch what it does not own are refused where they are
/// written: the bpffs itself as the instance, the cgroup root, a bpffs path that climbs, and
/// VIPs that no service can be.
#[test]
fn values_that_reach_beyond_the_daemon_are_refused() {
    let svc = |addr: &str| {
        format!(
            "clusters:\n  - name: a\nservices:\n  - name: s\n    address: {addr}\n    port: 80\n    cluster: a\n"
        )
    };
    let cases = [
        (
            "instance: \".\"\n".to_owned(),
            "instance",
            (1, 1),
            "bpffs directory itself",
        ),
        (
            "instance: \"..\"\n".to_owned(),
            "instance",
            (1, 1),
            "bpffs directory itself",
        ),
        (
            "cgroup: \"\"\n".to_owned(),
            "cgroup",
            (1, 1),
            "below the cgroup v2 root",
        ),
        (
            "cgroup: \".\"\n".to_owned(),
            "cgroup",
            (1, 1),
            "below the cgroup v2 root",
        ),
        (
            "cgroup: /\n".to_owned(),
            "cgroup",
            (1, 1),
            "below the cgroup v2 root",
        ),
        (
            "cgroup: a/../..\n".to_owned(),
            "cgroup",
            (1, 1),
            "without `.` or `..`",
        ),
        (
            "bpffs: sys/fs/bpf\n".to_owned(),
            "bpffs",
            (1, 1),
            "absolute path",
        ),
        (
            "bpffs: /sys/fs/bpf/..\n".to_owned(),
            "bpffs",
            (1, 1),
            "absolute path",
        ),
        ("bpffs: /\n".to_owned(), "bpffs", (1, 1), "absolute path"),
        (svc("0.0.0.0"), "services[0].address", (5, 5), "unspecified"),
        (
            svc("255.255.255.255"),
            "services[0].address",
            (5, 5),
            "broadcast",
        ),
        (svc("224.0.0.1"), "services[0].address", (5, 5), "multicast"),
        (
            svc("169.254.169.254"),
            "services[0].address",
            (5, 5),
            "link-local",
        ),
        (
            svc("\"fe80::1\""),
            "services[0].address",
            (5, 5),
            "link-local",
        ),
        (
            svc("\"::ffff:169.254.169.254\""),
            "services[0].address",
            (5, 5),
            "link-local",
        ),
    ];
    for (text, want_field, want_at, want_msg) in cases {
        let (field, line, column, msg) = invalid(&text);
        assert_eq!(field, want_field, "{text}");
        assert_eq!((line, column), want_at, "{text}");
        assert!(msg.contains(want_msg), "{text}: {msg}");
    }
    // What stays allowed: a nested cgroup, an instance with dots, a private VIP.
    let fine = "instance: proxy.v2\ncgroup: a/b.slice\nbpffs: /run/bpf\n";
    parse(fine).unwrap();
    parse(&svc("10.96.0.10")).unwrap();
}

/// `config_entry_files` may name any file: its content never appears in an error, and a FIFO is
/// refused at once instead of hanging the check.
#[test]
fn config_entry_files_are_read_as_hostile_input() {
    let dir = std::env::temp_dir().join(format!("proxy-entry-files-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let secret = dir.join("token");
    std::fs::write(&secret, "s3cr3t-t0ken-value\n").unwrap();
    // A YAML or JSON list whose elements are not entries: serde would quote them.
    let yaml_list = dir.join("list.yaml");
    std::fs::write(&yaml_list, "- root:s3cr3t-hash:19000\n- s3cr3t-2\n").unwrap();
    let json_list = dir.join("list.json");
    std::fs::write(
        &json_list,
        "[\"s3cr3t-t0ken\", {\"Kind\": \"s3cr3t-kind\"}]",
    )
    .unwrap();
    let fifo = dir.join("fifo");
    let made = std::process::Command::new("mkfifo").arg(&fifo).status();
    assert!(
        made.is_ok_and(|s| s.success()),
        "mkfifo (coreutils) is needed"
    );
    for (file, want) in [
        (&secret, "not a list of config entries"),
        (&yaml_list, "entry 0: "),
        (&json_list, "entry 0: invalid type: string (...)"),
        (&fifo, "not a regular file"),
    ] {
        let text = format!("config_entry_files: [\"{}\"]\n", file.display());
        let (field, _, _, msg) = invalid(&text);
        assert_eq!(field, "config_entry_files[0]");
        assert!(msg.contains(want), "{msg}");
        assert!(!msg.contains("s3cr3t"), "the file's content leaked: {msg}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn proxy_protocol_needs_trusted_sources() {
    let (field, line, column, msg) = invalid("proxy:\n  proxy_protocol: v2\n");
    assert_eq!(field, "proxy.proxy_protocol");
    assert_eq!((line, column), (2, 3));
    assert!(msg.contains("proxy_protocol_trusted_sources"), "{msg}");
    let config = parse(
        "proxy:\n  proxy_protocol: v2\n  proxy_protocol_trusted_sources: [10.0.0.0/8, 192.0.2.7]\n",
    )
    .unwrap();
    let trusted = &config.proxy.proxy_protocol_trusted_sources;
    assert!(trusted[0].contains("10.9.9.9".parse().unwrap()));
    assert!(!trusted[1].contains("127.0.0.1".parse().unwrap()));
    let (field, ..) = invalid("proxy:\n  proxy_protocol_trusted_sources: [10.0.0.0/40]\n");
    assert_eq!(field, "proxy.proxy_protocol_trusted_sources[0]");
}

/// What the daemon would not honour in Envoy's forms is refused, naming the field.
#[test]
fn envoy_form_errors_name_the_field() {
    let cases = [
        (
            "clusters:\n  - name: a\n    connect_timeout: 0s\n",
            "clusters[0].connect_timeout",
            "greater than 0",
        ),
        (
            "clusters:\n  - name: a\n    cluster_type:\n      name: envoy.cluster.dns\n      typed_config: { dns_refresh_rate: 1s, bogus: 1 }\n",
            "clusters[0].cluster_type.typed_config.bogus",
            "bogus",
        ),
        (
            "clusters:\n  - name: a\n    cluster_type:\n      name: envoy.cluster.dns\n      typed_config: { '@type': type.googleapis.com/envoy.extensions.clusters.dns.v3.Nope }\n",
            "clusters[0].cluster_type.typed_config.@type",
            "DnsCluster",
        ),
        (
            "clusters:\n  - name: a\n    type: STRICT_DNS\n    dns_resolvers: ['127.0.0.1:53']\n    typed_dns_resolver_config: { name: envoy.network.dns_resolver.cares }\n",
            "clusters[0].typed_dns_resolver_config",
            "not both",
        ),
        (
            "clusters:\n  - name: a\n    type: STRICT_DNS\n    typed_dns_resolver_config: { name: envoy.network.dns_resolver.cares, typed_config: { use_resolvers_as_fallback: true } }\n",
            "clusters[0].typed_dns_resolver_config.typed_config.use_resolvers_as_fallback",
            "not supported",
        ),
        (
            "clusters:\n  - name: a\n    type: STRICT_DNS\n    typed_dns_resolver_config: { name: envoy.network.dns_resolver.apple }\n",
            "clusters[0].typed_dns_resolver_config.name",
            "unknown DNS resolver",
        ),
        (
            "clusters:\n  - name: a\n    type: STRICT_DNS\n    typed_dns_resolver_config: { name: envoy.network.dns_resolver.cares, typed_config: { query_tries: 0 } }\n",
            "clusters[0].typed_dns_resolver_config.typed_config.query_tries",
            "must be 1 to 255",
        ),
        (
            "clusters:\n  - name: a\n    type: STRICT_DNS\n    typed_dns_resolver_config: { name: envoy.network.dns_resolver.cares, typed_config: { query_tries: 4294967295 } }\n",
            "clusters[0].typed_dns_resolver_config.typed_config.query_tries",
            "must be 1 to 255",
        ),
        (
            "clusters:\n  - name: a\n    type: STRICT_DNS\n    typed_dns_resolver_config: { name: envoy.network.dns_resolver.cares, typed_config: { query_timeout_seconds: 0 } }\n",
            "clusters[0].typed_dns_resolver_config.typed_config.query_timeout_seconds",
            "must be 1 to 3600",
        ),
        (
            "clusters:\n  - name: a\n    type: STRICT_DNS\n    typed_dns_resolver_config: { name: envoy.network.dns_resolver.cares, typed_config: { query_timeout_seconds: -1 } }\n",
            "clusters[0].typed_dns_resolver_config.typed_config.query_timeout_seconds",
            "invalid value",
        ),
    ];
    for (text, want_field, want_msg) in cases {
        let (field, line, _, msg) = invalid(text);
        assert_eq!(field, want_field, "{text}");
        assert!(line > 0, "{msg}");
        assert!(msg.contains(want_msg), "{msg}");
    }
}

/// Envoy 1.40's forms of a DNS cluster: the `envoy.cluster.dns` extension with a c-ares
/// resolver, the deprecated `type: STRICT_DNS` with `typed_dns_resolver_config`, and the fields
/// every Envoy cluster has (`connect_timeout`, `lb_policy: ROUND_ROBIN`) are accepted and become
/// the daemon's own fields.
#[test]
fn envoy_dns_cluster_forms_are_accepted() {
    let text = r#"
clusters:
  - name: strict
    connect_timeout: 0.25s
    lb_policy: ROUND_ROBIN
    cluster_type:
      name: envoy.cluster.dns
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.clusters.dns.v3.DnsCluster
        dns_refresh_rate: 2s
        respect_dns_ttl: true
        dns_failure_refresh_rate: { base_interval: 1s, max_interval: 4s }
        dns_lookup_family: V4_ONLY
        typed_dns_resolver_config:
          name: envoy.network.dns_resolver.cares
          typed_config:
            "@type": type.googleapis.com/envoy.extensions.network.dns_resolver.cares.v3.CaresDnsResolverConfig
            resolvers: [{ socket_address: { address: 127.0.0.53, port_value: 5353 } }]
            dns_resolver_options: { use_tcp_for_dns_lookups: false, no_default_search_domain: true }
            query_timeout_seconds: 2
            query_tries: 3
    load_assignment:
      cluster_name: strict
      endpoints: [{ lb_endpoints: [{ endpoint: { address: { socket_address: { address: web.test, port_value: 80 } } } }] }]
  - name: logical
    cluster_type:
      name: envoy.cluster.dns
      typed_config: { all_addresses_in_single_endpoint: true, dns_lookup_family: UNSPECIFIED }
    load_assignment:
      endpoints: [{ lb_endpoints: [{ endpoint: { address: { socket_address: { address: api.test, port_value: 80 } } } }] }]
  - name: legacy
    type: STRICT_DNS
    typed_dns_resolver_config:
      name: envoy.network.dns_resolver.cares
      typed_config: { resolvers: [{ socket_address: { address: "::1", port_value: 53 } }] }
    load_assignment:
      endpoints: [{ lb_endpoints: [{ endpoint: { address: { socket_address: { address: db.test, port_value: 5432 } } } }] }]
"#;
    let config = parse(text).expect("Envoy's forms load");
    let strict = config.cluster("strict").expect("strict");
    assert_eq!(strict.cluster_type, ClusterType::StrictDns);
    assert!(strict.custom_cluster_type.is_none());
    assert_eq!(strict.lb_policy, LbPolicy::RoundRobin);
    assert_eq!(strict.connect_timeout, Some(Duration::from_millis(250)));
    let dns = strict.dns_settings();
    assert_eq!(dns.dns_refresh_rate, Duration::from_secs(2));
    assert!(dns.respect_dns_ttl);
    assert_eq!(
        dns.dns_failure_refresh_rate
            .map(|r| (r.base_interval, r.max_interval)),
        Some((Duration::from_secs(1), Some(Duration::from_secs(4))))
    );
    assert_eq!(dns.dns_lookup_family, DnsLookupFamily::V4Only);
    assert_eq!(
        dns.dns_resolvers.iter().map(|r| r.0).collect::<Vec<_>>(),
        ["127.0.0.53:5353".parse::<SocketAddr>().unwrap()]
    );
    assert_eq!(
        strict.dns_query_limits,
        QueryLimits {
            timeout: Duration::from_secs(2),
            tries: 3
        }
    );
    let logical = config.cluster("logical").expect("logical");
    // Not given: Envoy's c-ares defaults.
    assert_eq!(logical.dns_query_limits, QueryLimits::default());
    assert_eq!(logical.cluster_type, ClusterType::LogicalDns);
    assert_eq!(
        logical.dns_settings().dns_lookup_family,
        DnsLookupFamily::Auto
    );
    assert!(logical.dns_settings().dns_resolvers.is_empty());
    let legacy = config.cluster("legacy").expect("legacy");
    assert!(legacy.typed_dns_resolver_config.is_none());
    assert_eq!(
        legacy
            .dns_settings()
            .dns_resolvers
            .iter()
            .map(|r| r.0)
            .collect::<Vec<_>>(),
        ["[::1]:53".parse::<SocketAddr>().unwrap()]
    );
}

/// Envoy's per-cluster `ignore_health_on_host_removal` and
/// `close_connections_on_host_health_failure` load; unset, they are Envoy's defaults (false,
/// and the proxy's own setting for the close).
#[test]
fn per_cluster_health_removal_and_close_settings_load() {
    let config = parse(
        "clusters:\n  - name: a\n    ignore_health_on_host_removal: true\n    close_connections_on_host_health_failure: true\n  - name: b\n",
    )
    .expect("valid");
    let a = config.cluster("a").expect("a");
    assert!(a.ignore_health_on_host_removal);
    assert!(a.health_config().ignore_health_on_host_removal);
    assert_eq!(a.close_connections_on_host_health_failure, Some(true));
    let b = config.cluster("b").expect("b");
    assert!(!b.health_config().ignore_health_on_host_removal);
    assert_eq!(b.close_connections_on_host_health_failure, None);
}

#[test]
fn admin_on_a_unix_socket_parses_and_a_bad_path_is_located() {
    let config = parse("admin:\n  address: unix:/run/proxy/admin.sock\n").unwrap();
    assert_eq!(
        config.admin.address.unix(),
        Some(Path::new("/run/proxy/admin.sock"))
    );
    let (field, line, column, msg) = invalid("instance: x\nadmin:\n  address: unix:admin.sock\n");
    assert_eq!(field, "admin.address");
    assert_eq!((line, column), (3, 3), "{msg}");
    assert!(msg.contains("is not absolute"), "{msg}");
}

#[test]
fn kernel_log_is_off_by_default_and_a_bad_level_points_at_its_line() {
    let minimal = "services: []\n";
    assert_eq!(
        parse(minimal).expect("valid").kernel_log,
        KernelLogLevel::Off
    );
    for (text, level) in [
        ("kernel_log: off\n", KernelLogLevel::Off),
        ("kernel_log: error\n", KernelLogLevel::Error),
        ("kernel_log: warn\n", KernelLogLevel::Warn),
        ("kernel_log: info\n", KernelLogLevel::Info),
        ("kernel_log: debug\n", KernelLogLevel::Debug),
    ] {
        assert_eq!(parse(text).expect(text).kernel_log, level, "{text}");
    }
    let (field, line, column, message) = invalid("instance: a\nkernel_log: loud\n");
    assert_eq!(
        (field.as_str(), line, column),
        ("kernel_log", 2, 13),
        "{message}"
    );
    assert!(
        message.starts_with("test.yaml:2:13: kernel_log: unknown variant `loud`, expected one of `off`, `error`, `warn`, `info`, `debug`"),
        "{message}"
    );
}

#[test]
fn clusters_are_found_by_name_also_after_the_list_changed() {
    let cluster = |name: &str| {
        format!(
            "  - {{ name: {name}, load_assignment: {{ endpoints: [ {{ lb_endpoints: [ {{ endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: 9000 }} }} }} }} ] }} ] }} }}\n"
        )
    };
    let text = format!(
        "clusters:\n{}{}{}services: []\n",
        cluster("a"),
        cluster("b"),
        cluster("c")
    );
    let mut config = parse(&text).unwrap();
    let name = |c: Option<&Cluster>| c.map(|c| c.name.clone());
    assert_eq!(name(config.cluster("b")), Some("b".to_owned()));
    assert_eq!(name(config.cluster("x")), None);
    // `clusters` is public: a lookup after the list changed must not trust old positions.
    let b = config.clusters.remove(1);
    config.clusters.push(b.clone());
    let mut x = b;
    x.name = "x".to_owned();
    config.clusters.insert(0, x);
    for want in ["a", "b", "c", "x"] {
        assert_eq!(name(config.cluster(want)), Some(want.to_owned()), "{want}");
    }
    config.clusters.retain(|c| c.name != "c");
    assert_eq!(name(config.cluster("c")), None);
}
