//! `/clusters`: Envoy's text, Envoy's JSON schema (`?format=json`), and the daemon's own view
//! (`/routing`: which services use a cluster, which hosts are routable now).
//!
//! The JSON is `envoy.admin.v3.Clusters` as Envoy 1.40 prints it (proto3 JSON with the
//! original field names): false booleans, zeros, empty strings and empty lists are left out,
//! 64-bit stat values are strings, a stat's `type` is printed only for gauges, and `locality`
//! is always there (`{}` when unknown); `circuit_breakers` lists both priorities' four maxima,
//! Envoy's defaults filled in, `DEFAULT` (left out, proto3's zero) first. Not printed, because
//! the daemon has no such thing: `added_via_api` (always false here: clusters come from the
//! file), `success_rate` and the outlier success-rate thresholds.
//!
//! A host's `cx_total` is its proxy-path connects plus its kernel-path ones (`HOST_CX_V1`, read
//! once per page into a map by address); `cx_connect_fail` and `cx_active` are the proxy
//! path's only: the kernel sees neither a connect's outcome nor a close there.

use std::{
    collections::{BTreeMap, HashMap},
    fmt::Write as _,
    net::SocketAddr,
    sync::PoisonError,
};

use proxy_core::{
    config::circuit_breakers::{Limits, Priority},
    health::{HostFlags, HostStatus},
    host::{EdsHealth, Host},
    upstream::HostTraffic,
};
use serde::Serialize;

use crate::admin::State;

/// `envoy.admin.v3.Clusters`.
#[derive(Serialize)]
pub(crate) struct Clusters {
    cluster_statuses: Vec<ClusterStatus>,
}

/// `envoy.admin.v3.ClusterStatus`.
#[derive(Serialize)]
struct ClusterStatus {
    name: String,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    host_statuses: Vec<EnvoyHost>,
    circuit_breakers: CircuitBreakers,
    observability_name: String,
}

/// `envoy.config.cluster.v3.CircuitBreakers` as Envoy's `/clusters` fills it: per priority,
/// the four maxima in force.
#[derive(Serialize)]
struct CircuitBreakers {
    thresholds: Vec<Thresholds>,
}

#[derive(Serialize)]
struct Thresholds {
    #[serde(skip_serializing_if = "Option::is_none")]
    priority: Option<&'static str>,
    max_connections: u64,
    max_pending_requests: u64,
    max_requests: u64,
    max_retries: u64,
}

impl CircuitBreakers {
    fn of(thresholds: [(Priority, Limits); 2]) -> Self {
        let thresholds = thresholds
            .into_iter()
            .map(|(priority, l)| Thresholds {
                priority: (priority != Priority::Default).then(|| priority.name()),
                max_connections: l.max_connections,
                max_pending_requests: l.max_pending_requests,
                max_requests: l.max_requests,
                max_retries: l.max_retries,
            })
            .collect();
        Self { thresholds }
    }
}

/// `envoy.admin.v3.HostStatus`.
#[derive(Serialize)]
struct EnvoyHost {
    address: Address,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    stats: Vec<SimpleMetric>,
    health_status: HostHealthStatus,
    #[serde(skip_serializing_if = "is_zero")]
    weight: u32,
    #[serde(skip_serializing_if = "String::is_empty")]
    hostname: String,
    #[serde(skip_serializing_if = "is_zero")]
    priority: u32,
    locality: Locality,
}

/// `envoy.config.core.v3.Address` with its `socket_address`.
#[derive(Serialize)]
struct Address {
    socket_address: SocketAddress,
}

#[derive(Serialize)]
struct SocketAddress {
    address: String,
    #[serde(skip_serializing_if = "is_zero")]
    port_value: u32,
}

/// `envoy.admin.v3.SimpleMetric`: `type` only for a gauge, `value` only when not 0.
#[derive(Serialize)]
struct SimpleMetric {
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    kind: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    value: Option<String>,
    name: &'static str,
}

