//! IPv6 end to end against real peers (root): the real daemon and kernel, with IPv6 VIPs
//! (`fd77::/16`) and IPv6 hosts (`fd00::/16`) on the loopback of each test's own namespace.
//!
//! AAAA answers from unbound, asked over IPv6, under each `dns_lookup_family` (STRICT_DNS and
//! LOGICAL_DNS, records changed live), EDS with IPv6 endpoints from the real xDS server, the
//! Consul catalog with IPv6 service addresses, TCP and HTTP health checks over IPv6 taking a host
//! out and back, the proxy path on an IPv6 VIP (TCP, HTTP routes, ORIGINAL_DST, PROXY protocol
//! headers naming IPv6 addresses), and dual-stack clusters whose IPv4 VIP reaches only their IPv4
//! hosts and whose IPv6 VIP only their IPv6 hosts.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    sync::atomic::{AtomicBool, Ordering},
    time::{Duration, Instant},
};

use integration_tests::{
    consul::{Consul, service},
    features::refused_errno,
    http_servers::{Servers, get_in_cgroup, http_server},
    kernel::{BannerServers, Daemon, Netns, Probe, TestCgroup, require_root, unique},
    unbound::Unbound,
    xds_server::XdsServer,
};
use serde_json::{Value, json};

/// Bound of every wait for connects to follow a change.
const WITHIN: Duration = Duration::from_secs(20);

/// The instance, cgroup and admin lines of a config.
fn header(cgroup: &TestCgroup) -> String {
    format!(
        "instance: {}\ncgroup: {}\nadmin:\n  address: \"{{admin}}\"\n",
        unique("v6"),
        cgroup.path().display()
    )
}

/// One `lb_endpoints` entry for `addr` (a host, or a DNS name with `port`).
fn endpoint(address: &str, port: u16) -> String {
    format!(
        "            - endpoint: {{ address: {{ socket_address: {{ address: \"{address}\", port_value: {port} }} }} }}\n"
    )
}

/// A cluster `name` with `extra` fields (indented four spaces) and `endpoints`.
fn cluster(name: &str, extra: &str, endpoints: &str) -> String {
    format!(
        "  - name: {name}\n{extra}    load_assignment:\n      endpoints:\n        - lb_endpoints:\n{endpoints}"
    )
}

/// A STATIC cluster of `hosts`.
fn static_cluster(name: &str, extra: &str, hosts: &[&str]) -> String {
    let endpoints: String = hosts
        .iter()
        .map(|h| {
            let h: SocketAddr = h.parse().expect("host address");
            endpoint(&h.ip().to_string(), h.port())
        })
        .collect();
    cluster(name, extra, &endpoints)
}

/// A service line: `name` on `vip` reading cluster `cluster`, with `extra` flow fields.
fn service_line(name: &str, vip: &str, cluster: &str, extra: &str) -> String {
    let vip: SocketAddr = vip.parse().expect("VIP");
    format!(
        "  - {{ name: {name}, address: \"{}\", port: {}, cluster: {cluster}{extra} }}\n",
        vip.ip(),
        vip.port()
    )
}

/// Adds each IPv6 host's address to the namespace's loopback (once) and starts a banner server
/// per host whose banner is the host's address.
fn banner_hosts(netns: &Netns, hosts: &[&str]) -> BannerServers {
    add_v6_addrs(netns, hosts);
    let servers: Vec<(SocketAddr, &str, bool)> = hosts
        .iter()
        .map(|h| (h.parse().expect("host address"), *h, false))
        .collect();
    BannerServers::start(netns, &servers)
}

/// Adds the IPv6 addresses of `hosts` to the namespace's loopback, each once.
fn add_v6_addrs(netns: &Netns, hosts: &[&str]) {
    let mut added = Vec::new();
    for h in hosts {
        let ip = h.parse::<SocketAddr>().expect("host address").ip();
        if ip.is_ipv6() && !ip.is_loopback() && !added.contains(&ip) {
            netns.add_lo_addr(&format!("{ip}/128"));
            added.push(ip);
        }
    }
}

