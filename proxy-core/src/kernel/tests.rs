//! The kernel form: flags from the clusters' policies and the mode, sockops only where
//! something needs it, levels from the routing, the refused share and the panic flag.

use std::path::Path;

use proxy_common::service::SERVICE_HASH_KEY_MASK;

use super::*;
use crate::{health::HostClass, host::Host};

const ENDPOINT: &str = "    load_assignment: { endpoints: [ { lb_endpoints: [ { endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: 1 } } } } ] } ] }\n";

#[test]
fn kernel_flags_follow_the_clusters() {
    let yaml = format!(
        "clusters:\n  - name: plain\n{ENDPOINT}  - name: watched\n    outlier_detection: {{ consecutive_5xx: 3 }}\n{ENDPOINT}  - name: hashed\n    lb_policy: MAGLEV\n{ENDPOINT}  - name: rotated\n    lb_policy: ROUND_ROBIN\n{ENDPOINT}services:\n  - {{ name: a, address: 127.77.0.1, port: 80, cluster: plain }}\n  - {{ name: b, address: 127.77.0.2, port: 80, cluster: watched }}\n  - {{ name: c, address: 127.77.0.3, port: 80, cluster: hashed }}\n  - {{ name: d, address: 127.77.0.4, port: 80, cluster: watched, mode: proxy }}\n  - {{ name: e, address: 127.77.0.5, port: 80, cluster: rotated }}\n  - {{ name: f, address: 127.77.0.6, port: 80, cluster: rotated, mode: proxy }}\n"
    );
    let config = Config::parse(&yaml, Path::new("t.yaml")).expect("valid config");
    let templates = ServiceTemplate::all(&config);
    let flags: Vec<u32> = templates.iter().map(|t| t.flags).collect();
    assert_eq!(
        flags,
        [
            0,
            SERVICE_F_PASSIVE,
            SERVICE_F_MAGLEV | (HASH_KEY_PROCESS << SERVICE_HASH_KEY_SHIFT),
            // While no proxy listens, the kernel connects to its hosts.
            SERVICE_F_PASSIVE | SERVICE_F_PROXY | SERVICE_F_NO_PROXY_HOSTS,
            SERVICE_F_ROUND_ROBIN,
            // The proxy rotates a proxy-mode service's hosts itself.
            SERVICE_F_PROXY | SERVICE_F_NO_PROXY_HOSTS,
        ]
    );
    assert!(templates[4].rotates() && !templates[5].rotates());
    assert_eq!(
        templates[0].key,
        ServiceKey::new("127.77.0.1".parse().unwrap(), 80, PROTO_TCP)
    );
}

#[test]
fn sockops_is_attached_only_where_something_needs_it() {
    let clusters = format!(
        "clusters:\n  - name: plain\n{ENDPOINT}  - name: watched\n    outlier_detection: {{ consecutive_5xx: 3 }}\n{ENDPOINT}"
    );
    let needs = |extra: &str, services: &str| {
        let yaml = format!("{extra}{clusters}services:\n{services}");
        let config = Config::parse(&yaml, Path::new("t.yaml")).expect("valid config");
        needs_sockops(&config, &ServiceTemplate::all(&config))
    };
    let plain = "  - { name: a, address: 127.77.0.1, port: 80, cluster: plain }\n";
    assert!(!needs("", plain), "plain kernel-path services only");
    assert!(needs("splice: true\n", plain), "splicing");
    let watched = "  - { name: b, address: 127.77.0.2, port: 80, cluster: watched }\n";
    assert!(needs("", &format!("{plain}{watched}")), "outlier detection");
    let proxied = "  - { name: c, address: 127.77.0.3, port: 80, cluster: plain, mode: proxy }\n";
    let listener = "proxy: { listeners: [\"127.0.0.1:15001\"] }\n";
    assert!(needs(listener, &format!("{plain}{proxied}")), "proxy mode");
}

