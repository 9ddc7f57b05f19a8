//! Composition: overlays add to the file, clashes are refused naming both sources, errors name
//! the resource and its source, chains compile from every source's entries.

use std::path::Path;

use super::*;
use crate::config::{Cluster, Service};

const FILE: &str = "\
clusters:
  - name: web
    load_assignment:
      endpoints:
        - lb_endpoints:
            - endpoint: { address: { socket_address: { address: 127.0.0.2, port_value: 80 } } }
  - name: backup
services:
  - { name: web, address: 127.77.0.1, port: 80, chain: web }
";

fn file() -> Config {
    Config::parse(FILE, Path::new("test.yaml")).unwrap()
}

fn cluster(yaml: &str) -> Cluster {
    serde_norway::from_str(yaml).unwrap()
}

fn service(yaml: &str) -> Service {
    serde_norway::from_str(yaml).unwrap()
}

fn entry(yaml: &str) -> proxy_chain::ConfigEntry {
    serde_norway::from_str(yaml).unwrap()
}

fn api() -> Overlay {
    Overlay {
        clusters: vec![cluster(
            "name: api\nload_assignment: {endpoints: [{lb_endpoints: [{endpoint: {address: \
             {socket_address: {address: 127.0.0.3, port_value: 81}}}}]}]}",
        )]
        .into(),
        services: vec![service(
            "{name: api, address: 127.77.0.2, port: 81, cluster: api}",
        )]
        .into(),
        config_entries: Vec::new(),
    }
}

#[test]
fn an_overlay_adds_its_resources_and_leaves_the_file_as_it_was() {
    let file = file();
    let overlay = api();
    let composed = file.compose([(Source::Xds, &overlay)], None).unwrap();
    let names: Vec<_> = composed.services.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["web", "api"]);
    assert!(composed.cluster("api").is_some());
    assert_eq!(composed.service_clusters(&composed.services[1]), ["api"]);
    assert_eq!(
        file.services.len(),
        1,
        "the file's configuration is not changed"
    );
    // Nothing from the sources: the file itself.
    let alone = file.compose([], None).unwrap();
    assert_eq!(format!("{alone:?}"), format!("{file:?}"));
}

