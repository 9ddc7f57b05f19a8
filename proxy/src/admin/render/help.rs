//! The `# HELP` line of each family of `/stats/prometheus`: what the stat counts, in the
//! daemon's words. Envoy prints no HELP; a stat with no entry here gets a line naming where it
//! comes from, so every family has one.

/// Per-cluster stats (`cluster.<name>.<leaf>`), by leaf.
const CLUSTER: &[(&str, &str)] = &[
    (
        "upstream_cx_total",
        "Connections made to the cluster's hosts (proxy path), plus the kernel path's connects to them for a direct-mode service of this one cluster.",
    ),
    (
        "upstream_cx_active",
        "Proxy path connections to the cluster's hosts open now.",
    ),
    (
        "upstream_cx_connect_fail",
        "Proxy path connects to the cluster's hosts that failed or timed out.",
    ),
    (
        "upstream_cx_connect_attempts_exceeded",
        "Proxy path connections reset after all their connect attempts failed.",
    ),
    (
        "upstream_cx_none_healthy",
        "Connections or requests that found no routable host in the cluster.",
    ),
    (
        "upstream_cx_overflow",
        "Connections refused by the cluster's max_connections (proxy and kernel path).",
    ),
    (
        "upstream_cx_connect_ms",
        "Time from the start of a proxy path connect to a cluster host to its success, in milliseconds.",
    ),
    (
        "upstream_rq_time",
        "Time from the start of a proxy path HTTP request attempt to its response headers, in milliseconds.",
    ),
    (
        "upstream_rq_xx",
        "Proxy path HTTP responses from the cluster's hosts by status class (a reset before the response counts as 503, a request timeout as 504).",
    ),
    (
        "upstream_rq",
        "Proxy path HTTP responses from the cluster's hosts by status code (a reset before the response counts as 503, a request timeout as 504).",
    ),
    (
        "upstream_rq_total",
        "Proxy path HTTP requests sent to the cluster's hosts, retries included.",
    ),
    (
        "upstream_rq_completed",
        "Proxy path HTTP requests to the cluster's hosts that completed (a response, a reset or a timeout).",
    ),
    (
        "upstream_rq_drop_overload",
        "Requests or connects refused by the cluster's drop_overloads.",
    ),
    (
        "upstream_rq_pending_overflow",
        "HTTP requests refused by the cluster's max_pending_requests.",
    ),
    (
        "upstream_rq_active_overflow",
        "HTTP requests refused by the cluster's max_requests.",
    ),
    (
        "upstream_rq_retry_overflow",
        "HTTP retries refused by the cluster's max_retries.",
    ),
    (
        "lb_healthy_panic",
        "Host choices made in panic mode (too few healthy hosts: all hosts are used).",
    ),
    (
        "lb_recalculate_zone_structures",
        "Zone-aware routing recomputations.",
    ),
    (
        "lb_zone_cluster_too_small",
        "Zone-aware recomputations that found too few healthy hosts.",
    ),
    (
        "lb_local_cluster_not_ok",
        "Zone-aware recomputations that found the local cluster unusable.",
    ),
    ("membership_total", "Hosts the cluster has now."),
    (
        "membership_healthy",
        "Hosts of the cluster that are healthy now.",
    ),
    (
        "membership_degraded",
        "Hosts of the cluster that are degraded now.",
    ),
    (
        "membership_excluded",
        "Hosts of the cluster excluded from load balancing now.",
    ),
    ("membership_change", "Changes of the cluster's host set."),
    ("update_attempt", "Discovery updates attempted."),
    ("update_success", "Discovery updates that succeeded."),
    ("update_failure", "Discovery updates that failed."),
    ("update_empty", "Discovery updates that found no host."),
    (
        "update_no_rebuild",
        "Discovery updates that changed nothing.",
    ),
    (
        "update_rejected",
        "Discovery updates refused (invalid hosts).",
    ),
    (
        "update_too_large",
        "Host sets too large for the kernel maps, skipped.",
    ),
    (
        "hosts_refused",
        "Discovered hosts refused by the host guard, now.",
    ),
    ("health_check.attempt", "Active health checks made."),
    ("health_check.success", "Active health checks that passed."),
    ("health_check.failure", "Active health checks that failed."),
    (
        "health_check.network_failure",
        "Active health checks that failed on the network.",
    ),
    (
        "health_check.healthy",
        "Hosts that pass active health checking now.",
    ),
    (
        "outlier_detection.ejections_active",
        "Hosts ejected by outlier detection now.",
    ),
    (
        "outlier_detection.ejections_enforced_total",
        "Ejections outlier detection enforced.",
    ),
];