/// The kernel limits a service only where its one cluster sets `max_connections` explicitly in
/// its `DEFAULT` thresholds (0 too: every connect refused, as in Envoy), on the kernel path
/// over TCP; Envoy's implicit 1024 is not applied there.
#[test]
fn max_connections_reaches_the_kernel_only_where_set_explicitly() {
    let cb = |t: &str| format!("    circuit_breakers: {{ thresholds: [ {t} ] }}\n{ENDPOINT}");
    let yaml = format!(
        "clusters:\n  - name: plain\n{ENDPOINT}  - name: pending\n{}  - name: two\n{}  - name: high\n{}  - name: zero\n{}services:\n  - {{ name: a, address: 127.77.0.1, port: 80, cluster: plain }}\n  - {{ name: b, address: 127.77.0.2, port: 80, cluster: pending }}\n  - {{ name: c, address: 127.77.0.3, port: 80, cluster: two }}\n  - {{ name: d, address: 127.77.0.4, port: 80, cluster: two, mode: proxy }}\n  - {{ name: e, address: 127.77.0.5, port: 80, cluster: two, protocol: UDP }}\n  - {{ name: f, address: 127.77.0.6, port: 80, cluster: high }}\n  - {{ name: g, address: 127.77.0.7, port: 80, cluster: zero }}\n",
        cb("{ max_pending_requests: 1 }"),
        cb("{ max_connections: 2 }"),
        cb("{ priority: HIGH, max_connections: 1 }"),
        cb("{ max_connections: 0 }"),
    );
    let config = Config::parse(&yaml, Path::new("t.yaml")).expect("valid config");
    let templates = ServiceTemplate::all(&config);
    let limits: Vec<_> = templates.iter().map(|t| t.max_connections).collect();
    assert_eq!(limits, [None, None, Some(2), None, None, None, Some(0)]);
    for t in &templates {
        let flagged = t.flags & SERVICE_F_CX_LIMIT != 0;
        assert_eq!(flagged, t.max_connections.is_some(), "{}", t.name);
    }
    assert!(
        templates[2].follows_sockets(),
        "sockops counts the connections"
    );
    assert!(!templates[0].follows_sockets());
    assert!(needs_sockops(&config, &templates));
    let spec = templates[2].spec(&[]);
    assert_eq!(spec.max_connections, Some(2), "the spec carries the limit");
}

/// The kernel drops a share of a service's connects where it serves the service's one cluster
/// directly over TCP, from the routing's `drop_overloads`; the flag comes and goes with it.
#[test]
fn the_drop_overload_reaches_the_kernel_from_the_routing() {
    use crate::health::drop_overload::{Denominator, DropOverload};
    let yaml = format!(
        "proxy: {{ listeners: [\"127.0.0.1:15001\"] }}\nclusters:\n  - name: web\n{ENDPOINT}services:\n  - {{ name: a, address: 127.77.0.1, port: 80, cluster: web }}\n  - {{ name: b, address: 127.77.0.2, port: 80, cluster: web, mode: proxy }}\n  - {{ name: c, address: 127.77.0.3, port: 80, cluster: web, protocol: UDP }}\n"
    );
    let config = Config::parse(&yaml, Path::new("t.yaml")).expect("valid config");
    let templates = ServiceTemplate::all(&config);
    let mut routing = Routing::compute(&[(host(1), HostClass::Healthy)], 50.0);
    routing.drop_overload = DropOverload::new(25, Denominator::TenThousand).unwrap();
    let specs: Vec<(u32, bool)> = templates
        .iter()
        .map(|t| t.spec(&[("web", &routing)]))
        .map(|s| (s.drop_overload, s.flags & SERVICE_F_DROP != 0))
        .collect();
    assert_eq!(specs, [(2_500, true), (0, false), (0, false)]);
    let none = templates[0].spec(&[(
        "web",
        &Routing::compute(&[(host(1), HostClass::Healthy)], 50.0),
    )]);
    assert_eq!((none.drop_overload, none.flags & SERVICE_F_DROP), (0, 0));
}

fn host(last: u8) -> Host {
    Host::new(SocketAddr::from(([127, 0, 0, last], 80)))
}

