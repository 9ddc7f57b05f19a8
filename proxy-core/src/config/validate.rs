//! Checks that need more than one field: references, uniqueness, ranges, and what this build can
//! serve. Each failure names the field it is about.

use std::{collections::HashSet, net::IpAddr};

use proxy_common::service::MAX_PRIORITIES;

use super::{ClusterType, Config, LbPolicy, ServiceMode, error::Invalid};

/// Validates `config`, typing each custom cluster's `typed_config` on the way.
pub(super) fn validate(config: &mut Config) -> Result<(), Invalid> {
    validate_names(config)?;
    config.admin.validate()?;
    let guard = super::host_guard::HostGuard::for_config(config);
    for (i, cluster) in config.clusters.iter_mut().enumerate() {
        super::envoy::normalize(i, cluster)?;
        if cluster.connect_timeout.is_some_and(|t| t.is_zero()) {
            return Err(Invalid::new(
                format!("clusters[{i}].connect_timeout"),
                "must be greater than 0",
            ));
        }
        if let Some(Err((field, why))) = cluster
            .circuit_breakers
            .as_ref()
            .map(super::circuit_breakers::CircuitBreakers::check)
        {
            return Err(Invalid::new(
                format!("clusters[{i}].circuit_breakers.{field}"),
                why,
            ));
        }
        super::unread::refuse_unread(i, cluster)?;
        match &cluster.custom_cluster_type {
            Some(custom) => {
                let typed = validate_custom(i, cluster, custom)?;
                if let Some(custom) = &mut cluster.custom_cluster_type {
                    custom.typed = Some(typed);
                }
            }
            None => validate_cluster(i, cluster, &guard)?,
        }
    }
    validate_services(config)?;
    validate_zones(config)?;
    if let Some(entries) = &config.consul_config_entries {
        entries
            .validate()
            .map_err(|e| Invalid::new("consul_config_entries", e.to_string()))?;
    }
    super::kernel_maps::check_config(config)
}

/// The local cluster exists and serves hosts; every zone-aware cluster has a local cluster
/// and a node locality to route by (Envoy would route without zones then; here the setting is
/// never ignored); the two node localities agree.
fn validate_zones(config: &Config) -> Result<(), Invalid> {
    if let Some(cm) = &config.cluster_manager {
        let name = &cm.local_cluster_name;
        if config.cluster(name).is_none() {
            return Err(Invalid::new(
                "cluster_manager.local_cluster_name",
                format!("local cluster '{name}' must be defined"),
            ));
        }
        if config.is_original_dst(name) {
            return Err(Invalid::new(
                "cluster_manager.local_cluster_name",
                format!(
                    "local cluster '{name}' is ORIGINAL_DST: it has no hosts to compare localities with"
                ),
            ));
        }
    }
    let node = config.node.as_ref().map(|n| &n.locality);
    if let (Some(node), Some(xds)) = (
        node,
        config.xds.as_ref().and_then(|x| x.node.locality.as_ref()),
    ) {
        let same =
            (&node.region, &node.zone, &node.sub_zone) == (&xds.region, &xds.zone, &xds.sub_zone);
        if !same {
            return Err(Invalid::new(
                "node.locality",
                "differs from xds.node.locality: one node has one locality",
            ));
        }
    }
    let placed = node.is_some_and(|l| *l != crate::host::Locality::default());
    for (i, cluster) in config.clusters.iter().enumerate() {
        if cluster.common_lb_config.zone_aware_lb_config.is_some()
            && (config.cluster_manager.is_none() || !placed)
        {
            return Err(Invalid::new(
                format!("clusters[{i}].common_lb_config.zone_aware_lb_config"),
                "needs cluster_manager.local_cluster_name (the cluster of this node's own service) and node.locality (where this node runs); without them Envoy routes without zones, and this daemon does not ignore a setting",
            ));
        }
    }
    Ok(())
}

