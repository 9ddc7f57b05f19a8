//! The fuzz targets: one function per parser of input the daemon does not control, each taking
//! arbitrary bytes and saying whether the parser accepted them (so the replay can check that the
//! seeds reach past the parser). A target must not panic, abort or hang on any input; where a parser accepts
//! an input, the target also checks what the rest of the daemon relies on (a parsed PROXY
//! header's length is within the bytes read; an accepted configuration dumps as JSON).
//!
//! The libFuzzer binaries (`fuzz_targets/`, feature `fuzzing`) call these; `tests/corpus.rs`
//! replays the corpora (`corpus/<target>/`) and every input that once crashed a target
//! (`regressions/<target>/`) under plain `cargo test`. `cargo xtask fuzz` runs the fuzzer.

use std::{
    net::{IpAddr, SocketAddr},
    path::Path,
    sync::OnceLock,
    time::Duration,
};

use prost::Message as _;
use proxy_core::{
    config::{Config, host_guard::HostGuard},
    discovery::{
        dns::{address_records, srv_records},
        xds::cla::{check_constraints, hosts_from_cla},
    },
    health::Routing,
};
use proxy_relay::{ClusterHandle, ProxyProtocolMode, RouteTable, parse_proxy_header};

/// A target: arbitrary bytes in, whether the parser accepted them out.
pub type Target = fn(&[u8]) -> bool;

/// Every target, by the name of its corpus directory and binary.
pub const TARGETS: [(&str, Target); 6] = [
    ("config", config),
    ("chain", chain),
    ("xds_cla", xds_cla),
    ("dns_answer", dns_answer),
    ("proxy_protocol", proxy_protocol),
    ("http_route", http_route),
];

/// The daemon's configuration file: parse and validate (chains compiled, files named by
/// `config_entry_files` are not read: there are none in a fuzzed text that exist), then dump as
/// `/config_dump?format=proxy` does.
pub fn config(data: &[u8]) -> bool {
    let Ok(text) = std::str::from_utf8(data) else {
        return false;
    };
    let Ok(config) = Config::parse(text, Path::new("/nonexistent/fuzz.yaml")) else {
        return false;
    };
    serde_json::to_string(&config).expect("an accepted configuration dumps as JSON");
    true
}

/// Consul config entries in the API's JSON shape: parse, validate and compile the chain of
/// `web` in `dc1`, as `proxy chain compile` does.
pub fn chain(data: &[u8]) -> bool {
    let Ok(text) = std::str::from_utf8(data) else {
        return false;
    };
    proxy_chain::compile_json_cli(text, "web", "dc1", proxy_chain::Overrides::default()).is_ok()
}

/// An EDS `ClusterLoadAssignment` off the wire: decode, check Envoy's proto validation rules,
/// map to hosts, and run the hosts through the guard every source uses.
pub fn xds_cla(data: &[u8]) -> bool {
    let Ok(cla) = envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment::decode(data)
    else {
        return false;
    };
    let checked = check_constraints(&cla);
    let Ok(hosts) = hosts_from_cla(&cla) else {
        return false;
    };
    assert!(
        checked.is_ok(),
        "hosts from an assignment that breaks a validation rule"
    );
    let _ = guard().filter(hosts);
    true
}

/// A DNS answer off the wire: decode the message, take its address and SRV records as the
/// resolver does, and check every address with the host guard.
pub fn dns_answer(data: &[u8]) -> bool {
    let Ok(message) = hickory_resolver::proto::op::Message::from_vec(data) else {
        return false;
    };
    let records = &message.answers;
    for record in address_records(records) {
        let _ = guard().refuses(SocketAddr::new(record.ip, 80));
    }
    for srv in srv_records(records) {
        let _ = guard().refuses(SocketAddr::new(IpAddr::from([127, 0, 0, 1]), srv.port));
    }
    true
}