#[test]
fn the_spec_carries_the_routing_its_refusals_and_the_panic_flag() {
    let yaml = format!(
        "clusters:\n  - name: web\n{ENDPOINT}  - name: backup\n{ENDPOINT}config_entries:\n  - {{Kind: service-resolver, Name: web, Failover: {{'*': {{Service: backup}}}}}}\nservices:\n  - {{ name: plain, address: 127.77.0.1, port: 80, cluster: web }}\n  - {{ name: chained, address: 127.77.0.2, port: 80, chain: web }}\n  - {{ name: six, address: '::ffff:127.77.0.3', port: 80, cluster: web }}\n"
    );
    let config = Config::parse(&yaml, Path::new("t.yaml")).expect("valid config");
    let templates = ServiceTemplate::all(&config);
    let web = Routing::compute(
        &[(host(1), HostClass::Healthy), (host(2), HostClass::Healthy)],
        50.0,
    );
    let backup = Routing::compute(&[(host(9), HostClass::Healthy)], 50.0);

    let plain = templates[0].spec(&[("web", &web)]);
    assert_eq!(plain.name, "plain");
    assert_eq!(plain.priorities, lb::kernel_levels(&web));
    assert_eq!(plain.flags & SERVICE_F_PANIC, 0);

    // A chain: the web level, then the failover's.
    let chained = templates[1].spec(&[("backup", &backup), ("web", &web)]);
    let levels: Vec<Vec<SocketAddr>> = chained
        .priorities
        .iter()
        .map(|l| l.iter().map(|(a, _)| *a).collect())
        .collect();
    assert_eq!(levels[0].len(), 2, "{levels:?}");
    assert_eq!(levels[1], [host(9).addr], "{levels:?}");

    // Every host failed: panic routes to all of them, and the kernel is told.
    let failed = Routing::compute(
        &[
            (host(1), HostClass::Unhealthy),
            (host(2), HostClass::Unhealthy),
        ],
        50.0,
    );
    let panicking = templates[0].spec(&[("web", &failed)]);
    assert_ne!(panicking.flags & SERVICE_F_PANIC, 0);

    // No cluster running: nothing routable, nothing invented.
    assert!(templates[2].spec(&[]).priorities.is_empty());
}

/// A cluster with hosts of both families behind a v4 and a v6 service: each service gets only
/// its own family's hosts (a priority level left empty goes), a proxy-mode one too: the kernel
/// connects to them only while no proxy listens (the proxy reads the cluster itself and
/// connects across families).
#[test]
fn a_service_keeps_only_hosts_of_its_family() {
    let yaml = format!(
        "proxy: {{ listeners: [\"127.0.0.1:15001\"] }}\nclusters:\n  - name: dual\n{ENDPOINT}services:\n  - {{ name: four, address: 127.77.0.1, port: 80, cluster: dual }}\n  - {{ name: six, address: 'fd77::1', port: 80, cluster: dual }}\n  - {{ name: proxied, address: 'fd77::2', port: 80, cluster: dual, mode: proxy }}\n"
    );
    let config = Config::parse(&yaml, Path::new("t.yaml")).expect("valid config");
    let templates = ServiceTemplate::all(&config);
    let (v4, v6) = (host(1), Host::new("[fd00::1]:80".parse().unwrap()));
    let v6_backup = Host {
        priority: 1,
        ..Host::new("[fd00::2]:80".parse().unwrap())
    };
    let dual = Routing::compute(
        &[
            (v4.clone(), HostClass::Healthy),
            (v6.clone(), HostClass::Healthy),
            (v6_backup.clone(), HostClass::Healthy),
        ],
        50.0,
    );
    let addrs = |spec: &ServiceSpec| -> Vec<Vec<SocketAddr>> {
        spec.priorities
            .iter()
            .map(|l| l.iter().map(|(a, _)| *a).collect())
            .collect()
    };
    let four = templates[0].spec(&[("dual", &dual)]);
    assert_eq!(addrs(&four), [vec![v4.addr]]);
    let six = templates[1].spec(&[("dual", &dual)]);
    assert_eq!(addrs(&six), [vec![v6.addr], vec![v6_backup.addr]]);
    let proxied = templates[2].spec(&[("dual", &dual)]);
    assert_eq!(addrs(&proxied), [vec![v6.addr], vec![v6_backup.addr]]);

    // Only hosts of the other family: no host at all (the kernel refuses the connect).
    let only_v4 = Routing::compute(&[(v4, HostClass::Healthy)], 50.0);
    assert!(
        templates[1]
            .spec(&[("dual", &only_v4)])
            .priorities
            .is_empty()
    );
}