impl SimpleMetric {
    fn new(name: &'static str, gauge: bool, value: u64) -> Self {
        Self {
            kind: gauge.then_some("GAUGE"),
            value: (value != 0).then(|| value.to_string()),
            name,
        }
    }
}

/// `envoy.admin.v3.HostHealthStatus`; a false flag is left out.
#[derive(Serialize)]
struct HostHealthStatus {
    #[serde(skip_serializing_if = "is_false")]
    failed_active_health_check: bool,
    #[serde(skip_serializing_if = "is_false")]
    failed_outlier_check: bool,
    #[serde(skip_serializing_if = "is_false")]
    failed_active_degraded_check: bool,
    #[serde(skip_serializing_if = "is_false")]
    pending_dynamic_removal: bool,
    #[serde(skip_serializing_if = "is_false")]
    pending_active_hc: bool,
    #[serde(skip_serializing_if = "is_false")]
    active_hc_timeout: bool,
    eds_health_status: &'static str,
}

impl HostHealthStatus {
    /// The flags of `flags` and the status discovery gave (`eds`) as Envoy 1.40 prints it:
    /// UNKNOWN as HEALTHY and TIMEOUT as UNHEALTHY (seen on a real Envoy), whatever active
    /// checking found (that is `failed_active_health_check`).
    fn new(flags: &HostFlags, eds: EdsHealth) -> Self {
        let eds_health_status = match eds {
            EdsHealth::Unknown | EdsHealth::Healthy => "HEALTHY",
            EdsHealth::Unhealthy | EdsHealth::Timeout => "UNHEALTHY",
            EdsHealth::Draining => "DRAINING",
            EdsHealth::Degraded => "DEGRADED",
        };
        Self {
            failed_active_health_check: flags.failed_active_hc,
            failed_outlier_check: flags.failed_outlier_check,
            failed_active_degraded_check: flags.degraded_active_hc,
            pending_dynamic_removal: flags.pending_dynamic_removal,
            pending_active_hc: flags.pending_active_hc,
            active_hc_timeout: flags.active_hc_timeout,
            eds_health_status,
        }
    }
}

/// `envoy.config.core.v3.Locality`, from an EDS host's `locality.*` metadata.
#[derive(Serialize, Default)]
struct Locality {
    #[serde(skip_serializing_if = "String::is_empty")]
    region: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    zone: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    sub_zone: String,
}

impl Locality {
    fn of(host: &Host) -> Self {
        let get = |key: &str| host.metadata().get(key).cloned().unwrap_or_default();
        Self {
            region: get(proxy_core::discovery::xds::cla::LOCALITY_REGION),
            zone: get(proxy_core::discovery::xds::cla::LOCALITY_ZONE),
            sub_zone: get(proxy_core::discovery::xds::cla::LOCALITY_SUB_ZONE),
        }
    }
}

fn is_zero(v: &u32) -> bool {
    *v == 0
}

fn is_false(v: &bool) -> bool {
    !*v
}

fn address(addr: SocketAddr) -> Address {
    Address {
        socket_address: SocketAddress {
            address: addr.ip().to_string(),
            port_value: u32::from(addr.port()),
        },
    }
}

/// The kernel path's connects per host address: empty before the data path is attached, and
/// when the map cannot be read (logged; the page shows the proxy path's counts).
fn kernel_connects(state: &State) -> HashMap<SocketAddr, u64> {
    let guard = state
        .dataplane
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    let Some(dp) = guard.as_ref() else {
        return HashMap::new();
    };
    dp.host_connects().unwrap_or_else(|err| {
        tracing::warn!(%err, "reading the kernel path's connects per host; /clusters shows the proxy path's");
        HashMap::new()
    })
}

/// `traffic` of the host at `addr` (the proxy path's) with its kernel-path connects added to
/// `cx_total`.
fn with_kernel(
    mut traffic: HostTraffic,
    kernel: &HashMap<SocketAddr, u64>,
    addr: SocketAddr,
) -> HostTraffic {
    let connects = kernel.get(&addr).copied().unwrap_or(0);
    traffic.cx_total = traffic.cx_total.saturating_add(connects);
    traffic
}

