//! The proxy path inside the real daemon (root): services with `mode: proxy` are redirected by
//! connect4 to the daemon's listener, which forwards them by their original destination from
//! the kernel's map. Each test runs the daemon, its backends and its clients in a fresh network
//! namespace (clients also in a fresh cgroup): TCP to a cluster with getpeername intact, open-
//! relay refusal, HTTP routes of a service-router chain, HTTP upgrades per `upgrade_configs`, an
//! ORIGINAL_DST cluster and its cleanup, draining of a host that STRICT_DNS removed, and
//! `max_connect_attempts` with a dead host.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use integration_tests::{
    http_servers::{Servers, get_in_cgroup, http_server},
    kernel::{
        BannerServers, Daemon, InCgroup, Netns, Probe, TestCgroup, require_root, unique,
        wait_for_backends,
    },
    slow_dns::{SLOW_ANSWER, SlowDns},
    unbound::Unbound,
};

const VIP: &str = "127.77.0.1:80";

fn header(cgroup: &TestCgroup, proxy_extra: &str) -> String {
    format!(
        "instance: {}\ncgroup: {}\nadmin:\n  address: \"{{admin}}\"\nproxy:\n  listeners: [\"127.0.0.1:15001\"]\n{proxy_extra}",
        unique("t"),
        cgroup.path().display()
    )
}

fn endpoint(addr: SocketAddr) -> String {
    format!(
        "            - endpoint: {{ address: {{ socket_address: {{ address: \"{}\", port_value: {} }} }} }}\n",
        addr.ip(),
        addr.port()
    )
}

fn cluster(name: &str, endpoints: &str) -> String {
    format!(
        "  - name: {name}\n    load_assignment:\n      endpoints:\n        - lb_endpoints:\n{endpoints}"
    )
}

/// `/ready` waits for the clusters behind a proxy-mode service: here a STRICT_DNS cluster whose
/// DNS server answers [`SLOW_ANSWER`] late. Once the daemon says ready, every connect through
/// the service reaches the host. Before the proxy-mode service's first publish waited for its
/// cluster, the daemon was ready at once and the first connects were reset (no host yet): the
/// start-up race behind a reload test that failed on a fresh clone.
#[test]
fn ready_means_a_proxy_mode_services_cluster_has_its_first_hosts() {
    require_root();
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let host: SocketAddr = "127.0.0.21:8081".parse().unwrap();
    let _servers = BannerServers::start(&netns, &[(host, "late", false)]);
    let dns: SocketAddr = "127.0.0.53:53".parse().unwrap();
    let _dns = SlowDns::start(&netns, dns, "127.0.0.21".parse().unwrap());
    let config = format!(
        "{}clusters:\n  - name: web\n    type: STRICT_DNS\n    dns_lookup_family: V4_ONLY\n    dns_resolvers: [\"{dns}\"]\n    load_assignment:\n      endpoints:\n        - lb_endpoints:\n            - endpoint: {{ address: {{ socket_address: {{ address: web.slow.test, port_value: {} }} }} }}\nservices:\n  - {{ name: web, address: 127.77.0.1, port: 80, cluster: web, mode: proxy }}\n",
        header(&cgroup, ""),
        host.port(),
    );
    let started = Instant::now();
    let daemon = Daemon::start_in(&netns, &config);
    let ready_after = started.elapsed();
    let n = 20;
    let probe = Probe::run(&netns, Some(cgroup.path()), VIP.parse().unwrap(), n, false);
    println!("ready after {ready_after:?}; first connects: {probe:?}");
    assert!(probe.errors.is_empty(), "{probe:?}");
    assert_eq!(probe.count("late"), n, "{probe:?}");
    assert!(
        ready_after >= SLOW_ANSWER,
        "ready after {ready_after:?}, before the cluster's first DNS answer"
    );
    drop(daemon);
}