/// An IPv4-mapped VIP is the IPv4 service (the kernel keys a dual-stack socket's mapped
/// destination so): its key is IPv4, it keeps the IPv4 hosts, its refusals go to 0.0.0.0; and
/// the same VIP spelled both ways is one service twice, refused.
#[test]
fn an_ipv4_mapped_vip_is_the_ipv4_service() {
    let yaml = format!(
        "clusters:\n  - name: dual\n{ENDPOINT}services:\n  - {{ name: m, address: '::ffff:127.77.0.3', port: 80, cluster: dual }}\n"
    );
    let config = Config::parse(&yaml, Path::new("t.yaml")).expect("valid config");
    let template = &ServiceTemplate::all(&config)[0];
    assert_eq!(
        template.key,
        ServiceKey::new("127.77.0.3".parse().unwrap(), 80, PROTO_TCP)
    );
    assert_eq!(template.refuse, "0.0.0.0:0".parse().unwrap());
    let v6 = Host::new("[fd00::1]:80".parse().unwrap());
    let dual = Routing::compute(
        &[(host(1), HostClass::Healthy), (v6, HostClass::Healthy)],
        50.0,
    );
    let levels = template.spec(&[("dual", &dual)]).priorities;
    assert_eq!(levels.len(), 1);
    assert_eq!(
        levels[0].iter().map(|(a, _)| *a).collect::<Vec<_>>(),
        [host(1).addr]
    );

    let twice = format!("{yaml}  - {{ name: n, address: 127.77.0.3, port: 80, cluster: dual }}\n");
    let err = Config::parse(&twice, Path::new("t.yaml")).expect_err("one VIP twice");
    assert!(err.to_string().contains("is already a service"), "{err}");
}

#[test]
fn consistent_hashing_keys_on_the_process_unless_the_service_says_otherwise() {
    let yaml = format!(
        "clusters:\n  - name: hashed\n    lb_policy: MAGLEV\n{ENDPOINT}services:\n  - {{ name: a, address: 127.77.0.1, port: 80, cluster: hashed }}\n  - {{ name: b, address: 127.77.0.2, port: 80, cluster: hashed, hash_key: netns }}\n  - {{ name: c, address: 127.77.0.3, port: 80, cluster: hashed, hash_key: cgroup }}\n  - {{ name: d, address: 127.77.0.4, port: 80, cluster: hashed, hash_key: process }}\n  - {{ name: e, address: 127.77.0.5, port: 80, cluster: hashed, hash_key: user }}\n  - {{ name: f, address: 127.77.0.6, port: 80, cluster: hashed, hash_key: socket, protocol: UDP }}\n"
    );
    let config = Config::parse(&yaml, Path::new("t.yaml")).expect("valid config");
    let templates = ServiceTemplate::all(&config);
    let keys: Vec<Option<u32>> = templates.iter().map(ServiceTemplate::hash_key).collect();
    assert_eq!(
        keys,
        [
            HASH_KEY_PROCESS,
            HASH_KEY_NETNS,
            HASH_KEY_CGROUP,
            HASH_KEY_PROCESS,
            HASH_KEY_USER,
            HASH_KEY_SOCKET
        ]
        .map(Some)
    );
    assert_eq!(
        templates[4].flags,
        SERVICE_F_MAGLEV | (HASH_KEY_USER << SERVICE_HASH_KEY_SHIFT)
    );
    // The key is part of the published entry, whatever the hosts.
    let spec = templates[2].spec(&[]);
    assert_eq!(hash_key_of(spec.flags), HASH_KEY_CGROUP);
}

#[test]
fn a_service_that_does_not_hash_carries_no_key() {
    let yaml = format!(
        "clusters:\n  - name: plain\n{ENDPOINT}services:\n  - {{ name: a, address: 127.77.0.1, port: 80, cluster: plain }}\n"
    );
    let config = Config::parse(&yaml, Path::new("t.yaml")).expect("valid config");
    let templates = ServiceTemplate::all(&config);
    assert_eq!(templates[0].hash_key(), None);
    assert_eq!(templates[0].flags & SERVICE_HASH_KEY_MASK, 0);
}