fn validate_names(config: &Config) -> Result<(), Invalid> {
    let bad = |c: char| !(c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.');
    if config.instance.is_empty() || config.instance.contains(bad) || config.instance.len() > 64 {
        return Err(Invalid::new(
            "instance",
            "must be 1-64 characters of [A-Za-z0-9._-] (it names a bpffs directory)",
        ));
    }
    if config.instance.chars().all(|c| c == '.') {
        return Err(Invalid::new(
            "instance",
            format!(
                "{:?} names the bpffs directory itself or its parent, not a directory of this daemon's own (a stop would remove other programs' pins)",
                config.instance
            ),
        ));
    }
    validate_paths(config)?;
    let mut seen = HashSet::new();
    for (i, cluster) in config.clusters.iter().enumerate() {
        if cluster.name.is_empty() {
            return Err(Invalid::new(
                format!("clusters[{i}].name"),
                "must not be empty",
            ));
        }
        if !seen.insert(cluster.name.as_str()) {
            return Err(Invalid::new(
                format!("clusters[{i}].name"),
                format!("duplicate cluster name {:?}", cluster.name),
            ));
        }
    }
    Ok(())
}

/// `cgroup` and `bpffs` name places the daemon changes (it attaches to the one, mounts and pins
/// in the other): each must name a place of its own, never the cgroup root or a parent.
fn validate_paths(config: &Config) -> Result<(), Invalid> {
    use std::path::{Component, Path};
    let climbs = |p: &Path| {
        p.components()
            .any(|c| matches!(c, Component::CurDir | Component::ParentDir))
    };
    let cgroup = Path::new(&config.cgroup);
    let below_root = cgroup
        .components()
        .any(|c| matches!(c, Component::Normal(_)));
    if !below_root || climbs(cgroup) {
        return Err(Invalid::new(
            "cgroup",
            format!(
                "{:?} must name a cgroup below the cgroup v2 root, without `.` or `..` (the root holds every process of the host)",
                config.cgroup
            ),
        ));
    }
    let bpffs = Path::new(&config.bpffs);
    if !bpffs.is_absolute() || climbs(bpffs) || bpffs == Path::new("/") {
        return Err(Invalid::new(
            "bpffs",
            format!(
                "{:?} must be an absolute path below / without `.` or `..` (for example /sys/fs/bpf)",
                config.bpffs
            ),
        ));
    }
    Ok(())
}

fn validate_cluster(
    i: usize,
    cluster: &super::Cluster,
    guard: &super::host_guard::HostGuard,
) -> Result<(), Invalid> {
    let at = |field: &str| format!("clusters[{i}].{field}");
    let dns = match cluster.cluster_type {
        ClusterType::Static => false,
        ClusterType::StrictDns | ClusterType::LogicalDns => true,
        ClusterType::Eds => {
            if cluster.eds_cluster_config.is_none() {
                return Err(Invalid::new(
                    at("eds_cluster_config"),
                    "EDS clusters need eds_cluster_config",
                ));
            }
            false
        }
        ClusterType::OriginalDst => return validate_original_dst(i, cluster),
    };
    if cluster.cleanup_interval.is_some() {
        return Err(Invalid::new(
            at("cleanup_interval"),
            "only ORIGINAL_DST clusters have a cleanup_interval",
        ));
    }
    if cluster.original_dst_lb_config.is_some() {
        return Err(Invalid::new(
            at("original_dst_lb_config"),
            "only ORIGINAL_DST clusters have an original_dst_lb_config",
        ));
    }
    if dns {
        validate_dns(i, cluster)?;
    }
    validate_health(i, cluster)?;
    validate_lb(cluster, &at)?;
    validate_endpoints(i, cluster, dns, guard)
}

/// The cluster's `lb_policy` and its `ring_hash_lb_config` / `maglev_lb_config` (Envoy's
/// bounds and texts; each only with its own policy).
fn validate_lb(cluster: &super::Cluster, at: &dyn Fn(&str) -> String) -> Result<(), Invalid> {
    if cluster.lb_policy == LbPolicy::ClusterProvided {
        return Err(Invalid::new(
            at("lb_policy"),
            "CLUSTER_PROVIDED is for ORIGINAL_DST clusters only; use RANDOM (weighted random, \
             the default), ROUND_ROBIN, LEAST_REQUEST, RING_HASH or MAGLEV",
        ));
    }
    let configs = [
        (
            "ring_hash_lb_config",
            LbPolicy::RingHash,
            cluster
                .ring_hash_lb_config
                .as_ref()
                .map(crate::lb::RingHashLbConfig::validate),
        ),
        (
            "maglev_lb_config",
            LbPolicy::Maglev,
            cluster
                .maglev_lb_config
                .as_ref()
                .map(crate::lb::MaglevLbConfig::validate),
        ),
    ];
    for (field, policy, checked) in configs {
        let Some(checked) = checked else { continue };
        if cluster.lb_policy != policy {
            return Err(Invalid::new(
                at(field),
                format!(
                    "applies to lb_policy {policy:?} only (this cluster's is {:?}); remove it \
                     or change lb_policy",
                    cluster.lb_policy
                ),
            ));
        }
        checked.map_err(|why| Invalid::new(at(field), why))?;
    }
    Ok(())
}

/// The endpoints of a cluster's `load_assignment`: priorities in range, IP literals where no
/// name is resolved, ports and weights above 0, and no address the data path refuses.
fn validate_endpoints(
    i: usize,
    cluster: &super::Cluster,
    dns: bool,
    guard: &super::host_guard::HostGuard,
) -> Result<(), Invalid> {
    let at = |field: &str| format!("clusters[{i}].{field}");
    let Some(assignment) = &cluster.load_assignment else {
        return Ok(());
    };
    for (g, group) in assignment.endpoints.iter().enumerate() {
        let at = |field: &str| at(&format!("load_assignment.endpoints[{g}].{field}"));
        if group.priority >= MAX_PRIORITIES {
            return Err(Invalid::new(
                at("priority"),
                format!("must be less than {MAX_PRIORITIES}"),
            ));
        }
        for (e, lb) in group.lb_endpoints.iter().enumerate() {
            let at = |field: &str| at(&format!("lb_endpoints[{e}].{field}"));
            let sa = &lb.endpoint.address.socket_address;
            if !dns && sa.address.parse::<IpAddr>().is_err() {
                return Err(Invalid::new(
                    at("endpoint.address.socket_address.address"),
                    format!(
                        "{:?} is not an IP address (STATIC clusters take IPs)",
                        sa.address
                    ),
                ));
            }
            if sa.port_value == 0 {
                return Err(Invalid::new(
                    at("endpoint.address.socket_address.port_value"),
                    "must not be 0",
                ));
            }
            if let Ok(ip) = sa.address.parse::<IpAddr>()
                && let Some(why) = guard.refuses(std::net::SocketAddr::new(ip, sa.port_value))
            {
                return Err(Invalid::new(
                    at("endpoint.address.socket_address"),
                    format!(
                        "{ip}:{} is {why}, which is never a host (the data path would refuse it)",
                        sa.port_value
                    ),
                ));
            }
            if lb.load_balancing_weight == 0 {
                return Err(Invalid::new(
                    at("load_balancing_weight"),
                    "must be at least 1",
                ));
            }
            if let Some(check) = &lb.endpoint.health_check_config {
                check.validate(guard).map_err(|(field, why)| {
                    Invalid::new(at(&format!("endpoint.health_check_config.{field}")), why)
                })?;
            }
        }
    }
    Ok(())
}

/// ORIGINAL_DST: hosts are the original destinations of proxied connections, so there are no
/// endpoints to list, resolve or health-check (Envoy refuses a load assignment as well).
fn validate_original_dst(i: usize, cluster: &super::Cluster) -> Result<(), Invalid> {
    let at = |field: &str| format!("clusters[{i}].{field}");
    if cluster.load_assignment.is_some() {
        return Err(Invalid::new(
            at("load_assignment"),
            "ORIGINAL_DST clusters take their hosts from the connections' original destinations; \
             remove load_assignment",
        ));
    }
    if !cluster.health_checks.is_empty() {
        return Err(Invalid::new(
            at("health_checks"),
            "ORIGINAL_DST hosts are not health-checked",
        ));
    }
    if cluster.circuit_breakers.is_some() {
        return Err(Invalid::new(
            at("circuit_breakers"),
            "ORIGINAL_DST clusters are not limited by circuit breakers here (the proxy keeps one \
             pool of original destinations for all of them); remove circuit_breakers",
        ));
    }
    if cluster.outlier_detection.is_some() {
        return Err(Invalid::new(
            at("outlier_detection"),
            "ORIGINAL_DST hosts have no outlier detection",
        ));
    }
    if !matches!(
        cluster.lb_policy,
        LbPolicy::Random | LbPolicy::ClusterProvided
    ) {
        return Err(Invalid::new(
            at("lb_policy"),
            "ORIGINAL_DST clusters choose no host; use CLUSTER_PROVIDED (or leave lb_policy out)",
        ));
    }
    if let Some(d) = cluster.cleanup_interval
        && d < crate::health::MIN_TIMER_INTERVAL
    {
        return Err(Invalid::new(
            at("cleanup_interval"),
            format!(
                "is {d:?}; a timer interval must be at least 1ms (a shorter one would spin a CPU)"
            ),
        ));
    }
    Ok(())
}

/// All ORIGINAL_DST clusters share the proxy's one pool of original-destination hosts, so they
/// must agree on its settings.
fn validate_original_dst_agree(config: &Config) -> Result<(), Invalid> {
    let mut first: Option<(usize, &super::Cluster)> = None;
    for (i, c) in config.clusters.iter().enumerate() {
        if c.cluster_type != ClusterType::OriginalDst || c.custom_cluster_type.is_some() {
            continue;
        }
        let Some((j, f)) = first else {
            first = Some((i, c));
            continue;
        };
        if f.cleanup_interval != c.cleanup_interval {
            return Err(Invalid::new(
                format!("clusters[{i}].cleanup_interval"),
                format!(
                    "ORIGINAL_DST clusters share one host pool; cleanup_interval must equal that \
                     of clusters[{j}] ({:?})",
                    f.cleanup_interval
                        .unwrap_or(super::proxy::defaults::cleanup_interval())
                ),
            ));
        }
        if f.connect_timeout != c.connect_timeout {
            return Err(Invalid::new(
                format!("clusters[{i}].connect_timeout"),
                format!(
                    "ORIGINAL_DST clusters share one host pool; connect_timeout must equal that \
                     of clusters[{j}]"
                ),
            ));
        }
        if f.original_dst_lb_config != c.original_dst_lb_config {
            return Err(Invalid::new(
                format!("clusters[{i}].original_dst_lb_config"),
                format!(
                    "ORIGINAL_DST clusters share one host pool; must equal that of clusters[{j}]"
                ),
            ));
        }
    }
    Ok(())
}

/// Health checks, outlier detection and the panic threshold of cluster `i`, whatever finds
/// its hosts.
fn validate_health(i: usize, cluster: &super::Cluster) -> Result<(), Invalid> {
    let at = |field: &str| format!("clusters[{i}].{field}");
    if let Some(od) = &cluster.outlier_detection {
        od.validate()
            .map_err(|err| Invalid::new(at("outlier_detection"), err.to_string()))?;
    }
    if let Err(err) = cluster.health_config().validate(&cluster.name) {
        let field = if cluster.health_checks.is_empty() {
            "outlier_detection"
        } else {
            "health_checks[0]"
        };
        return Err(Invalid::new(at(field), err.to_string()));
    }
    Ok(())
}

/// A custom backend: a known name and a `typed_config` of its type, returned typed.
fn validate_custom(
    i: usize,
    cluster: &super::Cluster,
    custom: &super::CustomClusterType,
) -> Result<super::CustomConfig, Invalid> {
    validate_health(i, cluster)?;
    let at = |field: &str| format!("clusters[{i}].cluster_type.{field}");
    let typed = |inner: String, msg: String| {
        let field = if inner == "." {
            at("typed_config")
        } else {
            at(&format!("typed_config.{inner}"))
        };
        Invalid::new(field, msg)
    };
    match custom.name.as_str() {
        super::CONSUL_CLUSTER => {
            let cfg: crate::config::sources::consul::ConsulConfig =
                serde_path_to_error::deserialize(&custom.typed_config)
                    .map_err(|e| typed(e.path().to_string(), e.into_inner().to_string()))?;
            cfg.validate()
                .map_err(|e| Invalid::new(at("typed_config"), e.to_string()))?;
            Ok(super::CustomConfig::Consul(cfg))
        }
        super::DNS_SRV_CLUSTER => {
            let cfg: super::DnsSrvConfig =
                serde_path_to_error::deserialize(&custom.typed_config)
                    .map_err(|e| typed(e.path().to_string(), e.into_inner().to_string()))?;
            if cfg.service_names.is_empty() {
                return Err(Invalid::new(
                    at("typed_config.service_names"),
                    "must not be empty",
                ));
            }
            validate_dns(i, cluster)?;
            Ok(super::CustomConfig::DnsSrv(cfg))
        }
        other => Err(Invalid::new(
            at("name"),
            format!(
                "unknown cluster type {other:?}; this build has proxy.clusters.consul and proxy.clusters.dns_srv"
            ),
        )),
    }
}

/// DNS settings, and Envoy's shape rules for DNS clusters.
fn validate_dns(i: usize, cluster: &super::Cluster) -> Result<(), Invalid> {
    use super::sources::dns::DnsConfigError;
    let at = |field: &str| format!("clusters[{i}].{field}");
    if let Err(err) = cluster.dns_settings().validate() {
        let field = match &err {
            DnsConfigError::IntervalTooSmall { field, .. } => (*field).to_owned(),
            DnsConfigError::EmptyName { field } => field.clone(),
            DnsConfigError::MaxBelowBase { .. } => "dns_failure_refresh_rate".to_owned(),
            DnsConfigError::BadResolver { .. } => "dns_resolvers".to_owned(),
            DnsConfigError::StaleBoundZero => "dns_stale_bound".to_owned(),
            DnsConfigError::LogicalNotSingleHost { .. } => "load_assignment".to_owned(),
        };
        return Err(Invalid::new(at(&field), err.to_string()));
    }
    let endpoints = cluster.dns_endpoints();
    if cluster.cluster_type == ClusterType::LogicalDns && endpoints.len() != 1 {
        return Err(Invalid::new(
            at("load_assignment"),
            "LOGICAL_DNS clusters must have a single locality_lb_endpoint and a single lb_endpoint",
        ));
    }
    Ok(())
}

fn validate_services(config: &Config) -> Result<(), Invalid> {
    let mut names = HashSet::new();
    let mut addrs = HashSet::new();
    for (i, svc) in config.services.iter().enumerate() {
        let at = |field: &str| format!("services[{i}].{field}");
        if !names.insert(svc.name.as_str()) {
            return Err(Invalid::new(
                at("name"),
                format!("duplicate service name {:?}", svc.name),
            ));
        }
        // An IPv4-mapped VIP is its IPv4 address in the kernel.
        let address = super::host_guard::canonical_ip(svc.address);
        if !addrs.insert((address, svc.port, svc.protocol)) {
            return Err(Invalid::new(
                at("address"),
                format!(
                    "{}:{} {:?} is already a service",
                    svc.address, svc.port, svc.protocol
                ),
            ));
        }
        if svc.port == 0 {
            return Err(Invalid::new(at("port"), "must not be 0"));
        }
        svc.validate_upgrades(i)?;
        if let Some(why) = not_a_service_address(svc.address) {
            return Err(Invalid::new(
                at("address"),
                format!("{} is {why}: not a service address", svc.address),
            ));
        }
        match (&svc.chain, svc.cluster.is_empty()) {
            (Some(_), false) | (None, true) => {
                return Err(Invalid::new(
                    at("cluster"),
                    "set exactly one of `cluster` and `chain`",
                ));
            }
            (Some(_), true) => {}
            (None, false) if config.cluster(&svc.cluster).is_none() => {
                return Err(Invalid::new(
                    at("cluster"),
                    format!("no cluster named {:?}", svc.cluster),
                ));
            }
            (None, false) => {}
        }
        let original_dst = config.cluster(&svc.cluster).is_some_and(|c| {
            c.cluster_type == ClusterType::OriginalDst && c.custom_cluster_type.is_none()
        });
        match svc.mode {
            ServiceMode::Proxy if svc.protocol == super::Protocol::Udp => {
                return Err(Invalid::new(
                    at("mode"),
                    "the proxy path serves TCP; UDP services use mode: direct",
                ));
            }
            ServiceMode::Direct if original_dst => {
                return Err(Invalid::new(
                    at("mode"),
                    "an ORIGINAL_DST cluster serves connections through the proxy path; set mode: proxy",
                ));
            }
            _ => {}
        }
        svc.validate_connect_attempts(&at("max_connect_attempts"), original_dst)?;
        svc.validate_hash_policy(i)?;
        svc.validate_hash_key(&at("hash_key"), config.cluster(&svc.cluster))?;
        svc.validate_chain_options(&at("chain_options"))?;
    }
    if let Some(name) = &config.proxy.fallback_cluster
        && config.cluster(name).is_none()
    {
        return Err(Invalid::new(
            "proxy.fallback_cluster",
            format!("no cluster named {name:?}"),
        ));
    }
    if config.proxy.proxy_protocol != super::proxy::ProxyProtocolMode::Off
        && config.proxy.proxy_protocol_trusted_sources.is_empty()
    {
        return Err(Invalid::new(
            "proxy.proxy_protocol",
            "needs proxy.proxy_protocol_trusted_sources: a PROXY header names where the daemon connects, so list the load balancers whose headers are believed (addresses or CIDRs); any other peer, local processes included, could make it connect anywhere",
        ));
    }
    config.proxy.validate_unread()?;
    let proxied = config.services.iter().any(|s| s.mode == ServiceMode::Proxy)
        || config.proxy.fallback_cluster.is_some();
    if proxied && config.proxy.listeners.is_empty() {
        return Err(Invalid::new(
            "proxy.listeners",
            "services use the proxy path; give it a listener address",
        ));
    }
    validate_original_dst_agree(config)
}

/// Why `ip` cannot be a service address (a connect to it is never a service's), if it cannot:
/// the unspecified, broadcast, multicast and link-local ranges (the last holds cloud metadata
/// services, which a VIP must not shadow).
fn not_a_service_address(ip: IpAddr) -> Option<&'static str> {
    if ip.is_unspecified() {
        return Some("the unspecified address");
    }
    if ip.is_multicast() {
        return Some("a multicast address");
    }
    match ip {
        IpAddr::V4(v4) if v4.is_broadcast() => Some("the broadcast address"),
        IpAddr::V4(v4) if v4.is_link_local() => {
            Some("link-local (169.254.0.0/16, where cloud metadata services answer)")
        }
        IpAddr::V6(v6) if v6.is_unicast_link_local() => Some("link-local (fe80::/10)"),
        IpAddr::V6(v6) => v6
            .to_ipv4_mapped()
            .and_then(|v4| not_a_service_address(v4.into())),
        IpAddr::V4(_) => None,
    }
}