/// A PROXY protocol header (v1 or v2) at the start of a connection's bytes. An accepted header
/// is within the bytes given and parses the same from exactly its own bytes.
pub fn proxy_protocol(data: &[u8]) -> bool {
    let mut accepted = false;
    for mode in [
        ProxyProtocolMode::Any,
        ProxyProtocolMode::V1,
        ProxyProtocolMode::V2,
    ] {
        if let Ok(Some((header, len))) = parse_proxy_header(data, mode) {
            assert!(len <= data.len(), "header length {len} beyond the input");
            let again = parse_proxy_header(&data[..len], mode);
            assert!(
                matches!(&again, Ok(Some((h, l))) if *l == len && format!("{h:?}") == format!("{header:?}")),
                "the header does not parse the same from its own bytes: {again:?}"
            );
            accepted = true;
        }
    }
    accepted
}

/// An HTTP request head through a chain's routes (path prefix, regex, header, query and method
/// matches, a prefix rewrite): the first line is `METHOD TARGET`, each further line a
/// `name: value` header.
pub fn http_route(data: &[u8]) -> bool {
    let Ok(text) = std::str::from_utf8(data) else {
        return false;
    };
    let mut lines = text.split("\r\n").flat_map(|l| l.split('\n'));
    let Some((method, target)) = lines.next().and_then(|l| l.split_once(' ')) else {
        return false;
    };
    let mut request = http::Request::builder().method(method).uri(target);
    for line in lines {
        if let Some((name, value)) = line.split_once(':') {
            request = request.header(name, value.trim_start());
        }
    }
    let Ok(request) = request.body(()) else {
        return false;
    };
    let Some(route) = routes().route(&request) else {
        return false;
    };
    let _ = route.rewrite(request.uri());
    let _ = route.pick_leg();
    true
}

/// The guard of a daemon with its admin on 127.0.0.1:15000 and a proxy listener on :15001.
fn guard() -> &'static HostGuard {
    static GUARD: OnceLock<HostGuard> = OnceLock::new();
    GUARD.get_or_init(|| {
        HostGuard::new(vec![
            SocketAddr::from(([127, 0, 0, 1], 15000)),
            SocketAddr::from(([127, 0, 0, 1], 15001)),
        ])
    })
}

/// The routes of `web`: a router with every kind of match, compiled by the daemon's own
/// configuration path.
const ROUTED: &str = r#"
proxy: { listeners: ["127.0.0.1:15001"] }
clusters:
  - name: web
    load_assignment: { endpoints: [ { lb_endpoints: [ { endpoint: { address: { socket_address: { address: 127.0.0.11, port_value: 8081 } } } } ] } ] }
  - name: admin
    load_assignment: { endpoints: [ { lb_endpoints: [ { endpoint: { address: { socket_address: { address: 127.0.0.12, port_value: 8082 } } } } ] } ] }
config_entries:
  - { Kind: service-defaults, Name: web, Protocol: http }
  - { Kind: service-defaults, Name: admin, Protocol: http }
  - Kind: service-router
    Name: web
    Routes:
      - Match: { HTTP: { PathPrefix: /admin, Header: [ { Name: x-debug, Exact: "1" } ] } }
        Destination: { Service: admin, PrefixRewrite: / }
      - Match: { HTTP: { PathRegex: "/v[0-9]+/.*", Methods: [GET, POST] } }
        Destination: { Service: admin }
      - Match: { HTTP: { QueryParam: [ { Name: canary, Present: true } ] } }
        Destination: { Service: admin }
      - Match: { HTTP: { PathExact: /health, Header: [ { Name: user-agent, Regex: "^probe/[0-9]+" } ] } }
        Destination: { Service: admin }
services:
  - { name: web, address: 127.77.0.1, port: 80, chain: web, mode: proxy }
"#;

struct Routes {
    table: RouteTable,
    _routing: tokio::sync::watch::Sender<Routing>,
}

fn routes() -> &'static RouteTable {
    static ROUTES: OnceLock<Routes> = OnceLock::new();
    &ROUTES
        .get_or_init(|| {
            let config = Config::parse(ROUTED, Path::new("routed.yaml"))
                .expect("the routed configuration is valid");
            let chain = config.chains.get("web").expect("web is a chain");
            let (tx, rx) = tokio::sync::watch::channel(Routing::default());
            let table = RouteTable::from_chain(chain, &|leg| {
                Some(ClusterHandle::new(
                    &leg.service,
                    rx.clone(),
                    true,
                    Duration::from_secs(1),
                ))
            })
            .expect("the chain's routes");
            Routes {
                table,
                _routing: tx,
            }
        })
        .table
}