/// Probes `vip` from the cgroup until every connect succeeds and exactly the banners `want`
/// answer (given in any order); panics after [`WITHIN`].
fn wait(netns: &Netns, cgroup: &TestCgroup, vip: &str, want: &[&str]) {
    let mut want = want.to_vec();
    want.sort_unstable();
    let vip = vip.parse().expect("VIP");
    integration_tests::kernel::wait_for_backends(netns, cgroup, vip, &want, WITHIN);
}

/// `n` connects to `vip` from the cgroup: every one answered, by `want` only, each of them
/// reached, and getpeername showing the VIP.
fn assert_only(netns: &Netns, cgroup: &TestCgroup, vip: &str, want: &[&str], n: u32) {
    let probe = Probe::run(netns, Some(cgroup.path()), vip.parse().unwrap(), n, false);
    assert!(probe.errors.is_empty(), "{vip}: {probe:?}");
    let reached: u32 = want.iter().map(|w| probe.count(w)).sum();
    assert_eq!(reached, n, "{vip} reached only {want:?}: {probe:?}");
    assert!(
        want.iter().all(|w| probe.count(w) > 0),
        "{vip}: each of {want:?} reached: {probe:?}"
    );
    assert_eq!(probe.peers, [vip.to_owned()], "{vip}: getpeername");
}

/// STRICT_DNS and LOGICAL_DNS on AAAA answers from unbound (asked over IPv6), under each lookup
/// family: V6_ONLY takes the AAAA records; AUTO the AAAA records of a name that has both, the A
/// records of one without AAAA; V4_PREFERRED the other way round; ALL both families, each to the
/// VIP of its family; LOGICAL_DNS the first AAAA address. Records changed live move the
/// connects.
#[test]
fn aaaa_answers_follow_the_lookup_family() {
    require_root();
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let (six_a, six_b, both6) = ("[fd00::11]:8080", "[fd00::12]:8080", "[fd00::13]:8080");
    let (both4, four) = ("127.0.0.11:8080", "127.0.0.12:8080");
    let _servers = banner_hosts(&netns, &[six_a, six_b, both6, both4, four]);
    // Asked over IPv6: unbound on [::1] in the namespace, the daemon there too.
    let dns = Unbound::start_v6_in(
        &netns.path(),
        &[
            "six.svc.test. 5 IN AAAA fd00::11",
            "six.svc.test. 5 IN AAAA fd00::12",
            "both.svc.test. 5 IN A 127.0.0.11",
            "both.svc.test. 5 IN AAAA fd00::13",
            "four.svc.test. 5 IN A 127.0.0.12",
        ],
    );
    // cluster, type, family, name, VIPs
    let table = [
        "v6only STRICT_DNS V6_ONLY six [fd77::1]:80",
        "auto STRICT_DNS AUTO both [fd77::2]:80",
        "autofb STRICT_DNS AUTO four 127.77.0.3:80",
        "v4pref STRICT_DNS V4_PREFERRED both 127.77.0.4:80",
        "v4preffb STRICT_DNS V4_PREFERRED six [fd77::5]:80",
        "all STRICT_DNS ALL both 127.77.0.6:80 [fd77::6]:80",
        "logical LOGICAL_DNS V6_ONLY six [fd77::7]:80",
    ];
    let (mut clusters, mut services) = (String::new(), String::new());
    for row in table {
        let row: Vec<&str> = row.split_whitespace().collect();
        let [name, kind, family, host, vips @ ..] = &row[..] else {
            panic!("a table row has five fields or more: {row:?}")
        };
        let extra = format!(
            "    type: {kind}\n    dns_refresh_rate: 0.2s\n    dns_lookup_family: {family}\n    dns_resolvers: [\"{}\"]\n",
            dns.addr()
        );
        clusters += &cluster(name, &extra, &endpoint(&format!("{host}.svc.test"), 8080));
        for (i, vip) in vips.iter().enumerate() {
            services += &service_line(&format!("{name}{i}"), vip, name, "");
        }
    }
    let config = format!(
        "{}clusters:\n{clusters}services:\n{services}",
        header(&cgroup)
    );
    let daemon = Daemon::start_in(&netns, &config);
    let expect: [(&str, &[&str]); 8] = [
        ("[fd77::1]:80", &[six_a, six_b]),
        ("[fd77::2]:80", &[both6]),
        ("127.77.0.3:80", &[four]),
        ("127.77.0.4:80", &[both4]),
        ("[fd77::5]:80", &[six_a, six_b]),
        ("127.77.0.6:80", &[both4]),
        ("[fd77::6]:80", &[both6]),
        ("[fd77::7]:80", &[six_a]),
    ];
    for (vip, want) in expect {
        wait(&netns, &cgroup, vip, want);
        assert_only(&netns, &cgroup, vip, want, 100);
    }
    let (_, hosts) = daemon.get("/clusters").expect("admin /clusters");
    assert!(
        hosts.contains("v6only::[fd00::11]:8080::health_flags::healthy"),
        "{hosts}"
    );
    assert!(hosts.contains("all::127.0.0.11:8080::") && hosts.contains("all::[fd00::13]:8080::"));

    // The AAAA records change live: the strict cluster and the logical one follow.
    dns.replace("six.svc.test", &["six.svc.test. 5 IN AAAA fd00::12"]);
    wait(&netns, &cgroup, "[fd77::1]:80", &[six_b]);
    wait(&netns, &cgroup, "[fd77::7]:80", &[six_b]);
    assert_eq!(daemon.counter("connect_family_mismatch"), 0);
}

