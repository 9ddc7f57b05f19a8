//! The table of docs/fields.md, "Every accepted field", checked against what the inputs accept: every field
//! path of the configuration file's types, of the Consul config entries and catalog entries, and
//! every field the xDS decoders name, must have a row (or a group row ending in `.*`).
//!
//! The file's and Consul's paths come from their serde types ([`tracer`]); the xDS decoders'
//! from the field lists they refuse by name, read from their sources, and from
//! [`XDS_HONOURED`], the fields their `clear` functions accept.

mod reference;
pub(crate) mod tracer;

use std::collections::BTreeSet;

/// The page that holds the table.
const FIELDS: &str = include_str!("../../docs/fields.md");

/// The heading of the table's section.
const SECTION: &str = "# Every accepted field";

/// The xDS decoders' sources, each with its refusal lists and the message each list is of.
const XDS_LISTS: &[(&str, &[(&str, &str)])] = &[
    (
        include_str!("discovery/xds/cds.rs"),
        &[
            ("CLUSTER_FIELDS", "Cluster"),
            (
                "LB_ENDPOINT_FIELDS",
                "Cluster.load_assignment.endpoints[].lb_endpoints[]",
            ),
        ],
    ),
    (
        include_str!("discovery/xds/cds/balance.rs"),
        &[("COMMON_LB_FIELDS", "Cluster.common_lb_config")],
    ),
    (
        include_str!("discovery/xds/lds.rs"),
        &[
            ("LISTENER_FIELDS", "Listener"),
            ("TCP_PROXY_FIELDS", "TcpProxy"),
            ("let names", "FilterChain"),
        ],
    ),
    (
        include_str!("discovery/xds/hcm.rs"),
        &[("HCM_FIELDS", "HttpConnectionManager")],
    ),
    (
        include_str!("discovery/xds/hcm/routes.rs"),
        &[
            ("ROUTE_CONFIG_FIELDS", "RouteConfiguration"),
            ("VHOST_FIELDS", "VirtualHost"),
            ("ROUTE_FIELDS", "Route"),
            ("MATCH_FIELDS", "RouteMatch"),
            ("ACTION_FIELDS", "RouteAction"),
            ("WEIGHTED_FIELDS", "WeightedCluster"),
            ("WEIGHT_FIELDS", "ClusterWeight"),
        ],
    ),
];

/// The fields the xDS decoders honour (what their `clear` functions take out before the rest is
/// refused), as `Message.field`.
const XDS_HONOURED: &[&str] = &[
    "Cluster.name",
    "Cluster.type",
    "Cluster.lb_policy",
    "Cluster.connect_timeout",
    "Cluster.load_assignment",
    "Cluster.eds_cluster_config",
    "Cluster.dns_refresh_rate",
    "Cluster.respect_dns_ttl",
    "Cluster.dns_lookup_family",
    "Cluster.cleanup_interval",
    "Cluster.ignore_health_on_host_removal",
    "Cluster.close_connections_on_host_health_failure",
    "Cluster.load_assignment.endpoints[].lb_endpoints[].endpoint",
    "Cluster.load_assignment.endpoints[].lb_endpoints[].health_status",
    "Cluster.load_assignment.endpoints[].lb_endpoints[].load_balancing_weight",
    "Cluster.load_assignment.endpoints[].locality",
    "Cluster.load_assignment.endpoints[].load_balancing_weight",
    "Cluster.load_assignment.policy.overprovisioning_factor",
    "Cluster.load_assignment.policy.weighted_priority_health",
    "Cluster.load_assignment.policy.drop_overloads",
    "Cluster.common_lb_config.healthy_panic_threshold",
    "Cluster.common_lb_config.locality_weighted_lb_config",
    "Cluster.common_lb_config.zone_aware_lb_config",
    "ClusterLoadAssignment.cluster_name",
    "ClusterLoadAssignment.endpoints",
    "ClusterLoadAssignment.policy",
    "LocalityLbEndpoints.locality",
    "LocalityLbEndpoints.lb_endpoints",
    "LocalityLbEndpoints.load_balancing_weight",
    "LocalityLbEndpoints.priority",
    "LocalityLbEndpoints.leds_cluster_locality_config",
    "LbEndpoint.endpoint",
    "LbEndpoint.health_status",
    "LbEndpoint.load_balancing_weight",
    "LbEndpoint.metadata",
    "Listener.name",
    "Listener.address",
    "Listener.filter_chains",
    "FilterChain.filters",
    "FilterChain.name",
    "TcpProxy.stat_prefix",
    "TcpProxy.cluster",
    "TcpProxy.weighted_clusters",
    "HttpConnectionManager.stat_prefix",
    "HttpConnectionManager.route_config",
    "HttpConnectionManager.rds",
    "HttpConnectionManager.http_filters",
    "HttpConnectionManager.upgrade_configs",
    "RouteConfiguration.name",
    "RouteConfiguration.virtual_hosts",
    "RouteConfiguration.validate_clusters",
    "VirtualHost.name",
    "VirtualHost.domains",
    "VirtualHost.routes",
    "Route.name",
    "Route.match",
    "Route.route",
    "RouteMatch.prefix",
    "RouteMatch.path",
    "RouteMatch.safe_regex",
    "RouteMatch.headers",
    "RouteMatch.query_parameters",
    "RouteMatch.case_sensitive",
    "RouteAction.cluster",
    "RouteAction.weighted_clusters",
    "RouteAction.prefix_rewrite",
    "RouteAction.timeout",
    "RouteAction.idle_timeout",
    "WeightedCluster.clusters",
    "ClusterWeight.name",
    "ClusterWeight.weight",
];