#[test]
fn proxy_mode_forwards_to_the_cluster_and_the_application_sees_the_vip() {
    require_root();
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let (a, b): (SocketAddr, SocketAddr) = (
        "127.0.0.11:8081".parse().unwrap(),
        "127.0.0.12:8082".parse().unwrap(),
    );
    let _servers = BannerServers::start(&netns, &[(a, "a", false), (b, "b", false)]);
    let config = format!(
        "{}clusters:\n{}services:\n  - {{ name: web, address: 127.77.0.1, port: 80, cluster: web, mode: proxy }}\n",
        header(&cgroup, ""),
        cluster("web", &(endpoint(a) + &endpoint(b))),
    );
    let daemon = Daemon::start_in(&netns, &config);
    let n = 200;
    let probe = Probe::run(&netns, Some(cgroup.path()), VIP.parse().unwrap(), n, false);
    assert!(probe.errors.is_empty(), "{probe:?}");
    assert_eq!(probe.count("a") + probe.count("b"), n, "{probe:?}");
    assert!(
        probe.count("a") > 0 && probe.count("b") > 0,
        "both hosts serve: {probe:?}"
    );
    // getpeername in the application shows what it dialled, not the proxy listener.
    assert!(probe.peers.iter().all(|p| p == VIP), "{:?}", probe.peers);
    assert!(daemon.stat("proxy.downstream_cx_total") >= u64::from(n));
    assert!(daemon.stat("proxy.upstream_cx_total") >= u64::from(n));

    // A connection to the listener that the kernel did not redirect has no original
    // destination: it is refused and counted, never relayed.
    let direct = Probe::run(&netns, None, "127.0.0.1:15001".parse().unwrap(), 5, false);
    assert_eq!(direct.backends.values().sum::<u32>(), 0, "{direct:?}");
    assert_eq!(daemon.stat("proxy.downstream_cx_no_original_dst"), 5);
}

/// Envoy's `max_connect_attempts` through the real daemon: a connect loop to a proxy-mode
/// service whose cluster has one dead host (nothing listens) and one live, no health checks, the
/// default lb (RANDOM: about half the first connects go to the dead host). At the default of
/// one attempt each connect that hits the dead host is reset and counted once in
/// `upstream_cx_connect_attempts_exceeded` (as Envoy counts it); with two, none fails, the dead
/// host's refusals are the retries (`upstream_cx_connect_fail`, each one more
/// `upstream_cx_total`) and nothing is exceeded.
#[test]
fn connect_attempts_retry_a_dead_host_under_a_connect_loop() {
    require_root();
    let (dead, live): (SocketAddr, SocketAddr) = (
        "127.0.0.11:8081".parse().unwrap(),
        "127.0.0.12:8082".parse().unwrap(),
    );
    let n = 200;
    for attempts in [None, Some(2)] {
        let (netns, cgroup) = (Netns::new(), TestCgroup::new());
        let _servers = BannerServers::start(&netns, &[(live, "live", false)]);
        let field = attempts.map_or(String::new(), |a| format!(", max_connect_attempts: {a}"));
        let config = format!(
            "{}clusters:\n{}services:\n  - {{ name: web, address: 127.77.0.1, port: 80, cluster: web, mode: proxy{field} }}\n",
            header(&cgroup, ""),
            cluster("web", &(endpoint(dead) + &endpoint(live))),
        );
        let daemon = Daemon::start_in(&netns, &config);
        let probe = Probe::run(&netns, Some(cgroup.path()), VIP.parse().unwrap(), n, false);
        let failed = u64::from(n - probe.count("live"));
        let stat = |name: &str| daemon.stat(&format!("cluster.web.{name}"));
        let total = stat("upstream_cx_total");
        let connect_fail = stat("upstream_cx_connect_fail");
        let exceeded = stat("upstream_cx_connect_attempts_exceeded");
        println!(
            "max_connect_attempts {attempts:?}: {failed} of {n} failed; upstream_cx_total \
             {total}, upstream_cx_connect_fail {connect_fail}, \
             upstream_cx_connect_attempts_exceeded {exceeded}; {probe:?}"
        );
        assert_eq!(u64::from(probe.errors.values().sum::<u32>()), failed);
        assert_eq!(
            daemon.stat("proxy.upstream_cx_connect_attempts_exceeded"),
            exceeded
        );
        if attempts.is_none() {
            assert!(failed > 0, "no connect hit the dead host: {probe:?}");
            assert_eq!((exceeded, connect_fail), (failed, failed));
            assert_eq!(total, u64::from(n));
        } else {
            assert_eq!(failed, 0, "{probe:?}");
            assert!(connect_fail > 0, "no connect hit the dead host first");
            assert_eq!(exceeded, 0);
            assert_eq!(total, u64::from(n) + connect_fail);
        }
        drop(daemon);
    }
}

/// Sends `<name>\n`, then echoes every byte until the client closes (a long-lived connection
/// whose host a client can tell).
fn echo_server(mut conn: TcpStream, name: &str) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(30)));
    if writeln!(conn, "{name}").is_err() {
        return;
    }
    let mut buf = [0u8; 256];
    while let Ok(n @ 1..) = conn.read(&mut buf) {
        if conn.write_all(&buf[..n]).is_err() {
            return;
        }
    }
}