/// `{address, port}` endpoints for the xDS server, all healthy.
fn eds_endpoints(addrs: &[&str]) -> Value {
    addrs
        .iter()
        .map(|a| {
            let a: SocketAddr = a.parse().unwrap();
            json!({"address": a.ip().to_string(), "port": a.port(), "health": "HEALTHY", "weight": 1})
        })
        .collect()
}

/// EDS with IPv6 endpoint addresses from the real xDS server: each version moves the IPv6 VIP's
/// connects; a version with hosts of both families serves each VIP its own family's.
#[test]
fn eds_ipv6_endpoints_drive_the_kernel() {
    require_root();
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let (a, b, c, d) = (
        "[fd00::21]:8081",
        "[fd00::22]:8082",
        "[fd00::23]:8083",
        "127.0.0.24:8084",
    );
    let _servers = banner_hosts(&netns, &[a, b, c, d]);
    let server = XdsServer::start();
    server.push("web", "1", eds_endpoints(&[a, b]));
    let (vip6, vip4) = ("[fd77::1]:80", "127.77.0.1:80");
    let config = format!(
        "{}xds:\n  node: {{ id: {}, cluster: edge }}\n  ads_config: {{ api_type: GRPC, server_uri: \"{}\" }}\nclusters:\n  - name: web\n    type: EDS\n    eds_cluster_config: {{ eds_config: {{ ads: {{}} }} }}\nservices:\n{}{}",
        header(&cgroup),
        unique("node"),
        server.grpc_addr(),
        service_line("web6", vip6, "web", ""),
        service_line("web4", vip4, "web", ""),
    );
    let daemon = Daemon::start(&config);
    wait(&netns, &cgroup, vip6, &[a, b]);
    assert_only(&netns, &cgroup, vip6, &[a, b], 100);

    server.push("web", "2", eds_endpoints(&[c]));
    wait(&netns, &cgroup, vip6, &[c]);

    server.push("web", "3", eds_endpoints(&[c, d]));
    wait(&netns, &cgroup, vip4, &[d]);
    assert_only(&netns, &cgroup, vip4, &[d], 100);
    assert_only(&netns, &cgroup, vip6, &[c], 100);
    let (_, hosts) = daemon.get("/clusters").expect("admin /clusters");
    assert!(
        hosts.contains("web::[fd00::23]:8083::health_flags::healthy"),
        "{hosts}"
    );
    assert_eq!(daemon.counter("connect_family_mismatch"), 0);
}