#[test]
fn a_resolvers_load_balancer_chooses_over_the_clusters_lb_policy() {
    let yaml = format!(
        "clusters:\n  - name: rotated\n{ENDPOINT}  - name: ring\n{ENDPOINT}  - name: random\n    lb_policy: MAGLEV\n{ENDPOINT}  - name: least\n{ENDPOINT}  - name: unset\n    lb_policy: MAGLEV\n{ENDPOINT}config_entries:\n  - {{Kind: service-resolver, Name: rotated, LoadBalancer: {{Policy: round_robin}}}}\n  - {{Kind: service-resolver, Name: ring, LoadBalancer: {{Policy: ring_hash, RingHashConfig: {{MinimumRingSize: 1024}}}}}}\n  - {{Kind: service-resolver, Name: random, LoadBalancer: {{Policy: random}}}}\n  - {{Kind: service-resolver, Name: least, LoadBalancer: {{Policy: least_request}}}}\nservices:\n  - {{ name: rotated, address: 127.77.0.1, port: 80, chain: rotated }}\n  - {{ name: ring, address: 127.77.0.2, port: 80, chain: ring, hash_key: socket }}\n  - {{ name: random, address: 127.77.0.3, port: 80, chain: random }}\n  - {{ name: least, address: 127.77.0.4, port: 80, chain: least }}\n  - {{ name: unset, address: 127.77.0.5, port: 80, chain: unset }}\n"
    );
    let config = Config::parse(&yaml, Path::new("t.yaml")).expect("valid config");
    let flags: Vec<u32> = ServiceTemplate::all(&config)
        .iter()
        .map(|t| t.flags)
        .collect();
    let process = HASH_KEY_PROCESS << SERVICE_HASH_KEY_SHIFT;
    assert_eq!(
        flags,
        [
            SERVICE_F_ROUND_ROBIN,
            // RING_HASH is served by the Maglev table.
            SERVICE_F_MAGLEV | (HASH_KEY_SOCKET << SERVICE_HASH_KEY_SHIFT),
            // The resolver's random wins over the cluster's MAGLEV.
            0,
            SERVICE_F_LEAST_REQUEST,
            // No LoadBalancer: the cluster's policy.
            SERVICE_F_MAGLEV | process,
        ]
    );
}

/// While no proxy listens (a restart's gap), the kernel serves a proxy-mode service the proxy
/// serves per connection: a cluster's service from its hosts (published for it), a plain
/// ORIGINAL_DST one to the address dialled. One the proxy routes per HTTP request (a chain, or
/// ORIGINAL_DST by `use_http_header`) gets neither flag and no hosts: the kernel refuses it.
#[test]
fn a_proxy_mode_service_says_what_the_kernel_does_while_no_proxy_listens() {
    let yaml = format!(
        "proxy: {{ listeners: [\"127.0.0.1:15001\"] }}\nclusters:\n  - name: web\n{ENDPOINT}  - name: api\n{ENDPOINT}  - {{ name: od, type: ORIGINAL_DST, lb_policy: CLUSTER_PROVIDED }}\nconfig_entries:\n  - {{ Kind: service-defaults, Name: web, Protocol: http }}\n  - {{ Kind: service-defaults, Name: api, Protocol: http }}\n  - {{ Kind: service-router, Name: web, Routes: [ {{ Match: {{ HTTP: {{ PathPrefix: /api }} }}, Destination: {{ Service: api }} }} ] }}\nservices:\n  - {{ name: direct, address: 127.77.0.1, port: 80, cluster: web }}\n  - {{ name: tcp, address: 127.77.0.2, port: 80, cluster: web, mode: proxy }}\n  - {{ name: od, address: 127.77.0.3, port: 80, cluster: od, mode: proxy }}\n  - {{ name: routed, address: 127.77.0.4, port: 80, chain: web, mode: proxy }}\n"
    );
    let config = Config::parse(&yaml, Path::new("t.yaml")).expect("valid config");
    let templates = ServiceTemplate::all(&config);
    let fallback = SERVICE_F_NO_PROXY_HOSTS | SERVICE_F_NO_PROXY_DIALLED;
    let flags: Vec<u32> = templates.iter().map(|t| t.flags & fallback).collect();
    assert_eq!(
        flags,
        [0, SERVICE_F_NO_PROXY_HOSTS, SERVICE_F_NO_PROXY_DIALLED, 0]
    );
    let reads: Vec<bool> = templates.iter().map(ServiceTemplate::reads_hosts).collect();
    assert_eq!(reads, [true, true, false, false]);
    let web = Routing::compute(&[(host(1), HostClass::Healthy)], 50.0);
    assert_eq!(
        templates[1].spec(&[("web", &web)]).priorities,
        lb::kernel_levels(&web),
        "the proxy-mode TCP service carries its hosts"
    );
    assert!(
        templates[3].spec(&[("web", &web)]).priorities.is_empty(),
        "the HTTP-routed one none"
    );

    let by_header = yaml.replace(
        "lb_policy: CLUSTER_PROVIDED",
        "lb_policy: CLUSTER_PROVIDED, original_dst_lb_config: { use_http_header: true }",
    );
    let config = Config::parse(&by_header, Path::new("t.yaml")).expect("valid config");
    assert_eq!(ServiceTemplate::all(&config)[2].flags & fallback, 0);
}