/// The host stats the daemon has, in Envoy's order (counters, then gauges): `cx_total` of both
/// paths, `cx_connect_fail` and `cx_active` of the proxy path; Envoy's `rq_*` are not kept per
/// host.
fn host_stats(traffic: HostTraffic) -> Vec<SimpleMetric> {
    vec![
        SimpleMetric::new("cx_connect_fail", false, traffic.cx_connect_fail),
        SimpleMetric::new("cx_total", false, traffic.cx_total),
        SimpleMetric::new("cx_active", true, traffic.cx_active),
    ]
}

fn envoy_host(status: &HostStatus, traffic: HostTraffic) -> EnvoyHost {
    let host = &status.host;
    EnvoyHost {
        address: address(host.addr),
        stats: host_stats(traffic),
        health_status: HostHealthStatus::new(&status.flags, host.eds_health),
        weight: host.weight,
        hostname: host.hostname().unwrap_or_default().to_owned(),
        priority: host.priority,
        locality: Locality::of(host),
    }
}

/// `/clusters?format=json`: every cluster in Envoy's schema, ORIGINAL_DST clusters with the
/// proxy path's current original-destination hosts.
pub(crate) fn clusters_json(state: &State) -> Clusters {
    json_with(state, &kernel_connects(state))
}

/// [`clusters_json`] with the kernel path's connects per host `kernel`.
fn json_with(state: &State, kernel: &HashMap<SocketAddr, u64>) -> Clusters {
    let mut cluster_statuses: Vec<ClusterStatus> = state
        .upstreams
        .iter()
        .map(|(name, upstream)| {
            let traffic = upstream.traffic();
            let host_statuses = upstream
                .host_statuses()
                .iter()
                .map(|s| {
                    let addr = s.host.addr;
                    envoy_host(s, with_kernel(traffic.host(addr), kernel, addr))
                })
                .collect();
            ClusterStatus {
                name: name.clone(),
                host_statuses,
                circuit_breakers: CircuitBreakers::of(traffic.breakers().thresholds()),
                observability_name: name.clone(),
            }
        })
        .collect();
    let original = original_dst_hosts(state);
    for name in original_dst_names(state) {
        let host_statuses = original
            .iter()
            .map(|&addr| {
                let status = HostStatus {
                    host: Host::new(addr),
                    flags: HostFlags::default(),
                };
                EnvoyHost {
                    stats: Vec::new(),
                    ..envoy_host(&status, HostTraffic::default())
                }
            })
            .collect();
        // An ORIGINAL_DST cluster takes no breakers here: Envoy's defaults.
        let defaults = [Priority::Default, Priority::High].map(|p| (p, Limits::default()));
        cluster_statuses.push(ClusterStatus {
            observability_name: name.clone(),
            name,
            host_statuses,
            circuit_breakers: CircuitBreakers::of(defaults),
        });
    }
    Clusters { cluster_statuses }
}

/// One host in `/routing`.
#[derive(Serialize)]
struct RoutingHost {
    #[serde(skip)]
    addr: SocketAddr,
    address: String,
    health_flags: String,
    weight: u32,
    priority: u32,
    routable: bool,
}

/// One cluster in `/routing`: the daemon's own view, which `proxy status` reads.
#[derive(Serialize)]
pub(crate) struct RoutingCluster {
    name: String,
    services: Vec<String>,
    hosts: Vec<RoutingHost>,
}

/// The services (`name address:port`) that `uses` says use a cluster.
fn services_where(
    state: &State,
    uses: impl Fn(&proxy_core::config::Service) -> bool,
) -> Vec<String> {
    state
        .config
        .services
        .iter()
        .filter(|s| uses(s))
        .map(|s| format!("{} {}:{}", s.name, s.address, s.port))
        .collect()
}