/// The Consul catalog with IPv6 service addresses (a real Consul 1.8.7): both instances serve
/// the IPv6 VIP; a critical check takes one out, passing brings it back; a deregistration removes
/// it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consul_ipv6_service_addresses_move_connects() {
    require_root();
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let (a, b) = ("[fd00::31]:8080", "[fd00::32]:8080");
    let _servers = banner_hosts(&netns, &[a, b]);
    let consul = Consul::start("dc1").await;
    consul
        .register(service("web-1", "web", "fd00::31", 8080))
        .await;
    consul
        .register(service("web-2", "web", "fd00::32", 8080))
        .await;
    let vip = "[fd77::1]:80";
    let config = format!(
        "{}clusters:\n  - name: web\n    cluster_type:\n      name: proxy.clusters.consul\n      typed_config: {{ address: \"{}\", service: web, datacenter: dc1, wait: 1s }}\nservices:\n{}",
        header(&cgroup),
        consul.http_addr(),
        service_line("web", vip, "web", ""),
    );
    let daemon = tokio::task::block_in_place(|| Daemon::start(&config));
    let wait_for = |want: &[&str]| tokio::task::block_in_place(|| wait(&netns, &cgroup, vip, want));
    wait_for(&[a, b]);
    tokio::task::block_in_place(|| assert_only(&netns, &cgroup, vip, &[a, b], 100));

    consul.set_check("web-2-ttl", "fail").await;
    wait_for(&[a]);
    consul.set_check("web-2-ttl", "pass").await;
    wait_for(&[a, b]);
    consul.deregister("web-1").await;
    wait_for(&[b]);
    let (_, hosts) = tokio::task::block_in_place(|| daemon.get("/clusters")).expect("admin");
    assert!(hosts.contains("web::[fd00::32]:8080::"), "{hosts}");
    assert!(!hosts.contains("[fd00::31]"), "{hosts}");
}

/// Whether [`SICK_HOST`]'s health endpoint answers 503.
static SICK: AtomicBool = AtomicBool::new(false);
/// The HTTP-checked host that [`SICK`] makes fail its checks.
const SICK_HOST: &str = "hc-b";

/// Answers one HTTP request: `/healthz` with 200 (503 for [`SICK_HOST`] while [`SICK`]), any
/// other path with `<name> <path>`.
fn checked_http_server(mut conn: TcpStream, name: &str) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") && head.len() < 8192 {
        match conn.read(&mut byte) {
            Ok(1) => head.push(byte[0]),
            _ => break,
        }
    }
    let head = String::from_utf8_lossy(&head);
    let path = head.split_whitespace().nth(1).unwrap_or_default();
    let (status, body) = match path {
        "/healthz" if name == SICK_HOST && SICK.load(Ordering::SeqCst) => (503, String::new()),
        "/healthz" => (200, String::new()),
        _ => (200, format!("{name} {path}")),
    };
    let _ = write!(
        conn,
        "HTTP/1.1 {status} X\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
}

/// The host's health flags in `/clusters`.
fn flags(daemon: &Daemon, cluster: &str, host: &str) -> String {
    let (_, body) = daemon.get("/clusters").expect("admin /clusters");
    let prefix = format!("{cluster}::{host}::health_flags::");
    body.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .unwrap_or_else(|| panic!("no {prefix} in /clusters:\n{body}"))
        .to_owned()
}