#[test]
fn service_router_chain_routes_http_by_path() {
    require_root();
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let (web, api): (SocketAddr, SocketAddr) = (
        "127.0.0.21:8081".parse().unwrap(),
        "127.0.0.22:8082".parse().unwrap(),
    );
    let _servers = Servers::start(&netns, &[(web, "web"), (api, "api")], http_server);
    let config = format!(
        "{}clusters:\n{}{}config_entries:\n  - {{ Kind: service-defaults, Name: web, Protocol: http }}\n  - {{ Kind: service-defaults, Name: api, Protocol: http }}\n  - Kind: service-router\n    Name: web\n    Routes:\n      - Match: {{ HTTP: {{ PathPrefix: /api }} }}\n        Destination: {{ Service: api, PrefixRewrite: /v2 }}\nservices:\n  - {{ name: web, address: 127.77.0.1, port: 80, chain: web, mode: proxy }}\n",
        header(&cgroup, ""),
        cluster("web", &endpoint(web)),
        cluster("api", &endpoint(api)),
    );
    let daemon = Daemon::start_in(&netns, &config);
    let bodies = get_in_cgroup(
        VIP.parse().expect("literal"),
        &netns,
        &cgroup,
        &["/api/users", "/", "/apix", "/index.html"],
    );
    assert_eq!(
        bodies,
        ["api /v2/users", "web /", "api /v2x", "web /index.html"]
    );
    assert!(daemon.stat("proxy.downstream_rq_total") >= 4);
    let (code, chain) = daemon.get("/chain/web").expect("admin");
    assert_eq!(code, 200);
    assert!(
        chain.contains("\"StartNode\": \"router:web.default.default\""),
        "{chain}"
    );
}

/// Reads an HTTP head (at most 8 KiB) from `conn`.
fn read_head(conn: &mut TcpStream) -> String {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") && head.len() < 8192 {
        match conn.read(&mut byte) {
            Ok(1) => head.push(byte[0]),
            _ => break,
        }
    }
    String::from_utf8_lossy(&head).into_owned()
}

/// Switches to whatever protocol the request's `Upgrade` names (101), then echoes raw bytes
/// until the client closes its side.
fn upgrade_server(mut conn: TcpStream, _name: &str) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
    let head = read_head(&mut conn);
    let kind = head.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.eq_ignore_ascii_case("upgrade")
            .then(|| v.trim().to_owned())
    });
    let Some(kind) = kind else { return };
    let reply = format!(
        "HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nupgrade: {kind}\r\n\r\n"
    );
    if conn.write_all(reply.as_bytes()).is_err() {
        return;
    }
    let mut buf = [0u8; 256];
    while let Ok(n @ 1..) = conn.read(&mut buf) {
        if conn.write_all(&buf[..n]).is_err() {
            return;
        }
    }
}

/// From inside the cgroup, asks the VIP for each upgrade in `kinds`: `101 <echo of "ping">` and
/// whether the tunnel then closed, or the status of the refusal.
fn upgrade_in_cgroup(netns: &Netns, cgroup: &TestCgroup, kinds: &[&str]) -> Vec<String> {
    let kinds: Vec<String> = kinds.iter().map(|k| (*k).to_owned()).collect();
    let child = InCgroup::spawn(Some(cgroup.path()), netns, move || {
        let mut out = Vec::new();
        for kind in kinds {
            let line = (|| -> std::io::Result<String> {
                let vip: SocketAddr = VIP.parse().expect("literal");
                let mut s = TcpStream::connect_timeout(&vip, Duration::from_secs(2))?;
                s.set_read_timeout(Some(Duration::from_secs(5)))?;
                write!(
                    s,
                    "GET /chat HTTP/1.1\r\nhost: web\r\nconnection: upgrade\r\nupgrade: {kind}\r\n\r\n"
                )?;
                let head = read_head(&mut s);
                let status = head
                    .split_whitespace()
                    .nth(1)
                    .unwrap_or_default()
                    .to_owned();
                let mut rest = Vec::new();
                if status != "101" {
                    s.read_to_end(&mut rest)?;
                    return Ok(status);
                }
                s.write_all(b"ping")?;
                let mut echo = [0u8; 4];
                s.read_exact(&mut echo)?;
                s.shutdown(std::net::Shutdown::Write)?;
                let closed = s.read_to_end(&mut rest)? == 0;
                Ok(format!(
                    "101 {} closed={closed}",
                    String::from_utf8_lossy(&echo)
                ))
            })();
            out.push(line.unwrap_or_else(|e| format!("error: {e}")));
        }
        out.join("\n")
    });
    child
        .wait(Duration::from_secs(30))
        .lines()
        .map(str::to_owned)
        .collect()
}