/// `close_connections_on_host_health_failure` (the cluster's, else `proxy.`'s) flags a
/// direct-mode service for host ending; off by default, and never for a proxy-mode one (the
/// proxy closes its own connections).
#[test]
fn host_ending_follows_the_clusters_option() {
    let yaml = |proxy: &str| {
        format!(
            "proxy: {{ listeners: [\"127.0.0.1:15001\"]{proxy} }}\nclusters:\n  - name: plain\n{ENDPOINT}  - name: on\n    close_connections_on_host_health_failure: true\n{ENDPOINT}  - name: off\n    close_connections_on_host_health_failure: false\n{ENDPOINT}services:\n  - {{ name: a, address: 127.77.0.1, port: 80, cluster: plain }}\n  - {{ name: b, address: 127.77.0.2, port: 80, cluster: on }}\n  - {{ name: c, address: 127.77.0.3, port: 80, cluster: on, mode: proxy }}\n  - {{ name: d, address: 127.77.0.4, port: 80, cluster: off }}\n  - {{ name: e, address: 127.77.0.5, port: 80, cluster: on, protocol: UDP }}\n"
        )
    };
    let ends = |proxy: &str| {
        let config = Config::parse(&yaml(proxy), Path::new("t.yaml")).expect("valid config");
        ServiceTemplate::all(&config)
            .iter()
            .map(|t| {
                assert_eq!(t.ends_hosts(), t.flags & SERVICE_F_END != 0, "{}", t.name);
                t.ends_hosts()
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(ends(""), [false, true, false, false, true]);
    let default_on = ", close_connections_on_host_health_failure: true";
    assert_eq!(ends(default_on), [true, true, false, false, true]);
}

/// A host that leaves the routable set while its cluster still has it (failed) is ended now;
/// one discovery removed, later; one still routable, a host of a cluster without the option
/// and the refusal address never.
#[test]
fn leavers_split_failed_from_removed() {
    let yaml = format!(
        "clusters:\n  - name: on\n    close_connections_on_host_health_failure: true\n{ENDPOINT}services:\n  - {{ name: a, address: 127.77.0.1, port: 80, cluster: on }}\n"
    );
    let config = Config::parse(&yaml, Path::new("t.yaml")).expect("valid config");
    let t = &ServiceTemplate::all(&config)[0];
    let healthy = |h: u8| (host(h), HostClass::Healthy);
    let before = Routing::compute(&[healthy(1), healthy(2), healthy(3), healthy(4)], 50.0);
    // 2 failed (still discovered), 3 removed, 1 and 4 stay.
    let after = Routing::compute(
        &[healthy(1), (host(2), HostClass::Unhealthy), healthy(4)],
        50.0,
    );
    let (b, a) = ([("on", &before)], [("on", &after)]);
    let leavers = t.leavers(&t.spec(&b), &t.spec(&a), &b, &a);
    assert_eq!(leavers.now, [host(2).addr]);
    assert_eq!(leavers.later, [host(3).addr]);
    // The same change in a cluster the service reads without the option: nothing.
    let (b, a) = ([("other", &before)], [("other", &after)]);
    let none = t.leavers(&t.spec(&b), &t.spec(&a), &b, &a);
    assert_eq!(none, ending::Leavers::default());
    // Nothing left: nothing ended.
    let (b, a) = ([("on", &before)], [("on", &before)]);
    assert_eq!(
        t.leavers(&t.spec(&b), &t.spec(&a), &b, &a),
        ending::Leavers::default()
    );
}