/// GETs `/` through `vip` until the 20 answers come from exactly `want` (by name); panics after
/// [`WITHIN`].
fn wait_http(netns: &Netns, cgroup: &TestCgroup, vip: &str, want: &[&str]) {
    let deadline = Instant::now() + WITHIN;
    let mut want: Vec<String> = want.iter().map(|w| format!("{w} /")).collect();
    want.sort_unstable();
    loop {
        let mut seen = get_in_cgroup(vip.parse().unwrap(), netns, cgroup, &["/"; 20]);
        seen.sort_unstable();
        let answered = seen.iter().all(|s| want.contains(s));
        seen.dedup();
        if answered && seen == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{vip} never answered by only {want:?}: {seen:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Active TCP and HTTP health checks from the daemon to IPv6 hosts: a host that fails its checks
/// leaves the IPv6 VIP's connects, and comes back once it passes again. Outlier detection fed
/// by the kernel's passive signal ejects an IPv6 host that refuses connects.
#[test]
fn health_checks_over_ipv6_take_a_host_out_and_back() {
    require_root();
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let (t1, t2, h1, h2) = (
        "[fd00::41]:8080",
        "[fd00::42]:8080",
        "[fd00::43]:8080",
        "[fd00::44]:8080",
    );
    // Passive: nothing listens on `dead`, whose refused connects sockops reports.
    let (good, dead) = ("[fd00::45]:8080", "[fd00::46]:8080");
    let _t1 = banner_hosts(&netns, &[t1, good]);
    add_v6_addrs(&netns, &[t2, h1, h2, dead]);
    let t2_server = BannerServers::start(&netns, &[(t2.parse().unwrap(), t2, false)]);
    let _http = Servers::start(
        &netns,
        &[
            (h1.parse().unwrap(), "hc-a"),
            (h2.parse().unwrap(), SICK_HOST),
        ],
        checked_http_server,
    );
    // Checked fast whatever the traffic: `no_traffic_interval` as short as `interval`.
    let timing = "timeout: 0.2s, interval: 0.2s, no_traffic_interval: 0.2s, unhealthy_threshold: 1, healthy_threshold: 1";
    let tcp = format!("    health_checks:\n      - {{ {timing}, tcp_health_check: {{}} }}\n");
    let http = format!(
        "    health_checks:\n      - {{ {timing}, http_health_check: {{ path: /healthz }} }}\n"
    );
    let outlier =
        "    outlier_detection: { consecutive_5xx: 2, interval: 0.2s, max_ejection_percent: 50 }\n";
    let (tcp_vip, http_vip, passive_vip) = ("[fd77::1]:80", "[fd77::2]:80", "[fd77::3]:80");
    let config = format!(
        "{}clusters:\n{}{}{}services:\n{}{}{}",
        header(&cgroup),
        static_cluster("tcp", &tcp, &[t1, t2]),
        static_cluster("http", &http, &[h1, h2]),
        static_cluster("passive", outlier, &[good, dead]),
        service_line("tcp", tcp_vip, "tcp", ""),
        service_line("http", http_vip, "http", ""),
        service_line("passive", passive_vip, "passive", ""),
    );
    let daemon = Daemon::start_in(&netns, &config);
    assert_eq!(flags(&daemon, "tcp", t2), "healthy");
    assert_eq!(flags(&daemon, "http", h2), "healthy");
    assert_only(&netns, &cgroup, tcp_vip, &[t1, t2], 100);
    wait_http(&netns, &cgroup, http_vip, &["hc-a", SICK_HOST]);

    drop(t2_server);
    wait(&netns, &cgroup, tcp_vip, &[t1]);
    assert!(flags(&daemon, "tcp", t2).contains("failed_active_hc"));
    let _t2 = BannerServers::start(&netns, &[(t2.parse().unwrap(), t2, false)]);
    wait(&netns, &cgroup, tcp_vip, &[t1, t2]);

    SICK.store(true, Ordering::SeqCst);
    wait_http(&netns, &cgroup, http_vip, &["hc-a"]);
    assert!(flags(&daemon, "http", h2).contains("failed_active_hc"));
    SICK.store(false, Ordering::SeqCst);
    wait_http(&netns, &cgroup, http_vip, &["hc-a", SICK_HOST]);
    assert_eq!(flags(&daemon, "http", h2), "healthy");

    // The kernel's passive signal over IPv6: the refusing host is ejected.
    wait(&netns, &cgroup, passive_vip, &[good]);
    assert!(daemon.stat("service.passive.cx_passive_failure") >= 2);
    assert!(flags(&daemon, "passive", dead).contains("failed_outlier_check"));
}

/// The proxy path on IPv6 VIPs, the daemon listening on `[::1]:15001`: a TCP service to IPv6
/// hosts (getpeername shows the VIP), HTTP routes of a service-router chain, an ORIGINAL_DST
/// cluster forwarding to the IPv6 address dialled, and a connect to the listener that the kernel
/// did not redirect refused.
#[test]
fn proxy_mode_on_ipv6_vips() {
    require_root();
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let (a, b, real) = ("[fd00::51]:8081", "[fd00::52]:8082", "[fd00::55]:9000");
    let (web, api) = ("[fd00::53]:8083", "[fd00::54]:8084");
    let _banners = banner_hosts(&netns, &[a, b, real]);
    add_v6_addrs(&netns, &[web, api]);
    let _http = Servers::start(
        &netns,
        &[(web.parse().unwrap(), "web"), (api.parse().unwrap(), "api")],
        http_server,
    );
    let (tcp_vip, http_vip) = ("[fd77::1]:80", "[fd77::2]:80");
    let proxy = ", mode: proxy";
    let config = format!(
        "{}proxy:\n  listeners: [\"127.0.0.1:15001\", \"[::1]:15001\"]\nclusters:\n{}{}{}  - name: passthrough\n    type: ORIGINAL_DST\n    lb_policy: CLUSTER_PROVIDED\nconfig_entries:\n  - {{ Kind: service-defaults, Name: web, Protocol: http }}\n  - {{ Kind: service-defaults, Name: api, Protocol: http }}\n  - Kind: service-router\n    Name: web\n    Routes:\n      - Match: {{ HTTP: {{ PathPrefix: /api }} }}\n        Destination: {{ Service: api, PrefixRewrite: /v2 }}\nservices:\n{}  - {{ name: web, address: \"fd77::2\", port: 80, chain: web{proxy} }}\n{}",
        header(&cgroup),
        static_cluster("tcp", "", &[a, b]),
        static_cluster("web", "", &[web]),
        static_cluster("api", "", &[api]),
        service_line("tcp", tcp_vip, "tcp", proxy),
        service_line("real", real, "passthrough", proxy),
    );
    let daemon = Daemon::start_in(&netns, &config);
    let n = 100;
    assert_only(&netns, &cgroup, tcp_vip, &[a, b], n);
    assert_eq!(daemon.stat("cluster.tcp.upstream_cx_total"), u64::from(n));

    let bodies = get_in_cgroup(
        http_vip.parse().unwrap(),
        &netns,
        &cgroup,
        &["/api/users", "/"],
    );
    assert_eq!(bodies, ["api /v2/users", "web /"]);
    assert_only(&netns, &cgroup, real, &[real], 20);
    let (_, hosts) = daemon.get("/clusters").expect("admin /clusters");
    assert!(
        hosts.contains("passthrough::[fd00::55]:9000::routable::true"),
        "{hosts}"
    );
    assert_eq!(
        daemon.stat("proxy.downstream_cx_total"),
        u64::from(n) + 2 + 20
    );

    let direct = Probe::run(&netns, None, "[::1]:15001".parse().unwrap(), 5, false);
    assert_eq!(direct.backends.values().sum::<u32>(), 0, "{direct:?}");
    assert_eq!(daemon.stat("proxy.downstream_cx_no_original_dst"), 5);
}

/// PROXY protocol headers naming IPv6 addresses (v1 `TCP6` and v2), from a trusted peer on the
/// `[::1]` listener: each connection goes to the IPv6 service its header names.
#[test]
fn proxy_protocol_headers_name_an_ipv6_service() {
    require_root();
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let host = "[fd00::81]:8081";
    let _servers = banner_hosts(&netns, &[host]);
    let config = format!(
        "{}proxy:\n  listeners: [\"[::1]:15001\"]\n  proxy_protocol: any\n  proxy_protocol_trusted_sources: [\"::1/128\"]\nclusters:\n{}services:\n{}",
        header(&cgroup),
        static_cluster("web", "", &[host]),
        service_line("web", "[fd77::1]:80", "web", ", mode: proxy"),
    );
    let daemon = Daemon::start_in(&netns, &config);
    let (client, vip) = ("[fd00::9]:40001", "[fd77::1]:80");
    let v1 = b"PROXY TCP6 fd00::9 fd77::1 40000 80\r\n".to_vec();
    let v2 = proxy_relay::encode_v2(client.parse().unwrap(), vip.parse().unwrap());
    let banners = integration_tests::kernel::in_netns(&netns, move || {
        [v1, v2].map(|header| {
            let listener: SocketAddr = "[::1]:15001".parse().expect("literal");
            let mut s = TcpStream::connect_timeout(&listener, Duration::from_secs(2))?;
            s.set_read_timeout(Some(Duration::from_secs(5)))?;
            s.write_all(&header)?;
            let mut banner = String::new();
            s.read_to_string(&mut banner)?;
            Ok::<_, std::io::Error>(banner.trim().to_owned())
        })
    })
    .join()
    .expect("client thread");
    let banners: Vec<String> = banners.into_iter().map(|b| b.expect("a banner")).collect();
    assert_eq!(banners, [host, host]);
    assert_eq!(daemon.stat("cluster.web.upstream_cx_total"), 2);
    assert_eq!(daemon.stat("proxy.downstream_cx_proxy_proto_error"), 0);
}

/// A VIP in its IPv4-mapped IPv6 spelling.
const MAPPED: &str = "[::ffff:127.77.0.4]:80";

/// One STATIC cluster with an IPv4 and an IPv6 host behind an IPv4 and an IPv6 VIP: each client
/// reaches only the host of its own family, never the other (the kernel's
/// `connect_family_mismatch` stays 0). A service whose cluster has hosts of the other family
/// only has no host: its connects are refused. The proxy path crosses families. An
/// IPv4-mapped VIP is the IPv4 service.
#[test]
fn a_dual_stack_cluster_serves_each_family_its_own_hosts() {
    require_root();
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let (h4, h6, only4) = ("127.0.0.61:8080", "[fd00::61]:8080", "127.0.0.62:8080");
    let _servers = banner_hosts(&netns, &[h4, h6, only4]);
    let (vip4, vip6, orphan, crossing) = (
        "127.77.0.1:80",
        "[fd77::1]:80",
        "[fd77::2]:80",
        "[fd77::3]:80",
    );
    let config = format!(
        "{}proxy:\n  listeners: [\"127.0.0.1:15001\", \"[::1]:15001\"]\nclusters:\n{}{}services:\n{}{}{}{}{}",
        header(&cgroup),
        static_cluster("dual", "", &[h4, h6]),
        static_cluster("four", "", &[only4]),
        service_line("dual4", vip4, "dual", ""),
        service_line("dual6", vip6, "dual", ""),
        service_line("orphan", orphan, "four", ""),
        service_line("crossing", crossing, "four", ", mode: proxy"),
        service_line("mapped", MAPPED, "dual", ""),
    );
    let daemon = Daemon::start_in(&netns, &config);
    let n = 200;
    assert_only(&netns, &cgroup, vip4, &[h4], n);
    assert_only(&netns, &cgroup, vip6, &[h6], n);
    assert_eq!(
        daemon.stat("cluster.dual.upstream_cx_total"),
        u64::from(2 * n)
    );

    let refused = Probe::run(
        &netns,
        Some(cgroup.path()),
        orphan.parse().unwrap(),
        20,
        false,
    );
    assert_eq!(
        refused.errors.get(refused_errno()),
        Some(&20),
        "{refused:?}"
    );
    assert_eq!(daemon.stat("service.orphan.cx_no_host"), 20);
    assert_only(&netns, &cgroup, crossing, &[only4], 20);
    // A VIP written IPv4-mapped is the IPv4 service, dialled from an IPv4 socket or from a
    // dual-stack IPv6 one (before, it was keyed as IPv6 and neither connect found it).
    assert_only(&netns, &cgroup, "127.77.0.4:80", &[h4], 20);
    assert_only(&netns, &cgroup, MAPPED, &[h4], 20);
    assert_eq!(daemon.counter("connect_family_mismatch"), 0);
}