/// `upgrade_configs` reaches the daemon's HTTP path: the type it lists is tunnelled through the
/// real redirect (bytes echoed, the client's close passed on), `websocket`, which it leaves out,
/// gets 403 without reaching the host.
#[test]
fn upgrade_configs_decide_which_upgrades_are_tunnelled() {
    require_root();
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let web: SocketAddr = "127.0.0.23:8083".parse().unwrap();
    let _servers = Servers::start(&netns, &[(web, "web")], upgrade_server);
    let config = format!(
        "{}clusters:\n{}config_entries:\n  - {{ Kind: service-defaults, Name: web, Protocol: http }}\nservices:\n  - {{ name: web, address: 127.77.0.1, port: 80, chain: web, mode: proxy, upgrade_configs: [{{ upgrade_type: custom-proto }}] }}\n",
        header(&cgroup, ""),
        cluster("web", &endpoint(web)),
    );
    let daemon = Daemon::start_in(&netns, &config);
    let lines = upgrade_in_cgroup(&netns, &cgroup, &["custom-proto", "websocket"]);
    assert_eq!(lines, ["101 ping closed=true", "403"]);
    assert_eq!(daemon.stat("proxy.downstream_cx_upgrades_total"), 1);
    assert_eq!(daemon.stat("proxy.downstream_rq_ws_on_non_ws_route"), 1);
    assert_eq!(
        daemon.stat("proxy.upstream_rq_total"),
        1,
        "the 403 never went upstream"
    );
}

#[test]
fn original_dst_forwards_to_the_dialled_address_and_flushes_unused_hosts() {
    require_root();
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let real: SocketAddr = "127.0.0.31:9000".parse().unwrap();
    let _servers = BannerServers::start(&netns, &[(real, "real", false)]);
    let config = format!(
        "{}clusters:\n  - name: passthrough\n    type: ORIGINAL_DST\n    lb_policy: CLUSTER_PROVIDED\n    cleanup_interval: 1s\nservices:\n  - {{ name: real, address: 127.0.0.31, port: 9000, cluster: passthrough, mode: proxy }}\n",
        header(&cgroup, ""),
    );
    let daemon = Daemon::start_in(&netns, &config);
    let probe = Probe::run(&netns, Some(cgroup.path()), real, 20, false);
    assert_eq!(probe.count("real"), 20, "{probe:?}");
    assert!(
        probe.peers.iter().all(|p| *p == real.to_string()),
        "{:?}",
        probe.peers
    );
    // Through the proxy, not straight: every connection was accepted by the listener.
    assert!(daemon.stat("proxy.downstream_cx_total") >= 20);
    let (_, clusters) = daemon.get("/clusters").expect("admin");
    assert!(
        clusters.contains("passthrough::127.0.0.31:9000::routable::true"),
        "{clusters}"
    );
    // Unused for cleanup_interval, the host is flushed (at the next cleanup, so within 2x).
    let deadline = Instant::now() + Duration::from_secs(10);
    while daemon.stat("proxy.original_dst_hosts") != 0 {
        assert!(Instant::now() < deadline, "ORIGINAL_DST host never flushed");
        std::thread::sleep(Duration::from_millis(100));
    }
    let (_, clusters) = daemon.get("/clusters").expect("admin");
    assert!(!clusters.contains("127.0.0.31:9000"), "{clusters}");
}

fn epoch_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_millis() as u64
}