/// Per-service kernel counters (`service.<name>.<leaf>`), by leaf.
const SERVICE: &[(&str, &str)] = &[
    (
        "cx_to_host",
        "Kernel path connects to the service rewritten to a chosen host.",
    ),
    (
        "cx_to_proxy",
        "Connects to the service redirected to the daemon's proxy.",
    ),
    (
        "cx_no_host",
        "Connects to the service refused: no routable host.",
    ),
    ("cx_panic", "Kernel path host choices made in panic mode."),
    (
        "cx_passive_failure",
        "Kernel path connections to the service's hosts that failed or were reset.",
    ),
    (
        "cx_open",
        "Kernel path connections to the service open now (max_connections).",
    ),
    (
        "cx_overflow",
        "Kernel path connects refused by the service's max_connections.",
    ),
    (
        "cx_drop_overload",
        "Kernel path connects refused by the service's drop overload.",
    ),
    (
        "hosts_stale",
        "1 while the kernel serves an older host set than the service's newest.",
    ),
    (
        "publish_failed",
        "Host set publications to the kernel that failed.",
    ),
];

/// Server stats (`server.<leaf>`), by leaf.
const SERVER: &[(&str, &str)] = &[
    ("services", "Services in the configuration in force."),
    ("clusters", "Clusters in the configuration in force."),
    (
        "chain_failures",
        "Discovery chains that Consul's config entries left uncompiled (each service keeps its previous chain or is left out).",
    ),
];

/// The HELP text of the stat named `name` (dotted, as `/stats` shows it) whose family is
/// `family`; `proxy` looks up the proxy path's own descriptions.
pub(super) fn help(
    name: &str,
    family: &str,
    proxy: impl Fn(&str) -> Option<&'static str>,
) -> String {
    let found = if let Some(leaf) = name.strip_prefix("proxy.") {
        proxy(leaf)
    } else if name.starts_with("service.") {
        name.rsplit_once('.')
            .and_then(|(_, leaf)| lookup(SERVICE, leaf))
    } else if name.starts_with("cluster.") {
        let leaf = family.strip_prefix("envoy_cluster_").unwrap_or(family);
        lookup_dotted(CLUSTER, leaf)
    } else if let Some(leaf) = name.strip_prefix("server.") {
        lookup(SERVER, leaf)
    } else {
        None
    };
    match found {
        Some(text) => text.to_owned(),
        None if name.starts_with("bpf.") => format!(
            "Kernel program counter {}, summed over CPUs.",
            &name["bpf.".len()..]
        ),
        None if name.contains(".circuit_breakers.") => {
            let rest = name.split(".circuit_breakers.").nth(1).unwrap_or_default();
            let (priority, what) = rest.split_once('.').unwrap_or(("default", rest));
            format!(
                "Circuit breaker gauge {what} of the {priority} priority (`_open`: 1 while at the limit; `remaining_`: what is left below it)."
            )
        }
        None if name.starts_with("cluster.") => {
            format!("Envoy's cluster stat {family}, per cluster.")
        }
        None => format!("The daemon's stat {family}."),
    }
}

fn lookup(table: &[(&str, &'static str)], leaf: &str) -> Option<&'static str> {
    table.iter().find(|(k, _)| *k == leaf).map(|(_, v)| *v)
}

/// A cluster family's leaf is sanitized (`health_check_attempt`): match the table's dotted
/// names the same way.
fn lookup_dotted(table: &[(&str, &'static str)], leaf: &str) -> Option<&'static str> {
    table
        .iter()
        .find(|(k, _)| k.replace('.', "_") == leaf)
        .map(|(_, v)| *v)
}