/// One row of the table: its input (first cell) and the backquoted names of its field cell.
struct Row {
    input: String,
    fields: Vec<String>,
}

/// The text of `text`'s section [`SECTION`], up to the next heading.
fn section(text: &str) -> &str {
    let start = text
        .find(SECTION)
        .unwrap_or_else(|| panic!("docs/fields.md has no section {SECTION:?}"));
    let section = &text[start + SECTION.len()..];
    &section[..section.find("\n#").unwrap_or(section.len())]
}

/// The table lines of `text`'s section, without the header.
fn lines(text: &str) -> impl Iterator<Item = &str> {
    section(text)
        .lines()
        .filter(|l| l.starts_with('|') && !l.starts_with("|---") && !l.starts_with("| input"))
}

/// The rows of `text`'s section [`SECTION`].
fn rows(text: &str) -> Vec<Row> {
    lines(text)
        .map(|line| {
            let mut cells = line.split(" | ");
            let input = cells.next().unwrap_or_default();
            let input = input.trim_start_matches('|').trim().to_owned();
            let fields = quoted(cells.next().unwrap_or_default());
            Row { input, fields }
        })
        .collect()
}

/// The backquoted words of `cell`.
fn quoted(cell: &str) -> Vec<String> {
    cell.split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect()
}

/// The paths of `paths` that no row of `input` names, itself or in a group (`a.b.*` names
/// `a.b.c` and everything below it).
fn missing(rows: &[Row], input: &str, paths: &BTreeSet<String>) -> Vec<String> {
    let names: Vec<&str> = rows
        .iter()
        .filter(|r| r.input == input)
        .flat_map(|r| r.fields.iter().map(String::as_str))
        .collect();
    // A name covers itself; `a.*` covers `a` and all below it; a parent is covered by a row
    // of a field below it (`a` by `a.b`, `a[].b` or `a(x).b`).
    let covered = |path: &str| {
        names.iter().any(|n| {
            let group = n.strip_suffix(".*").unwrap_or(n);
            let below = |p: &str, of: &str| {
                p.strip_prefix(of)
                    .is_some_and(|rest| rest.starts_with(['.', '[', '(']))
            };
            *n == path || (group != *n && (group == path || below(path, group))) || below(n, path)
        })
    };
    paths.iter().filter(|p| !covered(p)).cloned().collect()
}

/// Every field path the configuration file accepts, `typed_config`s included.
fn file_paths() -> BTreeSet<String> {
    file_trace().fields
}

/// Every path the configuration file accepts with its kind, `typed_config`s included.
fn file_trace() -> tracer::Trace {
    use crate::config::{
        Config, DnsSrvConfig,
        sources::{consul::ConsulConfig, xds::transport_socket::UpstreamTlsContext},
    };
    let custom = "clusters[].cluster_type";
    let mut trace = tracer::trace::<Config>("");
    trace.extend(tracer::trace::<ConsulConfig>(&format!(
        "{custom}(proxy.clusters.consul).typed_config"
    )));
    trace.extend(tracer::trace::<DnsSrvConfig>(&format!(
        "{custom}(proxy.clusters.dns_srv).typed_config"
    )));
    trace.extend(tracer::trace::<UpstreamTlsContext>(
        "clusters[].transport_socket.typed_config",
    ));
    trace.extend(crate::config::envoy::typed_trace(custom));
    trace
}

/// Every field path of the Consul config entries, under their `Kind`, and of the catalog's
/// `/v1/health/service` entries.
fn consul_paths() -> (BTreeSet<String>, BTreeSet<String>) {
    use proxy_chain::entries::{
        ProxyDefaults, ServiceDefaults, ServiceResolver, ServiceRouter, ServiceSplitter,
    };
    let mut entries = tracer::field_paths::<ServiceDefaults>("service-defaults");
    entries.extend(tracer::field_paths::<ProxyDefaults>("proxy-defaults"));
    entries.extend(tracer::field_paths::<ServiceRouter>("service-router"));
    entries.extend(tracer::field_paths::<ServiceSplitter>("service-splitter"));
    entries.extend(tracer::field_paths::<ServiceResolver>("service-resolver"));
    let catalog = tracer::field_paths::<crate::discovery::consul::catalog::ServiceEntry>("");
    (without_aliases(&entries), catalog)
}