#[test]
fn a_host_removed_by_strict_dns_is_drained() {
    require_root();
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let (a, b) = ("127.0.0.41:8080", "127.0.0.42:8080");
    let _servers = Servers::start(
        &netns,
        &[(a.parse().unwrap(), a), (b.parse().unwrap(), b)],
        echo_server,
    );
    let dns = Unbound::start_in(&netns.path(), &["web.svc.test. 5 IN A 127.0.0.41"]);
    let drain = Duration::from_secs(3);
    let config = format!(
        "{}clusters:\n  - name: web\n    type: STRICT_DNS\n    dns_refresh_rate: 0.2s\n    dns_lookup_family: V4_ONLY\n    dns_resolvers: [\"{}\"]\n    load_assignment:\n      endpoints:\n        - lb_endpoints:\n            - endpoint: {{ address: {{ socket_address: {{ address: web.svc.test, port_value: 8080 }} }} }}\nservices:\n  - {{ name: web, address: 127.77.0.1, port: 80, cluster: web, mode: proxy }}\n",
        header(&cgroup, &format!("  drain_timeout: {}s\n", drain.as_secs())),
        dns.addr(),
    );
    let daemon = Daemon::start_in(&netns, &config);
    let vip: SocketAddr = VIP.parse().unwrap();
    wait_for_backends(&netns, &cgroup, vip, &[a], Duration::from_secs(15));

    // A long-lived connection to a: it echoes a byte every 50 ms until the connection ends
    // (bounded at 20 s) and reports when that happened.
    let child = InCgroup::spawn(Some(cgroup.path()), &netns, move || {
        let run = || -> Result<(String, u64, u32), String> {
            let mut s = TcpStream::connect_timeout(&vip, Duration::from_secs(2))
                .map_err(|e| e.to_string())?;
            s.set_read_timeout(Some(Duration::from_secs(2)))
                .map_err(|e| e.to_string())?;
            let mut banner = [0u8; 16];
            let n = s.read(&mut banner).map_err(|e| e.to_string())?;
            let banner = String::from_utf8_lossy(&banner[..n]).trim().to_owned();
            let started = Instant::now();
            let mut rounds = 0;
            while started.elapsed() < Duration::from_secs(20) {
                let mut byte = [0u8; 1];
                if s.write_all(b"x").is_err() || !matches!(s.read(&mut byte), Ok(1)) {
                    return Ok((banner, epoch_ms(), rounds));
                }
                rounds += 1;
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(format!("still open after 20 s ({rounds} rounds)"))
        };
        match run() {
            Ok((banner, ended, rounds)) => format!("{banner} {ended} {rounds}"),
            Err(e) => format!("error {e}"),
        }
    });
    std::thread::sleep(Duration::from_millis(500));
    let removed = epoch_ms();
    dns.replace("web.svc.test", &["web.svc.test. 5 IN A 127.0.0.42"]);
    // New connections go to b while the old one to a goes on.
    wait_for_backends(&netns, &cgroup, vip, &[b], Duration::from_secs(15));
    let moved = epoch_ms();
    let report = child.wait(Duration::from_secs(30));
    let fields: Vec<&str> = report.split_whitespace().collect();
    assert_eq!(fields.first(), Some(&a), "{report}");
    let ended: u64 = fields[1].parse().expect("end time");
    let rounds: u32 = fields[2].parse().expect("rounds");
    assert!(
        moved < ended,
        "new connections moved to b only after the old one ended: {report}"
    );
    let open_after_removal = ended.saturating_sub(removed);
    let drain_ms = drain.as_millis() as u64;
    assert!(
        (drain_ms..drain_ms + 5_000).contains(&open_after_removal),
        "the connection to the removed host lasted {open_after_removal} ms after the removal (drain {drain_ms} ms)"
    );
    assert!(rounds > 20, "bytes kept flowing while draining: {report}");
    // At least the long-lived connection; a probe connection to a that was still closing
    // when a was removed may be counted as well.
    assert!(daemon.stat("proxy.upstream_cx_drain_close") >= 1);
}

#[test]
fn splice_kernel_hands_proxied_pairs_to_the_kernel() {
    require_root();
    if integration_tests::features::skip_unless(
        "splice_kernel_hands_proxied_pairs_to_the_kernel",
        &[integration_tests::features::Feature::SkSkbVerdict],
    ) {
        return;
    }
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let a: SocketAddr = "127.0.0.51:8081".parse().unwrap();
    // The servers hold their connections: one that closed right after its banner could be
    // gone before the proxy hands the pair to the kernel, and the pair would be copied.
    let _servers = BannerServers::start_holding(&netns, &[(a, "a", false)]);
    let config = format!(
        "{}clusters:\n{}services:\n  - {{ name: web, address: 127.77.0.1, port: 80, cluster: web, mode: proxy }}\n",
        header(&cgroup, "  splice: kernel\n"),
        cluster("web", &endpoint(a)),
    );
    let daemon = Daemon::start_in(&netns, &config);
    let n = 50;
    let probe = Probe::run(&netns, Some(cgroup.path()), VIP.parse().unwrap(), n, false);
    assert!(probe.errors.is_empty(), "{probe:?}");
    assert_eq!(probe.count("a"), n, "{probe:?}");
    let spliced = daemon.stat("proxy.downstream_cx_splice_total");
    let fallback = daemon.stat("proxy.downstream_cx_splice_fallback");
    assert_eq!(
        spliced + fallback,
        u64::from(n),
        "every connection was spliced or copied"
    );
    assert_eq!(
        fallback, 0,
        "the kernel took every pair: {spliced} spliced, {fallback} copied"
    );
    assert!(
        daemon.counter("pair_redirected") > 0,
        "the verdict program moved the banners"
    );
}