/// `/routing`: per cluster, the services using it and each host's flags, weight, priority and
/// whether new connections go to it now.
pub(crate) fn routing(state: &State) -> Vec<RoutingCluster> {
    // Each service's clusters once (not every service per cluster: 10,000 of each would be
    // 10^8 lookups).
    let mut users: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    let clusters_of: Vec<Vec<String>> = state
        .config
        .services
        .iter()
        .map(|s| state.config.service_clusters(s))
        .collect();
    for (svc, clusters) in state.config.services.iter().zip(&clusters_of) {
        for cluster in clusters {
            users
                .entry(cluster.as_str())
                .or_default()
                .push(format!("{} {}:{}", svc.name, svc.address, svc.port));
        }
    }
    let mut clusters: Vec<RoutingCluster> = state
        .upstreams
        .iter()
        .map(|(name, upstream)| {
            let routable: std::collections::HashSet<_> = upstream
                .routing()
                .borrow()
                .routable()
                .iter()
                .map(|h| h.addr)
                .collect();
            let hosts = upstream
                .host_statuses()
                .into_iter()
                .map(|s| RoutingHost {
                    addr: s.host.addr,
                    address: s.host.addr.to_string(),
                    health_flags: s.flags.render(),
                    weight: s.host.weight,
                    priority: s.host.priority,
                    routable: routable.contains(&s.host.addr),
                })
                .collect();
            RoutingCluster {
                name: name.clone(),
                services: users.remove(name.as_str()).unwrap_or_default(),
                hosts,
            }
        })
        .collect();
    // ORIGINAL_DST: one pool of hosts shared by every such cluster, all routable.
    let original = original_dst_hosts(state);
    for name in original_dst_names(state) {
        clusters.push(RoutingCluster {
            services: services_where(state, |s| s.cluster == name),
            hosts: original
                .iter()
                .map(|h| RoutingHost {
                    addr: *h,
                    address: h.to_string(),
                    health_flags: "healthy".to_owned(),
                    weight: 1,
                    priority: 0,
                    routable: true,
                })
                .collect(),
            name,
        });
    }
    clusters
}

fn original_dst_names(state: &State) -> Vec<String> {
    state
        .config
        .clusters
        .iter()
        .filter(|c| state.config.is_original_dst(&c.name))
        .map(|c| c.name.clone())
        .collect()
}

fn original_dst_hosts(state: &State) -> Vec<SocketAddr> {
    state
        .proxy
        .as_ref()
        .map(proxy_relay::ProxyStatsHandle::original_dst_hosts)
        .unwrap_or_default()
}

/// Envoy's `/clusters` text: `cluster::host::field::value`, a host's stats first, sorted by
/// name as Envoy sorts them (none for an ORIGINAL_DST cluster's hosts, as in the JSON).
pub(crate) fn clusters_text(state: &State) -> String {
    text_with(state, &kernel_connects(state))
}

/// [`clusters_text`] with the kernel path's connects per host `kernel`.
fn text_with(state: &State, kernel: &HashMap<SocketAddr, u64>) -> String {
    let mut out = String::new();
    for cluster in routing(state) {
        let traffic = state.upstreams.get(&cluster.name).map(|u| u.traffic());
        for host in &cluster.hosts {
            let prefix = format!("{}::{}", cluster.name, host.address);
            if let Some(traffic) = &traffic {
                let t = with_kernel(traffic.host(host.addr), kernel, host.addr);
                let _ = writeln!(out, "{prefix}::cx_active::{}", t.cx_active);
                let _ = writeln!(out, "{prefix}::cx_connect_fail::{}", t.cx_connect_fail);
                let _ = writeln!(out, "{prefix}::cx_total::{}", t.cx_total);
            }
            let _ = writeln!(out, "{prefix}::health_flags::{}", host.health_flags);
            let _ = writeln!(out, "{prefix}::weight::{}", host.weight);
            let _ = writeln!(out, "{prefix}::priority::{}", host.priority);
            let _ = writeln!(out, "{prefix}::routable::{}", host.routable);
        }
    }
    out
}

#[cfg(test)]
mod tests;