/// `paths` with each spelling Consul also accepts (`service_subset` for `ServiceSubset`, `http`
/// for `HTTP`) folded into Consul's own, the first of a path's spellings that starts with a
/// capital letter in each segment.
fn without_aliases(paths: &BTreeSet<String>) -> BTreeSet<String> {
    let fold = |p: &str| p.replace('_', "").to_ascii_lowercase();
    let pascal = |p: &str| {
        p.split('.').all(|s| {
            s.trim_end_matches("[]")
                .starts_with(|c: char| !c.is_ascii_lowercase())
        })
    };
    let mut by_fold = std::collections::BTreeMap::new();
    for path in paths {
        let kept = by_fold.entry(fold(path)).or_insert(path);
        if !pascal(kept) && pascal(path) {
            *kept = path;
        }
    }
    by_fold.into_values().cloned().collect()
}

/// The field names of the list that starts at `marker` in `source`, as `message.field`.
fn refused_list(source: &str, marker: &str, message: &str) -> BTreeSet<String> {
    let start = source
        .find(marker)
        .unwrap_or_else(|| panic!("no refusal list {marker} in an xDS decoder"));
    let list = &source[start..];
    let end = list.find("];").expect("a refusal list ends with `];`");
    list[..end]
        .split('"')
        .skip(1)
        .step_by(2)
        .map(|field| format!("{message}.{field}"))
        .collect()
}

/// Every field the xDS decoders honour or refuse by name.
fn xds_paths() -> BTreeSet<String> {
    let mut paths: BTreeSet<String> = XDS_HONOURED.iter().map(|f| (*f).to_owned()).collect();
    for (source, lists) in XDS_LISTS {
        for (marker, message) in *lists {
            paths.extend(refused_list(source, marker, message));
        }
    }
    paths
}

/// Panics naming the fields of each input that have no row.
fn assert_rows(rows: &[Row], inputs: &[(&str, &BTreeSet<String>)]) {
    let report: Vec<String> = inputs
        .iter()
        .filter_map(|(input, paths)| {
            let missing = missing(rows, input, paths);
            (!missing.is_empty()).then(|| format!("\n  {input}: {}", missing.join(", ")))
        })
        .collect();
    assert!(
        report.is_empty(),
        "docs/fields.md, {SECTION:?}: fields accepted without a row:{}",
        report.concat()
    );
}

#[test]
fn every_field_of_the_configuration_file_has_a_row() {
    assert_rows(&rows(FIELDS), &[("file", &file_paths())]);
}

#[test]
fn every_field_of_the_consul_entries_and_catalog_has_a_row() {
    let (entries, catalog) = consul_paths();
    assert_rows(
        &rows(FIELDS),
        &[("Consul entry", &entries), ("Consul catalog", &catalog)],
    );
}

#[test]
fn every_field_the_xds_decoders_name_has_a_row() {
    assert_rows(&rows(FIELDS), &[("xDS", &xds_paths())]);
}

#[test]
fn every_row_names_a_field_and_a_test() {
    let rows = rows(FIELDS);
    assert!(rows.len() > 50, "the table has {} rows", rows.len());
    for line in lines(FIELDS) {
        let cells: Vec<&str> = line.split(" | ").collect();
        assert_eq!(cells.len(), 5, "a row of five cells: {line}");
        assert!(!quoted(cells[1]).is_empty(), "a row names no field: {line}");
        assert!(!quoted(cells[4]).is_empty(), "a row names no test: {line}");
    }
}

#[test]
fn a_field_without_its_row_is_reported_by_name() {
    let fields = FIELDS.replace("| file | `splice` |", "| file | `splice_removed` |");
    let result = std::panic::catch_unwind(|| {
        assert_rows(&rows(&fields), &[("file", &file_paths())]);
    });
    let message = result.expect_err("a missing row fails the check");
    let text = message
        .downcast_ref::<String>()
        .expect("the failure is a message");
    assert!(text.contains("file: splice"), "{text}");
}

#[test]
fn the_tracer_reaches_nested_fields() {
    let paths = file_paths();
    for path in [
        "clusters[].health_checks[].http_health_check.path",
        "clusters[].load_assignment.endpoints[].lb_endpoints[].endpoint.address.socket_address.port_value",
        "xds.ads_config.api_type",
        "proxy.listeners",
    ] {
        assert!(paths.contains(path), "{path} not traced: {paths:?}");
    }
}