#[test]
fn a_name_two_sources_define_is_refused_naming_both() {
    let file = file();
    let mut overlay = api();
    std::sync::Arc::make_mut(&mut overlay.clusters)[0].name = "backup".to_owned();
    let err = file.compose([(Source::Xds, &overlay)], None).unwrap_err();
    assert_eq!(
        err,
        ComposeError::Clash {
            what: "cluster \"backup\"".to_owned(),
            first: Source::File,
            second: Source::Xds,
        }
    );
    assert_eq!(
        err.to_string(),
        "cluster \"backup\" is defined by both the configuration file and xDS: refused (no \
         source overrides another)"
    );

    let mut overlay = api();
    std::sync::Arc::make_mut(&mut overlay.services)[0].name = "web".to_owned();
    let err = file.compose([(Source::Xds, &overlay)], None).unwrap_err();
    assert!(matches!(err, ComposeError::Clash { ref what, .. } if what == "service \"web\""));

    let mut overlay = api();
    std::sync::Arc::make_mut(&mut overlay.services)[0].address = "127.77.0.1".parse().unwrap();
    std::sync::Arc::make_mut(&mut overlay.services)[0].port = 80;
    let err = file.compose([(Source::Xds, &overlay)], None).unwrap_err();
    assert!(
        err.to_string()
            .starts_with("service address 127.77.0.1:80 Tcp is defined by both"),
        "{err}"
    );

    // Between two overlays, the first named first.
    let other = api();
    let err = file
        .compose(
            [(Source::ConsulEntries, &api()), (Source::Xds, &other)],
            None,
        )
        .unwrap_err();
    assert!(
        matches!(
            err,
            ComposeError::Clash {
                first: Source::ConsulEntries,
                second: Source::Xds,
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn an_invalid_resource_is_named_with_its_source() {
    let file = file();
    let mut overlay = api();
    std::sync::Arc::make_mut(&mut overlay.clusters)[0].connect_timeout =
        Some(std::time::Duration::ZERO);
    let err = file.compose([(Source::Xds, &overlay)], None).unwrap_err();
    assert_eq!(
        err,
        ComposeError::Invalid {
            origin: Source::Xds,
            field: "clusters[\"api\"].connect_timeout".to_owned(),
            message: "must be greater than 0".to_owned(),
        }
    );
    // A service of a source naming a cluster nobody defines.
    let mut overlay = api();
    std::sync::Arc::make_mut(&mut overlay.clusters).clear();
    let err = file.compose([(Source::Xds, &overlay)], None).unwrap_err();
    assert!(
        matches!(&err, ComposeError::Invalid { origin: Source::Xds, field, .. } if field.starts_with("services[\"api\"]")),
        "{err:?}"
    );
}

#[test]
fn chains_compile_from_every_sources_entries() {
    let file = file();
    assert_eq!(
        file.chain_plan(&file.services[0]).unwrap().clusters().len(),
        1
    );
    let overlay = Overlay {
        config_entries: vec![entry(
            "{Kind: service-resolver, Name: web, Failover: {'*': {Service: backup}}}",
        )],
        ..Overlay::default()
    };
    let composed = file
        .compose([(Source::ConsulEntries, &overlay)], None)
        .unwrap();
    let plan = composed.chain_plan(&composed.services[0]).unwrap();
    assert_eq!(
        plan.clusters().into_iter().collect::<Vec<_>>(),
        ["backup", "web"]
    );

    // The same entry in the file and in Consul: neither wins; only the chains that read it are
    // left out, with the reason, and the rest composes.
    let text = format!(
        "{FILE}config_entries:\n  - {{Kind: service-resolver, Name: web, ConnectTimeout: 5s}}\n"
    );
    let with_entry = Config::parse(&text, Path::new("test.yaml")).unwrap();
    let composed = with_entry
        .compose([(Source::ConsulEntries, &overlay)], None)
        .unwrap();
    assert!(composed.services.is_empty(), "web is left out");
    assert_eq!(composed.chain_failures.len(), 1);
    assert!(
        composed.chain_failures[0]
            .reason
            .contains("defined both in the configuration file and in Consul"),
        "{:?}",
        composed.chain_failures
    );

    // An entry the compiler refuses: that chain keeps the one in force, and is reported.
    let bad = Overlay {
        config_entries: vec![entry(
            "{Kind: service-resolver, Name: web, Failover: {'*': {Service: nowhere}}}",
        )],
        ..Overlay::default()
    };
    let in_force = file
        .compose([(Source::ConsulEntries, &overlay)], None)
        .unwrap();
    let composed = file
        .compose([(Source::ConsulEntries, &bad)], Some(&in_force))
        .unwrap();
    assert_eq!(composed.chain_failures.len(), 1);
    assert!(
        composed.chain_failures[0].reason.contains("nowhere"),
        "{:?}",
        composed.chain_failures
    );
    assert_eq!(composed.services.len(), 1, "web stays");
    let plan = composed.chain_plan(&composed.services[0]).unwrap();
    assert_eq!(
        plan.clusters().into_iter().collect::<Vec<_>>(),
        ["backup", "web"],
        "the chain in force: failover to backup"
    );
    // With nothing in force to keep, the service is left out and the others stay.
    let mut with_api = bad.clone();
    with_api.clusters = api().clusters;
    with_api.services = api().services;
    let composed = file
        .compose([(Source::ConsulEntries, &with_api)], None)
        .unwrap();
    let names: Vec<_> = composed.services.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["api"]);
}

/// A file that watches Consul's entries may leave to them what makes a chain run: a proxy-mode
/// chain service is HTTP only once Consul's service-defaults says so. The file loads with the
/// chain listed as waiting; composed alone, the service is left out; with Consul's entries, it
/// runs. Without `consul_config_entries`, the same file is refused as before.
#[test]
fn a_chain_that_needs_consuls_entries_waits_for_them() {
    let proxied = FILE.replace("chain: web }", "chain: web, mode: proxy }");
    let refused = Config::parse(&proxied, Path::new("test.yaml")).unwrap_err();
    assert!(
        refused.to_string().contains("protocol is \"tcp\""),
        "{refused}"
    );

    let text = format!("{proxied}consul_config_entries: {{ address: \"127.0.0.1:8500\" }}\n");
    let file = Config::parse(&text, Path::new("test.yaml")).expect("loads");
    assert_eq!(file.services.len(), 1, "the file keeps its service");
    assert_eq!(file.chain_failures.len(), 1, "{:?}", file.chain_failures);
    let alone = file.compose([], None).unwrap();
    assert!(alone.services.is_empty(), "left out until Consul answers");
    assert_eq!(alone.chain_failures, file.chain_failures);

    let http = Overlay {
        config_entries: vec![entry("{Kind: service-defaults, Name: web, Protocol: http}")],
        ..Overlay::default()
    };
    let composed = file
        .compose([(Source::ConsulEntries, &http)], None)
        .unwrap();
    assert_eq!(composed.services.len(), 1);
    assert!(composed.chain_failures.is_empty());
    assert!(composed.chains.contains_key("web"));
}

/// The proxy path is declared by a proxy-mode service of the file, or by LDS (whose HTTP
/// listeners become proxy-mode services), not by a file of direct services alone.
#[test]
fn lds_declares_the_proxy_path() {
    let direct = Config::parse(FILE, Path::new("test.yaml")).unwrap();
    assert!(!direct.declares_proxy());
    let lds = format!(
        "{FILE}xds:\n  node: {{ id: n, cluster: c }}\n  ads_config: {{ api_type: GRPC, server_uri: \"http://127.0.0.1:18000\" }}\n  lds_config: {{ ads: {{}} }}\n"
    );
    let lds = Config::parse(&lds, Path::new("test.yaml")).unwrap();
    assert!(lds.declares_proxy() && !lds.uses_proxy());
}
